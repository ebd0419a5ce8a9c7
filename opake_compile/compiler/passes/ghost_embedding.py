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
(position and token-type embeddings) take the same factor with the ids broadcast
(:func:`_match_shared_ids`).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from opake_compile.compiler._graph_utils import Emitter, shape
from opake_compile.compiler.passes._factors import Factor

aten = torch.ops.aten

__all__ = ["match_embedding", "match_embedding_bag"]

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
    if not flipped and node.op == "call_function" and node.target is aten.permute.default:
        return _match_shared_ids(em, node, p)
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


def _match_shared_ids(em: Emitter, node: fx.Node, p: int) -> Factor | None:
    """Ids shared by every example (position and token-type embeddings: ``arange(T)`` or a
    buffer). vmap's rule for unbatched ids folds the examples into the columns:

        pattern:     permute(view(embedding_dense_backward(g2, ids, V, pad, False), [V, P, d]),
                             [1, 0, 2]),   ids of any shape S with T elements, g2 (*S, P*d)
        replacement: Factor(a=expand(ids, (P, T)) one-hot over V rows, b=g2 as (P, T, d))

    Example i's table scatters its own column block of ``g2``; ``pad`` (the embedding's
    ``padding_idx``, -1 for none) passes through unchanged."""
    if list(node.args[1]) != [1, 0, 2] or len(shape(node)) != 3 or shape(node)[0] != p:
        return None
    _, v, d = shape(node)
    view = node.args[0]
    if not isinstance(view, fx.Node) or view.target not in _VIEWS or list(shape(view)) != [v, p, d]:
        return None
    edb = view.args[0]
    if not isinstance(edb, fx.Node) or edb.target is not aten.embedding_dense_backward.default:
        return None
    grad, ids, num_weights, padding_idx, scale_by_freq = edb.args[:5]
    if scale_by_freq or num_weights != v or list(shape(grad)) != [*shape(ids), p * d]:
        return None
    if any(isinstance(u.target, torch._ops.OpOverload) and u.target._schema.is_mutable for u in (*view.users, *node.users)):
        return None
    t = math.prod(shape(ids))
    a = em(aten.expand.default, em(aten.reshape.default, ids, [1, t]), [p, t])
    b = em(aten.permute.default, em(aten.reshape.default, grad, [t, p, d]), [1, 0, 2])
    pad = None if padding_idx is None or padding_idx < 0 else int(padding_idx)
    return Factor(rule=RULE, a=a, b=b, rows=v, onehot=True, padding_idx=pad)


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


# ----------------------------------------------------------------------------- EmbeddingBag
#: ``mode`` of ``_embedding_bag_backward``.
_SUM, _MEAN = 0, 1


def match_embedding_bag(em: Emitter, node: fx.Node, flipped: bool, p: int) -> Factor | None:
    """A one-hot :class:`Factor` for a vmapped ``nn.EmbeddingBag`` gradient (bags of equal
    length, ``mode="sum"`` or ``"mean"``), or ``None``.

    ``_embedding_bag_backward`` has no batching rule, so vmap unrolls it: ``G`` is a ``stack``
    of P calls, call i reading row i (``select(X, 0, i)``) of batched tensors X. With bags of
    equal length (a 2-D input per example: ``offsets = arange(0, T, T / bags)``) example i's
    gradient scatters ``w_t g_ij`` to row ``ids_t`` for every position t of bag j, where
    ``g_ij`` is bag j's output gradient and ``w_t`` is 1 (sum), the per-sample weight (sum
    with ``per_sample_weights``) or ``1 / bag_size_j`` (mean): a one-hot factor with
    ``b_t = w_t g_ij``.

        pattern:     stack([_embedding_bag_backward(select(g, 0, i), select(ids, 0, i), offsets,
                            _, select(bag_size, 0, i), _, V, False, mode, False,
                            select(weights, 0, i) or None, padding_idx) for i in range(P)])
        replacement: Factor(a=ids (P, T) one-hot over V rows, b=w * g (P, T, d))
        guard:       bags of equal length (offsets one ``arange`` from 0), mode sum or mean,
                     no ``scale_grad_by_freq``, not sparse

    ``mode="max"`` (one id per feature column) stays materialised.
    """
    if flipped or node.op != "call_function" or node.target is not aten.stack.default:
        return None
    calls = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else 0
    if dim != 0 or len(calls) != p:
        return None
    first = None
    for i, call in enumerate(calls):
        if not (isinstance(call, fx.Node) and call.target is aten._embedding_bag_backward.default):
            return None
        args = list(call.args) + [-1] * (12 - len(call.args))
        grad, ids, offsets, _o2b, bag_size, _maxi, v, by_freq, mode, sparse, weights, pad = args
        rows = [_row_of(x, i) for x in (grad, ids, bag_size)] + [None if weights is None else _row_of(weights, i)]
        if any(r is None for r in rows[:3]) or (weights is not None and rows[3] is None):
            return None
        key = (tuple(rows), offsets, v, by_freq, mode, sparse, pad)
        if first is None:
            first = key
        elif key != first:
            return None
    (grad, ids, bag_size, weights), offsets, v, by_freq, mode, sparse, pad = first
    if by_freq or sparse or mode not in (_SUM, _MEAN) or (weights is not None and mode != _SUM):
        return None
    gs, ids_shape = shape(grad), shape(ids)
    if len(ids_shape) != 2 or len(gs) != 3 or gs[0] != p or shape(node) != (p, v, gs[2]):
        return None
    k, bags, d = ids_shape[1], gs[1], gs[2]
    if not _equal_bags(offsets, k, bags):
        return None
    # Position t of bag j = t // (k / bags) receives that bag's output gradient.
    per_bag = k // bags
    b = em(aten.expand.default, em(aten.unsqueeze.default, grad, 2), [p, bags, per_bag, d])
    if weights is not None:
        if shape(weights) != (p, k):
            return None
        b = em(aten.mul.Tensor, b, em(aten.reshape.default, weights, [p, bags, per_bag, 1]))
    elif mode == _MEAN:
        if math.prod(shape(bag_size)) != p * bags:
            return None
        count = em(aten.clamp_min.default, em(aten.reshape.default, bag_size, [p, bags, 1, 1]), 1)
        b = em(aten.div.Tensor, b, count)
    b = em(aten.reshape.default, b, [p, k, d])  # a dense (P, T, d) copy: the Gram and sum read it
    padding_idx = None if pad is None or pad < 0 else int(pad)
    return Factor(rule=BAG_RULE, a=ids, b=b, rows=v, onehot=True, padding_idx=padding_idx)


BAG_RULE = "embedding_bag"


def _row_of(node: object, i: int) -> fx.Node | None:
    """``X`` if ``node`` is ``select(X, 0, i)``, else ``None``."""
    if isinstance(node, fx.Node) and node.target is aten.select.int and node.args[1] == 0 and node.args[2] == i:
        src = node.args[0]
        return src if isinstance(src, fx.Node) else None
    return None


def _equal_bags(offsets: object, k: int, bags: int) -> bool:
    """Whether ``offsets`` is ``arange(0, k, k / bags)`` (through views): ``bags`` bags of
    equal length covering the example's k ids in order (the offsets of a 2-D input)."""
    node = offsets
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is aten.arange.start_step):
        return False
    start, end, step = node.args[:3]
    return start == 0 and shape(node) == (bags,) and bags * step == k and end <= k
