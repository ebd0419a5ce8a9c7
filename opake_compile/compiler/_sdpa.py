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

CUDA is not covered here: torch 2.13 has functorch rules for the forward of its CUDA kernels
(flash, memory-efficient, cuDNN) but not for their backward ops, which therefore still run
per example under ``vmap`` (not measured: no GPU was available when this was written).
"""

from __future__ import annotations

import contextlib
import threading
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
        from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

        if retrieve_current_functorch_interpreter().randomness() != "different":
            raise RuntimeError("vmap of fused CPU attention with dropout needs randomness='different'.")
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


@contextlib.contextmanager
def batched_attention() -> Iterator[None]:
    """Within the block, ``vmap`` of CPU scaled dot-product attention (forward and backward)
    runs the fused kernel once over all examples instead of a per-example loop, so a
    ``make_fx`` trace holds one attention call per layer whatever the batch size.

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
