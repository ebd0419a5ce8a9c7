"""JAX clipping primitives: DP-SGD's clipping step written in JAX, an independent oracle.

This module is **optional**. It needs JAX, installed with the extra::

    pip install "opake-compile[jax]"

and nothing else in ``opake_compile`` ever imports JAX: the library is a PyTorch library. The
module exists for two reasons. It states the specification's reference values (SPEC §3,
"Reference values") in the form they were posed, as JAX functions called inside ``jax.jit``;
and it gives the test suite a second implementation, written in another framework, to check
the torch reference (:func:`opake_compile.dpsgd.clipping.clipped_grad`) and the compiled path
against.

DP-SGD (Abadi et al. 2016, "Deep Learning with Differential Privacy") bounds each example's
influence by clipping its gradient ``g`` to L2 norm C: ``g * min(1, C / ||g||)``.

Both functions are jit-able with every argument traced. Nothing branches in Python on data:
the clip factor is a select (``jnp.where``). Structure (tree layout, shapes, dtypes) is static
under ``jax.jit`` and is checked eagerly with the project's exceptions; the *value* of
``max_norm`` can only be checked when it is concrete (an eager call, or ``static_argnums``).

Edge cases, shared by both functions:

==========================  ===============================================================
C = inf                     the identity (no clipping); a concrete C warns
                            ``NotPrivateWarning``
C <= 0, NaN                 ``ConfigurationError`` when concrete; a traced invalid C gives
                            NaN everywhere (loud, never a silently wrong scale)
zero gradient               clip factor exactly 1 (``||g|| <= C``), contributes zero
||g|| <= C                  leaves come back bit-for-bit unchanged (factor is exactly 1)
non-finite gradient         :func:`clip_by_global_norm`: every entry NaN (a non-finite tree
                            cannot be clipped). :func:`clipped_mean_grad_linear`: that
                            example contributes exactly zero (a select, never ``0 * NaN``)
float32 overflow of ||g||²  counts as a non-finite norm (entries above ~1.8e19)
empty tree / batch          norm 0, tree unchanged / zero gradient, norms of shape (0,)
==========================  ===============================================================

Example::

    >>> import jax, opake_compile.jax as opj
    >>> out = jax.jit(opj.clip_by_global_norm)({"w": [3.0, 0.0], "b": 4.0}, 1.0)
    >>> round(float(out["clipped"]["b"]), 6), float(out["global_norm"])
    (0.8, 5.0)
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any

try:
    # Absolute import (PEP 328): this is the real JAX, not this module.
    import jax
    import jax.numpy as jnp
except ImportError as _err:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "opake_compile.jax needs JAX, an optional dependency of opake-compile. Install it with "
        "`pip install \"opake-compile[jax]\"` (or `pip install jax`). The rest of opake_compile "
        "does not need JAX."
    ) from _err

import numpy as np

from opake_compile._markers import reject_dp_output
from opake_compile._validate import NotPrivateWarning
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = ["clip_by_global_norm", "clipped_mean_grad_linear"]

_LEAF_TYPES = (jax.Array, np.ndarray, np.generic, numbers.Number)


# ---------------------------------------------------------------------------------------------
# Validation (static facts only: tree structure, shapes, dtypes; values when concrete)
# ---------------------------------------------------------------------------------------------


def _check_max_norm(max_norm: Any) -> Any:
    """Check ``max_norm`` as far as is possible without concretising a tracer."""
    if isinstance(max_norm, (bool, np.bool_)):
        raise InputTypeError(f"Expected max_norm to be a real number, got bool {max_norm!r}.")
    if isinstance(max_norm, (jax.Array, np.ndarray, np.generic)):
        if np.ndim(max_norm) != 0:
            raise InputTypeError(
                f"Expected max_norm to be a scalar, got an array of shape {tuple(np.shape(max_norm))}."
            )
        dtype = jnp.asarray(max_norm).dtype if not isinstance(max_norm, jax.Array) else max_norm.dtype
        if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
            raise InputTypeError(f"Expected max_norm to be real, got dtype {dtype}.")
        if isinstance(max_norm, jax.core.Tracer):
            return max_norm  # value unknown under tracing; invalid values give NaN (see module doc)
    elif not isinstance(max_norm, numbers.Real):
        raise InputTypeError(
            f"Expected max_norm to be a real number or a scalar array, got {type(max_norm).__name__}."
        )
    c = float(max_norm)
    if math.isnan(c) or c <= 0:
        raise ConfigurationError(f"Expected max_norm={c!r} > 0 (use math.inf to disable clipping).")
    if math.isinf(c):
        warnings.warn(
            "max_norm=inf: gradients are not clipped, so the result has unbounded sensitivity "
            "and no noise level makes it differentially private.",
            NotPrivateWarning,
            stacklevel=3,
        )
    return max_norm


def _leaves_with_paths(tree: Any, where: str) -> tuple[list[Any], Any]:
    """Flatten ``tree``; refuse DP wrappers and anything that is not an array or a number."""
    reject_dp_output(tree, where=where)
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)  # jax >= 0.4.6
    leaves = []
    for path, leaf in path_leaves:
        reject_dp_output(leaf, where=where)
        if isinstance(leaf, (str, bytes)) or not isinstance(leaf, _LEAF_TYPES):
            raise InputTypeError(
                f"{where} expects a pytree of JAX/NumPy arrays or numbers; the leaf at "
                f"{jax.tree_util.keystr(path) or '<root>'} is a {type(leaf).__name__}."
            )
        leaf = jnp.asarray(leaf)
        if not (jnp.issubdtype(leaf.dtype, jnp.number) or leaf.dtype == jnp.bool_):
            raise InputTypeError(
                f"{where}: the leaf at {jax.tree_util.keystr(path) or '<root>'} has dtype "
                f"{leaf.dtype}, expected a numeric dtype."
            )
        leaves.append(leaf)
    return leaves, treedef


def _accumulation_dtype(dtypes: list[Any]) -> Any:
    """At least float32; float64 when a leaf is float64/complex128 (only under x64 mode)."""
    wide = any(d in (jnp.float64, jnp.complex128) for d in dtypes)
    return jnp.float64 if wide else jnp.float32


def _output_dtype(dtype: Any) -> Any:
    """Floating/complex leaves keep their dtype; integer/bool leaves (Python ints) become
    float32, since a clipped value cannot be represented in them."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return dtype
    return jnp.float32


# ---------------------------------------------------------------------------------------------
# The clip factor (no Python branch on data)
# ---------------------------------------------------------------------------------------------


def _clip_factor(norm: jax.Array, c: jax.Array) -> jax.Array:
    """``min(1, C / norm)`` as selects: exactly 1 when ``norm <= C`` (covers norm 0 and
    C = inf), NaN when the norm is not finite and exceeds C, NaN for an invalid C.

    The divisor is itself selected (``where(within, 1, norm)``) so that differentiating through
    the unselected branch never meets ``C / 0`` (the double-``where`` rule of JAX's FAQ).
    """
    within = norm <= c
    scaled = jnp.where(jnp.isfinite(norm), c / jnp.where(within, jnp.ones_like(norm), norm), jnp.nan)
    factor = jnp.where(within, jnp.ones_like(norm), scaled)
    return jnp.where(c > 0, factor, jnp.nan)


def _sqrt0(total: jax.Array) -> jax.Array:
    """``sqrt`` with a finite derivative at 0 (so ``jax.grad`` through a zero gradient tree is
    not NaN); the same values everywhere, NaN included."""
    zero = total == 0
    return jnp.where(zero, jnp.zeros_like(total), jnp.sqrt(jnp.where(zero, jnp.ones_like(total), total)))


def _global_norm(leaves: list[jax.Array], acc: Any) -> jax.Array:
    total = jnp.zeros((), acc)
    for leaf in leaves:
        x = leaf.astype(acc) if not jnp.issubdtype(leaf.dtype, jnp.complexfloating) else jnp.abs(leaf).astype(acc)
        total = total + jnp.sum(x * x)
    return _sqrt0(total)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def clip_by_global_norm(grads: Any, max_norm: Any) -> dict[str, Any]:
    """Clip a gradient pytree to global L2 norm ``max_norm``.

    Every leaf is scaled by the same factor ``s = min(1, C / ||g||)``, where ``||g||`` is the
    square root of the sum of squares of every entry of every leaf (Abadi et al. 2016). The
    result has L2 norm ``min(||g||, C)`` up to the rounding of the leaves back to their dtype
    (measured: at most 1.0000001 C for float32 leaves, 1.0019 C for bfloat16 ones, over 300
    random trees); a tree already within C comes back unchanged.

    Jit-able with both arguments traced; the factor is a ``jnp.where`` select, never a Python
    branch on data. Low-precision leaves (bfloat16, float16) are squared and summed in float32,
    and scaled in float32 before being rounded back once to their own dtype.

    Args:
        grads: any JAX pytree (dicts, lists, tuples, ...) whose leaves are arrays or numbers of
            any shapes. Python lists are pytree nodes, so ``{"w": [3.0, 0.0]}`` has two scalar
            leaves under ``w`` and comes back with the same layout.
        max_norm: C > 0 in gradient units: a Python number or a scalar array; ``math.inf``
            disables clipping (and warns when concrete).

    Returns:
        ``{"clipped": tree, "global_norm": norm}``. ``clipped`` has the structure of ``grads``
        and leaves of the input leaves' shapes and dtypes (integer/bool leaves, such as Python
        ints, come back as float32). ``global_norm`` is the float32 0-d norm before clipping
        (float64 if a leaf is float64 under ``jax_enable_x64``). See the module docstring for
        C = inf, a zero gradient, non-finite gradients and an empty tree (norm 0).

    Raises:
        InputTypeError: a leaf is not an array or number (a torch tensor, a string, a DP output
            wrapper), or ``max_norm`` is not a real scalar.
        ConfigurationError: a concrete ``max_norm`` is <= 0 or NaN.

    Example::

        >>> import jax, opake_compile.jax as opj
        >>> out = jax.jit(opj.clip_by_global_norm)({"layers": [{"w": [0.6, 0.6]}] * 3}, 1.0)
        >>> round(float(out["clipped"]["layers"][0]["w"][0]), 6), round(float(out["global_norm"]), 6)
        (0.408248, 1.469694)
    """
    max_norm = _check_max_norm(max_norm)
    leaves, treedef = _leaves_with_paths(grads, "clip_by_global_norm")
    acc = _accumulation_dtype([leaf.dtype for leaf in leaves])
    norm = _global_norm(leaves, acc)
    factor = _clip_factor(norm, jnp.asarray(max_norm).astype(acc))

    def scale(leaf: jax.Array) -> jax.Array:
        out = _output_dtype(leaf.dtype)
        if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
            return (leaf * factor).astype(out)
        return (leaf.astype(jnp.promote_types(acc, leaf.dtype)) * factor).astype(out)

    clipped = jax.tree_util.tree_unflatten(treedef, [scale(leaf) for leaf in leaves])
    return {"clipped": clipped, "global_norm": norm}


def _as_array(value: Any, name: str) -> jax.Array:
    reject_dp_output(value, where="clipped_mean_grad_linear")
    for leaf in jax.tree_util.tree_leaves(value):  # a nested list is a pytree: check its numbers
        if isinstance(leaf, (str, bytes)) or not isinstance(leaf, _LEAF_TYPES):
            raise InputTypeError(
                f"Expected {name} to be an array, a number or a (nested) list of numbers; it "
                f"holds a {type(leaf).__name__}."
            )
    try:
        arr = jnp.asarray(value)
    except (TypeError, ValueError) as err:
        raise InputTypeError(
            f"Expected {name} to be an array, a number or a (nested) list of numbers: {err}"
        ) from None
    if not (jnp.issubdtype(arr.dtype, jnp.floating) or jnp.issubdtype(arr.dtype, jnp.integer)):
        raise InputTypeError(f"Expected {name} to have a real dtype, got {arr.dtype}.")
    return arr


def _linear_loss(params: dict[str, jax.Array], x_n: jax.Array, y_n: jax.Array) -> jax.Array:
    """Per-example loss ½(x_n·w + b − y_n)²; HIGHEST precision so TPU/GPU dots are float32."""
    pred = jnp.dot(x_n, params["w"], precision=jax.lax.Precision.HIGHEST) + params["b"]
    return 0.5 * (pred - y_n) ** 2


def clipped_mean_grad_linear(params: Mapping[str, Any], x: Any, y: Any, max_norm: Any) -> dict[str, Any]:
    """Mean of clipped per-example gradients of a linear model with squared loss.

    The per-example loss is ``loss_n = ½(x_n·w + b − y_n)²``. Per-example gradients come from
    ``jax.vmap(jax.grad(loss))``; example n's gradient ``g_n = (r_n x_n, r_n)`` with
    ``r_n = x_n·w + b − y_n`` is clipped over all D + 1 entries together to
    ``g_n * min(1, C / ||g_n||)``, and the clipped gradients are averaged over the N examples
    (DP-SGD's clipping step, Abadi et al. 2016; the mean, not the noised sum).

    Args:
        params: ``{"w": (D,), "b": ()}``; arrays, numbers or lists of numbers.
        x: inputs, shape ``(N, D)``; an array or a nested list.
        y: targets, shape ``(N,)``; an array or a list.
        max_norm: C > 0 in gradient units (Python number or scalar array; ``math.inf`` means
            no clipping and warns when concrete).

    Returns:
        ``{"grads": {"w": (D,), "b": ()}, "norms": (N,)}``, all float32 (float64 when an input
        is float64 under ``jax_enable_x64``). ``norms`` are the per-example L2 norms before
        clipping (not privatised). Edge cases: N = 1 gives that example's clipped gradient;
        N = 0 gives zero gradients and norms of shape ``(0,)``; an example with a non-finite
        gradient contributes exactly zero (its norm is reported as is); integer and
        low-precision inputs are computed in float32.

    Raises:
        InputTypeError: ``params`` is not a mapping with exactly the keys ``"w"`` and ``"b"``,
            an input has the wrong number of dimensions or a non-real dtype, or ``max_norm``
            is not a real scalar.
        ConfigurationError: the shapes disagree (``x.shape[1] != D`` or ``y.shape[0] != N``),
            or a concrete ``max_norm`` is <= 0 or NaN.

    Example::

        >>> import jax, opake_compile.jax as opj
        >>> out = jax.jit(opj.clipped_mean_grad_linear)(
        ...     {"w": [2.0, 1.0], "b": -1.0}, [[1.0, 1.0], [0.5, -1.0]], [2.0, -4.0], 2.0)
        >>> [round(float(v), 6) for v in out["grads"]["w"]], round(float(out["grads"]["b"]), 6)
        ([0.333333, -0.666667], 0.666667)
        >>> [round(float(v), 6) for v in out["norms"]]
        [0.0, 4.5]
    """
    max_norm = _check_max_norm(max_norm)
    reject_dp_output(params, where="clipped_mean_grad_linear")
    if not isinstance(params, Mapping) or set(params) != {"w", "b"}:
        got = sorted(map(str, params)) if isinstance(params, Mapping) else type(params).__name__
        raise InputTypeError(f'Expected params to be a mapping with keys "w" and "b", got {got}.')
    w = _as_array(params["w"], 'params["w"]')
    b = _as_array(params["b"], 'params["b"]')
    x = _as_array(x, "x")
    y = _as_array(y, "y")
    for name, arr, ndim, shape in (
        ('params["w"]', w, 1, "(D,)"),
        ('params["b"]', b, 0, "()"),
        ("x", x, 2, "(N, D)"),
        ("y", y, 1, "(N,)"),
    ):
        if arr.ndim != ndim:
            raise InputTypeError(f"Expected {name} of shape {shape}, got shape {tuple(arr.shape)}.")
    n, d = x.shape
    if d != w.shape[0]:
        raise ConfigurationError(f"Expected x.shape[1]={d} to equal the length of params['w'] ({w.shape[0]}).")
    if y.shape[0] != n:
        raise ConfigurationError(f"Expected y.shape[0]={y.shape[0]} to equal the batch size x.shape[0]={n}.")

    dtype = _accumulation_dtype([a.dtype for a in (w, b, x, y)])
    p = {"w": w.astype(dtype), "b": b.astype(dtype)}
    x, y = x.astype(dtype), y.astype(dtype)
    c = jnp.asarray(max_norm).astype(dtype)

    per_example = jax.vmap(jax.grad(_linear_loss), in_axes=(None, 0, 0))(p, x, y)
    g_w, g_b = per_example["w"], per_example["b"]  # (N, D), (N,)
    norms = _sqrt0(jnp.sum(g_w * g_w, axis=1) + g_b * g_b)  # (N,)
    factor = _clip_factor(norms, c)
    kept = jnp.isfinite(norms)
    contrib_w = jnp.where(kept[:, None], g_w * factor[:, None], jnp.zeros_like(g_w))
    contrib_b = jnp.where(kept, g_b * factor, jnp.zeros_like(g_b))
    denom = max(n, 1)  # N is static (a shape); N = 0 gives zero gradients, not 0/0
    grads = {"w": jnp.sum(contrib_w, axis=0) / denom, "b": jnp.sum(contrib_b) / denom}
    return {"grads": grads, "norms": norms}
