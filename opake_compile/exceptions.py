"""The stable error categories of opake_compile.

Every error the library raises on purpose is an instance of :class:`OpakeError`, and of one of
the categories below, so callers can catch exactly what they mean to handle::

    try:
        step(x, y)
    except opake.exceptions.UnsupportedOperationError as err:
        print("this model cannot be made per-example:", err)

Each category also derives from the closest built-in exception (``TypeError``, ``ValueError``,
``RuntimeError``) so that generic handlers keep working. One warning is exported beside them,
:class:`SoundnessWarning` (a ``UserWarning``, not an error).
"""

from __future__ import annotations

__all__ = [
    "OpakeError",
    "InputTypeError",
    "ConfigurationError",
    "CalibrationError",
    "PrivacyBudgetExhaustedError",
    "CheckpointError",
    "UnsupportedOperationError",
    "SoundnessWarning",
]


class OpakeError(Exception):
    """Base class of every error raised on purpose by opake_compile."""


class InputTypeError(OpakeError, TypeError):
    """An argument has the wrong type or structure (for example a DP result where raw tensors
    are expected, or a pytree path component that is neither ``str`` nor ``int``)."""


class ConfigurationError(OpakeError, ValueError):
    """An argument has the right type but an invalid value (``clipping_norm <= 0``, a sample
    rate outside [0, 1], mismatched batch sizes, ...)."""


class CalibrationError(OpakeError, ValueError):
    """No parameter in the searched range meets the requested privacy budget."""


class PrivacyBudgetExhaustedError(OpakeError, RuntimeError):
    """Taking the requested step would spend more privacy than the budget allows. Raised before
    any parameter, optimizer or random state changes."""


class CheckpointError(OpakeError, ValueError):
    """A state dict cannot be loaded (missing keys, wrong version, mismatched configuration)."""


class UnsupportedOperationError(OpakeError, RuntimeError):
    """An operation cannot be made per-example or cannot be traced. The message names the module
    or ATen op responsible. Raised instead of ever returning non-private gradients."""


class SoundnessWarning(UserWarning):
    """A configuration whose privacy guarantee rests on an assumption the library cannot check
    (README, "The guarantee, in floating point": a known gap). Not an error: the run goes on,
    and the warning says which setting avoids it."""
