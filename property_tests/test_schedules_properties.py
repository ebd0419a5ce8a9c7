"""Shape properties of the learning-rate schedules (``opake_compile.schedules``).

Each property is checked against the closed form in the module docstring, over random
lengths, floors and steps: endpoints, monotonicity where the formula is monotone, bounds,
continuity at the warm-up boundary, periodicity of restarts, and that ``LambdaLR`` applies the
multiplier to the initial learning rate. The last test checks that the properties can fail (an
increasing schedule is caught by the monotonicity check).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from opake_compile import schedules as S
from opake_compile.exceptions import ConfigurationError, InputTypeError

SETTINGS = settings(max_examples=60, deadline=None)

lengths = st.integers(1, 10_000)
alphas = st.floats(0.0, 1.0)
steps = st.floats(0.0, 50_000.0, allow_nan=False)
int_steps = st.integers(0, 50_000)

DECAYS = {
    "cosine": lambda t_max, a: S.cosine_schedule(t_max, a),
    "one_minus_sqrt": lambda t_max, a: S.one_minus_sqrt_schedule(t_max, a),
}


def _non_increasing(s, t1: float, t2: float) -> bool:
    lo, hi = sorted((t1, t2))
    return s(hi) <= s(lo) + 1e-12


@pytest.mark.parametrize("name", sorted(DECAYS))
@SETTINGS
@given(t_max=lengths, a=alphas, t1=steps, t2=steps)
def test_decays_run_from_one_to_alpha_monotonically(name, t_max, a, t1, t2):
    s = DECAYS[name](t_max, a)
    assert s(0) == 1.0
    assert s(t_max) == a and s(t_max + t1) == a
    assert a - 1e-12 <= s(t1) <= 1.0 + 1e-12
    assert _non_increasing(s, t1, t2)


@SETTINGS
@given(t_max=lengths, a=alphas)
def test_cosine_midpoint_and_one_minus_sqrt_quarter(t_max, a):
    assert math.isclose(S.cosine_schedule(t_max, a)(t_max / 2), (1 + a) / 2, rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(S.one_minus_sqrt_schedule(t_max, a)(t_max / 4), 1 - (1 - a) / 2, rel_tol=1e-12, abs_tol=1e-12)


@SETTINGS
@given(k=lengths, t1=steps, t2=steps, factor=st.floats(1.0, 100.0))
def test_inverse_sqrt(k, t1, t2, factor):
    s = S.inverse_sqrt_schedule(k)
    assert s(0) == 1.0 and s(k) == 1.0 and s(min(t1, k)) == 1.0
    assert math.isclose(s(k * factor), 1 / math.sqrt(factor), rel_tol=1e-12)
    assert 0 < s(t1) <= 1.0
    assert _non_increasing(s, t1, t2)


@SETTINGS
@given(value=st.floats(0.0, 10.0), t=steps)
def test_constant(value, t):
    assert S.constant_schedule(value)(t) == value


@SETTINGS
@given(w=st.integers(1, 1000), t_max=lengths, a=alphas, init=alphas, t=steps, t1=steps, t2=steps)
def test_warmup_ramps_linearly_and_joins_the_decay_continuously(w, t_max, a, init, t, t1, t2):
    inner = S.cosine_schedule(t_max, a)
    s = S.with_warmup(inner, w, init_value=init)
    assert math.isclose(s(0), init, abs_tol=1e-12)
    # continuity at the boundary: the ramp's limit is the decay's start
    for eps in (1e-3, 1e-6, 1e-9):
        assert abs(s(w - eps * w) - s(w)) <= eps * (1 - init) + 1e-12
    assert s(w) == inner(0)
    assert s(w + int(t)) == inner(int(t))  # exact at integer steps
    assert math.isclose(s(w + t), inner(t), rel_tol=1e-9, abs_tol=1e-12)  # (w + t) - w rounds
    # non-decreasing during the warm-up
    lo, hi = sorted((t1 % w, t2 % w))
    assert s(lo) <= s(hi) + 1e-12


@SETTINGS
@given(period=st.integers(1, 500), repeats=st.integers(1, 6), t=st.floats(0.0, 500.0), extra=st.floats(0.0, 1e4))
def test_restarts_are_periodic_then_continue(period, repeats, t, extra):
    inner = S.cosine_schedule(period)
    s = S.with_restarts(inner, period, repeats)
    t = t % period
    # Within a period by more than rounding: t + r * period must not round into the next one
    # (t = 1 - 6e-14, period 1, r = 1000 gave 1001.0, a restart, found by Hypothesis).
    assume(t <= period * (1 - 1e-9))
    for r in range(repeats):
        assert math.isclose(s(t + r * period), inner(t), rel_tol=1e-9, abs_tol=1e-9)
    assert s(period * repeats + extra) == inner(period + extra) == 0.0
    forever = S.with_restarts(inner, period)
    assert math.isclose(forever(t + 1000 * period), inner(t), rel_tol=1e-9, abs_tol=1e-9)


@SETTINGS
@given(t_max=st.integers(1, 50), w=st.integers(0, 20), lr=st.floats(1e-4, 1.0))
def test_plugs_into_lambda_lr(t_max, w, lr):
    schedule = S.with_warmup(S.one_minus_sqrt_schedule(t_max), w)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(t_max + w + 3):
        assert math.isclose(opt.param_groups[0]["lr"], lr * schedule(step), rel_tol=1e-12, abs_tol=1e-15)
        opt.step()
        sched.step()


def test_the_monotonicity_check_can_fail():
    increasing = S.with_warmup(S.constant_schedule(), 10)
    assert not _non_increasing(increasing, 2.0, 8.0)
    assert not _non_increasing(lambda t: t, 1.0, 2.0)


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda: S.cosine_schedule(0), ConfigurationError),
        (lambda: S.cosine_schedule(10, alpha=1.5), ConfigurationError),
        (lambda: S.one_minus_sqrt_schedule(1.5), InputTypeError),
        (lambda: S.inverse_sqrt_schedule(-1), ConfigurationError),
        (lambda: S.constant_schedule(math.inf), ConfigurationError),
        (lambda: S.with_warmup(S.constant_schedule(), -1), ConfigurationError),
        (lambda: S.with_warmup("nope", 3), InputTypeError),
        (lambda: S.with_restarts(S.constant_schedule(), 0), ConfigurationError),
        (lambda: S.cosine_schedule(10)(-1), ConfigurationError),
        (lambda: S.cosine_schedule(10)("3"), InputTypeError),
    ],
)
def test_invalid_arguments(make, error):
    with pytest.raises(error):
        make()
