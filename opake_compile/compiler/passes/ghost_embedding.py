"""Rewrite rule: a per-example embedding gradient.

Under vmap, the gradient of ``nn.Embedding`` with batched ids is built with ids offset by
``arange(0, P*V, V)`` so that one ``embedding_dense_backward`` scatters every example into its
own ``(V, d)`` table: ``P x V x d`` floats, prohibitive for a 50k-token vocabulary. The same
gradient is ``onehot(ids_i)^T @ g_i``, a one-hot factor. With ``padding_idx = k`` the batching
rule passes ``-1`` and zeroes row k of the per-example tables afterwards, in place
(``fill_(select(G, 1, k), 0)``): the rule recognises that zeroing, records ``padding_idx = k``
(so positions with id k contribute nothing to norms and sums) and erases it with the
materialised form. Any other use of the per-example table refuses the match.

    pattern:     view(embedding_dense_backward(g, ids + view(arange(0, P*V, V)), P*V, -1, False),
                      [P, V, d])
    replacement: Factor(a=ids (P, T) one-hot over V rows, b=g (P, T, d))
    guard:       no scale_grad_by_freq; the offsets are exactly arange(0, P*V, V); the table's
                 only other use is the in-place zeroing of one padding row

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
    pad = _padding_row_zeroing(node)
    if pad is False:
        return None
    padding_idx, cleanup = pad if pad else (None, ())
    a = em(aten.reshape.default, ids, [p, k])
    b = em(aten.reshape.default, grad, [p, k, d])
    return Factor(rule=RULE, a=a, b=b, rows=v, onehot=True, padding_idx=padding_idx, cleanup=cleanup)


def _padding_row_zeroing(table: fx.Node) -> tuple[int, tuple[fx.Node, ...]] | None | bool:
    """``(k, nodes)`` if the table's row k is zeroed in place by ``fill_(select(table, 1, k), 0)``,
    ``None`` if nothing mutates the table, ``False`` for any other in-place use (no match)."""
    found = None
    for user in table.users:
        if user.target is aten.select.int and user.args[1] == 1 and len(user.users) == 1:
            fill = next(iter(user.users))
            if fill.target is aten.fill_.Scalar and fill.args[0] is user and fill.args[1] == 0 and found is None:
                found = (int(user.args[2]), (fill, user))
                continue
            return False
        if isinstance(user.target, torch._ops.OpOverload) and user.target._schema.is_mutable:
            return False
    return found
