"""``PrivacyEngine``: Opacus's entry point, running ``compile_dp`` + ``DPOptimizer`` underneath.

How the eager loop maps onto the compiled step::

    out = model(x)              # PrivateModule: the real output (an eager forward without
                                # autograd), recorded as the root of a loss program
    loss = criterion(out, y)    # recorded; loss.item() works here (the values are real)
    loss.backward()             # intercepted: the loss program is checked for separability,
                                # then the compiled step computes the clipped sum of this batch
    optimizer.step()            # noise once on the sum of the draw, / (q N), the user's step
    optimizer.zero_grad()

"hooks" mode compiles the model alone into a per-example vector-Jacobian product: the gradient
flowing into each example's output row is the loss program's gradient on that example alone
(a batch of one), and the step clips ``J_i^T v_i``. "ghost" mode compiles the model and the
recorded loss together (``compile_dp`` on ``loss(model(x), y)``), so its rewrites see the whole
graph. Both use the ghost-norm and book-keeping rewrites of ``compile_dp`` where they match.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import optree
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Sampler, default_collate

from opake_compile import accounting as _acc
from opake_compile import random as _random
from opake_compile.compiler.step import DPStep, _default_physical_batch_size, compile_dp
from opake_compile.exceptions import ConfigurationError, InputTypeError, UnsupportedOperationError
from opake_compile.functional import empty_collate
from opake_compile.opacus import _tape
from opake_compile.opacus._validator import ModuleValidator
from opake_compile.optim import DPOptimizer as _OpakeDPOptimizer
from opake_compile.optim import _check_delta, _claim_key
from opake_compile.sampling import Draw, DrawId, PoissonSampler, _CollateWithDraw, _DrawDataset

__all__ = [
    "BatchMemoryManager",
    "DPDataLoader",
    "DPOptimizer",
    "GradSampleModule",
    "PrivacyEngine",
    "PrivateModule",
    "register_grad_sampler",
]

_ACCOUNTANTS = {"prv": "pld", "pld": "pld", "rdp": "rdp"}
_MODES = ("hooks", "ghost")


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(t, torch.Tensor) and t.numel() > 0]


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _not_mapped(feature: str, alternative: str) -> UnsupportedOperationError:
    return UnsupportedOperationError(f"Opacus's {feature} is not supported by opake_compile.opacus. {alternative}")


class GradSampleModule:
    """Refused: Opacus's ``GradSampleModule`` used directly (``p.grad_sample`` hooks).

    Per-example gradients are never stored on parameters here. Use
    ``opake_compile.compile_dp`` (its ``ClippedPytree`` carries the clipped sum and the
    per-example norms) or ``opake_compile.clipped_grad`` for per-example values.

    Raises:
        UnsupportedOperationError: always.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _not_mapped(
            "GradSampleModule (per-example gradients in p.grad_sample from module hooks)",
            "Per-example gradients are not stored on parameters: use PrivacyEngine.make_private, or "
            "opake_compile.compile_dp directly (its ClippedPytree carries the clipped sum and the "
            "per-example norms).",
        )


def register_grad_sampler(*args: Any, **kwargs: Any) -> Any:
    """Refused: Opacus's custom grad samplers. ``compile_dp`` derives per-example gradients
    of any traceable module from its graph, so none is needed.

    Raises:
        UnsupportedOperationError: always.
    """
    raise _not_mapped(
        "register_grad_sampler (custom grad samplers)",
        "compile_dp derives the per-example gradient of any traceable module from its graph; "
        "a layer it cannot trace per example is named in the error at the first loss.backward().",
    )


class _Meta(NamedTuple):
    """Which Poisson draw a physical batch belongs to, whether it is the draw's last, the
    draw's size (its physical batches hold that many examples in all), and which physical batch
    of the draw it is (``chunk``, holding ``rows`` examples)."""

    draw: DrawId
    last: bool
    size: int
    chunk: int = 0
    rows: int = -1


@dataclasses.dataclass
class _Part:
    clipped: Any
    meta: _Meta | None


class _Session:
    """The state one ``make_private`` call shares between its model, optimizer and loader."""

    def __init__(self, *, module: nn.Module, mode: str, clipping_norm: float, loss_reduction: str, backend: Any, key: Any, expected_batch_size: float, physical_batch_size: int | None) -> None:
        self.module = module
        self.mode = mode
        self.clipping_norm = clipping_norm
        self.loss_reduction = loss_reduction
        self.backend = backend
        self.key = key
        self.default_physical_batch_size = physical_batch_size or _default_physical_batch_size(max(1, int(math.ceil(expected_batch_size))))
        self.physical_batch_size = self.default_physical_batch_size
        self.current: _Meta | None = None
        # Storage of every tensor the data loader has yielded and is still alive, with the
        # physical batches it was yielded in: a model input sharing storage only with batches of
        # other draws is an earlier draw's data, whose examples the current draw's charge does
        # not cover (see ``_check_inputs``).
        self.yielded: dict[tuple[str, int], list[tuple[weakref.ref, _Meta]]] = {}
        self.parts: list[_Part] = []
        self.steps: dict[Any, DPStep] = {}
        self.constants: dict[Any, torch.Tensor] = {}
        self.scalings: dict[Any, Any] = {}  # loss structure -> what check_batch_size has seen
        self.optimizer: DPOptimizer | None = None

    # --------------------------------------------------------------- forward
    def forward(self, args: tuple) -> Any:
        n = None
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 1:
                n = a.shape[0]
                break
        # The eager forward runs on the whole batch, outside the compiled per-example step: a
        # buffer it reassigns (self.mu = 0.9 * self.mu + 0.1 * x.mean(0)) would hold a statistic
        # of the batch, released with the weights uncharged (review: 12 steps moved it from
        # ~0.2 to ~-600 with one outlier). Put back and refused. (In-place writes are refused
        # by the step's own check.)
        buffers = [(m, name, t) for m in self.module.modules() for name, t in m._buffers.items()]
        with torch.no_grad():
            out = self.module(*args)
        moved = [(m, name, t) for m, name, t in buffers if m._buffers.get(name) is not t]
        if moved:
            for m, name, t in moved:
                m._buffers[name] = t
            raise UnsupportedOperationError(
                f"The model's forward replaced its buffer {moved[0][1]!r} ({type(moved[0][0]).__name__}): a "
                "buffer computed from the batch (a running statistic) is released with the model and "
                "charged nowhere. Keep the buffer fixed in training mode, or make it a parameter trained "
                "privately. The buffer was put back; nothing was recorded."
            )
        if not isinstance(out, torch.Tensor):
            raise UnsupportedOperationError(
                f"In training mode the model's forward must return one tensor, got "
                f"{type(out).__name__}: the loss is recorded from that tensor."
            )
        if n is None or out.dim() == 0 or out.shape[0] != n:
            raise UnsupportedOperationError(
                f"The model output has shape {tuple(out.shape)}, the batch {n} rows: the first "
                "dimension of inputs and output must be the batch (batch_first=True)."
            )
        self._check_inputs(args, n)
        tape = _tape.Tape(self, {"args": args, "n": n, "draw": self.current})
        return tape.root(out)

    # ------------------------------------------------------------ data binding
    def admit(self, batch: Any, meta: _Meta) -> None:
        """Record ``batch`` as the physical batch ``meta`` the data loader is about to yield."""
        self.current = meta
        for key, entries in list(self.yielded.items()):
            entries[:] = [(ref, m) for ref, m in entries if ref() is not None]
            if not entries:
                del self.yielded[key]
        for t in _tensor_leaves(batch):
            self.yielded.setdefault(_storage_key(t), []).append((weakref.ref(t), meta))

    def _check_inputs(self, args: tuple, n: int | None) -> None:
        """Refuse model inputs that are not the current physical batch of the data loader.

        The optimizer charges the draw the loader handed out last; a forward on tensors the
        loader yielded for an earlier draw (a batch kept from the first iteration and reused,
        or a view of it) would train on examples that draw's charge does not cover, every step,
        at the amplified rate q. A batch whose row count differs from the current physical
        batch's is refused for the same reason. (A transformed copy of an earlier batch with
        as many rows cannot be told apart from fresh data: see docs/migrating-from-opacus.md.)
        """
        meta = self.current
        if meta is None:
            return  # refused at backward with the reason (not the returned data loader)
        for t in _tensor_leaves(args):
            entries = [m for ref, m in self.yielded.get(_storage_key(t), ()) if ref() is not None]
            if entries and meta not in entries:
                old = entries[-1]
                raise UnsupportedOperationError(
                    f"The model input of shape {tuple(t.shape)} holds data the data loader yielded for an "
                    f"earlier Poisson draw (hand-out {old.draw.seq}, epoch {old.draw.epoch} step "
                    f"{old.draw.step}), while the draw being charged is hand-out {meta.draw.seq}: those "
                    "examples would be trained on again under a charge that does not cover them. Forward "
                    "the batch the loop's data loader yields at each iteration."
                )
        if meta.rows >= 0 and n is not None and n != meta.rows:
            raise UnsupportedOperationError(
                f"The model input has {n} rows but the current physical batch of the data loader has "
                f"{meta.rows}: only the examples of the yielded batch are covered by the draw's charge. "
                "Forward the batch the data loader yields, whole."
            )

    # -------------------------------------------------------------- backward
    def backward(self, loss: Any, gradient: Any = None, retain_graph: Any = None, create_graph: bool = False, inputs: Any = None) -> None:
        if gradient is not None or create_graph or inputs is not None:
            raise UnsupportedOperationError(
                "loss.backward(gradient=..., create_graph=..., inputs=...) is not supported: call "
                "loss.backward() on the scalar batch loss."
            )
        tape: _tape.Tape = loss._tape
        if tape.mixed:
            raise UnsupportedOperationError(
                "The loss combines the outputs of several model(...) calls: each forward pass must "
                "have its own loss and loss.backward() (one Poisson draw per optimizer step)."
            )
        if tape.consumed:
            raise UnsupportedOperationError(
                "loss.backward() was already called on this forward pass: a second call would add "
                "the same examples twice to the clipped sum (twice the sensitivity)."
            )
        meta: _Meta | None = tape.meta["draw"]
        if meta is None:
            raise ConfigurationError(
                "This batch did not come from the DataLoader that make_private returned: only its "
                "Poisson draws are accounted for. Iterate the returned data loader."
            )
        stale = self.parts[-1].meta if self.parts else None
        if stale is not None and stale.draw != meta.draw and not stale.last:
            # A loop left in the middle of a draw (a break inside BatchMemoryManager) left its first
            # physical batches pending, and every later backward was refused with no way out
            # (review). They were never released: dropped; the draw is charged with the next step,
            # as every skipped draw is.
            warnings.warn(
                "The physical batches of an earlier Poisson draw were left before its last one (a loop "
                "left mid-draw): their clipped sums are dropped unreleased, and that draw is charged with "
                "the next step as a skipped draw.",
                UserWarning,
                stacklevel=2,
            )
            self.parts.clear()
        if self.parts and self.parts[-1].meta is not None and self.parts[-1].meta.draw != meta.draw:
            raise UnsupportedOperationError(
                "Opacus's gradient accumulation over several Poisson batches (loss.backward() on "
                "several batches before optimizer.step()) is refused: one noise on the sum of several "
                "draws is not a step at sample rate q, and Opacus charges it as one step at rate "
                "k*q. Call optimizer.step() after every batch; for large logical batches use a "
                "larger batch_size with BatchMemoryManager(max_physical_batch_size=...)."
            )
        if any(p.meta is not None and p.meta.draw == meta.draw and p.meta.chunk == meta.chunk for p in self.parts):
            raise UnsupportedOperationError(
                f"Physical batch {meta.chunk} of this Poisson draw was already backwarded before this step (two "
                "forwards of one yielded batch): its examples would count twice under one charge, and "
                "skipping another physical batch kept the count equal to the draw's (review: 2 C). Call "
                "loss.backward() once per physical batch. Nothing was recorded."
            )
        args, n = tape.meta["args"], tape.meta["n"]
        clipped = self._clipped(loss, tape, args, n)
        tape.consumed = True
        self.parts.append(_Part(clipped, meta))

    def _clipped(self, loss: Any, tape: _tape.Tape, args: tuple, n: int) -> Any:
        program = tape.program(loss)
        program.check_constants()
        batched_args = [isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] == n for a in args]
        root = tape.root_value
        externals, batched_ext = _tape.split_externals(program, tape, n)
        program.check_batch_size(n, externals, self.scalings)
        self._check_broadcast(program, externals, batched_ext)
        if n == 0:
            step = self._step(("empty", self.mode), lambda m, *a: m(*a[: len(args)]).sum(), [i for i, b in enumerate(batched_args) if b])
            return step(*args).clipped
        hooks = self.mode == "hooks"
        with torch.no_grad():
            losses, grads = _tape.per_example(program, root, externals, batched_ext, with_grad=hooks)
        batch_loss = _tape._plain(loss).detach()
        _tape.check_separable(program, root, externals, batched_ext, batch_loss, losses, self.loss_reduction, grads)
        if hooks:
            nargs = len(args)

            def vjp(model: nn.Module, *a: Any) -> torch.Tensor:
                return (model(*a[:nargs]) * a[nargs]).sum()

            positions = [i for i, b in enumerate(batched_args) if b] + [nargs]
            step = self._step(("hooks", nargs, tuple(batched_args)), vjp, positions)
            return step(*args, grads.detach()).clipped
        nargs = len(args)

        def full(model: nn.Module, *a: Any) -> torch.Tensor:
            return program(model(*a[:nargs]), list(a[nargs:]))

        positions = [i for i, b in enumerate(batched_args) if b] + [nargs + i for i, b in enumerate(batched_ext) if b]
        key = ("ghost", nargs, tuple(batched_args), tuple(batched_ext), program.key())
        step = self._step(key, full, positions)
        return step(*args, *externals).clipped

    def _check_broadcast(self, program: _tape.Program, externals: list[torch.Tensor], batched: list[bool]) -> None:
        """Tensors the loss reads without a batch dimension (class weights, constants) must be
        the same at every step: one computed from the batch (a statistic of the labels) would
        scale every example's loss by something all examples share."""
        for i, (t, b) in enumerate(zip(externals, batched)):
            if b:
                continue
            key = (program.key(), i)
            seen = self.constants.get(key)
            if seen is None:
                self.constants[key] = t.detach().clone()
            elif seen.shape != t.shape or not torch.equal(seen, t.detach().to(seen.device)):
                raise UnsupportedOperationError(
                    f"The loss reads a tensor without a batch dimension (shape {tuple(t.shape)}) "
                    "whose value changed since the first step: if it is computed from the batch (a "
                    "statistic of the labels), it mixes examples. Give per-example values the "
                    "batch dimension; keep constants (class weights) constant."
                )

    def _step(self, key: Any, fn: Callable[..., Any], positions: list[int]) -> DPStep:
        key = (key, self.physical_batch_size)
        step = self.steps.get(key)
        if step is None:
            self.key, sub = _random.split(self.key, 2)
            step = compile_dp(
                fn,
                model=self.module,
                clipping_norm=self.clipping_norm,
                batch_argnums=tuple(positions),
                physical_batch_size=self.physical_batch_size,
                backend=self.backend,
                key=sub,
            )
            self.steps[key] = step
        return step


class PrivateModule(nn.Module):
    """The model ``make_private`` returns (Opacus's ``GradSampleModule`` in that role).

    In training mode with autograd enabled, ``forward(*args)`` runs the wrapped module without
    autograd and returns its output as a recording tensor (real values; ``loss.backward()`` on a
    loss computed from it runs the compiled DP step). In eval mode or under ``torch.no_grad()``
    it is the wrapped module. Positional arguments only in training; the first dimension of
    every batched input and of the output is the batch.

    Attributes:
        _module: the wrapped module (as in Opacus; its ``state_dict`` has no prefix).
    """

    def __init__(self, module: nn.Module, session: _Session) -> None:
        super().__init__()
        self._module = module
        object.__setattr__(self, "_session", session)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.training and torch.is_grad_enabled()):
            return self._module(*args, **kwargs)
        if kwargs:
            raise UnsupportedOperationError(
                f"In training mode pass the model's inputs positionally (got keyword(s) {sorted(kwargs)}): "
                "the compiled step batches positional arguments."
            )
        return self._session.forward(args)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._module, name)


class _RescaledOptimizer(torch.optim.Optimizer):
    """Multiplies every ``.grad`` by ``factor`` before the wrapped step (``loss_reduction="sum"``:
    the DP step divides by q N, Opacus's sum reduction does not)."""

    def __init__(self, inner: torch.optim.Optimizer, factor: float) -> None:  # noqa: D107 (no super().__init__: shares the inner state)
        self.inner = inner
        self.factor = factor

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self, closure: Any = None) -> Any:
        for group in self.inner.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.factor)
        return self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)


class DPOptimizer(torch.optim.Optimizer):
    """The optimizer ``make_private`` returns (Opacus's ``DPOptimizer`` in that role).

    ``step()`` takes the clipped sums of the current Poisson draw (one per ``loss.backward()``,
    several with :class:`BatchMemoryManager`), and hands them to
    :class:`opake_compile.DPOptimizer`, which adds ``N(0, (sigma C)^2)`` once, divides by the
    expected batch size ``q N`` (``loss_reduction="mean"``; not divided for ``"sum"``), steps the
    original optimizer and charges the draw. Before the last physical batch of a draw, ``step``
    and ``zero_grad`` do nothing (as in Opacus).

    Attributes:
        original_optimizer: the optimizer passed to ``make_private``.
        dp: the underlying :class:`opake_compile.DPOptimizer` (accounting, key, state).
        noise_multiplier, max_grad_norm, expected_batch_size, loss_reduction: the configuration.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dp: _OpakeDPOptimizer, session: _Session, *, max_grad_norm: float, loss_reduction: str) -> None:  # noqa: D107
        self.original_optimizer = optimizer
        self.dp = dp
        self._session = session
        self._max_grad_norm = max_grad_norm
        self.loss_reduction = loss_reduction

    @property
    def max_grad_norm(self) -> float:
        """C, fixed by ``make_private``: the compiled step clips to it."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        # Opacus reads the attribute at every step, so clipping schedules set it; here the step
        # clipped to the first C whatever it was set to (review): refused rather than ignored.
        raise ConfigurationError(
            f"max_grad_norm is fixed at {self._max_grad_norm} by make_private (the compiled step clips to it): "
            "setting it would be ignored. For another clipping norm, call make_private again on fresh "
            "objects; for a norm that follows the data, use opake_compile's adaptive clipping."
        )

    @property
    def noise_multiplier(self) -> float:
        return self.dp.noise_multiplier

    @property
    def expected_batch_size(self) -> float:
        return self.dp.expected_batch_size

    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @property
    def state(self):
        return self.original_optimizer.state

    @property
    def defaults(self):
        return self.original_optimizer.defaults

    @property
    def accumulated_iterations(self) -> int:
        """Physical batches of the current draw not yet stepped on."""
        return len(self._session.parts)

    def step(self, closure: Any = None) -> Any:
        """Privatise the pending clipped sums and step; ``None`` (no step) before the last
        physical batch of a draw.

        Raises:
            UnsupportedOperationError: no ``loss.backward()`` since the last step.
            PrivacyBudgetExhaustedError: ``make_private_with_epsilon``'s budget would be exceeded
                (nothing changes).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        parts = self._session.parts
        if not parts:
            raise UnsupportedOperationError(
                "optimizer.step() without a recorded training forward and loss.backward() since the last "
                "step: there is no clipped gradient to privatise (a step on the plain .grad would not be "
                "private). A forward in eval mode (model.eval()) or under torch.no_grad() is not "
                "recorded: call model.train() before the training forward."
            )
        meta = parts[-1].meta
        if meta is not None and not meta.last:
            return None  # BatchMemoryManager: more physical batches of this draw follow
        held = sum(p.clipped.num_examples for p in parts)
        if meta is not None and held > meta.size:
            parts.clear()
            raise UnsupportedOperationError(
                f"This step's losses hold {held} examples but the Poisson draw has {meta.size}: the same batch "
                "was forwarded and backwarded more than once, which would count its examples several times "
                "for one charged step. Call loss.backward() once per physical batch."
            )
        self.dp.step([p.clipped for p in parts], draw=None if meta is None else meta.draw)
        parts.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        parts = self._session.parts
        if parts and parts[-1].meta is not None and not parts[-1].meta.last:
            return  # mid logical batch (Opacus keeps the accumulated gradients too)
        parts.clear()
        self.original_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The underlying ``opake_compile.DPOptimizer`` state (wrapped optimizer state, noise
        key, steps charged)."""
        return self.dp.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dp.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise UnsupportedOperationError("Adding parameter groups after make_private is not supported: call make_private with all of them.")

    def __repr__(self) -> str:
        return f"opake_compile.opacus.DPOptimizer({self.original_optimizer!r}, noise_multiplier={self.noise_multiplier}, max_grad_norm={self.max_grad_norm})"


class _DrawChunks(Sampler):
    """Batch sampler: the sampler's draws, each split into chunks of at most ``max_size``
    (``np.array_split``, as Opacus), tagged with their draw and whether they are its last."""

    def __init__(self, sampler: PoissonSampler, max_size: int | None) -> None:
        self.sampler = sampler
        self.max_size = max_size

    def __iter__(self):
        for draw in self.sampler:
            if self.max_size is None or len(draw) <= self.max_size:
                chunks = [list(draw)]
            else:
                chunks = [c.tolist() for c in np.array_split(np.asarray(draw), math.ceil(len(draw) / self.max_size))]
            for k, chunk in enumerate(chunks):
                yield Draw(chunk, _Meta(draw.id, k == len(chunks) - 1, len(draw), k, len(chunk)))

    def __len__(self) -> int:
        if self.max_size is None:
            return len(self.sampler)
        return math.ceil(len(self.sampler) * max(1.0, self.sampler.expected_batch_size / self.max_size))


class DPDataLoader(DataLoader):
    """The data loader ``make_private`` returns: Poisson batches (every example joins each
    batch with probability q = 1 / len(original loader)), empty ones included as batches with
    0 rows, ``len(original loader)`` batches per epoch. Each batch tells the model which draw
    it belongs to, so the optimizer charges exactly the draws used.

    Attributes:
        sampler_: the :class:`~opake_compile.sampling.PoissonSampler`.
        original_dataset: the dataset.
    """

    def __init__(self, dataset: Any, sampler: PoissonSampler, collate_fn: Callable[..., Any], session: _Session, *, max_physical_batch_size: int | None = None, **loader_kwargs: Any) -> None:  # noqa: D107
        self.original_dataset = dataset
        self.sampler_ = sampler
        self._session = session
        self._collate = collate_fn
        self._loader_kwargs = loader_kwargs
        super().__init__(
            _DrawDataset(dataset),
            batch_sampler=_DrawChunks(sampler, max_physical_batch_size),
            collate_fn=_CollateWithDraw(collate_fn),
            **loader_kwargs,
        )

    def __iter__(self):
        for batch, meta in super().__iter__():
            self._session.admit(batch, meta)
            yield batch

    def _split(self, max_physical_batch_size: int) -> DPDataLoader:
        return DPDataLoader(
            self.original_dataset,
            self.sampler_,
            self._collate,
            self._session,
            max_physical_batch_size=max_physical_batch_size,
            **self._loader_kwargs,
        )


class BatchMemoryManager:
    """Opacus's ``BatchMemoryManager``: physical batches of at most ``max_physical_batch_size``.

    Inside the ``with`` block, the returned loader splits each Poisson draw into physical
    batches; ``optimizer.step()`` steps (and charges) once per draw, after its last physical
    batch. The compiled step uses ``max_physical_batch_size`` as its ``physical_batch_size``
    (one compiled graph whatever the chunk sizes).

    Args:
        data_loader: the loader ``make_private`` returned.
        max_physical_batch_size: the largest physical batch, >= 1.
        optimizer: the optimizer ``make_private`` returned.

    Raises:
        ConfigurationError: a loader or optimizer that ``make_private`` did not return, or
            ``max_physical_batch_size < 1``.
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer: Any) -> None:  # noqa: D107
        if not isinstance(data_loader, DPDataLoader):
            raise ConfigurationError("BatchMemoryManager needs the data loader that make_private returned.")
        if not isinstance(optimizer, DPOptimizer) or optimizer._session is not data_loader._session:
            raise ConfigurationError("BatchMemoryManager needs the optimizer make_private returned with this data loader.")
        if isinstance(max_physical_batch_size, bool) or not isinstance(max_physical_batch_size, int) or max_physical_batch_size < 1:
            raise ConfigurationError(f"Expected max_physical_batch_size >= 1, got {max_physical_batch_size!r}.")
        self.data_loader = data_loader
        self.max_physical_batch_size = max_physical_batch_size
        self.optimizer = optimizer
        self._saved: int | None = None

    def __enter__(self) -> DPDataLoader:
        session = self.data_loader._session
        self._saved = session.physical_batch_size
        # Chunks are at most max_physical_batch_size rows; the compiled step pads each to its
        # physical size, so padding to more than the default for the expected batch is waste.
        session.physical_batch_size = min(self.max_physical_batch_size, session.default_physical_batch_size)
        return self.data_loader._split(self.max_physical_batch_size)

    def __exit__(self, *exc: Any) -> None:
        self.data_loader._session.physical_batch_size = self._saved


@functools.lru_cache(maxsize=64)
def _calibrated_sigma(epsilon: float, delta: float, q: float, n: int, steps: int, method: str) -> float:
    """The smallest sigma with ``poisson(gaussian(sigma), q) * steps`` within (epsilon, delta)
    (deterministic, so cached: the same script run for several seeds calibrates once)."""
    return _acc.calibrate(
        _acc.epsilon_budget(epsilon, delta=delta),
        lambda s: _acc.dpsgd_step_process(s, q, dataset_size=n) * steps,
        0.1,
        100.0,
        accountant=method,
    ).param


class _AccountantView:
    """``privacy_engine.accountant``: ``get_epsilon(delta)``, ``len()`` (steps charged) and
    ``mechanism()`` (``"pld"`` or ``"rdp"``)."""

    def __init__(self, engine: PrivacyEngine) -> None:
        self._engine = engine

    def get_epsilon(self, delta: float) -> float:
        return self._engine.get_epsilon(delta)

    def mechanism(self) -> str:
        return self._engine._accountant.method

    def __len__(self) -> int:
        return sum(o.dp.steps for o in self._engine._optimizers)


class PrivacyEngine:
    """Opacus's ``PrivacyEngine`` on opake_compile: ``make_private`` / ``make_private_with_epsilon``
    return a model, an optimizer and a Poisson data loader (and, in ghost mode, a criterion) that
    run the ordinary eager loop on the compiled DP step.

    Args:
        accountant: ``"prv"`` (Opacus's default; here the PLD accountant of dp-accounting,
            pessimistic by construction), ``"pld"``, or ``"rdp"``.
        secure_mode: must be ``False`` (refused: see below).
        backend: (opake_compile) the ``torch.compile`` backend of the compiled steps
            (``"inductor"``; ``"aot_eager"`` skips code generation).
        key: (opake_compile) an :mod:`opake_compile.random` key from which every
            ``make_private`` call given neither ``key=`` nor ``noise_generator=`` takes the next
            :func:`~opake_compile.random.split` child, for its sampling and noise: the run is then
            reproducible (Opacus's non-secure mode gets that from ``torch.manual_seed``; here
            the global torch generator is never used). Default ``None``: a fresh key from the
            operating system's entropy for each such call.

    Raises:
        UnsupportedOperationError: ``secure_mode=True``; an accountant we do not have
            (``"gdp"``).
        InputTypeError: ``key`` is not an :class:`opake_compile.random.Key`.
        ConfigurationError: ``key`` is a key object another engine or optimizer already uses
            (keys of equal value, seeded alike, are allowed: two runs of one script).

    Example::

        >>> engine = PrivacyEngine()                                     # doctest: +SKIP
        >>> model, optimizer, loader = engine.make_private_with_epsilon(  # doctest: +SKIP
        ...     module=model, optimizer=optimizer, data_loader=loader,
        ...     target_epsilon=3.0, target_delta=1e-5, epochs=10, max_grad_norm=1.0)
        >>> engine.get_epsilon(1e-5)                                     # doctest: +SKIP
    """

    def __init__(self, *, accountant: str = "prv", secure_mode: bool = False, backend: Any = "inductor", key: Any = None) -> None:
        if secure_mode:
            raise _not_mapped(
                "secure_mode (cryptographically secure noise from torchcsprng)",
                "Noise here comes from torch generators seeded by opake_compile.random keys (OS "
                "entropy by default, random_key()); run with secure_mode=False.",
            )
        if accountant not in _ACCOUNTANTS:
            raise _not_mapped(
                f"accountant={accountant!r}",
                "Use accountant='prv' (mapped to PLD), 'pld' or 'rdp'.",
            )
        if key is not None and not isinstance(key, _random.Key):
            raise InputTypeError(f"Expected key to be an opake_compile.random.Key (from opake_compile.random.key(seed)), got {type(key).__name__}.")
        if key is not None:
            # Two engines given one key object split it alike: the same sampling and noise.
            _claim_key(key, self)
        self._key = key
        self.secure_mode = False
        self.accountant_name = accountant
        self._accountant = _acc.Accountant(_ACCOUNTANTS[accountant])
        self.backend = backend
        self._optimizers: list[DPOptimizer] = []
        self.accountant = _AccountantView(self)

    # ---------------------------------------------------------------- privacy
    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent at ``delta`` by every optimizer this engine made, composed: each
        Poisson draw stepped on (or skipped before a later step) is charged as one step of
        ``poisson(gaussian(sigma), q)``, by the PLD accountant for ``"prv"``/``"pld"``."""
        processes = [o.dp.process for o in self._optimizers if o.dp.steps > 0]
        if not processes:
            return 0.0
        process = processes[0]
        for p in processes[1:]:
            process = process | p
        return float(self._accountant.epsilon(process, delta))

    def make_private_with_epsilon(self, *, module: nn.Module, optimizer: torch.optim.Optimizer, criterion: Any = None, data_loader: DataLoader, target_epsilon: float, target_delta: float, epochs: int, max_grad_norm: float, **kwargs: Any) -> tuple:
        """``make_private`` with the noise multiplier that spends ``target_epsilon`` at
        ``target_delta`` over ``epochs * len(data_loader)`` steps at q = 1 / len(data_loader),
        found by :func:`opake_compile.accounting.calibrate` with this engine's accountant. As in
        Opacus, training longer than ``epochs`` is not stopped: ``get_epsilon`` reports what was
        spent (use :class:`opake_compile.DPOptimizer`'s ``budget=`` for a hard stop).

        Other arguments: as :meth:`make_private`. Returns: as :meth:`make_private`.

        Raises:
            ConfigurationError: ``target_delta`` of at least 1/N (N the dataset's size), as
                :class:`opake_compile.DPOptimizer`'s budget refuses it; and as :meth:`make_private`.
        """
        kwargs.pop("epsilon_tolerance", None)
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ConfigurationError(f"Expected epochs >= 1, got {epochs!r}.")
        steps = epochs * len(data_loader)
        q = 1.0 / len(data_loader)
        n = len(data_loader.dataset)
        _check_delta(float(target_delta), n, "target_delta")
        sigma = _calibrated_sigma(float(target_epsilon), float(target_delta), q, n, steps, self._accountant.method)
        return self.make_private(
            module=module,
            optimizer=optimizer,
            criterion=criterion,
            data_loader=data_loader,
            noise_multiplier=sigma,
            max_grad_norm=max_grad_norm,
            **kwargs,
        )

    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: Any = None,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float,
        batch_first: bool = True,
        loss_reduction: str = "mean",
        poisson_sampling: bool = True,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        wrap_model: bool = True,
        rand_on_empty: bool = False,
        key: Any = None,
        physical_batch_size: int | None = None,
        **kwargs: Any,
    ) -> tuple:
        """Opacus's ``make_private``: returns ``(model, optimizer, data_loader)``, and in ghost
        mode ``(model, optimizer, criterion, data_loader)``.

        The model is a :class:`PrivateModule`, the optimizer a :class:`DPOptimizer`, the loader
        a :class:`DPDataLoader` (Poisson, q = 1 / len(data_loader), empty batches included);
        the criterion (ghost mode) is ``criterion`` itself, whose result's ``.backward()`` runs
        the step. Everything that cannot be mapped is refused here, before anything is built.

        Args:
            module, optimizer, data_loader, noise_multiplier, max_grad_norm, criterion: as in
                Opacus (``max_grad_norm`` is C, one float: flat clipping).
            loss_reduction: ``"mean"``: the noised sum is divided by the expected batch size
                q N (as Opacus, which uses ``int(q N)``); ``"sum"``: not divided. The loss must
                use that reduction (checked at every ``loss.backward()``).
            grad_sample_mode: ``"hooks"`` (per-example vector-Jacobian product of the compiled
                model) or ``"ghost"`` (model and criterion compiled together).
            noise_generator: a ``torch.Generator``; four words drawn from it (advancing it) are
                the noise and sampling key, so each call gets its own (default: the next child
                of the engine's ``key``, or OS entropy).
            rand_on_empty: accepted, without effect: empty batches are batches with 0 rows.
            key: (opake_compile) an :mod:`opake_compile.random` key for noise and sampling;
                overrides ``noise_generator``.
            physical_batch_size: (opake_compile) rows per compiled chunk (default from the
                expected batch size; ``BatchMemoryManager`` sets it).

        Raises:
            UnsupportedOperationError: per-layer or adaptive clipping (``clipping`` other than
                ``"flat"``, or a list ``max_grad_norm``), another ``grad_sample_mode`` (custom
                or functorch grad samplers), ``poisson_sampling=False``, ``batch_first=False``,
                ``wrap_model=False``, a distributed module, a module ``ModuleValidator``
                rejects, an unknown keyword.
            ConfigurationError: optimizer parameters that are not the module's, bad values; a
                ``key`` object already given to another ``make_private`` call, engine or
                optimizer (the two runs would add the same noise).
        """
        if kwargs:
            raise _not_mapped(f"make_private keyword(s) {sorted(kwargs)}", "Remove them (see docs/migrating-from-opacus.md for what is mapped).")
        if isinstance(max_grad_norm, (list, tuple)) or clipping == "per_layer":
            raise _not_mapped(
                "per-layer clipping (clipping='per_layer' or a list of max_grad_norm)",
                "Use flat clipping: one max_grad_norm over all parameters together (the default).",
            )
        if clipping != "flat":
            raise _not_mapped(
                f"clipping={clipping!r}",
                "Use clipping='flat'. For a clipping norm that adapts to the data, use "
                "opake_compile.dpsgd.clipping.adaptive_clipped_grad (Andrew et al. 2021), accounted "
                "for by opake_compile.DPOptimizer.",
            )
        if grad_sample_mode not in _MODES:
            raise _not_mapped(
                f"grad_sample_mode={grad_sample_mode!r} (custom or functorch grad samplers)",
                "Use 'hooks' or 'ghost': both run compile_dp, which derives per-example gradients from "
                "the traced graph (ghost norms and book-keeping where they match).",
            )
        if not poisson_sampling:
            raise _not_mapped(
                "poisson_sampling=False (shuffled fixed-size batches accounted as Poisson)",
                "Keep poisson_sampling=True: the accountant's guarantee assumes Poisson subsampling.",
            )
        if not batch_first:
            raise _not_mapped("batch_first=False", "Put the batch in the first dimension of every input (e.g. x.transpose(0, 1)).")
        if not wrap_model:
            raise _not_mapped("wrap_model=False (GradSampleHooks on the original model)", "Use the module make_private returns.")
        if loss_reduction not in ("mean", "sum"):
            raise ConfigurationError(f"Expected loss_reduction in ('mean', 'sum'), got {loss_reduction!r}.")
        if isinstance(module, nn.parallel.DistributedDataParallel) or type(module).__name__ in ("DPDDP", "DifferentiallyPrivateDistributedDataParallel"):
            raise _not_mapped("distributed training (DPDDP/DDP modules)", "Use opake_compile.distributed (sum_gradients) with compile_dp and opake_compile.DPOptimizer.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputTypeError(f"Expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        if not isinstance(data_loader, DataLoader):
            raise InputTypeError(f"Expected a torch.utils.data.DataLoader, got {type(data_loader).__name__}.")
        if isinstance(data_loader, DPDataLoader):
            raise ConfigurationError("This data loader was already returned by make_private; pass the original one.")
        ModuleValidator.validate(module, strict=True)
        params = {id(p) for p in module.parameters()}
        if any(id(p) not in params for g in optimizer.param_groups for p in g["params"]):
            raise ConfigurationError("The optimizer has parameters that are not the module's.")
        owner = getattr(module, "_opake_private_engine", None)
        if owner is not None and owner() not in (None, self):
            # Each engine's accountant would hold only its own steps of one model (review: each
            # reported epsilon 4.206 where the model's 8 steps together cost 5.458).
            raise ConfigurationError(
                "This module was made private by another PrivacyEngine: each engine would account "
                "only its own steps of the same model. Use one PrivacyEngine per model (its "
                "get_epsilon composes every make_private call of that engine)."
            )
        if grad_sample_mode == "ghost":
            if criterion is None:
                criterion = nn.CrossEntropyLoss(reduction=loss_reduction)  # Opacus's default
            reduction = getattr(criterion, "reduction", loss_reduction)
            if reduction != loss_reduction:
                raise ConfigurationError(
                    f"The criterion reduces with reduction={reduction!r} but loss_reduction={loss_reduction!r}: make them agree."
                )
        max_grad_norm = float(max_grad_norm)
        given_key = key  # a key object of the caller's: claimed below, once the optimizer exists
        if key is None:
            if noise_generator is not None:
                # Drawn from the generator (advancing it), as Opacus draws its noise from it: two
                # calls with one generator get different keys (the same keys would add the same
                # noise to both runs, their difference noise-free); one seed still reproduces.
                words = torch.randint(0, 2**32, (4,), generator=noise_generator, dtype=torch.int64)
                key = _random.Key(tuple(int(w) for w in words))
            elif self._key is not None:
                self._key, key = _random.split(self._key, 2)
            else:
                key = _random.random_key()
        sample_key, noise_key, step_key = _random.split(key, 3)
        n = len(data_loader.dataset)
        steps = len(data_loader)
        q = 1.0 / steps
        sampler = PoissonSampler(n, q, key=sample_key, steps=steps)
        session = _Session(
            module=module,
            mode=grad_sample_mode,
            clipping_norm=max_grad_norm,
            loss_reduction=loss_reduction,
            backend=self.backend,
            key=step_key,
            expected_batch_size=q * n,
            physical_batch_size=physical_batch_size,
        )
        inner = optimizer if loss_reduction == "mean" else _RescaledOptimizer(optimizer, q * n)
        dp = _OpakeDPOptimizer(inner, noise_multiplier=noise_multiplier, sampler=sampler, key=noise_key, accountant=self._accountant)
        dp_optimizer = DPOptimizer(optimizer, dp, session, max_grad_norm=max_grad_norm, loss_reduction=loss_reduction)
        session.optimizer = dp_optimizer
        collate = data_loader.collate_fn or default_collate
        loader_kwargs = {
            k: getattr(data_loader, k)
            for k in ("num_workers", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context", "generator", "persistent_workers")
        }
        if data_loader.num_workers > 0:
            loader_kwargs["prefetch_factor"] = data_loader.prefetch_factor
        loader = DPDataLoader(data_loader.dataset, sampler, empty_collate(collate, example=data_loader.dataset[0]), session, **loader_kwargs)
        model = PrivateModule(module, session)
        if given_key is not None:
            # The same key object for two runs (an lr sweep on one dataset) would split into the
            # same sampling and noise keys: refused, as DPOptimizer refuses one key for two.
            # Claimed last, so that a call refused earlier leaves the key free for a retry.
            _claim_key(given_key, dp)
        self._optimizers.append(dp_optimizer)
        module._opake_private_engine = weakref.ref(self)
        if grad_sample_mode == "ghost":
            return model, dp_optimizer, criterion, loader
        return model, dp_optimizer, loader

    def is_compatible(self, *, module: nn.Module, optimizer: Any = None, data_loader: Any = None) -> bool:
        """``ModuleValidator.is_valid(module)``."""
        return ModuleValidator.is_valid(module)

    def validate(self, *, module: nn.Module, optimizer: Any = None, data_loader: Any = None) -> None:
        """``ModuleValidator.validate(module, strict=True)``."""
        ModuleValidator.validate(module, strict=True)
