"""Per-example clipping: the eager reference of the DP transform.

DP-SGD (Abadi et al. 2016, "Deep Learning with Differential Privacy") bounds each example's
influence by clipping its gradient g_i to L2 norm C, ``g_i * min(1, C / ||g_i||)``, and sums the
clipped gradients; Gaussian noise of standard deviation sigma * C on that sum then gives
differential privacy. This module is the slow, obviously right implementation the compiled
transform (:func:`opake_compile.compile_dp`) is verified against.

Edge cases, shared by every function here:

=========================  ==========================================================
C = inf                    allowed; no clipping; warns ``NotPrivateWarning``
C <= 0, NaN                ``ConfigurationError``
zero gradient              clip factor 1 (C / 0 = inf, clamped to 1); contributes 0
non-finite gradient        the example contributes exactly zero (a ``where`` select,
                           never a multiplication: 0 * NaN = NaN) and is counted in
                           ``num_nonfinite``. An example whose squared norm overflows
                           counts as non-finite too (it fails closed).
empty batch                a zero sum of the right shapes; ``num_examples = 0``
=========================  ==========================================================
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch

from opake_compile import pytree as _pt
from opake_compile._markers import reject_dp_output
from opake_compile._validate import NotPrivateWarning, check_batch_size, check_clipping_norm
from opake_compile.compiler.passes import numerics as _num
from opake_compile.dpsgd._types import ClippedPytree, ReceiptBook, ReleaseReceipt, lock_releases
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = [
    "ClippedPytree",
    "ClipState",
    "AdaptiveClipState",
    "clip_pytree",
    "clipped_grad",
    "clipped_fun",
    "adaptive_clipped_grad",
    "auto_clipped_grad",
    "per_example_global_norms",
    "clip_and_sum",
]


class ClipState(NamedTuple):
    """State of :func:`clipped_grad` / :func:`clipped_fun`: the clipping norm in use."""

    clipping_norm: float


class AdaptiveClipState(NamedTuple):
    """State of :func:`adaptive_clipped_grad`: the current clipping norm and the key that
    draws the noise on the clipped-fraction count.

    **Not privatised until its result is released.** A state returned by a call carries a norm
    computed from that call's noisy count, which the accountant charges only when the call's
    result is stepped on (``DPOptimizer.step``) or noised (``gaussian_noise``). Before then,
    do not log or publish ``clipping_norm``: the norms of a call and of its retry on another
    batch (the same count noise) reveal the exact difference of the two counts."""

    clipping_norm: float
    key: Any


def _checked_state(state: Any) -> Any:
    """``state`` (a :class:`ClipState` / :class:`AdaptiveClipState` passed by the caller) with
    its clipping norm checked as ``clipping_norm=`` is at construction (a NaN, negative or
    non-numeric C would release NaN or sign-flipped sums with the wrong bound)."""
    if not isinstance(state, (ClipState, AdaptiveClipState)):
        raise InputTypeError(f"Expected state= a ClipState or AdaptiveClipState, got {type(state).__name__}.")
    c = state.clipping_norm
    if not (isinstance(c, (int, float)) and not isinstance(c, bool) and math.isinf(c) and c > 0):
        c = check_clipping_norm(c, name="state.clipping_norm")  # (inf passes without a second warning)
    return state._replace(clipping_norm=float(c))


def clip_pytree(tree: Any, clipping_norm: Any) -> tuple[Any, torch.Tensor]:
    """Clip a whole tree to global L2 norm ``clipping_norm``.

    Every leaf is scaled by the same factor ``s = min(1, C / ||tree||)``, where ``||tree||`` is
    :func:`opake_compile.pytree.global_norm`. A tree already within C comes back unchanged.
    The scaled leaves are rounded in their dtype, so the clipped tree's norm may exceed C by
    that rounding: about eps relatively, and more where entries fall into the subnormal range
    (float16 entries below 6.1e-5 round on a grid of 6e-8). This is the plain primitive; the
    released sums of ``clipped_grad`` and ``compile_dp`` clip below C by a margin that covers
    their rounding (``compiler/passes/numerics.py``).

    Args:
        tree: a pytree of tensors of any shapes and floating dtypes.
        clipping_norm: C > 0 (int, float, or 0-d tensor; a tensor C works under
            ``torch.compile`` and is not checked with Python branches there).

    Returns:
        ``(clipped_tree, norm)``: leaves keep shape and dtype; ``norm`` is the 0-d global norm
        before clipping (:func:`~opake_compile.pytree.global_norm`, accumulated in at least
        float32, where squares of float32 entries below about 1e-23 vanish; whether to clip,
        and by how much, is also read from a float64 norm of the entries scaled by their
        largest magnitude, so such a tree is still clipped to C).

    Raises:
        ConfigurationError: C <= 0 or NaN (Python number or eager tensor).
        InputTypeError: C is not a number, or ``tree`` is a DP output wrapper.

    Example::

        >>> clipped, norm = clip_pytree({"w": torch.tensor([3.0, 0.0]), "b": torch.tensor(4.0)}, 1.0)
        >>> clipped["w"], float(norm)
        (tensor([0.6000, 0.0000]), 5.0)
    """
    reject_dp_output(tree, where="clip_pytree")
    if not (isinstance(clipping_norm, torch.Tensor) and torch.compiler.is_compiling()):
        check_clipping_norm(clipping_norm)
    norm = _pt.global_norm(tree)
    # Decided on the norm in float64 as well where it matters: global_norm squares float32
    # entries in float32, where squares below ~1e-45 vanish (a tree of 10^6 entries of 1e-24
    # had norm 0 and came back at 10^4 C for C = 1e-25; review). Each lost square is below
    # 2^-149, so a float32 sum of squares above numel 2^-129 is within 2^-20 of the exact
    # one and is used as it is (eagerly; under torch.compile the float64 norm is always formed).
    numel = sum(x.numel() for x in _pt.tree_leaves(tree))
    if norm.dtype == torch.float64 or (not torch.compiler.is_compiling() and float(norm) ** 2 > numel * 2.0**-129):
        exact = norm.to(torch.float64)
    else:
        exact = _scaled_global_norm(tree).to(norm.device)
    c = clipping_norm.to(exact) if isinstance(clipping_norm, torch.Tensor) else clipping_norm
    within = (norm.to(exact) <= c) & (exact <= c * (1.0 + 2.0**-22))
    scale = torch.where(within, torch.ones_like(exact), c / torch.maximum(exact, norm.to(exact)))
    clipped = optree.tree_map(
        lambda x: (x * scale.to(x.dtype)) if isinstance(x, torch.Tensor) else x, tree
    )
    return clipped, norm


def _scaled_global_norm(tree: Any) -> torch.Tensor:
    """The tree's global norm in float64, over its entries divided by their largest magnitude
    (no square underflows, float64 ones included). Non-finite entries give a non-finite norm."""
    leaves = [torch.view_as_real(x.resolve_conj()) if x.dtype.is_complex else x for x in _pt.tree_leaves(tree)]
    leaves = [x for x in leaves if x.numel()]
    if not leaves:
        return torch.zeros((), dtype=torch.float64)
    device = leaves[0].device
    # One leaf at a time in float64 (a copy of every leaf at once cost 4x the tree: review).
    m = torch.stack([x.abs().amax().to(device=device, dtype=torch.float64) for x in leaves]).amax()
    unit = torch.where(torch.isfinite(m) & (m > 0), m, torch.ones_like(m))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for x in leaves:
        total = total + (x.to(device=device, dtype=torch.float64) / unit).square().sum()
    return unit * total.sqrt()


def _per_example_sq_norms(per_example_tree: Any) -> tuple[torch.Tensor, torch.dtype]:
    """``(sum of squares per example in float64, the sum dtype)``: the squares of float32 and
    lower values are exact in float64 and cannot underflow there (see
    :mod:`opake_compile.compiler.passes.numerics`)."""
    leaves = _pt.tree_leaves(per_example_tree)
    if not leaves:
        raise InputTypeError("per_example_global_norms needs at least one tensor leaf.")
    acc = torch.float64 if any(l.dtype in (torch.float64, torch.complex128) for l in leaves) else torch.float32
    total = None
    for leaf in leaves:
        x = torch.view_as_real(leaf.resolve_conj()) if leaf.dtype.is_complex else leaf  # |z|^2 = re^2 + im^2
        sq = x.to(_num.NORM_DTYPE).reshape(x.shape[0], -1).square().sum(dim=1)
        total = sq if total is None else total + sq
    return total, acc


def per_example_global_norms(per_example_tree: Any) -> torch.Tensor:
    """Global L2 norms of a batch of per-example trees.

    Args:
        per_example_tree: a pytree whose tensor leaves all have a leading batch dimension B.

    Returns:
        Shape ``(B,)``, ``sqrt(sum over leaves and entries of g_i^2)``, accumulated in float64
        and returned in float32 (float64 if any leaf is float64).
    """
    total, acc = _per_example_sq_norms(per_example_tree)
    return total.sqrt().to(acc)


def _round_down(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Non-negative float64 ``x`` cast to ``dtype`` rounding toward zero (eager twin of
    :func:`~opake_compile.compiler.passes.numerics.emit_round_down`)."""
    if x.dtype == dtype:
        return x
    y = x.to(dtype)
    return torch.where(y.to(x.dtype) > x, torch.nextafter(y, torch.zeros_like(y)), y)


def clip_and_sum(
    per_example_tree: Any, clipping_norm: float, mask: torch.Tensor | None = None
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Clip each example of a batched tree to ``clipping_norm`` and sum over the batch.

    The numerical contract of :mod:`opake_compile.compiler.passes.numerics` holds here as in
    the compiled step, and both clip alike: norms and factors in float64, each factor
    ``min(1, C_eff / ||g_i||)`` with ``C_eff = C / (1 + rho)`` (rho: 2^-10 for float32 sums,
    2^-40 for float64) rounded down, sums accumulated in float64 and returned in float32 at
    least (bfloat16 and float16 leaves get float32 sums), so that one example moves the sum by
    at most C.

    Args:
        per_example_tree: pytree of tensors of shape ``(B, *leaf_shape)``.
        clipping_norm: C > 0 or ``math.inf`` (already validated).
        mask: optional bool ``(B,)``; ``False`` rows contribute exactly zero (padding).

    Returns:
        ``(summed_tree, norms, kept)``: leaves of shape ``leaf_shape`` in the sum dtype
        (float32, or float64 if any leaf is float64 or B is above 4096), the ``(B,)`` norms
        before clipping (in the sum dtype of one chunk: float32 or float64), and
        the bool ``(B,)`` of rows that contributed (finite norm and in the mask).

    Raises:
        ConfigurationError: subnormal results are flushed to zero
            (:func:`~opake_compile.compiler.passes.numerics.check_gradual_underflow`).
    """
    _num.check_gradual_underflow()
    sq, acc = _per_example_sq_norms(per_example_tree)
    norms64 = sq.sqrt()
    kept = torch.isfinite(norms64)
    if mask is not None:
        kept = kept & mask.to(device=norms64.device, dtype=torch.bool)
    c_eff = clipping_norm * _num.clip_scale(acc)
    factor = torch.clamp(c_eff / norms64, max=1.0)
    factor = _round_down(torch.where(kept, factor, torch.zeros_like(factor)), acc)
    return _weighted_sum(per_example_tree, kept, factor, acc), norms64.to(acc), kept


def _refuse_across_ranks() -> None:
    """Adaptive clipping in a process group of several ranks is refused: each rank counts its
    own examples below the norm and adds the same count noise (one key on every rank), so the
    ranks' next norms differ by their local counts' difference, without noise (review: the
    difference read back exactly, 1.000000, from two ranks' norms); and a local count over the
    global expected batch size tracks the wrong quantile."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigurationError(
            "adaptive clipping across ranks is not supported: each rank's next clipping norm would come "
            "from its own count of examples below the norm with the same count noise, so the ranks' norms "
            "would reveal their counts' difference without noise. Use a fixed clipping_norm in a "
            "data-parallel run. Nothing was computed or changed."
        )


def _weighted_sum(per_example_tree: Any, kept: torch.Tensor, factor: torch.Tensor, acc: torch.dtype) -> Any:
    """``sum_i factor_i g_i`` per leaf in ``acc`` (accumulated in float64), rows not ``kept``
    selected away (never multiplied by zero: a non-finite row would give NaN). A float32 sum holds at most
    ``numerics.MAX_FLOAT32_SUM_ROWS`` rows, as one compiled graph does; more rows are summed in
    float64, chunk by chunk (the result is then float64): one float32 sum of 2^18 aligned rows
    moved by 1.019 C on removing one (review), and float32 sums of 4096-row chunks added in
    float64 still moved by 1.0010 C, every chunk's rounding changing as the rows shift."""
    rows = _num.MAX_FLOAT32_SUM_ROWS if acc == torch.float32 else None

    def weighted_sum(g: torch.Tensor) -> torch.Tensor:
        shaped = kept.reshape(-1, *([1] * (g.dim() - 1)))
        selected = torch.where(shaped, g, torch.zeros_like(g))
        f = factor.reshape(shaped.shape)
        if rows is None or g.shape[0] <= rows:
            # Accumulated in float64 and rounded once: a float32 accumulation can be steered by
            # one example (it lifts the later partial sums into a binade where the others'
            # terms all round one way: 1.245 C on a compiled sum, review). One rounding of a
            # total of at most 4096 clipped examples is at most 2^-13 C.
            return (selected.to(acc) * f).sum(dim=0, dtype=torch.float64).to(acc)
        total = None
        for i in range(0, g.shape[0], rows):
            part = (selected[i:i + rows].to(torch.float64) * f[i:i + rows].to(torch.float64)).sum(dim=0)
            total = part if total is None else total + part
        return total

    return optree.tree_map(weighted_sum, per_example_tree)


def _normalise_argnums(value: int | Sequence[int], name: str) -> tuple[int, ...]:
    if isinstance(value, bool):
        raise InputTypeError(f"Expected {name} to be an int or a tuple of ints, got {value!r}.")
    if isinstance(value, int):
        return (value,)
    try:
        out = tuple(value)
    except TypeError:
        raise InputTypeError(f"Expected {name} to be an int or a tuple of ints, got {value!r}.") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise InputTypeError(f"Expected {name} to be an int or a tuple of ints, got {value!r}.")
    return out


def _check_normalize_by(normalize_by: Any) -> float | None:
    if normalize_by is None:
        return None
    if isinstance(normalize_by, bool) or not isinstance(normalize_by, (int, float)):
        raise InputTypeError(f"Expected normalize_by to be a number or None, got {type(normalize_by).__name__}.")
    if not (normalize_by > 0 and math.isfinite(normalize_by)):
        raise ConfigurationError(f"Expected normalize_by={normalize_by!r} to be finite and > 0.")
    return float(normalize_by)


def _per_example_outputs(
    fun: Callable[..., Any],
    args: tuple,
    batch_argnums: tuple[int, ...],
    keep_batch_dim: bool,
) -> Any:
    """vmap ``fun`` over the batched arguments; each example sees a batch of one when
    ``keep_batch_dim`` (the user's batch code runs unchanged)."""

    def per_example(*a):
        if keep_batch_dim:
            a = tuple(
                optree.tree_map(lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t, x)
                if i in batch_argnums
                else x
                for i, x in enumerate(a)
            )
        return fun(*a)

    from opake_compile.compiler._rnn import recurrent_ops  # noqa: PLC0415 - the compiler imports this module
    from opake_compile.compiler.trace import _own_batching_rules_only  # noqa: PLC0415

    in_dims = tuple(0 if i in batch_argnums else None for i in range(len(args)))
    # RNN/GRU/LSTM and packed sequences under vmap, as compile_dp traces them; batching rules
    # that are not torch's refused, as compile_dp refuses them (a user autograd.Function's vmap
    # staticmethod that mixed the batch moved this sum by 8.57 C: review).
    with recurrent_ops(), _own_batching_rules_only():
        return torch.func.vmap(per_example, in_dims=in_dims, randomness="different")(*args)


def _zeros_like_tree(tree: Any) -> Any:
    return optree.tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t, tree)


def _finish(
    summed: Any,
    norms: torch.Tensor,
    kept: torch.Tensor,
    clipping_norm: float,
    normalize_by: float | None,
    aux: Any = None,
    parameters: Any = None,
) -> ClippedPytree:
    if normalize_by is not None:
        summed = optree.tree_map(lambda t: t / normalize_by, summed)
    # The clipped sum is data, not part of an autograd graph: detaching frees the vmapped graph.
    summed = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, summed)
    n = int(norms.shape[0])
    return ClippedPytree(
        grads=summed,
        clipping_norm=clipping_norm,
        per_example_norms=norms.detach(),
        num_examples=n,
        normalize_by=normalize_by,
        num_nonfinite=int(n - int(kept.sum())),
        aux=aux,
        parameters=parameters if isinstance(parameters, dict) else None,
    )


def clipped_fun(
    fun: Callable[..., Any],
    *,
    batch_argnums: int | Sequence[int] = 0,
    clipping_norm: Any,
    normalize_by: float | None = None,
    keep_batch_dim: bool = True,
) -> tuple[Callable[..., tuple[ClippedPytree, ClipState]], ClipState]:
    """Clip and sum arbitrary per-example outputs.

    ``fun`` is evaluated once per example (under ``torch.func.vmap``; with ``keep_batch_dim``
    each example arrives as a batch of one). Each example's output tree is clipped to global
    L2 norm ``clipping_norm`` and the clipped outputs are summed over the batch.

    Args:
        fun: ``fun(*args) -> pytree of tensors`` for one example.
        batch_argnums: positions of the batched arguments (leading dim B).
        clipping_norm: C > 0 (or ``math.inf``, which warns).
        normalize_by: optional divisor of the sum (recorded in the result).
        keep_batch_dim: pass each example with a leading dimension of size 1.

    Returns:
        ``(fn, state)``; ``fn(*args, state=state) -> (ClippedPytree, state)``.

    Raises:
        ConfigurationError / InputTypeError: as :func:`clipped_grad`.
    """
    c = check_clipping_norm(clipping_norm)
    norm_by = _check_normalize_by(normalize_by)
    batch = _normalise_argnums(batch_argnums, "batch_argnums")

    def fn(*args: Any, state: ClipState | None = None) -> tuple[ClippedPytree, ClipState]:
        state = ClipState(c) if state is None else _checked_state(state)
        b = check_batch_size(args, batch)
        if b == 0:
            raise ConfigurationError(
                "clipped_fun cannot infer its output shapes from an empty batch; skip the call "
                "or use clipped_grad (whose output has the shape of the parameters)."
            )
        outs = _per_example_outputs(fun, args, batch, keep_batch_dim)
        summed, norms, kept = clip_and_sum(outs, state.clipping_norm)
        return _finish(summed, norms, kept, state.clipping_norm, norm_by), state

    return fn, ClipState(c)


def _grad_and_clip(
    loss_fn: Callable[..., Any],
    argnums: int | Sequence[int],
    batch_argnums: int | Sequence[int],
    has_aux: bool,
    keep_batch_dim: bool,
    transform: Callable[[Any], tuple[Any, torch.Tensor, torch.Tensor]],
    args: tuple,
    clipping_norm: float,
    normalize_by: float | None,
) -> ClippedPytree:
    arg_tuple = _normalise_argnums(argnums, "argnums")
    batch = _normalise_argnums(batch_argnums, "batch_argnums")
    overlap = set(arg_tuple) & set(batch)
    if overlap:
        raise ConfigurationError(f"Arguments {sorted(overlap)} are both differentiated (argnums) and batched (batch_argnums).")
    for i in arg_tuple:
        if i >= len(args):
            raise ConfigurationError(f"argnums names argument {i}, but only {len(args)} were passed.")
        reject_dp_output(args[i], where=f"argument {i}")
    b = check_batch_size(args, batch)
    wrt = args[arg_tuple[0]] if isinstance(argnums, int) else tuple(args[i] for i in arg_tuple)
    if b == 0:
        zero = _zeros_like_tree(wrt)
        empty = torch.zeros(0, dtype=torch.float32)
        return _finish(zero, empty, empty.bool(), clipping_norm, normalize_by, parameters=wrt)
    grad = torch.func.grad(loss_fn, argnums=argnums, has_aux=has_aux)
    outs = _per_example_outputs(grad, args, batch, keep_batch_dim)
    grads, aux = outs if has_aux else (outs, None)
    summed, norms, kept = transform(grads)
    return _finish(summed, norms, kept, clipping_norm, normalize_by, aux=aux, parameters=wrt)


def clipped_grad(
    loss_fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    batch_argnums: int | Sequence[int] = 1,
    clipping_norm: Any,
    normalize_by: float | None = None,
    has_aux: bool = False,
    keep_batch_dim: bool = True,
) -> tuple[Callable[..., tuple[ClippedPytree, ClipState]], ClipState]:
    """Per-example gradients, each clipped to ``clipping_norm``, summed (DP-SGD's clipped sum).

    ``loss_fn`` is differentiated per example (``torch.func.vmap(torch.func.grad(...))``,
    with independent randomness per example). With ``keep_batch_dim=True`` each example is
    passed as a batch of one, so an ordinary batch loss (mean or sum reduction) works as is.
    Each example's gradient with respect to ``args[argnums]`` is clipped over all its leaves
    together to L2 norm C, and the clipped gradients are summed over the batch (Abadi et al.
    2016). The sum has sensitivity C: adding or removing one example changes it by at most C.

    Args:
        loss_fn: ``loss_fn(*args) -> scalar`` (or ``(scalar, aux)`` with ``has_aux``).
        argnums: which argument(s) to differentiate (a pytree of tensors each).
        batch_argnums: which arguments carry the batch along dim 0; all must agree on B.
        clipping_norm: C > 0 as int, float or 0-d tensor; ``math.inf`` disables clipping and
            warns ``NotPrivateWarning``.
        normalize_by: optional divisor for eager users (recorded; ``DPOptimizer`` refuses it).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; the per-example ``aux`` (not private)
            lands in ``ClippedPytree.aux``.
        keep_batch_dim: pass each example with a leading batch dimension of size 1.

    Returns:
        ``(grad_fn, clip_state)`` with ``grad_fn(*args, state=clip_state) ->
        (ClippedPytree, new_state)``. ``grads`` has the structure of ``args[argnums]`` (a tuple
        of them for a tuple ``argnums``); ``per_example_norms`` has shape ``(B,)``.

    Raises:
        ConfigurationError: C <= 0 or NaN, batched arguments with different batch sizes,
            an argument both differentiated and batched, argnums out of range.
        InputTypeError: non-numeric C, a DP output wrapper passed as an argument.

    Example::

        >>> def loss(p, x, y):
        ...     return 0.5 * ((x @ p["w"] + p["b"] - y) ** 2).mean()
        >>> grad_fn, state = clipped_grad(loss, batch_argnums=(1, 2), clipping_norm=1.0)
        >>> p = {"w": torch.tensor([1.0, -1.0]), "b": torch.tensor(0.0)}
        >>> x = torch.tensor([[1.0, 0.0], [2.0, 2.0], [0.0, 3.0]]); y = torch.tensor([0.0, 1.0, 1.0])
        >>> clipped, state = grad_fn(p, x, y, state=state)
        >>> clipped.per_example_norms
        tensor([ 1.4142,  3.0000, 12.6491])
    """
    c = check_clipping_norm(clipping_norm)
    norm_by = _check_normalize_by(normalize_by)

    def grad_fn(*args: Any, state: ClipState | None = None) -> tuple[ClippedPytree, ClipState]:
        state = ClipState(c) if state is None else _checked_state(state)
        cn = state.clipping_norm
        result = _grad_and_clip(
            loss_fn, argnums, batch_argnums, has_aux, keep_batch_dim,
            lambda g: clip_and_sum(g, cn), args, cn, norm_by,
        )
        return result, state

    return grad_fn, ClipState(c)


def adaptive_clipped_grad(
    loss_fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    batch_argnums: int | Sequence[int] = 1,
    initial_clipping_norm: float,
    key: Any,
    expected_batch_size: float,
    target_quantile: float = 0.5,
    learning_rate: float = 0.2,
    count_noise_multiplier: float,
    normalize_by: float | None = None,
    has_aux: bool = False,
    keep_batch_dim: bool = True,
) -> tuple[Callable[..., tuple[ClippedPytree, AdaptiveClipState]], AdaptiveClipState]:
    """:func:`clipped_grad` with a clipping norm that tracks a quantile of the gradient norms.

    Andrew et al. 2021 ("Differentially Private Learning with Adaptive Clipping"): after each
    call, with ``b`` the fraction of examples whose norm is at most C, privatised as
    ``(count + N(0, count_noise_multiplier^2)) / expected_batch_size``, the norm is updated
    geometrically: ``C <- C * exp(-learning_rate * (b - target_quantile))``.

    Privacy: the noisy count is a second Gaussian query on the same sample, with sensitivity 1
    (the count is not centred) and noise std ``count_noise_multiplier``. Every result carries it
    in ``ClippedPytree.releases`` (``(accounting.gaussian(count_noise_multiplier),)``), and
    ``DPOptimizer`` charges each step as ``poisson(adaclip(sigma, count_noise_multiplier), q)``.
    To spend the budget of plain DP-SGD with noise ``sigma_total``, take the gradient noise from
    :func:`opake_compile.accounting.adaclip_noise_multipliers`.
    ``count_noise_multiplier=0`` warns that the norm update is not private (epsilon = inf).
    The returned state is usable once its result has been released (``DPOptimizer.step``, or
    ``gaussian_noise`` on the eager path): a call with a state whose result was never released
    raises, since the norm it carries depends on a count that was not charged. For the same
    reason its ``clipping_norm`` is not privatised before that release: do not log it earlier
    (see :class:`AdaptiveClipState`).

    Returns:
        ``(grad_fn, state)``; the returned state carries the updated C and advanced key.

    A retry (a second call with the state a call was given, after its step was refused) draws
    the same count noise as that call: once one of the two results is released, the other is
    refused by ``DPOptimizer.step`` and ``gaussian_noise``, its state is refused here, and so is
    a further call with the state both were computed from. Parts of one batch computed from one
    state (then accumulated) return states of one key whose counts share that noise: the first
    of them used carries the run on, and the others are refused. (States are plain values: one built
    by hand, or handed to another adaptive clipping function, is not checked.)

    Raises:
        ConfigurationError: (from ``grad_fn``) a state whose result has not been released; a
            state already used for a call whose result was released; a state of a key already
            used with another clipping norm; a process group of more than one rank (each rank
            would count its own examples: see :func:`_refuse_across_ranks`).
    """
    from opake_compile import random as _random

    c0 = check_clipping_norm(initial_clipping_norm, name="initial_clipping_norm")
    if math.isinf(c0):
        raise ConfigurationError("Expected a finite initial_clipping_norm for adaptive clipping.")
    if not (0.0 <= target_quantile <= 1.0):
        raise ConfigurationError(f"Expected target_quantile={target_quantile!r} in [0, 1].")
    if not (expected_batch_size > 0):
        raise ConfigurationError(f"Expected expected_batch_size={expected_batch_size!r} > 0.")
    if not (0 <= count_noise_multiplier < math.inf):  # also refuses NaN, which would poison C
        raise ConfigurationError(f"Expected count_noise_multiplier={count_noise_multiplier!r} to be finite and >= 0.")
    if not (0 < learning_rate < math.inf):
        raise ConfigurationError(f"Expected learning_rate={learning_rate!r} to be finite and > 0.")
    if count_noise_multiplier == 0:
        warnings.warn("count_noise_multiplier=0: the adaptive clipping norm is not private.", NotPrivateWarning, stacklevel=2)
    norm_by = _check_normalize_by(normalize_by)
    from opake_compile import accounting as _acc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)  # sigma_b = 0 was reported above
        count_release = _acc.gaussian(count_noise_multiplier)

    book = ReceiptBook()  # this function's states and the results they wait for

    def grad_fn(*args: Any, state: AdaptiveClipState) -> tuple[ClippedPytree, AdaptiveClipState]:
        state = _checked_state(state)
        _refuse_across_ranks()
        cn = state.clipping_norm
        refusal = book.refusal(state.key, cn)
        if refusal == "used":
            raise ConfigurationError(
                "This AdaptiveClipState was already used for a call whose result has been released: "
                "a further call with it draws the same count noise on another sample, and two such "
                "counts released would reveal their difference without noise. Continue from the state "
                "that call returned."
            )
        if refusal == "claimed":
            raise ConfigurationError(
                f"Another AdaptiveClipState with this key and a different clipping_norm (not {cn!r}) "
                "was used already: states of one key come from calls on one state (parts of a batch), "
                "and their counts carry the same noise, so using two of them would reveal the "
                "difference of the counts without noise. Continue from one of them."
            )
        if refusal == "pending":
            raise ConfigurationError(
                f"This AdaptiveClipState's clipping_norm={cn!r} was computed from the noisy count of "
                "a call whose result has not been released (passed to DPOptimizer.step or "
                "gaussian_noise): clipping with it would make the run depend on a count no "
                "accountant charged (a step that was refused or never taken). Step on that "
                "result first, or call again with the state that call was given."
            )
        result = _grad_and_clip(
            loss_fn, argnums, batch_argnums, has_aux, keep_batch_dim,
            lambda g: clip_and_sum(g, cn), args, cn, norm_by,
        )
        next_key, noise_key = _random.split(state.key, 2)
        gen = _random.generator_from_key(noise_key)
        below = float((result.per_example_norms <= cn).sum())
        noisy = below + count_noise_multiplier * float(torch.randn((), generator=gen, dtype=torch.float64))
        frac = noisy / expected_batch_size
        new_c = cn * math.exp(-learning_rate * (frac - target_quantile))
        # The noisy count is a second release from the same sample: the result says so, and
        # DPOptimizer charges it with the gradient query (accounting.adaclip).
        # The next C is a release too, made into the state: it may be used only once the result
        # has been released (and so charged), see ReleaseReceipt.
        receipt = ReleaseReceipt(book, state.key, (next_key, new_c), count_release)
        result = dataclasses.replace(
            result, releases=result.releases + (count_release,), receipts=result.receipts + (receipt,)
        )
        lock_releases(result)  # a copy that drops the count is refused
        book.claim(state.key, cn)
        return result, AdaptiveClipState(new_c, next_key)

    return grad_fn, AdaptiveClipState(c0, key)


def auto_clipped_grad(
    loss_fn: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    batch_argnums: int | Sequence[int] = 1,
    clipping_norm: float = 1.0,
    stability_constant: float = 0.01,
    normalize_by: float | None = None,
    has_aux: bool = False,
    keep_batch_dim: bool = True,
) -> tuple[Callable[..., tuple[ClippedPytree, ClipState]], ClipState]:
    """Automatic clipping (AUTO-S, Bu et al. 2023, "Automatic Clipping: Differentially Private
    Deep Learning Made Easier and Stronger"): every example is normalised,
    ``R * g_i / (||g_i|| + gamma)``, so each has norm below R and the sum has sensitivity R.

    Args:
        clipping_norm: R, the norm bound (and sensitivity) of each normalised example.
        stability_constant: gamma > 0; keeps small gradients from being blown up.

    Non-finite examples contribute exactly zero, as in :func:`clipped_grad`.
    """
    r = check_clipping_norm(clipping_norm)
    if math.isinf(r):
        raise ConfigurationError("Expected a finite clipping_norm for automatic clipping.")
    if not (stability_constant > 0):
        raise ConfigurationError(f"Expected stability_constant={stability_constant!r} > 0.")
    norm_by = _check_normalize_by(normalize_by)

    def normalise_and_sum(grads: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
        # The numerical contract of clip_and_sum: float64 norms, R shrunk by the sum dtype's
        # slack, factors rounded down, so that one example moves the float32 sum by at most R
        # (with R itself and float32 norms, 1 + 8.4e-8 R: review).
        _num.check_gradual_underflow()
        sq, acc = _per_example_sq_norms(grads)
        norms = sq.sqrt()
        kept = torch.isfinite(norms)
        r_eff = r * _num.clip_scale(acc)
        factor = _round_down(torch.where(kept, r_eff / (norms + stability_constant), torch.zeros_like(norms)), acc)
        return _weighted_sum(grads, kept, factor, acc), norms.to(acc), kept

    def grad_fn(*args: Any, state: ClipState | None = None) -> tuple[ClippedPytree, ClipState]:
        state = ClipState(r) if state is None else _checked_state(state)
        result = _grad_and_clip(
            loss_fn, argnums, batch_argnums, has_aux, keep_batch_dim,
            normalise_and_sum, args, r, norm_by,
        )
        return result, state

    return grad_fn, ClipState(r)
