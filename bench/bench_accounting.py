#!/usr/bin/env python
"""Benchmark of noise calibration and of a DPOptimizer's first budgeted step (issue 13).

For every case of the table (epsilon in {1, 3, 8, 50, 100}, delta = 1e-5, q in {0.004, 0.04},
10^2, 10^3 and 10^4 steps) it times

  opake      ``accounting.calibrate(epsilon_budget(eps, 1e-5), s -> poisson(gaussian(s), q) * steps,
             0.05, 100)`` with the default (fast) path: RDP bracket, then the coarse PLD grid
  opacus     ``opacus.accountants.utils.get_noise_multiplier`` on the same inputs (its default RDP
             accountant, epsilon_tolerance=0.01), when Opacus is installed (skipped otherwise)

and checks the fast path's stated accuracy against the finest grid (the default PLD accountant,
value_discretization_interval = 1e-4): ``eps_fine(sigma)`` must be <= the target (never less
private) and ``eps_fine(0.99 * sigma)`` above it (sigma within 1 % of the finest-grid answer).

Then it times a ``DPOptimizer``'s first budgeted step (the budget guard computes the exact number
of allowed steps once) for a few configurations, and, with ``--before``, the issue's slow case
with the pre-issue algorithm (bisection on the 1e-4 PLD grid alone, ``fast=False``).

    python bench/bench_accounting.py                 # the table, verified; ~5-10 min on 2 cores
    python bench/bench_accounting.py --quick         # three cases, no verification
    python bench/bench_accounting.py --before        # also the old path on the issue's case

Timings are wall-clock seconds on this machine; nothing here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import opake_compile as opake  # noqa: E402
from opake_compile import accounting as acc  # noqa: E402
from opake_compile.dpsgd.clipping import clipped_grad  # noqa: E402
from opake_compile.optim import DPOptimizer  # noqa: E402
from opake_compile.sampling import PoissonSampler  # noqa: E402

DELTA = 1e-5
EPSILONS = (1.0, 3.0, 8.0, 50.0, 100.0)
RATES = (0.004, 0.04)
STEPS = (100, 1000, 10000)
RANGE = (0.05, 100.0)


def _opacus():
    try:
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError:
        return None
    return get_noise_multiplier


def _process(q, steps):
    return lambda s: acc.poisson(acc.gaussian(s), q) * steps


def calibration_table(cases, verify):
    opacus = _opacus()
    fine = acc.Accountant("pld")  # the default grid, 1e-4
    print(f"{'eps':>6} {'q':>6} {'steps':>6} | {'sigma':>8} {'opake s':>8} {'grid':>7} | "
          f"{'eps_fine(s)':>11} {'eps_fine(.99s)':>14} {'ok':>3} | {'opacus sigma':>12} {'opacus s':>8}")
    worst = 0.0
    for eps, q, steps in cases:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = acc.calibrate(acc.epsilon_budget(eps, DELTA), _process(q, steps), *RANGE)
        dt = time.perf_counter() - t0
        worst = max(worst, dt)
        grid = f'{float(result.accountant.split("=")[-1].rstrip(")")):.2g}'
        check = ""
        if verify:
            at = fine.epsilon(_process(q, steps)(result.param), DELTA)
            below = fine.epsilon(_process(q, steps)(0.99 * result.param), DELTA)
            ok = at <= eps < below
            check = f"{at:11.4f} {below:14.4f} {'yes' if ok else 'NO':>3}"
        else:
            check = f"{'-':>11} {'-':>14} {'-':>3}"
        if opacus is not None:
            t0 = time.perf_counter()
            try:
                sigma_o = opacus(target_epsilon=eps, target_delta=DELTA, sample_rate=q, steps=steps, epsilon_tolerance=0.01)
                o = f"{sigma_o:12.4f} {time.perf_counter() - t0:8.2f}"
            except Exception as err:  # noqa: BLE001 - report, do not stop the table
                o = f"{type(err).__name__:>12} {time.perf_counter() - t0:8.2f}"
        else:
            o = f"{'(no opacus)':>12} {'-':>8}"
        print(f"{eps:6g} {q:6g} {steps:6d} | {result.param:8.4f} {dt:8.2f} {grid:>7} | {check} | {o}", flush=True)
    print(f"slowest opake calibration: {worst:.2f} s (target <= 10 s)")


def first_budgeted_step(configs):
    print(f"\n{'eps':>5} {'q':>6} {'steps':>6} {'sigma':>8} | {'first step s':>12} {'later step s':>12} | "
          f"{'exact count s':>13} {'allowed':>8}")
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64)
    for eps, q, steps in configs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sigma = acc.calibrate(acc.epsilon_budget(eps, DELTA), _process(q, steps), *RANGE).param
        n = 10_000
        params = {"w": torch.zeros(8, requires_grad=True)}
        grad_fn, st = clipped_grad(lambda p, a, b: 0.5 * ((a @ p["w"] - b) ** 2).mean(), 0, batch_argnums=(1, 2), clipping_norm=1.0)
        clipped, _ = grad_fn(params, x, y, state=st)
        sampler = PoissonSampler(n, q, key=opake.random.key(0))
        opt = DPOptimizer(
            torch.optim.SGD(params.values(), lr=0.1), noise_multiplier=sigma, sampler=sampler,
            key=opake.random.key(1), budget=acc.epsilon_budget(eps, DELTA),
        )
        t0 = time.perf_counter()
        opt.step(clipped)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        opt.step(clipped)
        later = time.perf_counter() - t0
        t0 = time.perf_counter()
        allowed = opt.max_steps()  # the exact count, computed once when training nears the end
        exact = time.perf_counter() - t0
        print(f"{eps:5g} {q:6g} {steps:6d} {sigma:8.4f} | {first:12.2f} {later:12.4f} | {exact:13.2f} {allowed:8d}", flush=True)


def before(eps=50.0, q=0.04, steps=1000):
    print(f"\nthe issue's case, eps={eps:g}, q={q:g}, {steps} steps, range (0.05, 10):")
    for label, kw in (("fast path (default)", {}), ("pre-issue: 1e-4 PLD bisection", {"fast": False})):
        t0 = time.perf_counter()
        r = acc.calibrate(acc.epsilon_budget(eps, DELTA), _process(q, steps), 0.05, 10.0, **kw)
        print(f"  {label:32s} sigma={r.param:.5f} eps={r.epsilon:.4f} {time.perf_counter() - t0:7.1f} s "
              f"({r.evaluations} evaluations, {r.accountant})", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="three cases, no verification")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the fine-grid checks")
    p.add_argument("--before", action="store_true", help="also time the pre-issue calibration on the issue's case")
    args = p.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Optimal order is the")  # Opacus's RDP order notes
    print(f"# {platform.platform()}, {os.cpu_count()} CPUs, torch {torch.__version__}, python {platform.python_version()}")
    if args.quick:
        cases = [(3.0, 0.004, 1000), (50.0, 0.04, 1000), (1.0, 0.04, 10000)]
        verify = False
    else:
        cases = [(e, q, k) for q in RATES for k in STEPS for e in EPSILONS]
        verify = args.verify
    calibration_table(cases, verify)
    first_budgeted_step([(3.0, 0.004, 1000), (8.0, 0.04, 1000), (1.0, 0.004, 10000)] if not args.quick else [(3.0, 0.004, 1000)])
    if args.before:
        before()


if __name__ == "__main__":
    main()
