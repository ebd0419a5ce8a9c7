"""Hypothesis properties of opake_compile.accounting.

Monotonicity of the spent privacy (epsilon non-increasing in the noise multiplier,
non-decreasing in the number of steps and in the sample rate) for both accountants, and the
algebra of processes (repeats multiply, composition adds). RDP is cheap and gets more examples;
PLD uses a coarse discretisation and few examples. PLD's pessimistic rounding may wobble at the
level of its discretisation interval, so PLD comparisons allow that much slack.
"""

from __future__ import annotations

import math

import dp_accounting
from dp_accounting.rdp import RdpAccountant
from hypothesis import given, settings
from hypothesis import strategies as st

from opake_compile import accounting as acc

INTERVAL = 1e-3
PLD = acc.Accountant("pld", value_discretization_interval=INTERVAL)
# Integer orders: the fractional orders of the default set are slow in dp-accounting (a series
# that often runs to its 1000-term cap) and add nothing to a monotonicity property.
ORDERS = [*range(2, 65), 128, 256]
RDP = acc.Accountant("rdp", orders=ORDERS)
SLACK = {PLD: 5 * INTERVAL, RDP: 1e-9}
DELTA = 1e-5

sigmas = st.floats(min_value=0.6, max_value=4.0)
rates = st.floats(min_value=1e-3, max_value=0.5)
rdp_steps = st.integers(min_value=1, max_value=10_000)
pld_steps = st.integers(min_value=1, max_value=64)

RDP_SETTINGS = settings(max_examples=20, deadline=None, derandomize=True)
PLD_SETTINGS = settings(max_examples=8, deadline=None, derandomize=True)


def eps(sigma: float, q: float, steps: int, accountant: acc.Accountant) -> float:
    return (acc.poisson(acc.gaussian(sigma), q) * steps).epsilon_at(DELTA, accountant=accountant)


def check_sigma(accountant, s1, s2, q, k):
    lo, hi = sorted((s1, s2))
    assert eps(hi, q, k, accountant) <= eps(lo, q, k, accountant) + SLACK[accountant]


def check_steps(accountant, sigma, q, k1, k2):
    lo, hi = sorted((k1, k2))
    assert eps(sigma, q, lo, accountant) <= eps(sigma, q, hi, accountant) + SLACK[accountant]


def check_rate(accountant, sigma, q1, q2, k):
    lo, hi = sorted((q1, q2))
    assert eps(sigma, lo, k, accountant) <= eps(sigma, hi, k, accountant) + SLACK[accountant]


@RDP_SETTINGS
@given(sigmas, sigmas, rates, rdp_steps)
def test_rdp_epsilon_non_increasing_in_sigma(s1, s2, q, k):
    check_sigma(RDP, s1, s2, q, k)


@RDP_SETTINGS
@given(sigmas, rates, rdp_steps, rdp_steps)
def test_rdp_epsilon_non_decreasing_in_steps(sigma, q, k1, k2):
    check_steps(RDP, sigma, q, k1, k2)


@RDP_SETTINGS
@given(sigmas, rates, rates, rdp_steps)
def test_rdp_epsilon_non_decreasing_in_sample_rate(sigma, q1, q2, k):
    check_rate(RDP, sigma, q1, q2, k)


@PLD_SETTINGS
@given(sigmas, sigmas, rates, pld_steps)
def test_pld_epsilon_non_increasing_in_sigma(s1, s2, q, k):
    check_sigma(PLD, s1, s2, q, k)


@PLD_SETTINGS
@given(sigmas, rates, pld_steps, pld_steps)
def test_pld_epsilon_non_decreasing_in_steps(sigma, q, k1, k2):
    check_steps(PLD, sigma, q, k1, k2)


@PLD_SETTINGS
@given(sigmas, rates, rates, pld_steps)
def test_pld_epsilon_non_decreasing_in_sample_rate(sigma, q1, q2, k):
    check_rate(PLD, sigma, q1, q2, k)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(sigmas, rates, st.integers(0, 500), st.integers(0, 500))
def test_repeats_and_composition_add_up(sigma, q, a, b):
    step = acc.poisson(acc.gaussian(sigma), q)
    # Under RDP composition is exactly additive, so every way of writing a+b steps agrees with
    # dp-accounting's own RDP of a+b steps.
    expected = 0.0
    if a + b:
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), a + b
        )
        expected = RdpAccountant(orders=ORDERS).compose(event).get_epsilon(DELTA)
    for process in (step * a | b * step, step * (a + b)):
        assert math.isclose(process.epsilon_at(DELTA, accountant=RDP), expected, rel_tol=1e-9, abs_tol=1e-12)
    assert (step * a) * b == step * (a * b)
    assert hash(step * a | step * b) == hash(acc.poisson(acc.gaussian(sigma), q) * a | step * b)
