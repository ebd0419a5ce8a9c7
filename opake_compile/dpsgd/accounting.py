"""The DP-SGD slice of :mod:`opake_compile.accounting`.

The typical workflow::

    >>> from opake_compile.dpsgd import accounting as dpsgd_acc
    >>> steps = dpsgd_acc.poisson(dpsgd_acc.gaussian(1.0), sample_rate=0.01) * 1000
    >>> 0 < steps.epsilon_at(1e-5) < 3
    True
"""

from __future__ import annotations

from opake_compile.accounting import (
    Accountant,
    adaclip,
    adaclip_noise_multipliers,
    calibrate,
    delta_budget,
    dpsgd_step_process,
    eps_delta,
    epsilon_budget,
    gaussian,
    parallel_poisson,
    poisson,
)

__all__ = [
    "gaussian",
    "adaclip",
    "adaclip_noise_multipliers",
    "poisson",
    "parallel_poisson",
    "eps_delta",
    "dpsgd_step_process",
    "calibrate",
    "epsilon_budget",
    "delta_budget",
    "Accountant",
]
