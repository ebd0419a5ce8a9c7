"""The direct-sum memory budget (GhostClipping's materialize_budget), counted in peak bytes
with the CPU profiler (no timing). A review found that layers freeing more than they hold
funded a wide layer whose G then held 13x the budget under ``aot_eager``: what a layer frees is
no longer credited to another (``rewrites._choose_direct``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from opake_compile import compile_dp
from opake_compile.compiler.passes.rewrites import GhostClipping

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_step  # noqa: E402  (the benches' peak-bytes counter)
from _models import TiedHead, next_token_loss  # noqa: E402


def _peak_bytes(fn) -> float:
    return bench_step.peak_step_bytes(fn, "cpu")[0]


class _Net(nn.Module):
    # Eight narrow layers over long positions free memory (K (R + C) >= R C); the last, wide
    # one (R C > K (R + C)) holds more than it frees and was admitted on their credit.
    def __init__(self) -> None:
        super().__init__()
        self.ups = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(8))
        self.up = nn.Linear(64, 2048, bias=False)
        self.mid = nn.Linear(2048, 2048, bias=False)

    def forward(self, x):
        for u in self.ups:
            x = torch.tanh(u(x))
        return self.mid(torch.tanh(self.up(x)))


def test_direct_sum_extra_peak_stays_near_its_budget_under_aot_eager():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _Net()
        x = torch.randn(2, 512, 64)

    def loss(m, x):
        return m(x).square().mean(dim=(1, 2)).sum()

    peaks, budget = {}, None
    for tag, rw in (("default", [GhostClipping()]), ("none", [GhostClipping(materialize_budget=None)])):
        step = compile_dp(loss, model=model, clipping_norm=1e-3, physical_batch_size=2, backend="aot_eager", rewrites=rw)
        step(x)
        peaks[tag] = _peak_bytes(lambda: step(x))
        if tag == "default":
            assert step.coverage["up.weight"].startswith("direct:")  # the free layers go direct
            assert not step.coverage["mid.weight"].startswith("direct:")  # not funded by them
            budget = float(re.findall(r"of a ([\d.]+) MiB budget", step.describe())[0]) * 2**20
    # The budget is the most the direct sums may add; allow 50 % for allocator noise.
    assert peaks["default"] - peaks["none"] <= 1.5 * budget, (peaks, budget)


@pytest.mark.inductor
def test_a_tied_lm_heads_mixed_norm_holds_one_per_example_gradient_buffer():
    # The mixed path forms the tied matrix's per-example gradient (P x V x d) for its norm.
    # Its embedding term is scatter-added into the head's product: one such buffer alive.
    # Formed apart and then added, the two terms and their sum were alive together (a GPT-2
    # shape at T = 512, P = 8: 1084 MB peak against 892 MB, the non-private step's 749 MB).
    vocab, d, t, p = 4096, 64, 48, 8
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = TiedHead(vocab, d)
        ids = torch.randint(0, vocab, (p, t))

    peaks, results = {}, {}
    for path in ("mixed", "ghost"):
        rw = [GhostClipping(force={"tok.weight": path}, materialize_budget=None)]
        step = compile_dp(next_token_loss, model=model, clipping_norm=1.0, physical_batch_size=p, rewrites=rw)
        results[path] = step(ids)
        if path == "mixed":
            assert "norm materialized" in step.coverage["tok.weight"], step.coverage
        peaks[path] = _peak_bytes(lambda: step(ids))
    one = p * vocab * d * 4  # one float32 (P, V, d) buffer
    assert peaks["mixed"] - peaks["ghost"] <= 1.5 * one, (peaks, one)
    # The same norms up to each form's rounding bound, and sums that agree.
    torch.testing.assert_close(results["mixed"].clipped.per_example_norms, results["ghost"].clipped.per_example_norms, rtol=1e-4, atol=0)
    torch.testing.assert_close(results["mixed"].clipped.grads["tok.weight"], results["ghost"].clipped.grads["tok.weight"], rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------------ when the sums are allocated
# Two ways Inductor held float64 sums longer than needed (measured on bench_shapes.py's Llama
# block: 342 MB at the peak, 268 MB with both fixed, the non-private step 252 MB):
# - every clipped sum of a per-example gradient formed in full reads the clip factor, and
#   Inductor fused all of them with the factor's kernel into one, whose outputs were allocated
#   while every per-example gradient was still alive (``_kernels.fence`` keeps them apart);
# - an embedding table's sum was zero-filled in the step's first kernel and held throughout
#   (``_kernels.scatter_rows`` allocates it when its rows are ready).


class _LlamaLike(nn.Module):
    # Token table, a gated MLP and an untied head: at T = 256 the MLP and head are summed
    # directly (as in the Llama row), the table by a scatter of its rows.
    def __init__(self, vocab: int, d: int, hidden: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids)
        x = x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        return self.head(x)


def _post_pass_graph(step):
    return list(step._cache.values())[-1].traced.gm.graph


def test_large_direct_sums_read_their_own_fence_and_the_table_sum_is_one_scatter():
    from opake_compile.compiler._graph_utils import nodes_with_role
    from opake_compile.compiler.passes import _kernels, clip

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _LlamaLike(512, 64, 128)
        ids = torch.randint(0, 512, (4, 256))
    step = compile_dp(next_token_loss, model=model, clipping_norm=1.0, physical_batch_size=4, backend=None,
                      rewrites=[GhostClipping(materialize_budget=2.0)])
    step(ids)
    graph = _post_pass_graph(step)
    sums = nodes_with_role(graph, "clipped_sum")
    direct = [k for k, v in step.coverage.items() if v.startswith("direct:")]
    assert {"gate.weight", "up.weight", "down.weight", "head.weight"} <= set(direct), step.coverage

    def upstream(node):
        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            todo.extend(a for a in n.all_input_nodes)
        return seen

    for name in direct:
        fences = [n for n in upstream(sums[name]) if n.target is _kernels.FENCE]
        big = 4 * model.get_parameter(name).numel() >= clip.FENCED_ENTRIES
        assert len(fences) == (1 if big else 0), (name, fences)
    # One fence per large sum, none shared (a shared one would let the backend fuse the sums again).
    assert sum(n.target is _kernels.FENCE for n in graph.nodes) == sum(
        4 * model.get_parameter(k).numel() >= clip.FENCED_ENTRIES for k in direct)
    # The table's sum is a scatter of its weighted rows; the graph's only other scatters are
    # the model's own backward (float32, of the batch's rows), never a float64 table.
    assert any(n.target is _kernels.SCATTER_ROWS for n in upstream(sums["tok.weight"]))
    for n in graph.nodes:
        if n.target is torch.ops.aten.embedding_dense_backward.default:
            assert n.meta["val"].dtype != torch.float64, n


@pytest.mark.inductor
@pytest.mark.parametrize("case", ["fence", "scatter"])
def test_sums_are_allocated_late_under_inductor(case, monkeypatch):
    # Peak bytes of the same step with the fix and with the old graph (fences off, or the
    # table's sum emitted as plain embedding_dense_backward), compiled by Inductor.
    from opake_compile.compiler.passes import _factors, clip

    vocab, d, hidden = (4096, 512, 1024) if case == "fence" else (8192, 512, 512)
    rw = [GhostClipping(materialize_budget=2.0)] if case == "fence" else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _LlamaLike(vocab, d, hidden)
        ids = torch.randint(0, vocab, (4, 256))
    peaks, results = {}, {}
    for tag in ("now", "old"):
        if tag == "old":
            if case == "fence":
                monkeypatch.setattr(clip, "FENCED_ENTRIES", 1 << 62)
            else:
                monkeypatch.setattr(_factors, "_scatter_rows", lambda em, rows, i, r, pad: em(
                    torch.ops.aten.embedding_dense_backward.default, rows, i, r, pad, False))
        step = compile_dp(next_token_loss, model=model, clipping_norm=1.0, physical_batch_size=4, rewrites=rw)
        results[tag] = step(ids)
        if case == "fence":
            assert step.coverage["head.weight"].startswith("direct:"), step.coverage
        peaks[tag] = _peak_bytes(lambda: step(ids))
    # What the fix frees: the head's float64 sum (fence) or the table's float64 sum (scatter).
    freed = vocab * d * 8
    assert peaks["old"] - peaks["now"] >= (0.5 if case == "fence" else 0.75) * freed, peaks
    for k, g in results["now"].clipped.grads.items():
        torch.testing.assert_close(g, results["old"].clipped.grads[k], rtol=1e-12, atol=1e-15)
