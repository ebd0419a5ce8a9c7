"""``DPOptimizer``: privatise a clipped sum and step any ``torch.optim`` optimizer.

DP-SGD (Abadi et al. 2016) with Poisson subsampling: the step adds Gaussian noise
``N(0, (noise_multiplier * C)^2)`` once to the *sum* of clipped per-example gradients, divides by
the *expected* batch size ``q * N`` (never the realised size, which depends on the data and
would leak), writes ``.grad`` of the trainable parameters and steps the wrapped optimizer. Any
update rule then works on the privatised gradient (DP-Adam is ``Adam`` wrapped here).

Every logical step is counted for the accountant, an empty batch included: it releases pure
noise, and skipping it would reveal that the batch was empty.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from opake_compile import accounting as _acc
from opake_compile import random as _random
from opake_compile._validate import NotPrivateWarning, check_noise_multiplier
from opake_compile.dpsgd._types import ClippedPytree
from opake_compile.dpsgd.noise import add_gaussian_noise
from opake_compile.exceptions import (
    CheckpointError,
    ConfigurationError,
    InputTypeError,
    PrivacyBudgetExhaustedError,
)

__all__ = ["DPOptimizer", "accumulate"]

_STATE_VERSION = 1


def accumulate(parts: Sequence[ClippedPytree]) -> ClippedPytree:
    """Add the clipped sums of several physical batches that form one logical batch.

    Args:
        parts: ``ClippedPytree`` s with the same clipping norm, parameters and keys, none of
            them normalised.

    Returns:
        One ``ClippedPytree``: grads added, per-example norms concatenated, counts added.

    Raises:
        InputTypeError: an element is not a ``ClippedPytree``; the list is empty.
        ConfigurationError: the parts disagree on C or on the parameters, or one is normalised.
    """
    parts = list(parts)
    if not parts:
        raise InputTypeError("accumulate needs at least one ClippedPytree.")
    for p in parts:
        if not isinstance(p, ClippedPytree):
            raise InputTypeError(f"accumulate expects ClippedPytree parts, got {type(p).__name__}.")
        if p.normalize_by is not None:
            raise ConfigurationError("accumulate expects unnormalised sums (normalize_by=None).")
    first = parts[0]
    for p in parts[1:]:
        if p.clipping_norm != first.clipping_norm:
            raise ConfigurationError(
                f"Cannot accumulate sums clipped at different norms ({first.clipping_norm} and {p.clipping_norm})."
            )
        if not isinstance(p.grads, dict) or set(p.grads) != set(first.grads):
            raise ConfigurationError("Cannot accumulate sums over different parameters.")
        if p.num_ranks != first.num_ranks:
            raise ConfigurationError("Cannot accumulate a local sum with a sum reduced over ranks.")
    grads = {k: sum(p.grads[k] for p in parts) for k in first.grads}
    return ClippedPytree(
        grads=grads,
        clipping_norm=first.clipping_norm,
        per_example_norms=torch.cat([p.per_example_norms.reshape(-1) for p in parts]),
        num_examples=sum(p.num_examples for p in parts),
        num_nonfinite=sum(p.num_nonfinite for p in parts),
        num_ranks=first.num_ranks,
        parameters=first.parameters,
    )


def _view_key(t: torch.Tensor) -> tuple:
    """Identity of a tensor's memory view: detached copies of a parameter share it."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


class DPOptimizer:
    """Wraps a ``torch.optim`` optimizer into a DP-SGD / DP-Adam / DP-anything step.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over (at least) the trainable parameters.
        noise_multiplier: sigma >= 0; the noise std on the clipped *sum* is sigma * C, C being
            read from each ``ClippedPytree``. sigma = 0 warns: not private.
        sampler: the batch sampler that drew the batches, a
            :class:`~opake_compile.sampling.PoissonSampler`. The sample rate q, the dataset size
            N and the truncation are read from it, so the accounted sampling is the one used.
            A sampler that is not Poisson is refused (accounting it as Poisson would overstate
            the privacy).
        key: an :mod:`opake_compile.random` key for the noise; advanced every step and saved
            in :meth:`state_dict`.
        accountant: an :class:`opake_compile.accounting.Accountant`, or ``"pld"`` (default) /
            ``"rdp"``.
        budget: optional privacy budget (``accounting.epsilon_budget(eps, delta)``). A step
            that would exceed it raises :class:`PrivacyBudgetExhaustedError` before any
            parameter, optimizer or random state changes.

    Raises:
        InputTypeError: ``optimizer`` is not a ``torch.optim.Optimizer``; bad key.
        ConfigurationError: sigma < 0 or non-finite; a sampler that is not Poisson; q * N = 0.

    Example::

        >>> opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
        ...                   sampler=sampler, key=opake.random.key(0),
        ...                   budget=opake.accounting.epsilon_budget(3.0, delta=1e-5))
        >>> opt.step(step(x, y).clipped)
        >>> opt.epsilon()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float,
        sampler: Any,
        key: Any,
        accountant: Any = None,
        budget: Any = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputTypeError(f"Expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        self.optimizer = optimizer
        self._noise_multiplier = check_noise_multiplier(noise_multiplier)
        if not getattr(sampler, "is_poisson", False):
            raise ConfigurationError(
                f"DPOptimizer needs a Poisson sampler (opake_compile.sampling.PoissonSampler); got "
                f"{type(sampler).__name__}. Fixed-size shuffled batches are not Poisson subsampling, "
                "and accounting them as such would overstate the privacy guarantee."
            )
        self.sampler = sampler
        self._sample_rate = float(sampler.sample_rate)
        self._dataset_size = int(sampler.dataset_size)
        self._truncated_batch_size = sampler.truncated_batch_size
        if not self.expected_batch_size > 0:
            raise ConfigurationError(
                f"Expected batch size q*N = {self.sample_rate}*{self.dataset_size} must be > 0."
            )
        if not isinstance(key, _random.Key):
            raise InputTypeError(f"Expected key to be an opake_compile.random.Key, got {type(key).__name__}.")
        self._key = key
        if accountant is None or isinstance(accountant, str):
            accountant = _acc.Accountant(accountant or "pld")
        if not isinstance(accountant, _acc.Accountant):
            raise InputTypeError(f"Expected an accounting.Accountant or 'pld'/'rdp', got {type(accountant).__name__}.")
        self.accountant = accountant
        if budget is not None and not isinstance(budget, _acc.PrivacyBudget):
            raise InputTypeError(
                f"Expected budget from accounting.epsilon_budget/delta_budget, got {type(budget).__name__}."
            )
        self.budget = budget
        self._steps = 0
        with warnings.catch_warnings():
            # sigma = 0 was already reported above; do not repeat it on every accounting query.
            warnings.simplefilter("ignore", NotPrivateWarning)
            self._step_process = _acc.dpsgd_step_process(
                self.noise_multiplier,
                self.sample_rate,
                dataset_size=self.dataset_size,
                truncated_batch_size=self.truncated_batch_size,
            )

    # ------------------------------------------------- the privacy configuration
    # Read-only: the noise, the normalisation and the accounting must always use the same
    # values (changing sigma after construction would under-report the privacy spent).
    @property
    def noise_multiplier(self) -> float:
        """sigma: the noise std on the clipped sum is sigma * C."""
        return self._noise_multiplier

    @property
    def sample_rate(self) -> float:
        """q, read from the sampler."""
        return self._sample_rate

    @property
    def dataset_size(self) -> int:
        """N, read from the sampler."""
        return self._dataset_size

    @property
    def truncated_batch_size(self) -> int | None:
        """The sampler's truncation (``None``: plain Poisson)."""
        return self._truncated_batch_size

    @property
    def expected_batch_size(self) -> float:
        """q * N: the divisor of the noised sum (never the realised batch size)."""
        return self._sample_rate * self._dataset_size

    @property
    def steps(self) -> int:
        """Logical steps taken (empty batches included): what the accountant charges for."""
        return self._steps

    # ---------------------------------------------------------------- accounting
    @property
    def step_process(self) -> Any:
        """The privacy process of one logical step (Poisson-subsampled Gaussian)."""
        return self._step_process

    @property
    def process(self) -> Any:
        """The privacy process of all steps taken so far."""
        return self.step_process * self.steps

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the budget's delta)."""
        if delta is None:
            delta = getattr(self.budget, "delta", None)
            if delta is None:
                raise ConfigurationError("Pass delta (no epsilon budget was configured to take it from).")
        if self.steps == 0:
            return 0.0
        return self.accountant.epsilon(self.process, delta)

    def max_steps(self) -> int | None:
        """How many logical steps the budget allows in total (``None`` without a budget)."""
        if self.budget is None:
            return None
        return self.accountant.max_steps(self.step_process, self.budget)

    # ---------------------------------------------------------------- the step
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, clipped: ClippedPytree | Sequence[ClippedPytree]) -> None:
        """Privatise ``clipped`` (one logical batch) and step the wrapped optimizer.

        Writes ``p.grad = (sum + N(0, (sigma C)^2 I)) / (q N)`` for every trainable parameter in
        ``clipped`` and sets ``.grad = None`` on every other parameter of the optimizer (a stale
        non-private gradient is never applied). A sequence of ``ClippedPytree`` (physical
        batches of one logical batch) is accumulated first.

        Raises:
            InputTypeError: not a ``ClippedPytree`` (a ``NoisedPytree`` is refused: no double
                noising); it carries no parameter references.
            ConfigurationError: the sum was already normalised; C = inf with sigma > 0; a
                gradient whose parameter is not in the optimizer or has another shape.
            PrivacyBudgetExhaustedError: this step would exceed the budget. Nothing changes.
        """
        if not isinstance(clipped, ClippedPytree):
            if isinstance(clipped, Sequence) and not isinstance(clipped, (str, bytes)):
                clipped = accumulate(clipped)
            else:
                hint = " (did you mean result.clipped?)" if hasattr(clipped, "clipped") else ""
                raise InputTypeError(
                    f"DPOptimizer.step expects the ClippedPytree of one logical batch, got "
                    f"{type(clipped).__name__}{hint}."
                )
        if clipped.normalize_by is not None:
            raise ConfigurationError(
                f"The ClippedPytree was already normalised (normalize_by={clipped.normalize_by}); "
                "DPOptimizer adds noise to the sum and divides by the expected batch size itself."
            )
        world = torch.distributed.get_world_size() if torch.distributed.is_available() and torch.distributed.is_initialized() else 1
        if clipped.num_ranks != world:
            raise ConfigurationError(
                f"This ClippedPytree holds the sum of {clipped.num_ranks} process(es), but the process "
                f"group has {world}: call opake_compile.distributed.sum_gradients(clipped) first, so "
                "that every rank adds the same noise to the same global sum."
            )
        c = clipped.clipping_norm
        if math.isinf(c) and self.noise_multiplier > 0:
            raise ConfigurationError("clipping_norm=inf cannot be privatised with noise_multiplier > 0.")
        targets = self._match_parameters(clipped)
        if self.budget is not None:
            allowed = self.max_steps()
            if self.steps + 1 > allowed:
                raise PrivacyBudgetExhaustedError(
                    f"Step {self.steps + 1} would exceed the privacy budget {self.budget}: it allows "
                    f"{allowed} step(s) with noise_multiplier={self.noise_multiplier}, "
                    f"sample_rate={self.sample_rate}. No state was changed."
                )
        next_key, draw_key = _random.split(self._key, 2)
        std = self.noise_multiplier * c if self.noise_multiplier > 0 else 0.0
        noised = add_gaussian_noise(clipped.grads, std, draw_key)
        new_grads = {
            name: (noised[name] / self.expected_batch_size).to(dtype=p.dtype, device=p.device)
            for name, p in targets.items()
        }
        # Validation and noise are done: from here on the state changes.
        written = {id(p) for p in targets.values()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in written:
                    p.grad = None
        for name, p in targets.items():
            p.grad = new_grads[name]
        self.optimizer.step()
        self._key = next_key
        self._steps += 1

    def _match_parameters(self, clipped: ClippedPytree) -> dict[str, torch.Tensor]:
        if clipped.parameters is None or not isinstance(clipped.grads, dict):
            raise InputTypeError(
                "This ClippedPytree carries no parameter references; build it with compile_dp or "
                "with clipped_grad on a dict of parameters (e.g. from make_functional)."
            )
        by_view = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                by_view[_view_key(p)] = p
        targets = {}
        for name, g in clipped.grads.items():
            ref = clipped.parameters.get(name)
            p = None if ref is None else by_view.get(_view_key(ref))
            if p is None:
                raise ConfigurationError(f"Parameter {name!r} of the clipped gradients is not in the wrapped optimizer.")
            if tuple(g.shape) != tuple(p.shape):
                raise ConfigurationError(
                    f"Gradient of {name!r} has shape {tuple(g.shape)}, the parameter {tuple(p.shape)}."
                )
            targets[name] = p
        return targets

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus the noise key, the step count and the privacy
        configuration (checked on load)."""
        return {
            "version": _STATE_VERSION,
            "optimizer": self.optimizer.state_dict(),
            "key": _random.key_to_state(self._key),
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "dataset_size": self.dataset_size,
            "truncated_batch_size": self.truncated_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            CheckpointError: missing keys, another version, or a different privacy configuration
                (noise multiplier, sample rate, dataset size, truncation).
        """
        required = {"version", "optimizer", "key", "steps", "noise_multiplier", "sample_rate", "dataset_size", "truncated_batch_size"}
        if not isinstance(state, dict) or not required <= set(state):
            missing = sorted(required - set(state)) if isinstance(state, dict) else sorted(required)
            raise CheckpointError(f"DPOptimizer state is missing {missing}.")
        if state["version"] != _STATE_VERSION:
            raise CheckpointError(f"DPOptimizer state version {state['version']} is not {_STATE_VERSION}.")
        for field in ("noise_multiplier", "sample_rate", "dataset_size", "truncated_batch_size"):
            if state[field] != getattr(self, field):
                raise CheckpointError(
                    f"Checkpoint has {field}={state[field]!r}, this optimizer {getattr(self, field)!r}: "
                    "the privacy accounting would not match."
                )
        key = _random.key_from_state(state["key"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._key = key
        self._steps = int(state["steps"])
