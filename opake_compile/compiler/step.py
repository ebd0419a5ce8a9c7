"""``compile_dp``: the compiled per-example DP step, tying the three stages together.

trace (:mod:`.trace`) -> passes (:mod:`.passes`) -> lower (:mod:`.lower`), plus what makes
compiled graphs usable with Poisson sampling. Graphs have static shapes, so each physical batch
size P needs its own graph. A logical batch is cut into chunks, each padded to a physical size
with a 0/1 mask (padded rows contribute exactly zero); the chunks' clipped sums are added, and
the optimizer receives one :class:`ClippedPytree` per logical batch.

Physical sizes (see :class:`_SizePlan`): with an explicit ``physical_batch_size`` every chunk
has that one size (one graph). By default the sizes are *buckets* on a geometric grid of ratio
1.05 anchored at the first batch's size n0, compiled lazily when first needed and capped in
number: a chunk of m rows runs at the smallest grid size >= m, so padding is under 5 % of the
work, a batch of exactly n0 rows never pads, and once the cap is reached no further graph is
ever compiled (chunks then run at the nearest compiled size, padding more).

Why buckets rather than a symbolic batch dimension: under ``vmap`` the backward of
``gather``/``cross_entropy``, embedding, layer norm and convolution specialise the batch size,
(measured on torch 2.13: a compiled vmap step recompiles for each new batch size even with
``dynamic=True``), and the rewrite passes read static sizes from ``node.meta['val']``; buckets
keep every graph static and every pass unchanged.

Checks on input values that the traced graph cannot make (a label outside the vocabulary, a
CTC length out of range; see :mod:`opake_compile.compiler._input_checks`) run on the real rows
of every chunk before any chunk's graph runs or the step's key is split: a refused batch raises
a ``ConfigurationError`` and changes nothing.

Privacy of the sizes: which bucket a batch uses is a function of its realised size, which
``ClippedPytree.num_examples`` already returns and documents as *not privatised* (as are the
chunk count and the step's running time, which already depended on it). The released value,
the noisy sum, does not depend on the bucket beyond floating-point rounding: padded rows are
selected away and every path's sensitivity bound holds at every physical size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import inspect
import itertools
import math
import operator
import sys
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np
import optree
import torch
import torch.nn as nn
from torch.nn.modules import module as _torch_module

from opake_compile import random as _random
from opake_compile._markers import reject_dp_output
from opake_compile._statistics import batch_statistics, is_real_number
from opake_compile._validate import check_batch_size, check_clipping_norm, check_positive_int, user_stacklevel
from opake_compile.compiler.lower import CompileCounter, lower
from opake_compile.compiler.passes import PassReport, insert_clipping, run_pipeline
from opake_compile.compiler.passes.memory import split_grouped_weight_grads
from opake_compile.compiler.passes import numerics as _num
from opake_compile.compiler.trace import TracedGraph, check_model_supported, trace_per_example_grads
from opake_compile.dpsgd._types import ClippedPytree
from opake_compile.exceptions import (
    CheckpointError,
    ConfigurationError,
    InputTypeError,
    SoundnessWarning,
    UnsupportedOperationError,
)

__all__ = ["DPStep", "DPStepResult", "compile_dp"]

_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True, eq=False)
class DPStepResult:
    """What one call of a :class:`DPStep` returns.

    Attributes:
        loss: **not privatised.** 0-d tensor: the mean per-example loss over the real examples
            (NaN for an empty batch). For a mean-reduced batch loss this is the batch loss.
        clipped: the :class:`ClippedPytree` (unnormalised sum of clipped per-example gradients
            of the trainable parameters, keyed like ``named_parameters()``), float64 for every
            parameter dtype (compiler/passes/numerics.py, point 3).
        coverage: parameter name -> the path its per-example gradient took
            (``"materialized"`` or a rewrite rule such as ``"ghost:linear"``).
    """

    loss: torch.Tensor
    clipped: ClippedPytree
    coverage: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class _Feed:
    """How :meth:`DPStep._run` feeds a graph, worked out once from its layout: the trainable
    names, the other parameters and buffers as ``(is_parameter, name)``, the kinds of the
    argument leaves (all of them, and the tensor ones), whether every leaf is a tensor, and the
    number of batch draws."""

    trainable: tuple[str, ...]
    others: tuple[tuple[bool, str], ...]
    leaf_kinds: tuple[str, ...]
    kinds: tuple[str, ...]
    tensors_only: bool
    batch_draws: int

    @classmethod
    def of(cls, layout: Any) -> "_Feed":
        others = tuple((kind == "param", name) for kind, name in (key.split(":", 1) for key in layout.others))
        kinds = tuple(k for k in layout.leaf_kinds if k != "const")
        return cls(layout.trainable, others, layout.leaf_kinds, kinds, len(kinds) == len(layout.leaf_kinds), layout.batch_draws)


@dataclasses.dataclass
class _Compiled:
    traced: TracedGraph
    reports: list[PassReport]
    coverage: dict[str, str]
    fn: Callable[..., Any]
    methods: dict[str, str] = dataclasses.field(default_factory=dict)  # see _check_same_methods
    identity: tuple = ()  # _graph_identity of the graph ``fn`` was lowered from
    feed: _Feed = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.feed = _Feed.of(self.traced.layout)


def _graph_identity(gm: torch.fx.GraphModule) -> tuple:
    """What lowering a graph depends on, but for its tensor constants: its Python code (every
    op, argument and literal), each input's shape, strides, dtype and device, and the
    matrix-product precision settings a backend may compile in (the graph's norm bounds assume
    the precision it was traced under)."""
    inputs = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            v = n.meta.get("val")
            inputs.append((tuple(v.shape), v.stride(), v.dtype, v.device) if isinstance(v, torch.Tensor) else repr(v))
    return gm.code, tuple(inputs), _precision_settings()


def _precision_settings() -> tuple:
    """The float32 matrix-product precision settings, read without raising: torch refuses to
    read the global or the legacy ones when legacy and per-backend settings were mixed, so
    those read as ``"mixed"``, and the per-backend ones are read as well."""

    def read(get: Callable[[], Any]) -> Any:
        try:
            return get()
        except RuntimeError:
            return "mixed"

    return (
        read(torch.get_float32_matmul_precision),
        read(lambda: torch.backends.cuda.matmul.allow_tf32),
        read(lambda: torch.backends.cudnn.allow_tf32),
        read(lambda: torch.backends.cuda.matmul.fp32_precision),
        read(lambda: torch.backends.mkldnn.matmul.fp32_precision),
        read(lambda: torch.backends.cudnn.conv.fp32_precision),
        _num.float32_matmul_is_ieee(),
    )


def _autocast_state() -> tuple:
    """Whether ``torch.autocast`` is on for the CPU and CUDA, and its dtype there: a trace bakes
    the casts in."""
    return (
        torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
    )


def _same_constants(a: torch.fx.GraphModule, b: torch.fx.GraphModule) -> bool:
    """Whether two graphs of the same code read equal non-tensor attributes and no tensor
    constant. A tensor constant is the tensor the model or the loss held at the trace (a plain
    tensor attribute, a closure variable), read by the lowered callable as it is then or copied
    in at lowering: a callable lowered for one such tensor would not follow a new tensor of equal
    values changed in place later (a hostile review: loss 2.41 against 0.72 from a new step),
    so a graph with one is always lowered anew."""
    for n in a.graph.nodes:
        if n.op != "get_attr":
            continue
        x, y = operator.attrgetter(n.target)(a), operator.attrgetter(n.target)(b)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or not (type(x) is type(y) and x == y):
            return False
    return True


def _default_physical_batch_size(n: int) -> int:
    # Room for Poisson fluctuation (about 3 standard deviations of Binomial(N, q) ~ sqrt(n)),
    # rounded up to a multiple of 8.
    return max(8, int(math.ceil((n + 3 * math.sqrt(n)) / 8.0)) * 8)


#: Padding bound of the default buckets: a chunk of m rows runs at a size <= BUCKET_RATIO * m.
BUCKET_RATIO = 1.05
#: Default cap on the number of physical sizes one step compiles (``max_physical_sizes``).
DEFAULT_MAX_PHYSICAL_SIZES = 24


class _SizePlan:
    """Which physical size each chunk of a logical batch runs at.

    ``fixed`` (an explicit ``physical_batch_size`` P): chunks of P rows, the last one padded.
    Otherwise buckets anchored at ``anchor`` (the first non-empty batch size n0): the grid holds
    n0, and above it ``g -> min(floor(r (g + 1)), max_rows)``, below it
    ``g -> ceil(g / r) - 1`` (r = :data:`BUCKET_RATIO`), so a chunk of m rows is padded to the
    smallest grid point g >= m with ``g <= r m``. Chunks hold at most ``max_rows``
    (n0 + 3 sqrt(n0) rounded up to 8: the old single size, which bounds memory), and never
    more than ``numerics.MAX_FLOAT32_SUM_ROWS`` (the anchor is capped the same way). Sizes are
    compiled lazily; once ``max_sizes`` sizes are in use, a chunk takes the smallest size in use
    that holds it (or the largest, and the rest goes to further chunks), so the number of
    graphs never exceeds the cap. Plans are memoised per batch size (Python work per call).
    """

    def __init__(self, fixed: int | None, max_sizes: int) -> None:
        self.fixed = fixed
        self.max_sizes = max_sizes
        self.anchor: int | None = None
        self.max_rows: int | None = fixed
        self.sizes: set[int] = set() if fixed is None else {fixed}
        self._grid: dict[int, int] = {}
        self._plans: dict[int, tuple[tuple[int, int], ...]] = {}

    def undo_point(self) -> tuple[int | None, int | None, int, int]:
        return (self.anchor, self.max_rows, len(self.sizes), len(self._plans))

    def undo(self, point: tuple[int | None, int | None, int, int]) -> None:
        """Forget what was planned after ``point`` (a failed call's sizes and anchor)."""
        anchor, max_rows, n_sizes, n_plans = point
        if len(self.sizes) == n_sizes and len(self._plans) == n_plans and self.anchor == anchor:
            return
        self.anchor, self.max_rows = anchor, max_rows
        if anchor is None:
            self._grid.clear()
        keep = list(self._plans.items())[:n_plans]
        self._plans = dict(keep)
        self.sizes = {p for _, chunks in keep for _, p in chunks} | ({self.fixed} if self.fixed else set())

    def set_anchor(self, n: int) -> None:
        if self.fixed is None and self.anchor is None:
            self.anchor = min(n, _num.MAX_FLOAT32_SUM_ROWS)
            self.max_rows = min(_default_physical_batch_size(n), _num.MAX_FLOAT32_SUM_ROWS)

    def grid_point(self, m: int) -> int:
        """The smallest grid size >= ``m`` (1 <= m <= max_rows)."""
        g = self._grid.get(m)
        if g is not None:
            return g
        if not 1 <= m <= self.max_rows:
            raise ValueError(f"grid_point needs 1 <= m <= {self.max_rows}, got {m}")  # internal: plan() never asks
        g = self.anchor
        if m > g:
            while g < m:
                g = min(int(math.floor(BUCKET_RATIO * (g + 1))), self.max_rows)
        else:
            while True:
                lower = int(math.ceil(g / BUCKET_RATIO)) - 1
                if lower < m:
                    break
                g = lower
        self._grid[m] = g
        return g

    def _size_for(self, m: int) -> int:
        if m in self.sizes:
            return m
        g = self.grid_point(m)
        if g in self.sizes or len(self.sizes) < self.max_sizes:
            return g
        holding = [s for s in self.sizes if s >= m]
        return min(holding) if holding else max(self.sizes)

    def planned(self, n: int) -> tuple[tuple[int, int], ...] | None:
        """The plan made earlier for ``n`` rows, or None (nothing is registered)."""
        return self._plans.get(n)

    def plan(self, n: int) -> tuple[tuple[int, int], ...]:
        """``((rows, physical size), ...)`` for a batch of ``n >= 1`` rows; registers the sizes."""
        hit = self._plans.get(n)
        if hit is not None:
            return hit
        if self.fixed is not None:
            p = self.fixed
            out = tuple((min(p, n - s), p) for s in range(0, n, p))
        else:
            chunks, rest = [], n
            while rest > 0:
                size = self._size_for(min(rest, self.max_rows))
                m = min(rest, size)
                chunks.append((m, size))
                rest -= m
            out = tuple(chunks)
        self.sizes.update(p for _, p in out)
        self._plans[n] = out
        return out


class DPStep:
    """A compiled DP-SGD gradient step. Build it with :func:`compile_dp`.

    Call it with the positional arguments of the loss, without the model:
    ``step(*args) -> DPStepResult``.
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        *,
        model: nn.Module,
        clipping_norm: Any,
        batch_argnums: Sequence[int] | int | None,
        physical_batch_size: int | None,
        backend: str | Callable[..., Any] | None,
        key: Any,
        rewrites: Sequence[Callable[..., PassReport]] | None,
        max_physical_sizes: int = DEFAULT_MAX_PHYSICAL_SIZES,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise InputTypeError(f"Expected model to be a torch.nn.Module, got {type(model).__name__}.")
        if not callable(loss_fn):
            raise InputTypeError(f"Expected loss_fn to be callable, got {type(loss_fn).__name__}.")
        check_model_supported(model)  # again at every trace: modes can change in between
        self._loss_fn = loss_fn
        self.model = model
        self._clipping_norm = check_clipping_norm(clipping_norm)
        if batch_argnums is not None:
            batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
            if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in batch_argnums):
                raise InputTypeError(f"Expected batch_argnums to be non-negative ints, got {batch_argnums!r}.")
            most = _max_batch_args(loss_fn)
            if most is not None and max(batch_argnums, default=-1) >= most:
                raise ConfigurationError(
                    f"batch_argnums={batch_argnums!r} names argument(s) loss_fn does not take: it takes "
                    f"{most} after the model (loss_fn(model, *args); batch_argnums counts from the first "
                    "argument after the model)."
                )
        self._batch_argnums: tuple[int, ...] | None = batch_argnums
        fixed = None if physical_batch_size is None else check_positive_int(physical_batch_size, name="physical_batch_size")
        if fixed is not None:
            # One graph sums at most MAX_FLOAT32_SUM_ROWS rows (numerical contract): a larger
            # physical batch runs as chunks of that size, their sums added in float64.
            if fixed > _num.MAX_FLOAT32_SUM_ROWS:
                warnings.warn(
                    f"physical_batch_size={fixed} is above the {_num.MAX_FLOAT32_SUM_ROWS} rows one graph "
                    f"may sum (a float32 sum of more examples rounds past the clipping slack): batches "
                    f"run in chunks of {_num.MAX_FLOAT32_SUM_ROWS}, their sums added in float64.",
                    stacklevel=3,
                )
            fixed = min(fixed, _num.MAX_FLOAT32_SUM_ROWS)
        self._plan = _SizePlan(fixed, check_positive_int(max_physical_sizes, name="max_physical_sizes"))
        self.backend = backend
        self._key = _random.random_key() if key is None else _random._check_key(key)
        self._rewrites = list(rewrites) if rewrites is not None else _default_rewrites()
        self._cache: dict[Any, _Compiled] = {}
        self._constants: dict[Any, torch.Tensor] = {}
        self._flat_treedefs: dict[int, Any] = {}  # tuples of n tensors (_signature)
        self._view: _ModelView | None = None  # the last reading of the model (_read_model)
        self._programs = _Programs(_LossReader(loss_fn))  # the programs graphs were traced under (_program)
        self._repeat: _Repeat | None = None  # what a call like the last one reuses (_call_again)
        self._scalars = _ScalarWatch()  # unbatched numbers that follow a count of the batch
        # Numbers the trace bakes in (_program_numbers): those of the last view read, each one's
        # first value, and those that changed since (watched against the batch's counts).
        self._numbers: tuple[Any, list[tuple[tuple, float]]] = (None, [])
        self._first_numbers: dict[tuple, float] = {}
        self._watched: set[tuple] = set()
        self._warned_zero = False  # (_warn_if_every_gradient_vanishes)
        self._counter = CompileCounter(backend) if backend is not None else None
        self.num_traces = 0
        self._num_calls = 0

    # ------------------------------------------------------------------ public
    @property
    def clipping_norm(self) -> float:
        """C, fixed for the life of the step (read-only: the graph and the reported C must
        never disagree, or noise would be calibrated to the wrong sensitivity)."""
        return self._clipping_norm

    @property
    def loss_fn(self) -> Callable[..., Any]:
        """The loss the graphs were traced from (read-only: a cached graph would go on
        computing the old one)."""
        return self._loss_fn

    @property
    def batch_argnums(self) -> tuple[int, ...] | None:
        """Which positional arguments are batched (None: all of them). Read-only: the graphs
        and the public-input checks were built for this split."""
        return self._batch_argnums

    @property
    def physical_batch_size(self) -> int | None:
        """The most rows one chunk holds: the explicit ``physical_batch_size``, or by default
        n0 + 3 sqrt(n0) rounded up to 8 for the first non-empty batch size n0 (None before it).
        **Not privatised** by default: n0 is a Poisson draw's realised size, which one example's
        presence moves; do not publish it (nor :attr:`physical_sizes`, :meth:`describe`)."""
        return self._plan.max_rows

    @property
    def physical_sizes(self) -> tuple[int, ...]:
        """The physical batch sizes in use so far, ascending (each is one compiled graph per
        input signature). At most ``max_physical_sizes`` by default, one with an explicit
        ``physical_batch_size``. **Not privatised** by default: the sizes follow the realised
        batch sizes, statistics of the data."""
        return tuple(sorted(self._plan.sizes))

    def plan(self, n: int) -> tuple[tuple[int, int], ...]:
        """``((rows, physical size), ...)``: how a batch of ``n`` rows would be cut and padded
        now (``()`` for ``n = 0``). Planning registers the sizes it uses, so call it only with
        sizes the step will see; :meth:`__call__` plans the same way. Padded rows in a step:
        ``sum(p - m for m, p in step.plan(n))``."""
        if n == 0:
            return ()
        n = check_positive_int(n, name="n")
        self._plan.set_anchor(n)
        return self._plan.plan(n)

    @property
    def num_backend_compiles(self) -> int:
        """How many graphs the backend compiled for this step (recompiles included)."""
        return 0 if self._counter is None else self._counter.count

    def __call__(self, *args: Any, **kwargs: Any) -> DPStepResult:
        if self._batch_argnums is not None and len(args) > len(self._batch_argnums):
            self._scalars.check(args, self._batch_argnums)  # before anything runs or changes
        repeat = self._repeat
        if repeat is not None and not kwargs:
            result = self._call_again(repeat, args)
            if result is not None:
                return result
        return self._call(args, kwargs)

    def _call_again(self, repeat: _Repeat, args: tuple) -> DPStepResult | None:
        """A call like the last general one (:meth:`_call`), without its general work: the
        same argument signature (positional tensors of the same dtypes, devices and shapes
        beyond the batch dimension), the same model reading (:class:`_ModelView`), the same
        matrix-product precision, a batch size planned before and graphs built for its
        sizes. Anything else, every error included, returns None and takes the general path,
        which decides as it always did: this path only skips work whose result it knows."""
        if len(args) != repeat.nargs:
            return None
        n = None
        for a, batched in zip(args, repeat.flags):
            if type(a) is not torch.Tensor:
                return None
            if batched:
                if a.dim() == 0 or (n is not None and a.shape[0] != n):
                    return None
                n = a.shape[0]
        if not n or _tensor_parts(args, repeat.batched) != repeat.parts:
            return None
        _num.check_gradual_underflow()
        view = self._read_model()
        if view is not repeat.view or _num.float32_matmul_is_ieee() != repeat.ieee or _autocast_state() != repeat.autocast:
            return None
        if self._watched:
            self._watch_numbers(view, args, repeat.batched)
        chunks = self._plan.planned(n)
        if chunks is None:
            return None
        graphs = repeat.graphs
        if any(p not in graphs for _, p in chunks):
            return None
        key = self._key
        try:
            result = self._run(graphs, chunks, args, repeat.batched, n, view.params, view.buffers)
        except BaseException:
            self._key = key  # a step that raised spent no draws
            raise
        self._num_calls += 1
        return result

    def _call(self, args: tuple, kwargs: dict[str, Any]) -> DPStepResult:
        """The general call: every check, the signature, planning, tracing and lowering on a miss."""
        if kwargs:
            raise InputTypeError(
                f"DPStep takes the loss's positional arguments only; got keyword(s) {sorted(kwargs)}. "
                "Pass them positionally (batched ones as named by batch_argnums)."
            )
        for i, a in enumerate(args):
            reject_dp_output(a, where=f"argument {i}")
        batched = self._batched_positions(len(args))
        n = check_batch_size(args, batched)
        _num.check_gradual_underflow()
        view = self._read_model()
        self._watch_numbers(view, args, batched)  # before anything runs or changes
        params, buffers, trainable = view.params, view.buffers, view.trainable
        if not trainable:
            raise InputTypeError("The model has no trainable parameter (requires_grad=True): nothing to privatise.")
        if n == 0:
            self._num_calls += 1
            return self._empty_result(params, trainable)
        base = self._signature(args, batched, view)
        undo, key, traces = self._plan.undo_point(), self._key, self.num_traces
        try:
            self._plan.set_anchor(n)
            chunks = self._plan.plan(n)
            graphs = {p: self._get_compiled((base, p), args, batched, p) for _, p in chunks}
            result = self._run(graphs, chunks, args, batched, n, params, buffers)  # lowers on first use
        except BaseException:
            self._plan.undo(undo)  # a batch that cannot be traced or compiled leaves no size behind
            self._key = key  # nor spent draws: a step that raised returned nothing
            raise
        if self.num_traces != traces:
            # A module that writes an attribute in its forward wrote it while tracing.
            self._programs.left_by_trace(view.program, _program(view.modules, self._programs.loss))
        self._num_calls += 1
        if self._num_calls <= 3 and not self._warned_zero:
            self._warn_if_every_gradient_vanishes(result)
        if self._num_calls <= 3 and 0 < result.clipped.num_examples == result.clipped.num_nonfinite:
            warnings.warn(
                f"Every example's gradient was non-finite or beyond the magnitude its norm can be computed at "
                f"at this call ({result.clipped.num_examples} examples, all dropped and counted in "
                "clipped.num_nonfinite): the sum is zero, so the step would add noise alone. A loss that is "
                "NaN for a batch of one (a standard deviation or a normalisation over the batch: compile_dp "
                "evaluates each example as a batch of one), a log of zero, or a diverged model does this.",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        if all(type(a) is torch.Tensor for a in args):
            self._repeat = _Repeat(
                nargs=len(args),
                batched=batched,
                flags=tuple(i in batched for i in range(len(args))),
                parts=base[1],
                view=view,
                ieee=base[-1],
                autocast=base[-2],
                graphs={p: c for (b, p), c in self._cache.items() if b == base},
            )
        return result

    @property
    def num_calls(self) -> int:
        """How many calls returned a result (empty batches included)."""
        return self._num_calls

    def _warn_if_every_gradient_vanishes(self, result: DPStepResult) -> None:
        """Warn (once, on one of the first calls) when every example's gradient norm is below
        1e-12: the mark of a loss that mixes examples (logits centred over the batch, in-batch
        contrastive pairs), which per example, traced as a batch of one, is a constant. It
        trained to nothing without a word (a newcomer's review: norms at most 7.8e-22 and
        6.1e-22); the Opacus layer refuses such losses."""
        norms = result.clipped.per_example_norms
        finite = norms[torch.isfinite(norms)]
        if finite.numel() >= 2 and float(finite.max()) <= 1e-12:
            self._warned_zero = True
            warnings.warn(
                f"Every example's gradient norm is below 1e-12 at this call ({finite.numel()} examples): "
                "a loss that mixes the examples of a batch (centring or normalising over the batch, "
                "in-batch contrastive pairs) is traced per example as a batch of one, where it is "
                "usually a constant, so nothing trains. Write the loss so that each example's value "
                "depends on that example alone (README: what compile_dp does not detect).",
                UserWarning,
                stacklevel=user_stacklevel(),
            )

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The step's random key (it draws the dropout masks of the loss), its call count and
        the clipping norm it was built with (checked on load). Plain Python values; the
        compiled graphs are not state (they are rebuilt on the first call).

        Example::

            >>> sd = step.state_dict()                       # doctest: +SKIP
            >>> fresh.load_state_dict(sd)                    # doctest: +SKIP
        """
        return {
            "version": _STATE_VERSION,
            "key": _random.key_to_state(self._key),
            "num_calls": self._num_calls,
            "clipping_norm": self._clipping_norm,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`: the next call draws the randomness the saved step's next
        call would have drawn.

        Raises:
            CheckpointError: missing fields, another version, an invalid key or count, or a
                different clipping norm. Nothing changes then.
        """
        required = ("version", "key", "num_calls", "clipping_norm")
        if not isinstance(state, Mapping) or any(k not in state for k in required):
            have = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise CheckpointError(f"DPStep state needs {list(required)}, got {have}.")
        if state["version"] != _STATE_VERSION:
            raise CheckpointError(f"DPStep state version {state['version']!r} is not {_STATE_VERSION}.")
        if state["clipping_norm"] != self._clipping_norm:
            raise CheckpointError(
                f"DPStep state has clipping_norm={state['clipping_norm']!r}, this step "
                f"{self._clipping_norm!r}: build the step with the saved clipping norm."
            )
        try:
            key = _random.key_from_state(state["key"])
        except InputTypeError as err:
            raise CheckpointError(f"Invalid key in DPStep state: {err}") from err
        calls = state["num_calls"]
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
            raise CheckpointError(f"Invalid num_calls {calls!r} in DPStep state.")
        self._key = key
        self._num_calls = calls

    def __repr__(self) -> str:
        name = getattr(self.loss_fn, "__qualname__", None) or type(self.loss_fn).__name__
        return (
            f"DPStep(loss_fn={name}, clipping_norm={self.clipping_norm}, physical_batch_size="
            f"{self.physical_batch_size}, backend={self.backend!r}, calls={self.num_calls}, traces={self.num_traces})"
        )

    def describe(self) -> str:
        """Which path each trainable parameter took, and what each pass did, as text.

        **Not privatised** where batch sizes vary: the physical sizes it lists (and the step's
        ``repr``) follow the realised sizes of Poisson batches; keep it out of what you publish.
        """
        lines = [
            f"DPStep(clipping_norm={self.clipping_norm}, physical_batch_size={self.physical_batch_size}, "
            f"physical_sizes={list(self.physical_sizes)}, backend={self.backend!r})"
        ]
        if not self._cache:
            lines.append("  not traced yet: call the step once.")
        shown: dict[Any, int] = {}
        for i, (sig, c) in enumerate(self._cache.items()):
            notes = {k: v for r in c.reports for k, v in r.notes.items()}
            same = (tuple(c.coverage.items()), tuple(notes.items()), tuple((r.name, tuple(r.matches.items())) for r in c.reports))
            if same in shown:  # one table per distinct plan (bucket sizes repeat it)
                lines.append(f"  graph {i} (P={sig[1]}): the paths of graph {shown[same]}")
                continue
            shown[same] = i
            lines.append(f"  graph {i} (P={sig[1]}):")
            width = max(len(k) for k in c.coverage)
            for name, path in c.coverage.items():
                why = f" ({notes[name]})" if name in notes and path == "materialized" else ""
                lines.append(f"    {name:<{width}}  {path}{why}")
                if name in notes and path != "materialized" and path.startswith(("materialized", "direct:")):
                    lines.append(f"    {'':<{width}}    {notes[name]}")  # the cost model's numbers
                if any("/per-example sum" in r.methods.get(name, "") for r in c.reports):
                    lines.append(f"    {'':<{width}}    sum: a float32 product per example, added in float64")
            for r in c.reports:
                matched = ", ".join(f"{k}={v}" for k, v in r.matches.items()) or "no match"
                lines.append(f"    pass {r.name}: {matched}")
        return "\n".join(lines)

    def explain(self, *, file: Any = None) -> None:
        """Print :meth:`describe` (to ``file``, default stdout); not privatised, as it is."""
        print(self.describe(), file=file)

    @property
    def coverage(self) -> dict[str, str]:
        """Parameter name -> path, for the most recently built graph ({} before the first call)."""
        if not self._cache:
            return {}
        return dict(list(self._cache.values())[-1].coverage)

    # ----------------------------------------------------------------- private
    def _compiled_for(self, args: tuple) -> _Compiled | None:
        """The graph a call with ``args`` runs, if it was built (None otherwise)."""
        if not self._cache or self.physical_batch_size is None:
            return None
        batched = self._batched_positions(len(args))
        n = check_batch_size(args, batched)
        if n == 0:
            return None
        base = self._signature(args, batched, self._read_model())
        return self._cache.get((base, self._plan.plan(n)[0][1]))

    def _watch_numbers(self, view: _ModelView, args: tuple, batched: tuple[int, ...]) -> None:
        """Refuse a number the trace bakes in (a global, closure variable or
        ``functools.partial`` argument of the loss, a module attribute) that tracks a count of
        the batch, as :class:`_ScalarWatch` refuses such arguments. ``loss / N`` with a global
        ``N = len(batch)`` traced again at each new value, and removing one example moved the
        clipped sum by 1.63 C (review). Only numbers that have changed since the step first saw
        them are watched (a constant never follows a count; reading the counts costs a pass
        over the batch), so such a number is refused from its third count after its first
        change. Read again when the view is (the model's or the loss's Python changed)."""
        last_view, numbers = self._numbers
        if view is not last_view:
            numbers = _program_numbers(view, self._programs.loss)
            self._numbers = (view, numbers)
        first, watched, scalars = self._first_numbers, self._watched, self._scalars
        extra = []
        for path, v in numbers:
            was = first.setdefault(path, v)
            if (path in watched or was != v) and not scalars.follows_no_count(path):
                watched.add(path)
                extra.append((path, v))
        if extra:
            self._scalars.check(args, batched, extra, functools.partial(self._describe_number, view))

    def _describe_number(self, view: _ModelView, path: tuple) -> str:
        entry = "" if len(path) == 3 else f" (entry {path[3]})"
        if path[0] == "module":
            module = view.modules[path[1]]
            name = next((n for n, m in self.model.named_modules() if m is module), "?") or "the model"
            return f"Attribute {path[2]!r} of module {name!r} ({type(module).__name__}){entry}"
        if path[0] == "partial":
            return f"Argument {path[2]} of the loss's functools.partial (layer {path[1]}){entry}"
        fn = self._programs.loss.functions[path[1]]
        kind = "Closure variable" if path[0] == "closure" else "Global"
        return f"{kind} {path[2]!r} of the loss {fn.__qualname__!r}{entry}"

    def _batched_positions(self, nargs: int) -> tuple[int, ...]:
        if self.batch_argnums is None:
            return tuple(range(nargs))
        bad = [i for i in self.batch_argnums if i >= nargs]
        if bad:
            raise ConfigurationError(f"batch_argnums names argument(s) {bad}, but the step got {nargs} argument(s).")
        return self.batch_argnums

    def _read_model(self) -> _ModelView:
        """The model's parameters, buffers, modes and trainable names, read again only when
        the tree changed since the last call (:class:`_ModelView`)."""
        view = self._view
        if view is None or not view.still_holds(self.model, self._programs.loss):
            view = self._view = _ModelView.read(self.model, self._programs)
        return view

    def _signature(self, args: tuple, batched: tuple[int, ...], view: _ModelView) -> Any:
        if all(type(a) is torch.Tensor for a in args):
            # Fast path, the common call: positional tensors only (the same key as below).
            treedef = self._flat_treedefs.get(len(args))
            if treedef is None:
                treedef = self._flat_treedefs[len(args)] = optree.tree_structure(args, none_is_leaf=True)
            parts = _tensor_parts(args, batched)
        else:
            paths, leaves, treedef = optree.tree_flatten_with_path(args, none_is_leaf=True)
            parts = []
            for path, leaf in zip(paths, leaves):
                if isinstance(leaf, torch.Tensor):
                    dims = tuple(leaf.shape[1:]) if path[0] in batched else tuple(leaf.shape)
                    parts.append((path[0] in batched, leaf.dtype, dims, leaf.device.type))
                else:
                    try:
                        hash(leaf)
                        parts.append(("const", leaf))
                    except TypeError:
                        parts.append(("const", repr(leaf)))
        model_state, device, modes, program = view.signature  # parameter dtypes and shapes, the model's device
        # The rewrites size float32 rounding bounds (Gram matrices, the mixed path's product) to
        # the matrix-product precision in force when they trace: a graph traced under IEEE
        # float32 must not run once TF32 or bfloat16 passes are allowed (an example's
        # contribution reached 1.007 C that way), so a changed setting traces again.
        # So does torch.autocast around the call: a graph traced under it has its casts built in
        # (a step first called under bfloat16 autocast ran bfloat16 products outside it: review).
        return (treedef, tuple(parts), view.trainable, model_state, device, modes, program, _autocast_state(),
                _num.float32_matmul_is_ieee())

    def _get_compiled(self, sig: Any, args: tuple, batched: tuple[int, ...], p: int) -> _Compiled:
        """The graph for signature ``sig`` (see :meth:`_signature`), traced and lowered on a miss."""
        hit = self._cache.get(sig)
        if hit is not None:
            return hit
        self._check_public_inputs(sig)
        example = _pad_args(args, batched, 0, min(p, check_batch_size(args, batched)), p)
        traced = trace_per_example_grads(
            self.model, self.loss_fn, example, batched_positions=batched, physical_batch_size=p
        )
        self.num_traces += 1
        layout = traced.layout
        clip_input = len(layout.trainable) + len(layout.others)
        # The batched inputs (and the mask) grow with P: the rewrites size their memory budget
        # by what is computed from them, so that their choices do not depend on P.
        placeholders = [n for n in traced.gm.graph.nodes if n.op == "placeholder"]
        leaves = placeholders[clip_input + 2 :]
        kinds = [k for k in layout.leaf_kinds if k != "const"]
        traced.gm.meta["opake_batched_inputs"] = {placeholders[clip_input + 1].name} | {
            n.name for n, k in zip(leaves, kinds) if k == "batched"
        }
        passes = [lambda gm: insert_clipping(gm, param_names=layout.trainable, clip_input=clip_input)]
        passes += self._rewrites
        passes.append(split_grouped_weight_grads)  # same values, smaller peak memory
        reports = run_pipeline(traced.gm, passes)
        coverage: dict[str, str] = {}
        for r in reports:
            coverage.update(r.coverage)
        methods = dict(coverage)
        for r in reports:
            methods.update(getattr(r, "methods", {}))
        self._check_same_methods(sig, methods)
        # A graph traced again to the same code, without tensor constants (transformers' output-capturing
        # hooks, installed by the first forward, change the model's program but not its graph)
        # runs the callable already lowered from it: no second backend compile.
        identity = _graph_identity(traced.gm)
        fn = next((c.fn for c in self._cache.values()
                   if c.identity == identity and _same_constants(c.traced.gm, traced.gm)), None)
        if fn is None:
            fn = lower(traced.gm, self.backend, self._counter)
        compiled = _Compiled(traced=traced, reports=reports, coverage=coverage, fn=fn, methods=methods, identity=identity)
        self._cache[sig] = compiled
        return compiled

    def _check_public_inputs(self, sig: Any) -> None:
        """Refuse a call whose arguments differ from an earlier call's in anything but the
        number of rows: their pytree structure, which leaves are tensors, and each tensor's
        dtype, device, dimensions beyond the batch dimension (batched) or shape (unbatched).
        (Constants may change, for a public schedule: their values, like unbatched tensors'
        values, are the caller's to keep public.)

        Those are the step's public inputs. Were one of them a statistic of the batch (each
        batch padded to its longest sequence, split into as many fixed-length segments as its
        longest example needs, or stored as int64 when no example needed a fraction), one
        example would set it for all the others, and every example's norm bound depends on it:
        the form of the norm (Gram form, direct sum, mixed), its rounding bound (centred or
        not, over K positions), the underflow guard's threshold. Hostile reviews moved the sum
        by 5.7 C to 28 C, and 19.3 C and 19.6 C, that way. (Another model state, mode, model
        device or matrix-product precision is the user's setting and traces anew.)
        """
        settings, public = _user_settings(sig), _public_inputs(sig)
        for other_sig in self._cache:
            if _user_settings(other_sig) != settings:
                continue
            then = _public_inputs(other_sig)
            if then == public:
                return  # every graph of a group shares its public inputs (checked when it was built)
            raise UnsupportedOperationError(
                _public_difference(public, then)
                + " A step's inputs other than the batch rows are public: give every call the same "
                "structure, dtypes and devices, and pad every batch to one fixed length chosen without "
                "looking at the data (a length, segment count or dtype set by the batch's examples makes "
                "every example's norm bound depend on another example). For a public change (a later "
                "training phase at another length), build another step with compile_dp. Nothing was "
                "computed or spent."
            )

    def _check_same_methods(self, sig: Any, methods: dict[str, str]) -> None:
        """Refuse a graph whose norm form differs, for a parameter, from the step's other graphs.

        The forms bound an example's norm differently on cancelling data (the Gram form's
        rounding bound, float32 or float64, the mixed product, the exact norm of a formed
        gradient): if the batch decided the form (its size picking the physical size, or its
        longest sequence the length), removing one example would change every other example's
        clip factor, and the sum could move by much more than C (a hostile review: 19.6 C when
        the longest example set the padded length). Every graph of one step must therefore form
        each parameter's norm the same way. (Graphs for another model state, mode, model device
        or matrix-product precision are not compared: those are the user's settings, not the
        batch's.)
        """
        settings = _user_settings(sig)
        for other_sig, other in self._cache.items():
            if _user_settings(other_sig) != settings:
                continue  # the user's settings changed, not the batch
            for name, method in methods.items():
                was = other.methods.get(name)
                if was is not None and was != method:
                    raise UnsupportedOperationError(
                        f"Parameter {name!r} would take another norm form at this input shape "
                        f"({method!r}) than at an earlier one ({was!r}). An example's clip factor may "
                        "not depend on the batch it came in (its size or its longest sequence), or one "
                        "example could move the others' contributions: pad batched inputs to one fixed, "
                        "public length, or fix the path with GhostClipping(force={...}). Nothing was "
                        "computed or spent."
                    )

    def _run(
        self,
        graphs: dict[int, _Compiled],
        chunks: tuple[tuple[int, int], ...],
        args: tuple,
        batched: tuple[int, ...],
        n: int,
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
    ) -> DPStepResult:
        first = graphs[chunks[0][1]]
        feed = first.feed  # parameter partition and argument layout: the same in every graph
        if n > _num.MAX_FLOAT32_SUM_ROWS:  # several chunks: the worst case of their float64 sums (numerics)
            _num.check_float32_rows(n, [params[k].dtype for k in feed.trainable], "compile_dp")
        state = [params[k].detach() for k in feed.trainable]
        for is_param, name in feed.others:
            state.append((params if is_param else buffers)[name].detach())
        device = state[0].device
        clip = self._constant(("clip", device, self._clipping_norm), lambda: torch.tensor(self.clipping_norm, dtype=torch.float64, device=device))
        if feed.tensors_only and all(type(a) is torch.Tensor for a in args):
            flat = args
        else:
            every = optree.tree_leaves(args, none_is_leaf=True)
            flat = [l for l, k in zip(every, feed.leaf_kinds) if k != "const"]
        kinds = feed.kinds

        def chunk(m: int, p: int, start: int) -> Sequence[torch.Tensor]:
            # Every tensor reaches the graph contiguous, as it was traced (_pad_args): the
            # backend compiles for the traced strides (a transposed unbatched argument failed
            # in Inductor's stride check).
            if m == n == p:  # a batch of exactly P rows is its own single chunk: no slicing, no padding
                if all(x.is_contiguous() for x in flat):
                    return flat
                return [x.contiguous() for x in flat]
            return [self._rows(i, x, start, m, p) if k == "batched" else x.contiguous() for i, (x, k) in enumerate(zip(flat, kinds))]

        # Checks on real values that the graph cannot make (e.g. labels within the vocabulary,
        # compiler/_input_checks.py): every chunk passes before any graph runs or key is split.
        ready: list[Sequence[torch.Tensor] | None] = []  # each chunk's padded leaves, if the checks made them
        start = 0
        for m, p in chunks:
            checks = graphs[p].traced.input_checks
            leaves = chunk(m, p, start) if checks else None
            for check in checks:
                message = check.run(leaves, m, start)
                if message is not None:
                    raise ConfigurationError(f"{message} The batch was refused before the step ran: nothing changed.")
            # One chunk's leaves are kept for its run (one copy, not two); several chunks'
            # are made again, one at a time, so that their copies are not all held at once.
            ready.append(leaves if len(chunks) == 1 else None)
            start += m
        draws = self._batch_draws(feed.batch_draws, device)
        start, sums, outs = 0, None, []
        for (m, p), leaves in zip(chunks, ready):
            compiled = graphs[p]
            if leaves is None:
                leaves = chunk(m, p, start)
            start += m
            mask = self._constant(("mask", device, p, m), lambda: torch.arange(p, device=device) < m)
            grad_was = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)  # torch.no_grad(), without its Python objects
            try:
                with self._rng_scope(compiled, device):
                    out = compiled.fn(*state, clip, mask, *leaves, *draws)
            finally:
                torch._C._set_grad_enabled(grad_was)
            # (per-example losses, norms, kept flags, clipped sums..., kept count, mean loss)
            sum_c = out[3:-2]
            # Chunk sums add up in float64 (numerics.MAX_FLOAT32_SUM_ROWS).
            sums = list(sum_c) if sums is None else [_num.add_partial(a, b) for a, b in zip(sums, sum_c)]
            outs.append((out[1] if m == p else out[1][:m], out[-2], out[-1]))
        if len(outs) == 1:
            ((per_example_norms, kept, loss),) = outs
        else:
            norms, kept_counts, means = zip(*outs)
            per_example_norms, kept = torch.cat(norms), torch.stack(kept_counts).sum()
            loss = sum(mean.double() * m for mean, (m, _) in zip(means, chunks)).div(n).to(means[0].dtype)
        clipped = ClippedPytree(
            grads=dict(zip(feed.trainable, sums)),
            clipping_norm=self._clipping_norm,
            per_example_norms=per_example_norms,
            num_examples=n,
            num_nonfinite=n - int(kept),  # the one host read of the step
            parameters={k: params[k] for k in feed.trainable},
        )
        return DPStepResult(loss=loss, clipped=clipped, coverage=dict(first.coverage))

    @staticmethod
    def _rows(i: int, x: torch.Tensor, start: int, m: int, p: int) -> torch.Tensor:
        """Rows ``start:start+m`` of a batched leaf, zero-padded to ``p`` rows (a fresh tensor:
        the step keeps no copy of a batch between calls), contiguous: the graphs are traced
        and compiled for contiguous batches (a channels_last batch in a graph traced on a
        contiguous one failed in a view, and would fail Inductor's stride checks)."""
        rows = x if start == 0 and m == x.shape[0] else x[start : start + m]  # (a slice is a view op: skipped when whole)
        if m == p:
            return rows.contiguous()
        # One kernel and one allocation (zeros and a concatenation were two of each); laid
        # out contiguously, as the concatenation was (a channels_last batch keeps its layout
        # in constant_pad_nd, and a different layout rounds a convolution differently).
        return torch.constant_pad_nd(rows, [0, 0] * (x.dim() - 1) + [0, p - m], 0).contiguous()

    def _constant(self, key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Small input tensors (C, masks) built once per device and size, never written to."""
        t = self._constants.get(key)
        if t is None:
            t = self._constants[key] = make()
        return t

    def _batch_draws(self, count: int, device: torch.device) -> list[torch.Tensor]:
        """The uniform draws shared by every chunk of one logical batch (LayerDrop decisions,
        see :mod:`opake_compile.patches`), from the step's key; ``[]`` when the graph has none."""
        if not count:
            return []
        self._key, draw = _random.split(self._key, 2)
        u = torch.rand(count, generator=_random.generator_from_key(draw), dtype=torch.float32)
        return [u.to(device)]

    def _rng_scope(self, compiled: _Compiled, device: torch.device) -> contextlib.AbstractContextManager:
        """Random ops in the loss (dropout) draw from a seed derived from the step's key, in a
        scope that restores the global generator afterwards; each example draws independent
        randomness (``vmap(randomness="different")``)."""
        if not compiled.traced.has_randomness:
            return contextlib.nullcontext()
        self._key, draw = _random.split(self._key, 2)
        seed = _random.generator_from_key(draw).initial_seed()

        @contextlib.contextmanager
        def scope():
            # Seed only the generator of the device the graph runs on, and restore it after.
            if device.type == "cuda":
                with torch.random.fork_rng(devices=[device], device_type="cuda"):
                    torch.cuda.default_generators[device.index or 0].manual_seed(seed)
                    yield
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.random.default_generator.manual_seed(seed)
                    yield

        return scope()

    def _empty_result(self, params: dict[str, torch.Tensor], trainable: tuple[str, ...]) -> DPStepResult:
        device = params[trainable[0]].device
        clipped = ClippedPytree(
            # Released sums are float64 (compiler/passes/numerics.py), empty or not.
            grads={
                k: torch.zeros(params[k].shape, dtype=_num.sum_dtype(params[k].dtype), device=device)
                for k in trainable
            },
            clipping_norm=self.clipping_norm,
            per_example_norms=torch.zeros(
                0,
                device=device,
                dtype=torch.float64 if any(params[k].dtype == torch.float64 for k in trainable) else torch.float32,
            ),
            num_examples=0,
            parameters={k: params[k] for k in trainable},
        )
        coverage = self.coverage or {k: "empty batch" for k in trainable}
        return DPStepResult(loss=torch.tensor(float("nan"), device=device), clipped=clipped, coverage=coverage)


class _ScalarWatch:
    """Refuses an unbatched number (a Python or NumPy number, or an entry of a tensor or array
    of at most ``_SMALL_TENSOR`` entries, in an argument outside ``batch_argnums``) that tracks
    a count of the batch. The counts: the batch
    size and the statistics of each batched tensor that
    :func:`~opake_compile._statistics.batch_statistics` reads for the Opacus layer (its number of
    entries, its non-zero or non-negative entries, its sum), also over a 2-dim tensor without its
    first or its last position (a next-token loss counts its shifted labels).
    Tracking: the number ``x``, or its inverse, equals the count at every call so far while the
    count took three values; or equals ``a count + b`` (``a != 0``: ``count + 1``, ``2 count``,
    a clamp that has not bound) at every call while the count took five values.

    A loss divided by the batch's token count passed this way let one example rescale every
    other: removing it moved the clipped sum by 1.52 C (review). A few calls cannot tell such a
    number from a public one that happens to follow a count: a first version that refused after
    two matching calls refused 11 % of runs passing a step counter beside Poisson batches of
    about 8, and 73 % passing a random integer magnitude in 0..10 (second review). A constant
    never changes while a count does, so it is never refused; a schedule or a random number
    must follow the same count, on the same line, at every call from the first (a step counter
    beside Poisson batch sizes: the sizes must step evenly five times). Only computed when such
    numbers are passed (a host read per statistic)."""

    #: Distinct values of the count before a number equal to it (or to its inverse) is refused.
    EQUAL_AFTER = 3
    #: Distinct values of the count before a number on a line ``a count + b`` (or its inverse
    #: on one) is refused: two points fix any line, so it takes more than equality.
    LINE_AFTER = 5

    def __init__(self) -> None:
        # Per number (argument, leaf), per count and form ("x" or "1/x"): the distinct
        # (count, value) pairs seen while every call kept to one line through them.
        self._last: dict[tuple[int, ...], dict[tuple, list[tuple[float, float]]]] = {}

    def follows_no_count(self, path: tuple) -> bool:
        """Whether the number at ``path`` has left every count's line, for good (a later call
        cannot bring it back on one: nothing more to watch)."""
        return self._last.get(path) == {}

    def check(self, args: tuple, batched: tuple[int, ...], extra: list[tuple[tuple, float]] | None = None,
              describe: Callable[[tuple], str] | None = None) -> None:
        """Refuse (``ConfigurationError``) a number that tracks a count of this call's batch.
        Without ``extra``: the numbers in the arguments outside ``batched``; with it, those
        ``(path, value)`` pairs instead (numbers the trace bakes in, named by ``describe``)."""
        scalars = _scalar_leaves(args, batched) if extra is None else extra
        if not scalars:
            return
        # (identity, value, description): the identity is the same at every call. Compared within
        # 1e-6, not within the slack batch_statistics allows a sum rounded in its tensor's dtype
        # (37 % for a float32 image batch): a constant equal to a count within that slack at
        # every call while the count moved would be refused.
        counts = {("size",): (float(check_batch_size(args, batched)), "the batch size")}
        tensors = [((i, j), leaf) for i in batched for j, leaf in enumerate(optree.tree_leaves(args[i], none_is_leaf=True))
                   if isinstance(leaf, torch.Tensor) and leaf.layout in (torch.strided, torch.sparse_coo)
                   and not leaf.is_nested and not leaf.is_meta]
        try:
            read = [((ident, ""), t) for ident, t in tensors]
            for ident, t in tensors:
                if t.dim() == 2 and t.shape[1] >= 2 and t.layout == torch.strided:  # (rows, positions)
                    read += [((ident, " without its first position"), t[:, 1:]),
                             ((ident, " without its last position"), t[:, :-1])]
            for ((leaf, cut), kind), c, _, _ in batch_statistics(read, slack=False):
                counts[(leaf, cut, kind)] = (c, f"the {_KINDS[kind]} of argument {leaf[0]} (leaf {leaf[1]}){cut}")
        except (RuntimeError, NotImplementedError, TypeError):
            pass  # (a tensor kind without these reductions: the batch size is still compared)
        seen, refusal = {}, None
        for path, v in scalars:
            prev = self._last.get(path)
            kept: dict[tuple, list[tuple[float, float]]] = {}
            for ident, (c, _) in counts.items():
                for form, y in (("x", v), ("1/x", 1.0 / v)):
                    key = (ident, form)
                    if prev is None:
                        kept[key] = [(c, y)]
                    elif key in prev and (points := _on_one_line(prev[key], c, y)) is not None:
                        kept[key] = points
            for (ident, form), points in kept.items():
                equal = len(points) >= self.EQUAL_AFTER and all(
                    cc >= 3 and abs(yy - cc) <= 1e-6 * cc for cc, yy in points)
                if refusal is None and (equal or len(points) >= self.LINE_AFTER):
                    c, what = counts[ident]
                    subject = "its inverse has" if form == "1/x" else "it has"
                    how = f"{subject} equalled" if equal else f"{subject} followed a line a*count + b of"
                    name = (
                        f"Argument {path[0]} (leaf {path[1]}{'' if len(path) == 2 else f', entry {path[2]}'})"
                        if describe is None else describe(path)
                    )
                    refusal = ConfigurationError(
                        f"{name} = {v!r}: "
                        f"{how} {what} at every call, while that "
                        f"count took the values {sorted(cc for cc, _ in points)}: a number computed from the batch "
                        "and given to the step beside it (an argument, or a global, closure variable or module "
                        "attribute the loss reads: a token count, the batch size) lets one example rescale every "
                        "other's contribution, so that removing it moves the clipped sum by more than C. Compute "
                        "it per example inside the loss (e.g. each sequence's own token count from its mask), or "
                        "pass a public constant (the expected count). Nothing was computed or changed."
                    )
            seen[path] = kept
        # The refused call's point is kept: a later call on the same line (a count seen before)
        # is refused again; a number that leaves it (a constant from now on) is not.
        self._last.update(seen)
        if refusal is not None:
            raise refusal


def _on_one_line(points: list[tuple[float, float]], c: float, y: float) -> list[tuple[float, float]] | None:
    """``points`` (distinct counts with their values, all on one line of non-zero slope) with
    ``(c, y)`` added, or ``None`` if ``(c, y)`` leaves that line: the same count with another
    value, a second count with the same value (slope 0: a constant), or a third point off the
    line through the first two (within 1e-6 of the terms' size)."""
    tol = lambda *terms: 1e-6 * sum(abs(t) for t in terms)
    for cc, yy in points:
        if cc == c:
            return points if abs(yy - y) <= tol(yy, y) else None
    if len(points) == 1:
        (c0, y0), = points
        return None if abs(y - y0) <= tol(y, y0) else points + [(c, y)]
    (c0, y0), (c1, y1) = points[:2]
    a = (y1 - y0) / (c1 - c0)
    b = y0 - a * c0
    return points + [(c, y)] if abs(y - (a * c + b)) <= tol(y, a * c, b) else None


#: How :meth:`_ScalarWatch.check` names each kind of statistic of ``batch_statistics``.
_KINDS = {"numel": "number of entries", "sum": "sum", "nonzero": "non-zero entries", "nonneg": "non-negative entries"}


#: Unbatched tensors of up to this many entries have each entry compared with the counts (a
#: count packed with other numbers, ``torch.tensor([n_tokens, step])``: a review's miss).
_SMALL_TENSOR = 16


def _number_values(leaf: Any) -> list[float] | None:
    """The values a batch count could hide in: a real number, or each entry of a small tensor
    or array (up to ``_SMALL_TENSOR`` entries); ``None`` for anything else."""
    try:
        if is_real_number(leaf):
            return [float(leaf)]
        if (isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided and not leaf.is_nested
                and 1 <= leaf.numel() <= _SMALL_TENSOR and not leaf.is_complex() and leaf.dtype != torch.bool
                and not leaf.is_meta and not isinstance(leaf, torch._subclasses.FakeTensor)):
            return [float(x) for x in leaf.detach().reshape(-1).tolist()]
        if (isinstance(leaf, np.ndarray) and 1 <= leaf.size <= _SMALL_TENSOR
                and (np.issubdtype(leaf.dtype, np.integer) or np.issubdtype(leaf.dtype, np.floating))):
            return [float(x) for x in leaf.reshape(-1).tolist()]
    except (OverflowError, RuntimeError, TypeError, ValueError):
        pass  # (not a number this check can compare; the call decides what it is)
    return None


def _numbered(path: tuple, values: list[float] | None) -> list[tuple[tuple, float]]:
    """``(path, value)`` per finite non-zero value; an entry's index appended when there are
    several."""
    if values is None:
        return []
    return [(path if len(values) == 1 else (*path, k), v) for k, v in enumerate(values) if math.isfinite(v) and v != 0]


def _scalar_leaves(args: tuple, batched: tuple[int, ...]) -> list[tuple[tuple[int, ...], float]]:
    """``((argument, leaf), value)`` of every finite non-zero number outside the batched
    arguments, and ``((argument, leaf, entry), value)`` of each entry of a small tensor or
    array (up to ``_SMALL_TENSOR`` entries)."""
    out = []
    for i, a in enumerate(args):
        if i in batched:
            continue
        for j, leaf in enumerate(optree.tree_leaves(a, none_is_leaf=True)):
            out += _numbered((i, j), _number_values(leaf))
    return out


def _program_numbers(view: "_ModelView", loss: "_LossReader | None") -> list[tuple[tuple, float]]:
    """The numbers a trace bakes in beside the arguments (:func:`_program`): each module's
    number attributes (``("module", index, name[, entry])``), and the loss's
    ``functools.partial`` arguments, closure variables and the globals its code loads
    (``("partial", layer, leaf[, entry])``, ``("closure" | "global", function, name[, entry])``).
    A changed one traces again; :meth:`DPStep._watch_numbers` also watches it against the
    batch's counts."""
    _, attrs, _, reading, _, _ = view.program
    out = []
    for index, values in enumerate(attrs):
        for name, value in values.items():
            if type(value) not in _CONTAINERS:
                out += _numbered(("module", index, name), _number_values(value))
    if loss is not None:
        k = len(loss.partials)
        for layer, (pargs, pkw) in enumerate(reading[:k]):
            for j, leaf in enumerate(optree.tree_leaves((pargs, pkw), none_is_leaf=True)):
                out += _numbered(("partial", layer, j), _number_values(leaf))
        for f, (fn, read) in enumerate(zip(loss.functions, reading[k:])):
            for kind, names, values in (("closure", fn.__code__.co_freevars, read[3]), ("global", loss.globals_of(fn), read[4])):
                for name, value in zip(names, values):
                    out += _numbered((kind, f, name), _number_values(value))
    return out


def _user_settings(sig: Any) -> tuple:
    """What of a graph signature (``(DPStep._signature, P)``) is the user's to change between
    calls (trainable set, model state and device, modes, matrix-product precision): graphs
    with the same settings must share their public inputs and their norm forms."""
    (_, _, *rest), _ = sig
    return tuple(rest)


def _public_inputs(sig: Any) -> tuple:
    """What of a graph signature the batch may not decide: the arguments' pytree structure and,
    per leaf, whether it is batched, a constant (its value left out: a constant may follow a
    public schedule) or a tensor, with its dtype, device and dimensions (beyond the batch
    dimension for batched ones). Only the physical size P and the rows are the batch's."""
    (treedef, parts, *_), _ = sig
    return (treedef, tuple(("const",) if part[0] == "const" else part for part in parts))


def _public_difference(now: tuple, then: tuple) -> str:
    """A sentence naming the first public input that differs between two ``_public_inputs``."""
    if now[0] != then[0]:
        return (
            f"The step's arguments have another pytree structure ({now[0]}) than at an earlier call "
            f"of this step ({then[0]})."
        )
    i, a, b = next((i, a, b) for i, (a, b) in enumerate(zip(now[1], then[1])) if a != b)
    if a[0] == "const" or b[0] == "const" or a[0] != b[0]:
        kind = lambda p: "a constant" if p[0] == "const" else ("a batched tensor" if p[0] else "an unbatched tensor")
        return f"Argument leaf {i} is {kind(a)} where it was {kind(b)} at an earlier call of this step."
    if a[1] != b[1]:
        return f"Argument leaf {i} has dtype {a[1]} against {b[1]} at an earlier call of this step."
    if a[3] != b[3]:
        return f"Argument leaf {i} is on device {a[3]!r} against {b[3]!r} at an earlier call of this step."
    beyond = " (beyond the batch dimension)" if a[0] else ""
    return f"Argument leaf {i} has shape {a[2]} against {b[2]}{beyond} at an earlier call of this step."


def _tensor_parts(args: tuple, batched: tuple[int, ...]) -> tuple:
    """Per positional tensor argument: (batched?, dtype, dimensions beyond the batch dimension
    if batched else the shape, device type): its part of :meth:`DPStep._signature`."""
    return tuple(
        (i in batched, a.dtype, tuple(a.shape[1:]) if i in batched else tuple(a.shape), a.device.type)
        for i, a in enumerate(args)
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _Repeat:
    """What the last general call (all positional tensors) found, for :meth:`DPStep._call_again`:
    its argument parts (:func:`_tensor_parts`), model reading, matrix-product precision and
    the graphs built for its signature, by physical size."""

    nargs: int
    batched: tuple[int, ...]
    flags: tuple[bool, ...]
    parts: tuple
    view: "_ModelView"
    ieee: bool
    autocast: tuple
    graphs: dict[int, _Compiled]


def _max_batch_args(loss_fn: Callable[..., Any]) -> int | None:
    """How many positional arguments ``loss_fn`` takes after the model, or ``None`` when its
    signature cannot say (``*args``, a builtin, no signature)."""
    try:
        # The function called, not what functools.wraps says it wraps: a decorator may add
        # arguments.
        params = list(inspect.signature(loss_fn, follow_wrapped=False).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return max(len(positional) - 1, 0)


def _walk(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], tuple[nn.Module, ...]]:
    """``(dict(named_parameters()), dict(named_buffers()), tuple(modules()))`` in one walk of
    the module tree (three walks were a measurable share of a small model's step). Modules are
    visited in ``named_modules()``'s order (pre-order, a shared module once, at its first
    name), with an explicit stack rather than its nested generators (per-call overhead); shared
    tensors are listed once, under their first name, as ``named_parameters`` does."""
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    seen_params: set[int] = set()
    seen_buffers: set[int] = set()
    visited: set[int] = set()
    modules = []
    stack = [("", model)]
    while stack:
        prefix, mod = stack.pop()
        if id(mod) in visited:
            continue
        visited.add(id(mod))
        modules.append(mod)
        dot = prefix + "." if prefix else ""
        for store, out, seen in ((mod._parameters, params, seen_params), (mod._buffers, buffers, seen_buffers)):
            for name, t in store.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out[dot + name] = t
        children = mod._modules
        if children:
            stack.extend((dot + name, child) for name, child in reversed(children.items()) if child is not None)
    return params, buffers, tuple(modules)


_TRAINING = operator.attrgetter("training")
_STORES = (operator.attrgetter("_parameters"), operator.attrgetter("_buffers"), operator.attrgetter("_modules"))
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_TENSOR_HOOKS = operator.attrgetter("_backward_hooks", "_post_accumulate_grad_hooks")  # None or a dict each


def _refuse_tensor_hooks(params: dict[str, torch.Tensor]) -> None:
    """Raise if a trainable parameter carries a tensor hook (``register_hook``,
    ``register_post_accumulate_grad_hook``): the step's gradients come from its traced graph,
    which no such hook reaches, so a hook that masks or rescales a gradient would be ignored
    without a word (a newcomer's review: a zeroing hook left the sums bit for bit unchanged)."""
    for name, p in params.items():
        if p.requires_grad and any(_TENSOR_HOOKS(p)):
            raise UnsupportedOperationError(
                f"Parameter {name!r} has a tensor hook (Tensor.register_hook or "
                "register_post_accumulate_grad_hook): compile_dp computes per-example gradients "
                "from the traced graph, which tensor hooks do not reach, so the hook would be "
                "ignored. Remove it (handle.remove()) and write what it does into the model or the "
                "loss (a mask on the weight in forward), or freeze the parameter."
            )


def _entries(modules: tuple[nn.Module, ...]) -> tuple[Any, ...]:
    """Every module's ``_parameters``, ``_buffers`` and ``_modules`` dicts, as they are now."""
    return tuple(chain.from_iterable(map(get, modules) for get in _STORES))


_VARS = operator.attrgetter("__dict__")
_HOOK_DICTS = {  # a module's hook dicts, keyed by handle ids, and the dicts flagging some of those ids
    "_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
    "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"),
    "_backward_pre_hooks": (),
    "_backward_hooks": (),
}
_CONTAINERS = (dict, OrderedDict, list, set)  # attribute values copied one level deep by _program
# Left out of program numbers (see _program_key): what the signature follows otherwise (the
# tree's dicts and modes, through _ModelView), the caches of its own parameters an RNN rebinds
# at eager forwards (weak references, which compare by their tensors' elementwise ==), the
# hook flags (folded into the hooks), and hooks that do not run in a forward.
_UNNUMBERED = frozenset(
    {"_parameters", "_buffers", "_modules", "training", "_flat_weights", "_flat_weight_refs", "_non_persistent_buffers_set",
     "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"}
    | {flag for flags in _HOOK_DICTS.values() for flag in flags}
)
# What the first torch.compile of a process patches on nn.Module
# (torch._dynamo.mutation_guard.install_generation_tagging_init): __init__ and __setstate__
# wrapped by functions that call the originals (held in their closures) and tag the module
# for Dynamo, and a flag. Read through to the originals by _program_key, so that a user's
# torch.compile anywhere after the first step does not make the step trace again (seconds at
# GPT-2 width); a patch of either by anything else still numbers a new program.
_DYNAMO_WRAPPERS = {"__init__": ("patched_init", "init"), "__setstate__": ("patched_setstate", "setstate")}
_DYNAMO_FLAG = "___needs_generation_tag_patch"


# The most programs (_program) one step traces under before each further one warns.
MAX_MODEL_PROGRAMS = 8
_NO_VALUE = object()  # an empty closure cell, a global not (yet) defined, an attribute absent


def _dynamo_unwrapped(attrs: dict[str, Any]) -> dict[str, Any]:
    """nn.Module's class attributes with Dynamo's wrappers read through (see above): a
    function is taken for Dynamo's wrapper only if its code object is one of those nested in
    ``install_generation_tagging_init`` (a look-alike of the same names still counts)."""
    out = dict(attrs)
    out.pop(_DYNAMO_FLAG, None)
    guard = sys.modules.get("torch._dynamo.mutation_guard")  # (loaded by whatever wrapped them)
    install = getattr(guard, "install_generation_tagging_init", None)
    nested = getattr(getattr(install, "__code__", None), "co_consts", ())
    for name, (code_name, cell) in _DYNAMO_WRAPPERS.items():
        fn = out.get(name)
        code = getattr(fn, "__code__", None)
        if code is not None and any(code is c for c in nested) and code.co_name == code_name and code.co_freevars == (cell,):
            out[name] = fn.__closure__[0].cell_contents
    return out


class _LossReader:
    """Reads what of the loss function's Python a trace bakes in, beside the model: a
    ``functools.partial``'s arguments; and for the function (a method's function, and every
    function a decorator wraps, through ``__wrapped__``) its code, defaults, the values of its
    closure cells and of the module globals its code loads, nested code (lambdas,
    comprehensions, generator expressions) included (``LOAD_GLOBAL``: not attribute names, so
    that ``out.loss`` does not follow a global ``loss``). Not followed: the functions it calls,
    a method's object and a callable object's attributes (a trainer's counters change every
    step), objects changed in place."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.partials: list[functools.partial] = []
        while isinstance(fn, functools.partial):
            self.partials.append(fn)
            fn = fn.func
        functions: list[types.FunctionType] = []
        while fn is not None and len(functions) < 64:
            f = getattr(fn, "__func__", fn)  # a bound method: its function
            if isinstance(f, types.FunctionType) and f not in functions:
                functions.append(f)
            fn = getattr(fn, "__wrapped__", None)  # functools.wraps
        self.functions = tuple(functions)
        self._globals: dict[Any, tuple[str, ...]] = {}  # code object -> the globals it loads

    def globals_of(self, fn: types.FunctionType) -> tuple[str, ...]:
        names = self._globals.get(fn.__code__)
        if names is None:
            names = self._globals[fn.__code__] = tuple(dict.fromkeys(_global_loads(fn.__code__)))
        return names

    def read(self) -> tuple:
        return tuple((p.args, dict(p.keywords)) for p in self.partials) + tuple(map(self._read_function, self.functions))

    def _read_function(self, fn: types.FunctionType) -> tuple:
        return (
            fn.__code__,
            fn.__defaults__,
            None if fn.__kwdefaults__ is None else dict(fn.__kwdefaults__),
            tuple(map(_cell_value, fn.__closure__ or ())),
            tuple(map(fn.__globals__.get, self.globals_of(fn), itertools.repeat(_NO_VALUE))),
        )

    def difference(self, old: tuple, new: tuple) -> str:
        """A phrase naming the first difference between two readings."""
        k = len(self.partials)
        for i, (a, b) in enumerate(zip(old[:k], new[:k])):
            if not _same_program(a, b):
                return f"the arguments of the loss's functools.partial (layer {i}) changed"
        for fn, was, now in zip(self.functions, old[k:], new[k:]):
            name = fn.__qualname__
            if not all(map(_same_program, was[:3], now[:3])):
                return f"the code or default arguments of the loss {name!r} changed"
            named = chain(
                (("closure variable", v) for v in was[0].co_freevars), (("global", v) for v in self.globals_of(fn))
            )
            for (kind, var), a, b in zip(named, was[3] + was[4], now[3] + now[4]):
                if not _same_program(a, b):
                    return f"{kind} {var!r} of the loss {name!r} changed ({_short(a)} -> {_short(b)})"
        return "the loss function changed"


def _global_loads(code: Any) -> Iterator[str]:
    """The names ``code`` and the code nested in it load as globals."""
    for ins in dis.get_instructions(code):
        if ins.opname == "LOAD_GLOBAL":
            yield ins.argval
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_loads(const)


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return _NO_VALUE


def _program(modules: tuple[nn.Module, ...], loss: _LossReader | None = None) -> tuple:
    """What of the model's and the loss's Python a trace bakes into its graph beside the
    tensors the fingerprint of :class:`_ModelView` follows: each module's class, and a copy of
    the ``__dict__`` of every class in their MROs (a method or class attribute patched); a copy
    of each module's instance attributes (a ``forward`` set on the instance, a float scale, a
    flag, a dropout probability), with copies of its dicts, lists and sets (hooks, PEFT's
    ``scaling``: changed in place); the global module hooks; and the loss function's reading
    (:class:`_LossReader`). Compare a reading with the model as it is now with
    :func:`_program_holds`; :class:`_Programs` numbers them."""
    types_ = tuple(map(type, modules))
    classes = tuple(c for c in dict.fromkeys(chain.from_iterable(t.__mro__ for t in types_)) if c is not object)
    return (
        types_,
        tuple(map(_attributes, modules)),
        _global_hooks(),
        () if loss is None else loss.read(),
        classes,
        tuple(dict(c.__dict__) for c in classes),
    )


def _attributes(module: nn.Module) -> dict[str, Any]:
    attrs = module.__dict__.copy()
    for name, value in attrs.items():
        if type(value) in _CONTAINERS:
            attrs[name] = value.copy()  # changed in place: hook dicts, PEFT's scaling dict
    return attrs


def _live_global_hooks() -> tuple:
    """The global module hook dicts as they are (changed in place) and the rebound flag."""
    m = _torch_module
    return (
        m._global_forward_pre_hooks,
        m._global_forward_hooks,
        m._global_forward_hooks_with_kwargs,
        m._global_forward_hooks_always_called,
        m._global_backward_pre_hooks,
        m._global_backward_hooks,
        m._global_is_full_backward_hook,
    )


def _global_hooks() -> tuple:
    """A copy of :func:`_live_global_hooks`, for :func:`_program`."""
    return tuple(h.copy() if isinstance(h, dict) else h for h in _live_global_hooks())


def _same_program(a: Any, b: Any) -> bool:
    """Whether two readings are equal: the same objects, or equal values (a rebound ``2.0`` is
    the same constant). Values that cannot say (two different tensors, an array) count as
    different: a graph would hold the old one."""
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - any comparison that cannot answer means "not the same"
        return False


def _program_holds(modules: tuple[nn.Module, ...], program: tuple, loss: _LossReader | None = None) -> bool:
    """Whether :func:`_program` of ``modules`` and ``loss`` now would equal ``program``,
    without copying: each live ``__dict__`` compared with its copy (C-level passes)."""
    types_, attrs, global_hooks, loss_reading, classes, class_attrs = program
    try:
        return (
            tuple(map(type, modules)) == types_
            and all(map(operator.eq, map(_VARS, modules), attrs))
            and all(map(operator.eq, map(_VARS, classes), class_attrs))
            and _live_global_hooks() == global_hooks  # (compared as they are: no copies per call)
            and (() if loss is None else loss.read()) == loss_reading
        )
    except Exception:  # noqa: BLE001 - as in _same_program
        return False


def _hook_key(hook: Any) -> Any:
    """A hook as what it does, not its handle: a function by its code, closure values and
    defaults (a hook made afresh each step by the same ``def`` or ``lambda`` is the same)."""
    fn = getattr(hook, "__func__", hook)
    if isinstance(fn, types.FunctionType):
        return (fn.__code__, tuple(map(_cell_value, fn.__closure__ or ())), fn.__defaults__, getattr(hook, "__self__", None))
    if isinstance(hook, functools.partial):
        return (_hook_key(hook.func), hook.args, hook.keywords)
    return hook


def _hooks_key(hooks: Mapping[int, Any], *flags: Mapping[int, Any]) -> tuple:
    return tuple((_hook_key(h), *(i in f for f in flags)) for i, h in hooks.items())


def _program_key(program: tuple, written: frozenset[tuple[int, str]] = frozenset()) -> tuple:
    """The part of a :func:`_program` reading that numbers graphs (:class:`_Programs`):
    without what the signature follows otherwise (parameters, buffers, children, modes: a
    swapped module of the same shapes or a mode switched back finds its graphs), with hooks as
    what they run (:func:`_hook_key`: a hook registered and removed around each step is the
    same hook), and without the ``written`` attributes, ``(module index, name)``, that forward
    itself writes (:meth:`_Programs.left_by_trace`)."""
    types_, attrs, global_hooks, loss_reading, classes, class_attrs = program
    kept = []
    for i, a in enumerate(attrs):
        k = {n: v for n, v in a.items() if n not in _UNNUMBERED and (i, n) not in written}
        for name, flags in _HOOK_DICTS.items():
            if name in k:
                k[name] = _hooks_key(a[name], *(a.get(f, {}) for f in flags))
        kept.append(k)
    g = global_hooks
    hooks = (_hooks_key(g[0]), _hooks_key(g[1], g[2], g[3]), _hooks_key(g[4]), _hooks_key(g[5]), g[6])
    numbered = tuple(_dynamo_unwrapped(a) if c is _torch_module.Module else a for c, a in zip(classes, class_attrs))
    return types_, tuple(kept), hooks, loss_reading, classes, numbered


def _program_difference(model: nn.Module, old: tuple, new: tuple, loss: _LossReader | None = None) -> str:
    """A phrase naming the first difference between two :func:`_program_key` readings of
    ``model`` (and of the loss ``loss`` reads)."""
    names = [name or "the model" for name, _ in model.named_modules()]  # _walk's order
    old_types, old_attrs, old_global, old_loss, old_classes, old_class_attrs = old
    new_types, new_attrs, new_global, new_loss, new_classes, new_class_attrs = new
    if loss is not None and not _same_program(old_loss, new_loss):
        return loss.difference(old_loss, new_loss)
    if len(old_types) != len(new_types) or len(names) != len(new_types):
        return "its module tree changed"
    for name, a, b in zip(names, old_types, new_types):
        if a is not b:
            return f"module {name!r} changed class from {a.__name__} to {b.__name__}"
    for name, a, b in zip(names, old_attrs, new_attrs):
        for attr in list(b) + [k for k in a if k not in b]:
            if attr not in a or attr not in b:
                return f"attribute {attr!r} of module {name!r} was {'added' if attr in b else 'deleted'}"
            if not _same_program(a[attr], b[attr]):
                if attr in _HOOK_DICTS:
                    return f"a hook ({attr}) was registered or removed on module {name!r}"
                return f"attribute {attr!r} of module {name!r} changed ({_short(a[attr])} -> {_short(b[attr])})"
    if old_classes == new_classes:
        for cls, a, b in zip(new_classes, old_class_attrs, new_class_attrs):
            for attr in dict.fromkeys(chain(a, b)):
                if not _same_program(a.get(attr, _NO_VALUE), b.get(attr, _NO_VALUE)):
                    return f"class attribute {attr!r} of {cls.__qualname__} changed ({_short(a.get(attr))} -> {_short(b.get(attr))})"
    if not _same_program(old_global, new_global):
        return "a global module hook (torch.nn.modules.module.register_module_*_hook) was registered or removed"
    return "its Python state changed"


def _short(value: Any) -> str:
    text = repr(value) if isinstance(value, (bool, int, float, str, type(None))) else f"a {type(value).__name__}"
    return text if len(text) <= 40 else text[:37] + "..."


class _Programs:
    """The programs (:func:`_program`: the model's and the loss's Python) a step has traced
    under, numbered by :func:`_program_key`: the number is part of the graph signature, so
    that a graph traced under one program never runs under another, and a program seen before
    finds its graphs again.

    A trace runs the forward, which may write attributes: a flag it reads first (a warm-up
    switch) or a value it computes before reading it (an old-style ``weight_norm``'s weight,
    a call counter). The first time a trace changes an attribute, the new value is a new
    program and is traced (the flag's new value may change the graph); an attribute a second
    trace changes again is written by the forward and leaves the numbering
    (:meth:`left_by_trace`), or every call, and every eager forward between calls, would
    trace again."""

    def __init__(self, loss: _LossReader | None = None) -> None:
        self.loss = loss
        self._seen: list[tuple[tuple, int]] = []  # (program, number)
        self._changed: set[tuple[int, str]] = set()  # (module index, name) a trace changed
        self.written: frozenset[tuple[int, str]] = frozenset()  # ... changed by two traces
        self.count = 0

    def _same(self, a: tuple, b: tuple) -> bool:
        return _same_program(_program_key(a, self.written), _program_key(b, self.written))

    def number(self, program: tuple, model: nn.Module) -> int:
        for seen, number in reversed(self._seen):
            if self._same(seen, program):
                return number
        if self.count >= MAX_MODEL_PROGRAMS:
            last = self._seen[-1][0]
            warnings.warn(
                f"The model's or the loss's Python changed again between calls of this DP step "
                f"({_program_difference(model, _program_key(last, self.written), _program_key(program, self.written), self.loss)}): "
                f"program {self.count + 1}, each traced and compiled anew, since a graph bakes in the classes, hooks and "
                f"Python values its trace saw. Pass values that change every step as arguments of "
                f"the loss (tensors, or constants of a public schedule), or set the model up before "
                f"the first call.",
                RuntimeWarning,
                stacklevel=4,
            )
        self._seen.append((program, self.count))
        self.count += 1
        return self.count - 1

    def left_by_trace(self, before: tuple, after: tuple) -> None:
        """A trace read the model as ``before`` and left it as ``after``."""
        _, was, *_ = before
        _, now, *_ = after
        if len(was) != len(now):
            return
        changed = {
            (i, n)
            for i, (a, b) in enumerate(zip(was, now))
            for n in dict.fromkeys(chain(a, b))
            if n not in _UNNUMBERED and not _same_program(a.get(n, _NO_VALUE), b.get(n, _NO_VALUE))
        }
        again = changed & self._changed
        self._changed |= changed
        if again:
            self.written |= again


@dataclasses.dataclass(frozen=True, eq=False)
class _ModelView:
    """One reading of the model (:func:`_walk`) and what a call derives from it, with the
    fingerprint that tells, without walking the tree again, whether a new reading would
    give the same: every module's mode, the names and identities of every entry of its
    parameter, buffer and child dicts, and each listed parameter's ``requires_grad``, dtype
    and shape (``.to()`` and ``.half()`` change a parameter in place), and the device of the
    first one (the signature's model device); and the model's :func:`_program` (classes,
    instance attributes, hooks). A parameter, buffer or module replaced, added, removed or
    frozen, a mode switched, a hook registered or an attribute rebound fails
    :meth:`still_holds`; so does another model set on the step. The view holds the entries it
    read, so that their ids cannot be reused by new objects while it is kept (a replaced
    module stays alive until the next call).
    """

    model: nn.Module
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    modes: tuple[bool, ...]
    trainable: tuple[str, ...]
    signature: tuple  # the model's part of DPStep._signature: (parameter meta, device, modes, program number)
    modules: tuple[nn.Module, ...]
    names: tuple[str, ...]
    members: tuple[Any, ...]
    member_ids: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]
    meta: tuple[tuple[bool, ...], tuple[torch.dtype, ...], tuple[torch.Size, ...], Any]
    program: tuple
    trainable_tensors: tuple[torch.Tensor, ...] = ()  # whose tensor hooks still_holds reads

    @classmethod
    def read(cls, model: nn.Module, programs: _Programs | None = None) -> "_ModelView":
        """Walk ``model``; ``programs`` numbers its :func:`_program` (0 without it)."""
        params, buffers, modules = _walk(model)
        _refuse_tensor_hooks(params)
        program = _program(modules, None if programs is None else programs.loss)
        number = 0 if programs is None else programs.number(program, model)
        modes = tuple(map(_TRAINING, modules))
        stores = _entries(modules)
        members = tuple(chain.from_iterable(map(dict.values, stores)))
        tensors = tuple(params.values())
        grads, dtypes, shapes = tuple(map(_REQUIRES_GRAD, tensors)), tuple(map(_DTYPE, tensors)), tuple(map(_SHAPE, tensors))
        device = tensors[0].device if tensors else None
        return cls(
            model=model,
            params=params,
            buffers=buffers,
            modes=modes,
            trainable=tuple(k for k, g in zip(params, grads) if g),
            signature=(tuple(zip(params, dtypes, shapes)), None if device is None else device.type, modes, number),
            modules=modules,
            names=tuple(chain.from_iterable(stores)),
            members=members,
            member_ids=tuple(map(id, members)),
            tensors=tensors,
            meta=(grads, dtypes, shapes, device),
            program=program,
            trainable_tensors=tuple(t for t, g in zip(tensors, grads) if g),
        )

    def still_holds(self, model: nn.Module, loss: _LossReader | None = None) -> bool:
        """Whether :meth:`read` of ``model`` now would give this view (C-level passes over
        the tree's dicts, no Python loop)."""
        if model is not self.model:
            return False
        modules = self.modules
        if tuple(map(_TRAINING, modules)) != self.modes:
            return False
        stores = _entries(modules)
        if tuple(chain.from_iterable(stores)) != self.names:
            return False
        if tuple(map(id, chain.from_iterable(map(dict.values, stores)))) != self.member_ids:
            return False
        tensors = self.tensors
        grads, dtypes, shapes, device = self.meta
        return (
            tuple(map(_REQUIRES_GRAD, tensors)) == grads
            and not any(chain.from_iterable(map(_TENSOR_HOOKS, self.trainable_tensors)))
            and tuple(map(_DTYPE, tensors)) == dtypes
            and tuple(map(_SHAPE, tensors)) == shapes
            and (not tensors or tensors[0].device == device)
            and _program_holds(modules, self.program, loss)
        )


def _pad_args(args: tuple, batched: tuple[int, ...], start: int, m: int, p: int) -> tuple:
    """Rows ``start:start+m`` of every batched tensor leaf, padded with zeros to ``p`` rows
    and contiguous, as :meth:`DPStep._rows` hands them to the graph (it makes them); the
    other tensor leaves contiguous, as :meth:`DPStep._run` hands them over."""

    def pad(x: Any) -> Any:
        return DPStep._rows(0, x, start, m, p) if isinstance(x, torch.Tensor) else x

    def whole(x: Any) -> Any:
        return x.contiguous() if isinstance(x, torch.Tensor) else x

    return tuple(optree.tree_map(pad if i in batched else whole, a, none_is_leaf=True) for i, a in enumerate(args))


def _default_rewrites() -> list[Callable[..., PassReport]]:
    from opake_compile.compiler.passes.rewrites import REWRITE_PASSES

    return list(REWRITE_PASSES)


def compile_dp(
    loss_fn: Callable[..., Any] | None = None,
    *,
    model: nn.Module,
    clipping_norm: Any,
    batch_argnums: Sequence[int] | int | None = None,
    physical_batch_size: int | None = None,
    backend: str | Callable[..., Any] | None = "inductor",
    key: Any = None,
    rewrites: Sequence[Callable[..., PassReport]] | None = None,
    max_physical_sizes: int = DEFAULT_MAX_PHYSICAL_SIZES,
) -> DPStep | Callable[[Callable[..., Any]], DPStep]:
    """Compile a batch loss into a DP-SGD step: per-example gradients of the trainable
    parameters, each clipped to L2 norm ``clipping_norm``, summed (Abadi et al. 2016).

    The loss is written for a whole batch, ``loss_fn(model, *args)``, with mean or sum
    reduction. The per-example loss is that function on a batch of one; only parameters with
    ``requires_grad=True`` are differentiated (LoRA, adapters, BitFit: frozen weights cost no
    gradient). The pipeline traces ``vmap(grad(per-example loss))`` into an ATen graph, inserts
    norms, clip factors and the weighted sum (then, where rewrite passes match, replaces them
    with ghost norms and book-keeping, Li et al. 2022 / Bu et al. 2023), and lowers the graph
    through ``backend``.

    Batches of any size run without recompiling once warmed up: each logical batch is cut into
    chunks, each padded with masked rows that contribute exactly zero. With an explicit
    ``physical_batch_size`` P every chunk has P rows (one graph; a batch of n < P rows pays for
    P). By default the chunk sizes are buckets, compiled lazily, with padding under 5 % of the
    work (a batch of the first batch's size never pads) and at most ``max_physical_sizes``
    graphs (see :meth:`DPStep.plan`).

    Each call reads the model as it is then: which parameters train, their dtypes, shapes and
    device, the modules' modes, and the Python a trace bakes in: each module's class and the
    attributes of the classes it derives from (a patched method), its forward and backward
    hooks (as the functions they run: a hook registered afresh at each step is the same hook),
    the global module hooks and its instance attributes (a ``forward`` set on an instance, a
    scale or flag its forward reads, a dict of them changed in place); and the loss function's
    code, default arguments, closure variables and the module globals its code loads, nested
    code included, through ``functools.partial``, ``functools.wraps`` and a method's function.
    Any change traces again; a state seen before finds its graphs again; past
    ``MAX_MODEL_PROGRAMS`` (8) such states each new one warns (``RuntimeWarning``, naming what
    changed). An attribute the forward writes itself is traced again once, and if the next
    trace writes it again it is left out (a counter, an old-style ``weight_norm`` weight). A
    trace that gives a graph already lowered (the same code and inputs, no tensor constants)
    runs the callable lowered from it: no second backend compile. Read once, when a graph is traced: what the functions the loss calls read, a method's object,
    modules other than ``model`` (a teacher reached through a global), and objects changed in
    place beyond one level (a config).

    Args:
        loss_fn: the batch loss. Omit it to use ``compile_dp`` as a decorator.
        model: the ``nn.Module`` whose parameters are trained (the ``model`` argument of
            ``loss_fn``). BatchNorm in training mode is refused (it mixes examples).
        clipping_norm: C > 0 (L2 norm in gradient units); ``math.inf`` disables clipping and
            warns that the result is not private.
        batch_argnums: positions (in ``step(*args)``) of the batched arguments; ``None``: all.
            Other arguments are broadcast to every example.
        physical_batch_size: rows per compiled chunk P, for exactly one graph; set it from
            public numbers (the expected batch size q N). Default (``None``): buckets on a
            geometric grid of ratio 1.05 anchored at the first non-empty batch size n0, at most
            n0 + 3 sqrt(n0) (rounded up to 8) rows per chunk; warns
            :class:`~opake_compile.exceptions.SoundnessWarning` (graphs of different row counts
            for D and D - i: a known gap, README "The guarantee, in floating point").
            Either way a graph holds at most 4096 rows (``numerics.MAX_FLOAT32_SUM_ROWS``); the
            sums are float64 (``clipped.grads``: exact products of the factors, accumulated
            in float64, so that no example can steer how the others round), up to
            ``numerics.MAX_FLOAT32_LOGICAL_ROWS`` = 2^16 examples of a float32 model per call
            (refused beyond: the chunks' rounding adds up as a removal shifts rows between them).
        max_physical_sizes: the most bucket sizes (graphs per input signature) the default
            compiles; past it, chunks run at the nearest compiled size (more padding, no
            compile). Ignored with an explicit ``physical_batch_size``.
        backend: ``"inductor"`` (default), ``"aot_eager"`` (cheap, for tests), any
            ``torch.compile`` backend, or ``None`` to run the FX graph unlowered.
        key: an :mod:`opake_compile.random` key for randomness inside the loss (dropout);
            default: fresh OS entropy.
        rewrites: the rewrite passes to run after clipping insertion (default: all of the
            library's). ``[]`` keeps every per-example gradient materialised.

    Returns:
        A :class:`DPStep`; ``step(*args) -> DPStepResult`` (``loss`` not private,
        ``clipped``: a :class:`ClippedPytree` of unnormalised sums, ``coverage``).

    Raises:
        ConfigurationError: C <= 0 or NaN; a backend name ``torch.compile`` does not know;
            batched arguments disagree on the batch size; at a call, subnormal float32 results
            flushed to zero (``torch.set_flush_denormal``); at a call, a number outside
            ``batch_argnums`` that has equalled a count of the batch (its size, or a batched
            tensor's number of entries, non-zero entries or sum, also over its positions but
            the first or the last) at every call while that count took three values, or
            followed a line ``a count + b`` while it took five (``_ScalarWatch``).
        InputTypeError: wrong argument types; no trainable parameter (at a call: which
            parameters train is read then, ``requires_grad`` may change between calls).
        UnsupportedOperationError: BatchNorm in training mode, a loss that cannot be traced
            per example (the message names the module or the failing op), or a backend that
            cannot compile the traced graph (at the first call; the message says so). A rewrite
            rule that cannot apply is never an error: that parameter keeps the materialised
            path and :meth:`DPStep.describe` says why.

    Example::

        >>> model = torch.nn.Linear(4, 2)
        >>> @opake.compile_dp(model=model, clipping_norm=1.0, backend="aot_eager")
        ... def step(model, x, y):
        ...     return torch.nn.functional.cross_entropy(model(x), y)
        >>> out = step(torch.randn(5, 4), torch.randint(0, 2, (5,)))
        >>> out.clipped.grads["weight"].shape
        torch.Size([2, 4])
    """

    if physical_batch_size is None:
        # A known gap (README): the graphs' row counts then follow the realised batch sizes,
        # and the BLAS can round an example's values differently at another row count.
        warnings.warn(
            "compile_dp: physical_batch_size is left to its default, sizes that follow the realised "
            "batch sizes (anchored at the first batch). A BLAS (MKL, measured) can round an example's values "
            "differently in graphs of different row counts, and crafted examples at a rounding "
            "threshold can then move the clipped sum by more than C (README, 'A known gap'). Pass "
            "physical_batch_size set from public numbers (e.g. the expected batch size q*N).",
            SoundnessWarning,
            stacklevel=2,
        )

    def build(fn: Callable[..., Any]) -> DPStep:
        return DPStep(
            fn,
            model=model,
            clipping_norm=clipping_norm,
            batch_argnums=batch_argnums,
            physical_batch_size=physical_batch_size,
            backend=backend,
            key=key,
            rewrites=rewrites,
            max_physical_sizes=max_physical_sizes,
        )

    return build if loss_fn is None else build(loss_fn)
