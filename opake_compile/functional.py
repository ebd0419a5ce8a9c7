"""Functional models and per-example helpers.

* :func:`make_functional` turns an ``nn.Module`` into a pure function of its parameters, a thin
  layer over :func:`torch.func.functional_call`, so that ``torch.func.vmap(grad(...))`` computes
  per-example gradients of exactly the parameters you pass (optionally only the trainable ones).
* :func:`with_batch_dim` lets code written for a leading batch dimension run per example under
  ``vmap``.
* :func:`empty_collate` makes a collate function survive the empty batches that Poisson
  subsampling produces.
* :func:`merge` is :func:`opake_compile.pytree.merge`, re-exported for joining a
  ``(trainable, frozen)`` partition.

Example::

    >>> import torch
    >>> from opake_compile.functional import make_functional
    >>> model = torch.nn.Linear(3, 1)
    >>> fmodel, params = make_functional(model)
    >>> x = torch.randn(5, 3)
    >>> torch.allclose(fmodel(params, x), model(x))
    True
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import optree
import torch
from torch import nn

from opake_compile._validate import check_positive_int
from opake_compile.exceptions import ConfigurationError, InputTypeError
from opake_compile.pytree import merge

__all__ = ["make_functional", "with_batch_dim", "empty_collate", "merge"]


# --------------------------------------------------------------------------------------------
# make_functional
# --------------------------------------------------------------------------------------------


def make_functional(
    module: nn.Module,
    disable_autograd_tracking: bool = False,
    partition_trainable: bool = False,
):
    """Make ``module`` a pure function of its parameters (via ``torch.func.functional_call``).

    Buffers are not passed in: ``fmodel`` uses the module's own buffers (live, so a BatchNorm
    in training mode still updates ``module``'s running statistics). Tied parameters appear once
    (``named_parameters()`` de-duplicates them) and stay tied. ``fmodel`` works under
    ``torch.func.vmap``, ``grad`` and ``torch.compile``.

    Args:
        module: the model.
        disable_autograd_tracking: return detached copies of the parameters (``requires_grad``
            False, sharing storage) instead of the ``nn.Parameter`` objects themselves. This
            never changes the trainable/frozen partition, which is decided on the original
            parameters.
        partition_trainable: split the parameters on ``requires_grad`` into two dicts.

    Returns:
        With ``partition_trainable=False``: ``(fmodel, params)``. ``params`` is a tuple in
        ``named_parameters()`` order; ``fmodel(params, *args, **kwargs)`` runs the module with
        them (``params`` a tuple or list of that length). ``fmodel.param_names`` holds the
        names.

        With ``partition_trainable=True``: ``(fmodel, trainable, frozen)``, dicts keyed like
        ``named_parameters()`` (in that order). ``fmodel(params_dict, *args, **kwargs)`` needs
        every trainable name in ``params_dict``; frozen names are optional and default to the
        captured ``frozen`` values, so both ``fmodel(trainable, x)`` and
        ``fmodel(merge(trainable, frozen), x)`` work (a frozen entry passed explicitly wins).
        Requiring every trainable name guarantees that ``grad`` w.r.t. the dict never silently
        falls back to the module's own parameters. ``fmodel.trainable_names`` and
        ``fmodel.frozen_names`` hold the names.

    Raises:
        InputTypeError: ``module`` is not an ``nn.Module``; at call time, ``params`` has the
            wrong type or length, or ``params_dict`` lacks a trainable name or has an unknown
            name.

    Example::

        >>> import torch
        >>> from opake_compile.pytree import merge
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        >>> model[0].weight.requires_grad_(False)  # doctest: +ELLIPSIS
        Parameter containing:...
        >>> fmodel, trainable, frozen = make_functional(model, partition_trainable=True)
        >>> sorted(frozen)
        ['0.weight']
        >>> x = torch.randn(2, 3)
        >>> torch.allclose(fmodel(trainable, x), fmodel(merge(trainable, frozen), x))
        True
    """
    if not isinstance(module, nn.Module):
        raise InputTypeError(f"Expected module to be a torch.nn.Module, got {type(module).__name__}.")
    named = list(module.named_parameters())
    names = tuple(n for n, _ in named)

    def prepare(p: torch.Tensor) -> torch.Tensor:
        return p.detach() if disable_autograd_tracking else p

    if not partition_trainable:
        params = tuple(prepare(p) for _, p in named)

        def fmodel(params: Sequence[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            if not isinstance(params, (tuple, list)):
                raise InputTypeError(
                    f"Expected params to be a tuple of {len(names)} tensors in "
                    f"named_parameters() order, got {type(params).__name__}."
                )
            if len(params) != len(names):
                raise InputTypeError(
                    f"Expected params to hold {len(names)} tensors (one per named parameter), "
                    f"got {len(params)}."
                )
            return torch.func.functional_call(module, dict(zip(names, params)), args, kwargs)

        fmodel.param_names = names  # type: ignore[attr-defined]
        return fmodel, params

    # Decide the partition on the original parameters, before any detaching.
    trainable = {n: prepare(p) for n, p in named if p.requires_grad}
    frozen = {n: prepare(p) for n, p in named if not p.requires_grad}
    trainable_names = frozenset(trainable)
    all_names = frozenset(names)

    def fmodel_dict(params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        if not isinstance(params, Mapping):
            raise InputTypeError(
                f"Expected a dict of parameters keyed like named_parameters(), got "
                f"{type(params).__name__}."
            )
        unknown = set(params) - all_names
        if unknown:
            raise InputTypeError(f"Unknown parameter names {sorted(map(str, unknown))}; expected names of {names}.")
        missing = trainable_names - set(params)
        if missing:
            raise InputTypeError(
                f"Missing trainable parameters {sorted(missing)}: pass every trainable "
                "parameter (frozen ones default to the captured values)."
            )
        full = dict(frozen)
        full.update(params)
        return torch.func.functional_call(module, full, args, kwargs)

    fmodel_dict.param_names = names  # type: ignore[attr-defined]
    fmodel_dict.trainable_names = tuple(trainable)  # type: ignore[attr-defined]
    fmodel_dict.frozen_names = tuple(frozen)  # type: ignore[attr-defined]
    return fmodel_dict, trainable, frozen


# --------------------------------------------------------------------------------------------
# with_batch_dim
# --------------------------------------------------------------------------------------------

_MARK = "__opake_with_batch_dim__"


def _as_tuple(value: Any, *, kind: type, name: str) -> tuple:
    label = "an int" if kind is numbers.Integral else "a str"
    if isinstance(value, kind) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InputTypeError(f"Expected {name} to be {label} or a sequence of them, got {value!r}.")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, kind):
            raise InputTypeError(f"Expected every entry of {name} to be {label}, got {v!r}.")
        out.append(int(v) if kind is numbers.Integral else v)
    return tuple(out)


def _unsqueeze_leaves(tree: Any, threshold: int | None) -> tuple[Any, bool]:
    changed = False

    def fn(leaf: Any) -> Any:
        nonlocal changed
        if isinstance(leaf, torch.Tensor) and (threshold is None or leaf.dim() < threshold):
            changed = True
            return leaf.unsqueeze(0)
        return leaf

    return optree.tree_map(fn, tree), changed


def _squeeze_top_level(out: Any) -> Any:
    def sq(x: Any) -> Any:
        return x.squeeze(0) if isinstance(x, torch.Tensor) and x.dim() > 0 else x

    if isinstance(out, torch.Tensor):
        return sq(out)
    if isinstance(out, tuple) and hasattr(type(out), "_fields"):
        return type(out)(*(sq(x) for x in out))
    if isinstance(out, (tuple, list)):
        return type(out)(sq(x) for x in out)
    if isinstance(out, dict):
        return type(out)((k, sq(v)) for k, v in out.items())
    return out


def with_batch_dim(
    fn: Callable[..., Any],
    batch_argnums: int | Sequence[int] = (),
    batch_kwargs: str | Sequence[str] = (),
    *,
    min_ndim: int | Mapping[str | int, int] | None = None,
) -> Callable[..., Any]:
    """Give ``fn`` a leading batch dimension of size 1 on its batch arguments.

    For code written for a batch that must run per example under ``vmap`` (e.g. a batch loss
    fed to ``clipped_grad``): inside ``vmap`` each example has lost its batch dimension, and
    this wrapper puts a size-1 one back.

    Modes:

    * ``min_ndim=None`` (default): every tensor leaf of every named argument is unsqueezed at
      dim 0, always; the output is never touched.
    * ``min_ndim=N`` (an int >= 1), or a dict of thresholds keyed by argument position (int) or
      keyword name (str) covering every named argument: only tensor leaves with fewer than the
      threshold's dims are unsqueezed, and if anything was unsqueezed the top-level output
      tensors (the output itself, or the direct tensor items of a tuple/list/dict output) are
      squeezed at dim 0 (only where that dim has size 1). Already-batched input therefore
      passes through unchanged: a no-op.

    Non-tensor leaves are passed through. Keyword arguments named in ``batch_kwargs`` are also
    recognised when passed positionally (matched through ``inspect.signature(fn)``); an
    argument named both ways is unsqueezed once. The wrapper keeps ``fn``'s name, docstring and
    signature (``functools.wraps``).

    Wrapping a wrapper is a no-op: ``with_batch_dim(with_batch_dim(f, 0), 0)`` returns the inner
    wrapper, so no argument is ever unsqueezed twice. Re-wrapping with a *different*
    configuration raises instead of silently keeping one of the two.

    Args:
        fn: the function.
        batch_argnums: positions (int or sequence; negative counts from the end of the
            positional arguments at call time) of batch arguments.
        batch_kwargs: names (str or sequence) of batch keyword arguments.
        min_ndim: ``None``, an int >= 1, or a dict of per-argument ints >= 1 (see Modes).

    Returns:
        The wrapped function. Shapes: a named tensor argument of shape ``s`` reaches ``fn`` as
        ``(1, *s)`` (always, or when ``len(s) < min_ndim``).

    Raises:
        InputTypeError: ``fn`` is not callable; ``batch_argnums``/``batch_kwargs``/``min_ndim``
            have the wrong types.
        ConfigurationError: a threshold < 1; a ``min_ndim`` dict that misses or adds an
            argument; a keyword that ``fn``'s signature cannot accept; ``fn`` is already wrapped
            with a different configuration.

    Example::

        >>> import torch
        >>> def batch_loss(w, x):  # x: (batch, d)
        ...     return (x @ w).pow(2).mean()
        >>> per_example = torch.func.vmap(with_batch_dim(batch_loss, batch_argnums=1), in_dims=(None, 0))
        >>> per_example(torch.ones(3), torch.ones(4, 3)).shape
        torch.Size([4])
    """
    if not callable(fn):
        raise InputTypeError(f"Expected fn to be callable, got {type(fn).__name__}.")
    argnums = _as_tuple(batch_argnums, kind=numbers.Integral, name="batch_argnums")
    kwnames = _as_tuple(batch_kwargs, kind=str, name="batch_kwargs")

    if min_ndim is None:
        thresholds: dict[str | int, int] | None = None
        config: tuple = (argnums, kwnames, None)
    elif isinstance(min_ndim, Mapping):
        thresholds = {}
        for k, v in min_ndim.items():
            if isinstance(k, bool) or not isinstance(k, (str, numbers.Integral)):
                raise InputTypeError(f"Expected min_ndim keys to be argument positions or names, got {k!r}.")
            thresholds[k if isinstance(k, str) else int(k)] = check_positive_int(v, name=f"min_ndim[{k!r}]")
        expected = set(argnums) | set(kwnames)
        if set(thresholds) != expected:
            raise ConfigurationError(
                f"Expected min_ndim keys to be exactly the batch arguments {sorted(map(str, expected))}, "
                f"got {sorted(map(str, thresholds))}."
            )
        config = (argnums, kwnames, tuple(sorted(thresholds.items(), key=lambda kv: str(kv[0]))))
    else:
        n = check_positive_int(min_ndim, name="min_ndim")
        thresholds = {a: n for a in (*argnums, *kwnames)}
        config = (argnums, kwnames, n)

    existing = getattr(fn, _MARK, None)
    if existing is not None:
        if existing == config:
            return fn
        raise ConfigurationError(
            f"{getattr(fn, '__name__', fn)!r} is already wrapped by with_batch_dim with "
            f"(batch_argnums, batch_kwargs, min_ndim)={existing}; got {config}. Wrap the "
            "original function once."
        )

    # Where can each batch keyword also arrive positionally?
    kw_positions: dict[str, int] = {}
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        params = list(sig.parameters.values())
        positional = [
            p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
        for name in kwnames:
            p = sig.parameters.get(name)
            if p is None or p.kind is p.VAR_POSITIONAL:
                if not has_var_kw:
                    raise ConfigurationError(
                        f"batch_kwargs names {name!r}, which {getattr(fn, '__name__', fn)!r} "
                        f"does not accept; its parameters are {list(sig.parameters)}."
                    )
                continue
            if p in positional:
                kw_positions[name] = positional.index(p)

    mode_always = thresholds is None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        new_args = list(args)
        nargs = len(args)
        done: set[int] = set()
        changed = False

        def handle_pos(pos: int, key: str | int) -> None:
            nonlocal changed
            if pos in done:
                return
            done.add(pos)
            thr = None if mode_always else thresholds[key]  # type: ignore[index]
            new_args[pos], did = _unsqueeze_leaves(new_args[pos], thr)
            changed = changed or did

        for a in argnums:
            pos = a + nargs if a < 0 else a
            if not 0 <= pos < nargs:
                raise InputTypeError(
                    f"batch_argnums contains {a}, but {getattr(fn, '__name__', fn)!r} was "
                    f"called with {nargs} positional arguments."
                )
            handle_pos(pos, a)
        for name in kwnames:
            if name in kwargs:
                thr = None if mode_always else thresholds[name]  # type: ignore[index]
                kwargs[name], did = _unsqueeze_leaves(kwargs[name], thr)
                changed = changed or did
            elif name in kw_positions and kw_positions[name] < nargs:
                handle_pos(kw_positions[name], name)
        out = fn(*new_args, **kwargs)
        if not mode_always and changed:
            out = _squeeze_top_level(out)
        return out

    setattr(wrapper, _MARK, config)
    return wrapper


# --------------------------------------------------------------------------------------------
# empty_collate
# --------------------------------------------------------------------------------------------


class _TensorTemplate:
    __slots__ = ("trailing", "dtype", "device", "zero_dim")

    def __init__(self, t: torch.Tensor) -> None:
        self.zero_dim = t.detach().clone() if t.dim() == 0 else None
        self.trailing = tuple(t.shape[1:])
        self.dtype = t.dtype
        self.device = t.device

    def empty(self) -> torch.Tensor:
        if self.zero_dim is not None:
            return self.zero_dim.clone()
        return torch.empty((0, *self.trailing), dtype=self.dtype, device=self.device)

    def __getstate__(self) -> tuple:
        return (self.trailing, self.dtype, str(self.device), self.zero_dim)

    def __setstate__(self, state: tuple) -> None:
        self.trailing, self.dtype, device, self.zero_dim = state
        self.device = torch.device(device)


class _ArrayTemplate:
    def __init__(self, a: np.ndarray) -> None:
        self.trailing = tuple(a.shape[1:])
        self.dtype = a.dtype

    def empty(self) -> np.ndarray:
        return np.empty((0, *self.trailing), dtype=self.dtype)


class _MappingTemplate:
    def __init__(self, kind: type, items: list[tuple[Any, Any]]) -> None:
        self.kind, self.items = kind, items

    def empty(self) -> Any:
        return self.kind((k, t.empty()) for k, t in self.items)


class _NamedTupleTemplate:
    def __init__(self, kind: type, fields: list[Any]) -> None:
        self.kind, self.fields = kind, fields

    def empty(self) -> Any:
        return self.kind(*(t.empty() for t in self.fields))


class _SequenceTemplate:
    def __init__(self, kind: type, fields: list[Any] | None) -> None:
        self.kind, self.fields = kind, fields  # fields None: a per-example sequence

    def empty(self) -> Any:
        if self.fields is None:
            return self.kind()
        return self.kind(t.empty() for t in self.fields)


class _ConstTemplate:
    def __init__(self, value: Any) -> None:
        self.value = value

    def empty(self) -> Any:
        return self.value


_SCALAR_TYPES = (str, bytes, numbers.Number, type(None))


def _learn(out: Any) -> Any:
    """A template whose ``empty()`` builds the batch-size-0 version of ``out``."""
    if isinstance(out, torch.Tensor):
        return _TensorTemplate(out)
    if isinstance(out, np.ndarray):
        return _ArrayTemplate(out)
    if isinstance(out, Mapping):
        kind = type(out)
        try:
            kind(())  # the mapping type can be rebuilt from pairs
        except Exception:
            kind = dict
        return _MappingTemplate(kind, [(k, _learn(v)) for k, v in out.items()])
    if isinstance(out, tuple) and hasattr(type(out), "_fields"):
        return _NamedTupleTemplate(type(out), [_learn(v) for v in out])
    if isinstance(out, (list, tuple)):
        if out and all(isinstance(v, _SCALAR_TYPES) for v in out):
            # A per-example sequence (default_collate keeps strings as a list of length batch).
            return _SequenceTemplate(type(out), None)
        return _SequenceTemplate(type(out), [_learn(v) for v in out])
    # Anything else (a scalar, an object) is repeated as first seen.
    return _ConstTemplate(out)


class _EmptyCollate:
    """Picklable wrapper returned by :func:`empty_collate` (works with DataLoader workers, which
    receive the structure learned so far)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], template: Any = None) -> None:
        self.collate_fn = collate_fn
        self.template: Any = template
        functools.update_wrapper(self, collate_fn, updated=())

    def __call__(self, batch: Any) -> Any:
        try:
            is_empty = len(batch) == 0
        except TypeError:
            is_empty = False
        if is_empty and self.template is not None:
            return self.template.empty()
        out = self.collate_fn(batch)
        if not is_empty and self.template is None:
            self.template = _learn(out)
        return out

    def __repr__(self) -> str:
        return f"empty_collate({self.collate_fn!r})"


_NO_EXAMPLE = object()


def empty_collate(collate_fn: Callable[[list[Any]], Any] | None = None, *, example: Any = _NO_EXAMPLE) -> Callable[[list[Any]], Any]:
    """Make ``collate_fn`` return an empty batch for an empty list of examples.

    Poisson subsampling yields empty batches (with probability ``(1-q)**N`` each) and standard
    collators crash on them (``default_collate([])`` raises ``IndexError``). The wrapper knows
    the output structure of a batch and answers an empty list with the same structure at batch
    size 0:

    * a tensor of shape ``(B, *s)`` becomes ``torch.empty((0, *s))`` with the same dtype and
      device (a 0-d tensor is repeated as first seen); numpy arrays likewise;
    * dicts, namedtuples, tuples and lists keep their type and are rebuilt field by field;
    * a list/tuple of plain scalars or strings (how ``default_collate`` batches strings) is
      treated as per-example and becomes empty;
    * any other leaf is repeated as first seen.

    **Recommended: pass one example** (``example=dataset[0]``). The structure is then learned
    up front from ``collate_fn([example])``, so every batch can be empty, the first one
    included, and DataLoader workers (``num_workers > 0``) receive the structure with the
    wrapper. Without ``example`` the structure is learned from the first non-empty batch, and
    an empty list before that goes to ``collate_fn`` unchanged (``default_collate`` raises):
    the first Poisson batch is empty with probability ``(1-q)**N``, which is not small when
    ``q·N`` is, and each worker process learns the structure on its own.

    Edge cases: ``collate_fn`` is never called with an empty list once the structure is known;
    non-empty batches always go through ``collate_fn`` unchanged.

    Args:
        collate_fn: the collate function; ``None`` means
            ``torch.utils.data.default_collate``.
        example: one example of the dataset, as ``dataset[i]`` returns it (not a batch).

    Returns:
        A picklable callable ``collate(batch: list) -> batch structure``.

    Raises:
        InputTypeError: ``collate_fn`` is not callable.
        ConfigurationError: ``collate_fn([example])`` raised (the message says what it raised).

    Example::

        >>> import torch
        >>> from torch.utils.data import DataLoader, TensorDataset, default_collate
        >>> ds = TensorDataset(torch.randn(10, 3), torch.randint(0, 2, (10,)))
        >>> collate = empty_collate(default_collate, example=ds[0])
        >>> x, y = collate([])                        # even before any non-empty batch
        >>> x.shape, y.shape
        (torch.Size([0, 3]), torch.Size([0]))
        >>> loader = DataLoader(ds, batch_size=4, collate_fn=collate)
    """
    if collate_fn is None:
        from torch.utils.data import default_collate

        collate_fn = default_collate
    if not callable(collate_fn):
        raise InputTypeError(f"Expected collate_fn to be callable, got {type(collate_fn).__name__}.")
    if example is _NO_EXAMPLE:
        return _EmptyCollate(collate_fn)
    try:
        out = collate_fn([example])
    except Exception as err:  # noqa: BLE001 - re-raised with context
        raise ConfigurationError(
            f"empty_collate: collate_fn([example]) raised {type(err).__name__}: {err}. Pass one "
            "example as the dataset returns it (e.g. example=dataset[0]), not a batch."
        ) from err
    return _EmptyCollate(collate_fn, _learn(out))
