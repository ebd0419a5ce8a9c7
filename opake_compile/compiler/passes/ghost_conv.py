"""Rewrite rule: a per-example convolution weight gradient (1-D, 2-D, 3-D; any groups).

Under vmap, the weight gradient of ``conv1d``/``conv2d``/``conv3d`` is one
``convolution_backward`` with ``groups = P * groups``: the examples are stacked along channels,
``(1, P*C, *spatial)`` (example-major, so that group ``i * groups + j`` is example i's group j),
and the result is viewed to ``(P, C_out, C_in / groups, *kernel)``. Within one group the same
gradient is a product with the unfolded input (im2col, Chellapilla et al. 2006)::

    G_i^j = g_i^j @ unfold(x_i^j)^T,   g_i^j: (C_out / groups, L),  unfold(x_i^j): (C_in / groups * prod(kernel), L)

with L the number of output positions, and ``G_i`` stacks the groups' rows (the weight's
output channels are group-major). That is a dense factor pair with K = L and ``groups`` blocks
per example (:attr:`Factor.groups <._factors.Factor>`): norms add over the blocks, sums are one
product per group.

    pattern:     view(getitem(convolution_backward(gout, x, w, None, stride, padding, dilation,
                      False, output_padding, P * groups, [_, True, _]), 1),
                      [P, C_out, C_in / groups, *kernel])
    replacement: Factor(a=gout as (P * groups, C_out / groups, L),
                        b=unfold(x) as (P * groups, L, C_in / groups * prod(kernel)), groups=groups)
    guard:       not transposed; 1 to 3 spatial dims; the shapes agree with the view

The unfold is ``im2col`` for ungrouped 1-D and 2-D convolutions and a pad followed by one
``unfold`` per spatial dim otherwise (any N-d, any dilation). Depthwise and most grouped
convolutions have ``R C / (R + C) < 1`` per group and stay on the materialised path by the
cost model (the Gram form costs L^2 per group where forming the gradient costs L).
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
    """A dense :class:`Factor` in ``(C_out, C_in / groups * prod(kernel))`` orientation, or ``None``."""
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
    nd = len(out) - 3
    if transposed or nd not in (1, 2, 3) or out[0] != p or groups % p:
        return None
    stride, padding, dilation = (_per_dim(v, nd) for v in (stride, padding, dilation))
    if stride is None or padding is None or dilation is None:
        return None
    ng = groups // p
    _, c_out, c_in_g, *kernel = out
    gs, xs = shape(gout), shape(x)
    if len(gs) != 2 + nd or len(xs) != 2 + nd or gs[0] != 1 or xs[0] != 1:
        return None
    if c_out % ng or gs[1] != p * c_out or xs[1] != p * c_in_g * ng:
        return None
    spatial_out = gs[2:]
    positions = math.prod(spatial_out)
    rows = c_out // ng
    a = em(aten.reshape.default, gout, [p * ng, rows, positions])
    if ng == 1 and nd in (1, 2):
        cols = _im2col(em, x, p, c_in_g, xs[2:], kernel, stride, padding, dilation)
        if shape(cols)[2] != positions:
            return None
        b = em(aten.transpose.int, cols, 1, 2)
    else:
        b = _unfold(em, x, p, ng, c_in_g, xs[2:], kernel, stride, padding, dilation, spatial_out)
        if b is None:
            return None
    return Factor(rule=RULE, a=a, b=b, rows=rows, groups=ng)


def _per_dim(v: object, nd: int) -> list[int] | None:
    """``v`` as one int per spatial dim (a one-element list is broadcast), else ``None``."""
    vals = list(v) if isinstance(v, (list, tuple)) else [v]
    if len(vals) == 1:
        vals = vals * nd
    if len(vals) != nd or not all(isinstance(x, int) for x in vals):
        return None
    return vals


def _im2col(em: Emitter, x: fx.Node, p: int, c_in: int, sp: list[int], kernel, stride, padding, dilation) -> fx.Node:  # noqa: ANN001
    """``(P, C_in * prod(kernel), L)`` by ``im2col`` (1-D as a 2-D image of height one)."""
    if len(sp) == 1:
        x4 = em(aten.reshape.default, x, [p, c_in, 1, sp[0]])
        params = ([1, kernel[0]], [1, dilation[0]], [0, padding[0]], [1, stride[0]])
    else:
        x4 = em(aten.reshape.default, x, [p, c_in, *sp])
        params = (list(kernel), list(dilation), list(padding), list(stride))
    return em(aten.im2col.default, x4, *params)


def _unfold(em: Emitter, x: fx.Node, p: int, ng: int, c_in_g: int, sp: list[int], kernel, stride, padding, dilation, spatial_out) -> fx.Node | None:  # noqa: ANN001
    """``(P * groups, L, C_in / groups * prod(kernel))`` for any number of spatial dims: zero
    padding, then one ``unfold`` per spatial dim (a window of the dilated kernel's extent,
    subsampled by the dilation), channels split into groups, one copy into row-major
    (example, group, position) x (channel, kernel offset) order."""
    nd = len(sp)
    xn = em(aten.reshape.default, x, [p, ng, c_in_g, *sp])
    if any(padding):
        pad = []
        for q in reversed(padding):
            pad += [q, q]
        xn = em(aten.constant_pad_nd.default, xn, pad, 0.0)
    for d in range(nd):
        extent = dilation[d] * (kernel[d] - 1) + 1
        xn = em(aten.unfold.default, xn, 3 + d, extent, stride[d])
        if dilation[d] > 1:
            xn = em(aten.slice.Tensor, xn, -1, 0, extent, dilation[d])
    # (P, groups, C_in / groups, *out_spatial, *kernel)
    if list(shape(xn)[3 : 3 + nd]) != list(spatial_out) or list(shape(xn)[3 + nd :]) != list(kernel):
        return None
    order = [0, 1, *range(3, 3 + nd), 2, *range(3 + nd, 3 + 2 * nd)]
    xn = em(aten.permute.default, xn, order)
    return em(aten.reshape.default, xn, [p * ng, math.prod(spatial_out), c_in_g * math.prod(kernel)])
