"""DPTrainer / TrainingArguments (opake_compile.transformers) on a tiny GPT-2 built from a config."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it

from opake_compile import accounting as acc  # noqa: E402
from opake_compile.exceptions import CheckpointError, ConfigurationError, PrivacyBudgetExhaustedError  # noqa: E402
from opake_compile.transformers import DPTrainer, TrainingArguments  # noqa: E402

VOCAB, T = 48, 8


def tiny_gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    cfg._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(cfg)


def lm_rows(n: int, seed: int = 1, label_lengths: list[int] | None = None) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (n, T), generator=g)
    rows = []
    for i in range(n):
        labels = ids[i].clone()
        if label_lengths is not None:
            labels[label_lengths[i]:] = -100
        rows.append({"input_ids": ids[i].tolist(), "labels": labels.tolist()})
    return rows


def dp_args(tmp_path, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(tmp_path), report_to=[], disable_tqdm=True, use_cpu=True,
        optim="sgd", learning_rate=0.5, weight_decay=0.0, lr_scheduler_type="constant",
        per_device_train_batch_size=8, max_steps=3, logging_steps=1, save_strategy="no",
        target_delta=1e-5, dp_backend="aot_eager", dp_seed=0, max_length=T,
    )
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TrainingArguments(**base)


def quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


def test_non_private_limit_equals_plain_trainer(tmp_path):
    """sigma = 0, C huge, q = 1, equal lengths: the same parameters as Hugging Face's Trainer.

    The first label of every row is -100: Trainer counts num_items_in_batch before the causal
    shift, so with it the batch divisor equals the number of shifted targets (7 per row) and
    its batch mean is the mean of the per-example token means."""
    rows = lm_rows(6)
    for r in rows:
        r["labels"][0] = -100
    plain_model = tiny_gpt2()
    plain_args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "plain"), report_to=[], disable_tqdm=True, use_cpu=True,
        optim="sgd", learning_rate=0.5, weight_decay=0.0, lr_scheduler_type="constant",
        per_device_train_batch_size=6, max_steps=3, max_grad_norm=0.0, save_strategy="no",
        logging_steps=100,
    )
    from opake_compile.transformers.trainer import PadToLength
    quiet(transformers.Trainer(plain_model, plain_args, train_dataset=rows,
                               data_collator=PadToLength(T)).train)
    dp_model = tiny_gpt2()
    args = dp_args(tmp_path / "dp", noise_multiplier=0.0, clipping_norm=1e6, sample_rate=1.0,
                   per_device_train_batch_size=4)
    trainer = DPTrainer(dp_model, args, train_dataset=rows)
    out = quiet(trainer.train)
    assert out.global_step == 3
    for (name, p), q in zip(plain_model.named_parameters(), dp_model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    moved = max((a - b).abs().max().item() for a, b in zip(tiny_gpt2().parameters(), dp_model.parameters()))
    assert moved > 1e-3  # training did something


def test_epsilon_logged_equals_accountant(tmp_path):
    """Calibrated sigma spends the target over the planned steps; every logged epsilon is the
    accountant's for the steps taken so far."""
    n, steps = 40, 3
    args = dp_args(tmp_path, target_epsilon=4.0, expected_batch_size=4, max_steps=steps, dp_backend=None)
    trainer = DPTrainer(tiny_gpt2(), args, train_dataset=lm_rows(n), eval_dataset=lm_rows(4, seed=9))
    out = quiet(trainer.train)
    sigma, q = out.privacy["noise_multiplier"], out.privacy["sample_rate"]
    assert q == pytest.approx(0.1) and out.privacy["dataset_size"] == n
    accountant = acc.Accountant("pld")
    step = acc.dpsgd_step_process(sigma, q, dataset_size=n)
    logged = [h for h in trainer.state.log_history if "epsilon" in h and "learning_rate" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
    for h in logged:
        assert h["epsilon"] == pytest.approx(accountant.epsilon(step * h["step"], 1e-5), rel=1e-9)
    assert out.epsilon == pytest.approx(accountant.epsilon(step * steps, 1e-5), rel=1e-9)
    assert 0.97 * 4.0 <= out.epsilon <= 4.0  # calibrated to the target, never above it
    assert out.delta == 1e-5 and trainer.dp_optimizer.steps == steps
    metrics = quiet(trainer.evaluate)
    assert metrics.epsilon == out.epsilon and not metrics.privatised and math.isfinite(metrics["eval_loss"])
    empty = trainer._collate_train([])  # an empty Poisson draw: (0, T) tensors, a zero clipped sum
    assert all(v.shape[0] == 0 for v in empty.values()) and empty["input_ids"].shape == (0, T)
    zero = trainer.dp_step(*[empty[k] for k in trainer._dp_keys]).clipped
    assert all(float(g.abs().sum()) == 0.0 for g in zero.grads.values())


def _reference_update(rows, reduce: str, lr: float) -> list[torch.Tensor]:
    """theta_0 - lr * (sum_i grad loss_i) / N, loss_i normalised by example i's own token count
    ("mean"), summed ("sum") or by the batch's token count ("batch", the wrong one)."""
    from opake_compile.transformers.trainer import PadToLength
    model = tiny_gpt2()
    batch = PadToLength(T)(rows)
    total = sum((torch.tensor(r["labels"][1:]) != -100).sum().item() for r in rows)
    grads = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(len(rows)):
        logits = model(input_ids=batch["input_ids"][i:i + 1], attention_mask=batch["attention_mask"][i:i + 1]).logits
        labels = batch["labels"][i, 1:]
        tok = torch.nn.functional.cross_entropy(logits[0, :-1], labels, ignore_index=-100, reduction="sum")
        count = (labels != -100).sum()
        loss = {"mean": tok / count, "sum": tok, "batch": tok / total * len(rows)}[reduce]
        for g, d in zip(grads, torch.autograd.grad(loss, list(model.parameters()))):
            g += d
    return [p.detach() - lr * g / len(rows) for p, g in zip(model.parameters(), grads)]


def test_training_loss_is_logged_only_when_asked(tmp_path):
    """The training loss is a noise-free statistic of the private batches, and the Trainer's
    logs are saved in every checkpoint's trainer_state.json (uploaded by push_to_hub) and sent
    to the report_to integrations: by default no log holds it; log_training_loss=True logs it."""
    import json

    for opted in (False, True):
        out_dir = tmp_path / str(opted)
        args = dp_args(out_dir, noise_multiplier=1.0, expected_batch_size=4, max_steps=2, dp_backend=None,
                       save_strategy="steps", save_steps=2, log_training_loss=opted)
        trainer = DPTrainer(tiny_gpt2(), args, train_dataset=lm_rows(20))
        out = quiet(trainer.train)
        saved = json.loads((out_dir / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
        for history in (trainer.state.log_history, saved):
            keys = {k for h in history for k in h}
            assert ("loss" in keys) == opted, (opted, keys)
            assert "epsilon" in keys
        assert ("train_loss" in {k for h in trainer.state.log_history for k in h}) == opted
        assert math.isfinite(out.training_loss)  # returned to the caller, not logged


def test_per_example_normalisation_not_batch_divisor(tmp_path):
    """Rows with 7, 5, 3, 1 target tokens: the update is the mean of each example's own
    token-mean gradient, not sum / (tokens in the batch). A user's compute_loss override is
    used and never receives num_items_in_batch."""
    rows = lm_rows(4, label_lengths=[8, 6, 4, 2])
    seen = []

    class SumLoss(DPTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.append(num_items_in_batch)
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            labels = inputs["labels"][:, 1:]
            return torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum"
            )

    common = dict(noise_multiplier=0.0, clipping_norm=1e6, sample_rate=1.0, max_steps=1, dp_backend=None,
                  learning_rate=1.0)
    default = DPTrainer(tiny_gpt2(), dp_args(tmp_path / "a", **common), train_dataset=rows)
    quiet(default.train)
    want, wrong = _reference_update(rows, "mean", 1.0), _reference_update(rows, "batch", 1.0)
    got = [p.detach() for p in default.model.parameters()]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    assert max((g - w).abs().max().item() for g, w in zip(got, wrong)) > 1e-3  # the test can fail
    summed = SumLoss(tiny_gpt2(), dp_args(tmp_path / "b", **common), train_dataset=rows)
    quiet(summed.train)
    assert seen and all(v is None for v in seen)
    for g, w in zip(summed.model.parameters(), _reference_update(rows, "sum", 1.0)):
        torch.testing.assert_close(g.detach(), w, rtol=1e-4, atol=1e-6)


def test_peft_trains_only_adapters(tmp_path):
    peft = pytest.importorskip("peft")
    base = tiny_gpt2()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"],
                                                      fan_in_fan_out=True, lora_dropout=0.0))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    args = dp_args(tmp_path, noise_multiplier=1.0, target_epsilon=50.0, expected_batch_size=4, max_steps=2,
                   dp_backend=None)
    trainer = DPTrainer(model, args, train_dataset=lm_rows(40))
    quiet(trainer.train)
    trained = {k for k, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in k for k in trained)
    for k, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[k])
        assert changed == (k in trained), k
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad
    }


def test_resume_continues_epsilon_and_randomness(tmp_path):
    """Save at step 2, resume from it in a fresh trainer and model: the same parameters (noise,
    sampling) and the same epsilon as the uninterrupted 4-step run."""
    rows = lm_rows(24)
    kw = dict(noise_multiplier=1.0, expected_batch_size=6, max_steps=4, dp_backend=None,
              save_strategy="steps", save_steps=2, dp_seed=None)
    full = DPTrainer(tiny_gpt2(), dp_args(tmp_path / "full", **kw), train_dataset=rows)
    out_full = quiet(full.train)
    assert (tmp_path / "full" / "checkpoint-2" / "dp_state").is_dir()
    resumed = DPTrainer(tiny_gpt2(), dp_args(tmp_path / "full", **kw), train_dataset=rows)
    # checkpoint-4 is newer: resuming from checkpoint-2 replays steps 3-4's noise (a review
    # resumed on edited rows and read their clipped sums' difference without noise), so it
    # takes rewind=True, here for the bit-for-bit comparison on the same rows.
    with pytest.raises(CheckpointError, match="older than checkpoint-4"):
        quiet(resumed.train, resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    # The same checkpoint under another name (a "best model" copy) is as old (review: it was
    # resumed from, and the replayed noise cancelled between the two runs).
    import shutil

    shutil.copytree(tmp_path / "full" / "checkpoint-2", tmp_path / "best_model")
    with pytest.raises(CheckpointError, match="older than checkpoint-4"):
        quiet(resumed.train, resume_from_checkpoint=str(tmp_path / "best_model"))
    assert all(torch.equal(a, b) for a, b in zip(tiny_gpt2().parameters(), resumed.model.parameters()))
    out = quiet(resumed.train, resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"), rewind=True)
    assert out.global_step == 4 and resumed.dp_optimizer.steps == 4
    assert out.epsilon == out_full.epsilon
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    noisy = DPTrainer(tiny_gpt2(), dp_args(tmp_path / "other", **kw), train_dataset=rows)  # fresh entropy
    quiet(noisy.train)
    assert any(not torch.equal(a, b) for a, b in zip(full.model.parameters(), noisy.model.parameters()))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(gradient_accumulation_steps=2, sample_rate=0.1, noise_multiplier=1.0), "expected_batch_size"),
        (dict(poisson_sampling=False, sample_rate=0.1, noise_multiplier=1.0), "poisson_sampling=True"),
        (dict(sample_rate=0.1, expected_batch_size=4, noise_multiplier=1.0), "exactly one"),
        (dict(noise_multiplier=1.0), "exactly one"),
        (dict(sample_rate=0.1), "target_epsilon"),
        (dict(sample_rate=0.1, noise_multiplier=1.0, target_delta=None), "target_delta"),
        (dict(sample_rate=0.1, noise_multiplier=1.0, noise_mechanism="laplace"), "gaussian"),
        (dict(sample_rate=0.1, noise_multiplier=1.0, accountant="moments"), "accountant"),
        (dict(sample_rate=0.1, noise_multiplier=-1.0), "noise_multiplier"),
        # Options the loop did not apply were accepted silently (review); refused now.
        (dict(sample_rate=0.1, noise_multiplier=1.0, auto_find_batch_size=True), "auto_find_batch_size is not applied"),
        (dict(sample_rate=0.1, noise_multiplier=1.0, neftune_noise_alpha=5.0), "neftune_noise_alpha is not applied"),
        (dict(sample_rate=0.1, noise_multiplier=1.0, load_best_model_at_end=True, eval_strategy="steps",
              save_strategy="steps"), "load_best_model_at_end is not applied"),
        (dict(sample_rate=0.1, noise_multiplier=1.0, bf16=True), "bf16 is not applied"),
    ],
)
def test_arguments_refused_up_front(tmp_path, kw, match):
    with pytest.raises(ConfigurationError, match=match):
        dp_args(tmp_path, **kw)


def test_trainer_refusals(tmp_path):
    rows = lm_rows(40)
    with pytest.raises(ConfigurationError, match=r"N\^-1.1"):
        DPTrainer(tiny_gpt2(), dp_args(tmp_path, noise_multiplier=1.0, sample_rate=0.1, target_delta=0.05),
                  train_dataset=rows)
    with pytest.raises(ConfigurationError, match="max_length is required"):
        DPTrainer(tiny_gpt2(), dp_args(tmp_path, noise_multiplier=1.0, sample_rate=0.1, max_length=None), train_dataset=rows)
    with pytest.raises(ConfigurationError, match="sample_rate=1.0"):
        DPTrainer(tiny_gpt2(), dp_args(tmp_path, noise_multiplier=1.0, expected_batch_size=41), train_dataset=rows)
    with pytest.raises(Exception, match="TrainingArguments"):
        DPTrainer(tiny_gpt2(), transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[]),
                  train_dataset=rows)
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    small = DPTrainer(model, dp_args(tmp_path, noise_multiplier=0.5, target_epsilon=0.5, sample_rate=0.1,
                                     max_steps=50), train_dataset=rows)
    with pytest.raises(PrivacyBudgetExhaustedError, match="raise noise_multiplier"):
        quiet(small.train)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ConfigurationError, match="not the DP step"):
        small.training_step(model, {})
    # A user's optimizer was replaced silently (review); and fields changed after construction
    # are checked again before training.
    with pytest.raises(ConfigurationError, match="would be replaced"):
        DPTrainer(model, dp_args(tmp_path, noise_multiplier=1.0, sample_rate=0.1), train_dataset=rows,
                  optimizers=(torch.optim.SGD(model.parameters(), lr=0.0), None))
    late = DPTrainer(tiny_gpt2(), dp_args(tmp_path, noise_multiplier=1.0, sample_rate=0.1), train_dataset=rows)
    late.args.gradient_accumulation_steps = 4
    with pytest.raises(ConfigurationError, match="gradient_accumulation_steps=4"):
        quiet(late.train)


def test_the_collator_sees_one_example_at_a_time(tmp_path):
    """Each example is collated alone. A packing collator turned a draw of 8 rows into one
    (1, 64) row (removing one real example moved the clipped sum by up to 1.10 C), and a
    collator padding on the left to the draw's longest row shifted every other row's positions
    with that row's presence (2.1 C at 6 rows, 6 C at 24: review). A collator that makes several
    rows of one example is refused, naming the key."""

    def flatten(rows):
        ids = [t for r in rows for t in r["input_ids"]]
        return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([ids])}

    def left_pad(rows):
        longest = max(len(r["input_ids"]) for r in rows)
        pad = lambda xs, v: [v] * (longest - len(xs)) + xs  # noqa: E731
        return {"input_ids": torch.tensor([pad(r["input_ids"], 0) for r in rows]),
                "attention_mask": torch.tensor([pad([1] * len(r["input_ids"]), 0) for r in rows]),
                "labels": torch.tensor([pad(r["labels"], -100) for r in rows])}

    rows = [{"input_ids": r["input_ids"][: 2 + i % 6], "labels": r["labels"][: 2 + i % 6]} for i, r in enumerate(lm_rows(40))]
    args = dp_args(tmp_path, noise_multiplier=1.0, expected_batch_size=4, max_steps=1, dp_backend=None)
    packing = DPTrainer(tiny_gpt2(), args, train_dataset=lm_rows(40), data_collator=flatten)
    assert packing._collate_train([0, 1, 2])["input_ids"].shape == (3, T)
    lefty = DPTrainer(tiny_gpt2(), args, train_dataset=rows, data_collator=left_pad)
    alone = lefty._collate_train([0])
    for draw in ([0, 5], [0, 4, 5], [3, 0]):
        got = lefty._collate_train(draw)
        row = draw.index(0)
        assert all(torch.equal(got[k][row], alone[k][0]) for k in alone), draw

    def split(rows):  # one example as two rows
        ids = torch.tensor([r["input_ids"] for r in rows])
        return {"input_ids": torch.cat([ids, ids]), "labels": torch.cat([ids, ids])}

    splitting = DPTrainer(tiny_gpt2(), args, train_dataset=lm_rows(40), data_collator=split)
    with pytest.raises(ConfigurationError, match=r"returned 'input_ids' with shape \(2, \d+\) for one example"):
        splitting._collate_train([0, 1, 2])


def test_the_seed_is_not_pickled_or_logged_and_training_mode_survives_evaluation(tmp_path):
    """``training_args.bin`` (written beside the weights, uploaded by ``push_to_hub``) carried
    ``dp_seed``, from which the run's draws and noise were rebuilt exactly; and after an
    ``evaluate()`` during training the rest of the run trained in eval mode (dropout off)."""
    import pickle

    args = dp_args(tmp_path, noise_multiplier=1.0, expected_batch_size=4, max_steps=4, dp_backend=None, dp_seed=7)
    assert pickle.loads(pickle.dumps(args)).dp_seed is None and args.to_dict()["dp_seed"] is None
    assert args.dp_seed == 7
    # print(args) and repr (transformers builds them from every field; example scripts log them).
    assert "dp_seed=<DP_SEED>" in str(args) and "dp_seed=<DP_SEED>" in repr(args) and "dp_seed=7" not in str(args)
    trainer = DPTrainer(tiny_gpt2(), args, train_dataset=lm_rows(40), eval_dataset=lm_rows(4, seed=9))
    modes = []

    class EvalMidway(transformers.TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            if state.global_step == 2:
                trainer.model.eval()  # what an evaluate() callback leaves behind
            return control

        def on_step_end(self, a, state, control, **kw):
            modes.append(trainer.model.training)
            return control

    trainer.add_callback(EvalMidway())
    quiet(trainer.train)
    assert modes == [True] * 4


def test_an_older_checkpoint_resumes_when_the_newer_one_is_incomplete_or_another_run(tmp_path):
    """The rewind guard counts only complete checkpoints of the same run: after a save that
    was interrupted (no complete dp_state), or beside another run's later checkpoint, resuming
    from the last complete checkpoint of this run replays nothing and is accepted."""
    import shutil

    rows = lm_rows(24)
    kw = dict(noise_multiplier=1.0, expected_batch_size=6, max_steps=4, dp_backend=None,
              save_strategy="steps", save_steps=2, dp_seed=None)
    quiet(DPTrainer(tiny_gpt2(), dp_args(tmp_path / "a", **kw), train_dataset=rows).train)
    for f in (tmp_path / "a" / "checkpoint-4" / "dp_state").glob("ckpt-*"):  # the save was cut short
        f.unlink()
    resumed = DPTrainer(tiny_gpt2(), dp_args(tmp_path / "a", **kw), train_dataset=rows)
    assert quiet(resumed.train, resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2")).global_step == 4

    quiet(DPTrainer(tiny_gpt2(), dp_args(tmp_path / "b", **kw), train_dataset=rows).train)  # another run (fresh keys)
    shutil.copytree(tmp_path / "b" / "checkpoint-4", tmp_path / "c" / "checkpoint-4")
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "c" / "checkpoint-2")
    other = DPTrainer(tiny_gpt2(), dp_args(tmp_path / "c", **kw), train_dataset=rows)
    assert quiet(other.train, resume_from_checkpoint=str(tmp_path / "c" / "checkpoint-2")).global_step == 4


def test_early_stopping_reads_the_best_metric(tmp_path):
    """EarlyStoppingCallback compares each evaluation with state.best_metric, which DPTrainer
    never set: every evaluation counted as an improvement and training ran to the end (review).
    The stop must now follow the logged evaluation losses as the callback's rule does."""
    args = dp_args(tmp_path, noise_multiplier=1.0, expected_batch_size=4, max_steps=12, dp_backend=None,
                   eval_strategy="steps", eval_steps=1, metric_for_best_model="loss", greater_is_better=True,
                   learning_rate=0.5)
    trainer = DPTrainer(tiny_gpt2(), args, train_dataset=lm_rows(40), eval_dataset=lm_rows(4, seed=9),
                        callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=2)])
    quiet(trainer.train)
    losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    best, waited, stop = None, 0, len(losses)
    for i, v in enumerate(losses):  # the callback's rule: improvement = greater (greater_is_better)
        if best is None or v > best:
            best, waited = v, 0
        else:
            waited += 1
            if waited >= 2:
                stop = i + 1
                break
    assert trainer.state.best_metric == max(losses[:stop])
    assert trainer.state.global_step == stop and len(losses) == stop
    assert stop < 12  # (this run stops at step 9 of 12: two evaluations without a new highest loss)


def test_a_second_train_call_continues_the_run(tmp_path):
    """train() stopped at step 2 by a callback, then train() again: the same parameters, step
    count, checkpoint names and epsilon as one uninterrupted 4-step run (the step count restarted
    at 0 before while the accountant went on, and checkpoint-2 was overwritten by step 4's
    state). A third call has nothing left to do; raising max_steps in between is refused."""
    rows = lm_rows(24)
    kw = dict(noise_multiplier=1.0, expected_batch_size=6, max_steps=4, save_strategy="steps", save_steps=2)
    full = DPTrainer(tiny_gpt2(), dp_args(tmp_path / "full", **kw), train_dataset=rows)
    out_full = quiet(full.train)

    class StopAt2(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                control.should_training_stop = True

    parts = DPTrainer(tiny_gpt2(), dp_args(tmp_path / "parts", **kw), train_dataset=rows, callbacks=[StopAt2()])
    assert quiet(parts.train).global_step == 2
    parts.remove_callback(StopAt2)
    out = quiet(parts.train)
    assert out.global_step == 4 and parts.dp_optimizer.steps == 4
    assert out.epsilon == out_full.epsilon
    assert all(torch.equal(a, b) for a, b in zip(full.model.parameters(), parts.model.parameters()))
    from opake_compile.checkpoint import Checkpointer

    assert Checkpointer(tmp_path / "parts" / "checkpoint-2" / "dp_state").latest_step() == 2
    assert Checkpointer(tmp_path / "parts" / "checkpoint-4" / "dp_state").latest_step() == 4
    before = [p.detach().clone() for p in parts.model.parameters()]
    assert quiet(parts.train).global_step == 4 and parts.dp_optimizer.steps == 4
    assert all(torch.equal(a, b) for a, b in zip(before, parts.model.parameters()))
    parts.args.max_steps = 6
    with pytest.raises(ConfigurationError, match="plan 6 steps"):
        quiet(parts.train)
    assert parts.dp_optimizer.steps == 4
