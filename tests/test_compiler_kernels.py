"""The operators the rewrite passes emit (``compiler/passes/_kernels.py``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from opake_compile import compile_dp
from opake_compile.compiler.passes._kernels import BOOKKEEPING_MM

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _loop(at, b, kept, factor):
    """sum_i factor_i at_i^T b_i over kept examples, one example at a time, in float64."""
    out = torch.zeros(at.shape[2], b.shape[2], dtype=F64)
    for i in range(at.shape[0]):
        if kept[i]:
            out += float(factor[i]) * at[i].double().T @ b[i].double()
    return out


@pytest.mark.parametrize("r,c", [(3, 7), (7, 3), (5, 5)], ids=["r<c", "r>c", "r=c"])
@pytest.mark.parametrize("k", [1, 4])
def test_bookkeeping_mm_matches_the_per_example_loop_when_every_example_is_kept(r, c, k):
    p = 6
    at = torch.randn(p, k, r, generator=_gen(1), dtype=F64)
    b = torch.randn(p, k, c, generator=_gen(2), dtype=F64)
    factor = torch.rand(p, generator=_gen(3), dtype=F64)
    kept = torch.ones(p, dtype=torch.bool)
    got = BOOKKEEPING_MM(at, b, kept, factor, kept.all())
    assert got.shape == (r, c) and got.dtype == F64
    torch.testing.assert_close(got, _loop(at, b, kept, factor), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("r,c", [(3, 7), (7, 3)], ids=["r<c", "r>c"])
def test_bookkeeping_mm_excluded_rows_with_nan_and_inf_contribute_exactly_zero(r, c):
    p, k = 5, 2
    at = torch.randn(p, k, r, generator=_gen(4), dtype=F64)
    b = torch.randn(p, k, c, generator=_gen(5), dtype=F64)
    # Example 1 is excluded with a NaN in the left factor, example 3 with an inf in the right
    # one; 0 * NaN = NaN, so multiplying their rows by a zero factor would poison the sum.
    at[1, 0, 0] = math.nan
    b[3, 1, 2] = math.inf
    kept = torch.tensor([True, False, True, False, True])
    factor = torch.where(kept, torch.rand(p, generator=_gen(6), dtype=F64), 0.0)
    got = BOOKKEEPING_MM(at, b, kept, factor, kept.all())
    assert bool(torch.isfinite(got).all())
    want = _loop(at, b, kept, factor)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # The excluded rows really are ignored: replacing them changes nothing.
    at2, b2 = at.clone(), b.clone()
    at2[1], b2[3] = 1e30, -1e30
    assert torch.equal(BOOKKEEPING_MM(at2, b2, kept, factor, kept.all()), got)


@pytest.mark.parametrize("m", [0, 1, 3, 5], ids=lambda m: f"first{m}")
@pytest.mark.parametrize("r,c", [(3, 7), (7, 3)], ids=["r<c", "r>c"])
def test_bookkeeping_mm_padded_tail_is_sliced_off_with_its_nan_and_factor(m, r, c):
    # A chunk padded at its end keeps exactly its first m rows: the operator slices the rest
    # off (no select copies); their NaN, inf and factors must still never reach the sum.
    p, k = 5, 3
    at = torch.randn(p, k, r, generator=_gen(20), dtype=F64)
    b = torch.randn(p, k, c, generator=_gen(21), dtype=F64)
    kept = torch.arange(p) < m
    at[m:, 0, 0] = math.nan
    b[m:, 1, 1] = math.inf
    factor = torch.rand(p, generator=_gen(22), dtype=F64)
    factor[m:] = math.nan
    got = BOOKKEEPING_MM(at, b, kept, factor, kept.all())
    assert got.shape == (r, c) and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, _loop(at, b, kept, torch.nan_to_num(factor)), rtol=1e-12, atol=1e-12)
    # The same rows excluded in a pattern that is not a prefix take the select path: same sum.
    perm = torch.tensor([4, 0, 3, 1, 2]) if 0 < m < p else torch.arange(p)
    got2 = BOOKKEEPING_MM(at[perm], b[perm], kept[perm], factor[perm], kept.all())
    torch.testing.assert_close(got2, got, rtol=1e-12, atol=1e-12)


def test_bookkeeping_mm_ignores_the_factor_of_an_excluded_example():
    p, k, r, c = 3, 2, 4, 5
    at = torch.randn(p, k, r, generator=_gen(10), dtype=F64)
    b = torch.randn(p, k, c, generator=_gen(11), dtype=F64)
    kept = torch.tensor([True, False, True])
    factor = torch.tensor([0.5, math.nan, 0.25], dtype=F64)
    got = BOOKKEEPING_MM(at, b, kept, factor, kept.all())
    torch.testing.assert_close(got, _loop(at, b, kept, torch.nan_to_num(factor)), rtol=1e-12, atol=1e-12)


def test_bookkeeping_mm_accumulates_low_precision_factors_in_the_factor_dtype():
    p, k, r, c = 4, 3, 5, 6
    at = torch.randn(p, k, r, generator=_gen(7)).to(torch.bfloat16)
    b = torch.randn(p, k, c, generator=_gen(8)).to(torch.bfloat16)
    factor = torch.rand(p, generator=_gen(9))
    for kept in (torch.ones(p, dtype=torch.bool), torch.tensor([True, False, True, True])):
        got = BOOKKEEPING_MM(at, b, kept, factor, kept.all())
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), _loop(at, b, kept, factor), rtol=1e-5, atol=1e-5)


def test_bookkeeping_mm_fake_impl_gives_shape_and_dtype():
    with FakeTensorMode():
        out = BOOKKEEPING_MM(
            torch.empty(4, 2, 3, dtype=torch.bfloat16), torch.empty(4, 2, 5, dtype=torch.bfloat16),
            torch.empty(4, dtype=torch.bool), torch.empty(4, dtype=torch.float32), torch.empty((), dtype=torch.bool),
        )
    assert out.shape == (3, 5) and out.dtype == torch.float32


def test_rewritten_graph_sums_each_linear_term_with_one_bookkeeping_call_and_biases_without_products():
    """One opaque book-keeping call per linear weight (so the backend cannot fuse every
    layer's masked copies into one kernel), and the per-example bias gradients summed by a
    reduction: no matrix product over a masked (P, d) copy."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    step = compile_dp(lambda m, x: m(x).pow(2).sum(), model=model, clipping_norm=0.1,
                      physical_batch_size=4, backend=None)
    step(torch.randn(4, 5, dtype=F64))
    gm = list(step._cache.values())[-1].traced.gm
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(BOOKKEEPING_MM) == 2
    mm = torch.ops.aten.mm.default
    # The forward and backward of two linear layers need at most three products; a fourth
    # (or more) would be a clipped sum written as a product.
    assert targets.count(mm) + targets.count(torch.ops.aten.addmm.default) <= 3
