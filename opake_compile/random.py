"""Immutable random keys for reproducible DP noise and sampling.

A :class:`Key` is a frozen value (128 bits held as four uint32 words). Keys are never advanced
in place: :func:`split` and :func:`fold_in` derive *new* keys, and a consumer that draws
randomness takes a key argument and returns the key the caller should use next. The library
never touches torch's global generator; :func:`generator_from_key` builds a private
``torch.Generator`` per draw.

Derivation. Every key is the 16-byte BLAKE2b digest of a domain-separated, length-prefixed
encoding of its inputs (the seed; the parent key and a child index; the parent key and folded
data). Different derivations therefore never produce the same input bytes, and distinct keys
collide only with the negligible probability of a 128-bit hash collision. Python's ``hash()`` is
not used, so keys are identical across processes, machines and ``PYTHONHASHSEED`` values.

Key discipline (privacy-critical). **A key must never be used for two noise draws.** Two
Gaussian noise draws from the same key are identical, so their difference cancels the noise and
reveals the clipped sum. Split (or fold in a step counter) before every draw, keep the advanced
key, and checkpoint it with :func:`key_to_state`.

Example::

    >>> import torch
    >>> from opake_compile import random as oprandom
    >>> root = oprandom.key(42)
    >>> noise_key, sampler_key = oprandom.split(root)
    >>> g = oprandom.generator_from_key(noise_key)
    >>> z = torch.randn(3, generator=g)
    >>> torch.equal(z, torch.randn(3, generator=oprandom.generator_from_key(noise_key)))
    True
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import torch

from opake_compile._validate import check_positive_int
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = [
    "Key",
    "key",
    "random_key",
    "split",
    "fold_in",
    "generator_from_key",
    "device_generators",
    "key_to_state",
    "key_from_state",
    "set_reproducible_pytorch_seed",
]

_NUM_WORDS = 4
_WORD_MAX = 2**32

# Domain-separation tags: one per derivation, so no two derivations hash the same bytes.
_TAG_SEED = b"opake.key.seed.v1"
_TAG_SPLIT = b"opake.key.split.v1"
_TAG_FOLD = b"opake.key.fold_in.v1"
_TAG_GENERATOR = b"opake.key.generator.v1"


@dataclasses.dataclass(frozen=True)
class Key:
    """An immutable 128-bit random key.

    Hashable, comparable and picklable. For ``state_dict()`` use :func:`key_to_state` (a plain
    list of four ints, safe for ``torch.load(weights_only=True)`` and JSON) and
    :func:`key_from_state`.

    Attributes:
        words: four Python ints in ``[0, 2**32)``.

    Raises:
        InputTypeError: ``words`` is not a sequence of exactly four ints in ``[0, 2**32)``.

    Example::

        >>> k = key(0)
        >>> k == key(0), k == key(1)
        (True, False)
    """

    words: tuple[int, int, int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "words", _check_words(self.words, name="Key.words"))

    def __repr__(self) -> str:
        return "Key(" + "".join(f"{w:08x}" for w in self.words) + ")"

    def _bytes(self) -> bytes:
        return b"".join(w.to_bytes(4, "little") for w in self.words)


def _check_words(words: Any, *, name: str) -> tuple[int, int, int, int]:
    if isinstance(words, (str, bytes)) or not isinstance(words, Sequence):
        raise InputTypeError(
            f"Expected {name} to be a sequence of {_NUM_WORDS} ints in [0, 2**32), got "
            f"{type(words).__name__}."
        )
    if len(words) != _NUM_WORDS:
        raise InputTypeError(f"Expected {name} to hold {_NUM_WORDS} words, got {len(words)}.")
    out = []
    for w in words:
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise InputTypeError(f"Expected every word of {name} to be an int, got {w!r}.")
        if not 0 <= int(w) < _WORD_MAX:
            raise InputTypeError(f"Expected every word of {name} in [0, 2**32), got {int(w)}.")
        out.append(int(w))
    return tuple(out)  # type: ignore[return-value]


def _check_key(k: Any, *, name: str = "key") -> Key:
    if not isinstance(k, Key):
        hint = (f": pass opake_compile.random.key({k!r})" if isinstance(k, numbers.Integral) and not isinstance(k, bool)
                else "")
        raise InputTypeError(
            f"Expected {name} to be an opake_compile.random.Key (from key(seed), split or "
            f"fold_in), got {type(k).__name__}{hint}."
        )
    return k


def _check_int(value: Any, *, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"Expected {name} to be an int, got {type(value).__name__}.")
    return int(value)


def _encode_int(value: int) -> bytes:
    """Length-prefixed two's-complement encoding of an arbitrary-size int."""
    n = (value.bit_length() + 8) // 8  # room for the sign bit
    return n.to_bytes(8, "little") + value.to_bytes(n, "little", signed=True)


def _hash_words(*parts: bytes) -> Key:
    h = hashlib.blake2b(digest_size=4 * _NUM_WORDS)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    d = h.digest()
    return Key(tuple(int.from_bytes(d[4 * i : 4 * i + 4], "little") for i in range(_NUM_WORDS)))  # type: ignore[arg-type]


def key(seed: int) -> Key:
    """A key determined by an integer seed.

    Args:
        seed: any int >= 0 (arbitrary size; numpy integers accepted).

    Returns:
        The :class:`Key`; equal seeds give equal keys in every process.

    Raises:
        InputTypeError: ``seed`` is not an int (``bool`` and ``float`` are refused).
        ConfigurationError: ``seed < 0``.

    Example::

        >>> key(7) == key(7)
        True
    """
    s = _check_int(seed, name="seed")
    if s < 0:
        raise ConfigurationError(f"Expected seed={s} >= 0.")
    return _hash_words(_TAG_SEED, _encode_int(s))


def random_key() -> Key:
    """A fresh key from the operating system's entropy (:mod:`secrets`), 128 bits.

    Use it for production runs; store the key (:func:`key_to_state`) if the run must be
    reproducible later.

    Example::

        >>> random_key() != random_key()
        True
    """
    bits = secrets.randbits(32 * _NUM_WORDS)
    return Key(tuple((bits >> (32 * i)) & 0xFFFFFFFF for i in range(_NUM_WORDS)))  # type: ignore[arg-type]


def split(key: Key, n: int = 2) -> tuple[Key, ...]:
    """Derive ``n`` new keys from ``key``.

    The children are distinct from each other and from ``key`` (up to a 128-bit hash collision)
    and child ``i`` does not depend on ``n``: ``split(k, 3)[:2] == split(k, 2)``. Children of
    :func:`split` never coincide with results of :func:`fold_in` (different domain tags).

    Args:
        key: the parent :class:`Key` (do not use it for a draw after splitting it).
        n: number of children, >= 1.

    Returns:
        A tuple of ``n`` keys.

    Raises:
        InputTypeError: ``key`` is not a :class:`Key` or ``n`` is not an int.
        ConfigurationError: ``n < 1``.

    Example::

        >>> a, b = split(key(0))
        >>> len({a, b, key(0)})
        3
    """
    k = _check_key(key)
    n = check_positive_int(n, name="n")
    base = k._bytes()
    return tuple(_hash_words(_TAG_SPLIT, base, _encode_int(i)) for i in range(n))


def fold_in(key: Key, data: int) -> Key:
    """Derive a key from ``key`` and an integer (a step, epoch or rank number).

    ``fold_in(k, i)`` for distinct ``i`` are distinct, and distinct from ``k`` and from the
    children of :func:`split`.

    Args:
        key: the parent :class:`Key`.
        data: any int (negative and arbitrarily large values allowed).

    Returns:
        The derived :class:`Key`.

    Raises:
        InputTypeError: ``key`` is not a :class:`Key` or ``data`` is not an int.

    Example::

        >>> k = key(0)
        >>> fold_in(k, 1) == fold_in(k, 1), fold_in(k, 1) == fold_in(k, 2)
        (True, False)
    """
    k = _check_key(key)
    d = _check_int(data, name="data")
    return _hash_words(_TAG_FOLD, k._bytes(), _encode_int(d))


def _generator_seed(k: Key) -> int:
    d = hashlib.blake2b(_TAG_GENERATOR + k._bytes(), digest_size=8).digest()
    # torch.Generator.manual_seed accepts [0, 2**64); all 128 key bits influence the seed.
    return int.from_bytes(d, "little")


def device_generators(key: Key) -> Callable[[torch.device], torch.Generator]:
    """``generator(device)``: one generator per device for one draw spread over several devices.

    The first device asked for is seeded from ``key`` itself (a single-device draw is
    ``generator_from_key(key, device)``); the i-th other device from ``fold_in(key, i)``, so two
    devices of one type (``cuda:0``, ``cuda:1``) never draw the same stream: equal noise on two
    leaves of one release would let their difference cancel it.
    """
    _check_key(key)
    made: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        g = made.get(device)
        if g is None:
            g = made[device] = generator_from_key(key if not made else fold_in(key, len(made)), device)
        return g

    return generator


def generator_from_key(key: Key, device: str | torch.device = "cpu") -> torch.Generator:
    """A fresh ``torch.Generator`` on ``device`` seeded from ``key``.

    The same key gives an identical random stream (on the same device type and torch version);
    the 64-bit seed is a hash of all 128 key bits, so two distinct keys share a stream only with
    probability about ``2**-64``. The generator is private to the caller: torch's global
    generator is never read or changed.

    Privacy: a key (hence its generator) must be used for **one** noise draw only; derive a new
    key with :func:`split` or :func:`fold_in` for the next draw.

    Args:
        key: the :class:`Key`.
        device: the generator's device (``"cpu"``, ``"cuda"``, ``torch.device("cuda:1")``, ...).
            A generator on one device type cannot drive sampling on another.

    Returns:
        A seeded ``torch.Generator``.

    Raises:
        InputTypeError: ``key`` is not a :class:`Key`.

    Example::

        >>> g = generator_from_key(key(3))
        >>> torch.rand(2, generator=g).shape
        torch.Size([2])
    """
    k = _check_key(key)
    g = torch.Generator(device=device)
    g.manual_seed(_generator_seed(k))
    return g


def key_to_state(key: Key) -> list[int]:
    """The key as a plain list of four ints, for ``state_dict()`` / JSON / ``weights_only`` loads.

    Raises:
        InputTypeError: ``key`` is not a :class:`Key`.

    Example::

        >>> k = key(1)
        >>> key_from_state(key_to_state(k)) == k
        True
    """
    return list(_check_key(key).words)


def key_from_state(state: Any) -> Key:
    """Rebuild a key from :func:`key_to_state`'s output (a list or tuple of four ints in
    ``[0, 2**32)``, or a 1-d integer tensor of four elements); a :class:`Key` is returned as is.

    Raises:
        InputTypeError: ``state`` is not of that form.
    """
    if isinstance(state, Key):
        return state
    if isinstance(state, torch.Tensor):
        if state.dim() != 1 or state.dtype.is_floating_point or state.dtype.is_complex or state.dtype == torch.bool:
            raise InputTypeError(
                f"Expected a key state tensor to be 1-d with an integer dtype, got shape "
                f"{tuple(state.shape)} and dtype {state.dtype}."
            )
        state = state.tolist()
    return Key(_check_words(state, name="key state"))


def set_reproducible_pytorch_seed(seed: int) -> None:
    """Seed torch's *global* generators (CPU and every accelerator) with ``seed``.

    For user scripts only (weight initialisation, data shuffling, dropout outside the DP step).
    The library itself never calls this nor reads the global generator: DP noise and Poisson
    sampling come from explicit :class:`Key` arguments, so seeding the global generator does not
    make them reproducible and reusing the global seed does not correlate them.

    Args:
        seed: an int in ``[0, 2**64)``.

    Raises:
        InputTypeError: ``seed`` is not an int.
        ConfigurationError: ``seed`` is out of range.

    Example::

        >>> set_reproducible_pytorch_seed(0)  # at the top of a training script  # doctest: +SKIP
    """
    s = _check_int(seed, name="seed")
    if not 0 <= s < 2**64:
        raise ConfigurationError(f"Expected seed={s} in [0, 2**64).")
    torch.manual_seed(s)
