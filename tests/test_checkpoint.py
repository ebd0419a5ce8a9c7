"""``opake_compile.Checkpointer`` and the resumable main job.

The central test kills the main job (``examples/train_digits.py``, dropout in the model, a
cosine LR schedule, aot_eager) with SIGKILL, sent by the process to itself right after the
checkpoint of step k was written, resumes it, and compares the final parameters, the optimizer
state and the reported epsilon with an uninterrupted run, bit for bit. The others inject a
failure between write and rename, corrupt and truncate files, and check rotation.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import opake_compile as opake
from opake_compile import checkpoint as C
from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError

_DRIVER = Path(__file__).resolve().parent / "_resume_driver.py"


def _objects(seed: int = 0, key: int = 1):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Linear(4, 3)
    sampler = opake.PoissonSampler(20, 0.25, key=opake.random.key(2))
    opt = opake.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(key))
    return {"model": model, "optimizer": opt, "sampler": sampler}


def _advance(objs, steps: int) -> None:
    """Pure-noise steps (zero clipped sums): enough to move parameters, moments, keys, counts."""
    model, opt = objs["model"], objs["optimizer"]
    for _ in range(steps):
        clipped = opake.ClippedPytree(
            grads={k: torch.zeros_like(p) for k, p in model.named_parameters()},
            clipping_norm=1.0, per_example_norms=torch.zeros(0), num_examples=0,
            parameters=dict(model.named_parameters()),
        )
        next(iter(opt.sampler))  # a step is charged for a draw the sampler handed out
        opt.step(clipped)


def _state(objs):
    flat, _ = opake.serialization.state_dict(objs)
    return {k: v.clone() for k, v in flat.items()}


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_save_restore_and_keep_the_last_k(tmp_path):
    ckpt = opake.Checkpointer(tmp_path / "run", keep=2)
    objs = _objects()
    assert ckpt.restore(**_objects()) is None and ckpt.steps() == []
    saved = {}
    for step in range(1, 5):
        _advance(objs, 1)
        ckpt.save(step, **objs)
        saved[step] = _state(objs)
    assert ckpt.steps() == [3, 4] and ckpt.latest_step() == 4
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["ckpt-0000000003.safetensors", "ckpt-0000000004.safetensors"]
    fresh = _objects(seed=1, key=9)
    assert ckpt.restore(**fresh) == 4
    assert _equal(_state(fresh), saved[4])
    older = _objects(seed=1, key=9)
    # An older checkpoint replays released noise (a review's fork from step 1 of 3 did): refused
    # unless asked for, and nothing changes then.
    untouched = _state(older)
    with pytest.raises(CheckpointError, match="older than the newest"):
        ckpt.load(3, **older)
    assert _equal(_state(older), untouched)
    ckpt.load(3, rewind=True, **older)
    assert _equal(_state(older), saved[3])
    with pytest.raises(CheckpointError, match="No checkpoint of step 1"):
        ckpt.load(1, **_objects())


def test_restore_state_returns_value_types(tmp_path):
    ckpt = opake.Checkpointer(tmp_path)
    noise = opake.dpsgd.noise.NoiseState(opake.random.key(3))
    ckpt.save(7, noise=noise, count=12)
    step, restored = ckpt.restore_state(noise=opake.dpsgd.noise.NoiseState(opake.random.key(0)), count=0)
    assert step == 7 and restored == {"noise": noise, "count": 12}


def test_failure_between_write_and_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt = opake.Checkpointer(tmp_path, keep=3)
    objs = _objects()
    _advance(objs, 2)
    ckpt.save(2, **objs)
    good = _state(objs)
    _advance(objs, 1)

    def crash(src, dst):
        assert Path(src).is_file() and Path(src).stat().st_size > 0  # written and fsync'ed
        raise OSError("injected failure before rename")

    monkeypatch.setattr(C, "_atomic_rename", crash)
    with pytest.raises(CheckpointError, match="injected failure"):
        ckpt.save(3, **objs)
    monkeypatch.undo()
    assert ckpt.steps() == [2]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt-0000000002.safetensors"]  # no temporary left
    fresh = _objects(seed=5)
    assert ckpt.restore(**fresh) == 2
    assert _equal(_state(fresh), good)


def test_a_leftover_temporary_file_is_ignored_and_cleaned(tmp_path):
    ckpt = opake.Checkpointer(tmp_path)
    objs = _objects()
    ckpt.save(1, **objs)
    stale = tmp_path / f"{C._TMP_PREFIX}0000000002-999.safetensors"
    stale.write_bytes(b"half a checkpoint")  # what a kill during a write leaves
    assert ckpt.restore(**_objects()) == 1
    ckpt.save(2, **objs)
    assert not stale.exists()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupted_checkpoint_raises_and_changes_nothing(tmp_path, damage):
    ckpt = opake.Checkpointer(tmp_path)
    objs = _objects()
    _advance(objs, 1)
    path = ckpt.save(1, **objs)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x10  # inside the last tensor's bytes
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    fresh = _objects(seed=3)
    before = _state(fresh)
    with pytest.raises(CheckpointError, match="checksum mismatch" if damage == "flip" else "cannot read"):
        ckpt.restore(**fresh)
    assert _equal(_state(fresh), before)


def test_mismatched_objects_raise_and_change_nothing(tmp_path):
    ckpt = opake.Checkpointer(tmp_path)
    objs = _objects()
    _advance(objs, 1)
    ckpt.save(1, **objs)
    fresh = _objects(seed=3)
    before = _state(fresh)
    with pytest.raises(CheckpointError, match=r"^sampler_renamed: missing from the checkpoint"):
        ckpt.restore(model=fresh["model"], optimizer=fresh["optimizer"], sampler_renamed=fresh["sampler"])
    other_sigma = opake.DPOptimizer(torch.optim.SGD(fresh["model"].parameters(), lr=0.1, momentum=0.9), noise_multiplier=2.0, sampler=fresh["sampler"], key=opake.random.key(1))
    with pytest.raises(CheckpointError, match=r"^optimizer\.noise_multiplier"):
        ckpt.restore(model=fresh["model"], optimizer=other_sigma, sampler=fresh["sampler"])
    assert _equal(_state(fresh), before)


def test_arguments_are_validated(tmp_path):
    with pytest.raises(ConfigurationError):
        opake.Checkpointer(tmp_path, keep=0)
    with pytest.raises(InputTypeError):
        opake.Checkpointer(3)  # type: ignore[arg-type]
    with pytest.raises(InputTypeError):
        opake.Checkpointer(tmp_path).save(1)
    with pytest.raises(ConfigurationError):
        opake.Checkpointer(tmp_path).save(-1, model=nn.Linear(1, 1))


# ----------------------------------------------------------------------------- kill and resume
_ARGS = [
    "--subset", "300", "--epochs", "2", "--batch-size", "64", "--dropout", "0.3", "--lr-schedule", "cosine",
    "--backend", "aot_eager", "--no-progress", "--quiet", "--seed", "1",
]
_KILL_AFTER = 7  # mid-way through the second of two 5-step epochs


def _driver(out: Path, kill_after: int, *extra: str) -> subprocess.CompletedProcess:
    pytest.importorskip("sklearn")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(_DRIVER), str(out), str(kill_after), "--", *_ARGS, *extra],
        env=env, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.slow
def test_main_job_killed_after_a_checkpoint_resumes_bit_for_bit(tmp_path):
    ckdir = tmp_path / "ck"
    flags = ["--checkpoint-dir", str(ckdir), "--checkpoint-every", "1"]
    whole = _driver(tmp_path / "whole.pt", -1)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = _driver(tmp_path / "never.pt", _KILL_AFTER, *flags)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "never.pt").exists()
    assert opake.Checkpointer(ckdir).latest_step() == _KILL_AFTER
    resumed = _driver(tmp_path / "resumed.pt", -1, *flags, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    print("\n[uninterrupted]", whole.stdout.strip().splitlines()[-1])
    print("[killed]       ", killed.stdout.strip().splitlines()[-1])
    print("[resumed]      ", resumed.stdout.strip().splitlines()[-1])

    a = torch.load(tmp_path / "whole.pt", weights_only=False)
    b = torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert b["resumed_from_step"] == _KILL_AFTER and a["steps"] == b["steps"] == 10
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    assert a["epsilon"] == b["epsilon"]
    sa, sb = a["optimizer"], b["optimizer"]
    assert sa["key"] == sb["key"] and sa["steps"] == sb["steps"]
    assert sa["optimizer"]["param_groups"] == sb["optimizer"]["param_groups"]  # lr from the schedule
    assert sa["optimizer"]["state"].keys() == sb["optimizer"]["state"].keys()
    for i, entry in sa["optimizer"]["state"].items():
        for name, t in entry.items():
            assert torch.equal(t, sb["optimizer"]["state"][i][name]), (i, name)
    # The resumed run reports the epochs it finished itself (the second one) identically.
    assert a["history"][-1]["epsilon"] == b["history"][-1]["epsilon"]
    assert a["history"][-1]["test_accuracy"] == b["history"][-1]["test_accuracy"]


def test_every_dtype_round_trips_through_the_file(tmp_path):
    """The direct safetensors writer and the fallback (complex) both give back the same bits."""
    ckpt = opake.Checkpointer(tmp_path)
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
              torch.int16, torch.int8, torch.uint8, torch.bool]
    g = torch.Generator().manual_seed(0)
    tensors = {str(d): (torch.randn(3, 2, generator=g) * 50).to(d) for d in dtypes}
    tensors["empty"] = torch.zeros(0, 3)
    tensors["scalar"] = torch.tensor(float("nan"))
    tensors["view"] = torch.arange(10.0)[2:8:2]  # a strided view of a larger storage
    for tree in (tensors, {**tensors, "complex": torch.randn(2, generator=g, dtype=torch.complex64)}):
        ckpt.save(1, t=tree)
        _, out = ckpt.restore_state(t={k: torch.empty_like(v) for k, v in tree.items()})
        for k, v in tree.items():
            assert out["t"][k].dtype == v.dtype and out["t"][k].shape == v.shape, k
            assert torch.equal(out["t"][k].reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), k


def test_tied_weights_are_saved_once_each_and_restored(tmp_path):
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied, as GPT-2's LM head
    ckpt = opake.Checkpointer(tmp_path)
    ckpt.save(1, model=model)
    fresh = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    fresh[1].weight = fresh[0].weight
    ckpt.restore(model=fresh)
    assert torch.equal(fresh[0].weight, model[0].weight) and fresh[1].weight is fresh[0].weight


def test_main_job_refuses_resume_without_a_directory():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_digits_ck", Path(__file__).resolve().parents[1] / "examples" / "train_digits.py")
    td = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = td
    spec.loader.exec_module(td)
    with pytest.raises(ConfigurationError, match="--resume needs --checkpoint-dir"):
        td._check_config(td.parse_args(["--resume"]))
    config = td.parse_args(["--checkpoint-dir", "d", "--resume", "--checkpoint-every", "3", "--dropout", "0.2", "--lr-schedule", "cosine"])
    assert (config.checkpoint_dir, config.resume, config.checkpoint_every, config.dropout, config.lr_schedule) == ("d", True, 3, 0.2, "cosine")
    with pytest.raises(ConfigurationError, match="checkpoint_every"):
        td._check_config(td.parse_args(["--checkpoint-every", "0"]))


def test_a_refused_restore_leaves_every_object_as_it_was(tmp_path):
    """The optimizer's own refusal (it charged more steps than the checkpoint) used to come
    after the model had been loaded: the model held the checkpoint's weights and the optimizer
    its own. Every object's checks now run before any object is loaded."""
    ckpt = C.Checkpointer(tmp_path)
    saved = _objects()
    _advance(saved, 2)
    ckpt.save(2, **saved)
    target = _objects(seed=5)
    _advance(target, 3)
    before = _state(target)
    with pytest.raises(CheckpointError, match="charged 3 step"):
        ckpt.restore(**target)
    assert _equal(_state(target), before)


def test_another_models_optimizer_state_is_refused_at_load(tmp_path):
    """Moments of another model with as many tensors: torch loads them, and the next step then
    failed half-way, after the noise was released and charged (two of four parameters updated).
    ``DPOptimizer.load_state_dict`` and ``Checkpointer.restore`` refuse it, naming the entry."""

    def build(classes: int):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, classes))
        sampler = opake.PoissonSampler(20, 0.25, key=opake.random.key(2))
        opt = opake.DPOptimizer(torch.optim.Adam(model.parameters()), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(1))
        return {"model": model, "optimizer": opt, "sampler": sampler}

    a, b = build(3), build(5)
    _advance(a, 1)
    before = _state(b)
    with pytest.raises(CheckpointError, match=r"optimizer\.state\.2\.exp_avg: shape \(3, 6\), but parameter 2 .* \(5, 6\)"):
        b["optimizer"].load_state_dict(a["optimizer"].state_dict())
    ckpt = C.Checkpointer(tmp_path)
    ckpt.save(1, optimizer=a["optimizer"])
    with pytest.raises(CheckpointError, match=r"exp_avg: shape \(3, 6\)"):
        ckpt.restore(optimizer=b["optimizer"])
    assert _equal(_state(b), before) and b["optimizer"].steps == 0


def test_the_latest_save_is_restored_whatever_its_step_number(tmp_path):
    """A step counter that restarts (per epoch) saved step 1 after steps 2-4 exist: the file just
    written was pruned as the lowest number and a later restore() rewound silently to a state 2
    charged steps older, whose next step replayed released noise (review). Checkpoints are
    ordered by when they were saved; an older save loads only with rewind=True."""
    ckpt = C.Checkpointer(tmp_path / "run", keep=3)
    objs = _objects()
    for i in range(1, 5):  # epoch 0: steps 1..4
        _advance(objs, 1)
        ckpt.save(i, **objs)
    _advance(objs, 2)  # epoch 1 restarts the counter: 6 steps charged, saved as "2"
    saved = _state(objs)
    ckpt.save(2, **objs)
    assert ckpt.path(2).is_file() and ckpt.latest_step() == 2 and ckpt.steps() == [2, 3, 4]
    fresh = _objects()
    assert ckpt.restore(**fresh) == 2
    assert fresh["optimizer"].steps == 6 and _equal(_state(fresh), saved)
    with pytest.raises(CheckpointError, match=r"older than the newest \(2, saved after it\)"):
        ckpt.load(4, **_objects())
    # keep=1: the save just written is the one kept, not the one with the higher number.
    one = C.Checkpointer(tmp_path / "one", keep=1)
    one.save(5, **objs)
    one.save(1, **objs)
    assert one.steps() == [1]


def test_restore_refuses_value_types_it_would_discard(tmp_path):
    """restore() loads in place and returns a step number: a noise state passed to it was
    checked, restored into a copy and dropped, and the resumed loop added step 1's noise again
    (review). Refused, naming restore_state, which returns the restored values."""
    from opake_compile.dpsgd.noise import gaussian_noise

    ckpt = C.Checkpointer(tmp_path / "run")
    noise_fn, state = gaussian_noise(1.0, opake.random.key(0))
    grads = opake.ClippedPytree(grads={"w": torch.zeros(3)}, clipping_norm=1.0,
                                per_example_norms=torch.zeros(1), num_examples=1)
    first, state = noise_fn(grads, state)
    ckpt.save(1, noise=state, model=nn.Linear(2, 2))
    fresh = gaussian_noise(1.0, opake.random.key(0))[1]
    model = nn.Linear(2, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match="'noise' holds a value .* restore_state"):
        ckpt.restore(noise=fresh, model=model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing loaded
    step, restored = ckpt.restore_state(noise=fresh, model=model)
    again = opake.ClippedPytree(grads={"w": torch.zeros(3)}, clipping_norm=1.0,
                                per_example_norms=torch.zeros(1), num_examples=1)
    second, _ = noise_fn(again, restored["noise"])
    assert step == 1 and not torch.equal(first.grads["w"], second.grads["w"])
