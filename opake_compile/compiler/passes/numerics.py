"""The numerical contract of the clipped sum, and the graph helpers that keep it.

**Contract.** For every path (materialised, per-example vector, ghost norm, mixed, conv,
embedding, fused or per-layer book-keeping), every parameter dtype (float64, float32, bfloat16,
float16) and every input whose gradients are finite, adding or removing one example moves the
released clipped sum by at most C in L2 norm, with C the ``clipping_norm`` (C >= 2^-100).
Gradients that are not finite are selected away (they contribute exactly zero and are counted).
So, gradually, are examples too large for their norm to be computed: the clip factor is
multiplied by ``clamp(2 - m_i / H, 0, 1)``, ``m_i`` the largest entry of any factor or
materialised gradient the example's norm is read from and ``H`` a power of two set by dtype and
shape (:func:`magnitude_limit`: 2^46 for a GPT-2 layer's inputs at T = 256 in float32, 2^14 for
float16 values, which the model itself computes in float16), and the product of the
example's largest input and output-gradient entries of a layer too (:func:`product_limit`: 2^40
for GPT-2's first MLP layer at T = 256; float64 factors, scaled by powers of two, bound only
that product: 2^487 for a 768 x 768 layer at T = 4),
so that no float32 sum of squares, Gram entry or product overflows while the weight is above 0
(:func:`emit_range_weight`). A cut instead (the example dropped where its float32 sum of squares
overflowed, about 1.8e19) flipped with the last ulp of the input, from adding 0 to adding
0.999 C, and the last bits of an example's values can differ between evaluations of it (another
batch size, another bucket's graph), so removing a neighbour could flip it: 2 C. The eager
reference, whose float64 norms of materialised gradients cannot overflow, keeps its plain
finiteness test. What stays is the model's own arithmetic: a forward or backward that
overflows to inf or NaN inside the model (a normalisation's variance, say) for an example at
that edge is the same kind of cut, and no transform of the gradient can see it.

**How.** Write ``G_i`` for example i's per-example gradient as exact arithmetic would form it
from the factors the graph actually computed (the layer inputs ``a`` and output gradients ``b``
of each linear term, ``G_i = sum_t b_it a_it^T``), ``S_i = sum_t ||a_it|| ||b_it||`` for its
*mass* (the sum of the absolute sizes of the terms that enter the released sum; for a
materialised gradient, its norm), and ``u`` for the unit roundoff of the sum dtype. Three
things are needed:

1. *A norm that is never too small.* Every path computes an upper bound ``nu_i >= ||G_i||``
   from quantities that cannot underflow unnoticed:

   - sums of squares with no cancellation (rank-one norms ``||a||^2 ||b||^2``, per-position
     norms, short per-example vectors such as biases) are float32 reductions bounded above by
     ``(1 + gamma_n)`` plus ``n 2^-149`` for squares that underflow (an example with
     ``|b| ~ 10^-23`` is then over-clipped, never under-clipped: the failure "||b||^2
     underflows to 0, the norm is 0, the example is not clipped" cannot happen); long
     materialised rows are summed in float64 (:data:`NORM_DTYPE`), where products of float32
     numbers are exact and cannot underflow;
   - float64 factors (float64 models) are first scaled per example by exact powers of two
     (largest entry in [1/2, 1)) and the squared norm scaled back, so that |a| ~ 10^-170 with
     |b| ~ 10^170 still gives the right norm; a squared norm beyond float64's range makes the
     example non-finite (dropped and counted), one that underflows belongs to a gradient far
     below the smallest admissible C (2^-100);
   - Gram-form (ghost) norms: where the sequence is short enough that the bound below inflates
     an ordinary norm by at most 0.4 % (``(gamma_R + gamma_C) K / 2``, with gamma over at most
     128 terms: longer contractions are float32 products over slices of at most 121 to 128,
     added in float32 in groups of 8 slices, a blocked sum whose bound is that of at most 128
     terms, and the groups in float64), the Gram matrices are float32 products reduced in
     float64 (symmetric ones in panels, the upper triangle of blocks counted twice), and the
     smaller of
     ``2 (gamma_R + gamma_C) S_i^2`` and a Frobenius-norm bound (``gamma_R ||A||^2 ||B B^T||_F
     + gamma_C ||B||^2 ||A^T A||_F + 3 gamma_R gamma_C (sum_j ||A^j|| ||B^j||)^2``, about
     sqrt(K) times smaller when positions do not line up) is added, plus an absolute term for
     float32 underflow (``2^-149 K (C ||A||^2 + R ||B||^2)``). Linear terms over about 92
     positions or more first centre the factor that holds the layer's inputs (the one the
     losses are computed from; ``B = B' + 1 m^T``, the mean as a rank-one term; convolutions
     are not centred), so that a direction every position shares does not enter that bound;
     the rounding of the centring is bounded and added to the norm
     (``_factors._emit_centred``). Over longer sequences the Gram matrices are float64 end to
     end and ``2 n u_64 S_i^2`` (~10^-10 relative) is added. The choice depends on shapes only,
     never on values seen: an example's bound must depend on that example alone, or one
     example could change the others' clip factors.
     The float32 Gram form with a threshold-based guard inflated GPT-2-width norms by 26 % at
     T = 128 and 1,430 % at T = 1024;
   - the mixed path (per-example gradient formed by a float32 ``bmm`` for its norm only, the
     sum book-kept) adds ``gamma_K S_i`` to the norm of the float32 product, since every entry
     of a length-K dot product is within ``gamma_K sum_t |a_t| |b_t|`` of the exact one
     (Higham 2002, Thm 3.5, any summation order), plus ``K sqrt(R C) 2^-149`` for products
     that underflow. Relative to an ordinary norm (``S ~ sqrt(K) ||G||``) that is ~K^1.5 u:
     7e-4 at K = 512.

   - gradients made of disjoint blocks (the groups of a grouped convolution; the pieces of a
     parameter used separately, such as ``in_proj_weight`` with distinct q, k, v): each
     block's bound and mass as above, added in float64 and multiplied by ``1 + 2 gamma`` for
     that addition (``_factors.merge_groups``, ``merge_parts``); the sum is one product per
     block, concatenated exactly.

2. *A clip factor that never rounds up.* ``f_i = min(1, C_eff / max(nu_i, S_i / KAPPA))``
   is computed in float64 and rounded *down* to the sum dtype (:func:`emit_round_down`), so the
   exact contribution ``f_i G_i`` has norm at most ``C_eff <= C``.

3. *A sum whose rounding no example can steer.* Every sum across examples is formed in
   float64, the released sum's dtype (:func:`sum_dtype`): float32 (and lower) factors are
   scaled by ``f_i`` and multiplied exactly there, and every accumulation over examples (the
   book-keeping product ``opake::bookkeeping_mm`` and its fused form, one-hot scatters, grouped
   products, the weighted sum of materialised gradients) runs in float64. A float32
   accumulation could be steered by the data: a BLAS adds a contraction nearly in sequence, so
   one example that lifts every later partial sum into the next binade makes each later small
   term round the same way (a hostile review: 1.245 C in one graph of 4096 examples, 4.98 C
   over 16 chunks; 4096 identical examples alone, 1.009 C at T = 64 and 1.95 C at T = 4096).
   On the CPU, a dense term with at least 32 positions per example is summed example by
   example instead (``opake::per_example_mm``, :func:`~._factors.per_example_sum_ok`): each
   example's product over its own positions is a float32 product, within ``gamma_K S_i`` of
   the exact one, an error of that example alone, which every example's norm bound includes
   (:func:`~._factors.emit_per_example_bound`: at most ``gamma_K KAPPA`` of the norm, 0.1 % at
   K = 256); the products are then added in float64. It costs about a float32 product where
   the float64 one over all rows costs twice that.
   What remains is rounding inside one example (its materialised ``f_i g_i``, entry by entry,
   its own contribution) and the float64 accumulation, whose error is at most ``gamma_n`` (n
   the rows added) times the masses ``f_j S_j`` of *all* examples, not their norms: examples
   whose positions nearly cancel (mass far above norm) would let rounding carry more through
   the sum, so the factor also caps every example's mass at ``KAPPA * C_eff`` (ordinary
   examples, mass / norm ~ sqrt(T): 11 at T = 128, never reach it). The cap also bounds what
   the last bits of an example's factors can swing (they can differ between two evaluations of
   the example, in another batch size's graph; a float32 product over K positions then rounds
   across a threshold): up to about ``gamma_K S_i`` before the clip factor, at most
   ``KAPPA gamma_K C_eff`` after it. So it applies to blocks summed example by example too: replacing
   their mass by their norm bound (tried) let an example whose positions cancel swing by
   0.51 C between a graph of one and a graph of two, and a removal move the sum by 1.51 C (a
   hostile review; ``test_the_mass_cap_bounds_what_an_examples_last_bits_can_swing``). The
   price is over-clipping where positions share a direction that the output gradients cancel
   (an attention key projection whose inputs share one 5-10x the rest: released at 0.64-0.82
   of a norm below C, measured). The two roundings (inside an example, and across examples)
   are absorbed by clipping to ``C_eff = C / (1 + rho)`` with a slack that depends only on the parameters'
   dtype (:func:`rho` of :func:`slack_dtype`: 2^-10 for float32 and lower, 2^-40 for float64),
   so that every path and the eager reference clip to the same ``C_eff``.

   **Not covered (a known gap): many examples swinging together.** The slack absorbs the
   swings of a few examples, not of many. The model's own products can round with the graph's
   row count (MKL on the CPU measured: row 0 of ``F.linear`` over 10 and over 11 rows), the
   default bucketed sizes run D and D - i at different row counts, and n crafted copies at a
   threshold add n swings: 1.0135 C at n = 10 and 1.253 C at n = 175 on the ghost and mixed
   paths, 10.99 C and 175.8 C on the materialised path, which has no cap (a hostile review;
   an expected failure in ``tests/test_compiler_dynamic_batch.py``). One physical size for
   every chunk, set from public numbers, measured 0.999; ``compile_dp`` without one warns
   (``SoundnessWarning``).

   For float32 models the accumulation's bound is a worst case, not an estimate: every float64 accumulation over
   (example, position) rows is cut into chains of at most ``L = 2^19`` rows
   (:data:`MAX_FLOAT64_CHAIN`) whose results are added in float64; a chain of total mass
   ``m_c`` errs by at most ``L 2^-53 m_c``, the chains of a logical batch of ``N`` examples
   carry at most ``N KAPPA C_eff`` in all, and a removal that shifts every row after it
   changes all of them on both sides: at most ``N L 2^-46 C_eff = 2^-11 C_eff`` for
   ``N <= 2^16`` (:data:`MAX_FLOAT32_LOGICAL_ROWS`), whatever the physical batch and the
   positions per example. The other half of ``rho = 2^-10`` covers the rest, each bounded the
   same way on both sides: adding the chains' results and a parameter's terms (under 2^-19
   for K below 2^30 positions), adding chunk partials in order (``N^2 / P 2^-47``: 2^-15 at
   P = 1), an example's own rounding of ``f_i g_i`` (2^-24), and the all-reduce of ``W``
   ranks' sums (about ``W^2 2^-31``: 2^-13 at W = 512; more ranks are refused,
   :data:`MAX_FLOAT32_RANKS`).
   A review found the first cut (L = 2^20) left nothing for these; before the chains, a graph
   of 4096 rows of 512 positions was one chain of 2^21.
   Float64 models' own float64 products and sums keep rho = 2^-40, an argument about
   realistic rounding (Higham & Mary 2019, "A new approach to probabilistic rounding error
   analysis": a dot product of length n errs by about ``lambda sqrt(n) u`` times its absolute
   terms), with the adversarial suite (``property_tests/test_soundness_properties.py``:
   near-cancelling positions with mass / norm up to 10^9, magnitudes from 10^-30 to 10^19,
   hundreds of identical examples, bfloat16 models, every path forced in turn) measuring
   removal ratios at or below 1.

   All of this assumes IEEE float32 products. With TF32 allowed
   (``torch.set_float32_matmul_precision("high")``), cuBLAS reads float32 operands rounded to
   2^-11, relative to an example's mass rather than its norm (measured with emulated TF32: a
   near-cancelling example moved the sum by 1.0013 C). The norms already take that into
   account (:func:`unit_roundoff` with ``matmul=True``); every sum is a float64 product, which
   the setting does not touch.

   The book-keeping sum applies ``f_i`` to one factor before the product: exactly, for
   float32 (and lower) factors, scaled in float64. For float64 factors, each scaled entry
   that lands below the sum dtype's normal range errs by up to half the smallest subnormal
   (2^-150 in float32, 2^-1075 in float64) whatever its own size, and the product multiplies
   that error by the entries it meets in the other factor: a tiny C next to large activations
   (C = 1e-29 with inputs ~1e15 in float32: 1.33 C), or small scaled entries next to huge
   partners while the example's largest scaled entry is ordinary (output gradients
   ``[v1, s, -2 s]`` against inputs ``[x1, 2^55, 2^54]``, whose last two positions cancel in G
   but set f through the mass: 31.9 C at C = 2^-100, which an earlier test of the largest
   scaled entry missed). So the test bounds that error against C: an example is caught where
   ``2^-150 sqrt(R_s) K sqrt(C_p) max |partner|`` could exceed :data:`UNDERFLOW_SHARE` of
   ``C_eff`` (``_kernels.underflow_unsafe``; ``f_i = 1`` is never caught; at C >= 10^-6 and
   GPT-2 shapes only partners beyond ~2^80 are). ``opake::bookkeeping_mm`` tests this on the
   CPU (first from the partner's extremes: only an entry past the threshold or a NaN sends
   it to the per-example test), then forms a caught example's product with ``f_i`` applied
   to the operand with the larger entries, every other example's exactly as if none had been
   caught, and adds the two once (per example: when one caught example switched the whole
   call, removing it also changed the rounding of every other product, systematic over
   identical near-cancelling examples: 1.019 C); it refuses (``UnsupportedOperationError``)
   an example whose two operands are both beyond ~2^890 (unreachable in practice: its
   rescaled norm overflows first and it is dropped as
   non-finite). Grouped convolutions' in-graph sums always form float32 products in float64
   (``_factors._grouped_sum``). Where the test would be a host synchronisation (the operator
   on an accelerator) or cannot branch (``bookkeeping="fused"``'s in-graph products), the
   graph evaluates the same criterion per example and zeroes the clip factor of an example
   it catches, for every term of the parameter together (``_factors.emit_clipped_sum``): the
   example adds nothing to that parameter's sum, a part of its clipped gradient. Per term
   would not do (cancelling terms, one released alone: 32 C).

   All of this assumes gradual underflow. Flushed to zero (``torch.set_flush_denormal(True)``)
   a result below 2^-126 becomes 0, 2^23 times the error bounded above (measured: 2046 C via
   a bias norm, 1.004 C via a book-keeping sum), so the step and the eager reference refuse
   to run then (:func:`check_gradual_underflow`). Whether a GPU backend's kernels flush
   float32 subnormals is not yet measured (Triton links libdevice with its flush-to-zero
   variants): ``tests/test_gpu.py`` checks each kind of float32 arithmetic the graph uses.

The released sum and the noise are float64 (:func:`sum_dtype`; bfloat16 and float16 models
included: a bfloat16 sum rounds on a grid of ~2^-8 of its own magnitude, and 256 identical
examples moved one by 1.30 C). One compiled graph sums at most :data:`MAX_FLOAT32_SUM_ROWS`
rows (larger physical batches run as chunks of that size), the chunks of one logical batch,
:func:`~opake_compile.optim.accumulate` and :func:`~opake_compile.distributed.sum_gradients`
add their partial sums in float64, and a logical batch on one rank holds at most
:data:`MAX_FLOAT32_LOGICAL_ROWS` examples of a float32 model (the worst case of point 3); the
noise of :class:`~opake_compile.optim.DPOptimizer` is added in the sum's dtype, and only the
final ``.grad`` is cast to the parameter dtype, after the noise.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from opake_compile.compiler._graph_utils import Emitter, val
from opake_compile.exceptions import ConfigurationError

aten = torch.ops.aten

__all__ = [
    "NORM_DTYPE",
    "KAPPA",
    "MAX_FLOAT32_SUM_ROWS",
    "slack_dtype",
    "MAX_FLOAT32_LOGICAL_ROWS",
    "check_float32_rows",
    "MAX_FLOAT64_CHAIN",
    "MAX_FLOAT32_RANKS",
    "chain_slices",
    "RHO",
    "HALF_SUBNORMAL_LOG2",
    "UNDERFLOW_SHARE",
    "add_partial",
    "unit_roundoff",
    "float32_matmul_is_ieee",
    "check_gradual_underflow",
    "ieee_float32_matmul",
    "gamma",
    "rho",
    "clip_scale",
    "sum_dtype",
    "effective_clipping_norm",
    "emit_sq_sum",
    "emit_sum_sq_bound",
    "emit_round_down",
    "magnitude_limit",
    "product_limit",
    "MAX_EXAMPLE_NUMEL",
    "emit_magnitude",
    "emit_range_weight",
]

#: Squared norms, masses and clip factors are computed in float64.
NORM_DTYPE = torch.float64

#: Cap on an example's mass relative to C (see the module docstring, point 3).
KAPPA = 64.0

#: The smallest positive float32 (subnormal): the absolute error of an underflowing product.
FLOAT32_TINY = 2.0**-149
#: The smallest positive float64 (subnormal): the absolute error of an underflowing product.
FLOAT64_TINY = 2.0**-1074

#: ``log2`` of half the smallest subnormal, per sum dtype: the absolute error of a product that
#: rounds in the subnormal range (2^-1075 is not a float64, hence the exponent).
HALF_SUBNORMAL_LOG2 = {torch.float32: -150, torch.float64: -1075}

#: The share of ``C_eff`` that the clip factor's rounding in the subnormal range may add to one
#: example's contribution to the book-keeping sum, per sum dtype (``_kernels.underflow_unsafe``
#: catches examples where it could add more). Far below the slack ``rho`` (2^-10 and 2^-40),
#: of which it is a part.
UNDERFLOW_SHARE = {torch.float32: 2.0**-30, torch.float64: 2.0**-60}

#: The most entries one example may have in one factor or materialised gradient (the longest
#: reduction the norms run, :func:`magnitude_limit`'s premise; 2^36 float32 numbers are 256 GiB).
MAX_EXAMPLE_NUMEL = 2**36


def float32_matmul_is_ieee() -> bool:
    """Whether float32 matrix products run in IEEE float32 (``"highest"`` precision). False
    when TF32 or bfloat16 passes may be used, and when torch cannot say (its legacy and
    per-backend precision settings were mixed, which makes
    ``torch.get_float32_matmul_precision`` raise): then reduced precision is assumed."""
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:
        return False


@contextlib.contextmanager
def ieee_float32_matmul() -> Iterator[None]:
    """Within the block, float32 matrix products run in IEEE float32 whatever the user set
    (``torch.set_float32_matmul_precision("high")`` or ``allow_tf32`` would let cuBLAS read
    operands as TF32, u = 2^-11, and oneDNN use bfloat16 passes). The released sum's slack
    :func:`rho` (2^-10 for float32) assumes IEEE products: with TF32 operands an example whose
    positions nearly cancel (mass up to ``KAPPA C``) moved the sum by 1.0013 C. The setting is
    process-global (as torch's is) and restored on exit, through the same API it was read
    with."""
    try:
        prev = torch.get_float32_matmul_precision()
    except RuntimeError:  # legacy and per-backend settings mixed: use the per-backend ones
        prev = None
    if prev == "highest":
        yield
        return
    backends = [torch.backends.cuda.matmul, torch.backends.mkldnn.matmul]
    saved = [b.fp32_precision for b in backends]
    if prev is not None:
        torch.set_float32_matmul_precision("highest")
    else:
        for b in backends:
            b.fp32_precision = "ieee"
    try:
        yield
    finally:
        if prev is not None:
            torch.set_float32_matmul_precision(prev)
        for b, v in zip(backends, saved):  # a per-backend value the global one did not give
            if b.fp32_precision != v:
                b.fp32_precision = v


#: The smallest normal float32 and 1/2, as NumPy scalars: their product is the probe of
#: :func:`check_gradual_underflow` (a NumPy scalar product costs ~0.5 us, a tensor one ~4.5).
_PROBE = (np.float32(torch.finfo(torch.float32).smallest_normal), np.float32(0.5))


def check_gradual_underflow() -> None:
    """Raise :class:`~opake_compile.exceptions.ConfigurationError` if float32 arithmetic on
    the CPU flushes subnormal results to zero (``torch.set_flush_denormal(True)``).

    The contract bounds what underflow can hide by the size of a subnormal (2^-149 per square
    in the norms, 2^-150 per scaled entry of a book-keeping sum). Flushed, a result below
    2^-126 becomes 0, an error 2^23 times larger: a hostile review measured 2046 C (a bias
    norm 2^11 too small) and 1.004 C (a book-keeping sum) with the setting on. torch has no
    getter for it; the setting is the calling thread's floating-point control word, so this
    multiplies the smallest normal float32 by 1/2 on that thread and reads the result.
    """
    tiny, half = _PROBE
    if float(tiny * half) == 0.0:
        raise ConfigurationError(
            "Subnormal float32 results are flushed to zero (torch.set_flush_denormal(True) is in effect, or "
            "code built with -ffast-math was loaded, e.g. Inductor kernels compiled with "
            "cpp.enable_unsafe_math_opt_flag). The clipping bound relies on gradual underflow: call "
            "torch.set_flush_denormal(False) (and leave that Inductor flag off) before the DP step. "
            "Nothing was computed or spent."
        )


def unit_roundoff(dtype: torch.dtype, *, matmul: bool = False) -> float:
    """u of ``dtype``; for float32 matrix products, that of the reduced precision torch may
    use (TF32 or bfloat16 passes) unless float32 products are IEEE
    (:func:`float32_matmul_is_ieee`)."""
    if matmul and dtype == torch.float32 and not float32_matmul_is_ieee():
        return 2.0**-8
    return torch.finfo(dtype).eps / 2


def gamma(n: int, u: float) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of a length-n sum or
    dot product in any evaluation order (``inf`` once ``n u >= 1``: fail closed)."""
    nu = n * u
    return math.inf if nu >= 1 else nu / (1 - nu)


#: The slack of the released sum, per sum dtype (module docstring, point 3).
RHO = {torch.float32: 2.0**-10, torch.float64: 2.0**-40}


def rho(sum_dtype: torch.dtype) -> float:
    """The slack of the released sum's rounding (module docstring, point 3): the graph and the
    eager reference clip to ``C / (1 + rho)`` so that one example moves the sum by at most C."""
    return RHO[sum_dtype]


def clip_scale(sum_dtype: torch.dtype) -> float:
    """``1 / (1 + rho)``, the factor from C to the effective clipping norm ``C_eff``."""
    return 1.0 / (1.0 + rho(sum_dtype))


#: Most rows one compiled graph sums. Sums are float64 (point 3 of the module docstring): a
#: float32 total of m C rounded on a grid of 2^-24 m C (2^18 aligned examples moved one by
#: 1.0055 C), so graphs held at most this many rows; the cap stays, as a factor of the float64
#: worst case of point 3 (rows x K per graph), and the sums of several graphs, physical batches
#: or ranks are added in float64 (:func:`add_partial`).
MAX_FLOAT32_SUM_ROWS = 4096

#: Most examples of a float32 (or lower) model one logical batch on one rank may sum. Removing
#: one example shifts the rows after it into other chunks (or accumulated parts), so every
#: later partial sum rounds differently: with float32 partial sums, 2^18 aligned rows in 64
#: chunks of 4096 moved the sum by 1.00017 C (review). The sums are float64 now, and this cap
#: bounds the worst case of point 3 of the module docstring (examples x rows per chunk x K <=
#: 2^36 keeps it within rho up to K = 128). Beyond it the step and ``accumulate`` refuse
#: (:func:`check_float32_rows`); ranks sum their own rows, so a data-parallel run counts each
#: rank's examples alone. The eager reference sums more than ``MAX_FLOAT32_SUM_ROWS`` rows in
#: float64 and has no such limit.
MAX_FLOAT32_LOGICAL_ROWS = 2**16

#: Most data-parallel ranks whose float64 sums :func:`~opake_compile.distributed.sum_gradients`
#: adds for a float32 (or lower) model: ``W`` ranks of at most 2^16 examples each round by up to
#: about ``W^2 2^-31 C`` in any order, 2^-13 C at 512, within the half of rho that point 3
#: leaves for the additions after the chains. More ranks are refused.
MAX_FLOAT32_RANKS = 512

#: Most (example, position) rows one float64 accumulation of a clipped sum adds before its
#: result is added to the others' (``_kernels.chained``, in the operators and in graphs):
#: ``MAX_FLOAT32_LOGICAL_ROWS`` times this is 2^35, where the worst case of point 3 takes half
#: of rho, whatever the physical batch and the positions per example. Fixed, so that it depends
#: on no graph's shape (a clipping norm scaled by the graph's rows instead differed between
#: bucket graphs: removing one example moved a sum by 1.844 C, review).
MAX_FLOAT64_CHAIN = 2**19


def chain_slices(n: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` cutting ``n`` rows into chains of at most :data:`MAX_FLOAT64_CHAIN`."""
    return [(s, min(s + MAX_FLOAT64_CHAIN, n)) for s in range(0, max(n, 1), MAX_FLOAT64_CHAIN)]


def check_float32_rows(rows: int, dtypes: Any, where: str) -> None:
    """Refuse a logical batch of more than :data:`MAX_FLOAT32_LOGICAL_ROWS` examples of a
    float32 (or lower) model (``dtypes``: the parameters'; float64 models are not limited)."""
    if rows > MAX_FLOAT32_LOGICAL_ROWS and any(d != torch.float64 for d in dtypes):
        raise ConfigurationError(
            f"{where}: {rows} examples of a float32 (or lower-precision) model in one logical batch exceed "
            f"{MAX_FLOAT32_LOGICAL_ROWS}: removing one example shifts the rows after it into other partial "
            "sums, and the worst case of their accumulated rounding grows with the batch past the clipping "
            "norm's slack (with float32 partial sums, 2^18 rows moved the sum by 1.00017 C). Spread the batch "
            "over more ranks (each rank counts its own examples), lower the expected batch size, or train a "
            "float64 model. Nothing was computed or changed."
        )


def add_partial(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """Add one partial clipped sum (a chunk, a physical batch, a rank) to a running total of
    the same parameter, in float64 (see :data:`MAX_FLOAT32_SUM_ROWS`): the sum of several
    partial sums is float64 whatever their dtype."""
    return total.to(torch.float64) + part.to(torch.float64)


def sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the released sum for gradients of ``dtype``: float64 (float32 products
    are exact there, and no example can steer a float64 accumulation: point 3 above)."""
    return torch.float64


def slack_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose ``rho`` clips gradients of ``dtype``: float64 stays, everything else
    is float32 (its products and per-example roundings are float32's)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def effective_clipping_norm(clipping_norm: float, dtype: torch.dtype) -> float:
    """``C_eff = C / (1 + rho)``: the norm every example is actually clipped to when its
    gradients have ``dtype`` (``C (1 - 2^-10)`` for float32 and lower, ``C (1 - 2^-40)`` for
    float64), so that the rounding of the sum cannot carry one example past C.

    Example::

        >>> effective_clipping_norm(1.0, torch.float32)
        0.9990243902439024
    """
    return clipping_norm * clip_scale(slack_dtype(dtype))


def emit_sq_sum(em: Emitter, flat: fx.Node) -> fx.Node:
    """Row-wise sum of squares of a ``(P, N)`` node, or an upper bound on it, in
    :data:`NORM_DTYPE`. Long rows of float32 and lower inputs are summed in float64, where
    every square is exact and none underflows; short ones (N u <= 10^-4) in float32, bounded
    above. Float64 inputs under about 2^-500 may underflow, which only matters for C below
    :data:`MIN_CLIPPING_NORM`."""
    n = int(val(flat).shape[1])
    if val(flat).dtype != NORM_DTYPE and gamma(n, unit_roundoff(torch.float32)) <= 1e-4:
        # Short rows (biases, normalisation weights).
        return emit_sum_sq_bound(em, flat, [1], n)
    x = flat if val(flat).dtype == NORM_DTYPE else em(aten._to_copy.default, flat, dtype=NORM_DTYPE)
    return em(aten.sum.dim_IntList, em(aten.mul.Tensor, x, x), [1])


def emit_sum_sq_bound(em: Emitter, x: fx.Node, dims: list[int], n: int) -> fx.Node:
    """Upper bound, in :data:`NORM_DTYPE`, on the sums of squares of a float32-or-lower ``x``
    over ``dims`` (n terms each): a float32 sum (a vectorised reduction; float64 ones are
    several times slower on CPU) times ``(1 + gamma_n)``, plus ``n 2^-149`` for squares that
    underflow. No cancellation is possible, so the relative bound is rigorous; a square that
    overflows makes the bound inf and the example non-finite (dropped and counted)."""
    x32 = x if val(x).dtype == torch.float32 else em(aten._to_copy.default, x, dtype=torch.float32)
    sq = em(aten._to_copy.default, em(aten.sum.dim_IntList, em(aten.mul.Tensor, x32, x32), dims), dtype=NORM_DTYPE)
    return em(aten.add.Tensor, em(aten.mul.Tensor, sq, 1.0 + gamma(n, unit_roundoff(torch.float32))), n * FLOAT32_TINY)


def emit_round_down(em: Emitter, x: fx.Node, dtype: torch.dtype) -> fx.Node:
    """``x`` (non-negative, float64) cast to ``dtype`` rounding toward zero: the cast rounds to
    nearest, and where that went up, the next representable value toward zero is taken."""
    if val(x).dtype == dtype:
        return x
    y = em(aten._to_copy.default, x, dtype=dtype)
    up = em(aten.gt.Tensor, em(aten._to_copy.default, y, dtype=val(x).dtype), x)
    zero = em(aten.scalar_tensor.default, 0.0, dtype=dtype)
    return em(aten.where.self, up, em(aten.nextafter.default, y, zero), y)


def magnitude_limit(dtype: torch.dtype, n: int) -> float:
    """``H`` for one node of ``dtype`` whose norm computations reduce at most ``n`` terms per
    example: an example with an entry beyond ``H`` is weighted down linearly, to nothing at
    ``2 H`` (:func:`emit_range_weight`), before any of them can overflow. A power of two, from
    shapes only.

    Float32 and lower: a float32 reduction over one node (sums of squares, Gram entries,
    position norms) is at most ``n (2 x)^2`` for entries ``|x| <= 2 H`` (2 x: centring), and
    ``16 n H^2 <= 2^123`` leaves a factor 32 below float32's 2^128:
    ``H = 2^floor((119 - ceil(log2 n)) / 2)``. A factor's ``n`` is its entries per example
    times its positions K (a centred term's mean is a sum over the K positions, squared and
    summed over the entries: a review found the cut still there at K = 1024 without it):
    2^46 for a GPT-2 layer's inputs at T = 256. Products of two factors are bounded by
    :func:`product_limit`. Float16 nodes are the model's own arithmetic (its activations,
    output gradients, per-example gradients), which overflows at 65504 before anything of ours
    runs: at most 2^14, so the weight is 0 from 2^15 on (a review: a float16 per-example gradient
    entry at 65504 added 0.999 C, the next input ulp made it inf, dropped). Float64 (a
    materialised gradient's float64 sum of squares): ``16 n H^2 <= 2^1001``."""
    top = 1001 if dtype == torch.float64 else 123
    limit = 2.0 ** ((top - 4 - max(0, math.ceil(math.log2(max(n, 1))))) // 2)
    return min(limit, 2.0**14) if dtype == torch.float16 else limit


def product_limit(dtype: torch.dtype, k: int, r: int, c: int) -> float:
    """``H`` for the product ``max |a| max |b|`` of a parameter's factors (``k`` positions in
    all terms, an ``(r, c)`` gradient): ``||G|| <= k sqrt(r c) max|a| max|b|``, so while the
    product is at most ``2 H``, ``H = 2^(t - ceil(log2(k sqrt(r c))))``, ``||G||^2`` stays
    at most 2^123 in float32 (``t = 59``: a mixed path's per-example product, whose short rows
    are squared and summed in float32; a review's counterexample at full weight before: 0.999 C
    against 0 one ulp apart; 2^40 for a GPT-2 MLP input layer at T = 256) and 2^1000 in
    float64 (``t = 499``: float64 factors are scaled by powers of two, only the unscaled
    squared norm can overflow; 2^487 for a 768 x 768 layer at T = 4, so inputs of 1e292
    against output gradients of 1e-150 keep full weight)."""
    t = 499 if dtype == torch.float64 else 59
    return 2.0 ** (t - max(0, math.ceil(math.log2(max(k * math.sqrt(r * c), 1.0)))))


def emit_magnitude(em: Emitter, node: fx.Node, p: int, limit: float | None = None) -> fx.Node:
    """Example i's largest absolute entry of ``node`` (shape ``(P * g, ...)``, ``g`` blocks per
    example, example-major) over ``limit`` (default: its :func:`magnitude_limit`): ``(P,)``
    float64.

    Exact (a maximum does not round; dividing by a power of two neither), so the weight of
    :func:`emit_range_weight` depends on the example's entries alone. NaN where an entry is.

    Raises:
        ConfigurationError: an example's share of ``node`` has more than
            :data:`MAX_EXAMPLE_NUMEL` entries.
    """
    dims = list(val(node).shape)
    per_example = math.prod(dims[1:]) * (dims[0] // p)
    if per_example > MAX_EXAMPLE_NUMEL:
        raise ConfigurationError(
            f"one example's share of a per-example gradient or factor ({dims}) has {per_example} entries, "
            f"more than the 2^36 the overflow analysis of the norms covers (numerics.MAX_EXAMPLE_NUMEL)."
        )
    m = em(aten.amax.default, em(aten.abs.default, node), list(range(1, len(dims)))) if len(dims) > 1 else em(aten.abs.default, node)
    if dims[0] != p:
        m = em(aten.amax.default, em(aten.view.default, m, [p, dims[0] // p]), [1])
    limit = magnitude_limit(val(node).dtype, per_example) if limit is None else limit
    return em(aten.mul.Tensor, em(aten._to_copy.default, m, dtype=NORM_DTYPE), 1.0 / limit)


def emit_range_weight(em: Emitter, magnitude: fx.Node) -> fx.Node:
    """``w_i = clamp(2 - m_i, 0, 1)`` for ``m_i`` the largest of an example's
    :func:`emit_magnitude` values: 1 up to ``H``, 0 from ``2 H`` on and for NaN (``(P,)``
    float64). The clip factor is multiplied by it.

    Why a ramp and not a cut: an example whose squared norm overflows must not count, and a cut
    at any threshold on computed values flips when their last bits differ between two
    evaluations of the same example (another batch size, another bucket's graph), so removing
    one example could switch another between adding 0 and adding C: 2 C. Measured before: one
    ulp of the input took a rank-one linear's example from 0 to 0.999 C at float32 overflow
    of ``||a||^2``. The ramp changes by at most ``2^-22`` under such a change, and reaches 0
    before any norm computation can overflow (:func:`magnitude_limit`): a non-finite example
    has weight 0 on both sides of its threshold."""
    w = em(aten.clamp.default, em(aten.rsub.Scalar, magnitude, 2.0), 0.0, 1.0)
    zero = em(aten.scalar_tensor.default, 0.0, dtype=NORM_DTYPE)
    return em(aten.where.self, em(aten.isnan.default, w), zero, w)
