"""Composable privacy processes: immutable descriptions of what touched the data.

A process is a frozen, hashable value. ``p * k`` repeats ``p`` k times (adaptive composition),
``a | b`` composes different parts, and :meth:`PrivacyProcess.to_dp_event` maps the value onto
dp-accounting's ``DpEvent`` vocabulary, which is what every accountant consumes. Public names
are re-exported from :mod:`opake_compile.accounting`.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dp_accounting import dp_event

from opake_compile._accounting_bridge import TRUNCATED_EVENT, EpsilonDeltaDpEvent, dp_accounting_version
from opake_compile._validate import (
    NotPrivateWarning,
    _as_float,
    check_noise_multiplier,
    check_nonnegative_int,
    check_positive_int,
    check_probability,
)
from opake_compile.exceptions import ConfigurationError, InputTypeError

if TYPE_CHECKING:
    from opake_compile._accounting_accountant import Accountant

__all__ = [
    "PrivacyProcess",
    "GaussianMechanism",
    "AdaClipMechanism",
    "PoissonSampled",
    "EpsDeltaMechanism",
    "IdentityProcess",
    "NonPrivateProcess",
    "Repeated",
    "Composed",
    "gaussian",
    "adaclip",
    "adaclip_noise_multipliers",
    "poisson",
    "eps_delta",
    "identity",
    "nonprivate",
    "dpsgd_step_process",
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
        (epsilon, delta) maps to :class:`~opake_compile._accounting_bridge.EpsilonDeltaDpEvent`,
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


def _resolve(accountant: Any) -> Accountant:
    from opake_compile._accounting_accountant import Accountant

    if isinstance(accountant, Accountant):
        return accountant
    if isinstance(accountant, str):
        return Accountant(accountant)
    raise InputTypeError(
        f"Expected accountant to be 'pld', 'rdp' or an Accountant, got {type(accountant).__name__}."
    )


_NOOP = dp_event.NoOpDpEvent()


@dataclass(frozen=True, repr=False)
class GaussianMechanism(PrivacyProcess):
    """The Gaussian mechanism: a sum of L2-bounded contributions plus N(0, (sigma C)^2) noise.

    Attributes:
        noise_multiplier: sigma, noise std divided by the L2 sensitivity C (unitless).
    """

    noise_multiplier: float

    def to_dp_event(self) -> dp_event.DpEvent:
        return dp_event.GaussianDpEvent(self.noise_multiplier)

    def __repr__(self) -> str:
        return f"gaussian({self.noise_multiplier!r})"


@dataclass(frozen=True, repr=False)
class AdaClipMechanism(PrivacyProcess):
    """One step of adaptive clipping (Andrew et al. 2021): two Gaussian releases, same data.

    The clipped gradient sum (sensitivity C, noise std sigma C) and the count of examples whose
    norm is at most C (sensitivity 1, not centred, noise std sigma_b). Equivalent to
    ``gaussian(noise_multiplier) | gaussian(count_noise_multiplier)``, i.e. one Gaussian
    mechanism with ``effective_noise_multiplier = (sigma^-2 + sigma_b^-2)^(-1/2)``.

    Attributes:
        noise_multiplier: sigma of the gradient query.
        count_noise_multiplier: sigma_b, the std of the noise on the count.
    """

    noise_multiplier: float
    count_noise_multiplier: float

    @property
    def effective_noise_multiplier(self) -> float:
        """(sigma^-2 + sigma_b^-2)^(-1/2); 0 when either is 0."""
        inverse_variance = _inverse_variance(self)
        return 0.0 if math.isinf(inverse_variance) else inverse_variance**-0.5

    def to_dp_event(self) -> dp_event.DpEvent:
        return dp_event.ComposedDpEvent(
            [dp_event.GaussianDpEvent(self.noise_multiplier), dp_event.GaussianDpEvent(self.count_noise_multiplier)]
        )

    def __repr__(self) -> str:
        return f"adaclip({self.noise_multiplier!r}, {self.count_noise_multiplier!r})"


@dataclass(frozen=True, repr=False)
class PoissonSampled(PrivacyProcess):
    """``mechanism`` applied to a Poisson sample: each record joins with probability q.

    Attributes:
        mechanism: a Gaussian, or a composition of Gaussians run on the same sample.
        sample_rate: q in [0, 1].
        truncated_batch_size: if set, samples larger than this are cut down to a random subset of
            this size (accounted for with dp-accounting's truncated event, PLD only).
        dataset_size: N, the number of records; required with ``truncated_batch_size``.
    """

    mechanism: PrivacyProcess
    sample_rate: float
    truncated_batch_size: int | None = None
    dataset_size: int | None = None

    @property
    def noise_multiplier(self) -> float:
        """The effective noise multiplier of ``mechanism`` (inf when it adds nothing)."""
        inverse_variance = _inverse_variance(self.mechanism)
        return math.inf if inverse_variance == 0 else inverse_variance**-0.5

    def to_dp_event(self) -> dp_event.DpEvent:
        sigma = self.noise_multiplier
        if self.sample_rate == 0 or math.isinf(sigma):
            return _NOOP
        truncated = self.truncated_batch_size is not None and (
            self.dataset_size is None or self.truncated_batch_size < self.dataset_size
        )
        if truncated:
            if self.dataset_size is None:
                raise ConfigurationError("truncated Poisson accounting needs dataset_size.")
            if TRUNCATED_EVENT is None:
                raise ConfigurationError(
                    "truncated Poisson sampling is not supported by the accountant yet: "
                    f"dp-accounting {dp_accounting_version()} has no truncated event (0.6 adds "
                    "TruncatedSubsampledGaussianDpEvent). Upgrade dp-accounting or drop "
                    "truncated_batch_size."
                )
            return TRUNCATED_EVENT(
                dataset_size=self.dataset_size,
                sampling_probability=self.sample_rate,
                truncated_batch_size=self.truncated_batch_size,
                noise_multiplier=sigma,
            )
        gaussian_event = dp_event.GaussianDpEvent(sigma)
        if self.sample_rate == 1:
            return gaussian_event
        return dp_event.PoissonSampledDpEvent(self.sample_rate, gaussian_event)

    def __repr__(self) -> str:
        extra = ""
        if self.truncated_batch_size is not None:
            extra += f", truncated_batch_size={self.truncated_batch_size}"
        if self.dataset_size is not None:
            extra += f", dataset_size={self.dataset_size}"
        return f"poisson({self.mechanism!r}, sample_rate={self.sample_rate!r}{extra})"


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


def _inverse_variance(mechanism: PrivacyProcess) -> float:
    """sum of count / sigma^2 over a (nested) composition of Gaussians; inf if a sigma is 0.

    Raises:
        ConfigurationError: a part is not a Gaussian (Poisson sampling of other mechanisms is not
            something dp-accounting can account for).
    """
    if isinstance(mechanism, GaussianMechanism):
        sigma = mechanism.noise_multiplier
        return math.inf if sigma == 0 else sigma**-2
    if isinstance(mechanism, AdaClipMechanism):
        return sum(math.inf if s == 0 else s**-2 for s in (mechanism.noise_multiplier, mechanism.count_noise_multiplier))
    if isinstance(mechanism, IdentityProcess):
        return 0.0
    if isinstance(mechanism, Repeated):
        return 0.0 if mechanism.count == 0 else mechanism.count * _inverse_variance(mechanism.process)
    if isinstance(mechanism, Composed):
        return sum(_inverse_variance(p) for p in mechanism.parts)
    raise ConfigurationError(
        f"poisson() accounts only for a Gaussian mechanism (or a composition of Gaussians run on "
        f"the same sample), got {mechanism!r}."
    )


# --- constructors ----------------------------------------------------------------------------


def gaussian(noise_multiplier: float) -> GaussianMechanism:
    """The Gaussian mechanism with noise std = ``noise_multiplier`` x L2 sensitivity.

    In DP-SGD the sensitivity is the clipping norm C and the noise std on the clipped sum is
    sigma*C (Abadi et al. 2016).

    Args:
        noise_multiplier: sigma >= 0, finite (a Python number or a 0-d tensor).

    Returns:
        A :class:`GaussianMechanism`. ``gaussian(0)`` is valid and has epsilon = inf.

    Raises:
        InputTypeError: not a real number.
        ConfigurationError: negative, NaN or infinite.

    Warns:
        NotPrivateWarning: ``noise_multiplier == 0``.

    Example::

        >>> from opake_compile import accounting as acc
        >>> round((acc.gaussian(3 ** 0.5) * 3).delta_at(1.0), 4)   # sigma_eff = 1
        0.1269
    """
    return GaussianMechanism(check_noise_multiplier(noise_multiplier))


def adaclip(noise_multiplier: float, count_noise_multiplier: float) -> AdaClipMechanism:
    """The mechanism of one adaptive-clipping step (Andrew et al. 2021) on one sample.

    Adaptive clipping releases, from the same examples, the clipped gradient sum with noise
    std sigma C and the count of examples whose gradient norm is at most C with noise std
    sigma_b. Our count is not centred (sensitivity 1, where Andrew et al. centre it to
    sensitivity 1/2), so the step is ``gaussian(sigma) | gaussian(sigma_b)``: one Gaussian
    mechanism with effective noise multiplier ``(sigma^-2 + sigma_b^-2)^(-1/2)`` (both
    queries' noise-normalised shifts add in quadrature). Use it inside :func:`poisson` for
    DP-SGD: ``poisson(adaclip(sigma, sigma_b), q) * steps``.

    Args:
        noise_multiplier: sigma >= 0 of the gradient query.
        count_noise_multiplier: sigma_b >= 0, the std of the noise on the count.

    Raises:
        InputTypeError: not real numbers.
        ConfigurationError: negative, NaN or infinite.

    Warns:
        NotPrivateWarning: either is 0 (epsilon = inf).

    Example::

        >>> from opake_compile import accounting as acc
        >>> round(acc.adaclip(1.0, 1.0).effective_noise_multiplier, 4)
        0.7071
        >>> step = acc.poisson(acc.adaclip(1.0, 0.4), sample_rate=0.1)
        >>> 40 < (step * 50).epsilon_at(1e-5) < 50
        True
    """
    return AdaClipMechanism(
        check_noise_multiplier(noise_multiplier),
        check_noise_multiplier(count_noise_multiplier, name="count_noise_multiplier"),
    )


def adaclip_noise_multipliers(total_noise_multiplier: float, count_noise_multiplier: float) -> tuple[float, float]:
    """Split a total noise multiplier between the gradient and the count of adaptive clipping.

    Returns the gradient noise multiplier sigma such that ``adaclip(sigma, sigma_b)`` is exactly
    as private as ``gaussian(total_noise_multiplier)``, at any sampling rate and step count:
    sigma^-2 + sigma_b^-2 = sigma_total^-2, so

        sigma = (sigma_total^-2 - sigma_b^-2)^(-1/2).

    This is Andrew et al. 2021 (Section 3.1, sigma = (z^-2 - (2 sigma_b)^-2)^(-1/2)) with the
    count's sensitivity 1 instead of 1/2, since our count is not centred. Andrew et al. suggest
    sigma_b = expected_batch_size / 20.

    Args:
        total_noise_multiplier: sigma_total > 0, e.g. from :func:`calibrate` for plain DP-SGD.
        count_noise_multiplier: sigma_b > sigma_total.

    Returns:
        ``(noise_multiplier, count_noise_multiplier)``.

    Raises:
        ConfigurationError: sigma_total <= 0, or sigma_b <= sigma_total (the count alone would
            spend the whole budget or more), or either not finite.

    Example::

        >>> from opake_compile import accounting as acc
        >>> sigma, sigma_b = acc.adaclip_noise_multipliers(1.0, 2.0)
        >>> round(sigma, 4), sigma_b
        (1.1547, 2.0)
    """
    total = check_noise_multiplier(total_noise_multiplier, name="total_noise_multiplier")
    count = check_noise_multiplier(count_noise_multiplier, name="count_noise_multiplier")
    if not total > 0:
        raise ConfigurationError(f"Expected total_noise_multiplier={total!r} > 0.")
    if not count > total:
        raise ConfigurationError(
            f"Expected count_noise_multiplier={count!r} > total_noise_multiplier={total!r}: the "
            "count query alone would spend the whole budget. Increase count_noise_multiplier "
            "(Andrew et al. 2021 suggest expected_batch_size / 20) or the total noise."
        )
    remaining = total**-2 - count**-2
    return remaining**-0.5, count


def poisson(
    mechanism: PrivacyProcess,
    sample_rate: float,
    truncated_batch_size: int | None = None,
    dataset_size: int | None = None,
) -> PoissonSampled:
    """``mechanism`` run on a Poisson sample (every record joins with probability ``sample_rate``).

    Privacy amplification by subsampling is accounted for by dp-accounting (PLD: Koskela et al.
    2020, Zhu et al. 2022; RDP: Mironov et al. 2019). With ``truncated_batch_size`` the sample is
    cut to at most that many records; dp-accounting 0.6 accounts for this with its truncated
    event (arXiv:2508.15089) under PLD only; the RDP accountant refuses it.

    Edge cases: ``sample_rate = 0`` costs nothing; ``sample_rate = 1`` is the bare mechanism;
    ``truncated_batch_size >= dataset_size`` never truncates and is accounted as plain Poisson.

    Args:
        mechanism: a :func:`gaussian`, or a composition of Gaussians run on the same sample.
        sample_rate: q in [0, 1].
        truncated_batch_size: optional maximum batch size (int >= 1).
        dataset_size: N (int >= 1); required with ``truncated_batch_size``.

    Raises:
        InputTypeError: wrong argument types.
        ConfigurationError: a value out of range, ``truncated_batch_size`` without
            ``dataset_size``, or a mechanism that is not Gaussian.

    Example::

        >>> from opake_compile import accounting as acc
        >>> steps = acc.poisson(acc.gaussian(1.0), sample_rate=0.01) * 1000
        >>> 1.5 < steps.epsilon_at(1e-5) < 2.5
        True
    """
    if not isinstance(mechanism, PrivacyProcess):
        raise InputTypeError(f"Expected mechanism to be a privacy process, got {type(mechanism).__name__}.")
    q = check_probability(sample_rate, name="sample_rate")
    if dataset_size is not None:
        dataset_size = check_positive_int(dataset_size, name="dataset_size")
    if truncated_batch_size is not None:
        truncated_batch_size = check_positive_int(truncated_batch_size, name="truncated_batch_size")
        if dataset_size is None:
            raise ConfigurationError(
                "truncated Poisson accounting needs dataset_size: pass dataset_size=N together "
                f"with truncated_batch_size={truncated_batch_size}."
            )
    _inverse_variance(mechanism)  # validates the mechanism now, not at query time
    return PoissonSampled(mechanism, q, truncated_batch_size, dataset_size)


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


def dpsgd_step_process(
    noise_multiplier: float,
    sample_rate: float,
    dataset_size: int | None = None,
    truncated_batch_size: int | None = None,
) -> PoissonSampled:
    """One logical DP-SGD step (Abadi et al. 2016): ``poisson(gaussian(sigma), q, ...)``.

    Every logical step counts, including one whose Poisson batch happened to be empty.

    Example::

        >>> from opake_compile import accounting as acc
        >>> acc.dpsgd_step_process(1.0, 0.01) == acc.poisson(acc.gaussian(1.0), 0.01)
        True
    """
    return poisson(
        gaussian(noise_multiplier),
        sample_rate,
        truncated_batch_size=truncated_batch_size,
        dataset_size=dataset_size,
    )
