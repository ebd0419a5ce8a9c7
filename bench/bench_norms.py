#!/usr/bin/env python
"""Per-example norm accuracy at realistic shapes: compiled step vs a float64 microbatch oracle.

Over-clipping is a silent utility loss: a norm reported (and clipped) 26 % too large means an
effective clipping norm 26 % below C at the same noise. This script builds transformer blocks
at real widths (no downloads: models from ``transformers`` configs with random weights), runs
``compile_dp`` (``aot_eager``; the norms do not depend on the backend's fusion) and compares
each example's reported norm with the norm of its gradient computed one example at a time in
float64. Target (numerical contract, SPEC §6): at most 1 % above the oracle, never below it by
more than rho.

    python bench/bench_norms.py                       # GPT-2 T=128..1024, Llama T=512, BERT T=128
    python bench/bench_norms.py --models gpt2 --seq 128,256
    python bench/bench_norms.py --models llama,bert --shared 5 --train k_proj,attention.self.key

``--shared s`` adds one direction of s times a row's typical norm to every token embedding,
so that hidden states share it, as in pretrained models (anisotropy); ``--train`` keeps only
the parameters whose names contain one of the given substrings trainable, so the norm is
theirs alone (a key projection's output gradients sum to zero over positions, which makes
its norm the hardest one to bound tightly under a shared direction).

Prints one row per (model, T): the relative error of each example's norm, the worst one, and
the path each weight took.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import torch


def oracle_norms(model: torch.nn.Module, loss, args: tuple, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Per-example gradient norms, one example at a time: the model's gradient computed in
    ``dtype`` (float64 by default; a low-precision model's own arithmetic otherwise), its norm
    in float64."""
    m64 = copy.deepcopy(model).to(dtype)
    out = []
    for i in range(args[0].shape[0]):
        m64.zero_grad()
        loss(m64, *(a[i : i + 1] for a in args)).backward()
        out.append(math.sqrt(sum(float(p.grad.double().square().sum()) for p in m64.parameters() if p.grad is not None)))
    return torch.tensor(out, dtype=torch.float64)


def build(name: str, t: int, batch: int, shared: float = 0.0, train: str = ""):
    import transformers

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if name == "gpt2":
            cfg = transformers.GPT2Config(
                n_embd=768, n_head=12, n_layer=1, vocab_size=500, n_positions=max(1024, t),
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            )
            cfg._attn_implementation = "eager"
            model = transformers.GPT2LMHeadModel(cfg).eval()
        elif name == "llama":
            cfg = transformers.LlamaConfig(
                hidden_size=768, intermediate_size=2048, num_attention_heads=12, num_key_value_heads=12,
                num_hidden_layers=1, vocab_size=500, max_position_embeddings=max(1024, t),
                bos_token_id=0, eos_token_id=0, pad_token_id=0,
            )
            cfg._attn_implementation = "eager"
            model = transformers.LlamaForCausalLM(cfg).eval()
        elif name == "bert":
            cfg = transformers.BertConfig(
                hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=1,
                vocab_size=500, max_position_embeddings=max(512, t), hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, pad_token_id=0,
            )
            cfg._attn_implementation = "eager"
            model = transformers.BertForMaskedLM(cfg).eval()
        else:
            raise SystemExit(f"unknown model {name!r}")
        ids = torch.randint(1, 500, (batch, t))
        if shared:
            table = model.get_input_embeddings().weight
            direction = torch.randn(table.shape[1])
            with torch.no_grad():
                table += shared * table.norm(dim=1).mean() * direction / direction.norm()
    if train:
        for pname, param in model.named_parameters():
            param.requires_grad_(any(part in pname for part in train.split(",")))
    # A 4-D additive mask of zeros: BERT's 2-D mask path has a data-dependent branch (see the
    # coverage issue); without a mask transformers builds one itself.
    if name == "bert":
        mask = torch.zeros(batch, 1, 1, t)

        def loss(model, ids, mask):
            return model(input_ids=ids, attention_mask=mask, labels=ids).loss

        return model, loss, (ids, mask)

    def lm_loss(model, ids):
        return model(input_ids=ids, labels=ids).loss

    return model, lm_loss, (ids,)


def run(name: str, t: int, batch: int, shared: float = 0.0, train: str = "", dtype: torch.dtype = torch.float32) -> dict:
    import opake_compile as opake

    model, loss, args = build(name, t, batch, shared, train)
    model.to(dtype)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    step = opake.compile_dp(loss, model=model, clipping_norm=1.0, physical_batch_size=batch, backend="aot_eager")
    t0 = time.perf_counter()
    got = step(*args).clipped.per_example_norms.double()
    elapsed = time.perf_counter() - t0
    # A low-precision model is compared with its own arithmetic (the gradient computed one
    # example at a time in its dtype, normed in float64): the float64 model's gradient differs
    # from it by the forward pass's rounding, which is not the norm's error.
    ref = oracle_norms(model, loss, args, torch.float64 if dtype == torch.float32 else dtype)
    rel = (got - ref) / ref
    paths = sorted({v for k, v in step.coverage.items() if k.endswith("weight") and v != "frozen"})
    return {"model": name, "T": t, "rel": rel.tolist(), "worst": float(rel.abs().max()), "paths": paths, "seconds": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,llama,bert")
    ap.add_argument("--seq", default=None, help="comma-separated T (default: per model, see the docstring)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--shared", type=float, default=0.0, help="shared embedding direction, in row norms")
    ap.add_argument("--train", default="", help="comma-separated substrings of the parameters to train")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="parameter dtype")
    ns = ap.parse_args()
    dtype = getattr(torch, ns.dtype)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    defaults = {"gpt2": [128, 256, 512, 1024], "llama": [512], "bert": [128]}
    print(f"{'model':<6} {'T':>5}  {'norm error (rel. to float64 oracle)':<40} {'worst':>9}  paths")
    for name in ns.models.split(","):
        seqs = [int(s) for s in ns.seq.split(",")] if ns.seq else defaults[name]
        for t in seqs:
            r = run(name, t, ns.batch, ns.shared, ns.train, dtype)
            errs = ", ".join(f"{e:+.2e}" for e in r["rel"])
            print(f"{name:<6} {t:>5}  {errs:<40} {r['worst']:>9.2e}  {'; '.join(r['paths'])}", flush=True)


if __name__ == "__main__":
    main()
