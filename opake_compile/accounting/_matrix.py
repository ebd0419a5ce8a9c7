"""Layer 3: accounting of the matrix mechanism (DP-FTRL), sibling of ``_mechanisms``.

* :func:`mf_gaussian`: a whole run of the matrix mechanism with strategy ``M`` (column norm 1)
  and noise ``sigma C M^-1 Z`` releases ``M x + sigma C Z`` up to post-processing; with
  sensitivity ``sens`` of ``M x`` under the participation pattern it is one Gaussian mechanism
  with noise multiplier ``sigma / sens`` (Denisov et al. 2022; Choquette-Choo et al. 2023).
  No amplification: valid for any batches whose participation pattern is the declared one
  (deterministic batches, e.g. :class:`~opake_compile.sampling.SequentialBatchSampler`).
* :func:`mf_poisson`: BandMF amplified by cyclic Poisson sampling (Choquette-Choo et al. 2023,
  "(Amplified) Banded Matrix Factorization", Thm. 4; JAX-Privacy's ``amplified_bandmf_event``):
  the examples are split into ``bands`` fixed groups, step ``t`` Poisson-samples group
  ``t mod bands`` at rate ``q``; with at most ``bands`` bands each example's participations
  touch disjoint rows of ``M x``, so ``T`` steps are ``ceil(T / bands)`` Poisson-subsampled
  Gaussian mechanisms of noise multiplier ``sigma`` composed. ``bands = 1`` and the identity
  strategy is DP-SGD.

* :func:`b_min_sep`: ``(k, b)``-min-separation participation (b-min-sep sampling, Dong &
  Ganesh 2026; :class:`~opake_compile.sampling.BMinSepSampler`): at most ``ceil(T / b)``
  participations in ``T`` steps, any two at least ``b`` apart; charged as :func:`mf_gaussian`
  with that pattern's sensitivity, **without amplification** by the sampler's randomness.
* :func:`balls_in_bins`: one participation per epoch of ``s`` steps, anywhere in it (new bins
  every epoch; :class:`~opake_compile.sampling.BallsInBinsSampler`): the Gaussian mechanism
  with :meth:`~opake_compile.dpftrl.Strategy.epoch_sensitivity`, **without amplification**.

Not built, and never charged as estimates: amplification by plain Poisson sampling of
non-banded strategies, by balls-in-bins sampling (Chua et al. 2024; Choquette-Choo et al.
2024, "Near-exact privacy amplification for matrix mechanisms") and by b-min-sep sampling
(Dong & Ganesh 2026): their only known analyses are Monte Carlo estimates (JAX-Privacy ships
them as examples / ``experimental.monte_carlo``, not as accountants). The reference name of
:func:`b_min_sep`, "warm-start b-min-separation amplification", refers to that analysis; here
the warm start only makes the sampler's batch size stationary, and nothing is amplified.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from opake_compile._validate import check_noise_multiplier, check_nonnegative_int, check_positive_int, check_probability
from opake_compile.accounting._mechanisms import GaussianMechanism, dpsgd_step_process, gaussian, poisson
from opake_compile.accounting._process import PrivacyProcess
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = ["mf_gaussian", "mf_poisson", "b_min_sep", "balls_in_bins", "mf_plan", "MFPlan"]


def _check_strategy(strategy: Any) -> Any:
    from opake_compile.dpftrl.strategies import Strategy

    if not isinstance(strategy, Strategy):
        raise InputTypeError(f"Expected a Strategy (opake_compile.dpftrl), got {type(strategy).__name__}.")
    return strategy


def _check_run(strategy: Any, noise_multiplier: float, steps: int) -> tuple[Any, float, int]:
    """The strategy, sigma and a step count within the strategy's horizon, validated."""
    strategy = _check_strategy(strategy)
    sigma = check_noise_multiplier(noise_multiplier)
    steps = check_nonnegative_int(steps, name="steps")
    if steps > strategy.n:
        raise ConfigurationError(f"steps={steps} exceeds the {strategy.n} steps of {strategy!r}.")
    return strategy, sigma, steps


def mf_gaussian(
    strategy: Any, noise_multiplier: float, *, participations: int = 1, min_separation: int | None = None
) -> GaussianMechanism:
    """The whole run of the matrix mechanism with ``strategy``, as one Gaussian mechanism.

    Every step ``t < strategy.n`` adds ``sigma C (M^-1 Z)[t]``; an example taking part in at
    most ``participations`` steps at least ``min_separation`` apart changes ``M x`` by at most
    ``C * strategy.sensitivity(participations, min_separation)`` in L2, so the run is
    ``gaussian(sigma / sens)`` (no amplification by sampling is assumed: the batches may be
    fixed). Do not repeat it with ``* steps``: it already covers all ``strategy.n`` steps.
    Neighbouring relation: one example's gradients changed within its participation slots
    (zero-out, Kairouz et al. 2021); with batches that move other examples when one is added
    or removed, the pattern does not hold for add-or-remove.

    Args:
        strategy: the :class:`~opake_compile.dpftrl.strategies.Strategy`.
        noise_multiplier: sigma >= 0 (as passed to ``mf_gaussian_noise``).
        participations, min_separation: the participation pattern (single epoch by default).

    Raises:
        InputTypeError: not a strategy.
        ConfigurationError: sigma < 0; ``participations > 1`` without ``min_separation``.

    Example::

        >>> s = band_mf_strategy(100, 4)
        >>> acc.mf_gaussian(s, 2.0, participations=5, min_separation=20)  # gaussian(2 / sqrt(5))
    """
    strategy = _check_strategy(strategy)
    sigma = check_noise_multiplier(noise_multiplier)
    sens = strategy.sensitivity(participations, min_separation)
    return gaussian(sigma / sens)


def mf_poisson(strategy: Any, noise_multiplier: float, sample_rate: float, *, bands: int, steps: int) -> PrivacyProcess:
    """BandMF (or identity) with cyclic Poisson sampling over ``bands`` groups, ``steps`` steps.

    Returns ``poisson(gaussian(sigma), q) * ceil(steps / bands)`` (see the module docstring;
    the same event as JAX-Privacy's ``amplified_bandmf_event``). Re-exported as
    :func:`opake_compile.dpftrl.poisson`.

    Args:
        strategy: a banded strategy with at most ``bands`` bands (BandMF, identity).
        noise_multiplier: sigma >= 0.
        sample_rate: q, the Poisson rate *within* the group of the step.
        bands: the number of groups of the cyclic Poisson sampler.
        steps: steps taken, ``<= strategy.n``.

    Raises:
        ConfigurationError: the strategy is not banded, has more bands than groups, or
            ``steps`` exceeds ``strategy.n``.
    """
    strategy = _check_strategy(strategy)
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_probability(sample_rate, name="sample_rate")
    bands = check_positive_int(bands, name="bands")
    steps = check_nonnegative_int(steps, name="steps")
    if strategy.bands is None or strategy.bands > bands:
        raise ConfigurationError(
            f"Amplification by cyclic Poisson sampling needs a banded strategy with at most {bands} bands "
            f"(the sampler's groups); {strategy!r} has "
            f"{'a full (non-banded) M' if strategy.bands is None else f'{strategy.bands} bands'}."
        )
    if steps > strategy.n:
        raise ConfigurationError(f"steps={steps} exceeds the {strategy.n} steps of {strategy!r}.")
    return poisson(gaussian(sigma), q) * -(-steps // bands)


def b_min_sep(strategy: Any, noise_multiplier: float, min_separation: int, *, steps: int) -> PrivacyProcess:
    """The first ``steps`` steps of the matrix mechanism under b-min-separation participation.

    With b-min-sep sampling (:class:`~opake_compile.sampling.BMinSepSampler`; Dong & Ganesh
    2026, "Privacy amplification for BandMF via b-min-sep subsampling") an example never takes
    part in two steps less than ``b`` apart, so in ``T`` steps it takes part at most
    ``k = ceil(T / b)`` times: the ``(k, b)``-min-separation pattern of Choquette-Choo et al.
    2023 ("Multi-epoch matrix factorization mechanisms"). The charge is the Gaussian mechanism
    ``gaussian(sigma / strategy.sensitivity(k, b))`` (:func:`mf_gaussian`), valid whatever
    the batches were (no amplification is claimed, so no band limit applies: a strategy with
    more than ``b`` bands simply has a larger sensitivity). The amplification by the sampler's
    randomness is known only by Monte Carlo analysis (Dong & Ganesh 2026) and is not charged.
    Nondecreasing in ``steps``. Neighbouring relation: as :func:`mf_gaussian` (one example's
    gradients changed in its participation slots).

    Args:
        strategy: the :class:`~opake_compile.dpftrl.strategies.Strategy`.
        noise_multiplier: sigma >= 0.
        min_separation: ``b >= 1``, the fewest steps between two participations.
        steps: ``T``, steps taken, ``0 <= T <= strategy.n`` (0 costs nothing).

    Raises:
        InputTypeError: not a strategy.
        ConfigurationError: a bad value, ``steps > strategy.n``.

    Example::

        >>> s = dpftrl.band_mf_strategy(100, 4)
        >>> acc.b_min_sep(s, 2.0, 20, steps=100)  # 5 participations: gaussian(2 / sqrt(5))
    """
    strategy, sigma, steps = _check_run(strategy, noise_multiplier, steps)
    b = check_positive_int(min_separation, name="min_separation")
    if steps == 0:
        return gaussian(sigma) * 0
    k = -(-steps // b)
    return mf_gaussian(strategy, sigma, participations=k, min_separation=b if k > 1 else None)


def balls_in_bins(strategy: Any, noise_multiplier: float, epoch_steps: int, *, steps: int) -> PrivacyProcess:
    """The first ``steps`` steps of the matrix mechanism with balls-in-bins batches.

    Every epoch of ``s = epoch_steps`` steps, each example lands in exactly one batch
    (:class:`~opake_compile.sampling.BallsInBinsSampler`, new bins every epoch; Chua et al.
    2024, "Balls-and-bins sampling for DP-SGD"), so it takes part once per epoch with no
    minimum separation across epoch boundaries. The charge is the Gaussian mechanism
    ``gaussian(sigma / strategy.epoch_sensitivity(s, steps))``: the sensitivity of the first
    ``steps`` rows of ``M x`` maximised over every such pattern (an upper bound, exact for the
    identity, ``sqrt(epochs)``, and for banded strategies of at most ``s + 1`` bands with
    nonnegative ``M^T M``). The randomness of the bins is not credited: the amplified analyses
    (Chua et al. 2024; Choquette-Choo et al. 2024) are Monte Carlo estimates, not built.
    Nondecreasing in ``steps``. With the identity strategy this is DP-SGD with balls-in-bins
    batches accounted as ``epochs`` unsubsampled Gaussian steps.

    Args:
        strategy: the :class:`~opake_compile.dpftrl.strategies.Strategy`.
        noise_multiplier: sigma >= 0.
        epoch_steps: ``s >= 1``, batches per epoch (the sampler's ``steps``).
        steps: steps taken, ``0 <= steps <= strategy.n`` (0 costs nothing).

    Raises:
        InputTypeError: not a strategy.
        ConfigurationError: a bad value, ``steps > strategy.n``.

    Example::

        >>> acc.balls_in_bins(dpftrl.identity_strategy(40), 2.0, 10, steps=40)  # gaussian(1.0)
    """
    strategy, sigma, steps = _check_run(strategy, noise_multiplier, steps)
    s = check_positive_int(epoch_steps, name="epoch_steps")
    if steps == 0:
        return gaussian(sigma) * 0
    return gaussian(sigma / strategy.epoch_sensitivity(s, steps))


@dataclasses.dataclass(frozen=True)
class MFPlan:
    """How a ``DPOptimizer`` charges correlated noise with its sampler.

    Attributes:
        kind: ``"cyclic_poisson"``, ``"poisson"``, ``"fixed"``, ``"b_min_sep"`` or
            ``"balls_in_bins"`` (the sampler's ``sampling``).
        strategy, noise_multiplier: the mechanism.
        sample_rate: q (Poisson kinds) or ``None``.
        period: steps per group cycle (``bands``; 1 for plain Poisson), the min-separation
            (``"fixed"``: steps per epoch; ``"b_min_sep"``: ``b``) or steps per epoch
            (``"balls_in_bins"``).
        divisor: the sampler's expected batch size, the normaliser of the noised sum.
    """

    kind: str
    strategy: Any
    noise_multiplier: float
    sample_rate: float | None
    period: int
    divisor: float

    def process(self, steps: int) -> PrivacyProcess:
        """The privacy process of the first ``steps`` steps."""
        if steps > self.strategy.n:
            raise ConfigurationError(f"{steps} steps exceed the {self.strategy.n} steps of {self.strategy!r}.")
        if self.kind in ("fixed", "b_min_sep"):
            # fixed batches: participations exactly `period` apart, a special case of b-min-sep
            return b_min_sep(self.strategy, self.noise_multiplier, self.period, steps=steps)
        if self.kind == "balls_in_bins":
            return balls_in_bins(self.strategy, self.noise_multiplier, self.period, steps=steps)
        if self.kind == "poisson":
            return dpsgd_step_process(self.noise_multiplier, self.sample_rate) * steps
        return mf_poisson(self.strategy, self.noise_multiplier, self.sample_rate, bands=self.period, steps=steps)

    def max_steps(self, accountant: Any, budget: Any) -> int:
        """The largest number of steps (<= ``strategy.n``) whose process fits ``budget``."""
        n = self.strategy.n
        if self.kind == "poisson":
            return min(n, accountant.max_steps(dpsgd_step_process(self.noise_multiplier, self.sample_rate), budget, limit=n))
        if self.kind == "cyclic_poisson":
            rounds = accountant.max_steps(poisson(gaussian(self.noise_multiplier), self.sample_rate), budget, limit=n)
            return min(n, rounds * self.period)
        if self.kind == "balls_in_bins":
            # the sensitivity of the first T rows is nondecreasing in T: bisect
            lo, hi = 0, n
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if budget.allows(self.process(mid), accountant):
                    lo = mid
                else:
                    hi = mid - 1
            return lo
        # fixed, b_min_sep: epsilon grows with the participations; search over them
        epochs = -(-n // self.period)
        fit = 0
        for k in range(1, epochs + 1):
            if not budget.allows(self.process(min(n, k * self.period)), accountant):
                break
            fit = k
        return min(n, fit * self.period)


def mf_plan(strategy: Any, noise_multiplier: float, sampler: Any) -> MFPlan:
    """The accounting of correlated noise with ``sampler``, or a refusal with the reason.

    Accepted: :class:`~opake_compile.sampling.CyclicPoissonSampler` with a banded strategy of
    at most ``sampler.bands`` bands (:func:`mf_poisson`);
    :class:`~opake_compile.sampling.PoissonSampler` with the identity strategy (DP-SGD);
    :class:`~opake_compile.sampling.SequentialBatchSampler` with any strategy
    (:func:`mf_gaussian`, ``min_separation`` = steps per epoch);
    :class:`~opake_compile.sampling.BMinSepSampler` with any strategy (:func:`b_min_sep`);
    :class:`~opake_compile.sampling.BallsInBinsSampler` with any strategy
    (:func:`balls_in_bins`). The last three are charged without amplification.

    Raises:
        ConfigurationError: any other combination (the reason is in the message).
    """
    strategy = _check_strategy(strategy)
    sigma = check_noise_multiplier(noise_multiplier)
    kind = getattr(sampler, "sampling", None)
    divisor = float(getattr(sampler, "expected_batch_size", 0.0) or 0.0)
    if not divisor > 0:
        raise ConfigurationError(f"The sampler's expected batch size must be > 0, got {divisor}.")
    if kind == "cyclic_poisson":
        if getattr(sampler, "truncated_batch_size", None) is not None:
            raise ConfigurationError("Truncated cyclic Poisson sampling is not accounted for; drop truncated_batch_size.")
        mf_poisson(strategy, sigma, sampler.sample_rate, bands=sampler.bands, steps=0)  # validates
        return MFPlan("cyclic_poisson", strategy, sigma, float(sampler.sample_rate), int(sampler.bands), divisor)
    if kind == "poisson":
        if strategy.name != "identity":
            raise ConfigurationError(
                f"Correlated noise ({strategy!r}) with plain Poisson sampling has no closed-form amplification "
                "(only Monte Carlo analyses, not built): use CyclicPoissonSampler with a BandMF strategy of at "
                "most `bands` bands, or SequentialBatchSampler (no amplification)."
            )
        if getattr(sampler, "truncated_batch_size", None) is not None:
            raise ConfigurationError("Use DPOptimizer's default Gaussian noise for truncated Poisson sampling.")
        return MFPlan("poisson", strategy, sigma, float(sampler.sample_rate), 1, divisor)
    if kind == "fixed":
        return MFPlan("fixed", strategy, sigma, None, int(sampler.steps), divisor)
    if kind == "b_min_sep":
        b = int(sampler.min_separation)
        return MFPlan("b_min_sep", strategy, sigma, None, b, divisor)
    if kind == "balls_in_bins":
        return MFPlan("balls_in_bins", strategy, sigma, None, int(sampler.steps), divisor)
    raise ConfigurationError(
        f"Correlated noise cannot be accounted with a {type(sampler).__name__}: it declares no sampling scheme "
        "this mechanism knows (CyclicPoissonSampler, SequentialBatchSampler, BMinSepSampler, BallsInBinsSampler; "
        "PoissonSampler for identity)."
    )
