"""``verify``: check a compiled DP step against the eager reference on the user's own model."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import optree
import torch

from opake_compile.compiler.passes.numerics import RHO
from opake_compile.compiler.step import DPStep
from opake_compile.compiler.trace import _LossModule
from opake_compile import patches as _patches
from opake_compile.dpsgd.clipping import clipped_grad
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = ["VerificationReport", "verify"]

_RHO = RHO[torch.float32]


@dataclasses.dataclass(frozen=True)
class VerificationReport:
    """Result of :func:`verify`. **Not privatised:** every number in it is a statistic of the
    batch it was run on (differences of clipped sums, per-example norms); run it on data you may
    look at, and do not publish it as a private result.

    Attributes:
        max_abs_diff: max over parameters and entries of |compiled - reference| of the clipped sum.
        tolerance: the tolerance the difference was judged against (dtype-scaled).
        matches_reference: ``max_abs_diff <= tolerance``.
        max_removal_change: max over the removed examples i of ||S - S_without_i|| (L2 over all
            trainable parameters); the sensitivity bound says it is at most C.
        sensitivity_ok: ``max_removal_change <= C * (1 + tolerance)``.
        examples_removed: how many examples the sensitivity check removed.
        coverage: parameter -> path taken in the compiled step.
        norm_overestimate: max over examples of ``(compiled norm - reference norm) / reference
            norm`` (0 if never above): how much harder than necessary the compiled step clips.
            Above 1 % is over-clipping (a silent utility loss) and fails ``norms_ok``.
        norm_underestimate: max over examples of ``(reference - compiled) / reference`` (0 if
            never below); the numerical contract allows at most rho (2^-10 for float32).
    """

    max_abs_diff: float
    tolerance: float
    matches_reference: bool
    max_removal_change: float
    sensitivity_ok: bool
    examples_removed: int
    coverage: dict[str, str]
    norm_overestimate: float = 0.0
    norm_underestimate: float = 0.0

    #: Largest relative norm overestimate :attr:`norms_ok` accepts.
    MAX_NORM_OVERESTIMATE = 0.01

    @property
    def norms_ok(self) -> bool:
        """Per-example norms within 1 % above and rho below the eager reference."""
        return self.norm_overestimate <= self.MAX_NORM_OVERESTIMATE and self.norm_underestimate <= _RHO

    @property
    def ok(self) -> bool:
        return self.matches_reference and self.sensitivity_ok and self.norms_ok

    def __str__(self) -> str:
        return (
            f"compiled vs eager reference: max |diff| = {self.max_abs_diff:.3g} "
            f"(tolerance {self.tolerance:.3g}) -> {'OK' if self.matches_reference else 'MISMATCH'}\n"
            f"sensitivity: max ||S - S_-i|| = {self.max_removal_change:.6g} over {self.examples_removed} "
            f"removal(s) -> {'OK' if self.sensitivity_ok else 'VIOLATED'}\n"
            f"per-example norms vs reference: up to {100 * self.norm_overestimate:.3g} % above, "
            f"{100 * self.norm_underestimate:.3g} % below -> {'OK' if self.norms_ok else 'OVER-CLIPPING' if self.norm_overestimate > self.MAX_NORM_OVERESTIMATE else 'TOO SMALL'}"
        )


def _remove_example(args: tuple, batched: tuple[int, ...], i: int) -> tuple:
    def drop(x: Any) -> Any:
        return torch.cat([x[:i], x[i + 1 :]]) if isinstance(x, torch.Tensor) else x

    return tuple(optree.tree_map(drop, a, none_is_leaf=True) if j in batched else a for j, a in enumerate(args))


def verify(step: DPStep, *args: Any, max_removals: int = 8, rtol: float | None = None) -> VerificationReport:
    """Run the compiled step and the eager reference on ``args`` and compare.

    The reference is :func:`opake_compile.dpsgd.clipping.clipped_grad` (``vmap(grad)`` in eager
    mode) of the same per-example loss. The sensitivity check removes each of the first
    ``max_removals`` examples in turn and measures how much the clipped sum moves (at most C
    for a correct DP step). The per-example norms are compared in relative terms
    (:attr:`VerificationReport.norm_overestimate`): a compiled norm above the reference means
    the example is clipped harder than C asks, which is how over-clipping shows on a user's
    own model. The report is **not privatised** (:class:`VerificationReport`).

    Args:
        step: a :class:`DPStep` from ``compile_dp``.
        *args: one batch, as passed to ``step``.
        max_removals: how many examples to remove one at a time.
        rtol: relative tolerance, scaled by the larger of the sum's largest entry and C (1 and
            the largest entry without clipping); default ``100 * eps`` of the
            reference's gradient dtype, or ``4 * eps`` of the trainable parameters' dtype where
            that is larger (bfloat16 and float16 models round in both paths), for the
            comparison; the sensitivity test allows C times ``1 + rtol`` (default the former).

    Raises:
        InputTypeError: ``step`` is not a ``DPStep``.
        ConfigurationError: the loss draws randomness (dropout in training mode): the two
            paths cannot be compared; call ``model.eval()`` for the check.
    """
    if not isinstance(step, DPStep):
        raise InputTypeError(f"verify expects a DPStep from compile_dp, got {type(step).__name__}.")
    result = step(*args)
    # The graph this call ran (its cache signature), not whichever graph was built last.
    compiled = step._compiled_for(args)
    batched = step._batched_positions(len(args))
    if compiled is not None and compiled.traced.has_randomness:
        raise ConfigurationError(
            "The loss draws randomness (e.g. dropout in training mode), so the compiled and eager "
            "paths cannot be compared; call model.eval() (or disable the randomness) for verify."
        )
    model = step.model
    named = dict(model.named_parameters())
    trainable = {k: p.detach() for k, p in named.items() if p.requires_grad}
    frozen = {k: p.detach() for k, p in named.items() if not p.requires_grad}
    buffers = {k: b for k, b in model.named_buffers()}
    wrapper = _LossModule(model, step.loss_fn)

    def loss(train: dict[str, torch.Tensor], *a: Any) -> torch.Tensor:
        state = {f"model.{k}": v for k, v in {**train, **frozen, **buffers}.items()}
        return torch.func.functional_call(wrapper, state, a)

    grad_fn, state = clipped_grad(loss, 0, batch_argnums=tuple(i + 1 for i in batched), clipping_norm=step.clipping_norm)
    with _patches.tracing_patches(model):  # the same adjustments as the compiled trace
        ref, _ = grad_fn(trainable, *args, state=state)
    diff, scale = 0.0, 0.0
    for k, g in result.clipped.grads.items():
        diff = max(diff, float((g.double() - ref.grads[k].double()).abs().max()))
        scale = max(scale, float(ref.grads[k].double().abs().max()))
    # The precision of one graph's sum (the reference's dtype): a batch run as several chunks
    # returns float64 sums (their float32 partial sums added in float64), no more accurate.
    dtype = next(iter(ref.grads.values())).dtype
    eps = torch.finfo(dtype).eps
    c = step.clipping_norm
    # Relative to the sum's own size (or C, where it is smaller): a floor of 1 made the
    # tolerance 10^16 C at C = 2^-70, and a sum 200x too small passed as a match (a hostile
    # review). Without clipping (C = inf), at least 1.
    magnitude = max(1.0, scale) if math.isinf(c) else max(scale, c)
    # The comparison with the reference allows for the model's own precision too: a bfloat16
    # model's gradients round at 2^-8 in both paths, in different orders, and were reported as
    # a mismatch against float32's tolerance (a newcomer's review: 1.1e-3 of the largest entry
    # for bfloat16, 1.1e-4 for float16). 4 eps of the model's dtype (3 % for bfloat16) leaves
    # that 28x of room and still catches a sum scaled by 0.9 (16 eps did not: review). The
    # sensitivity test keeps the sum dtype's tolerance: the contract bounds the released sum
    # whatever the model's dtype.
    model_eps = max([0.0] + [torch.finfo(p.dtype).eps for p in trainable.values() if p.is_floating_point()])
    tol = (rtol if rtol is not None else max(100 * eps, 4 * model_eps)) * magnitude
    sens_rtol = rtol if rtol is not None else 100 * eps  # (relative to C)
    got_n = result.clipped.per_example_norms.double()
    ref_n = ref.per_example_norms.double().reshape(got_n.shape)
    usable = torch.isfinite(ref_n) & torch.isfinite(got_n) & (ref_n > 0)
    rel = (got_n[usable] - ref_n[usable]) / ref_n[usable]
    over = float(rel.max().clamp_min(0)) if rel.numel() else 0.0
    under = float((-rel).max().clamp_min(0)) if rel.numel() else 0.0
    n = result.clipped.num_examples
    removals = min(n, max_removals)
    worst = 0.0
    for i in range(removals):
        reduced = step(*_remove_example(args, batched, i)).clipped.grads
        sq = sum(float((result.clipped.grads[k].double() - reduced[k].double()).square().sum()) for k in reduced)
        worst = max(worst, math.sqrt(sq))
    return VerificationReport(
        max_abs_diff=diff,
        tolerance=tol,
        matches_reference=diff <= tol,
        max_removal_change=worst,
        sensitivity_ok=worst <= c * (1 + sens_rtol) if not math.isinf(c) else True,
        examples_removed=removals,
        coverage=dict(result.coverage),
        norm_overestimate=over,
        norm_underestimate=under,
    )
