#!/usr/bin/env python
"""The model zoo (``zoo.py``) under ``compile_dp``'s defaults, one table row per model.

For each model: the fast-path share (trainable elements whose per-example gradient is never
materialised, by element count), the first-call seconds of the DP step (trace, passes and
Inductor), and the DP step time over the fastest compiled non-private step of the same model
and batch (``torch.compile`` of ``torch.func.grad`` and of ``loss.backward()``), timed in ONE
process in rotating order, round after round, so every round sees the same machine load.
Eval mode (dropout would make the non-private and private steps do different work).

    python bench/bench_zoo.py                         # every model, bench sizes
    python bench/bench_zoo.py --size tiny --rounds 10 # the unit tests' sizes: a smoke test
    python bench/bench_zoo.py --models bert,gru --device cuda

Models needing a missing optional package (transformers, peft) are skipped with a note.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import opake_compile as opake  # noqa: E402
from zoo import ZOO, available, build, fast_path_share  # noqa: E402


def _sync(device: str):
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def run(name: str, ns: argparse.Namespace) -> dict:
    entry = ZOO[name]
    model, loss_fn, make_batch = build(name, ns.size)
    model.to(ns.device).eval()
    b = ns.batch or (3 if ns.size == "tiny" else entry.bench_batch)
    args = tuple(a.to(ns.device) for a in make_batch(b, torch.Generator().manual_seed(1)))
    sync = _sync(ns.device)
    trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}
    wrapped = _Loss(model, loss_fn)

    def _call(params: dict, *a):
        # The batch loss as a function of the trainable parameters (frozen ones stay constants).
        return torch.func.functional_call(wrapped, {f"m.{k}": v for k, v in params.items()}, a)

    params = {k: p.detach() for k, p in trainable.items()}
    cgrad = torch.compile(lambda p, *a: torch.func.grad(_call)(p, *a))
    closs = torch.compile(lambda *a: loss_fn(model, *a))

    def np_grad() -> None:
        with torch.no_grad():
            cgrad(params, *args)

    def np_backward() -> None:
        model.zero_grad(set_to_none=True)
        closs(*args).backward()

    dp = opake.compile_dp(loss_fn, model=model, clipping_norm=1.0, physical_batch_size=b, backend="inductor")
    t0 = time.perf_counter()
    out = dp(*args)
    sync()
    first = time.perf_counter() - t0
    steps = {"np_compiled_grad": np_grad, "np_compiled_backward": np_backward, "dp_default": lambda: dp(*args)}
    for k, fn in steps.items():
        for _ in range(1 + ns.warmup):
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - a non-private form that does not compile is reported
                print(f"  {name}: {k} failed ({type(err).__name__}: {str(err)[:120]})", flush=True)
                steps[k] = None
                break
        sync()
    steps = {k: v for k, v in steps.items() if v is not None}
    times: dict[str, list[float]] = {k: [] for k in steps}
    order = list(steps)
    for r in range(ns.rounds):
        for k in order[r % len(order):] + order[: r % len(order)]:
            t0 = time.perf_counter()
            steps[k]()
            sync()
            times[k].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    bases = [k for k in ("np_compiled_grad", "np_compiled_backward") if k in med]
    base = min(bases, key=lambda k: med[k])
    per_round = statistics.median([d / n for d, n in zip(times["dp_default"], times[base])])
    materialized = sorted({p for p in out.coverage.values() if p.startswith("materialized")})
    return {
        "model": name, "batch": b, "share": fast_path_share(model, dict(out.coverage)), "first_s": first,
        "dp_ms": med["dp_default"], "base_ms": med[base], "base": base, "ratio": med["dp_default"] / med[base],
        "round_ratio": per_round, "materialized": materialized,
    }


class _Loss(torch.nn.Module):
    def __init__(self, model, loss_fn) -> None:
        super().__init__()
        self.m = model
        self._loss_fn = loss_fn

    def forward(self, *a):
        return self._loss_fn(self.m, *a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all", help=f"comma list of {', '.join(ZOO)} or 'all'")
    ap.add_argument("--size", default="bench", choices=("tiny", "bench"))
    ap.add_argument("--batch", type=int, default=0, help="batch size (default: the entry's, 3 when tiny)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ns = ap.parse_args()
    warnings.filterwarnings("ignore")
    names = list(ZOO) if ns.models == "all" else ns.models.split(",")
    print(f"threads {torch.get_num_threads()}, device {ns.device}, size {ns.size}, torch {torch.__version__}")
    print("| model | B | fast-path share | first call s | DP ms | non-private ms (fastest) | DP / non-private (medians; per-round) | materialised |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        if not available(ZOO[name]):
            print(f"| {name} | skipped: needs {', '.join(ZOO[name].needs)} |")
            continue
        try:
            r = run(name, ns)
        except Exception as err:  # noqa: BLE001 - one model's failure is a row, not the end of the table
            print(f"| {name} | failed: {type(err).__name__}: {str(err)[:200]} |", flush=True)
            continue
        mats = "; ".join(r["materialized"]) or "-"
        print(
            f"| {name} | {r['batch']} | {100 * r['share']:.1f} % | {r['first_s']:.1f} | {r['dp_ms']:.2f} | "
            f"{r['base_ms']:.2f} ({r['base'][3:]}) | {r['ratio']:.2f}; {r['round_ratio']:.2f} | {mats} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
