"""Membership scores of canaries: black-box (loss) and white-box (gradient alignment)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

from opake_compile._validate import check_positive_int
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = ["loss_scores", "gradient_scores"]


def _check_canaries(model: Any, canaries: Any, loss_fn: Any) -> tuple[torch.Tensor, ...]:
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"Expected model to be a torch.nn.Module, got {type(model).__name__}.")
    if not callable(loss_fn):
        raise InputTypeError(f"Expected loss_fn to be callable, got {type(loss_fn).__name__}.")
    if isinstance(canaries, torch.Tensor):
        canaries = (canaries,)
    if not isinstance(canaries, (tuple, list)) or not canaries or not all(isinstance(t, torch.Tensor) for t in canaries):
        raise InputTypeError("Expected canaries to be a tensor or a tuple of tensors (e.g. (x, y)), batched along dim 0.")
    sizes = {len(t) if t.dim() else -1 for t in canaries}
    if len(sizes) != 1 or -1 in sizes or 0 in sizes:
        raise ConfigurationError(
            f"Expected every canary tensor to have the same number m >= 1 of canaries along dim 0, "
            f"got shapes {[tuple(t.shape) for t in canaries]}."
        )
    return tuple(canaries)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _per_example(loss_fn: Callable[..., torch.Tensor], model: nn.Module) -> Callable[..., torch.Tensor]:
    def one(*example: torch.Tensor) -> torch.Tensor:
        out = loss_fn(model, *(e.unsqueeze(0) for e in example))
        if out.numel() != 1:
            raise ConfigurationError(f"loss_fn must return a scalar loss for a batch, got shape {tuple(out.shape)}.")
        return out.reshape(())

    return one


def _chunks(canaries: tuple[torch.Tensor, ...], batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    m = len(canaries[0])
    for start in range(0, m, batch_size):
        yield tuple(t[start : start + batch_size] for t in canaries)


def loss_scores(
    model: nn.Module,
    canaries: Any,
    loss_fn: Callable[..., torch.Tensor],
    *,
    batch_size: int = 1024,
) -> np.ndarray:
    """Black-box membership scores: minus each canary's loss under the trained ``model``.

    A canary the model was trained on tends to have a lower loss, so a higher score means
    "more likely included". ``loss_fn`` is the same batch loss given to
    :func:`~opake_compile.compile_dp` (``loss_fn(model, *batch)`` -> scalar, mean or sum); it
    is evaluated per canary as a batch of one under ``torch.func.vmap``, in chunks of
    ``batch_size``, with the model in eval mode (dropout off; the mode is restored) and no
    autograd. Nothing here is private: the scores are the auditor's.

    Args:
        model: the trained model.
        canaries: a tensor or tuple of tensors (e.g. ``(x, y)``), canary ``i`` at index ``i``
            of dim 0, for all m canaries (included and excluded, in the record's order).
        loss_fn: ``loss_fn(model, *batch) -> scalar``.
        batch_size: canaries per vmapped chunk.

    Returns:
        ``(m,)`` float64 numpy array.

    Raises:
        InputTypeError: a non-module model, non-callable loss, canaries not tensors.
        ConfigurationError: canary tensors of different lengths; a loss that is not scalar.

    Example::

        >>> import torch, torch.nn.functional as F, opake_compile as opake
        >>> model = torch.nn.Linear(4, 3)
        >>> x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
        >>> s = opake.auditing.loss_scores(model, (x, y), lambda m, x, y: F.cross_entropy(m(x), y))
        >>> s.shape
        (10,)
    """
    canaries = _check_canaries(model, canaries, loss_fn)
    bs = check_positive_int(batch_size, name="batch_size")
    per_example = vmap(_per_example(loss_fn, model), randomness="different")
    out = []
    with torch.no_grad(), _eval_mode(model):
        for chunk in _chunks(canaries, bs):
            out.append(per_example(*chunk).detach().to(torch.float64).cpu())
    return -torch.cat(out).numpy()


def gradient_scores(
    model: nn.Module,
    canaries: Any,
    loss_fn: Callable[..., torch.Tensor],
    *,
    initial_params: Mapping[str, torch.Tensor],
    batch_size: int = 256,
) -> np.ndarray:
    """White-box membership scores: the cosine between each canary's descent direction at the
    initial parameters theta_0 and the total update theta_T - theta_0.

    score_i = <-g_i(theta_0), theta_T - theta_0> / (||g_i(theta_0)|| ||theta_T - theta_0||),
    over the trainable parameters (``requires_grad=True``) only; a canary with a zero gradient
    scores 0. Training on canary i pushes the parameters along -g_i, so included canaries tend
    to align with the update. The caller keeps theta_0 (``{n: p.detach().clone() for n, p in
    model.named_parameters()}`` before training); theta_T is the model's current parameters.
    Per-example gradients come from ``torch.func.vmap(grad(...))`` at theta_0 (eval mode, the
    model's current buffers), in chunks of ``batch_size``.

    Args:
        model: the trained model (theta_T).
        canaries: as in :func:`loss_scores`.
        loss_fn: ``loss_fn(model, *batch) -> scalar``, the training loss.
        initial_params: theta_0 for (at least) every trainable parameter, keyed like
            ``named_parameters()``; shapes must match.
        batch_size: canaries per vmapped chunk (memory: ``batch_size`` x the trainable size).

    Returns:
        ``(m,)`` float64 numpy array in [-1, 1].

    Raises:
        InputTypeError / ConfigurationError: as in :func:`loss_scores`; ``initial_params``
            missing a trainable parameter or with a wrong shape; no trainable parameter.

    Example::

        >>> import torch, torch.nn.functional as F, opake_compile as opake
        >>> model = torch.nn.Linear(4, 3)
        >>> theta0 = {n: p.detach().clone() for n, p in model.named_parameters()}
        >>> with torch.no_grad():
        ...     _ = model.weight.add_(0.1)
        >>> x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
        >>> loss = lambda m, x, y: F.cross_entropy(m(x), y)
        >>> s = opake.auditing.gradient_scores(model, (x, y), loss, initial_params=theta0)
        >>> bool((abs(s) <= 1 + 1e-9).all())
        True
    """
    canaries = _check_canaries(model, canaries, loss_fn)
    bs = check_positive_int(batch_size, name="batch_size")
    if not isinstance(initial_params, Mapping):
        raise InputTypeError(f"Expected initial_params to be a dict name -> tensor, got {type(initial_params).__name__}.")
    named = dict(model.named_parameters())
    trainable = [n for n, p in named.items() if p.requires_grad]
    if not trainable:
        raise ConfigurationError("The model has no trainable parameter (requires_grad=True): nothing to score.")
    theta0: dict[str, torch.Tensor] = {}
    for n in trainable:
        if n not in initial_params:
            raise ConfigurationError(f"initial_params has no entry for the trainable parameter {n!r}.")
        t0 = initial_params[n]
        if not isinstance(t0, torch.Tensor) or t0.shape != named[n].shape:
            raise ConfigurationError(
                f"initial_params[{n!r}] must be a tensor of shape {tuple(named[n].shape)}, got "
                f"{tuple(t0.shape) if isinstance(t0, torch.Tensor) else type(t0).__name__}."
            )
        theta0[n] = t0.detach().to(named[n].device, named[n].dtype)
    frozen = {n: p.detach() for n, p in named.items() if not p.requires_grad}
    buffers = dict(model.named_buffers())
    update = torch.cat([(named[n].detach() - theta0[n]).reshape(-1).double() for n in trainable])
    update_norm = torch.linalg.vector_norm(update)

    wrapper = _LossModule(model, loss_fn)
    state = {f"model.{n}": t for n, t in {**frozen, **buffers}.items()}

    def loss_one(params: dict[str, torch.Tensor], *example: torch.Tensor) -> torch.Tensor:
        batch = tuple(e.unsqueeze(0) for e in example)
        full = {**state, **{f"model.{n}": t for n, t in params.items()}}
        return functional_call(wrapper, full, batch, strict=False).reshape(())

    per_example_grad = vmap(grad(loss_one), in_dims=(None,) + (0,) * len(canaries), randomness="different")
    out = []
    with _eval_mode(model):
        for chunk in _chunks(canaries, bs):
            g = per_example_grad(theta0, *chunk)
            flat = torch.cat([g[n].reshape(len(chunk[0]), -1).double() for n in trainable], dim=1)
            norms = torch.linalg.vector_norm(flat, dim=1)
            dots = -(flat @ update)
            denom = norms * update_norm
            out.append(torch.where(denom > 0, dots / torch.where(denom > 0, denom, 1.0), 0.0).cpu())
    return torch.cat(out).numpy()


class _LossModule(nn.Module):
    """``loss_fn(model, *batch)`` as a module, so ``functional_call`` can swap in theta_0."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        return self._loss_fn(self.model, *batch)
