#!/usr/bin/env python
"""Benchmark of the DP step against non-private training and Opacus.

For each model, every configuration runs in its own subprocess (fresh Dynamo/Inductor state,
a fresh Inductor cache directory, its own peak-memory and max-RSS figures):

  np_eager             non-private: zero_grad; loss.backward()                    (eager)
  np_compiled_grad     non-private: torch.compile(torch.func.grad step) under no_grad on
                       detached trainable params
  np_compiled_backward non-private: torch.compile(loss) then .backward() (AOTAutograd fw+bw)
  dp_materialized      compile_dp(..., rewrites=[])   every per-example gradient materialised
  dp_default           compile_dp(..., rewrites=None) the library's default rewrite passes
  dp_fused             the same with GhostClipping(bookkeeping="fused") (speed over memory)
  opacus_hooks         Opacus GradSampleModule + DPOptimizer.pre_step (noise 0)
  opacus_ghost         Opacus GradSampleModuleFastGradientClipping (ghost clipping, noise 0)

The ratio column divides by the fastest of the two compiled non-private steps ("THE baseline").
C is the median per-example gradient norm, computed once per model with the library's eager
reference (opake.clipped_grad); DP and Opacus rows also report the relative max error of their
clipped sum against that reference on the same batch.

    python bench/bench_step.py --models mlp,cnn,transformer --reps 20
    python bench/bench_step.py --models all --quick          # smoke test, tiny sizes
    python bench/bench_step.py --models mlp --device cuda

See bench/README.md for what each column means and how memory is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

RESULT_TAG = "BENCH_RESULT "
ALL_CONFIGS = (
    "np_eager",
    "np_compiled_grad",
    "np_compiled_backward",
    "dp_materialized",
    "dp_default",
    "dp_fused",
    "opacus_hooks",
    "opacus_ghost",
)
BASELINE_CONFIGS = ("np_compiled_grad", "np_compiled_backward")
CORE_MODELS = ("mlp", "cnn", "transformer")
OPTIONAL_MODELS = ("encoder", "gpt2", "gpt2_t512", "mlp_lora")
NUM_POISSON = 20


# --------------------------------------------------------------------------------- models
@dataclasses.dataclass
class Spec:
    """One benchmark model: the module, how to make a batch, the batch loss, Opacus glue."""

    name: str
    model: Any  # nn.Module
    batch_size: int
    make_batch: Callable[[int, Any], tuple]  # (n, torch.Generator) -> args (CPU tensors)
    # (module, *args) -> (logits 2-D, targets 1-D, shape or None): the loss is the mean
    # cross-entropy over all rows; for a sequence model, shape=(B, T) tells Opacus' ghost
    # clipping how rows group into examples (the per-example loss is the mean over T).
    logits_targets: Callable[..., tuple]
    description: str

    def loss_fn(self, model: Any, *args: Any) -> Any:
        import torch.nn.functional as F

        logits, targets, _ = self.logits_targets(model, *args)
        return F.cross_entropy(logits, targets)


def _classify(module: Any, x: Any, y: Any) -> tuple:
    return module(x), y, None


def build_mlp(quick: bool) -> Spec:
    import torch
    import torch.nn as nn

    d_in, h, b = (64, 64, 16) if quick else (256, 512, 256)
    model = nn.Sequential(nn.Linear(d_in, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))

    def make_batch(n: int, g: Any) -> tuple:
        return torch.randn(n, d_in, generator=g), torch.randint(0, 10, (n,), generator=g)

    return Spec("mlp", model, b, make_batch, _classify, f"MLP {d_in}-{h}-{h}-10, B={b}")


def build_mlp_lora(quick: bool, rank: int = 8) -> Spec:
    import torch
    import torch.nn as nn

    class _LoRALinear(nn.Module):
        """Frozen ``base`` plus trainable rank-r adapters: base(x) + B(A(x)) * alpha / r."""

        def __init__(self, d_in: int, d_out: int, r: int) -> None:
            super().__init__()
            self.base = nn.Linear(d_in, d_out)
            self.base.requires_grad_(False)
            self.lora_a = nn.Linear(d_in, r, bias=False)
            self.lora_b = nn.Linear(r, d_out, bias=False)
            nn.init.normal_(self.lora_b.weight, std=0.02)  # nonzero so both adapters get gradient
            self.scale = 16.0 / r

        def forward(self, x: Any) -> Any:
            return self.base(x) + self.lora_b(self.lora_a(x)) * self.scale

    d_in, h, b = (64, 64, 16) if quick else (256, 512, 256)
    model = nn.Sequential(
        _LoRALinear(d_in, h, rank), nn.ReLU(), _LoRALinear(h, h, rank), nn.ReLU(), _LoRALinear(h, 10, rank)
    )

    def make_batch(n: int, g: Any) -> tuple:
        return torch.randn(n, d_in, generator=g), torch.randint(0, 10, (n,), generator=g)

    return Spec(
        "mlp_lora", model, b, make_batch, _classify,
        f"MLP {d_in}-{h}-{h}-10 frozen + rank-{rank} LoRA adapters trainable, B={b}",
    )


def build_cnn(quick: bool) -> Spec:
    import torch
    import torch.nn as nn

    b = 16 if quick else 256
    # Opacus' MNIST example CNN.
    model = nn.Sequential(
        nn.Conv2d(1, 16, 8, 2, padding=3), nn.ReLU(), nn.MaxPool2d(2, 1),
        nn.Conv2d(16, 32, 4, 2), nn.ReLU(), nn.MaxPool2d(2, 1),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10),
    )

    def make_batch(n: int, g: Any) -> tuple:
        return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)

    return Spec("cnn", model, b, make_batch, _classify, f"Opacus MNIST CNN 1x28x28, B={b}")


def build_transformer(quick: bool) -> Spec:
    import torch
    import torch.nn as nn

    d, heads, t, vocab, b, n_cls = (32, 2, 16, 100, 8, 10) if quick else (128, 4, 64, 1000, 32, 10)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)
            self.ln2 = nn.LayerNorm(d)
            self.fc1 = nn.Linear(d, 4 * d)
            self.fc2 = nn.Linear(4 * d, d)

        def forward(self, x: Any) -> Any:
            bsz, n, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.reshape(bsz, n, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            # Attention in math form (SDPA has no vmap batching rule).
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // heads))
            causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(causal, float("-inf"))
            att = torch.softmax(scores, dim=-1) @ v
            x = x + self.proj(att.transpose(1, 2).reshape(bsz, n, d))
            return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))

    class GPTClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab, d)
            self.pos = nn.Embedding(t, d)
            self.blocks = nn.Sequential(Block(), Block())
            self.ln_f = nn.LayerNorm(d)
            self.head = nn.Linear(d, n_cls)

        def forward(self, ids: Any) -> Any:
            bsz, n = ids.shape
            # Contiguous position ids: Opacus' ghost embedding sampler crashes on an expand().
            pos = torch.arange(n, device=ids.device).unsqueeze(0).repeat(bsz, 1)
            h = self.blocks(self.tok(ids) + self.pos(pos))
            return self.head(self.ln_f(h).mean(dim=1))

    model = GPTClassifier()

    def make_batch(n: int, g: Any) -> tuple:
        return torch.randint(0, vocab, (n, t), generator=g), torch.randint(0, n_cls, (n,), generator=g)

    return Spec(
        "transformer", model, b, make_batch, _classify,
        f"2-layer transformer d={d} heads={heads} T={t} vocab={vocab}, mean-pool {n_cls}-class head, B={b}",
    )


def build_encoder(quick: bool) -> Spec:
    """``nn.TransformerEncoder`` (the performance issue's SDPA row): 2 layers, d=128, 4 heads,
    MLP 512, dropout 0 (CPU attention takes the fused SDPA kernel), mean-pool 10-class head on
    (B, T=64, 128) float features, B=32."""
    import torch.nn as nn

    d, heads, ff, t, b = (32, 2, 64, 16, 8) if quick else (128, 4, 512, 64, 32)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(d, 10)

        def forward(self, x: Any) -> Any:
            return self.head(self.enc(x).mean(1))

    def make_batch(n: int, g: Any) -> tuple:
        import torch

        return torch.randn(n, t, d, generator=g), torch.randint(0, 10, (n,), generator=g)

    return Spec("encoder", Encoder(), b, make_batch, _classify, f"nn.TransformerEncoder 2 layers d={d} T={t} (SDPA), B={b}")


def build_gpt2(quick: bool, *, long: bool = False) -> Spec:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if quick:
        n_embd, n_head, vocab, t, b = 32, 2, 500, 16, 4
    elif long:
        # GPT-2-small width at a realistic sequence length (vocab cut to keep the LM head from
        # dominating a 2-core step): the shape where sequence layers take the mixed path.
        n_embd, n_head, vocab, t, b = 768, 12, 8192, 512, 2
    else:
        n_embd, n_head, vocab, t, b = 768, 12, 50257, 64, 8
    cfg = GPT2Config(
        n_layer=2, n_embd=n_embd, n_head=n_head, vocab_size=vocab, n_positions=max(t, 64),
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )
    # Eager attention, kept so that this row stays comparable with its earlier measurements;
    # bench_shapes.py times transformers' default (SDPA, which compile_dp batches since
    # 2026-11-30) and takes --attention eager for this form.
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg)  # random weights, tied wte / lm_head, no download
    assert model.config._attn_implementation == "eager", model.config._attn_implementation

    def make_batch(n: int, g: Any) -> tuple:
        return (torch.randint(0, vocab, (n, t), generator=g),)

    def logits_targets(module: Any, ids: Any) -> tuple:
        # Explicit all-ones attention mask and (B, T) position ids: without a mask, transformers
        # inspects the position ids for packed sequences with data-dependent control flow that
        # make_fx(vmap(...)) cannot trace (its is_tracing() does not see functorch/make_fx);
        # (B, T) position ids because Opacus' hooks mis-handle a (1, T) wpe input.
        ones = torch.ones_like(ids)
        pos = torch.cumsum(ones, dim=1) - 1
        logits = module(input_ids=ids, attention_mask=ones, position_ids=pos, use_cache=False).logits[:, :-1]
        return logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), (ids.shape[0], ids.shape[1] - 1)

    return Spec(
        "gpt2_t512" if long and not quick else "gpt2", model, b, make_batch, logits_targets,
        f"GPT-2 shaped (transformers {__import__('transformers').__version__}) n_layer=2 n_embd={n_embd} "
        f"heads={n_head} vocab={vocab} T={t}, tied LM head, eager attention, B={b}",
    )


BUILDERS = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "transformer": build_transformer,
    "encoder": build_encoder,
    "gpt2": build_gpt2,
    "gpt2_t512": lambda quick: build_gpt2(quick, long=True),
    "mlp_lora": build_mlp_lora,
}


def build(name: str, quick: bool, device: str) -> tuple[Spec, tuple]:
    """The model (seeded, identical in every subprocess) and the fixed timing batch."""
    import torch

    torch.manual_seed(0)
    spec = BUILDERS[name](quick)
    spec.model.to(device)
    g = torch.Generator().manual_seed(1)
    args = tuple(a.to(device) for a in spec.make_batch(spec.batch_size, g))
    return spec, args


# -------------------------------------------------------------------------------- helpers
def _sync(device: str) -> Callable[[], None]:
    import torch

    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


ALLOCATORS = ("system", "retain")


def set_allocator(kind: str, device: str) -> str:
    """How the CPU allocator treats freed memory in this process (``--allocator``).

    ``"system"`` leaves glibc's malloc as it is: blocks above its (dynamic) mmap threshold are
    returned to the kernel when freed, and so is free memory at the top of the heap, so every
    step of a compiled graph page-faults its large temporaries in again (measured: 6,500 minor
    faults and 18 ms of system time in a 125 ms DP step of the encoder, 2,200 and 4 ms in its
    non-private step). ``"retain"`` calls ``mallopt`` so that malloc never maps blocks apart
    (``M_MMAP_MAX = 0``) and never trims the heap (``M_TRIM_THRESHOLD`` = 2 GiB): what a
    caching allocator (jemalloc, tcmalloc, or a GPU's) does for a loop of same-sized steps.
    Set it before the first large allocation. Returns what was set, as printed in the header.

    Raises:
        RuntimeError: ``"retain"`` where the C library has no ``mallopt`` (not glibc).
    """
    if kind not in ALLOCATORS:
        raise ValueError(f"--allocator: {kind!r} is not one of {ALLOCATORS}")
    if kind == "system":
        return "system"
    import ctypes

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt"):
        raise RuntimeError("--allocator retain needs glibc's mallopt")
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**31 - 1)):
        raise RuntimeError("mallopt refused the retain settings")
    return "retain (glibc M_MMAP_MAX=0, M_TRIM_THRESHOLD=2GiB)" + ("" if device == "cpu" else "; host memory only")


def minor_faults() -> int:
    """Minor page faults of this process so far (all threads): first touches of fresh pages."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _trainable(model: Any) -> dict:
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def _loss_module(spec: Spec) -> Any:
    import torch.nn as nn

    class LossModule(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = spec.model

        def forward(self, *args: Any) -> Any:
            return spec.loss_fn(self.model, *args)

    return LossModule()


def _param_loss(spec: Spec) -> Callable[..., Any]:
    """loss(params, *args) over the trainable parameters (keys as in named_parameters)."""
    import torch

    wrapper = _loss_module(spec)

    def loss(params: dict, *args: Any) -> Any:
        return torch.func.functional_call(wrapper, {f"model.{k}": v for k, v in params.items()}, args)

    return loss


def eager_reference(spec: Spec, args: tuple, clip: float, chunk: int) -> tuple[Any, dict]:
    """Per-example norms and the clipped sum at ``clip``, with opake.clipped_grad (eager vmap),
    in chunks of ``chunk`` examples to bound memory."""
    import torch

    import opake_compile as opake

    loss = _param_loss(spec)
    params = {k: p.detach() for k, p in _trainable(spec.model).items()}
    batch_argnums = tuple(range(1, 1 + len(args)))
    grad_fn, state = opake.clipped_grad(loss, 0, batch_argnums=batch_argnums, clipping_norm=clip)
    n = args[0].shape[0]
    norms, total = [], None
    for s in range(0, n, chunk):
        part = tuple(a[s : s + chunk] for a in args)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, state = grad_fn(params, *part, state=state)
        norms.append(out.per_example_norms.detach())
        g = {k: v.detach() for k, v in out.grads.items()}
        total = g if total is None else {k: total[k] + g[k] for k in total}
    return torch.cat(norms), total


def rel_err(got: dict, ref: dict) -> float:
    worst, scale = 0.0, 0.0
    for k, r in ref.items():
        scale = max(scale, float(r.abs().max()))
        worst = max(worst, float((got[k].to(r.dtype) - r).abs().max()))
    return worst / max(scale, 1e-30)


def time_fn(fn: Callable[[], Any], reps: int, warmup: int, sync: Callable[[], None]) -> tuple[float, list[float]]:
    """First call seconds (compile included for compiled steps), then per-rep milliseconds."""
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return first, times


def peak_step_bytes(fn: Callable[[], Any], device: str) -> tuple[float, str]:
    """Peak bytes allocated by one call of ``fn`` above what was allocated when it started.

    CUDA: torch.cuda.max_memory_allocated. CPU: the PyTorch profiler's memory events (every
    c10 CPU-allocator allocation/free inside the window, with a running "Total Allocated"
    that includes what was allocated before the window); the peak of that counter above its
    value when the window opened is the step's working memory. Inductor's CPU wrapper
    allocates its buffers through the same allocator.
    """
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - base), "cuda max_memory_allocated"
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    mem = sorted(
        (e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0),
        key=lambda e: e.get("ts", 0),
    )
    if not mem:
        return 0.0, "profiler CPU allocator"
    # "Total Allocated" counts what the allocator held before the window too (earlier models'
    # tensors in the same process): measure from what it held when the window opened.
    first = mem[0]["args"]
    base = first.get("Total Allocated", 0) - first.get("Bytes", 0)
    peak = max(e["args"].get("Total Allocated", 0) for e in mem) - base
    return float(peak), "profiler CPU allocator"


def poisson_sizes(expected: int, seed: int = 2) -> list[int]:
    """20 Poisson-sampling batch sizes: Binomial(N, q) with N = 240 B (a dataset) and q = 1/240."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [int(s) for s in rng.binomial(240 * expected, 1.0 / 240, size=NUM_POISSON)]


# ------------------------------------------------------------------------ configurations
def run_config(config: str, spec: Spec, args: tuple, ns: argparse.Namespace) -> dict:
    import torch

    device, reps, warmup = ns.device, ns.reps, ns.warmup
    sync = _sync(device)
    model = spec.model
    out: dict[str, Any] = {}
    compiled = config.startswith(("np_compiled", "dp_"))
    if compiled:
        # Pay the one-off cost of the first Inductor compile in a process (toolchain probing,
        # precompiled headers, worker pool) on a trivial function, so that the config's
        # compile seconds are comparable across configurations.
        t0 = time.perf_counter()
        torch.compile(lambda z: (z * 2).sin().sum())(torch.randn(8, device=device))
        sync()
        out["warmup_compile_s"] = time.perf_counter() - t0

    result_box: dict[str, Any] = {}

    if config == "np_eager":
        def step() -> None:
            model.zero_grad(set_to_none=True)
            spec.loss_fn(model, *args).backward()

    elif config == "np_compiled_backward":
        closs = torch.compile(lambda *a: spec.loss_fn(model, *a))

        def step() -> None:
            model.zero_grad(set_to_none=True)
            closs(*args).backward()

    elif config == "np_compiled_grad":
        loss = _param_loss(spec)
        params = {k: p.detach() for k, p in _trainable(model).items()}
        cgrad = torch.compile(lambda p, *a: torch.func.grad(loss)(p, *a))

        def step() -> None:
            with torch.no_grad():
                result_box["g"] = cgrad(params, *args)

    elif config.startswith("dp_"):
        import opake_compile as opake

        from opake_compile.compiler.passes.rewrites import GhostClipping

        rewrites = {"dp_materialized": [], "dp_default": None, "dp_fused": [GhostClipping(bookkeeping="fused")]}[config]
        dp = opake.compile_dp(
            spec.loss_fn, model=model, clipping_norm=ns.clip, physical_batch_size=spec.batch_size,
            backend="inductor", rewrites=rewrites,
        )

        def step() -> None:
            result_box["r"] = dp(*args)

    elif config.startswith("opacus_"):
        import logging

        import opacus
        import torch.nn as nn
        from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

        logging.getLogger("opacus").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        b = spec.batch_size
        crit = nn.CrossEntropyLoss(reduction="mean")
        if config == "opacus_hooks":
            from opacus import GradSampleModule

            gsm = GradSampleModule(model, loss_reduction="mean")
            opt = DPOptimizer(
                torch.optim.SGD([p for p in gsm.parameters() if p.requires_grad], lr=0.0),
                noise_multiplier=0.0, max_grad_norm=ns.clip, expected_batch_size=b, loss_reduction="mean",
            )

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                logits, targets, _ = spec.logits_targets(gsm, *args)
                crit(logits, targets).backward()
                opt.pre_step()  # clip, accumulate, (zero) noise, scale by 1/B
        else:
            from opacus.grad_sample import GradSampleModuleFastGradientClipping
            from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

            gsm = GradSampleModuleFastGradientClipping(
                model, max_grad_norm=ns.clip, use_ghost_clipping=True, loss_reduction="mean"
            )
            opt = DPOptimizerFastGradientClipping(
                torch.optim.SGD([p for p in gsm.parameters() if p.requires_grad], lr=0.0),
                noise_multiplier=0.0, max_grad_norm=ns.clip, expected_batch_size=b, loss_reduction="mean",
            )
            dploss = DPLossFastGradientClipping(gsm, opt, crit, loss_reduction="mean")

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                logits, targets, shape = spec.logits_targets(gsm, *args)
                dploss(logits, targets, shape=shape).backward()  # two backward passes
                opt.pre_step()
        out["opacus_version"] = opacus.__version__
    else:
        raise SystemExit(f"unknown config {config}")

    first, times = time_fn(step, reps, warmup, sync)
    out["first_call_s"] = first
    out["times_ms"] = times
    out["median_ms"] = statistics.median(times)
    peak, how = peak_step_bytes(step, device)
    out["peak_step_mb"] = peak / 2**20
    out["peak_method"] = how

    if config.startswith("dp_"):
        res = result_box["r"]
        out["coverage"] = dict(Counter(res.coverage.values()))
        out["explain"] = dp.describe()
        if ns.ref:
            ref = torch.load(ns.ref)
            out["rel_err"] = rel_err({k: v.cpu() for k, v in res.clipped.grads.items()}, ref)
        # Recompiles over Poisson-size batches on the same step (physical batch P = B: a batch
        # larger than B is processed in two padded chunks of the same graph).
        g = torch.Generator().manual_seed(3)
        sizes = poisson_sizes(spec.batch_size)
        batches = [tuple(a.to(device) for a in spec.make_batch(n, g)) for n in sizes]
        ptimes = []
        for bat in batches:
            t0 = time.perf_counter()
            dp(*bat)
            sync()
            ptimes.append((time.perf_counter() - t0) * 1e3)
        out["poisson_sizes"] = sizes
        out["poisson_ms"] = statistics.median(ptimes)
        out["poisson_max_ms"] = max(ptimes)
        out["recompiles"] = dp.num_backend_compiles - 1
        out["num_backend_compiles"] = dp.num_backend_compiles
        out["num_traces"] = dp.num_traces
    elif config.startswith("opacus_") and ns.ref:
        ref = torch.load(ns.ref)
        # After pre_step p.grad = (clipped sum + 0 noise) / expected batch size.
        got = {k: (p.grad * spec.batch_size).detach().cpu() for k, p in _trainable(model).items()}
        out["rel_err"] = rel_err(got, ref)
    return out


def worker(ns: argparse.Namespace) -> None:
    import torch

    warnings.filterwarnings("ignore", message=".*Full backward hook.*")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    spec, args = build(ns.model, ns.quick, ns.device)
    t_start = time.time()
    if ns.worker == "reference":
        # C = median per-example norm; then the reference clipped sum at that C.
        norms, _ = eager_reference(spec, args, math.inf, ns.ref_chunk)
        clip = float(norms.median())
        _, ref = eager_reference(spec, args, clip, ns.ref_chunk)
        torch.save({k: v.cpu() for k, v in ref.items()}, ns.ref)
        n_params = sum(p.numel() for p in spec.model.parameters())
        n_train = sum(p.numel() for p in _trainable(spec.model).values())
        out = {
            "clip": clip, "description": spec.description, "params": n_params, "trainable": n_train,
            "norm_quantiles": [float(norms.quantile(q)) for q in (0.1, 0.5, 0.9)],
        }
    else:
        out = run_config(ns.worker, spec, args, ns)
    out["wall_s"] = time.time() - t_start
    out["loadavg_end"] = os.getloadavg()
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(RESULT_TAG + json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------- parent
def spawn(ns: argparse.Namespace, job: str, model: str, clip: float | None, ref: str, timeout: float) -> dict:
    cmd = [
        sys.executable, os.path.abspath(__file__), "--worker", job, "--model", model,
        "--device", ns.device, "--reps", str(ns.reps), "--warmup", str(ns.warmup),
        "--ref", ref, "--ref-chunk", str(ns.ref_chunk),
    ]
    if clip is not None:
        cmd += ["--clip", repr(clip)]
    if ns.quick:
        cmd.append("--quick")
    if ns.threads:
        cmd += ["--threads", str(ns.threads)]
    cache = tempfile.mkdtemp(prefix="bench_inductor_")
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    exc = re.compile(r"^[\w.]*(Error|Exception|Interrupt|Exit)\w*: ")
    msg = next((l for l in reversed(tail) if exc.match(l)), None)
    msg = msg or next((l for l in reversed(tail) if l.strip() and not l.startswith(("USDT", " "))), "no output")
    return {"error": f"rc={proc.returncode}: {msg[:300]}", "stderr_tail": "\n".join(tail[-40:])}


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _mb(v: float) -> str:
    return f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def print_table(model: str, ref: dict, rows: dict, file: Any = sys.stdout) -> None:
    base_name = min(
        (c for c in BASELINE_CONFIGS if "median_ms" in rows.get(c, {})),
        key=lambda c: rows[c]["median_ms"], default=None,
    )
    base = rows[base_name] if base_name else {}
    print(f"\n## {model}: {ref.get('description', '')}", file=file)
    if "clip" in ref:
        print(
            f"C = {ref['clip']:.4g} (median per-example norm; 10/50/90% = "
            + "/".join(f"{q:.3g}" for q in ref["norm_quantiles"])
            + f"); params {ref['params']:,}, trainable {ref['trainable']:,}; baseline = {base_name}",
            file=file,
        )
    header = (
        "| config | median ms | min ms | x base | peak step MB | x base mem | max RSS MB | first call s "
        "| recompiles/20 Poisson | traces | Poisson median ms | rel err | coverage |"
    )
    print(header, file=file)
    print("|" + "---|" * (header.count("|") - 1), file=file)
    for c, r in rows.items():
        if "error" in r:
            print(f"| {c} | error: {r['error']} |" + " |" * 11, file=file)
            continue
        ratio = r["median_ms"] / base["median_ms"] if base else None
        mratio = r["peak_step_mb"] / base["peak_step_mb"] if base and base["peak_step_mb"] > 0 else None
        compiled = c.startswith(("np_compiled", "dp_"))
        cov = ", ".join(f"{k}:{v}" for k, v in r.get("coverage", {}).items()) or "-"
        print(
            f"| {c} | {r['median_ms']:.2f} | {min(r['times_ms']):.2f} | {_fmt(ratio, '.2f')} | {_mb(r['peak_step_mb'])} | "
            f"{_fmt(mratio, '.2f')} | {r['max_rss_mb']:.0f} | {_fmt(r['first_call_s'] if compiled else None, '.1f')} | "
            f"{_fmt(r.get('recompiles'), 'd')} | {_fmt(r.get('num_traces'), 'd')} | "
            f"{_fmt(r.get('poisson_ms'), '.2f')} | {_fmt(r.get('rel_err'), '.1e')} | {cov} |",
            file=file,
        )


def parent(ns: argparse.Namespace) -> None:
    import torch

    models = list(CORE_MODELS + OPTIONAL_MODELS) if ns.models == "all" else [m for m in ns.models.split(",") if m]
    for m in models:
        if m not in BUILDERS:
            raise SystemExit(f"unknown model {m!r}; choose from {', '.join(BUILDERS)} or 'all'")
    configs = list(ALL_CONFIGS) if ns.configs == "all" else [c for c in ns.configs.split(",") if c]
    for c in configs:
        if c not in ALL_CONFIGS:
            raise SystemExit(f"unknown config {c!r}; choose from {', '.join(ALL_CONFIGS)}")
    try:
        import opacus  # noqa: F401

        opacus_version = opacus.__version__
    except ImportError:
        opacus_version = None
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    if opacus_version is None:
        configs = [c for c in configs if not c.startswith("opacus_")]
    if transformers_version is None and "gpt2" in models:
        print("transformers is not installed: skipping gpt2", flush=True)
        models.remove("gpt2")
    if ns.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")

    timeout = ns.timeout or (900 if ns.quick else 3600)
    env = {
        "torch": torch.__version__, "opacus": opacus_version, "transformers": transformers_version,
        "python": platform.python_version(), "cpu_count": os.cpu_count(), "device": ns.device,
        "gpu": torch.cuda.get_device_name() if ns.device.startswith("cuda") else None,
        "threads": ns.threads or torch.get_num_threads(), "reps": ns.reps, "warmup": ns.warmup,
        "quick": ns.quick, "loadavg_start": os.getloadavg(),
    }
    print("# bench_step " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print(
            f"# WARNING: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: other processes "
            "share the cores, timings will be noisy (multi-threaded eager ops suffer most; see "
            "--threads 1 and the min ms column)",
            flush=True,
        )
    results: dict[str, Any] = {"env": env, "models": {}}
    workdir = tempfile.mkdtemp(prefix="bench_step_")
    try:
        for m in models:
            ref_path = os.path.join(workdir, f"ref_{m}.pt")
            print(f"[{m}] eager reference (C = median per-example norm) ...", flush=True)
            ref = spawn(ns, "reference", m, None, ref_path, timeout)
            if "error" in ref:
                print(f"[{m}] reference failed: {ref['error']}\n{ref.get('stderr_tail', '')}", flush=True)
                results["models"][m] = {"reference": ref, "rows": {}}
                continue
            rows: dict[str, Any] = {}
            for c in configs:
                t0 = time.time()
                r = spawn(ns, c, m, ref["clip"], ref_path, timeout)
                rows[c] = r
                state = r.get("error") or f"median {r['median_ms']:.2f} ms"
                print(f"[{m}] {c}: {state} ({time.time() - t0:.0f} s)", flush=True)
                if "error" in r and ns.verbose:
                    print(r.get("stderr_tail", ""), flush=True)
            results["models"][m] = {"reference": ref, "rows": rows}
            print_table(m, ref, rows)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    env["loadavg_end"] = os.getloadavg()
    print(f"\n# load average start {env['loadavg_start']} end {env['loadavg_end']}")
    print("\n# Summary")
    for m, v in results["models"].items():
        print_table(m, v["reference"], v["rows"])
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)
        print(f"\nraw results: {ns.json}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(CORE_MODELS),
                   help=f"comma list of {', '.join(BUILDERS)}, or 'all' (default: %(default)s)")
    p.add_argument("--configs", default="all", help=f"comma list of {', '.join(ALL_CONFIGS)} or 'all'")
    p.add_argument("--reps", type=int, default=None, help="timed runs per config (default 20, --quick 5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs after the first call")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads in each worker (0: torch default)")
    p.add_argument("--timeout", type=float, default=0, help="seconds per configuration subprocess")
    p.add_argument("--ref-chunk", type=int, default=32, help="examples per chunk of the eager reference")
    p.add_argument("--json", default="", help="also write the raw results (all timings) to this file")
    p.add_argument("--verbose", action="store_true", help="print a failing worker's stderr tail")
    # internal: run one configuration
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help=argparse.SUPPRESS)
    p.add_argument("--clip", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ref", default="", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.reps is None:
        ns.reps = 5 if ns.quick else 20
    if ns.worker:
        try:
            worker(ns)
        except Exception:
            traceback.print_exc()
            sys.exit(1)
    else:
        parent(ns)


if __name__ == "__main__":
    main()
