"""Time a full-state checkpoint (``opake.Checkpointer``) of the digits CNN and a GPT-2-shaped model.

For each model: a ``DPOptimizer`` over Adam after one (pure-noise) step, so the moments exist,
plus the ``PoissonSampler`` and the ``DPStep``. Reports the file size and the median wall time
of ``save`` (flatten, SHA-256, write, fsync, rename) and ``restore`` (read, checksum, validate,
load in place) over ``--reps`` repetitions, and the share of the checksum. Run::

    python bench/bench_checkpoint.py --reps 5            # digits + GPT-2 small (124M parameters)
    python bench/bench_checkpoint.py --gpt2-layers 2     # a smaller GPT-2

GPT-2 is built from ``transformers.GPT2Config`` with random weights (no download); its LM head
is tied to the token embedding (one tensor in memory, two entries of the state dict).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "examples")]

import opake_compile as opake  # noqa: E402
from opake_compile import checkpoint as C  # noqa: E402
from opake_compile import serialization as S  # noqa: E402


def _objects(model: nn.Module, n: int) -> dict:
    sampler = opake.PoissonSampler(n, 0.01, key=opake.random.key(1))
    opt = opake.DPOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(2))
    params = dict(model.named_parameters())
    opt.step(opake.ClippedPytree(grads={k: torch.zeros_like(p) for k, p in params.items()}, clipping_norm=1.0,
                                 per_example_norms=torch.zeros(0), num_examples=0, parameters=params))
    step = opake.compile_dp(lambda m, *a: m(*a).sum(), model=model, clipping_norm=1.0, key=opake.random.key(3))
    return {"model": model, "optimizer": opt, "sampler": sampler, "step": step}


def _bench(name: str, objs: dict, reps: int) -> None:
    n_params = sum(p.numel() for p in objs["model"].parameters())
    with tempfile.TemporaryDirectory(dir=".") as d:
        ckpt = opake.Checkpointer(d, keep=2)
        saves, restores = [], []
        for i in range(reps):
            t0 = time.perf_counter()
            path = ckpt.save(i, **objs)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert ckpt.restore(**objs) == i
            restores.append(time.perf_counter() - t0)
        size = path.stat().st_size
        flat, meta = S.state_dict(objs)
        t0 = time.perf_counter()
        C._checksum(S._writable(flat), S._metadata_json(meta))
        checksum = time.perf_counter() - t0
    print(
        f"{name:<8} {n_params / 1e6:8.2f} M params  file {size / 2**20:8.1f} MiB  "
        f"save {statistics.median(saves) * 1e3:8.1f} ms  restore {statistics.median(restores) * 1e3:8.1f} ms  "
        f"(checksum {checksum * 1e3:.1f} ms each way; median of {reps}, {torch.get_num_threads()} threads)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--gpt2-layers", type=int, default=12)
    args = p.parse_args()
    import train_digits as td

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        digits = td.build_model((1, 8, 8), 10, dropout=0.1)
    _bench("digits", _objects(digits, 1437), args.reps)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("gpt2: transformers is not installed; skipped")
        return
    config = GPT2Config(n_layer=args.gpt2_layers, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        gpt2 = GPT2LMHeadModel(config)
    _bench(f"gpt2-{args.gpt2_layers}L", _objects(gpt2, 100_000), args.reps)


if __name__ == "__main__":
    main()
