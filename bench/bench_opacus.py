#!/usr/bin/env python
"""Step time of the Opacus-style digits script: Opacus 1.6 (hooks, ghost) against
``opake_compile.opacus`` (hooks, ghost), paired in one process.

The model, data and loop are those of ``tests/_opacus_digits_script.py`` (the CNN on the
sklearn digits, Poisson batches of expected size 64, C = 1, sigma = 1). Each setup is made
private by its own library; then, round after round, every setup runs ``--steps`` training
steps (``optimizer.zero_grad(); loss = criterion(model(x), y); loss.backward();
optimizer.step()``) on its own Poisson batches, in rotating order, so that every round sees
the same machine load. Printed: the median step time per setup, its ratio to Opacus hooks
(ratio of medians and median of per-round ratios), and for opake_compile the share of the
step spent in the eager forward pass without autograd that makes ``loss.item()`` before
``.backward()`` possible.

    python bench/bench_opacus.py --rounds 20 --steps 5 [--backend inductor|aot_eager]

Needs opacus and scikit-learn (``pip install -e ".[bench,examples]"``). Compile time is not
part of the step times (a warm-up round runs first).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
import warnings
from typing import Any


def _script() -> Any:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "_opacus_digits_script.py")
    spec = importlib.util.spec_from_file_location("_opacus_digits_script", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _setup(lib: str, mode: str, script: Any, backend: str, seed: int) -> dict[str, Any]:
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader

    if lib == "opacus":
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator

        engine = PrivacyEngine()
    else:
        import opake_compile as opake
        from opake_compile.opacus import ModuleValidator, PrivacyEngine

        engine = PrivacyEngine(backend=backend)
    torch.manual_seed(seed)
    train_set, _ = script.load_data()
    model = ModuleValidator.fix(script.Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    extra = {"key": opake.random.key(seed)} if lib == "opake" else {}
    out = engine.make_private(
        module=model, optimizer=optimizer, criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(train_set, batch_size=64),
        noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode, **extra,
    )
    if mode == "ghost":
        model, optimizer, criterion, loader = out
    else:
        (model, optimizer, loader), criterion = out, nn.CrossEntropyLoss()
    return {"name": f"{lib}_{mode}", "model": model, "optimizer": optimizer, "criterion": criterion, "loader": loader, "it": iter(loader), "lib": lib}


def _batch(s: dict[str, Any]) -> Any:
    try:
        return next(s["it"])
    except StopIteration:
        s["it"] = iter(s["loader"])
        return next(s["it"])


def _steps(s: dict[str, Any], k: int) -> tuple[float, float]:
    """(seconds per step, seconds per step in the model's forward call)."""
    import torch

    total = fwd = 0.0
    for _ in range(k):
        x, y = _batch(s)
        t0 = time.perf_counter()
        s["optimizer"].zero_grad()
        out = s["model"](x)
        t1 = time.perf_counter()
        loss = s["criterion"](out, y)
        loss.item()
        loss.backward()
        s["optimizer"].step()
        t2 = time.perf_counter()
        total += t2 - t0
        fwd += t1 - t0
    return total / k, fwd / k


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--threads", type=int, default=None)
    ns = p.parse_args(argv)
    import torch

    if ns.threads:
        torch.set_num_threads(ns.threads)
    warnings.filterwarnings("ignore")
    script = _script()
    setups = [_setup(lib, mode, script, ns.backend, seed=0) for lib in ("opacus", "opake") for mode in ("hooks", "ghost")]
    t = time.perf_counter()
    for s in setups:  # warm-up: compiles
        t0 = time.perf_counter()
        _steps(s, 2)
        print(f"warm-up {s['name']}: {time.perf_counter() - t0:.1f} s (compile included)")
    times: dict[str, list[float]] = {s["name"]: [] for s in setups}
    fwds: dict[str, list[float]] = {s["name"]: [] for s in setups}
    for r in range(ns.rounds):
        order = setups[r % len(setups) :] + setups[: r % len(setups)]
        for s in order:
            step, fwd = _steps(s, ns.steps)
            times[s["name"]].append(step)
            fwds[s["name"]].append(fwd)
    base = "opacus_hooks"
    print(f"\nstep time, {ns.rounds} rounds x {ns.steps} steps, torch threads {torch.get_num_threads()}, backend {ns.backend}")
    print(f"{'setup':<14} {'median ms':>10} {'/opacus_hooks':>14} {'median of ratios':>17} {'forward ms (share)':>20}")
    for name, ts in times.items():
        med = statistics.median(ts)
        ratio = med / statistics.median(times[base])
        per_round = statistics.median(a / b for a, b in zip(ts, times[base]))
        f = statistics.median(fwds[name])
        print(f"{name:<14} {1e3 * med:>10.2f} {ratio:>14.2f} {per_round:>17.2f} {1e3 * f:>11.2f} ({f / med:5.1%})")
    print(f"total {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
