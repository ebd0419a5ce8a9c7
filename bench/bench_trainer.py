#!/usr/bin/env python
"""Benchmark: one ``DPTrainer`` step against one plain Hugging Face ``Trainer`` step, paired.

Model: GPT-2 with 2 layers of width 768 (12 heads, GPT-2's vocabulary of 50,257, tied LM head),
built from a config, eager attention; batches of ``--batch`` sequences of ``--seq-len`` tokens
(default T = 256). Both trainers use SGD on the same model shape and the same batch:

  plain   ``Trainer.compute_loss`` (forward) + ``backward()`` + ``optimizer.step()`` (what
          ``Trainer.training_step`` does without gradient accumulation or mixed precision)
  dp      ``DPTrainer``'s step: ``trainer.dp_step(*batch)`` (compiled per-example clipped sum)
          + ``trainer.dp_optimizer.step`` (noise, normalisation, SGD)
  opacus  Opacus ``GradSampleModule`` (hooks mode) + its ``DPOptimizer`` (noise 0), if installed
          (its ghost mode refuses GPT-2's tied embedding)

The three are timed in alternation in one process (after warm-up, compilation excluded) and
the medians of the per-round ratios dp/plain and opacus/plain are printed. Numbers depend on the
machine and its load: run it on an otherwise idle machine.

    python bench/bench_trainer.py                      # defaults: B = 8, T = 256, 10 rounds
    python bench/bench_trainer.py --quick              # tiny smoke run
    python bench/bench_trainer.py --rounds 100 --budget-s 600   # as many rounds as fit in 10 minutes
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import transformers

from opake_compile.transformers import DPTrainer, TrainingArguments


def model_of(ns: argparse.Namespace, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=ns.vocab, n_positions=ns.seq_len, n_embd=ns.width, n_layer=ns.layers, n_head=ns.heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    cfg._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(cfg)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop after the round that passes this many seconds of timed rounds (at least 2 rounds)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--no-opacus", action="store_true")
    p.add_argument("--quick", action="store_true")
    ns = p.parse_args()
    if ns.quick:
        ns.batch, ns.seq_len, ns.width, ns.heads, ns.vocab, ns.rounds, ns.warmup = 4, 32, 64, 2, 512, 3, 1
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    b, t = ns.batch, ns.seq_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ns.vocab, (b, t), generator=g)
    rows = [{"input_ids": r.tolist(), "labels": r.tolist()} for r in ids]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    common = dict(report_to=[], disable_tqdm=True, use_cpu=True, optim="sgd", learning_rate=1e-4,
                  weight_decay=0.0, save_strategy="no", per_device_train_batch_size=b, max_steps=10**6)

    plain_model = model_of(ns)
    plain = transformers.Trainer(plain_model, transformers.TrainingArguments(output_dir="/tmp/bench_trainer_plain", **common),
                                 train_dataset=rows)
    plain.create_optimizer()

    def plain_step() -> None:
        plain.compute_loss(plain_model, dict(batch)).backward()
        plain.optimizer.step()
        plain_model.zero_grad(set_to_none=True)

    dp_model = model_of(ns)
    dp = DPTrainer(dp_model, TrainingArguments(output_dir="/tmp/bench_trainer_dp", **common, noise_multiplier=1.0,
                                               target_delta=1e-6, sample_rate=1.0, max_length=t, dp_backend=ns.backend,
                                               dp_seed=0), train_dataset=rows)
    dp.setup_privacy()
    dp_batch = dp._collate_train(list(range(b)))
    tensors = [dp_batch[k] for k in dp._dp_keys]

    def dp_step() -> None:
        out = dp.dp_step(*tensors)
        dp.dp_optimizer.step(out.clipped)

    steps = {"plain": plain_step, "dp": dp_step}
    try:
        if ns.no_opacus:
            raise ImportError
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer as OpacusDPOptimizer

        op_model = model_of(ns)
        gsm = GradSampleModule(op_model, loss_reduction="mean")
        op_opt = OpacusDPOptimizer(torch.optim.SGD(op_model.parameters(), lr=1e-4), noise_multiplier=0.0,
                                   max_grad_norm=1.0, expected_batch_size=b, loss_reduction="mean")

        # Opacus needs every input batched: GPT-2's default position_ids have batch dimension 1.
        op_batch = {**batch, "position_ids": torch.arange(t).expand(b, t)}

        def opacus_step() -> None:
            gsm(**op_batch).loss.backward()
            op_opt.step()
            op_opt.zero_grad(set_to_none=True)

        opacus_step()
        steps["opacus"] = opacus_step
    except ImportError:
        pass
    except Exception as err:  # noqa: BLE001 - report and go on
        print(f"opacus hooks mode failed on this model: {type(err).__name__}: {err}"[:300])

    t0 = time.perf_counter()
    dp_step()  # compile
    print(f"DPTrainer step compile + first step: {time.perf_counter() - t0:.1f} s (backend {ns.backend})", flush=True)
    for _ in range(ns.warmup):
        for fn in steps.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    start = time.perf_counter()
    for r in range(ns.rounds):
        for name, fn in steps.items():
            times[name].append(timed(fn))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1] * 1e3:.0f} ms" for k, v in times.items()), flush=True)
        if ns.budget_s is not None and r >= 1 and time.perf_counter() - start > ns.budget_s:
            break
    rounds = len(times["plain"])
    print(f"GPT-2 {ns.layers} layers, width {ns.width}, vocab {ns.vocab}, B = {b}, T = {t}; "
          f"{torch.get_num_threads()} threads; {rounds} paired rounds (medians)")
    for name in steps:
        print(f"  {name:7s} {statistics.median(times[name]) * 1e3:9.1f} ms/step")
    for name in steps:
        if name != "plain":
            ratios = [a / c for a, c in zip(times[name], times["plain"])]
            print(f"  {name}/plain = {statistics.median(ratios):.2f}x (median of per-round ratios)")


if __name__ == "__main__":
    main()
