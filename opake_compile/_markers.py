"""A marker base class for the library's privatised outputs.

``ClippedPytree`` and ``NoisedPytree`` derive from :class:`DPOutput` and are deliberately not
registered as pytree nodes. The pytree helpers refuse them, so a clipped or noised result can
never be re-clipped or re-normed by accident.
"""

from __future__ import annotations

from typing import Any

from opake_compile.exceptions import InputTypeError

__all__ = ["DPOutput", "reject_dp_output"]


class DPOutput:
    """Base class of privatised results (``ClippedPytree``, ``NoisedPytree``)."""

    __slots__ = ()


def reject_dp_output(value: Any, *, where: str) -> None:
    """Raise :class:`InputTypeError` if ``value`` is a DP output wrapper."""
    if isinstance(value, DPOutput):
        raise InputTypeError(
            f"{where} expects a pytree of tensors, got a {type(value).__name__}. Use its "
            "`.grads` field explicitly if you really mean to operate on the raw tensors."
        )
