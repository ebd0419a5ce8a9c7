"""Accountants (PLD or RDP, both from dp-accounting) and privacy budgets.

Public names are re-exported from :mod:`opake_compile.accounting`.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from opake_compile._accounting_bridge import PLDCache, compose, validate_options
from opake_compile._accounting_process import PrivacyProcess
from opake_compile._validate import _as_float, check_nonnegative_int, check_probability
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = [
    "Accountant",
    "PrivacyBudget",
    "EpsilonBudget",
    "DeltaBudget",
    "epsilon_budget",
    "delta_budget",
]


def _check_epsilon(value: Any, *, name: str = "epsilon") -> float:
    eps = _as_float(name, value)
    if not (math.isfinite(eps) and eps >= 0):
        raise ConfigurationError(f"Expected {name}={eps!r} to be finite and >= 0.")
    return eps


def _check_process(process: Any, *, name: str = "process") -> PrivacyProcess:
    if not isinstance(process, PrivacyProcess):
        raise InputTypeError(
            f"Expected {name} to be a privacy process (gaussian(), poisson(), ...), got "
            f"{type(process).__name__}."
        )
    return process


class PrivacyBudget:
    """Base class of privacy budgets: a target that :meth:`spent` must not exceed."""

    __slots__ = ()

    @property
    def target(self) -> float:
        """The largest allowed value of :meth:`spent`."""
        raise NotImplementedError  # pragma: no cover

    @property
    def quantity(self) -> str:
        """``"epsilon"`` or ``"delta"``: what :meth:`spent` measures."""
        raise NotImplementedError  # pragma: no cover

    def spent(self, process: PrivacyProcess, accountant: Accountant) -> float:
        """What ``process`` spends of this budget's quantity under ``accountant``."""
        raise NotImplementedError  # pragma: no cover

    def allows(self, process: PrivacyProcess, accountant: Accountant) -> bool:
        """Whether ``process`` stays within this budget (``spent <= target``)."""
        return self.spent(process, accountant) <= self.target


@dataclass(frozen=True)
class EpsilonBudget(PrivacyBudget):
    """At most ``epsilon`` (nats) spent at failure probability ``delta``."""

    epsilon: float
    delta: float

    @property
    def target(self) -> float:
        return self.epsilon

    @property
    def quantity(self) -> str:
        return "epsilon"

    def spent(self, process: PrivacyProcess, accountant: Accountant) -> float:
        return accountant.epsilon(process, self.delta)


@dataclass(frozen=True)
class DeltaBudget(PrivacyBudget):
    """At most ``delta`` spent at privacy loss ``epsilon`` (nats)."""

    delta: float
    epsilon: float

    @property
    def target(self) -> float:
        return self.delta

    @property
    def quantity(self) -> str:
        return "delta"

    def spent(self, process: PrivacyProcess, accountant: Accountant) -> float:
        return accountant.delta(process, self.epsilon)


def epsilon_budget(epsilon: float, delta: float) -> EpsilonBudget:
    """A budget of ``epsilon`` (nats) at failure probability ``delta``.

    Args:
        epsilon: finite, >= 0.
        delta: in [0, 1].

    Raises:
        InputTypeError: not real numbers.
        ConfigurationError: out of range.

    Example::

        >>> from opake_compile import accounting as acc
        >>> acc.epsilon_budget(3.0, delta=1e-5)
        EpsilonBudget(epsilon=3.0, delta=1e-05)
    """
    return EpsilonBudget(_check_epsilon(epsilon), check_probability(delta, name="delta"))


def delta_budget(delta: float, epsilon: float) -> DeltaBudget:
    """A budget of failure probability ``delta`` at privacy loss ``epsilon`` (nats).

    Example::

        >>> from opake_compile import accounting as acc
        >>> acc.delta_budget(1e-5, epsilon=3.0)
        DeltaBudget(delta=1e-05, epsilon=3.0)
    """
    return DeltaBudget(check_probability(delta, name="delta"), _check_epsilon(epsilon))


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
        self._max_steps_cache: dict[tuple[PrivacyProcess, PrivacyBudget, int], int] = {}
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

    def epsilon(self, process: PrivacyProcess, delta: float) -> float:
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
        return max(eps, 0.0)

    def delta(self, process: PrivacyProcess, epsilon: float) -> float:
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
        return min(max(delta, 0.0), 1.0)

    def max_steps(self, step_process: PrivacyProcess, budget: PrivacyBudget, *, limit: int = 10**7) -> int:
        """The largest k <= ``limit`` such that ``step_process * k`` stays within ``budget``.

        Exponential bracketing (k = 1, 2, 4, ...) then bisection, so about 2 log2(k) queries;
        results are cached per (step_process, budget, limit) on this accountant. Assumes the
        spent privacy is non-decreasing in k (true for composition).

        Args:
            step_process: the process of one step (for DP-SGD :func:`dpsgd_step_process`).
            budget: from :func:`epsilon_budget` or :func:`delta_budget`.
            limit: the largest k considered (int >= 0).

        Returns:
            0 when a single step already exceeds the budget; ``limit`` when ``limit`` steps fit.

        Raises:
            InputTypeError, ConfigurationError: as :meth:`epsilon` / :meth:`delta`.
        """
        step_process = _check_process(step_process, name="step_process")
        if not isinstance(budget, PrivacyBudget):
            raise InputTypeError(
                "Expected budget from epsilon_budget() or delta_budget(), got "
                f"{type(budget).__name__}."
            )
        limit = check_nonnegative_int(limit, name="limit")
        key = (step_process, budget, limit)
        if key not in self._max_steps_cache:
            self._max_steps_cache[key] = self._search_max_steps(step_process, budget, limit)
        return self._max_steps_cache[key]

    def _search_max_steps(self, step: PrivacyProcess, budget: PrivacyBudget, limit: int) -> int:
        def fits(k: int) -> bool:
            return budget.allows(step * k, self)

        if limit == 0 or not fits(1):
            return 0
        good, bad, growth = 1, None, 2  # fits(good) holds; fits(bad) fails
        start = self._rdp_start(step, budget, limit)
        if start > 1 and fits(start):
            # RDP is looser than PLD, so its answer is usually just below PLD's: bracket
            # upwards from there in small steps instead of from 1 in doublings.
            good, growth = start, 1.25
        while bad is None:
            candidate = min(max(int(good * growth), good + 1), limit)
            if candidate == good:  # good == limit
                return limit
            if fits(candidate):
                good = candidate
            else:
                bad = candidate
        while bad - good > 1:
            mid = (good + bad) // 2
            if fits(mid):
                good = mid
            else:
                bad = mid
        return good

    def _rdp_start(self, step: PrivacyProcess, budget: PrivacyBudget, limit: int) -> int:
        """A cheap first guess for the PLD search (only a guess: every answer is still decided
        by this accountant's own queries). 0 when RDP cannot account for the process."""
        if self._method != "pld":
            return 0
        try:
            return Accountant("rdp").max_steps(step, budget, limit=limit)
        except ConfigurationError:
            return 0
