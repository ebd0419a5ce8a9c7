"""Correlated Gaussian noise of the matrix mechanism (DP-FTRL), streamed step by step.

``mf_gaussian_noise(strategy, sigma, key)`` is shaped like
:func:`opake_compile.dpsgd.noise.gaussian_noise`: it returns ``(noise_fn, noise_state)`` and
``noise_fn(clipped, state)`` returns ``(NoisedPytree, new_state)``. At step ``t`` it adds
``sigma * C * (M^-1 Z)[t]`` to the clipped sum, ``Z`` being i.i.d. standard normal vectors of
the gradient's size and ``M`` the strategy (normalised to column norm 1, see
:mod:`opake_compile.dpftrl.strategies`). ``Z_t`` is drawn exactly as ``gaussian_noise`` draws
its noise (same key chain, same generator, same order over leaves), so the identity strategy
adds bit for bit the same noise.

Streaming: ``M^-1`` is Toeplitz with generating function ``Q(x) / P(x)``, so
``y = M^-1 Z`` obeys the recursion ``P_0 y_t = sum_i Q_i Z_(t-i) - sum_(i>=1) P_i y_(t-i)``,
run in transposed direct form (the form of ``scipy.signal.lfilter``): the state is
``max(deg P, deg Q)`` vectors per parameter (BandMF: ``bands - 1``; BLT: ``buffers``;
BISR: ``bands - 1``). DP-lambda-CGD's ``M^-1`` is a two-term filter of ``Z``: ``Z_(t-1)`` is
regenerated from its saved key (PRNG replay, Kalinin et al. 2026) and no vector is stored.
The recursion runs in float64 for float64 leaves and in float32 otherwise.

State: :class:`MFNoiseState` (the next key, the step, the buffers, the replay keys), a
NamedTuple of keys, ints and tensors that :mod:`opake_compile.serialization` saves.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from opake_compile import random as _random
from opake_compile._validate import check_noise_multiplier
from opake_compile.dpftrl.strategies import Strategy
from opake_compile.dpsgd._types import (
    ClippedPytree,
    NoisedPytree,
    check_release,
    record_release,
)
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = ["MFNoiseState", "MFGaussianNoise", "mf_gaussian_noise"]


class MFNoiseState(NamedTuple):
    """State of :func:`mf_gaussian_noise`.

    Attributes:
        key: the key the next step splits (as in ``gaussian_noise``).
        step: steps already noised (0-based index of the next one).
        buffers: ``None`` before the first step, then a tuple (one per tensor leaf, in leaf
            order) of tuples of ``num_buffers`` tensors of the leaf's shape.
        replay_keys: the draw keys of the last ``len(Q) - 1`` steps, newest first (replay
            strategies only; empty otherwise).
    """

    key: Any
    step: int = 0
    buffers: Any = None
    replay_keys: tuple = ()


#: The attribute a ``DPOptimizer`` sets on the key of every noise state it holds (see
#: :meth:`MFGaussianNoise.__call__`); copies of the key carry it too.
OPTIMIZER_KEY_MARK = "_opake_held_by_an_optimizer"


def mark_held_by_optimizer(state: "MFNoiseState") -> None:
    """Mark ``state`` (its key object) as a ``DPOptimizer``'s: the mechanism refuses it from
    anyone else, for good."""
    object.__setattr__(state.key, OPTIMIZER_KEY_MARK, True)


def _draw_dtype(leaf: torch.Tensor) -> torch.dtype:
    return torch.float64 if leaf.dtype == torch.float64 else torch.float32


def _standard_normals(leaves: list[torch.Tensor], key: Any) -> list[torch.Tensor]:
    """One N(0, 1) tensor per leaf, drawn exactly as ``add_gaussian_noise`` draws them."""
    generator = _random.device_generators(key)
    return [torch.randn(leaf.shape, generator=generator(leaf.device), dtype=_draw_dtype(leaf), device=leaf.device) for leaf in leaves]


class MFGaussianNoise:
    """The noise function of :func:`mf_gaussian_noise` (a callable with its configuration).

    Attributes:
        strategy: the :class:`~opake_compile.dpftrl.strategies.Strategy`.
        noise_multiplier: sigma; the noise on the sum at step ``t`` is
            ``sigma * C * (M^-1 Z)[t]``.
    """

    def __init__(self, strategy: Strategy, noise_multiplier: float) -> None:
        if not isinstance(strategy, Strategy):
            raise InputTypeError(f"Expected a Strategy (band_mf_strategy(...), ...), got {type(strategy).__name__}.")
        self._strategy = strategy
        self._noise_multiplier = check_noise_multiplier(noise_multiplier)
        num = strategy.numerator
        self._a = [p / num[0] for p in num]  # feedback (P), a[0] = 1
        self._b = [q / num[0] for q in strategy.denominator]  # feedforward (Q)
        self._plain = strategy.numerator == (1.0,) and strategy.denominator == (1.0,)

    # Read-only: a DPOptimizer accounts the strategy and sigma it was built with, so a change
    # afterwards would add other noise than the one charged.
    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def noise_multiplier(self) -> float:
        return self._noise_multiplier

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("strategy", "noise_multiplier"):
            raise ConfigurationError(
                f"MFGaussianNoise.{name} is fixed at construction: optimizers account the noise they were "
                "built with. Build a new mf_gaussian_noise(...) (and a new DPOptimizer) instead."
            )
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        return f"mf_gaussian_noise({self.strategy!r}, noise_multiplier={self.noise_multiplier!r})"

    def check_step(self, step: int) -> None:
        """Refuse the 0-based ``step`` if it is past the steps the strategy was built for.

        Raises:
            ConfigurationError: ``step >= strategy.n`` (the message counts steps from 1).
        """
        if step >= self.strategy.n:
            raise ConfigurationError(
                f"Step {step + 1} is past the {self.strategy.n} steps the strategy {self.strategy!r} was "
                "built (and accounted) for; build it for more steps."
            )

    # ------------------------------------------------------------------ the filter
    def correlated(self, zs: list[torch.Tensor], state: MFNoiseState) -> tuple[list[torch.Tensor], Any, tuple]:
        """``(M^-1 Z)[t]`` per leaf from this step's draws ``zs``; new buffers and replay keys."""
        if self._plain:
            return zs, state.buffers, ()
        a, b = self._a, self._b
        if self.strategy.replay:
            # FIR filter of Z: regenerate the past draws from their keys.
            ys = [b[0] * z for z in zs]
            for i, k in enumerate(state.replay_keys[: len(b) - 1], start=1):
                for y, zp in zip(ys, _standard_normals(zs, k)):
                    y.add_(zp, alpha=b[i])
            return ys, None, ()
        length = max(len(a), len(b)) - 1
        a = a + [0.0] * (length + 1 - len(a))
        b = b + [0.0] * (length + 1 - len(b))
        old = state.buffers
        if old is None:
            old = tuple(tuple(torch.zeros_like(z) for _ in range(length)) for z in zs)
        ys, new = [], []
        for z, bufs in zip(zs, old):
            # one new tensor per output and per buffer; the old state's tensors are not modified
            y = torch.add(bufs[0], z, alpha=b[0]) if length else b[0] * z
            nb = []
            for i in range(1, length + 1):
                s = torch.add(bufs[i], z, alpha=b[i]) if i < length else torch.mul(z, b[i])
                nb.append(s.add_(y, alpha=-a[i]))
            ys.append(y)
            new.append(tuple(nb))
        return ys, tuple(new), ()

    def __call__(self, clipped: ClippedPytree, state: MFNoiseState, *, _by_optimizer: bool = False) -> tuple[NoisedPytree, MFNoiseState]:
        """Add this step's correlated noise to ``clipped``.

        Raises:
            InputTypeError: ``clipped`` is not a ``ClippedPytree``; ``state`` is not an
                :class:`MFNoiseState`.
            ConfigurationError: C = inf with sigma > 0; the strategy's ``n`` steps are used up;
                the buffers do not match the gradient's leaves; the sum (or a part of it) was
                released before (here, by ``gaussian_noise`` or by ``DPOptimizer.step``); the
                state is one a ``DPOptimizer`` holds or has used (its ``noise_state``, or the
                pair it was built with): its noise is that optimizer's.
        """
        if not isinstance(clipped, ClippedPytree):
            raise InputTypeError(
                f"mf_gaussian_noise expects a ClippedPytree (it reads C from it), got {type(clipped).__name__}."
            )
        if not isinstance(state, MFNoiseState):
            raise InputTypeError(f"Expected an MFNoiseState, got {type(state).__name__}.")
        if not _by_optimizer and getattr(state.key, OPTIMIZER_KEY_MARK, False):
            # (review: noise_fn(other_sum, opt.noise_state) drew the optimizer's next noise)
            raise ConfigurationError(
                "This noise state belongs to a DPOptimizer (its noise_state, or the pair it was built "
                "with): its noise is the noise of one of that optimizer's steps, and adding it to another "
                "sum here would release that noise twice (the difference of the two releases carries "
                "none). Let the optimizer add it, or build a mechanism of your own with a fresh key."
            )
        c = clipped.clipping_norm
        sigma = self.noise_multiplier
        if math.isinf(c) and sigma > 0:
            raise ConfigurationError("Cannot add noise calibrated to clipping_norm=inf; clip with a finite C.")
        self.check_step(state.step)
        check_release(clipped)  # one release per sum, whichever function makes it
        std = sigma * c if sigma > 0 else 0.0
        next_key, draw_key = _random.split(state.key, 2)
        leaves, treedef = optree.tree_flatten(clipped.grads)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        if state.buffers is not None and (
            len(state.buffers) != len(tensors)
            or any(len(bs) and tuple(bs[0].shape) != tuple(t.shape) for bs, t in zip(state.buffers, tensors))
        ):
            raise ConfigurationError("The noise state's buffers do not match the gradient's tensors (another model?).")
        zs = _standard_normals(tensors, draw_key)
        ys, buffers, _ = self.correlated(zs, state)
        it = iter(ys)
        out = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                out.append(leaf)
                continue
            y = next(it)
            if std == 0:
                out.append(leaf.clone())
            elif clipped.normalize_by is None:
                out.append((leaf.to(y.dtype) + std * y).to(leaf.dtype))
            else:
                out.append(leaf + (std * y).to(leaf.dtype) / clipped.normalize_by)
        grads = optree.tree_unflatten(treedef, out)
        replay = ()
        if self.strategy.replay:
            replay = (draw_key, *state.replay_keys)[: len(self._b) - 1]
        new_state = MFNoiseState(next_key, state.step + 1, buffers, replay)
        record_release(clipped)
        return (
            NoisedPytree(grads=grads, clipping_norm=c, noise_multiplier=sigma, noise_std=std, normalize_by=clipped.normalize_by),
            new_state,
        )

    # ------------------------------------------------------------------ accounting
    def accounting_plan(self, sampler: Any) -> Any:
        """How a ``DPOptimizer`` charges this noise with ``sampler`` (see
        :func:`opake_compile.accounting.mf_plan`).

        Raises:
            ConfigurationError: a sampler this mechanism cannot be accounted with, with the reason.
        """
        from opake_compile.accounting._matrix import mf_plan

        return mf_plan(self.strategy, self.noise_multiplier, sampler)


def mf_gaussian_noise(strategy: Strategy, noise_multiplier: float, key: Any) -> tuple[MFGaussianNoise, MFNoiseState]:
    """Correlated Gaussian noise of the matrix mechanism with ``strategy`` (DP-FTRL).

    At step ``t`` (counted by the state) the clipped sum receives ``sigma * C * (M^-1 Z)[t]``,
    ``C`` read from the ``ClippedPytree`` (Denisov et al. 2022, "Improved differential privacy
    for SGD via optimal private linear operators on adaptive streams"; Choquette-Choo et al.
    2023). Its privacy over the run is that of one Gaussian mechanism with noise multiplier
    ``sigma / sens`` (``sens`` the strategy's sensitivity under the participation pattern):
    :func:`opake_compile.accounting.mf_gaussian` (:func:`~opake_compile.accounting.b_min_sep`,
    :func:`~opake_compile.accounting.balls_in_bins` for those samplers), or amplified by cyclic
    Poisson sampling for BandMF: :func:`opake_compile.accounting.mf_poisson`.

    Args:
        strategy: a strategy from :mod:`opake_compile.dpftrl.strategies`; it fixes the number of
            steps ``n`` (a step past it is refused).
        noise_multiplier: sigma >= 0.
        key: the initial :mod:`opake_compile.random` key.

    Returns:
        ``(noise_fn, noise_state)`` with ``noise_fn(clipped, state) -> (noised, new_state)``;
        the state holds at most ``strategy.num_buffers`` tensors per parameter.

    Raises:
        InputTypeError: ``strategy`` is not a Strategy; ``key`` is not a key.
        ConfigurationError: sigma < 0 or not finite.

    Example::

        >>> s = band_mf_strategy(100, bands=4)
        >>> noise_fn, state = mf_gaussian_noise(s, 1.0, opake.random.key(0))
        >>> noised, state = noise_fn(clipped, state)
    """
    _random._check_key(key)
    return MFGaussianNoise(strategy, noise_multiplier), MFNoiseState(key)
