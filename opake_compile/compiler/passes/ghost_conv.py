"""Rewrite rule: a per-example convolution weight gradient.

Under vmap, the weight gradient of ``conv1d``/``conv2d`` is one ``convolution_backward`` with
``groups = P * groups``: the examples are stacked along channels, ``(1, P*C, H, W)``, and the
result is viewed to ``(P, C_out, C_in / groups, *kernel)``. For ``groups == 1`` the same gradient
is a product with the unfolded input (im2col, Chellapilla et al. 2006)::

    G_i = g_i @ unfold(x_i)^T,     g_i: (C_out, L),  unfold(x_i): (C_in * prod(kernel), L)

with L the number of output positions: a dense factor pair with K = L.

    pattern:     view(getitem(convolution_backward(gout, x, w, None, stride, padding, dilation,
                      False, output_padding, P, [_, True, _]), 1), [P, C_out, C_in, *kernel])
    replacement: Factor(a=gout as (P, C_out, L), b=im2col(x)^T (P, L, C_in * prod(kernel)))
    guard:       1-D or 2-D, not transposed, original groups == 1
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from opake_compile.compiler._graph_utils import Emitter, shape
from opake_compile.compiler.passes._factors import Factor

aten = torch.ops.aten

__all__ = ["match_conv"]

RULE = "conv"
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def match_conv(em: Emitter, g: fx.Node, p: int) -> Factor | None:
    """A dense :class:`Factor` in ``(C_out, C_in * prod(kernel))`` orientation, or ``None``."""
    if g.op != "call_function" or g.target not in _VIEWS:
        return None
    item = g.args[0]
    if not (isinstance(item, fx.Node) and item.target is operator.getitem and item.args[1] == 1):
        return None
    cb = item.args[0]
    if not (isinstance(cb, fx.Node) and cb.target is aten.convolution_backward.default):
        return None
    gout, x, _w, _bias_sizes, stride, padding, dilation, transposed, _out_pad, groups, _mask = cb.args
    out = shape(g)
    nd = len(stride)
    if transposed or groups != p or nd not in (1, 2) or len(out) != 3 + nd or out[0] != p:
        return None
    _, c_out, c_in, *kernel = out
    gs, xs = shape(gout), shape(x)
    if gs[0] != 1 or xs[0] != 1 or gs[1] != p * c_out or xs[1] != p * c_in:
        return None
    spatial_out = gs[2:]
    positions = math.prod(spatial_out)
    a = em(aten.reshape.default, gout, [p, c_out, positions])
    if nd == 1:
        x4 = em(aten.reshape.default, x, [p, c_in, 1, xs[2]])
        params = ([1, kernel[0]], [1, dilation[0]], [0, padding[0]], [1, stride[0]])
    else:
        x4 = em(aten.reshape.default, x, [p, c_in, xs[2], xs[3]])
        params = (list(kernel), list(dilation), list(padding), list(stride))
    cols = em(aten.im2col.default, x4, *params)  # (P, C_in * prod(kernel), L)
    if shape(cols)[2] != positions:
        return None
    b = em(aten.transpose.int, cols, 1, 2)
    return Factor(rule=RULE, a=a, b=b, rows=c_out)
