"""Gaussian noise for clipped sums: the privatisation step of DP-SGD.

The Gaussian mechanism (Dwork & Roth 2014, Thm. A.1; used for DP-SGD by Abadi et al. 2016)
adds ``N(0, (noise_multiplier * C)^2)`` independently to every entry of a sum whose L2
sensitivity is C. The clipping norm is read from the :class:`ClippedPytree`, so noise cannot be
calibrated to a different C than the one used for clipping.

Later strategies (correlated noise for DP-FTRL / matrix factorisation: BandMF, BLT) will share
this ``(noise_fn, noise_state)`` shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from opake_compile import random as _random
from opake_compile._validate import check_noise_multiplier
from opake_compile.dpsgd._types import (
    ClippedPytree,
    NoisedPytree,
    check_release,
    record_release,
)
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = ["NoiseState", "NoisedPytree", "gaussian_noise", "add_gaussian_noise"]


class NoiseState(NamedTuple):
    """State of :func:`gaussian_noise`: the key the *next* draw will use."""

    key: Any


def add_gaussian_noise(tree: Any, std: float, key: Any) -> Any:
    """Add ``N(0, std^2)`` independently to every entry of every tensor leaf of ``tree``.

    The noise is drawn from ``device_generators(key)(leaf.device)`` in float32 or float64 (at
    least float32, so low-precision leaves do not get quantised noise) and cast to the leaf's
    dtype. The key must never be reused for another draw.

    Args:
        tree: a pytree of floating tensors.
        std: the standard deviation (sigma * C for DP-SGD), >= 0.
        key: an :mod:`opake_compile.random` key.

    Returns:
        A tree of the same structure, shapes and dtypes.
    """
    generator = _random.device_generators(key)

    def noisy(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        if std == 0:
            return leaf.clone()
        draw_dtype = torch.float64 if leaf.dtype == torch.float64 else torch.float32
        z = torch.randn(leaf.shape, generator=generator(leaf.device), dtype=draw_dtype, device=leaf.device)
        return (leaf.to(draw_dtype) + std * z).to(leaf.dtype)

    return optree.tree_map(noisy, tree)


def gaussian_noise(
    noise_multiplier: float, key: Any
) -> tuple[Callable[[ClippedPytree, NoiseState], tuple[NoisedPytree, NoiseState]], NoiseState]:
    """The Gaussian mechanism on a clipped sum.

    Args:
        noise_multiplier: sigma >= 0; the noise std on the *sum* is sigma * C. sigma = 0 warns
            (no privacy).
        key: the initial :mod:`opake_compile.random` key; every call advances it.

    Returns:
        ``(noise_fn, noise_state)`` with ``noise_fn(clipped, noise_state) -> (noised,
        new_state)``: ``noised.grads = (clipped sum + N(0, (sigma*C)^2 I)) / normalize_by``
        (the division only when the ``ClippedPytree`` was normalised).

    Warning:
        The same state gives the same noise (JAX-style, for reproducibility). Pass each state
        once and carry ``new_state`` on: two sums noised from one state differ by exactly the
        difference of the clipped sums, with no noise at all. Nothing here is charged to an
        accountant; :class:`~opake_compile.optim.DPOptimizer` keeps the key and the charge
        together.

    Raises:
        InputTypeError: the input is not a ``ClippedPytree`` (raw tensors have no recorded C;
            a ``NoisedPytree`` must not be noised twice).
        ConfigurationError: C = inf with sigma > 0 (no finite noise calibrates to it); the sum
            (or a part of it) was released before, here or by ``DPOptimizer.step`` (each sum is
            released once: two noisy views of one sample are not what one charge covers); an
            adaptive clipping result that cannot be released (see
            :class:`~opake_compile.dpsgd._types.ReleaseReceipt`).

    Example::

        >>> noise_fn, state = gaussian_noise(1.0, opake.random.key(0))
        >>> noised, state = noise_fn(clipped, state)
    """
    sigma = check_noise_multiplier(noise_multiplier)

    def noise_fn(clipped: ClippedPytree, state: NoiseState) -> tuple[NoisedPytree, NoiseState]:
        if not isinstance(clipped, ClippedPytree):
            raise InputTypeError(
                f"gaussian_noise expects a ClippedPytree (it reads C from it), got {type(clipped).__name__}."
            )
        c = clipped.clipping_norm
        if math.isinf(c) and sigma > 0:
            raise ConfigurationError("Cannot add noise calibrated to clipping_norm=inf; clip with a finite C.")
        # One release per sum, whichever function makes it: a sum noised here and stepped on by
        # DPOptimizer (or noised twice) would be two noisy views of one sample under one charge.
        check_release(clipped)
        std = sigma * c if sigma > 0 else 0.0
        next_key, draw_key = _random.split(state.key, 2)
        if clipped.normalize_by is None:
            grads = add_gaussian_noise(clipped.grads, std, draw_key)
        else:
            # grads already hold sum / n: add the noise to the sum, then apply the same division.
            n = clipped.normalize_by
            grads = optree.tree_map(
                lambda g, z: g + z / n,
                clipped.grads,
                add_gaussian_noise(optree.tree_map(torch.zeros_like, clipped.grads), std, draw_key),
            )
        record_release(clipped)
        return (
            NoisedPytree(grads=grads, clipping_norm=c, noise_multiplier=sigma, noise_std=std, normalize_by=clipped.normalize_by),
            NoiseState(next_key),
        )

    return noise_fn, NoiseState(key)
