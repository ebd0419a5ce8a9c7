"""Rewrite rule: a per-example embedding gradient.

Under vmap, the gradient of ``nn.Embedding`` with batched ids is built with ids offset by
``arange(0, P*V, V)`` so that one ``embedding_dense_backward`` scatters every example into its
own ``(V, d)`` table: ``P x V x d`` floats, prohibitive for a 50k-token vocabulary. The same
gradient is ``onehot(ids_i)^T @ g_i``, a one-hot factor (``padding_idx`` rows are already
zeroed in ``g`` by the batching rule, which then passes ``padding_idx=-1``).

    pattern:     view(embedding_dense_backward(g, ids + view(arange(0, P*V, V)), P*V, -1, False),
                      [P, V, d])
    replacement: Factor(a=ids (P, T) one-hot over V rows, b=g (P, T, d))
    guard:       no scale_grad_by_freq; the offsets are exactly arange(0, P*V, V)

Norms become ``sum_{t,t'} [id_t == id_t'] <g_t, g_t'>`` and the clipped sum one
``embedding_dense_backward`` over all examples. Embeddings with ids shared by all examples
(position embeddings) do not match and stay materialised.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from opake_compile.compiler._graph_utils import Emitter, shape
from opake_compile.compiler.passes._factors import Factor

aten = torch.ops.aten

__all__ = ["match_embedding"]

RULE = "embedding"
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _offset_ids(indices: fx.Node, p: int, v: int) -> fx.Node | None:
    """``ids`` if ``indices = ids + view(arange(0, P*V, V))`` (either order), else ``None``."""
    if indices.op != "call_function" or indices.target is not aten.add.Tensor:
        return None
    for ids, offs in (indices.args, indices.args[::-1]):
        if not (isinstance(ids, fx.Node) and isinstance(offs, fx.Node)):
            continue
        while offs.op == "call_function" and offs.target in _VIEWS:
            offs = offs.args[0]
        if offs.op == "call_function" and offs.target is aten.arange.start_step:
            start, end, step = offs.args[:3]
            if (start, end, step) == (0, p * v, v):
                return ids
    return None


def match_embedding(em: Emitter, node: fx.Node, flipped: bool, p: int) -> Factor | None:
    """A one-hot :class:`Factor` for a vmapped embedding gradient, or ``None``."""
    if flipped or node.op != "call_function" or node.target not in _VIEWS:
        return None
    edb = node.args[0]
    if not isinstance(edb, fx.Node) or edb.target is not aten.embedding_dense_backward.default:
        return None
    out = shape(node)
    if len(out) != 3 or out[0] != p:
        return None
    _, v, d = out
    grad, indices, num_weights, padding_idx, scale_by_freq = edb.args[:5]
    if scale_by_freq or num_weights != p * v or padding_idx != -1:
        return None
    ids = _offset_ids(indices, p, v)
    if ids is None:
        return None
    k = math.prod(shape(ids)) // p
    if math.prod(shape(grad)) != p * k * d:
        return None
    a = em(aten.reshape.default, ids, [p, k])
    b = em(aten.reshape.default, grad, [p, k, d])
    return Factor(rule=RULE, a=a, b=b, rows=v, onehot=True)
