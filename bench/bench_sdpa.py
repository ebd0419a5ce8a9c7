#!/usr/bin/env python
"""SDPA under compile_dp: graph size, compile seconds and step time against the batch size P.

Model: ``nn.TransformerEncoder`` with 2 ``nn.TransformerEncoderLayer`` (d=128, 4 heads, MLP 512,
``batch_first``, dropout 0 so CPU attention takes the fused SDPA kernel), mean-pool, a 10-class
head; input (P, T=64, 128) float features, mean cross-entropy; physical batch = batch = P.

For every P, in a fresh process (so each first compile pays the same one-off costs):

- ``attn nodes`` / ``nodes``: attention ops and all nodes in the traced per-example gradient
  graph (``trace_per_example_grads``). A per-example loop shows as attention nodes growing
  with P; one batched form as a count independent of P (2 layers: 2 forward + 2 backward).
- ``trace s``: that trace alone; ``compile s``: the first ``compile_dp`` call (Inductor), which
  traces again, runs the passes and compiles.
- ``np ms`` / ``dp ms``: medians of the compiled non-private step (``torch.compile`` of
  ``torch.func.grad``) and the DP step, called alternately round after round in one process;
  ``dp/np``: the median of the per-round ratios.

``--paired`` measures the change in one process per P instead: the DP step traced with the
batching rules switched off (the per-example loop, as before they existed) and with them on,
beside the non-private step, timed in rotating order so that all three see the same load::

    PYTHONPATH=. python bench/bench_sdpa.py --paired --sizes 8,32,56 --rounds 10

To compare two versions of the library, run the script with each on ``PYTHONPATH``::

    PYTHONPATH=. python bench/bench_sdpa.py --sizes 8,32,56 --rounds 10
    git worktree add --detach ../opake-old <commit>
    PYTHONPATH=../opake-old python bench/bench_sdpa.py --sizes 8,32,56 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

D, HEADS, FF, T, LAYERS, CLASSES = 128, 4, 512, 64, 2, 10


def _build(p: int, device: str) -> tuple[Any, Any, tuple]:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(D, HEADS, FF, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = nn.Linear(D, CLASSES)

        def forward(self, x: Any) -> Any:
            return self.head(self.enc(x).mean(1))

    def loss_fn(model: Any, x: Any, y: Any) -> Any:
        return F.cross_entropy(model(x), y)

    g = torch.Generator().manual_seed(1)
    args = (torch.randn(p, T, D, generator=g).to(device), torch.randint(0, CLASSES, (p,), generator=g).to(device))
    return Classifier().to(device), loss_fn, args


def one(p: int, rounds: int, device: str) -> dict[str, Any]:
    import torch

    import opake_compile as opake
    from opake_compile.compiler.trace import trace_per_example_grads

    model, loss_fn, args = _build(p, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t0 = time.perf_counter()
    traced = trace_per_example_grads(model, loss_fn, args, batched_positions=(0, 1), physical_batch_size=p)
    trace_s = time.perf_counter() - t0
    nodes = list(traced.gm.graph.nodes)
    attn = sum(1 for n in nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target))

    dp = opake.compile_dp(loss_fn, model=model, clipping_norm=1.0, physical_batch_size=p, backend="inductor")
    t0 = time.perf_counter()
    dp(*args)
    sync()
    compile_s = time.perf_counter() - t0

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of(prm: dict, x: Any, y: Any) -> Any:
        return torch.nn.functional.cross_entropy(torch.func.functional_call(model, prm, (x,)), y)

    cgrad = torch.compile(lambda prm, *a: torch.func.grad(loss_of)(prm, *a))
    with torch.no_grad():
        cgrad(params, *args)

    def np_step() -> None:
        with torch.no_grad():
            cgrad(params, *args)

    def dp_step() -> None:
        dp(*args)

    for _ in range(2):
        np_step(), dp_step()
    np_t, dp_t, ratios = [], [], []
    for r in range(rounds):
        times = {}
        for name, fn in ((("np", np_step), ("dp", dp_step)) if r % 2 == 0 else (("dp", dp_step), ("np", np_step))):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name] = time.perf_counter() - t0
        np_t.append(times["np"])
        dp_t.append(times["dp"])
        ratios.append(times["dp"] / times["np"])
    return {
        "P": p, "attn_nodes": attn, "nodes": len(nodes), "trace_s": trace_s, "compile_s": compile_s,
        "np_ms": 1e3 * statistics.median(np_t), "dp_ms": 1e3 * statistics.median(dp_t),
        "dp_np": statistics.median(ratios),
    }


def paired(p: int, rounds: int, device: str) -> dict[str, Any]:
    """Loop (no batching rules: the per-example fallback, as before they existed) and batched
    DP steps and the non-private step in ONE process: compile each, then time them in rotating
    order, so all three see the same load."""
    import contextlib

    import torch

    import opake_compile as opake
    import opake_compile.compiler.trace as trace_mod

    model, loss_fn, args = _build(p, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_of(prm: dict, x: Any, y: Any) -> Any:
        return torch.nn.functional.cross_entropy(torch.func.functional_call(model, prm, (x,)), y)

    cgrad = torch.compile(lambda prm, *a: torch.func.grad(loss_of)(prm, *a))
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    with torch.no_grad():
        cgrad(params, *args)  # also pays the process's one-off compile costs
    times["np"] = time.perf_counter() - t0
    steps = {}
    for name in ("loop", "batched"):
        step = opake.compile_dp(loss_fn, model=model, clipping_norm=1.0, physical_batch_size=p, backend="inductor")
        saved = trace_mod.batched_attention
        if name == "loop":
            trace_mod.batched_attention = contextlib.nullcontext
        try:
            t0 = time.perf_counter()
            step(*args)
            sync()
            times[name] = time.perf_counter() - t0
        finally:
            trace_mod.batched_attention = saved
        steps[name] = step

    def np_step() -> None:
        with torch.no_grad():
            cgrad(params, *args)

    fns = {"np": np_step, "loop": lambda: steps["loop"](*args), "batched": lambda: steps["batched"](*args)}
    for fn in fns.values():
        fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    order = list(fns)
    for r in range(rounds):
        for name in order[r % 3 :] + order[: r % 3]:
            sync()
            t0 = time.perf_counter()
            fns[name]()
            sync()
            samples[name].append(time.perf_counter() - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(samples[a], samples[b]))  # noqa: E731
    return {
        "P": p, "compile_np_s": times["np"], "compile_loop_s": times["loop"], "compile_batched_s": times["batched"],
        "np_ms": med["np"], "loop_ms": med["loop"], "batched_ms": med["batched"],
        "loop_np": ratio("loop", "np"), "batched_np": ratio("batched", "np"), "batched_loop": ratio("batched", "loop"),
    }


def _run_one(p: int, ns: argparse.Namespace, *flags: str) -> dict | None:
    """This script's ``--one P`` mode in a fresh process (its own Dynamo and Inductor state); its
    JSON result, or ``None`` after printing a failed table row."""
    cmd = [sys.executable, os.path.abspath(__file__), *flags, "--one", str(p), "--rounds", str(ns.rounds), "--device", ns.device]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        print(f"| {p} | failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode} |")
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="8,32,56", help="comma list of P (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per P (default %(default)s)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--paired", action="store_true",
                    help="per P, one process: the loop (rules off) and batched DP steps and the non-private step, interleaved")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.one is not None:
        print(json.dumps((paired if ns.paired else one)(ns.one, ns.rounds, ns.device)))
        return
    if ns.paired:
        print("| P | compile s: np / loop / batched | ms: np / loop / batched | loop/np | batched/np | batched/loop |")
        print("|---|---|---|---|---|---|")
        for p in (int(s) for s in ns.sizes.split(",")):
            r = _run_one(p, ns, "--paired")
            if r is None:
                continue
            print(
                f"| {p} | {r['compile_np_s']:.0f} / {r['compile_loop_s']:.0f} / {r['compile_batched_s']:.0f} "
                f"| {r['np_ms']:.0f} / {r['loop_ms']:.0f} / {r['batched_ms']:.0f} | {r['loop_np']:.2f} "
                f"| {r['batched_np']:.2f} | {r['batched_loop']:.2f} |",
                flush=True,
            )
        return
    import opake_compile

    print(f"# library: {os.path.dirname(os.path.dirname(os.path.abspath(opake_compile.__file__)))!s}")
    print("| P | attn nodes | nodes | trace s | compile s | np ms | dp ms | dp/np |")
    print("|---|---|---|---|---|---|---|---|")
    for p in (int(s) for s in ns.sizes.split(",")):
        r = _run_one(p, ns)
        if r is None:
            continue
        print(
            f"| {p} | {r['attn_nodes']} | {r['nodes']} | {r['trace_s']:.1f} | {r['compile_s']:.1f} "
            f"| {r['np_ms']:.1f} | {r['dp_ms']:.1f} | {r['dp_np']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
