"""The algebra shared by the ghost-norm / book-keeping rewrites.

Every rule describes one contribution to a parameter's per-example gradient as a product of
two per-example factors, in the orientation of the gradient viewed as an (R, C) matrix::

    term_i = A_i @ B_i,     A_i: (R, K) and B_i: (K, C)

where ``A`` is either *dense*, a ``(P, R, K)`` node (the output gradients of a linear layer,
say), or *one-hot*, given by integer ids ``(P, K)`` with ``A_i[r, k] = [ids_i[k] == r]``
(an embedding lookup). A parameter's gradient is the sum of its terms (a weight used twice,
tied embeddings), so ``G_i = [A_i^1 | A_i^2 | ...] @ [B_i^1; B_i^2; ...]``.

Ghost norm (Li et al. 2022, "Large Language Models Can Be Strong Differentially Private
Learners"; Goodfellow 2015 for K = 1)::

    ||G_i||_F^2 = sum_{j,k} < A_i^j^T A_i^k , B_i^j B_i^k^T >      (K_j x K_k Gram matrices)

Book-keeping clipped sum (Bu et al. 2023, "Differentially Private Optimization on Large Model
at Small Cost")::

    sum_i f_i G_i = sum_j (f * A^j) concatenated over (example, k)  @  B^j concatenated

one matrix product per term, never materialising a per-example ``R x C`` gradient: a call of
``opake::bookkeeping_mm`` (:mod:`._kernels`) per dense term, an ``embedding_dense_backward``
per one-hot term. (On the CPU, dense terms over many positions are summed one example at a
time by ``opake::per_example_mm``: float32 products inside an example, float64 across
examples, :func:`per_example_sum_ok`.) Rows of excluded examples (padding, non-finite) are
removed from *both* factors with a select before any product, so a NaN in an excluded example
cannot reach the sum (0 * NaN = NaN).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable

import torch
import torch.fx as fx

from opake_compile.compiler._graph_utils import Emitter, shape, val
from opake_compile.compiler.passes import _kernels
from opake_compile.compiler.passes._kernels import (
    BOOKKEEPING_MM,
    GRAM_CHUNK,
    GRAM_GROUP,
    PER_EXAMPLE_MM,
    SLICED_GRAM,
    group_terms,
    underflow_unsafe,
)
from opake_compile.compiler.passes.numerics import (
    FLOAT32_TINY,
    FLOAT64_TINY,
    KAPPA,
    NORM_DTYPE,
    emit_magnitude,
    emit_sq_sum,
    emit_sum_sq_bound,
    gamma,
    magnitude_limit,
    product_limit,
    unit_roundoff,
)

aten = torch.ops.aten

__all__ = [
    "GRAM_COST_FACTOR",
    "Factor",
    "ghost_cost",
    "materialized_cost",
    "materialized_fits",
    "emit_sq_norm",
    "fast_gram_ok",
    "FAST_GRAM_OVERCLIP",
    "mixed_product_dtype",
    "emit_sq_norm_materialized",
    "emit_clipped_sum",
    "per_example_sum_ok",
    "emit_per_example_bound",
    "merge_groups",
    "merge_parts",
    "emit_factor_magnitude",
    "value_key",
    "view_root",
]


@dataclasses.dataclass(frozen=True)
class Factor:
    """One term ``A_i @ B_i`` of a per-example gradient, in (R, C) orientation.

    Attributes:
        rule: the rule that matched (coverage label, e.g. ``"linear"``, ``"embedding"``).
        a: dense ``(P, R, K)`` node, or int ids ``(P, K)`` for a one-hot factor.
        b: dense ``(P, K, C)`` node.
        rows: R.
        onehot: whether ``a`` holds ids.
        padding_idx: for one-hot factors, an id whose rows get no gradient (``None``: none).
        cleanup: nodes of the materialised form the rule accounted for (an in-place zeroing
            of the padding row, say) that the rewrite must erase, or the old per-example
            gradient would stay alive.
        groups: blocks per example (a grouped convolution): ``a`` and ``b`` then hold
            ``P * groups`` blocks, example-major, block ``(i, j)`` giving rows
            ``[j R, (j + 1) R)`` of example i's ``(groups * R, C)`` gradient. Norms are per
            block and added (:func:`merge_groups`); the sum is one product per group.
        input_side: which factor holds the layer's inputs, ``"a"`` or ``"b"`` (``None``: not
            known, or not worth it). Float32 Gram norms centre that side first
            (:func:`_centre`): inputs are where positions share a direction.
    """

    rule: str
    a: fx.Node
    b: fx.Node
    rows: int
    onehot: bool = False
    padding_idx: int | None = None
    cleanup: tuple[fx.Node, ...] = ()
    groups: int = 1
    input_side: str | None = None

    @property
    def k(self) -> int:
        return shape(self.b)[1]

    @property
    def cols(self) -> int:
        return shape(self.b)[2]


def materialized_cost(factors: list[Factor], p: int) -> int:
    """Flops-like cost of forming and reducing the per-example gradients (P x R x C each;
    ``groups`` blocks of R x C for a grouped convolution): ``R C K`` per dense term (a
    product), ``K C`` per one-hot term (a scatter-add of its K rows of B), ``2 R C`` to reduce."""
    r, c = factors[0].rows, factors[0].cols
    dense_k = sum(f.k for f in factors if not f.onehot)
    onehot_k = sum(f.k for f in factors if f.onehot)
    return p * factors[0].groups * (r * c * (dense_k + 2) + onehot_k * c)


def materialized_fits(factors: list[Factor], p: int) -> bool:
    """Whether the per-example gradients ``P x R x C``, formed for the norm only (the mixed
    path), stay within twice the largest factor the graph holds anyway (``P x R x K`` or
    ``P x K x C``): a bound on the transient memory of forming them for one-hot terms, whose
    B alone can be far smaller than ``R x C`` (a 50257-row vocabulary read at 64 positions)."""
    held = max(
        [math.prod(shape(f.b)) for f in factors] + [math.prod(shape(f.a)) for f in factors if not f.onehot]
    )
    return p * factors[0].rows * factors[0].cols <= 2 * held


#: Relative cost of a float64 matrix product to a float32 one (the Gram matrices are float64,
#: :func:`emit_sq_norm`): about 2 on CPUs and on data-centre GPUs without TF32.
GRAM_COST_FACTOR = 2


def ghost_cost(factors: list[Factor], p: int, gram_cost_factor: int = GRAM_COST_FACTOR) -> int:
    """Cost of the Gram-matrix norms: per pair of terms, ``P K_f K_g (R + C)`` for dense left
    factors, ``P K_f K_g (1 + C)`` when a one-hot factor turns its Gram into a gather or a
    comparison, times ``gram_cost_factor`` (:data:`GRAM_COST_FACTOR` for float64 Gram
    matrices, 1 for float32 ones); a term with itself computes only the panels of its
    symmetric Grams (:func:`_panel_share`). (The book-keeping sum costs what the non-private
    weight gradient costs.)"""
    total = 0.0
    for f in factors:
        for g in factors:
            left = 1 if (f.onehot or g.onehot) else f.rows
            share = _panel_share(f.k) if f is g else 1.0
            total += p * f.groups * f.k * g.k * (left + f.cols) * share
    return int(gram_cost_factor * total)


def merge_groups(em: Emitter, sq: fx.Node, mass_sq: fx.Node, groups: int) -> tuple[fx.Node, fx.Node]:
    """Per-block ``(sq, mass_sq)`` of shape ``(P * groups,)`` (example-major) to per-example
    ones of shape ``(P,)``: the blocks are disjoint rows of the gradient, so squared norms
    add, and so do masses (``S_i = sum_j S_ij``).

    Error analysis: each block's ``sq`` is already an upper bound on its exact squared norm
    and each ``S_ij`` on its mass; the float64 sums of ``groups`` non-negative numbers (and
    the square root and square of the masses) err by at most ``gamma_{groups+2}`` relatively,
    which the factor ``1 + 2 gamma`` covers, so the results stay upper bounds."""
    if groups == 1:
        return sq, mass_sq
    p = shape(sq)[0] // groups
    up = 1.0 + 2.0 * gamma(groups + 2, unit_roundoff(NORM_DTYPE))
    sq = em(aten.mul.Tensor, em(aten.sum.dim_IntList, em(aten.view.default, sq, [p, groups]), [1]), up)
    s = em(aten.sum.dim_IntList, em(aten.view.default, em(aten.sqrt.default, mass_sq), [p, groups]), [1])
    s = em(aten.mul.Tensor, s, up)
    return sq, em(aten.mul.Tensor, s, s)


def _as_dtype(em: Emitter, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    return node if val(node).dtype == dtype else em(aten._to_copy.default, node, dtype=dtype)


def _b_of(em: Emitter, f: Factor, acc: torch.dtype) -> fx.Node:
    """B with the rows of a one-hot factor's padding id zeroed (they get no gradient)."""
    b = _as_dtype(em, f.b, acc)
    if f.onehot and f.padding_idx is not None:
        p, k, _ = shape(f.b)
        is_pad = em(aten.eq.Scalar, f.a, f.padding_idx)
        zero = em(aten.scalar_tensor.default, 0.0, dtype=acc)
        b = em(aten.where.self, em(aten.view.default, is_pad, [p, k, 1]), zero, b)
    return b


def _gram_a(em: Emitter, f: Factor, g: Factor, acc: torch.dtype) -> fx.Node:
    """``A_f^T A_g`` per example: (P, K_f, K_g)."""
    p = shape(f.b)[0]
    if f.onehot and g.onehot:
        eq = em(aten.eq.Tensor, em(aten.unsqueeze.default, f.a, 2), em(aten.unsqueeze.default, g.a, 1))
        return em(aten._to_copy.default, eq, dtype=acc)
    if f.onehot or g.onehot:
        one, dense = (f, g) if f.onehot else (g, f)
        # (A_one^T A_dense)[k, l] = A_dense[ids[k], l]: gather the rows the ids pick.
        # Gathered first and cast after (a gather is exact): the cast touches K x K entries,
        # not the R x K of the dense factor (R can be a 50k vocabulary).
        idx = em(aten.expand.default, em(aten.unsqueeze.default, one.a, 2), [p, one.k, dense.k])
        picked = _as_dtype(em, em(aten.gather.default, dense.a, 1, idx), acc)
        return picked if f.onehot else em(aten.transpose.int, picked, 1, 2)
    fa = _as_dtype(em, f.a, acc)
    ga = fa if g.a is f.a else _as_dtype(em, g.a, acc)  # one cast of A for its own Gram
    return _gram(em, em(aten.transpose.int, fa, 1, 2), ga, acc)


# GRAM_CHUNK (imported from _kernels, whose sliced_gram enforces it) is the longest contraction
# one float32 Gram product runs over: a longer one (an LM head's vocabulary, a wide MLP) is split
# into slices whose products are added in float32 in groups and the groups in float64
# (``opake::sliced_gram``), the slices short enough that each entry's rounding bound is that of
# at most GRAM_CHUNK terms (:func:`_gram_entry_gamma`).


#: A float32 Gram product with at most this many rows or columns (a centred term against the
#: rank-one term of its mean, :func:`_centre`) is a matrix-vector product, bound by memory.
THIN = 2


def _gram(em: Emitter, x: fx.Node, y: fx.Node, acc: torch.dtype) -> fx.Node:
    """``bmm(x, y)`` for ``x`` (P, K1, n) and ``y`` (P, n, K2). In float32 with n above
    :data:`GRAM_CHUNK`: one product per slice of the n terms (:func:`_gram_slice`), added in
    float32 in groups of ``GRAM_GROUP`` slices, each group's sum cast to float64 (exact) and
    added there (``opake::sliced_gram``, two slices' products alive at a time); the result is
    then float64. (Stacking the slices into one
    batched product instead needs a copy of the factor and measured slower.) A thin
    float32 product (K1 or K2 at most :data:`THIN`) is one float64 reduction instead: products
    of float32 numbers are exact there and the sum errs by ``gamma_n(u_64)``, inside the
    float32 bound the callers assume (:func:`_gram_entry_gamma`); one pass over the larger
    factor, no slices."""
    n, k1, k2 = shape(x)[2], shape(x)[1], shape(y)[2]
    if acc == torch.float32 and min(k1, k2) <= THIN:
        # One reduction per column (row) of the thin side, each over the wide side in its
        # own layout: the backend vectorises along K there (one broadcast reduction into a
        # (P, K, 2) result did not vectorise and cost 9 ms per layer at K = 256, width 768).
        x64, y64 = _as_dtype(em, x, NORM_DTYPE), _as_dtype(em, y, NORM_DTYPE)
        if k2 <= THIN:  # columns of y, each (P, 1, n) against x: (P, K1)
            cols = [em(aten.unsqueeze.default, em(aten.select.int, y64, 2, j), 1) for j in range(k2)]
            return em(aten.stack.default, [em(aten.sum.dim_IntList, em(aten.mul.Tensor, x64, c), [2]) for c in cols], 2)
        rows = [em(aten.unsqueeze.default, em(aten.select.int, x64, 1, i), 2) for i in range(k1)]  # (P, n, 1)
        return em(aten.stack.default, [em(aten.sum.dim_IntList, em(aten.mul.Tensor, r, y64), [1]) for r in rows], 1)
    if acc != torch.float32 or n <= GRAM_CHUNK:
        return em(aten.bmm.default, x, y)
    return em(SLICED_GRAM, x, y, _gram_slice(n))


def _gram_a_panels(em: Emitter, f: Factor, acc: torch.dtype) -> list[fx.Node]:
    """``A_f^T A_f`` per example in the panels of :func:`_sym_panels`."""
    if f.onehot:  # a comparison of ids: nothing to save, cut the full matrix
        return _as_panels(em, _gram_a(em, f, f, acc))
    return _sym_panels(em, em(aten.transpose.int, _as_dtype(em, f.a, acc), 1, 2), acc)


def _block_inner(em: Emitter, xs: list[tuple[fx.Node, float]], ys: list[tuple[fx.Node, float]]) -> fx.Node:
    """``<X, Y>`` per example, (P,), for two matrices given as the same weighted blocks
    (:func:`_panel_blocks`, or one block of weight 1): ``sum_j weight_j * sum(X_j * Y_j)``."""
    return _weighted_sum(em, [
        (em(aten.sum.dim_IntList, em(aten.mul.Tensor, x, y), [1, 2]), w) for (x, w), (y, _) in zip(xs, ys)
    ])


#: Symmetric Gram matrices (a term's own ``A^T A`` and ``B B^T``) are formed as horizontal
#: panels of about this many rows, each from its diagonal block to the last column: the
#: upper triangle of blocks, ``(b + 1) / (2 b)`` of the full product for b panels (3/4 at
#: K = 256, 5/8 at K = 512), the lower triangle being its mirror (:func:`_sym_panels`).
#: Narrower panels (64 rows) measured no faster on GPT-2 width at T = 256 and compiled slower.
GRAM_PANEL = 128


def _panel_rows(k: int) -> list[tuple[int, int]]:
    """Row ranges ``(start, stop)`` of the panels of a symmetric K x K Gram matrix: as even
    as possible, at most :data:`GRAM_PANEL` rows each (ViT-B/16's K = 197: two panels of 99
    and 98 rows, 1.178x against 1.216x for the full product, paired)."""
    if k <= GRAM_PANEL:
        return [(0, k)]
    size = -(-k // -(-k // GRAM_PANEL))
    return [(start, min(k, start + size)) for start in range(0, k, size)]


def _panel_share(k: int) -> float:
    """The share of a symmetric K x K Gram matrix's entries that its panels compute."""
    return sum((stop - start) * (k - start) for start, stop in _panel_rows(k)) / (k * k)


def _sym_panels(em: Emitter, x: fx.Node, acc: torch.dtype) -> list[fx.Node]:
    """The panels of ``x x^T`` for ``x`` (P, K, n): panel ``[start, stop)`` is rows
    ``start:stop`` and columns ``start:K`` of the Gram matrix, (P, stop - start, K - start),
    formed by :func:`_gram` (so its entries carry the same rounding bound as the full
    product's). The entries left out are the mirror images of computed ones."""
    k = shape(x)[1]
    xt = em(aten.transpose.int, x, 1, 2)
    return [
        _gram(em, em(aten.slice.Tensor, x, 1, start, stop), em(aten.slice.Tensor, xt, 2, start, k), acc)
        for start, stop in _panel_rows(k)
    ]


def _as_panels(em: Emitter, g: fx.Node) -> list[fx.Node]:
    """A full symmetric (P, K, K) Gram matrix cut into the panels of :func:`_sym_panels`
    (views), to pair it with panels."""
    k = shape(g)[1]
    return [em(aten.slice.Tensor, em(aten.slice.Tensor, g, 1, start, stop), 2, start, k) for start, stop in _panel_rows(k)]


def _panel_blocks(em: Emitter, panels: list[fx.Node]) -> list[tuple[fx.Node, float]]:
    """Each panel as its diagonal block (weight 1) and the block right of it (weight 2: it
    stands for itself and its mirror below the diagonal), so that ``sum_blocks weight *
    sum(block entries)`` is a sum over every entry of the symmetric matrix once."""
    out = []
    for panel in panels:
        w, width = shape(panel)[1], shape(panel)[2]
        out.append((em(aten.slice.Tensor, panel, 2, 0, w), 1.0))
        if width > w:
            out.append((em(aten.slice.Tensor, panel, 2, w, width), 2.0))
    return out


def _weighted_sum(em: Emitter, parts: list[tuple[fx.Node, float]]) -> fx.Node:
    """``sum_j weight_j * part_j`` for (P,) parts (weights 1 or 2: exact)."""
    total = None
    for node, weight in parts:
        node = node if weight == 1.0 else em(aten.mul.Tensor, node, weight)
        total = node if total is None else em(aten.add.Tensor, total, node)
    return total


def _gram_entry_gamma(n: int) -> float:
    """The rounding bound of one float32 Gram entry over n terms, relative to
    ``sum_i |x_i| |y_i|``: ``gamma_n`` for one product; over slices of m terms (:func:`_gram`,
    ``opake::sliced_gram``) added in float32 in groups of at most G slices, ``gamma_{m + G - 1}``
    for each group (a blocked sum, Higham 2002, Lemma 3.3: each slice's ``gamma_m``, then
    G - 1 float32 additions; the unit roundoff of a product, which TF32 may raise, is at
    least that of an addition), which :func:`_gram_slice` keeps within ``gamma_128``; plus
    the float64 sum of the groups' values, which are at most ``(1 + gamma_{m + G - 1})``
    times their share."""
    u = unit_roundoff(torch.float32, matmul=True)
    if n <= GRAM_CHUNK:
        return gamma(n, u)
    size = _gram_slice(n)
    g = gamma(group_terms(n, size), u)
    groups = -(-n // (size * GRAM_GROUP))  # (groups of GRAM_GROUP slices of size terms)
    return g + gamma(groups, unit_roundoff(NORM_DTYPE)) * (1.0 + g)


def _gram_slice(n: int) -> int:
    """The slice length :func:`_gram` cuts a contraction of n > GRAM_CHUNK terms into (the
    bound and the product read it from here): as even as possible, and short enough that a
    group's float32 sum (``opake::sliced_gram``: the slice's terms and at most GRAM_GROUP - 1
    additions of slice products) is a sum of at most GRAM_CHUNK terms in the bound, as one
    product of GRAM_CHUNK terms was: 768 terms in 7 slices of 110, 3072 in 26 of 119."""
    slices = -(-n // GRAM_CHUNK)
    while group_terms(n, -(-n // slices)) > GRAM_CHUNK:
        slices += 1
    return -(-n // slices)


#: View ops: two chains of them with the same arguments over the same node alias the same
#: memory, so they read the same values whenever they are read. Copies (``clone``,
#: ``_to_copy``) are deliberately absent: two copies of one source taken before and after an
#: in-place update hold different values, yet would get the same key.
_PURE_VIEWS = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default,
    aten.transpose.int, aten.permute.default, aten.t.default, aten.alias.default,
    aten.slice.Tensor, aten.select.int,
})


def _freeze(x: object) -> object:
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    return x


def value_key(node: fx.Node) -> object:
    """A hashable key equal for nodes that alias the same tensor through chains of view ops
    (:data:`_PURE_VIEWS`) from the same source (each ``nn.Linear`` reading ``x`` gets its own chain of views
    in the vmapped graph)."""
    if node.op == "call_function" and node.target in _PURE_VIEWS and isinstance(node.args[0], fx.Node):
        rest = tuple(a for a in node.args[1:] if not isinstance(a, fx.Node))
        if len(rest) == len(node.args) - 1:
            return (node.target, value_key(node.args[0]), _freeze(rest), _freeze(dict(node.kwargs)))
    return node


def view_root(node: fx.Node) -> fx.Node:
    """The node ``node`` is a chain of view ops (:data:`_PURE_VIEWS`) of."""
    while node.op == "call_function" and node.target in _PURE_VIEWS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _memo(cache: dict, key: tuple, make: Callable[[], object]) -> object:
    """``cache[key]``, made by ``make()`` the first time: the nodes a parameter's norm shares
    with later parameters' (Gram matrices, centred inputs, per-position norms of one input).
    Nodes made while rewriting one parameter precede every later parameter's norm, so reusing
    them keeps the graph ordered."""
    if key not in cache:
        cache[key] = make()
    return cache[key]


def _b_key(f: Factor) -> object:
    """What ``_b_of(f)`` depends on: B, and for a one-hot factor with a padding id also the ids
    (they choose the rows that are zeroed): two embeddings summed into one output share B
    but not their ids."""
    if f.onehot and f.padding_idx is not None:
        return (value_key(f.b), value_key(f.a), f.padding_idx)
    return value_key(f.b)


def fast_gram_ok(factors: list[Factor], sum_dtype: torch.dtype) -> bool:
    """Whether float32 Gram matrices are accurate enough here (:func:`emit_sq_norm`).

    Their rounding bound is the smaller of two (:func:`_bound_rounding`). On positions that
    do not line up the Frobenius one inflates a norm by about ``(gamma_R + gamma_C) sqrt(K) /
    2``; where one factor's positions share a direction (anisotropic activations) and the
    other's do not, by up to about ``(gamma_R + gamma_C) K / 2``, which the ``S^2`` one also
    reaches on unaligned positions. Float32 Grams are used when that larger figure is at most
    :data:`FAST_GRAM_OVERCLIP` (0.4 %); longer sequences get float64 ones. The choice depends
    on shapes only: an example's norm bound must depend on that example alone (a choice made
    from one batch's values would change every later example's clip factor, so one example
    could move the others' contributions).

    Output gradients that sum to zero over positions (a separate key projection: softmax is
    shift invariant) against inputs sharing one direction cancel in the exact norm; the
    bound would see the shared direction's ``||G_B||_F`` (1-3 % over at K = 256, width 768)
    but for the centring of the layer inputs (:func:`_emit_centred`), which leaves it out:
    0.02 % at K = 256 and 0.03 % at K = 512 with the shared part 5-20x the rest."""
    if sum_dtype != torch.float32 or any(val(f.b).dtype == torch.float64 for f in factors):
        return False
    if any(not f.onehot and val(f.a).dtype == torch.float64 for f in factors):
        return False  # a float64 factor would be rounded by the cast to float32 Grams
    if all(f.k == 1 and not f.onehot for f in factors):
        return False  # rank one: no Gram matrix, only sums of squares (bounded above)
    g_r, g_c = _gram_gammas(factors)
    k = sum(f.k for f in factors)
    return (g_r + g_c) * k / 2 <= FAST_GRAM_OVERCLIP


#: The largest norm inflation (relative) accepted from float32 Gram matrices' rounding bound on
#: ordinary data (no cancellation), estimated from shapes (:func:`fast_gram_ok`).
FAST_GRAM_OVERCLIP = 4e-3


def emit_sq_norm(
    em: Emitter,
    factors: list[Factor],
    grams: dict | None = None,
    gram_dtype: torch.dtype = NORM_DTYPE,
    *,
    centre: bool = True,
    fast_norms: tuple | None = None,
) -> tuple[fx.Node, fx.Node]:
    """Ghost norm: an upper bound on the per-example squared Frobenius norm of
    ``sum_j A^j B^j`` and the example's mass, both shape (P,) in float64.

    Error analysis (:mod:`.numerics`, point 1). ``gram_dtype=float64``: every Gram entry,
    product and sum is evaluated in float64 from the float32 (or lower) factors, whose products
    are exact there; the result is within ``n u_64 S^2`` of the exact squared norm (n terms in
    the longest chain, ``S = sum over positions of ||a_k|| ||b_k||``, read off the Gram
    diagonals), and that bound is added; float64 factors are rescaled by powers of two first.
    ``gram_dtype=float32`` (where :func:`fast_gram_ok`): float32 Gram matrices reduced in
    float64, plus the smaller of two bounds on their rounding (:func:`_bound_rounding`:
    ``2 (gamma_R + gamma_C) S^2``, or the Frobenius form ``gamma_R ||A||^2 ||B B^T||_F +
    gamma_C ||B||^2 ||A^T A||_F + ...``, about sqrt(K) times smaller when positions do not
    line up) and a bound for float32 underflow (:func:`_bound_underflow`), with S and the
    Frobenius norms from bounded per-position norms. Rank-one terms use sums of squares
    bounded above (``emit_sum_sq_bound``). Terms whose input side is known are centred first
    where that pays (:data:`CENTRE_ABOVE`, :func:`_emit_centred`), so that a direction their
    positions share does not enter the rounding bound (``centre=False``: the centred system
    itself, whose position norms the caller passes as ``fast_norms``).

    Returns:
        ``(sq, mass_sq)``: the bounded squared norm and ``S^2``.

    ``grams``: a cache shared by the parameters of one graph. Layers that read the same input
    (q/k/v or gate/up projections, LoRA adapters next to each other) have the same right
    factor, so its Gram matrix ``B B^T`` is formed once. Nodes cached while rewriting one
    parameter precede every later parameter's norm, so reusing them keeps the graph ordered.
    """
    grams = {} if grams is None else grams
    fast = gram_dtype != NORM_DTYPE
    if fast and centre and any(_centres(f) for f in factors) and _centring_pays(factors):
        return _emit_centred(em, factors, grams, gram_dtype)
    acc = gram_dtype
    unscale = None
    if not fast and any(val(f.b).dtype == NORM_DTYPE for f in factors):
        # Float64 factors: their products are not exact in float64 and their squares can
        # underflow (an example with |a| ~ 1e-170, |b| ~ 1e170 would get norm 0 and escape
        # clipping). Scale them by exact powers of two first and undo it at the end.
        factors, unscale = _rescale_float64(em, factors, grams)
    if fast and fast_norms is None:
        fast_norms = _position_norms(em, factors, grams)

    bs = [_b_of(em, f, acc) for f in factors]
    total = None
    frob_parts = []  # fast Grams: per pair, gamma_R ||A||^2 ||G_B||_F + gamma_C ||B||^2 ||G_A||_F
    s_parts = []  # per term: sum_k ||a_k|| ||b_k||, from the diagonals of its own Gram matrices
    for j, f in enumerate(factors):
        for k in range(j, len(factors)):
            g = factors[k]
            b_key = (_b_key(f), _b_key(g), acc)
            if f.k == 1 and g.k == 1 and not f.onehot and not g.onehot:
                # Rank one (Goodfellow 2015): <a_f, a_g> <b_f, b_g> with vectors.
                if k == j and val(f.a).dtype != NORM_DTYPE and val(f.b).dtype != NORM_DTYPE:
                    # ||a||^2 ||b||^2: sums of squares, no cancellation. In float32 (a vectorised
                    # reduction; float64 ones cost ~10 % of a small MLP's step) and then bounded
                    # above rigorously: (1 + gamma_n) for the rounding, n 2^-149 for squares that
                    # underflow; one that overflows makes the example non-finite (dropped).
                    pa = _sum_sq_bound_all(em, grams, f.a, f.rows)
                    pb = _sum_sq_bound_all(em, grams, f.b, f.cols)
                else:
                    nd = NORM_DTYPE
                    pa = em(aten.sum.dim_IntList, em(aten.mul.Tensor, _as_dtype(em, f.a, nd), _as_dtype(em, g.a, nd)), [1, 2])
                    pb = _memo(grams, ("dot",) + b_key, lambda: em(aten.sum.dim_IntList, em(aten.mul.Tensor, _as_dtype(em, bs[j], nd), _as_dtype(em, bs[k], nd)), [1, 2]))
                term = em(aten.mul.Tensor, pa, pb)
                if k == j and not fast:
                    s_parts.append(em(aten.sqrt.default, term))
            else:
                # A term with itself (k == j) has symmetric Grams: formed in panels, the upper
                # triangle of blocks only, each block weighted 1 (diagonal) or 2 (it and its
                # mirror), so every entry of the full matrices is counted once.
                sym = k == j and len(_panel_rows(f.k)) > 1

                def blocks(panels: list[fx.Node]) -> list[tuple[fx.Node, float]]:
                    if fast:  # products of two float32 entries are exact in float64: reduce there
                        panels = [_as_dtype(em, x, NORM_DTYPE) for x in panels]
                    return _panel_blocks(em, panels) if sym else [(panels[0], 1.0)]

                ga = blocks(_gram_a_panels(em, f, acc) if sym else [_gram_a(em, f, g, acc)])
                gb = _memo(grams, ("gram", sym) + b_key, lambda: blocks(
                    _sym_panels(em, bs[j], acc) if sym else [_gram(em, bs[j], em(aten.transpose.int, bs[k], 1, 2), acc)]
                ))
                if fast:
                    # Frobenius norms of the computed Grams, for _bound_rounding: squares of
                    # float32 numbers are exact in float64, their sum within gamma_{K^2}(u_64).
                    fro_a = em(aten.sqrt.default, _block_inner(em, ga, ga))
                    fro_b = _memo(grams, ("fro", sym) + b_key, lambda: em(aten.sqrt.default, _block_inner(em, gb, gb)))
                    # A one-hot factor's Gram entries are exact (comparisons, gathers).
                    frob_parts.append((j, k, fro_a, fro_b, f.onehot or g.onehot))
                term = _block_inner(em, ga, gb)
                if k == j and not fast:
                    # diag(A^T A)_k diag(B B^T)_k = ||a_k||^2 ||b_k||^2: sums of squares, no
                    # cancellation, and already computed (in the diagonal blocks, weight 1).
                    for (xa, w), (xb, _) in zip(ga, gb):
                        if w == 1.0:
                            da = em(aten.diagonal.default, xa, 0, 1, 2)
                            db = em(aten.diagonal.default, xb, 0, 1, 2)
                            s_parts.append(em(aten.sum.dim_IntList, em(aten.sqrt.default, em(aten.mul.Tensor, da, db)), [1]))
            if k != j:
                term = em(aten.mul.Tensor, term, 2.0)
            total = term if total is None else em(aten.add.Tensor, total, term)
    if fast:
        # Float32 Gram diagonals can under- or overflow: S from bounded per-position norms.
        s = fast_norms[0]
    else:
        s = s_parts[0]
        for part in s_parts[1:]:
            s = em(aten.add.Tensor, s, part)
    if unscale is not None:
        under_s, under_sq = _underflow64(factors)
        s = em(aten.add.Tensor, s, under_s)
    mass_sq = em(aten.mul.Tensor, s, s)
    if sum(f.k for f in factors) > 1:
        frob = _frobenius_rounding(em, factors, frob_parts, fast_norms) if fast and frob_parts else None
        total = _bound_rounding(factors, total, mass_sq, em, gram_dtype, frob)
    if fast:
        total = _bound_underflow(em, factors, total, fast_norms[1], fast_norms[2])
    if unscale is not None:
        total = unscale(em(aten.add.Tensor, total, under_sq))
        # S back to true units before squaring: a scaled S near 2^-537, squared, loses digits.
        s = unscale(s, power=1)
        mass_sq = em(aten.mul.Tensor, s, s)
    return total, mass_sq


def _underflow64(factors: list[Factor]) -> tuple[float, float]:
    """What float64 underflow can hide in the Gram form of factors scaled by
    :func:`_rescale_float64` (every entry at most 1 in magnitude): ``(to S, to the squared
    norm)``, in scaled units.

    A scaled entry far below its example's largest one can pair with a large partner in the
    other factor (an input of 2^300 at a position whose output gradient is 0 sets the scale,
    a 2^-300 one meets an output gradient of 2^300): its square underflows and the example's
    norm came out 0, unclipped (100 C at C = 0.01). Each product that underflows loses under
    2^-1074, so a Gram entry of A is off by at most ``R 2^-1074`` besides its relative
    rounding, one of B by ``C 2^-1074``, and their entries are at most R and C: the squared
    norm, a sum over K^2 pairs, is off by at most ``K^2 (2 R C 2^-1074 + R C 2^-2148)``, added
    doubled. Each diagonal term ``sqrt(||a_k||^2 ||b_k||^2)`` of S is off by at most
    ``sqrt(R C) (2^-537 + 2^-537 + 2^-1074)``. On ordinary data both are some 2^-1000 of the
    norm; an example whose norm underflowed gets a bound far above it and is clipped."""
    k = sum(f.k for f in factors)
    r = max([f.rows for f in factors if not f.onehot] + [1])
    c = max(f.cols for f in factors)
    return 3.0 * k * math.sqrt(r * c) * 2.0**-537, 6.0 * k * k * r * c * FLOAT64_TINY


#: A parameter's terms are centred before their float32 Gram matrices are formed
#: (:func:`_emit_centred`) where ``(gamma_R + gamma_C) K / 2``, the estimate of
#: :func:`fast_gram_ok`, is at least this. A key projection under a shared input direction
#: five times the rest was over-clipped by about 14 times that estimate uncentred (2.8 % at
#: K = 256, width 768), so this centres where that would pass 1 % (K >= 92 at width 128 and
#: above). Below, centring's extra passes cost more than they save: +4 % of the step of a
#: d = 128, K = 64 encoder (one thread, paired), against about 0.7 % over-clipping of such
#: a key projection there.
CENTRE_ABOVE = 7e-4


def _centring_pays(factors: list[Factor]) -> bool:
    g_r, g_c = _gram_gammas(factors)
    return (g_r + g_c) * sum(f.k for f in factors) / 2 >= CENTRE_ABOVE


def _centres(f: Factor) -> bool:
    return not f.onehot and f.input_side is not None and f.k > 1


def _centre(em: Emitter, f: Factor, acc: torch.dtype, grams: dict) -> tuple[Factor, Factor]:
    """One dense term ``A B`` as a term with its input side centred and a rank-one term, in
    ``acc`` (float32).

    Inputs ``B`` (``f.input_side == "b"``): from ``sigma = fl_64(B^T 1)`` (C,), a float64 sum
    over positions, the mean ``m = fl(sigma / K)`` (any value would do: only the tensors used
    below enter the identity) and ``B' = fl(B - 1 m^T)``, so that exactly ``B = B' + 1 m^T +
    D`` with ``|D| <= u_32 |x|`` entrywise for the exact difference x (a subtraction whose
    result is subnormal is exact): ``||D|| <= 2 u_32 ||B'||``. Then::

        A B = A B' + s m^T + A D,    s = A 1 (R,), computed as fl(fl_64(A 1))

    and the terms returned are ``(A, B')`` (K positions) and ``(s, m^T)`` (one). Inputs ``A``
    are the mirror image: ``A B = A' B + u t^T + D B`` with ``u`` the mean of A's columns and
    ``t = B^T 1``. The errors (``D`` and the rounding of ``s``) are bounded in
    :func:`_emit_centred`. The centred B and its mean depend on B alone and are cached
    (``grams``): q/k/v projections reading one input share them and the Gram matrices
    formed from them.

    Returns:
        ``(centred, low)``: the two terms.
    """
    k = f.k
    if f.input_side == "b":

        def centred_b() -> tuple[fx.Node, fx.Node]:
            b = _as_dtype(em, f.b, acc)
            sigma = em(aten.sum.dim_IntList, _as_dtype(em, b, NORM_DTYPE), [1], True)  # (P, 1, C)
            m = _as_dtype(em, em(aten.div.Tensor, sigma, float(k)), acc)
            return em(aten.sub.Tensor, b, m), m

        b_c, m = _memo(grams, ("centred", _b_key(f), acc), centred_b)
        s = em(aten.sum.dim_IntList, _as_dtype(em, f.a, NORM_DTYPE), [2], True)  # (P, R, 1)
        centred = dataclasses.replace(f, b=b_c, cleanup=())
        low = dataclasses.replace(f, a=_as_dtype(em, s, acc), b=m, cleanup=())
        return centred, low
    a = _as_dtype(em, f.a, acc)
    sigma = em(aten.sum.dim_IntList, _as_dtype(em, a, NORM_DTYPE), [2], True)  # (P, R, 1)
    u = _as_dtype(em, em(aten.div.Tensor, sigma, float(k)), acc)
    if val(f.a).stride(1) == 1:
        # A is the transpose of a (P, K, R) activation (x^T for ``x @ W``): centre in that
        # layout, so that A' is written as x is stored, not transposed on the way.
        x_c = em(aten.sub.Tensor, em(aten.transpose.int, a, 1, 2), em(aten.transpose.int, u, 1, 2))
        a_c = em(aten.transpose.int, x_c, 1, 2)
    else:
        a_c = em(aten.sub.Tensor, a, u)
    t = _memo(grams, ("colsum", _b_key(f), acc), lambda: _as_dtype(  # (P, 1, C)
        em, em(aten.sum.dim_IntList, _as_dtype(em, f.b, NORM_DTYPE), [1], True), acc
    ))
    centred = dataclasses.replace(f, a=a_c, cleanup=())
    low = dataclasses.replace(f, a=u, b=t, cleanup=())
    return centred, low


def _emit_centred(em: Emitter, factors: list[Factor], grams: dict, gram_dtype: torch.dtype) -> tuple[fx.Node, fx.Node]:
    """:func:`emit_sq_norm` with float32 Grams of terms whose input side is centred
    (:func:`_centre`).

    Why: where positions share a direction (anisotropic hidden states: a large common
    component of every input row) the Frobenius rounding bound reads ``||B B^T||_F``, which
    that direction dominates, even when the exact norm does not see it: output gradients that
    sum to zero over positions (a separate key projection; softmax is shift invariant) cancel
    it exactly. Uncentred, such a parameter's norm came out 1-3 % above the exact one at
    K = 256, width 768. Centred, the shared direction is one rank-one term.

    Bound: the centred system ``X = sum_j (A_j B'_j + s_j m_j^T)`` is an ordinary list of
    terms, so :func:`emit_sq_norm` bounds ``||X||^2``; per term centred on B, ``A B - X_j =
    A D + e_s m^T`` with ``e_s = A 1 - s``, so ``||G - X|| <= E = sum_j (2 u_32 ||A|| ||B'||
    + ||e_s|| ||m||)``, where ``||e_s|| <= gamma_K(u_64) sqrt(K) ||A|| + 2 u_32 ||s|| + sqrt(R)
    2^-149`` (the float64 sum, its rounding to float32 with underflow); a term centred on A
    is the mirror image. Every norm here is an upper bound from :func:`_position_norms` or
    ``emit_sum_sq_bound``. The result is ``(sqrt(||X||^2 bound) + E)^2`` (rounded up); on
    ordinary data E is about ``2 u_32 sqrt(K)`` of the norm.

    The mass ``S`` (what enters the book-keeping sum) is that of the original terms.
    """
    acc = gram_dtype
    system, centred = [], []  # centred: (index in factors, index of the centred term in system)
    for j, f in enumerate(factors):
        if _centres(f):
            centred.append((j, len(system)))
            system += list(_centre(em, f, acc, grams))
        else:
            system.append(f)
    norms = _position_norms(em, system, grams)
    sq, _ = emit_sq_norm(em, system, grams, gram_dtype, centre=False, fast_norms=norms)
    _, _, _, per_a, per_b = norms
    mass, _, _, orig_a, orig_b = _position_norms(em, factors, grams)
    eps = 4.0 * unit_roundoff(torch.float32)  # 2 u_32: a rounding to float32, with margin

    def root(x: fx.Node) -> fx.Node:
        return em(aten.sqrt.default, x)

    def prod(*xs: fx.Node | float) -> fx.Node:
        out = xs[0]
        for x in xs[1:]:
            out = em(aten.mul.Tensor, out, x)
        return out

    parts = []
    for j, i in centred:
        f = factors[j]
        # Inputs B: the side kept whole is A (its original norm), the centred one B', the
        # rank-one term is (s = A 1, m); inputs A: the mirror image.
        if f.input_side == "b":
            whole, centred_norm, wide = root(orig_a[j]), root(per_b[i]), f.rows
            n_sum, n_mean = root(per_a[i + 1]), root(per_b[i + 1])
        else:
            whole, centred_norm, wide = root(orig_b[j]), root(per_a[i]), f.cols
            n_sum, n_mean = root(per_b[i + 1]), root(per_a[i + 1])
        g64 = gamma(f.k, unit_roundoff(NORM_DTYPE))
        e_sum = em(aten.add.Tensor, prod(whole, g64 * math.sqrt(f.k)), prod(n_sum, eps))
        e_sum = em(aten.add.Tensor, e_sum, math.sqrt(wide) * 2.0 * FLOAT32_TINY)
        parts.append((em(aten.add.Tensor, prod(whole, centred_norm, eps), prod(e_sum, n_mean)), 1.0))
    err = _weighted_sum(em, parts)
    # A few float64 operations on non-negative numbers: 1 + 2^-40 covers their rounding.
    norm = em(aten.add.Tensor, prod(root(sq), 1.0 + 2.0**-40), prod(err, 1.0 + 2.0**-40))
    return prod(norm, norm, 1.0 + 2.0**-40), em(aten.mul.Tensor, mass, mass)


def _position_norms(
    em: Emitter, factors: list[Factor], cache: dict | None = None
) -> tuple[fx.Node, fx.Node, fx.Node, list[fx.Node], list[fx.Node]]:
    """Upper bounds, in float64, from the factors themselves: ``S = sum_j sum_k ||a_jk||
    ||b_jk||``, the squared Frobenius norms ``||A||^2``, ``||B||^2`` summed over terms, and the
    same per term (two lists in the factors' order), each shape (P,).
    One read of every factor, nothing large written (float32 Gram matrices, whose diagonals
    could underflow, are not trusted for these). The per-position norms of a factor are
    cached (``cache``, the Gram cache of :func:`emit_sq_norm`): q/k/v projections read one
    input, and a centred term keeps one factor of its original term."""
    cache = {} if cache is None else cache

    s = fa = fb = None
    per_a, per_b = [], []
    for f in factors:
        nb = _memo(  # (P, K)
            cache, ("position_b", _b_key(f)), lambda: emit_sum_sq_bound(em, _b_of(em, f, torch.float32), [2], f.cols)
        )
        fb_part = em(aten.sum.dim_IntList, nb, [1])
        if f.onehot:  # unit rows: ||a_k|| = 1, ||A||^2 = K
            part = em(aten.sum.dim_IntList, em(aten.sqrt.default, nb), [1])
            fa_part = em(aten.full_like.default, fb_part, float(f.k))
        else:
            na = _memo(cache, ("position_a", value_key(f.a)), lambda: emit_sum_sq_bound(em, f.a, [1], f.rows))
            part = em(aten.sum.dim_IntList, em(aten.sqrt.default, em(aten.mul.Tensor, na, nb)), [1])
            fa_part = em(aten.sum.dim_IntList, na, [1])
        s = part if s is None else em(aten.add.Tensor, s, part)
        fa = fa_part if fa is None else em(aten.add.Tensor, fa, fa_part)
        fb = fb_part if fb is None else em(aten.add.Tensor, fb, fb_part)
        per_a.append(fa_part)
        per_b.append(fb_part)
    return s, fa, fb, per_a, per_b


def _bound_underflow(em: Emitter, factors: list[Factor], sq: fx.Node, fa: fx.Node, fb: fx.Node) -> fx.Node:
    """Add what float32 underflow can hide in the Gram form: every product that underflows
    loses at most 2^-149, so a Gram entry of B is off by at most ``C 2^-149`` besides its
    relative rounding, and ``sum_kl |<a_k, a_l>| <= K ||A||_F^2``. Hence
    ``|error| <= 2^-149 K (C ||A||^2 + R ||B||^2) + K^2 R C 2^-298``, added (doubled). On
    ordinary data this is ~10^-40 of the norm; on |b| ~ 10^-23 it is what keeps the example
    clipped (fault 2 of the soundness issue, in Gram form)."""
    k = sum(f.k for f in factors)
    r = max([f.rows for f in factors if not f.onehot] + [1])
    c = max(f.cols for f in factors)
    term = em(aten.add.Tensor, em(aten.mul.Tensor, fa, float(c)), em(aten.mul.Tensor, fb, float(r)))
    term = em(aten.add.Tensor, em(aten.mul.Tensor, term, 2.0 * k * FLOAT32_TINY), 2.0 * k * k * r * c * FLOAT32_TINY**2)
    return em(aten.add.Tensor, sq, term)


def _rescale_float64(
    em: Emitter, factors: list[Factor], cache: dict | None = None
) -> tuple[list[Factor], Callable[..., fx.Node]]:
    """Factors scaled per example by exact powers of two (largest entry in [1/4, 1)), and the
    function that maps a squared quantity computed from them back, ``x * 2^(2 (e_a + e_b))``
    (``unscale(x, power=1)``: a norm, ``x * 2^(e_a + e_b)``).

    The squares of the scaled factors cannot overflow; they underflow for entries below
    2^-537 of the largest, which can still pair with large entries of the other factor, so
    the callers add what underflow can hide (:func:`_underflow64`, and the mixed path's own
    ``K sqrt(R C) 2^-1074``) before undoing the scale. Undoing the scale saturates:
    a norm below ~2^-1074 becomes 0 (the example is then far below any admissible C), one
    above ~2^1024 becomes inf (the example is dropped as non-finite and counted). One-hot
    left factors have unit entries and are not scaled: with one, each dense term's left
    scale is moved into its right factor instead."""
    p = shape(factors[0].b)[0]

    def exponent(nodes: list[fx.Node]) -> fx.Node:
        m = None
        for n in nodes:
            a = em(aten.amax.default, em(aten.abs.default, n), list(range(1, len(shape(n)))))
            m = a if m is None else em(aten.maximum.default, m, a)
        # floor(log2 m) + 1, frexp's exponent or one more where log2 rounds up to an integer
        # (the largest entry then lands in [1/4, 1/2)). Not frexp itself: Inductor's C++
        # vectorisation of its int32 exponent in a float64 kernel does not compile (torch 2.13).
        # Zeros give -inf and non-finite maxima inf or NaN: clamped, or left non-finite.
        e = em(aten.add.Tensor, em(aten.floor.default, em(aten.log2.default, m)), 1.0)
        return em(aten.clamp.default, e, -1000.0, 1000.0)

    def scaled(node: fx.Node, e: fx.Node) -> fx.Node:
        s = em(aten.exp2.default, em(aten.neg.default, e))
        return em(aten.mul.Tensor, _as_dtype(em, node, NORM_DTYPE), em(aten.view.default, s, [p, 1, 1]))

    if any(f.onehot for f in factors) and not all(f.onehot for f in factors):
        # A one-hot left factor has unit entries and stays as it is, so a dense term's left
        # factor cannot share a common left scale: each dense term moves its own scale into
        # its right factor, A_j B_j = (A_j 2^-ea_j)(B_j 2^ea_j), and the right factors share
        # one scale e, so that every scaled entry is at most 1 (unscaled, a dense 2^300 left
        # factor broke _underflow64's premise: 100 C). Each right factor is brought to its own
        # largest entry first, then down by 2^(t_j - e) <= 1: nothing overflows, and what
        # underflows is below 2^-1074 (bounded as any other underflow).
        terms = []
        for f in factors:
            ea_j = None if f.onehot else exponent([f.a])
            eb_j = exponent([f.b])
            terms.append((f, ea_j, eb_j, eb_j if ea_j is None else em(aten.add.Tensor, ea_j, eb_j)))
        e1 = terms[0][3]
        for *_, t in terms[1:]:
            e1 = em(aten.maximum.default, e1, t)
        out = [
            dataclasses.replace(
                f, a=f.a if ea_j is None else scaled(f.a, ea_j),
                b=scaled(scaled(f.b, eb_j), em(aten.sub.Tensor, e1, t)),
            )
            for f, ea_j, eb_j, t in terms
        ]
        return out, _unscaler(em, e1)
    if cache is not None and len(factors) == 1:
        # One term: its right factor's scale depends on that factor alone, so layers reading
        # the same input (q/k/v) share the scaled node, and with it their Gram matrix.
        def scaled_b() -> tuple[fx.Node, fx.Node]:
            e = exponent([factors[0].b])
            return e, scaled(factors[0].b, e)

        eb, b_scaled = _memo(cache, ("scaled_b", _b_key(factors[0])), scaled_b)
        b_nodes = [b_scaled]
    else:
        eb = exponent([f.b for f in factors])
        b_nodes = [scaled(f.b, eb) for f in factors]
    ea = None if any(f.onehot for f in factors) else exponent([f.a for f in factors])
    out = [
        dataclasses.replace(f, a=f.a if ea is None else scaled(f.a, ea), b=b)
        for f, b in zip(factors, b_nodes)
    ]
    return out, _unscaler(em, eb if ea is None else em(aten.add.Tensor, ea, eb))


def _unscaler(em: Emitter, e1: fx.Node) -> Callable[..., fx.Node]:
    """``unscale(x, power=2)``: ``x * 2^(power e1)``, ``power`` 2 for squared quantities, 1
    for norms (:func:`_rescale_float64`)."""

    def unscale(x: fx.Node, power: int = 2) -> fx.Node:
        back = em(aten.exp2.default, em(aten.mul.Tensor, e1, float(power)))
        zero = em(aten.scalar_tensor.default, 0.0, dtype=NORM_DTYPE)
        # 0 * inf would be NaN: an exactly zero norm stays zero whatever the scale.
        return em(aten.where.self, em(aten.eq.Scalar, x, 0.0), zero, em(aten.mul.Tensor, x, back))

    return unscale


def _bound_rounding(
    factors: list[Factor],
    sq: fx.Node,
    mass_sq: fx.Node,
    em: Emitter,
    gram_dtype: torch.dtype = NORM_DTYPE,
    frob: fx.Node | None = None,
) -> fx.Node:
    """``sq + 2 n u S^2``: above the exact squared norm whatever the rounding.

    ``sum_{k,l} <a_k, a_l> <b_k, b_l>`` adds terms of both signs bounded by ``S^2``; each
    Gram entry is a dot product of length R (or C) and the final sum has K^2 terms, so the
    computed value is within ``n u S^2`` of the exact one (n = R + C + K^2 + 4, a factor 2
    of margin on top). In float64 that is ~10^-10 S^2: invisible on ordinary examples
    (``sq ~ S^2 / K``), decisive on positions that nearly cancel, where the Gram value alone
    could be far too small and the clip factor too large.

    Float32 Gram matrices (``gram_dtype``) add the rounding of their entries: the smaller of
    ``2 (gamma_R + gamma_C + gamma_R gamma_C) S^2`` and ``frob``
    (:func:`_frobenius_rounding`), both valid bounds, so taking the smaller is too."""
    n = 4 + sum(f.cols + (0 if f.onehot else f.rows) for f in factors) + sum(f.k for f in factors) ** 2
    coef = 2.0 * gamma(n, unit_roundoff(NORM_DTYPE))
    if gram_dtype == NORM_DTYPE:
        return em(aten.add.Tensor, sq, em(aten.mul.Tensor, mass_sq, coef))
    # Float32 Gram entries: each within gamma_R ||a_k|| ||a_l|| (gamma_C for b); their
    # products and the K^2-term sum are float64. n 2^-149 more (underflow proper is bounded
    # separately by _bound_underflow).
    g_r, g_c = _gram_gammas(factors)
    coef += n * FLOAT32_TINY
    slack = em(aten.mul.Tensor, mass_sq, 2.0 * (g_r + g_c + g_r * g_c))
    if frob is not None:
        # minimum, not fmin: a NaN bound makes the example non-finite (dropped), never smaller.
        slack = em(aten.minimum.default, slack, frob)
    return em(aten.add.Tensor, em(aten.add.Tensor, sq, em(aten.mul.Tensor, mass_sq, coef)), slack)


def _gram_gammas(factors: list[Factor]) -> tuple[float, float]:
    """``(gamma_R, gamma_C)``: the rounding bounds of one float32 Gram entry of A (a dot
    product over R) and of B (over C), the largest over the factors. (Not the bound of the
    widest: :func:`_gram_entry_gamma` is not monotone in n, 128 terms in one product bound
    higher than 129 in two slices of 65. The terms of one block share R and C today.)"""
    rows = [f.rows for f in factors if not f.onehot] or [1]
    return max(map(_gram_entry_gamma, rows)), max(_gram_entry_gamma(f.cols) for f in factors)


def _frobenius_rounding(
    em: Emitter, factors: list[Factor], parts: list[tuple[int, int, fx.Node, fx.Node, bool]], norms: tuple
) -> fx.Node:
    """A bound on what rounding the float32 Gram matrices' entries moves the squared norm by,
    through Frobenius norms instead of ``S^2``; shape (P,), float64.

    For the pair of terms (j, k), computed Grams ``G~_A = G_A + E_A`` and ``G~_B = G_B + E_B``
    with ``|E_A[k, l]| <= gamma_R ||a^j_k|| ||a^k_l||`` (any summation order), so ``||E_A||_F <=
    gamma_R ||A^j||_F ||A^k||_F``, and likewise for B. Then ``sum G~_A G~_B - sum G_A G_B =
    sum E_A G~_B + sum G_A E_B``, and Cauchy-Schwarz with ``||G_A||_F <= ||G~_A||_F +
    ||E_A||_F`` gives::

        |error| <= gamma_R ||A^j|| ||A^k|| ||G~_B||_F + gamma_C ||B^j|| ||B^k|| ||G~_A||_F
                   + gamma_R gamma_C ||A^j|| ||A^k|| ||B^j|| ||B^k||

    per pair (counted twice for an off-diagonal pair; no ``gamma_R`` term where a one-hot
    factor makes ``G_A`` exact), with ``3 gamma_R gamma_C (sum_j ||A^j|| ||B^j||)^2`` for the
    last terms of all pairs together (not ``||A||^2 ||B||^2``, which can be far larger: the
    rank-one term of a centred term's mean, :func:`_centre`, can have a large A and a tiny
    B). When
    positions do not line up, ``||G_B||_F ~ ||B||_F^2 / sqrt(K)``, so this is about
    ``(gamma_R + gamma_C) sqrt(K)`` of an ordinary squared norm against ``(gamma_R + gamma_C)
    K`` for the ``S^2`` form; when they do (anisotropic activations), the two are alike. Its
    own float64 evaluation (sums of at most K^2 squares, a few products and square roots) is
    covered by the factor 1.001."""
    _, _, _, per_a, per_b = norms
    g_r, g_c = _gram_gammas(factors)
    mass = _weighted_sum(em, [(em(aten.sqrt.default, em(aten.mul.Tensor, na, nb)), 1.0) for na, nb in zip(per_a, per_b)])
    total = em(aten.mul.Tensor, em(aten.mul.Tensor, mass, mass), 3.0 * g_r * g_c)

    def both(per: list[fx.Node], j: int, k: int) -> fx.Node:  # ||X^j|| ||X^k||
        return per[j] if j == k else em(aten.sqrt.default, em(aten.mul.Tensor, per[j], per[k]))

    for j, k, fro_a, fro_b, a_exact in parts:
        term = em(aten.mul.Tensor, em(aten.mul.Tensor, both(per_b, j, k), fro_a), g_c)
        if not a_exact:
            term = em(aten.add.Tensor, em(aten.mul.Tensor, em(aten.mul.Tensor, both(per_a, j, k), fro_b), g_r), term)
        total = em(aten.add.Tensor, total, term if j == k else em(aten.mul.Tensor, term, 2.0))
    return em(aten.mul.Tensor, total, 1.001)


def mixed_product_dtype(factors: list[Factor], acc: torch.dtype) -> torch.dtype:
    """The dtype of the mixed path's per-example product (:func:`emit_sq_norm_materialized`).

    Its bound adds ``gamma_{K+J} S`` to the norm, a relative over-estimate of about
    ``gamma_{K+J} sqrt(K)`` when positions do not line up (``S / ||G||`` is then about
    ``sqrt(K)``). The sum dtype while that stays within :data:`FAST_GRAM_OVERCLIP`; float64
    beyond it (narrow layers over long sequences: Linear(16, 16) at T = 32768 over-clipped by
    1.5 % with a float32 product), where products of float32 factors neither underflow nor
    round visibly."""
    if acc == NORM_DTYPE:
        return acc
    k_total = sum(f.k for f in factors) + len(factors)
    if gamma(k_total, unit_roundoff(acc, matmul=True)) * math.sqrt(k_total) > FAST_GRAM_OVERCLIP:
        return NORM_DTYPE
    return acc


def emit_sq_norm_materialized(em: Emitter, factors: list[Factor], acc: torch.dtype) -> tuple[fx.Node, fx.Node]:
    """Per-example squared norm by forming ``G_i = sum_j A^j_i B^j_i`` in the sum dtype
    ``acc``: cheaper than the Gram form when K (R + C) > R C, e.g. long sequences (one bmm per
    dense term), and for one-hot terms (embeddings, a tied LM head) whenever K^2 > R (one
    scatter-add of B). Only the norm materialises; the sum stays book-keeping.

    Error analysis (:mod:`.numerics`, point 1): the product is a different evaluation from
    the book-keeping sum, so its norm alone can be below the norm of what the sum adds.
    Each entry of the float32 product is within ``gamma_{K+J} sum_t |a_t| |b_t|`` of the
    exact one (J terms), so ``||G_exact|| <= ||G~|| + gamma_{K+J} S + K sqrt(R C) 2^-149``
    (the last term: products that underflow); that bound is returned, squared.

    Returns:
        ``(sq, mass_sq)`` in float64, shape (P,).
    """
    p = shape(factors[0].b)[0]
    nd = NORM_DTYPE
    unscale = None
    if acc == NORM_DTYPE:
        # Float64 model: exact power-of-two scaling keeps squares in range (_rescale_float64).
        factors, unscale = _rescale_float64(em, factors)
    k_total = sum(f.k for f in factors) + len(factors)
    prod = mixed_product_dtype(factors, acc)
    g = None
    # Dense terms first, one product each; one-hot terms are then added into that product in
    # place (a scatter-add of B's rows into example i's rows, offset by i R): one P x R x C
    # buffer alive, not one per term and their sum (a tied LM head at T = 512, P = 8 and a
    # vocabulary of 8192 held three 201 MB buffers). Each entry is still a float sum of at
    # most K + J products, so the bound below holds whatever the order of its additions.
    for f in sorted(factors, key=lambda f: f.onehot):
        if f.onehot:
            # Rows of a padding id zeroed first, as in the sum. int64 ids: P R can exceed int32.
            b_acc = _b_of(em, f, prod)
            offsets = em(aten.arange.start_step, 0, p * f.rows, f.rows, dtype=torch.int64, device=val(f.a).device)
            ids = em(aten.add.Tensor, _as_dtype(em, f.a, torch.int64), em(aten.view.default, offsets, [p, 1]))
            ids, b_flat = em(aten.reshape.default, ids, [p * f.k]), em(aten.reshape.default, b_acc, [p * f.k, f.cols])
            if g is None:
                # G_i = sum_k e_{ids_k} b_k^T for all examples at once (|a| = 1 per product).
                flat = em(aten.embedding_dense_backward.default, b_flat, ids, p * f.rows, -1, False)
            else:
                flat = em(aten.index_put.default, em(aten.reshape.default, g, [p * f.rows, f.cols]), [ids], b_flat, True)
            g = em(aten.view.default, flat, [p, f.rows, f.cols])
        else:
            term = em(aten.bmm.default, _as_dtype(em, f.a, prod), _as_dtype(em, f.b, prod))
            g = term if g is None else em(aten.add.Tensor, g, term)
    s = None
    for f in factors:
        # Per-position norms, bounded above: ||a_k|| over R (1 for a one-hot column), ||b_k|| over C.
        # A one-hot term's B as G adds it (_b_of: a padding id's rows zeroed, as in the sum):
        # the padding rows' gradients enter no product, and counting them in S inflated the
        # mass cap's S / kappa past the norm (a LayerNorm of the zero padding embedding
        # scales them by ~1/sqrt(eps): examples of norm 0.48 C were released at 0.21 C).
        if acc == NORM_DTYPE:
            # Scaled float64 factors (entries at most 1): a square that underflows loses under
            # 2^-1074, added per term so that S stays an upper bound (as emit_sum_sq_bound does).
            b_nd = _b_of(em, f, nd)
            nb = em(aten.sum.dim_IntList, em(aten.mul.Tensor, b_nd, b_nd), [2])
            nb = em(aten.add.Tensor, nb, f.cols * FLOAT64_TINY)
            if f.onehot:
                part = em(aten.sum.dim_IntList, em(aten.sqrt.default, nb), [1])
            else:
                na = em(aten.sum.dim_IntList, em(aten.mul.Tensor, _as_dtype(em, f.a, nd), _as_dtype(em, f.a, nd)), [1])
                na = em(aten.add.Tensor, na, f.rows * FLOAT64_TINY)
                part = em(aten.sum.dim_IntList, em(aten.sqrt.default, em(aten.mul.Tensor, na, nb)), [1])
        else:
            nb = emit_sum_sq_bound(em, _b_of(em, f, torch.float32), [2], f.cols)
            if f.onehot:
                part = em(aten.sum.dim_IntList, em(aten.sqrt.default, nb), [1])
            else:
                na = emit_sum_sq_bound(em, f.a, [1], f.rows)
                part = em(aten.sum.dim_IntList, em(aten.sqrt.default, em(aten.mul.Tensor, na, nb)), [1])
        s = part if s is None else em(aten.add.Tensor, s, part)
    r, c = factors[0].rows, factors[0].cols
    sq_g = emit_sq_sum(em, em(aten.reshape.default, g, [p, -1]))
    if unscale is not None:
        # Scaled float64 G: its entries' squares may underflow (each loses under 2^-1074).
        sq_g = em(aten.add.Tensor, sq_g, r * c * FLOAT64_TINY)
    norm = em(aten.sqrt.default, sq_g)
    slack = em(aten.mul.Tensor, s, gamma(k_total, unit_roundoff(prod, matmul=True)))
    # Products that underflow (each loses under the dtype's smallest subnormal): in float32
    # products, and in float64 ones of scaled float64 factors (_rescale_float64), where a
    # small entry can meet a large partner.
    tiny = FLOAT32_TINY if prod != torch.float64 else (FLOAT64_TINY if unscale is not None else 0.0)
    if tiny:
        slack = em(aten.add.Tensor, slack, k_total * math.sqrt(r * c) * tiny)
    bound = em(aten.add.Tensor, norm, slack)
    if unscale is not None:
        # Back to true units before squaring (a scaled bound near 2^-537 would lose digits).
        bound, s = unscale(bound, power=1), unscale(s, power=1)
    return em(aten.mul.Tensor, bound, bound), em(aten.mul.Tensor, s, s)


#: The fewest positions per example for which :func:`per_example_sum_ok` forms the
#: book-keeping sum example by example (``opake::per_example_mm``). Measured on this 2-core
#: CPU, one thread, per example against the float64 product over all rows: P = 64, K = 16,
#: 256 x 256: 3.4 against 3.6 ms (even, before the slabs); K = 32: 4.4 against 5.1; K = 64,
#: P = 32, 512 x 128: 3.7 against 6.6; K = 256, P = 8, 8192 x 768 (a tied LM head): 271
#: against 509 (239 for the unsound float32 product). At K = 1 (an MLP) one call per example
#: costs ~10x the product.
PER_EXAMPLE_MIN_K = 32

#: The smallest ``R C`` for which :func:`per_example_sum_ok` loops over examples (a few calls
#: per example, ~20 us of Python each, against a product of ``2 K R C`` flops).
PER_EXAMPLE_MIN_SIZE = 4096


def _float64_term(f: Factor) -> bool:
    """Whether a term has a float64 dense factor (one-hot ids have no dtype that matters)."""
    return val(f.b).dtype == NORM_DTYPE or (not f.onehot and val(f.a).dtype == NORM_DTYPE)


def per_example_sum_ok(factors: list[Factor], acc: torch.dtype, bookkeeping: str) -> bool:
    """Whether a block's clipped sum is formed example by example (``opake::per_example_mm``:
    each example's float32 product, added in float64) rather than as one float64 product over
    every (example, position) row. A function of shapes, dtypes, the device and the float32
    matmul precision, never of values (every graph of a step makes the same choice).

    Yes for the dense terms of an ungrouped block of float32 (or lower) factors on the CPU
    with per-layer book-keeping (a one-hot term beside them, a tied LM head's embedding, stays
    a float64 scatter), with at least :data:`PER_EXAMPLE_MIN_K` positions and
    :data:`PER_EXAMPLE_MIN_SIZE` entries, while the norm bound's raise costs at most
    :data:`FAST_GRAM_OVERCLIP` (``gamma_K KAPPA``, :func:`emit_per_example_bound`: K up to
    1048), and while float32 products are IEEE. On an accelerator the float64 product over all
    rows needs no host read, and data-centre GPUs multiply float64 at about their IEEE float32
    rate.
    """
    dense = [f for f in factors if not f.onehot]  # (one-hot terms are float64 scatters anyway)
    if acc == NORM_DTYPE or bookkeeping != "per_layer" or not dense:
        return False
    for f in factors:
        if f.groups != 1 or _float64_term(f):
            return False
        if not _kernels._host_reads_are_free(val(f.b)):  # (a module attribute: tests patch it)
            return False
    for f in dense:
        if f.k < PER_EXAMPLE_MIN_K or f.rows * f.cols < PER_EXAMPLE_MIN_SIZE:
            return False
    k = max(f.k for f in dense)
    return gamma(k, unit_roundoff(torch.float32, matmul=True)) * KAPPA <= FAST_GRAM_OVERCLIP


def emit_per_example_bound(
    em: Emitter, factors: list[Factor], sq: fx.Node, mass_sq: fx.Node, acc: torch.dtype, bookkeeping: str
) -> fx.Node:
    """The squared norm bound ``sq`` of a block, raised where its sum is formed example by
    example (:func:`per_example_sum_ok`) to bound what that sum adds; unchanged otherwise.

    Example i's float32 product is within ``e_i = gamma_K S_i + K sqrt(R C) 2^-149`` of its
    exact gradient ``G_i`` (Higham 2002, Thm 3.5, any order of additions; the second term for
    products that underflow; ``S_i = sqrt(mass_sq)``), so ``||fl32(G_i)|| <= nu_i + e_i`` with
    ``nu_i = sqrt(sq)`` the block's bound on ``||G_i||``. Every example gets the raise, whatever
    its values: a per-example choice between a float32 and a float64 product would be a
    threshold on computed norms, whose last bits can differ between two evaluations of the
    same example (another batch size, another bucket's graph), and an example sitting at the
    threshold would then add one product or the other depending on the rest of the batch.

    What the raise costs: where the mass cap does not bind (``S_i <= KAPPA nu_i``) at most
    ``gamma_K KAPPA`` of the norm (:func:`per_example_sum_ok` keeps that within
    :data:`FAST_GRAM_OVERCLIP`); where it binds, the cap sets the clip factor anyway.
    Ordinary examples (``S ~ sqrt(K) ||G||``) pay ``gamma_K sqrt(K)``: 2.4e-4 at K = 256.

    Returns:
        the squared bound, (P,) float64.
    """
    if not per_example_sum_ok(factors, acc, bookkeeping):
        return sq
    dense = [f for f in factors if not f.onehot]
    k = max(f.k for f in dense)
    r, c = factors[0].rows, factors[0].cols
    err = em(aten.mul.Tensor, em(aten.sqrt.default, mass_sq), gamma(k, unit_roundoff(torch.float32, matmul=True)))
    err = em(aten.add.Tensor, err, sum(f.k for f in dense) * math.sqrt(r * c) * FLOAT32_TINY)
    # (A one-hot term's mass is in mass_sq too: an over-estimate.) A few float64 operations on
    # non-negative numbers: 1 + 2^-40 covers their rounding.
    raised = em(aten.mul.Tensor, em(aten.add.Tensor, em(aten.sqrt.default, sq), err), 1.0 + 2.0**-40)
    return em(aten.mul.Tensor, em(aten.mul.Tensor, raised, raised), 1.0 + 2.0**-40)


def emit_clipped_sum(
    em: Emitter,
    factors: list[Factor],
    kept: fx.Node,
    factor: fx.Node,
    clip: fx.Node,
    acc: torch.dtype,
    bookkeeping: str = "per_layer",
    kept_prefix: fx.Node | None = None,
) -> fx.Node:
    """``sum_i f_i G_i`` as one product per term, shape (R, C), float64 (``acc`` is the clip
    factor's dtype). Where :func:`per_example_sum_ok`, dense terms are summed example by
    example (``opake::per_example_mm``; its rounding is in the norm bound,
    :func:`emit_per_example_bound`).

    ``bookkeeping="per_layer"`` sums each dense term in one opaque ``opake::bookkeeping_mm``
    call; ``"fused"`` emits the selects and the scaling as plain graph ops (see
    :class:`~opake_compile.compiler.passes.rewrites.GhostClipping` for the trade-off).
    ``clip``: the 0-d float64 node of ``C_eff`` (the underflow test of
    :func:`~._kernels.underflow_unsafe` measures against it); ``kept_prefix``: the node of
    :func:`~._kernels.kept_prefix`, shared by every call in one graph (emitted here when not given)."""
    p = shape(factors[0].b)[0] // factors[0].groups
    # Released sums are float64 (numerics, point 3): float32 (or lower) factors are scaled and
    # multiplied exactly there and accumulate in float64, where no example can steer the
    # rounding of the others' terms. Float64 factors keep the float64 analysis below.
    wide = torch.float64
    # For the in-graph forms (one-hot terms, and dense ones when fused); unused nodes are
    # removed by dead-code elimination.
    keep3 = em(aten.view.default, kept, [p, 1, 1])
    f3 = em(aten.view.default, factor, [p, 1, 1])
    zero = em(aten.scalar_tensor.default, 0.0, dtype=wide)
    fused = bookkeeping == "fused"
    if acc == torch.float64 and (fused or not _kernels._host_reads_are_free(val(kept))):  # (a module attribute: tests patch it)
        # Float64 factors only: no host test of the clip factor against the subnormal range
        # here (in-graph products, or the operator on an accelerator): an example it would
        # catch in any dense term has its factor zeroed for every term of this parameter
        # together. (Float32 factors scale exactly in float64: nothing to catch.)
        f3 = em(aten.where.self, keep3, f3, em(aten.scalar_tensor.default, 0.0, dtype=acc))
        danger = None
        for f in factors:
            if not f.onehot and f.groups == 1:
                # f scales A^T (P, K, R); its partner is B. (Excluded rows already have f = 0:
                # catching one changes nothing, so B need not be selected first.)
                d = underflow_unsafe(em, f.b, f.rows, f3, clip, acc)
                danger = d if danger is None else em(aten.logical_or.default, danger, d)
        if danger is not None:
            f3 = em(aten.where.self, danger, em(aten.scalar_tensor.default, 0.0, dtype=acc), f3)
            factor = em(aten.view.default, f3, [p])
    f3w = _as_dtype(em, f3, wide)
    per_example = per_example_sum_ok(factors, acc, bookkeeping)
    total = None
    for f in factors:
        r, k, c = f.rows, f.k, f.cols
        if f.groups > 1:
            term = _grouped_sum(em, f, kept, factor, acc)
        elif f.onehot:
            b = em(aten.where.self, keep3, _b_of(em, f, wide), zero)
            weighted = em(aten.mul.Tensor, b, f3w)
            flat_ids = em(aten.reshape.default, f.a, [p * k])
            flat_b = em(aten.reshape.default, weighted, [p * k, c])
            pad = -1 if f.padding_idx is None else f.padding_idx
            term = _kernels.chained(em, p * k, lambda s, e: _scatter_rows(
                em, _rows(em, flat_b, 0, s, e, p * k), _rows(em, flat_ids, 0, s, e, p * k), r, pad))
        elif fused:
            # The backend fuses these selects into its own kernels: fastest, but it may keep
            # every layer's masked copies alive at once.
            at = em(aten.permute.default, _as_dtype(em, f.a, wide), [0, 2, 1])
            at = em(aten.mul.Tensor, em(aten.where.self, keep3, at, zero), f3w)
            b = em(aten.where.self, keep3, _as_dtype(em, f.b, wide), zero)
            a_rows = em(aten.t.default, em(aten.reshape.default, at, [p * k, r]))
            b_rows = em(aten.reshape.default, b, [p * k, c])
            term = _kernels.chained(em, p * k, lambda s, e: em(
                aten.mm.default, _rows(em, a_rows, 1, s, e, p * k), _rows(em, b_rows, 0, s, e, p * k)))
        else:
            # A^T (P, K, R) is usually a view of a contiguous tensor (output gradients), so the
            # operator reads both factors in (example, k)-major order without a copy; the
            # selects and the scaling happen inside it, one layer at a time.
            at = em(aten.permute.default, f.a, [0, 2, 1])
            if kept_prefix is None:
                kept_prefix = _kernels.kept_prefix(kept, em)
            if per_example:  # (its rounding is in the norm: emit_per_example_bound)
                term = em(PER_EXAMPLE_MM, at, f.b, kept, factor, kept_prefix)
            else:
                term = em(BOOKKEEPING_MM, at, f.b, kept, factor, kept_prefix, clip)
        total = term if total is None else em(aten.add.Tensor, total, term)
    return total


def _scatter_rows(em: Emitter, rows: fx.Node, ids: fx.Node, r: int, pad: int) -> fx.Node:
    """An embedding table's clipped sum, ``embedding_dense_backward`` of the weighted rows, as
    the opaque ``opake::scatter_rows`` (:func:`~._kernels.scatter_rows`): its float64 result
    is then allocated when the rows are ready, not zeroed at the start of the step."""
    return em(_kernels.SCATTER_ROWS, rows, ids, r, pad)


def _sum_sq_bound_all(em: Emitter, cache: dict, x: fx.Node, n: int) -> fx.Node:
    """``emit_sum_sq_bound`` of ``x`` (P, ., .) over its last two dims (n entries), memoised
    in ``cache``: a rank-one norm's ``||a||^2`` and ``||b||^2``, shared by the parameters that
    read the same factor."""
    return _memo(cache, ("sum_sq_all", value_key(x), n), lambda: emit_sum_sq_bound(em, x, [1, 2], n))


def merge_parts(em: Emitter, sqs: list[fx.Node], masses: list[fx.Node]) -> tuple[fx.Node, fx.Node]:
    """Per-example ``(sq, mass_sq)`` of a gradient made of disjoint blocks (pieces of one
    parameter used separately) from those of its blocks, each shape (P,): squared norms add,
    masses add. Upper bounds stay upper bounds (same argument as :func:`merge_groups`)."""
    if len(sqs) == 1:
        return sqs[0], masses[0]
    up = 1.0 + 2.0 * gamma(len(sqs) + 2, unit_roundoff(NORM_DTYPE))
    sq, s = sqs[0], em(aten.sqrt.default, masses[0])
    for x, m in zip(sqs[1:], masses[1:]):
        sq = em(aten.add.Tensor, sq, x)
        s = em(aten.add.Tensor, s, em(aten.sqrt.default, m))
    s = em(aten.mul.Tensor, s, up)
    return em(aten.mul.Tensor, sq, up), em(aten.mul.Tensor, s, s)


def emit_factor_magnitude(em: Emitter, factors: list[Factor], p: int, cache: dict | None = None) -> fx.Node:
    """What the magnitude ramp reads for one block of a rewritten parameter (its terms share one
    ``(R, C)`` shape; :func:`~.numerics.emit_range_weight`): ``(P,)`` float64, 1 where its
    weight starts to fall, 2 where it reaches 0. A parameter used in pieces takes the largest
    over its blocks: with the first block's shape for all, a review found a cut at weight 0.4
    (pieces of 1 and 1600 rows; 0.3996 C against 0 one ulp apart).

    The largest of: the product of example i's largest input-side and output-side entries over
    :func:`~.numerics.product_limit` (one-hot ids are not entries), and, for float32 and lower
    factors, each dense factor's largest entry over its :func:`~.numerics.magnitude_limit`
    (entries per example times positions). Float64 factors are scaled by powers of two before
    their norms are formed, so only the product matters there.
    ``cache``: the graph's Gram cache, so that layers reading one input take its maximum once."""
    cache = {} if cache is None else cache
    wide = any(_float64_term(f) for f in factors)

    def raw(node: fx.Node) -> fx.Node:
        return _memo(cache, ("magnitude", node, p), lambda: emit_magnitude(em, node, p, 1.0))

    def largest(nodes: list[fx.Node]) -> fx.Node | None:
        out = None
        for node in dict.fromkeys(nodes):
            out = raw(node) if out is None else em(aten.maximum.default, out, raw(node))
        return out

    a_side = largest([f.a for f in factors if not f.onehot])
    b_side = largest([f.b for f in factors])
    both = b_side if a_side is None else em(aten.mul.Tensor, a_side, b_side)
    limit = product_limit(NORM_DTYPE if wide else torch.float32, sum(f.k for f in factors),
                          factors[0].rows * factors[0].groups, factors[0].cols)
    out = em(aten.mul.Tensor, both, 1.0 / limit)
    if not wide:
        for f in factors:
            for node in [f.b] + ([] if f.onehot else [f.a]):
                n = math.prod(val(node).shape) // p * f.k
                out = em(aten.maximum.default, out, em(aten.mul.Tensor, raw(node), 1.0 / magnitude_limit(val(node).dtype, n)))
    return out


def _grouped_sum(em: Emitter, f: Factor, kept: fx.Node, factor: fx.Node, acc: torch.dtype) -> fx.Node:
    """``sum_i f_i G_i`` for a grouped factor (:attr:`Factor.groups`), ``(groups * R, C)``:
    per group one product over all (example, position) rows, as for an ungrouped term, with
    the excluded examples selected away from both factors first.

    The clip factor never meets a factor in the subnormal range (tiny C next to large
    activations, where ``f_i a`` would keep a few digits and could round up, measured 1.11 C):
    float32 sums form the products in float64 (exact and normal for float32 and lower
    operands; this path is rare, the cost model keeps most grouped convolutions
    materialised) and round once when cast back; float64 sums apply ``f_i`` to the operand
    with the larger entries of each example (``_kernels._exact_scaling`` has the argument)."""
    ng, r, k, c = f.groups, f.rows, f.k, f.cols
    p = shape(f.b)[0] // ng
    wide = NORM_DTYPE
    keep4 = em(aten.view.default, kept, [p, 1, 1, 1])
    f4 = em(aten.view.default, _as_dtype(em, factor, wide), [p, 1, 1, 1])
    zero = em(aten.scalar_tensor.default, 0.0, dtype=wide)
    f4 = em(aten.where.self, keep4, f4, zero)
    a = em(aten.where.self, keep4, em(aten.reshape.default, _as_dtype(em, f.a, wide), [p, ng, r, k]), zero)
    b = em(aten.where.self, keep4, em(aten.reshape.default, _as_dtype(em, f.b, wide), [p, ng, k, c]), zero)
    if acc == wide:
        big_a = em(aten.amax.default, em(aten.abs.default, a), [1, 2, 3], True)
        big_b = em(aten.amax.default, em(aten.abs.default, b), [1, 2, 3], True)
        on_a = em(aten.ge.Tensor, big_a, big_b)
        a, b = (
            em(aten.where.self, on_a, em(aten.mul.Tensor, a, f4), a),
            em(aten.where.self, on_a, b, em(aten.mul.Tensor, b, f4)),
        )
    else:
        a = em(aten.mul.Tensor, a, f4)
    a = em(aten.reshape.default, em(aten.permute.default, a, [1, 2, 0, 3]), [ng, r, p * k])
    b = em(aten.reshape.default, em(aten.permute.default, b, [1, 0, 2, 3]), [ng, p * k, c])
    prod = _kernels.chained(em, p * k, lambda s, e: em(aten.bmm.default, _rows(em, a, 2, s, e, p * k), _rows(em, b, 1, s, e, p * k)))
    return em(aten.reshape.default, prod, [ng * r, c])  # (float64: released sums are)


def _rows(em: Emitter, x: fx.Node, dim: int, start: int, stop: int, n: int) -> fx.Node:
    """Rows ``[start, stop)`` of ``x`` along ``dim`` (``x`` itself when that is all ``n``)."""
    return x if (start, stop) == (0, n) else em(aten.slice.Tensor, x, dim, start, stop)
