"""Hugging Face models with 2-D padding masks, masked writes, LayerDrop and SpecAugment under
``compile_dp``.

Every model is built from a small ``transformers`` config (no download) and gets a 2-D
``attention_mask`` with real padding. In eval mode the compiled clipped sum must equal the
microbatch oracle (each example alone at batch size one, plain autograd, clip, sum). In training
mode (dropout and LayerDrop on) the step must run and be reproducible from its key, and LayerDrop
must drop the same layers for every example of a logical batch (Wav2Vec2's and BART's forms);
SpecAugment's masks are drawn in the graph per example with transformers' distribution. The
encoders use eager attention (``attn_implementation="eager"``); the causal LMs (GPT-2, Llama)
use transformers' default, SDPA, left-padded.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opake_compile as opake
from _models import loop_reference, seeded, tiny_ctc_model

transformers = pytest.importorskip("transformers")

B, T = 5, 7
P = 3  # two chunks for B = 5: each logical batch spans chunks


def _padding_mask(b: int, t: int, lengths: list[int]) -> torch.Tensor:
    mask = torch.zeros(b, t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return mask


def _ids(b: int, t: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (b, t), generator=seeded(seed))


def _build(fn):  # noqa: ANN001, ANN202
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return fn()


def _enc_kwargs() -> dict:
    return dict(
        vocab_size=40, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        max_position_embeddings=24, num_labels=3, attn_implementation="eager",
    )


def _cls_loss(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(input_ids=ids, attention_mask=mask).logits, y)


def _bert():  # noqa: ANN202
    return transformers.BertForSequenceClassification(transformers.BertConfig(**_enc_kwargs()))


def _roberta():  # noqa: ANN202
    return transformers.RobertaForSequenceClassification(transformers.RobertaConfig(pad_token_id=1, **_enc_kwargs()))


def _distilbert():  # noqa: ANN202
    cfg = transformers.DistilBertConfig(
        vocab_size=40, dim=8, n_layers=1, n_heads=2, hidden_dim=16, max_position_embeddings=24, num_labels=3,
        attn_implementation="eager",
    )
    return transformers.DistilBertForSequenceClassification(cfg)


def _lora_bert():  # noqa: ANN202
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4, target_modules=["query", "value"])
    return peft.get_peft_model(_bert(), cfg)


def _classifier_case(make):  # noqa: ANN001, ANN202
    def case():  # noqa: ANN202
        model = _build(make).eval()
        ids = _ids(B, T, 40, 1)
        mask = _padding_mask(B, T, [7, 3, 5, 1, 6])
        y = torch.randint(0, 3, (B,), generator=seeded(2))
        return model, _cls_loss, (ids, mask, y)

    return case


def _t5_case():  # noqa: ANN202
    cfg = transformers.T5Config(
        vocab_size=40, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, attn_implementation="eager",
    )
    model = _build(lambda: transformers.T5ForConditionalGeneration(cfg)).eval()
    ids = _ids(B, T, 40, 3)
    mask = _padding_mask(B, T, [7, 2, 4, 6, 5])
    labels = _ids(B, 4, 40, 4)
    dmask = _padding_mask(B, 4, [4, 3, 2, 4, 1])

    def loss(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, dmask: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, attention_mask=mask, labels=labels, decoder_attention_mask=dmask).loss

    return model, loss, (ids, mask, labels, dmask)


def _wav2vec2(**overrides):  # noqa: ANN003, ANN202
    kw = dict(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
        conv_dim=(4, 4), conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, num_labels=3, classifier_proj_size=4, mask_time_prob=0.0,
        attn_implementation="eager",
    )
    kw.update(overrides)
    return _build(lambda: transformers.Wav2Vec2ForSequenceClassification(transformers.Wav2Vec2Config(**kw)))


def _audio_batch(seed: int = 5) -> tuple:
    x = torch.randn(B, 120, generator=seeded(seed))
    mask = _padding_mask(B, 120, [120, 50, 90, 30, 110])
    y = torch.randint(0, 3, (B,), generator=seeded(seed + 1))
    return x, mask, y


def _audio_loss(m: nn.Module, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(input_values=x, attention_mask=mask).logits, y)


def _wav2vec2_case():  # noqa: ANN202
    return _wav2vec2().eval(), _audio_loss, _audio_batch()


def _left_padded_causal_lm_case(family: str):  # noqa: ANN202
    """A causal LM under transformers' default attention (SDPA), left-padded: the padded query
    rows have no key to attend to (fully masked rows), and the mask matters (with right padding
    and -100 labels, the causal mask alone already hides the padding from every target)."""

    def case():  # noqa: ANN202
        if family == "gpt2":
            cfg = transformers.GPT2Config(
                vocab_size=40, n_embd=8, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation="sdpa",
            )
            make = lambda: transformers.GPT2LMHeadModel(cfg)  # noqa: E731
        else:  # Llama: RMSNorm, rotary positions, grouped-query attention
            cfg = transformers.LlamaConfig(
                vocab_size=40, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=16, attn_implementation="sdpa",
            )
            make = lambda: transformers.LlamaForCausalLM(cfg)  # noqa: E731
        model = _build(make).eval()
        assert model.config._attn_implementation == "sdpa"
        ids = _ids(B, T, 40, 6)
        lengths = [7, 3, 5, 2, 6]  # every row has a next-token target
        mask = _padding_mask(B, T, lengths).flip(1)
        labels = ids.masked_fill(mask == 0, -100)

        def loss(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return m(input_ids=ids, attention_mask=mask, labels=labels).loss

        return model, loss, (ids, mask, labels)

    return case


CASES = {
    "bert": _classifier_case(_bert),
    "distilbert": _classifier_case(_distilbert),
    "roberta": _classifier_case(_roberta),
    "t5": _t5_case,
    "lora_bert": _classifier_case(_lora_bert),
    "wav2vec2": _wav2vec2_case,
    "gpt2_sdpa_left_padded": _left_padded_causal_lm_case("gpt2"),
    "llama_sdpa_left_padded": _left_padded_causal_lm_case("llama"),
}


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rel: float = 1e-5) -> None:
    assert set(got) == set(want)
    scale = max(float(w.double().abs().max()) for w in want.values())
    assert scale > 0
    for k in want:
        diff = float((got[k].double() - want[k].double()).abs().max())
        assert diff <= rel * scale, f"{k}: max |diff| {diff:.3g} > {rel:g} * {scale:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_two_d_padding_mask_matches_microbatch_oracle(name: str) -> None:
    from transformers import masking_utils

    shims = {n: getattr(masking_utils, n) for n in ("_ignore_bidirectional_mask_sdpa", "_ignore_causal_mask_sdpa")}
    model, loss, args = CASES[name]()
    _, norms = loop_reference(model, loss, args, 1e6)
    assert bool((norms > 0).all())
    c = float(norms.median())  # about half the examples clipped
    want, _ = loop_reference(model, loss, args, c)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = opake.compile_dp(loss, model=model, clipping_norm=c, backend="aot_eager", physical_batch_size=P)
    got = step(*args)
    _compare(got.clipped.grads, want)
    assert torch.allclose(got.clipped.per_example_norms.double(), norms, rtol=1e-5)
    # The mask reaches the model: without it (all ones, same graph) the result differs.
    unmasked = step(args[0], torch.ones_like(args[1]), *args[2:]).clipped.grads
    assert not _close(unmasked, want)
    # Tracing changed nothing outside: model, library functions, torch's compiling flag.
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(getattr(masking_utils, n) is f for n, f in shims.items())
    assert not torch.compiler.is_compiling()
    assert not any(k in m.__dict__ for m in model.modules() for k in ("forward", "_get_feature_vector_attention_mask"))
    if name in ("bert", "wav2vec2"):  # verify's eager reference runs with the same adjustments
        report = opake.verify(step, *args, max_removals=1)
        assert report.matches_reference and report.sensitivity_ok, report


class _MaskedWrite(nn.Module):
    """Plain torch: zero padded positions in place, ``h[~mask] = 0`` and ``h[mask] = row``."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.fill = nn.Parameter(torch.randn(4))
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h[~mask.bool()] = 0
        h[(x[..., 0] > 1.0)] = self.fill
        return self.out(h).sum(1)


def test_in_place_masked_writes_are_traced_functionally() -> None:
    model = _build(_MaskedWrite)
    x = torch.randn(B, T, 3, generator=seeded(7))
    mask = _padding_mask(B, T, [7, 3, 5, 1, 6])
    y = torch.randint(0, 2, (B,), generator=seeded(8))

    def loss(m: nn.Module, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x, mask), y)

    want, _ = loop_reference(model, loss, (x, mask, y), 0.5)
    step = opake.compile_dp(loss, model=model, clipping_norm=0.5, backend="aot_eager", physical_batch_size=P)
    _compare(step(x, mask, y).clipped.grads, want)
    assert float(want["fill"].abs().max()) > 0


@pytest.mark.parametrize(
    "shape, mask_dims, value",
    [((3, 4), 1, 0), ((3, 4), 1, torch.tensor(2.0)), ((3, 4), 1, torch.arange(4.0)), ((3, 4), 2, -1.5),
     ((2, 3, 4), 1, torch.ones(3, 4)), ((2, 3, 4), 1, torch.ones(1, 4)), ((3, 4), 1, torch.ones(2, 4))],
)
def test_masked_write_rewrite_has_the_values_of_index_put(shape: tuple, mask_dims: int, value: object) -> None:
    """Eagerly, with and without the rewrite, on each value form (the last is one row per
    selected element: left to ``index_put_``)."""
    from opake_compile.patches import _FunctionalMaskedWrites

    x = torch.randn(shape, generator=seeded(9))
    mask = torch.zeros(shape[:mask_dims], dtype=torch.bool)
    mask.view(-1)[::2] = True
    want, got = x.clone(), x.clone()
    want[mask] = value
    with _FunctionalMaskedWrites():
        got[mask] = value
    assert torch.equal(got, want)
    assert not torch.equal(want, x)


def _skip_layers(model: nn.Module, skipped: tuple[int, ...]) -> None:
    for i in skipped:
        model.wav2vec2.encoder.layers[i].forward = lambda h, *a, **k: h


def test_layerdrop_is_drawn_once_per_logical_batch() -> None:
    """Training mode, LayerDrop 0.5, no other randomness: every call equals the microbatch oracle
    for one set of dropped layers, the same for all examples of the batch (which spans chunks)."""
    zero = dict(num_hidden_layers=2, hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0)
    model = _wav2vec2(layerdrop=0.5, **zero).train()
    args = _audio_batch()
    c = 0.05
    oracles = {}
    for skipped in itertools.chain.from_iterable(itertools.combinations(range(2), r) for r in range(3)):
        ref = _wav2vec2(layerdrop=0.0, **zero).train()
        _skip_layers(ref, skipped)
        oracles[skipped] = loop_reference(ref, _audio_loss, args, c)[0]
    step = opake.compile_dp(
        _audio_loss, model=model, clipping_norm=c, backend="aot_eager", physical_batch_size=P, key=opake.random.key(3)
    )
    seen = set()
    for _ in range(4):
        got = step(*args).clipped.grads
        match = [s for s, want in oracles.items() if _close(got, want)]
        assert len(match) == 1, "the result matches no single set of dropped layers"
        seen.add(match[0])
    assert len(seen) >= 2  # the decisions are redrawn each step (fixed key: deterministic)
    assert model.config.layerdrop == 0.5
    assert all("forward" not in layer.__dict__ for layer in model.wav2vec2.encoder.layers)


def _bart(**overrides):  # noqa: ANN003, ANN202
    kw = dict(
        vocab_size=40, d_model=8, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=16, decoder_ffn_dim=16, max_position_embeddings=24, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, attn_implementation="eager",
    )
    kw.update(overrides)
    return _build(lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(**kw))).train()


def _bart_loss(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return m(input_ids=ids, attention_mask=mask, labels=labels).loss


def test_bart_layerdrop_is_selected_in_the_graph_once_per_logical_batch() -> None:
    """BART's LayerDrop (``torch.rand([]) < self.layerdrop`` in the encoder and decoder loops,
    from encoder_layerdrop / decoder_layerdrop): each call equals the microbatch oracle of one
    set of dropped layers, the same for every example; the set changes across steps; the
    draws are a graph input of the step (one per layer)."""
    model = _bart(encoder_layerdrop=0.5, decoder_layerdrop=0.5)
    args = (_ids(B, T, 40, 21), _padding_mask(B, T, [7, 3, 5, 1, 6]), _ids(B, 4, 40, 22))
    c = 0.05
    layers = lambda m: [*m.model.encoder.layers, *m.model.decoder.layers]  # noqa: E731
    oracles = {}
    for skipped in itertools.chain.from_iterable(itertools.combinations(range(3), r) for r in range(4)):
        ref = _bart()
        for i in skipped:
            layers(ref)[i].forward = lambda h, *a, **k: h
        oracles[skipped] = loop_reference(ref, _bart_loss, args, c)[0]
    step = opake.compile_dp(_bart_loss, model=model, clipping_norm=c, backend="aot_eager", physical_batch_size=P, key=opake.random.key(4))
    seen = set()
    for _ in range(4):
        got = step(*args).clipped.grads
        # Per parameter (float32 sums of small gradients: 1e-4 relative): a dropped layer's
        # gradient is exactly zero, a kept one's is not. The attention key biases' gradients are
        # zero in exact arithmetic (softmax is shift-invariant), float32 rounding noise here, so
        # each parameter's scale is floored at 1e-4 of the largest gradient of the oracle.
        match = [s for s, want in oracles.items() if all(_close_per_key(got[k], want[k], _floor(want)) for k in want)]
        assert match, "the result matches no set of dropped layers"
        # Sets that match together give one gradient (both decoder layers dropped: the encoder's
        # layers do not reach the loss, whichever ran).
        assert all(_close_per_key(oracles[s][k], oracles[match[0]][k], _floor(oracles[match[0]])) for s in match for k in got)
        seen.add(tuple(match))
    assert len(seen) >= 2
    assert [c.traced.layout.batch_draws for c in step._cache.values()] == [3]
    assert model.model.encoder.layerdrop == 0.5 and model.model.decoder.layerdrop == 0.5
    assert all("forward" not in layer.__dict__ for layer in layers(model))


def _floor(tree: dict[str, torch.Tensor]) -> float:
    return 1e-4 * max(float(t.double().abs().max()) for t in tree.values())


def _close_per_key(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> bool:
    scale = float(want.double().abs().max())
    return float((got.double() - want.double()).abs().max()) <= 1e-4 * max(scale, floor) if scale > 0 else float(got.abs().max()) == 0


class _OwnLayerDrop(nn.Module):
    """A user's module with BART's LayerDrop form (a NumPy coin against ``self.layerdrop``)."""

    def __init__(self, layers: nn.Module) -> None:
        super().__init__()
        self.layers = layers
        self.layerdrop = 0.25

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        import numpy as np

        for layer in self.layers:
            if self.training and np.random.random() < self.layerdrop:
                continue
            h = layer(h)
        return h


def test_layerdrop_sites_read_from_source() -> None:
    """WavLM never drops its first layer (``i > 0 and ...``); Flaubert's layers are parallel
    lists, which cannot be selected: refused by name while it would draw, accepted at 0."""
    from opake_compile.patches import _layerdrop_sites, count_batch_draws

    wavlm_cfg = transformers.WavLMConfig(
        hidden_size=8, num_hidden_layers=3, num_attention_heads=2, intermediate_size=16, conv_dim=(4, 4), conv_stride=(4, 2),
        conv_kernel=(8, 4), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, layerdrop=0.3, num_buckets=8,
    )
    wavlm = _build(lambda: transformers.WavLMModel(wavlm_cfg)).train()
    (site,) = _layerdrop_sites(wavlm)
    assert site.layers == tuple(wavlm.encoder.layers)[1:] and site.probability == 0.3
    assert count_batch_draws(wavlm.eval()) == 0
    flaubert_cfg = transformers.FlaubertConfig(vocab_size=40, emb_dim=8, n_layers=2, n_heads=2, layerdrop=0.2)
    flaubert = _build(lambda: transformers.FlaubertModel(flaubert_cfg)).train()
    with pytest.raises(opake.exceptions.UnsupportedOperationError, match=r"FlaubertModel.*layerdrop=0.2"):
        count_batch_draws(flaubert)
    flaubert.layerdrop = 0.0
    assert count_batch_draws(flaubert) == 0
    assert count_batch_draws(_OwnLayerDrop(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))) == 2
    with pytest.raises(opake.exceptions.UnsupportedOperationError, match=r"_OwnLayerDrop.*Sequential"):
        count_batch_draws(_OwnLayerDrop(nn.Sequential(nn.Linear(2, 2))))


def test_layerdrop_of_shape_changing_layers_is_refused_by_name() -> None:
    """Wav2Vec2's adapter drops layers that halve the time axis: whether one ran would change
    the graph's shapes, so it is refused by name (it used to freeze one NumPy draw)."""
    model = _ctc_model("wav2vec2", add_adapter=True, output_hidden_size=8, adapter_stride=2, num_adapter_layers=1, mask_time_prob=0.0)
    assert model.wav2vec2.adapter.layerdrop > 0
    step = opake.compile_dp(_frame_loss, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=P)
    with pytest.raises(opake.exceptions.UnsupportedOperationError, match=r"'wav2vec2.adapter' \(Wav2Vec2Adapter\) \(layerdrop=0.1\)"):
        step(*_audio_batch())


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    try:
        _compare(got, want)
    except AssertionError:
        return False
    return True


def test_wav2vec2_training_mode_runs_and_is_reproducible() -> None:
    """Dropout and LayerDrop on, 2-D mask: runs, finite, and the step replays its draws from a
    saved state (its key) exactly, while consecutive steps draw anew."""
    model = _wav2vec2(layerdrop=0.3, hidden_dropout=0.1, attention_dropout=0.1, feat_proj_dropout=0.1).train()
    step = opake.compile_dp(
        _audio_loss, model=model, clipping_norm=0.1, backend="aot_eager", physical_batch_size=P,
        key=opake.random.key(11),
    )
    args = _audio_batch()
    saved = step.state_dict()
    first = [step(*args).clipped.grads for _ in range(2)]
    # (transformers installs its output-capturing hooks at the first forward, which the first
    # trace runs: the model it leaves behind is traced once more, DPStep._Programs, to the same
    # graph, which runs the callable already lowered: one backend compile)
    traces = step.num_traces
    step.load_state_dict(saved)
    again = [step(*args).clipped.grads for _ in range(2)]
    for a, b in zip(first, again):
        assert all(torch.equal(a[k], b[k]) for k in a)
        assert all(bool(torch.isfinite(v).all()) for v in a.values())
    assert any(not torch.equal(first[0][k], first[1][k]) for k in first[0])
    assert traces <= 2 and step.num_traces == traces and step.num_backend_compiles == 1


# ----------------------------------------------------------------------------- patch scope
def test_patches_are_scoped_to_tracing() -> None:
    from transformers import masking_utils

    originals = {n: getattr(masking_utils, n) for n in ("_ignore_bidirectional_mask_sdpa", "_ignore_causal_mask_sdpa")}
    assert not opake.patches.is_runtime_patched()
    model, loss, args = CASES["bert"]()
    seen_inside = []

    def failing(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen_inside.append((torch.compiler.is_compiling(), masking_utils._ignore_bidirectional_mask_sdpa))
        raise RuntimeError("boom")

    bad = opake.compile_dp(failing, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=P)
    with pytest.raises(opake.exceptions.UnsupportedOperationError):
        bad(*args)
    assert seen_inside and seen_inside[0][0] and seen_inside[0][1] is not originals["_ignore_bidirectional_mask_sdpa"]
    for n, f in originals.items():
        assert getattr(masking_utils, n) is f
    assert not torch.compiler.is_compiling()
    assert torch.overrides._get_current_function_mode_stack() == []
    assert not opake.patches.is_runtime_patched()
    w2v = _wav2vec2(layerdrop=0.4).train()
    failing_audio = lambda m, x, mask, y: (_ for _ in ()).throw(RuntimeError("boom"))  # noqa: E731
    with pytest.raises(opake.exceptions.UnsupportedOperationError):
        opake.compile_dp(failing_audio, model=w2v, clipping_norm=1.0, backend="aot_eager")(*_audio_batch())
    assert w2v.config.layerdrop == 0.4
    assert not any(k in m.__dict__ for m in w2v.modules() for k in ("forward", "_get_feature_vector_attention_mask", "_mask_hidden_states"))


# ----------------------------------------------------------------------------- SpecAugment
_ZERO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0)


def _frame_loss(m: nn.Module, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A per-frame head's logits pooled over frames (a cheap loss; the heads' own CTC loss with labels: test_coverage_ctc.py)."""
    return F.cross_entropy(m(input_values=x, attention_mask=mask).logits.mean(1), y)


def _ctc_model(family: str, **overrides):  # noqa: ANN003, ANN202
    """A tiny ``*ForCTC`` with the config's DEFAULT SpecAugment and LayerDrop (training mode)."""
    return tiny_ctc_model(family, **{"vocab_size": 3, **overrides})


@pytest.mark.parametrize("family", ["wav2vec2", "hubert"])
def test_default_spec_augment_trains_with_per_example_masks(family: str) -> None:
    """Default config (mask_time_prob 0.05, span 10, at least 2 spans; HuBERT also masks
    features), training mode, 2-D mask: the step runs, trains ``masked_spec_embed``, redraws
    each step, replays from its key, and one example's result does not depend on another's
    length (its masks are its own)."""
    extra = {"mask_feature_prob": 0.3, "mask_feature_length": 2} if family == "hubert" else {}
    model = _ctc_model(family, **extra)
    assert model.config.mask_time_prob > 0 and model.config.layerdrop > 0
    step = opake.compile_dp(
        _frame_loss, model=model, clipping_norm=1e4, backend="aot_eager", physical_batch_size=P, key=opake.random.key(5)
    )
    args = _audio_batch()
    saved = step.state_dict()
    first, second = step(*args), step(*args)
    embed = f"{family}.masked_spec_embed"
    assert float(first.clipped.grads[embed].abs().max()) > 0
    assert not torch.equal(first.clipped.grads[embed], second.clipped.grads[embed])
    step.load_state_dict(saved)
    again = step(*args)
    assert all(torch.equal(again.clipped.grads[k], first.clipped.grads[k]) for k in first.clipped.grads)
    # Example 1 shorter (same key): every other example's norm is bit-identical.
    step.load_state_dict(saved)
    shorter = args[1].clone()
    shorter[1, 20:] = 0
    moved = step(args[0], shorter, args[2]).clipped.per_example_norms
    others = [0, 2, 3, 4]
    assert torch.equal(moved[others], first.clipped.per_example_norms[others])
    assert not torch.equal(moved[1], first.clipped.per_example_norms[1])
    assert step.num_traces == 1
    assert not any("_mask_hidden_states" in m.__dict__ for m in model.modules())


def test_spec_augment_drawn_in_graph_matches_microbatch_oracle() -> None:
    """``mask_time_prob=1, mask_time_length=1``: every valid start is drawn, so the in-graph
    draw (uniform keys, ranks, spans) must mask exactly each example's own frames, as
    transformers' NumPy draw does in the oracle; the gradient reaches ``masked_spec_embed``
    through each example's mask."""
    model = _ctc_model("wav2vec2", mask_time_prob=1.0, mask_time_length=1, mask_time_min_masks=0, layerdrop=0.0, **_ZERO_DROPOUT)
    args = _audio_batch()
    _, norms = loop_reference(model, _frame_loss, args, 1e6)
    c = float(norms.median())
    want, _ = loop_reference(model, _frame_loss, args, c)
    assert float(want["wav2vec2.masked_spec_embed"].abs().max()) > 0
    step = opake.compile_dp(_frame_loss, model=model, clipping_norm=c, backend="aot_eager", physical_batch_size=P)
    got = step(*args)
    assert all(c.traced.has_randomness for c in step._cache.values())  # the mask is drawn in the graph
    _compare(got.clipped.grads, want)
    assert torch.allclose(got.clipped.per_example_norms.double(), norms, rtol=1e-5)


def _mask_statistics(masks: torch.Tensor, span: int) -> dict[str, torch.Tensor]:
    """Per row, over draws ``masks (N, rows, T)``: the masked fraction at each position, and the
    mean and variance of the number of masked positions and of masked runs (span structure)."""
    m = masks.double()
    runs = (m[..., 1:] > m[..., :-1]).sum(-1) + m[..., 0]
    count = m.sum(-1)
    return {"position": m.mean(0), "count": count.mean(0), "count_var": count.var(0), "runs": runs.double().mean(0)}


def _differs(a: dict, b: dict, n: int) -> list[str]:
    """Which statistics of two samplers of ``n`` draws each differ beyond 6 standard errors."""
    bad = []
    p = (a["position"] + b["position"]) / 2
    se = (2 * p * (1 - p) / n).sqrt().clamp_min(1e-3)
    if bool(((a["position"] - b["position"]).abs() > 6 * se).any()):
        bad.append("position")
    se_count = ((a["count_var"] + b["count_var"]) / n).sqrt().clamp_min(1e-3)
    if bool(((a["count"] - b["count"]).abs() > 6 * se_count).any()):
        bad.append("count")
    if bool(((a["runs"] - b["runs"]).abs() > 6 * se_count).any()):
        bad.append("runs")
    return bad


def test_spec_augment_mask_has_the_distribution_of_transformers() -> None:
    """The in-graph sampler against transformers' own ``_compute_mask_indices`` over many draws,
    for rows of several lengths (full, short, shorter than the span), with a minimum number of
    spans: per-position rates, masked counts (mean and variance: the rounding draw) and runs
    agree; wrong samplers (lengths ignored, another span length) are told apart."""
    np = pytest.importorskip("numpy")
    from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices

    from opake_compile.patches import _span_mask

    n, size, prob, span, min_spans = 2000, 30, 0.35, 4, 1
    lengths = [30, 17, 9, 3]
    attention = _padding_mask(len(lengths), size, lengths)
    cpu = torch.device("cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ours = torch.stack([_span_mask(4, size, prob, span, min_spans, attention.sum(-1), cpu) for _ in range(n)])
        blind = torch.stack([_span_mask(4, size, prob, span, min_spans, None, cpu) for _ in range(n)])
    state = np.random.get_state()
    try:
        np.random.seed(0)
        theirs = torch.stack([torch.from_numpy(_compute_mask_indices((4, size), prob, span, attention, min_spans)) for _ in range(n)])
        other_span = torch.stack([torch.from_numpy(_compute_mask_indices((4, size), prob, span - 1, attention, min_spans)) for _ in range(n)])
    finally:
        np.random.set_state(state)
    want = _mask_statistics(theirs, span)
    assert _differs(_mask_statistics(ours, span), want, n) == []
    assert _differs(_mask_statistics(blind, span), want, n) != []
    assert _differs(_mask_statistics(other_span, span), want, n) != []
    assert not bool(ours[:, 3, :3].any())  # a row shorter than the span masks none of its frames
    assert float(want["count_var"][0]) > 0  # the rounding draw is random (a fixed count would fail "count")


def test_spec_augment_rows_draw_independently_under_vmap() -> None:
    """Under ``vmap(randomness="different")`` (how compile_dp runs it) one row's mask does not
    depend on another row's length."""
    from opake_compile.patches import _span_mask

    def one(length: torch.Tensor) -> torch.Tensor:
        return _span_mask(1, 24, 0.3, 3, 1, length[None], torch.device("cpu"))[0]

    draw = torch.func.vmap(one, randomness="different")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        a = draw(torch.tensor([24, 20, 11]))
        torch.manual_seed(1)
        b = draw(torch.tensor([24, 6, 11]))
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    assert not bool(b[1, 6:].any()) and bool(a[1].any())
    assert not torch.equal(a[0], a[2])  # rows draw different masks


def test_unrecognised_spec_augment_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``_mask_hidden_states`` that is not the recognised one would freeze NumPy masks into the
    graph: refused, naming the fix."""
    from opake_compile import patches

    monkeypatch.setattr(patches, "_KNOWN_SPEC_AUGMENT", frozenset())
    monkeypatch.setattr(patches, "_SPEC_AUGMENT_KIND", {})
    model = _wav2vec2(mask_time_prob=0.2, mask_time_length=2).train()
    step = opake.compile_dp(_audio_loss, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=P)
    with pytest.raises(opake.exceptions.UnsupportedOperationError, match="mask_time_prob"):
        step(*_audio_batch())


def _tiny_whisper(**overrides):  # noqa: ANN003, ANN202
    import transformers

    cfg = transformers.WhisperConfig(
        d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=101, num_mel_bins=8, max_source_positions=8,
        max_target_positions=16, pad_token_id=1, decoder_start_token_id=2, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0, **overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.WhisperForConditionalGeneration(cfg).train()


def test_whisper_spec_augment_is_drawn_in_the_graph_per_example_and_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whisper masks its log-mel input in ``_mask_input_features`` with NumPy: the trace froze one
    mask for every example and every step (four steps, bit-identical sums: review). Drawn in
    the graph now: each step redraws, and a step replays from its key; unrecognised code is
    refused by name."""
    from opake_compile import patches

    model = _tiny_whisper(apply_spec_augment=True, mask_time_prob=0.5, mask_time_length=2, mask_feature_prob=0.5, mask_feature_length=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        x, labels = torch.randn(3, 8, 16), torch.randint(3, 101, (3, 6))
    loss = lambda m, x, lab: m(input_features=x, labels=lab).loss  # noqa: E731
    step = opake.compile_dp(loss, model=model, clipping_norm=1e-3, backend="aot_eager", physical_batch_size=3, key=opake.random.key(4))
    saved = step.state_dict()
    first, second = step(x, labels), step(x, labels)
    assert all(c.traced.has_randomness for c in step._cache.values())
    assert not torch.equal(first.clipped.per_example_norms, second.clipped.per_example_norms)
    step.load_state_dict(saved)
    assert torch.equal(step(x, labels).clipped.per_example_norms, first.clipped.per_example_norms)
    model.config.apply_spec_augment = False  # off: the traced graph draws nothing
    off = opake.compile_dp(loss, model=model, clipping_norm=1e-3, backend="aot_eager", physical_batch_size=3)
    off(x, labels)
    assert not any(c.traced.has_randomness for c in off._cache.values())

    monkeypatch.setattr(patches, "_KNOWN_INPUT_FEATURE_MASKS", frozenset())
    model.config.apply_spec_augment = True
    refused = opake.compile_dp(loss, model=model, clipping_norm=1e-3, backend="aot_eager", physical_batch_size=3)
    with pytest.raises(opake.exceptions.UnsupportedOperationError, match="_mask_input_features that compile_dp does not recognise"):
        refused(x, labels)


def test_runtime_patches_are_an_explicit_global_opt_in() -> None:
    """``apply_runtime_patches`` makes the eager ``vmap`` reference work with a 2-D mask;
    ``remove_runtime_patches`` restores the library."""
    from transformers import masking_utils

    original = masking_utils._ignore_bidirectional_mask_sdpa
    model, loss, args = CASES["bert"]()
    from _models import reference_clipped

    try:
        opake.patches.apply_runtime_patches()
        opake.patches.apply_runtime_patches()  # idempotent
        assert opake.patches.is_runtime_patched()
        assert masking_utils._ignore_bidirectional_mask_sdpa is not original
        got = reference_clipped(model, loss, args, 0.3)
    finally:
        opake.patches.remove_runtime_patches()
    assert not opake.patches.is_runtime_patched()
    assert masking_utils._ignore_bidirectional_mask_sdpa is original
    want, _ = loop_reference(model, loss, args, 0.3)
    _compare({k: v for k, v in got.grads.items()}, want)
    assert math.isfinite(float(got.per_example_norms.sum()))
