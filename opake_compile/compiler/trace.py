"""Stage 1 of the pipeline: trace the per-example gradient graph.

Given the user's *batch* loss ``loss_fn(model, *args)``, the per-example loss is the same
function evaluated on a batch of one. We differentiate it with respect to the trainable
parameters only (``requires_grad=True``; frozen parameters and buffers are inputs that are never
differentiated), vectorise over a fixed physical batch of P examples with
``torch.func.vmap(..., randomness="different")``, and trace the whole computation into an
ATen-level FX graph with ``make_fx`` in fake mode (no real computation happens).

The traced graph has flat tensor inputs, in this order (see :class:`InputLayout`)::

    trainable params | frozen params and buffers | clipping_norm (0-d) | mask (P,) bool
    | batched argument leaves (P, ...) | broadcast tensor leaves | [batch draws (D,)]

(the batch draws, uniform on [0, 1) and drawn once per logical batch, exist only for models
with LayerDrop in training mode; see :mod:`opake_compile.patches`, which also lists what else
is adjusted while tracing: data-inspecting shortcuts, in-place masked writes, SpecAugment)

and returns ``(per_example_losses (P,), G_1 (P, *shape_1), ..., G_k (P, *shape_k))``: one
materialised per-example gradient per trainable parameter. The pass stage
(:mod:`opake_compile.compiler.passes`) turns these into a clipped sum.

Checks that library code makes on input values in Python (transformers' CTC label check, the
CTC kernel's range checks) cannot run in the graph; patched code registers them while tracing
(:mod:`opake_compile.compiler._input_checks`) and :attr:`TracedGraph.input_checks` carries them
to the step, which runs them on the real batch first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import optree
import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode

from opake_compile import patches as _patches
from opake_compile.compiler import _input_checks
from opake_compile.compiler._graph_utils import draws_randomness
from opake_compile.compiler._rnn import recurrent_ops
from opake_compile.compiler._sdpa import batched_attention
from opake_compile.exceptions import ConfigurationError, InputTypeError, UnsupportedOperationError

__all__ = ["InputLayout", "TracedGraph", "check_model_supported", "relax_stride_assumptions", "trace_per_example_grads"]


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """How the flat graph inputs map back to the user's model and arguments."""

    trainable: tuple[str, ...]
    others: tuple[str, ...]  # frozen parameter and buffer names (prefixed "param:"/"buffer:")
    batched_positions: tuple[int, ...]
    args_treedef: Any  # optree spec of the positional args tuple
    leaf_kinds: tuple[str, ...]  # per args leaf: "batched" | "broadcast" | "const"
    const_leaves: tuple[Any, ...]  # the non-tensor leaves, baked into the graph
    physical_batch_size: int
    # Uniform draws shared by the whole logical batch (LayerDrop; see opake_compile.patches):
    # a last graph input of shape (batch_draws,), present only when batch_draws > 0.
    batch_draws: int = 0

    @property
    def num_leading(self) -> int:
        return len(self.trainable) + len(self.others) + 2


@dataclasses.dataclass
class TracedGraph:
    """The output of stage 1: the per-example gradient graph and its input layout."""

    gm: fx.GraphModule
    layout: InputLayout
    param_shapes: dict[str, tuple[int, ...]]
    has_randomness: bool
    # Checks on the real batch, run before the graph (see opake_compile.compiler._input_checks).
    input_checks: tuple[_input_checks.InputCheck, ...] = ()


class _LossModule(nn.Module):
    """Holds the user's model as a submodule so that ``functional_call`` can swap its
    parameters while the user's ``loss_fn(model, *args)`` runs unchanged."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self._loss_fn = loss_fn

    def forward(self, *args: Any) -> torch.Tensor:
        return self._loss_fn(self.model, *args)


def _is_view_op(target: Any) -> bool:
    """Whether ``target`` returns an alias of its first argument (``Tensor(a)`` in its schema)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    rets = target._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def relax_stride_assumptions(gm: fx.GraphModule) -> int:
    """Replace ``aten.view`` / ``aten._unsafe_view`` by ``aten.reshape`` where nothing can tell
    the difference. In place; returns how many nodes were replaced.

    ``make_fx`` records the ``view`` calls that the eager kernels made, each valid for the
    strides the *eager* kernels produced. A backend that traces the graph again may lay out
    intermediates differently (Inductor's decomposition of ``cat`` with an empty part, as in
    a Hugging Face decoder's empty key/value cache, returns another stride), and a ``view``
    of such a tensor raises "Cannot view a tensor with shape ... and strides ...". ``reshape``
    is a view whenever one is possible and a copy otherwise, so it computes the same values
    under any layout. The one observable difference is aliasing, so views stay views in any
    storage group (tensors linked by view ops) that an in-place op writes to.
    """
    graph = gm.graph
    parent: dict[fx.Node, fx.Node] = {}

    def root(n: fx.Node) -> fx.Node:
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    for node in graph.nodes:
        if node.op == "call_function" and _is_view_op(node.target) and node.args and isinstance(node.args[0], fx.Node):
            parent[root(node)] = root(node.args[0])
    written = set()
    for node in graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            for arg in node.all_input_nodes:
                written.add(root(arg))
    relaxable = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in relaxable or not isinstance(node.args[0], fx.Node):
            continue
        if root(node) in written or root(node.args[0]) in written:
            continue
        node.target = torch.ops.aten.reshape.default
        count += 1
    return count


def _inside_activation_checkpointing(err: BaseException) -> bool:
    """Whether ``err`` was raised inside ``torch.utils.checkpoint`` (read from the traceback):
    its message then speaks of saved-tensor hooks or an ``autograd.Function`` without a vmap
    rule, and the module named is the one that called it (review: the root, or GPT-2's
    embedding)."""
    suffix = os.path.join("torch", "utils", "checkpoint.py")
    return any(frame.f_code.co_filename.endswith(suffix) for frame, _ in traceback.walk_tb(err.__traceback__))


def _failing_module(model: nn.Module, err: BaseException) -> str:
    """`` in module 'name' (Type)`` for the innermost module of ``model`` whose code was running
    when ``err`` was raised (read from the traceback), or ``""`` if none was."""
    names = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        names.setdefault(id(mod), name)
    found = None
    for frame, _ in traceback.walk_tb(err.__traceback__):
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            found = owner
    if found is None:
        return ""
    return f" in module {names[id(found)] or '<root>'!r} ({type(found).__name__})"


@contextlib.contextmanager
def _model_left_unchanged(model: nn.Module) -> Iterator[None]:
    """Restore every parameter, buffer and submodule slot of ``model`` after tracing.

    ``functional_call`` swaps fake tensors into the model's slots and swaps the originals back
    afterwards; when one object is reachable under several names (a submodule registered
    twice, ``self.b = self.a``; a shared parameter or buffer), the swap back can restore a
    fake tensor into a slot that was already swapped. Tracing must never modify the user's
    model, so every slot is recorded by identity before and put back as it was after, whatever
    the aliasing and whether tracing succeeded.

    A forward that stores a tensor on its module (``self.last = x``, or in a list, tuple, dict
    or set attribute: ``self.seen.append(x)``) stores one of the trace's batched fake tensors,
    which holds no data: any later use of it fails far from the cause. Such an attribute is
    put back to what it held before tracing (removed if it is new; a container changed in
    place gets its old contents back). The compiled step runs the graph, not the forward, so
    it is not set on later calls either. A tensor stored deeper (on an object the module
    holds) is not found.
    """
    modules = list(model.modules())  # each module object once, aliases included
    saved = [(m, store, dict(getattr(m, store))) for m in modules for store in ("_parameters", "_buffers", "_modules")]
    attrs = [(m, dict(vars(m)), {k: _contents(v) for k, v in vars(m).items() if type(v) in _MUTABLE}) for m in modules]
    try:
        yield
    finally:
        for mod, before, contents in attrs:
            now = vars(mod)
            for key, value in list(now.items()):
                if not _holds_tensor(value):
                    continue
                if before.get(key, _MISSING) is not value:
                    if key in before:
                        now[key] = before[key]
                    else:
                        del now[key]
                elif key in contents and not _same_contents(_contents(value), contents[key]):
                    _refill(value, contents[key])
        for mod, store, before in saved:
            slots = getattr(mod, store)
            for key, obj in before.items():
                if slots.get(key, _MISSING) is not obj:
                    slots[key] = obj
            for key in [k for k in slots if k not in before]:
                del slots[key]


_MISSING = object()
_MUTABLE = (list, dict, set)


def _holds_tensor(value: Any) -> bool:
    """A tensor, or a list, tuple, dict or set holding one (one level deep)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) for v in value.values())
    return isinstance(value, (list, tuple, set)) and any(isinstance(v, torch.Tensor) for v in value)


def _contents(value: Any) -> Any:
    return list(value.items()) if isinstance(value, dict) else list(value)


def _same_contents(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y or (isinstance(x, tuple) and isinstance(y, tuple) and all(p is q for p, q in zip(x, y))) for x, y in zip(a, b))


def _refill(value: Any, contents: list) -> None:
    """Put ``contents`` (from :func:`_contents`) back into the container ``value`` in place."""
    if isinstance(value, list):
        value[:] = contents
    else:  # a dict (its (key, value) pairs) or a set
        value.clear()
        value.update(contents)


_BACKWARD_HOOK = (
    "{where} (a register_full_backward_hook or ..._pre_hook) cannot run in "
    "compile_dp's trace: the per-example gradients are traced with torch.func, and torch's "
    "backward-hook function has no functorch support. "
    "Remove it (handle.remove()) while training privately, or do its work in a forward hook or in "
    "the loss."
)


def check_model_supported(model: nn.Module) -> None:
    """Refuse modules that mix examples or mutate state during the loss.

    Raises:
        UnsupportedOperationError: a BatchNorm that normalises with batch statistics: in
            training mode, or built with ``track_running_stats=False`` (which uses batch
            statistics in every mode). Batch statistics mix examples, and the running-statistics
            update would leak every example into a buffer. An ``nn.Embedding`` or
            ``nn.EmbeddingBag`` with ``max_norm``: its forward rescales, in place, the weight
            rows that the batch's ids pick (in every mode, trainable or not), a write of the
            batch into the model outside the clipped, noised gradient; a trainable one with
            ``sparse=True`` (sparse gradients). The message names the module.
    """
    from torch.nn.modules import module as _module

    if (_module._global_is_full_backward_hook and _module._global_backward_hooks) or _module._global_backward_pre_hooks:
        raise UnsupportedOperationError(_BACKWARD_HOOK.format(where="A global full backward hook of modules"))
    for name, mod in model.named_modules():
        where = f"Module {name or '<root>'!r} ({type(mod).__name__})"
        if (mod._is_full_backward_hook and mod._backward_hooks) or mod._backward_pre_hooks:
            raise UnsupportedOperationError(_BACKWARD_HOOK.format(where=f"The full backward hook of module {name or '<root>'!r} ({type(mod).__name__})"))
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.max_norm is not None:
            raise UnsupportedOperationError(
                f"{where} has max_norm={mod.max_norm!r}: its forward renormalises, in place, the rows of "
                "its weight that the batch's ids select, which writes the batch into the model outside the "
                "clipped and noised gradient. Build it with max_norm=None (clipping bounds each example's "
                "gradient instead), or renormalise the weight yourself after the optimizer step."
            )
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse and mod.weight.requires_grad:
            raise UnsupportedOperationError(
                f"{where} has sparse=True: its gradient is a sparse tensor, which the per-example "
                "transform cannot form or clip. Build it with sparse=False: compile_dp never forms an "
                "embedding's dense per-example gradient (its norm is computed from the rows each example "
                "uses), so the dense sum costs one table-sized gradient, as in non-private training."
            )
        if not isinstance(mod, nn.modules.batchnorm._BatchNorm):
            continue
        if mod.training:
            raise UnsupportedOperationError(
                f"{where} is in training mode: batch normalisation mixes examples, so "
                "per-example gradients are not defined. Use GroupNorm/LayerNorm, or call .eval() "
                "on it to use fixed running statistics."
            )
        if mod.running_mean is None or mod.running_var is None:
            raise UnsupportedOperationError(
                f"{where} has no running statistics (track_running_stats=False), so it normalises "
                "with the statistics of the batch in every mode: that mixes examples. Use "
                "GroupNorm/LayerNorm instead."
            )


def _written_inputs(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, fx.Node]]:
    """``(placeholder, node)`` for each operator ``node`` of the graph that writes into a
    graph input in place (an argument its schema marks as written, ``out=`` included, reached
    through views of the input)."""
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
            continue
        for i, arg in enumerate(target._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.kwargs.get(arg.name) if arg.kwarg_only or i >= len(node.args) else node.args[i]
            while isinstance(value, fx.Node) and value.op == "call_function" and isinstance(value.target, torch._ops.OpOverload):
                first = value.target._schema.arguments[:1]
                if not first or first[0].alias_info is None or first[0].alias_info.is_write:
                    break
                value = value.args[0]  # a view: its base
            if isinstance(value, fx.Node) and value.op == "placeholder":
                yield value, node


def _check_no_state_written(gm: fx.GraphModule, model: nn.Module, state_names: Sequence[str]) -> None:
    """Refuse a forward that writes into the model's parameters or buffers in place, even with
    values that do not depend on the examples (a call counter, ``spectral_norm``'s power
    iteration): the step runs the graph once per physical chunk, and not at all for an empty
    batch, so the state would count the chunks, a function of the batch size that no noise
    covers, and it ships with the model (review: a counter rose by 2, 0, 1, 3, 4 for batches of
    8, 0, 3, 9, 13 examples at physical_batch_size=4). Writes of per-example values are refused
    while tracing (:func:`_writes_into_shared_state`)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {p: i for i, p in enumerate(placeholders[: len(state_names)])}
    for placeholder, node in _written_inputs(gm):
        i = index.get(placeholder)
        if i is None:
            continue
        kind, name = state_names[i].split(":", 1) if ":" in state_names[i] else ("param", state_names[i])
        what = "buffer" if kind == "buffer" else "parameter"
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        module = type(model.get_submodule(owner)).__name__ if owner else type(model).__name__
        raise UnsupportedOperationError(
            f"The forward writes into the model's {what} {name!r} (of {module}) in place "
            f"({node.target.__name__}): compile_dp runs the forward once per physical chunk of the "
            "batch, and not at all for an empty batch, so the "
            f"{what} would count the chunks, a function of the private batch size that no noise covers "
            "(and it ships with the model). Keep such updates out of the forward while training "
            "privately (skip them when torch.compiler.is_compiling()), and make them once per step "
            "yourself after optimizer.step() if they do not depend on the data. spectral_norm in "
            "training mode updates its power-iteration vectors this way: put that module in eval() "
            "for the step and run its power iteration on the updated weight after each step."
        )


def _split_args(
    args: tuple, batched_positions: Sequence[int]
) -> tuple[list[Any], Any, list[str], list[Any]]:
    leaves, treedef = optree.tree_flatten(args, none_is_leaf=True)
    paths = optree.tree_paths(args, none_is_leaf=True)
    kinds = []
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor):
            kinds.append("batched" if path[0] in batched_positions else "broadcast")
        else:
            kinds.append("const")
    return leaves, treedef, kinds, paths


def _check_arity(loss_fn: Callable[..., Any], nargs: int) -> None:
    """Refuse a call whose arguments ``loss_fn(model, *args)`` cannot take, as Python would,
    before tracing (where the TypeError would read as an untraceable loss)."""
    import inspect

    try:
        sig = inspect.signature(loss_fn, follow_wrapped=False)  # a decorator's own parameters
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, *([None] * nargs))
    except TypeError as err:
        raise InputTypeError(
            f"loss_fn{sig} is called as loss_fn(model, *batch) with {nargs} batch argument(s): {err}."
        ) from None


# Products whose eager kernels refuse operands of different dtypes; their fake (tracing) kernels
# under vmap do not always check, so such a graph would fail (or, compiled, misread) at run time.
_SAME_DTYPE_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "baddbmm", "mv", "dot", "convolution")
)


def _check_operand_dtypes(
    gm: fx.GraphModule, named: dict[str, torch.Tensor], leaves: Sequence[Any], kinds: Sequence[str]
) -> None:
    """Refuse a traced product whose floating-point operands differ in dtype (a float64 batch
    into a float32 model), naming the op, the dtypes and the batch arguments that differ from
    the parameters, before anything runs."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _SAME_DTYPE_OPS:
            continue
        dtypes = {
            a.meta["val"].dtype
            for a in node.args
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
        }
        if len(dtypes) > 1:
            params = sorted({str(p.dtype) for p in named.values()})
            odd = sorted({
                str(l.dtype) for l, k in zip(leaves, kinds)
                if k != "const" and isinstance(l, torch.Tensor) and l.is_floating_point() and str(l.dtype) not in params
            })
            hint = (
                f" The batch holds {', '.join(odd)} tensors and the model's parameters are {', '.join(params)}: "
                "cast the batch to the model's dtype (or the model to the batch's)."
                if odd else ""
            )
            raise ConfigurationError(
                f"loss_fn multiplies tensors of different dtypes ({node.target.name()} on "
                f"{', '.join(sorted(str(d) for d in dtypes))}), which PyTorch refuses.{hint}"
            )


_ZEROS_OPS = frozenset((torch.ops.aten.zeros.default, torch.ops.aten.zeros_like.default, torch.ops.aten.new_zeros.default))
_PASS_THROUGH_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("view", "reshape", "expand", "clone", "_to_copy", "permute", "t", "unsqueeze", "squeeze", "alias", "detach")
)


def _check_depends_on_parameters(gm: fx.GraphModule, names: Sequence[str]) -> None:
    """Refuse a loss whose per-example gradients are zero by construction for every trainable
    parameter (a ``.detach()``-ed loss, a loss of the labels alone): every clipped sum would be
    zero and training would follow the noise alone, with no error from autograd as eagerly. (A
    gradient that is a nonzero constant, as of a bias under a linear score, trains.)"""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    grads = [g for g in out.args[0][1:] if isinstance(g, fx.Node)]
    if grads and all(_is_zeros(g) for g in grads):
        raise ConfigurationError(
            f"loss_fn's per-example gradient is zero for every input and every trainable parameter "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}): the loss does not depend on "
            "them (a .detach() or .item() on the loss, or a loss of the labels alone?). Training would "
            "follow the noise alone."
        )


def _is_zeros(node: fx.Node) -> bool:
    """Whether ``node`` is zeros whatever the inputs: a zeros-creating op (``zeros_like(p)``,
    the gradient of a parameter the loss does not reach), through views, copies and casts."""
    while node.op == "call_function" and node.target in _PASS_THROUGH_OPS:
        node = node.args[0]
    if node.op != "call_function":
        return False
    if node.target in _ZEROS_OPS:
        return True
    fill = {torch.ops.aten.full.default: 1, torch.ops.aten.full_like.default: 1, torch.ops.aten.new_full.default: 2}
    return node.target in fill and len(node.args) > fill[node.target] and node.args[fill[node.target]] == 0


@contextlib.contextmanager
def _quiet_fake_tensor_logs() -> Iterator[None]:
    """torch logs an error line per failing meta kernel while tracing; the failure reaches the
    user once, as our exception (with its cause chained)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _foreign(owner: Any) -> bool:
    """Whether ``owner`` is defined outside this package (a module named ``opake_compile_ext``
    is outside: its vmap rule mixed examples by 3.96 C when the prefix alone was tested)."""
    module = str(getattr(owner, "__module__", "") or "")
    return module != "opake_compile" and not module.startswith("opake_compile.")


#: Operator namespaces whose batching rules are torch's own.
_OWN_NAMESPACES = frozenset({"aten", "prims", "prim", "flex_lib", "torch_nn"})  # (flex_attention, chunked CE)


def _own_operators() -> frozenset[str]:
    """This library's operators with batching rules (the CTC loss, :mod:`opake_compile._ctc`)."""
    from opake_compile import _ctc

    return frozenset({_ctc._ctc_nll._qualname, _ctc._ctc_nll_backward._qualname})


def _has_batching_rule(name: str) -> bool:
    try:
        return any(
            torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
            for key in ("FuncTorchBatched", "FuncTorchBatchedDecomposition")
        )
    except RuntimeError:  # an operator the dispatcher does not hold (TorchScript's own)
        return False


class _RefuseForeignBatchingRules(TorchFunctionMode):
    """Sees every torch call while tracing; refuses an operator outside :data:`_OWN_NAMESPACES`
    (and this library's own) that has a batching rule (a ``FuncTorchBatched`` or
    ``FuncTorchBatchedDecomposition`` kernel: ``torch.library.register_vmap``,
    ``custom_op(...).register_vmap``). Code that hides its calls from torch-function modes
    (``torch._C.DisableTorchFunction``) is deliberate circumvention and is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.checked: set[str] = set(_own_operators())

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if isinstance(func, torch._ops.OpOverloadPacket):
            name = func._qualified_op_name
        elif isinstance(func, torch._ops.OpOverload):
            name = func._schema.name
        else:
            name = None
        if name is not None and name not in self.checked:
            if name.split("::", 1)[0] not in _OWN_NAMESPACES and _has_batching_rule(name):
                raise UnsupportedOperationError(
                    f"Custom operator {name} has a vmap rule (register_vmap): opake_compile cannot check that it "
                    "keeps the examples of a batch apart (a rule that mixes them breaks the clipping bound). "
                    "Register no vmap rule (torch then loops over the examples, or raises), or write the "
                    "operator with torch ops."
                )
            self.checked.add(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _own_batching_rules_only() -> Iterator[None]:
    """Refuse, while tracing (and while the eager reference vmaps), code that batches itself:
    an ``autograd.Function`` with its own ``vmap`` staticmethod, or an operator with a
    ``register_vmap`` rule (``custom_op`` or ``torch.library``). A batching rule sees the whole batch, and nothing checks that it keeps
    examples apart (a hostile review's ``x + 100 * x.mean(0)`` moved the clipped sum by 11 C
    when one example was replaced). ``generate_vmap_rule=True`` is accepted: its forward is
    vmapped op by op."""
    import torch.autograd.function as autograd_function

    original = autograd_function.custom_function_call

    def guarded(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(cls, "generate_vmap_rule", False) and cls.vmap is not torch.autograd.Function.vmap and _foreign(cls):
            raise UnsupportedOperationError(
                f"autograd.Function {cls.__qualname__} has its own vmap rule: opake_compile cannot check that "
                "it keeps the examples of a batch apart (a rule that mixes them breaks the clipping bound). "
                "Set generate_vmap_rule = True (its forward is then vmapped op by op), or write it with "
                "torch ops."
            )
        return original(cls, *args, **kwargs)

    autograd_function.custom_function_call = guarded
    try:
        with _RefuseForeignBatchingRules():
            yield
    finally:
        autograd_function.custom_function_call = original


#: Phrases of torch's shape and dtype errors (an argument passed in the wrong order or dtype).
_ARGUMENT_ERRORS = ("shape", "size", "dtype", "scalar type", "same reduction dim", "must match", "dimension", "target tensor")


def _looks_like_an_argument_error(err: BaseException) -> bool:
    """Whether a tracing failure reads like a shape or dtype mismatch (not a data-dependent
    branch or a missing vmap rule); only the message's wording is used, nothing is re-run."""
    text = str(err).lower()
    return isinstance(err, (RuntimeError, ValueError, IndexError, AssertionError)) and any(p in text for p in _ARGUMENT_ERRORS) and (
        "vmap" not in text and "functorch" not in text and "data-dependent" not in text
    )


_SHARED_WRITE = re.compile(
    r"output with shape (?:torch\.Size\()?\[([\d, ]*)\]\)? doesn't match the broadcast shape (?:torch\.Size\()?[\[(](\d+),? ?([\d, ]*)[\])]"
)


def _writes_into_shared_state(err: BaseException, physical_batch_size: int) -> bool:
    """Whether a tracing failure is an in-place write of per-example values into a tensor that
    all examples share (a buffer or parameter updated inside forward): under ``vmap`` the
    target has the shape of one example's value while the written value has the examples in
    front (``output with shape [8] doesn't match the broadcast shape [P, 8]``), or functorch
    says so itself."""
    text = str(err)
    if "inplace arithmetic" in text and "vmap" in text:
        return True
    m = _SHARED_WRITE.search(text)
    return bool(m and int(m.group(2)) == physical_batch_size and m.group(1).replace(" ", "") == m.group(3).replace(" ", ""))


def trace_per_example_grads(
    model: nn.Module,
    loss_fn: Callable[..., Any],
    args: tuple,
    *,
    batched_positions: Sequence[int],
    physical_batch_size: int,
) -> TracedGraph:
    """Trace ``vmap(grad(per-example loss))`` over the trainable parameters into ATen FX.

    Tracing runs under :func:`opake_compile.patches.tracing_patches` (undone on return or
    error): library shortcuts that inspect data take their always-valid branch, in-place masked
    writes become ``where``, LayerDrop selects layers in the graph from the batch draws, and
    SpecAugment draws its masks in the graph, per example.

    Args:
        model: the user's module; its current ``requires_grad`` flags define the trainable
            partition.
        loss_fn: ``loss_fn(model, *args) -> scalar`` written for a whole batch.
        args: example positional arguments; batched tensors must already be padded to
            ``physical_batch_size`` along dim 0 (only shapes and dtypes are used).
        batched_positions: positions of ``args`` whose tensor leaves carry the batch.
        physical_batch_size: P, the fixed batch the graph is traced for.

    Raises:
        UnsupportedOperationError: tracing failed (data-dependent control flow, an op without
            a fake/vmap implementation, a non-scalar loss, ...). The message says which.
        ConfigurationError: a product of operands of different dtypes (a float64 batch into
            a float32 model).
        InputTypeError: no trainable parameter.
    """
    check_model_supported(model)
    _check_arity(loss_fn, len(args))
    named = dict(model.named_parameters())
    trainable = tuple(n for n, p in named.items() if p.requires_grad)
    if not trainable:
        raise InputTypeError("The model has no trainable parameter (requires_grad=True): nothing to privatise.")
    frozen = tuple(n for n, p in named.items() if not p.requires_grad)
    buffers = tuple(n for n, _ in model.named_buffers())
    others = tuple(f"param:{n}" for n in frozen) + tuple(f"buffer:{n}" for n in buffers)

    leaves, treedef, kinds, _ = _split_args(args, batched_positions)
    const_leaves = tuple(l for l, k in zip(leaves, kinds) if k == "const")
    n_draws = _patches.count_batch_draws(model)
    layout = InputLayout(
        trainable=trainable,
        others=others,
        batched_positions=tuple(batched_positions),
        args_treedef=treedef,
        leaf_kinds=tuple(kinds),
        const_leaves=const_leaves,
        physical_batch_size=physical_batch_size,
        batch_draws=n_draws,
    )
    draws = _patches._BatchDraws()
    wrapper = _LossModule(model, loss_fn)
    n_tr, n_ot = len(trainable), len(others)
    tensor_kinds = [k for k in kinds if k != "const"]

    def rebuild_args(tensor_leaves: Sequence[Any]) -> tuple:
        it_t, it_c = iter(tensor_leaves), iter(const_leaves)
        flat = [next(it_c) if k == "const" else next(it_t) for k in kinds]
        return optree.tree_unflatten(treedef, flat)

    def per_example_loss(train: dict[str, torch.Tensor], other_vals: Sequence[torch.Tensor], *tensor_leaves: torch.Tensor) -> torch.Tensor:
        leaves_b1 = [
            t.unsqueeze(0) if k == "batched" else t for t, k in zip(tensor_leaves, tensor_kinds)
        ]
        state = {f"model.{n}": v for n, v in train.items()}
        for key, v in zip(others, other_vals):
            state["model." + key.split(":", 1)[1]] = v
        loss = torch.func.functional_call(wrapper, state, rebuild_args(leaves_b1))
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            if isinstance(loss, torch.Tensor):
                # Traced one example at a time (a batch of one): a per-example loss of shape
                # (B, ...) shows here as (1, ...); say so rather than print a shape the user never made.
                got = f"a tensor of shape {tuple(loss.shape)} when traced on one example (a batch of one)"
            else:
                got = type(loss).__name__
            raise UnsupportedOperationError(
                f"loss_fn must return a scalar tensor for a batch (mean or sum reduction, not "
                f"reduction='none'); got {got}."
            )
        return loss

    in_dims = (None, None, *[0 if k == "batched" else None for k in tensor_kinds])
    per_example = torch.func.vmap(
        torch.func.grad_and_value(per_example_loss), in_dims=in_dims, randomness="different"
    )

    def graph_fn(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        train = dict(zip(trainable, flat[:n_tr]))
        other_vals = flat[n_tr : n_tr + n_ot]
        tensor_leaves = flat[n_tr + n_ot + 2 : len(flat) - (1 if n_draws else 0)]
        draws.values = flat[-1] if n_draws else None
        with batched_attention():  # one fused SDPA call per layer, not one per example
            grads, losses = per_example(train, other_vals, *tensor_leaves)
        return (losses, *[grads[n] for n in trainable])

    state_tensors = [named[n].detach() for n in trainable]
    state_tensors += [named[n].detach() for n in frozen]
    state_tensors += [b.detach() for _, b in model.named_buffers()]
    # The step passes C, the row mask and the draws on the device of the model's first trainable
    # parameter (step.py); traced on the CPU, the mask met CUDA norms in the clipping pass.
    device = state_tensors[0].device if state_tensors else torch.device("cpu")
    clip = torch.zeros((), dtype=torch.float64, device=device)
    mask = torch.zeros(physical_batch_size, dtype=torch.bool, device=device)
    tensor_leaves = [l for l, k in zip(leaves, kinds) if k != "const"]
    extra = [torch.zeros(n_draws, dtype=torch.float32, device=device)] if n_draws else []
    try:
        # recurrent_ops: RNN/GRU/LSTM and packed sequences; tracing_patches: masks, LayerDrop, SpecAugment, CTC.
        with _model_left_unchanged(model), recurrent_ops(), _patches.tracing_patches(model, draws), \
                _input_checks.recording() as recorder, _own_batching_rules_only(), _quiet_fake_tensor_logs():
            gm = make_fx(graph_fn, tracing_mode="fake", _allow_non_fake_inputs=True)(
                *state_tensors, clip, mask, *tensor_leaves, *extra
            )
    except UnsupportedOperationError:
        raise
    except Exception as err:  # noqa: BLE001 - re-raised with context, never swallowed
        where = _failing_module(model, err)
        if _writes_into_shared_state(err, physical_batch_size):
            raise UnsupportedOperationError(
                f"Could not trace the per-example gradient of loss_fn{where}: {type(err).__name__}: {err}. "
                "The forward writes values computed from the examples into a tensor they all share, "
                "in place (a buffer or parameter updated inside forward, such as a running "
                "statistic). compile_dp evaluates the loss one example at a time, and state "
                "updated from the batch would also leave the step holding data that no noise "
                "covers: keep such updates out of the forward while training privately (or skip "
                "them when torch.compiler.is_compiling())."
            ) from err
        if _looks_like_an_argument_error(err):
            # The arguments', not an operation compile_dp lacks: a ConfigurationError, as the
            # mixed-dtype refusal above is (a newcomer's review: float64 and int64 batches got
            # two different classes).
            params = sorted({str(named[n].dtype) for n in trainable})
            given = sorted({str(l.dtype) for l, k in zip(leaves, kinds)
                            if k != "const" and isinstance(l, torch.Tensor)})
            raise ConfigurationError(
                f"Could not trace the per-example gradient of loss_fn{where}: {type(err).__name__}: {err}. "
                "A shape or dtype mismatch: check the order, shapes and dtypes of the step's arguments "
                "(the step calls loss_fn(model, *args) with them as passed, e.g. step(x, y) for "
                "loss_fn(model, x, y); class labels are integers). The step's tensor arguments are "
                f"{', '.join(given) or 'none'}, the trainable parameters {', '.join(params) or 'none'}."
            ) from err
        if _inside_activation_checkpointing(err):
            raise UnsupportedOperationError(
                f"Could not trace the per-example gradient of loss_fn{where}: it runs activation "
                "checkpointing (torch.utils.checkpoint), which torch.func cannot differentiate per "
                f"example ({type(err).__name__}: {err}). Turn it off for the private step (transformers "
                "models: model.gradient_checkpointing_disable()): compile_dp does not keep per-example "
                "gradients, so its memory is close to the non-private step's without recomputation."
            ) from err
        # transformers' mixture-of-experts blocks (MixtralExperts, ...): the default kernels
        # group tokens by expert with data-dependent shapes; "batched_mm" traces (review).
        experts = " (transformers mixture of experts: build the model with experts_implementation=\"batched_mm\")" if (
            "Experts)" in where) else ""
        raise UnsupportedOperationError(
            f"Could not trace the per-example gradient of loss_fn{where} ({type(err).__name__}: {err}). "
            "compile_dp needs a loss whose operations are traceable without looking at data "
            "values (no Python branches on tensor values, no .item()) and have vmap rules: "
            "rewrite that code with tensor ops (torch.where instead of an if on a tensor), "
            f"or freeze its parameters (requires_grad=False) if it need not be trained{experts}."
        ) from err
    _check_operand_dtypes(gm, named, tensor_leaves, tensor_kinds)
    _check_no_state_written(gm, model, trainable + others)
    _check_depends_on_parameters(gm, trainable)
    first_leaf = n_tr + n_ot + 2
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    input_checks = recorder.build(gm, placeholders[first_leaf : first_leaf + len(tensor_leaves)])
    for what in recorder.dropped:
        warnings.warn(
            f"compile_dp cannot check {what} on the real batch before the step runs (the checked "
            "value depends on more than the batch arguments); such a batch fails inside the step instead.",
            stacklevel=3,
        )
    gm.graph.eliminate_dead_code()
    relax_stride_assumptions(gm)
    gm.recompile()
    has_random = any(draws_randomness(n) for n in gm.graph.nodes)
    shapes = {n: tuple(named[n].shape) for n in trainable}
    return TracedGraph(gm=gm, layout=layout, param_shapes=shapes, has_randomness=has_random, input_checks=input_checks)
