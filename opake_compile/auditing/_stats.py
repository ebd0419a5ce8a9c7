"""The hypothesis tests behind the one-run audit (private; see :mod:`opake_compile.auditing`).

Setting (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run",
arXiv:2305.08846). m canaries; each is included in training by an independent fair coin. After
training, an attacker who sees the model (through the canaries' scores) guesses "included" for
the k highest-scored canaries and abstains on the rest; c of its k guesses are correct. A
mechanism that is private with respect to each canary cannot make c large: for every privacy
claim there is a bound on P[c >= observed], and when that bound is at most the significance
level tau the claim is rejected. The *estimate* is the strongest claim still rejected, a lower
bound on the privacy loss that holds with probability at least 1 - tau.

Two families of claims are tested:

* (epsilon, delta)-DP, with the bound of Steinke et al. (their Theorem 3 and Proposition 5,
  one-sided: no "excluded" guesses): the correct guesses are stochastically dominated by
  Binomial(k, e^eps / (1 + e^eps)) up to a delta term 2 m delta max_i P[c - i <= B < c] / i.
* mu-GDP (f-DP with the Gaussian trade-off function f_mu(a) = Phi(Phi^-1(1 - a) - mu), Dong,
  Roth & Su 2022), with the recursive bound of Mahloujifar, Melis & Chaudhuri (2024, "Auditing
  f-Differential Privacy in One Run", arXiv:2410.22235; the version with a cap on the guess
  probabilities). It uses the whole trade-off curve rather than one (epsilon, delta) point and
  is markedly tighter for the Gaussian mechanism that DP-SGD is.

Every function here works on counts only (k guesses, c correct, m canaries); which guesses
are tried and the multiple-testing correction live in ``_one_run.py``. The functions are
written for speed on scalars: Phi via ``math.erfc``, Phi^-1 via ``statistics.NormalDist``, no
numpy in the inner loop of the f-DP recursion.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

import numpy as np
from scipy import stats

__all__ = [
    "gdp_rejected",
    "eps_delta_p_value",
    "eps_delta_max_rejected_delta",
    "largest_rejected",
    "gdp_epsilon",
    "gdp_delta",
    "gdp_beta",
    "gdp_advantage",
]

_STD = NormalDist()
_SQRT1_2 = 1.0 / math.sqrt(2.0)


def _phi(z: float) -> float:
    """Standard normal CDF, accurate in the lower tail (erfc, no cancellation)."""
    return 0.5 * math.erfc(-z * _SQRT1_2)


def _gdp_blow_up_inverse(mu: float) -> Callable[[float], float]:
    """x -> Phi(Phi^-1(x) - mu): the inverse of the mu-GDP blow-up x -> 1 - f_mu(x)."""

    def g(x: float) -> float:
        if x <= 0.0:
            return 0.0
        if x >= 1.0:
            return 1.0
        return _phi(_STD.inv_cdf(x) - mu)

    return g


def gdp_rejected(mu: float, m: int, k: int, c: int, tau: float) -> bool:
    """Whether observing ``c`` correct out of ``k`` guesses among ``m`` canaries rejects the
    claim "mu-GDP with respect to each canary" at significance ``tau``.

    The recursion of Mahloujifar, Melis & Chaudhuri (2024) with the cap: start from the
    probability mass tau c / m on correct and tau (k - c) / m on wrong guesses and push it
    down through the trade-off curve one correct guess at a time; if the mass it can spread is
    larger than the k / m guesses made, ``c`` correct guesses have probability at most tau.
    Monotone: if it holds for ``mu`` it holds for every smaller ``mu``.
    """
    if c <= 0 or k <= 0:
        return False
    if mu <= 0.0:  # 0-GDP: guesses are independent of the coins; c > k/2 is the only signal
        g = lambda x: x  # noqa: E731
    else:
        g = _gdp_blow_up_inverse(mu)
    r = tau * c / m
    h = tau * (k - c) / m
    for i in range(c - 1, -1, -1):
        h_new = g(r)
        if h_new <= h:  # h (hence r) can no longer change
            break
        r = min(r + (i / (k - i)) * (h_new - h), 1.0)
        h = h_new
    return r + h > k / m


def eps_delta_p_value(eps: float, delta: float, m: int, k: int, c: int) -> float:
    """Upper bound on P[at least ``c`` of ``k`` guesses correct] under (eps, delta)-DP.

    Steinke, Nasr & Jagielski (2023), Proposition 5 (one-sided guesses): with
    B ~ Binomial(k, e^eps / (1 + e^eps)),
    P[B >= c] + 2 m delta max_{1 <= i <= c} P[c - i <= B < c] / i. Increasing in eps and delta.
    """
    if c <= 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-eps)) if eps < 700 else 1.0
    tail = float(stats.binom.sf(c - 1, k, q))
    if delta == 0.0:
        return tail
    return min(tail + 2.0 * m * delta * _steinke_alpha(q, k, c, tail), 1.0)


def _steinke_alpha(q: float, k: int, c: int, tail: float) -> float:
    i = np.arange(1, c + 1)
    sf = stats.binom.sf(c - i - 1, k, q)  # P[B >= c - i]
    return float(np.max((sf - tail) / i))


def eps_delta_max_rejected_delta(eps: float, m: int, k: int, c: int, tau: float) -> float:
    """The largest delta for which (eps, delta)-DP is rejected at significance ``tau`` by ``c``
    of ``k`` correct guesses (0 when even (eps, 0) is not rejected). Closed form: the p-value
    of :func:`eps_delta_p_value` is affine in delta."""
    if c <= 0:
        return 0.0
    q = 1.0 / (1.0 + math.exp(-eps)) if eps < 700 else 1.0
    tail = float(stats.binom.sf(c - 1, k, q))
    if tail > tau:
        return 0.0
    a = _steinke_alpha(q, k, c, tail)
    if a <= 0.0:
        return 1.0
    return min((tau - tail) / (2.0 * m * a), 1.0)


def largest_rejected(rejects: Callable[[float], bool], lo: float, *, hi: float | None = None, rtol: float = 1e-6) -> float:
    """The largest x >= ``lo`` with ``rejects(x)``, for a monotone (true, then false) test.

    ``rejects(lo)`` must hold (the caller checked). Returns the lower end of the final bracket,
    so the result is always a value the test verified (rounded towards "no evidence").
    """
    if hi is None:
        hi = max(1.0, 2.0 * lo)
        while rejects(hi):
            lo, hi = hi, 2.0 * hi
            if hi > 1e6:  # no finite bound: every claim is rejected
                return math.inf
    while hi - lo > rtol * max(hi, 1e-3):
        mid = 0.5 * (lo + hi)
        if rejects(mid):
            lo = mid
        else:
            hi = mid
    return lo


# ----------------------------------------------------------------------------- mu-GDP conversions
def gdp_delta(mu: float, eps: float) -> float:
    """delta(eps) of mu-GDP (Dong, Roth & Su 2022, Corollary 2.13):
    Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2), computed in the log domain."""
    if mu <= 0.0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = stats.norm.logcdf(-eps / mu + mu / 2.0)
    b = eps + stats.norm.logcdf(-eps / mu - mu / 2.0)
    if b >= a:
        return 0.0
    return float(math.exp(a) * -math.expm1(b - a))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest eps with mu-GDP => (eps, delta)-DP (0 if delta >= delta(0)); via
    dp-accounting's analytic Gaussian mechanism (Balle & Wang 2018) with sigma = 1/mu."""
    import dp_accounting

    if mu <= 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    return float(dp_accounting.get_epsilon_gaussian(1.0 / mu, delta))


def gdp_beta(mu: float, alpha: float) -> float:
    """The mu-GDP trade-off function f_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)."""
    return float(stats.norm.cdf(stats.norm.ppf(1.0 - alpha) - mu))


def gdp_advantage(mu: float) -> float:
    """max_alpha (1 - alpha - f_mu(alpha)) = 2 Phi(mu / 2) - 1: the total-variation distance."""
    return float(2.0 * stats.norm.cdf(mu / 2.0) - 1.0)
