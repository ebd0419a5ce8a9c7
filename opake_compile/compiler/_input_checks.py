"""Checks on the values of a step's real inputs, registered while tracing, run before the graph.

Some library code validates its inputs with a Python ``if`` on their values (transformers'
``*ForCTC.forward`` raises when ``labels.max() >= config.vocab_size``). Inside a traced graph the
values are fake, so the patch that makes such code traceable (:mod:`opake_compile.patches`)
cannot run the check; it calls :func:`require` instead, with the tensor to check and a test on
its rows. The tracer (:mod:`.trace`) records, from the FX graph, how that tensor is computed
from the step's batch arguments (a small graph of views, casts and the like), and
:class:`~opake_compile.compiler.step.DPStep` runs every recorded check on the real rows of each
chunk before any graph runs, any key is split or anything is returned: a refused batch changes
nothing.

A check whose tensor depends on anything but the batch arguments (parameters, random draws)
cannot be evaluated ahead of the step; it is dropped, and reported in
:attr:`InputCheckRecorder.dropped` (the code then behaves as it would without the check).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx

__all__ = ["InputCheck", "InputCheckRecorder", "range_test", "recording", "require"]

# A test on the real rows of the checked tensor (batch dimension first, padding removed):
# ``test(rows, first_row) -> message or None``; ``first_row`` is the position of ``rows[0]`` in
# the logical batch, so that a message can name the offending example.
Test = Callable[[torch.Tensor, int], "str | None"]


@dataclasses.dataclass(frozen=True)
class InputCheck:
    """One recorded check.

    Attributes:
        value: maps the graph's tensor argument leaves (batched ones with ``P`` rows, in the
            graph's input order) to the checked tensor, batch dimension first ``(P, ...)``.
        test: see :data:`Test`.
        what: what is checked (the tracer's warning names it when a check has to be dropped).
        mutates: the value's graph writes to a tensor in place (a loss that edits its labels
            with ``y.add_(1)`` before ``cross_entropy``): it then runs on copies of the leaves,
            so that the step's own run sees them as the loss does, edited once.
    """

    value: fx.GraphModule | int
    test: Test
    what: str
    mutates: bool = False

    def run(self, leaves: Sequence[torch.Tensor], rows: int, first_row: int) -> str | None:
        """The test's message on the first ``rows`` rows of the value, or None when they pass.
        (An ``int`` value is the index of a leaf checked as it is, singleton dimensions the
        value added left out: no graph call.) The leaves are never written to."""
        if isinstance(self.value, int):
            leaf = leaves[self.value]
            return self.test(leaf if leaf.shape[0] == rows else leaf[:rows], first_row)
        if self.mutates:
            leaves = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        with torch.no_grad():
            value = self.value(*leaves)
        return self.test(value[:rows], first_row)


class InputCheckRecorder:
    """Collects :func:`require` calls during one trace (see :func:`recording`)."""

    def __init__(self) -> None:
        self._pending: list[tuple[fx.Node, int, Test, str, bool]] = []
        self.dropped: list[str] = []

    def build(self, gm: fx.GraphModule, leaf_placeholders: Sequence[fx.Node]) -> tuple[InputCheck, ...]:
        """Turn the recorded nodes of ``gm`` (before dead-code elimination or any pass) into
        checks over ``leaf_placeholders``; a check reaching any other input, or a random op,
        is dropped (listed in :attr:`dropped` unless it was recorded with ``quiet=True``). The
        same check on the same node is kept once."""
        allowed = set(leaf_placeholders)
        checks, seen = [], set()
        for node, bdim, test, what, quiet in self._pending:
            if (node, bdim, what) in seen:
                continue
            seen.add((node, bdim, what))
            leaf = node
            while leaf.op == "call_function" and leaf.target is torch.ops.aten.unsqueeze.default and leaf.args[1] != 0:
                leaf = leaf.args[0]  # (the tracer's batch of one: the leaf's rows with a singleton dim)
            if leaf in allowed and bdim == 0:
                checks.append(InputCheck(value=list(leaf_placeholders).index(leaf), test=test, what=what))
                continue
            value = _extract(gm, node, bdim, leaf_placeholders, allowed)
            if value is None:
                if not quiet:
                    self.dropped.append(what)
            else:
                checks.append(InputCheck(value=value, test=test, what=what, mutates=_mutates(value)))
        return tuple(checks)


_ACTIVE: list[InputCheckRecorder] = []


@contextlib.contextmanager
def recording() -> Iterator[InputCheckRecorder]:
    """The scope in which :func:`require` records (the tracer's ``make_fx`` call)."""
    rec = InputCheckRecorder()
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.remove(rec)


def require(value: torch.Tensor, test: Test, what: str, *, quiet: bool = False) -> bool:
    """Ask the compiled step to run ``test`` on the real rows of ``value`` before it runs.

    Args:
        value: a tensor batched by the tracer's ``vmap`` (per-example values), under any
            ``grad`` wrappers, computed from the step's batch arguments.
        test: ``test(rows, first_row) -> message or None`` on the value's real rows
            ``(m, *per_example_shape)``; a message refuses the batch with a
            :class:`~opake_compile.exceptions.ConfigurationError` carrying it.
        what: a short description of the check (checks with the same ``what`` on the same
            traced value are run once).
        quiet: drop the check without a warning when its value cannot be computed from the
            batch arguments alone (for checks the library adds on its own, such as index
            ranges: an index computed by the model is in range by construction).

    Returns:
        True if the check was recorded; False outside a ``compile_dp`` trace or when ``value``
        is not traced or not batched once (the caller keeps its own behaviour then).
    """
    if not _ACTIVE:
        return False
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return False
    ft = torch._C._functorch
    t, bdims = value, []
    while isinstance(t, torch.Tensor) and (ft.is_functorch_wrapped_tensor(t) or ft.is_batchedtensor(t)):
        if ft.is_batchedtensor(t):
            bdims.append(ft.maybe_get_bdim(t))
        t = ft.get_unwrapped(t)
    if len(bdims) != 1 or bdims[0] < 0:
        return False
    slot = get_proxy_slot(t, mode.tracer, None)
    if slot is None:
        return False
    _ACTIVE[-1]._pending.append((slot.proxy.node, bdims[0], test, what, quiet))
    return True


def range_test(what: str, low: int, high: int, *, ignore: int | None = None, hint: str = "") -> Test:
    """A :data:`Test` that every value of the rows is an integer in ``[low, high]`` (or equals
    ``ignore``). The message names the value and the example: ``"{what} {value} in example
    {i} of the batch is outside [{low}, {high}]{hint}."``. One ``aminmax`` over the rows when
    they pass and hold no ``ignore`` value."""

    def test(rows: torch.Tensor, first_row: int) -> str | None:
        if rows.numel() == 0:
            return None
        lo, hi = _extremes(rows)
        if lo >= low and hi <= high:
            return None
        values = rows if ignore is None else rows.masked_fill(rows == ignore, low)
        if ignore is not None:
            lo, hi = _extremes(values)
            if lo >= low and hi <= high:
                return None
        flat = values.reshape(values.shape[0], -1)
        out = (flat < low) | (flat > high)
        row = int(torch.argmax(out.any(dim=1).to(torch.int8)))
        bad = int(flat[row][out[row]][0])
        return f"{what} {bad} in example {first_row + row} of the batch is outside [{low}, {high}]{hint}."

    return test


def _extremes(rows: torch.Tensor) -> tuple[Any, Any]:
    """``(min, max)`` of ``rows`` as Python numbers: one host read (one device sync) on an
    accelerator, two reads of 0-d results on the CPU (where a read costs no sync, and they are
    cheaper than stacking the pair)."""
    lo, hi = torch.aminmax(rows)
    if rows.device.type == "cpu":
        return lo.item(), hi.item()
    return tuple(torch.stack((lo, hi)).tolist())


def _mutates(gm: fx.GraphModule) -> bool:
    """Whether any op of ``gm`` writes to one of its arguments (a mutable schema)."""
    return any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        for n in gm.graph.nodes
    )


def _extract(
    gm: fx.GraphModule, target: fx.Node, bdim: int, leaves: Sequence[fx.Node], allowed: set[fx.Node]
) -> fx.GraphModule | None:
    """The subgraph of ``gm`` computing ``target`` from ``leaves``, its dimension ``bdim`` moved
    first, as a module taking all of ``leaves`` in order; None if it needs another placeholder
    or holds a random op."""
    needed: set[fx.Node] = set()
    stack = [target]
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.op == "placeholder":
            if n not in allowed:
                return None
            continue
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            if torch.Tag.nondeterministic_seeded in n.target.tags:
                return None
        elif n.op not in ("call_function", "get_attr"):
            return None
        stack.extend(n.all_input_nodes)
    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for leaf in leaves:
        env[leaf] = graph.placeholder(leaf.name)
    for n in gm.graph.nodes:  # topological order
        if n in needed and n.op != "placeholder":
            env[n] = graph.node_copy(n, lambda a: env[a])
    out = env[target]
    if bdim != 0:
        out = graph.call_function(torch.ops.aten.movedim.int, (out, bdim, 0))
    graph.output(out)
    return fx.GraphModule(gm, graph)
