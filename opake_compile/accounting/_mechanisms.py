"""Layer 3: the DP-SGD mechanisms and their Poisson-family amplification.

``gaussian`` (Abadi et al. 2016), ``adaclip`` (Andrew et al. 2021), ``poisson`` (plain or
truncated Poisson subsampling) and ``parallel_poisson`` (Poisson subsampling within disjoint
shards), each a process of the algebra in ``_process`` with an exact ``DpEvent``. Matrix
factorisation mechanisms (DP-FTRL) will be a sibling module at this layer. Public names are
re-exported from :mod:`opake_compile.accounting` and :mod:`opake_compile.dpsgd.accounting`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

from dp_accounting import dp_event

from opake_compile._validate import check_noise_multiplier, check_positive_int, check_probability
from opake_compile.accounting._bridge import TRUNCATED_EVENT, dp_accounting_version
from opake_compile.accounting._process import (
    _NOOP,
    Composed,
    IdentityProcess,
    PrivacyProcess,
    Repeated,
)
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = [
    "GaussianMechanism",
    "AdaClipMechanism",
    "PoissonSampled",
    "ParallelPoissonSampled",
    "gaussian",
    "adaclip",
    "adaclip_noise_multipliers",
    "poisson",
    "parallel_poisson",
    "dpsgd_step_process",
]


def _checked_sigma(value: float, name: str) -> float:
    """``check_noise_multiplier`` for a mechanism built directly (the constructors have
    already warned about sigma = 0): a NaN sigma built that way was accounted as epsilon 0
    under RDP (dp-accounting reads its negative divergence as none; review)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return check_noise_multiplier(value, name=name)


def _checked_sampling(sampled: Any) -> float:
    """The sample rate of a Poisson-sampled process built directly, after checking it and its
    mechanism."""
    if not isinstance(sampled.mechanism, PrivacyProcess):
        raise InputTypeError(f"Expected mechanism to be a privacy process, got {type(sampled.mechanism).__name__}.")
    return check_probability(sampled.sample_rate, name="sample_rate")


def _freeze(obj: object, **values: object) -> None:
    for name, value in values.items():
        object.__setattr__(obj, name, value)


@dataclass(frozen=True, repr=False)
class GaussianMechanism(PrivacyProcess):
    """The Gaussian mechanism: a sum of L2-bounded contributions plus N(0, (sigma C)^2) noise.

    Attributes:
        noise_multiplier: sigma, noise std divided by the L2 sensitivity C (unitless).
    """

    noise_multiplier: float

    def __post_init__(self) -> None:
        _freeze(self, noise_multiplier=_checked_sigma(self.noise_multiplier, "noise_multiplier"))

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

    def __post_init__(self) -> None:
        _freeze(
            self,
            noise_multiplier=_checked_sigma(self.noise_multiplier, "noise_multiplier"),
            count_noise_multiplier=_checked_sigma(self.count_noise_multiplier, "count_noise_multiplier"),
        )

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

    def __post_init__(self) -> None:
        _freeze(
            self,
            sample_rate=_checked_sampling(self),
            truncated_batch_size=None if self.truncated_batch_size is None
            else check_positive_int(self.truncated_batch_size, name="truncated_batch_size"),
            dataset_size=None if self.dataset_size is None else check_positive_int(self.dataset_size, name="dataset_size"),
        )

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
            self.dataset_size is None or self.truncated_batch_size <= self.dataset_size
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
                dataset_size=self.dataset_size + 1,  # the larger dataset of an add-one pair (docstring of poisson)
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

@dataclass(frozen=True, repr=False)
class ParallelPoissonSampled(PrivacyProcess):
    """``mechanism`` run on a Poisson sample of each of ``num_shards`` disjoint shards.

    Accounted as one shard's ``poisson(mechanism, sample_rate)`` by parallel composition (see
    :func:`parallel_poisson`).

    Attributes:
        mechanism: a Gaussian, or a composition of Gaussians run on the same sample.
        sample_rate: q in [0, 1], within each shard.
        num_shards: how many disjoint shards run in parallel (>= 1).
    """

    mechanism: PrivacyProcess
    sample_rate: float
    num_shards: int

    def __post_init__(self) -> None:
        _freeze(self, sample_rate=_checked_sampling(self), num_shards=check_positive_int(self.num_shards, name="num_shards"))

    def to_dp_event(self) -> dp_event.DpEvent:
        # Parallel composition: one record is in exactly one shard, so only that shard's
        # release depends on it; the others are independent of it (McSherry 2009, Thm. 4).
        return PoissonSampled(self.mechanism, self.sample_rate).to_dp_event()

    def __repr__(self) -> str:
        return f"parallel_poisson({self.mechanism!r}, sample_rate={self.sample_rate!r}, num_shards={self.num_shards})"


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
    2020, Zhu et al. 2022; RDP: Mironov et al. 2019), for the add-or-remove-one neighbouring
    relation: a record's presence changes the sum by at most the sensitivity, and it is present
    with probability q independently of everything else.

    Truncated Poisson sampling (``truncated_batch_size=B``, with ``dataset_size=N``): a sample
    of more than B records is replaced by a uniformly random subset of exactly B of them, as
    :class:`~opake_compile.sampling.PoissonSampler` does. The analysis: a record's chance of
    being released is then below q by an amount that depends on N and B, and the sampled batch
    size is no longer independent of the other records, so the plain Poisson bound does not
    apply as is; dp-accounting 0.6 builds the exact PLD of the truncated subsampled Gaussian
    (its ``TruncatedSubsampledGaussianDpEvent``; the analysis is arXiv:2508.15089, "bounded"
    Poisson sampling for DP-SGD with a memory cap). It is available under PLD only; the RDP
    accountant refuses it (never accounted as untruncated). dp-accounting's bound counts the
    record whose presence is in question among its ``dataset_size`` records, so it is given
    N + 1: the larger dataset of the pair where a record is added to the N trained on, whose
    bound is the larger (by 0.4 % at N = 1000, q = 0.05, B = 55, sigma = 1, 500 steps; 6 % at
    N = 50, q = 0.5, B = 26; review).

    Edge cases: ``sample_rate = 0`` costs nothing; ``sample_rate = 1`` is the bare mechanism;
    ``truncated_batch_size > dataset_size`` never truncates (not even the dataset with one
    more record) and is accounted as plain Poisson.

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

def parallel_poisson(mechanism: PrivacyProcess, sample_rate: float, num_shards: int) -> ParallelPoissonSampled:
    """``mechanism`` run in parallel on a Poisson sample of each of ``num_shards`` disjoint shards.

    The setting: the records are split into disjoint shards by a fixed rule that does not
    depend on the other records (a hash of a record id, or a pre-assigned shard), and each
    shard draws its own Poisson sample at rate q and makes its own release (per-shard models,
    PATE-style teachers, per-silo statistics). The releases are *not* summed into one query
    (summing per-shard Poisson samples is plain :func:`poisson` at rate q over the union).

    The analysis is parallel composition (McSherry 2009, "Privacy Integrated Queries", Thm. 4):
    adding or removing one record changes only the shard that holds it, so the whole step is
    exactly as private as one shard's ``poisson(mechanism, q)``, whatever ``num_shards`` is.
    This holds for the add-or-remove-one relation with a data-independent shard rule; if the
    rule depends on positions in the dataset (round-robin over a list), one record can move
    others between shards and this accounting does not apply. Repeat with ``* steps``.

    Args:
        mechanism: a :func:`gaussian`, or a composition of Gaussians run on the same sample.
        sample_rate: q in [0, 1], the Poisson rate within each shard.
        num_shards: the number of disjoint shards (int >= 1).

    Raises:
        InputTypeError, ConfigurationError: as :func:`poisson`; ``num_shards < 1``.

    Example::

        >>> from opake_compile import accounting as acc
        >>> shards = acc.parallel_poisson(acc.gaussian(1.0), 0.01, num_shards=8) * 1000
        >>> shards.epsilon_at(1e-5) == (acc.poisson(acc.gaussian(1.0), 0.01) * 1000).epsilon_at(1e-5)
        True
    """
    sampled = poisson(mechanism, sample_rate)
    return ParallelPoissonSampled(sampled.mechanism, sampled.sample_rate, check_positive_int(num_shards, name="num_shards"))


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
