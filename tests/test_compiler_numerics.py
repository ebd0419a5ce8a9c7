"""The numerical contract (``compiler/passes/numerics.py``): regression tests for the faults
that broke it, norm accuracy at real widths, and its helpers.

Each fault test is the issue's minimal input; each failed on the code before the contract
(measured ratios in the comments). The removal ratio is ``max_i ||S(D) - S(D without i)|| / C``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _models import MathTransformer, TiedHead, huge_partner_batch, next_token_loss
from opake_compile import DPOptimizer, PoissonSampler, compile_dp
from opake_compile.optim import accumulate
from opake_compile.pytree import global_norm
from opake_compile import random as oprandom
from opake_compile.compiler.passes import _factors, _kernels, numerics
from opake_compile.compiler.passes.rewrites import GhostClipping
from opake_compile.dpsgd.clipping import _round_down
from opake_compile.exceptions import ConfigurationError


def removal_ratio(step, args: tuple, c: float, removals: int | None = None) -> float:
    full = step(*args).clipped.grads
    n = args[0].shape[0]
    worst = 0.0
    for i in range(n if removals is None else removals):
        part = step(*(torch.cat([a[:i], a[i + 1 :]]) for a in args)).clipped.grads
        worst = max(worst, math.sqrt(sum(float((full[k].double() - part[k].double()).square().sum()) for k in part)))
    return worst / c


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- helpers
def test_gamma_and_rho():
    assert numerics.gamma(10, 2.0**-24) == pytest.approx(10 * 2.0**-24, rel=1e-6)
    assert numerics.gamma(2**24, 2.0**-24) == math.inf  # fails closed
    assert numerics.rho(torch.float32) == 2.0**-10 and numerics.rho(torch.float64) == 2.0**-40
    assert numerics.effective_clipping_norm(2.0, torch.bfloat16) == pytest.approx(2.0 / (1 + 2.0**-10), rel=1e-15)
    assert numerics.sum_dtype(torch.float16) == torch.float64 and numerics.sum_dtype(torch.float32) == torch.float64
    assert numerics.slack_dtype(torch.float16) == torch.float32 and numerics.slack_dtype(torch.float64) == torch.float64


def test_round_down_never_rounds_up():
    x = torch.rand(100_000, generator=_gen(0), dtype=torch.float64) * torch.logspace(-40, 30, 100_000, dtype=torch.float64)
    y = _round_down(x, torch.float32)
    assert y.dtype == torch.float32
    assert bool((y.double() <= x).all())
    # ... and it is the nearest float32 at or below x: the next float32 up is above x.
    assert bool((torch.nextafter(y, torch.full_like(y, math.inf)).double() > x).all())


def test_clipping_norm_below_the_contract_range_is_refused():
    with pytest.raises(ConfigurationError, match="clipping_norm"):
        compile_dp(lambda m, x: m(x).sum(), model=nn.Linear(2, 2), clipping_norm=1e-31)
    compile_dp(lambda m, x: m(x).sum(), model=nn.Linear(2, 2), clipping_norm=1e-30)


# ----------------------------------------------------------------------------- fault 1: mixed path
_T = 128
_SIGNS = torch.tensor([1.0 if t % 2 == 0 else -1.0 for t in range(_T)])


def _cancel_loss(model, x, v):
    return (_SIGNS[None, :, None] * v[:, None, :] * model(x)).sum()


@pytest.mark.parametrize("m", [1e6, 1e8])
def test_mixed_path_near_cancellation(m):
    # Before: 1.0045 C (M = 1e6) and 1.18 C (M = 1e8) on the mixed path (norm from a separate
    # bmm, sum from the book-keeping product).
    g = _gen(1)
    lin = nn.Linear(8, 8, bias=False)
    u = torch.randn(8, generator=g)
    x = m * u / u.norm() + torch.randn(6, _T, 8, generator=g)
    v = torch.randn(6, 8, generator=g)
    v = v / v.norm(dim=1, keepdim=True)
    step = compile_dp(_cancel_loss, model=lin, clipping_norm=1.0, physical_batch_size=6, backend="aot_eager", rewrites=_GRAM_ONLY)
    assert removal_ratio(step, (x, v), 1.0) <= 1.0
    assert step.coverage == {"weight": "bk:linear (norm materialized)"}  # without the direct sum: the mixed path
    # The default sums this layer's per-example gradients directly (K (R + C) >= R C).
    step = compile_dp(_cancel_loss, model=lin, clipping_norm=1.0, physical_batch_size=6, backend="aot_eager")
    assert removal_ratio(step, (x, v), 1.0) <= 1.0
    assert step.coverage == {"weight": "direct:linear (per-example gradient summed directly)"}


# ----------------------------------------------------------------------------- fault 2: underflow
@pytest.mark.parametrize("c", [1e-16, 1e-17])
def test_ghost_norm_underflow(c):
    # Before: ||b||^2 underflowed to 0 in float32, the norm was 0 and the example unclipped:
    # 1.5 C at C = 1e-4, 15 C at C = 1e-5.
    g = _gen(2)
    lin = nn.Linear(16, 16, bias=False)
    # (Measured with inputs of norm 1.5e19; now inputs of 1.5e15, below the magnitude ramp of
    # numerics.magnitude_limit, and C 10^4 times smaller: unclipped, that example would add
    # 1.5e4 C.)
    x = torch.randn(1, 16, generator=g)
    v = torch.randn(1, 16, generator=g)
    x, v = x * 1.5e15 / x.norm(), v * 1e-27 / v.norm()
    step = compile_dp(lambda mod, x, v: (mod(x) * v).sum(), model=lin, clipping_norm=c, physical_batch_size=1, backend="aot_eager")
    out = step(x, v).clipped
    assert step.coverage == {"weight": "ghost:linear"} and out.num_nonfinite == 0
    true_norm = float(x.double().norm() * v.double().norm())
    # ||b||^2 underflows in float32: the rank-one norm is bounded above by the n 2^-149 of its
    # lost squares, so the example is over-clipped (adversarial input), never under-clipped.
    assert float(out.per_example_norms[0]) >= true_norm
    assert float(out.grads["weight"].double().norm()) <= c


# ----------------------------------------------------------------------------- float64 chains
@pytest.mark.parametrize("case", ["linear, fused", "embedding", "grouped conv"])
def test_in_graph_sums_accumulate_in_chains_of_at_most_max_float64_chain_rows(monkeypatch, case):
    # numerics point 3: the graph's own float64 products over (example, position) rows (fused
    # book-keeping, one-hot scatters, grouped products) are cut into chains, here of 64 rows
    # (4 examples of 40 positions), whose results are added: the same sums, rounded in chains.
    g = _gen(11)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        if case == "linear, fused":
            model, name = nn.Linear(4, 4, bias=False), "weight"
            args = (torch.randn(4, 40, 4, generator=g), torch.randn(4, 40, 4, generator=g))
            loss = lambda m, x, v: (m(x) * v).sum()  # noqa: E731
            rewrites = lambda: [GhostClipping(force={"weight": "ghost"}, bookkeeping="fused")]  # noqa: E731
        elif case == "embedding":
            model, name = nn.Embedding(20, 8), "weight"
            args = (torch.randint(0, 20, (4, 40), generator=g), torch.randn(4, 40, 8, generator=g))
            loss = lambda m, ids, v: (m(ids) * v).sum()  # noqa: E731
            rewrites = lambda: [GhostClipping(force={"weight": "ghost"})]  # noqa: E731
        else:
            model, name = nn.Conv1d(4, 4, 3, groups=2, bias=False), "weight"
            args = (torch.randn(4, 4, 40, generator=g), torch.randn(4, 4, 38, generator=g))
            loss = lambda m, x, v: (m(x) * v).sum()  # noqa: E731
            rewrites = lambda: [GhostClipping(force={"weight": "ghost"})]  # noqa: E731
    whole = compile_dp(loss, model=model, clipping_norm=1.0, physical_batch_size=4, backend="aot_eager", rewrites=rewrites())
    want = whole(*args).clipped.grads[name]
    seen = []

    def short_chains(n):
        seen.append(n)
        return [(s, min(s + 64, n)) for s in range(0, n, 64)]

    monkeypatch.setattr(_kernels, "chain_slices", short_chains)
    chained = compile_dp(loss, model=model, clipping_norm=1.0, physical_batch_size=4, backend="aot_eager", rewrites=rewrites())
    got = chained(*args).clipped.grads[name]
    assert chained.coverage[name].startswith("ghost")
    assert 4 * 38 in seen or 4 * 40 in seen  # the rows of the sum went through the chains
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- a cut at overflow
def _released_norm(step, *args) -> tuple[float, int]:
    out = step(*args).clipped
    return math.sqrt(sum(float(g.double().square().sum()) for g in out.grads.values())), out.num_nonfinite


def _rank_one_step(dtype=torch.float32):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        lin = nn.Linear(16, 16, bias=False).to(dtype)
    return compile_dp(lambda m, x, v: (m(x) * v).sum(), model=lin, clipping_norm=1.0, physical_batch_size=1, backend="aot_eager")


def _edge_case(case: str):
    """A step, a function from a float32 scale to its batch, and two adjacent float32 scales at
    which the cut at overflow switched example 0 (a review's bisection): the mixed path's
    float32 per-example product, squared and summed in float32 (0.99902 C against 0), and a
    centred float32-Gram term whose mean over K = 1024 positions overflowed (0.99711 C
    against 0) while every entry was below its own node's limit."""
    g = torch.Generator().manual_seed(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lin = nn.Linear(4, 4, bias=False) if case == "mixed product" else nn.Linear(32, 32, bias=False)
    path = "mixed" if case == "mixed product" else "ghost"
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=lin, clipping_norm=1.0, physical_batch_size=2,
                      backend="aot_eager", rewrites=[GhostClipping(force={"weight": path})])
    if case == "mixed product":
        xb, vb = torch.rand(1, 8, 4, generator=g) + 0.5, torch.rand(1, 8, 4, generator=g) + 0.5
        xo, vo = torch.randn(1, 8, 4, generator=g), torch.randn(1, 8, 4, generator=g)
        make = lambda s: (torch.cat([xb * s, xo]), torch.cat([vb * 2.0**30, vo]))  # noqa: E731
        return step, make, (506260512.0, 506260544.0)
    xb, xo, vo = (torch.randn(1, 1024, 32, generator=g) for _ in range(3))
    make = lambda s: (torch.cat([xb, xo]), torch.cat([torch.full((1, 1024, 32), s), vo]))  # noqa: E731
    return step, make, (3184525781762048.0, 3184526050197504.0)


@pytest.mark.parametrize("case", ["mixed product", "centred ghost"])
def test_one_ulp_at_a_product_or_mean_overflow_does_not_switch_an_example_on(case):
    step, make, (below, above) = _edge_case(case)
    alone = step(*(t[1:] for t in make(below))).clipped.grads["weight"].double()
    moved = [float((step(*make(s)).clipped.grads["weight"].double() - alone).norm()) for s in (below, above)]
    assert abs(moved[0] - moved[1]) <= 2.0**-20, moved


class _Pieces(nn.Module):
    """One parameter used in two pieces of 1 and 1600 rows (two blocks of unequal shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((1601, 1), 2.0**-70))

    def forward(self, x, v1, v2):
        w1, w2 = self.w.split([1, 1600])
        return ((x @ w1.t()) * v1).sum() + ((x @ w2.t()) * v2).sum()


def test_one_ulp_at_a_larger_piece_overflow_does_not_switch_an_example_on():
    # A review: the product limit took the first block's shape (1 row) for the whole parameter,
    # so the 1600-row block's float32 sum of squares overflowed at weight 0.4: 0.3996 C against
    # 0 one ulp apart. Each block now has its own limit.
    step = compile_dp(lambda m, x, a, b: m(x, a, b), model=_Pieces(), clipping_norm=1.0, physical_batch_size=1,
                      backend="aot_eager", rewrites=[GhostClipping(force={"w": "mixed"})])
    x, v1 = torch.full((1, 1, 1), 2.0**7), torch.ones(1, 1, 1)
    below = torch.tensor(3602879218712576.0)
    above = torch.nextafter(below, torch.tensor(math.inf))
    got = [_released_norm(step, x, v1, torch.full((1, 1, 1600), float(s)))[0] for s in (below, above)]
    assert abs(got[0] - got[1]) <= 2.0**-20, got


@pytest.mark.parametrize("case", ["materialised", "through a second layer"])
def test_one_ulp_at_float16_overflow_does_not_switch_an_example_on(case):
    # A review: float16 models' own arithmetic overflows at 65504, far below the float32-derived
    # limits. A per-example gradient entry of 8 x 8188 added 0.999 C, 8 x 8192 was inf and
    # dropped; an output gradient flowing back through Linear(16, 16) of ones, 16 x 4094
    # against 16 x 4096, the same. The float16 limit (2^14) ramps them to 0 first.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if case == "materialised":
            model = nn.Linear(16, 16, bias=False).half()
        else:
            model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)).half()
            nn.init.ones_(model[1].weight)
            model[1].weight.requires_grad_(False)
    rewrites = [] if case == "materialised" else [GhostClipping(force={"0.weight": "ghost"})]
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=model, clipping_norm=1.0, physical_batch_size=2,
                      backend="aot_eager", rewrites=rewrites)
    g = _gen(4)
    xo, vo = torch.randn(1, 8, 16, generator=g).half(), torch.randn(1, 8, 16, generator=g).half()
    if case == "materialised":
        make = lambda s: (torch.cat([torch.full((1, 8, 16), s).half(), xo]), torch.cat([torch.ones(1, 8, 16).half(), vo]))  # noqa: E731
        scales = (8188.0, 8192.0)
    else:
        make = lambda s: (torch.cat([torch.full((1, 8, 16), 0.01).half(), xo]), torch.cat([torch.full((1, 8, 16), s).half(), vo]))  # noqa: E731
        scales = (4094.0, 4096.0)
    alone = step(*(t[1:] for t in make(scales[0]))).clipped.grads
    moved = []
    for s in scales:
        grads = step(*make(s)).clipped.grads
        moved.append(math.sqrt(sum(float((grads[k].double() - alone[k].double()).square().sum()) for k in grads)))
    assert abs(moved[0] - moved[1]) <= 2.0**-20, moved


@pytest.mark.parametrize("case", ["rank-one linear", "bias vector"])
def test_one_ulp_at_float32_overflow_does_not_switch_an_example_on(case):
    # Before: a float32 sum of squares (||a||^2 of a rank-one ghost norm, a bias gradient's)
    # overflowed at 2^128 and the example was dropped (it added 0); one ulp below, it was
    # clipped and added 0.999 C. Rounding that differs between two evaluations of the same
    # example (another batch size, another bucket's graph) can move it across that cut when a
    # neighbour is removed: 2 C. Now its weight has ramped to 0 long before (both add 0).
    if case == "rank-one linear":
        step = _rank_one_step()
        x, v = torch.full((1, 16), 2.0**62), torch.full((1, 16), 2.0**-62)
        at = [(x, v), (x * (1 - 2.0**-24), v)]
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            lin = nn.Linear(4, 16)
        step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=lin, clipping_norm=1.0, physical_batch_size=1, backend="aot_eager")
        x, v = torch.zeros(1, 4), torch.full((1, 16), 2.0**62)
        at = [(x, v), (x, v * (1 - 2.0**-24))]
    (over, n_over), (under, n_under) = (_released_norm(step, *args) for args in at)
    assert abs(over - under) <= 2.0**-20
    assert n_over == n_under == 1  # both beyond the ramp, counted as dropped


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_magnitude_ramp_weights_examples_continuously(dtype):
    # An example's clip factor is multiplied by clamp(2 - m / H, 0, 1), m its largest entry
    # (float64: the product of its input's and output gradient's largest entries): full weight
    # up to H, none from 2 H, linear between, and one ulp moves it by ~2^-23.
    step = _rank_one_step(dtype)
    h = numerics.magnitude_limit(dtype, 16) if dtype == torch.float32 else numerics.product_limit(dtype, 1, 16, 16)
    c_eff = numerics.effective_clipping_norm(1.0, dtype)
    for t in [0.5, 1.0, 1.25, 1.5, 1.75, 1.999, 2.0, 3.0]:
        # ||G|| = ||x|| ||v|| = 16 t (float32; float64: 16 t / 2^-400): clipped to C_eff, then weighted.
        v_entry = 1.0 / h if dtype == torch.float32 else 2.0**400
        x, v = torch.full((1, 16), t * h / (1.0 if dtype == torch.float32 else v_entry), dtype=dtype), torch.full((1, 16), v_entry, dtype=dtype)
        got, dropped = _released_norm(step, x, v)
        m = float(x[0, 0]) / h * (1.0 if dtype == torch.float32 else v_entry)
        want = c_eff * min(1.0, max(0.0, 2.0 - m))
        assert got == pytest.approx(want, rel=1e-5, abs=1e-12), t  # (the bound is ~1e-6 above the norm)
        assert dropped == (t >= 2.0)
        nudged, _ = _released_norm(step, x * (1 - 2.0 ** -(24 if dtype == torch.float32 else 53)), v)
        assert abs(nudged - got) <= 2.0**-20


def test_magnitude_ramp_reads_the_factors_on_rewritten_paths_and_the_gradient_otherwise():
    # The ghost path's entries are the layer's inputs and output gradients; forced
    # materialised, the per-example gradient's (here 1 each: full weight).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        lin = nn.Linear(16, 16, bias=False)
    h = numerics.magnitude_limit(torch.float32, 16)
    x, v = torch.full((1, 16), 1.5 * h), torch.full((1, 16), 1.0 / h)
    ghost = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=lin, clipping_norm=1.0, physical_batch_size=1, backend="aot_eager")
    full = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=lin, clipping_norm=1.0, physical_batch_size=1, backend="aot_eager",
                      rewrites=[GhostClipping(force={"weight": "materialized"})])
    c_eff = numerics.effective_clipping_norm(1.0, torch.float32)
    assert _released_norm(ghost, x, v)[0] == pytest.approx(0.5 * c_eff, rel=1e-5)
    assert _released_norm(full, x, v)[0] == pytest.approx(c_eff, rel=1e-5)


def test_magnitude_limit_is_a_power_of_two_that_leaves_float32_room():
    for n in [1, 3, 16, 256 * 768, 2**36]:
        h = numerics.magnitude_limit(torch.float32, n)
        assert math.log2(h).is_integer()
        assert n * (4 * h) ** 2 <= 2.0**127  # entries up to 2 H, doubled by centring
        assert n * (4 * numerics.magnitude_limit(torch.float64, n)) ** 2 <= 2.0**1001
    for k, r, c in [(1, 1, 1), (4, 768, 768), (512, 3072, 768)]:
        # ||G|| <= k sqrt(r c) (2 H), squared at most 2^123 (float32) or 2^1000 (float64)
        for dtype, top in [(torch.float32, 123), (torch.float64, 1000)]:
            assert (k * math.sqrt(r * c) * 2 * numerics.product_limit(dtype, k, r, c)) ** 2 <= 2.0**top


# ----------------------------------------------------------------------------- fault 3: bf16 sums
@pytest.mark.parametrize("p", [256, 64])
def test_low_precision_model_releases_a_float32_sum(p):
    # Before: the sum was cast to bfloat16 in the graph and chunk sums added in bfloat16:
    # 1.30 C (P = 256), 1.20 C (P = 64) on 256 identical examples.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(torch.bfloat16)
    x = torch.randn(1, 16, generator=_gen(3)).to(torch.bfloat16).expand(256, 16).contiguous()
    y = torch.zeros(256, dtype=torch.long)
    step = compile_dp(lambda m, x, y: F.cross_entropy(m(x).float(), y), model=mlp, clipping_norm=1.0, physical_batch_size=p, backend="aot_eager")
    out = step(x, y).clipped
    # float64, in one graph or several (never in bfloat16)
    assert {g.dtype for g in out.grads.values()} == {torch.float64}
    assert removal_ratio(step, (x, y), 1.0, removals=1) <= 1.0


def test_optimizer_adds_noise_in_float32_and_casts_only_the_grad():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).to(torch.bfloat16)
    step = compile_dp(lambda m, x, y: F.cross_entropy(m(x).float(), y), model=mlp, clipping_norm=1.0, physical_batch_size=8, backend="aot_eager")
    sampler = PoissonSampler(64, sample_rate=0.125, key=oprandom.key(0))
    opt = DPOptimizer(torch.optim.SGD(mlp.parameters(), lr=0.0), noise_multiplier=1e-3, sampler=sampler, key=oprandom.key(1))
    x, y = torch.randn(8, 4).to(torch.bfloat16), torch.randint(0, 2, (8,))
    clipped = step(x, y).clipped
    next(iter(sampler))  # the draw the step is charged for
    opt.step(clipped)
    for name, p in mlp.named_parameters():
        assert p.grad.dtype == torch.bfloat16
        # Noise 1e-3 is below bfloat16's resolution of most entries: the grad is the float32
        # noisy sum / (q N), rounded once.
        want = (clipped.grads[name] / 8.0).to(torch.bfloat16)
        torch.testing.assert_close(p.grad.float(), want.float(), rtol=2e-2, atol=1e-3)


# ----------------------------------------------------------------------------- fault 4: norm accuracy
def _oracle_norms(model, loss, args) -> torch.Tensor:
    m64 = copy.deepcopy(model).double()
    out = []
    for i in range(args[0].shape[0]):
        m64.zero_grad()
        loss(m64, *(a[i : i + 1].double() if a.is_floating_point() else a[i : i + 1] for a in args)).backward()
        out.append(math.sqrt(sum(float(p.grad.square().sum()) for p in m64.parameters() if p.grad is not None)))
    return torch.tensor(out, dtype=torch.float64)


#: The Gram-form and mixed paths only: long sequences would otherwise sum the per-example
#: gradient directly (GhostClipping's materialize_budget), and these tests are about the others.
_GRAM_ONLY = [GhostClipping(materialize_budget=None)]


def _assert_norms_exact(model, loss, args, p, tol=0.01, rewrites=None):
    step = compile_dp(loss, model=model, clipping_norm=1.0, physical_batch_size=p, backend="aot_eager", rewrites=rewrites)
    got = step(*args).clipped.per_example_norms.double()
    ref = _oracle_norms(model, loss, args)
    rel = (got - ref) / ref
    # At most 1 % above the float64 oracle, never below it by more than rho.
    assert float(rel.max()) <= tol, rel
    assert float(rel.min()) >= -numerics.rho(torch.float32), rel
    return step, rel


@pytest.mark.slow
def test_gpt2_small_width_block_norms_are_exact_at_t128():
    # Before: +26 % and +23 % (the float32 Gram form's cancellation guard fired on ordinary
    # language-model examples).
    transformers = pytest.importorskip("transformers")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(
            n_embd=768, n_head=12, n_layer=1, vocab_size=500, n_positions=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
        cfg._attn_implementation = "eager"
        model = transformers.GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 500, (2, 128), generator=_gen(5))
    loss = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    step, rel = _assert_norms_exact(model, loss, (ids,), 2)
    assert any(v.startswith("ghost:") for v in step.coverage.values())
    # Float32 Grams where fast_gram_ok: their rounding bound costs at most FAST_GRAM_OVERCLIP.
    assert 0 <= float(rel.min()) and float(rel.max()) <= _factors.FAST_GRAM_OVERCLIP, rel


@pytest.mark.slow
def test_bert_base_width_norms_are_exact_at_t128():
    transformers = pytest.importorskip("transformers")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        cfg = transformers.BertConfig(
            hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=1,
            vocab_size=500, max_position_embeddings=128, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=0,
        )
        cfg._attn_implementation = "eager"
        model = transformers.BertForMaskedLM(cfg).eval()
    ids = torch.randint(1, 500, (2, 128), generator=_gen(6))
    mask = torch.zeros(2, 1, 1, 128)  # 4-D additive mask (the 2-D form is the coverage issue's)
    _assert_norms_exact(model, lambda m, ids, mask: m(input_ids=ids, attention_mask=mask, labels=ids).loss, (ids, mask), 2)


def test_bench_transformer_and_mlp_norms_are_exact():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        tf = MathTransformer(vocab=1000, d=128, heads=4, seq=64).eval()
        mlp = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    ids = torch.randint(0, 1000, (4, 64), generator=_gen(7))
    # Next-token loss (a tied model predicting its own input has a loss of ~1e-13: degenerate).
    _assert_norms_exact(tf, lambda m, ids: F.cross_entropy(m(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()), (ids,), 4)
    x, y = torch.randn(8, 256, generator=_gen(8)), torch.randint(0, 10, (8,), generator=_gen(9))
    _assert_norms_exact(mlp, lambda m, x, y: F.cross_entropy(m(x), y), (x, y), 8)


def test_bench_cnn_and_lora_norms_are_exact():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(8)
        cnn = nn.Sequential(  # the bench's (Opacus') MNIST CNN
            nn.Conv2d(1, 16, 8, 2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, 2), nn.ReLU(), nn.MaxPool2d(2, 1),
            nn.Flatten(), nn.Linear(512, 32), nn.ReLU(), nn.Linear(32, 10),
        )
        base = nn.Linear(64, 64)
        lora_a, lora_b = nn.Linear(64, 8, bias=False), nn.Linear(8, 64, bias=False)
    base.requires_grad_(False)

    class LoRA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base, self.a, self.b = base, lora_a, lora_b

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + 2.0 * self.b(self.a(x))

    lora = LoRA()
    x, y = torch.randn(4, 1, 28, 28, generator=_gen(12)), torch.randint(0, 10, (4,), generator=_gen(13))
    _assert_norms_exact(cnn, lambda m, x, y: F.cross_entropy(m(x), y), (x, y), 4)
    xs = torch.randn(4, 16, 64, generator=_gen(14))  # LoRA over a sequence: the mixed path's home
    step, _ = _assert_norms_exact(lora, lambda m, x: m(x).tanh().sum(), (xs,), 4)
    assert set(step.coverage) == {"a.weight", "b.weight"}


def test_mixed_path_norms_stay_exact_over_long_sequences():
    # A narrow layer over a long sequence takes the mixed path. Its float32 product's bound
    # over-clipped by 0.39 % at T = 8192 (1.5 % at T = 32768); the float64 product keeps the
    # norm within 1e-6 of the oracle.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(15)
        lin = nn.Linear(16, 16, bias=False)
    x, y = torch.randn(2, 8192, 16, generator=_gen(15)), torch.randn(2, 8192, 16, generator=_gen(16))
    step, _ = _assert_norms_exact(lin, lambda m, x, y: (m(x) - y).square().sum(dim=(1, 2)).mean(), (x, y), 2, tol=1e-6,
                                  rewrites=_GRAM_ONLY)
    assert step.coverage == {"weight": "bk:linear (norm materialized)"}


def test_tied_lm_head_over_a_long_sequence_forms_its_norm_per_example():
    # T (R + C) > R C: the Gram form of the tied table (float64 K x K Grams over the vocabulary,
    # 12 % of GPT-2 width's DP step at T = 512) costs more than one scatter-add and one
    # product per example. The norm stays within the contract's tolerance of the oracle.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(16)
        lm = TiedHead(64, 32)
    ids = torch.randint(0, 64, (2, 128), generator=_gen(16))
    step, _ = _assert_norms_exact(lm, next_token_loss, (ids,), 2, tol=1e-3)
    assert step.coverage["tok.weight"] == "bk:embedding+linear (norm materialized)"


def test_embedding_mixed_path_near_cancellation():
    # One id at every position, rows of alternating sign and size M: the scatter-add cancels
    # in float32, and its bound (gamma_K S) keeps every example at or below C.
    g = _gen(17)
    emb = nn.Embedding(4, 8)
    u = torch.randn(8, generator=g)
    ids = torch.zeros(6, _T, dtype=torch.long)
    v = 1e6 * u / u.norm() + torch.randn(6, 8, generator=g)
    step = compile_dp(lambda m, ids, v: (_SIGNS[None, :, None] * v[:, None, :] * m(ids)).sum(), model=emb,
                      clipping_norm=1.0, physical_batch_size=6, backend="aot_eager")
    assert removal_ratio(step, (ids, v), 1.0) <= 1.0
    assert step.coverage == {"weight": "bk:embedding (norm materialized)"}


# ----------------------------------------------------------------------------- forcing paths
def test_force_picks_each_path_and_rejects_impossible_ones():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 16, 8, generator=_gen(10))

    def loss(m, x):
        return m(x).square().sum()

    paths = {}
    for path in ("ghost", "mixed", "materialized"):
        step = compile_dp(loss, model=lin, clipping_norm=0.1, physical_batch_size=4, backend=None,
                          rewrites=[GhostClipping(force={"weight": path})])
        out = step(x)
        paths[path] = (step.coverage["weight"], out.clipped)
    assert paths["ghost"][0] == "ghost:linear"
    assert paths["mixed"][0] == "bk:linear (norm materialized)"
    assert paths["materialized"][0] == "materialized (forced)"
    for path in ("ghost", "mixed"):
        for k, g in paths[path][1].grads.items():
            torch.testing.assert_close(g, paths["materialized"][1].grads[k], rtol=1e-4, atol=1e-6)
    with pytest.raises(ConfigurationError, match="Unknown path"):
        GhostClipping(force={"weight": "fast"})
    # An embedding forced onto the mixed path: its norm from one scatter-add, same result.
    emb, ids = nn.Embedding(5, 4), torch.randint(0, 5, (2, 3), generator=_gen(10))
    got = {}
    for path in ("mixed", "materialized"):
        step = compile_dp(lambda m, ids: m(ids).square().sum(), model=emb, clipping_norm=0.1, physical_batch_size=2,
                          backend=None, rewrites=[GhostClipping(force={"weight": path})])
        got[path] = step(ids).clipped.grads["weight"]
        assert step.coverage["weight"] == ("bk:embedding (norm materialized)" if path == "mixed" else "materialized (forced)")
    torch.testing.assert_close(got["mixed"], got["materialized"], rtol=1e-5, atol=1e-7)
    step = compile_dp(loss, model=lin, clipping_norm=1.0, physical_batch_size=4, backend=None,
                      rewrites=[GhostClipping(force={"no.such": "ghost"})])
    with pytest.raises(ConfigurationError, match="no.such"):
        step(x)


@pytest.mark.parametrize("path", ["ghost", "mixed"])
@pytest.mark.parametrize("exps", [(-170, 170), (170, -170), (0, 0)], ids=["tiny_input", "huge_input", "unit"])
def test_float64_factors_at_the_ends_of_the_range(path, exps):
    # Without the power-of-two scaling, ||a||^2 underflows (or ||b||^2 overflows) in float64
    # exactly as fault 2 did in float32: norm 0 or NaN.
    lin = nn.Linear(16, 16, bias=False).double()
    g = _gen(11)
    x = torch.randn(2, 8, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 8, 16, generator=g, dtype=torch.float64)
    x = x / x.flatten(1).norm(dim=1).view(-1, 1, 1) * 10.0 ** exps[0]
    v = v / v.flatten(1).norm(dim=1).view(-1, 1, 1) * 10.0 ** exps[1]
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=lin, clipping_norm=1e-3, physical_batch_size=2,
                      backend="aot_eager", rewrites=[GhostClipping(force={"weight": path})])
    out = step(x, v).clipped
    # The true per-example gradient is sum_t v_t x_t^T; compute its norm with the scales factored out.
    true = torch.stack([(v[i] * 10.0 ** -exps[1]).T @ (x[i] * 10.0 ** -exps[0]) for i in range(2)]).flatten(1).norm(dim=1)
    torch.testing.assert_close(out.per_example_norms, true, rtol=1e-9, atol=0)
    assert out.num_nonfinite == 0
    assert removal_ratio(step, (x, v), 1e-3) <= 1.0


# ----------------------------------------------------------------------------- reduced precision
def _round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to nearest on TF32's 10-bit mantissa, as tensor cores read it."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def _emulated_tf32_mm(real):  # noqa: ANN001, ANN202
    """``torch.mm`` as cuBLAS runs it: float32 operands are read as TF32 unless
    ``torch.get_float32_matmul_precision() == "highest"`` (``allow_tf32``)."""

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
            a, b = _round_to_tf32(a), _round_to_tf32(b)
        return real(a, b)

    return mm


def test_bookkeeping_sum_is_exact_float32_when_tf32_is_allowed(monkeypatch):
    # The slack rho = 2^-10 assumes the book-keeping product rounds like IEEE float32. With
    # TF32 allowed (set_float32_matmul_precision("high"), common on GPUs) its operands are
    # rounded to 2^-11, relative to an example's mass (up to KAPPA C): before the fix, this
    # near-cancelling example (two positions, mass / norm at the cap) contributed 1.0013 C
    # (emulated TF32, found by a scan of M and seeds).
    monkeypatch.setattr(torch, "mm", _emulated_tf32_mm(torch.mm))
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        signs = torch.tensor([1.0, -1.0])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = nn.Linear(64, 64, bias=False)
        step = compile_dp(
            lambda m, x, v: (signs[None, :, None] * v[:, None, :] * m(x)).sum(),
            model=model, clipping_norm=1.0, physical_batch_size=1, backend="aot_eager",
            rewrites=[GhostClipping(force={"weight": "ghost"})],
        )
        g = _gen(1)
        u = torch.randn(64, generator=g)
        x = 270.0 * u / u.norm() + torch.randn(1, 2, 64, generator=g)
        v = torch.randn(1, 64, generator=g)
        out = step(x, v / v.norm())
        assert float(out.clipped.grads["weight"].double().norm()) <= 1.0
        assert torch.get_float32_matmul_precision() == "high"  # restored after the product
    finally:
        torch.set_float32_matmul_precision(prev)


def test_mixed_matmul_precision_settings_count_as_reduced_precision():
    # Legacy and per-backend precision settings mixed: torch.get_float32_matmul_precision
    # raises, which used to crash the rewrite pass with torch's RuntimeError. Now reduced
    # precision is assumed (the conservative bounds) and the user's settings are kept.
    prev = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()
        assert numerics.unit_roundoff(torch.float32, matmul=True) == 2.0**-8
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        step = compile_dp(lambda m, x: m(x).square().sum(), model=model, clipping_norm=1.0, backend="aot_eager")
        out = step(torch.randn(4, 5, 8, generator=_gen(0)))
        assert out.clipped.num_examples == 4 and out.coverage["1.weight"].startswith("bk:")
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    finally:
        torch.set_float32_matmul_precision(prev)


def test_many_aligned_examples_in_one_large_logical_batch_move_the_sum_by_at_most_c():
    # Before: chunk sums (and graphs of any size) were added in float32; a sum of magnitude
    # n C rounds on a grid of ~2^-24 n C per entry, so 2^18 aligned examples in chunks of 2^14
    # moved the released sum by 1.0055 C (found by a hostile review). Now graphs hold at most
    # MAX_FLOAT32_SUM_ROWS rows and chunk sums add up in float64, up to MAX_FLOAT32_LOGICAL_ROWS
    # rows in one call (beyond, the chunks' own rounding adds up: refused, test_compiler_step).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
    with pytest.warns(UserWarning, match="physical_batch_size=16384 is above the 4096 rows"):
        step = compile_dp(lambda m, x, y: (m(x) - y).square().mean(), model=model, clipping_norm=1.0,
                          backend="aot_eager", physical_batch_size=2**14)
    g = _gen(0)
    n = numerics.MAX_FLOAT32_LOGICAL_ROWS
    x = (5 * torch.randn(1, 4, generator=g)).expand(n, 4).contiguous()
    y = torch.randn(1, 1, generator=g).expand(n, 1).contiguous()
    assert step.plan(n)[0][1] == numerics.MAX_FLOAT32_SUM_ROWS
    assert removal_ratio(step, (x, y), 1.0, removals=1) <= 1.0


def _aligned_removal(model, loss, args, clipping_norm, rewrites=None):
    """||sum(D) - sum(D minus its first example)|| / C (float64): the others shift up a row."""
    step = compile_dp(loss, model=model, clipping_norm=clipping_norm, backend="aot_eager",
                      physical_batch_size=args[0].shape[0], rewrites=rewrites)
    full, less = step(*args).clipped.grads, step(*(a[1:] for a in args)).clipped.grads
    return math.sqrt(sum(float((full[k].double() - less[k].double()).square().sum()) for k in full)) / clipping_norm


@pytest.mark.parametrize("case", ["linear, default path", "linear, fused", "embedding", "conv, ghost"])
def test_a_long_contraction_of_aligned_rows_moves_the_sum_by_at_most_c(case):
    """A book-keeping sum is one product over every (example, position) row; a BLAS adds a
    long contraction nearly in sequence, and aligned rows (identical examples) then round the
    same way at every addition. Removing one of 4096 identical examples of 64 positions moved
    the released sum by 1.009 C on the default path, likewise through the fused product, an
    embedding's scatter and a convolution's Gram path, and by 1.95 C at T = 4096 (review).
    Every sum across examples is float64 now (exact products of the float32 factors)."""
    b, t = 4096, 64
    c = 1.2697867137638703  # (a mantissa at which the old sum's rounding reached 1.009 C)
    ones = lambda *s: torch.ones(*s)  # noqa: E731
    if case.startswith("linear"):
        rewrites = [GhostClipping(force={"weight": "mixed"}, bookkeeping="fused")] if case.endswith("fused") else None
        ratio = _aligned_removal(nn.Linear(1, 1, bias=False), lambda m, x, y: (m(x) * y).sum(),
                                 (ones(b, t, 1), ones(b, t, 1)), c, rewrites)
    elif case == "embedding":
        ratio = _aligned_removal(nn.Embedding(4, 1), lambda m, ids, y: (m(ids) * y).sum(),
                                 (torch.zeros(b, t, dtype=torch.long), ones(b, t, 1)), c)
    else:
        ratio = _aligned_removal(nn.Conv2d(1, 1, 1, bias=False), lambda m, x, y: (m(x) * y).sum(),
                                 (ones(1024, 1, 16, 16), ones(1024, 1, 16, 16)), c, [GhostClipping(force={"weight": "ghost"})])
    assert ratio <= 1.0


@pytest.mark.parametrize("case", ["linear, one graph", "linear, 4 chunks", "embedding"])
def test_one_example_cannot_steer_how_the_others_round(case):
    """A float32 accumulation can be steered: one example ("lifter") that puts every later
    partial sum above 4096, where 3 * 2^-12 is 1.5 grid steps, makes each of 2039 small terms
    after it round up by half a step (ties to even): +C/4 per 4096 examples, gone with the
    lifter. Removing the first example moved the sum by 1.245 C in one graph, 1.99 C over four
    chunks (each chunk carries a lifter, and the removal shifts every chunk) and 1.245 C
    through an embedding (review; 4.98 C over 16 chunks). Float64 sums: the lifter's own
    share (0.996 C)."""
    c, lifter, small = 2.0, 1.9921875, 3 * 2.0**-12  # every norm below C_eff: clip factors 1
    unit = [lifter] * 2056 + [0.09375] + [small] * 2039  # 4096 examples of one position
    chunks = 4 if case == "linear, 4 chunks" else 1
    y = torch.tensor(unit * chunks).view(-1, 1, 1)
    if case == "embedding":
        model, x, y = nn.Embedding(64, 2), torch.zeros(y.shape[0], 1, dtype=torch.long), y * torch.tensor([1.0, 0.0])
    else:
        model, x = nn.Linear(1, 1, bias=False), torch.ones(y.shape[0], 1, 1)
    step = compile_dp(lambda m, x, y: (m(x) * y).sum(), model=model, clipping_norm=c, backend="aot_eager",
                      physical_batch_size=4096)
    moved = step(x, y).clipped.grads["weight"].double() - step(x[1:], y[1:]).clipped.grads["weight"].double()
    assert float(moved.norm()) / c <= 1.0


def test_partial_sums_add_in_float64_across_chunks_parts_and_graphs():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
    step = compile_dp(lambda m, x: m(x).square().mean(), model=model, clipping_norm=1.0,
                      backend="aot_eager", physical_batch_size=4)
    x = torch.randn(8, 3, generator=_gen(1))
    one = step(x[:4]).clipped
    two = step(x).clipped
    assert all(t.dtype == torch.float64 for t in one.grads.values())  # (released sums are float64)
    assert all(t.dtype == torch.float64 for t in two.grads.values())
    acc = accumulate([one, step(x[4:]).clipped])
    assert all(t.dtype == torch.float64 for t in acc.grads.values())
    for k in two.grads:
        torch.testing.assert_close(acc.grads[k], two.grads[k])
    # The default buckets never exceed the cap either.
    big = compile_dp(lambda m, x: m(x).square().mean(), model=model, clipping_norm=1.0, backend="aot_eager")
    assert max(p for _, p in big.plan(3 * numerics.MAX_FLOAT32_SUM_ROWS)) <= numerics.MAX_FLOAT32_SUM_ROWS


@pytest.fixture(params=["cpu", "accelerator"])
def operator_branch(request, monkeypatch):
    """The book-keeping operator's CPU code, or its accelerator code (no host reads) run on
    the CPU."""
    if request.param == "accelerator":
        monkeypatch.setattr(_kernels, "_host_reads_are_free", lambda t: False)
    return request.param


@pytest.mark.parametrize("bookkeeping", ["per_layer", "fused"])
@pytest.mark.parametrize("path", ["ghost", "mixed"])
@pytest.mark.parametrize("dtype, x_scale", [(torch.float32, 1e15), (torch.float64, 1e292)])
def test_clip_factor_times_a_small_factor_stays_within_c(path, dtype, x_scale, bookkeeping, operator_branch):
    # The book-keeping sum multiplies the clip factor into one factor before the product.
    # Where that product (C / |b| here) lands in the subnormal range it keeps a few digits
    # and may round up, and the product with the large other factor carried that into the
    # sum although the norm was exact: before the fix one example moved the sum by 1.33 C
    # (float32, inputs 1e15) and 1.0102 C (float64, inputs 1e292), with C = 1e-29.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Linear(8, 4, bias=False).to(dtype)
    c = 1e-29
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=model, clipping_norm=c, backend="aot_eager",
                      physical_batch_size=1,
                      rewrites=[GhostClipping(force={"weight": path}, bookkeeping=bookkeeping)])
    v_scale = 1e-6 if dtype == torch.float32 else 1e-150
    worst = 0.0
    for seed in range(30):
        g = _gen(seed)
        x = torch.randn(1, 8, generator=g, dtype=dtype) * x_scale
        v = torch.randn(1, 4, generator=g, dtype=dtype) * v_scale
        out = step(x, v)
        assert out.clipped.num_nonfinite == 0
        worst = max(worst, float(out.clipped.grads["weight"].double().norm()) / c)
    assert worst <= 1.0


@pytest.mark.inductor
def test_fused_bookkeeping_keeps_subnormal_scaled_factors_out_under_inductor():
    # The fused sums' in-graph selection lowered for real, on the hostile example above
    # (1.16 C here with the clip factor simply applied; the example now adds nothing).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Linear(8, 4, bias=False)
    c = 1e-29
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=model, clipping_norm=c, backend="inductor",
                      physical_batch_size=2, rewrites=[GhostClipping(force={"weight": "ghost"}, bookkeeping="fused")])
    worst = 0.0
    for seed in range(10):
        g = _gen(seed)
        x = torch.randn(2, 8, generator=g) * 1e15
        v = torch.randn(2, 4, generator=g) * 1e-6
        out = step(x[:1], v[:1])  # one real example, one padded row
        assert out.clipped.num_nonfinite == 0
        worst = max(worst, float(out.clipped.grads["weight"].double().norm()) / c)
    assert worst <= 1.0
    assert step.num_backend_compiles == 1


@pytest.mark.parametrize("bookkeeping", ["per_layer", "fused"])
def test_a_small_entry_next_to_a_large_partner_stays_within_c(bookkeeping, operator_branch):
    # A hostile review's counterexample to rescaling both operands by powers of two (float64
    # Grams, C = 2^-100): position 0's huge input has a zero output gradient, position 1's
    # tiny input a unit one. Scaling the input operand down made the tiny entry subnormal,
    # rounded up: 1.95 C.
    from unittest import mock

    c = 2.0**-100
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = nn.Linear(4, 4, bias=False)
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=model, clipping_norm=c, physical_batch_size=2,
                      backend="aot_eager", rewrites=[GhostClipping(force={"weight": "ghost"}, bookkeeping=bookkeeping)])
    with mock.patch("opake_compile.compiler.passes.rewrites.fast_gram_ok", lambda *a: False):
        step(torch.zeros(2, 2, 4), torch.zeros(2, 2, 4))  # traced with float64 Grams
    x, v = torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)
    # (It was 2^100; a float32 input beyond 2^56 against a unit output gradient here is now
    # weighted down by the magnitude ramp, so the construction runs at 2^55, the tiny entry
    # still 2^155 below it.)
    x[0, 0, 0], x[0, 1, 0], v[0, 1, 0] = 2.0**55, 1.025 * 2.0**-100, 1.0
    out = step(x, v).clipped
    assert out.num_nonfinite == 0
    assert float(out.grads["weight"].double().norm()) / c <= 1.0


@pytest.mark.parametrize("bookkeeping", ["per_layer", "fused"])
@pytest.mark.parametrize("path", ["ghost", "mixed"])
def test_small_scaled_entries_next_to_huge_partners_stay_within_c(path, bookkeeping, operator_branch):
    # A third review's construction: output gradients [v1, s, -2 s] against inputs
    # [x1, L, L / 2]. The last two positions cancel in G but carry the mass, so f is set by
    # it; f s and 2 f s round to the smallest subnormal, and the pair adds ~2^-150 L / 2 ~ 32 C
    # instead of 0, while f v1 is normal: a test of f times the largest scaled entry missed it
    # (31.9 C on every branch). The test now bounds the subnormal error against the partners.
    c = 2.0**-100
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = nn.Linear(1, 1, bias=False)
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=model, clipping_norm=c, physical_batch_size=2,
                      backend="aot_eager", rewrites=[GhostClipping(force={"weight": path}, bookkeeping=bookkeeping)])
    x, v = huge_partner_batch()
    moved = float((step(x, v).clipped.grads["weight"].double() - step(x[1:], v[1:]).clipped.grads["weight"].double()).norm())
    assert moved / c <= 1.0


@pytest.mark.parametrize(("lx0", "lx1", "lv1"), [(300, -300, 300), (0, -600, 600), (0, 0, 0)])
def test_float64_tied_embedding_rescaling_covers_the_dense_term(lx0, lx1, lv1):
    # A one-hot (embedding) term and a dense one (the tied head) of one float64 weight: the
    # one-hot left factor is not scaled, and the dense one was left unscaled with it (2^300),
    # outside the underflow bound's premise: 100 C. Now each dense term moves its scale into
    # its right factor: extreme examples are dropped as non-finite or clipped, an ordinary
    # one keeps its norm.
    def loss(m, ids, u, x, v):
        return (m(ids) * u).sum() + (F.linear(x, m.weight) * v).sum()

    c = 0.01
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = nn.Embedding(4, 4).double()
    step = compile_dp(loss, model=model, clipping_norm=c, physical_batch_size=2, backend="aot_eager",
                      rewrites=[GhostClipping(force={"weight": "ghost"})])
    ids = torch.zeros(1, 3, dtype=torch.long)
    u = torch.zeros(1, 3, 4, dtype=torch.float64)
    x, v = torch.zeros(1, 3, 4, dtype=torch.float64), torch.zeros(1, 3, 4, dtype=torch.float64)
    x[0, 0, 0] = 2.0**lx0  # sets the scale; its output gradient is 0
    x[0, 1, 0], v[0, 1, 0] = 2.0**lx1, 2.0**lv1  # G = 2^(lx1 + lv1) e0 e0^T: norm 1
    out = step(ids, u, x, v).clipped
    assert float(out.grads["weight"].norm()) <= c
    norm = float(out.per_example_norms[0])
    assert out.num_nonfinite == 1 or 1.0 <= norm <= 1.0 + 1e-9


@pytest.mark.parametrize("bookkeeping", ["per_layer", "fused"])
@pytest.mark.parametrize("path", ["ghost", "mixed"])
@pytest.mark.parametrize(
    "dtype, c, lx, lv, shift",
    [(torch.float32, 2.0**-100, 7.0, -60.0, 1.0), (torch.float32, 2.0**-100, 60.0, -70.0, 60.0),
     (torch.float64, 1.0, 974.5, -900.0, 1.0)],
    ids=["f32-scaled-subnormal", "f32-scaled-to-zero", "f64"],
)
def test_cancelling_terms_of_one_parameter_are_kept_or_dropped_together(dtype, c, lx, lv, shift, path, bookkeeping,
                                                                        operator_branch):
    # A weight used twice: the attacker's two terms cancel (G = 0), and the clip factor times
    # one term's output gradient falls below the normal range (or to zero) while the other's
    # does not. Dropping or zeroing that term alone released the other: 32 C (a review).
    def loss(m, x, v, y, w):
        return (m(x) * v).sum() + (m(y) * w).sum()

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = nn.Linear(4, 4, bias=False).to(dtype)
    step = compile_dp(loss, model=model, clipping_norm=c, physical_batch_size=2, backend="aot_eager",
                      rewrites=[GhostClipping(force={"weight": path}, bookkeeping=bookkeeping)])
    x = torch.zeros(2, 2, 4, dtype=dtype)
    v, y, w = torch.zeros_like(x), torch.zeros_like(x), torch.zeros_like(x)
    x[0, 0, 0], v[0, 0, 0] = 2.0**lx, 2.0**lv  # term 1: 2^(lx + lv) e0 e0^T
    y[0, 0, 0], w[0, 0, 0] = 2.0 ** (lx - shift), -(2.0 ** (lv + shift))  # term 2 = -term 1
    g = _gen(0)
    x[1], v[1], y[1], w[1] = (torch.randn(2, 4, generator=g, dtype=dtype) * c for _ in range(4))
    full = step(x, v, y, w).clipped.grads
    part = step(x[1:], v[1:], y[1:], w[1:]).clipped.grads
    moved = math.sqrt(sum(float((full[k].double() - part[k].double()).square().sum()) for k in full))
    assert moved / c <= 1.0


@pytest.mark.parametrize("path", ["ghost", "mixed"])
def test_float64_rescaling_cannot_hide_a_small_entry_with_a_large_partner(path, operator_branch):
    # Float64 factors are scaled per example by their largest entry (_rescale_float64). An
    # input of 2^300 whose output gradient is 0 set the scale; a 2^-300 input meeting an output
    # gradient of 2^300 then underflowed in the Gram (or product) squares: norm 0, unclipped,
    # 100 C. Now the underflow is bounded: the example is clipped (or dropped as non-finite).
    c = 0.01
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = nn.Linear(4, 4, bias=False).double()
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=model, clipping_norm=c, physical_batch_size=2,
                      backend="aot_eager", rewrites=[GhostClipping(force={"weight": path})])
    x = torch.zeros(1, 2, 4, dtype=torch.float64)
    v = torch.zeros(1, 2, 4, dtype=torch.float64)
    x[0, 0, 0], x[0, 1, 0], v[0, 1, 0] = 2.0**300, 2.0**-300, 2.0**300  # G = e0 e0^T, norm 1
    out = step(x, v).clipped
    assert float(out.grads["weight"].norm()) <= c
    assert out.num_nonfinite == 1 or float(out.per_example_norms[0]) >= 1.0  # a bound, never below
    # An ordinary float64 example keeps an accurate norm.
    x2, v2 = torch.randn(1, 2, 4, dtype=torch.float64), torch.randn(1, 2, 4, dtype=torch.float64)
    exact = float(torch.einsum("btj,bti->ij", x2, v2).norm())
    got = float(step(x2, v2).clipped.per_example_norms[0])
    assert exact <= got <= exact * (1 + 1e-9)


@pytest.mark.parametrize("dtype, x_scale, v_scale", [(torch.float32, 1e15, 1e-6), (torch.float64, 1e292, 1e-150)])
def test_grouped_conv_sum_keeps_the_clip_factor_out_of_the_subnormal_range(dtype, x_scale, v_scale):
    # The grouped convolution's book-keeping sum (in-graph products, one per group): before
    # the fix one example moved the float32 sum by 1.11 C (C = 1e-29, inputs 1e15).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Conv1d(4, 4, 1, groups=2, bias=False).to(dtype)
    c = 1e-29
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=model, clipping_norm=c, backend="aot_eager",
                      physical_batch_size=1, rewrites=[GhostClipping(force={"weight": "ghost"})])
    worst = 0.0
    for seed in range(30):
        g = _gen(seed)
        x = torch.randn(1, 4, 1, generator=g, dtype=dtype) * x_scale
        v = torch.randn(1, 4, 1, generator=g, dtype=dtype) * v_scale
        out = step(x, v)
        assert out.clipped.num_nonfinite == 0 and out.coverage["weight"] == "ghost:conv"
        worst = max(worst, float(out.clipped.grads["weight"].double().norm()) / c)
    assert worst <= 1.0


# ------------------------------------------------------- float32 Gram matrices: bounds and escalation
def _positions_batch(p: int, k: int, r: int, c: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x (P, K, R) and output weights w (P, K, C) of ``loss = sum(linear(x) * w)``, whose
    per-example gradient is ``sum_k w_k x_k^T``: "cancel" pairs positions with x nearly equal
    and w opposite (norm ~ delta |x| |w| while the Gram entries are ~ |x|^2 |w|^2), "aligned"
    shares one direction across positions (anisotropic), "random" is ordinary."""
    g = _gen(seed)
    x = torch.randn(p, k, r, generator=g)
    w = torch.randn(p, k, c, generator=g)
    if kind == "cancel":
        delta = torch.logspace(-4, -1, p, dtype=torch.float64).view(p, 1, 1)
        e = k - k % 2  # odd K: the last position gets no output weight
        x[:, 1:e:2] = (x[:, 0:e:2].double() * (1 + delta)).float()
        w[:, 1:e:2] = -w[:, 0:e:2]
        w[:, e:] = 0
    elif kind == "aligned":
        x = x * 0.1 + torch.randn(p, 1, r, generator=g)
    return x, w


@pytest.mark.parametrize("r, k", [(64, 16), (2500, 16), (2500, 301)])
@pytest.mark.parametrize("kind", ["cancel", "aligned", "random"])
def test_float32_gram_norms_are_never_below_the_exact_norm(kind, r, k):
    """Shapes where the float32 Gram form applies (fast_gram_ok): every kept example's norm is
    at least the exact norm of the gradient of its float32 inputs (computed in float64). With
    the float32 rounding bound removed, near-cancelling examples come out below it. R = 2500
    contracts A's Gram over more than GRAM_CHUNK terms: float32 products added in float64.
    K = 301 positions forms the symmetric Grams in panels (101, 101 and 99 rows): the
    cancelling pairs are positions (2i, 2i + 1), so (100, 101) and (200, 201) straddle panel
    edges (and C = 384, where the Gram form is the cheaper one)."""
    p, c = 48, (64 if k < 128 else 384)
    lin = nn.Linear(r, c, bias=False)
    x, w = _positions_batch(p, k, r, c, kind, seed=11)
    step = compile_dp(lambda m, x, w: (m(x) * w).sum(dim=(1, 2)).sum(), model=lin, clipping_norm=1.0, backend="aot_eager",
                      rewrites=_GRAM_ONLY)
    got = step(x, w).clipped.per_example_norms.double()
    assert step.coverage["weight"] == "ghost:linear"
    g_r, g_c = _factors._gram_entry_gamma(r), _factors._gram_entry_gamma(c)  # a shape the float32 form takes:
    assert (g_r + g_c) * math.sqrt(k) <= _factors.FAST_GRAM_OVERCLIP
    graph = next(iter(step._cache.values())).traced.gm.graph
    # Every float32 Gram product runs over at most GRAM_CHUNK terms (a product of its own, or
    # one slice of an opake::sliced_gram), and together they form each entry of the panels
    # (the upper triangle of blocks) once per slice of A's R and B's C terms: R = 2500 in 21
    # slices of at most 120 (a group of 8 slices' float32 sum then counts as 127 terms).
    shapes = []
    for n in graph.nodes:
        if n.target is torch.ops.aten.bmm.default:
            shapes.append(n.args[0].meta["val"].shape + n.args[1].meta["val"].shape[2:])
        elif n.target is _kernels.SLICED_GRAM:
            (b, m, terms), cols, size = n.args[0].meta["val"].shape, n.args[1].meta["val"].shape[2], n.args[2]
            shapes += [(b, m, min(size, terms - start), cols) for start in range(0, terms, size)]
    assert all(n <= _factors.GRAM_CHUNK for _, _, n, _ in shapes)
    slices = sum(1 if n <= _factors.GRAM_CHUNK else -(-n // _factors._gram_slice(n)) for n in (r, c))
    assert r <= _factors.GRAM_CHUNK or -(-r // _factors._gram_slice(r)) == 21
    panel_entries = sum((stop - start) * (k - start) for start, stop in _factors._panel_rows(k))
    assert sum(b * m * n for b, m, _, n in shapes) == p * slices * panel_entries
    assert panel_entries == (k * k if k < 128 else 101 * 301 + 101 * 200 + 99 * 99)
    exact = torch.einsum("pkc,pkr->pcr", w.double(), x.double()).flatten(1).norm(dim=1)
    kept = torch.isfinite(got)
    assert int(kept.sum()) == p
    # Reported in float32: allow its own rounding, nothing more.
    assert bool((got >= exact * (1 - 2.0**-23)).all()), (got / exact).min()
    if kind == "random":
        assert float((got / exact).max()) <= 1 + _factors.FAST_GRAM_OVERCLIP  # ordinary data: tight


@pytest.mark.parametrize("kind", ["cancel", "aligned", "random"])
def test_float64_gram_panels_give_the_exact_norm(kind):
    """Float64 Gram matrices in panels (K = 300 positions: 3 panels of 100 rows) on a float64
    layer: the norms and the S used for the rounding bound read the diagonal blocks; every
    norm is at least the exact one and ordinary ones within 1e-7 of it."""
    p, k, r, c = 6, 300, 48, 40
    lin = nn.Linear(r, c, bias=False).double()
    x, w = (t.double() for t in _positions_batch(p, k, r, c, kind, seed=5))
    step = compile_dp(lambda m, x, w: (m(x) * w).sum(dim=(1, 2)).sum(), model=lin, clipping_norm=1.0,
                      backend="aot_eager", rewrites=[GhostClipping(force={"weight": "ghost"})])
    got = step(x, w).clipped.per_example_norms.double()
    assert step.coverage["weight"] == "ghost:linear" and len(_factors._panel_rows(k)) == 3
    exact = torch.einsum("pkc,pkr->pcr", w, x).flatten(1).norm(dim=1)
    assert bool((got >= exact * (1 - 1e-12)).all()), (got / exact).min()
    if kind != "cancel":
        assert float((got / exact).max()) <= 1 + 1e-7  # the float64 bound: ~1e-11 S^2


class _RightMatmul(nn.Module):
    """``x @ W`` with W (in, out): GPT-2's Conv1D orientation, where the per-example gradient's
    left factor is the inputs and its right factor the output gradients."""

    def __init__(self, r: int, c: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(r, c) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


@pytest.mark.parametrize("layout", ["linear", "right_matmul"])
@pytest.mark.parametrize("k,shared", [(256, 5.0), (512, 20.0)])
def test_zero_sum_output_gradients_against_shared_inputs_stay_tight(layout, k, shared):
    """A key projection's output gradients sum to zero over positions (softmax is shift
    invariant) while its inputs share a direction (anisotropic hidden states): the exact norm
    cancels the shared direction. Uncentred float32 Gram bounds read it in ``||B B^T||_F``
    and over-clipped by 2.8 % at K = 256 (shared part 5x the rest, width 768); centred terms
    (``_factors._centre``) keep it out of the bound, whichever side the inputs are on. (The
    Gram form's bound alone: fused book-keeping, since the CPU's per-example float32 sum raises
    every bound by gamma_K S, which reads the shared direction; see
    test_compiler_per_example_sum.py for what that costs.)"""
    p, r, c = 2, 768, 768
    g = _gen(21)
    x = shared * torch.randn(p, 1, r, generator=g) + torch.randn(p, k, r, generator=g)
    w = torch.randn(p, k, c, generator=g)
    w = w - w.mean(dim=1, keepdim=True)
    model = nn.Linear(r, c, bias=False) if layout == "linear" else _RightMatmul(r, c)
    step = compile_dp(lambda m, x, w: (m(x) * w).sum(dim=(1, 2)).sum(), model=model, clipping_norm=1.0,
                      backend="aot_eager", rewrites=[GhostClipping(materialize_budget=None, bookkeeping="fused")])
    got = step(x, w).clipped.per_example_norms.double()
    assert step.coverage["weight"] == "ghost:linear"
    exact = torch.einsum("pkc,pkr->pcr", w.double(), x.double()).flatten(1).norm(dim=1)
    assert bool((got >= exact * (1 - 2.0**-23)).all())
    assert float((got / exact).max()) <= 1.001, (got / exact).max()


def _shifted_batch(p: int, k: int, r: int, c: int, kind: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs with a large shared direction (the part centring removes) under hostile
    residuals: "cancel" pairs positions whose residuals nearly agree with opposite output
    weights, "mixed_sign" makes inputs straddle zero around a mean of either sign (the
    subtraction then rounds), "tiny" has residuals whose squares underflow in float32,
    "identical" repeats one input (the exact gradient is zero: output weights sum to zero);
    "shifted" is ordinary data on top of the shared direction (output weights that do not
    sum to zero, so the rank-one term carries most of the norm)."""
    g = _gen(seed)
    mean = torch.randn(p, 1, r, generator=g) * 1e3
    w = torch.randn(p, k, c, generator=g)
    if kind == "shifted":
        return mean + torch.randn(p, k, r, generator=g), w
    if kind == "cancel":
        x, w = _positions_batch(p, k, r, c, "cancel", seed)
        return (x.double() + mean.double()).float(), w
    if kind == "mixed_sign":
        return mean + torch.randn(p, k, r, generator=g) * 3e3, w - w.mean(dim=1, keepdim=True)
    if kind == "tiny":
        return mean * 1e-20 + torch.randn(p, k, r, generator=g) * 1e-23, w - w.mean(dim=1, keepdim=True)
    return mean.expand(p, k, r).contiguous(), w - w.mean(dim=1, keepdim=True)


@pytest.mark.parametrize("layout", ["linear", "right_matmul"])
@pytest.mark.parametrize("kind", ["shifted", "cancel", "mixed_sign", "tiny", "identical"])
def test_centred_norms_are_never_below_the_exact_norm(kind, layout):
    """The centring of the inputs (``_factors._centre``) rounds ``B - 1 m^T`` and sums the
    other factor over positions in float64; the bound adds both errors. Under a shared
    direction 1e3 times the residuals, near-cancelling pairs, inputs straddling zero,
    underflowing residuals and identical positions, no norm comes out below the exact norm
    of the float32 inputs' gradient (float64), in either layout."""
    p, k, r, c = 8, 128, 128, 112
    x, w = _shifted_batch(p, k, r, c, kind, seed=31)
    model = nn.Linear(r, c, bias=False) if layout == "linear" else _RightMatmul(r, c)
    step = compile_dp(lambda m, x, w: (m(x) * w).sum(dim=(1, 2)).sum(), model=model, clipping_norm=1.0,
                      backend="aot_eager", rewrites=[GhostClipping(force={"weight": "ghost"})])
    got = step(x, w).clipped.per_example_norms.double()
    assert step.coverage["weight"] == "ghost:linear"
    graph = next(iter(step._cache.values())).traced.gm.graph
    assert any(n.target is torch.ops.aten.div.Tensor and n.args[1] == float(k) for n in graph.nodes)  # centred
    exact = torch.einsum("pkc,pkr->pcr", w.double(), x.double()).flatten(1).norm(dim=1)
    assert bool(torch.isfinite(got).all())
    assert bool((got >= exact * (1 - 2.0**-23)).all()), (got / exact).min()
    if kind in ("shifted", "mixed_sign"):
        assert float((got / exact).max()) <= 1.001, (got / exact).max()  # and tight


def test_an_examples_norm_depends_on_that_example_alone():
    """The norm bound (float32 Grams here) is a function of the example's own data: not of the
    other examples in its batch, nor of batches seen before. A step that adapted its precision
    to what it had seen (say, float64 Grams after a batch with aligned positions) would let one
    example change every later example's clip factor, and the sum's sensitivity would no
    longer be C."""
    p, k, r, c = 4, 256, 1024, 1024
    assert (_factors._gram_entry_gamma(r) + _factors._gram_entry_gamma(c)) * k / 2 <= _factors.FAST_GRAM_OVERCLIP
    x, w = _positions_batch(p, k, r, c, "random", seed=12)
    hx, hw = _positions_batch(p, k, r, c, "aligned", seed=13)
    hx = hx * 0.01 + hx[:, :1]  # every position nearly the same input: a loose float32 bound
    loss = lambda m, x, w: (m(x) * w).sum(dim=(1, 2)).sum()  # noqa: E731
    step = compile_dp(loss, model=nn.Linear(r, c, bias=False), clipping_norm=1.0, backend="aot_eager")
    first = step(x, w).clipped.per_example_norms
    assert step.coverage["weight"] == "ghost:linear"
    hostile = step(hx, hw).clipped.per_example_norms.double()
    exact = torch.einsum("pkc,pkr->pcr", hw.double(), hx.double()).flatten(1).norm(dim=1)
    assert bool((hostile >= exact * (1 - 2.0**-23)).all())
    assert torch.equal(step(x, w).clipped.per_example_norms, first)  # nothing learned from it
    x2, w2 = x.clone(), w.clone()
    x2[0], w2[0] = hx[0], hw[0]
    assert torch.equal(step(x2, w2).clipped.per_example_norms[1:], first[1:])
    assert step.num_traces == 1


def test_a_changed_matmul_precision_traces_again():
    """Float32 rounding bounds are sized to the matrix-product precision in force at trace time:
    allowing TF32 / bfloat16 passes after the first call must not reuse the IEEE graph (its
    float32 Grams would then read operands at 2^-11 under bounds for 2^-24)."""
    p, k, r, c = 4, 16, 64, 64
    x, w = _positions_batch(p, k, r, c, "random", seed=21)
    step = compile_dp(lambda m, x, w: (m(x) * w).sum(dim=(1, 2)).sum(), model=nn.Linear(r, c, bias=False),
                      clipping_norm=1.0, backend="aot_eager")
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        step(x, w)
        assert step.num_traces == 1
        torch.set_float32_matmul_precision("high")
        assert not numerics.float32_matmul_is_ieee()
        step(x, w)
        assert step.num_traces == 2  # traced again, under reduced-precision bounds
        torch.set_float32_matmul_precision("highest")
        step(x, w)
        assert step.num_traces == 2  # the IEEE graph is still cached
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("bookkeeping", ["per_layer", "fused"])
def test_float64_example_huge_on_both_sides_adds_nothing(bookkeeping, operator_branch):
    # Float64 sums put the clip factor on the operand with the larger entries, so the partners
    # of its scaled entries are the smaller operand's. An example huge in both (2^950 inputs at
    # one position, 2^950 output gradients at another, an ordinary third position) would
    # defeat that at C = 2^-100; its rescaled norm overflows first, so it is dropped as
    # non-finite on every branch. (The operator's own refusal: test_compiler_kernels.)
    c = 2.0**-100
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = nn.Linear(1, 1, bias=False).double()
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=model, clipping_norm=c, physical_batch_size=2,
                      backend="aot_eager", rewrites=[GhostClipping(force={"weight": "ghost"}, bookkeeping=bookkeeping)])
    x, v = torch.zeros(2, 3, 1, dtype=torch.float64), torch.zeros(2, 3, 1, dtype=torch.float64)
    x[0, :, 0] = torch.tensor([2.0**950, 0.0, 1.0], dtype=torch.float64)
    v[0, :, 0] = torch.tensor([0.0, 2.0**950, 1.0], dtype=torch.float64)
    g = _gen(0)
    x[1], v[1] = torch.randn(3, 1, generator=g, dtype=torch.float64), torch.randn(3, 1, generator=g, dtype=torch.float64)
    base = step(x[1:], v[1:]).clipped.grads["weight"]
    out = step(x, v).clipped
    assert out.num_nonfinite == 1
    assert float((out.grads["weight"] - base).norm()) / c <= 1.0


def test_flushed_subnormals_are_refused_before_anything_runs():
    # The contract bounds underflow by the size of a subnormal; flushed to zero, a hostile
    # review's bias norm came out 2^11 too small (2046 C) and a book-keeping sum moved by
    # 1.004 C. Both the compiled step and the eager reference refuse, and the step's key and
    # call count do not move.
    from opake_compile.dpsgd.clipping import clip_and_sum
    from opake_compile.exceptions import ConfigurationError

    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush subnormals")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Linear(2, 4)
    step = compile_dp(lambda m, x, v: (m(x) * v).sum(), model=model, clipping_norm=1.0, backend="aot_eager",
                      physical_batch_size=2)
    x, v = torch.randn(2, 1, 2), torch.randn(2, 1, 4)
    before = step(x, v).clipped.grads["bias"]
    state = step.state_dict()
    torch.set_flush_denormal(True)
    try:
        with pytest.raises(ConfigurationError, match="set_flush_denormal"):
            step(x, v)
        with pytest.raises(ConfigurationError, match="set_flush_denormal"):
            clip_and_sum({"g": torch.randn(3, 2)}, 1.0)
    finally:
        torch.set_flush_denormal(False)
    assert step.state_dict()["num_calls"] == state["num_calls"]
    assert str(step.state_dict()["key"]) == str(state["key"])
    assert torch.equal(step(x, v).clipped.grads["bias"], before)  # works again once restored


def _tied_head_step(path: str, p: int, make: Callable[[], nn.Module]) -> tuple[nn.Module, Any]:
    """A :class:`TiedHead` built by ``make`` under seed 1, and its step at C = 1 with the tied
    weight forced onto ``path`` of GhostClipping (``"mixed"``: the norm from the per-example
    gradient)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = make()
    step = compile_dp(next_token_loss, model=model, clipping_norm=1.0, physical_batch_size=p, backend="aot_eager",
                      rewrites=[GhostClipping(force={"tok.weight": path}, materialize_budget=None)])
    return model, step


@pytest.mark.parametrize("scale", [1.0, 1e-20], ids=["unit", "tiny-head-input"])
@pytest.mark.parametrize("pattern", ["random", "one-id-repeated", "identical-examples"])
def test_a_tied_heads_float32_mixed_norm_is_never_below_the_float64_norm(pattern, scale):
    # The mixed path scatter-adds the embedding's rows into the head's float32 product, one
    # per-example gradient buffer. Ids repeated in a sequence pile up in one entry (a scatter
    # that overwrote instead of adding, or skipped the embedding term, fails every case here:
    # checked); a head input 1e-20 puts the head's products near float32's subnormals. (The
    # rounding slack gamma_{K+J} S is not what this tests: on these data the float32 norm
    # stays above the float64 one without it.)
    vocab, d, t, p = 50, 8, 20, 6
    g = torch.Generator().manual_seed(0)
    ids = {
        "random": torch.randint(0, vocab, (p, t), generator=g),
        "one-id-repeated": torch.full((p, t), 7).index_fill_(1, torch.arange(0, t, 3), 3),
        "identical-examples": torch.randint(0, vocab, (1, t), generator=g).repeat(p, 1),
    }[pattern]
    model, step = _tied_head_step("mixed", p, lambda: TiedHead(vocab, d, scale))
    norms = step(ids).clipped.per_example_norms.double()
    assert "norm materialized" in step.coverage["tok.weight"], step.coverage
    exact = []
    m64 = copy.deepcopy(model).double()
    for i in range(p):
        m64.zero_grad()
        next_token_loss(m64, ids[i : i + 1]).backward()
        exact.append(torch.sqrt(sum(q.grad.square().sum() for q in m64.parameters())))
    exact = torch.stack(exact)
    assert torch.all(norms >= exact), (norms / exact).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", ["mixed", "ghost"])
def test_a_tied_heads_padding_rows_do_not_shrink_its_clipped_contribution(path, dtype):
    # Padding ids at every other position: their rows get no embedding gradient, but the
    # LayerNorm of the zero padding embedding makes their would-be gradients large (~1/sqrt(eps)).
    # Counted in the mixed path's mass S, they made the mass cap bind: examples of norm 0.48 C
    # were released at 0.21 C (a hostile review's find). Each example alone must be released at
    # min(its norm, C_eff), as on the ghost path.
    vocab, d, t, p = 50, 8, 20, 6
    ids = torch.randint(0, vocab, (p, t), generator=torch.Generator().manual_seed(0))
    ids[:, ::2] = 0
    ids[0] = 0  # all padding but the head's term
    _, step = _tied_head_step(path, p, lambda: TiedHead(vocab, d, padding_idx=0).to(dtype))
    norms = step(ids).clipped.per_example_norms.double()
    assert ("norm materialized" in step.coverage["tok.weight"]) == (path == "mixed"), step.coverage
    c_eff = numerics.effective_clipping_norm(1.0, dtype)
    assert float(norms.min()) < c_eff < float(norms.max())  # some examples clipped, some not
    for i in range(p):
        got = float(global_norm(step(ids[i : i + 1]).clipped.grads, compute_dtype=torch.float64))
        assert got == pytest.approx(min(float(norms[i]), c_eff), rel=1e-5), (i, got, float(norms[i]))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["mixed", "ghost"])
def test_a_tied_heads_padded_sequences_at_real_width_are_clipped_at_their_own_norm(path):
    # The test above at a width users train at: V = 8192, d = 768, T = 512, right-, left- and
    # scattered padding (padding_idx 0 at 41-61 % of the positions). Each example's norm is
    # a bound at or above its float64 norm, within 1e-4 (the float32 rounding slack grows with
    # T and d); each example alone is released at its exact norm times its clip factor
    # min(1, C_eff / norm) (the bound's slack shows here: 2-4e-5 below C_eff). With the old
    # mass (padding rows counted) the scattered-padding example's norm came out 0.1 % above
    # its float64 norm on the mixed path (checked).
    vocab, d, t, p = 8192, 768, 512, 3
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (p, t), generator=g)
    ids[0, 300:] = 0
    ids[1] = torch.where(torch.rand(t, generator=g) < 0.5, 0, ids[1])
    ids[2, :200] = 0
    model, step = _tied_head_step(path, p, lambda: TiedHead(vocab, d, padding_idx=0))
    norms = step(ids).clipped.per_example_norms.double()
    assert ("norm materialized" in step.coverage["tok.weight"]) == (path == "mixed"), step.coverage
    m64 = copy.deepcopy(model).double()
    c_eff = numerics.effective_clipping_norm(1.0, torch.float32)
    for i in range(p):
        m64.zero_grad()
        next_token_loss(m64, ids[i : i + 1]).backward()
        exact = float(global_norm({k: q.grad for k, q in m64.named_parameters()}, compute_dtype=torch.float64))
        assert exact <= float(norms[i]) <= exact * (1 + 1e-4), (i, float(norms[i]) / exact)
        got = float(global_norm(step(ids[i : i + 1]).clipped.grads, compute_dtype=torch.float64))
        assert got == pytest.approx(exact * min(1.0, c_eff / float(norms[i])), rel=1e-5), (i, got, float(norms[i]))
        assert got <= c_eff
