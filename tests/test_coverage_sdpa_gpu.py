"""The GPU attention kernels' backward ops run once per layer under ``vmap``, checked on the CPU.

On CUDA, ``F.scaled_dot_product_attention`` runs the flash, memory-efficient or cuDNN kernel;
torch has batching rules for their forward ops but not their backward ops, so the DP trace
called each backward kernel once per example (an H200 run, 2026-12-04).
``compiler/_sdpa.batched_attention`` gives the three backward ops a rule that folds the
vmapped dimension into the kernel's batch.

The kernels exist only on CUDA. Here each op gets a float64 reference kernel on the CPU (the
softmax-attention formulas, with the real kernels' output shapes: the memory-efficient
kernel's log-sum-exp padded to 32 rows, cuDNN's with a trailing 1), registered for the test
only, so that the rules' folds, the bias's two forms and the undefined outputs are checked by
value against a per-example loop; the ``meta`` device, whose kernels torch ships, checks a
whole DP trace of the real ops' shapes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _models import assert_trees_close, loop_reference, no_functorch_fallback, seeded
from opake_compile import compile_dp
from opake_compile.compiler import step as step_mod
from opake_compile.compiler._sdpa import batched_attention
from opake_compile.compiler.trace import trace_per_example_grads

F64 = torch.float64
aten = torch.ops.aten
EFFICIENT, FLASH, CUDNN = "efficient", "flash", "cudnn"
D, H, T = 8, 2, 5


# ----------------------------------------------------------------------------- reference kernels
def _scores(q, k, bias, is_causal, scale):  # noqa: ANN001, ANN202
    s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if bias is not None:
        s = s + bias
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return s


def _keep(shape: torch.Size, dropout_p: float, seed: int) -> torch.Tensor | float:
    """The dropout mask (scaled by 1 / (1 - p)) as the GPU kernels make it: from one seed and
    each row's index in the kernel's batch, so the backward regenerates the forward's mask
    only if it sees the rows in the forward's order."""
    if dropout_p == 0:
        return 1.0
    rows = [torch.rand(shape[1:], generator=torch.Generator().manual_seed(1000 * seed + r)) >= dropout_p for r in range(shape[0])]
    return torch.stack(rows).to(F64) / (1 - dropout_p)


def _forward(q, k, v, bias, is_causal, scale, dropout_p=0.0, seed=0):  # noqa: ANN001, ANN202
    s = _scores(q, k, bias, is_causal, scale)
    return (s.softmax(-1) * _keep(s.shape, dropout_p, seed)) @ v, s.logsumexp(-1)


def _backward(grad_out, q, k, v, out, lse, bias, is_causal, scale, dropout_p=0.0, seed=0):  # noqa: ANN001, ANN202
    """Softmax attention's gradients from the saved output and log-sum-exp (rows of lse past
    the query length are padding): dQ, dK, dV and the scores' gradient dS (the bias's)."""
    s = _scores(q, k, bias, is_causal, scale)
    p = (s - lse[..., : q.shape[-2], None]).exp()
    keep = _keep(s.shape, dropout_p, seed)
    ds = p * ((grad_out @ v.transpose(-2, -1)) * keep - (grad_out * out).sum(-1, keepdim=True))
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    return ds @ k * sc, ds.transpose(-2, -1) @ q * sc, (p * keep).transpose(-2, -1) @ grad_out, ds


_calls: dict[str, int] = {}


def _count(name: str) -> None:
    _calls[name] = _calls.get(name, 0) + 1


def _seed() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


_SEED = 7


def _check_bias(kind: str, bias, query) -> None:  # noqa: ANN001
    """The real kernels' bias checks: the memory-efficient kernels take a 4-d bias of the
    call's batch ("attn_bias: wrong shape (batch dimension)"); cuDNN broadcasts a 2-d or 3-d
    mask and takes a 4-d one of the call's batch."""
    if bias is None or (kind == CUDNN and bias.dim() < 4):
        return
    if bias.dim() != 4 or bias.shape[0] != query.shape[0]:
        raise RuntimeError(f"attn_bias: wrong shape (batch dimension): {tuple(bias.shape)} for query {tuple(query.shape)}")


def _efficient_fwd(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):  # noqa: ANN001, ANN202
    _check_bias(EFFICIENT, attn_bias, query)
    out, lse = _forward(query, key, value, attn_bias, is_causal, scale, dropout_p, _SEED)
    lse = F.pad(lse, (0, -lse.shape[-1] % 32))  # the kernel's padded rows, as its meta kernel gives
    return out, lse, _seed() + _SEED, _seed()


def _efficient_bwd(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p, grad_input_mask, is_causal=False, *, scale=None):  # noqa: ANN001, ANN202
    _count(EFFICIENT)
    _check_bias(EFFICIENT, attn_bias, query)
    dq, dk, dv, ds = _backward(grad_out_, query, key, value, out, logsumexp, attn_bias, is_causal, scale, dropout_p, int(philox_seed))
    return dq, dk, dv, (ds.sum_to_size(attn_bias.shape) if grad_input_mask[3] else None)


def _flash_fwd(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):  # noqa: ANN001, ANN202
    out, lse = _forward(query, key, value, None, is_causal, scale)
    rng = torch.zeros(2, dtype=torch.uint64)
    return out, lse, None, None, query.shape[-2], key.shape[-2], rng, torch.zeros((), dtype=torch.uint64), torch.empty(0)


def _flash_bwd(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):  # noqa: ANN001, ANN202
    _count(FLASH)
    return _backward(grad_out, query, key, value, out, logsumexp, None, is_causal, scale)[:3]


def _cudnn_fwd(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):  # noqa: ANN001, ANN202
    _check_bias(CUDNN, attn_bias, query)
    out, lse = _forward(query, key, value, attn_bias, is_causal, scale)
    return out, lse[..., None], None, None, query.shape[-2], key.shape[-2], _seed(), _seed(), None


def _cudnn_bwd(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):  # noqa: ANN001, ANN202
    _count(CUDNN)
    _check_bias(CUDNN, attn_bias, query)
    return _backward(grad_out, query, key, value, out, logsumexp[..., 0], attn_bias, is_causal, scale)[:3]


_KERNELS = {
    "_scaled_dot_product_efficient_attention": _efficient_fwd,
    "_scaled_dot_product_efficient_attention_backward": _efficient_bwd,
    "_scaled_dot_product_flash_attention": _flash_fwd,
    "_scaled_dot_product_flash_attention_backward": _flash_bwd,
    "_scaled_dot_product_cudnn_attention": _cudnn_fwd,
    "_scaled_dot_product_cudnn_attention_backward": _cudnn_bwd,
}


def _with_meta_strides(name: str, fn):  # noqa: ANN001, ANN202
    """``fn``'s results laid out as torch's meta kernel of ``name`` lays them out (the
    memory-efficient kernel's outputs are (N, L, H, E) in memory; its bias gradient has rows
    padded to 16): a traced graph views them with those strides."""
    op = getattr(aten, name).default

    def kernel(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        got = fn(*args, **kwargs)
        to_meta = lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a  # noqa: E731
        meta = op(*map(to_meta, args), **{k: to_meta(v) for k, v in kwargs.items()})
        return tuple(
            torch.empty_strided(m.shape, m.stride(), dtype=m.dtype).copy_(g) if isinstance(g, torch.Tensor) else g
            for g, m in zip(got, meta)
        )

    return kernel


@pytest.fixture(scope="module")
def reference_kernels():
    """The six ops with CPU reference kernels for this module's tests, removed after."""
    for name in _KERNELS:
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CPU"):
            pytest.skip(f"aten::{name} has a CPU kernel in this torch; the reference would replace it")
    lib = torch.library.Library("aten", "IMPL")
    for name, fn in _KERNELS.items():
        lib.impl(name, _with_meta_strides(name, fn), "CPU")
    yield
    lib._destroy()


def _attend(kind: str, q, k, v, bias=None, is_causal=False, scale=None, dropout_p=0.0):  # noqa: ANN001, ANN202
    """The kernel's forward op, as ``F.scaled_dot_product_attention`` calls it on a GPU."""
    if kind == EFFICIENT:
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal, scale=scale)[0]
    if kind == FLASH:
        assert bias is None
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, scale=scale)[0]
    return aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, is_causal, scale=scale)[0]


# ----------------------------------------------------------------------------- the rules, eagerly
_BIASES = {
    "none": (lambda n: None, None),
    "per example (1, H, T, T)": (lambda n: torch.randn(n, 1, H, T, T, generator=seeded(21), dtype=F64), 0),
    "per example, batch dim last": (lambda n: torch.randn(1, H, T, T, n, generator=seeded(22), dtype=F64), 4),
    "per example, rows at an odd stride": (lambda n: torch.randn(n, 1, H, T, T + 3, generator=seeded(23), dtype=F64)[..., :T], 0),
    "shared (1, H, T, T)": (lambda n: torch.randn(1, H, T, T, generator=seeded(24), dtype=F64), None),
    "shared 2-d (T, T)": (lambda n: torch.randn(T, T, generator=seeded(33), dtype=F64), None),
}
_CASES = [(k, b, c) for k in (EFFICIENT, CUDNN) for b in _BIASES for c in (False, True) if k == CUDNN or "2-d" not in b]
_CASES += [(FLASH, "none", c) for c in (False, True)]


@pytest.mark.parametrize(("kind", "bias_kind", "causal"), _CASES, ids=[f"{k}-{b}-{'causal' if c else 'full'}" for k, b, c in _CASES])
def test_backward_rules_equal_a_loop(reference_kernels, kind, bias_kind, causal):
    make_bias, bias_dim = _BIASES[bias_kind]
    n = 3
    w = torch.randn(D, D, generator=seeded(25), dtype=F64)
    x = torch.randn(n, T, D, generator=seeded(26), dtype=F64)
    bias = make_bias(n)

    def loss(w, x, bias):  # noqa: ANN001, ANN202
        q = (x @ w).view(T, H, D // H).transpose(0, 1).unsqueeze(0)  # (1, H, T, E)
        return _attend(kind, q, q.sin(), q * 0.5, bias, causal, scale=0.3).square().sum()

    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, bias_dim))
    _calls.clear()
    with no_functorch_fallback(), batched_attention():
        got = per_example(w, x, bias)
    assert _calls == {kind: 1}, _calls  # one backward call for all examples, not one per example
    one = lambda i: None if bias is None else (bias if bias_dim is None else bias.select(bias_dim, i))  # noqa: E731
    want = torch.stack([torch.func.grad(loss)(w, x[i], one(i)) for i in range(n)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e3 * torch.finfo(F64).eps * float(want.abs().max()))


def test_a_trainable_bias_gets_per_example_gradients(reference_kernels):
    """The memory-efficient kernel's fourth output, the bias's gradient, unfolds per example."""
    n = 4
    x = torch.randn(n, H, T, D // H, generator=seeded(27), dtype=F64)
    rel = torch.randn(1, H, T, T, generator=seeded(28), dtype=F64)

    def loss(rel, x):  # noqa: ANN001, ANN202
        q = x.unsqueeze(0)
        return _attend(EFFICIENT, q, q.cos(), q, rel).square().sum()

    with no_functorch_fallback(), batched_attention():
        got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(rel, x)
    want = torch.stack([torch.func.grad(loss)(rel, x[i]) for i in range(n)])
    assert got.shape == (n, *rel.shape)
    torch.testing.assert_close(got, want)


def test_a_shared_bias_over_several_rows_per_example(reference_kernels):
    """Each example's kernel batch has two rows and the trainable bias one entry per row,
    shared by the examples: expanded to every example in the forward and the backward alike,
    its gradient comes back per example."""
    n = 3
    x = torch.randn(n, 2, H, T, D // H, generator=seeded(29), dtype=F64)
    rel = torch.randn(2, H, T, T, generator=seeded(30), dtype=F64)

    def loss(rel, x):  # noqa: ANN001, ANN202
        return _attend(EFFICIENT, x, x.cos(), x, rel).square().sum()

    _calls.clear()
    with no_functorch_fallback(), batched_attention():
        got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(rel, x)
    assert _calls == {EFFICIENT: 1}, _calls
    want = torch.stack([torch.func.grad(loss)(rel, x[i]) for i in range(n)])
    assert got.shape == (n, *rel.shape)
    torch.testing.assert_close(got, want)


def test_vmap_over_cotangents_with_dropout_calls_the_backward_per_example(reference_kernels):
    """The forward ran once, unbatched: its dropout masks are those of its own rows, which a
    call per cotangent regenerates and a folded call would not (the rule loops then)."""
    q = torch.randn(1, H, T, D // H, generator=seeded(34), dtype=F64)
    out, vjp_fn = torch.func.vjp(lambda q: _attend(EFFICIENT, q, q.sin(), q * 0.5, dropout_p=0.4), q)
    cotangents = torch.randn(3, *out.shape, generator=seeded(35), dtype=F64)
    want = torch.stack([vjp_fn(c)[0] for c in cotangents])
    _calls.clear()
    with batched_attention():
        got = torch.func.vmap(vjp_fn)(cotangents)[0]
    assert _calls == {EFFICIENT: 3}, _calls
    torch.testing.assert_close(got, want)
    with batched_attention():  # without dropout the cotangents fold into one call
        _, vjp_fn = torch.func.vjp(lambda q: _attend(EFFICIENT, q, q.sin(), q * 0.5), q)
        _calls.clear()
        got = torch.func.vmap(vjp_fn)(cotangents)[0]
    assert _calls == {EFFICIENT: 1}, _calls
    torch.testing.assert_close(got, torch.stack([vjp_fn(c)[0] for c in cotangents]))


def test_the_backward_regenerates_the_forwards_dropout_masks(reference_kernels):
    """With dropout, the kernel's backward regenerates each row's mask from the forward's seed
    and the row's index in the kernel's batch (the reference kernels do the same). The rule
    folds the examples as the forward rule did, so each example's gradient is the one for the
    mask its forward used: the gradient of all examples in one kernel call, each with its own
    copy of the weights. functorch's per-example fallback gave every example row 0's mask."""
    n, e = 4, D // H
    w = torch.randn(D, D, generator=seeded(31), dtype=F64)
    x = torch.randn(n, T, D, generator=seeded(32), dtype=F64)

    def loss(w, x):  # noqa: ANN001, ANN202
        q = (x @ w).view(T, H, e).transpose(0, 1).unsqueeze(0)
        return _attend(EFFICIENT, q, q.sin(), q * 0.5, dropout_p=0.4).square().sum()

    def together(ws, x):  # noqa: ANN001, ANN202
        q = torch.einsum("btd,bde->bte", x, ws).view(n, T, H, e).transpose(1, 2)
        return _attend(EFFICIENT, q, q.sin(), q * 0.5, dropout_p=0.4).square().sum()

    with no_functorch_fallback(), batched_attention():
        got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0), randomness="different")(w, x)
    want = torch.func.grad(together)(w.expand(n, D, D).clone(), x)
    torch.testing.assert_close(got, want)
    first = torch.func.grad(together)(w.expand(n, D, D).clone(), x[:1].expand(n, T, D).clone())
    assert not torch.allclose(first[1], first[0])  # the masks differ by row: the check can fail


def test_rules_are_registered_only_inside_the_block():
    names = [f"aten::{n}" for n in _KERNELS if n.endswith("_backward")]
    has = lambda: [torch._C._dispatch_has_kernel_for_dispatch_key(n, "FuncTorchBatched") for n in names]  # noqa: E731
    assert has() == [False] * 3
    def torchs_rule() -> bool:  # the active FuncTorchBatched kernel is torch's C++ rule
        dump = torch._C._dispatch_dump("aten::_scaled_dot_product_efficient_attention").splitlines()
        return "BatchRulesLinearAlgebra" in next(line for line in dump if line.startswith("FuncTorchBatched:"))

    assert torchs_rule()
    with batched_attention():
        assert has() == [True] * 3
        assert not torchs_rule()  # replaced while the block runs
    assert has() == [False] * 3
    assert torchs_rule()  # and torch's again after it


# ----------------------------------------------------------------------------- in the DP step
class _Attention(nn.Module):
    """Two attention layers through one GPU kernel's forward op (causal, then with a padding
    bias for the kernels that take one)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * D) for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x, pad):  # noqa: ANN001, ANN201
        b = x.shape[0]
        bias = None if self.kind == FLASH else torch.zeros(b, 1, T, T, dtype=x.dtype, device=x.device).masked_fill(pad[:, None, None, :], -1e4)
        for i, proj in enumerate(self.qkv):
            q, k, v = proj(x).view(b, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
            out = _attend(self.kind, q, k, v, bias if i else None, is_causal=not i)
            x = x + out.transpose(1, 2).reshape(b, T, D)
        return self.head(x.mean(1))


def _batch(n: int, seed: int):  # noqa: ANN202
    x = torch.randn(n, T, D, generator=seeded(seed), dtype=F64)
    lengths = torch.randint(2, T + 1, (n,), generator=seeded(seed + 1))
    return x, torch.arange(T).expand(n, T) >= lengths[:, None], torch.randint(0, 3, (n,), generator=seeded(seed + 2))


def _classify(m, x, pad, y):  # noqa: ANN001, ANN202
    return F.cross_entropy(m(x, pad), y)


def _model(kind: str) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _Attention(kind).to(F64)


@pytest.mark.parametrize("kind", [EFFICIENT, FLASH, CUDNN])
def test_dp_step_matches_the_loop_oracle_with_one_backward_call_per_layer(reference_kernels, kind):
    model = _model(kind)
    counts = []
    for p in (2, 6):
        with no_functorch_fallback():
            traced = trace_per_example_grads(model, _classify, _batch(p, 0), batched_positions=(0, 1, 2), physical_batch_size=p)
        counts.append(sum("attention_backward" in str(n.target) for n in traced.gm.graph.nodes))
    assert counts == [2, 2], counts  # a per-example fallback gives 2 P

    args = _batch(6, 1)
    with no_functorch_fallback():
        out = compile_dp(_classify, model=model, clipping_norm=0.05, physical_batch_size=4, backend="aot_eager")(*args)
    want, norms = loop_reference(model, _classify, args, 0.05)
    assert bool((norms > 0.05).any())
    assert_trees_close(out.clipped.grads, want, F64)
    torch.testing.assert_close(out.clipped.per_example_norms, norms)


def test_meta_trace_of_the_real_kernels_holds_one_backward_per_layer(monkeypatch):
    """torch's own meta kernels for the memory-efficient ops (no reference kernels here):
    the DP trace on ``meta``, the device class that, like CUDA, refuses CPU operands."""

    class _Lowered(Exception):
        pass

    def record(gm, backend, counter):  # noqa: ANN001, ANN202
        raise _Lowered(gm)

    monkeypatch.setattr(step_mod, "lower", record)
    model = _model(EFFICIENT).float().to("meta")
    x, pad, y = _batch(6, 2)
    step = compile_dp(_classify, model=model, clipping_norm=1.0, physical_batch_size=6, backend="inductor")
    with no_functorch_fallback(), pytest.raises(_Lowered) as got:
        step(x.float().to("meta"), pad.to("meta"), y.to("meta"))
    targets = [str(n.target) for n in got.value.args[0].graph.nodes]
    assert sum("efficient_attention_backward" in t for t in targets) == 2, targets
