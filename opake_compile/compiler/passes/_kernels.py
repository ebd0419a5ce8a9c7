"""Operators the rewrite passes emit that the backend must treat as one opaque call.

``opake::bookkeeping_mm`` is the book-keeping clipped sum of one dense term,
``sum_i f_i A_i @ B_i`` with the excluded examples selected away. Emitted as plain ATen ops,
the selects and the scaling are pointwise consumers of the clip factor, and Inductor fuses
all of them, for every layer, into the kernel that computes the factor: every layer's masked
copies are then alive at once (measured on the MLP bench: 1.50x the non-private step's peak
memory with plain ops, 1.20x with this operator). As one operator per layer, the copies exist
one layer at a time and are freed as soon as that layer's product is done.
"""

from __future__ import annotations

import torch

from opake_compile.compiler.passes.numerics import float32_matmul_is_ieee, ieee_float32_matmul

__all__ = ["bookkeeping_mm", "BOOKKEEPING_MM"]


_LIB = torch.library.Library("opake", "DEF")
_LIB.define("bookkeeping_mm(Tensor at, Tensor b, Tensor kept, Tensor factor, Tensor all_kept) -> Tensor")


def bookkeeping_mm(
    at: torch.Tensor, b: torch.Tensor, kept: torch.Tensor, factor: torch.Tensor, all_kept: torch.Tensor
) -> torch.Tensor:
    """``sum_i factor[i] * at[i]^T @ b[i]`` over the examples with ``kept[i]``.

    Args:
        at: ``(P, K, R)``, the left factor stored transposed (e.g. output gradients).
        b: ``(P, K, C)``, the right factor (e.g. layer inputs).
        kept: ``(P,)`` bool; excluded rows contribute exactly zero, even when they hold
            NaN or inf (they are selected away, never multiplied by zero).
        factor: ``(P,)`` clip factors; its dtype is the accumulation dtype of the result.
        all_kept: 0-d bool, ``kept.all()`` (computed once in the graph rather than reduced
            again in every layer's call).

    Returns:
        ``(R, C)`` in ``factor.dtype``.
    """
    p, k, r = at.shape
    c = b.shape[2]
    acc = factor.dtype
    # On CPU reading ``kept`` costs nothing. When the kept examples are exactly the first m
    # rows (every example kept, or a chunk padded at its end: the common case), the excluded
    # rows are sliced off (views: they never enter the product, so their NaN or inf cannot
    # either) and only the smaller factor is copied (scaled). Otherwise, and always on an
    # accelerator (where reading ``kept`` would be a host sync per layer), the selects run.
    rows = _kept_prefix(kept, all_kept)
    if rows is not None and rows < p:
        at, b, kept, factor = at[:rows], b[:rows], kept[:rows], factor[:rows]
        p = rows
    f3 = factor.view(p, 1, 1)
    if rows is not None:
        # Few dispatches on this path: it runs once per layer per step on small models too.
        scale_left = r <= c
        if scale_left:
            left = torch.mul(at, f3) if at.dtype == acc else at.to(acc).mul_(f3)
            right = b if b.dtype == acc else b.to(acc)
        else:
            left = at if at.dtype == acc else at.to(acc)
            right = torch.mul(b, f3) if b.dtype == acc else b.to(acc).mul_(f3)
        scaled = left if scale_left else right
    else:
        keep = kept.view(p, 1, 1)
        # The factor is selected too, so the result never depends on an excluded row's
        # factor (callers pass zero there, but 0 * NaN would not be zero).
        f3 = torch.where(keep, f3, 0)
        left = torch.where(keep, at, 0).to(acc)
        right = torch.where(keep, b, 0).to(acc)
        if _host_reads_are_free(at):
            scaled = left.mul_(f3)
        else:
            # No host-side test here (it would be a sync per layer): every example's two
            # copies are balanced instead, whatever their scale.
            s_left, s_right = balancing_scales(_eager, left, right, f3)
            left.mul_(s_left)  # formed in the scales' float64, rounded once to acc
            right.mul_(s_right)
            scaled = None
    if scaled is not None and _scaled_underflows(scaled, f3, acc):
        # (A host-side test: free on CPU.)
        left, right = _exact_scaling(at, b, kept, f3, acc)
    if left.dtype == torch.float32 and not float32_matmul_is_ieee():
        # The slack rho of the released sum assumes IEEE float32 products; TF32 operands
        # (rounded to 2^-11 of an example's mass) let one example move it past C.
        with ieee_float32_matmul():
            return torch.mm(left.reshape(p * k, r).t(), right.reshape(p * k, c))
    return torch.mm(left.reshape(p * k, r).t(), right.reshape(p * k, c)).to(acc)


def _host_reads_are_free(t: torch.Tensor) -> bool:
    """Whether reading a value of ``t`` on the host costs nothing (a CPU tensor); on an
    accelerator it would be a synchronisation, which this operator never makes. (Tests
    patch it to run the accelerator's code on the CPU.)"""
    return t.device.type == "cpu"


def _kept_prefix(kept: torch.Tensor, all_kept: torch.Tensor) -> int | None:
    """``m`` when ``kept`` (on the CPU) is True on exactly its first ``m`` rows, else ``None``."""
    if not _host_reads_are_free(all_kept):
        return None
    if bool(all_kept):
        return kept.shape[0]
    m = int(kept.sum())
    return m if bool(kept[:m].all()) else None


def _scaled_underflows(scaled: torch.Tensor, f3: torch.Tensor, acc: torch.dtype) -> bool:
    """Whether some example's scaled factor ``x_i f_i`` (nonzero ``f_i``) has its largest entry
    below ``tiny / u`` of ``acc``: its entries then lose precision in the subnormal range, and
    the product with the other (large) factor would carry that rounding, which can go up,
    into the sum (measured: one example moved a float32 sum by 1.33 C with C = 1e-29 and
    inputs ~1e15, although its norm was exact). One read of the scaled factor."""
    fi = torch.finfo(acc)
    low = fi.tiny / (fi.eps / 2)
    big = scaled.abs().amax(dim=(1, 2))
    # An all-zero scaled factor (zero output gradients, a layer LayerDrop skipped) is exact.
    return bool(((big < low) & (big > 0) & (f3.view(-1) > 0)).any())


def _exact_scaling(at: torch.Tensor, b: torch.Tensor, kept: torch.Tensor, f3: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The two factors with the clip factor applied where no product leaves the normal range.

    Float32 sums: both factors in float64, where the products of float32 numbers are exact
    and normal, and the matrix product is rounded once when cast back. Float64 sums: per
    example, the factor goes to the operand with the larger entries. Error analysis: a
    clipped example has ``C <= f ||G_i|| <= f K sqrt(R C) L_i R_i`` (``L_i >= R_i`` the largest
    entries of its two operands), so ``f L_i >= C / (K sqrt(R C) L_i) >= 2^-100 / (K sqrt(R C)
    2^512)``; ``L_i < 2^512`` since its squared norm is finite (else it is dropped). That is far
    above float64's subnormal range, and smaller entries' absolute errors (2^-1075 each) are
    negligible next to C >= 2^-100."""
    keep = kept.view(-1, 1, 1)
    f3 = torch.where(keep, f3, 0)
    if acc == torch.float32:
        wide = torch.float64
        left = torch.where(keep, at, 0).to(wide).mul_(f3.to(wide))
        return left, torch.where(keep, b, 0).to(wide)
    a_acc, b_acc = torch.where(keep, at, 0).to(acc), torch.where(keep, b, 0).to(acc)
    s_left, s_right = balancing_scales(_eager, a_acc, b_acc, f3)  # f on one side, 1 on the other
    return a_acc * s_left, b_acc * s_right


def _eager(op, *args, **kwargs):  # the ``call`` of balancing_scales outside a graph
    return op(*args, **kwargs)


def balancing_scales(call, left, right, f3):
    """Per-example scales ``(s_left, s_right)``, float64 and shaped like ``f3``, with
    ``s_left * s_right == f3`` exactly, such that ``fl(left * s_left) @ fl(right * s_right)``
    carries no more rounding than an unscaled product, with no host read (no ``if`` on values).

    Why: the book-keeping sum ``sum_i f_i A_i^T B_i`` applies ``f_i`` to one operand first.
    Where that lands below the sum dtype's normal range (a tiny C next to large activations:
    C = 1e-29 with inputs ~1e15 in float32), the scaled entries keep few digits and may round
    up, and the product with the large other operand carries that into the sum (measured:
    1.33 C). The CPU operator tests for it and recomputes exactly (:func:`_exact_scaling`);
    accelerators and the fused in-graph sums cannot test without a host synchronisation, so
    they always apply these scales.

    Float32 sums (the operands' dtype): ``s_left = f 2^-e``, ``s_right = 2^e`` with
    ``e = trunc((log2(f L) - log2 R) / 2)`` (L, R the largest entries of the example's two
    operands; e = 0 where either is zero or not finite). Both scaled maxima then lie within a
    factor of 2 of ``g = sqrt(f L R)`` and below ``max(f L, R)`` (so nothing new overflows);
    ``2^e`` is built from its bits, exact, and ``fl(right 2^e)`` is exact unless subnormal.
    A clipped example has ``C <= f ||G_i|| <= f K sqrt(R_dim C_dim) L R``, so with
    ``C >= 2^-100`` and ``K sqrt(R_dim C_dim) < 2^40``, ``g >= 2^-70``: both maxima are far
    above float32's ``tiny / u = 2^-102``, the threshold of the CPU test, and the absolute
    error 2^-150 of any subnormal entry is under 2^-79 of the largest product. An unclipped
    example with ``g < 2^-101`` contributes under 2^-160 in all, next to C >= 2^-100.
    Float64 sums: ``f`` goes to the operand with the larger entries (the argument is
    :func:`_exact_scaling`'s), the other scale is 1.

    Args:
        call: ``call(op, *args)`` applies an ATen overload: :func:`_eager` on tensors, or an
            :class:`~opake_compile.compiler._graph_utils.Emitter` to emit graph nodes.
        left, right: ``(P, ...)`` operands in the sum dtype (float32 or float64), excluded
            examples already selected to zero.
        f3: ``(P, 1, ...)`` clip factors in the sum dtype, zero for excluded examples.
    """
    aten = torch.ops.aten
    wide = torch.float64
    dims = list(range(1, _meta(left).dim()))
    big_l = call(aten.amax.default, call(aten.abs.default, left), dims, True)
    big_r = call(aten.amax.default, call(aten.abs.default, right), dims, True)
    f_w = call(aten._to_copy.default, f3, dtype=wide)
    one = call(aten.scalar_tensor.default, 1.0, dtype=wide)
    if _meta(f3).dtype == wide:
        on_left = call(aten.ge.Tensor, big_l, big_r)
        return call(aten.where.self, on_left, f_w, one), call(aten.where.self, on_left, one, f_w)
    log_l = call(aten.add.Tensor, call(aten.log2.default, call(aten._to_copy.default, big_l, dtype=wide)),
                 call(aten.log2.default, f_w))
    log_r = call(aten.log2.default, call(aten._to_copy.default, big_r, dtype=wide))
    e = call(aten.trunc.default, call(aten.mul.Tensor, call(aten.sub.Tensor, log_l, log_r), 0.5))
    zero = call(aten.scalar_tensor.default, 0.0, dtype=wide)
    e = call(aten.where.self, call(aten.isfinite.default, e), e, zero)
    # |e| <= 214 for float32 operands; the clamp only keeps the bit construction in range.
    e = call(aten.clamp.default, e, -1000.0, 1000.0)
    e_int = call(aten._to_copy.default, e, dtype=torch.int64)
    up = _power_of_two(call, e_int)
    down = _power_of_two(call, call(aten.neg.default, e_int))
    return call(aten.mul.Tensor, f_w, down), up


def _power_of_two(call, e_int):
    """``2^e`` in float64 from its bits (exact for -1022 <= e <= 1023)."""
    aten = torch.ops.aten
    biased = call(aten.add.Tensor, e_int, 1023)
    return call(aten.view.dtype, call(aten.bitwise_left_shift.Tensor_Scalar, biased, 52), torch.float64)


def _meta(x):  # a tensor, or a graph node's fake value
    return x if isinstance(x, torch.Tensor) else x.meta["val"]


# A plain library kernel, not ``torch.library.custom_op``: the latter's Python wrapper cost
# about 50 us per call, a few per cent of a small model's step.
_LIB.impl("bookkeeping_mm", bookkeeping_mm, "CompositeExplicitAutograd")


@torch.library.register_fake("opake::bookkeeping_mm")
def _(at: torch.Tensor, b: torch.Tensor, kept: torch.Tensor, factor: torch.Tensor, all_kept: torch.Tensor) -> torch.Tensor:
    torch._check(at.dim() == 3 and b.dim() == 3 and at.shape[:2] == b.shape[:2])
    torch._check(kept.shape == (at.shape[0],) and kept.dtype == torch.bool)
    torch._check(factor.shape == (at.shape[0],) and factor.dtype.is_floating_point)
    torch._check(all_kept.dim() == 0 and all_kept.dtype == torch.bool)
    return at.new_empty((at.shape[2], b.shape[2]), dtype=factor.dtype)


#: The overload the passes put in graphs.
BOOKKEEPING_MM = torch.ops.opake.bookkeeping_mm.default
