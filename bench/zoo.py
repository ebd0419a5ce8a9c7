"""The model zoo: real architectures, built from configs (no downloads), at two sizes.

Each entry builds ``(model, loss_fn, make_batch)`` where ``loss_fn(model, *batch)`` is the
*batch* loss a user would write (a mean over the batch, or an HF model's ``.loss``) and
``make_batch(b, generator)`` returns the batch tensors, every one with a leading batch
dimension. ``size="tiny"`` is what the unit tests compile (seconds under ``aot_eager``);
``size="bench"`` is what ``bench_zoo.py`` times.

The privacy unit is one row of the batch: one sequence, one image, one utterance. Padding is
real (sequences of different lengths with a 2-D ``attention_mask``) wherever the architecture
takes one, because that is what users pass.

    from zoo import ZOO, build
    model, loss_fn, make_batch = build("bert", "tiny")
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Entry:
    """One zoo model: its builder and what it needs."""

    name: str
    what: str
    build: Callable[[str], tuple[nn.Module, Callable[..., torch.Tensor], Callable[[int, torch.Generator], tuple]]]
    needs: tuple[str, ...] = ()  # optional packages (transformers, peft)
    bench_batch: int = 8


def available(entry: Entry) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in entry.needs)


def _lengths(b: int, t: int, g: torch.Generator, lo: int | None = None) -> torch.Tensor:
    """Per-example lengths in [lo, t], the first one full (so T is the real maximum)."""
    lo = max(1, t // 2) if lo is None else lo
    n = torch.randint(lo, t + 1, (b,), generator=g)
    n[0] = t
    return n


def _padding_mask(lengths: torch.Tensor, t: int) -> torch.Tensor:
    """2-D mask (B, T): 1 for real tokens, 0 for right padding."""
    return (torch.arange(t)[None, :] < lengths[:, None]).long()


# ----------------------------------------------------------------------------- transformers
def _gpt2(size: str, *, lora: bool = False):
    import transformers

    tiny = size == "tiny"
    cfg = transformers.GPT2Config(
        n_embd=32 if tiny else 768, n_layer=2, n_head=2 if tiny else 12, vocab_size=101 if tiny else 8192,
        n_positions=64 if tiny else 512, bos_token_id=0, eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg)  # tied LM head, default (SDPA) attention
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4 if tiny else 8, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.1))
    t = 12 if tiny else 256

    def make_batch(b: int, g: torch.Generator) -> tuple:
        ids = torch.randint(1, cfg.vocab_size, (b, t), generator=g)
        return (ids, _padding_mask(_lengths(b, t, g), t))

    def loss_fn(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        labels = ids.masked_fill(mask == 0, -100)
        return m(input_ids=ids, attention_mask=mask, labels=labels).loss

    return model, loss_fn, make_batch


def _decoder(kind: str, size: str):
    """A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention), or Mixtral's
    mixture of experts on it (top-2 of 4 experts per token, transformers' "batched_mm" expert
    kernel: the default one groups tokens by expert with data-dependent shapes)."""
    import transformers

    tiny = size == "tiny"
    d, heads = (32, 4) if tiny else (768, 12)
    common = dict(hidden_size=d, intermediate_size=2 * d if tiny else 2048, num_hidden_layers=2, num_attention_heads=heads,
                  num_key_value_heads=heads // 2, vocab_size=101 if tiny else 8192, max_position_embeddings=64 if tiny else 512,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm")
        model = transformers.MixtralForCausalLM(cfg)
    t = 12 if tiny else 256

    def make_batch(b: int, g: torch.Generator) -> tuple:
        ids = torch.randint(1, common["vocab_size"], (b, t), generator=g)
        return (ids, _padding_mask(_lengths(b, t, g), t))

    def loss_fn(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        labels = ids.masked_fill(mask == 0, -100)
        return m(input_ids=ids, attention_mask=mask, labels=labels).loss

    return model, loss_fn, make_batch


def _encoder_classifier(kind: str, size: str, *, lora: bool = False):
    import transformers

    tiny = size == "tiny"
    d, heads, layers = (32, 2, 2) if tiny else (768, 12, 2)
    common = dict(hidden_size=d, num_attention_heads=heads, num_hidden_layers=layers, intermediate_size=4 * d,
                  vocab_size=101 if tiny else 8192, max_position_embeddings=64 if tiny else 514, num_labels=3)
    if kind == "bert":
        model = transformers.BertForSequenceClassification(transformers.BertConfig(**common))
    else:
        model = transformers.RobertaForSequenceClassification(transformers.RobertaConfig(**common, pad_token_id=1))
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=4 if tiny else 8, lora_alpha=8, target_modules=["query", "value"], task_type="SEQ_CLS"))
    t = 10 if tiny else 128

    def make_batch(b: int, g: torch.Generator) -> tuple:
        ids = torch.randint(3, common["vocab_size"], (b, t), generator=g)
        mask = _padding_mask(_lengths(b, t, g), t)
        ids = ids.masked_fill(mask == 0, 1 if kind == "roberta" else 0)
        return (ids, mask, torch.randint(0, 3, (b,), generator=g))

    def loss_fn(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, attention_mask=mask, labels=y).loss

    return model, loss_fn, make_batch


def _t5(size: str):
    import transformers

    tiny = size == "tiny"
    cfg = transformers.T5Config(
        d_model=32 if tiny else 512, d_kv=16 if tiny else 64, d_ff=64 if tiny else 2048, num_layers=2,
        num_heads=2 if tiny else 8, vocab_size=101 if tiny else 8192, decoder_start_token_id=0, pad_token_id=0,
    )
    model = transformers.T5ForConditionalGeneration(cfg)
    t_in, t_out = (10, 6) if tiny else (128, 32)

    def make_batch(b: int, g: torch.Generator) -> tuple:
        ids = torch.randint(2, cfg.vocab_size, (b, t_in), generator=g)
        mask = _padding_mask(_lengths(b, t_in, g), t_in)
        labels = torch.randint(2, cfg.vocab_size, (b, t_out), generator=g)
        return (ids.masked_fill(mask == 0, 0), mask, labels)

    def loss_fn(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, attention_mask=mask, labels=labels).loss

    return model, loss_fn, make_batch


def _vit(size: str):
    import transformers

    tiny = size == "tiny"
    cfg = transformers.ViTConfig(
        image_size=16 if tiny else 224, patch_size=4 if tiny else 16, hidden_size=32 if tiny else 768,
        num_hidden_layers=2, num_attention_heads=2 if tiny else 12, intermediate_size=64 if tiny else 3072,
        num_labels=5,
    )
    model = transformers.ViTForImageClassification(cfg)

    def make_batch(b: int, g: torch.Generator) -> tuple:
        return (torch.randn(b, 3, cfg.image_size, cfg.image_size, generator=g), torch.randint(0, 5, (b,), generator=g))

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return m(pixel_values=x, labels=y).loss

    return model, loss_fn, make_batch


def _wav2vec2(size: str):
    import transformers

    tiny = size == "tiny"
    cfg = transformers.Wav2Vec2Config(
        hidden_size=32 if tiny else 256, num_hidden_layers=2, num_attention_heads=2 if tiny else 4,
        intermediate_size=64 if tiny else 1024, conv_dim=(16, 16) if tiny else (128, 128, 128),
        conv_kernel=(10, 3) if tiny else (10, 3, 3), conv_stride=(5, 2) if tiny else (5, 2, 2),
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, feat_extract_norm="layer",
        do_stable_layer_norm=True, vocab_size=12,
        # Defaults otherwise: LayerDrop 0.1, SpecAugment (mask_time_prob 0.05), blank = pad_token_id = 0,
        # ctc_loss_reduction "sum", ctc_zero_infinity False.
    )
    model = transformers.Wav2Vec2ForCTC(cfg)
    # Frames after the feature encoder: 19 (tiny, 200 samples) and 199 (bench, 4000 samples,
    # a quarter second at 16 kHz). CTC is one kernel call per batch (its graph does not grow with T).
    t = 200 if tiny else 4000
    width = 4 if tiny else 24

    def make_batch(b: int, g: torch.Generator) -> tuple:
        lengths = _lengths(b, t, g)
        mask = _padding_mask(lengths, t)
        x = torch.randn(b, t, generator=g) * mask
        # Transcripts of 1..width labels in [1, vocab), padded with -100 (transformers' convention);
        # short enough that every example has an alignment.
        n = torch.randint(1, width + 1, (b,), generator=g)
        labels = torch.randint(1, cfg.vocab_size, (b, width), generator=g)
        labels = torch.where(torch.arange(width)[None, :] < n[:, None], labels, -100)
        return (x, mask, labels)

    def loss_fn(m: nn.Module, x: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return m(input_values=x, attention_mask=mask, labels=labels).loss

    return model, loss_fn, make_batch


def _tied_lm(size: str):
    tiny = size == "tiny"
    vocab, d, t = (50, 16, 8) if tiny else (8192, 512, 128)

    class TiedLM(nn.Module):
        """Embedding, a GRU-free MLP mixer, and a decoder that shares the embedding matrix."""

        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.mix = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
            self.norm = nn.LayerNorm(d)
            self.decoder = nn.Linear(d, vocab, bias=False)
            self.decoder.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            return self.decoder(self.norm(h + self.mix(h)))

    def make_batch(b: int, g: torch.Generator) -> tuple:
        return (torch.randint(0, vocab, (b, t), generator=g),)

    def loss_fn(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

    return TiedLM(), loss_fn, make_batch


# ----------------------------------------------------------------------------- torch.nn
class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.n1 = nn.GroupNorm(min(8, cout // 2), cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.n2 = nn.GroupNorm(min(8, cout // 2), cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(min(8, cout // 2), cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.n2(self.c2(F.relu(self.n1(self.c1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet18GN(nn.Module):
    """ResNet-18 (He et al. 2016) with GroupNorm in place of BatchNorm, the usual DP choice
    (BatchNorm mixes examples). ``width`` is the first stage's channel count (64 in the paper)."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.GroupNorm(min(8, w // 2), w), nn.ReLU())
        stages, cin = [], w
        for i, cout in enumerate((w, 2 * w, 4 * w, 8 * w)):
            stages += [_Block(cin, cout, 1 if i == 0 else 2), _Block(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


def _resnet18_gn(size: str):
    tiny = size == "tiny"
    model = ResNet18GN(width=4 if tiny else 64)
    hw = 8 if tiny else 32

    def make_batch(b: int, g: torch.Generator) -> tuple:
        return (torch.randn(b, 3, hw, hw, generator=g), torch.randint(0, 10, (b,), generator=g))

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(x), y)

    return model, loss_fn, make_batch


def _recurrent(kind: str, size: str):
    tiny = size == "tiny"
    vocab, d, h, t = (30, 8, 12, 7) if tiny else (8192, 256, 512, 64)
    cell = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]

    class Classifier(nn.Module):
        """Embedding -> 2-layer bidirectional recurrent net -> linear head on the final states."""

        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.rnn = cell(d, h, num_layers=2, batch_first=True, bidirectional=True, dropout=0.1)
            self.head = nn.Linear(2 * h, 3)

        def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids)
            if kind == "lstm":  # packed: each sequence stops at its own length
                packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
                _, (hn, _) = self.rnn(packed)
            else:
                _, hn = self.rnn(x)
            return self.head(torch.cat([hn[-2], hn[-1]], dim=-1))

    def make_batch(b: int, g: torch.Generator) -> tuple:
        return (torch.randint(0, vocab, (b, t), generator=g), _lengths(b, t, g), torch.randint(0, 3, (b,), generator=g))

    def loss_fn(m: nn.Module, ids: torch.Tensor, lengths: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(ids, lengths), y)

    return Classifier(), loss_fn, make_batch


def _transformer_encoder(size: str):
    tiny = size == "tiny"
    vocab, d, heads, t = (50, 16, 2, 8) if tiny else (8192, 256, 8, 128)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(d, 3)

        def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            h = self.enc(self.emb(ids), src_key_padding_mask=mask == 0)
            keep = mask.unsqueeze(-1).to(h.dtype)
            return self.head((h * keep).sum(1) / keep.sum(1))

    def make_batch(b: int, g: torch.Generator) -> tuple:
        return (torch.randint(0, vocab, (b, t), generator=g), _padding_mask(_lengths(b, t, g), t), torch.randint(0, 3, (b,), generator=g))

    def loss_fn(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(ids, mask), y)

    return Encoder(), loss_fn, make_batch


ZOO: dict[str, Entry] = {
    e.name: e
    for e in (
        Entry("gpt2", "GPT-2 (tied LM head, SDPA attention, 2-D padding mask)", _gpt2, ("transformers",)),
        Entry("llama", "Llama decoder (RMSNorm, rotary, grouped-query attention), 2-D padding mask", lambda s: _decoder("llama", s), ("transformers",)),
        Entry("mixtral", "Mixtral mixture of experts (top-2 of 4, batched_mm experts), 2-D padding mask", lambda s: _decoder("mixtral", s), ("transformers",)),
        Entry("bert", "BERT sequence classifier, 2-D padding mask", lambda s: _encoder_classifier("bert", s), ("transformers",)),
        Entry("roberta", "RoBERTa sequence classifier, 2-D padding mask", lambda s: _encoder_classifier("roberta", s), ("transformers",)),
        Entry("t5", "T5 encoder-decoder, 2-D padding mask", _t5, ("transformers",)),
        Entry("vit", "ViT image classifier (ViT-B/16 width at bench size, 224x224)", _vit, ("transformers",)),
        Entry("wav2vec2", "Wav2Vec2ForCTC trained with its labels (CTC), 2-D mask, default LayerDrop and SpecAugment", _wav2vec2, ("transformers",)),
        Entry("resnet18_gn", "ResNet-18 with GroupNorm, 32x32 images", _resnet18_gn),
        Entry("lstm_packed", "2-layer bidirectional LSTM over packed sequences", lambda s: _recurrent("lstm", s)),
        Entry("gru", "2-layer bidirectional GRU", lambda s: _recurrent("gru", s)),
        Entry("transformer_encoder", "nn.TransformerEncoder (SDPA), key padding mask", _transformer_encoder),
        Entry("lora_gpt2", "PEFT LoRA on GPT-2's attention (adapters trained)", lambda s: _gpt2(s, lora=True), ("transformers", "peft")),
        Entry("lora_bert", "PEFT LoRA on BERT's query/value (adapters and head trained)", lambda s: _encoder_classifier("bert", s, lora=True), ("transformers", "peft")),
        Entry("tied_lm", "embedding and decoder sharing one matrix", _tied_lm),
    )
}


def build(name: str, size: str = "tiny", seed: int = 0):
    """``(model, loss_fn, make_batch)`` of a zoo entry, weights seeded by ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ZOO[name].build(size)


def fast_path_share(model: nn.Module, coverage: dict[str, str]) -> float:
    """Fraction of trainable elements whose per-example gradient is never materialised, by
    element count (the library's ``fast_path_share`` on this model's parameter sizes)."""
    from opake_compile.compiler.passes.rewrites import fast_path_share as share

    return share(coverage, {k: p.numel() for k, p in model.named_parameters()})
