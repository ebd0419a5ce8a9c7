"""Layer 4: calibrating a mechanism parameter (usually the noise multiplier) to a privacy budget.

Public names are re-exported from :mod:`opake_compile.accounting`.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from opake_compile._validate import NotPrivateWarning, _as_float
from opake_compile.accounting._accountant import Accountant, UnevaluableProcessError, _check_process, coarse_interval
from opake_compile.accounting._budgets import DeltaBudget, EpsilonBudget, PrivacyBudget
from opake_compile.accounting._process import PrivacyProcess, _resolve
from opake_compile.exceptions import CalibrationError, ConfigurationError, InputTypeError

__all__ = ["CalibrationResult", "CalibrationRangeWarning", "calibrate"]

_MAX_BISECTIONS = 200


class CalibrationRangeWarning(UserWarning):
    """:func:`calibrate` returned an end of the search range: even the least private parameter
    in the range meets the budget, so a less private one outside it might too."""


@dataclass(frozen=True)
class CalibrationResult:
    """What :func:`calibrate` found.

    Attributes:
        param: the parameter returned (it meets the budget: it was evaluated).
        epsilon: achieved epsilon (nats) of ``process``: the spent epsilon for an epsilon budget,
            the budget's epsilon for a delta budget, ``nan`` for an f-DP budget.
        delta: achieved delta: the budget's delta for an epsilon budget, the spent delta for a
            delta budget, ``nan`` for an f-DP budget.
        process: ``make_process(param)``.
        bracket: ``(param, other)`` where ``other`` is the nearest evaluated parameter that
            misses the budget (``None`` when the whole range meets it), within ``tol`` of param.
        evaluations: how many processes were accounted for (all accountants together).
        spent: the budget's quantity spent by ``process`` (epsilon, delta, advantage, beta or
            risk), as measured by ``accountant``.
        accountant: the ``repr`` of the accountant that decided ``param`` (with the fast PLD
            search, the coarser PLD grid; see :func:`calibrate`).
        at_range_end: True when even the least private end of the range meets the budget, so
            ``param`` is that end (a :class:`CalibrationRangeWarning` was issued): widen the
            range to use the whole budget.
    """

    param: float
    epsilon: float
    delta: float
    process: PrivacyProcess
    bracket: tuple[float, float | None]
    evaluations: int
    spent: float = math.nan
    accountant: str = ""
    at_range_end: bool = False


def calibrate(
    budget: PrivacyBudget,
    make_process: Callable[[float], PrivacyProcess],
    param_min: float,
    param_max: float,
    *,
    tol: float = 1e-3,
    accountant: str | Accountant = "pld",
    increasing: bool | None = None,
    fast: bool = True,
) -> CalibrationResult:
    """Find the parameter in [param_min, param_max] that best uses ``budget`` (bisection).

    "Best" is the boundary of the feasible set: the smallest feasible parameter when privacy
    spent decreases with it (a noise multiplier), the largest when it increases (a sample rate
    or step count). The returned parameter has itself been accounted for, so it always meets
    the budget under the accountant that decided it (never above the target); the bisection
    stops when the feasible and infeasible ends are within ``tol * |param|`` of each other.

    Fast PLD search (``fast=True``, the default, with a PLD accountant): PLD queries at the
    default grid (1e-4) take seconds each at small noise, so the search first brackets the
    answer with the RDP accountant (looser, milliseconds), then bisects with a *coarser* PLD
    grid (:func:`~opake_compile.accounting._accountant.coarse_interval`: ``2e-3 * epsilon``,
    at most 1e-2, never finer than the accountant's own). The grid's overstatement grows with
    the number of compositions, so one evaluation at a 4x finer grid measures it, and if it
    exceeds 0.2 % of the target the answer is re-solved near the coarse one on a grid fine
    enough to bring it under that (never finer than the accountant's own).

    Stated accuracy: every PLD grid is pessimistic, so the result meets the budget under the
    grid that decided it (``result.accountant``) and is never less private than the
    finest-grid answer; it is within 1 % of it (the finest grid spends more than the budget at
    ``0.99 * param``). ``bench/bench_accounting.py`` checks both on its table (ε from 1 to 100,
    q in {0.004, 0.04}, 10^2 to 10^4 steps). ``fast=False`` bisects with ``accountant`` alone.

    Args:
        budget: from :func:`epsilon_budget`, :func:`delta_budget`, :func:`advantage_budget`,
            :func:`beta_budget` or :func:`risk_budget`.
        make_process: maps a parameter value (float) to a privacy process.
        param_min, param_max: the search range, finite, ``param_min < param_max``.
        tol: relative width of the final bracket, in (0, 1).
        accountant: ``"pld"``, ``"rdp"`` or an :class:`Accountant`.
        increasing: whether spent privacy increases with the parameter. ``None`` infers it by
            accounting both ends (one extra evaluation).
        fast: use the RDP bracket and the coarse PLD grid described above (PLD only).

    Returns:
        A :class:`CalibrationResult` with ``.param`` and the achieved ``.epsilon``/``.delta``.

    Raises:
        CalibrationError: no parameter in the range meets the budget; the message names the end
            that came closest and by how much it missed.
        ConfigurationError: an invalid range or ``tol``, or ``increasing=None`` and both ends
            spend exactly the same (direction unknown).
        InputTypeError: ``budget`` is not a budget or ``make_process`` does not return a process.

    Warns:
        CalibrationRangeWarning: even the least private end of the range meets the budget; it
            is returned with ``at_range_end=True`` (a wider range could use more of the budget).

    ``NotPrivateWarning`` from ``make_process`` (for example ``gaussian(0)`` at
    ``param_min = 0``) is silenced while probing.

    Example::

        >>> from opake_compile import accounting as acc
        >>> budget = acc.epsilon_budget(2.0, delta=1e-5)
        >>> result = acc.calibrate(
        ...     budget,
        ...     lambda sigma: acc.dpsgd_step_process(sigma, sample_rate=0.01) * 500,
        ...     0.3, 10.0,
        ... )
        >>> 1.99 < result.epsilon <= 2.0
        True
    """
    if not isinstance(budget, PrivacyBudget):
        raise InputTypeError(
            f"Expected a budget (epsilon_budget(), delta_budget(), advantage_budget(), ...), got {type(budget).__name__}."
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
    if not isinstance(fast, bool):
        raise InputTypeError(f"Expected fast to be a bool, got {type(fast).__name__}.")
    acc = _resolve(accountant)
    search = _Search(budget, make_process)
    if fast and acc.method == "pld":
        own = acc.options["value_discretization_interval"]
        coarse = Accountant("pld", value_discretization_interval=max(own, coarse_interval(budget)))
        lo_b, hi_b, increasing = _rdp_bracket(search, lo, hi, increasing)
        result = _bracketed(search, coarse, lo, hi, lo_b, hi_b, tol, increasing)
        if result.at_range_end or coarse.options["value_discretization_interval"] <= own:
            return result
        return _refine(search, result, coarse, own, lo, hi, tol)
    return _bisect(search, acc, lo, hi, tol, increasing, inner=(False, False))


def _bracketed(
    search: _Search, acc: Accountant, lo: float, hi: float, lo_b: float, hi_b: float, tol: float, increasing: bool | None
) -> CalibrationResult:
    """Bisection in the bracket [lo_b, hi_b] inside [lo, hi], moved until it holds the answer."""
    for _ in range(64):
        try:
            return _bisect(search, acc, lo_b, hi_b, tol, increasing, inner=(lo_b > lo, hi_b < hi))
        except _OutsideBracket as out:  # the bracket was off: move it past that end
            if out.end == lo_b:
                lo_b, hi_b = max(lo, lo_b / 1.5), lo_b
            else:
                lo_b, hi_b = hi_b, min(hi, hi_b * 1.5)
    return _bisect(search, acc, lo, hi, tol, increasing, inner=(False, False))  # pragma: no cover


#: The grid may move the spent quantity by at most this fraction of the target.
_GRID_ERROR = 2e-3


def _refine(
    search: _Search, result: CalibrationResult, coarse: Accountant, own: float, lo: float, hi: float, tol: float
) -> CalibrationResult:
    """Re-solve on a finer grid when the coarse grid's overstatement matters.

    The pessimistic PLD overstates the spent quantity by about ``c * interval`` (``c`` grows
    with the number of compositions: ~3e-3 per step and unit interval for subsampled Gaussians).
    One evaluation at a 4x finer grid estimates ``c``; if the coarse grid's error
    ``c * interval`` exceeds ``_GRID_ERROR`` of the target, the answer is re-solved by bisection
    near the coarse answer on the grid ``_GRID_ERROR * target / c`` (never finer than the
    accountant's own), so the answer stays within about 0.2 % of the target's worth of noise of
    the finest-grid answer, and on the private side of it.
    """
    budget = search.budget
    delta_c = coarse.options["value_discretization_interval"]
    delta_q = max(own, delta_c / 4)
    spent_q = search.spend(result.param, Accountant("pld", value_discretization_interval=delta_q))[1]
    slope = abs(result.spent - spent_q) / (delta_c - delta_q)
    allowed = _GRID_ERROR * abs(budget.target)
    if not (math.isfinite(slope) and slope * delta_c > allowed):
        return result
    delta_f = max(own, min(delta_q, allowed / slope if slope > 0 else delta_q))
    fine = Accountant("pld", value_discretization_interval=delta_f)
    param, other = result.bracket
    increasing = other is not None and other > param  # the infeasible side is the less private one
    # The fine grid frees about slope * (delta_c - delta_f) of the target; privacy spent moves
    # at least proportionally to the parameter for DP-SGD mechanisms, so twice that relative
    # gap (at least 0.5 %, at most 5 %) brackets the answer; if not, the bracket moves.
    gap = slope * (delta_c - delta_f) / abs(budget.target) if budget.target else 0.05
    width = 1.0 + min(0.05, max(0.005, 2.0 * gap))
    if increasing:
        lo_b, hi_b = param, min(hi, param * width)
    else:
        lo_b, hi_b = max(lo, param / width), param
    return _bracketed(search, fine, lo, hi, lo_b, hi_b, tol, increasing)


class _OutsideBracket(Exception):
    """The answer lies beyond ``end``, an interior end of the bracket (the most private end
    misses the budget, or the least private one meets it)."""

    def __init__(self, end: float) -> None:
        super().__init__(end)
        self.end = end


class _Search:
    """``make_process`` with its evaluations counted."""

    def __init__(self, budget: PrivacyBudget, make_process: Callable[[float], PrivacyProcess]) -> None:
        self.budget = budget
        self.make_process = make_process
        self.evaluations = 0

    def spend(self, param: float, acc: Accountant) -> tuple[PrivacyProcess, float]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotPrivateWarning)
            process = _check_process(self.make_process(param), name="make_process(param)")
        self.evaluations += 1
        try:
            return process, float(self.budget.spent(process, acc))
        except UnevaluableProcessError:  # a loss too large to compute: more than any budget
            return process, math.inf


def _rdp_bracket(search: _Search, lo: float, hi: float, increasing: bool | None) -> tuple[float, float, bool | None]:
    """A narrow bracket around the answer from the RDP accountant, or the range unchanged.

    RDP's epsilon is an upper bound that is usually above PLD's, so the PLD answer is usually
    a little less private than RDP's: the bracket reaches 1 % to the private side of the RDP
    answer and a factor 1.5 to the other. The PLD bisection checks both ends and widens the
    bracket if the answer lies outside. Only for epsilon and delta budgets (the f-DP views have
    no cheap RDP form); returns the direction it found.
    """
    budget = search.budget
    if not isinstance(budget, (EpsilonBudget, DeltaBudget)):
        return lo, hi, increasing
    rdp = Accountant("rdp")
    absl = logging.getLogger("absl")  # dp-accounting's RDP code logs harmless convergence notes
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        result = _bisect(search, rdp, lo, hi, 1e-2, increasing, inner=(False, False), quiet=True)
    except (CalibrationError, ConfigurationError):
        return lo, hi, increasing
    finally:
        absl.setLevel(level)
    if result.at_range_end or result.bracket[1] is None:
        return lo, hi, increasing
    param, other = result.bracket
    inc = other > param  # the infeasible side is the less private one
    if inc:  # the answer lies at or above the RDP answer
        return max(lo, param * 0.99), min(hi, param * 1.5), inc
    return max(lo, param / 1.5), min(hi, param * 1.01), inc


def _bisect(
    search: _Search,
    acc: Accountant,
    lo: float,
    hi: float,
    tol: float,
    increasing: bool | None,
    *,
    inner: tuple[bool, bool],
    quiet: bool = False,
) -> CalibrationResult:
    """Bisection for the feasible boundary in [lo, hi]. ``inner``: whether lo, hi are interior
    points of the user's range (a bracket); an answer beyond such an end raises
    :class:`_OutsideBracket` instead of failing or returning the end."""
    budget = search.budget

    def excess(value: float) -> float:
        e = budget.excess(value)
        return math.inf if math.isnan(e) else e

    if increasing is None:
        ends = {lo: search.spend(lo, acc), hi: search.spend(hi, acc)}
        if ends[lo][1] == ends[hi][1]:
            if excess(ends[lo][1]) > 0:
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
        increasing = excess(ends[hi][1]) > excess(ends[lo][1])
    else:
        ends = {}
    best, worst = (lo, hi) if increasing else (hi, lo)
    interior = {lo: inner[0], hi: inner[1]}
    best_process, best_spent = ends[best] if best in ends else search.spend(best, acc)
    if excess(best_spent) > 0:
        if interior[best]:
            raise _OutsideBracket(best)
        which = "param_min" if best == lo else "param_max"
        _fail(
            budget,
            best_spent,
            f"even at {which} = {best:g}, the most private end",
            f"Move {which} {'down' if best == lo else 'up'} or relax the budget.",
        )
    worst_process, worst_spent = ends[worst] if worst in ends else search.spend(worst, acc)
    at_range_end = excess(worst_spent) <= 0
    if at_range_end:
        if interior[worst]:
            raise _OutsideBracket(worst)
        feasible, infeasible, process, spent = worst, None, worst_process, worst_spent
        if not quiet:
            which = "param_max" if worst == hi else "param_min"
            warnings.warn(
                f"calibrate: even the least private end of the range, {which} = {worst:g}, meets the "
                f"budget {budget.describe()} (it spends {budget.quantity} = {worst_spent:g}); returning it "
                "with at_range_end=True. Widen the range to use the whole budget.",
                CalibrationRangeWarning,
                stacklevel=3,
            )
    else:
        feasible, infeasible, process, spent = best, worst, best_process, best_spent
        for _ in range(_MAX_BISECTIONS):
            if abs(infeasible - feasible) <= tol * max(abs(feasible), abs(infeasible)):
                break
            mid = 0.5 * (feasible + infeasible)
            mid_process, mid_spent = search.spend(mid, acc)
            if excess(mid_spent) <= 0:
                feasible, process, spent = mid, mid_process, mid_spent
            else:
                infeasible = mid
    if isinstance(budget, EpsilonBudget):
        epsilon, delta = spent, budget.delta
    elif isinstance(budget, DeltaBudget):
        epsilon, delta = budget.epsilon, spent
    else:
        epsilon = delta = math.nan
    return CalibrationResult(
        feasible, epsilon, delta, process, (feasible, infeasible), search.evaluations, spent, repr(acc), at_range_end
    )


def _fail(budget: PrivacyBudget, spent: float, where: str, hint: str) -> None:
    target = budget.target
    over = budget.excess(spent)
    relative = f" ({over / target:.1%} beyond it)" if target > 0 and math.isfinite(over) else ""
    side = "below" if budget.larger_is_private else "above"
    raise CalibrationError(
        f"No parameter in the range meets the budget {budget.describe()}: {where}, the process "
        f"spends {budget.quantity} = {spent:g}, {abs(over):g} {side} the target {target:g}{relative}. "
        f"{hint}"
    )
