"""Operators the rewrite passes emit that the backend must treat as one opaque call.

``opake::sliced_gram`` is a float32 Gram product over a long contraction, cut into slices
whose products are added in float32 in groups and the groups' sums in float64
(:func:`sliced_gram`).

``opake::bookkeeping_mm`` is the book-keeping clipped sum of one dense term,
``sum_i f_i A_i @ B_i`` with the excluded examples selected away. Emitted as plain ATen ops,
the selects and the scaling are pointwise consumers of the clip factor, and Inductor fuses
all of them, for every layer, into the kernel that computes the factor: every layer's masked
copies are then alive at once (measured on the MLP bench: 1.50x the non-private step's peak
memory with plain ops, 1.20x with this operator). As one operator per layer, the copies exist
one layer at a time and are freed as soon as that layer's product is done.

``opake::fence`` is a copy the backend cannot fuse with its producer or its consumers
(:func:`fence`): the clipped sums of per-example gradients the graph forms in full read the clip
factor through one each, so that each sum is a kernel of its own that frees its per-example
gradient before the next allocates its result.

``opake::scatter_rows`` is ``embedding_dense_backward`` as an opaque call (:func:`scatter_rows`):
the clipped sum of an embedding table, whose result the backend would otherwise allocate and
zero at the start of the step.

``opake::per_example_mm`` is the same sum formed example by example on the CPU: each
example's float32 product over its own positions, then weighted and added in float64
(:func:`per_example_mm`). Where an example has many positions this costs about a float32
product, where the float64 product over all rows costs about twice that on CPUs.
"""

from __future__ import annotations

import math

import torch

from opake_compile.compiler._graph_utils import val
from opake_compile.compiler.passes.numerics import HALF_SUBNORMAL_LOG2, UNDERFLOW_SHARE, chain_slices, check_gradual_underflow
from opake_compile.exceptions import UnsupportedOperationError

__all__ = ["bookkeeping_mm", "BOOKKEEPING_MM", "GRAM_CHUNK", "GRAM_GROUP", "group_terms", "per_example_mm", "PER_EXAMPLE_MM", "chained", "fence", "FENCE", "scatter_rows", "SCATTER_ROWS", "kept_prefix", "partner_of", "sliced_gram", "SLICED_GRAM", "underflow_unsafe"]


_LIB = torch.library.Library("opake", "DEF")
_LIB.define(
    "bookkeeping_mm(Tensor at, Tensor b, Tensor kept, Tensor factor, Tensor kept_prefix, Tensor clip) -> Tensor"
)
_LIB.define("per_example_mm(Tensor at, Tensor b, Tensor kept, Tensor factor, Tensor kept_prefix) -> Tensor")
# Any strides will do (its products read views): the backend need not copy a sliced or
# transposed operand into the layout it had when traced.
_LIB.define("fence(Tensor x) -> Tensor")
_LIB.define("scatter_rows(Tensor rows, Tensor ids, SymInt num_weights, SymInt padding_idx) -> Tensor")
_LIB.define("sliced_gram(Tensor x, Tensor y, int size) -> Tensor", tags=(torch.Tag.flexible_layout,))


def bookkeeping_mm(
    at: torch.Tensor,
    b: torch.Tensor,
    kept: torch.Tensor,
    factor: torch.Tensor,
    kept_prefix: torch.Tensor,
    clip: torch.Tensor,
) -> torch.Tensor:
    """``sum_i factor[i] * at[i]^T @ b[i]`` over the examples with ``kept[i]``.

    Args:
        at: ``(P, K, R)``, the left factor stored transposed (e.g. output gradients).
        b: ``(P, K, C)``, the right factor (e.g. layer inputs).
        kept: ``(P,)`` bool; excluded rows contribute exactly zero, even when they hold
            NaN or inf (they are selected away, never multiplied by zero).
        factor: ``(P,)`` clip factors; its dtype is the accumulation dtype of the result.
        kept_prefix: 0-d int64, ``m`` when ``kept`` is True on exactly its first ``m`` rows,
            else -1 (:func:`kept_prefix`; computed once in the graph and read by every
            layer's call, rather than reduced and tested again in each).
        clip: 0-d float64, the effective clipping norm ``C_eff``; the test of
            :func:`underflow_unsafe` measures the scaled operand's underflow against it.
    Returns:
        ``(R, C)`` float64: float32 (or lower) factors are scaled and multiplied exactly and
        summed in float64 (:func:`_wide_bookkeeping`); float64 ones as described below.

    Raises:
        UnsupportedOperationError: a float64 example whose operands are beyond ~2^890 on
            both sides, where no choice of operand keeps the underflow of the scaled one
            within :data:`~opake_compile.compiler.passes.numerics.UNDERFLOW_SHARE` of C.
    """
    p, k, r = at.shape
    c = b.shape[2]
    acc = factor.dtype
    if acc != torch.float64:
        return _wide_bookkeeping(at, b, kept, factor, kept_prefix)
    # On CPU reading ``kept`` costs nothing. When the kept examples are exactly the first m
    # rows (every example kept, or a chunk padded at its end: the common case), the excluded
    # rows are sliced off (views: they never enter the product, so their NaN or inf cannot
    # either) and only the smaller factor is copied (scaled). Otherwise, and always on an
    # accelerator (where reading ``kept`` would be a host sync per layer), the selects run.
    rows = _kept_prefix(kept_prefix)
    if rows is not None and rows < p:
        at, b, kept, factor = at[:rows], b[:rows], kept[:rows], factor[:rows]
        p = rows
    f3 = factor.view(p, 1, 1)
    if rows is not None:
        # Few dispatches on this path: it runs once per layer per step on small models too.
        scale_left = partner_of(r, c) == "b"
        caught = _caught_on_host(b if scale_left else at, r if scale_left else c, f3, clip, acc)
        if scale_left:
            left = torch.mul(at, f3) if at.dtype == acc else at.to(acc).mul_(f3)
            right = b if b.dtype == acc else b.to(acc)
        else:
            left = at if at.dtype == acc else at.to(acc)
            right = torch.mul(b, f3) if b.dtype == acc else b.to(acc).mul_(f3)
    else:
        keep = kept.view(p, 1, 1)
        # The factor is selected too, so the result never depends on an excluded row's
        # factor (callers pass zero there, but 0 * NaN would not be zero).
        f3 = torch.where(keep, f3, 0)
        left = torch.where(keep, at, 0).to(acc)
        right = torch.where(keep, b, 0).to(acc)
        # On an accelerator, no host-side test (a sync per layer): the graph has already
        # zeroed the factor of any example the test would catch, for every term of the
        # parameter together (_factors.emit_clipped_sum).
        if _host_reads_are_free(at):
            # The partner here is always b (the scaled operand is at); an excluded example
            # (f = 0) is never caught.
            caught = _caught_on_host(right, r, f3, clip, acc)
        else:
            caught = None
        left.mul_(f3)
    if caught is not None:
        # (A host-side test: free on CPU.) The caught examples' products are formed exactly,
        # apart from the others': see _split_exact.
        return _split_exact(at, b, left, right, caught, f3, clip, acc)
    return _rows_mm(left, right)


def fence(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` (the clip factors, (P,)), as an opaque call.

    Why: written as graph ops, every clipped sum ``sum_i f_i G_i`` of a per-example gradient
    formed in full is a reduction that reads the clip factor, and Inductor fuses all of them
    with the factor's own kernel into one kernel. That kernel's outputs (every such
    parameter's float64 sum) are allocated before it runs, while every per-example gradient it
    reads is still alive: measured on the Llama block of ``bench/bench_shapes.py`` (T = 512,
    B = 4, every linear layer summed directly), 342 MB at the peak against 316 MB when each sum
    reads the factor through its own fence and so runs as its own kernel, its per-example
    gradient freed before the next sum's result is allocated. The values are unchanged: the
    same ops on the same numbers.

    Args:
        x: any tensor.
    Returns:
        A new tensor equal to ``x``.
    """
    return x.clone()


def scatter_rows(rows: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int) -> torch.Tensor:
    """``embedding_dense_backward(rows, ids, num_weights, padding_idx, False)``: row ``ids[j]``
    of the result is the sum of the rows ``rows[j]`` with that id (``padding_idx``'s row, when
    not -1, stays zero), as one opaque call.

    Why: Inductor lowers the scatter into a zero-filled buffer and a scatter-add, and places the
    fill, which reads nothing, in the first kernel of the step. An embedding table's float64
    sum (V x d: 48 MiB at V = 8192, d = 768) was then alive through the whole step, 15 % of the
    Llama block's peak in ``bench/bench_shapes.py``. As one call, it is allocated when the
    rows it sums are ready. Each row's sum is in ``rows``' dtype (float64 in the graphs), in
    whatever order the kernel adds them; the error analysis allows any order.

    Args:
        rows: ``(N, d)`` rows to add up.
        ids: ``(N,)`` int64, each in ``[0, num_weights)``.
        num_weights: rows of the result.
        padding_idx: a row left zero, or -1.
    Returns:
        ``(num_weights, d)`` in ``rows``' dtype.
    """
    return torch.ops.aten.embedding_dense_backward.default(rows, ids, num_weights, padding_idx, False)


def per_example_mm(
    at: torch.Tensor, b: torch.Tensor, kept: torch.Tensor, factor: torch.Tensor, kept_prefix: torch.Tensor
) -> torch.Tensor:
    """``sum_i factor[i] * fl32(at[i]^T @ b[i])`` over the examples with ``kept[i]``, formed one
    example at a time and added in float64: each example's product over its own K positions is
    a float32 product, cast exactly to float64, scaled and added.

    Why: a float32 accumulation over the rows of *several* examples can be steered by the
    data (:func:`_wide_bookkeeping`), so the book-keeping product over all rows is formed in
    float64, which this CPU multiplies at half the float32 rate or less. Here float32 rounding
    stays inside one example: ``fl32(A_i^T B_i)`` is within ``gamma_K S_i`` of the exact
    product entry by entry (S_i the example's mass; Higham 2002, Thm 3.5, any order of
    additions), plus ``K 2^-149`` per entry for products that underflow. The graph adds that
    to every example's norm bound (:func:`~._factors.emit_per_example_bound`), so each clipped
    contribution ``f_i fl32(A_i^T B_i)`` has norm at most ``C_eff``; the float64 total then has
    the rounding of point 3 of :mod:`~opake_compile.compiler.passes.numerics`, over P terms per
    entry rather than P K.

    What an example adds must depend on its own values and on nothing else: not on its
    position in the batch, nor on the batch size (which removing an example changes), nor on
    a choice that another evaluation could make differently. A BLAS may round a product
    differently with the alignment of its operands or the size of a batched call (measured
    here: ``bmm`` with K = 300, R = 5, C = 7 gave entries that differ with the example's index
    and the batch size, by up to 6e-6). So every example is copied into the same freshly
    allocated (64-byte aligned) buffers and multiplied by one ``mm`` of one shape: identical
    calls on identical addresses. Every example takes the float32 product; one whose float32
    product is not finite (a mass near 2^128, whose partial sums leave float32's range; its
    clip factor is then at most ``KAPPA C / S``) takes the float32 product of its factors
    scaled by an exact power of two (:func:`_rescaled_product`), the same product up to
    subnormal effects, so that being on either side of that threshold does not change what
    it adds.

    CPU only (it reads ``kept`` and the factors on the host); elsewhere it forms the float64
    product of :func:`_wide_bookkeeping`, whose rounding is within the same bound. The graph
    emits it only for float32 (and lower) factors on the CPU
    (:func:`~._factors.per_example_sum_ok`).

    Args:
        at: ``(P, K, R)``, the left factor stored transposed (float32 or lower).
        b: ``(P, K, C)``, the right factor.
        kept: ``(P,)`` bool; excluded rows are never read.
        factor: ``(P,)`` clip factors.
        kept_prefix: as for :func:`bookkeeping_mm`.

    Returns:
        ``(R, C)`` float64.
    """
    if not _host_reads_are_free(at):
        return _wide_bookkeeping(at, b, kept, factor, kept_prefix)
    rows = _kept_prefix(kept_prefix)
    index = range(rows) if rows is not None else kept.nonzero().view(-1).tolist()
    weights = factor.to(torch.float64).tolist()
    total = _total(at, b, index, weights, check=False)
    # Finite iff every entry is: the weights are clip factors (at most 1), a finite float32
    # product is below 2^128 and there are at most 2^36 entries (larger factors are refused),
    # so a float64 sum of finite entries cannot overflow, while an inf or NaN entry makes it
    # inf or NaN. One read of the total, where ``isfinite(total).all()`` cost four passes
    # (abs, two comparisons, the reduction: ~100 ms per GPT-2 T = 256 step).
    if not math.isfinite(float(total.sum())):
        # Some example's float32 product overflowed: again, each example checked on its own.
        total = _total(at, b, index, weights, check=True)
    return total


class _FusedAddFailed(Exception):
    """The compiled add raised (a recompile it may not make, a mode it cannot run under)."""


def _total(at, b, index, weights, *, check: bool) -> torch.Tensor:
    """:func:`_per_example_total`, with the compiled add where it runs, else the slabs. A total
    the compiled add failed on is discarded whole and formed again: no example is added twice."""
    axpy = _fused_axpy() if at.shape[2] * b.shape[2] >= FUSED_ADD_MIN_ENTRIES else None
    if axpy is not None:
        try:
            return _per_example_total(at, b, index, weights, check=check, axpy=axpy)
        except _FusedAddFailed:
            pass
    return _per_example_total(at, b, index, weights, check=check, axpy=None)


def _per_example_total(at, b, index, weights, *, check: bool, axpy=None) -> torch.Tensor:
    """The loop of :func:`per_example_mm`; with ``check``, an example whose float32 product is
    not finite is formed again with its factors rescaled (:func:`_rescaled_product`). ``axpy``:
    the compiled add of :func:`_fused_axpy`, or None for the slabs (the same value: each
    weight is a float32 clip factor, times a power of two after rescaling, so its product with
    a float32 entry is exact in float64 and both paths round only the sum)."""
    wide = torch.float64
    _, k, r = at.shape
    c = b.shape[2]
    total = torch.empty((r * c,), dtype=wide)
    left, right = torch.empty((k, r), dtype=torch.float32), torch.empty((k, c), dtype=torch.float32)
    # The product's buffer is 1-D, seen as R x C by the product: the compiled add gets a tensor
    # that is no view, so Dynamo guards no sizes of a base (a square R x C first would have
    # specialised its graph to R == C, and compiled again at the next layer).
    prod_flat = torch.empty((r * c,), dtype=torch.float32)
    prod = prod_flat.view(r, c)
    first = True
    if axpy is not None:
        total.zero_()  # (the first product added to zero: exactly the product)
        first = False
        weight = torch.empty((), dtype=wide)
    slab = torch.empty((min(_SLAB, r * c),), dtype=wide) if axpy is None else None
    # Every view the loop reads is made once (a view op costs ~1-2 us of Python per call, and
    # the loop runs once per example and layer: 256 times in a step of the encoder row).
    ats, bs = at.unbind(0), b.unbind(0)
    left_t = left.t()
    cuts = [(start, min(start + _SLAB, r * c)) for start in range(0, r * c, _SLAB)]
    prod_parts = [prod_flat[s0:s1] for s0, s1 in cuts]
    total_parts = [total[s0:s1] for s0, s1 in cuts]
    slab_parts = [slab[: s1 - s0] for s0, s1 in cuts] if slab is not None else None
    for i in index:
        w = weights[i]
        if w == 0.0:  # adds exactly zero
            continue
        left.copy_(ats[i])
        right.copy_(bs[i])
        torch.mm(left_t, right, out=prod)
        flat, exact = None, False  # (None: the product is in ``prod_flat``, unscaled or scaled)
        if check and not bool(torch.isfinite(prod).all()):
            flat, exact, w = _rescaled_product(left, right, prod, w)
        if axpy is not None and not exact:
            # One pass: each float32 entry read, cast exactly, scaled and added in float64.
            weight.fill_(w)
            try:
                with torch.no_grad():  # (one grad mode: Dynamo guards on it)
                    axpy(total, prod_flat, weight)
            except Exception as err:  # noqa: BLE001 - the caller forms the total again by slabs
                raise _FusedAddFailed() from err
            continue
        # Cast and added slab by slab: a float32 product is cast exactly into a small float64
        # buffer that stays in cache (an in-place float64 += float32 add is ~4x slower, and
        # an R x C float64 copy is one more large buffer to fault in at every call).
        for j, (s0, s1) in enumerate(cuts):
            part = flat[s0:s1] if exact else slab_parts[j].copy_(prod_parts[j])
            if first:
                torch.mul(part, w, out=total_parts[j])
            else:
                total_parts[j].add_(part, alpha=w)
        first = False
    if first:  # no example adds anything
        total.zero_()
    return total.view(r, c)


def _axpy(total: torch.Tensor, part: torch.Tensor, weight: torch.Tensor) -> None:
    total.add_(part.to(torch.float64) * weight)


#: Entries (R x C) from which :func:`_per_example_total` adds with the compiled add. Below,
#: the slabs: the compiled add's call costs ~30 us more (Dynamo's guards and wrappers) and a
#: product that small stays in cache either way. One thread, 32 examples: 128 x 512, the slabs
#: 3.71 ms against 4.51; 256 x 512, 7.53 against 7.30; 512 x 512, 16.5 against 14.3.
FUSED_ADD_MIN_ENTRIES = 1 << 17

#: The compiled ``total += float64(part) * weight`` of :func:`_per_example_total` (one kernel
#: for every size: ``dynamic=True``), False where compiling it failed, None before the first use.
_AXPY: object = None


def _fused_axpy():
    """``total += float64(part) * weight`` as one generated loop (float64 ``total``, float32
    ``part``, a 0-d float64 ``weight``), compiled once per process by Inductor; None where it
    cannot be (no C++ compiler): the caller then casts and adds slab by slab, the same float64
    operations on each entry.

    Why: ATen has no single-pass mixed-precision add on the CPU. Cast into a float64 slab and
    then added, an entry cost 1.34 ns (one thread, 768 x 3072 entries); as one loop, 0.55 ns.
    That is about 150 ms of a GPT-2 width T = 256, B = 8 step (``bench/README.md``, stop 51)."""
    global _AXPY
    if _AXPY is None:
        try:
            # Never Inductor's unsafe-math flag (``cpp.enable_unsafe_math_opt_flag``, settable
            # by the environment): gcc then links crtfastmath, and loading the kernel turns on
            # flush-to-zero for the process (a review measured it), which the norms' bound
            # does not allow.
            fn = torch.compile(_axpy, dynamic=True, fullgraph=True, options={"cpp.enable_unsafe_math_opt_flag": False})
            # 20 entries (a vector loop and a tail): a float32 subnormal read as it is, the
            # infinities and NaN carried; added twice, half each time, the total is the probe.
            probe = torch.tensor([1.0, 2.0**-140, -3.0, math.inf, math.nan] * 4)
            t = torch.zeros(probe.numel(), dtype=torch.float64)
            w = torch.full((), 0.5, dtype=torch.float64)
            with torch.no_grad():
                fn(t, probe, w)  # compiled here, once: a failure leaves the slab path
                fn(t, probe, w)
            want = probe.to(torch.float64)
            if not torch.equal(torch.nan_to_num(t, nan=7.0), torch.nan_to_num(want, nan=7.0)):
                raise RuntimeError("the compiled float64 add gave a wrong value")
            _AXPY = fn
        except Exception:  # noqa: BLE001 - any compile failure means: use the slab path
            _AXPY = False
        # Whatever the compile loaded, subnormals must still be kept (fails closed here, before
        # the total it would have formed is used).
        check_gradual_underflow()
    return _AXPY or None


def _rescaled_product(left, right, prod, w) -> tuple[torch.Tensor, bool, float]:
    """The float32 product of one example whose unscaled product overflowed, with ``left``
    scaled by an exact power of two ``2^-s`` so that no partial sum can: every partial sum of
    an entry is at most ``S_inf = sum_k max|a_k| max|b_k|`` (times 1 + gamma_K), and s brings
    that below 2^125. Returns ``(flat product, exact, weight)`` with the weight ``w 2^s``
    (exact in float64), so that the caller adds ``w 2^s fl32(2^-s A^T B)``.

    Why scaled rather than a float64 product: whether the unscaled product overflows is a
    threshold on the example's computed factors, and their last bits can differ between two
    evaluations of the same example (an upstream ``bmm`` rounded one example differently in a
    graph of one and in a graph of two). Power-of-two scaling commutes with rounding, so on
    either side of the threshold the example adds the same float32 product, up to products
    that underflow once scaled (each at most 2^-150 in scaled units; with the clip factor at
    most ``KAPPA C / S`` that is below 2^-100 C). A float64 product would differ from it by up
    to ``gamma_K S`` times the clip factor, ~2^-10 C at K = 256 per such example. Where even
    the scaled product is not finite (not reachable for finite factors), the float64 product."""
    wide = torch.float64
    s_inf = float((left.abs().amax(1).to(wide) * right.abs().amax(1).to(wide)).sum())
    shift = max(1, math.ceil(math.log2(s_inf)) - 125) if math.isfinite(s_inf) and s_inf > 0 else 0
    if shift:
        left.mul_(math.ldexp(1.0, -shift))  # (in place: the same buffers, the same product call)
        w = math.ldexp(w, shift)
        torch.mm(left.t(), right, out=prod)
        if bool(torch.isfinite(prod).all()):
            return prod.view(-1), False, w
    return torch.mm(left.t().to(wide), right.to(wide)).view(-1), True, w


#: Entries per slab of :func:`per_example_mm`'s float64 additions (2 MiB of float64).
_SLAB = 1 << 18


def _rows_mm(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``sum_i left_i^T right_i`` for float64 ``(P, K, R)`` and ``(P, K, C)``: a product over
    the (example, position) rows (float64 products are never TF32), in chains
    (:func:`_chained_mm`)."""
    p, k, r = left.shape
    c = right.shape[2]
    return _chained_mm(left.reshape(p * k, r), right.reshape(p * k, c))


def _chained_mm(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left^T right`` for ``(n, R)`` and ``(n, C)`` float64 rows, in chains (:func:`chained`)."""
    return chained(_eager, left.shape[0], lambda s, e: torch.mm(left[s:e].t(), right[s:e]))


def chained(call, n: int, product):
    """A float64 accumulation over ``n`` rows in chains of at most
    :data:`~opake_compile.compiler.passes.numerics.MAX_FLOAT64_CHAIN` rows:
    ``product(start, stop)`` forms one chain's sum, and the chains' results are added in
    float64 (point 3 of the numerics: the worst case of a chain grows with its length).
    ``call`` as for :func:`underflow_unsafe` (:func:`_eager` on tensors, an ``Emitter`` in a
    graph)."""
    out = None
    for start, stop in chain_slices(n):
        part = product(start, stop)
        out = part if out is None else call(torch.ops.aten.add.Tensor, out, part)
    return out


def _wide_bookkeeping(at: torch.Tensor, b: torch.Tensor, kept: torch.Tensor, factor: torch.Tensor,
                      kept_prefix: torch.Tensor) -> torch.Tensor:
    """The book-keeping sum of float32 (or lower) factors, formed in float64: the clip factor
    and every product of two float32 numbers are exact there (so no scaled entry can underflow
    and no partner can amplify its rounding), and the sum over every (example, position) row
    accumulates in float64, where no example can steer it.

    A float32 accumulation could be steered: a BLAS adds a contraction nearly in sequence, so
    one example that lifts every later partial sum into the next binade makes each later small
    term round the same way (a hostile review: 1.245 C in one graph of 4096 rows, 4.98 C over
    16 chunks; identical examples alone, 1.009 C at T = 64 and 1.95 C at T = 4096)."""
    wide = torch.float64
    p, _, r = at.shape
    c = b.shape[2]
    rows = _kept_prefix(kept_prefix)
    if rows is not None:
        f3 = factor[:rows].to(wide).view(rows, 1, 1)
        at, b = at[:rows], b[:rows]
    else:
        keep = kept.view(p, 1, 1)
        f3 = torch.where(keep, factor.view(p, 1, 1), 0).to(wide)
        at, b = torch.where(keep, at, 0), torch.where(keep, b, 0)
    if r <= c:  # scale the smaller operand (the products are exact either way)
        left, right = at.to(wide, copy=True).mul_(f3), b.to(wide)
    else:
        left, right = at.to(wide), b.to(wide, copy=True).mul_(f3)
    n = left.shape[0] * left.shape[1]
    return _chained_mm(left.reshape(n, r), right.reshape(n, c))


def _split_exact(
    at: torch.Tensor,
    b: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    caught: torch.Tensor,
    f3: torch.Tensor,
    clip: torch.Tensor,
    acc: torch.dtype,
) -> torch.Tensor:
    """The float64 book-keeping sum when :func:`_caught_on_host` caught some examples: theirs
    formed by :func:`_exact_scaling`, every other example's exactly as if none had been caught
    (the same rows of ``left``, ``right`` in one product), the two parts added once.

    Per example, not per call: had one caught example sent every example of the call to the
    exact path, it would have removed the float32 rounding of all the others' products, which
    identical near-cancelling examples make systematic (a hostile review: removing the one
    caught example moved the sum by 1.019 C). Removing a caught example now changes the sum by
    its own exact contribution and one rounding of the total."""
    hit = caught.nonzero().view(-1)
    rest = (~caught).nonzero().view(-1)
    main = _rows_mm(left.index_select(0, rest), right.index_select(0, rest))
    ones = torch.ones(hit.shape[0], dtype=torch.bool, device=hit.device)
    el, er = _exact_scaling(at.index_select(0, hit), b.index_select(0, hit), ones, f3.index_select(0, hit), clip, acc)
    return main + _rows_mm(el, er)


def partner_of(r: int, c: int) -> str:
    """Which operand the CPU path leaves unscaled (the partner of the underflow test) for
    ``at`` (P, K, R) and ``b`` (P, K, C): ``"b"`` when ``R <= C`` (the clip factor scales the
    smaller ``at``), else ``"at"``."""
    return "b" if r <= c else "at"


def _host_reads_are_free(t: torch.Tensor) -> bool:
    """Whether reading a value of ``t`` on the host costs nothing (a CPU tensor); on an
    accelerator it would be a synchronisation, which this operator never makes. (Tests
    patch it to run the accelerator's code on the CPU.)"""
    return t.device.type == "cpu"


def kept_prefix(kept, call=None):
    """The operator's ``kept_prefix`` argument for a ``(P,)`` bool ``kept``: 0-d int64, ``m``
    when ``kept`` is True on exactly its first ``m`` rows, else -1. ``call`` as for
    :func:`underflow_unsafe` (default :func:`_eager`, on tensors; graphs pass their
    :class:`~opake_compile.compiler._graph_utils.Emitter` and compute it once per graph)."""
    aten, call = torch.ops.aten, call or _eager
    v = val(kept)
    m = call(aten.sum.default, kept, dtype=torch.int64)
    lead = call(aten.lt.Tensor, call(aten.arange.default, v.shape[0], dtype=torch.int64, device=v.device), m)
    prefix = call(aten.all.default, call(aten.eq.Tensor, kept, lead))
    return call(aten.where.self, prefix, m, call(aten.scalar_tensor.default, -1, dtype=torch.int64, device=v.device))


def _kept_prefix(kept_prefix: torch.Tensor) -> int | None:
    """``m`` when the kept examples are exactly the first ``m`` rows (read on the CPU, one
    host read per call), else ``None``."""
    if not _host_reads_are_free(kept_prefix):
        return None
    m = int(kept_prefix)
    return m if m >= 0 else None


def _exact_scaling(
    at: torch.Tensor, b: torch.Tensor, kept: torch.Tensor, f3: torch.Tensor, clip: torch.Tensor, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The two float64 factors with the clip factor applied so that no rounding of a scaled
    entry can be amplified by its partners (the case :func:`underflow_unsafe` caught): per
    example, the factor goes to the operand with the larger entries, so that the partners of
    its scaled entries are the smaller operand's; that suffices unless both operands exceed
    ~2^890 (at C = 2^-100), which is refused. (Float32 factors never get here: they are
    scaled exactly in float64, :func:`_wide_bookkeeping`.)"""
    keep = kept.view(-1, 1, 1)
    f3 = torch.where(keep, f3, 0)
    a_acc, b_acc = torch.where(keep, at, 0).to(acc), torch.where(keep, b, 0).to(acc)
    big_a, big_b = _largest(_eager, a_acc), _largest(_eager, b_acc)
    on_left = big_a >= big_b
    # The partner of the scaled operand is the other one; each example is tested against its
    # own choice (its largest entries read once, for the choice and for the test).
    r, c = at.shape[2], b.shape[2]
    unsafe_left = _caught(_eager, big_b, _per_clip(b_acc, r, acc), f3, clip)
    unsafe_right = _caught(_eager, big_a, _per_clip(a_acc, c, acc), f3, clip)
    if bool(torch.where(on_left, unsafe_left, unsafe_right).any()):
        raise UnsupportedOperationError(
            "opake::bookkeeping_mm: a float64 example's operands are both so large (beyond ~2^890) "
            "that the clip factor's rounding in the subnormal range could move the clipped sum by more "
            "than a negligible share of the clipping norm; rescale the model's inputs or raise clipping_norm."
        )
    left = torch.where(on_left, a_acc * f3, a_acc)
    right = torch.where(on_left, b_acc, b_acc * f3)
    return left, right


def _caught_on_host(partner, scaled_cols, f3, clip, acc) -> torch.Tensor | None:
    """:func:`underflow_unsafe` per example, ``(P,)`` bool, on the CPU; ``None`` where it
    catches no example. No example can be caught when no entry of ``partner`` reaches the
    threshold (the common case by ~2^80 at ordinary C): that is tested first from the
    operand's extremes (one pass over it); the per-example test runs only when it fails (an
    entry past the threshold, a NaN). Float64 factors only: float32 ones are scaled exactly
    in float64 (:func:`_wide_bookkeeping`)."""
    if partner.numel() == 0:  # no example kept (or no positions): nothing is scaled
        return None
    threshold = float(clip) * _per_clip(partner, scaled_cols, acc)
    lo, hi = torch.aminmax(partner)
    if max(-float(lo), float(hi)) <= threshold:  # (NaN fails the test)
        return None
    caught = underflow_unsafe(_eager, partner, scaled_cols, f3, clip, acc).view(-1)
    return caught if bool(caught.any()) else None


def _per_clip(partner, scaled_cols, acc) -> float:
    """The threshold of :func:`underflow_unsafe` on ``max |partner|`` per unit of ``C_eff``:
    ``share / (eta sqrt(R_s) K sqrt(C_p))``, a normal float64 (below 2^1015); eta itself is
    not (float64: 2^-1075 rounds to zero), hence the exponent."""
    shape = val(partner).shape
    size = math.sqrt(scaled_cols * int(shape[2])) * int(shape[1])
    return math.ldexp(UNDERFLOW_SHARE[acc] / size, -HALF_SUBNORMAL_LOG2[acc]) if size else math.inf


def _eager(op, *args, **kwargs):  # the ``call`` of underflow_unsafe outside a graph
    return op(*args, **kwargs)


def underflow_unsafe(call, partner, scaled_cols, f3, clip, acc):
    """Per example, ``(P, 1, 1)`` bool: whether the clip factor's rounding in the subnormal
    range, amplified by the other operand, could move the book-keeping sum by more than
    :data:`~opake_compile.compiler.passes.numerics.UNDERFLOW_SHARE` of ``C_eff``. No host read.

    The sum ``sum_i f_i A_i^T B_i`` applies ``f_i`` to one operand first. Each scaled entry
    ``fl(f_i x)`` errs by ``u f_i |x|`` (covered by the slack of the sum) plus, where it lands
    below the normal range, an absolute ``eta`` (half the smallest subnormal: 2^-150 in
    float32, 2^-1075 in float64), and the product carries that into the sum times the entries
    it meets. Over example i's ``K`` positions the second part is at most
    ``eta sqrt(R_s) sum_k ||p_k|| <= eta sqrt(R_s) K sqrt(C_p) max |p|`` (``p`` the partner
    operand ``(P, K, C_p)``, ``R_s`` the scaled operand's columns): a tiny C next to large
    activations (C = 1e-29 with inputs ~1e15 in float32 moved the sum by 1.33 C), or small
    scaled entries whose partners are huge while the example's largest scaled entry is
    ordinary (output gradients ``[v1, s, -2 s]`` against inputs ``[x1, 2^55, 2^54]`` at
    C = 2^-100: 31.9 C, which a test of the largest scaled entry missed). Examples with
    ``f_i = 1`` or ``f_i = 0`` are never caught (their scaled entries are exact); at
    C >= 10^-6 and GPT-2 shapes only partners beyond ~2^80 are.

    On the CPU, :func:`bookkeeping_mm` tests this on the host and then forms the caught
    examples' products exactly (:func:`_exact_scaling`), every other example's as if none had
    been caught (:func:`_split_exact`). Where no host test is possible (an accelerator, where it
    would be a synchronisation per layer; ``bookkeeping="fused"``'s in-graph products),
    :func:`~opake_compile.compiler.passes._factors.emit_clipped_sum` zeroes such an
    example's clip factor for every term of the parameter together: the example then adds
    nothing to that parameter's sum, a part of its clipped gradient (norm at most C). Per term
    would not do: two terms of one parameter (a weight used twice, a tied embedding) can
    cancel, and releasing one of them alone moved the sum by 32 C.

    Args:
        call: ``call(op, *args)`` applies an ATen overload: :func:`_eager` on tensors, or an
            :class:`~opake_compile.compiler._graph_utils.Emitter` to emit graph nodes.
        partner: ``(P, K, C_p)``, the operand the clip factor is *not* applied to.
        scaled_cols: ``R_s``, the last dimension of the scaled operand.
        f3: ``(P, 1, 1)`` clip factors in ``acc`` (zero for excluded examples).
        clip: 0-d float64, ``C_eff``.
        acc: the sum dtype (float32 or float64).
    """
    # Caught where eta sqrt(R_s) K sqrt(C_p) max|p| > share C_eff (:func:`_per_clip`).
    return _caught(call, _largest(call, partner), _per_clip(partner, scaled_cols, acc), f3, clip)


def _largest(call, x):
    """``(P, 1, 1)`` float64: the largest magnitude of each example's entries of ``x`` (P, K, C)."""
    aten = torch.ops.aten
    return call(aten._to_copy.default, call(aten.amax.default, call(aten.abs.default, x), [1, 2], True), dtype=torch.float64)


def _caught(call, big, per_clip, f3, clip):
    """The test of :func:`underflow_unsafe` given each example's largest partner entry ``big``:
    ``big > C_eff per_clip`` where the clip factor actually scales (``0 < f < 1``)."""
    aten = torch.ops.aten
    over = call(aten.gt.Tensor, big, call(aten.mul.Tensor, clip, per_clip))
    scaled = call(aten.logical_and.default, call(aten.lt.Scalar, f3, 1.0), call(aten.gt.Scalar, f3, 0.0))
    return call(aten.logical_and.default, over, scaled)


def sliced_gram(x: torch.Tensor, y: torch.Tensor, size: int) -> torch.Tensor:
    """``bmm(x, y)`` for float32 ``x`` (P, K1, n) and ``y`` (P, n, K2), formed as one float32
    product per slice of at most ``size`` of the n terms; the products of each group of
    :data:`GRAM_GROUP` consecutive slices are added in float32, in slice order, and each
    group's sum is cast exactly and added to a float64 total as soon as it is formed:
    ``(g_0 + g_1) + ...`` with ``g_j = ((p_jG + p_jG+1) + ...)`` and ``p_s`` the float32 product
    over terms ``[s size, (s + 1) size)``.

    A blocked summation (Higham 2002, section 4.2): each entry of ``g_j`` is within
    ``gamma_{size + G - 1}`` of the exact sum over its group's terms, relative to their
    absolute values, which is the bound of
    :func:`~opake_compile.compiler.passes._factors._gram_entry_gamma`. Adding the G products
    in float64 instead cast and added every slice's product there, which cost about a third
    of the products themselves (a mixed-precision ``add_`` casts into a temporary first).

    Why an operator: emitted as ATen ops (a product per slice, a chain of additions), the
    backend fuses the chain into one pass that reads every slice's product, so all of them are
    alive at once: 24 slices of a (16, 99, 197) panel of ViT-B/16's MLP, 28 MiB at the step's
    peak. Here two float32 products are alive at a time.

    Returns:
        ``(P, K1, K2)`` float64.
    """
    n = x.shape[2]
    if size < n and group_terms(n, size) > GRAM_CHUNK:
        # The bound the norms add assumes at most GRAM_CHUNK terms per group (_gram_slice).
        raise UnsupportedOperationError(
            f"opake::sliced_gram: slices of {size} of {n} terms, in groups of {GRAM_GROUP}, round like more than "
            f"{GRAM_CHUNK} terms, past the bound the norms assume; cut them with _factors._gram_slice."
        )
    total = group = part = None
    in_group = 0
    for start in range(0, n, size):
        xs, ys = x[:, :, start : start + size], y[:, start : start + size]
        if in_group == 0:  # a group's first product is its float32 sum so far
            group = torch.bmm(xs, ys) if group is None else torch.bmm(xs, ys, out=group)
        else:
            part = torch.bmm(xs, ys) if part is None else torch.bmm(xs, ys, out=part)
            group.add_(part)
        in_group += 1
        if in_group == GRAM_GROUP or start + size >= n:
            # float32 into float64: exact cast, one rounding of the float64 sum
            total = group.to(torch.float64) if total is None else total.add_(group)
            in_group = 0
    return total


#: Slices of :func:`sliced_gram` whose float32 products are added in float32 before their sum
#: goes to the float64 total: an eighth of the float64 additions. A group's rounding is that of
#: its slice's terms plus 7, so the passes cut slices of at most 121 terms
#: (:func:`~opake_compile.compiler.passes._factors._gram_slice`) and the bound stays that of 128.
GRAM_GROUP = 8

#: The most terms a float32 Gram entry's rounding bound counts (``_factors._gram_entry_gamma``):
#: one product over at most this many, or a group of slices whose :func:`group_terms` is at
#: most this (:func:`sliced_gram` refuses anything else).
GRAM_CHUNK = 128


def group_terms(n: int, size: int) -> int:
    """How many terms one group of :func:`sliced_gram`'s slices rounds like, for a contraction
    of ``n > size`` terms in slices of ``size``: the slice's terms and the float32 additions of
    the other slices of its group (a blocked sum, ``gamma_{size + G - 1}``)."""
    return size + min(-(-n // size), GRAM_GROUP) - 1


# A plain library kernel, not ``torch.library.custom_op``: the latter's Python wrapper cost
# about 50 us per call, a few per cent of a small model's step.
_LIB.impl("bookkeeping_mm", bookkeeping_mm, "CompositeExplicitAutograd")
_LIB.impl("sliced_gram", sliced_gram, "CompositeExplicitAutograd")
_LIB.impl("per_example_mm", per_example_mm, "CompositeExplicitAutograd")
_LIB.impl("fence", fence, "CompositeExplicitAutograd")
_LIB.impl("scatter_rows", scatter_rows, "CompositeExplicitAutograd")


@torch.library.register_fake("opake::bookkeeping_mm")
def _(at, b, kept, factor, kept_prefix, clip) -> torch.Tensor:  # (the operator's tensors)
    torch._check(at.dim() == 3 and b.dim() == 3 and at.shape[:2] == b.shape[:2])
    torch._check(kept.shape == (at.shape[0],) and kept.dtype == torch.bool)
    torch._check(factor.shape == (at.shape[0],) and factor.dtype.is_floating_point)
    torch._check(kept_prefix.dim() == 0 and kept_prefix.dtype == torch.int64)
    torch._check(clip.dim() == 0 and clip.dtype == torch.float64)
    return at.new_empty((at.shape[2], b.shape[2]), dtype=torch.float64)


@torch.library.register_fake("opake::per_example_mm")
def _(at, b, kept, factor, kept_prefix) -> torch.Tensor:
    torch._check(at.dim() == 3 and b.dim() == 3 and at.shape[:2] == b.shape[:2])
    torch._check(kept.shape == (at.shape[0],) and kept.dtype == torch.bool)
    torch._check(factor.shape == (at.shape[0],) and factor.dtype.is_floating_point)
    torch._check(kept_prefix.dim() == 0 and kept_prefix.dtype == torch.int64)
    return at.new_empty((at.shape[2], b.shape[2]), dtype=torch.float64)


@torch.library.register_fake("opake::fence")
def _(x) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.register_fake("opake::scatter_rows")
def _(rows, ids, num_weights, padding_idx) -> torch.Tensor:
    torch._check(rows.dim() == 2 and ids.dim() == 1 and ids.shape[0] == rows.shape[0])
    return rows.new_empty((num_weights, rows.shape[1]))


@torch.library.register_fake("opake::sliced_gram")
def _(x, y, size) -> torch.Tensor:
    torch._check(x.dim() == 3 and y.dim() == 3 and x.shape[0] == y.shape[0] and x.shape[2] == y.shape[1])
    torch._check(x.dtype == y.dtype and size > 0)
    return x.new_empty((x.shape[0], x.shape[1], y.shape[2]), dtype=torch.float64)


#: The overloads the passes put in graphs.
BOOKKEEPING_MM = torch.ops.opake.bookkeeping_mm.default
PER_EXAMPLE_MM = torch.ops.opake.per_example_mm.default
SLICED_GRAM = torch.ops.opake.sliced_gram.default
FENCE = torch.ops.opake.fence.default
SCATTER_ROWS = torch.ops.opake.scatter_rows.default
