"""Is materialising a convolution's per-example gradient really faster where the cost model
says so? Paired per-layer timings for the conv layers of a GroupNorm ResNet-18 (CIFAR stem).

For every distinct conv layer shape of the network (input size, channels, stride), a one-layer
step ``sum(conv(x) * v)`` is built twice in one process: the weight forced onto the Gram form
(``GhostClipping(force={"weight": "ghost"})``) and forced onto the materialised path
(``force={"weight": "materialized"}``). The table prints the cost model's two numbers, its
choice, and the measured median step times (interleaved runs) and their ratio. The FX graph
runs unlowered (``backend=None``): the time is in the matrix products and the convolution
backward, which every backend hands to the same library kernels.

Run from a clone's root::

    PYTHONPATH=. python bench/bench_fastpath.py [--width 16] [--size 32] [--batch 16] [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from opake_compile import compile_dp
from opake_compile.compiler.passes.rewrites import GhostClipping


def layer_shapes(width: int, size: int) -> list[tuple[int, int, int, int, int]]:
    """(C_in, C_out, kernel, stride, input size) of every distinct conv of a CIFAR ResNet-18."""
    shapes = [(3, width, 3, 1, size)]
    cin, s = width, size
    for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        stride = 1 if i == 0 else 2
        shapes.append((cin, cout, 3, stride, s))
        if stride != 1 or cin != cout:
            shapes.append((cin, cout, 1, stride, s))
        s //= stride
        shapes.append((cout, cout, 3, 1, s))
        cin = cout
    return list(dict.fromkeys(shapes))


def _loss(m: nn.Module, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return (m(x) * v).sum()


def _time(step, args, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step(*args)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"GroupNorm ResNet-18 conv layers, width {a.width}, input {a.size}x{a.size}, P = {a.batch}, "
          f"{torch.get_num_threads()} threads; medians of {a.reps} interleaved runs")
    print("| C_in | C_out | k | stride | in | cost model: Gram / per-example | choice | ghost ms | materialised ms | ghost / materialised |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for cin, cout, k, stride, s in layer_shapes(a.width, a.size):
        conv = nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
        x = torch.randn(a.batch, cin, s, s, generator=g)
        out = conv(x)
        v = torch.randn(out.shape, generator=g)
        steps = {}
        for path in ("ghost", "materialized"):
            steps[path] = compile_dp(_loss, model=conv, clipping_norm=1.0, physical_batch_size=a.batch, backend=None,
                                     rewrites=[GhostClipping(force={"weight": path})])
            steps[path](x, v)  # trace
        auto = compile_dp(_loss, model=conv, clipping_norm=1.0, physical_batch_size=a.batch, backend=None)
        auto(x, v)
        label = auto.coverage["weight"]
        l_pos = out.shape[2] * out.shape[3]
        r, c = cout, cin * k * k
        gram, direct = a.batch * l_pos * l_pos * (r + c), a.batch * r * c * (l_pos + 2)
        times = {p: [] for p in steps}
        for _ in range(a.reps):  # interleaved, so that load changes hit both alike
            for p, st in steps.items():
                times[p] += _time(st, (x, v), 1)
        tg, tm = (statistics.median(times[p]) * 1e3 for p in ("ghost", "materialized"))
        choice = "ghost" if label.startswith("ghost") else "materialised"
        print(f"| {cin} | {cout} | {k} | {stride} | {s} | {gram:.3g} / {direct:.3g} | {choice} | {tg:.2f} | {tm:.2f} | {tg / tm:.2f} |")


if __name__ == "__main__":
    main()
