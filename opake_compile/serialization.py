"""Flat, bit-exact serialization of explicit state trees (the whole state of a DP run).

A DP run's state is more than the model: the noise key and step count of
:class:`~opake_compile.optim.DPOptimizer` (and its wrapped optimizer's moments), the sampler's
epoch and position, the :class:`~opake_compile.compiler.DPStep`'s key for dropout, clip and noise
states, schedulers. Resuming with any of them missing replays randomness (the same noise or
dropout masks twice) or forgets spent privacy. This module turns a *tree* of such objects (a
dict, list, tuple, NamedTuple or dataclass whose leaves are tensors, plain values or registered
objects) into

* ``flat``: a ``dict[str, torch.Tensor]`` keyed by stable dotted paths
  (``"optimizer.optimizer.state.0.exp_avg"``), loadable with ``torch.load(weights_only=True)``
  and storable with ``safetensors``; and
* ``metadata``: a small JSON-able dict (``{"format", "version", "tree"}``) describing the
  structure, so that restore needs no pickle.

Encoding of leaves (exact, so a checkpoint round-trips bit for bit):

==================  ===============================================================
tensor              stored as is (same dtype, shape and bits) under its dotted path
``bool``            0-d ``torch.bool`` tensor
``int``             0-d ``torch.int64`` tensor (ints outside int64: decimal string in
                    the metadata)
``float``           0-d ``torch.float64`` tensor (every Python float, NaN payloads,
                    -0.0 and inf included, is exactly a float64)
``None``            ``null`` in the metadata, nothing in ``flat``
``str``             the string in the metadata
list/tuple/dict     containers in the metadata (dict keys: ``str`` or ``int``, kept with
                    their type); NamedTuples and dataclasses by field name
registered object   its ``to_state`` tree, encoded by these rules, under the object's path
==================  ===============================================================

Restore is *template-driven* (:func:`from_state_dict`): the caller passes objects of the same
configuration (a freshly built model, optimizer, sampler, ...), and the data must match them:
every key present, every tensor of the template's shape and dtype, every configuration field
(noise multiplier, sample rate, dataset size, clipping norm, key of a sampler, accountant)
equal. Any mismatch raises :class:`~opake_compile.exceptions.CheckpointError` naming the dotted
key, **before anything changes**: the whole tree is checked first, and only then are stateful
objects (modules, optimizers, samplers, steps, schedulers) loaded in place. Value types
(keys, clip/noise states, processes) come back as new objects in the returned tree.

Built-in serializers: ``torch.Tensor``, ``torch.nn.Module`` (its ``state_dict``),
``torch.optim.Optimizer``, ``torch.optim.lr_scheduler.LRScheduler``,
:class:`~opake_compile.optim.DPOptimizer` (plus its accountant as configuration),
:class:`~opake_compile.sampling.PoissonSampler` (and subclasses),
:class:`~opake_compile.compiler.DPStep`, :class:`~opake_compile.random.Key`,
:class:`~opake_compile.dpsgd.clipping.ClipState` (C is configuration),
:class:`~opake_compile.accounting.Accountant` (configuration only) and the privacy processes of
:mod:`opake_compile.accounting`; every other NamedTuple or dataclass (adaptive clip states,
noise states) field by field. :func:`register_serializer` adds user types.

Example::

    >>> import torch, opake_compile as opake
    >>> from opake_compile import serialization
    >>> state = {"noise": opake.dpsgd.noise.NoiseState(opake.random.key(0)), "step": 3}
    >>> flat, meta = serialization.state_dict(state)
    >>> sorted(flat)
    ['noise.key', 'step']
    >>> serialization.from_state_dict(state, flat, meta)["step"]
    3
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError

__all__ = [
    "FORMAT",
    "VERSION",
    "Serializer",
    "register_serializer",
    "serializer_for",
    "state_dict",
    "from_state_dict",
    "save_file",
    "load_file",
]

FORMAT = "opake_compile.state"
VERSION = 1

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Serializer:
    """How one type is saved and restored (see :func:`register_serializer`).

    Attributes:
        type: the registered class (subclasses use it unless they have their own).
        name: the stable name written into checkpoints.
        to_state: ``obj -> state tree`` (tensors, plain values, containers, registered objects).
        from_state: ``(template, state) -> restored object``; for ``in_place`` serializers it
            loads ``state`` into ``template`` and its return value is ignored.
        config: top-level keys of the state that are configuration: they must equal the
            template's, else :class:`CheckpointError`.
        free: paths (tuples of keys) inside the state whose structure comes from the data, not
            the template (for example a fresh optimizer has no moments yet); ``()`` frees all.
        in_place: the object is mutable and restored by ``from_state`` in place, after the
            whole tree has been validated.
        local: top-level state keys that legitimately differ between processes of one run (a
            sampler's rank, a step's dropout key): :func:`opake_compile.distributed.sync`
            neither compares nor overwrites them.
        check: ``check(template, state)`` for ``in_place`` serializers: every refusal
            ``from_state`` could make, changing nothing; run on every object of the tree before
            any is loaded, so that one refused object leaves the others unrestored too.
    """

    type: type
    name: str
    to_state: Callable[[Any], Any]
    from_state: Callable[[Any, Any], Any]
    config: tuple[str, ...] = ()
    free: tuple[tuple[Any, ...], ...] = ()
    in_place: bool = False
    local: tuple[str, ...] = ()
    check: Callable[[Any, Any], None] | None = None


_REGISTRY: dict[type, Serializer] = {}
_BY_NAME: dict[str, Serializer] = {}


def register_serializer(
    cls: type,
    *,
    to_state: Callable[[Any], Any],
    from_state: Callable[[Any, Any], Any],
    name: str | None = None,
    config: tuple[str, ...] = (),
    free: tuple[tuple[Any, ...], ...] = (),
    in_place: bool = False,
    local: tuple[str, ...] = (),
    check: Callable[[Any, Any], None] | None = None,
) -> Serializer:
    """Teach :func:`state_dict` / :func:`from_state_dict` a type.

    Args:
        cls: the type. Its subclasses use this serializer too unless registered themselves.
        to_state: returns the object's state as a tree of tensors, ``bool``/``int``/``float``/
            ``str``/``None``, lists, tuples, dicts (``str``/``int`` keys) and registered objects.
            It must not copy large tensors needlessly: the tree is written right away.
        from_state: ``from_state(template, state)`` builds the restored object from a template
            of the same configuration and the decoded state (same structure as ``to_state``'s).
            It must not modify ``template`` (unless ``in_place``). Raise
            :class:`~opake_compile.exceptions.CheckpointError` for data it cannot accept.
        name: the name recorded in checkpoints (default ``module.qualname``); keep it stable.
        config: top-level state keys compared for equality with the template's state.
        free: state paths whose structure is taken from the data (validated by ``from_state``).
        in_place: restore by mutating the template, after the whole tree was validated.
        local: top-level state keys that differ between the processes of one run by design
            (ignored by :func:`opake_compile.distributed.sync`).
        check: for ``in_place``: ``check(template, state)`` raises what ``from_state`` would
            refuse, without changing anything; run for every object before any is restored.

    Returns:
        The :class:`Serializer` record.

    Raises:
        InputTypeError: ``cls`` is not a class, or a function is not callable.
        ConfigurationError: ``name`` is already used by another type.

    Example::

        >>> class Counter:
        ...     def __init__(self, n=0): self.n = n
        >>> _ = register_serializer(Counter, to_state=lambda c: {"n": c.n},
        ...                         from_state=lambda tmpl, s: Counter(s["n"]))
        >>> flat, meta = state_dict({"c": Counter(5)})
        >>> from_state_dict({"c": Counter()}, flat, meta)["c"].n
        5
    """
    if not isinstance(cls, type):
        raise InputTypeError(f"Expected a class to register, got {type(cls).__name__}.")
    if not callable(to_state) or not callable(from_state):
        raise InputTypeError("to_state and from_state must be callable.")
    name = name or f"{cls.__module__}.{cls.__qualname__}"
    other = _BY_NAME.get(name)
    if other is not None and other.type is not cls:
        raise ConfigurationError(f"Serializer name {name!r} is already used by {other.type.__qualname__}.")
    ser = Serializer(cls, name, to_state, from_state, tuple(config), tuple(tuple(f) for f in free), in_place, tuple(local), check)
    old = _REGISTRY.get(cls)
    if old is not None:
        _BY_NAME.pop(old.name, None)
    _REGISTRY[cls] = ser
    _BY_NAME[name] = ser
    return ser


def serializer_for(obj: Any) -> Serializer | None:
    """The serializer used for ``obj`` (its class or the nearest registered base), or ``None``."""
    _ensure_builtins()
    for klass in type(obj).__mro__:
        ser = _REGISTRY.get(klass)
        if ser is not None:
            return ser
    return None


_BUILTINS_LOADED = False


def _ensure_builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from opake_compile import _serializers  # noqa: F401  (registers on import)


# ============================================================================= encoding
def _seg(key: Any) -> str:
    return str(key)


def _join(path: str, key: Any) -> str:
    return _seg(key) if not path else f"{path}.{_seg(key)}"


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


class _Encoder:
    def __init__(self) -> None:
        self.flat: dict[str, torch.Tensor] = {}

    def put(self, path: str, t: torch.Tensor) -> str:
        if path in self.flat:
            raise InputTypeError(
                f"Two entries of the state tree map to the same key {path!r} (a dict key containing "
                "a dot collides with a nested path); rename one."
            )
        self.flat[path] = t
        return path

    def encode(self, x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            return {"tensor": self.put(path, x.detach())}
        ser = serializer_for(x) if not isinstance(x, (bool, int, float, str, type(None), list, dict)) or _is_namedtuple(x) else None
        if ser is not None:
            return {"object": ser.name, "state": self.encode(ser.to_state(x), path)}
        if x is None:
            return None
        if isinstance(x, bool):
            return {"bool": self.put(path, torch.tensor(x, dtype=torch.bool))}
        if isinstance(x, int):
            if _INT64_MIN <= x <= _INT64_MAX:
                return {"int": self.put(path, torch.tensor(x, dtype=torch.int64))}
            return {"bigint": str(int(x))}
        if isinstance(x, float):
            return {"float": self.put(path, torch.tensor(x, dtype=torch.float64))}
        if isinstance(x, str):
            return {"str": x}
        if isinstance(x, Mapping):
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise InputTypeError(f"{path or '<root>'}: dict keys must be str or int, got {k!r}.")
                items.append([k, self.encode(v, _join(path, k))])
            return {"dict": items}
        if _is_namedtuple(x):
            return {"fields": [[f, self.encode(v, _join(path, f))] for f, v in zip(x._fields, x)]}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = [f.name for f in dataclasses.fields(x) if f.init]
            return {"fields": [[f, self.encode(getattr(x, f), _join(path, f))] for f in fields]}
        if isinstance(x, list):
            return {"list": [self.encode(v, _join(path, i)) for i, v in enumerate(x)]}
        if isinstance(x, tuple):
            return {"tuple": [self.encode(v, _join(path, i)) for i, v in enumerate(x)]}
        raise InputTypeError(
            f"{path or '<root>'}: no serializer for {type(x).__module__}.{type(x).__qualname__}; "
            "register one with opake_compile.serialization.register_serializer."
        )


def state_dict(tree: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten a state tree into tensors under dotted keys plus JSON-able metadata.

    Args:
        tree: a dict / list / tuple / NamedTuple / dataclass of tensors, plain values and
            registered objects (models, optimizers, ``DPOptimizer``, samplers, ``DPStep``,
            keys, clip and noise states, ...). Typically ``{"model": model, "optimizer": opt,
            "sampler": sampler, "step": step}``.

    Returns:
        ``(flat, metadata)``. ``flat``: ``dict[str, Tensor]``; tensors of the live objects are
        **shared, not copied** (as ``nn.Module.state_dict``): write them out before the next
        step, or clone. ``metadata``: ``{"format": FORMAT, "version": VERSION, "tree": ...}``,
        JSON-serialisable, without floats (every number is a tensor in ``flat``).

    Raises:
        InputTypeError: a leaf of an unregistered type, a dict key that is not str/int, or two
            paths that collide once joined with dots.
    """
    enc = _Encoder()
    node = enc.encode(tree, "")
    return enc.flat, {"format": FORMAT, "version": VERSION, "tree": node}


# ============================================================================= decoding
def _kind(node: Any) -> str:
    if node is None:
        return "None"
    if isinstance(node, dict) and len(node) >= 1:
        for k in ("tensor", "bool", "int", "bigint", "float", "str", "dict", "list", "tuple", "fields", "object"):
            if k in node:
                return k
    raise CheckpointError(f"Malformed checkpoint metadata node {str(node)[:80]!r}.")


def _template_kind(x: Any) -> str:
    if x is None:
        return "None"
    if isinstance(x, torch.Tensor):
        return "tensor"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, float):
        return "float"
    if isinstance(x, str):
        return "str"
    return type(x).__name__


_SCALAR_DTYPES = {"bool": torch.bool, "int": torch.int64, "float": torch.float64}


class _Decoder:
    def __init__(self, flat: Mapping[str, Any]) -> None:
        self.flat = flat
        self.used: set[str] = set()
        self.commits: list[Callable[[], Any]] = []

    def tensor(self, key: Any, path: str) -> torch.Tensor:
        if not isinstance(key, str):
            raise CheckpointError(f"{path}: malformed metadata (tensor key {key!r}).")
        if key not in self.flat:
            raise CheckpointError(f"{key}: missing from the checkpoint data.")
        t = self.flat[key]
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{key}: expected a tensor in the checkpoint data, got {type(t).__name__}.")
        self.used.add(key)
        return t

    def scalar(self, kind: str, node: Any, path: str) -> Any:
        if kind == "bigint":
            try:
                return int(node["bigint"])
            except (TypeError, ValueError) as err:
                raise CheckpointError(f"{path}: malformed big integer {node['bigint']!r}.") from err
        t = self.tensor(node[kind], path)
        if t.dim() != 0 or t.dtype != _SCALAR_DTYPES[kind]:
            raise CheckpointError(
                f"{node[kind]}: a saved {kind} must be a 0-d {_SCALAR_DTYPES[kind]} tensor, got shape "
                f"{tuple(t.shape)} and dtype {t.dtype}."
            )
        return t.item()

    # -- free decoding: the data alone decides the structure -------------------------------
    def free(self, node: Any, path: str) -> Any:
        kind = _kind(node)
        if kind == "None":
            return None
        if kind == "tensor":
            return self.tensor(node["tensor"], path)
        if kind in ("bool", "int", "float", "bigint"):
            return self.scalar(kind, node, path)
        if kind == "str":
            return _check_str(node["str"], path)
        if kind == "dict":
            return {self._key(k, path): self.free(v, _join(path, k)) for k, v in self._items(node, path)}
        if kind in ("list", "tuple", "fields"):
            if kind == "fields":
                return {self._key(k, path): self.free(v, _join(path, k)) for k, v in self._items(node, path, "fields")}
            seq = node[kind]
            if not isinstance(seq, list):
                raise CheckpointError(f"{path}: malformed {kind} node.")
            out = [self.free(v, _join(path, i)) for i, v in enumerate(seq)]
            return out if kind == "list" else tuple(out)
        # An object inside free data: only serializers that need no template (value types).
        ser = _BY_NAME.get(node["object"])
        if ser is None or ser.in_place:
            raise CheckpointError(f"{path}: cannot restore a {node['object']!r} object without a template.")
        return self._call_from_state(ser, None, self.free(node["state"], path), path)

    @staticmethod
    def _key(k: Any, path: str) -> Any:
        if isinstance(k, bool) or not isinstance(k, (str, int)):
            raise CheckpointError(f"{path}: malformed dict key {k!r} in the metadata.")
        return k

    @staticmethod
    def _items(node: Any, path: str, kind: str = "dict") -> list:
        items = node[kind]
        if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 for i in items):
            raise CheckpointError(f"{path}: malformed {kind} node in the metadata.")
        return items

    # -- template-driven decoding ----------------------------------------------------------
    def restore(self, tmpl: Any, node: Any, path: str, free: tuple = (), rel: tuple = ()) -> Any:
        if rel in free:  # a free subtree: its structure comes from the data
            return self.free(node, path)
        kind = _kind(node)
        where = path or "<root>"
        if isinstance(tmpl, torch.Tensor):
            if kind != "tensor":
                raise CheckpointError(f"{where}: the template has a tensor, the checkpoint a {kind}.")
            t = self.tensor(node["tensor"], path)
            if tuple(t.shape) != tuple(tmpl.shape) or t.dtype != tmpl.dtype:
                raise CheckpointError(
                    f"{node['tensor']}: checkpoint has shape {tuple(t.shape)} and dtype {t.dtype}, the "
                    f"template shape {tuple(tmpl.shape)} and dtype {tmpl.dtype}."
                )
            return t if t.device == tmpl.device else t.to(tmpl.device)
        ser = None if isinstance(tmpl, (bool, int, float, str, type(None), list, dict)) and not _is_namedtuple(tmpl) else serializer_for(tmpl)
        if ser is not None:
            return self.restore_object(ser, tmpl, node, path)
        if tmpl is None:
            if kind != "None":
                raise CheckpointError(f"{where}: the template has None, the checkpoint a {kind}.")
            return None
        tk = _template_kind(tmpl)
        if tk in ("bool", "int", "float", "str"):
            if not (kind == tk or (tk == "int" and kind == "bigint")):
                raise CheckpointError(f"{where}: the template has a {tk}, the checkpoint a {kind}.")
            return _check_str(node["str"], path) if tk == "str" else self.scalar(kind, node, path)
        if isinstance(tmpl, Mapping):
            if kind != "dict":
                raise CheckpointError(f"{where}: the template has a dict, the checkpoint a {kind}.")
            data = {self._key(k, path): v for k, v in self._items(node, path)}
            _check_keys(list(tmpl), list(data), path)
            out = {k: self.restore(tmpl[k], data[k], _join(path, k), free, (*rel, k)) for k in tmpl}
            return _same_mapping_type(tmpl, out)
        if _is_namedtuple(tmpl) or (dataclasses.is_dataclass(tmpl) and not isinstance(tmpl, type)):
            if kind != "fields":
                raise CheckpointError(f"{where}: the template has a {type(tmpl).__name__}, the checkpoint a {kind}.")
            names = list(tmpl._fields) if _is_namedtuple(tmpl) else [f.name for f in dataclasses.fields(tmpl) if f.init]
            data = dict((k, v) for k, v in self._items(node, path, "fields"))
            _check_keys(names, list(data), path)
            vals = {f: self.restore(getattr(tmpl, f), data[f], _join(path, f), free, (*rel, f)) for f in names}
            if _is_namedtuple(tmpl):
                return type(tmpl)(**vals)
            return dataclasses.replace(tmpl, **vals)
        if isinstance(tmpl, (list, tuple)):
            want = "list" if isinstance(tmpl, list) else "tuple"
            if kind != want:
                raise CheckpointError(f"{where}: the template has a {want}, the checkpoint a {kind}.")
            seq = node[kind]
            if not isinstance(seq, list):
                raise CheckpointError(f"{where}: malformed {kind} node.")
            if len(seq) != len(tmpl):
                raise CheckpointError(f"{where}: the checkpoint holds {len(seq)} entries, the template {len(tmpl)}.")
            out = [self.restore(t, v, _join(path, i), free, (*rel, i)) for i, (t, v) in enumerate(zip(tmpl, seq))]
            return out if isinstance(tmpl, list) else tuple(out)
        raise InputTypeError(
            f"{where}: no serializer for {type(tmpl).__module__}.{type(tmpl).__qualname__} in the template; "
            "register one with opake_compile.serialization.register_serializer."
        )

    def restore_object(self, ser: Serializer, tmpl: Any, node: Any, path: str) -> Any:
        where = path or "<root>"
        if _kind(node) != "object":
            raise CheckpointError(f"{where}: the template has a {ser.name} object, the checkpoint a {_kind(node)}.")
        if node["object"] != ser.name:
            raise CheckpointError(f"{where}: the checkpoint holds a {node['object']!r}, the template a {ser.name!r}.")
        tmpl_state = ser.to_state(tmpl)
        data_node = node["state"]
        # Configuration first: a different sigma, q, N or C is reported as such, not as
        # whatever structural difference it also causes.
        if ser.config and isinstance(tmpl_state, Mapping) and _kind(data_node) == "dict":
            data_items = dict((k, v) for k, v in self._items(data_node, path))
            for field in ser.config:
                if field not in tmpl_state:
                    continue
                if field not in data_items:
                    raise CheckpointError(f"{_join(path, field)}: missing from the checkpoint.")
                a, b = self.free(data_items[field], _join(path, field)), tmpl_state[field]
                if not _equal(a, b):
                    raise CheckpointError(
                        f"{_join(path, field)}: the checkpoint has {_show(a)}, the template {_show(b)}; this is "
                        "configuration and must match (build the objects with the saved configuration)."
                    )
        state = self.restore(tmpl_state, data_node, path, ser.free, ())
        if ser.in_place:
            if ser.check is not None:
                try:
                    ser.check(tmpl, state)
                except CheckpointError as err:
                    raise CheckpointError(f"{path or '<root>'}: {err}") from err
            self.commits.append(lambda: ser.from_state(tmpl, state))
            return tmpl
        return self._call_from_state(ser, tmpl, state, path)

    @staticmethod
    def _call_from_state(ser: Serializer, tmpl: Any, state: Any, path: str) -> Any:
        try:
            return ser.from_state(tmpl, state)
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - a user's from_state: report where it failed
            raise CheckpointError(f"{path or '<root>'}: cannot restore a {ser.name}: {err}") from err


def _check_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise CheckpointError(f"{path}: malformed string node.")
    return value


def _check_keys(want: list, have: list, path: str) -> None:
    missing = [k for k in want if k not in have]
    if missing:
        raise CheckpointError(f"{_join(path, missing[0])}: missing from the checkpoint" + (f" (and {len(missing) - 1} more)." if len(missing) > 1 else "."))
    extra = [k for k in have if k not in want]
    if extra:
        raise CheckpointError(f"{_join(path, extra[0])}: in the checkpoint but not in the template" + (f" (and {len(extra) - 1} more)." if len(extra) > 1 else "."))


def _same_mapping_type(tmpl: Mapping, out: dict) -> Any:
    if type(tmpl) is dict:
        return out
    try:
        new = type(tmpl)(out)
    except Exception:  # noqa: BLE001 - exotic mappings come back as plain dicts
        return out
    meta = getattr(tmpl, "_metadata", None)  # nn.Module.state_dict's version records
    if meta is not None:
        try:
            new._metadata = meta
        except AttributeError:
            pass
    return new


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return type(a) is type(b) and a == b


def _show(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 80 else s[:77] + "..."


def from_state_dict(template: Any, flat: Mapping[str, torch.Tensor], metadata: Mapping[str, Any], *, strict: bool = True) -> Any:
    """Restore a tree saved by :func:`state_dict`, driven by ``template``.

    The whole tree is validated first: structure, every key present, tensor shapes and dtypes
    equal to the template's, configuration fields equal, value types decodable. Only then are
    stateful objects (modules, optimizers, ``DPOptimizer``, samplers, ``DPStep``, schedulers)
    loaded in place; value types come back as new objects.

    Args:
        template: a tree of the same structure as the saved one, built with the same
            configuration (fresh objects are fine: their state is overwritten).
        flat: the tensors, as returned by :func:`state_dict` or loaded with
            ``torch.load(weights_only=True)`` / ``safetensors``. Tensors are moved to the
            template's devices; stateful objects copy them, value types may share them.
        metadata: the metadata dict returned with ``flat``.
        strict: refuse tensors in ``flat`` that the metadata does not reference (default).

    Returns:
        A tree like ``template``: stateful objects are the template's own (now restored), value
        leaves (tensors, numbers, keys, clip and noise states) are the restored values.

    Raises:
        CheckpointError: a wrong format or version; a missing or unexpected key; a shape, dtype
            or kind mismatch; a configuration mismatch (sigma, q, N, C, sampler key, ...). The
            message starts with the dotted key. Nothing has changed when it is raised.
        InputTypeError: ``template`` holds a type without a serializer.
    """
    _ensure_builtins()
    if not isinstance(metadata, Mapping) or metadata.get("format") != FORMAT:
        raise CheckpointError(f"Not an {FORMAT} checkpoint (metadata format {getattr(metadata, 'get', lambda k: None)('format')!r}).")
    if metadata.get("version") != VERSION:
        raise CheckpointError(f"Checkpoint format version {metadata.get('version')!r} is not supported (expected {VERSION}).")
    if "tree" not in metadata:
        raise CheckpointError("Checkpoint metadata has no tree.")
    if not isinstance(flat, Mapping):
        raise CheckpointError(f"Expected the checkpoint tensors as a mapping, got {type(flat).__name__}.")
    dec = _Decoder(flat)
    out = dec.restore(template, metadata["tree"], "")
    if strict:
        extra = sorted(set(flat) - dec.used)
        if extra:
            raise CheckpointError(f"{extra[0]}: in the checkpoint data but not referenced by its metadata ({len(extra)} such key(s)).")
    for commit in dec.commits:
        commit()
    return out


def _object_fields(tree: Any, path: str = "") -> list[tuple[str, Serializer, dict[str, Any]]]:
    """``(path, serializer, {field: node})`` for every registered object in a metadata tree
    whose state is a dict (the objects whose ``config``/``local`` fields can be named)."""
    _ensure_builtins()
    out: list[tuple[str, Serializer, dict[str, Any]]] = []

    def walk(node: Any, p: str) -> None:
        kind = _kind(node)
        if kind == "object":
            ser = _BY_NAME.get(node["object"])
            inner = node["state"]
            if ser is not None and _kind(inner) == "dict":
                out.append((p, ser, {k: v for k, v in inner["dict"]}))
            walk(inner, p)
        elif kind in ("dict", "fields"):
            for k, v in node[kind]:
                walk(v, _join(p, k))
        elif kind in ("list", "tuple"):
            for i, v in enumerate(node[kind]):
                walk(v, _join(p, i))

    walk(tree, path)
    return out


def _tensor_keys(node: Any) -> list[str]:
    """The flat keys a metadata subtree references."""
    kind = _kind(node)
    if kind in ("tensor", "bool", "int", "float"):
        return [node[kind]]
    if kind in ("dict", "fields"):
        return [k for _, v in node[kind] for k in _tensor_keys(v)]
    if kind in ("list", "tuple"):
        return [k for v in node[kind] for k in _tensor_keys(v)]
    if kind == "object":
        return _tensor_keys(node["state"])
    return []


# ============================================================================= files
def _metadata_json(metadata: Mapping[str, Any]) -> str:
    return json.dumps(metadata, separators=(",", ":"), allow_nan=False)


def _writable(flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors, none sharing memory with another (safetensors refuses shared
    storage, e.g. tied embeddings): later sharers are copied."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for k, t in flat.items():
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        sig = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.numel() and sig in seen or (t.numel() and t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            t = t.clone()
        if t.numel():
            seen.add((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        out[k] = t
    return out


def save_file(path: Any, tree: Any, *, extra_metadata: Mapping[str, str] | None = None) -> None:
    """Write :func:`state_dict` of ``tree`` to ``path`` (not atomic; see :class:`Checkpointer`).

    The format follows the suffix: ``.safetensors`` (tensors, and the metadata as a JSON string
    under the metadata key ``"opake_compile"``) or anything else for ``torch.save`` of
    ``{"tensors": flat, "metadata": metadata}`` (loadable with ``weights_only=True``).

    Raises:
        InputTypeError: as :func:`state_dict`.
    """
    flat, meta = state_dict(tree)
    _write(str(path), flat, meta, extra_metadata or {})


def _write(path: str, flat: Mapping[str, torch.Tensor], meta: Mapping[str, Any], extra: Mapping[str, str]) -> None:
    tensors = _writable(flat)
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file as _st_save

        _st_save(tensors, path, metadata={**extra, "opake_compile": _metadata_json(meta)})
    else:
        torch.save({"tensors": tensors, "metadata": json.loads(_metadata_json(meta)), "extra": dict(extra)}, path)


def _read(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, str]]:
    try:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                header = dict(f.metadata() or {})
                flat = {k: f.get_tensor(k) for k in f.keys()}
            meta = json.loads(header.pop("opake_compile"))
            return flat, meta, header
        blob = torch.load(path, weights_only=True, map_location="cpu")
        return blob["tensors"], blob["metadata"], dict(blob.get("extra", {}))
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - truncated, corrupted or foreign files
        raise CheckpointError(f"{path}: cannot read the checkpoint ({type(err).__name__}: {err}).") from err


def load_file(path: Any, template: Any) -> Any:
    """Read a file written by :func:`save_file` and restore it into ``template``.

    Returns:
        As :func:`from_state_dict`.

    Raises:
        CheckpointError: an unreadable or corrupted file; anything :func:`from_state_dict`
            raises.
    """
    flat, meta, _ = _read(str(path))
    return from_state_dict(template, flat, meta)
