"""The fast calibration path (RDP bracket, coarse PLD grid) and the range-end flag.

Oracles: the same calibration with the fine accountant alone (``fast=False``) and
dp-accounting's own PLD accountant on the returned parameter; the Gaussian closed form where
the whole range meets the budget.
"""

from __future__ import annotations

import warnings

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant

from opake_compile import accounting as acc
from opake_compile.accounting import CalibrationRangeWarning
from opake_compile.accounting._accountant import coarse_interval
from opake_compile.exceptions import CalibrationError

FINE = acc.Accountant("pld", value_discretization_interval=1e-3)


def _steps(q, k):
    return lambda s: acc.poisson(acc.gaussian(s), q) * k


def _direct_eps(sigma, q, k, interval):
    a = PLDAccountant(value_discretization_interval=interval)
    a.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), k))
    return a.get_epsilon(1e-5)


@pytest.mark.parametrize("eps, q, k", [(3.0, 0.01, 500), (20.0, 0.04, 200)])
def test_fast_sigma_is_within_one_percent_above_the_fine_answer(eps, q, k):
    budget = acc.epsilon_budget(eps, 1e-5)
    fast = acc.calibrate(budget, _steps(q, k), 0.2, 20.0, accountant=FINE)
    slow = acc.calibrate(budget, _steps(q, k), 0.2, 20.0, accountant=FINE, fast=False)
    grid = float(fast.accountant.split("=")[-1].rstrip(")"))
    assert 1e-3 <= grid <= coarse_interval(budget)  # the coarse grid, or a refinement of it
    # never less private than the fine-grid answer (up to the bisection tolerance), within 1 %
    assert slow.param * (1 - 2e-3) <= fast.param <= slow.param * 1.01
    # and it meets the budget under dp-accounting's own accountant at the fine grid
    assert _direct_eps(fast.param, q, k, 1e-3) <= eps
    assert fast.epsilon <= eps and fast.spent == fast.epsilon


def test_whole_range_meeting_the_budget_is_flagged_and_warned():
    budget = acc.epsilon_budget(10.0, 1e-5)
    with pytest.warns(CalibrationRangeWarning, match="param_min"):
        result = acc.calibrate(budget, acc.gaussian, 1.0, 5.0)
    assert result.at_range_end and result.param == 1.0 and result.bracket == (1.0, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        inside = acc.calibrate(budget, acc.gaussian, 0.2, 5.0)
    assert not inside.at_range_end and 0.2 < inside.param < 1.0
    with pytest.raises(CalibrationError, match="No parameter in the range meets the budget"):
        acc.calibrate(acc.epsilon_budget(0.1, 1e-5), acc.gaussian, 1.0, 5.0)


def test_fast_path_falls_back_when_rdp_cannot_account():
    # eps_delta parts have no RDP curve: the search runs on the coarse PLD grid over the range.
    budget = acc.epsilon_budget(5.0, 1e-5)
    result = acc.calibrate(budget, lambda s: acc.gaussian(s) * 2 | acc.eps_delta(1.0, 1e-7), 0.5, 20.0, accountant=FINE)
    assert result.epsilon <= 5.0 and not result.at_range_end
    assert FINE.epsilon(result.process, 1e-5) <= 5.0 + 1e-2


@pytest.mark.parametrize("factor", [0.2, 5.0])
def test_answer_outside_the_rdp_bracket_is_still_found(monkeypatch, factor):
    # Force RDP's bracket to miss the answer (entirely below it, or entirely above it): the PLD
    # bisection must move it until it holds the answer.
    from opake_compile.accounting import _calibration

    budget = acc.epsilon_budget(3.0, 1e-5)
    slow = acc.calibrate(budget, _steps(0.05, 100), 0.1, 50.0, accountant=FINE, fast=False)
    coarse = acc.Accountant("pld", value_discretization_interval=coarse_interval(budget))
    reference = acc.calibrate(budget, _steps(0.05, 100), 0.1, 50.0, accountant=coarse, fast=False)
    wrong = (reference.param * factor, reference.param * factor * 1.2, False)
    monkeypatch.setattr(_calibration, "_rdp_bracket", lambda search, lo, hi, inc: wrong)
    fast = acc.calibrate(budget, _steps(0.05, 100), 0.1, 50.0, accountant=FINE)
    assert fast.param == pytest.approx(reference.param, rel=2e-3)
    assert slow.param * (1 - 2e-3) <= fast.param <= slow.param * 1.01
    assert fast.epsilon <= 3.0
