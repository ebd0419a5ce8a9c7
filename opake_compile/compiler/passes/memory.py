"""Peak-memory passes: same values, smaller working sets.

Under ``vmap`` the per-example weight gradient of a convolution becomes one grouped
``convolution_backward`` with ``groups = P x groups`` (each example its own group). CPU
kernels unfold the input of every group at once for it: a scratch buffer of
``P x C_in x prod(kernel) x prod(output spatial)`` elements (16 MiB for the first conv of the
bench's MNIST CNN at P = 256, against a 1 MiB result, and the step's peak). The
non-private step's weight gradient (groups = 1) accumulates over examples and never holds it.

:func:`split_grouped_weight_grads` cuts such a call into chunks of whole groups whose scratch
stays under :data:`SCRATCH_BYTES`, and concatenates their results: every output element is
computed by the same kernel from the same operands, so the result is bit-for-bit the same
(checked in ``tests/test_compiler_memory.py``).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from opake_compile.compiler._graph_utils import Emitter, shape, val
from opake_compile.compiler.passes._base import PassReport

__all__ = ["SCRATCH_BYTES", "split_grouped_weight_grads"]

aten = torch.ops.aten

#: Largest unfold scratch one grouped weight-gradient call may need before it is split.
SCRATCH_BYTES = 4 * 2**20


def _scratch_bytes(node: fx.Node) -> int:
    go, x, w = node.args[0], node.args[1], node.args[2]
    k = math.prod(shape(w)[2:])
    return shape(x)[0] * shape(x)[1] * k * math.prod(shape(go)[2:]) * val(x).element_size()


def split_grouped_weight_grads(gm: fx.GraphModule) -> PassReport:
    """Split grouped ``convolution_backward`` calls that compute only the weight gradient and
    whose unfold scratch exceeds :data:`SCRATCH_BYTES` into chunks of groups (module
    docstring). Leaves every other call alone."""
    splits: dict[str, int] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.convolution_backward.default:
            continue
        go, x, w, _bias, stride, padding, dilation, transposed, out_pad, groups, mask = node.args
        if transposed or groups <= 1 or list(mask) != [False, True, False]:
            continue
        scratch = _scratch_bytes(node)
        if scratch <= SCRATCH_BYTES:
            continue
        # The largest divisor of groups whose chunk fits.
        per_group = scratch / groups
        chunk = max((d for d in range(1, groups + 1) if groups % d == 0 and d * per_group <= SCRATCH_BYTES), default=1)
        n = groups // chunk
        if n <= 1 or any(u.target is not operator.getitem or (u.args[1] != 1 and u.users) for u in node.users):
            continue
        for u in [u for u in node.users if u.args[1] != 1]:
            gm.graph.erase_node(u)  # unused grad_input / grad_bias slots
        users = list(node.users)
        cin, cout = shape(x)[1] // groups, shape(go)[1] // groups
        em = Emitter(gm.graph, before=node)
        parts = []
        for i in range(n):
            lo, hi = i * chunk, (i + 1) * chunk
            part = em(
                aten.convolution_backward.default,
                em(aten.slice.Tensor, go, 1, lo * cout, hi * cout),
                em(aten.slice.Tensor, x, 1, lo * cin, hi * cin),
                em(aten.slice.Tensor, w, 0, lo * cout, hi * cout),
                _bias, stride, padding, dilation, transposed, out_pad, chunk, mask,
            )
            parts.append(em(operator.getitem, part, 1))
        whole = em(aten.cat.default, parts, 0)
        for u in users:
            u.replace_all_uses_with(whole)
            gm.graph.erase_node(u)
        gm.graph.erase_node(node)
        splits[f"{shape(w)[0]}x{'x'.join(map(str, shape(w)[1:]))}"] = n
    return PassReport("split_grouped_weight_grads", bool(splits), matches={f"grouped weight grad {k} in {v} chunks": 1 for k, v in splits.items()})
