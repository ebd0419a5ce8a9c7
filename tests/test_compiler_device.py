"""The traced graph lives on the model's device, every node of it, without a GPU.

The step passes its clipping norm, row mask and draws on the device of the model's first
trainable parameter, and Inductor lowers a graph for one device. On the first H200 run (torch
2.11, 2026-12-04) every DP step failed in the clipping pass: the trace had made the row mask on
the CPU (``logical_and`` of CUDA finite flags and a CPU mask), and the passes made their zero
constants on the CPU (``nextafter`` of CUDA values and a CPU zero takes no CPU scalar).

These tests run the trace and every pass on the ``meta`` device, which like CUDA refuses to mix
with CPU tensors, and stop before lowering (``lower`` is replaced by one that records the graph):
every tensor value in the graph must be on the model's device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from opake_compile import compile_dp
from opake_compile.compiler import step as step_mod
from opake_compile.compiler.passes.rewrites import GhostClipping


class _Lowered(Exception):
    """Raised by the recording ``lower``: the passes ran; the graph is in ``args[0]``."""


@pytest.fixture
def graph_of(monkeypatch):
    def record(gm, backend, counter):
        raise _Lowered(gm)

    monkeypatch.setattr(step_mod, "lower", record)

    def run(model: nn.Module, *batch: torch.Tensor, **kw):
        model = model.to("meta")
        step = compile_dp(_ce, model=model, clipping_norm=1.0, backend="inductor", **kw)
        with pytest.raises(_Lowered) as got:
            step(*(b.to("meta") for b in batch))
        return got.value.args[0]

    return run


def _ce(model, x, y):
    return F.cross_entropy(model(x), y)


def _devices(gm) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out.setdefault(str(v.device), []).append(f"{n.name} ({n.target})")
    return out


class _Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.enc(x).mean(1))


class _ConvEmbed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.norm = nn.GroupNorm(2, 8)
        self.emb = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        ids = torch.arange(5, device=x.device).expand(x.shape[0], 5)
        return self.head(self.norm(self.conv(x)).mean((2, 3)) + self.emb(ids).mean(1))


_X, _Y = torch.randn(6, 16), torch.randint(0, 4, (6,))
_CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)), (_X, _Y)),
    "encoder": (_Encoder, (torch.randn(6, 10, 32), _Y)),
    "conv_embedding": (_ConvEmbed, (torch.randn(6, 3, 9, 9), _Y)),
}


@pytest.mark.parametrize("name", sorted(_CASES))
def test_every_graph_value_is_on_the_model_device(graph_of, name):
    build, batch = _CASES[name]
    torch.manual_seed(0)
    devices = _devices(graph_of(build(), *batch))
    assert set(devices) == {"meta"}, {k: v[:5] for k, v in devices.items() if k != "meta"}


@pytest.mark.parametrize("bookkeeping", ["per_layer", "fused"])
@pytest.mark.parametrize("path", ["ghost", "mixed", "materialized"])
def test_forced_norm_forms_stay_on_the_model_device(graph_of, path, bookkeeping):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    gm = graph_of(model, _X, _Y, physical_batch_size=8,
                  rewrites=[GhostClipping(force={"0.weight": path, "2.weight": path}, bookkeeping=bookkeeping)])
    devices = _devices(gm)
    assert set(devices) == {"meta"}, {k: v[:5] for k, v in devices.items() if k != "meta"}


def _lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_transformers_graphs_stay_on_the_model_device(monkeypatch, name):
    # GPT-2 (tied LM head, Conv1D, learned positions) and Llama (RMSNorm, rotary, grouped-query
    # SDPA): the embedding and LM-head book-keeping paths the small models above do not take.
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(step_mod, "lower", lambda gm, backend, counter: (_ for _ in ()).throw(_Lowered(gm)))
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=16, use_cache=False)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                       intermediate_size=64, vocab_size=100, use_cache=False)
        model = transformers.LlamaForCausalLM(cfg)
    step = compile_dp(_lm_loss, model=model.to("meta"), clipping_norm=1.0, backend="inductor")
    with pytest.raises(_Lowered) as got:
        step(torch.randint(0, 100, (4, 16)).to("meta"))
    devices = _devices(got.value.args[0])
    assert set(devices) == {"meta"}, {k: v[:5] for k, v in devices.items() if k != "meta"}


def test_ctc_by_recursion_stays_on_the_model_device(graph_of, monkeypatch):
    # The CTC loss's own recursion (the path for half-precision log-probabilities) made its
    # constants with torch.tensor, which detaches in place: refused under grad off the CPU.
    import opake_compile._ctc as ctc

    monkeypatch.setattr(ctc, "_kernel_applies", lambda log_probs: False)

    def loss(m, x, targets, in_len, tgt_len):
        return F.ctc_loss(m(x).log_softmax(-1).transpose(0, 1), targets, in_len, tgt_len, zero_infinity=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5)).to("meta")
    step = compile_dp(loss, model=model, clipping_norm=1.0, backend="aot_eager")
    batch = (torch.randn(6, 12, 8), torch.randint(1, 5, (6, 4)), torch.full((6,), 12), torch.randint(1, 5, (6,)))
    with pytest.raises(_Lowered) as got:
        step(*(b.to("meta") for b in batch))
    devices = _devices(got.value.args[0])
    assert set(devices) == {"meta"}, {k: v[:5] for k, v in devices.items() if k != "meta"}
