#!/usr/bin/env python
"""Per-call overhead of ``DPStep``: the Python around the compiled graph.

Each call of the step is timed whole, and the compiled graph inside it is timed on its own (a
thin timer wrapped around the graph's callable); the difference is the overhead: argument
checks, the model-state walk, the signature, the size plan, slicing and padding, the masks,
assembling the :class:`ClippedPytree` and the one host read of the non-finite count. Both
figures come from the same calls, so machine load moves them together. Reported as a share of
the whole step (target: <= 2 % on the MLP 256-512-512-10, B = 256), and as CPU time of the
calling thread (``time.thread_time``): the overhead is single-threaded Python, and its CPU time
does not grow when other processes take the cores (wall-clock shares do, on a loaded machine).

The last two columns time the same calls with every graph replaced by a replay of its
outputs: the Python around the graph alone, with warm caches. The gap between that and the
overhead above is mostly cache misses: the graph (8-12 ms of matrix products on the MLP) evicts
the interpreter's and torch's data, and the Python after it runs cold. Measured 2026-12-04 on 2
cores: the step's Python took 53 us warm and 456 us after a 32 MB memory sweep; a single
``torch.zeros(1) + 1`` took 165 us cold. The non-private baseline's own wrapper (guards, the
compiled graph's Python) pays the same kind of misses inside its step time.

    python bench/bench_overhead.py                 # MLP, B = 256, fixed batch and Poisson sizes
    python bench/bench_overhead.py --device cuda   # the same on a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


class _Timed:
    """Wraps a compiled graph; adds the seconds spent inside it to ``total``."""

    def __init__(self, fn: Any, sync: Any) -> None:
        self.fn, self.sync, self.total, self.cpu = fn, sync, 0.0, 0.0

    def __call__(self, *a: Any) -> Any:
        self.sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        out = self.fn(*a)
        self.sync()
        self.total += time.perf_counter() - t0
        self.cpu += time.thread_time() - c0
        return out


def measure(step: Any, batches: list[tuple], rounds: int, sync: Any) -> tuple[float, float, float, float]:
    """Medians over ``rounds`` passes over ``batches``: (step ms, overhead share of the wall
    time, step CPU ms of this thread, overhead CPU microseconds of this thread)."""
    for b in batches:  # compile every size first
        step(*b)
    timers = []
    for c in step._cache.values():
        if not isinstance(c.fn, _Timed):
            c.fn = _Timed(c.fn, sync)
        timers.append(c.fn)
    steps, shares, cpus, over = [], [], [], []
    for _ in range(rounds):
        for b in batches:
            inner0, cin0 = sum(t.total for t in timers), sum(t.cpu for t in timers)
            sync()
            t0, c0 = time.perf_counter(), time.thread_time()
            step(*b)
            sync()
            whole, cpu = time.perf_counter() - t0, time.thread_time() - c0
            inner, cin = sum(t.total for t in timers) - inner0, sum(t.cpu for t in timers) - cin0
            steps.append(whole * 1e3)
            shares.append((whole - inner) / whole)
            cpus.append(cpu * 1e3)
            over.append((cpu - cin) * 1e6)
    return statistics.median(steps), statistics.median(shares), statistics.median(cpus), statistics.median(over)


class _Replay:
    """Stands in for a compiled graph: returns the outputs of its last real call (one per
    argument shapes), so that timing the step measures the Python around the graph alone."""

    def __init__(self, timed: _Timed) -> None:
        self.fn, self.outs = timed.fn, {}

    def __call__(self, *a: Any) -> Any:
        key = tuple(getattr(x, "shape", None) for x in a)
        if key not in self.outs:
            self.outs[key] = self.fn(*a)
        return self.outs[key]


def python_alone(step: Any, batches: list[tuple], rounds: int) -> float:
    """Median microseconds per call with every graph replaced by a replay of its outputs: the
    signature, the model and program checks, the plan, padding, masks, input checks, result
    assembly and the host read, without the graph and without freeing its outputs."""
    for c in step._cache.values():
        c.fn = _Replay(c.fn)
    for b in batches:
        step(*b)
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(20):
            for b in batches:
                step(*b)
        per.append((time.perf_counter() - t0) / (20 * len(batches)) * 1e6)
    return statistics.median(per)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp", help="a bench_step.py model name")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    ns = p.parse_args()
    import bench_step as bs  # a sibling script: `python bench/<this>.py` puts bench/ on sys.path
    import torch

    import opake_compile as opake

    spec, args = bs.build(ns.model, ns.quick, ns.device)
    sync = bs._sync(ns.device)
    g = torch.Generator().manual_seed(3)
    sizes = bs.poisson_sizes(spec.batch_size)[:6]
    poisson = [tuple(a.to(ns.device) for a in spec.make_batch(n, g)) for n in sizes]
    print(f"# bench_overhead torch={torch.__version__} threads={torch.get_num_threads()} device={ns.device} "
          f"loadavg={os.getloadavg()}", flush=True)
    print("| model | batches | step ms (wall) | overhead share of wall | step CPU ms (this thread) | overhead CPU us "
          "| Python alone us (graph replayed) | Python alone / step |")
    print("|---|---|---|---|---|---|---|---|")
    for label, batches in (("fixed B", [args]), (f"Poisson sizes {sizes}", poisson)):
        step = opake.compile_dp(spec.loss_fn, model=spec.model, clipping_norm=1.0)
        step(*args)  # anchor the buckets at the expected batch size
        ms, share, cpu, over = measure(step, batches, ns.rounds, sync)
        alone = python_alone(step, batches, ns.rounds)
        print(f"| {spec.description} | {label} | {ms:.2f} | {100 * share:.2f} % | {cpu:.2f} | {over:.0f} "
              f"| {alone:.0f} | {alone / (10 * ms):.2f} % |", flush=True)
    print(f"# loadavg end {os.getloadavg()}")


if __name__ == "__main__":
    main()
