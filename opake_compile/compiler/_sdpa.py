"""Batching rules for CPU scaled dot-product attention, active while the graph is traced.

``F.scaled_dot_product_attention`` on CPU dispatches (without dropout) to the fused kernel
``aten._scaled_dot_product_flash_attention_for_cpu``, and its derivative to
``aten._scaled_dot_product_flash_attention_for_cpu_backward``. Neither has a vmap batching rule
in torch 2.13, so under ``vmap(grad(...))`` functorch falls back to a loop over the examples
("There is a performance drop because we have not yet implemented the batching rule ...") and
``make_fx`` records that loop unrolled: P attention calls per layer in the forward and P more in
the backward. The graph, its compile time and its kernel launches grow with the physical batch
size P. ``nn.MultiheadAttention`` (``need_weights=False``), ``nn.TransformerEncoderLayer`` and
Hugging Face's default ``attn_implementation="sdpa"`` all take that path.

While :func:`batched_attention` is active, both ops have a batching rule: the vmapped dimension
is folded into the kernel's own batch dimension (``(P, N, H, L, E) -> (P·N, H, L, E)``), the
fused kernel runs *once* on all examples, and the results are unfolded. Attention does not mix
the rows of its batch dimension, so every example's output (and its gradient) is the one the
kernel computes for that example alone: the same kernel, the same arithmetic, as a loop at
batch size one. Masks follow the same fold; a mask shared by all examples is passed unchanged
and broadcast by the kernel.

Grouped-query attention (``enable_gqa``, fewer key/value heads) runs in the same kernel: heads
are untouched by the fold. The other cases need nothing from us: with dropout
(``dropout_p > 0``) or a floating mask that requires a gradient, torch's dispatcher chooses its
math backend, a composite of ``matmul``, ``_safe_softmax`` and ``dropout`` that already has
batching rules, and the vmapped dropout draws a mask per example
(``vmap(randomness="different")``).

The rules are registered with :class:`torch.library.Library` on entry and removed on exit (the
outermost exit when nested or concurrent): nothing stays patched after ``compile_dp`` has
traced, and the user's model is never touched.

On CUDA, torch has functorch rules for the forward of its fused kernels (flash,
memory-efficient, cuDNN: they fold the vmapped dimension into the kernel's batch as above) but
not for their backward ops. Those ran per example under ``vmap``: functorch's fallback called
the backward kernel once per example, P calls per layer in the graph (first seen on an H200,
2026-12-04). :func:`batched_attention` gives each of them the same fold as the forward, so the
backward sees the rows in the order the forward did. That order matters with dropout: the
kernels regenerate the forward's dropout mask from one seed and the row's index in the
kernel's batch, which the per-example fallback restarted at zero for every example. When the
forward ran unbatched and only the backward is vmapped (``vmap`` over cotangents, ``jacrev``),
a call per example is what regenerates its masks, and the rule loops.

The forward rules of the two kernels that take a bias (memory-efficient, cuDNN) are replaced
as well, while the block runs: torch's pass a bias that is not batched (a mask shared by all
examples, such as a causal mask built inside the model) unchanged to the folded call, and the
memory-efficient kernel refuses a bias whose batch is not the call's. Ours expand such a bias
to every example first (a stride-0 view when it has one row). A rule whose op has a signature
other than the one expected here is not registered (torch's handling stays).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

import torch
from torch._C import _functorch as _ft

__all__ = ["batched_attention"]

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_NOT_BATCHED = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)

_lock = threading.Lock()
_users = 0
_library: torch.library.Library | None = None


def _unwrap(t: torch.Tensor | None, level: int) -> tuple[torch.Tensor | None, int | None]:
    """``(physical tensor, batch dim)`` of ``t`` at vmap ``level``; batch dim ``None`` if ``t``
    is not batched at that level."""
    if t is not None and _ft.is_batchedtensor(t) and _ft.maybe_get_level(t) == level:
        return _ft._unwrap_batched(t, level)
    return t, None


def _fold(x: torch.Tensor, bdim: int | None, p: int) -> torch.Tensor:
    """``(P, N, ...)`` (batch dim moved first; an unbatched ``x`` is expanded) -> ``(P·N, ...)``."""
    x = x.expand(p, *x.shape) if bdim is None else x.movedim(bdim, 0)
    return x.reshape(p * x.shape[1], *x.shape[2:])


def _fold_mask(m: torch.Tensor | None, bdim: int | None, p: int, n: int) -> torch.Tensor | None:
    """A mask broadcastable to ``(N, H, L, S)`` per example -> broadcastable to ``(P·N, H, L, S)``."""
    if m is None or (bdim is None and (m.dim() < 4 or m.shape[0] == 1)):
        return m  # shared by every example and every row of the kernel's batch: broadcast
    if bdim is None:
        return _fold(m, None, p)
    m = m.movedim(bdim, 0)
    m = m.reshape(p, *([1] * (5 - m.dim())), *m.shape[1:])  # left-pad to (P, N|1, H|1, L|1, S)
    return m.expand(p, n, *m.shape[2:]).reshape(p * n, *m.shape[2:])


def _unfold(x: torch.Tensor, p: int, level: int) -> torch.Tensor:
    return _ft._add_batch_dim(x.view(p, x.shape[0] // p, *x.shape[1:]), 0, level)


def _require_different_randomness(what: str) -> None:
    """Refuse dropout in a fused kernel unless vmap draws each example's mask independently."""
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    if retrieve_current_functorch_interpreter().randomness() != "different":
        raise RuntimeError(f"vmap of {what} with dropout needs randomness='different'.")


def _prepare(tensors: tuple[torch.Tensor, ...], q_index: int, attn_mask: torch.Tensor | None, dropout_p: float):
    """Unwrap the op's tensors at the current vmap level and fold them; ``None`` when none is
    batched at this level (then the op runs as it is, like functorch's own rules do)."""
    level = _ft.current_level()
    pairs = [_unwrap(t, level) for t in tensors]
    mask, mask_bdim = _unwrap(attn_mask, level)
    sizes = {x.shape[b] for x, b in (*pairs, (mask, mask_bdim)) if b is not None}
    if not sizes:
        return None
    (p,) = sizes  # vmap gives every input batched at one level the same batch size
    if dropout_p > 0:  # torch 2.13 never picks this kernel with dropout; refuse a shared mask
        _require_different_randomness("fused CPU attention")
    q, q_bdim = pairs[q_index]
    n = q.shape[0] if q_bdim is None else q.movedim(q_bdim, 0).shape[1]
    folded = [_fold(x, b, p) for x, b in pairs]
    return level, p, folded, _fold_mask(mask, mask_bdim, p, n)


def _forward_rule(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):  # noqa: ANN001, ANN202
    with torch._C._ExcludeDispatchKeyGuard(_NOT_BATCHED):
        prepared = _prepare((query, key, value), 0, attn_mask, dropout_p)
        if prepared is None:
            return _FWD(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        level, p, (q, k, v), mask = prepared
        out, logsumexp = _FWD(q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale)
        return _unfold(out, p, level), _unfold(logsumexp, p, level)


def _backward_rule(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):  # noqa: ANN001, ANN202
    tensors = (grad_out, query, key, value, out, logsumexp)
    with torch._C._ExcludeDispatchKeyGuard(_NOT_BATCHED):
        prepared = _prepare(tensors, 1, attn_mask, dropout_p)
        if prepared is None:
            return _BWD(*tensors, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        level, p, folded, mask = prepared
        grads = _BWD(*folded, dropout_p, is_causal, attn_mask=mask, scale=scale)
        return tuple(_unfold(g, p, level) for g in grads)


# The GPU kernels. Per-row arguments (first dimension the kernel's batch) are folded with the
# vmapped dimension; the attention bias is folded by :func:`_fold_bias`; seeds, offsets and
# sequence bounds are shared by all rows and passed unchanged.
_ROWS = ("grad_out", "query", "key", "value", "out", "logsumexp")
_FUSED_BACKWARD = {
    "_scaled_dot_product_efficient_attention_backward": ("grad_out_", *_ROWS[1:]),
    "_scaled_dot_product_flash_attention_backward": _ROWS,
    "_scaled_dot_product_cudnn_attention_backward": _ROWS,
}
# Forward ops that take a bias: torch's rules pass a bias not batched at the level unchanged,
# which the memory-efficient kernel refuses ("attn_bias: wrong shape (batch dimension)": its
# bias must have the folded batch). Their outputs with a row per kernel batch entry: the
# output, the log-sum-exp and cuDNN's debug mask.
_FUSED_FORWARD = {
    "_scaled_dot_product_efficient_attention": (0, 1),
    "_scaled_dot_product_cudnn_attention": (0, 1, 8),
}
_BIAS = "attn_bias"
_SHARED = frozenset({"philox_seed", "philox_offset", "cum_seq_q", "cum_seq_k"})


def _fused_rules() -> list[tuple[torch._ops.OpOverload, object]]:
    """``(op, batching rule)`` for each GPU attention op of this torch whose tensor arguments
    are the ones expected here (the rows, the bias, the shared ones); any other signature keeps
    torch's own handling (its forward rule, or functorch's per-example fallback)."""
    rules = []
    expected = [(name, frozenset(rows), None) for name, rows in _FUSED_BACKWARD.items()]
    expected += [(name, frozenset(_ROWS[1:4]), outs) for name, outs in _FUSED_FORWARD.items()]
    for name, rows, outs in expected:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        op = packet.default
        args = op._schema.arguments
        tensors = {a.name for a in args if "Tensor" in str(a.type)}
        if not rows <= tensors or not tensors <= {*rows, _BIAS, *_SHARED}:
            continue
        names = [a.name for a in args]
        rules.append((op, _fused_rule(op, rows, names, outs)))
    return rules


def _fold_bias(b: torch.Tensor, bdim: int | None, p: int) -> torch.Tensor:
    """The bias for the folded kernel call: batched, its vmapped dimension folded into the first
    (as torch's forward rules do); shared by the examples and 4-d, expanded to every example
    first (the memory-efficient kernels take a bias of the call's batch only); a shared 2-d or
    3-d mask (passed on by ``F.scaled_dot_product_attention`` to cuDNN, which broadcasts it)
    unchanged."""
    if bdim is None:
        if b.dim() != 4:
            return b
        b, bdim = b.expand(p, *b.shape), 0
    return b.movedim(bdim, 0).flatten(0, 1)


def _fused_rule(op: torch._ops.OpOverload, rows: frozenset[str], names: list[str], outs: tuple[int, ...] | None):  # noqa: ANN202
    """The batching rule of a GPU attention op: one kernel call on the folded batch. ``outs``:
    the forward op's outputs to unfold (``None``: a backward op, all of its outputs)."""

    def rule(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        bound = {**dict(zip(names, args)), **kwargs}
        with torch._C._ExcludeDispatchKeyGuard(_NOT_BATCHED):
            level = _ft.current_level()
            parts = {k: _unwrap(v, level) for k, v in bound.items() if isinstance(v, torch.Tensor)}
            sizes = {x.shape[b] for x, b in parts.values() if b is not None}
            if not sizes:
                return op(**bound)
            (p,) = sizes
            dropout = bound.get("dropout_p", 0.0) > 0
            if dropout and outs is not None:
                _require_different_randomness(op.name())
            if any(b is not None for k, (_, b) in parts.items() if k in _SHARED) or (
                # The forward ran once, unbatched at this level (vmap over cotangents, jacrev):
                # its dropout masks are rows 0..N-1 of its call, which a folded call would not
                # regenerate, and a call per example does.
                dropout and outs is None and parts.get("out", (None, None))[1] is None
            ):
                return _loop(op, bound, parts, p, level)
            folded = dict(bound)
            for k, (x, b) in parts.items():
                folded[k] = _fold(x, b, p) if k in rows else _fold_bias(x, b, p) if k == _BIAS else x
            results = op(**folded)
            wanted = range(len(results)) if outs is None else outs
            return tuple(
                _unfold(r, p, level) if i in wanted and isinstance(r, torch.Tensor) and r.dim() > 0 and r.numel() > 0 else r
                for i, r in enumerate(results)
            )

    return rule


def _loop(op: torch._ops.OpOverload, bound: dict, parts: dict, p: int, level: int):  # noqa: ANN202
    """The backward op once per example, results stacked: what functorch's fallback does.
    Refused with dropout when the forward was batched: each call would regenerate its rows'
    masks from row 0, not from the rows the forward's folded call used."""
    if bound.get("dropout_p", 0.0) > 0 and parts.get("out", (None, None))[1] is not None:
        raise RuntimeError(
            f"vmap of {op.name()} with dropout and a batched seed: a per-example loop would not "
            "regenerate the forward's dropout masks."
        )
    outs = []
    for i in range(p):
        call = dict(bound)
        for n, (x, b) in parts.items():
            call[n] = x if b is None else x.select(b, i)
        outs.append(op(**call))
    return tuple(None if col[0] is None else _ft._add_batch_dim(torch.stack(col), 0, level) for col in zip(*outs))


@contextlib.contextmanager
def batched_attention() -> Iterator[None]:
    """Within the block, ``vmap`` of scaled dot-product attention runs the fused kernel once
    over all examples instead of a per-example loop (the CPU kernel forward and backward; the
    GPU kernels' backward, torch having rules for their forward), so a ``make_fx`` trace holds
    one attention call per layer whatever the batch size.

    Thread-safe and re-entrant; the rules are removed when the last user exits.

    Example::

        >>> with batched_attention():
        ...     gm = make_fx(torch.func.vmap(torch.func.grad(loss)))(x)  # one attention call per layer
    """
    global _users, _library
    with _lock:
        if _users == 0:
            lib = torch.library.Library("aten", "IMPL")
            lib.impl(_FWD.name().split("::")[1], _forward_rule, "FuncTorchBatched")
            lib.impl(_BWD.name().split("::")[1], _backward_rule, "FuncTorchBatched")
            with warnings.catch_warnings():  # torch's forward rules, replaced while the block runs
                warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
                for op, rule in _fused_rules():
                    lib.impl(op.name().split("::")[1], rule, "FuncTorchBatched")
            _library = lib
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _library is not None:
                _library._destroy()
                _library = None
