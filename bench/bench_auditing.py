#!/usr/bin/env python
"""Benchmark and tables of the one-run audit (``opake_compile.auditing``) on synthetic canaries.

Synthetic canaries: the scores of a mu-GDP mechanism, N(mu, 1) for included canaries and
N(0, 1) for excluded ones (coins from ``auditing.coin_flip``). No model is trained.

    python bench/bench_auditing.py                  # time the audit of 10^4 canaries (target <= 2 s)
    python bench/bench_auditing.py --table          # + bound vs number of canaries, (eps, delta) gap
    python bench/bench_auditing.py --oracle         # + our bounds next to JAX-Privacy's (jax extra)

The timed audit is what a user runs after training: ``one_run`` (the mu-GDP search, the
default view), ``epsilon_at(delta)``, the (eps, delta) view's ``epsilon_at(delta)``, the
attack AUC and beta at FPR 0.01. The scores are given (scoring a model is not timed here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import opake_compile as opake  # noqa: E402
from opake_compile import auditing  # noqa: E402
from opake_compile.auditing import _stats  # noqa: E402

DELTA = 1e-5


def synthetic(m: int, mu: float, seed: int) -> tuple[np.ndarray, auditing.CanaryRecord]:
    rec = auditing.coin_flip(m, opake.random.fold_in(opake.random.key(0), seed))
    return np.random.default_rng(seed).normal(size=m) + mu * rec.mask(), rec


def full_audit(scores: np.ndarray, rec: auditing.CanaryRecord) -> dict[str, float]:
    est = auditing.one_run(scores, rec, confidence=0.95)
    return {
        "mu": est.mu_lower_bound,
        "eps_gdp": est.epsilon_at(DELTA),
        "eps_ed": est.eps_delta().epsilon_at(DELTA),
        "auc": est.attack_auc(),
        "beta": est.attack_beta_at(0.01),
    }


def bench(m: int, mu: float, reps: int) -> None:
    times = []
    for seed in range(reps):
        scores, rec = synthetic(m, mu, seed)
        t0 = time.perf_counter()
        out = full_audit(scores, rec)
        times.append(time.perf_counter() - t0)
    print(
        f"audit of {m} synthetic canaries (mu = {mu}): median {statistics.median(times):.3f} s, "
        f"max {max(times):.3f} s over {reps} seeds (target <= 2 s); last: mu >= {out['mu']:.3f}, "
        f"eps >= {out['eps_gdp']:.3f} (GDP view), eps >= {out['eps_ed']:.3f} ((eps, delta) view) at delta = {DELTA:g}"
    )


def table(mus: list[float], ms: list[int], seeds: int) -> None:
    print(f"\nbound vs number of canaries (median over {seeds} seeds, 95 % confidence, delta = {DELTA:g})")
    print(f"{'true mu':>8} {'true eps':>9} {'m':>7} {'mu >=':>7} {'eps >= (GDP)':>13} {'eps >= ((eps,delta))':>21} {'ceiling eps':>12}")
    for mu in mus:
        true_eps = _stats.gdp_epsilon(mu, DELTA)
        for m in ms:
            rows = []
            for seed in range(seeds):
                scores, rec = synthetic(m, mu, seed)
                est = auditing.one_run(scores, rec)
                rows.append((est.mu_lower_bound, est.epsilon_at(DELTA), est.eps_delta().epsilon_at(DELTA), est.ceiling().epsilon_at(DELTA)))
            med = np.median(np.array(rows), axis=0)
            print(f"{mu:8.2f} {true_eps:9.3f} {m:7d} {med[0]:7.3f} {med[1]:13.3f} {med[2]:21.3f} {med[3]:12.3f}")


def oracle(cases: list[tuple[float, int]], seed: int) -> None:
    try:
        from jax_privacy import auditing as ja
    except ImportError as err:
        print(f"\noracle skipped: jax_privacy does not import ({err})")
        return
    print(f"\nours vs JAX-Privacy {getattr(__import__('jax_privacy'), '__version__', '?')} (95 % confidence, delta = {DELTA:g}, seed {seed})")
    print("  per rule: JAX's Explicit(threshold) at our per-rule significance, on the rule our GDP search chose")
    print("  whole audit: JAX's default Bonferroni over its ROC-hull thresholds vs ours over fixed guess budgets")
    print(f"{'mu':>5} {'m':>6} | {'GDP ours':>9} {'JAX fdp@rule':>12} | {'GDP ours':>9} {'JAX fdp':>8} | {'(e,d) ours':>10} {'JAX':>7}")
    for mu, m in cases:
        scores, rec = synthetic(m, mu, seed)
        est = auditing.one_run(scores, rec)
        aud = ja.CanaryScoreAuditor(est.in_scores, est.out_scores)
        tau = (1 - est.confidence) / len(auditing.guess_counts(m))
        at_rule = aud.epsilon_one_run_fdp(tau, DELTA, threshold_strategy=ja.Explicit(est.threshold)) if est.threshold is not None else 0.0
        print(
            f"{mu:5.2f} {m:6d} | {est.epsilon_at(DELTA):9.4f} {at_rule:12.4f} | {est.epsilon_at(DELTA):9.4f} "
            f"{aud.epsilon_one_run_fdp(0.05, DELTA):8.4f} | {est.eps_delta().epsilon_at(DELTA):10.4f} {aud.epsilon_one_run(0.05, DELTA):7.4f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--canaries", type=int, default=10_000)
    p.add_argument("--mu", type=float, default=1.0, help="mu of the synthetic mechanism (default %(default)s)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--table", action="store_true", help="print the bound vs number of canaries")
    p.add_argument("--oracle", action="store_true", help="print our bounds next to JAX-Privacy's")
    a = p.parse_args()
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}")
    bench(a.canaries, a.mu, a.reps)
    if a.table:
        table([0.5, 1.0, 2.0], [100, 1_000, 10_000, 100_000], seeds=3)
    if a.oracle:
        oracle([(0.5, 1000), (1.0, 1000), (1.0, 10_000), (2.0, 10_000), (4.0, 2000)], seed=0)


if __name__ == "__main__":
    main()
