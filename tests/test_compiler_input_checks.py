"""Input checks registered while tracing (``opake_compile.compiler._input_checks``): run by the
compiled step on the real rows of every chunk before any graph runs; a refusal changes nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opake_compile as opake
from _models import seeded
from opake_compile.compiler._input_checks import require


def _nonnegative(rows: torch.Tensor, first_row: int) -> str | None:
    bad = (rows < 0).nonzero()
    return None if len(bad) == 0 else f"row {first_row + int(bad[0, 0])} holds {float(rows[int(bad[0, 0])].min())}"


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))


def test_check_runs_on_real_rows_of_every_chunk_before_the_step() -> None:
    """A check on a value computed from a batch argument (a view and an arithmetic op of it):
    the step refuses a batch whose real row fails it, names the row's position in the logical
    batch, and leaves the step's key, the global generator and the sizes untouched; padded rows
    (zeros here, shifted to -1 by the value's computation) are never checked; outside a trace
    ``require`` records nothing."""
    model = _model()
    recorded = []

    def loss(m: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        recorded.append(require(w[:, 0] - 1.0, _nonnegative, "w >= 1"))
        return (F.softplus(m(x)).sum(-1) * w[:, 0]).mean()

    x = torch.randn(7, 3, generator=seeded(0))
    w = torch.rand(7, 1, generator=seeded(1)) + 1.0  # padding (zeros) would fail: it is never checked
    step = opake.compile_dp(loss, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=3, key=opake.random.key(0))
    first = step.state_dict()
    want = step(x, w).clipped
    assert recorded == [True] and step.num_traces == 1
    state, rng = step.state_dict(), torch.random.get_rng_state()
    bad = w.clone()
    bad[5, 0] = 0.5  # the third chunk (rows 6..) passes; the second holds row 5
    with pytest.raises(opake.exceptions.ConfigurationError, match=r"row 5 holds -0\.5"):
        step(x, bad)
    assert step.state_dict() == state and torch.equal(torch.random.get_rng_state(), rng) and step.num_calls == 1
    assert step.num_traces == 1 and step(x, w).clipped.num_examples == 7
    step.load_state_dict(first)  # the same key as the first call: the same draws, the same sums
    again = step(x, w).clipped
    assert all(torch.equal(again.grads[k], want.grads[k]) for k in want.grads)
    assert require(w, _nonnegative, "outside a trace") is False


def test_check_on_a_value_that_depends_on_parameters_is_dropped_with_a_warning() -> None:
    """A value that needs the parameters cannot be computed before the step: no check, a warning."""
    model = _model()

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        require(out, _nonnegative, "the model's outputs")
        return out.square().mean()

    step = opake.compile_dp(loss, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=4)
    with pytest.warns(UserWarning, match="cannot check the model's outputs"):
        step(torch.randn(4, 3, generator=seeded(2)))
    assert next(iter(step._cache.values())).traced.input_checks == ()


def test_value_batched_along_another_dimension_is_checked_rows_first() -> None:
    """The recorded value is the physical tensor under ``vmap``; when its batch dimension is not
    the first (here ``in_dims=1``) the check still sees one row per example."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from opake_compile.compiler import _input_checks

    def f(w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def inner(w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            assert require(y, lambda rows, first: repr(rows.tolist()), "y")
            return (w * y.float()).sum()

        return torch.func.vmap(torch.func.grad(inner), in_dims=(None, 1))(w, y)

    y = torch.arange(12).reshape(3, 4)
    with _input_checks.recording() as rec:
        gm = make_fx(f, tracing_mode="fake")(torch.randn(3), y)
    (check,) = rec.build(gm, [n for n in gm.graph.nodes if n.op == "placeholder"][1:])
    assert check.run([y], 2, 0) == repr(y.t()[:2].tolist())


# ----------------------------------------------------------------------------- index ranges
class _Tokens(nn.Module):
    """Token embedding, mean over positions, a linear head: ids (B, T) -> logits (B, 5)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.emb, self.head = nn.Embedding(11, 4), nn.Linear(4, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(-2))


def _token_loss(m: nn.Module, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(ids), y, ignore_index=-1)


def test_out_of_range_token_ids_and_class_targets_are_refused_before_the_step() -> None:
    """The compiled step checks what eager ``embedding`` and ``cross_entropy`` check (a kernel
    compiled without them reads out of bounds, or on a GPU asserts on the device): a token id
    outside the table or a target outside the classes is refused in any chunk, naming the
    function, the value and the example; ``ignore_index`` targets pass; nothing changes (the
    step's key and counters, the global generator); the graph is not traced again."""
    model = _Tokens()
    ids = torch.randint(0, 11, (7, 6), generator=seeded(2))
    y = torch.randint(0, 5, (7,), generator=seeded(3))
    y[1] = -1  # ignored: passes
    step = opake.compile_dp(_token_loss, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=3, key=opake.random.key(0))
    assert step(ids, y).clipped.num_examples == 7
    state, rng = step.state_dict(), torch.random.get_rng_state()
    cases = [
        (4, "ids", 11, r"embedding: index 11 in example 4 of the batch is outside \[0, 10\] \(the table has 11 rows\)"),
        (6, "ids", -2, r"embedding: index -2 in example 6 of the batch"),
        (5, "y", 5, r"cross_entropy: target class 5 in example 5 of the batch is outside \[0, 4\] \(5 classes, ignore_index -1\)"),
        (0, "y", -100, r"cross_entropy: target class -100 in example 0"),  # not this loss's ignore_index
    ]
    for row, which, value, message in cases:
        bad_ids, bad_y = ids.clone(), y.clone()
        (bad_ids[row, 3] if which == "ids" else bad_y[row]).fill_(value)
        with pytest.raises(opake.exceptions.ConfigurationError, match=message):
            step(bad_ids, bad_y)
    assert step.state_dict() == state and torch.equal(torch.random.get_rng_state(), rng)
    assert step.num_calls == 1 and step.num_traces == 1


def test_indices_the_model_computes_are_not_checked() -> None:
    """A lookup by indices computed from the parameters (a codebook's nearest entry) is in
    range by construction: no check, no warning, and the step runs."""

    class Codebook(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.codes = nn.Parameter(torch.randn(6, 3, generator=seeded(4)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            nearest = torch.cdist(x, self.codes).argmin(-1)
            return F.embedding(nearest, self.codes)

    x = torch.randn(4, 2, 3, generator=seeded(5))
    step = opake.compile_dp(lambda m, x: (m(x) - x).pow(2).mean(), model=Codebook(), clipping_norm=1.0, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = step(x)
    graph = next(iter(step._cache.values())).traced
    assert graph.input_checks == () and out.clipped.num_examples == 4


def test_batch_of_another_dtype_than_the_model_is_refused_naming_both() -> None:
    """A float64 batch into a float32 model: eager PyTorch refuses the product; the traced
    graph's fake kernels did not, and the step failed inside its graph with torch's error. Now a
    ``ConfigurationError`` at the first call names the op and both dtypes; nothing changes, and
    the float32 batch then runs."""
    model = _model().eval()
    x = torch.randn(5, 3, generator=seeded(6))
    step = opake.compile_dp(lambda m, x: m(x).pow(2).mean(), model=model, clipping_norm=1.0, backend="aot_eager")
    state = step.state_dict()
    with pytest.raises(opake.exceptions.ConfigurationError, match=r"aten::(mm|addmm) on torch.float32, torch.float64.*batch holds torch.float64"):
        step(x.double())
    assert step.state_dict() == state and step.num_calls == 0
    assert step(x).clipped.num_examples == 5


def test_causal_lm_labels_padded_with_minus_100_pass_and_ids_past_the_vocabulary_are_refused() -> None:
    """transformers' causal-LM loss (labels shifted, -100 padding, ``ignore_index=-100``): the
    checks reach through the shift to the batch argument; a label or an input id equal to the
    vocabulary size is refused naming the example; the learned position table is not checked
    (its ids come from ``arange``, not the batch)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)

    def loss(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, attention_mask=mask, labels=labels).loss

    ids = torch.randint(0, 50, (6, 8), generator=seeded(7))
    mask = torch.ones(6, 8, dtype=torch.long)
    labels = ids.clone()
    labels[:, -3:] = -100
    step = opake.compile_dp(loss, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=4)
    assert step(ids, mask, labels).clipped.num_examples == 6
    checks = next(iter(step._cache.values())).traced.input_checks
    assert sorted(c.what for c in checks) == ["cross_entropy: target class in [0, 50)", "embedding: index in [0, 50)"]
    bad = labels.clone()
    bad[5, 2] = 50
    with pytest.raises(opake.exceptions.ConfigurationError, match=r"cross_entropy: target class 50 in example 5 .*ignore_index -100"):
        step(ids, mask, bad)
    bad = ids.clone()
    bad[3, 0] = 50
    with pytest.raises(opake.exceptions.ConfigurationError, match=r"embedding: index 50 in example 3 .*50 rows"):
        step(bad, mask, labels)
    assert step.num_calls == 1


def test_gather_indices_are_checked_and_a_failing_graph_spends_no_draw() -> None:
    """``gather`` indices from the batch are checked like class targets. An error raised inside
    the graph itself (advanced indexing out of range, which is not pre-checked) leaves the
    step's key where it was: the next call draws what it would have drawn without the failed
    one (the key was split per chunk before the graph ran)."""
    model = _model()  # dropout: the graph draws from the step's key
    x = torch.randn(7, 3, generator=seeded(8))
    y = torch.tensor([0, 1, 1, 0, 1, 0, 1])
    gather = opake.compile_dp(
        lambda m, x, y: -m(x).log_softmax(-1).gather(1, y[:, None]).mean(),
        model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=3, key=opake.random.key(1),
    )
    with pytest.raises(opake.exceptions.ConfigurationError, match=r"gather: index 2 in example 6 .*dimension 1 has 2 entries"):
        gather(x, torch.tensor([0, 1, 1, 0, 1, 0, 2]))

    def indexed(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logp = m(x).log_softmax(-1)
        return -logp[torch.arange(logp.shape[0]), y].mean()

    step = opake.compile_dp(indexed, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=3, key=opake.random.key(1))
    first = step.state_dict()
    want = step(x, y).clipped
    step.load_state_dict(first)
    bad = y.clone()
    bad[5] = 7  # the second chunk: the first chunk's graph has run and drawn
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        step(x, bad)
    assert step.state_dict() == first
    got = step(x, y).clipped
    assert all(torch.equal(got.grads[k], want.grads[k]) for k in want.grads)
