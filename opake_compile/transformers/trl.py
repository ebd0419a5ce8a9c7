"""TRL-style trainers on :class:`~opake_compile.transformers.DPTrainer`: supervised fine-tuning
(``SFTTrainer`` / ``SFTConfig``) and direct preference optimisation (``DPOTrainer`` /
``DPOConfig``, Rafailov et al. 2023), with TRL's dataset formats and argument names.

Units of privacy:

* ``SFTTrainer``: one training *sequence* (one row of the dataset: a ``"text"``, a
  ``"prompt"``/``"completion"`` pair or a ``"messages"`` conversation). ``packing=True`` is
  refused: packing puts several rows into one sequence, so one sequence would no longer be one
  person's row (and cross-row attention would mix them).
* ``DPOTrainer``: one *preference pair* (``"prompt"``, ``"chosen"``, ``"rejected"``): the chosen
  and rejected completions of a row are in the same example, so the pair is clipped together.

The DPO reference model is frozen and is not trained: its log-probabilities of every pair are
computed once before training (what TRL calls ``precompute_ref_log_probs``, always on here) and
travel with the example as two numbers, so the reference model never enters the per-example
gradient. Without a ``ref_model``, the reference is the model itself as given (PEFT: the base
model with the adapters disabled; otherwise a frozen copy).

The ``trl`` package itself is not needed: only its formats and names are followed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from opake_compile.exceptions import ConfigurationError, InputTypeError
from opake_compile.transformers.trainer import DPTrainer
from opake_compile.transformers.training_args import TrainingArguments

__all__ = ["SFTConfig", "SFTTrainer", "DPOConfig", "DPOTrainer"]


@dataclasses.dataclass
class SFTConfig(TrainingArguments):
    """TRL's ``SFTConfig`` names on our :class:`TrainingArguments`.

    Args (beyond ``TrainingArguments``):
        dataset_text_field: the text column of language-modelling datasets (``"text"``).
        completion_only_loss: loss on the completion only (prompt-completion data). ``None``:
            ``True`` for prompt-completion rows, the whole sequence otherwise.
        packing: must stay ``False`` (see the module docstring).
        assistant_only_loss: must stay ``False`` (not implemented).
        eos_token: appended to each sequence (default: the tokenizer's).
        max_length: tokens per sequence (cut from the end, TRL's ``"keep_start"``); required, a
            public bound (a default from the data would release a private statistic).
    """

    dataset_text_field: str = "text"
    completion_only_loss: bool | None = None
    packing: bool = False
    assistant_only_loss: bool = False
    eos_token: str | None = None

    def validate_privacy(self) -> None:
        super().validate_privacy()
        if self.packing:
            raise ConfigurationError(
                "packing=True is refused: it puts several rows into one sequence, so the privacy unit "
                "(one row) would be split across examples. Keep packing=False; max_length bounds the padding."
            )
        if self.assistant_only_loss:
            raise ConfigurationError("assistant_only_loss=True is not supported; use prompt/completion rows.")


def _load_model(model: Any) -> torch.nn.Module:
    if isinstance(model, str):
        import transformers

        # transformers' default attention (SDPA where the model has it): compile_dp batches it
        # per example, padding masks included, and it holds no (T, T) probabilities for backward.
        return transformers.AutoModelForCausalLM.from_pretrained(model)
    if not isinstance(model, torch.nn.Module):
        raise InputTypeError(f"Expected a model (nn.Module) or a model id, got {type(model).__name__}.")
    return model


def _with_peft(model: torch.nn.Module, peft_config: Any) -> torch.nn.Module:
    if peft_config is None:
        return model
    import peft

    return peft.get_peft_model(model, peft_config)


def _ids(tok: Any, text: Any, *, chat: bool = False, generation_prompt: bool = False) -> list[int]:
    if chat:
        out = tok.apply_chat_template(text, tokenize=True, add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if isinstance(out, Mapping) else out)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _prepared(eval_dataset: Any, prepare: Callable[[Any], Any]) -> Any:
    """``eval_dataset`` as given to ``evaluate``: ``None`` (the constructor's), a dict of
    datasets (as is: ``Trainer.evaluate`` calls ``evaluate`` on each entry, which prepares it;
    preparing here too tokenized the rows twice: review), or rows (prepared)."""
    if eval_dataset is None or isinstance(eval_dataset, Mapping):
        return eval_dataset  # (a dict: transformers evaluates each entry through evaluate() again)
    return prepare(eval_dataset)


def _eos(tok: Any, eos_token: str | None) -> list[int]:
    if eos_token is not None:
        return [tok.convert_tokens_to_ids(eos_token)]
    return [] if tok.eos_token_id is None else [tok.eos_token_id]


class SFTTrainer(DPTrainer):
    """Supervised fine-tuning with DP-SGD, TRL's ``SFTTrainer`` interface (privacy unit: one row).

    Rows: ``{"text": ...}`` (the ``dataset_text_field``), ``{"prompt": ..., "completion": ...}``
    (strings, or message lists for conversational data), ``{"messages": [...]}`` (a chat
    template is applied), or already tokenised ``{"input_ids": [...]}``. ``formatting_func(row)
    -> str`` overrides them. Each row becomes ``input_ids`` and ``labels`` (-100 on the prompt when
    ``completion_only_loss``), cut to ``max_length``; the loss is the model's mean over the row's
    own target tokens.

    Args:
        model: an ``nn.Module`` (a causal LM, eager or SDPA attention) or a model id (loaded
            with transformers' default attention).
        args: :class:`SFTConfig`.
        train_dataset, eval_dataset: rows as above (a list of dicts or a ``datasets.Dataset``).
        processing_class: the tokenizer (required for text rows).
        peft_config: optional ``peft`` config; then only the adapters are trained and noised.
        formatting_func: optional ``row -> text``.

    Raises:
        ConfigurationError: ``packing=True``; a row in no known format.
    """

    def __init__(
        self,
        model: Any,
        args: SFTConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        formatting_func: Callable[[Mapping[str, Any]], str] | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, SFTConfig):
            raise InputTypeError(f"SFTTrainer needs an SFTConfig, got {type(args).__name__}.")
        self._sft_args = args
        self._tok = processing_class
        self._formatting_func = formatting_func
        model = _with_peft(_load_model(model), peft_config)
        train = self._tokenize(train_dataset)
        evals = None if eval_dataset is None else self._tokenize(eval_dataset)
        super().__init__(model, args, train_dataset=train, eval_dataset=evals, processing_class=processing_class, **kwargs)

    def _tokenize(self, dataset: Any) -> list[dict[str, list[int]]]:
        return [self._tokenize_row(row) for row in dataset]

    def evaluate(self, eval_dataset: Any = None, *pargs: Any, **kwargs: Any) -> Any:
        """``DPTrainer.evaluate``; rows passed here are tokenized as the constructor's
        ``eval_dataset`` is (they reached transformers as text, which failed: a newcomer's
        review). A dict of datasets is tokenized per entry. The metrics are not privatised."""
        return super().evaluate(_prepared(eval_dataset, self._tokenize), *pargs, **kwargs)

    def _tokenize_row(self, row: Mapping[str, Any]) -> dict[str, list[int]]:
        args, tok = self._sft_args, self._tok
        if "input_ids" in row and self._formatting_func is None:
            ids = list(row["input_ids"])
            labels = list(row.get("labels", ids))
        else:
            if tok is None:
                raise ConfigurationError("SFTTrainer needs processing_class (a tokenizer) for text rows.")
            eos = _eos(tok, args.eos_token)
            if self._formatting_func is not None:
                ids = _ids(tok, self._formatting_func(row)) + eos
                labels = list(ids)
            elif "prompt" in row and "completion" in row:
                chat = not isinstance(row["prompt"], str)
                if chat:
                    prompt = _ids(tok, row["prompt"], chat=True, generation_prompt=True)
                    full = _ids(tok, list(row["prompt"]) + list(row["completion"]), chat=True)
                    completion = full[len(prompt):]
                else:
                    prompt, completion = _ids(tok, row["prompt"]), _ids(tok, row["completion"]) + eos
                ids = prompt + completion
                only = args.completion_only_loss is not False
                labels = ([-100] * len(prompt) if only else prompt) + completion
            elif "messages" in row:
                ids = _ids(tok, row["messages"], chat=True)
                labels = list(ids)
            elif args.dataset_text_field in row:
                ids = _ids(tok, row[args.dataset_text_field]) + eos
                labels = list(ids)
            else:
                raise ConfigurationError(
                    f"Row with keys {sorted(row)} is in no SFT format: expected '{args.dataset_text_field}', "
                    "'prompt'+'completion', 'messages' or 'input_ids' (or pass formatting_func)."
                )
        if args.max_length is not None:
            ids, labels = ids[: args.max_length], labels[: args.max_length]
        return {"input_ids": ids, "labels": labels}


@dataclasses.dataclass
class DPOConfig(TrainingArguments):
    """TRL's ``DPOConfig`` names on our :class:`TrainingArguments`.

    Args (beyond ``TrainingArguments``):
        beta: the DPO temperature beta (deviation from the reference), default 0.1.
        loss_type: ``"sigmoid"`` (the DPO loss; TRL's default), as a string or a one-element list.
        label_smoothing: conservative DPO's flip probability eps in [0, 0.5):
            ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``.
        precompute_ref_log_probs: must stay ``True``: the reference log-probabilities are always
            computed once before training (see the module docstring).
        max_length: tokens of prompt + completion, for chosen and rejected alike.
    """

    beta: float = 0.1
    loss_type: Any = "sigmoid"
    label_smoothing: float = 0.0
    precompute_ref_log_probs: bool = True

    def validate_privacy(self) -> None:
        super().validate_privacy()
        kinds = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        if kinds != ["sigmoid"]:
            raise ConfigurationError(f"loss_type={self.loss_type!r} is not supported; use 'sigmoid' (DPO).")
        if not (0.0 <= float(self.label_smoothing) < 0.5):
            raise ConfigurationError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}.")
        if not float(self.beta) > 0:
            raise ConfigurationError(f"beta must be > 0, got {self.beta!r}.")
        if not self.precompute_ref_log_probs:
            raise ConfigurationError(
                "precompute_ref_log_probs=False is refused: the frozen reference model's log-probabilities are "
                "computed once before training so that the reference never enters the per-example gradient."
            )


def sequence_log_probs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       labels: torch.Tensor) -> torch.Tensor:
    """Sum over each row's target tokens (``labels != -100``, shifted by one) of
    ``log p(token | prefix)``: shape ``(B,)``."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    targets = labels[:, 1:]
    mask = targets != -100
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = torch.gather(logp, 2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * mask).sum(-1)


class DPOTrainer(DPTrainer):
    """Direct preference optimisation (Rafailov et al. 2023) with DP-SGD, TRL's ``DPOTrainer``
    interface (privacy unit: one preference pair).

    Rows: ``{"prompt": str, "chosen": str, "rejected": str}`` (or already tokenised
    ``prompt_input_ids``/``chosen_input_ids``/``rejected_input_ids``). The loss of a pair is
    ``-log sigmoid(beta ((log pi(c) - log ref(c)) - (log pi(r) - log ref(r))))`` with sequence
    log-probabilities summed over the completion tokens.

    Args:
        model: the policy (``nn.Module`` or model id).
        ref_model: the frozen reference (default: see the module docstring). Never trained.
        args: :class:`DPOConfig`.
        train_dataset, eval_dataset, processing_class, peft_config: as TRL's.
    """

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: DPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(args, DPOConfig):
            raise InputTypeError(f"DPOTrainer needs a DPOConfig, got {type(args).__name__}.")
        self._dpo_args = args
        self._tok = processing_class
        policy = _with_peft(_load_model(model), peft_config)
        if ref_model is not None:
            ref_model = _load_model(ref_model)
        train = self._prepare(train_dataset, policy, ref_model)
        evals = None if eval_dataset is None else self._prepare(eval_dataset, policy, ref_model)
        self.ref_model = ref_model
        super().__init__(policy, args, train_dataset=train, eval_dataset=evals, processing_class=processing_class, **kwargs)

    def evaluate(self, eval_dataset: Any = None, *pargs: Any, **kwargs: Any) -> Any:
        """``DPTrainer.evaluate``; rows passed here are prepared as the constructor's
        ``eval_dataset`` is, with ``ref_model``'s log-probabilities. The metrics are not
        privatised.

        Raises:
            ConfigurationError: rows passed here without a ``ref_model``: the reference is then
                the initial policy, which training has changed (pass them to the constructor).
        """
        if eval_dataset is not None and self.ref_model is None:
            raise ConfigurationError(
                "DPOTrainer.evaluate(eval_dataset=...) without a ref_model: the reference log-probabilities "
                "come from the initial policy, which training has changed. Pass eval_dataset to the "
                "constructor, or build the trainer with a ref_model."
            )
        prepare = lambda rows: self._prepare(rows, self.model, self.ref_model)  # noqa: E731
        return super().evaluate(_prepared(eval_dataset, prepare), *pargs, **kwargs)

    # Evaluation keeps every column: compute_loss reads the chosen / rejected ones, which
    # transformers dropped as unknown to the model's forward ("The batch received was empty").
    def _get_collator_with_removed_columns(self, data_collator: Any, description: str | None = None) -> Any:
        return data_collator

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        return dataset

    def prediction_step(self, model: torch.nn.Module, inputs: Mapping[str, Any], prediction_loss_only: bool,
                        ignore_keys: Any = None) -> tuple[torch.Tensor, None, None]:
        """The evaluation loss is the DPO loss of the pairs (transformers called the model on the
        pair columns, which it cannot read). The metric is not privatised."""
        inputs = self._prepare_inputs(dict(inputs))
        with torch.no_grad():
            loss = self.compute_loss(model, {k: (v.float() if k.startswith("ref_") else v) for k, v in inputs.items()})
        return loss.detach(), None, None

    # ------------------------------------------------------------------ data
    def _tokenize_row(self, row: Mapping[str, Any]) -> dict[str, list[int]]:
        tok, args = self._tok, self._dpo_args
        out: dict[str, list[int]] = {}
        if "chosen_input_ids" in row:
            prompt = list(row.get("prompt_input_ids", []))
            chosen, rejected = list(row["chosen_input_ids"]), list(row["rejected_input_ids"])
        else:
            if tok is None:
                raise ConfigurationError("DPOTrainer needs processing_class (a tokenizer) for text rows.")
            missing = {"prompt", "chosen", "rejected"} - set(row)
            if missing:
                raise ConfigurationError(f"DPO rows need 'prompt', 'chosen' and 'rejected'; missing {sorted(missing)}.")
            eos = _eos(tok, None)
            prompt = _ids(tok, row["prompt"])
            chosen, rejected = _ids(tok, row["chosen"]) + eos, _ids(tok, row["rejected"]) + eos
        for name, completion in (("chosen", chosen), ("rejected", rejected)):
            ids = prompt + completion
            labels = [-100] * len(prompt) + completion
            if args.max_length is not None:
                ids, labels = ids[: args.max_length], labels[: args.max_length]
            out[f"{name}_input_ids"], out[f"{name}_labels"] = ids, labels
            out[f"{name}_attention_mask"] = [1] * len(ids)
        return out

    @torch.no_grad()
    def _prepare(self, dataset: Any, policy: torch.nn.Module, ref_model: Any) -> list[dict[str, Any]]:
        from opake_compile.transformers.trainer import PadToLength

        rows = [self._tokenize_row(r) for r in dataset]
        length = max(len(r[k]) for r in rows for k in ("chosen_input_ids", "rejected_input_ids"))
        collate = PadToLength(length, 0, add_attention_mask=False)
        ref, restore = self._reference(policy, ref_model)
        try:
            was_training = ref.training
            ref.eval()
            for i in range(0, len(rows), 16):
                part = rows[i:i + 16]
                batch = collate(part)
                for name in ("chosen", "rejected"):
                    lp = sequence_log_probs(ref, batch[f"{name}_input_ids"], batch[f"{name}_attention_mask"],
                                            batch[f"{name}_labels"])
                    for r, v in zip(part, lp.tolist()):
                        r[f"ref_{name}_logps"] = v
            ref.train(was_training)
        finally:
            restore()
        return rows

    def _reference(self, policy: torch.nn.Module, ref_model: Any) -> tuple[torch.nn.Module, Callable[[], None]]:
        if ref_model is not None:
            return ref_model, lambda: None
        if hasattr(policy, "disable_adapter"):  # PEFT: the base model is the reference
            ctx = policy.disable_adapter()
            ctx.__enter__()
            return policy, lambda: ctx.__exit__(None, None, None)
        frozen = copy.deepcopy(policy)
        for p in frozen.parameters():
            p.requires_grad_(False)
        return frozen, lambda: None

    # ------------------------------------------------------------------ loss
    def compute_loss(self, model: torch.nn.Module, inputs: Mapping[str, torch.Tensor], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """The DPO loss of each pair (mean over the batch; per pair under the per-example
        transform). ``num_items_in_batch`` is ignored."""
        args = self._dpo_args
        chosen = sequence_log_probs(model, inputs["chosen_input_ids"], inputs["chosen_attention_mask"],
                                    inputs["chosen_labels"])
        rejected = sequence_log_probs(model, inputs["rejected_input_ids"], inputs["rejected_attention_mask"],
                                      inputs["rejected_labels"])
        h = (chosen - inputs["ref_chosen_logps"]) - (rejected - inputs["ref_rejected_logps"])
        eps = float(args.label_smoothing)
        loss = -(1 - eps) * F.logsigmoid(args.beta * h) - eps * F.logsigmoid(-args.beta * h)
        loss = loss.mean()
        return (loss, {"rewards": args.beta * h}) if return_outputs else loss

    def _collate_train(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        batch = super()._collate_train(indices)
        return {k: (v.float() if k.startswith("ref_") else v) for k, v in batch.items()}
