"""f-DP views (``beta_at``, ``advantage``, ``risk_at``), their budgets, and ``PrivacyValue``.

Oracles: the mu-GDP closed forms of the Gaussian mechanism (Dong, Roth and Su 2022): k-fold
``gaussian(sigma)`` is mu-GDP with mu = sqrt(k) / sigma, beta(alpha) = Phi(Phi^-1(1 - alpha) - mu),
advantage 2 Phi(mu / 2) - 1, and the Bayes risk found by minimising prior * alpha + (1 - prior)
* beta(alpha) numerically. PLD is pessimistic, so every comparison is one-sided: the views may
err towards less privacy (smaller beta and risk, larger advantage) by a small tolerance, never
the other way. Subsampled processes are checked against dp-accounting's own PLD.
"""

from __future__ import annotations

import json
import math
import pickle
import warnings

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from scipy import optimize, stats

from opake_compile import accounting as acc
from opake_compile._validate import NotPrivateWarning
from opake_compile.dpsgd import accounting as dpsgd_acc
from opake_compile.exceptions import ConfigurationError, InputTypeError

PLD = acc.Accountant("pld", value_discretization_interval=1e-3)  # pessimistic at any grid; faster
EXACT = 1e-9  # float slack on the never-less-private side
TOL = 2e-3  # how much more pessimistic than the closed form a view may be


def gdp_beta(mu, alpha):
    return stats.norm.cdf(stats.norm.ppf(1 - alpha) - mu)


def gdp_advantage(mu):
    return 2 * stats.norm.cdf(mu / 2) - 1


def gdp_risk(mu, prior):
    res = optimize.minimize_scalar(
        lambda a: prior * a + (1 - prior) * gdp_beta(mu, a), bounds=(0.0, 1.0), method="bounded", options={"xatol": 1e-12}
    )
    return min(res.fun, prior, 1 - prior)


GAUSSIANS = [(0.5, 1), (1.0, 1), (2.0, 1), (4.0, 3), (1.5, 10)]  # (sigma, repeats)


@pytest.mark.parametrize("sigma, k", GAUSSIANS)
@pytest.mark.parametrize("alpha", [1e-4, 0.05, 0.7])
def test_beta_matches_gdp_closed_form_one_sided(sigma, k, alpha):
    mu = math.sqrt(k) / sigma
    beta = (acc.gaussian(sigma) * k).beta_at(alpha, accountant=PLD)
    true = gdp_beta(mu, alpha)
    assert beta <= true + EXACT  # never more private than the truth
    assert beta >= true - TOL


@pytest.mark.parametrize("sigma, k", GAUSSIANS)
def test_advantage_matches_gdp_closed_form_one_sided(sigma, k):
    mu = math.sqrt(k) / sigma
    adv = (acc.gaussian(sigma) * k).advantage(accountant=PLD)
    assert gdp_advantage(mu) - EXACT <= adv <= gdp_advantage(mu) + TOL


@pytest.mark.parametrize("sigma, k", GAUSSIANS[:3])
@pytest.mark.parametrize("prior", [0.01, 0.5, 0.9])
def test_risk_matches_numerical_bayes_error_one_sided(sigma, k, prior):
    mu = math.sqrt(k) / sigma
    risk = (acc.gaussian(sigma) * k).risk_at(prior, accountant=PLD)
    true = gdp_risk(mu, prior)
    assert true - TOL <= risk <= true + 1e-7  # the oracle's own minimisation is accurate to ~1e-9


def test_default_grid_views_match_closed_forms():
    mu = 1.0
    g = acc.gaussian(1 / mu)
    assert gdp_beta(mu, 0.05) - 1e-4 <= g.beta_at(0.05) <= gdp_beta(mu, 0.05) + EXACT
    assert gdp_advantage(mu) - EXACT <= g.advantage() <= gdp_advantage(mu) + 1e-4


def test_views_of_trivial_processes():
    idle = acc.identity()
    assert idle.advantage() == 0.0
    assert idle.beta_at(0.2) == pytest.approx(0.8, abs=1e-12)
    assert idle.risk_at(0.3) == pytest.approx(0.3, abs=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        leak = acc.nonprivate()
        assert leak.advantage() == 1.0 and leak.beta_at(0.2) == 0.0 and leak.risk_at(0.5) == 0.0
    assert acc.gaussian(1.0).beta_at(1.0) == 0.0
    assert acc.gaussian(1.0).risk_at(0.0) == 0.0 and acc.gaussian(1.0).risk_at(1.0) == 0.0
    with pytest.raises(ConfigurationError):
        acc.gaussian(1.0).beta_at(1.5)
    with pytest.raises(ConfigurationError):
        acc.gaussian(1.0).risk_at(-0.1)


def test_subsampled_views_against_dp_accounting_pld():
    process = acc.poisson(acc.gaussian(1.0), 0.02) * 300
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0)), 300
    )
    direct = PLDAccountant(value_discretization_interval=1e-3)
    direct.compose(event)
    coarse = acc.Accountant("pld", value_discretization_interval=1e-3)
    assert process.advantage(accountant=coarse) == pytest.approx(direct.get_delta(0.0), rel=1e-9)
    prior = 0.8
    eps = math.log(prior / (1 - prior))
    assert process.risk_at(prior, accountant=coarse) == pytest.approx((1 - prior) * (1 - direct.get_delta(eps)), rel=1e-9)
    # beta is the supremum of Prop. 2.12's lines; each line at a given eps is a lower bound.
    for alpha in (0.01, 0.1):
        beta = process.beta_at(alpha, accountant=coarse)
        for e in (0.0, 0.5, 1.0, 2.0):
            d = direct.get_delta(e)
            line = max(0.0, 1 - d - math.exp(e) * alpha, math.exp(-e) * (1 - d - alpha))
            assert beta >= line - 1e-12
    betas = [process.beta_at(a, accountant=coarse) for a in (0.001, 0.01, 0.1, 0.5)]
    assert all(x >= y for x, y in zip(betas, betas[1:]))


def test_rdp_views_are_more_pessimistic_than_pld():
    process = acc.poisson(acc.gaussian(1.2), 0.05) * 100
    coarse = acc.Accountant("pld", value_discretization_interval=1e-3)
    assert process.advantage(accountant="rdp") >= process.advantage(accountant=coarse) - 1e-9
    assert process.risk_at(0.5, accountant="rdp") <= process.risk_at(0.5, accountant=coarse) + 1e-9


# ------------------------------------------------------------------------------ budgets
def test_advantage_budget_calibrates_to_the_closed_form():
    target = 0.1
    sigma_star = 1 / (2 * stats.norm.ppf((1 + target) / 2))  # 2 Phi(mu/2) - 1 = target
    result = acc.calibrate(acc.advantage_budget(target), acc.gaussian, 1.0, 100.0, accountant=PLD)
    assert sigma_star * (1 - EXACT) <= result.param <= sigma_star * 1.01
    assert result.spent <= target and math.isnan(result.epsilon)
    assert acc.advantage_budget(target).allows(acc.gaussian(result.param), PLD)


def test_beta_budget_calibrates_to_the_closed_form():
    alpha, beta = 0.05, 0.9
    sigma_star = 1 / (stats.norm.ppf(1 - alpha) - stats.norm.ppf(beta))
    result = acc.calibrate(acc.beta_budget(alpha, beta), acc.gaussian, 0.5, 100.0, accountant=PLD)
    assert sigma_star * (1 - EXACT) <= result.param <= sigma_star * 1.01
    assert result.spent >= beta


def test_risk_budget_calibrates_steps_of_a_mechanism():
    # risk at prior 1/2 is (1 - advantage) / 2: the largest k with sqrt(k)/sigma <= mu_star.
    risk = 0.45
    mu_star = 2 * stats.norm.ppf((1 + (1 - 2 * risk)) / 2)
    sigma = 10.0
    k = acc.Accountant("pld", value_discretization_interval=1e-3).max_steps(acc.gaussian(sigma), acc.risk_budget(0.5, risk))
    assert k == math.floor((mu_star * sigma) ** 2) or k == math.floor((mu_star * sigma) ** 2) - 1


def test_budget_validation():
    with pytest.raises(ConfigurationError):
        acc.advantage_budget(1.5)
    with pytest.raises(ConfigurationError):
        acc.beta_budget(0.3, 0.8)  # beta above 1 - alpha
    with pytest.raises(ConfigurationError):
        acc.risk_budget(0.2, 0.3)  # above the prior's own error
    with pytest.raises(InputTypeError):
        acc.beta_budget("0.1", 0.5)
    assert acc.beta_budget(0.05, 0.9).larger_is_private and not acc.advantage_budget(0.1).larger_is_private


# ------------------------------------------------------------------------------ values
def test_results_are_plain_numbers_that_know_their_accountant():
    eps = (acc.poisson(acc.gaussian(1.0), 0.01) * 100).epsilon_at(1e-5)
    assert isinstance(eps, float) and isinstance(eps, acc.PrivacyValue)
    assert eps.quantity == "epsilon" and eps.accountant.startswith("Accountant('pld'")
    assert f"{eps:.3f}" == f"{float(eps):.3f}" and repr(eps) == repr(float(eps))
    assert json.loads(json.dumps({"eps": eps}))["eps"] == float(eps)
    back = pickle.loads(pickle.dumps(eps))
    assert back == eps and back.quantity == "epsilon"
    assert type(eps + 1.0) is float
    d = acc.gaussian(1.0).delta_at(1.0, accountant="rdp")
    assert d.quantity == "delta" and "rdp" in d.accountant


def test_parallel_poisson_is_one_shard():
    one = acc.poisson(acc.gaussian(1.0), 0.01)
    shards = acc.parallel_poisson(acc.gaussian(1.0), 0.01, num_shards=16)
    assert shards.to_dp_event() == one.to_dp_event()
    assert (shards * 50).to_dp_event() == (one * 50).to_dp_event()
    assert repr(shards) == "parallel_poisson(gaussian(1.0), sample_rate=0.01, num_shards=16)"
    assert dpsgd_acc.parallel_poisson is acc.parallel_poisson
    with pytest.raises(ConfigurationError):
        acc.parallel_poisson(acc.gaussian(1.0), 0.01, num_shards=0)
    with pytest.raises(ConfigurationError):
        acc.parallel_poisson(acc.eps_delta(1.0, 0.0), 0.01, num_shards=2)
    assert acc.parallel_poisson(acc.gaussian(1.0), 0.0, num_shards=3).epsilon_at(1e-5) == 0.0
    assert np.isclose((shards * 10).epsilon_at(1e-5, accountant="rdp"), (one * 10).epsilon_at(1e-5, accountant="rdp"))
