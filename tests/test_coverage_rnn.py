"""Recurrent layers (``nn.RNN`` tanh/relu, ``nn.GRU``, ``nn.LSTM``, the ``*Cell`` forms) and
packed sequences under ``compile_dp`` (:mod:`opake_compile.compiler._rnn`).

The oracle runs each example alone (a batch of one with its own length, through torch's own
fused kernels and ``pack_padded_sequence``), clips its gradient and sums
(``_models.loop_reference``). Batches are padded to P > n rows, so masked rows (length 0) are
exercised too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import opake_compile as opake
from _models import loop_reference, seeded
from opake_compile.compiler.trace import trace_per_example_grads
from opake_compile.exceptions import UnsupportedOperationError

FEATURES, HIDDEN, STEPS, CLASSES = 3, 4, 4, 3


class PackedNet(nn.Module):
    """pack_padded_sequence -> recurrent stack -> features from the final
    states and from the length-normalised sum of pad_packed_sequence's output -> linear head."""

    def __init__(self, kind: str, *, bidirectional: bool, num_layers: int, batch_first: bool,
                 proj: int = 0, learned_h0: bool = False, dropout: float = 0.0, enforce_sorted: bool = False) -> None:
        super().__init__()
        cls = {"rnn_tanh": nn.RNN, "rnn_relu": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}[kind]
        extra = {"nonlinearity": kind[4:]} if kind.startswith("rnn") else {}
        if proj:
            extra["proj_size"] = proj
        self.kind, self.batch_first, self.enforce_sorted = kind, batch_first, enforce_sorted
        self.dirs = 2 if bidirectional else 1
        self.rnn = cls(FEATURES, HIDDEN, num_layers=num_layers, bidirectional=bidirectional,
                       batch_first=batch_first, dropout=dropout, **extra)
        out = proj or HIDDEN
        self.h0 = nn.Parameter(0.3 * torch.randn(num_layers * self.dirs, 1, out)) if learned_h0 else None
        self.head = nn.Linear(2 * self.dirs * out, CLASSES)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(x, lengths, batch_first=self.batch_first, enforce_sorted=self.enforce_sorted)
        hx = None
        if self.h0 is not None:
            h0 = self.h0.expand(-1, x.shape[0 if self.batch_first else 1], -1)
            hx = (h0, torch.zeros(h0.shape[0], h0.shape[1], HIDDEN)) if self.kind == "lstm" else h0
        out, state = self.rnn(packed, hx)
        h_n = state[0] if self.kind == "lstm" else state
        last = h_n[-self.dirs :].transpose(0, 1).reshape(h_n.shape[1], -1)
        padded, lens = pad_packed_sequence(out, batch_first=self.batch_first)
        pooled = padded.sum(1 if self.batch_first else 0) / lens.clamp(min=1).unsqueeze(-1).to(padded.dtype)
        return self.head(torch.cat([last, pooled], -1))


def _loss(model: nn.Module, x: torch.Tensor, lengths: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x, lengths), y)


def _batch(n: int, seed: int, nan_padding: bool = True) -> tuple[torch.Tensor, ...]:
    """(x (n, T, F) batch first, lengths (n,) int64 in [1, T], labels (n,))."""
    g = seeded(seed)
    x = torch.randn(n, STEPS, FEATURES, generator=g)
    lengths = torch.randint(1, STEPS + 1, (n,), generator=g)
    lengths[0] = STEPS  # one full-length example
    if nan_padding:  # packing never reads the padding
        x[torch.arange(STEPS) >= lengths.unsqueeze(1)] = float("nan")
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return x, lengths, y


def _build(seed: int, **kw) -> PackedNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PackedNet(**kw)


class _TimeMajor(nn.Module):
    """Adapts a batch-first (n, T, F) argument to a time-major model."""

    def __init__(self, inner: PackedNet) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.inner(x.transpose(0, 1), lengths)


def _check_against_oracle(model: nn.Module, args: tuple, p: int, backend: str = "aot_eager", verify: bool = False) -> dict[str, str]:
    _, norms = loop_reference(model, _loss, args, float("inf"))
    c = float(norms.median())  # about half of the examples are clipped
    want, want_norms = loop_reference(model, _loss, args, c)
    step = opake.compile_dp(_loss, model=model, clipping_norm=c, physical_batch_size=p, backend=backend)
    out = step(*args)
    assert out.clipped.num_nonfinite == 0
    torch.testing.assert_close(out.clipped.per_example_norms.double(), want_norms, rtol=1e-5, atol=1e-7)
    for name, g in out.clipped.grads.items():
        torch.testing.assert_close(g.double(), want[name], rtol=1e-5, atol=1e-5 * c, msg=name)
    if verify:  # the eager reference (vmap) runs recurrent layers and packing the same way
        report = opake.verify(step, *args, max_removals=2)
        assert report.matches_reference and report.sensitivity_ok, report
    return dict(out.coverage)


CASES = {
    "rnn_tanh-bi-2layer-batch_first": dict(kind="rnn_tanh", bidirectional=True, num_layers=2, batch_first=True),
    "rnn_relu-time_major-h0-sorted": dict(kind="rnn_relu", bidirectional=False, num_layers=1, batch_first=False,
                                          learned_h0=True, enforce_sorted=True),
    "gru-bi-2layer-time_major": dict(kind="gru", bidirectional=True, num_layers=2, batch_first=False),
    "lstm-bi-proj-h0-batch_first": dict(kind="lstm", bidirectional=True, num_layers=1, batch_first=True, proj=2,
                                        learned_h0=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_packed_recurrent_clipped_sum_matches_microbatch_oracle(name):
    kw = CASES[name]
    model = _build(3, **kw)
    args = _batch(6, 11)
    net = model if kw["batch_first"] else _TimeMajor(model)
    coverage = _check_against_oracle(net, args, p=8, verify=name.startswith("rnn_relu"))
    # The recurrent weights enter through one product over all steps, so a linear rule applies.
    hh = [path for k, path in coverage.items() if "weight_hh" in k]
    assert hh and all(path != "materialized" for path in hh), coverage


def test_unpacked_recurrent_layers_and_cells_match_oracle():
    """The plain (unpacked) layers with hx=None, which vmap refused for RNN and GRU, and the
    cells, in one model: RNN(relu) -> GRU -> LSTM (batch first), then RNNCell, GRUCell and
    LSTMCell over the time steps."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.RNN(FEATURES, HIDDEN, nonlinearity="relu", batch_first=True)
            self.gru = nn.GRU(HIDDEN, HIDDEN, batch_first=True)
            self.lstm = nn.LSTM(HIDDEN, HIDDEN, batch_first=True)
            self.cells = nn.ModuleList([nn.RNNCell(HIDDEN, HIDDEN), nn.GRUCell(HIDDEN, HIDDEN), nn.LSTMCell(HIDDEN, HIDDEN)])
            self.head = nn.Linear(HIDDEN, CLASSES)

        def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            seq = self.lstm(self.gru(self.rnn(x)[0])[0])[0]
            h = [None, None, None]
            for t in range(seq.shape[1]):
                h[0] = self.cells[0](seq[:, t], h[0])
                h[1] = self.cells[1](h[0], h[1])
                h[2] = self.cells[2](h[1], h[2])
            return self.head(h[2][0])

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        model = Net()
    _check_against_oracle(model, _batch(5, 2, nan_padding=False), p=7)


@pytest.mark.parametrize("packed", [False, True], ids=["lstm", "packed-lstm"])
def test_graph_size_does_not_grow_with_the_physical_batch(packed):
    """No per-example loop: the fused LSTM kernel (mkldnn on CPU) and the in-place sort/unsort
    of packing have no vmap rule, and vmap unrolled them once per example."""
    model = _build(2, kind="lstm", bidirectional=False, num_layers=1, batch_first=True)

    def loss(m, x, lengths, y):  # noqa: ANN001, ANN202
        if packed:
            return _loss(m, x, lengths, y)
        return F.cross_entropy(m.head(m.rnn(x)[0][:, -1].repeat(1, 2)), y)

    def count(p: int) -> int:
        traced = trace_per_example_grads(model, loss, _batch(p, 0), batched_positions=(0, 1, 2), physical_batch_size=p)
        return sum(n.op == "call_function" for n in traced.gm.graph.nodes)

    assert count(2) == count(9)


def test_dropout_between_layers_runs_in_training_mode():
    model = _build(4, kind="lstm", bidirectional=False, num_layers=2, batch_first=True, dropout=0.5)
    model.train()
    args = _batch(4, 1)
    step = opake.compile_dp(_loss, model=model, clipping_norm=1.0, physical_batch_size=4,
                            backend="aot_eager", key=opake.random.key(0))
    first, second = step(*args), step(*args)
    assert step.num_traces == 1
    for name in first.clipped.grads:
        assert torch.isfinite(first.clipped.grads[name]).all()
    # Fresh masks at each call: the inter-layer dropout is in the graph.
    assert any(not torch.equal(first.clipped.grads[k], second.clipped.grads[k]) for k in first.clipped.grads)


def test_other_use_of_packed_data_fails_closed():
    rnn = nn.GRU(FEATURES, HIDDEN, batch_first=True)

    def loss(model, x, lengths, y):  # noqa: ANN001, ANN202
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = model(packed)
        return out.data.square().sum()  # would include padded positions

    step = opake.compile_dp(loss, model=rnn, clipping_norm=1.0, physical_batch_size=4, backend="aot_eager")
    with pytest.raises(UnsupportedOperationError, match="PackedSequence"):
        step(*_batch(4, 0))


@pytest.mark.inductor
def test_packed_gru_under_inductor():
    model = _build(6, kind="gru", bidirectional=False, num_layers=1, batch_first=True)
    _check_against_oracle(model, _batch(5, 3), p=8, backend="inductor")


@pytest.mark.parametrize("layer", ["lstm", "mha", "transformer"])
def test_a_sequence_first_layer_fed_a_time_major_batch_is_refused(layer: str) -> None:
    """``batch_first=False`` layers take (T, B, F); compile_dp takes the batch along dim 0. Fed a
    (T, B, F) batch as it is, each time step was an example holding every sequence (removing one
    sequence moved the clipped sum by 3.6 C with an LSTM). Refused by name when one example's
    forward holds several sequences; the same layer behind a transpose (one sequence per
    example) trains."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        core = {
            "lstm": lambda: nn.LSTM(4, 4),
            "mha": lambda: nn.MultiheadAttention(4, 2),
            "transformer": lambda: nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0),
        }[layer]()
    run = (lambda x: core(x)[0]) if layer == "lstm" else (lambda x: core(x, x, x, need_weights=False)[0]) if layer == "mha" else core
    time_major = torch.randn(6, 5, 4, generator=seeded(1))  # (T, B, F)

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return run(x).pow(2).mean()

    def transposed(m: nn.Module, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, F)
        return run(x.transpose(0, 1)).pow(2).mean()

    step = opake.compile_dp(loss, model=core, clipping_norm=1.0, backend="aot_eager")
    name = {"lstm": "LSTM", "mha": "MultiheadAttention", "transformer": "MultiheadAttention"}[layer]
    with pytest.raises(UnsupportedOperationError, match=rf"{name} \(batch_first=False\) sees 5 sequences in one example"):
        step(time_major)
    good = opake.compile_dp(transposed, model=core, clipping_norm=1.0, backend="aot_eager")
    assert good(time_major.transpose(0, 1)).clipped.num_examples == 5


def test_several_sequences_of_one_example_over_their_own_time_steps_train() -> None:
    """A document of S sentences run through a ``batch_first=False`` LSTM as a ``(T, S, F)``
    mini-batch is one example: not refused (only a ``(1, S, F)`` input, one time step of several
    sequences, is the trace of a split ``(T, B, F)`` batch)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lstm = nn.LSTM(4, 4)
    docs = torch.randn(3, 2, 5, 4, generator=seeded(2))  # (B, S sentences, T words, F)

    def loss(m: nn.Module, d: torch.Tensor) -> torch.Tensor:
        out, _ = m(d.flatten(0, 1).transpose(0, 1))  # (T, B*S, F): B*S = S in one example's trace
        return out.pow(2).mean()

    step = opake.compile_dp(loss, model=lstm, clipping_norm=1.0, backend="aot_eager")
    assert step(docs).clipped.num_examples == 3
