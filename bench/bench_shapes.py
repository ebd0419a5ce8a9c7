#!/usr/bin/env python
"""Realistic shapes, every row paired in one process: GPT-2-small width, a ViT-B/16 block, a
Llama-style block, and LoRA on the GPT-2 shape.

For each model, every row's step is built and compiled in this process (first-call seconds
recorded), then all rows are called in rotating order, round after round, so machine load
drifts the same way for all of them; then each row's peak working memory is read. Ratios are to
the fastest compiled non-private step (the faster of ``torch.compile``d ``torch.func.grad`` and
a ``torch.compile``d loss followed by ``.backward()``) of the same model and batch.

Rows: ``np_grad``, ``np_backward`` (non-private), ``dp_default`` (``compile_dp`` defaults: at a
fixed batch B the default plan is one graph of exactly B rows, so it is also the P = B row),
``dp_p_eq_b`` (explicit ``physical_batch_size=B``: the same plan, compiled again; off unless
named in ``--rows``), ``opacus_hooks`` and ``opacus_ghost`` (Opacus 1.6, where they run; a row
that fails prints why).

Models (``--models``): ``gpt2_t256_b8``, ``gpt2_t256_b32``, ``gpt2_t512_b8``, ``gpt2_t512_b32``
(transformers GPT-2, n_layer 2, n_embd 768, 12 heads, vocabulary cut to ``--vocab`` so the LM
head does not dominate), ``vit_b16`` (patch 16 at 224 x 224, one encoder block of width 768,
12 heads, MLP 3072, 1000 classes, B = 16; attention by ``F.scaled_dot_product_attention``
as in timm's and transformers' ViTs: before 2026-12-03 it was written out as softmax and
products, which Inductor turns into the fused kernel for the non-private rows only),
``llama_t512`` (transformers Llama, one decoder layer: RMSNorm, rotary positions, 12 query
heads sharing 4 key/value heads, hidden 768, MLP 2048, T = 512, B = 4), ``gpt2_lora`` (peft
rank-8 LoRA on ``c_attn`` of the GPT-2 shape, T = 256, B = 8).

The transformers models use transformers' default attention, ``attn_implementation="sdpa"``
(``--attention eager``: softmax and products, the form every row used before 2026-12-03; the
DP step then keeps the attention probabilities for its backward, 483 MB at its peak against
431 MB with SDPA on ``gpt2_t256_b8``).

    python bench/bench_shapes.py --models gpt2_t256_b8,vit_b16 --rows np_grad,np_backward,dp_default
    python bench/bench_shapes.py --quick                 # tiny sizes: a smoke test of every row
    python bench/bench_shapes.py --device cuda           # unchanged on a GPU

These are heavy on a small CPU: a full run compiles several minutes per model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
from typing import Any

ALL_MODELS = ("gpt2_t256_b8", "gpt2_t256_b32", "gpt2_t512_b8", "gpt2_t512_b32", "vit_b16", "llama_t512", "gpt2_lora")
ALL_ROWS = ("np_grad", "np_backward", "dp_default", "dp_p_eq_b", "opacus_hooks", "opacus_ghost")
DEFAULT_ROWS = ("np_grad", "np_backward", "dp_default", "opacus_hooks", "opacus_ghost")


# --------------------------------------------------------------------------------- models
def _lm_logits_targets(module: Any, ids: Any) -> tuple:
    # Explicit mask and (B, T) position ids: see bench_step.build_gpt2.
    ones = torch_ones_like(ids)
    pos = ones.cumsum(dim=1) - 1
    logits = module(input_ids=ids, attention_mask=ones, position_ids=pos, use_cache=False).logits[:, :-1]
    return logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), (ids.shape[0], ids.shape[1] - 1)


def torch_ones_like(x: Any) -> Any:
    import torch

    return torch.ones_like(x)


def build_gpt2(bs: Any, quick: bool, t: int, b: int, vocab: int, attention: str, lora: bool = False) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    d, heads = (32, 2) if quick else (768, 12)
    t, b, vocab = (16, 2, 200) if quick else (t, b, vocab)
    cfg = GPT2Config(
        n_layer=2, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=t, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )
    cfg._attn_implementation = attention
    model = GPT2LMHeadModel(cfg)
    desc = f"GPT-2 width n_layer=2 n_embd={d} heads={heads} vocab={vocab} T={t} B={b}, {attention} attention"
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True))
        desc += ", rank-8 LoRA on c_attn (base frozen)"

    def make_batch(n: int, g: Any) -> tuple:
        return (torch.randint(0, vocab, (n, t), generator=g),)

    return bs.Spec("gpt2_lora" if lora else f"gpt2_t{t}_b{b}", model, b, make_batch, _lm_logits_targets, desc)


def build_vit(bs: Any, quick: bool) -> Any:
    import torch
    import torch.nn as nn

    d, heads, mlp, img, patch, classes, b = (32, 2, 64, 32, 16, 10, 2) if quick else (768, 12, 3072, 224, 16, 1000, 16)
    n_tok = (img // patch) ** 2 + 1

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, mlp), nn.Linear(mlp, d)

        def forward(self, x: Any) -> Any:
            bsz, n, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
            q, k, v = (z.reshape(bsz, n, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            att = nn.functional.scaled_dot_product_attention(q, k, v)  # as timm's and HF's ViTs
            x = x + self.proj(att.transpose(1, 2).reshape(bsz, n, d))
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))

    class ViT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch = nn.Conv2d(3, d, patch, patch)
            self.cls = nn.Embedding(1, d)  # class token and positions as embeddings (Opacus-friendly)
            self.pos = nn.Embedding(n_tok, d)
            self.block = Block()
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, classes)

        def forward(self, x: Any) -> Any:
            bsz = x.shape[0]
            tok = self.patch(x).flatten(2).transpose(1, 2)
            zero = torch.zeros(bsz, 1, dtype=torch.long, device=x.device)
            pos = torch.arange(n_tok, device=x.device).unsqueeze(0).repeat(bsz, 1)
            h = torch.cat([self.cls(zero), tok], dim=1) + self.pos(pos)
            return self.head(self.ln(self.block(h))[:, 0])

    def make_batch(n: int, g: Any) -> tuple:
        return torch.randn(n, 3, img, img, generator=g), torch.randint(0, classes, (n,), generator=g)

    desc = f"ViT-B/16 width: patch {patch} at {img}x{img}, 1 block d={d} heads={heads} (SDPA) MLP {mlp}, B={b}"
    return bs.Spec("vit_b16", ViT(), b, make_batch, lambda m, x, y: (m(x), y, None), desc)


def build_llama(bs: Any, quick: bool, attention: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d, heads, kv, mlp, t, b, vocab = (32, 4, 2, 64, 16, 2, 200) if quick else (768, 12, 4, 2048, 512, 4, 8192)
    cfg = LlamaConfig(
        hidden_size=d, intermediate_size=mlp, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=t, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    cfg._attn_implementation = attention
    model = LlamaForCausalLM(cfg)

    def make_batch(n: int, g: Any) -> tuple:
        return (torch.randint(0, vocab, (n, t), generator=g),)

    desc = f"Llama block (RMSNorm, rotary, GQA {heads}q/{kv}kv) hidden={d} MLP {mlp} vocab={vocab} T={t} B={b}, {attention} attention"
    return bs.Spec("llama_t512", model, b, make_batch, _lm_logits_targets, desc)


def build(bs: Any, name: str, ns: argparse.Namespace) -> Any:
    if name.startswith("gpt2_t"):
        t, b = (int(x[1:]) for x in name[len("gpt2_"):].split("_"))
        return build_gpt2(bs, ns.quick, t, b, ns.vocab, ns.attention)
    if name == "gpt2_lora":
        return build_gpt2(bs, ns.quick, 256, 8, ns.vocab, ns.attention, lora=True)
    if name == "vit_b16":
        return build_vit(bs, ns.quick)
    if name == "llama_t512":
        return build_llama(bs, ns.quick, ns.attention)
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(ALL_MODELS)}")


# ----------------------------------------------------------------------------------- rows
def make_row(bs: Any, row: str, spec: Any, args: tuple, ns: argparse.Namespace) -> Any:
    """A no-argument callable running one step of ``row`` on ``args``."""
    import torch

    model = spec.model
    if row == "np_grad":
        loss = bs._param_loss(spec)
        params = {k: p.detach() for k, p in bs._trainable(model).items()}
        cgrad = torch.compile(lambda p, *a: torch.func.grad(loss)(p, *a))

        def step() -> None:
            with torch.no_grad():
                cgrad(params, *args)

        return step
    if row == "np_backward":
        closs = torch.compile(lambda *a: spec.loss_fn(model, *a))

        def step() -> None:
            model.zero_grad(set_to_none=True)
            closs(*args).backward()

        return step
    if row in ("dp_default", "dp_p_eq_b"):
        import opake_compile as opake

        p = spec.batch_size if row == "dp_p_eq_b" else None
        dp = opake.compile_dp(spec.loss_fn, model=model, clipping_norm=1.0, physical_batch_size=p)

        def step() -> None:
            dp(*args)

        step.dp = dp  # type: ignore[attr-defined]
        return step
    if row in ("opacus_hooks", "opacus_ghost"):
        import copy
        import logging
        import warnings

        import torch.nn as nn
        from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

        logging.getLogger("opacus").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore")
        crit = nn.CrossEntropyLoss(reduction="mean")
        model = copy.deepcopy(model)  # Opacus hooks stay on its module: keep them off the other rows' model
        params = [p for p in model.parameters() if p.requires_grad]
        if row == "opacus_hooks":
            from opacus import GradSampleModule

            gsm = GradSampleModule(model, loss_reduction="mean")
            opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, max_grad_norm=1.0,
                              expected_batch_size=spec.batch_size, loss_reduction="mean")

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                logits, targets, _ = spec.logits_targets(gsm, *args)
                crit(logits, targets).backward()
                opt.pre_step()
        else:
            from opacus.grad_sample import GradSampleModuleFastGradientClipping
            from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

            gsm = GradSampleModuleFastGradientClipping(model, max_grad_norm=1.0, use_ghost_clipping=True, loss_reduction="mean")
            opt = DPOptimizerFastGradientClipping(torch.optim.SGD(params, lr=0.0), noise_multiplier=0.0, max_grad_norm=1.0,
                                                  expected_batch_size=spec.batch_size, loss_reduction="mean")
            dploss = DPLossFastGradientClipping(gsm, opt, crit, loss_reduction="mean")

            def step() -> None:
                opt.zero_grad(set_to_none=True)
                logits, targets, shape = spec.logits_targets(gsm, *args)
                dploss(logits, targets, shape=shape).backward()
                opt.pre_step()

        step.gsm = gsm  # type: ignore[attr-defined]
        return step
    raise SystemExit(f"unknown row {row!r}; choose from {', '.join(ALL_ROWS)}")


def run_model(bs: Any, name: str, ns: argparse.Namespace) -> None:
    import torch

    torch.manual_seed(0)
    spec = build(bs, name, ns)
    spec.model.to(ns.device)
    g = torch.Generator().manual_seed(1)
    args = tuple(a.to(ns.device) for a in spec.make_batch(spec.batch_size, g))
    sync = bs._sync(ns.device)
    steps, first, failed = {}, {}, {}
    for row in ns.rows:
        try:
            fn = make_row(bs, row, spec, args, ns)
            t0 = time.perf_counter()
            fn()
            sync()
            first[row] = time.perf_counter() - t0
            for _ in range(ns.warmup):
                fn()
            sync()
            steps[row] = fn
        except Exception as err:  # noqa: BLE001 - a row that cannot run is reported, not fatal
            failed[row] = f"{type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}"
            if ns.verbose:
                traceback.print_exc()
    times: dict[str, list[float]] = {k: [] for k in steps}
    faults = dict.fromkeys(steps, 0)
    order = list(steps)
    for r in range(ns.rounds):
        rot = order[r % max(1, len(order)):] + order[: r % max(1, len(order))]
        for k in rot:
            f0, t0 = bs.minor_faults(), time.perf_counter()
            steps[k]()
            sync()
            times[k].append((time.perf_counter() - t0) * 1e3)
            faults[k] += bs.minor_faults() - f0
    peaks = {}
    for k, fn in steps.items():
        peaks[k], _ = bs.peak_step_bytes(fn, ns.device)
    med = {k: statistics.median(v) for k, v in times.items()}
    nps = [k for k in ("np_grad", "np_backward") if k in med]
    base = min(nps, key=lambda k: med[k]) if nps else None
    print(f"\n### {name}: {spec.description}", flush=True)
    print("| row | median ms (min-max) | / fastest np (medians; per round) | peak MB | / np peak | first call s "
          "| minor faults / step |")
    print("|---|---|---|---|---|---|---|")
    for k in ns.rows:
        if k in failed:
            print(f"| {k} | fails: {failed[k]} | | | | | |")
            continue
        v = times[k]
        ratio = rr = pr = ""
        if base:
            ratio = f"{med[k] / med[base]:.3f}"
            rr = f"{statistics.median([a / b for a, b in zip(v, times[base])]):.3f}"
            pr = f"{peaks[k] / peaks[base]:.2f}" if peaks[base] else ""
        print(f"| {k} | {med[k]:.1f} ({min(v):.1f}-{max(v):.1f}) | {ratio}; {rr} | {peaks[k] / 2**20:.0f} | {pr} "
              f"| {first[k]:.1f} | {faults[k] / max(ns.rounds, 1):.0f} |", flush=True)
    dp = getattr(steps.get("dp_default"), "dp", None)
    if dp is not None:
        print(f"# dp_default plan for B={spec.batch_size}: {dp.plan(spec.batch_size)}; compiles {dp.num_backend_compiles}; "
              f"coverage {sorted(set(dp.coverage.values()))}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(ALL_MODELS), help="comma list of %(default)s")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma list of {', '.join(ALL_ROWS)}")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary of the GPT-2 shapes (default %(default)s)")
    p.add_argument("--attention", default="sdpa", choices=("eager", "sdpa"),
                   help="attn_implementation of the transformers models: sdpa (transformers' default, "
                   "the default here since 2026-12-03) or eager (softmax and products, as before)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    p.add_argument("--verbose", action="store_true", help="print a failing row's traceback")
    p.add_argument("--inductor", action="append", default=[], metavar="NAME=VALUE",
                   help="set torch._inductor.config.NAME (dotted, e.g. triton.max_tiles=2) before any compile; repeatable")
    p.add_argument("--allocator", default="system", help="system (glibc as is) or retain (keep freed memory: "
                   "no page faults from re-mapping each step; see bench_step.set_allocator)")
    ns = p.parse_args()
    ns.rows = [r for r in ns.rows.split(",") if r]
    import bench_step as bs  # a sibling script: `python bench/<this>.py` puts bench/ on sys.path

    allocator = bs.set_allocator(ns.allocator, ns.device)
    import ast

    import torch
    import torch._inductor.config as inductor_config

    for item in ns.inductor:
        name, _, value = item.partition("=")
        *path, last = name.split(".")
        obj = inductor_config
        for part in path:
            obj = getattr(obj, part)
        if not hasattr(obj, last):
            p.error(f"--inductor {item}: torch._inductor.config has no {name}")
        setattr(obj, last, ast.literal_eval(value))
        print(f"# torch._inductor.config.{name} = {getattr(obj, last)!r}")

    print(f"# bench_shapes torch={torch.__version__} threads={torch.get_num_threads()} device={ns.device} "
          f"rounds={ns.rounds} allocator={allocator} loadavg={os.getloadavg()}", flush=True)
    for name in [m for m in ns.models.split(",") if m]:
        run_model(bs, name, ns)
    print(f"# loadavg end {os.getloadavg()}")


if __name__ == "__main__":
    main()
