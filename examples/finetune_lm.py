"""Private fine-tuning of a small causal language model with LoRA adapters and ``DPTrainer``.

Everything is local and real: the text is the English reference documentation that ships with
every Python install (``pydoc_data.topics``: 79 topics, about 465k characters). The topics are
split (by topic, in a fixed order) into three disjoint parts:

* **public** (about 40 %): trains the byte-level BPE tokenizer (``tokenizers``) and pre-trains a
  small GPT-2 built from a config (no download), without privacy: it stands in for a public
  pre-trained model;
* **private** (about 45 %): cut into sequences of ``--seq-len`` tokens; **one sequence is the unit
  of privacy**. LoRA adapters are fine-tuned on it with ``DPTrainer`` at epsilon = 8 and
  delta = the largest power of ten at most N^-1.1;
* **held-out** (the rest): perplexity is measured on it before fine-tuning, after the private
  fine-tune, and after the same fine-tune without privacy (Hugging Face's ``Trainer``, same
  adapters, optimizer, learning rate and steps).

The tokenizer and the pre-training see only the public part, so nothing about the private text
leaks through them. The training loss logged during the private run is computed on the private
data without noise (**not privatised**; for your eyes only); the perplexities are on held-out
text.

Run it (a few minutes on 2 CPU cores; ``--quick`` for a smoke run)::

    python examples/finetune_lm.py --plot finetune_lm.png
    python examples/finetune_lm.py --quick --backend aot_eager
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings
from pathlib import Path

import torch

try:
    import peft
    import tokenizers
    import transformers
except ImportError as err:  # pragma: no cover - message for people without the extra
    sys.exit(f"This example needs the hf extra: pip install -e '.[hf,examples]' ({err})")

from opake_compile.transformers import DPTrainer, TrainingArguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--seq-len", type=int, default=32, help="tokens per private example")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--pretrain-steps", type=int, default=300)
    p.add_argument("--epochs", type=float, default=2.0, help="epochs of the private fine-tune")
    p.add_argument("--batch-size", type=int, default=128, help="expected Poisson batch size")
    p.add_argument("--physical-batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--clipping-norm", type=float, default=1.0)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--backend", default="inductor", help="compile_dp backend (aot_eager compiles faster)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of loss and epsilon per step")
    p.add_argument("--output-dir", type=Path, default=Path("runs/finetune_lm"))
    p.add_argument("--quick", action="store_true", help="smaller run (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.pretrain_steps, args.epochs, args.batch_size = 100, 1.0, 64
    return args


def split_topics() -> tuple[list[str], list[str], list[str]]:
    from pydoc_data.topics import topics

    texts = [topics[k] for k in sorted(topics)]
    public, private, held_out = [], [], []
    for i, text in enumerate(texts):  # a fixed interleaving: every part sees every kind of topic
        (public, private, private, public, held_out, private, public, private, public, private)[i % 10].append(text)
    return public, private, held_out


def train_tokenizer(public: list[str], vocab: int) -> transformers.PreTrainedTokenizerFast:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(public, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.pad_token = fast.eos_token
    return fast


def chunks(texts: list[str], tok, seq_len: int) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        ids.extend(tok(text)["input_ids"] + [tok.eos_token_id])
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def rows(x: torch.Tensor) -> list[dict]:
    return [{"input_ids": r.tolist(), "labels": r.tolist()} for r in x]


@torch.no_grad()
def perplexity(model, x: torch.Tensor, batch: int = 64) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(x), batch):
        ids = x[i:i + batch]
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total, count = total + loss.item(), count + ids[:, 1:].numel()
    model.train()
    return math.exp(total / count)


def pretrain(model, x: torch.Tensor, steps: int, seed: int) -> None:
    """Ordinary (non-private) training on the public part: the stand-in for a pre-trained model."""
    from tqdm.auto import tqdm

    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in tqdm(range(steps), desc="pre-training on public text", leave=False):
        ids = x[torch.randint(0, len(x), (32,), generator=g)]
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()


def gpt2_config(tok, n_positions: int, width: int, layers: int) -> transformers.GPT2Config:
    """A small GPT-2 config for the tokenizer ``tok`` (transformers' default SDPA attention)."""
    config = transformers.GPT2Config(
        vocab_size=len(tok), n_positions=n_positions, n_embd=width, n_layer=layers,
        n_head=max(1, width // 32), bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return config


def with_lora(model, rank: int, modules_to_save: list[str] | None = None):
    """LoRA adapters on GPT-2's attention and MLP projections; ``modules_to_save`` are trained in full."""
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, fan_in_fan_out=True,
        target_modules=["c_attn", "c_proj", "c_fc"], modules_to_save=modules_to_save,
    )
    return peft.get_peft_model(model, config)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    warnings.filterwarnings("ignore", message=".*loss_type=None.*")
    transformers.logging.set_verbosity_error()
    t0 = time.time()
    public, private, held_out = split_topics()
    tok = train_tokenizer(public, args.vocab)
    x_pub, x_priv, x_test = (chunks(part, tok, args.seq_len) for part in (public, private, held_out))
    n = len(x_priv)
    delta = 10.0 ** math.floor(math.log10(n ** -1.1))
    print(f"data: pydoc_data.topics, {len(public)}/{len(private)}/{len(held_out)} topics public/private/held-out; "
          f"{n} private sequences of {args.seq_len} tokens (the privacy unit), {len(x_test)} held-out")
    base = transformers.GPT2LMHeadModel(gpt2_config(tok, args.seq_len, args.width, args.layers))
    pretrain(base, x_pub, args.pretrain_steps, args.seed)
    ppl_before = perplexity(base, x_test)
    print(f"held-out perplexity after public pre-training: {ppl_before:.2f}")

    common = dict(
        report_to=[], use_cpu=True, optim="adamw_torch", learning_rate=args.lr, weight_decay=0.0,
        lr_scheduler_type="constant", num_train_epochs=args.epochs, logging_steps=5, save_strategy="no",
        per_device_train_batch_size=args.physical_batch_size, seed=args.seed,
    )
    private_model = with_lora(copy.deepcopy(base), args.lora_rank)
    dp_args = TrainingArguments(
        output_dir=str(args.output_dir / "private"), **common,
        target_epsilon=args.epsilon, target_delta=delta, clipping_norm=args.clipping_norm,
        expected_batch_size=args.batch_size, max_length=args.seq_len, dp_backend=args.backend,
        dp_seed=None,  # fresh OS entropy: the noise must not be predictable
        log_training_loss=args.plot is not None,  # for the plot: not privatised, and saved in checkpoints
    )
    trainer = DPTrainer(private_model, dp_args, train_dataset=rows(x_priv), processing_class=tok)
    out = trainer.train()
    ppl_private = perplexity(private_model, x_test)
    print(f"private fine-tune: epsilon = {out.epsilon:.3f}, delta = {delta:g}, sigma = "
          f"{out.privacy['noise_multiplier']:.3f}, {out.global_step} steps of expected batch {args.batch_size}")

    plain_model = with_lora(copy.deepcopy(base), args.lora_rank)
    plain_args = transformers.TrainingArguments(
        output_dir=str(args.output_dir / "non_private"), **{**common, "per_device_train_batch_size": args.batch_size},
        max_steps=out.global_step, disable_tqdm=True,
    )
    from opake_compile.transformers import PadToLength

    transformers.Trainer(plain_model, plain_args, train_dataset=rows(x_priv),
                         data_collator=PadToLength(args.seq_len, tok.pad_token_id)).train()
    ppl_plain = perplexity(plain_model, x_test)
    wall = time.time() - t0
    print("summary (held-out perplexity, lower is better)")
    print(f"  before fine-tuning:        {ppl_before:8.2f}")
    print(f"  private LoRA fine-tune:    {ppl_private:8.2f}  (epsilon = {out.epsilon:.2f}, delta = {delta:g})")
    print(f"  non-private LoRA fine-tune:{ppl_plain:8.2f}  (epsilon = inf)")
    print(f"  wall time {wall:.0f} s; {torch.get_num_threads()} threads")
    if args.plot is not None:
        plot(trainer.state.log_history, args.plot)
        print(f"  plot: {args.plot}")
    return {"before": ppl_before, "private": ppl_private, "non_private": ppl_plain, "epsilon": out.epsilon}


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = [h for h in history if "loss" in h and "epsilon" in h]
    steps = [h["step"] for h in logs]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [h["loss"] for h in logs], color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (not privatised)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(steps, [h["epsilon"] for h in logs], color="tab:red")
    ax2.set_ylabel("epsilon spent", color="tab:red")
    ax.set_title("DPTrainer: LoRA fine-tune on pydoc topics")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
