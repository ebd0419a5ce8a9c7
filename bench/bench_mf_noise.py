#!/usr/bin/env python
"""Noise generation per step: correlated DP-FTRL noise against plain Gaussian noise.

For a gradient of ``d`` float32 entries (default 10^7) every mechanism noises the same zero
sum, round after round in rotating order in ONE process (so machine load hits all rows alike):
``gaussian`` (``gaussian_noise``) and ``mf_gaussian_noise`` with the identity, BandMF, BLT,
BISR and DP-lambda-CGD strategies. Reported per mechanism:

* ``time x gaussian``: median over rounds of (its step time / the Gaussian step time of the
  same round);
* ``state (x d)``: the noise state's tensors in units of ``d`` float32 entries, counted (not
  timed) after the steps: BandMF ``bands - 1``, BLT ``buffers``, BISR ``bands - 1``,
  lambda-CGD 0 (its past noise is regenerated from keys);
* ``extra draws``: standard-normal vectors drawn per step beyond the Gaussian's one (lambda-CGD
  redraws ``Z_(t-1)``).

    python bench/bench_mf_noise.py --d 10000000 --rounds 7 --steps 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import opake_compile as opake
from opake_compile import dpftrl
from opake_compile.dpsgd._types import ClippedPytree
from opake_compile.dpsgd.noise import gaussian_noise


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, default=10_000_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=64, help="n of the strategies")
    p.add_argument("--bands", type=int, default=4)
    p.add_argument("--buffers", type=int, default=3)
    ns = p.parse_args()
    n = ns.steps
    strategies = {
        "identity": dpftrl.identity_strategy(n),
        f"bandmf(bands={ns.bands})": dpftrl.band_mf_strategy(n, ns.bands),
        f"blt(buffers={ns.buffers})": dpftrl.blt_strategy(n, ns.buffers, restarts=1),
        f"bisr(bands={ns.bands})": dpftrl.bisr_strategy(n, ns.bands),
        "lambda-cgd": dpftrl.lambda_cgd_strategy(n),
    }
    mechs = {"gaussian": gaussian_noise(1.0, opake.random.key(0))}
    for name, s in strategies.items():
        mechs[name] = dpftrl.mf_gaussian_noise(s, 1.0, opake.random.key(0))
    states = {k: v[1] for k, v in mechs.items()}
    grads = {"w": torch.zeros(ns.d)}
    clipped = ClippedPytree(grads=grads, clipping_norm=1.0, per_example_norms=torch.zeros(0), num_examples=0)
    times = {k: [] for k in mechs}
    names = list(mechs)
    for r in range(ns.rounds + 1):  # round 0 warms up (allocates the buffers)
        order = names[r % len(names):] + names[: r % len(names)]
        for k in order:
            t0 = time.perf_counter()
            _, states[k] = mechs[k][0](clipped, states[k])
            if r:
                times[k].append(time.perf_counter() - t0)
    print(f"d = {ns.d:,} float32 entries, {ns.rounds} rounds, torch threads = {torch.get_num_threads()}")
    print(f"{'mechanism':<22}{'median ms':>10}{'time x gaussian':>17}{'state (x d)':>13}{'extra draws':>13}")
    for k in names:
        ratio = statistics.median(t / g for t, g in zip(times[k], times["gaussian"]))
        st = states[k]
        bufs = getattr(st, "buffers", None) or ()
        elems = sum(b.numel() for leaf in bufs for b in leaf)
        extra = 0
        if k in strategies and strategies[k].replay:
            extra = len(strategies[k].denominator) - 1
        print(f"{k:<22}{1e3 * statistics.median(times[k]):>10.1f}{ratio:>17.2f}{elems / ns.d:>13.0f}{extra:>13d}")


if __name__ == "__main__":
    main()
