"""opake_compile.transformers.trl: SFTTrainer / DPOTrainer on a tiny GPT-2 and a word-level
tokenizer built locally (no downloads)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it
tokenizers = pytest.importorskip("tokenizers")

from opake_compile.exceptions import ConfigurationError  # noqa: E402
from opake_compile.transformers.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

WORDS = "<eos> <unk> the cat dog sat ran on a mat log is good bad yes no question answer".split()


def word_tokenizer():
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.pad_token = fast.eos_token
    return fast


def tiny_gpt2(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=len(WORDS), n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "eager"
    return transformers.GPT2LMHeadModel(cfg)


def config(cls, tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], disable_tqdm=True, use_cpu=True, optim="sgd",
                learning_rate=0.1, max_steps=2, logging_steps=1, save_strategy="no", per_device_train_batch_size=4,
                target_delta=1e-3, noise_multiplier=1.0, expected_batch_size=4, dp_backend=None, dp_seed=0, max_length=16)
    base.update(kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**base)


def test_sft_prompt_completion_masks_prompt_and_trains(tmp_path):
    rows = [{"prompt": "the cat sat on", "completion": "a mat"}, {"prompt": "the dog ran", "completion": "on a log"}] * 10
    rows.append({"text": "the cat is good"})
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = SFTTrainer(model, config(SFTConfig, tmp_path), train_dataset=rows, processing_class=word_tokenizer())
    first = trainer.train_dataset[0]
    assert first["input_ids"] == [2, 3, 5, 7, 8, 9, 0]  # prompt, completion, eos
    assert first["labels"] == [-100, -100, -100, -100, 8, 9, 0]
    assert trainer.train_dataset[-1]["labels"] == trainer.train_dataset[-1]["input_ids"]  # text rows: all tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = trainer.train()
    assert out.global_step == 2 and 0 < out.epsilon < math.inf
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # Rows given to evaluate() are tokenized as the constructor's eval_dataset is (they reached
    # transformers as text, which raised "The batch received was empty": a newcomer's review).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        given = trainer.evaluate(eval_dataset=rows[:6])
        built = SFTTrainer(model, config(SFTConfig, tmp_path), train_dataset=rows, eval_dataset=rows[:6],
                           processing_class=word_tokenizer()).evaluate()
    assert math.isfinite(given["eval_loss"]) and given["eval_loss"] == pytest.approx(built["eval_loss"], rel=1e-6)


def test_sft_loads_a_model_id_with_default_attention_and_trains_on_padded_rows(tmp_path):
    """A model given by id (a local directory here) keeps transformers' default attention, SDPA,
    and trains on rows of different lengths (padded batches) to the same first step as the eager
    form of the same weights."""
    path = tmp_path / "model"
    tiny_gpt2(seed=3).save_pretrained(path)
    rows = [{"text": "the cat sat on a mat"}, {"text": "yes"}, {"text": "the dog ran"}, {"text": "a log is good"}] * 5
    trainers = {}
    for attn, model in (("sdpa", str(path)), ("eager", tiny_gpt2(seed=3))):
        trainers[attn] = SFTTrainer(model, config(SFTConfig, tmp_path / attn), train_dataset=rows,
                                    processing_class=word_tokenizer())
    assert trainers["sdpa"].model.config._attn_implementation == "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        firsts = {}
        for attn, trainer in trainers.items():
            trainer.setup_privacy()
            batch = trainer._collate_train([0, 1, 2, 3])
            firsts[attn] = trainer.dp_step(*[batch[k] for k in trainer._dp_keys])
        out = trainers["sdpa"].train()
    assert out.global_step == 2 and 0 < out.epsilon < math.inf
    a, b = firsts["sdpa"].clipped, firsts["eager"].clipped
    assert a.num_examples == b.num_examples == 4
    torch.testing.assert_close(a.per_example_norms, b.per_example_norms, rtol=1e-5, atol=0)
    for k in b.grads:
        torch.testing.assert_close(a.grads[k], b.grads[k], rtol=1e-5, atol=1e-7)


def test_sft_refusals(tmp_path):
    with pytest.raises(ConfigurationError, match="packing"):
        config(SFTConfig, tmp_path, packing=True)
    with pytest.raises(ConfigurationError, match="no SFT format"):
        SFTTrainer(tiny_gpt2(), config(SFTConfig, tmp_path), train_dataset=[{"question": "x"}] * 20,
                   processing_class=word_tokenizer())
    with pytest.raises(ConfigurationError, match="sigmoid"):
        config(DPOConfig, tmp_path, loss_type="hinge")
    with pytest.raises(ConfigurationError, match="precompute_ref_log_probs"):
        config(DPOConfig, tmp_path, precompute_ref_log_probs=False)


def test_dpo_reference_frozen_and_first_loss_log2(tmp_path):
    """Policy = reference at the start, so every pair's loss is log 2; the reference's
    log-probabilities are the frozen model's and do not move while the policy trains."""
    rows = [{"prompt": "question the cat", "chosen": "yes good", "rejected": "no bad"},
            {"prompt": "question the dog", "chosen": "no", "rejected": "yes a bad answer"}] * 10
    model = tiny_gpt2()
    ref = tiny_gpt2()
    ref_before = [p.detach().clone() for p in ref.parameters()]
    trainer = DPOTrainer(model, ref_model=ref, args=config(DPOConfig, tmp_path, beta=0.5),
                         train_dataset=rows, processing_class=word_tokenizer())
    from opake_compile.transformers.trl import sequence_log_probs

    r0 = trainer.train_dataset[1]
    ids = torch.tensor([r0["rejected_input_ids"]])
    want = sequence_log_probs(ref, ids, torch.ones_like(ids), torch.tensor([r0["rejected_labels"]])).item()
    assert r0["ref_rejected_logps"] == pytest.approx(want, rel=1e-5)
    assert r0["rejected_labels"][:3] == [-100, -100, -100]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Evaluation reads the pair columns (transformers dropped them, then called the model on
        # none: it failed in every form, a review); policy = reference, so the loss is log 2.
        assert trainer.evaluate(eval_dataset=rows[:4])["eval_loss"] == pytest.approx(math.log(2), rel=1e-5)
        assert trainer.evaluate(eval_dataset={"a": rows[:4]})["eval_a_loss"] == pytest.approx(math.log(2), rel=1e-5)
        trainer.setup_privacy()
        first = trainer.dp_step(*[trainer._collate_train([0, 1, 2])[k] for k in trainer._dp_keys])
        assert first.loss.item() == pytest.approx(math.log(2), rel=1e-5)
        out = trainer.train()
    assert out.global_step == 2 and out.epsilon > 0
    assert all(torch.equal(a, b) for a, b in zip(ref_before, ref.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
