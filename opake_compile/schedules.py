"""Learning-rate schedules: pure functions of the step that return a learning-rate *multiplier*.

Every schedule here is a plain function ``schedule(step) -> float`` (``step`` an int or real
number >= 0, in optimizer steps), with no state: its value depends on the step alone, so a
resumed run recomputes it exactly and nothing about it needs checkpointing beyond the step
count. They plug into ``torch.optim.lr_scheduler.LambdaLR`` directly (which multiplies each
group's initial learning rate by the returned value), and compose: :func:`with_warmup` and
:func:`with_restarts` take a schedule and return a schedule.

Schedules act on the *update rule*, after the privatised gradient is formed: they are
post-processing of a DP release and cost no privacy (any schedule fixed in advance, not derived
from the private data, is fine).

Formulas (``t`` the step, ``T`` the decay length):

=============================  ==================================================================
:func:`constant_schedule`      ``value``
:func:`cosine_schedule`        ``alpha + (1 - alpha) * (1 + cos(pi * min(t, T) / T)) / 2``
                               (Loshchilov & Hutter 2017, SGDR, without restarts)
:func:`inverse_sqrt_schedule`  ``sqrt(timescale / max(t, timescale))``: 1 up to ``timescale``,
                               then ``∝ 1/sqrt(t)`` (Vaswani et al. 2017, Sec. 5.3; Raffel et
                               al. 2020, T5)
:func:`one_minus_sqrt_schedule`  ``1 - (1 - alpha) * sqrt(min(t, T) / T)`` (the "1-sqrt"
                               cool-down of Hägele et al. 2024)
:func:`with_warmup`            ``s(0) * (init + (1 - init) * t / W)`` for ``t < W``, then
                               ``s(t - W)`` (linear warm-up, Goyal et al. 2017)
:func:`with_restarts`          ``s(t mod P)`` for the first ``repeats`` periods, then ``s``
                               continues past its end (warm restarts, Loshchilov & Hutter 2017)
=============================  ==================================================================

Example::

    >>> import torch
    >>> from opake_compile import schedules
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> sched = torch.optim.lr_scheduler.LambdaLR(
    ...     opt, schedules.with_warmup(schedules.cosine_schedule(100), warmup_steps=10))
    >>> [round(schedules.cosine_schedule(100)(t), 3) for t in (0, 50, 100, 200)]
    [1.0, 0.5, 0.0, 0.0]
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from opake_compile._validate import check_positive_int
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = [
    "Schedule",
    "constant_schedule",
    "cosine_schedule",
    "inverse_sqrt_schedule",
    "one_minus_sqrt_schedule",
    "with_warmup",
    "with_restarts",
]

Schedule = Callable[[Any], float]
"""``step -> learning-rate multiplier``; ``step`` an int (or real) >= 0."""


def _step(step: Any) -> float:
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise InputTypeError(f"Expected the step to be a number, got {type(step).__name__}.")
    t = float(step)
    if not (math.isfinite(t) and t >= 0):
        raise ConfigurationError(f"Expected step={step!r} >= 0 and finite.")
    return t


def _fraction(value: Any, *, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"Expected {name} to be a number, got {type(value).__name__}.")
    v = float(value)
    if not 0.0 <= v <= 1.0:
        raise ConfigurationError(f"Expected {name}={value!r} in [0, 1].")
    return v


def _check_schedule(schedule: Any) -> Schedule:
    if not callable(schedule):
        raise InputTypeError(f"Expected a schedule (a function of the step), got {type(schedule).__name__}.")
    return schedule


def constant_schedule(value: float = 1.0) -> Schedule:
    """The multiplier ``value`` at every step.

    Args:
        value: a finite number >= 0 (default 1: the optimizer's own learning rate).

    Raises:
        InputTypeError, ConfigurationError: ``value`` is not a finite number >= 0.

    Example::

        >>> constant_schedule(0.5)(1000)
        0.5
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InputTypeError(f"Expected value to be a number, got {type(value).__name__}.")
    v = float(value)
    if not (math.isfinite(v) and v >= 0):
        raise ConfigurationError(f"Expected value={value!r} >= 0 and finite.")

    def schedule(step: Any) -> float:
        _step(step)
        return v

    return schedule


def cosine_schedule(decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine annealing from 1 to ``alpha`` over ``decay_steps`` steps, then ``alpha``.

    ``m(t) = alpha + (1 - alpha) * (1 + cos(pi * min(t, T) / T)) / 2`` (Loshchilov & Hutter
    2017, "SGDR: Stochastic Gradient Descent with Warm Restarts", Eq. 5, one cycle).
    Non-increasing; ``m(0) = 1``, ``m(T / 2) = (1 + alpha) / 2``, ``m(t >= T) = alpha``.

    Args:
        decay_steps: T >= 1.
        alpha: the final multiplier, in [0, 1].

    Raises:
        InputTypeError, ConfigurationError: ``decay_steps`` not an int >= 1; ``alpha`` outside
            [0, 1].

    Example::

        >>> cosine_schedule(10, alpha=0.1)(10)
        0.1
    """
    t_max = check_positive_int(decay_steps, name="decay_steps")
    a = _fraction(alpha, name="alpha")

    def schedule(step: Any) -> float:
        t = min(_step(step), t_max)
        if t == t_max:
            return a
        return a + (1.0 - a) * 0.5 * (1.0 + math.cos(math.pi * t / t_max))

    return schedule


def inverse_sqrt_schedule(timescale: int = 1) -> Schedule:
    """Inverse-square-root decay: 1 up to ``timescale`` steps, then ``sqrt(timescale / t)``.

    ``m(t) = sqrt(timescale / max(t, timescale))`` (Vaswani et al. 2017, "Attention Is All You
    Need", Sec. 5.3, after its warm-up; Raffel et al. 2020, T5). Continuous, non-increasing,
    never zero; combine with :func:`with_warmup` for the Transformer recipe.

    Args:
        timescale: the step at which the decay starts, >= 1.

    Raises:
        InputTypeError, ConfigurationError: ``timescale`` not an int >= 1.

    Example::

        >>> inverse_sqrt_schedule(100)(400)
        0.5
    """
    k = check_positive_int(timescale, name="timescale")

    def schedule(step: Any) -> float:
        t = _step(step)
        return 1.0 if t <= k else math.sqrt(k / t)

    return schedule


def one_minus_sqrt_schedule(decay_steps: int, alpha: float = 0.0) -> Schedule:
    """``1 - sqrt(progress)`` decay from 1 to ``alpha`` over ``decay_steps``, then ``alpha``.

    ``m(t) = 1 - (1 - alpha) * sqrt(min(t, T) / T)``: the "1-sqrt" cool-down of Hägele et al.
    2024 ("Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"). It is
    non-increasing; as a function of the progress ``t / T`` it is convex (it drops fastest at
    the start: ``m(T/4) = 1 - (1 - alpha)/2``).

    Args:
        decay_steps: T >= 1.
        alpha: the final multiplier, in [0, 1].

    Raises:
        InputTypeError, ConfigurationError: ``decay_steps`` not an int >= 1; ``alpha`` outside
            [0, 1].

    Example::

        >>> one_minus_sqrt_schedule(100)(25)
        0.5
    """
    t_max = check_positive_int(decay_steps, name="decay_steps")
    a = _fraction(alpha, name="alpha")

    def schedule(step: Any) -> float:
        t = min(_step(step), t_max)
        if t == t_max:
            return a
        return 1.0 - (1.0 - a) * math.sqrt(t / t_max)

    return schedule


def with_warmup(schedule: Schedule, warmup_steps: int, init_value: float = 0.0) -> Schedule:
    """Prefix ``schedule`` with a linear warm-up of ``warmup_steps`` steps.

    ``m(t) = schedule(0) * (init + (1 - init) * t / W)`` for ``t < W``, then
    ``schedule(t - W)``: the decay starts after the warm-up, and the two pieces meet at
    ``t = W`` (continuous). Linear warm-up as in Goyal et al. 2017 ("Accurate, Large Minibatch
    SGD").

    Args:
        schedule: any schedule (its step 0 is the end of the warm-up).
        warmup_steps: W >= 0 (0 returns ``schedule`` itself).
        init_value: the multiplier at step 0, as a fraction of ``schedule(0)``, in [0, 1].

    Raises:
        InputTypeError, ConfigurationError: ``schedule`` not callable; ``warmup_steps`` not an
            int >= 0; ``init_value`` outside [0, 1].

    Example::

        >>> s = with_warmup(constant_schedule(), warmup_steps=4)
        >>> [s(t) for t in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    inner = _check_schedule(schedule)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral):
        raise InputTypeError(f"Expected warmup_steps to be an int, got {type(warmup_steps).__name__}.")
    w = int(warmup_steps)
    if w < 0:
        raise ConfigurationError(f"Expected warmup_steps={w} >= 0.")
    init = _fraction(init_value, name="init_value")
    if w == 0:
        return inner
    peak = inner(0)

    def warmed(step: Any) -> float:
        t = _step(step)
        if t < w:
            return peak * (init + (1.0 - init) * t / w)
        return inner(t - w)

    return warmed


def with_restarts(schedule: Schedule, period: int, repeats: int | None = None) -> Schedule:
    """Replay ``schedule`` every ``period`` steps (warm restarts).

    ``m(t) = schedule(t mod P)`` during the first ``repeats`` periods; after them
    ``schedule`` continues past its end (``schedule(t - P (repeats - 1))``, e.g. a cosine stays
    at its ``alpha``). ``repeats=None`` restarts forever. Periodic: ``m(t + P) = m(t)`` within
    the repeats. SGDR's warm restarts with a fixed period (Loshchilov & Hutter 2017).

    Args:
        schedule: the schedule of one period (usually one that decays over ``period`` steps).
        period: P >= 1.
        repeats: the number of periods, >= 1, or ``None`` (unbounded).

    Raises:
        InputTypeError, ConfigurationError: ``schedule`` not callable; ``period`` or
            ``repeats`` not an int >= 1.

    Example::

        >>> s = with_restarts(cosine_schedule(4), period=4, repeats=2)
        >>> [round(s(t), 2) for t in range(10)]
        [1.0, 0.85, 0.5, 0.15, 1.0, 0.85, 0.5, 0.15, 0.0, 0.0]
    """
    inner = _check_schedule(schedule)
    p = check_positive_int(period, name="period")
    r = None if repeats is None else check_positive_int(repeats, name="repeats")

    def restarted(step: Any) -> float:
        t = _step(step)
        if r is not None and t >= p * r:
            return inner(t - p * (r - 1))
        return inner(math.fmod(t, p))

    return restarted
