"""Canary designation: which canaries go into training (the coin flips of the one-run audit)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from opake_compile import random as _random
from opake_compile._validate import check_positive_int
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = ["CanaryRecord", "coin_flip"]

_FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class CanaryRecord:
    """Which of m canaries were included in training: the secret of a one-run audit.

    Canary ``i`` is the ``i``-th element of whatever canary set the caller built (``m``
    mislabelled images, out-of-distribution inputs, ...); the record only holds the coins.
    Immutable and serialisable (:meth:`to_dict` / :meth:`from_dict`, JSON-compatible), so it
    can be written next to a checkpoint and audited later. It does **not** hold the initial
    parameters that :func:`~opake_compile.auditing.gradient_scores` needs: the caller keeps
    theta_0 (it is model-sized).

    The record is as sensitive as the canaries: an auditor who sees it before scoring learns
    nothing about the training data, but the training loop must not use it for anything other
    than adding the included canaries.

    Attributes:
        included: one bool per canary, ``True`` if it was added to the training data.
        key_state: the :func:`opake_compile.random.key_to_state` of the key the coins were
            drawn with (provenance; ``None`` for a record built by hand).

    Example::

        >>> import opake_compile as opake
        >>> rec = opake.auditing.coin_flip(6, opake.random.key(0))
        >>> rec.num_canaries, rec.num_included + rec.num_excluded
        (6, 6)
        >>> opake.auditing.CanaryRecord.from_dict(rec.to_dict()) == rec
        True
    """

    included: tuple[bool, ...]
    key_state: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        inc = self.included
        if isinstance(inc, torch.Tensor):
            inc = inc.detach().cpu().numpy()
        if isinstance(inc, np.ndarray):
            if inc.ndim != 1 or inc.dtype != np.bool_:
                raise InputTypeError(f"Expected included to be a 1-d bool array, got dtype {inc.dtype}, shape {inc.shape}.")
            inc = inc.tolist()
        if not isinstance(inc, Sequence) or isinstance(inc, (str, bytes)):
            raise InputTypeError(f"Expected included to be a sequence of bools, got {type(self.included).__name__}.")
        if not all(isinstance(b, (bool, np.bool_)) for b in inc):
            raise InputTypeError("Expected included to hold bools only (True: the canary was added to training).")
        if len(inc) == 0:
            raise ConfigurationError("Expected at least one canary, got an empty record.")
        object.__setattr__(self, "included", tuple(bool(b) for b in inc))
        if self.key_state is not None:
            object.__setattr__(self, "key_state", tuple(_random.key_to_state(_random.key_from_state(self.key_state))))

    @property
    def num_canaries(self) -> int:
        """m, the number of canaries."""
        return len(self.included)

    @property
    def num_included(self) -> int:
        """How many canaries were added to training."""
        return sum(self.included)

    @property
    def num_excluded(self) -> int:
        """How many canaries were held out."""
        return self.num_canaries - self.num_included

    def mask(self) -> np.ndarray:
        """A fresh ``(m,)`` bool array: ``True`` where the canary was included."""
        return np.array(self.included, dtype=bool)

    @property
    def included_indices(self) -> np.ndarray:
        """``(num_included,)`` int64 indices of the included canaries, ascending."""
        return np.flatnonzero(self.mask()).astype(np.int64)

    @property
    def excluded_indices(self) -> np.ndarray:
        """``(num_excluded,)`` int64 indices of the held-out canaries, ascending."""
        return np.flatnonzero(~self.mask()).astype(np.int64)

    def select(self, *canaries: Any) -> Any:
        """The included canaries of each argument (tensors or arrays, canary ``i`` along dim 0).

        Returns one value for one argument, else a tuple: what the training loop appends to the
        training data.

        Raises:
            ConfigurationError: an argument does not have m entries along dim 0.
        """
        out = []
        idx = self.included_indices
        for x in canaries:
            if len(x) != self.num_canaries:
                raise ConfigurationError(f"Expected {self.num_canaries} canaries along dim 0, got {len(x)}.")
            out.append(x[torch.as_tensor(idx)] if isinstance(x, torch.Tensor) else x[idx])
        return out[0] if len(out) == 1 else tuple(out)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (the coins as a '0'/'1' string)."""
        return {
            "version": _FORMAT_VERSION,
            "included": "".join("1" if b else "0" for b in self.included),
            "key_state": None if self.key_state is None else list(self.key_state),
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> CanaryRecord:
        """Rebuild a record from :meth:`to_dict` (or its JSON).

        Raises:
            InputTypeError / ConfigurationError: not a record written by :meth:`to_dict`.
        """
        if isinstance(state, str):
            state = json.loads(state)
        if not isinstance(state, dict) or state.get("version") != _FORMAT_VERSION:
            raise ConfigurationError(f"Expected a CanaryRecord dict of version {_FORMAT_VERSION}, got {state!r:.80}.")
        bits = state.get("included")
        if not isinstance(bits, str) or set(bits) - {"0", "1"}:
            raise InputTypeError("Expected 'included' to be a string of '0' and '1'.")
        return cls(tuple(b == "1" for b in bits), state.get("key_state"))


def coin_flip(num_canaries: int, key: _random.Key) -> CanaryRecord:
    """Designate ``num_canaries`` canaries and flip an independent fair coin for each.

    Step one of the one-run audit (Steinke, Nasr & Jagielski 2023): canary ``i`` is added to
    the training data iff its coin comes up heads (probability exactly 1/2, independently of
    everything else). The audit's guarantee rests on these coins being independent of the
    training randomness, so draw them from a key of their own: split it off the run's root key
    and never reuse it for noise or sampling. The key is consumed (like ``jax.random``), not
    advanced: there is no state to return.

    Args:
        num_canaries: m >= 1. A few hundred to a few thousand: the largest epsilon an audit
            can certify grows with m (see ``OneRunEstimate.ceiling``).
        key: an :class:`opake_compile.random.Key`.

    Returns:
        A :class:`CanaryRecord`.

    Raises:
        ConfigurationError: ``num_canaries < 1``.
        InputTypeError: ``key`` is not a Key.

    Example::

        >>> import opake_compile as opake
        >>> a = opake.auditing.coin_flip(1000, opake.random.key(3))
        >>> a == opake.auditing.coin_flip(1000, opake.random.key(3))   # same key, same coins
        True
        >>> 400 < a.num_included < 600
        True
    """
    m = check_positive_int(num_canaries, name="num_canaries")
    _random._check_key(key)
    gen = _random.generator_from_key(key)
    coins = torch.randint(0, 2, (m,), generator=gen, dtype=torch.int64) == 1
    return CanaryRecord(tuple(coins.tolist()), tuple(_random.key_to_state(key)))
