"""Scaled dot-product attention traces as one batched computation (issue 14, item 3).

Without a batching rule, ``vmap`` runs CPU SDPA as a per-example loop that ``make_fx`` unrolls
into P attention calls per layer. These tests count attention nodes at two physical batch
sizes (the graph must not depend on P), check that no "performance drop" fallback warning is
raised, and compare compiled clipped sums (``aot_eager``) with the loop oracle at batch size
one for ``nn.MultiheadAttention``, ``nn.TransformerEncoder``, raw ``F.scaled_dot_product_attention``
(causal, boolean and additive masks, a custom scale, grouped-query attention) and a Hugging
Face GPT-2 with ``attn_implementation="sdpa"``.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opake_compile as opake
from _models import assert_trees_close, loop_reference, no_functorch_fallback, seeded
from opake_compile import compile_dp
from opake_compile.compiler._sdpa import batched_attention
from opake_compile.compiler.trace import trace_per_example_grads

F64 = torch.float64
D, H, T = 8, 2, 5


def _build(make, seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        return make().to(F64)


def _pad_mask(n, seed):
    """(n, T) key padding, True = padding: each example keeps at least two positions."""
    lengths = torch.randint(2, T + 1, (n,), generator=seeded(seed))
    return torch.arange(T).expand(n, T) >= lengths[:, None]


class _SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.head = nn.Linear(D, 3)

    def forward(self, x, pad):  # noqa: ANN001, ANN201
        y, _ = self.attn(x, x, x, key_padding_mask=pad, need_weights=False)
        return self.head(y.mean(1))


class _Encoder(nn.Module):
    def __init__(self, layers: int = 1) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(D, H, 16, dropout=0.2, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(D, 3)

    def forward(self, x, pad):  # noqa: ANN001, ANN201
        return self.head(self.enc(x, src_key_padding_mask=pad).mean(1))


class _RawAttention(nn.Module):
    """Four SDPA calls: causal; a per-example boolean mask; a per-example additive mask with a
    custom scale; grouped-query attention (H query heads over one key/value head)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(D, D)
        self.kv = nn.Linear(D, 2 * D)
        self.kv_one = nn.Linear(D, 2 * (D // H))
        self.head = nn.Linear(D, 3)

    def forward(self, x, bool_mask, add_mask):  # noqa: ANN001, ANN201
        b = x.shape[0]
        heads = lambda z: z.view(b, T, -1, D // H).transpose(1, 2)  # noqa: E731
        q = heads(self.q(x))
        k, v = (heads(z) for z in self.kv(x).chunk(2, -1))
        k1, v1 = (heads(z) for z in self.kv_one(x).chunk(2, -1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out + F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
        out = out + F.scaled_dot_product_attention(q, k, v, attn_mask=add_mask, scale=0.2)
        out = out + F.scaled_dot_product_attention(q, k1, v1, enable_gqa=True)
        return self.head(out.transpose(1, 2).reshape(b, T, D).mean(1))


def _classify(m, *a):  # noqa: ANN001, ANN202
    *inputs, y = a
    return F.cross_entropy(m(*inputs), y)


def _batch(kind, n, seed):
    x = torch.randn(n, T, D, generator=seeded(seed), dtype=F64)
    y = torch.randint(0, 3, (n,), generator=seeded(seed + 1))
    if kind == "raw":
        bool_mask = torch.rand(n, 1, T, T, generator=seeded(seed + 2)) > 0.3
        bool_mask |= torch.eye(T, dtype=torch.bool)  # every query sees at least itself
        add_mask = torch.randn(n, H, T, T, generator=seeded(seed + 3), dtype=F64)
        return (x, bool_mask, add_mask, y)
    return (x, _pad_mask(n, seed + 2), y)


_MODELS = {"mha": _SelfAttention, "encoder": _Encoder, "encoder-2": lambda: _Encoder(2), "raw": _RawAttention}


def _attention_nodes(gm):  # noqa: ANN001, ANN202
    return [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


@pytest.mark.parametrize("kind", ["encoder-2", "raw"])
def test_attention_is_traced_once_whatever_the_batch_size(kind):
    model = _build(_MODELS[kind]).eval()
    counts = []
    for p in (2, 8):
        with no_functorch_fallback():
            traced = trace_per_example_grads(
                model, _classify, _batch(kind, p, 0), batched_positions=tuple(range(4 if kind == "raw" else 3)), physical_batch_size=p
            )
        counts.append((len(traced.gm.graph.nodes), len(_attention_nodes(traced.gm))))
    assert counts[0] == counts[1], counts  # a per-example loop would grow with P
    # One fused forward and one fused backward per attention call, not one per example.
    calls = 2 if kind == "encoder-2" else 4
    assert counts[0][1] == 2 * calls, counts


@pytest.mark.parametrize("kind", ["mha", "encoder", "raw"])
def test_compiled_matches_loop_oracle(kind):
    model = _build(_MODELS[kind]).eval()
    args = _batch(kind, 6, 1)
    with no_functorch_fallback():
        out = compile_dp(_classify, model=model, clipping_norm=0.05, physical_batch_size=4, backend="aot_eager")(*args)
    want, norms = loop_reference(model, _classify, args, 0.05)
    assert bool((norms > 0.05).any())  # clipping happens, so a wrong per-example split shows
    assert_trees_close(out.clipped.grads, want, F64)
    torch.testing.assert_close(out.clipped.per_example_norms, norms)


def test_encoder_training_mode_dropout_is_per_example():
    model = _build(_Encoder).train()
    x, pad, y = _batch("encoder", 1, 2)
    args = (x.expand(4, T, D).clone(), pad.expand(4, T).clone(), y.expand(4).clone())  # identical examples
    step = compile_dp(_classify, model=model, clipping_norm=1e6, physical_batch_size=4, backend="aot_eager", key=opake.random.key(0))
    norms = step(*args).clipped.per_example_norms
    assert bool(torch.isfinite(norms).all())
    assert len(set(norms.tolist())) == 4, norms  # independent dropout masks per example


def test_hugging_face_gpt2_with_sdpa_attention():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=60, n_positions=8,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        attn_implementation="sdpa",
    )
    model = _build(lambda: transformers.GPT2LMHeadModel(cfg)).eval()
    assert model.config._attn_implementation == "sdpa"
    loss = lambda m, ids: m(input_ids=ids, labels=ids).loss  # noqa: E731
    ids = torch.randint(0, 60, (5, 6), generator=seeded(4))
    with no_functorch_fallback():
        step = compile_dp(loss, model=model, clipping_norm=0.05, physical_batch_size=4, backend="aot_eager")
        out = step(ids)
    want, norms = loop_reference(model, loss, (ids,), 0.05)
    assert_trees_close(out.clipped.grads, want, F64)
    torch.testing.assert_close(out.clipped.per_example_norms, norms)


# ----------------------------------------------------------------------------- the rules, eagerly
def _attn_loss(kw):  # noqa: ANN001, ANN202
    def loss(w, x, mask):  # noqa: ANN001, ANN202
        q = (x @ w).view(T, H, D // H).transpose(0, 1).unsqueeze(0)
        extra = {} if mask is None else {"attn_mask": mask}
        return F.scaled_dot_product_attention(q, q.sin(), q * 0.5, **kw, **extra).square().sum()

    return loss


_MASKS = {
    "none": (lambda n: None, None),
    "bool, per example (1, 1, T, T)": (lambda n: torch.rand(n, 1, 1, T, T, generator=seeded(5)) > 0.4, 0),
    "additive, per example (T, T)": (lambda n: torch.randn(n, T, T, generator=seeded(6), dtype=F64), 0),
    "additive, per example, batch dim last": (lambda n: torch.randn(1, H, T, T, n, generator=seeded(7), dtype=F64), 4),
    "bool, shared (T, T)": (lambda n: torch.rand(T, T, generator=seeded(8)) > 0.4, None),
    "additive, shared (1, H, T, T)": (lambda n: torch.randn(1, H, T, T, generator=seeded(9), dtype=F64), None),
}


_RULE_CASES = [(m, {}) for m in _MASKS] + [("none", {"is_causal": True}), ("bool, per example (1, 1, T, T)", {"scale": 0.3})]


@pytest.mark.parametrize(("mask_kind", "kw"), _RULE_CASES, ids=[f"{m}-{sorted(kw)}" for m, kw in _RULE_CASES])
def test_batching_rules_equal_a_loop(mask_kind, kw):
    make_mask, mask_dim = _MASKS[mask_kind]
    n = 3
    w = torch.randn(D, D, generator=seeded(10), dtype=F64)
    x = torch.randn(n, T, D, generator=seeded(11), dtype=F64)
    mask = make_mask(n)
    loss = _attn_loss(kw)
    per_example = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, mask_dim))
    with no_functorch_fallback(), batched_attention():
        got = per_example(w, x, mask)
    one = lambda i: None if mask is None else (mask if mask_dim is None else mask.select(mask_dim, i))  # noqa: E731
    want = torch.stack([torch.func.grad(loss)(w, x[i], one(i)) for i in range(n)])
    torch.testing.assert_close(got, want, rtol=0, atol=1e3 * torch.finfo(F64).eps * float(want.abs().max()))


def test_rules_are_registered_only_inside_the_block():
    has_rule = lambda: torch._C._dispatch_has_kernel_for_dispatch_key(  # noqa: E731
        "aten::_scaled_dot_product_flash_attention_for_cpu", "FuncTorchBatched"
    )
    assert not has_rule()
    with batched_attention():
        with batched_attention():  # re-entrant
            assert has_rule()
        assert has_rule()
    assert not has_rule()


def test_nested_vmap_with_inputs_batched_at_different_levels():
    q = torch.randn(3, 4, 1, 2, 5, 8, generator=seeded(12), dtype=F64)
    k = torch.randn(3, 1, 2, 7, 8, generator=seeded(13), dtype=F64)
    f = lambda q, k: F.scaled_dot_product_attention(q, k, k.sin())  # noqa: E731
    with no_functorch_fallback(), batched_attention():
        inner_q_only = torch.func.vmap(torch.func.vmap(f, in_dims=(0, None)))(q, k)
        inner_k_only = torch.func.vmap(torch.func.vmap(f, in_dims=(None, 0)), in_dims=(0, None))(q[:, 0], k)
    want = torch.stack([torch.stack([f(q[i, j], k[i]) for j in range(4)]) for i in range(3)])
    torch.testing.assert_close(inner_q_only, want)
    want = torch.stack([torch.stack([f(q[i, 0], k[j]) for j in range(3)]) for i in range(3)])
    torch.testing.assert_close(inner_k_only, want)
