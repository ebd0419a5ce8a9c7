"""``Checkpointer``: atomic, bit-exact checkpoints of a whole DP run, keeping the last ``k``.

A DP run is resumable only if *everything* random it consumes comes back: the model and the
wrapped optimizer's moments, but also the noise key and step count of the
:class:`~opake_compile.optim.DPOptimizer` (the accountant charges by it), the sampler's epoch and
position, and the :class:`~opake_compile.compiler.DPStep`'s key (dropout masks). A resumed run
that replays a key releases the same noise twice (whose difference reveals the clipped sums);
one that forgets steps under-reports epsilon. :class:`Checkpointer` writes all of these into one
file per checkpoint with :mod:`opake_compile.serialization`, so a run killed at any instant and
resumed from the newest checkpoint continues exactly as the uninterrupted run would have (bit
for bit on the same machine, torch version and thread settings).

Files. ``<directory>/ckpt-<step:010d>.safetensors``: the flat tensors of
:func:`~opake_compile.serialization.state_dict` plus, in the safetensors header, the structure
(``"opake_compile"``), the step number, the save's sequence number in the directory and a
SHA-256 checksum of the metadata and of every tensor's bytes (checked on restore: a corrupted
file raises instead of loading garbage). Checkpoints are ordered by when they were saved, not
by their step numbers: ``restore()`` loads the latest save, and the latest ``keep`` saves are
kept, so a step counter that restarts (per epoch) never rewinds the run.

Atomicity. A checkpoint is written to a temporary file in the same directory, flushed and
``fsync`` ed, then renamed over its final name (``os.replace``, atomic on POSIX) and the
directory is ``fsync`` ed. A crash at any point leaves either the previous set of complete
checkpoints or the new one; leftover temporary files are ignored and removed by the next save.
Only after the rename are checkpoints beyond the latest ``keep`` saves deleted.

Example::

    >>> ckpt = opake.Checkpointer("runs/digits", keep=2)           # doctest: +SKIP
    >>> start = ckpt.restore(model=model, optimizer=opt, sampler=sampler, step=step) or 0  # doctest: +SKIP
    >>> for i, idx in enumerate(sampler, start=start + 1):         # doctest: +SKIP
    ...     opt.step(step(x[idx], y[idx]).clipped)
    ...     ckpt.save(i, model=model, optimizer=opt, sampler=sampler, step=step)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from opake_compile import serialization as _ser
from opake_compile._validate import check_nonnegative_int, check_positive_int
from opake_compile.exceptions import CheckpointError, InputTypeError

__all__ = ["Checkpointer"]

_NAME = re.compile(r"^ckpt-(\d{10,})\.safetensors$")
_TMP_PREFIX = ".tmp-ckpt-"


def _checksum(flat: Mapping[str, torch.Tensor], meta_json: str) -> str:
    """SHA-256 over the metadata and every tensor (key, dtype, shape, raw bytes), in key order."""
    h = hashlib.sha256()
    h.update(meta_json.encode())
    for k in sorted(flat):
        t = flat[k]
        h.update(json.dumps([k, str(t.dtype), list(t.shape)]).encode())
        if t.numel():
            h.update(_tensor_bytes(t.detach().cpu().contiguous()))
    return h.hexdigest()


_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Write the safetensors format (8-byte header length, JSON header, raw little-endian data)
    straight from the tensors' memory and ``fsync`` it: no serialised copy of the whole state
    in memory (``safetensors.torch.save_file`` builds one). Read back with ``safe_open``, which
    validates the layout. Other dtypes go through ``safetensors.torch.save_file``."""
    if any(t.dtype not in _ST_DTYPES for t in tensors.values()):
        from safetensors.torch import save_file as _st_save

        _st_save(dict(tensors), str(path), metadata=dict(metadata))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    else:
        header: dict[str, Any] = {"__metadata__": dict(metadata)}
        offset = 0
        order = sorted(tensors)
        for k in order:
            t = tensors[k]
            n = t.numel() * t.element_size()
            header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        with open(path, "wb") as f:
            f.write(len(blob).to_bytes(8, "little"))
            f.write(blob)
            for k in order:
                if tensors[k].numel():
                    f.write(_tensor_bytes(tensors[k]))
            f.flush()
            os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _atomic_rename(src: Path, dst: Path) -> None:
    """The commit point of a save (a module function so that tests can inject a failure)."""
    os.replace(src, dst)


class Checkpointer:
    """Save and restore the whole state of a DP run in ``directory``, keeping the last ``keep``.

    ``save(step_number, **objects)`` writes every object (models, ``DPOptimizer`` with its
    wrapped optimizer, samplers, ``DPStep``, schedulers, keys, clip and noise states, any
    type registered with :func:`opake_compile.serialization.register_serializer`) into one
    checkpoint, atomically. ``restore(**objects)`` loads the most recently saved complete
    checkpoint into stateful objects built with the same configuration and returns its step
    number (``None``, touching nothing, when there is none; value types such as keys and noise
    states are refused there: :meth:`restore_state` returns them). The names of the keyword arguments are the top-level keys of
    the checkpoint: restore with the names used for saving.

    One process per directory: in a data-parallel run the sampler's state is per rank, so give
    each rank its own directory (or save, on rank 0 only, the state all ranks share, and after
    restoring call :func:`opake_compile.distributed.sync` on every rank).

    Args:
        directory: where checkpoints live (created if missing). One run per directory.
        keep: how many of the latest saves to keep (>= 1).

    Raises:
        InputTypeError, ConfigurationError: ``keep`` is not an int >= 1.

    Example::

        >>> ckpt = Checkpointer(tmp_dir, keep=3)                                     # doctest: +SKIP
        >>> ckpt.save(100, model=model, optimizer=opt, sampler=sampler, step=step)  # doctest: +SKIP
        >>> ckpt.restore(model=model, optimizer=opt, sampler=sampler, step=step)    # doctest: +SKIP
        100
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise InputTypeError(f"Expected directory to be a path, got {type(directory).__name__}.")
        self._dir = Path(directory)
        self._keep = check_positive_int(keep, name="keep")

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def keep(self) -> int:
        return self._keep

    def path(self, step_number: int) -> Path:
        """The file of the checkpoint of ``step_number``."""
        return self._dir / f"ckpt-{check_nonnegative_int(step_number, name='step_number'):010d}.safetensors"

    def steps(self) -> list[int]:
        """Step numbers of the complete checkpoints in the directory, ascending."""
        if not self._dir.is_dir():
            return []
        out = []
        for p in self._dir.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_file():
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self) -> int | None:
        """The step number of the most recently saved complete checkpoint (the one
        :meth:`restore` loads), or ``None``. Checkpoints are ordered by when they were saved,
        not by their numbers: after a counter restarted, or a rewind, the latest save holds
        the run's state."""
        order = self._save_order()
        return order[-1][1] if order else None

    # ------------------------------------------------------------------------------ save
    def save(self, step_number: int, **objects: Any) -> Path:
        """Write a checkpoint of ``objects`` for ``step_number``, atomically.

        Call it after the optimizer step of logical step ``step_number`` (so that restoring
        resumes with step ``step_number + 1``). Saving a step number that exists replaces it.

        Args:
            step_number: an int >= 0 (usually the number of steps taken).
            **objects: the state to save, by name.

        Returns:
            The path of the new checkpoint.

        Raises:
            InputTypeError: no objects, or an object of a type without a serializer.
            CheckpointError: the file could not be written (the previous checkpoints are intact).
        """
        step_number = check_nonnegative_int(step_number, name="step_number")
        if not objects:
            raise InputTypeError("Checkpointer.save needs at least one object, e.g. save(step, model=model, optimizer=opt).")
        flat, meta = _ser.state_dict(dict(objects))
        tensors = _ser._writable(flat)
        meta_json = _ser._metadata_json(meta)
        self._dir.mkdir(parents=True, exist_ok=True)
        order = self._save_order()
        seq = int(max((s for s, _ in order if math.isfinite(s)), default=0)) + 1
        header = {
            "opake_compile": meta_json,
            "opake_compile.step": str(step_number),
            "opake_compile.saved": str(seq),
            "opake_compile.sha256": _checksum(tensors, meta_json),
        }
        final = self.path(step_number)
        tmp = self._dir / f"{_TMP_PREFIX}{step_number:010d}-{os.getpid()}.safetensors"
        try:
            _write_safetensors(tmp, tensors, header)
            _atomic_rename(tmp, final)
            _fsync_dir(self._dir)
        except Exception as err:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"Could not write the checkpoint of step {step_number} to {final}: {err}") from err
        # (The order read above, with this save: its headers are not read again.)
        self._prune(sorted([e for e in order if e[1] != step_number] + [(float(seq), step_number)]))
        return final

    def _save_order(self) -> list[tuple[float, int]]:
        """``(save sequence, step number)`` of every complete checkpoint, oldest save first.
        Files written before the sequence was recorded count as saved before all others, among
        themselves in step order. A file whose header cannot be read counts as the newest, so
        that ``restore()`` reports it instead of loading an older state without a word (review)."""
        from safetensors import safe_open

        out = []
        for step in self.steps():
            try:
                with safe_open(str(self.path(step)), framework="pt") as f:
                    seq = float(int((f.metadata() or {}).get("opake_compile.saved", 0)))
            except Exception:  # noqa: BLE001 - a damaged file: load() raises on it
                seq = math.inf
            out.append((seq, step))
        return sorted(out)

    def _prune(self, order: list[tuple[float, int]]) -> None:
        # The most recently saved are kept, whatever their step numbers: a counter that
        # restarted (per epoch) had the file just written pruned as the lowest number, and a
        # later restore() rewound silently to an older state (review).
        for _, s in order[: -self._keep]:
            self.path(s).unlink(missing_ok=True)
        for p in self._dir.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                p.unlink(missing_ok=True)

    # --------------------------------------------------------------------------- restore
    def restore(self, **objects: Any) -> int | None:
        """Load the newest complete checkpoint into ``objects``; return its step number.

        Stateful objects (modules, optimizers, ``DPOptimizer``, samplers, ``DPStep``,
        schedulers) are restored in place. For value-type state (keys, clip and noise
        states) use :meth:`restore_state`, which also returns the restored values.

        Returns:
            The step number of the restored checkpoint, or ``None`` when the directory holds
            no complete checkpoint (then nothing is changed).

        Raises:
            CheckpointError: an object holds a value type (use :meth:`restore_state`); the
                newest checkpoint is corrupted (checksum), unreadable or does
                not match ``objects`` (missing or extra names, shapes, dtypes, configuration
                such as the noise multiplier, sample rate or clipping norm). Nothing has
                changed then. Older checkpoints are not tried silently: pass one explicitly
                with :meth:`load` (``rewind=True``, and read its warning).
        """
        values = [name for name, obj in objects.items() if _value_leaves(obj)]
        if values:
            raise CheckpointError(
                f"restore() loads objects in place, but {values[0]!r} holds a value ("
                f"{type(_value_leaves(objects[values[0]])[0]).__name__}: a key, a clip or noise state, a tensor, a "
                "number) whose restored copy it would discard, so that the run went on from the fresh one (a noise "
                "state's key replayed step 1's noise). Use restore_state(), which returns the restored values. "
                "Nothing was loaded."
            )
        found = self.restore_state(**objects)
        return None if found is None else found[0]

    def restore_state(self, **objects: Any) -> tuple[int, dict[str, Any]] | None:
        """As :meth:`restore`, returning ``(step_number, restored)``: ``restored`` maps each
        name to its restored object (the same object for stateful ones, a new value for value
        types). ``None`` when there is no checkpoint."""
        latest = self.latest_step()
        if latest is None:
            return None
        return latest, self.load(latest, **objects)

    def load(self, step_number: int, *, rewind: bool = False, **objects: Any) -> dict[str, Any]:
        """Load the checkpoint of ``step_number`` into ``objects``; return the restored tree.

        A checkpoint older than the newest one is refused unless ``rewind=True``: a run
        continued from it draws again the noise of the steps after it, which were already
        released with other data (the difference of two such releases is the difference of
        two clipped sums, without noise), and its accountant forgets them. Rewind only when
        nothing computed after that checkpoint was seen (a newest file corrupted before it
        left the machine, say).

        Raises:
            CheckpointError: no such checkpoint; an older one without ``rewind=True``; as
                :meth:`restore`.
        """
        path = self.path(step_number)
        if not path.is_file():
            raise CheckpointError(f"No checkpoint of step {step_number} in {self._dir} (have {self.steps()}).")
        latest = self.latest_step()
        if latest is not None and step_number != latest and not rewind:
            raise CheckpointError(
                f"Checkpoint {step_number} is older than the newest ({latest}, saved after it) in {self._dir}: a run continued "
                "from it replays the noise of the steps taken after it, already released with other "
                "data, and its accountant forgets them. Resume from the newest (restore()), or pass "
                "rewind=True if nothing computed after this checkpoint was ever seen."
            )
        if not objects:
            raise InputTypeError("Checkpointer.restore needs the objects to restore into, by the names used to save them.")
        flat, meta, header = _read(path)
        if header.get("opake_compile.step") != str(step_number):
            raise CheckpointError(f"{path}: records step {header.get('opake_compile.step')!r}, its name says {step_number}.")
        return _ser.from_state_dict(dict(objects), flat, meta)


def _value_leaves(obj: Any) -> list[Any]:
    """The leaves of ``obj`` that restoring returns as new values instead of loading in place
    (anything but a module, an optimizer, a scheduler or an object of an in-place serializer)."""
    if obj is None or isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
        return []
    ser = _ser.serializer_for(obj)
    if ser is not None:
        return [] if ser.in_place else [obj]
    if isinstance(obj, Mapping):
        return [v for x in obj.values() for v in _value_leaves(x)]
    if isinstance(obj, (list, tuple)):
        return [v for x in obj for v in _value_leaves(x)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [v for f in dataclasses.fields(obj) for v in _value_leaves(getattr(obj, f.name))]
    return [obj]


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, str]]:
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            header = dict(f.metadata() or {})
            flat = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # noqa: BLE001 - truncated or foreign files
        raise CheckpointError(f"{path}: cannot read the checkpoint ({type(err).__name__}: {err}).") from err
    meta_json = header.get("opake_compile")
    digest = header.get("opake_compile.sha256")
    if meta_json is None or digest is None:
        raise CheckpointError(f"{path}: not an opake_compile checkpoint (no structure or checksum in its header).")
    if _checksum(flat, meta_json) != digest:
        raise CheckpointError(f"{path}: checksum mismatch: the file is corrupted. Restore an older checkpoint with Checkpointer.load.")
    try:
        meta = json.loads(meta_json)
    except ValueError as err:
        raise CheckpointError(f"{path}: malformed structure metadata ({err}).") from err
    return flat, meta, header
