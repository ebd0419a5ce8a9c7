"""Pytree utilities for parameter and gradient trees, built on optree.

Dict keys are traversed in sorted order (optree's convention). A *path* (:data:`ParamPath`) is
a tuple of ``str``/``int`` entries naming a leaf: the key ``"layers.0.weight"`` of a flat
``named_parameters()`` dict is the one-segment path ``("layers.0.weight",)``; nested trees give
multi-segment paths; a bare tensor has the empty path ``()``.

Example::

    >>> import torch, opake_compile as opake
    >>> tree = {"lora": {"a": torch.ones(2)}, "base": torch.zeros(3)}
    >>> lora, base = opake.pytree.partition(lambda path, leaf: path[0] == "lora", tree)
    >>> sorted(lora), sorted(base)
    (['lora'], ['base'])
    >>> float(opake.pytree.global_norm(tree)) ** 2
    2.0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import optree
import torch

from opake_compile._markers import reject_dp_output
from opake_compile.exceptions import InputTypeError

__all__ = [
    "ParamPath",
    "param_path",
    "param_path_display",
    "tree_map",
    "tree_map_with_path",
    "tree_leaves",
    "tree_flatten",
    "tree_flatten_with_paths",
    "tree_unflatten",
    "tree_structure",
    "partition",
    "merge",
    "global_norm",
]

ParamPath: TypeAlias = tuple[str | int, ...]
PyTree: TypeAlias = Any

_MISSING = object()


def param_path(path: str | int | Sequence[str | int]) -> ParamPath:
    """Normalise ``path`` to a :data:`ParamPath`.

    A ``str`` is one segment (``"layers.0.weight"`` -> ``("layers.0.weight",)``), an ``int`` one
    index; a sequence is converted component-wise.

    Raises:
        InputTypeError: a component is neither ``str`` nor ``int`` (``bool`` is refused).
    """
    if isinstance(path, (str, int)) and not isinstance(path, bool):
        return (path,)
    if not isinstance(path, Sequence):
        raise InputTypeError(f"Expected a parameter path (str, int or a sequence of them), got {path!r}.")
    out = []
    for part in path:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise InputTypeError(
                f"Expected every parameter path component to be str or int, got {part!r} "
                f"({type(part).__name__}) in {path!r}."
            )
        out.append(part)
    return tuple(out)


def param_path_display(path: str | int | Sequence[str | int]) -> str:
    """Join a path with dots: ``("layers", 0, "w")`` -> ``"layers.0.w"``."""
    return ".".join(str(p) for p in param_path(path))


def _check(tree: PyTree, where: str) -> None:
    reject_dp_output(tree, where=where)
    for leaf in optree.tree_leaves(tree):
        reject_dp_output(leaf, where=where)


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Apply ``fn`` leaf-wise over one or more trees of the same structure."""
    for t in (tree, *rest):
        _check(t, "tree_map")
    return optree.tree_map(fn, tree, *rest)


def tree_map_with_path(fn: Callable[[ParamPath, Any], Any], tree: PyTree) -> PyTree:
    """Apply ``fn(path, leaf)`` to every leaf; ``path`` is a :data:`ParamPath`."""
    _check(tree, "tree_map_with_path")
    return optree.tree_map_with_path(fn, tree)


def tree_leaves(tree: PyTree) -> list[torch.Tensor]:
    """The tensor leaves of ``tree`` in traversal order (non-tensor leaves are skipped)."""
    _check(tree, "tree_leaves")
    return [leaf for leaf in optree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def tree_flatten(tree: PyTree) -> tuple[list[Any], optree.PyTreeSpec]:
    """``(leaves, treedef)``; ``tree_unflatten(treedef, leaves)`` rebuilds the tree."""
    _check(tree, "tree_flatten")
    return optree.tree_flatten(tree)


def tree_flatten_with_paths(tree: PyTree) -> tuple[list[ParamPath], list[Any], optree.PyTreeSpec]:
    """``(paths, leaves, treedef)`` with one :data:`ParamPath` per leaf."""
    _check(tree, "tree_flatten_with_paths")
    return optree.tree_flatten_with_path(tree)


def tree_unflatten(treedef: optree.PyTreeSpec, leaves: Sequence[Any]) -> PyTree:
    """Inverse of :func:`tree_flatten`."""
    return optree.tree_unflatten(treedef, list(leaves))


def tree_structure(tree: PyTree) -> optree.PyTreeSpec:
    """The tree definition (structure without leaves)."""
    _check(tree, "tree_structure")
    return optree.tree_structure(tree)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _partition(pred: Callable[[ParamPath, Any], bool], node: Any, path: ParamPath) -> tuple[Any, Any]:
    if node is None:
        return _MISSING, _MISSING
    if isinstance(node, dict):
        yes, no = {}, {}
        for k in sorted(node.keys()) if _sortable(node) else node.keys():
            a, b = _partition(pred, node[k], (*path, k))
            if a is not _MISSING:
                yes[k] = a
            if b is not _MISSING:
                no[k] = b
        # Keep the input's key order (and dict subclass) in both halves.
        yes = type(node)((k, yes[k]) for k in node if k in yes) if yes else _MISSING
        no = type(node)((k, no[k]) for k in node if k in no) if no else _MISSING
        return yes, no
    if isinstance(node, (list, tuple)):
        parts = [_partition(pred, child, (*path, i)) for i, child in enumerate(node)]

        def build(side: int) -> Any:
            items = [None if p[side] is _MISSING else p[side] for p in parts]
            if all(p[side] is _MISSING for p in parts):
                return _MISSING
            if _is_namedtuple(node):
                return type(node)(*items)
            return type(node)(items)

        return build(0), build(1)
    reject_dp_output(node, where="partition")
    return (node, _MISSING) if pred(path, node) else (_MISSING, node)


def _sortable(d: dict) -> bool:
    try:
        sorted(d.keys())
        return True
    except TypeError:
        return False


def _empty_like(tree: Any) -> Any:
    if isinstance(tree, dict):
        return type(tree)()
    if _is_namedtuple(tree):
        return type(tree)(*([None] * len(tree)))
    if isinstance(tree, (list, tuple)):
        return type(tree)()
    return None


def partition(predicate: Callable[[ParamPath, Any], bool], tree: PyTree) -> tuple[PyTree, PyTree]:
    """Split ``tree`` into ``(matching, rest)`` by ``predicate(path, leaf)``.

    Both halves keep the input's structure: dict branches left empty are dropped, list/tuple
    positions keep ``None`` placeholders, and an empty half is ``{}`` for a dict input (an empty
    container of the input's type otherwise, ``None`` for a bare leaf). ``merge(*partition(p, t))``
    gives back ``t``. Typical use: split LoRA adapters from a frozen backbone.

    Raises:
        InputTypeError: ``tree`` contains a DP output wrapper.
    """
    reject_dp_output(tree, where="partition")
    yes, no = _partition(predicate, tree, ())
    return (
        _empty_like(tree) if yes is _MISSING else yes,
        _empty_like(tree) if no is _MISSING else no,
    )


def _merge2(a: Any, b: Any) -> Any:
    if b is None:
        return a
    if a is None:
        return b
    if isinstance(a, dict) and isinstance(b, dict):
        out = type(a)(a)
        for k, v in b.items():
            out[k] = _merge2(out[k], v) if k in out else v
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        n = max(len(a), len(b))
        items = [
            _merge2(a[i] if i < len(a) else None, b[i] if i < len(b) else None) for i in range(n)
        ]
        return type(a)(*items) if _is_namedtuple(a) else type(a)(items)
    return b


def merge(*trees: PyTree) -> PyTree:
    """Recursively merge trees; later trees win on overlapping leaves.

    ``None`` arguments (and ``None`` placeholders inside lists/tuples) are skipped; no
    argument gives ``{}``. Inverse of :func:`partition`.
    """
    out: Any = _MISSING
    for t in trees:
        if t is None:
            continue
        _check(t, "merge")
        out = t if out is _MISSING else _merge2(out, t)
    return {} if out is _MISSING else out


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype == torch.float64 or dtype == torch.complex128:
        return torch.float64
    return torch.float32


def global_norm(tree: PyTree, *, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The L2 norm of all entries of all tensor leaves: ``sqrt(sum_leaf sum_entry |x|^2)``.

    Args:
        tree: a pytree of tensors (any shapes). DP output wrappers are refused.
        compute_dtype: accumulation dtype; must be a real floating dtype. By default at least
            float32: float16/bfloat16/integer/bool leaves accumulate in float32, float64 (and
            complex128) in float64; complex leaves count ``|z|^2``.

    Returns:
        A 0-d tensor of the accumulation dtype on the first leaf's device (a float32 zero on
        the CPU for an empty tree).

    Raises:
        InputTypeError: ``compute_dtype`` is not a real floating dtype, or the tree holds a DP
            output wrapper.

    Works under ``torch.compile`` (no Python branch on data).
    """
    if compute_dtype is not None:
        if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
            raise InputTypeError(f"Expected compute_dtype to be a real floating dtype, got {compute_dtype!r}.")
    leaves = tree_leaves(tree)
    if not leaves:
        return torch.zeros((), dtype=compute_dtype or torch.float32)
    if compute_dtype is None:
        compute_dtype = torch.float32
        for leaf in leaves:
            if _accumulation_dtype(leaf.dtype) == torch.float64:
                compute_dtype = torch.float64
    device = leaves[0].device
    total = torch.zeros((), dtype=compute_dtype, device=device)
    for leaf in leaves:
        # |z|^2 = re^2 + im^2, squared in compute_dtype (abs() would round |z| in the leaf's precision).
        x = torch.view_as_real(leaf.resolve_conj()) if leaf.dtype.is_complex else leaf
        x = x.to(device=device, dtype=compute_dtype)
        total = total + (x * x).sum()
    return total.sqrt()
