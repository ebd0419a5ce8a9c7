"""Privacy accounting and calibration, built on Google's ``dp-accounting``.

A *privacy process* is an immutable description of everything that touched the private data:
``gaussian(sigma)`` (the Gaussian mechanism), ``poisson(mechanism, sample_rate)`` (Poisson
subsampling, optionally truncated), ``eps_delta(epsilon, delta)`` (a black-box guarantee),
``identity()`` and ``nonprivate()``; ``p * k`` repeats a process k times and ``a | b`` composes
different ones. Queries ``.epsilon_at(delta)`` / ``.delta_at(epsilon)`` map the process onto
dp-accounting ``DpEvent`` s (``.to_dp_event()``) and run one of its accountants:

* ``"pld"`` (default): privacy loss distributions (Koskela et al. 2020; Doroshenko et al.
  2022). Pessimistic by construction: never below the true epsilon, and close to it.
* ``"rdp"``: Renyi differential privacy (Mironov 2017; Mironov et al. 2019 for the subsampled
  Gaussian; it generalises the moments accountant of Abadi et al. 2016). Faster, looser.

f-DP views (Dong, Roth and Su 2022) of every process: ``.beta_at(alpha)`` (the trade-off
curve), ``.advantage()`` (max TPR - FPR) and ``.risk_at(prior)`` (the smallest Bayes error of a
membership test), derived from the privacy profile the accountant computes, with budgets
``advantage_budget``, ``beta_budget`` and ``risk_budget`` for :func:`calibrate`.

Epsilon is in nats throughout. No PLD or RDP arithmetic is implemented here. Results are
:class:`PrivacyValue` floats (they format and compare as plain numbers).

Layout (each layer imports only the ones above it, so there are no cycles):

* ``_bridge``: the bridge to dp-accounting (events it lacks, the PLD memo, privacy profiles);
* ``_fdp``: f-DP views of a privacy profile; ``_budgets``: privacy budgets;
* ``_accountant``: :class:`Accountant` (PLD or RDP), answering every query on a ``DpEvent``;
* ``_process``: the process algebra (``*``, ``|``, queries) and generic mechanisms;
* ``_mechanisms``: DP-SGD mechanisms and Poisson-family amplification; ``_matrix``, its
  sibling: matrix-factorisation (DP-FTRL) accounting (``mf_gaussian``, ``mf_poisson``, ``b_min_sep``,
  ``balls_in_bins``);
* ``_calibration``: :func:`calibrate`.

Edge cases: ``sample_rate = 0`` or ``k = 0`` gives epsilon = 0; ``sample_rate = 1`` equals the
bare Gaussian; ``noise_multiplier = 0`` gives epsilon = inf (and warns ``NotPrivateWarning``);
truncated Poisson sampling is accounted for exactly by PLD (dp-accounting >= 0.6) and refused
by RDP with a ConfigurationError; ``eps_delta`` parts are refused by RDP likewise.

Example::

    >>> from opake_compile import accounting as acc
    >>> step = acc.poisson(acc.gaussian(1.1), sample_rate=256 / 60_000)
    >>> eps = (step * 1_000).epsilon_at(1e-5)
    >>> eps_rdp = (step * 1_000).epsilon_at(1e-5, accountant="rdp")
    >>> 0 < eps < eps_rdp
    True
    >>> sigma = acc.calibrate(
    ...     acc.epsilon_budget(3.0, delta=1e-5),
    ...     lambda s: acc.poisson(acc.gaussian(s), 0.01) * 1000,
    ...     0.5, 5.0,
    ...     accountant="rdp",
    ... ).param
    >>> (acc.poisson(acc.gaussian(sigma), 0.01) * 1000).epsilon_at(1e-5, accountant="rdp") <= 3.0
    True
"""

from __future__ import annotations

from opake_compile.accounting._accountant import Accountant, PrivacyValue
from opake_compile.accounting._budgets import (
    AdvantageBudget,
    BetaBudget,
    DeltaBudget,
    EpsilonBudget,
    PrivacyBudget,
    RiskBudget,
    advantage_budget,
    beta_budget,
    delta_budget,
    epsilon_budget,
    risk_budget,
)
from opake_compile.accounting._calibration import CalibrationRangeWarning, CalibrationResult, calibrate
from opake_compile.accounting._mechanisms import (
    AdaClipMechanism,
    GaussianMechanism,
    ParallelPoissonSampled,
    PoissonSampled,
    adaclip,
    adaclip_noise_multipliers,
    dpsgd_step_process,
    gaussian,
    parallel_poisson,
    poisson,
)
from opake_compile.accounting._matrix import MFPlan, b_min_sep, balls_in_bins, mf_gaussian, mf_plan, mf_poisson
from opake_compile.accounting._process import (
    Composed,
    EpsDeltaMechanism,
    IdentityProcess,
    NonPrivateProcess,
    PrivacyProcess,
    Repeated,
    eps_delta,
    identity,
    nonprivate,
)

__all__ = [
    # processes
    "gaussian",
    "adaclip",
    "adaclip_noise_multipliers",
    "poisson",
    "parallel_poisson",
    "eps_delta",
    "identity",
    "nonprivate",
    "dpsgd_step_process",
    # matrix factorisation (DP-FTRL)
    "mf_gaussian",
    "mf_poisson",
    "b_min_sep",
    "balls_in_bins",
    "mf_plan",
    "MFPlan",
    "PrivacyProcess",
    "GaussianMechanism",
    "AdaClipMechanism",
    "PoissonSampled",
    "ParallelPoissonSampled",
    "EpsDeltaMechanism",
    "IdentityProcess",
    "NonPrivateProcess",
    "Repeated",
    "Composed",
    # budgets and accountants
    "epsilon_budget",
    "delta_budget",
    "advantage_budget",
    "beta_budget",
    "risk_budget",
    "PrivacyBudget",
    "EpsilonBudget",
    "DeltaBudget",
    "AdvantageBudget",
    "BetaBudget",
    "RiskBudget",
    "Accountant",
    "PrivacyValue",
    # calibration
    "calibrate",
    "CalibrationResult",
    "CalibrationRangeWarning",
]
