"""CTC under ``compile_dp``: the traceable CTC loss (``opake_compile._ctc``) against PyTorch's
kernel, and speech models trained with their own labels (``model(x, attention_mask=mask,
labels=labels).loss``, labels padded with -100) against the microbatch oracle, which runs the
real ``F.ctc_loss`` one example at a time.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opake_compile as opake
from _models import loop_reference, seeded, tiny_ctc_model
from opake_compile._ctc import ctc_loss as _ctc_loss

B, P = 5, 3


# ----------------------------------------------------------------------------- the loss itself
def _case(seed: int, dtype: torch.dtype) -> tuple:
    """Seeded hostile cases: ``(logits (T, N, C), targets (N, S), input_lengths, target_lengths)``."""
    g = seeded(100 + seed)
    t, n, c, s = 9, 6, 4, 4
    scale = (1.0, 30.0, 300.0, 1.0, 1.0, 1.0)[seed]
    logits = torch.randn(t, n, c, generator=g, dtype=dtype) * scale
    # Few classes for odd seeds: many repeated labels (a blank is needed between them).
    targets = torch.randint(1, 2 if seed % 2 else c, (n, s), generator=g)
    target_lengths = torch.randint(0, s + 1, (n,), generator=g)
    input_lengths = torch.randint(0, t + 1, (n,), generator=g)
    # Row 0: target length 0. Row 1: input length = the minimum feasible (labels + repeats).
    # Row 2: impossible (too few frames). Row 3: all frames, full target.
    target_lengths[0] = 0
    repeats = int((targets[1, 1:] == targets[1, :-1]).sum())
    target_lengths[1], input_lengths[1] = s, s + repeats
    targets[2] = 1
    target_lengths[2], input_lengths[2] = s, s
    target_lengths[3], input_lengths[3] = s, t
    if seed == 5:  # log-probabilities of -inf (a class that is never emitted)
        logits[:, :, 2] = float("-inf")
    return logits, targets, input_lengths, target_lengths


@pytest.mark.parametrize("impl", ["kernel", "recursion"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(6))
def test_ctc_loss_equals_torch_kernel(seed: int, dtype: torch.dtype, impl: str) -> None:
    """Both implementations (PyTorch's kernel through ``opake::ctc_nll``, the default, and the
    unrolled recursion): values for every reduction and ``zero_infinity``; gradients with
    respect to the logits (through ``log_softmax``) where PyTorch's are finite, and finite
    everywhere; padded, concatenated and unbatched target forms; ``torch.ctc_loss`` and
    ``F.ctc_loss`` routed while tracing."""
    from functools import partial

    from opake_compile.patches import _TraceableCTC

    ctc_loss = partial(_ctc_loss, impl=impl)
    logits, targets, il, tl = _case(seed, dtype)
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    concatenated = torch.cat([targets[i, : tl[i]] for i in range(len(tl))])
    for reduction in ("none", "sum", "mean"):
        for zero_infinity in (False, True):
            a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
            want = F.ctc_loss(a.log_softmax(-1), targets, il, tl, reduction=reduction, zero_infinity=zero_infinity)
            got = ctc_loss(b.log_softmax(-1), targets, il, tl, reduction=reduction, zero_infinity=zero_infinity)
            assert torch.allclose(got, want, rtol=rtol, atol=0, equal_nan=True), (reduction, zero_infinity, got, want)
            flat = ctc_loss(logits.log_softmax(-1), concatenated, il, tl, reduction=reduction, zero_infinity=zero_infinity)
            assert torch.allclose(flat, want.detach(), rtol=rtol, atol=0, equal_nan=True)
            if zero_infinity:
                # Against the kernel in float64 (in float32 the kernel's own gradient loses
                # digits when the loss is large: ours must be as close as its, or within rtol).
                exact = logits.double().requires_grad_()
                ref = F.ctc_loss(exact.log_softmax(-1), targets, il, tl, reduction=reduction, zero_infinity=True)
                (g64,) = torch.autograd.grad(ref.sum(), exact)
                (ga,) = torch.autograd.grad(want.sum(), a)
                (gb,) = torch.autograd.grad(got.sum(), b)
                # The kernel's gradient is NaN at log-probabilities of -inf (seed 5); ours is 0.
                fin = torch.isfinite(g64)
                assert bool(torch.isfinite(gb).all()) and bool(fin.any())
                kernel_err = float((ga.double() - g64)[fin].abs().max())
                ours_err = float((gb.double() - g64)[fin].abs().max())
                assert ours_err <= max(2 * kernel_err, 10 * rtol * max(float(g64[fin].abs().max()), 1.0)), (ours_err, kernel_err)
    losses = F.ctc_loss(logits.log_softmax(-1), targets, il, tl, reduction="none")
    assert losses[0] > 0 and torch.isfinite(losses[1]) and losses[2] == float("inf")  # the cases bite
    one = ctc_loss(logits[:, 3].log_softmax(-1), targets[3], il[3], tl[3], reduction="sum")
    assert torch.allclose(one, losses[3], rtol=rtol)
    with _TraceableCTC():  # both entry points go to the traceable loss, same values
        routed = torch.ctc_loss(logits.log_softmax(-1), targets, il, tl, 0, 0, False)
        routed_f = F.ctc_loss(logits.log_softmax(-1), targets, il, tl, reduction="none")
    assert torch.allclose(routed, losses, rtol=rtol, equal_nan=True) and torch.allclose(routed_f, losses, rtol=rtol, equal_nan=True)


@pytest.mark.parametrize("impl", ["kernel", "recursion"])
def test_impossible_alignment_has_zero_gradient(impl: str) -> None:
    """``zero_infinity=False``: +inf with a zero (not NaN) gradient; the other examples' gradients
    are untouched."""
    logits, targets, il, tl = _case(0, torch.float64)
    x = logits.clone().requires_grad_()
    loss = _ctc_loss(x.log_softmax(-1), targets, il, tl, reduction="none", impl=impl)
    assert loss[2] == float("inf")
    (g,) = torch.autograd.grad(loss[2] + loss[3], x)
    assert torch.equal(g[:, 2], torch.zeros_like(g[:, 2])) and float(g[:, 3].abs().max()) > 0


def _per_example(impl: str, zero_infinity: bool):  # noqa: ANN202
    """``vmap(grad_and_value)`` of one sequence's loss (mean reduction) with respect to its logits."""

    def loss(lg: torch.Tensor, y: torch.Tensor, il: torch.Tensor, tl: torch.Tensor) -> torch.Tensor:
        lp = lg[:, None].log_softmax(-1)
        return _ctc_loss(lp, y[None], il[None], tl[None], reduction="mean", zero_infinity=zero_infinity, impl=impl)

    return torch.func.vmap(torch.func.grad_and_value(loss), in_dims=(1, 0, 0, 0), out_dims=(1, 0))


@pytest.mark.parametrize("seed", range(6))
def test_kernel_under_vmap_grad_equals_recursion(seed: int) -> None:
    """Per-example losses and gradients (float64) of the kernel path under ``vmap(grad)`` (the
    vmap rules of ``opake::ctc_nll`` and its backward) equal the recursion's on the hostile
    cases. Sequences the kernel cannot take (a class index outside [0, C), an input length
    outside [0, T]) get a NaN loss and gradient, alone: the others are unchanged."""
    logits, targets, il, tl = _case(seed, torch.float64)
    for zero_infinity in (False, True):
        gk, lk = _per_example("kernel", zero_infinity)(logits, targets, il, tl)
        gr, lr = _per_example("recursion", zero_infinity)(logits, targets, il, tl)
        assert torch.allclose(lk, lr, rtol=1e-10, atol=0), (lk, lr)
        assert bool(torch.isfinite(gk).all()) and torch.allclose(gk, gr, rtol=1e-8, atol=1e-12)
    bad_y, bad_il = targets.clone(), il.clone()
    bad_y[4, 0] = logits.shape[-1] + 3
    tl = tl.clone()
    tl[4] = max(int(tl[4]), 1)
    bad_il[5] = -3
    gk, lk = _per_example("kernel", True)(logits, bad_y, bad_il, tl)
    gr, lr = _per_example("recursion", True)(logits, targets, il, tl)
    assert bool(lk[4:].isnan().all()) and bool(gk[:, 4:].isnan().all())
    assert torch.allclose(lk[:4], lr[:4], rtol=1e-10) and torch.allclose(gk[:, :4], gr[:, :4], rtol=1e-8, atol=1e-12)


def test_kernel_graph_does_not_grow_with_frames() -> None:
    """Traced ``vmap(grad)`` of the loss: the kernel path is one ``opake::ctc_nll`` and one
    ``opake::ctc_nll_backward`` node for the whole batch and the same graph size at 8 and 64
    frames; the recursion grows with the frames."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def nodes(impl: str, t: int) -> list:
        logits = torch.randn(t, 4, 6)
        y, il, tl = torch.randint(1, 6, (4, 3)), torch.full((4,), t), torch.full((4,), 3)
        gm = make_fx(_per_example(impl, True), tracing_mode="fake")(logits, y, il, tl)
        return [str(n.target) for n in gm.graph.nodes]

    short, long = nodes("kernel", 8), nodes("kernel", 64)
    assert len(short) == len(long) and short.count("opake.ctc_nll.default") == 1
    assert short.count("opake.ctc_nll_backward.default") == 1
    assert len(nodes("recursion", 16)) > len(nodes("recursion", 8)) + 100


# ----------------------------------------------------------------------------- in a model
class _FrameModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn_free = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn_free(x)


def test_user_loss_with_f_ctc_loss_matches_microbatch_oracle() -> None:
    """A plain torch model whose loss calls ``F.ctc_loss`` with padded targets and per-example
    lengths (tensors): compiled equals the oracle (the kernel, one example at a time)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _FrameModel()
    t = 12
    x = torch.randn(B, t, 3, generator=seeded(1))
    y = torch.randint(1, 3, (B, 4), generator=seeded(2))  # repeats are likely
    il = torch.tensor([12, 7, 9, 4, 11])
    tl = torch.tensor([4, 2, 0, 3, 1])

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor, il: torch.Tensor, tl: torch.Tensor) -> torch.Tensor:
        lp = m(x).log_softmax(-1).transpose(0, 1)
        return F.ctc_loss(lp, y, il, tl, reduction="mean", zero_infinity=True)

    _, norms = loop_reference(model, loss, (x, y, il, tl), 1e6)
    c = float(norms.median())
    want, _ = loop_reference(model, loss, (x, y, il, tl), c)
    step = opake.compile_dp(loss, model=model, clipping_norm=c, backend="aot_eager", physical_batch_size=P)
    got = step(x, y, il, tl)
    for k in want:
        assert torch.allclose(got.clipped.grads[k].double(), want[k], rtol=1e-5, atol=1e-6 * c)
    assert torch.allclose(got.clipped.per_example_norms.double(), norms, rtol=1e-5)
    graph = next(iter(step._cache.values())).traced.gm.graph  # the kernel path, not the recursion
    assert [str(n.target) for n in graph.nodes].count("opake.ctc_nll.default") == 1
    # What the eager kernel refuses (or reads out of bounds) is refused on the real rows before
    # the step runs: a class index outside [0, C), a length outside its range.
    bad_y, bad_il = y.clone(), il.clone()
    bad_y[3, 1] = 7  # within example 3's target length (3): C = 5 classes
    with pytest.raises(opake.exceptions.ConfigurationError, match=r"target class 7 in example 3 .*\[0, 4\]"):
        step(x, bad_y, il, tl)
    bad_y[3, 1], bad_y[3, 3] = 1, 7  # past example 3's target length: ignored, as by the kernel
    step(x, bad_y, il, tl)
    bad_il[4] = t + 1
    with pytest.raises(opake.exceptions.ConfigurationError, match=rf"input length {t + 1} in example 4 .*\[0, {t}\]"):
        step(x, y, bad_il, tl)
    assert step.num_calls == 2 and step.num_traces == 1



def test_concatenated_targets_outside_the_batch_are_refused() -> None:
    """Concatenated targets ``(sum(target_lengths),)`` cannot be a batched argument (their
    length is not the batch's), so they were passed outside it, and every example read the
    first example's labels: removing it moved the clipped sum by 4.0 C (review). Refused at
    the trace, naming the padded form; nothing is charged or changed."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _FrameModel()
    x = torch.randn(B, 8, 3, generator=seeded(1))
    y = torch.randint(1, 3, (B, 2), generator=seeded(2))
    il, tl = torch.full((B,), 8), torch.full((B,), 2)

    def loss(m: nn.Module, x: torch.Tensor, il: torch.Tensor, tl: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        return F.ctc_loss(m(x).log_softmax(-1).transpose(0, 1), flat, il, tl, reduction="sum")

    before = [p.detach().clone() for p in model.parameters()]
    step = opake.compile_dp(loss, model=model, clipping_norm=1.0, backend="aot_eager", batch_argnums=(0, 1, 2))
    with pytest.raises(opake.exceptions.UnsupportedOperationError, match=r"targets of shape \(10,\) passed outside batch_argnums.* padded, one row per example"):
        step(x, il, tl, y.reshape(-1))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # The padded form, batched, trains.
    padded = opake.compile_dp(loss, model=model, clipping_norm=1.0, backend="aot_eager")
    assert torch.isfinite(padded(x, il, tl, y).clipped.per_example_norms).all()


# ----------------------------------------------------------------------------- transformers
transformers = pytest.importorskip("transformers")


def _speech_batch() -> tuple:
    """120 samples (13 frames); labels padded with -100, one empty, one with a blank (0) in the
    middle (transformers drops it, as ``masked_select`` does), one with a repeat."""
    x = torch.randn(B, 120, generator=seeded(5))
    mask = torch.zeros(B, 120, dtype=torch.long)
    for i, n in enumerate([120, 50, 90, 30, 110]):
        mask[i, :n] = 1
    labels = torch.tensor([[1, 4, 2, -100], [2, 2, -100, -100], [1, 0, 3, 1], [-100, -100, -100, -100], [3, -100, -100, -100]])
    return x, mask, labels


def _labels_loss(m: nn.Module, x: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return m(x, attention_mask=mask, labels=labels).loss


_NO_RANDOMNESS = dict(
    hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
    layerdrop=0.0, mask_time_prob=0.0,
)


def test_wav2vec2_ctc_with_labels_matches_microbatch_oracle() -> None:
    """Training mode (randomness off so the oracle is one function), labels through the model:
    the clipped sum equals the oracle; the scope is undone; a label outside the vocabulary
    fails and releases nothing."""
    from transformers.loss import loss_utils

    model = tiny_ctc_model("wav2vec2", **_NO_RANDOMNESS)
    mapping = dict(loss_utils.LOSS_MAPPING)
    args = _speech_batch()
    _, norms = loop_reference(model, _labels_loss, args, 1e6)
    assert bool(torch.isfinite(norms).all()) and bool((norms > 0).all())
    c = float(norms.median())
    want, _ = loop_reference(model, _labels_loss, args, c)
    step = opake.compile_dp(_labels_loss, model=model, clipping_norm=c, backend="aot_eager", physical_batch_size=P)
    got = step(*args)
    scale = max(float(w.abs().max()) for w in want.values())
    for k in want:
        assert float((got.clipped.grads[k].double() - want[k]).abs().max()) <= 1e-5 * scale, k
    assert torch.allclose(got.clipped.per_example_norms.double(), norms, rtol=1e-5)
    assert loss_utils.LOSS_MAPPING == mapping
    assert not any("forward" in m.__dict__ for m in model.modules())
    bad = args[2].clone()
    bad[1, 0] = model.config.vocab_size
    with pytest.raises(opake.exceptions.ConfigurationError, match="vocab_size"):
        step(args[0], args[1], bad)
    assert step.num_traces == 1
    # Under an eager vmap with the same adjustments (opake.verify's reference) the values are
    # real: transformers' own check runs, on the whole batch.
    from opake_compile.patches import tracing_patches

    def per_example(x: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _labels_loss(model, x[None], mask[None], labels[None])

    with tracing_patches(model), pytest.raises(ValueError, match="vocab_size"):
        torch.func.vmap(per_example)(args[0], args[1], bad)


@pytest.mark.parametrize("family", ["wav2vec2", "hubert"])
def test_default_config_ctc_model_trains_with_its_labels(family: str) -> None:
    """The default config (LayerDrop, SpecAugment, dropout on) in training mode: the step runs
    with labels, gives finite clipped gradients that reach the head and ``masked_spec_embed``,
    and replays from its key."""
    model = tiny_ctc_model(family)
    assert model.config.layerdrop > 0 and model.config.mask_time_prob > 0
    step = opake.compile_dp(
        _labels_loss, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=P, key=opake.random.key(7)
    )
    args = _speech_batch()
    saved = step.state_dict()
    first = step(*args).clipped
    assert all(bool(torch.isfinite(v).all()) for v in first.grads.values())
    assert float(first.grads["lm_head.weight"].abs().max()) > 0
    assert float(first.grads[f"{family}.masked_spec_embed"].abs().max()) > 0
    step.load_state_dict(saved)
    again = step(*args).clipped
    assert all(torch.equal(again.grads[k], first.grads[k]) for k in first.grads)


def test_out_of_vocabulary_label_is_refused_before_the_step_runs() -> None:
    """transformers' label check (``labels.max() >= config.vocab_size``), skipped inside the
    graph, runs on the real labels before the step: randomness on (LayerDrop, SpecAugment,
    dropout: the step's key moves), two chunks with the bad label in the second, a
    ``DPOptimizer``. The refusal names the model, the value and the vocabulary size and changes
    nothing (parameters, the step's key and sizes, the optimizer, the global generator); an
    in-vocabulary batch afterwards trains."""
    model = tiny_ctc_model("wav2vec2")
    step = opake.compile_dp(
        _labels_loss, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=P, key=opake.random.key(3)
    )
    sampler = opake.PoissonSampler(B, 0.99, key=opake.random.key(4))  # a draw of all B rows (checked below)
    opt = opake.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(5))
    x, mask, labels = _speech_batch()
    vocab = model.config.vocab_size
    bad = labels.clone()
    bad[4, 0] = vocab + 2  # the second chunk (rows 3..4): the first chunk passes its check
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    step_state, opt_state, rng = step.state_dict(), copy.deepcopy(opt.state_dict()), torch.random.get_rng_state()
    for _ in range(2):  # the first call traces, the second runs the cached graph
        with pytest.raises(opake.exceptions.ConfigurationError, match=rf"Wav2Vec2ForCTC: label value {vocab + 2} in example 4 .*vocab_size = {vocab}"):
            step(x, mask, bad)
    assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
    assert step.state_dict() == step_state and step.num_calls == 0
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert opt.state_dict().keys() == opt_state.keys() and opt.steps == 0
    # The refused batch left nothing behind: an in-vocabulary batch trains, with the draws of
    # the step's unchanged key (replayed from the saved state: the same sums).
    got = step(x, mask, labels).clipped
    step.load_state_dict(step_state)
    again = step(x, mask, labels).clipped
    assert all(torch.equal(got.grads[k], again.grads[k]) for k in got.grads)
    draw = next(iter(sampler))  # the draw the step is charged for: every row of the batch
    assert list(draw) == list(range(B))
    opt.step(got, draw=draw)
    assert opt.steps == 1 and not torch.equal(model.lm_head.weight, params["lm_head.weight"])
    edge = labels.clone()
    edge[4, 0] = vocab - 1  # the largest label in the vocabulary passes
    assert bool(torch.isfinite(step(x, mask, edge).clipped.grads["lm_head.weight"]).all())
