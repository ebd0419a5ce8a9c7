"""Layer 1d: the accountant. dp-accounting's PLD (default) or RDP accountant behind one interface.

Answers every query on a process (epsilon, delta and the f-DP views) from the ``DpEvent`` the
process maps to; it needs only that method, so it imports no process class and the process
algebra (layer 2) can call it without an import cycle. Results are :class:`PrivacyValue`, plain
floats that also say which accountant produced them. Public names are re-exported from
:mod:`opake_compile.accounting`.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from opake_compile._validate import check_nonnegative_int, check_probability
from opake_compile.accounting._bridge import PLDCache, compose, privacy_profile, validate_options
from opake_compile.accounting._budgets import PrivacyBudget, _check_epsilon
from opake_compile.accounting._fdp import advantage_from_profile, beta_from_profile, risk_from_profile
from opake_compile.exceptions import ConfigurationError, InputTypeError, OpakeError

_F = TypeVar("_F", bound=Callable[..., Any])


class UnevaluableProcessError(ConfigurationError):
    """An accountant could not evaluate a process (a PLD grid too large to allocate, an
    overflow): its privacy loss is too large to compute. ``calibrate`` reads it as a parameter
    that spends more than any budget."""


def _numerical_failures(query: _F) -> _F:
    """Report dp-accounting's numerical failures (a PLD grid too large to allocate, an
    overflow) as ConfigurationError naming the process, rather than as NumPy's or Python's own
    errors: they come from a process no accountant can evaluate (a noise multiplier so small
    that epsilon is astronomically large), and a caller checking a budget must get the library's
    error class."""

    @functools.wraps(query)
    def checked(self: Any, process: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return query(self, process, *args, **kwargs)
        except OpakeError:
            raise
        except (ValueError, MemoryError, OverflowError, FloatingPointError, ZeroDivisionError) as err:
            raise UnevaluableProcessError(
                f"{self!r} could not evaluate {process!r} ({type(err).__name__}: {err}); a noise "
                "multiplier this small spends an epsilon too large to compute: raise it, or ask "
                "Accountant('rdp') (an upper bound that needs no grid)."
            ) from err

    return checked  # type: ignore[return-value]

__all__ = ["Accountant", "PrivacyValue", "coarse_interval", "last_fitting"]


class PrivacyValue(float):
    """A privacy quantity (epsilon, delta, advantage, beta or risk): a plain ``float`` that
    also records what produced it.

    It formats, compares and computes exactly like the float it is (``f"{eps:.3f}"``,
    ``eps <= 3.0``, ``json.dumps``); arithmetic returns plain floats.

    Attributes:
        quantity: ``"epsilon"``, ``"delta"``, ``"advantage"``, ``"beta"`` or ``"risk"``.
        accountant: the ``repr`` of the :class:`Accountant` that computed it.
    """

    quantity: str
    accountant: str

    def __new__(cls, value: float, quantity: str = "", accountant: str = "") -> PrivacyValue:
        obj = super().__new__(cls, value)
        obj.quantity = quantity
        obj.accountant = accountant
        return obj

    def __reduce__(self):
        return (PrivacyValue, (float(self), self.quantity, self.accountant))


def _check_process(process: Any, *, name: str = "process") -> Any:
    if not callable(getattr(process, "to_dp_event", None)):
        raise InputTypeError(
            f"Expected {name} to be a privacy process (gaussian(), poisson(), ...), got "
            f"{type(process).__name__}."
        )
    return process


class Accountant:
    """A privacy accountant: dp-accounting's PLD (default) or RDP accountant behind one interface.

    Each query builds a fresh dp-accounting accountant and composes the process's
    ``to_dp_event()``; the object itself holds only its configuration, a cache of
    :meth:`max_steps` results and (PLD) a small memo of single-step PLDs, so repeated queries
    that differ only in the number of steps are cheap. Reuse one instance for that.

    * ``"pld"``: privacy loss distributions (Koskela et al. 2020; Doroshenko et al. 2022),
      pessimistic: the reported epsilon is never below the true one and exceeds it by at most a
      few ``value_discretization_interval``. Option ``value_discretization_interval`` (default
      1e-4; smaller is tighter and slower).
    * ``"rdp"``: Renyi DP (Mironov 2017; Mironov et al. 2019 for subsampling; the moments
      accountant of Abadi et al. 2016 is its special case), an upper bound that is faster but
      looser. Option ``orders`` (default: dp-accounting's orders). Cannot account for
      :func:`eps_delta` parts or truncated Poisson sampling (raises ConfigurationError).

    Args:
        method: ``"pld"`` or ``"rdp"``.
        **options: method-specific options listed above.

    Raises:
        InputTypeError: ``method`` not a string, option of the wrong type.
        ConfigurationError: unknown method or option, option out of range.

    Example::

        >>> from opake_compile import accounting as acc
        >>> accountant = acc.Accountant("rdp")
        >>> step = acc.dpsgd_step_process(noise_multiplier=1.0, sample_rate=0.01)
        >>> k = accountant.max_steps(step, acc.epsilon_budget(1.0, delta=1e-5))
        >>> accountant.epsilon(step * k, 1e-5) <= 1.0 < accountant.epsilon(step * (k + 1), 1e-5)
        True
    """

    def __init__(self, method: str = "pld", **options: Any) -> None:
        self._method, self._options = validate_options(method, options)
        self._max_steps_cache: dict[tuple[Any, PrivacyBudget, int], int] = {}
        self._pld_cache = PLDCache() if self._method == "pld" else None

    @property
    def method(self) -> str:
        """``"pld"`` or ``"rdp"``."""
        return self._method

    @property
    def options(self) -> Mapping[str, Any]:
        """The method's options, defaults filled in (read-only)."""
        return types.MappingProxyType(self._options)

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self._options.items() if v is not None)
        return f"Accountant({self._method!r}{opts})"

    @_numerical_failures
    def epsilon(self, process: Any, delta: float) -> float:
        """The epsilon (nats) ``process`` spends at failure probability ``delta``.

        Returns:
            epsilon >= 0, ``math.inf`` when none reaches ``delta``.

        Raises:
            InputTypeError: ``process`` is not a privacy process.
            ConfigurationError: ``delta`` outside [0, 1], or this accountant cannot account for a
                part of ``process``.
        """
        process = _check_process(process)
        delta = check_probability(delta, name="delta")
        accountant = compose(self._method, self._options, process.to_dp_event(), self._pld_cache)
        eps = float(accountant.get_epsilon(delta))
        return self._value(max(eps, 0.0), "epsilon")

    @_numerical_failures
    def delta(self, process: Any, epsilon: float) -> float:
        """The delta ``process`` spends at privacy loss ``epsilon`` (nats).

        Returns:
            delta in [0, 1].

        Raises:
            InputTypeError: ``process`` is not a privacy process.
            ConfigurationError: ``epsilon`` negative or infinite, or an unsupported part.
        """
        process = _check_process(process)
        epsilon = _check_epsilon(epsilon)
        accountant = compose(self._method, self._options, process.to_dp_event(), self._pld_cache)
        delta = float(accountant.get_delta(epsilon))
        return self._value(min(max(delta, 0.0), 1.0), "delta")

    def _value(self, value: float, quantity: str) -> PrivacyValue:
        return PrivacyValue(value, quantity, repr(self))

    def _profile(self, process: Any):
        process = _check_process(process)
        return privacy_profile(compose(self._method, self._options, process.to_dp_event(), self._pld_cache))

    @_numerical_failures
    def advantage(self, process: Any) -> PrivacyValue:
        """max over membership tests of TPR - FPR, i.e. delta at epsilon = 0 (Dong, Roth and
        Su 2022). Pessimistic (never below the true advantage) with either method.

        Returns:
            advantage in [0, 1].

        Raises:
            InputTypeError, ConfigurationError: as :meth:`epsilon`.
        """
        return self._value(advantage_from_profile(self._profile(process)), "advantage")

    @_numerical_failures
    def beta(self, process: Any, alpha: float) -> PrivacyValue:
        """The trade-off curve at ``alpha``: the smallest type-II error of a membership test
        with type-I error ``alpha``, from the privacy profile (Dong, Roth and Su 2022, Prop.
        2.12). Pessimistic: never above the true curve.

        Returns:
            beta in [0, 1 - alpha].

        Raises:
            InputTypeError: as :meth:`epsilon`.
            ConfigurationError: ``alpha`` outside [0, 1]; an unsupported part.
        """
        alpha = check_probability(alpha, name="alpha")
        return self._value(beta_from_profile(self._profile(process), alpha), "beta")

    @_numerical_failures
    def risk(self, process: Any, prior: float) -> PrivacyValue:
        """The smallest Bayes error of a membership test at prior ``prior``:
        ``min(prior, 1 - prior) * (1 - delta(|log(prior / (1 - prior))|))``. Pessimistic: never
        above the true risk.

        Returns:
            risk in [0, min(prior, 1 - prior)].

        Raises:
            InputTypeError: as :meth:`epsilon`.
            ConfigurationError: ``prior`` outside [0, 1]; an unsupported part.
        """
        prior = check_probability(prior, name="prior")
        return self._value(risk_from_profile(self._profile(process), prior), "risk")

    @_numerical_failures
    def max_steps(self, step_process: Any, budget: PrivacyBudget, *, limit: int = 10**7, exact: bool = True) -> int:
        """The largest k <= ``limit`` such that ``step_process * k`` stays within ``budget``.

        PLD: the answer of a coarser grid (:func:`coarse_interval`; cheap queries) is the
        starting point, then a secant/bisection search (:func:`last_fitting`) settles the exact
        boundary with this accountant's own queries, a handful of them. Without a PLD starting
        point, exponential bracketing then bisection (about 2 log2(k) queries). Results are
        cached per (step_process, budget, limit, exact) on this accountant. Assumes the spent
        privacy is non-decreasing in k (true for composition).

        Args:
            step_process: the process of one step (for DP-SGD :func:`dpsgd_step_process`).
            budget: from :func:`epsilon_budget`, :func:`delta_budget` or an f-DP budget.
            limit: the largest k considered (int >= 0).
            exact: ``False`` answers with the coarser PLD grid alone: still sound (every PLD
                grid is pessimistic) and typically a few percent below the exact count, at a
                fraction of the cost (``DPOptimizer`` guards with it until it nears the end).

        Returns:
            0 when a single step already exceeds the budget; ``limit`` when ``limit`` steps fit.

        Raises:
            InputTypeError, ConfigurationError: as :meth:`epsilon` / :meth:`delta`.
        """
        step_process = _check_process(step_process, name="step_process")
        if not isinstance(budget, PrivacyBudget):
            raise InputTypeError(
                "Expected a budget (epsilon_budget(), delta_budget(), advantage_budget(), ...), got "
                f"{type(budget).__name__}."
            )
        limit = check_nonnegative_int(limit, name="limit")
        if not isinstance(exact, bool):
            raise InputTypeError(f"Expected exact to be a bool, got {type(exact).__name__}.")
        coarse = self._coarse(budget)
        if not exact and coarse is not None:
            return coarse.max_steps(step_process, budget, limit=limit)
        key = (step_process, budget, limit)
        if key not in self._max_steps_cache:
            self._max_steps_cache[key] = self._search_max_steps(step_process, budget, limit)
        return self._max_steps_cache[key]

    def _coarse(self, budget: PrivacyBudget) -> Accountant | None:
        """The coarser PLD accountant for ``budget`` (kept, with its caches), or None."""
        if self._method != "pld":
            return None
        interval = coarse_interval(budget)
        if not interval > self._options["value_discretization_interval"]:
            return None
        companions = self.__dict__.setdefault("_companions", {})
        if interval not in companions:
            companions[interval] = Accountant("pld", value_discretization_interval=interval)
        return companions[interval]

    def _search_max_steps(self, step: Any, budget: PrivacyBudget, limit: int) -> int:
        def excess(k: int) -> float:  # <= 0: k steps fit
            return budget.excess(float(budget.spent(step * k, self)))

        return last_fitting(excess, limit, self._start_hint(step, budget, limit))

    def _start_hint(self, step: Any, budget: PrivacyBudget, limit: int) -> int:
        """A cheap first guess for the search (only a guess: the answer is decided by this
        accountant's own queries near it). PLD: the answer of a coarser PLD grid (itself
        started from RDP); 0 when no cheaper accountant can account for the process."""
        coarse = self._coarse(budget)
        if coarse is None:  # RDP, or already a coarse grid: queries are cheap, no hint needed
            return 0
        try:
            return coarse.max_steps(step, budget, limit=limit)
        except ConfigurationError:  # pragma: no cover - the coarse grid supports what this one does
            return 0


def coarse_interval(budget: PrivacyBudget) -> float:
    """The PLD value discretisation used to search near a budget's boundary.

    PLD with dp-accounting's connect-the-dots discretisation is pessimistic at every grid; its
    epsilon exceeds the finest grid's by roughly ``3e-3 * steps * interval`` for subsampled
    Gaussians (measured: 0.01 at interval 1e-2 for 1000 steps at epsilon 44; 0.05 at 2e-3 for
    10^4 steps at epsilon 1). ``2e-3 * epsilon`` (at most 1e-2) is cheap and close enough up to
    about 10^3 steps; :func:`calibrate` measures the overstatement and refines when it
    matters, and ``max_steps`` only starts its exact search from this grid's answer. 1e-3 for
    budgets not in epsilon.
    """
    target = getattr(budget, "epsilon", None)
    if budget.quantity != "epsilon" or target is None or not target > 0:
        return 1e-3
    return float(min(1e-2, max(1e-4, 2e-3 * target)))


def last_fitting(excess: Any, limit: int, hint: int) -> int:
    """The largest k in [0, limit] with ``excess(k) <= 0``, for ``excess`` non-decreasing in k.

    Brackets around ``hint`` in growing strides (1/64 of it, times 4 each time), then narrows
    the bracket by interpolating on the excess (secant; a bisection whenever the same end was
    kept twice, so it always halves at least every other query). Near a good hint this costs
    a handful of evaluations; without one (hint 0) about 2 log2(k).
    """
    if limit == 0:
        return 0
    values: dict[int, float] = {}

    def f(k: int) -> float:
        if k not in values:
            v = excess(k)
            values[k] = math.inf if math.isnan(v) else v
        return values[k]

    hint = min(max(hint, 1), limit)
    stride = max(1, hint // 64)
    if f(hint) <= 0:
        a = hint
        while True:
            if a == limit:
                return limit
            b = min(limit, a + stride)
            if f(b) > 0:
                break
            a, stride = b, stride * 4
    else:
        b = hint
        while True:
            a = max(0, b - stride)
            if f(a) <= 0:
                break
            if a == 0:
                return 0
            b, stride = a, stride * 4
    kept_same = 0
    last_side = None
    while b - a > 1:
        fa, fb = f(a), f(b)
        if kept_same >= 2 or not (math.isfinite(fa) and math.isfinite(fb)) or fb == fa:
            m = (a + b) // 2
        else:
            m = a + int(round((b - a) * (-fa) / (fb - fa)))
        m = min(max(m, a + 1), b - 1)
        side = "a" if f(m) <= 0 else "b"
        if side == "a":
            a = m
        else:
            b = m
        kept_same = kept_same + 1 if side == last_side else 0
        last_side = side
    return a
