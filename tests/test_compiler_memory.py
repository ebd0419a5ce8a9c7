"""Peak-memory passes (``compiler/passes/memory.py``): same values, smaller working sets."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from _models import loop_reference, assert_trees_close
from opake_compile import compile_dp
from opake_compile.compiler.passes import memory
from opake_compile.compiler.passes.memory import split_grouped_weight_grads

aten = torch.ops.aten


def _grouped_weight_grad(go, x, w):
    return aten.convolution_backward.default(go, x, w, None, [2, 2], [3, 3], [1, 1], False, [0, 0], x.shape[1], [False, True, False])[1]


def _args(p: int = 64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, p, 28, 28, generator=g)
    go = torch.randn(1, p * 4, 14, 14, generator=g)
    w = torch.zeros(()).expand(p * 4, 1, 8, 8)  # as vmap passes it: only the shape matters
    return go, x, w


def test_split_is_bit_identical_and_bounds_the_scratch(monkeypatch):
    # 64 groups, unfold scratch 64 x 64 x 196 x 4 B = 3.1 MiB: split at a 1 MiB limit.
    monkeypatch.setattr(memory, "SCRATCH_BYTES", 2**20)
    args = _args()
    gm = make_fx(_grouped_weight_grad, tracing_mode="fake")(*args)
    want = gm(*args)
    report = split_grouped_weight_grads(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    assert report.modified
    calls = [n for n in gm.graph.nodes if n.target is aten.convolution_backward.default]
    assert len(calls) == 4  # 64 groups in chunks of 16: 16 x 49 KiB x ... <= 1 MiB
    assert all(memory._scratch_bytes(n) <= 2**20 for n in calls)
    assert torch.equal(gm(*args), want)


def test_small_or_ungrouped_calls_are_left_alone():
    args = _args(8)  # 0.4 MiB of scratch: under the limit
    gm = make_fx(_grouped_weight_grad, tracing_mode="fake")(*args)
    assert not split_grouped_weight_grads(gm).modified

    def plain(go, x, w):  # groups = 1: the non-private form, no per-group unfold
        return aten.convolution_backward.default(go, x, w, None, [1], [0], [1], False, [0], 1, [False, True, False])[1]

    g = torch.Generator().manual_seed(1)
    big = (torch.randn(64, 8, 1000, generator=g), torch.randn(64, 8, 1000, generator=g), torch.randn(8, 8, 1))
    assert not split_grouped_weight_grads(make_fx(plain, tracing_mode="fake")(*big)).modified


def test_compiled_cnn_with_a_split_conv_matches_the_oracle():
    # P = 96: the first conv's per-example weight gradient needs 96 x 64 x 196 x 4 B = 4.6 MiB
    # of unfold scratch, over the 4 MiB limit, so the DP graph carries the split form.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        model = nn.Sequential(nn.Conv2d(1, 4, 8, 2, padding=3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 14 * 14, 3))
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(96, 1, 28, 28, generator=g), torch.randint(0, 3, (96,), generator=g)
    loss = lambda m, x, y: F.cross_entropy(m(x), y)  # noqa: E731
    step = compile_dp(loss, model=model, clipping_norm=0.05, physical_batch_size=96, backend="aot_eager")
    got = step(x, y)
    assert any(r.name == "split_grouped_weight_grads" and r.modified for r in step._compiled_for((x, y)).reports)
    want, _ = loop_reference(model, loss, (x, y), 0.05)
    assert_trees_close(got.clipped.grads, want, torch.float32)
