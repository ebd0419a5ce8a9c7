#!/usr/bin/env python
"""Interleaved timing: the DP steps and the compiled non-private steps in ONE process.

``bench_step.py`` runs every configuration in its own process, one after the other, which
isolates memory figures and compile times but lets machine load drift between rows: on a
shared 2-core machine the same row can move by 30 % from one minute to the next. Here the
three steps of a model are built in one process and called in rotating order, round after
round, so every round sees the same load; the ratio of medians and the median of per-round
ratios are what the speed targets are judged on. Rows: np_compiled_grad, np_compiled_backward,
dp_default (compile_dp's defaults: physical sizes are buckets anchored at the first batch),
dp_p_eq_b (physical_batch_size = B: one graph) and dp_fused (GhostClipping(bookkeeping="fused"),
P = B).

``--poisson K`` adds a second table: the same DP step at default settings and the non-private
step, each called on K Poisson-sampled batch sizes in turn (the non-private step is a
``torch.compile`` with dynamic shapes, warmed on every size); the ratio is the realised cost of
a Poisson batch against the fastest non-private step on that same batch. ``dp_exact`` is the DP
step compiled for exactly b rows (``physical_batch_size=b``, one graph per size, no padding) on
each batch of b rows: ``dp_default / dp_exact`` is what the default sizing costs over P = b.
It is split in two: ``dp_bucket_full`` runs each batch's bucket graph(s) on a full batch of the
bucket's size (the compute of the padded rows, no copy and no mask), so ``dp_bucket_full /
dp_exact`` is the cost of computing at the bucket size and ``dp_default / dp_bucket_full`` that
of padding a short batch around the same graphs.

    python bench/bench_paired.py --models mlp,transformer --rounds 40 --poisson 6
    python bench/bench_paired.py --models mlp,encoder --rounds 15 --poisson 6 --threads 1

``--threads 1`` times CPU seconds of this process (``time.process_time``) on one thread: on a
machine shared with other jobs that counts the work each step does and not the time it waits
for a core, which wall time on several threads does not (default: wall time, torch's threads).
CPU seconds include the kernel's: the page faults of memory glibc handed back and the step maps
in again. ``--allocator retain`` keeps freed memory in the process (``bench_step.set_allocator``);
the last column counts minor page faults per step either way.

Models and batches are those of bench_step.py (same builders, same seeds). Memory is not
measured here (see bench_step.py's peak-memory columns).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def _clock(ns: argparse.Namespace) -> Any:
    """CPU time of this process on one thread (``--threads 1``), else wall time."""
    return time.process_time if ns.threads == 1 else time.perf_counter


def run_model(bs: Any, name: str, ns: argparse.Namespace) -> dict[str, Any]:
    import torch

    import opake_compile as opake

    spec, args = bs.build(name, ns.quick, ns.device)
    sync, clock = bs._sync(ns.device), _clock(ns)
    model = spec.model
    loss = bs._param_loss(spec)
    params = {k: p.detach() for k, p in bs._trainable(model).items()}
    cgrad = torch.compile(lambda p, *a: torch.func.grad(loss)(p, *a))
    closs = torch.compile(lambda *a: spec.loss_fn(model, *a))
    from opake_compile.compiler.passes.rewrites import GhostClipping

    kw = dict(model=model, clipping_norm=ns.clip, backend="inductor")
    dp = opake.compile_dp(spec.loss_fn, **kw)  # the defaults a user gets
    dp_pb = opake.compile_dp(spec.loss_fn, physical_batch_size=spec.batch_size, **kw)
    dp_fused = opake.compile_dp(
        spec.loss_fn, rewrites=[GhostClipping(bookkeeping="fused")], physical_batch_size=spec.batch_size, **kw
    )

    def np_grad() -> None:
        with torch.no_grad():
            cgrad(params, *args)

    def np_backward() -> None:
        model.zero_grad(set_to_none=True)
        closs(*args).backward()

    def dp_step() -> None:
        dp(*args)

    def dp_pb_step() -> None:
        dp_pb(*args)

    def dp_fused_step() -> None:
        dp_fused(*args)

    steps = {
        "np_compiled_grad": np_grad, "np_compiled_backward": np_backward,
        "dp_default": dp_step, "dp_p_eq_b": dp_pb_step, "dp_fused": dp_fused_step,
    }
    dp_rows = ("dp_default", "dp_p_eq_b", "dp_fused")
    for fn in steps.values():  # compile, then warm up
        for _ in range(1 + ns.warmup):
            fn()
        sync()
    times: dict[str, list[float]] = {k: [] for k in steps}
    faults = dict.fromkeys(steps, 0)
    order = list(steps)
    for r in range(ns.rounds):
        rot = order[r % len(order):] + order[: r % len(order)]
        for k in rot:
            f0, t0 = bs.minor_faults(), clock()
            steps[k]()
            sync()
            times[k].append((clock() - t0) * 1e3)
            faults[k] += bs.minor_faults() - f0
    med = {k: statistics.median(v) for k, v in times.items()}
    base = min((k for k in ("np_compiled_grad", "np_compiled_backward") if k in med), key=lambda k: med[k])
    ratios = {k: med[k] / med[base] for k in dp_rows}
    rounds = {k: statistics.median([d / b for d, b in zip(times[k], times[base])]) for k in dp_rows}
    out = {
        "model": name, "description": spec.description, "median_ms": med, "min_ms": {k: min(v) for k, v in times.items()},
        "baseline": base, "ratio_of_medians": ratios, "median_round_ratio": rounds, "coverage": dict(dp.coverage),
        "faults_per_step": {k: v / ns.rounds for k, v in faults.items()},
    }
    if ns.poisson:
        out["poisson"] = run_poisson(bs, spec, dp, loss, model, ns)
    return out


def run_poisson(bs: Any, spec: Any, dp: Any, loss: Any, model: Any, ns: argparse.Namespace) -> dict[str, Any]:
    """dp (default settings, already anchored at B) against the fastest compiled non-private step
    on the same Poisson-size batches, paired per batch, rotating the order."""
    import torch

    import opake_compile as opake

    sync, clock = bs._sync(ns.device), _clock(ns)
    g = torch.Generator().manual_seed(4)
    sizes = bs.poisson_sizes(spec.batch_size)[: ns.poisson]
    batches = [tuple(a.to(ns.device) for a in spec.make_batch(n, g)) for n in sizes]
    params = {k: p.detach() for k, p in bs._trainable(model).items()}
    cgrad = torch.compile(lambda p, *a: torch.func.grad(loss)(p, *a), dynamic=True)
    closs = torch.compile(lambda *a: spec.loss_fn(model, *a), dynamic=True)

    def np_grad(b: tuple) -> None:
        with torch.no_grad():
            cgrad(params, *b)

    def np_backward(b: tuple) -> None:
        model.zero_grad(set_to_none=True)
        closs(*b).backward()

    # The reference for "cost tracks the realised batch size": a step compiled for exactly b
    # rows (physical_batch_size=b, no padding) for every size b, called on its own batch.
    exact = {n: opake.compile_dp(spec.loss_fn, model=model, clipping_norm=ns.clip, backend="inductor", physical_batch_size=n) for n in set(sizes) if n}

    def dp_exact(b: tuple) -> None:
        if len(b[0]):
            exact[len(b[0])](*b)

    # dp_default / dp_exact splits in two: the compute of the padded rows (a bucket's graph on a
    # full batch of its size, no copy, no mask: dp_bucket_full / dp_exact) and what padding a
    # short batch adds around the same graphs (the copies and masks: dp_default / dp_bucket_full).
    plans = {n: dp.plan(n) for n in sizes if n}
    for chunks in plans.values():
        for _, p in chunks:
            exact.setdefault(p, opake.compile_dp(spec.loss_fn, model=model, clipping_norm=ns.clip, backend="inductor", physical_batch_size=p))
    full = {p: tuple(a.to(ns.device) for a in spec.make_batch(p, g)) for p in {p for c in plans.values() for _, p in c}}

    def dp_bucket_full(b: tuple) -> None:
        for _, p in plans.get(len(b[0]), ()):
            exact[p](*full[p])

    steps = {"np_compiled_grad": np_grad, "np_compiled_backward": np_backward, "dp_default": dp, "dp_exact": dp_exact,
             "dp_bucket_full": dp_bucket_full}
    failed: dict[str, str] = {}
    for k, fn in list(steps.items()):
        try:
            for b in batches:
                for _ in range(2):
                    fn(*b) if fn is dp else fn(b)
        except Exception as e:  # a baseline torch cannot compile (dynamic shapes) leaves the pair
            if not k.startswith("np_"):
                raise
            failed[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            del steps[k]
        sync()
    if not any(k.startswith("np_") for k in steps):
        raise RuntimeError(f"no non-private baseline compiled on the Poisson sizes: {failed}")
    per: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps)
    for r in range(ns.rounds):
        rot = order[r % len(order):] + order[: r % len(order)]
        for k in rot:
            t0 = clock()
            for b in batches:
                steps[k](*b) if k == "dp_default" else steps[k](b)
            sync()
            per[k].append((clock() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in per.items()}
    base = min((k for k in ("np_compiled_grad", "np_compiled_backward") if k in med), key=lambda k: med[k])
    padded = sum(p - m for n in sizes for m, p in dp.plan(n))
    return {
        "sizes": sizes, "median_ms": med, "baseline": base, "ratio": med["dp_default"] / med[base],
        "round_ratio": statistics.median([d / b for d, b in zip(per["dp_default"], per[base])]),
        "vs_exact": med["dp_default"] / med["dp_exact"],
        "vs_exact_round": statistics.median([d / e for d, e in zip(per["dp_default"], per["dp_exact"])]),
        "bucket_vs_exact": med["dp_bucket_full"] / med["dp_exact"], "default_vs_bucket": med["dp_default"] / med["dp_bucket_full"],
        "padded_rows": padded, "rows": sum(sizes), "physical_sizes": dp.physical_sizes,
        "compiles": dp.num_backend_compiles, "baseline_failed": failed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="mlp,cnn,transformer", help="comma list (bench_step.py's model names)")
    p.add_argument("--rounds", type=int, default=40, help="rounds of the three steps (default %(default)s)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--clip", type=float, default=1.0, help="clipping norm C (timing does not depend on it)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    p.add_argument("--poisson", type=int, default=0, help="also time K Poisson batch sizes at default settings")
    p.add_argument("--allocator", default="system", help="system (glibc as is) or retain (keep freed memory: "
                   "no page faults from re-mapping each step; see bench_step.set_allocator)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads (0: torch's default); 1 also times CPU seconds instead of wall time")
    ns = p.parse_args()
    import bench_step as bs  # a sibling script: `python bench/<this>.py` puts bench/ on sys.path
    import torch

    allocator = bs.set_allocator(ns.allocator, ns.device)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.threads == 1 and ns.device != "cpu":
        p.error("--threads 1 times CPU seconds: use it on the CPU only")
    print(f"# bench_paired torch={torch.__version__} threads={torch.get_num_threads()} "
          f"clock={'cpu' if ns.threads == 1 else 'wall'} rounds={ns.rounds} "
          f"device={ns.device} allocator={allocator} loadavg={os.getloadavg()}", flush=True)
    print("| model | np_compiled_grad ms | np_compiled_backward ms | dp_default ms | dp_p_eq_b ms | dp_fused ms "
          "| dp_default / fastest np (medians; per round) | dp_p_eq_b / fastest np | dp_fused / fastest np "
          "| minor page faults / step (fastest np; dp_p_eq_b) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    poisson = []
    for name in [m for m in ns.models.split(",") if m]:
        r = run_model(bs, name, ns)
        m, q, pr = r["median_ms"], r["ratio_of_medians"], r["median_round_ratio"]
        cells = " | ".join(f"{q[k]:.3f}; {pr[k]:.3f}" for k in ("dp_default", "dp_p_eq_b", "dp_fused"))
        pf = r["faults_per_step"]
        print(f"| {name} | {m['np_compiled_grad']:.2f} | {m['np_compiled_backward']:.2f} | {m['dp_default']:.2f} | "
              f"{m['dp_p_eq_b']:.2f} | {m['dp_fused']:.2f} | {cells} | {pf[r['baseline']]:.0f}; {pf['dp_p_eq_b']:.0f} |",
              flush=True)
        if "poisson" in r:
            poisson.append((name, r["poisson"]))
    if poisson:
        print("\n| model | Poisson sizes | padded rows / rows | physical sizes (compiles) | dp_default ms | dp_exact ms "
              "| fastest np ms | dp_default / dp_exact (medians; per round) | = dp_bucket_full / dp_exact × dp_default / dp_bucket_full "
              "| dp_default / fastest np (medians; per round) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name, r in poisson:
            m = r["median_ms"]
            print(f"| {name} | {r['sizes']} | {r['padded_rows']} / {r['rows']} | {list(r['physical_sizes'])} "
                  f"({r['compiles']}) | {m['dp_default']:.2f} | {m['dp_exact']:.2f} | {m[r['baseline']]:.2f} | "
                  f"{r['vs_exact']:.3f}; {r['vs_exact_round']:.3f} | {r['bucket_vs_exact']:.3f} × {r['default_vs_bucket']:.3f} "
                  f"| {r['ratio']:.3f}; {r['round_ratio']:.3f} |", flush=True)
        for name, r in poisson:
            for k, why in r["baseline_failed"].items():
                print(f"# {name}: {k} did not compile on the Poisson sizes, left out of the baseline: {why}")
    print(f"# loadavg end {os.getloadavg()}")


if __name__ == "__main__":
    main()
