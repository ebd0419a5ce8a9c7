"""Layer 1c: privacy budgets, the targets that calibration and the optimizer's guard respect.

A budget names a quantity the accountant measures on a process (epsilon at a delta, delta at an
epsilon, or an f-DP view), a target, and on which side of the target a process is private
enough. Budgets only *call* the accountant they are given, so this module imports no other
accounting layer. Public names are re-exported from :mod:`opake_compile.accounting`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from opake_compile._validate import _as_float, check_probability
from opake_compile.exceptions import ConfigurationError

__all__ = [
    "PrivacyBudget",
    "EpsilonBudget",
    "DeltaBudget",
    "AdvantageBudget",
    "BetaBudget",
    "RiskBudget",
    "epsilon_budget",
    "delta_budget",
    "advantage_budget",
    "beta_budget",
    "risk_budget",
]


def _check_epsilon(value: Any, *, name: str = "epsilon") -> float:
    eps = _as_float(name, value)
    if not (math.isfinite(eps) and eps >= 0):
        raise ConfigurationError(f"Expected {name}={eps!r} to be finite and >= 0.")
    return eps


class PrivacyBudget:
    """Base class of privacy budgets: a target that :meth:`spent` must not cross.

    For epsilon, delta and advantage budgets a process is within the budget when
    ``spent <= target``; for the beta and risk budgets (errors an attacker must at least make)
    when ``spent >= target`` (:attr:`larger_is_private`).
    """

    __slots__ = ()

    #: Whether larger values of :meth:`spent` are more private (beta, risk).
    larger_is_private = False

    @property
    def target(self) -> float:
        """The bound on :meth:`spent`."""
        raise NotImplementedError  # pragma: no cover

    @property
    def quantity(self) -> str:
        """What :meth:`spent` measures: ``"epsilon"``, ``"delta"``, ``"advantage"``, ``"beta"``
        or ``"risk"``."""
        raise NotImplementedError  # pragma: no cover

    def spent(self, process: Any, accountant: Any) -> float:
        """What ``process`` spends of this budget's quantity under ``accountant``."""
        raise NotImplementedError  # pragma: no cover

    def excess(self, value: float) -> float:
        """How far ``value`` of :meth:`spent` is on the wrong side of the target (<= 0: within)."""
        return self.target - value if self.larger_is_private else value - self.target

    def allows(self, process: Any, accountant: Any) -> bool:
        """Whether ``process`` stays within this budget."""
        return self.excess(self.spent(process, accountant)) <= 0

    def describe(self) -> str:
        """The budget in words, for messages."""
        raise NotImplementedError  # pragma: no cover


@dataclass(frozen=True)
class EpsilonBudget(PrivacyBudget):
    """At most ``epsilon`` (nats) spent at failure probability ``delta``."""

    epsilon: float
    delta: float

    target = property(lambda self: self.epsilon)
    quantity = property(lambda self: "epsilon")

    def spent(self, process: Any, accountant: Any) -> float:
        return accountant.epsilon(process, self.delta)

    def describe(self) -> str:
        return f"epsilon <= {self.epsilon:g} at delta = {self.delta:g}"


@dataclass(frozen=True)
class DeltaBudget(PrivacyBudget):
    """At most ``delta`` spent at privacy loss ``epsilon`` (nats)."""

    delta: float
    epsilon: float

    target = property(lambda self: self.delta)
    quantity = property(lambda self: "delta")

    def spent(self, process: Any, accountant: Any) -> float:
        return accountant.delta(process, self.epsilon)

    def describe(self) -> str:
        return f"delta <= {self.delta:g} at epsilon = {self.epsilon:g}"


@dataclass(frozen=True)
class AdvantageBudget(PrivacyBudget):
    """Every membership test has TPR - FPR at most ``advantage`` (delta at epsilon = 0)."""

    advantage: float

    target = property(lambda self: self.advantage)
    quantity = property(lambda self: "advantage")

    def spent(self, process: Any, accountant: Any) -> float:
        return accountant.advantage(process)

    def describe(self) -> str:
        return f"advantage <= {self.advantage:g}"


@dataclass(frozen=True)
class BetaBudget(PrivacyBudget):
    """Every membership test with false-positive rate ``alpha`` misses members with
    probability at least ``beta`` (the trade-off curve stays above (alpha, beta))."""

    alpha: float
    beta: float
    larger_is_private = True

    target = property(lambda self: self.beta)
    quantity = property(lambda self: "beta")

    def spent(self, process: Any, accountant: Any) -> float:
        return accountant.beta(process, self.alpha)

    def describe(self) -> str:
        return f"beta >= {self.beta:g} at alpha = {self.alpha:g}"


@dataclass(frozen=True)
class RiskBudget(PrivacyBudget):
    """Every membership test errs with probability at least ``risk`` at prior ``prior``."""

    prior: float
    risk: float
    larger_is_private = True

    target = property(lambda self: self.risk)
    quantity = property(lambda self: "risk")

    def spent(self, process: Any, accountant: Any) -> float:
        return accountant.risk(process, self.prior)

    def describe(self) -> str:
        return f"Bayes risk >= {self.risk:g} at prior = {self.prior:g}"


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


def advantage_budget(advantage: float) -> AdvantageBudget:
    """A budget on the membership advantage: max over tests of TPR - FPR <= ``advantage``.

    Equivalent to ``delta_budget(advantage, epsilon=0)`` (Dong, Roth and Su 2022).

    Args:
        advantage: in [0, 1].

    Raises:
        InputTypeError: not a real number.
        ConfigurationError: outside [0, 1].

    Example::

        >>> from opake_compile import accounting as acc
        >>> r = acc.calibrate(acc.advantage_budget(0.1), lambda s: acc.gaussian(s), 1.0, 100.0)
        >>> acc.gaussian(r.param).advantage() <= 0.1
        True
    """
    return AdvantageBudget(check_probability(advantage, name="advantage"))


def beta_budget(alpha: float, beta: float) -> BetaBudget:
    """A budget on the trade-off curve: ``beta(alpha) >= beta``.

    "No membership test with false-positive rate ``alpha`` detects members with probability
    above ``1 - beta``."

    Args:
        alpha: type-I error in [0, 1].
        beta: the type-II error floor, in [0, 1 - alpha] (1 - alpha is perfect privacy).

    Raises:
        InputTypeError: not real numbers.
        ConfigurationError: out of range.

    Example::

        >>> from opake_compile import accounting as acc
        >>> acc.beta_budget(0.05, 0.9)
        BetaBudget(alpha=0.05, beta=0.9)
    """
    a = check_probability(alpha, name="alpha")
    b = check_probability(beta, name="beta")
    if a + b > 1:
        raise ConfigurationError(f"Expected beta={b!r} <= 1 - alpha = {1 - a!r}: no test does worse than guessing.")
    return BetaBudget(a, b)


def risk_budget(prior: float, risk: float) -> RiskBudget:
    """A budget on the Bayes risk of a membership test at prior ``prior``: ``risk_at(prior) >= risk``.

    Args:
        prior: in [0, 1].
        risk: in [0, min(prior, 1 - prior)] (the error of guessing from the prior alone).

    Raises:
        InputTypeError: not real numbers.
        ConfigurationError: out of range.

    Example::

        >>> from opake_compile import accounting as acc
        >>> acc.risk_budget(0.5, 0.45)
        RiskBudget(prior=0.5, risk=0.45)
    """
    p = check_probability(prior, name="prior")
    r = check_probability(risk, name="risk")
    if r > min(p, 1 - p):
        raise ConfigurationError(
            f"Expected risk={r!r} <= min(prior, 1 - prior) = {min(p, 1 - p)!r}, the error of guessing from the prior."
        )
    return RiskBudget(p, r)
