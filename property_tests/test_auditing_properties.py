"""Hypothesis and statistical properties of opake_compile.auditing.

* Hypothesis: for arbitrary scores (ties, infinities) and coins, every bound lies in
  [0, ceiling], does not grow with the confidence level, depends only on the order of the
  scores, and the (eps, delta) bound does not grow with delta.
* Coverage (the guarantee itself): scores of a mu-GDP mechanism (N(mu, 1) for included
  canaries, N(0, 1) for the others) over many seeds; the rate at which a bound exceeds the
  truth must be consistent with 1 - confidence (one-sided binomial test). The same test
  rejects a plug-in estimate without a confidence correction, so it can fail.
* Convergence: the GDP bound grows with the number of canaries.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import opake_compile as opake
from opake_compile import auditing
from opake_compile.auditing import _stats

DELTA = 1e-5
SETTINGS = settings(max_examples=40, deadline=None, derandomize=True)


@st.composite
def audits(draw):
    m = draw(st.integers(min_value=2, max_value=300))
    coins = draw(st.lists(st.booleans(), min_size=m, max_size=m).filter(lambda c: 0 < sum(c) < len(c)))
    values = st.one_of(st.integers(-3, 3).map(float), st.floats(-1e6, 1e6), st.sampled_from([math.inf, -math.inf]))
    scores = np.array(draw(st.lists(values, min_size=m, max_size=m)))
    if draw(st.booleans()):  # give the included canaries a head start so bounds are often > 0
        scores = np.where(np.array(coins), scores + draw(st.floats(0, 10)), scores)
    return scores, auditing.CanaryRecord(tuple(coins))


@SETTINGS
@given(audits(), st.sampled_from([0.5, 0.8, 0.95]))
def test_bounds_lie_between_zero_and_the_ceiling(audit, confidence):
    scores, rec = audit
    est = auditing.one_run(scores, rec, confidence=confidence)
    ceil = est.ceiling()
    assert 0.0 <= est.mu_lower_bound <= est.mu_ceiling + 1e-12
    assert ceil.mu_lower_bound == pytest.approx(est.mu_ceiling, rel=1e-3, abs=1e-9)
    ed, ced = est.eps_delta(), ceil.eps_delta()
    for d in (0.0, DELTA, 1e-2):
        assert 0.0 <= ed.epsilon_at(d) <= ced.epsilon_at(d) + 1e-6
    assert ed.epsilon_at(1e-2) <= ed.epsilon_at(DELTA) + 1e-6 <= ed.epsilon_at(0.0) + 2e-6
    assert 0.0 <= ed.delta_at(1.0) <= 1.0 and 0.0 <= est.delta_at(1.0) <= 1.0
    assert 0.0 <= est.attack_auc() <= 1.0 and 0.0 <= est.attack_beta_at(0.1) <= 1.0


@SETTINGS
@given(audits())
def test_more_confidence_never_gives_a_larger_bound(audit):
    scores, rec = audit
    lo, hi = auditing.one_run(scores, rec, confidence=0.99), auditing.one_run(scores, rec, confidence=0.6)
    assert lo.mu_lower_bound <= hi.mu_lower_bound + lo.mu_ceiling / lo.grid_size
    assert lo.eps_delta().epsilon_at(DELTA) <= hi.eps_delta().epsilon_at(DELTA) + 1e-6


@SETTINGS
@given(audits())
def test_only_the_order_of_the_scores_matters(audit):
    scores, rec = audit
    a = auditing.one_run(scores, rec)
    b = auditing.one_run(np.arctan(scores) * 3.0 - 1.0, rec)  # strictly increasing, maps inf to finite
    assert a.mu_lower_bound == b.mu_lower_bound
    assert a.eps_delta().epsilon_at(DELTA) == b.eps_delta().epsilon_at(DELTA)


# ----------------------------------------------------------------------------- coverage
def _gaussian_scores(m, mu, seed):
    rec = auditing.coin_flip(m, opake.random.fold_in(opake.random.key(2024), seed))
    scores = np.random.default_rng([2024, seed]).normal(size=m) + mu * rec.mask()
    return scores, rec


def _plug_in_mu(scores, mask):
    """What one would get forgetting the confidence correction: the best threshold's
    Phi^-1(TPR) - Phi^-1(FPR) (Gaussian fit through one ROC point), no interval, no split."""
    t = np.quantile(scores, np.linspace(0.02, 0.98, 49))
    tpr = (scores[mask][:, None] >= t).mean(0)
    fpr = (scores[~mask][:, None] >= t).mean(0)
    ok = (tpr > 0) & (tpr < 1) & (fpr > 0) & (fpr < 1)
    return float(np.max(stats.norm.ppf(tpr[ok]) - stats.norm.ppf(fpr[ok])))


@pytest.mark.slow
@pytest.mark.parametrize("mu", [0.0, 0.3, 1.5])
def test_coverage_is_consistent_with_the_confidence_level(mu):
    """P[bound > truth] <= 1 - confidence, checked at confidence 0.95 and 0.5 (the weaker level
    gives the test some bite: its failures are frequent enough to count)."""
    m, seeds = 400, 150
    true_eps = _stats.gdp_epsilon(mu, DELTA)
    exceed = {("gdp", 0.95): 0, ("gdp", 0.5): 0, ("eps_delta", 0.95): 0, ("eps_delta", 0.5): 0}
    plug_in = 0
    for seed in range(seeds):
        scores, rec = _gaussian_scores(m, mu, seed)
        for conf in (0.95, 0.5):
            est = auditing.one_run(scores, rec, confidence=conf, grid_size=2000)
            exceed["gdp", conf] += est.mu_lower_bound > mu
            exceed["eps_delta", conf] += est.eps_delta().epsilon_at(DELTA) > true_eps
        plug_in += _plug_in_mu(scores, rec.mask()) > mu
    for (view, conf), k in exceed.items():
        p = stats.binomtest(k, seeds, 1 - conf, alternative="greater").pvalue
        assert p > 1e-3, f"{view} at {conf}: bound above the truth in {k}/{seeds} runs"
    # the same test rejects an estimate without a confidence correction (it overshoots the
    # truth about half the time or more)
    assert stats.binomtest(plug_in, seeds, 0.05, alternative="greater").pvalue < 1e-6, plug_in


@pytest.mark.slow
def test_gdp_bound_grows_with_the_number_of_canaries():
    mu = 1.0
    medians = []
    for m in (100, 1000, 10_000):
        mus = [auditing.one_run(*_gaussian_scores(m, mu, s)).mu_lower_bound for s in range(3)]
        medians.append(float(np.median(mus)))
    assert medians[0] < medians[1] < medians[2] <= mu, medians


# ----------------------------------------------------------------------------- nesting
@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    st.integers(2, 3000).flatmap(
        lambda m: st.tuples(st.just(m), st.integers(1, m)).flatmap(lambda mk: st.tuples(st.just(mk[0]), st.just(mk[1]), st.integers(0, mk[1])))
    ),
    st.floats(-5, -0.5),
    st.floats(-8, -2),
)
def test_rejections_are_nested(mkc, log_tau, log_delta):
    """A larger mu (a larger eps) is a weaker claim: if it is rejected, every smaller one is.
    The coverage argument needs this: the event "some claim weaker than the truth is rejected"
    is then the event "the true claim is rejected", of probability at most tau."""
    m, k, c = mkc
    tau, delta = 10.0**log_tau, 10.0**log_delta
    rejected = [_stats.gdp_rejected(mu, m, k, c, tau) for mu in np.linspace(0, 6, 61)]
    assert all(a or not b for a, b in zip(rejected, rejected[1:])), rejected
    p = [_stats.eps_delta_p_value(e, delta, m, k, c) for e in np.linspace(0, 12, 61)]
    assert all(b >= a - 1e-12 for a, b in zip(p, p[1:]))
