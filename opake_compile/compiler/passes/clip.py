"""The clipping pass: per-example norms, clip factors and the weighted sum.

Input graph (from :mod:`opake_compile.compiler.trace`)::

    placeholders: params..., others..., C (0-d float64), mask (P,) bool, args...
    output: (losses (P,), G_1 (P, *s_1), ..., G_k (P, *s_k))

Output graph::

    output: (losses (P,), norms (P,), kept (P,) bool, S_1 (*s_1), ..., S_k (*s_k))

with norms computed in float64 (reported in the sum dtype) and sums in the sum dtype ``acc`` (float32, or float64 when a gradient
is float64; never lower than float32)::

    sq_p     = sum over entries of G_p[i]^2   (float64)          (tagged "sq_norm", p)
    mass_p   = sq_p                           (float64)          (tagged "sum_mass", p)
    mag_p    = max over entries of |G_p[i]| / H   (float64)       (tagged "magnitude", p)
    norms    = sqrt(sum_p sq_p)
    w        = clamp(2 - max_p mag_p, 0, 1)   (NaN: 0)
    kept     = isfinite(norms) & (w > 0) & mask
    denom    = max(norms, sqrt(sum_p mass_p) / KAPPA)
    factor   = where(kept, min(1, C_eff / denom) w, 0) rounded down to acc  (tagged "clip_factor")
    S_p      = sum_i factor[i] * where(kept[i], G_p[i], 0)     (acc)   (tagged "clipped_sum", p)

``C_eff = C / (1 + rho)``, rho a slack for the rounding of the sum that depends only on the
sum dtype. See :mod:`.numerics` for the error analysis that makes one example move the released
sum by at most C.

Non-finite examples are removed with a select, never by multiplying with zero (0 * NaN = NaN).
``w`` takes an example whose entries reach ``H`` (:func:`.numerics.magnitude_limit`, from the
dtype and the entries per example: 2^46 for a GPT-2 layer's inputs at T = 256 in float32;
the product of input and output-gradient entries too, :func:`.numerics.product_limit`) down to nothing at ``2 H``, before its norm could overflow
(:func:`.numerics.emit_range_weight`): a continuous weight, not a cut that rounding could flip.

Rewrite passes replace ``sq_p``, ``mass_p``, ``mag_p`` (their factors' entries) and ``S_p`` for
the parameters they match; ``G_p`` then becomes dead and is never materialised.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from opake_compile.compiler._graph_utils import Emitter, set_role, shape, val
from opake_compile.compiler.passes import _kernels, numerics
from opake_compile.compiler.passes._base import PassReport

aten = torch.ops.aten

__all__ = ["insert_clipping", "accumulation_dtype", "emit_weighted_sum"]


def accumulation_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The sum dtype: float64 if any gradient is float64, else float32 (low precision is
    promoted: a bfloat16 sum would round on a grid proportional to its own magnitude)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


#: Per-example gradients (all examples) of at least this many entries have their clipped sum
#: fenced off from the others' (:func:`emit_weighted_sum`): 4 MiB in float32, where one
#: opaque call per layer costs nothing next to the sum itself.
FENCED_ENTRIES = 1 << 20


def emit_weighted_sum(em: Emitter, kept: fx.Node, factor: fx.Node, g: fx.Node) -> fx.Node:
    """``sum_i factor[i] * where(kept[i], g[i], 0)`` for g of shape (P, ...), float64 (the
    products in ``factor``'s dtype).

    Written as one select-multiply-reduce so that the backend fuses it into a single reduction
    over examples: no masked copy of ``g`` is ever stored (a matrix product would need one).

    A ``g`` of at least :data:`FENCED_ENTRIES` entries reads the factor through its own
    ``opake::fence`` (:func:`~._kernels.fence`), so that its sum is a kernel of its own.

    Error analysis: each entry is a sum of P products ``f_i g_i``; whatever the order, its
    error is at most ``gamma_P sum_i f_i |g_i|``, so in Frobenius norm at most
    ``gamma_P sum_i f_i ||g_i||`` and the norm and the sum read the same ``g_i``
    (:mod:`.numerics`, case "materialised")."""
    p = shape(g)
    bshape = [p[0]] + [1] * (len(p) - 1)
    acc = val(factor).dtype
    if val(g).numel() >= FENCED_ENTRIES:
        factor = em(_kernels.FENCE, factor)
    x = em(aten._to_copy.default, g, dtype=acc) if val(g).dtype != acc else g
    zero = em(aten.scalar_tensor.default, 0.0, dtype=acc)
    masked = em(aten.where.self, em(aten.view.default, kept, bshape), x, zero)
    weighted = em(aten.mul.Tensor, masked, em(aten.view.default, factor, bshape))
    # Accumulated over the examples in float64 (the released sums are: numerics, point 3);
    # each f_i g_i is rounded once, in its own example.
    return em(aten.sum.dim_IntList, weighted, [0], dtype=torch.float64)


def insert_clipping(gm: fx.GraphModule, *, param_names: tuple[str, ...], clip_input: int) -> PassReport:
    """Rewrite the per-example gradient outputs into norms and a clipped sum (in place).

    Args:
        gm: the traced graph of stage 1.
        param_names: the trainable parameter names, in output order.
        clip_input: the index of the clipping-norm placeholder; the mask placeholder follows it.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    out_node = next(n for n in graph.nodes if n.op == "output")
    losses, *grads = out_node.args[0]
    n_params = len(param_names)
    assert len(grads) == n_params, "trace/clip layout mismatch"
    c_node, mask_node = placeholders[clip_input], placeholders[clip_input + 1]
    em = Emitter(graph, before=out_node)
    acc = accumulation_dtype([val(g).dtype for g in grads])
    nd = numerics.NORM_DTYPE
    total = mass = magnitude = None
    for name, g in zip(param_names, grads):
        p = shape(g)
        sq = set_role(numerics.emit_sq_sum(em, em(aten.reshape.default, g, [p[0], -1])), "sq_norm", name)
        sq.meta["opake_gradient"] = g  # what the rewrite passes decompose
        # What enters this parameter's sum from example i is f_i g_i itself: its mass is its norm.
        m = set_role(em(aten.mul.Tensor, sq, 1.0), "sum_mass", name)
        # The entries the norm is computed from; a rewrite replaces it by its factors'.
        big = set_role(numerics.emit_magnitude(em, g, p[0]), "magnitude", name)
        total = sq if total is None else em(aten.add.Tensor, total, sq)
        mass = m if mass is None else em(aten.add.Tensor, mass, m)
        magnitude = big if magnitude is None else em(aten.maximum.default, magnitude, big)
    norms = em(aten.sqrt.default, total)
    weight = numerics.emit_range_weight(em, magnitude)
    counts = em(aten.logical_and.default, em(aten.isfinite.default, norms), em(aten.gt.Scalar, weight, 0.0))
    kept = set_role(em(aten.logical_and.default, counts, mask_node), "kept", "")
    c_nd = em(aten._to_copy.default, c_node, dtype=nd)
    # (Tagged: the book-keeping sums measure the clip factor's underflow against it.)
    c_eff = set_role(em(aten.mul.Tensor, c_nd, numerics.clip_scale(acc)), "clip_norm_eff", "")
    denom = em(aten.maximum.default, norms, em(aten.mul.Tensor, em(aten.sqrt.default, mass), 1.0 / numerics.KAPPA))
    ratio = em(aten.mul.Tensor, em(aten.clamp_max.default, em(aten.div.Tensor, c_eff, denom), 1.0), weight)
    zero = em(aten.scalar_tensor.default, 0.0, dtype=nd)
    factor_nd = em(aten.where.self, kept, ratio, zero)
    factor = set_role(numerics.emit_round_down(em, factor_nd, acc), "clip_factor", "")
    sums = []
    for name, g in zip(param_names, grads):
        sums.append(set_role(emit_weighted_sum(em, kept, factor, g), "clipped_sum", name))
    # Reported in the sum dtype (float32 or float64), like the eager reference.
    reported = norms if acc == nd else em(aten._to_copy.default, norms, dtype=acc)
    # The kept count and the mean loss over the real rows, computed in the graph: two fewer
    # host-side operations per call (the step's Python overhead, bench/bench_overhead.py).
    num_kept = em(aten.sum.dim_IntList, em(aten._to_copy.default, kept, dtype=torch.int64), [0])
    loss_dtype = val(losses).dtype
    wide = torch.float64 if loss_dtype == torch.float64 else torch.float32  # counts exact
    real = em(aten.where.self, mask_node, em(aten._to_copy.default, losses, dtype=wide),
              em(aten.scalar_tensor.default, 0.0, dtype=wide))
    count = em(aten.sum.dim_IntList, em(aten._to_copy.default, mask_node, dtype=wide), [0])
    loss_mean = em(aten.div.Tensor, em(aten.sum.dim_IntList, real, [0]), count)
    if loss_dtype != wide:
        loss_mean = em(aten._to_copy.default, loss_mean, dtype=loss_dtype)
    num_kept, loss_mean = set_role(num_kept, "kept_count", ""), set_role(loss_mean, "mean_loss", "")
    out_node.args = ((losses, reported, kept, *sums, num_kept, loss_mean),)
    return PassReport(
        name="insert_clipping",
        modified=True,
        matches={"clipped_parameters": n_params},
        coverage={n: "materialized" for n in param_names},
    )
