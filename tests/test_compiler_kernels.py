"""The operators the rewrite passes emit (``compiler/passes/_kernels.py``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from _models import bookkeeping_reference

from opake_compile import compile_dp
from opake_compile.compiler.passes._kernels import BOOKKEEPING_MM, SLICED_GRAM, kept_prefix

_C = torch.tensor(1.0, dtype=torch.float64)  # C_eff: ordinary, so the underflow test never fires here

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("r,c", [(3, 7), (7, 3), (5, 5)], ids=["r<c", "r>c", "r=c"])
@pytest.mark.parametrize("k", [1, 4])
def test_bookkeeping_mm_matches_the_per_example_loop_when_every_example_is_kept(r, c, k):
    p = 6
    at = torch.randn(p, k, r, generator=_gen(1), dtype=F64)
    b = torch.randn(p, k, c, generator=_gen(2), dtype=F64)
    factor = torch.rand(p, generator=_gen(3), dtype=F64)
    kept = torch.ones(p, dtype=torch.bool)
    got = BOOKKEEPING_MM(at, b, kept, factor, kept_prefix(kept), _C)
    assert got.shape == (r, c) and got.dtype == F64
    torch.testing.assert_close(got, bookkeeping_reference(at, b, kept, factor), rtol=1e-12, atol=1e-12)


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
    got = BOOKKEEPING_MM(at, b, kept, factor, kept_prefix(kept), _C)
    assert bool(torch.isfinite(got).all())
    want = bookkeeping_reference(at, b, kept, factor)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # The excluded rows really are ignored: replacing them changes nothing.
    at2, b2 = at.clone(), b.clone()
    at2[1], b2[3] = 1e30, -1e30
    assert torch.equal(BOOKKEEPING_MM(at2, b2, kept, factor, kept_prefix(kept), _C), got)


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
    got = BOOKKEEPING_MM(at, b, kept, factor, kept_prefix(kept), _C)
    assert got.shape == (r, c) and bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, bookkeeping_reference(at, b, kept, torch.nan_to_num(factor)), rtol=1e-12, atol=1e-12)
    # The same rows excluded in a pattern that is not a prefix take the select path: same sum.
    perm = torch.tensor([4, 0, 3, 1, 2]) if 0 < m < p else torch.arange(p)
    got2 = BOOKKEEPING_MM(at[perm], b[perm], kept[perm], factor[perm], kept_prefix(kept[perm]), _C)
    torch.testing.assert_close(got2, got, rtol=1e-12, atol=1e-12)


def test_bookkeeping_mm_ignores_the_factor_of_an_excluded_example():
    p, k, r, c = 3, 2, 4, 5
    at = torch.randn(p, k, r, generator=_gen(10), dtype=F64)
    b = torch.randn(p, k, c, generator=_gen(11), dtype=F64)
    kept = torch.tensor([True, False, True])
    factor = torch.tensor([0.5, math.nan, 0.25], dtype=F64)
    got = BOOKKEEPING_MM(at, b, kept, factor, kept_prefix(kept), _C)
    torch.testing.assert_close(got, bookkeeping_reference(at, b, kept, torch.nan_to_num(factor)), rtol=1e-12, atol=1e-12)


def test_bookkeeping_mm_forms_low_precision_factors_exactly_and_accumulates_in_float64():
    # bfloat16 and float32 factors with a float32 clip factor: scaled and multiplied exactly in
    # float64, summed in float64 (the released sum's dtype).
    p, k, r, c = 4, 3, 5, 6
    for dtype in (torch.bfloat16, torch.float32):
        at = torch.randn(p, k, r, generator=_gen(7)).to(dtype)
        b = torch.randn(p, k, c, generator=_gen(8)).to(dtype)
        factor = torch.rand(p, generator=_gen(9))
        for kept in (torch.ones(p, dtype=torch.bool), torch.tensor([True, False, True, True])):
            got = BOOKKEEPING_MM(at, b, kept, factor, kept_prefix(kept), _C)
            assert got.dtype == torch.float64
            torch.testing.assert_close(got, bookkeeping_reference(at, b, kept, factor), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bookkeeping_mm_products_with_huge_partners_are_exact_or_refused(dtype):
    # f times small entries of one operand rounds in the subnormal range; their huge partners
    # would carry that into the sum. Float32: formed exactly in float64 (the result equals the
    # per-example loop). Float64: the factor moves to the larger operand, and where both are
    # beyond reach (2^950 each) the operator refuses, naming itself.
    from opake_compile.exceptions import UnsupportedOperationError

    clip = torch.tensor(2.0**-100, dtype=F64)
    at, b = torch.zeros(2, 3, 1, dtype=dtype), torch.zeros(2, 3, 1, dtype=dtype)
    if dtype == torch.float32:
        # f s = 1.5 2^-149 rounds to 2 2^-149, f 2 s = 3 2^-149 is exact: the two huge
        # partners no longer cancel (32 C when the products are formed in float32).
        at[0, :, 0] = torch.tensor([2.0**12, 1.5 * 2.0**-41, -3.0 * 2.0**-41])
        b[0, :, 0] = torch.tensor([2.0**-4, 2.0**55, 2.0**54])
        factor = torch.tensor([2.0**-108, 0.0])
        kept = torch.tensor([True, False])
        got = BOOKKEEPING_MM(at, b, kept, factor, kept_prefix(kept), clip)
        assert float((got.double() - bookkeeping_reference(at, b, kept, factor)).abs().max()) <= 2.0**-20 * float(clip)
        return
    at[0, :, 0] = torch.tensor([0.0, 2.0**950, 1.0], dtype=dtype)
    b[0, :, 0] = torch.tensor([2.0**950, 0.0, 1.0], dtype=dtype)
    factor, kept = torch.tensor([0.5, 0.0], dtype=dtype), torch.tensor([True, False])
    with pytest.raises(UnsupportedOperationError, match="bookkeeping_mm"):
        BOOKKEEPING_MM(at, b, kept, factor, kept_prefix(kept), clip)


@pytest.mark.parametrize("kept, want", [
    ([True, True, True], 3), ([True, True, False], 2), ([False, False, False], 0),
    ([True, False, True], -1), ([False, True, True], -1),
])
def test_kept_prefix_counts_leading_kept_rows_only_when_they_are_all(kept, want):
    # The operator slices the rows past m off only when kept is exactly a prefix of m rows;
    # any other pattern (-1) takes the selects, so an excluded row never enters the product.
    from opake_compile.compiler.passes import _kernels

    got = _kernels.kept_prefix(torch.tensor(kept))
    assert got.dtype == torch.int64 and got.dim() == 0 and int(got) == want
    assert _kernels._kept_prefix(got) == (None if want < 0 else want)


@pytest.mark.parametrize("n, size", [(300, 100), (301, 101), (400, 64), (129, 65), (64, 128), (1300, 100), (2000, 64)])
def test_sliced_gram_adds_slice_products_in_float32_groups_then_float64_in_order(n, size):
    # The order the rounding bound of _gram_entry_gamma assumes: a float32 product per slice
    # of `size` terms, the products of each group of GRAM_GROUP slices added left to right in
    # float32, each group's sum cast and added left to right in float64. Equal bit for bit, on
    # non-contiguous views as the panels pass them. Slices 0, 1, 2 (mod 3) are scaled by 2^45,
    # 1 and -2^45 and slice 2 nearly mirrors slice 0, so their products cancel to ~2^25 while
    # slice 1's are ~1: another grouping (all in float64, all in float32, groups of another
    # size), another order, or slices of another length than `size` (400 terms: 64, not
    # _gram_slice's 100) rounds slice 1's contribution differently. 1300 and 2000 terms make
    # two and four groups, the last one short.
    from opake_compile.compiler.passes._kernels import GRAM_GROUP

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(3, n, 7, generator=g), torch.randn(3, 10, n, generator=g).transpose(1, 2)
    mirror = max(0, min(size, n - 2 * size))
    x[:, 2 * size : 2 * size + mirror] = x[:, :mirror] * (1 + 2.0**-20 * torch.randn(3, mirror, 7, generator=g))
    y[:, 2 * size : 2 * size + mirror] = y[:, :mirror]
    scale = torch.tensor([2.0**45, 1.0, -(2.0**45)])[(torch.arange(n) // size) % 3]
    x, y = (x * scale.view(1, n, 1)).transpose(1, 2), y[:, :, 1:]
    parts = [torch.bmm(x[:, :, s : s + size], y[:, s : s + size]) for s in range(0, n, size)]
    want = None
    for j in range(0, len(parts), GRAM_GROUP):
        group = parts[j]
        for part in parts[j + 1 : j + GRAM_GROUP]:
            group = group + part  # float32
        want = group.double() if want is None else want + group.double()
    got = SLICED_GRAM(x, y, size)
    assert got.dtype == torch.float64 and got.shape == (3, 7, 9)
    assert torch.equal(got, want)
    if len(parts) > 1:  # the float64-per-slice order it replaced rounds differently here
        old = sum((p.double() for p in parts[1:]), parts[0].double())
        assert not torch.equal(got, old)
    with FakeTensorMode():
        fake = SLICED_GRAM(torch.empty(3, 7, n), torch.empty(3, n, 9), size)
    assert fake.shape == (3, 7, 9) and fake.dtype == torch.float64


@pytest.mark.parametrize("n, size", [(300, 128), (1000, 125), (2000, 122)])
def test_sliced_gram_refuses_slices_whose_groups_round_past_the_bound(n, size):
    # A group of 8 slices of m terms rounds like m + 7 terms; the norms' bound counts at most
    # GRAM_CHUNK = 128. 300 terms in slices of 128 (3 slices: 130), 1000 in 125 (8: 132),
    # 2000 in 122 (17 slices, groups of 8: 129) are refused; 2000 in 121 is not.
    from opake_compile.exceptions import UnsupportedOperationError

    x, y = torch.randn(2, 3, n), torch.randn(2, n, 4)
    with pytest.raises(UnsupportedOperationError, match="sliced_gram"):
        SLICED_GRAM(x, y, size)
    assert SLICED_GRAM(x, y, size - 1 if n == 2000 else n).shape == (2, 3, 4)


@pytest.mark.parametrize("n", [129, 1000, 3072, 8192, 20000])
def test_sliced_gram_is_within_the_gram_entry_bound_on_same_signed_terms(n):
    # Positive terms of mixed sizes (no cancellation, so the bound relative to sum |x| |y|
    # is tight-ish): the error against the float64 product stays within _gram_entry_gamma(n).
    from opake_compile.compiler.passes import _factors

    g = torch.Generator().manual_seed(n)
    x = torch.rand(2, 5, n, generator=g) * torch.exp2(torch.randint(-8, 8, (1, 1, n), generator=g).float())
    y = torch.rand(2, n, 6, generator=g)
    size = _factors._gram_slice(n) if n > _factors.GRAM_CHUNK else n
    got = SLICED_GRAM(x, y, size)
    exact = torch.bmm(x.double(), y.double())
    mass = torch.bmm(x.double().abs(), y.double().abs())
    assert ((got - exact).abs() <= _factors._gram_entry_gamma(n) * mass).all()


def test_bookkeeping_mm_fake_impl_gives_shape_and_dtype():
    with FakeTensorMode():
        out = BOOKKEEPING_MM(
            torch.empty(4, 2, 3, dtype=torch.bfloat16), torch.empty(4, 2, 5, dtype=torch.bfloat16),
            torch.empty(4, dtype=torch.bool), torch.empty(4, dtype=torch.float32), torch.empty((), dtype=torch.int64),
            torch.empty((), dtype=torch.float64),
        )
    assert out.shape == (3, 5) and out.dtype == torch.float64


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


@pytest.mark.parametrize("c, k, r_s, c_p, floor_log2", [
    (1e-6, 512, 768, 50257, 78),  # GPT-2's tied head at T = 512, float32 sums
    (1e-6, 4096, 4096, 4096, 70),  # a wide Llama-style block at T = 4096
])
def test_underflow_threshold_leaves_ordinary_training_alone(c, k, r_s, c_p, floor_log2):
    # The underflow test catches an example only when its partners could carry 2^-30 C of
    # subnormal rounding: at ordinary C and large shapes that needs entries beyond ~2^70, so
    # no real example takes the exact path (CPU) or is dropped (accelerator, fused).
    from opake_compile.compiler.passes import _kernels

    partner = torch.empty(2, k, c_p, device="meta")
    per_clip = _kernels._per_clip(partner, r_s, torch.float32)
    assert math.log2(per_clip * c) >= floor_log2
    # Float64 sums: far beyond any finite float32 activation.
    assert math.log2(_kernels._per_clip(partner, r_s, torch.float64) * c) > 800
    # And the host test agrees with the threshold on either side of it.
    small = torch.zeros(1, 3, 2)
    f3 = torch.full((1, 1, 1), 0.5)
    clip = torch.tensor(2.0**-100, dtype=F64)
    thr = float(clip) * _kernels._per_clip(small, 2, torch.float32)
    small[0, 1, 0] = thr * 0.99
    assert _kernels._caught_on_host(small, 2, f3, clip, torch.float32) is None
    small[0, 1, 0] = -thr * 1.01
    assert _kernels._caught_on_host(small, 2, f3, clip, torch.float32).tolist() == [True]
    assert _kernels._caught_on_host(small, 2, torch.ones(1, 1, 1), clip, torch.float32) is None


@pytest.mark.parametrize("prefix", [True, False], ids=["kept-prefix", "selects"])
def test_removing_one_example_changes_a_float32_bookkeeping_sum_by_its_own_product(prefix):
    # Identical near-cancelling examples made a float32 product's rounding systematic, and one
    # example the underflow test caught (a huge partner, a scaled entry in the subnormal range)
    # changed every other example's rounding when it went (1.019 C: a hostile review). Float32
    # factors are now scaled and multiplied exactly in float64 and summed there: the others'
    # products are exact, and removing any example changes the sum by its own product.
    from opake_compile.compiler.passes import _kernels

    m = 1000
    at = torch.tensor([[[1.0], [1 + 2.0**-22]]]).repeat(m + 2, 1, 1)
    b = torch.tensor([[[1.0], [-1.0]]]).repeat(m + 2, 1, 1)
    f = torch.full((m + 2,), 1 / 3)
    clip = torch.tensor(1.0, dtype=F64)
    b[m] = torch.tensor([[4 * float(clip) * _kernels._per_clip(b[:1], 1, torch.float32)], [0.0]])
    at[m], f[m] = torch.tensor([[2.0**-140], [0.0]]), 0.5  # a huge partner, f < 1
    kept = torch.ones(m + 2, dtype=torch.bool)
    if prefix:
        at, b, f, kept = at[: m + 1], b[: m + 1], f[: m + 1], kept[: m + 1]
    else:
        at[m + 1], kept[m + 1] = float("nan"), False  # an excluded row after it: the selects run
    others = torch.ones_like(kept)
    others[m] = False

    def bk(keep):
        return float(_kernels.bookkeeping_mm(at, b, keep, torch.where(keep, f, 0), _kernels.kept_prefix(keep), clip))

    with_it, without = bk(kept), bk(kept & others)
    own = float(f[m].double() * at[m, 0, 0].double() * b[m, 0, 0].double())
    rest_exact = float(sum(f[i].double() * (at[i, :, 0].double() @ b[i, :, 0].double()) for i in range(m)))
    assert abs(without - rest_exact) <= 2.0**-50 * abs(rest_exact)
    assert abs(with_it - without - own) <= 2.0**-50 * (abs(with_it) + own)


def test_a_cpu_step_of_a_float32_model_never_reads_an_operand_on_the_host(monkeypatch):
    # Float32 factors are scaled exactly in float64 (no subnormal rounding to catch), so the
    # operator runs no host-side underflow test: no partner bound in the graph, no aminmax
    # over an operand (it cost 3-4 % of the MLP and encoder benches' steps).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    step = compile_dp(lambda m, x: m(x).pow(2).sum(), model=model, clipping_norm=0.1, backend="aot_eager")
    x = torch.randn(5, 6)
    want = step(x).clipped.grads
    gm = list(step._cache.values())[-1].traced.gm
    calls = [n for n in gm.graph.nodes if n.target is BOOKKEEPING_MM]
    assert len(calls) == 2 and all(len(n.args) == 6 for n in calls)

    def refuse(*args, **kwargs):
        raise AssertionError("the operand was read on the host")

    monkeypatch.setattr(torch, "aminmax", refuse)
    got = step(x).clipped.grads
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == torch.float64 for k in want)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("prefix", [True, False], ids=["kept_prefix", "selected"])
def test_bookkeeping_mm_accumulates_in_chains_of_at_most_max_float64_chain_rows(monkeypatch, dtype, prefix):
    # numerics point 3: the worst case of one float64 accumulation grows with its rows, so
    # products over more than MAX_FLOAT64_CHAIN (example, position) rows are cut into chains
    # (here 64 rows, 8 examples of 40 positions) whose results are added.
    from opake_compile.compiler.passes import numerics

    monkeypatch.setattr(numerics, "MAX_FLOAT64_CHAIN", 64)
    lengths = []
    real_mm = torch.mm

    def spy(x, y, **kw):
        if x.dtype == F64:
            lengths.append(x.shape[1])
        return real_mm(x, y, **kw)

    monkeypatch.setattr(torch, "mm", spy)
    p, k, r, c = 8, 40, 3, 5
    at = torch.randn(p, k, r, generator=_gen(7), dtype=dtype)
    b = torch.randn(p, k, c, generator=_gen(8), dtype=dtype)
    factor = torch.rand(p, generator=_gen(9), dtype=dtype)
    kept = torch.ones(p, dtype=torch.bool)
    if not prefix:
        kept[2] = False
    got = BOOKKEEPING_MM(at, b, kept, factor, kept_prefix(kept), _C)
    torch.testing.assert_close(got, bookkeeping_reference(at, b, kept, factor), rtol=1e-12, atol=1e-12)
    assert lengths and max(lengths) <= 64 and sum(lengths) == p * k  # (excluded rows are zeroed, not dropped)


def test_gram_gammas_take_the_largest_bound_not_the_bound_of_the_widest():
    # _gram_entry_gamma is not monotone: 128 terms are one product (gamma_128), 129 are two
    # slices of 65 (gamma_66). Terms of different widths must get the larger of their bounds.
    from types import SimpleNamespace

    from opake_compile.compiler.passes import _factors

    assert _factors._gram_entry_gamma(128) > _factors._gram_entry_gamma(129)
    terms = [SimpleNamespace(rows=128, cols=129, onehot=False), SimpleNamespace(rows=129, cols=128, onehot=False)]
    g_r, g_c = _factors._gram_gammas(terms)
    assert g_r == g_c == _factors._gram_entry_gamma(128)
