"""Rewrite rule: a per-example weight gradient formed by a batched matrix product.

In the vmapped gradient graph, the weight gradient of a linear layer (``nn.Linear``, GPT-2's
``Conv1D``/``addmm``, any ``x @ W`` against a trainable ``W``) is ``bmm(L, R)`` with
``L: (P, M, K)`` and ``R: (P, K, N)``, K being the number of positions (1 for 2-D inputs, T for
sequences), possibly transposed on the way to the parameter's layout. Matched here:

    pattern:     term = bmm(L, R)            or its transpose (transpose/permute of dims 1, 2)
    replacement: Factor(a=L, b=R)            or Factor(a=R^T, b=L^T)
    guard:       3-D operands with the physical batch P leading
"""

from __future__ import annotations

import torch
import torch.fx as fx

from opake_compile.compiler._graph_utils import Emitter, shape
from opake_compile.compiler.passes._factors import Factor

aten = torch.ops.aten

__all__ = ["match_matmul"]

RULE = "linear"


def match_matmul(em: Emitter, node: fx.Node, flipped: bool, p: int) -> Factor | None:
    """A :class:`Factor` for ``node`` (flipped: its transpose), or ``None`` if it is no bmm."""
    if node.op != "call_function" or node.target is not aten.bmm.default:
        return None
    left, right = node.args
    if not (isinstance(left, fx.Node) and isinstance(right, fx.Node)):
        return None
    ls, rs = shape(left), shape(right)
    if len(ls) != 3 or len(rs) != 3 or ls[0] != p or rs[0] != p:
        return None
    if not flipped:
        return Factor(rule=RULE, a=left, b=right, rows=ls[1])
    a = em(aten.transpose.int, right, 1, 2)
    b = em(aten.transpose.int, left, 1, 2)
    return Factor(rule=RULE, a=a, b=b, rows=rs[2])
