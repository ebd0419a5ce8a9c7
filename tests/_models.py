"""Small model factories and the eager oracles shared by the compiler tests.

Not a test module (leading underscore). ``property_tests/`` imports it through its conftest,
which puts this directory on ``sys.path``.

Every factory builds its module under ``torch.random.fork_rng`` with a local seed, so no test
changes (or depends on) torch's global generator. A :class:`Case` bundles a model, a batch loss
``loss_fn(model, *args)`` written for a whole batch (mean reduction unless said otherwise) and a
``make_batch(n, seed)`` that returns the positional arguments of ``step(*args)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from opake_compile.compiler.passes.numerics import effective_clipping_norm
from opake_compile.dpsgd.clipping import clipped_grad

__all__ = [
    "Case",
    "mlp_case",
    "conv2d_case",
    "conv1d_case",
    "embedding_case",
    "lora_case",
    "CASE_FACTORIES",
    "freeze_random",
    "seeded",
    "reference_clipped",
    "loop_reference",
    "tolerance",
    "assert_trees_close",
    "tree_distance",
    "inductor_retrace_backend",
    "EmptyCacheAttention",
    "TiedHead",
    "next_token_loss",
]


def inductor_retrace_backend() -> Callable[..., Any]:
    """A ``torch.compile`` backend that re-traces the graph the way Inductor does (AOTAutograd
    with Inductor's decomposition table, so with Inductor's strides) and then runs it without
    code generation: it catches graphs that only eager strides make valid, in seconds."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def run(gm, example_inputs):  # noqa: ANN001, ANN202
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=run, decompositions=select_decomp_table())


class EmptyCacheAttention(nn.Module):
    """Self-attention that appends keys and values to an *empty* cache along the time axis
    before ``q @ k^T``, as Hugging Face decoders do with ``use_cache``: the minimal form of
    the stride trap of issue 14 (Inductor lays ``cat`` of an empty part out differently)."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h, dh = self.heads, self.d // self.heads
        q, k, v = (z.view(b, t, h, dh).transpose(1, 2) for z in self.qkv(x).split(self.d, dim=-1))
        past = x.new_zeros(b, h, 0, dh)
        k, v = torch.cat([past, k], dim=-2), torch.cat([past, v], dim=-2)
        att = (q @ k.transpose(-1, -2) / math.sqrt(dh)).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, self.d))


class TiedHead(nn.Module):
    """A token embedding whose matrix is also the LM head (one parameter with an embedding
    term and a dense term in its per-example gradient), the head's input scaled by ``scale``;
    ``padding_idx`` as in ``nn.Embedding`` (its row gets no embedding gradient)."""

    def __init__(self, vocab: int, d: int, scale: float = 1.0, padding_idx: int | None = None) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.norm = nn.LayerNorm(d)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.tok(ids)) * self.scale, self.tok.weight)


def as_before_any_torch_compile(monkeypatch: Any) -> dict[str, Any]:
    """Puts nn.Module back as it was before the process's first ``torch.compile`` (which wraps
    ``__init__`` and ``__setstate__`` and sets a flag; restored by ``monkeypatch``). Returns
    nn.Module's class attributes with the wrappers read through."""
    from opake_compile.compiler.step import _dynamo_unwrapped

    original = _dynamo_unwrapped(dict(vars(nn.Module)))
    monkeypatch.setattr(nn.Module, "__init__", original["__init__"])
    monkeypatch.setattr(nn.Module, "__setstate__", original["__setstate__"])
    monkeypatch.setattr(nn.Module, "___needs_generation_tag_patch", True, raising=False)
    return original


def next_token_loss(m: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of each position's logits against the next id."""
    logits = m(ids)[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def huge_partner_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, v)``, each ``(2, 3, 1)``, for ``(Linear(1, 1, bias=False)(x) * v).sum()`` at
    C = 2^-100: example 0 has output gradients ``[v1, s, -2 s]`` against inputs
    ``[x1, 2^55, 2^54]`` (a review's construction: the last two positions cancel in G but set
    the clip factor through the mass, and the book-keeping sum's subnormal rounding of
    ``f s`` met its huge partners: 31.9 C), example 1 is ordinary."""
    s = 2.0**-40 * (1 + 47 / 48)
    x, v = torch.zeros(2, 3, 1), torch.zeros(2, 3, 1)
    v[0, :, 0] = torch.tensor([2.0**12, s, -2 * s])
    x[0, :, 0] = torch.tensor([2.0**-4, 2.0**55, 2.0**54])
    g = seeded(0)
    x[1], v[1] = torch.randn(3, 1, generator=g), torch.randn(3, 1, generator=g)
    return x, v


def _build(seed: int, fn: Callable[[], nn.Module], dtype: torch.dtype) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(int(seed))
        model = fn()
    return model.to(dtype)


@dataclasses.dataclass
class Case:
    name: str
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    make_batch: Callable[[int, int], tuple]
    dtype: torch.dtype


def _classify(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(x), y)


# ----------------------------------------------------------------------------- factories
def mlp_case(seed: int = 0, *, dtype: torch.dtype = torch.float32, layernorm: bool = True, din: int = 5, hidden: int = 7, classes: int = 3) -> Case:
    """Linear -> [LayerNorm] -> Tanh -> Linear, cross-entropy."""

    def make() -> nn.Module:
        layers: list[nn.Module] = [nn.Linear(din, hidden)]
        if layernorm:
            layers.append(nn.LayerNorm(hidden))
        layers += [nn.Tanh(), nn.Linear(hidden, classes)]
        return nn.Sequential(*layers)

    def batch(n: int, s: int) -> tuple:
        g = seeded(s)
        return (torch.randn(n, din, generator=g, dtype=dtype) * 2, torch.randint(0, classes, (n,), generator=g))

    return Case("mlp", _build(seed, make, dtype), _classify, batch, dtype)


def conv2d_case(seed: int = 0, *, dtype: torch.dtype = torch.float32, pool: str = "max", classes: int = 3) -> Case:
    """Conv2d -> ReLU -> Max/AvgPool2d -> GroupNorm -> Conv2d -> flatten -> Linear."""

    def make() -> nn.Module:
        p = nn.MaxPool2d(2) if pool == "max" else nn.AvgPool2d(2)
        return nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), p, nn.GroupNorm(2, 4),
            nn.Conv2d(4, 3, 2), nn.Flatten(), nn.Linear(3 * 2 * 2, classes),
        )

    def batch(n: int, s: int) -> tuple:
        g = seeded(s)
        return (torch.randn(n, 2, 6, 6, generator=g, dtype=dtype), torch.randint(0, classes, (n,), generator=g))

    return Case("conv2d", _build(seed, make, dtype), _classify, batch, dtype)


def conv1d_case(seed: int = 0, *, dtype: torch.dtype = torch.float32, classes: int = 2) -> Case:
    """Conv1d -> GELU -> AvgPool1d -> LayerNorm over the last dim -> Linear, MSE-like loss
    with a sum reduction (the per-example loss is the batch loss at batch one either way)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(3, 4, 3)
            self.pool = nn.AvgPool1d(2)
            self.norm = nn.LayerNorm(3)
            self.head = nn.Linear(12, classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(self.pool(F.gelu(self.conv(x))))  # (B, 4, 3)
            return self.head(h.flatten(1))

    def loss(m: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((m(x) - t) ** 2).sum()

    def batch(n: int, s: int) -> tuple:
        g = seeded(s)
        return (torch.randn(n, 3, 8, generator=g, dtype=dtype), torch.randn(n, classes, generator=g, dtype=dtype))

    return Case("conv1d", _build(seed, Net, dtype), loss, batch, dtype)


def embedding_case(seed: int = 0, *, dtype: torch.dtype = torch.float32, vocab: int = 11, d: int = 6, seq: int = 4, classes: int = 3) -> Case:
    """Token embedding + position embedding -> Linear over tokens -> LayerNorm -> mean over
    the sequence -> Linear head."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(seq, d)
            self.proj = nn.Linear(d, d)
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, classes)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(ids.shape[1], device=ids.device)
            h = self.tok(ids) + self.pos(pos)
            h = self.norm(torch.tanh(self.proj(h)))
            return self.head(h.mean(dim=1))

    def batch(n: int, s: int) -> tuple:
        g = seeded(s)
        return (torch.randint(0, vocab, (n, seq), generator=g), torch.randint(0, classes, (n,), generator=g))

    return Case("embedding", _build(seed, Net, dtype), _classify, batch, dtype)


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update ``B @ A`` (Hu et al. 2021)."""

    def __init__(self, din: int, dout: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(din, dout)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, din) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(dout, rank) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def lora_case(seed: int = 0, *, dtype: torch.dtype = torch.float32, din: int = 6, dout: int = 4, rank: int = 2) -> Case:
    def batch(n: int, s: int) -> tuple:
        g = seeded(s)
        return (torch.randn(n, din, generator=g, dtype=dtype), torch.randint(0, dout, (n,), generator=g))

    return Case("lora", _build(seed, lambda: LoRALinear(din, dout, rank), dtype), _classify, batch, dtype)


CASE_FACTORIES: dict[str, Callable[..., Case]] = {
    "mlp": mlp_case,
    "conv2d": conv2d_case,
    "conv1d": conv1d_case,
    "embedding": embedding_case,
}


def freeze_random(model: nn.Module, seed: int, p_frozen: float = 0.4) -> list[str]:
    """Freeze each parameter with probability ``p_frozen`` (at least one stays trainable).
    Returns the names of the trainable parameters."""
    rng = random.Random(seed)
    names = [n for n, _ in model.named_parameters()]
    keep = rng.choice(names)
    for n, p in model.named_parameters():
        p.requires_grad_(n == keep or rng.random() >= p_frozen)
    return [n for n, p in model.named_parameters() if p.requires_grad]


# ----------------------------------------------------------------------------- oracles
class _Wrapped(nn.Module):
    """``functional_call`` target: the user's loss around the user's model."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any) -> torch.Tensor:
        return self.loss_fn(self.model, *args)


def _state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    named = dict(model.named_parameters())
    train = {k: p.detach() for k, p in named.items() if p.requires_grad}
    rest = {f"model.{k}": p.detach() for k, p in named.items() if not p.requires_grad}
    rest.update({f"model.{k}": b for k, b in model.named_buffers()})
    return train, rest


def reference_clipped(model: nn.Module, loss_fn: Callable[..., torch.Tensor], args: tuple, clipping_norm: float, batch_argnums: Sequence[int] | None = None):
    """The eager reference: :func:`clipped_grad` (``vmap(grad)``) of the same per-example loss
    (``loss_fn`` on a batch of one) over the trainable parameters, via ``functional_call``."""
    wrapped = _Wrapped(model, loss_fn)
    train, rest = _state(model)
    batched = tuple(range(len(args))) if batch_argnums is None else tuple(batch_argnums)

    def loss(params: dict[str, torch.Tensor], *a: Any) -> torch.Tensor:
        state = {f"model.{k}": v for k, v in params.items()}
        state.update(rest)
        return torch.func.functional_call(wrapped, state, a)

    grad_fn, st = clipped_grad(loss, 0, batch_argnums=tuple(i + 1 for i in batched), clipping_norm=clipping_norm)
    out, _ = grad_fn(train, *args, state=st)
    return out


def loop_reference(model: nn.Module, loss_fn: Callable[..., torch.Tensor], args: tuple, clipping_norm: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The slowest, most obviously right oracle: a Python loop over examples at batch size one
    with ``torch.autograd.grad``, global-norm clipping in float64 to the effective clipping
    norm ``C / (1 + rho)`` of the parameters' dtype, and a sum. All args batched."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    n = int(args[0].shape[0])
    total = {k: torch.zeros(p.shape, dtype=torch.float64) for k, p in params.items()}
    norms = []
    for i in range(n):
        one = tuple(a[i : i + 1] for a in args)
        grads = torch.autograd.grad(loss_fn(model, *one), list(params.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params.values())]
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        norms.append(norm)
        if not math.isfinite(norm):
            continue
        # The library's contract clips to C / (1 + rho) (compiler/passes/numerics.py).
        c_eff = effective_clipping_norm(clipping_norm, next(iter(params.values())).dtype)
        factor = 1.0 if norm == 0 else min(1.0, c_eff / norm)
        for k, g in zip(params, grads):
            total[k] += g.double() * factor
    return total, torch.tensor(norms, dtype=torch.float64)


# ----------------------------------------------------------------------------- comparisons
def tolerance(dtype: torch.dtype, scale: float = 1.0, factor: float = 2000.0) -> float:
    """An absolute tolerance ``factor * eps(dtype) * max(1, scale)``."""
    return factor * torch.finfo(dtype).eps * max(1.0, scale)


def assert_trees_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], dtype: torch.dtype, *, factor: float = 2000.0) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    scale = max([float(w.double().abs().max()) for w in want.values() if w.numel()] + [1.0])
    tol = tolerance(dtype, scale, factor)
    for k in want:
        assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        diff = float((got[k].double() - want[k].double()).abs().max()) if want[k].numel() else 0.0
        assert diff <= tol, f"{k}: max |diff| {diff:.3g} > tol {tol:.3g}"


def tree_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Global L2 distance between two gradient dicts (float64)."""
    return math.sqrt(sum(float((a[k].double() - b[k].double()).square().sum()) for k in a))


class MathTransformer(nn.Module):
    """Token + position embedding, one pre-LN block with math-form causal attention (explicit
    matmul / softmax) and an MLP, final LayerNorm, LM head (optionally tied)."""

    def __init__(self, vocab: int = 50, d: int = 16, heads: int = 2, seq: int = 8, tied: bool = True, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, mlp_ratio * d)
        self.fc2 = nn.Linear(mlp_ratio * d, d)
        self.lnf = nn.LayerNorm(d)
        self.head = None if tied else nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        q, k, v = self.qkv(self.ln1(h)).split(h.shape[-1], dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        h = h + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        h = self.lnf(h)
        return F.linear(h, self.tok.weight) if self.head is None else self.head(h)


def tiny_ctc_model(family: str, **overrides: Any) -> nn.Module:
    """A tiny transformers ``*ForCTC`` (``"wav2vec2"`` or ``"hubert"``) with its config's
    defaults (LayerDrop, SpecAugment, dropout, blank = pad_token_id = 0) unless overridden,
    built under seed 0, in training mode. Needs ``transformers`` (callers skip without it)."""
    import transformers

    kw = dict(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, conv_dim=(4, 4),
        conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2,
        vocab_size=5, attn_implementation="eager",
    )
    kw.update(overrides)
    config_cls, model_cls = {
        "wav2vec2": (transformers.Wav2Vec2Config, transformers.Wav2Vec2ForCTC),
        "hubert": (transformers.HubertConfig, transformers.HubertForCTC),
    }[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_cls(config_cls(**kw)).train()


@contextlib.contextmanager
def no_functorch_fallback() -> Iterator[None]:
    """Fail on functorch's per-example fallback warning ("There is a performance drop because we
    have not yet implemented the batching rule ..."): an op ran once per example under vmap."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*performance drop.*")
        yield


def bookkeeping_reference(at, b, kept, factor):
    """``sum_i factor_i at_i^T b_i`` over the kept examples of ``at`` (P, K, R) and ``b``
    (P, K, C), one example at a time, products and sums in float64: the oracle of the
    book-keeping operators (``compiler/passes/_kernels.py``)."""
    out = torch.zeros(at.shape[2], b.shape[2], dtype=torch.float64)
    for i in range(at.shape[0]):
        if kept[i]:
            out += float(factor[i]) * at[i].double().T @ b[i].double()
    return out
