"""DP-FTRL: correlated noise of the matrix mechanism, its samplers and its accounting.

* strategies (:mod:`.strategies`): :func:`identity_strategy`, :func:`band_mf_strategy`,
  :func:`blt_strategy`, :func:`bisr_strategy`, :func:`lambda_cgd_strategy`;
* noise (:mod:`.noise`): :func:`mf_gaussian_noise`, shaped like ``gaussian_noise``; pass its
  pair to ``DPOptimizer(..., noise=...)``;
* sampling (from :mod:`opake_compile.sampling`): :class:`CyclicPoissonSampler`,
  :class:`BMinSepSampler`, :class:`BallsInBinsSampler`, :class:`SequentialBatchSampler`;
* accounting: :func:`poisson` (BandMF amplified by cyclic Poisson sampling,
  :func:`opake_compile.accounting.mf_poisson`), :func:`mf_gaussian` (any fixed pattern),
  :func:`b_min_sep` (b-min-separation) and :func:`balls_in_bins` (one participation per
  epoch); the last two charge no amplification (their amplified analyses are Monte Carlo only).

Which sampler with which strategy (``DPOptimizer`` derives the charge from the pair):

* :class:`CyclicPoissonSampler`: BandMF or identity with at most ``bands`` bands, amplified
  (:func:`poisson`);
* :class:`~opake_compile.sampling.PoissonSampler`: identity only (DP-SGD);
* :class:`SequentialBatchSampler`: any strategy, :func:`b_min_sep` with ``b`` = steps per epoch;
* :class:`BMinSepSampler`: any strategy, :func:`b_min_sep` (sensitivity at ``(ceil(T/b), b)``);
* :class:`BallsInBinsSampler`: any strategy, :func:`balls_in_bins` (one participation per epoch).

Example::

    >>> from opake_compile import dpftrl, random
    >>> s = dpftrl.band_mf_strategy(120, bands=4)
    >>> sampler = dpftrl.CyclicPoissonSampler(1000, 0.4, bands=4, key=random.key(1), steps=120)
    >>> opt = DPOptimizer(torch.optim.SGD(params, lr=0.1), sampler=sampler,
    ...                   noise=dpftrl.mf_gaussian_noise(s, 1.0, random.key(2)))
"""

from opake_compile.accounting._matrix import b_min_sep, balls_in_bins, mf_gaussian
from opake_compile.accounting._matrix import mf_poisson as poisson
from opake_compile.dpftrl.noise import MFGaussianNoise, MFNoiseState, mf_gaussian_noise
from opake_compile.dpftrl.strategies import (
    Strategy,
    band_mf_strategy,
    bisr_strategy,
    blt_strategy,
    identity_strategy,
    lambda_cgd_strategy,
)
from opake_compile.sampling import BallsInBinsSampler, BMinSepSampler, CyclicPoissonSampler, SequentialBatchSampler

__all__ = [
    "Strategy",
    "identity_strategy",
    "band_mf_strategy",
    "blt_strategy",
    "bisr_strategy",
    "lambda_cgd_strategy",
    "mf_gaussian_noise",
    "MFGaussianNoise",
    "MFNoiseState",
    "CyclicPoissonSampler",
    "BMinSepSampler",
    "BallsInBinsSampler",
    "SequentialBatchSampler",
    "poisson",
    "mf_gaussian",
    "b_min_sep",
    "balls_in_bins",
]
