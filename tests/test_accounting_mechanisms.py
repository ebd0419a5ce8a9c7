"""The DP-SGD family of mechanisms beyond the plain Gaussian: ``adaclip`` and its noise split.

Oracles: dp-accounting composing the Gaussian events itself, and the closed-form identity
sigma_eff^-2 = sigma^-2 + sigma_b^-2 for two Gaussian queries on one sample.
"""

from __future__ import annotations

import math
import warnings

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from opake_compile import accounting as acc
from opake_compile._validate import NotPrivateWarning
from opake_compile.dpsgd import accounting as dpsgd_acc
from opake_compile.exceptions import ConfigurationError, InputTypeError

DELTA = 1e-5
COARSE = acc.Accountant("pld", value_discretization_interval=1e-3)


def _eps(accountant_cls, event, **kw):
    a = accountant_cls(**kw)
    a.compose(event)
    return a.get_epsilon(DELTA)


def _two_gaussians(sigma, sigma_b):
    return dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(sigma), dp_accounting.GaussianDpEvent(sigma_b)])


@pytest.mark.parametrize("sigma, sigma_b", [(1.0, 0.4), (2.0, 5.0)])
def test_adaclip_alone_matches_dp_accounting_composing_two_gaussians(sigma, sigma_b):
    ours = (acc.adaclip(sigma, sigma_b) * 3).epsilon_at(DELTA, accountant=COARSE)
    theirs = _eps(
        PLDAccountant, dp_accounting.SelfComposedDpEvent(_two_gaussians(sigma, sigma_b), 3), value_discretization_interval=1e-3
    )
    assert ours == pytest.approx(theirs, rel=1e-9)


@pytest.mark.parametrize("sigma, sigma_b, q, steps", [(1.0, 0.4, 0.1, 50), (1.1, 3.0, 0.01, 500)])
def test_poisson_adaclip_matches_rdp_of_composed_events(sigma, sigma_b, q, steps):
    ours = (acc.poisson(acc.adaclip(sigma, sigma_b), q) * steps).epsilon_at(DELTA, accountant="rdp")
    theirs = _eps(
        RdpAccountant,
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, _two_gaussians(sigma, sigma_b)), steps),
    )
    assert ours == pytest.approx(theirs, rel=1e-9)


def test_poisson_adaclip_equals_gaussian_composition_and_issue_number():
    # The issue's case: poisson(gaussian(1.0) | gaussian(0.4), 0.1) * 50 gives 44.7 under PLD.
    a = acc.poisson(acc.adaclip(1.0, 0.4), 0.1) * 50
    b = acc.poisson(acc.gaussian(1.0) | acc.gaussian(0.4), 0.1) * 50
    assert a.to_dp_event() == b.to_dp_event()
    eff = acc.adaclip(1.0, 0.4).effective_noise_multiplier
    assert eff == pytest.approx((1 + 0.4**-2) ** -0.5, rel=1e-15)
    assert 44.0 < a.epsilon_at(DELTA, accountant=COARSE) < 45.5


@pytest.mark.parametrize("total, sigma_b", [(1.0, 2.0), (0.7, 10.0), (3.0, 3.0001)])
def test_noise_split_spends_exactly_the_total(total, sigma_b):
    sigma, count = acc.adaclip_noise_multipliers(total, sigma_b)
    assert count == sigma_b and sigma > total
    assert sigma**-2 + sigma_b**-2 == pytest.approx(total**-2, rel=1e-12)
    split = acc.poisson(acc.adaclip(sigma, sigma_b), 0.02) * 100
    plain = acc.poisson(acc.gaussian(total), 0.02) * 100
    assert split.epsilon_at(DELTA, accountant="rdp") == pytest.approx(plain.epsilon_at(DELTA, accountant="rdp"), rel=1e-9)


def test_noise_split_refuses_a_count_noise_too_small():
    with pytest.raises(ConfigurationError, match="count_noise_multiplier"):
        acc.adaclip_noise_multipliers(1.0, 1.0)
    with pytest.raises(ConfigurationError, match="count_noise_multiplier"):
        acc.adaclip_noise_multipliers(2.0, 0.5)
    with pytest.raises(ConfigurationError):
        acc.adaclip_noise_multipliers(-1.0, 2.0)
    with pytest.raises(InputTypeError):
        acc.adaclip_noise_multipliers("1", 2.0)


def test_adaclip_validation_and_reexports():
    with pytest.raises(ConfigurationError):
        acc.adaclip(1.0, -0.1)
    with pytest.warns(NotPrivateWarning):
        zero = acc.adaclip(1.0, 0.0)
    assert zero.effective_noise_multiplier == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        assert math.isinf(acc.poisson(zero, 0.1).epsilon_at(DELTA))
    assert dpsgd_acc.adaclip is acc.adaclip and dpsgd_acc.adaclip_noise_multipliers is acc.adaclip_noise_multipliers
    assert repr(acc.adaclip(1.0, 0.4)) == "adaclip(1.0, 0.4)"
