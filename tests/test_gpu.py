"""Checks that need an accelerator: the premises of the numerical contract on the device's
kernels, the book-keeping operator's device path, and the compiled step on the device
against the CPU step.

Skipped unless the device named by ``OPAKE_TEST_DEVICE`` (default ``cuda``) is available, so
CI (CPU only) skips them all. ``OPAKE_TEST_DEVICE=cpu`` runs the same checks on the CPU, with
Inductor's C++ lowering: a dry run of the tests themselves. On a GPU::

    python -m pytest -q tests/test_gpu.py            # or bench/gpu_check.sh for the whole check

The contract (``compiler/passes/numerics.py``) assumes gradual underflow: a float32 result
below 2^-126 keeps its subnormal digits. On the CPU the step refuses to run when
``torch.set_flush_denormal(True)`` is on; on a GPU nothing sets that, but Triton links
libdevice with its flush-to-zero variants (``nvvm-reflect-ftz``), so each kind of arithmetic
the graph's float32 kernels perform is checked here on the device, compiled by Inductor.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.nn as nn

from _models import huge_partner_batch, no_functorch_fallback
from opake_compile import compile_dp
from opake_compile.compiler._sdpa import batched_attention
from opake_compile.compiler.passes import _kernels
from opake_compile.compiler.passes.numerics import ieee_float32_matmul
from opake_compile.compiler.passes.rewrites import GhostClipping
from opake_compile.dpsgd.clipping import _round_down

DEVICE = os.environ.get("OPAKE_TEST_DEVICE", "cuda")


def _available(device: str) -> bool:
    kind = torch.device(device).type
    if kind == "cpu":
        return True
    module = getattr(torch, kind, None)
    return bool(module is not None and module.is_available())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.inductor,
    pytest.mark.skipif(not _available(DEVICE), reason=f"OPAKE_TEST_DEVICE={DEVICE!r} is not available"),
]

TINY = 2.0**-140  # a float32 subnormal (the smallest normal is 2^-126)


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="inductor", fullgraph=True)


# ------------------------------------------------------------ the contract's premises
@pytest.mark.parametrize(
    "name, fn, args, want",
    [
        ("mul", lambda x, y: x * y, (2.0**-70, 2.0**-70), TINY),
        ("sub", lambda x, y: x - y, (2.0**-125, 2.0**-125 - 2.0**-140), TINY),
        ("fma", lambda x, y: x * y + x * 0.0, (2.0**-70, 2.0**-70), TINY),
        ("div", lambda x, y: x / y, (2.0**-100, 2.0**40), TINY),
        ("sum", lambda x, y: (x * y).sum(), (2.0**-71, 2.0**-70), TINY),  # two halves of TINY
        ("to_float32", lambda x, y: (x.double() * y.double()).float(), (2.0**-70, 2.0**-70), TINY),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_compiled_float32_kernels_keep_subnormal_results(name, fn, args, want):
    # The clip factor's scaling, the book-keeping sums and the float32 norms' partial sums
    # are such kernels. A flushed result would let an example's subnormal rounding exceed
    # the bound the underflow test assumes (2^23 times: 2046 C measured on the CPU).
    n = 2 if name == "sum" else 1
    x = torch.full((n,), args[0], dtype=torch.float32, device=DEVICE)
    y = torch.full((n,), args[1], dtype=torch.float32, device=DEVICE)
    got = _compiled(fn)(x, y)
    assert got.dtype == torch.float32
    assert float(got.double().flatten()[0]) == want, f"{name}: the device flushed a subnormal float32 result"


def test_float32_matrix_products_keep_subnormal_results():
    # The book-keeping product itself (cuBLAS on a GPU), under IEEE float32 (no TF32).
    a = torch.full((4, 8), 2.0**-70, device=DEVICE)
    b = torch.full((8, 4), 2.0**-73, device=DEVICE)  # 8 * 2^-143 = 2^-140 per entry
    with ieee_float32_matmul():
        got = torch.mm(a, b)
    assert torch.equal(got.double(), torch.full((4, 4), TINY, dtype=torch.float64, device=DEVICE))


def test_clip_factors_round_down_into_the_subnormal_range():
    # The clip factor is formed in float64 and rounded toward zero to float32
    # (numerics.emit_round_down; here its eager twin, compiled): it must never round up, and
    # under gradual underflow a subnormal factor keeps its value.
    x = torch.tensor([TINY * (1 + 2.0**-30), TINY, 3 * TINY], dtype=torch.float64, device=DEVICE)
    got = _compiled(lambda t: _round_down(t, torch.float32))(x)
    assert bool((got.double() <= x).all()), "a clip factor rounded up"
    assert got.double().tolist() == [TINY, TINY, 3 * TINY], "the device flushed a subnormal clip factor"


# ------------------------------------------------------------ the operator's device path
def test_bookkeeping_operator_makes_no_host_synchronisation():
    # On a GPU the operator reads nothing on the host (no kept-prefix test, no host underflow
    # test); CUDA's sync debug mode turns any synchronisation into an error.
    if torch.device(DEVICE).type != "cuda":
        pytest.skip("CUDA's synchronisation debug mode")
    g = torch.Generator(device="cpu").manual_seed(0)
    at, b = torch.randn(6, 5, 3, generator=g), torch.randn(6, 5, 4, generator=g)
    kept = torch.tensor([True, False, True, True, False, True])
    factor = torch.rand(6, generator=g)
    clip = torch.tensor(1.0, dtype=torch.float64)
    want = sum(float(factor[i]) * at[i].double().t() @ b[i].double() for i in range(6) if kept[i])
    args = [t.to(DEVICE) for t in (at, b, kept, factor, _kernels.kept_prefix(kept), clip)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _kernels.bookkeeping_mm(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.allclose(got.double().cpu(), want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------ hostile removal ratios on the device
def _step(loss, model, c, path, bookkeeping, p):
    return compile_dp(loss, model=model.to(DEVICE), clipping_norm=c, physical_batch_size=p, backend="inductor",
                      rewrites=[GhostClipping(force={"weight": path}, bookkeeping=bookkeeping)])


def _moved(full, part) -> float:
    return math.sqrt(sum(float((full[k].double() - part[k].double()).square().sum()) for k in full))


@pytest.mark.parametrize("bookkeeping", ["per_layer", "fused"])
@pytest.mark.parametrize("path", ["ghost", "mixed"])
def test_small_scaled_entries_next_to_huge_partners_stay_within_c(path, bookkeeping):
    # tests/test_compiler_numerics.py's construction (31.9 C before the partner test), run
    # through the device's own kernels: output gradients [v1, s, -2 s] against inputs
    # [x1, 2^55, 2^54] at C = 2^-100.
    c = 2.0**-100
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = nn.Linear(1, 1, bias=False)
    step = _step(lambda m, x, v: (m(x) * v).sum(), model, c, path, bookkeeping, 2)
    x, v = (t.to(DEVICE) for t in huge_partner_batch())
    assert _moved(step(x, v).clipped.grads, step(x[1:], v[1:]).clipped.grads) / c <= 1.0


@pytest.mark.parametrize("bookkeeping", ["per_layer", "fused"])
def test_clip_factor_times_a_small_factor_stays_within_c(bookkeeping):
    # C = 1e-29 against inputs of 1e15: the scaled output gradients are subnormal (1.33 C
    # before the underflow test, 1.16 C with the fused sums under Inductor).
    c = 1e-29
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Linear(8, 4, bias=False)
    step = _step(lambda m, x, v: (m(x) * v).sum(), model, c, "ghost", bookkeeping, 1)
    worst = 0.0
    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(1, 8, generator=g) * 1e15).to(DEVICE)
        v = (torch.randn(1, 4, generator=g) * 1e-6).to(DEVICE)
        out = step(x, v)
        assert out.clipped.num_nonfinite == 0
        worst = max(worst, float(out.clipped.grads["weight"].double().norm()) / c)
    assert worst <= 1.0


@pytest.mark.parametrize("bookkeeping", ["per_layer", "fused"])
def test_cancelling_terms_of_one_parameter_are_kept_or_dropped_together(bookkeeping):
    # A weight used twice whose two terms cancel, one of them scaled below the normal range
    # by the clip factor (32 C when the device zeroed one term alone).
    def loss(m, x, v, y, w):
        return (m(x) * v).sum() + (m(y) * w).sum()

    c = 2.0**-100
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = nn.Linear(4, 4, bias=False)
    step = _step(loss, model, c, "ghost", bookkeeping, 2)
    x = torch.zeros(2, 2, 4)
    v, y, w = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(x)
    x[0, 0, 0], v[0, 0, 0] = 2.0**7, 2.0**-60
    y[0, 0, 0], w[0, 0, 0] = 2.0**6, -(2.0**-59)
    g = torch.Generator().manual_seed(0)
    x[1], v[1], y[1], w[1] = (torch.randn(2, 4, generator=g) * c for _ in range(4))
    args = [t.to(DEVICE) for t in (x, v, y, w)]
    assert _moved(step(*args).clipped.grads, step(*(a[1:] for a in args)).clipped.grads) / c <= 1.0


# ------------------------------------------------------------ the device step against the CPU step
def test_compiled_step_on_the_device_matches_the_cpu_step():
    # A small encoder layer (SDPA, LayerNorm, MLP) at default settings: clipped sums and
    # per-example norms on the device's Inductor lowering against aot_eager on the CPU.
    def loss(m, x, y):
        return nn.functional.cross_entropy(m[1](m[0](x).mean(1)), y)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cpu_model = nn.ModuleList([nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), nn.Linear(32, 5)])
    dev_model = copy.deepcopy(cpu_model)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 6, 32, generator=g), torch.randint(0, 5, (8,), generator=g)
    ref = compile_dp(loss, model=cpu_model, clipping_norm=0.5, backend="aot_eager")(x, y).clipped
    got = compile_dp(loss, model=dev_model.to(DEVICE), clipping_norm=0.5, backend="inductor")(x.to(DEVICE), y.to(DEVICE)).clipped
    assert got.num_nonfinite == ref.num_nonfinite == 0
    assert torch.allclose(got.per_example_norms.cpu().double(), ref.per_example_norms.double(), rtol=1e-4)
    for k, want in ref.grads.items():
        assert torch.allclose(got.grads[k].cpu(), want, rtol=1e-4, atol=1e-6), k


# ------------------------------------------------------------ attention's backward, batched
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mask", ["causal", "padding", "shared", "none"])
def test_attention_backward_runs_once_for_all_examples_on_the_device(dtype, mask):
    # The device's fused attention kernels (on CUDA: memory-efficient for float32; flash or
    # cuDNN for bfloat16) under vmap(grad): compiler/_sdpa.py folds the examples into the
    # kernel's batch for the backward op too, and expands a mask shared by the examples (which
    # torch's forward rule passes on with one row, refused by the memory-efficient kernel). No
    # per-example fallback; each example's gradient equals the kernel's gradient for that
    # example alone (a loop at batch size one).
    n, heads, t, e = 4, 2, 40, 16
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, t, heads * e, generator=g).to(DEVICE, dtype)
    w = (torch.randn(heads * e, heads * e, generator=g) / 8).to(DEVICE, dtype)
    lengths = torch.randint(t // 2, t + 1, (n,), generator=g)
    pad = (torch.arange(t) < lengths[:, None]).to(DEVICE)  # True = attend
    shared = torch.ones(t, t, dtype=torch.bool, device=DEVICE).tril()

    def loss(w, x, keep):
        q = (x @ w).view(t, heads, e).transpose(0, 1).unsqueeze(0)
        kw = {
            "causal": {"is_causal": True},
            "padding": {"attn_mask": keep[None, None, None, :]},
            "shared": {"attn_mask": shared},
            "none": {},
        }[mask]
        return nn.functional.scaled_dot_product_attention(q, q.tanh(), q * 0.5, **kw).float().square().sum()

    with no_functorch_fallback(), batched_attention():
        got = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(w, x, pad)
    want = torch.stack([torch.func.grad(loss)(w, x[i], pad[i]) for i in range(n)])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max())), mask


# ------------------------------------------------------------ a whole DP-SGD step on the device
def test_noisy_optimizer_step_on_the_device():
    # compile_dp, then DPOptimizer (Gaussian noise from the key, drawn on the parameters'
    # device) on device parameters: the update is the noised clipped sum over the expected batch
    # size, the noise has std sigma*C per entry (C tiny, so the update is almost all noise), the
    # same key gives the same update, and one step is charged.
    from opake_compile import random as oprandom
    from opake_compile.optim import DPOptimizer
    from opake_compile.sampling import PoissonSampler

    n, sigma, c, lr = 64, 2.0, 1e-3, 1.0

    def run(seed: int) -> tuple[torch.Tensor, DPOptimizer]:
        torch.manual_seed(0)
        model = nn.Linear(256, 128).to(DEVICE)
        before = model.weight.detach().clone()
        step = compile_dp(lambda m, x, y: nn.functional.cross_entropy(m(x), y), model=model, clipping_norm=c)
        opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=lr), noise_multiplier=sigma,
                          sampler=PoissonSampler(n, 1.0, key=oprandom.key(1)), key=oprandom.key(seed))
        idx = next(iter(opt.sampler))
        g = torch.Generator().manual_seed(3)
        x, y = torch.randn(n, 256, generator=g)[idx], torch.randint(0, 128, (n,), generator=g)[idx]
        opt.step(step(x.to(DEVICE), y.to(DEVICE)).clipped, draw=idx)
        assert model.weight.device.type == torch.device(DEVICE).type
        return (model.weight.detach() - before).cpu().double(), opt

    upd, opt = run(5)
    again, _ = run(5)
    other, _ = run(6)
    assert torch.equal(upd, again)
    assert not torch.equal(upd, other)
    # update = -lr (clipped sum + N(0, (sigma C)^2)) / n; the clipped sum adds at most C / n.
    std = float(upd.std()) * n / lr
    assert abs(std / (sigma * c) - 1) < 0.02, std / (sigma * c)  # 32768 entries: std error ~0.4 %
    assert opt.steps == 1 and 0 < opt.epsilon(1e-5) < math.inf
