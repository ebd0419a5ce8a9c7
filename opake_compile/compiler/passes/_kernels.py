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

from opake_compile.compiler._graph_utils import val
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
        exact = bool(subnormal_scaled(_eager, at if scale_left else b, f3, acc).any())
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
        exact = _host_reads_are_free(at) and bool(subnormal_scaled(_eager, left, f3, acc).any())
        left.mul_(f3)
    if exact:
        # (A host-side test: free on CPU.) The products are then formed exactly.
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
    on_left = (a_acc.abs().amax(dim=(1, 2)) >= b_acc.abs().amax(dim=(1, 2))).view(-1, 1, 1)
    left = torch.where(on_left, a_acc * f3, a_acc)
    right = torch.where(on_left, b_acc, b_acc * f3)
    return left, right


def _eager(op, *args, **kwargs):  # the ``call`` of subnormal_scaled outside a graph
    return op(*args, **kwargs)


def subnormal_scaled(call, operand, f3, acc):
    """Per example, ``(P, 1, ...)`` bool: whether ``f_i`` times the largest entry of
    ``operand`` (one book-keeping operand before the clip factor is applied) falls below
    ``tiny / u`` of the sum dtype ``acc`` while both are nonzero. Formed in float64, so a
    product that would underflow to zero entirely is caught too. No host read.

    Why: the book-keeping sum ``sum_i f_i A_i^T B_i`` applies ``f_i`` to one operand first.
    Where that lands below the sum dtype's normal range (a tiny C next to large activations:
    C = 1e-29 with inputs ~1e15 in float32), the scaled entries keep few digits (or none) and
    may round up, and the product with the large other operand carries that into the sum
    (measured: 1.33 C). On the CPU, :func:`bookkeeping_mm` tests this on the host and forms
    the products exactly (:func:`_exact_scaling`). Where no host test is possible (an
    accelerator, where it would be a synchronisation per layer; ``bookkeeping="fused"``'s
    in-graph products), :func:`~opake_compile.compiler.passes._factors.emit_clipped_sum`
    zeroes such an example's clip factor for every term of the parameter together: the
    example then adds nothing to that parameter's sum, a part of its clipped gradient (norm
    at most C). Per term would not do: two terms of one parameter (a weight used twice, a
    tied embedding) can cancel, and releasing one of them alone moved the sum by 32 C.
    Rescaling both operands by powers of two instead was tried and is unsound too (the other
    operand's small entries became subnormal next to large partners: 1.95 C).

    Args:
        call: ``call(op, *args)`` applies an ATen overload: :func:`_eager` on tensors, or an
            :class:`~opake_compile.compiler._graph_utils.Emitter` to emit graph nodes.
        operand: ``(P, ...)``, unscaled (excluded examples selected to zero).
        f3: ``(P, 1, ...)`` clip factors (zero for excluded examples).
        acc: the sum dtype (float32 or float64).
    """
    aten = torch.ops.aten
    fi = torch.finfo(acc)
    dims = list(range(1, val(operand).dim()))
    big = call(aten.amax.default, call(aten.abs.default, operand), dims, True)
    wide = torch.float64
    scaled = call(aten.mul.Tensor, call(aten._to_copy.default, big, dtype=wide), call(aten._to_copy.default, f3, dtype=wide))
    low = call(aten.lt.Scalar, scaled, fi.tiny / (fi.eps / 2))
    return call(aten.logical_and.default, low, call(aten.gt.Scalar, scaled, 0.0))


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
