"""Small helpers for editing the library's ATen FX graphs.

Nodes created by the passes get a ``meta['val']`` (a FakeTensor computed by running the op in
the graph's fake mode), so later passes can read shapes and dtypes exactly as they do for
nodes that ``make_fx`` produced.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

aten = torch.ops.aten

__all__ = ["Emitter", "val", "shape", "role_of", "set_role", "nodes_with_role"]


def val(node: Any) -> Any:
    """The ``meta['val']`` of an FX node (or the value itself for a non-node argument)."""
    return node.meta["val"] if isinstance(node, fx.Node) else node


def draws_randomness(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers: an op tagged ``nondeterministic_seeded``, except
    one whose ``dropout_p`` argument is 0 (the attention ops carry the tag whatever their
    dropout: an SDPA model in eval mode draws nothing)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return not (isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0)
    return True


def shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(int(s) for s in node.meta["val"].shape)


def role_of(node: fx.Node) -> tuple[str, str] | None:
    """``(role, parameter name)`` recorded by the clip pass, e.g. ``("sq_norm", "fc.weight")``."""
    return node.meta.get("opake_role")


def set_role(node: fx.Node, role: str, param: str) -> fx.Node:
    node.meta["opake_role"] = (role, param)
    return node


def nodes_with_role(graph: fx.Graph, role: str) -> dict[str, fx.Node]:
    return {r[1]: n for n in graph.nodes if (r := role_of(n)) is not None and r[0] == role}


_aten = torch.ops.aten
#: Ops that make a tensor from numbers alone; :class:`Emitter` puts them on the graph's device.
_FACTORIES = frozenset((_aten.scalar_tensor.default, _aten.full.default, _aten.zeros.default, _aten.ones.default,
                        _aten.empty.memory_format, _aten.arange.default, _aten.arange.start, _aten.arange.start_step))


class Emitter:
    """Appends ATen calls to a graph before a given node, with fake-tensor metadata.

    Example::

        em = Emitter(gm.graph, before=output_node)
        sq = em(aten.mul.Tensor, g, g)
    """

    def __init__(self, graph: fx.Graph, *, before: fx.Node) -> None:
        self.graph = graph
        self.before = before
        vals = [n.meta["val"] for n in graph.nodes if "val" in n.meta]
        self.fake_mode = detect_fake_mode(vals)
        #: Where new constants are made (a ``scalar_tensor`` without ``device``): the device of
        #: the graph's first tensor input, the model's first trainable parameter. A CPU constant
        #: beside CUDA values fails where an op does not take CPU scalars (``nextafter``).
        first = next((n.meta.get("val") for n in graph.nodes if n.op == "placeholder"
                      and isinstance(n.meta.get("val"), torch.Tensor)), None)
        self.device = first.device if first is not None else None
        #: Every node this emitter inserted, in order (see :meth:`erase_since`).
        self.created: list[fx.Node] = []

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> fx.Node:
        if op in _FACTORIES and "device" not in kwargs and self.device is not None:
            kwargs = {**kwargs, "device": self.device}
        with self.graph.inserting_before(self.before):
            node = self.graph.call_function(op, args, kwargs)
        self.created.append(node)  # before its value is computed, which may raise
        fake_args = torch.fx.node.map_arg(args, val)
        fake_kwargs = torch.fx.node.map_arg(kwargs, val)
        with self._mode():
            node.meta["val"] = op(*fake_args, **fake_kwargs)
        return node

    def mark(self) -> int:
        """A position in :attr:`created` to roll back to with :meth:`erase_since`."""
        return len(self.created)

    def erase_since(self, mark: int) -> None:
        """Erase the nodes inserted since ``mark`` (last first, so users go before their
        inputs). For a rewrite that failed or gave up halfway: nothing it emitted stays in the
        graph (dead-code elimination would keep in-place ops, and nodes without a value break
        later passes).

        Raises:
            RuntimeError: one of them is used by a node this emitter did not insert since
                ``mark`` (the caller redirected uses before it was sure of the rewrite).
        """
        for node in reversed(self.created[mark:]):
            if not getattr(node, "_erased", False):
                self.graph.erase_node(node)
        del self.created[mark:]

    @contextmanager
    def _mode(self) -> Iterator[None]:
        if self.fake_mode is None:
            yield
        else:
            with self.fake_mode:
                yield
