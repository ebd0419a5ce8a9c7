"""Poisson batch sizes under ``compile_dp``'s default bucketed physical sizes.

Everything is counted, never timed: compiled graphs (a counting backend that returns the graph
unchanged), padded rows per step (``DPStep.plan``), and the results against the same batch run
at ``physical_batch_size = b`` and against the eager oracle.
"""

from __future__ import annotations

import math

import pytest
import torch

import opake_compile as opake
from _models import assert_trees_close, mlp_case, reference_clipped
from opake_compile import compile_dp
from opake_compile.compiler.step import BUCKET_RATIO, DEFAULT_MAX_PHYSICAL_SIZES, _SizePlan
from opake_compile.exceptions import UnsupportedOperationError
from opake_compile.sampling import PoissonSampler


def _passthrough(gm, example_inputs):  # a backend that compiles nothing: counted by DPStep
    return gm


def _padded(step, n: int) -> int:
    return sum(p - m for m, p in step.plan(n))


@pytest.mark.parametrize("anchor", [1, 7, 32, 100, 256, 1000])
def test_grid_pads_under_five_percent_and_holds_the_anchor(anchor):
    plan = _SizePlan(None, 10**6)
    plan.set_anchor(anchor)
    assert plan.grid_point(anchor) == anchor
    for m in range(1, plan.max_rows + 1):
        g = plan.grid_point(m)
        assert m <= g <= BUCKET_RATIO * m, (m, g)
        assert g <= plan.max_rows


@pytest.mark.parametrize(("expected", "sds"), [(16, 2), (32, 3), (64, 4), (256, 4), (4096, 4)])
def test_poisson_sizes_fit_the_cap(expected, sds):
    """The sizes within ``sds`` standard deviations of a Poisson batch (2: about 95 % of steps;
    3: all but 3e-3; 4: all but 6e-5) each get their own bucket under the default cap, which
    bounds compile time."""
    plan = _SizePlan(None, DEFAULT_MAX_PHYSICAL_SIZES)
    plan.set_anchor(expected)
    sd = math.sqrt(expected)
    lo, hi = max(1, int(expected - sds * sd)), int(expected + sds * sd)
    grid = {plan.grid_point(m) for m in range(lo, min(hi, plan.max_rows) + 1)}
    assert len(grid) <= DEFAULT_MAX_PHYSICAL_SIZES, sorted(grid)


def test_poisson_steps_no_recompiles_after_warmup_and_little_padding():
    case = mlp_case(seed=0, hidden=5)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=0.5, backend=_passthrough)
    n_data, expected = 640, 64
    sampler = PoissonSampler(n_data, sample_rate=expected / n_data, key=opake.random.key(0))
    x, y = case.make_batch(n_data, 1)
    step(x[:expected], y[:expected])  # the expected batch size anchors the grid
    # Warm-up: one batch per bucket within 4 standard deviations of the expected size.
    lo, hi = int(expected - 4 * math.sqrt(expected)), int(expected + 4 * math.sqrt(expected))
    for n in sorted({step._plan.grid_point(m) for m in range(lo, min(hi, step.physical_batch_size) + 1)}):
        step(x[:n], y[:n])
    warm = step.num_backend_compiles
    assert warm == len(step.physical_sizes) <= DEFAULT_MAX_PHYSICAL_SIZES
    sizes = [len(b) for _ in range(3) for b in sampler]  # three epochs of Poisson batches
    assert len(set(sizes)) > 8 and all(lo <= n <= hi for n in sizes), sizes
    for n in sizes:
        out = step(x[:n], y[:n])
        assert out.clipped.num_examples == n
        assert _padded(step, n) <= 0.05 * n, (n, step.plan(n))
    assert step.num_backend_compiles == warm  # zero recompiles after warm-up


def test_fixed_size_batches_never_pad():
    case = mlp_case(seed=1)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=0.5, backend=_passthrough)
    for s in range(3):
        step(*case.make_batch(13, s))
    assert step.plan(13) == ((13, 13),)
    assert step.physical_sizes == (13,) and step.num_backend_compiles == 1


@pytest.mark.parametrize("n", [97, 150])
def test_bucketed_results_equal_the_unpadded_step(n):
    case = mlp_case(seed=2)
    args = case.make_batch(n, 3)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=0.3, backend=None)
    step(*case.make_batch(100, 0))  # anchor at 100: 97 runs padded to 100, 150 in two chunks
    out = step(*args)
    assert out.clipped.num_examples == n and out.clipped.per_example_norms.shape == (n,)
    assert {97: ((97, 100),), 150: ((136, 136), (14, 14))}[n] == step.plan(n)
    exact = compile_dp(case.loss_fn, model=case.model, clipping_norm=0.3, physical_batch_size=n, backend=None)(*args)
    assert_trees_close(out.clipped.grads, exact.clipped.grads, torch.float32)
    torch.testing.assert_close(out.clipped.per_example_norms, exact.clipped.per_example_norms)
    torch.testing.assert_close(out.loss, exact.loss)
    assert_trees_close(out.clipped.grads, reference_clipped(case.model, case.loss_fn, args, 0.3).grads, torch.float32)


def test_cap_bounds_the_graphs_and_results_stay_exact():
    case = mlp_case(seed=3)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=0.4, backend=_passthrough, max_physical_sizes=3)
    step(*case.make_batch(20, 0))
    for n in (1, 5, 14, 19, 21, 27, 33, 60, 2):
        args = case.make_batch(n, n)
        out = step(*args)
        assert_trees_close(out.clipped.grads, reference_clipped(case.model, case.loss_fn, args, 0.4).grads, torch.float32)
        assert sum(m for m, _ in step.plan(n)) == n
    assert len(step.physical_sizes) == 3 and step.num_backend_compiles == 3


def test_explicit_physical_batch_size_keeps_one_graph():
    case = mlp_case(seed=4)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=0.4, physical_batch_size=8, backend=_passthrough)
    for n in (3, 8, 13):
        step(*case.make_batch(n, n))
    assert step.physical_sizes == (8,) and step.num_backend_compiles == 1
    assert step.plan(13) == ((8, 8), (5, 8))


def test_a_failed_call_leaves_no_size_behind():
    case = mlp_case(seed=5)
    calls = {"n": 0}

    def flaky(gm, example_inputs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("backend down")
        return gm

    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=0.4, backend=flaky)
    step(*case.make_batch(10, 0))
    with pytest.raises(UnsupportedOperationError):
        step(*case.make_batch(7, 1))
    assert step.physical_sizes == (10,)


# ------------------------------------------------------------------ a known gap (stop 53)
def _upstream_row(r: torch.Tensor, q: torch.Tensor, rows: int, d: int) -> float:
    """Row 0 of ``F.linear`` over ``rows`` identical rows (the op the model below runs)."""
    return float(torch.nn.functional.linear(r[None, None].repeat(rows, 1, 1), q[None].repeat(d, 1))[0, 0, 0])


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "Known gap, found in stop 53 by a hostile review: the BLAS rounds a row of a matrix product "
    "differently with the product's row count, default buckets give D and D - i graphs of "
    "different row counts, and copies of an example at a rounding threshold all swing the "
    "same way (10.99 C with 10 copies where the gradient is materialised; 1.0135 C on the "
    "ghost path, whose margin over 1 depends on the BLAS: not kept strict)."))
def test_copies_at_a_rounding_threshold_cannot_swing_together_between_bucket_sizes():
    # Every copy of j sees its upstream F.linear row rounded one way in the graph of D (n + 1
    # rows, anchoring the buckets) and the other in the graph of D - i (n rows, the bucket
    # below); j's output gradients [1, h, ..., h, -1] put its float32 product over positions on
    # the two sides of a half-ulp threshold. Needs a machine whose BLAS changes row 0 between
    # two consecutive row counts that the buckets separate (this one: 10 and 11); skipped where
    # none is found. An explicit physical_batch_size (one row count) measured 0.999. The
    # library chooses the path: materialised per-example gradients here.
    d0, d, c, k, clip = 256, 256, 256, 384, 1e-6
    g = torch.Generator().manual_seed(0)
    r = torch.rand(d0, generator=g) * 0.5 + 0.1
    q = torch.rand(d0, generator=g) * 0.5 + 0.1
    rows = {m: _upstream_row(r, q, m, d) for m in range(2, 41)}
    n = next((m for m in range(2, 40) if rows[m] != rows[m + 1]), None)
    if n is None:
        pytest.skip("this machine's BLAS rounds the row alike at every row count from 2 to 40")
    p_a, p_b = rows[n], rows[n + 1]
    c0 = float(torch.tensor(p_a - 0.0313, dtype=torch.float32))
    v_a, v_b = float(torch.tensor(p_a) - c0), float(torch.tensor(p_b) - c0)
    h = float(torch.tensor(2.0**-29 / math.sqrt(v_a * v_b), dtype=torch.float32))

    class PreThenLinear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("w", q[None].repeat(d, 1).contiguous())  # (no gradient)
            self.register_buffer("c0", torch.tensor(c0))
            self.fc = torch.nn.Linear(d, c, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc((torch.nn.functional.linear(x, self.w) - self.c0).expand(-1, k, -1))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = PreThenLinear()
    step = compile_dp(lambda m, x, w: (m(x) * w).sum(), model=model, clipping_norm=clip, backend="aot_eager")
    wj = torch.zeros(1, k, c)
    wj[0, 0], wj[0, 1 : k - 1], wj[0, k - 1] = 1.0, h, -1.0
    wi = torch.zeros(1, k, c)
    wi[0, 0] = 1.0 if v_b > v_a else -1.0
    x, w = r[None, None].repeat(n + 1, 1, 1), torch.cat([wj] * n + [wi])
    both = step(x, w).clipped.grads["fc.weight"].double()
    if step.plan(n) == step.plan(n + 1):
        pytest.skip(f"the buckets anchored at {n + 1} hold {n} rows in the same graph")
    without = step(x[:n], w[:n]).clipped.grads["fc.weight"].double()
    assert float((both - without).norm()) / clip <= 1.0


def test_the_default_sizes_warn_of_the_gap_and_an_explicit_size_does_not():
    import warnings

    from opake_compile.exceptions import SoundnessWarning

    model = torch.nn.Linear(3, 2)
    with pytest.warns(SoundnessWarning, match=r"physical_batch_size set from public numbers") as record:
        compile_dp(lambda m, x: m(x).sum(), model=model, clipping_norm=1.0, backend="aot_eager")
    assert record[0].filename == __file__  # (points at the caller)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SoundnessWarning)
        compile_dp(lambda m, x: m(x).sum(), model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=8)
