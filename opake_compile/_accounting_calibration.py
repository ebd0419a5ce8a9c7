"""Calibrating a mechanism parameter (usually the noise multiplier) to a privacy budget.

Public names are re-exported from :mod:`opake_compile.accounting`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from opake_compile._accounting_accountant import (
    Accountant,
    EpsilonBudget,
    PrivacyBudget,
    _check_process,
)
from opake_compile._accounting_process import PrivacyProcess, _resolve
from opake_compile._validate import NotPrivateWarning, _as_float
from opake_compile.exceptions import CalibrationError, ConfigurationError, InputTypeError

__all__ = ["CalibrationResult", "calibrate"]

_MAX_BISECTIONS = 200


@dataclass(frozen=True)
class CalibrationResult:
    """What :func:`calibrate` found.

    Attributes:
        param: the parameter returned (it meets the budget: it was evaluated).
        epsilon: achieved epsilon (nats) of ``process``: the spent epsilon for an epsilon budget,
            the budget's epsilon for a delta budget.
        delta: achieved delta: the budget's delta for an epsilon budget, the spent delta for a
            delta budget.
        process: ``make_process(param)``.
        bracket: ``(param, other)`` where ``other`` is the nearest evaluated parameter that
            misses the budget (``None`` when the whole range meets it), within ``tol`` of param.
        evaluations: how many processes were accounted for.
    """

    param: float
    epsilon: float
    delta: float
    process: PrivacyProcess
    bracket: tuple[float, float | None]
    evaluations: int


def _describe(budget: PrivacyBudget) -> str:
    if isinstance(budget, EpsilonBudget):
        return f"epsilon <= {budget.epsilon:g} at delta = {budget.delta:g}"
    return f"delta <= {budget.delta:g} at epsilon = {budget.epsilon:g}"


def calibrate(
    budget: PrivacyBudget,
    make_process: Callable[[float], PrivacyProcess],
    param_min: float,
    param_max: float,
    *,
    tol: float = 1e-3,
    accountant: str | Accountant = "pld",
    increasing: bool | None = None,
) -> CalibrationResult:
    """Find the parameter in [param_min, param_max] that best uses ``budget`` (bisection).

    "Best" is the boundary of the feasible set: the smallest feasible parameter when privacy
    spent decreases with it (a noise multiplier), the largest when it increases (a sample rate
    or step count). The returned parameter has itself been accounted for, so it always meets
    the budget (achieved epsilon <= target, never above); the bisection stops when the feasible
    and infeasible ends are within ``tol * |param|`` of each other, so the achieved epsilon is
    below the target by at most about ``|d eps / d log param| * tol`` (for DP-SGD noise
    multipliers that is about 0.1-0.3 % of the target at the default tolerance).

    Args:
        budget: from :func:`epsilon_budget` or :func:`delta_budget`.
        make_process: maps a parameter value (float) to a privacy process.
        param_min, param_max: the search range, finite, ``param_min < param_max``.
        tol: relative width of the final bracket, in (0, 1).
        accountant: ``"pld"``, ``"rdp"`` or an :class:`Accountant`.
        increasing: whether spent privacy increases with the parameter. ``None`` infers it by
            accounting both ends (one extra evaluation).

    Returns:
        A :class:`CalibrationResult` with ``.param`` and the achieved ``.epsilon``/``.delta``.

    Raises:
        CalibrationError: no parameter in the range meets the budget; the message names the end
            that came closest and by how much it missed.
        ConfigurationError: an invalid range or ``tol``, or ``increasing=None`` and both ends
            spend exactly the same (direction unknown).
        InputTypeError: ``budget`` is not a budget or ``make_process`` does not return a process.

    ``NotPrivateWarning`` from ``make_process`` (for example ``gaussian(0)`` at
    ``param_min = 0``) is silenced while probing.

    Example::

        >>> from opake_compile import accounting as acc
        >>> budget = acc.epsilon_budget(2.0, delta=1e-5)
        >>> result = acc.calibrate(
        ...     budget,
        ...     lambda sigma: acc.dpsgd_step_process(sigma, sample_rate=0.01) * 500,
        ...     0.3, 10.0,
        ...     accountant="rdp",
        ... )
        >>> 1.99 < result.epsilon <= 2.0
        True
    """
    if not isinstance(budget, PrivacyBudget):
        raise InputTypeError(
            f"Expected budget from epsilon_budget() or delta_budget(), got {type(budget).__name__}."
        )
    if not callable(make_process):
        raise InputTypeError(f"Expected make_process to be callable, got {type(make_process).__name__}.")
    lo = _as_float("param_min", param_min)
    hi = _as_float("param_max", param_max)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ConfigurationError(f"Expected finite param_min={lo!r} < param_max={hi!r}.")
    tol = _as_float("tol", tol)
    if not 0 < tol < 1:
        raise ConfigurationError(f"Expected tol={tol!r} in (0, 1).")
    if increasing is not None and not isinstance(increasing, bool):
        raise InputTypeError(f"Expected increasing to be a bool or None, got {type(increasing).__name__}.")
    acc = _resolve(accountant)
    evaluations = 0

    def spend(param: float) -> tuple[PrivacyProcess, float]:
        nonlocal evaluations
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotPrivateWarning)
            process = _check_process(make_process(param), name="make_process(param)")
        evaluations += 1
        return process, budget.spent(process, acc)

    target = budget.target
    if increasing is None:
        ends = {lo: spend(lo), hi: spend(hi)}
        if ends[lo][1] == ends[hi][1]:
            if ends[lo][1] > target:
                _fail(
                    budget,
                    ends[lo][1],
                    f"at both param_min = {lo:g} and param_max = {hi:g}",
                    "Widen the range or relax the budget.",
                )
            raise ConfigurationError(
                f"make_process spends the same {budget.quantity}={ends[lo][1]:g} at "
                f"param_min={lo:g} and param_max={hi:g}, so the direction of the search is "
                "unknown; pass increasing=True or False."
            )
        increasing = ends[hi][1] > ends[lo][1]
    else:
        ends = {}
    best, worst = (lo, hi) if increasing else (hi, lo)
    best_process, best_spent = ends[best] if best in ends else spend(best)
    if best_spent > target:
        which = "param_min" if best == lo else "param_max"
        _fail(
            budget,
            best_spent,
            f"even at {which} = {best:g}, the most private end",
            f"Move {which} {'down' if best == lo else 'up'} or relax the budget.",
        )
    worst_process, worst_spent = ends[worst] if worst in ends else spend(worst)
    if worst_spent <= target:
        feasible, infeasible, process, spent = worst, None, worst_process, worst_spent
    else:
        feasible, infeasible, process, spent = best, worst, best_process, best_spent
        for _ in range(_MAX_BISECTIONS):
            if abs(infeasible - feasible) <= tol * max(abs(feasible), abs(infeasible)):
                break
            mid = 0.5 * (feasible + infeasible)
            mid_process, mid_spent = spend(mid)
            if mid_spent <= target:
                feasible, process, spent = mid, mid_process, mid_spent
            else:
                infeasible = mid
    if isinstance(budget, EpsilonBudget):
        epsilon, delta = spent, budget.delta
    else:
        epsilon, delta = budget.epsilon, spent
    return CalibrationResult(feasible, epsilon, delta, process, (feasible, infeasible), evaluations)


def _fail(budget: PrivacyBudget, spent: float, where: str, hint: str) -> None:
    target = budget.target
    over = spent - target
    relative = f" ({over / target:.1%} over)" if target > 0 and math.isfinite(over) else ""
    raise CalibrationError(
        f"No parameter in the range meets the budget {_describe(budget)}: {where}, the process "
        f"spends {budget.quantity} = {spent:g}, {over:g} above the target {target:g}{relative}. "
        f"{hint}"
    )
