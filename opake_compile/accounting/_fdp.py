"""Layer 1b: f-DP views of a privacy profile (Dong, Roth and Su 2022, "Gaussian differential privacy").

Every function here takes the privacy profile ``delta(eps)`` of a process, a vectorised callable
that the accountant builds from dp-accounting's own PLD (or RDP) result, and turns it into a
hypothesis-testing quantity about a membership attack:

* the trade-off curve ``beta(alpha)``: the smallest type-II error at type-I error alpha;
* the advantage ``max(TPR - FPR) = delta(0)``;
* the Bayes risk ``min over tests of prior * alpha + (1 - prior) * beta(alpha)``.

Pessimism is preserved: the PLD profile is never below the true one, and the trade-off curve is
a supremum over finitely many eps of lower bounds, so every view errs towards "less private"
(a smaller beta, a larger advantage, a smaller risk). Nothing here does PLD arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from scipy import optimize

__all__ = ["advantage_from_profile", "beta_from_profile", "risk_from_profile", "DeltaProfile"]

#: delta(eps) for an array of eps >= 0, as an array of the same shape.
DeltaProfile = Callable[[np.ndarray], np.ndarray]

_GRID = 48  # eps grid of the trade-off supremum, before the local refinement


def advantage_from_profile(profile: DeltaProfile) -> float:
    """max over tests of TPR - FPR: the total variation distance, ``delta(0)``."""
    return float(np.clip(profile(np.zeros(1))[0], 0.0, 1.0))


def risk_from_profile(profile: DeltaProfile, prior: float) -> float:
    """The smallest Bayes error ``min over tests of prior alpha + (1 - prior) beta(alpha)``.

    For a test between P (prior ``prior``) and Q, the Bayes error is
    ``(1 - p) - sup_S [(1 - p) Q(S) - p P(S)]``, a hockey-stick divergence; with the
    symmetric profile delta(eps) = max of both directions this is
    ``min(p, 1 - p) * (1 - delta(|log(p / (1 - p))|))``.
    """
    if prior <= 0.0 or prior >= 1.0:
        return 0.0
    eps = abs(math.log(prior) - math.log1p(-prior))
    delta = float(np.clip(profile(np.array([eps]))[0], 0.0, 1.0))
    return min(prior, 1.0 - prior) * (1.0 - delta)


def _tradeoff_lines(profile: DeltaProfile, eps: np.ndarray, alpha: float) -> np.ndarray:
    """Lower bounds on beta(alpha), one per eps (Dong et al. 2022, Prop. 2.12, both directions)."""
    one_minus = 1.0 - np.clip(profile(eps), 0.0, 1.0)
    first = one_minus - np.exp(eps) * alpha
    second = np.exp(-eps) * (one_minus - alpha)
    return np.maximum(0.0, np.maximum(first, second))


def _eps_range(profile: DeltaProfile, alpha: float) -> float:
    """An eps beyond which neither line of :func:`_tradeoff_lines` can improve."""
    hi, last = 1.0, float(profile(np.array([1.0]))[0])
    while hi < 512.0:
        nxt = float(profile(np.array([2.0 * hi]))[0])
        hi *= 2.0
        if nxt <= 1e-15 or nxt >= last * (1.0 - 1e-9):  # vanished, or only the mass at +inf left
            break
        last = nxt
    if alpha > 0:
        hi = max(hi, -math.log(alpha))  # the first line needs e^eps alpha < 1
    return hi


def beta_from_profile(profile: DeltaProfile, alpha: float) -> float:
    """The trade-off curve at ``alpha``: sup over eps >= 0 of the lines of Prop. 2.12.

    A grid of eps, then a bounded scalar refinement around the best grid point; every
    evaluated eps gives a valid lower bound on the true curve, so the maximum is one too.
    """
    if alpha >= 1.0:
        return 0.0
    hi = _eps_range(profile, alpha)
    grid = np.concatenate([np.linspace(0.0, hi, _GRID), [hi * 4.0]])
    values = _tradeoff_lines(profile, grid, alpha)
    best_i = int(np.argmax(values))
    best = float(values[best_i])
    if 0 < best_i < len(grid) - 2:
        lo_e, hi_e = float(grid[best_i - 1]), float(grid[best_i + 1])
        res = optimize.minimize_scalar(
            lambda e: -float(_tradeoff_lines(profile, np.array([e]), alpha)[0]),
            bounds=(lo_e, hi_e),
            method="bounded",
            options={"xatol": 1e-6 * max(1.0, hi_e)},
        )
        best = max(best, -float(res.fun))
    return float(min(best, 1.0 - alpha))
