"""Argument validation shared by the whole package. Messages name the argument and the
expected range, and errors are the project's own exception classes."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import optree
import torch

from opake_compile._markers import reject_dp_output
from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError

__all__ = [
    "NotPrivateWarning",
    "check_clipping_norm",
    "check_noise_multiplier",
    "check_probability",
    "check_positive_int",
    "check_nonnegative_int",
    "check_batch_size",
    "check_optimizer_state",
]


class NotPrivateWarning(UserWarning):
    """Emitted when a configuration gives no differential privacy guarantee (an infinite
    clipping norm, a zero noise multiplier, a non-private accounting process)."""


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise InputTypeError(f"Expected {name} to be a number, got bool {value!r}.")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dim() != 0:
            raise InputTypeError(
                f"Expected {name} to be a number or a 0-d tensor, got a tensor of shape "
                f"{tuple(value.shape)}."
            )
        if value.dtype.is_complex or value.dtype == torch.bool:
            raise InputTypeError(f"Expected {name} to be real, got dtype {value.dtype}.")
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    raise InputTypeError(f"Expected {name} to be a number or a 0-d tensor, got {type(value).__name__}.")


#: The smallest clipping norm accepted (2^-100, about 7.9e-31). See
#: :mod:`opake_compile.compiler.passes.numerics`.
MIN_CLIPPING_NORM = 2.0**-100


def check_clipping_norm(value: Any, *, name: str = "clipping_norm") -> float:
    """Validate a clipping norm C and return it as a Python float.

    C must be a positive int, float or 0-d tensor; ``math.inf`` is allowed (no clipping) and
    warns with :class:`NotPrivateWarning` because the result then has unbounded sensitivity.

    Raises:
        InputTypeError: C is not a real number or 0-d tensor.
        ConfigurationError: C <= 0, C < 2^-100 or C is NaN.
    """
    c = _as_float(name, value)
    if math.isnan(c) or c <= 0:
        raise ConfigurationError(f"Expected {name}={c!r} > 0 (use math.inf to disable clipping).")
    if c < MIN_CLIPPING_NORM:
        # Below this, rounding at the bottom of the float32 range (subnormal products in the
        # sums) is no longer negligible next to C: the numerical contract could not hold.
        raise ConfigurationError(
            f"Expected {name}={c!r} >= {MIN_CLIPPING_NORM:.3g}: smaller clipping norms are below the "
            "range where the sensitivity bound holds in floating point (rescale the loss instead)."
        )
    if math.isinf(c):
        warnings.warn(
            f"{name}=inf: per-example gradients are not clipped, so the sum has unbounded "
            "sensitivity and no noise level makes it differentially private.",
            NotPrivateWarning,
            stacklevel=user_stacklevel(),
        )
    return c


def user_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called here that names the first caller outside
    this package (a warning raised three calls down, from ``compile_dp``, named the library's
    own file: a newcomer's review)."""
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1  # the function calling this one (which calls warn)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def check_noise_multiplier(value: Any, *, name: str = "noise_multiplier") -> float:
    """Validate a noise multiplier sigma >= 0 (finite). sigma = 0 warns: no privacy."""
    s = _as_float(name, value)
    if math.isnan(s) or s < 0 or math.isinf(s):
        raise ConfigurationError(f"Expected {name}={s!r} to be finite and >= 0.")
    if s > 0 and s * s < 1e-300:  # 1 / sigma^2, the accountants' first quantity, would overflow
        raise ConfigurationError(f"{name}={s!r} is too small to account for (epsilon beyond any float): use 0 or a real noise multiplier.")
    if s == 0:
        warnings.warn(
            f"{name}=0: no noise is added, so training is not differentially private.",
            NotPrivateWarning,
            stacklevel=user_stacklevel(),
        )
    return s


def check_probability(value: Any, *, name: str) -> float:
    """Validate a probability in [0, 1] (a sample rate)."""
    p = _as_float(name, value)
    if not (0.0 <= p <= 1.0):
        raise ConfigurationError(f"Expected {name}={p!r} in [0, 1].")
    return p


def check_positive_int(value: Any, *, name: str) -> int:
    """Validate an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"Expected {name} to be an int, got {type(value).__name__}.")
    if value < 1:
        raise ConfigurationError(f"Expected {name}={value!r} >= 1.")
    return int(value)


def check_nonnegative_int(value: Any, *, name: str) -> int:
    """Validate an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InputTypeError(f"Expected {name} to be an int, got {type(value).__name__}.")
    if value < 0:
        raise ConfigurationError(f"Expected {name}={value!r} >= 0.")
    return int(value)


def check_batch_size(args: tuple, batch_argnums: tuple[int, ...]) -> int:
    """The common leading dimension B of every tensor leaf of the batched arguments.

    Raises:
        ConfigurationError: a position out of range, a 0-d tensor (no batch dimension), no
            batched argument, or batched arguments that disagree on B (the message lists them).
        InputTypeError: a batched argument holds no tensor, is a DP output wrapper, or holds
            what looks like per-example values that are not tensors (an array of B rows, or a
            list/tuple of B numbers): they would be one constant shared by every example.
    """
    # Fast path, the common call: every batched argument a plain tensor of one batch size
    # (anything else, including every error, takes the general path below).
    size = None
    for i in batch_argnums:
        x = args[i] if i < len(args) else None
        if type(x) is not torch.Tensor or x.dim() == 0 or (size is not None and x.shape[0] != size):
            break
        size = x.shape[0]
    else:
        if size is not None:
            return int(size)
    sizes: dict[int, set[int]] = {}
    for i in batch_argnums:
        if i >= len(args):
            raise ConfigurationError(f"batch_argnums names argument {i}, but only {len(args)} were passed.")
        reject_dp_output(args[i], where=f"argument {i}")
        leaves = [leaf for leaf in optree.tree_leaves(args[i], none_is_leaf=True) if isinstance(leaf, torch.Tensor)]
        if not leaves:
            raise InputTypeError(_no_tensor_message(i, args[i]))
        for leaf in leaves:
            reject_dp_output(leaf, where=f"argument {i}")
            if leaf.dim() == 0:
                raise ConfigurationError(f"Batched argument {i} holds a 0-d tensor: it has no batch dimension.")
            sizes.setdefault(int(leaf.shape[0]), set()).add(i)
    if not sizes:
        raise ConfigurationError("At least one argument must be batched (batch_argnums).")
    if len(sizes) > 1:
        detail = ", ".join(f"size {s} in argument(s) {sorted(v)}" for s, v in sorted(sizes.items()))
        raise ConfigurationError(f"Batched arguments disagree on the batch size: {detail}.")
    size = next(iter(sizes))
    for i in batch_argnums:
        _reject_per_example_constants(args[i], size, f"argument {i}")
    return size


def _no_tensor_message(i: int, value: Any) -> str:
    """What a batched argument without a tensor most likely is, and what to do about it."""
    import torch.nn as nn

    if isinstance(value, nn.Module):
        return (
            f"Argument {i} is a {type(value).__name__} module: a compiled step is bound to its model "
            "(compile_dp(model=...)) and takes the loss's other arguments only: call step(x, y), "
            "not step(model, x, y)."
        )
    if hasattr(value, "__array__") and getattr(value, "shape", None) is not None:
        return (
            f"Batched argument {i} is a {type(value).__name__}, not a tensor: only tensors are split "
            "into examples. Convert it with torch.as_tensor (or torch.from_numpy)."
        )
    return (
        f"Batched argument {i} holds no tensor ({type(value).__name__}): only tensors are split into "
        "examples. Pass the batch as tensors, or leave a constant argument out of batch_argnums."
    )


def _reject_per_example_constants(value: Any, size: int, where: str) -> None:
    """Refuse what a batched argument holds beside its tensors that looks per example: a NumPy
    array (anything with ``__array__``) of ``size`` rows, or a list/tuple of ``size`` numbers.
    Only tensor leaves are split into examples; anything else is one constant shared by every
    example, so per-example values there would reach every example's gradient (one example's
    removal could move the clipped sum by more than C). Strings, ``torch.Size`` and values of
    another length are kept as constants."""
    if isinstance(value, (str, bytes, torch.Tensor, torch.Size)) or value is None:
        return
    shape = getattr(value, "shape", None)
    if hasattr(value, "__array__") and shape is not None and len(shape) >= 1 and shape[0] == size:
        raise InputTypeError(
            f"Batched {where} holds a {type(value).__name__} of {size} rows, one per example by its "
            "length: only tensor leaves are split into examples, so every example would see all of "
            "them. Pass per-example values as a tensor (torch.as_tensor); pass a constant that happens "
            "to have this length through loss_fn itself (a closure or functools.partial)."
        )
    if isinstance(value, dict):
        for k, v in value.items():
            _reject_per_example_constants(v, size, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        if len(value) == size and all(isinstance(v, numbers.Number) for v in value):
            raise InputTypeError(
                f"Batched {where} is a {type(value).__name__} of {size} numbers, one per example by "
                "its length: only tensor leaves are split into examples, so every example would see "
                "all of them. Pass per-example values as a tensor (torch.as_tensor); pass a constant "
                "that happens to have this length through loss_fn itself (a closure or "
                "functools.partial)."
            )
        for j, v in enumerate(value):
            _reject_per_example_constants(v, size, f"{where}[{j}]")


def check_optimizer_state(optimizer: torch.optim.Optimizer, saved: Any, where: str = "") -> None:
    """Check a ``torch.optim`` state dict against ``optimizer`` before it is loaded: every
    per-parameter entry indexes a parameter, and its tensors (momenta, second moments) have
    that parameter's shape, parameters matched in order as ``Optimizer.load_state_dict``
    matches them. torch accepts another model's moments of the same count, and the next step
    then fails half-way (some parameters updated; under DP the noise released and charged).

    Raises:
        CheckpointError: the message starts with ``where`` and the offending entry.
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("state", {}), dict):
        raise CheckpointError(f"{where}: not a torch.optim state_dict ({type(saved).__name__}).")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    groups = saved.get("param_groups")
    ids = [i for g in groups for i in g.get("params", ())] if isinstance(groups, list) else list(range(len(params)))
    if len(ids) != len(params):
        raise CheckpointError(f"{where}param_groups: {len(ids)} parameter(s) in the checkpoint, {len(params)} in the optimizer.")
    position = {i: j for j, i in enumerate(ids)}
    for k, entry in saved.get("state", {}).items():
        if isinstance(k, bool) or k not in position:
            raise CheckpointError(f"{where}state.{k}: the optimizer has {len(params)} parameter(s); no parameter {k!r}.")
        p = params[position[k]]
        for name, value in (entry or {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(p.shape):
                raise CheckpointError(
                    f"{where}state.{k}.{name}: shape {tuple(value.shape)}, but parameter {position[k]} of the "
                    f"optimizer has shape {tuple(p.shape)} (a checkpoint of another model?)."
                )
