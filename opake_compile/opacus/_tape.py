"""The loss program of an eager Opacus-style loop, recorded so it can be run per example.

The compatibility layer's model returns its output as a :class:`TapeTensor`: an ordinary tensor
holding the real values (so ``loss.item()``, accuracy and logging work before ``.backward()``)
whose ``__torch_function__`` records every torch operation applied to it and to what derives
from it. ``loss.backward()`` on the result is intercepted: the recorded operations from the
model output to the loss form a small program ``f(output, *external tensors)``, which can be
evaluated again on one example at a time (a batch of one, under ``torch.func.vmap``) or compiled
together with the model by ``compile_dp``.

That is what makes the per-example gradients per example *by construction*: every per-example
quantity comes from the program run on a batch of one, never from the batch's autograd graph.
:func:`check_separable` then compares the program on the whole batch with the per-example
values and refuses a loss that mixes examples (or whose reduction is not the declared one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from opake_compile._statistics import batch_statistics as _batch_statistics
from opake_compile._statistics import is_real_number as _real
from opake_compile.exceptions import UnsupportedOperationError

__all__ = ["Program", "Tape", "TapeTensor", "check_separable"]

# Functions whose non-tensor result carries data values (not shapes or metadata). A Python
# number obtained this way and fed back into the loss would scale every example's gradient
# by a statistic of the whole batch.
_DATA_SCALARS = {"item", "tolist", "__float__", "__int__", "__index__", "numpy", "__array__"}

# Functions that scale a tensor by a number (a Python scalar or a one-element tensor).
_SCALINGS = {
    "__truediv__", "__rtruediv__", "__itruediv__", "__mul__", "__rmul__", "__imul__",
    "div", "div_", "divide", "true_divide", "true_divide_", "mul", "mul_", "multiply",
}
# Reads of a recorded tensor's shape: the batch size can be read from the model output
# (``out.shape`` reaches __torch_function__ as the ``shape`` getter's ``__get__``).
_SHAPE_READS = {"size", "__len__", "numel"}
_SHAPE_GETTERS = {"shape"}


@dataclasses.dataclass(frozen=True)
class _Ref:  # not a tuple: optree must treat it as a leaf
    node: int


@dataclasses.dataclass(frozen=True)
class _Ext:
    index: int


@dataclasses.dataclass
class _Op:
    func: Callable[..., Any]
    args: Any
    kwargs: Any
    outs: tuple[tuple[int | None, int], ...]  # (position in a tuple result or None, node)


class Tape:
    """Operations recorded from one model output (node 0) onward.

    Attributes:
        owner: the object whose ``backward(loss)`` a ``loss.backward()`` calls.
        meta: what the forward recorded (the inputs and the draw they came from).
        ops, externals: the recorded operations and the tensors they read that do not derive
            from the output (labels, class weights).
        tainted: Python numbers read out of derived tensors (``.item()``, ``.tolist()``).
        shape_read: a shape of a recorded tensor was read (``out.shape``, ``len(out)``).
        mixed: an operation combined this output with another forward's output.
        consumed: ``backward`` already ran on this tape.
    """

    def __init__(self, owner: Any, meta: Any) -> None:
        self.owner = owner
        self.meta = meta
        self.ops: list[_Op] = []
        self.externals: list[torch.Tensor] = []
        self._ext_ids: dict[int, int] = {}
        self.tainted: list[float] = []
        self.shape_read = False
        self.mixed = False
        self.consumed = False
        self._next = 1

    def root(self, value: torch.Tensor) -> TapeTensor:
        """The model output as node 0 (``root_value`` keeps it as a plain tensor)."""
        self.root_value = value
        return TapeTensor._wrap(value, self, 0)

    def _spec(self, leaf: Any) -> Any:
        if isinstance(leaf, TapeTensor):
            return _Ref(leaf._node)
        if isinstance(leaf, torch.Tensor):
            i = self._ext_ids.get(id(leaf))
            if i is None or self.externals[i] is not leaf:
                i = len(self.externals)
                self.externals.append(leaf)
                self._ext_ids[id(leaf)] = i
            return _Ext(i)
        return leaf

    def record(self, func: Callable[..., Any], args: tuple, kwargs: dict, out: Any) -> Any:
        name = getattr(func, "__name__", "")
        if isinstance(out, torch.Tensor):
            node = self._next
            self._next += 1
            self._add(func, args, kwargs, ((None, node),))
            return TapeTensor._wrap(out, self, node)
        if isinstance(out, (tuple, list)) and out and all(isinstance(o, torch.Tensor) for o in out):
            outs = tuple((i, self._next + i) for i in range(len(out)))
            self._next += len(out)
            self._add(func, args, kwargs, outs)
            wrapped = [TapeTensor._wrap(o, self, node) for o, (_, node) in zip(out, outs)]
            try:
                return type(out)(wrapped)
            except TypeError:
                return tuple(wrapped)
        if name in _SHAPE_READS or (name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") in _SHAPE_GETTERS):
            self.shape_read = True
        if name in _DATA_SCALARS:
            self.tainted.extend(
                float(v) for v in optree.tree_leaves(out) if isinstance(v, (int, float)) and not isinstance(v, bool)
            )
        return out

    def _add(self, func: Callable[..., Any], args: tuple, kwargs: dict, outs: tuple) -> None:
        spec_args = optree.tree_map(self._spec, args, none_is_leaf=True)
        spec_kwargs = optree.tree_map(self._spec, kwargs, none_is_leaf=True)
        self.ops.append(_Op(func, spec_args, spec_kwargs, outs))

    def program(self, target: TapeTensor) -> Program:
        """The operations that lead from the output to ``target``, in order."""
        needed = {target._node}
        ops: list[_Op] = []
        for op in reversed(self.ops):
            if not any(node in needed for _, node in op.outs):
                continue
            ops.append(op)
            for leaf in optree.tree_leaves((op.args, op.kwargs), none_is_leaf=True):
                if isinstance(leaf, _Ref):
                    needed.add(leaf.node)
        ops.reverse()
        used = sorted(
            {l.index for op in ops for l in optree.tree_leaves((op.args, op.kwargs), none_is_leaf=True) if isinstance(l, _Ext)}
        )
        return Program(
            ops=tuple(ops), target=target._node, externals=tuple(used), tainted=tuple(self.tainted), shape_read=self.shape_read
        )


class TapeTensor(torch.Tensor):
    """A tensor that records the operations applied to it on its :class:`Tape`.

    It holds real values; only ``.backward()`` behaves differently (it hands the loss to the
    tape's owner). Results of operations on it are ``TapeTensor`` s of the same tape.
    """

    _tape: Tape
    _node: int

    @staticmethod
    def _wrap(value: torch.Tensor, tape: Tape, node: int) -> TapeTensor:
        with torch._C.DisableTorchFunctionSubclass():
            t = value.as_subclass(TapeTensor)
        t._tape = tape
        t._node = node
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tapes = {}
        for leaf in optree.tree_leaves((args, kwargs), none_is_leaf=True):
            if isinstance(leaf, TapeTensor):
                tapes[id(leaf._tape)] = leaf._tape
        if func is torch.Tensor.backward:
            return args[0]._tape.owner.backward(*args, **kwargs)
        # Run on plain views (same data): Python-level Tensor methods that test
        # ``type(self) is Tensor`` (``__format__``, ``__repr__``) then behave as usual.
        plain_args = optree.tree_map(_plain, args, none_is_leaf=True)
        plain_kwargs = optree.tree_map(_plain, kwargs, none_is_leaf=True)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*plain_args, **plain_kwargs)
        if len(tapes) != 1:
            # Several forward passes meet here: whatever derives from this is refused at
            # backward (a tape of its own, marked mixed).
            first = next(iter(tapes.values()))
            tape = Tape(first.owner, first.meta)
            tape.mixed = True
            return tape.record(func, args, kwargs, _plain(out))
        (tape,) = tapes.values()
        return tape.record(func, args, kwargs, _plain(out))

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.__repr__(self.as_subclass(torch.Tensor))


def _plain(out: Any) -> Any:
    """``out`` with any TapeTensor (an in-place result) viewed as a plain tensor."""
    if isinstance(out, TapeTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return out.as_subclass(torch.Tensor)
    if isinstance(out, (tuple, list)) and any(isinstance(o, TapeTensor) for o in out):
        items = [_plain(o) for o in out]
        try:
            return type(out)(items)
        except TypeError:
            return tuple(items)
    return out


@dataclasses.dataclass(frozen=True)
class Program:
    """``f(output, *externals) -> loss``: the recorded operations from node 0 to ``target``."""

    ops: tuple[_Op, ...]
    target: int
    externals: tuple[int, ...]  # indices into Tape.externals the program reads, in order
    tainted: tuple[float, ...]
    shape_read: bool = False

    def __call__(self, output: torch.Tensor, externals: Sequence[torch.Tensor]) -> torch.Tensor:
        values: dict[int, Any] = {0: output}
        ext = dict(zip(self.externals, externals))

        def value(leaf: Any) -> Any:
            if isinstance(leaf, _Ref):
                return values[leaf.node]
            if isinstance(leaf, _Ext):
                return ext[leaf.index]
            return leaf

        for op in self.ops:
            args = optree.tree_map(value, op.args, none_is_leaf=True)
            kwargs = optree.tree_map(value, op.kwargs, none_is_leaf=True)
            try:
                out = op.func(*args, **kwargs)
            except Exception as err:  # report which recorded operation failed
                raise UnsupportedOperationError(
                    f"The loss cannot be evaluated one example at a time: {_name(op.func)} raised "
                    f"{type(err).__name__}: {err}. Write the loss without naming the batch size "
                    "(view(-1, k) or flatten(1) instead of view(batch, -1); reduction='mean' or "
                    "'sum' instead of dividing by len(x))."
                ) from err
            for pos, node in op.outs:
                values[node] = out if pos is None else out[pos]
        return values[self.target]

    def key(self) -> Any:
        """A hashable description (functions and constants; tensors by position)."""
        return tuple((op.func, repr(op.args), repr(op.kwargs), op.outs) for op in self.ops), self.target, self.externals

    def check_constants(self) -> None:
        """Refuse a program that uses a number read out of the batch (``loss.item()``)."""
        if not self.tainted:
            return
        tainted = set(self.tainted)
        for op in self.ops:
            for leaf in optree.tree_leaves((op.args, op.kwargs), none_is_leaf=True):
                if isinstance(leaf, (int, float)) and not isinstance(leaf, bool) and float(leaf) in tainted:
                    raise UnsupportedOperationError(
                        f"The loss uses the number {leaf!r}, read out of the batch (.item(), "
                        f".tolist(), float(...)), in {_name(op.func)}: it would scale every "
                        "example's gradient by a statistic of the whole batch, which mixes "
                        "examples. Keep such values out of the loss (detach()ed tensors are "
                        "fine: they are evaluated per example)."
                    )


    def scaling_constants(self, externals: Sequence[torch.Tensor], n: int | None = None) -> tuple[Any, list[tuple[int, float, float]]]:
        """``(structure, constants)``: the program with its numbers masked (a key that is the
        same at every step of one loss), and each number that scales a value of the loss (a
        real number, a one-element tensor it reads, or, given the batch size ``n``, the common
        value of a batched tensor whose non-zero entries are all equal: ``torch.full((n,),
        1 / n)``, ``mask / mask.sum()``) as ``(position, value, relative tolerance)``, the
        tolerance that of the number's dtype."""
        ext = dict(zip(self.externals, externals))
        found: list[tuple[int, float, float]] = []
        position = 0

        def mask(leaf: Any) -> Any:
            return _NUMBER if _real(leaf) else leaf

        structure = []
        for op in self.ops:
            if getattr(op.func, "__name__", "") in _SCALINGS:
                for leaf in optree.tree_leaves((op.args, op.kwargs), none_is_leaf=True):
                    t = ext.get(leaf.index) if isinstance(leaf, _Ext) else None
                    common = None
                    if t is not None and (t.numel() == 1 or (n is not None and _batched(t, n))):
                        common = _common_value(t)
                    if common is not None:
                        tol = 4 * torch.finfo(t.dtype).eps if t.dtype.is_floating_point else 1e-9
                        found.append((position, common, tol))
                    elif _real(leaf):
                        found.append((position, float(leaf), 1e-9))
                    position += 1
            masked = optree.tree_map(mask, (op.args, op.kwargs), none_is_leaf=True)
            structure.append((op.func, repr(masked), op.outs))
        return (tuple(structure), self.target, self.externals), found

    def check_batch_size(self, n: int, externals: Sequence[torch.Tensor], history: dict[Any, Any]) -> None:
        """Refuse a loss scaled by the batch size or by another statistic of the batch: a
        division by ``len(x)`` (or a product with ``1 / x.size(0)``) is recorded as the
        constant ``n`` of this batch, so each example's loss, evaluated alone, carries the size
        of the batch it came in. Removing one example then changes every other example's
        gradient before clipping: a released sum moved by 1.88 C in a newcomer's construction,
        against the C the noise is for. A division by the batch's token count (``mask.sum()``)
        and per-example weights scaled by it (``mask / mask.sum()``) do the same (3.47 C in a
        hostile construction). The mean and sum over the batch (``reduction=``, ``.mean()``)
        are fine: they are evaluated per example.

        Which numbers are suspect, each with its inverse and within the number's rounding:
        ``n``, from ``n = 2`` when the loss read the shape of the model output or of a value
        derived from it, from ``n = 3`` otherwise (a batch size read from an input is not
        recorded, and a factor 2 or 1/2 is too common to refuse on its value alone); and from
        ``n = 2``, each statistic ``s >= 3`` of the batched tensors the loss reads
        (:func:`_batch_statistics`: a mask's count, a weight total, a count of token labels).
        A real number, a one-element tensor, or the common value of a batched tensor of
        weights that scales (multiplies or divides) a value of the loss is compared with all
        of them.

        A number is cleared for good, at its value, once it kept that value between two
        consecutive steps, matched a statistic at one of them, and every statistic it matched
        moved by more than the match's tolerance and :data:`_EVIDENCE` (``history``, kept by
        the caller per loss structure): a constant that equals a step's n or token count by
        chance is cleared at that step if the step before showed it (so refused only at the
        first step of a run), and a true statistic, which follows the batch, is never cleared,
        also where it matches nothing at some steps (a count of 0, a clamp, a rounding).

        These are value heuristics: a statistic in another form (``/ (2 * len(x))``), weights
        normalised over the batch that differ between examples (``w / w.sum()``) and products
        other than ``*`` and ``/`` (``@``, ``einsum``) are not recognised
        (docs/migrating-from-opacus.md).

        Raises:
            UnsupportedOperationError: such a constant, with the operation that uses it.
        """
        key, found = self.scaling_constants(externals, n)
        # Every statistic, whatever its value: the refusal below reads only n and those >= 3,
        # but clearing must see a true statistic match itself at every step (one of 2 tokens at
        # two steps, or one equal to n, would otherwise look like a constant and be cleared).
        stats = {("n",): (float(n), "n", 0.0)}
        for ident, value, what, slack in _batch_statistics([(i, t) for i, t in zip(self.externals, externals) if _batched(t, n)]):
            stats[ident] = (value, what, slack)
        last_stats, last_values, cleared = history.get(key, ({}, {}, frozenset()))
        values = {pos: v for pos, v, _ in found}

        def matches(v: float, tol: float, table: dict) -> dict:
            """The statistics of ``table`` that ``v`` equals, each -> whether as its inverse."""
            out = {}
            for ident, (s, _, slack) in table.items():
                t = max(tol, slack)
                if s > 0 and (abs(v - s) <= t * s or abs(v - 1.0 / s) <= t / s):
                    out[ident] = abs(v - s) > t * s
            return out

        def moved(ident: Any, tol: float) -> bool:
            """Whether a statistic present at both steps changed by more than a match allows,
            and by more than a rounding the number may carry beyond its stated tolerance (a
            float16 or bfloat16 sum read back as float32: :data:`_EVIDENCE`)."""
            if ident not in stats or ident not in last_stats:
                return False
            (a, _, slack_a), (b, _, slack_b) = stats[ident], last_stats[ident]
            return abs(a - b) > max(tol, slack_a, slack_b, _EVIDENCE) * max(abs(a), abs(b))

        cleared = set(cleared)  # (position, value): a constant keeps its value, a statistic does not
        for pos, v, tol in found:
            if (pos, v) in cleared or last_values.get(pos) != v:
                continue
            # Evidence needs a match: a true statistic can match nothing at a step (a count of
            # 0, a clamp such as max(count, 1), a rounding to bfloat16), and two such steps
            # proved nothing. A rounded statistic stays within the tolerance it was matched
            # with, so that is not a move either.
            seen = matches(v, tol, stats).keys() | matches(v, tol, last_stats).keys()
            if seen and all(moved(i, tol) for i in seen):
                cleared.add((pos, v))  # the number stayed while what it matched moved: a constant
        history[key] = (stats, values, frozenset(cleared))
        if n < 2:
            return  # one example: its own statistics are not the batch's
        for pos, v, tol in found:
            if (pos, v) in cleared:
                continue
            for ident, inverse in matches(v, tol, stats).items():
                s, what, _ = stats[ident]
                if (ident == ("n",) and n < (2 if self.shape_read else 3)) or (ident != ("n",) and (s < 3 or s == n)):
                    continue
                what = ("1 / n" if ident == ("n",) else f"1 / ({what})") if inverse else what
                raise UnsupportedOperationError(
                    f"The loss is scaled by {v!r}, and this batch has {n} examples ({v!r} is {what}): a "
                    "loss divided by the batch size (len(x), x.size(0)) or by another statistic "
                    "of the batch (its token count, mask.sum()) makes each example's gradient "
                    "depend on the others that came with it, which breaks the "
                    "sensitivity bound. Use the mean or sum over the batch (reduction='mean' "
                    "or 'sum', .mean()) and declare it with loss_reduction. A constant that "
                    "only happens to equal this batch's size or count is cleared once a batch "
                    "with another has shown it fixed: this draw is charged at the next step, "
                    "and the loop may go on with the next batch."
                )


_NUMBER = "<number>"

#: How far (relative) a statistic must move between two steps for a number that stayed to be
#: read as a constant: beyond a float16 or bfloat16 rounding of the statistic (2^-9, 2^-8)
#: that the number may carry although it was converted to float32 or read with ``.item()``.
_EVIDENCE = 2.0**-5


def _batched(t: torch.Tensor, n: int) -> bool:
    return t.dim() >= 1 and t.shape[0] == n


def _common_value(t: torch.Tensor) -> float | None:
    """The value every non-zero entry of ``t`` has (a batch-wide constant, or a mask scaled by
    one number), or None (no non-zero entry, or two different ones). A one-element tensor's
    value, zero included."""
    if t.is_complex() or t.is_sparse:
        return None
    flat = t.detach().reshape(-1)
    if flat.numel() == 1:
        return float(flat[0])
    nz = flat[flat != 0]
    if nz.numel() == 0 or not bool((nz == nz[0]).all()):
        return None
    return float(nz[0])


def _name(func: Any) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    mod = getattr(func, "__module__", None)
    return f"{mod}.{qual}" if mod and not qual.startswith("Tensor") else qual


def split_externals(program: Program, tape: Tape, n: int) -> tuple[list[torch.Tensor], list[bool]]:
    """The external tensors the program reads and whether each is batched (leading dim n)."""
    tensors = [_plain(tape.externals[i]) for i in program.externals]
    batched = [t.dim() >= 1 and t.shape[0] == n for t in tensors]
    return tensors, batched


def per_example(program: Program, output: torch.Tensor, externals: list[torch.Tensor], batched: list[bool], *, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(losses (n,), grads (n, *output.shape[1:]) or None)``: the program on each example
    alone (a batch of one), and its gradient with respect to that example's output row."""

    def loss_one(o: torch.Tensor, *b: torch.Tensor) -> torch.Tensor:
        it = iter(b)
        ext = [next(it).unsqueeze(0) if bt else t for t, bt in zip(externals, batched)]
        value = program(o.unsqueeze(0), ext)
        if value.dim() != 0:
            raise UnsupportedOperationError(
                f"The loss of one example has shape {tuple(value.shape)}, not a scalar: reduce it "
                "with reduction='mean' or 'sum' (loss.backward() needs a scalar)."
            )
        return value

    b_ext = [t for t, bt in zip(externals, batched) if bt]
    if with_grad:
        grads, losses = torch.func.vmap(torch.func.grad_and_value(loss_one))(output, *b_ext)
        return losses, grads
    return torch.func.vmap(loss_one)(output, *b_ext), None


def check_separable(
    program: Program,
    output: torch.Tensor,
    externals: list[torch.Tensor],
    batched: list[bool],
    batch_loss: torch.Tensor,
    losses: torch.Tensor,
    reduction: str,
    grads: torch.Tensor | None = None,
) -> None:
    """Refuse a loss that is not ``reduction`` over independent per-example losses.

    Checks, on this batch: the loss equals the mean (or sum) of the per-example losses; the
    program on the batch without its last example equals the mean (or sum) of the others (a
    loss that divides by the batch size it was called with, or reads other examples' labels,
    fails this); and, when ``grads`` is given, the gradient of the batch loss with respect to
    the output is the per-example gradients divided by n (mean) or equal to them (sum).

    Raises:
        UnsupportedOperationError: one of them does not hold (the message says which).
    """
    n = output.shape[0]
    reduce = (lambda v: v.mean()) if reduction == "mean" else (lambda v: v.sum())
    what = f"{reduction} of the per-example losses"

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        a, b = a.detach().double(), b.detach().double()
        scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
        return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5 * scale))

    def refuse(detail: str) -> None:
        raise UnsupportedOperationError(
            f"The loss mixes examples or is not loss_reduction={reduction!r}: {detail}. DP-SGD "
            "needs a loss that is the mean (or sum) of one loss per example; declare the "
            "reduction you use (loss_reduction='mean' or 'sum'), and keep batch statistics, "
            "weighted means over the batch and losses over pairs of examples out of the loss."
        )

    if batch_loss.dim() != 0:
        refuse(f"the loss has shape {tuple(batch_loss.shape)}, not a scalar")
    if not close(batch_loss, reduce(losses)):
        refuse(f"the batch loss is {float(batch_loss):.6g}, the {what} {float(reduce(losses)):.6g}")
    if n >= 2:
        sub_ext = [t[:-1] if bt else t for t, bt in zip(externals, batched)]
        with torch.no_grad():
            sub = program(output[:-1], sub_ext)
        if not close(sub, reduce(losses[:-1])):
            refuse(
                f"without its last example the batch loss is {float(sub):.6g}, the {what} "
                f"{float(reduce(losses[:-1])):.6g} (does the loss depend on the batch size or on "
                "other examples' labels?)"
            )
    if grads is not None and n >= 1:
        batch_grad = torch.func.grad(lambda o: program(o, externals))(output)
        expected = grads / n if reduction == "mean" else grads
        if not close(batch_grad, expected):
            refuse("the gradient flowing into the model output is not the per-example gradients" + (" / n" if reduction == "mean" else ""))

