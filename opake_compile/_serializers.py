"""The built-in serializers of :mod:`opake_compile.serialization` (registered on first use).

Every stateful object goes through its own public ``state_dict()`` / ``load_state_dict()``, so
fields that those methods gain later are saved without changes here; the privacy
configuration is declared as ``config`` (checked against the template before anything loads).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from opake_compile import accounting as _acc
from opake_compile import random as _random
from opake_compile._validate import check_optimizer_state
from opake_compile.compiler.step import DPStep
from opake_compile.dpsgd.clipping import ClipState
from opake_compile.exceptions import CheckpointError, InputTypeError, OpakeError
from opake_compile.optim import DPOptimizer
from opake_compile.sampling import PoissonSampler
from opake_compile.serialization import register_serializer

__all__: list[str] = []


def _load(method_owner: Any, state: Any) -> None:
    """``owner.load_state_dict(state)``, errors of the owner reported as CheckpointError."""
    try:
        method_owner.load_state_dict(state)
    except CheckpointError:
        raise
    except (OpakeError, ValueError, KeyError, RuntimeError, TypeError) as err:
        raise CheckpointError(f"{type(method_owner).__name__}.load_state_dict refused the checkpoint: {err}") from err


# ----------------------------------------------------------------------------- torch
register_serializer(
    nn.Module,
    name="torch.nn.Module",
    to_state=lambda m: m.state_dict(),
    from_state=lambda m, s: _load(m, s),
    in_place=True,
)


def _optimizer_to_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return opt.state_dict()


register_serializer(
    torch.optim.Optimizer,
    name="torch.optim.Optimizer",
    to_state=_optimizer_to_state,
    from_state=_load,
    free=(("state",),),
    in_place=True,
    check=check_optimizer_state,
)

register_serializer(
    torch.optim.lr_scheduler.LRScheduler,
    name="torch.optim.lr_scheduler.LRScheduler",
    to_state=lambda s: s.state_dict(),
    from_state=lambda s, st: _load(s, st),
    in_place=True,
)

# ----------------------------------------------------------------------------- opake objects
register_serializer(
    _random.Key,
    name="opake.Key",
    to_state=lambda k: torch.tensor(_random.key_to_state(k), dtype=torch.int64),
    from_state=lambda _tmpl, t: _random.key_from_state(t),
)

register_serializer(
    ClipState,
    name="opake.ClipState",
    to_state=lambda s: {"clipping_norm": float(s.clipping_norm)},
    from_state=lambda _tmpl, s: ClipState(s["clipping_norm"]),
    config=("clipping_norm",),
)


def _accountant_to_state(a: _acc.Accountant) -> dict[str, Any]:
    return {"method": a.method, "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in a.options.items()}}


register_serializer(
    _acc.Accountant,
    name="opake.Accountant",
    to_state=_accountant_to_state,
    from_state=lambda tmpl, _s: tmpl,  # configuration only: equal by the config check
    config=("method", "options"),
)


def _dp_optimizer_to_state(opt: DPOptimizer) -> dict[str, Any]:
    return {**opt.state_dict(), "accountant": _accountant_to_state(opt.accountant)}


def _dp_optimizer_from_state(opt: DPOptimizer, state: Mapping[str, Any]) -> None:
    _load(opt, {k: v for k, v in state.items() if k != "accountant"})


def _dp_optimizer_check(opt: DPOptimizer, state: Mapping[str, Any]) -> None:
    # (A subclass with its own load_state_dict reads its own state format: not checked ahead.)
    if type(opt).load_state_dict is DPOptimizer.load_state_dict:
        opt._validated_state({k: v for k, v in state.items() if k != "accountant"})


register_serializer(
    DPOptimizer,
    name="opake.DPOptimizer",
    to_state=_dp_optimizer_to_state,
    from_state=_dp_optimizer_from_state,
    config=("noise_multiplier", "sample_rate", "dataset_size", "truncated_batch_size", "accountant"),
    # "runs": the per-run history of charged steps some optimizer versions keep (its length is
    # data); the wrapped optimizer's moments do not exist yet in a fresh template.
    free=(("optimizer", "state"), ("runs",), ("noise_state", "buffers"), ("noise_state", "replay_keys")),
    in_place=True,
    check=_dp_optimizer_check,
)

register_serializer(
    PoissonSampler,
    name="opake.PoissonSampler",
    to_state=lambda s: s.state_dict(),
    from_state=lambda s, st: _load(s, st),
    config=("dataset_size", "sample_rate", "truncated_batch_size", "steps", "key", "rank", "world_size"),
    in_place=True,
    local=("rank",),
)

register_serializer(
    DPStep,
    name="opake.DPStep",
    to_state=lambda s: s.state_dict(),
    from_state=lambda s, st: _load(s, st),
    config=("clipping_norm",),
    in_place=True,
    local=("key",),  # dropout randomness stays per process in data-parallel runs
)


# ----------------------------------------------------------------------------- processes
def _process_to_state(p: Any) -> dict[str, Any]:
    """A privacy process through the public constructors of :mod:`opake_compile.accounting`."""
    if isinstance(p, _acc.GaussianMechanism):
        return {"kind": "gaussian", "noise_multiplier": float(p.noise_multiplier)}
    if isinstance(p, _acc.PoissonSampled):
        return {
            "kind": "poisson",
            "mechanism": _process_to_state(p.mechanism),
            "sample_rate": float(p.sample_rate),
            "truncated_batch_size": p.truncated_batch_size,
            "dataset_size": p.dataset_size,
        }
    if isinstance(p, _acc.EpsDeltaMechanism):
        return {"kind": "eps_delta", "epsilon": float(p.epsilon), "delta": float(p.delta)}
    if isinstance(p, _acc.IdentityProcess):
        return {"kind": "identity"}
    if isinstance(p, _acc.NonPrivateProcess):
        return {"kind": "nonprivate"}
    if isinstance(p, _acc.Repeated):
        return {"kind": "repeated", "process": _process_to_state(p.process), "count": int(p.count)}
    if isinstance(p, _acc.Composed):
        return {"kind": "composed", "parts": [_process_to_state(q) for q in p.parts]}
    # Any other public process class that is a dataclass: by its constructor's fields.
    if dataclasses.is_dataclass(p) and getattr(_acc, type(p).__name__, None) is type(p):
        return {
            "kind": "class",
            "name": type(p).__name__,
            "fields": {f.name: _field_to_state(getattr(p, f.name)) for f in dataclasses.fields(p) if f.init},
        }
    raise InputTypeError(f"No serialization for the privacy process {p!r} ({type(p).__name__}).")


def _field_to_state(v: Any) -> Any:
    if isinstance(v, _acc.PrivacyProcess):
        return _process_to_state(v)
    if isinstance(v, (list, tuple)):
        return [_field_to_state(x) for x in v]
    return v


def _field_from_state(v: Any) -> Any:
    if isinstance(v, Mapping) and "kind" in v:
        return _process_from_state(v)
    if isinstance(v, list):
        return tuple(_field_from_state(x) for x in v)  # frozen processes hold tuples
    return v


def _process_from_state(s: Any) -> Any:
    if not isinstance(s, Mapping) or "kind" not in s:
        raise CheckpointError(f"Malformed privacy process state {s!r}.")
    kind = s["kind"]
    if kind == "gaussian":
        return _acc.gaussian(s["noise_multiplier"])
    if kind == "poisson":
        return _acc.poisson(
            _process_from_state(s["mechanism"]),
            s["sample_rate"],
            truncated_batch_size=s["truncated_batch_size"],
            dataset_size=s["dataset_size"],
        )
    if kind == "eps_delta":
        return _acc.eps_delta(s["epsilon"], s["delta"])
    if kind == "identity":
        return _acc.identity()
    if kind == "nonprivate":
        return _acc.nonprivate()
    if kind == "repeated":
        inner = _process_from_state(s["process"])
        return _acc.Repeated(inner, s["count"]) if isinstance(inner, _acc.Repeated) else inner * s["count"]
    if kind == "composed":
        return _acc.Composed(tuple(_process_from_state(q) for q in s["parts"]))
    if kind == "class":
        cls = getattr(_acc, str(s.get("name")), None)
        if not (isinstance(cls, type) and issubclass(cls, _acc.PrivacyProcess)):
            raise CheckpointError(f"Unknown privacy process class {s.get('name')!r}.")
        return cls(**{k: _field_from_state(v) for k, v in s["fields"].items()})
    raise CheckpointError(f"Unknown privacy process kind {kind!r}.")


register_serializer(
    _acc.PrivacyProcess,
    name="opake.PrivacyProcess",
    to_state=_process_to_state,
    from_state=lambda _tmpl, s: _process_from_state(s),
    free=((),),  # the process is data: its structure comes from the checkpoint
)
