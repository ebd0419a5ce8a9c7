"""Layer 2: the process algebra. Immutable descriptions of what touched the data.

A process is a frozen, hashable value. ``p * k`` repeats ``p`` k times (adaptive composition),
``a | b`` composes different parts, and :meth:`PrivacyProcess.to_dp_event` maps the value onto
dp-accounting's ``DpEvent`` vocabulary, which is what every accountant consumes. This module
holds the algebra and the mechanisms that are not DP-SGD specific (:func:`eps_delta`,
:func:`identity`, :func:`nonprivate`); the DP-SGD mechanisms live in ``_mechanisms``. Queries
(``epsilon_at``, ``beta_at``, ...) are answered by the accountant of ``_accountant`` (the layer
below), so nothing here imports upwards. Public names are re-exported from
:mod:`opake_compile.accounting`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any

from dp_accounting import dp_event

from opake_compile._validate import NotPrivateWarning, _as_float, check_nonnegative_int, check_probability
from opake_compile.accounting._accountant import Accountant
from opake_compile.accounting._bridge import EpsilonDeltaDpEvent
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = [
    "PrivacyProcess",
    "EpsDeltaMechanism",
    "IdentityProcess",
    "NonPrivateProcess",
    "Repeated",
    "Composed",
    "eps_delta",
    "identity",
    "nonprivate",
]


class PrivacyProcess:
    """Base class of every privacy process (an immutable, hashable value).

    Subclasses are frozen dataclasses; build them with :func:`gaussian`, :func:`poisson`,
    :func:`eps_delta`, :func:`identity`, :func:`nonprivate` and the operators:

    * ``p * k`` (or ``k * p``), ``k`` an int >= 0: ``p`` run ``k`` times, adaptively;
      ``k = 0`` costs nothing.
    * ``a | b``: ``a`` and ``b`` both run (in any order, adaptively).

    Example::

        >>> from opake_compile import accounting as acc
        >>> step = acc.poisson(acc.gaussian(1.1), sample_rate=0.01)
        >>> run = step * 1000 | acc.gaussian(20.0)      # training, then one noisy release
        >>> round(run.epsilon_at(1e-5), 1)
        1.5
    """

    __slots__ = ()

    # --- operators -------------------------------------------------------------------------
    def __mul__(self, count: Any) -> PrivacyProcess:
        if isinstance(count, numbers.Real) and not isinstance(count, numbers.Integral):
            raise InputTypeError(f"Expected an int repeat count, got {type(count).__name__} {count!r}.")
        if isinstance(count, bool) or not isinstance(count, numbers.Integral):
            return NotImplemented
        count = check_nonnegative_int(count, name="count")
        if isinstance(self, Repeated):  # (p * a) * b == p * (a * b)
            return Repeated(self.process, self.count * count)
        return Repeated(self, count)

    __rmul__ = __mul__

    def __or__(self, other: Any) -> PrivacyProcess:
        if not isinstance(other, PrivacyProcess):
            return NotImplemented
        parts: list[PrivacyProcess] = []
        for part in (self, other):
            parts.extend(part.parts if isinstance(part, Composed) else (part,))
        return Composed(tuple(parts))

    # --- mapping onto dp-accounting --------------------------------------------------------
    def to_dp_event(self) -> dp_event.DpEvent:
        """The dp-accounting ``DpEvent`` describing this process.

        The mapping is exact and simplifies where dp-accounting would otherwise do needless
        (or numerically lossy) work: parts that cost nothing (``k = 0``, ``q = 0``,
        :func:`identity`) become ``NoOpDpEvent``; Poisson sampling with ``q = 1`` is the bare
        mechanism; a Poisson-sampled composition of Gaussians is one Gaussian with the
        effective noise multiplier (Mironov et al. 2019, Section 3). A mechanism known only by
        (epsilon, delta) maps to :class:`~opake_compile.accounting._bridge.EpsilonDeltaDpEvent`,
        which dp-accounting's own accountants reject as unsupported.

        Raises:
            ConfigurationError: truncated Poisson sampling with a dp-accounting that has no
                truncated event.
        """
        raise NotImplementedError  # pragma: no cover - every subclass overrides it

    # --- queries ---------------------------------------------------------------------------
    def epsilon_at(self, delta: float, *, accountant: str | Accountant = "pld") -> float:
        """The epsilon (nats) this process spends at failure probability ``delta``.

        Args:
            delta: target delta in [0, 1].
            accountant: ``"pld"`` (default: privacy loss distributions, Koskela et al. 2020,
                Doroshenko et al. 2022; pessimistic, i.e. never below the true value),
                ``"rdp"`` (Renyi DP, Mironov 2017; looser, faster) or an :class:`Accountant`.

        Returns:
            epsilon >= 0; ``math.inf`` when no finite epsilon reaches ``delta`` (for example
            ``gaussian(0)`` or :func:`nonprivate`).

        Raises:
            ConfigurationError: ``delta`` outside [0, 1], or the accountant cannot account for a
                part of the process (for example truncated Poisson sampling under RDP).
        """
        return _resolve(accountant).epsilon(self, delta)

    def delta_at(self, epsilon: float, *, accountant: str | Accountant = "pld") -> float:
        """The delta this process spends at privacy loss ``epsilon`` (nats).

        Args:
            epsilon: target epsilon, finite and >= 0.
            accountant: as in :meth:`epsilon_at`.

        Returns:
            delta in [0, 1]; 1 for a non-private process.

        Raises:
            ConfigurationError: ``epsilon`` negative or not finite, or an unsupported part.
        """
        return _resolve(accountant).delta(self, epsilon)

    # --- f-DP views (Dong, Roth and Su 2022), derived from the privacy profile ---------------
    def advantage(self, *, accountant: str | Accountant = "pld") -> float:
        """The largest advantage of any membership test: max over tests of TPR - FPR.

        Equal to the total-variation distance of the neighbouring output distributions, i.e.
        ``delta_at(0)``. For ``gaussian(1/mu)`` (mu-GDP) it is ``2 Phi(mu/2) - 1``. Pessimistic
        with the PLD accountant (never below the true advantage).

        Returns:
            advantage in [0, 1].

        Example::

            >>> from opake_compile import accounting as acc
            >>> round(acc.gaussian(1.0).advantage(), 3)   # 2 Phi(1/2) - 1 = 0.3829
            0.383
        """
        return _resolve(accountant).advantage(self)

    def beta_at(self, alpha: float, *, accountant: str | Accountant = "pld") -> float:
        """The trade-off curve: the smallest type-II error of a membership test at type-I error
        ``alpha`` (the f of f-DP, Dong, Roth and Su 2022).

        Derived from the privacy profile delta(eps) that the accountant computes:
        ``beta(alpha) = sup_{eps >= 0} max(0, 1 - delta(eps) - e^eps alpha,
        e^-eps (1 - delta(eps) - alpha))`` (Dong et al. 2022, Prop. 2.12, symmetrised), evaluated
        on finitely many eps, so the result is never above the true curve: pessimistic, like the
        PLD itself. For ``gaussian(1/mu)`` it is ``Phi(Phi^-1(1 - alpha) - mu)``.

        Args:
            alpha: type-I error (false-positive rate) in [0, 1].

        Returns:
            beta in [0, 1 - alpha]; 1 - alpha means no test beats guessing.

        Raises:
            ConfigurationError: ``alpha`` outside [0, 1].

        Example::

            >>> from opake_compile import accounting as acc
            >>> round(acc.gaussian(1.0).beta_at(0.05), 3)   # Phi(Phi^-1(0.95) - 1) = 0.7405
            0.74
        """
        return _resolve(accountant).beta(self, alpha)

    def risk_at(self, prior: float, *, accountant: str | Accountant = "pld") -> float:
        """The smallest Bayes error of a membership test at prior ``prior``:
        ``min over tests of prior * alpha + (1 - prior) * beta(alpha)``.

        Closed form in the privacy profile: with ``eps = |log(prior / (1 - prior))|``,
        ``risk = min(prior, 1 - prior) * (1 - delta(eps))`` (the Bayes error of a binary test
        is one minus a hockey-stick divergence). Without any data access the error is
        ``min(prior, 1 - prior)``; a non-private process has risk 0. Pessimistic with PLD
        (never above the true risk).

        Args:
            prior: the attacker's prior probability of either hypothesis, in [0, 1].

        Returns:
            risk in [0, min(prior, 1 - prior)].

        Raises:
            ConfigurationError: ``prior`` outside [0, 1].

        Example::

            >>> from opake_compile import accounting as acc
            >>> round(acc.gaussian(1.0).risk_at(0.5), 4)   # (1 - advantage) / 2
            0.3085
        """
        return _resolve(accountant).risk(self, prior)


def _resolve(accountant: Any) -> Accountant:
    if isinstance(accountant, Accountant):
        return accountant
    if isinstance(accountant, str):
        return Accountant(accountant)
    raise InputTypeError(
        f"Expected accountant to be 'pld', 'rdp' or an Accountant, got {type(accountant).__name__}."
    )


_NOOP = dp_event.NoOpDpEvent()

@dataclass(frozen=True, repr=False)
class EpsDeltaMechanism(PrivacyProcess):
    """A mechanism known only to satisfy (epsilon, delta)-DP (PLD accountant only).

    Attributes:
        epsilon: finite, >= 0 (nats).
        delta: in [0, 1]; delta = 1 is no guarantee at all.
    """

    epsilon: float
    delta: float

    def to_dp_event(self) -> dp_event.DpEvent:
        if self.delta >= 1:
            return dp_event.NonPrivateDpEvent()
        if self.epsilon == 0 and self.delta == 0:
            return _NOOP
        return EpsilonDeltaDpEvent(self.epsilon, self.delta)

    def __repr__(self) -> str:
        return f"eps_delta({self.epsilon!r}, {self.delta!r})"


@dataclass(frozen=True, repr=False)
class IdentityProcess(PrivacyProcess):
    """A step that does not touch private data (costs nothing)."""

    def to_dp_event(self) -> dp_event.DpEvent:
        return _NOOP

    def __repr__(self) -> str:
        return "identity()"


@dataclass(frozen=True, repr=False)
class NonPrivateProcess(PrivacyProcess):
    """A step with no privacy guarantee: epsilon = inf at every delta < 1."""

    def to_dp_event(self) -> dp_event.DpEvent:
        return dp_event.NonPrivateDpEvent()

    def __repr__(self) -> str:
        return "nonprivate()"


@dataclass(frozen=True, repr=False)
class Repeated(PrivacyProcess):
    """``process`` run ``count`` times, adaptively (``process * count``)."""

    process: PrivacyProcess
    count: int

    def __post_init__(self) -> None:
        if not isinstance(self.process, PrivacyProcess):
            raise InputTypeError(f"Expected process to be a privacy process, got {type(self.process).__name__}.")
        object.__setattr__(self, "count", check_nonnegative_int(self.count, name="count"))

    def to_dp_event(self) -> dp_event.DpEvent:
        inner = self.process.to_dp_event()
        if self.count == 0 or isinstance(inner, dp_event.NoOpDpEvent):
            return _NOOP
        if self.count == 1:
            return inner
        return dp_event.SelfComposedDpEvent(inner, self.count)

    def __repr__(self) -> str:
        inner = repr(self.process)
        if isinstance(self.process, Composed):
            inner = f"({inner})"
        return f"{inner} * {self.count}"


@dataclass(frozen=True, repr=False)
class Composed(PrivacyProcess):
    """Several processes run on the same data, adaptively (``a | b | ...``)."""

    parts: tuple[PrivacyProcess, ...]

    def to_dp_event(self) -> dp_event.DpEvent:
        events = [e for e in (p.to_dp_event() for p in self.parts) if not isinstance(e, dp_event.NoOpDpEvent)]
        if not events:
            return _NOOP
        if len(events) == 1:
            return events[0]
        return dp_event.ComposedDpEvent(events)

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.parts)

# --- constructors ----------------------------------------------------------------------------

def eps_delta(epsilon: float, delta: float) -> EpsDeltaMechanism:
    """A mechanism known only by its (epsilon, delta)-DP guarantee.

    Composed with the PLD accountant through the worst-case PLD of any (epsilon, delta)-DP
    mechanism (dp-accounting's ``from_privacy_parameters``), i.e. optimal composition
    (Kairouz et al. 2015). The RDP accountant cannot compose it and raises ConfigurationError.

    Args:
        epsilon: finite, >= 0 (nats).
        delta: in [0, 1].

    Raises:
        InputTypeError: not real numbers.
        ConfigurationError: out of range.

    Warns:
        NotPrivateWarning: ``delta == 1`` (no guarantee).

    Example::

        >>> from opake_compile import accounting as acc
        >>> acc.eps_delta(1.0, 0.0) * 2 | acc.identity()
        eps_delta(1.0, 0.0) * 2 | identity()
    """
    eps = _as_float("epsilon", epsilon)
    if not (math.isfinite(eps) and eps >= 0):
        raise ConfigurationError(f"Expected epsilon={eps!r} to be finite and >= 0.")
    d = check_probability(delta, name="delta")
    if d == 1:
        warnings.warn("eps_delta(..., delta=1) gives no privacy guarantee.", NotPrivateWarning, stacklevel=2)
    return EpsDeltaMechanism(eps, d)


def identity() -> IdentityProcess:
    """A process that costs nothing (a step that touches no private data).

    Example::

        >>> from opake_compile import accounting as acc
        >>> acc.identity().epsilon_at(1e-5)
        0.0
    """
    return IdentityProcess()


def nonprivate() -> NonPrivateProcess:
    """A process with no privacy guarantee (epsilon = inf, delta = 1).

    Warns:
        NotPrivateWarning: always; composing it makes the whole process non-private.

    Example::

        >>> import warnings
        >>> from opake_compile import accounting as acc
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     acc.nonprivate().epsilon_at(1e-5)
        inf
    """
    warnings.warn("nonprivate(): this process has no privacy guarantee.", NotPrivateWarning, stacklevel=2)
    return NonPrivateProcess()
