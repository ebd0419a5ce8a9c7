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

Not built (refused with the reason by :func:`mf_plan`): amplification of non-banded strategies
(BLT, BISR, lambda-CGD) by Poisson or balls-in-bins sampling, whose only known analyses are
Monte Carlo (MMCC, Choquette-Choo et al. 2024; Chua et al. 2024).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from opake_compile._validate import check_noise_multiplier, check_nonnegative_int, check_positive_int, check_probability
from opake_compile.accounting._mechanisms import GaussianMechanism, dpsgd_step_process, gaussian, poisson
from opake_compile.accounting._process import PrivacyProcess
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = ["mf_gaussian", "mf_poisson", "mf_plan", "MFPlan"]


def _check_strategy(strategy: Any) -> Any:
    from opake_compile.dpftrl.strategies import Strategy

    if not isinstance(strategy, Strategy):
        raise InputTypeError(f"Expected a Strategy (opake_compile.dpftrl), got {type(strategy).__name__}.")
    return strategy


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


@dataclasses.dataclass(frozen=True)
class MFPlan:
    """How a ``DPOptimizer`` charges correlated noise with its sampler.

    Attributes:
        kind: ``"cyclic_poisson"``, ``"poisson"`` or ``"fixed"``.
        strategy, noise_multiplier: the mechanism.
        sample_rate: q (Poisson kinds) or ``None``.
        period: steps per group cycle (``bands``; 1 for plain Poisson) or per epoch
            (``"fixed"``: the min-separation).
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
        if self.kind == "fixed":
            if steps == 0:
                return gaussian(self.noise_multiplier) * 0
            k = -(-steps // self.period)
            return mf_gaussian(self.strategy, self.noise_multiplier, participations=k, min_separation=self.period)
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
        # fixed: epsilon grows with the participations; search over them
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
    (:func:`mf_gaussian`, ``min_separation`` = steps per epoch).

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
    if kind == "balls_in_bins":
        raise ConfigurationError(
            "Balls-in-bins sampling with correlated noise is only analysed by Monte Carlo (Chua et al. 2024; "
            "Choquette-Choo et al. 2024), which is not built: its epsilon cannot be charged. Use "
            "SequentialBatchSampler (accounted without amplification) or CyclicPoissonSampler with BandMF."
        )
    raise ConfigurationError(
        f"Correlated noise cannot be accounted with a {type(sampler).__name__}: it declares no sampling scheme "
        "this mechanism knows (CyclicPoissonSampler, SequentialBatchSampler; PoissonSampler for identity)."
    )
