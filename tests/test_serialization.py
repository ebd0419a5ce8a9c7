"""``opake_compile.serialization``: flat state dicts of whole DP runs.

Oracles: a restored tree re-encodes to exactly the same tensors (dtype, shape, bits) and
metadata as the original (after a trip through ``torch.save``/``torch.load(weights_only=True)``
and through safetensors); a run resumed from restored state continues exactly as the
uninterrupted run, and one resumed *without* the step's key does not (the bug of issue 20);
every mismatch raises ``CheckpointError`` naming the key and leaves every object unchanged.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opake_compile as opake
from opake_compile import accounting as acc
from opake_compile import serialization as S
from opake_compile._validate import NotPrivateWarning
from opake_compile.distributed import DistributedPoissonSampler
from opake_compile.dpsgd.clipping import AdaptiveClipState, ClipState, adaptive_clipped_grad
from opake_compile.dpsgd.noise import NoiseState, gaussian_noise
from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError

N = 24


class _Net(nn.Module):
    def __init__(self, seed: int = 0, p: float = 0.5) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.fc1 = nn.Linear(5, 8)
            self.drop = nn.Dropout(p)
            self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.tanh(self.fc1(x))))


def _loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(x), y)


def _data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)


def _run_objects(model_seed=0, sigma=1.0, q=0.25, c=1.0, sampler_seed=1, noise_seed=2, step_seed=3):
    model = _Net(model_seed)
    step = opake.compile_dp(_loss, model=model, clipping_norm=c, backend="aot_eager", physical_batch_size=16, key=opake.random.key(step_seed))
    sampler = opake.PoissonSampler(N, q, key=opake.random.key(sampler_seed))
    opt = opake.DPOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), noise_multiplier=sigma, sampler=sampler, key=opake.random.key(noise_seed))
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, opake.schedules.cosine_schedule(8))
    return {"model": model, "optimizer": opt, "sampler": sampler, "step": step, "scheduler": sched}


def _epochs(sampler):
    while True:  # a new iter() per epoch, as a training loop does
        yield from sampler


def _train(objs, batches, it=None):
    x, y = _data()
    it = _epochs(objs["sampler"]) if it is None else it
    for _ in range(batches):
        idx = torch.as_tensor(next(it), dtype=torch.int64)
        objs["optimizer"].step(objs["step"](x[idx], y[idx]).clipped)
        objs["scheduler"].step()
    return it


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_flat_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8) if a[k].numel() else a[k], b[k].view(-1).view(torch.uint8) if b[k].numel() else b[k]), k


def _snapshot(tree) -> tuple[dict, dict]:
    flat, meta = S.state_dict(tree)
    return {k: v.clone() for k, v in flat.items()}, json.loads(json.dumps(meta))


def _through_torch_save(flat, meta):
    buf = io.BytesIO()
    torch.save({"tensors": flat, "metadata": meta}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=True)
    return blob["tensors"], blob["metadata"]


def _through_safetensors(flat, meta, tmp_path):
    path = tmp_path / "state.safetensors"
    S._write(str(path), flat, meta, {})
    flat2, meta2, _ = S._read(str(path))
    return flat2, meta2


# ----------------------------------------------------------------------------- round trips
def _value_tree():
    sigma_noise_fn, noise_state = gaussian_noise(1.0, opake.random.key(11))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        grad_fn, ada = adaptive_clipped_grad(
            lambda p, x: (p * x).sum(), initial_clipping_norm=1.0, key=opake.random.key(12),
            expected_batch_size=4.0, count_noise_multiplier=1.0,
        )
    _, ada = grad_fn(torch.ones(3), torch.randn(4, 3), state=ada)  # a C and key that moved
    step = acc.dpsgd_step_process(1.1, 0.01, dataset_size=1000)
    return {
        "clip": ClipState(1.5),
        "adaptive": ada,
        "noise": noise_state,
        "key": opake.random.key(5),
        "accountant": acc.Accountant("pld", value_discretization_interval=1e-3),
        "process": step * 7 | acc.gaussian(3.0) | acc.eps_delta(0.5, 1e-6) | acc.identity(),
        "truncated": acc.poisson(acc.gaussian(2.0), 0.1, truncated_batch_size=5, dataset_size=50) * 2,
        "nonprivate": acc.nonprivate(),
        "plain": [0, -3, 2**70, 1.5, -0.0, math.inf, math.nan, True, None, "text", (1, [2.0]), {"a": 1, 3: "x"}],
        "tensors": (torch.arange(6, dtype=torch.int32).reshape(2, 3), torch.tensor([1.5], dtype=torch.bfloat16), torch.zeros(0, 4)),
    }


def _fresh_value_tree():
    """Same structure and configuration, different values."""
    t = _value_tree()
    return {
        **t,
        "adaptive": AdaptiveClipState(1.0, opake.random.key(0)),
        "noise": NoiseState(opake.random.key(0)),
        "key": opake.random.key(0),
        "process": acc.identity(),
        "truncated": acc.identity(),
        "nonprivate": acc.identity(),
        "plain": [1, 1, 1, 0.0, 0.0, 0.0, 0.0, False, None, "", (0, [0.0]), {"a": 0, 3: ""}],
        "tensors": (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.bfloat16), torch.ones(0, 4)),
    }


@pytest.mark.filterwarnings("ignore::opake_compile._validate.NotPrivateWarning")
@pytest.mark.parametrize("medium", ["memory", "torch.save", "safetensors"])
def test_value_states_round_trip_bit_for_bit(medium, tmp_path):
    tree = _value_tree()
    flat, meta = S.state_dict(tree)
    json.dumps(meta, allow_nan=False)  # JSON-able, no floats
    if medium == "torch.save":
        flat, meta = _through_torch_save(flat, meta)
    elif medium == "safetensors":
        flat, meta = _through_safetensors(flat, meta, tmp_path)
    out = S.from_state_dict(_fresh_value_tree(), flat, meta)
    assert out["adaptive"] == tree["adaptive"] and out["noise"] == tree["noise"] and out["key"] == tree["key"]
    assert out["process"] == tree["process"] and out["truncated"] == tree["truncated"] and out["nonprivate"] == tree["nonprivate"]
    assert out["process"].epsilon_at(1e-5) == tree["process"].epsilon_at(1e-5)
    plain = out["plain"]
    assert plain[:4] == [0, -3, 2**70, 1.5] and math.copysign(1.0, plain[4]) == -1.0 and plain[5] == math.inf
    assert math.isnan(plain[6]) and plain[7:] == [True, None, "text", (1, [2.0]), {"a": 1, 3: "x"}]
    assert type(plain[7]) is bool and type(plain[10]) is tuple
    again, meta_again = S.state_dict(out)
    original, _ = S.state_dict(tree)
    _assert_flat_equal(again, original)
    assert meta_again == S.state_dict(tree)[1]


@pytest.mark.parametrize("medium", ["torch.save", "safetensors"])
def test_run_objects_round_trip_and_continue_identically(medium, tmp_path):
    run = _run_objects()
    it = _train(run, 3)  # mid-epoch (4 batches per epoch)
    flat, meta = S.state_dict(run)
    flat, meta = _through_torch_save(flat, meta) if medium == "torch.save" else _through_safetensors(flat, meta, tmp_path)
    fresh = _run_objects(model_seed=9, noise_seed=0)  # other initial weights and noise key: overwritten
    fresh["step"] = opake.compile_dp(_loss, model=fresh["model"], clipping_norm=1.0, backend="aot_eager", physical_batch_size=16)
    out = S.from_state_dict(fresh, flat, meta)
    assert out["model"] is fresh["model"] and out["optimizer"] is fresh["optimizer"]
    _assert_flat_equal(S.state_dict(fresh)[0], S.state_dict(run)[0])
    assert fresh["step"].num_calls == run["step"].num_calls == 3
    _train(run, 5, it)  # crosses into the next epoch
    _train(fresh, 5)
    for k, v in _params(run["model"]).items():
        assert torch.equal(v, _params(fresh["model"])[k]), k
    assert fresh["optimizer"].epsilon(1e-5) == run["optimizer"].epsilon(1e-5)
    assert fresh["scheduler"].get_last_lr() == run["scheduler"].get_last_lr()


def test_resume_without_the_steps_key_replays_dropout():
    """The bug of issue 20, as a control: saving everything but the DPStep replays masks."""
    run = _run_objects()
    it = _train(run, 3)
    partial = {k: v for k, v in run.items() if k != "step"}
    flat, meta = S.state_dict(partial)
    fresh = _run_objects()
    S.from_state_dict({k: v for k, v in fresh.items() if k != "step"}, flat, meta)
    _train(run, 2, it)
    _train(fresh, 2)
    assert any(not torch.equal(v, _params(fresh["model"])[k]) for k, v in _params(run["model"]).items())


def test_distributed_sampler_round_trips_with_its_rank():
    s = DistributedPoissonSampler(N, 0.3, key=opake.random.key(1), rank=1, world_size=2)
    it = iter(s)
    next(it)
    flat, meta = S.state_dict({"s": s})
    fresh = DistributedPoissonSampler(N, 0.3, key=opake.random.key(1), rank=1, world_size=2)
    S.from_state_dict({"s": fresh}, flat, meta)
    assert list(iter(fresh)) == list(it)
    other = DistributedPoissonSampler(N, 0.3, key=opake.random.key(1), rank=0, world_size=2)
    with pytest.raises(CheckpointError, match=r"^s\.rank"):
        S.from_state_dict({"s": other}, flat, meta)


def test_keys_are_stable_dotted_paths():
    model = nn.Linear(2, 1)
    sampler = opake.PoissonSampler(10, 0.5, key=opake.random.key(0))
    opt = opake.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(1))
    flat, _ = S.state_dict({"model": model, "opt": opt, "clip": ClipState(1.0), "k": opake.random.key(2)})
    assert {"model.weight", "model.bias", "opt.steps", "opt.noise_multiplier", "opt.key.0", "opt.optimizer.param_groups.0.lr",
            "opt.optimizer.param_groups.0.params.1", "opt.sample_rate", "clip.clipping_norm", "k"} <= set(flat)
    assert flat["opt.steps"].dtype == torch.int64 and flat["opt.steps"].dim() == 0
    assert flat["opt.noise_multiplier"].dtype == torch.float64
    assert flat["k"].dtype == torch.int64 and flat["k"].tolist() == list(opake.random.key(2).words)


# ----------------------------------------------------------------------------- mismatches
def _saved_run():
    run = _run_objects()
    _train(run, 2)
    flat, meta = S.state_dict(run)
    return {k: v.clone() for k, v in flat.items()}, meta


MISMATCHES = {
    "sigma": (dict(sigma=1.1), r"^optimizer\.noise_multiplier: .*1\.0.*1\.1"),
    "q": (dict(q=0.5), r"^optimizer\.sample_rate"),
    "C": (dict(c=2.0), r"^step\.clipping_norm"),
    "sampler key": (dict(sampler_seed=5), r"^sampler\.key"),
}


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_configuration_mismatch_raises_and_changes_nothing(name):
    flat, meta = _saved_run()
    kwargs, pattern = MISMATCHES[name]
    template = _run_objects(model_seed=4, **kwargs)
    before = _snapshot(template)
    with pytest.raises(CheckpointError, match=pattern):
        S.from_state_dict(template, flat, meta)
    after = _snapshot(template)
    _assert_flat_equal(before[0], after[0])
    assert before[1] == after[1]


def _edit(flat, meta, key, value=None, delete=False):
    flat = dict(flat)
    if delete:
        del flat[key]
    else:
        flat[key] = value
    return flat, meta


@pytest.mark.parametrize(
    "change, pattern",
    [
        (lambda f, m: _edit(f, m, "model.fc1.weight", delete=True), r"^model\.fc1\.weight: missing"),
        (lambda f, m: _edit(f, m, "model.fc2.bias", torch.zeros(4)), r"^model\.fc2\.bias: checkpoint has shape \(4,\)"),
        (lambda f, m: _edit(f, m, "model.fc2.bias", torch.zeros(3, dtype=torch.float64)), r"^model\.fc2\.bias: .*dtype torch\.float64"),
        (lambda f, m: _edit(f, m, "optimizer.steps", torch.tensor(2.0, dtype=torch.float64)), r"^optimizer\.steps: a saved int"),
        (lambda f, m: _edit(f, m, "optimizer.optimizer.state.9.exp_avg", torch.zeros(1)), r"optimizer\.optimizer\.state\.9\.exp_avg: in the checkpoint data but not referenced"),
        (lambda f, m: (f, {**m, "version": 99}), r"version 99"),
        (lambda f, m: (f, {**m, "format": "other"}), r"Not an opake_compile\.state checkpoint"),
        (lambda f, m: (f, {**m, "tree": {"dict": [["model", m["tree"]["dict"][0][1]]]}}), r"^optimizer: missing"),
        (lambda f, m: (f, {**m, "tree": {"dict": [*m["tree"]["dict"], ["extra", None]]}}), r"^extra: in the checkpoint but not in the template"),
        (lambda f, m: (f, {**m, "tree": {"dict": [["model", {"nonsense": 1}], *m["tree"]["dict"][1:]]}}), r"Malformed"),
    ],
    ids=["missing", "shape", "dtype", "kind", "unreferenced", "version", "format", "missing-object", "extra-object", "malformed"],
)
def test_corrupted_or_mismatched_data_raises_and_changes_nothing(change, pattern):
    flat, meta = _saved_run()
    flat, meta = change(flat, meta)
    template = _run_objects(model_seed=4)
    before = _snapshot(template)
    with pytest.raises(CheckpointError, match=pattern):
        S.from_state_dict(template, flat, meta)
    _assert_flat_equal(before[0], _snapshot(template)[0])


def test_a_late_mismatch_leaves_earlier_objects_unchanged():
    """Validation of the whole tree precedes every in-place load: the model (validated first)
    is untouched when the sampler (validated last) does not match."""
    flat, meta = _saved_run()
    template = _run_objects(model_seed=4, sampler_seed=6)
    before = _params(template["model"])
    with pytest.raises(CheckpointError, match=r"^sampler\.key"):
        S.from_state_dict(template, flat, meta)
    assert all(torch.equal(v, _params(template["model"])[k]) for k, v in before.items())
    assert template["optimizer"].steps == 0 and template["step"].num_calls == 0


def test_clip_state_norm_is_configuration_but_adaptive_norm_is_state():
    flat, meta = S.state_dict({"c": ClipState(1.0), "a": AdaptiveClipState(0.7, opake.random.key(1))})
    with pytest.raises(CheckpointError, match=r"^c\.clipping_norm"):
        S.from_state_dict({"c": ClipState(2.0), "a": AdaptiveClipState(1.0, opake.random.key(0))}, flat, meta)
    out = S.from_state_dict({"c": ClipState(1.0), "a": AdaptiveClipState(1.0, opake.random.key(0))}, flat, meta)
    assert out["a"] == AdaptiveClipState(0.7, opake.random.key(1))


def test_accountant_is_configuration():
    flat, meta = S.state_dict({"a": acc.Accountant("pld")})
    with pytest.raises(CheckpointError, match=r"^a\.method"):
        S.from_state_dict({"a": acc.Accountant("rdp")}, flat, meta)


# ----------------------------------------------------------------------------- registry
class _Counter:
    def __init__(self, n: int = 0, scale: float = 1.0) -> None:
        self.n, self.scale = n, scale


def test_register_serializer_for_a_user_type():
    S.register_serializer(
        _Counter,
        to_state=lambda c: {"n": c.n, "scale": c.scale},
        from_state=lambda tmpl, s: _Counter(s["n"], s["scale"]),
        config=("scale",),
    )
    flat, meta = S.state_dict({"c": _Counter(5, 2.0)})
    assert S.from_state_dict({"c": _Counter(0, 2.0)}, flat, meta)["c"].n == 5
    with pytest.raises(CheckpointError, match=r"^c\.scale"):
        S.from_state_dict({"c": _Counter(0, 3.0)}, flat, meta)
    with pytest.raises(ConfigurationError, match="already used"):
        S.register_serializer(int, to_state=int, from_state=lambda t, s: s, name=S.serializer_for(_Counter(1)).name)


def test_unregistered_types_and_bad_trees_are_refused():
    with pytest.raises(InputTypeError, match="no serializer for .*object"):
        S.state_dict({"x": object()})
    with pytest.raises(InputTypeError, match="same key 'a.b'"):
        S.state_dict({"a": {"b": 1}, "a.b": 2})
    with pytest.raises(InputTypeError, match="dict keys must be str or int"):
        S.state_dict({(1, 2): 3})
    with pytest.raises(InputTypeError):
        S.register_serializer("not a type", to_state=str, from_state=str)  # type: ignore[arg-type]


def test_plain_torch_optimizer_round_trips_and_its_free_state_is_checked():
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = _data()
    _loss(model, x, y).backward()
    opt.step()
    flat, meta = S.state_dict({"opt": opt})
    fresh_model = _Net(1)
    fresh = torch.optim.AdamW(fresh_model.parameters(), lr=0.01)
    S.from_state_dict({"opt": fresh}, flat, meta)
    _assert_flat_equal(S.state_dict({"opt": fresh})[0], flat)
    # moments of a parameter the template's optimizer does not have
    small = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=0.01)
    with pytest.raises(CheckpointError, match=r"^opt\.param_groups\.0\.params: the checkpoint holds 4 entries, the template 2"):
        S.from_state_dict({"opt": small}, flat, meta)


@dataclasses.dataclass(frozen=True, repr=False)
class _CustomProcess(acc.PrivacyProcess):
    """A process class the serializer has no explicit case for (as new mechanisms will be)."""

    inner: acc.PrivacyProcess
    weights: tuple[float, ...]

    def to_dp_event(self):
        return self.inner.to_dp_event()


def test_other_public_process_classes_round_trip_by_their_fields(monkeypatch):
    monkeypatch.setattr(acc, "_CustomProcess", _CustomProcess, raising=False)
    _CustomProcess.__name__ = "_CustomProcess"
    p = _CustomProcess(acc.gaussian(2.0) * 3, (0.5, 1.5)) | acc.gaussian(1.0)
    flat, meta = S.state_dict({"p": p})
    assert S.from_state_dict({"p": acc.identity()}, flat, meta)["p"] == p
    monkeypatch.delattr(acc, "_CustomProcess")
    with pytest.raises(InputTypeError, match="No serialization for the privacy process"):
        S.state_dict({"p": p})


def test_optimizer_history_of_varying_length_is_data_not_structure():
    """A DPOptimizer state entry whose length grows with the run (``runs``, kept by optimizers
    that charge heterogeneous steps) is restored from the data, not matched to the template."""

    class _WithRuns(opake.DPOptimizer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.runs = []

        def state_dict(self):
            return {**super().state_dict(), "runs": [list(r) for r in self.runs]}

        def load_state_dict(self, state):
            super().load_state_dict({k: v for k, v in state.items() if k != "runs"})
            self.runs = [tuple(r) for r in state["runs"]]

    def make():
        model = _Net()
        sampler = opake.PoissonSampler(N, 0.25, key=opake.random.key(1))
        return _WithRuns(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(2))

    saved = make()
    saved.runs = [([1.5], 3), ([], 2)]
    flat, meta = S.state_dict({"opt": saved})
    fresh = make()
    S.from_state_dict({"opt": fresh}, flat, meta)
    assert fresh.runs == [([1.5], 3), ([], 2)]
