"""``DPTrainer``: Hugging Face's ``Trainer`` whose training step is DP-SGD.

Each optimizer step is one Poisson draw of the training set (Abadi et al. 2016; sampling and
accounting as in :mod:`opake_compile.sampling` and :mod:`opake_compile.accounting`): the draw is
collated into sequences of one fixed length (so the compiled step never recompiles), the
compiled step (:func:`opake_compile.compile_dp`) returns the sum of the per-example gradients
of the trainable parameters, each clipped to ``clipping_norm``, and
:class:`opake_compile.DPOptimizer` adds Gaussian noise once to that sum, divides by the expected
batch size ``q N`` and steps the optimizer that ``Trainer.create_optimizer`` built from the
arguments (``optim``, ``learning_rate``, ``weight_decay``, ...), with Hugging Face's scheduler.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.trainer_callback import ExportableState, TrainerState

from opake_compile import accounting as _acc
from opake_compile import random as _random
from opake_compile.checkpoint import Checkpointer
from opake_compile.compiler import compile_dp
from opake_compile.exceptions import (
    CheckpointError,
    ConfigurationError,
    InputTypeError,
    PrivacyBudgetExhaustedError,
)
from opake_compile.optim import DPOptimizer
from opake_compile.sampling import PoissonSampler
from opake_compile.transformers.trainer.types import EvaluationResult, TrainOutput
from opake_compile.transformers.training_args import TrainingArguments

__all__ = ["DPTrainer", "PadToLength"]

logger = logging.getLogger(__name__)

_DP_STATE_DIR = "dp_state"
_ROOT_DIR = "root_key"
_SEQUENCE_PAD = {"labels": -100, "attention_mask": 0, "token_type_ids": 0}
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def _as_row_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value)


class PadToLength:
    """Collate examples (dicts) into tensors whose sequence keys all have length ``max_length``.

    Keys whose value is a 1-D sequence (``input_ids``, ``attention_mask``, ``labels``, ...) are cut
    to ``max_length`` and padded on the right: ``labels`` with -100 (ignored by the loss),
    ``attention_mask`` and ``token_type_ids`` with 0, anything else (``input_ids``) with
    ``pad_token_id``. Scalars (a class label) are stacked. String values are dropped. ``label``
    is renamed ``labels`` (as Hugging Face's collators do). With ``add_attention_mask`` an
    ``attention_mask`` of the real positions is added when the examples carry none.

    Padding and cutting act on each example alone, so they never mix examples.

    Args:
        max_length: T, the length of every sequence key.
        pad_token_id: the id written into padded ``input_ids`` positions (masked out).
        keys: optional keys to keep (default: every non-string key).
        add_attention_mask: add a 0/1 ``attention_mask`` for ``input_ids`` if missing.
        sequence_keys: the keys padded per position; default: every key whose values are 1-D.
    """

    def __init__(
        self,
        max_length: int,
        pad_token_id: int = 0,
        *,
        keys: Sequence[str] | None = None,
        add_attention_mask: bool = True,
        sequence_keys: Sequence[str] | None = None,
    ) -> None:
        self.max_length = int(max_length)
        self.pad_token_id = int(pad_token_id)
        self.keys = None if keys is None else tuple(keys)
        self.add_attention_mask = add_attention_mask
        self.sequence_keys = None if sequence_keys is None else tuple(sequence_keys)

    def _pad_value(self, key: str) -> int:
        if key in _SEQUENCE_PAD:
            return _SEQUENCE_PAD[key]
        if key.endswith("labels"):
            return -100
        if key.endswith("attention_mask"):
            return 0
        return self.pad_token_id

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if not features:
            raise InputTypeError("PadToLength needs at least one example (slice a one-example batch for empty).")
        first = {("labels" if k == "label" else k): v for k, v in features[0].items()}
        names = [k for k, v in first.items() if not isinstance(v, str) and v is not None]
        if self.keys is not None:
            names = [k for k in names if k in self.keys]
        out: dict[str, torch.Tensor] = {}
        lengths = None
        for name in names:
            src = "label" if name == "labels" and "labels" not in features[0] else name
            rows = [_as_row_tensor(f[src]) for f in features]
            sequence = rows[0].dim() >= 1 if self.sequence_keys is None else name in self.sequence_keys
            if not sequence:
                out[name] = torch.stack(rows)
                continue
            t = self.max_length
            pad = self._pad_value(name)
            padded = torch.full((len(rows), t, *rows[0].shape[1:]), pad, dtype=rows[0].dtype)
            row_lengths = []
            for i, r in enumerate(rows):
                n = min(r.shape[0], t)
                padded[i, :n] = r[:n]
                row_lengths.append(n)
            out[name] = padded
            if name == "input_ids":
                lengths = row_lengths
        if self.add_attention_mask and "input_ids" in out and "attention_mask" not in out and lengths is not None:
            mask = torch.zeros(len(lengths), self.max_length, dtype=torch.long)
            for i, n in enumerate(lengths):
                mask[i, :n] = 1
            out["attention_mask"] = mask
        return out


class DPTrainer(transformers.Trainer):
    """A :class:`transformers.Trainer` that trains with DP-SGD (per-example clipping + Gaussian
    noise + Poisson sampling + accounting). Same constructor as ``Trainer``; ``args`` must be
    :class:`opake_compile.transformers.TrainingArguments`.

    Training: ``train()`` runs its own loop (Hugging Face's gradient accumulation, batch-gradient
    clipping and shuffled sampler are not DP and are not used) with the Trainer's callbacks
    (``on_train_begin``, ``on_step_begin/end``, ``on_log``, ``on_save``, ``on_evaluate``,
    ``on_train_end``; the tqdm bar), its optimizer and scheduler (``create_optimizer``,
    ``create_scheduler``), ``log`` (every ``logging_steps``: ``learning_rate``, ``epsilon``, and
    with ``log_training_loss=True`` the ``loss``, **not privatised**: logs are saved in every
    checkpoint and sent to the ``report_to`` integrations), ``evaluate`` and ``save_model``.

    The loss: ``compute_loss(model, inputs)`` (override it as with ``Trainer``) is traced per
    example: its value on a batch of one example is that example's loss, so a mean over tokens is
    each example's own mean. ``DPTrainer`` never passes ``num_items_in_batch``: a batch-level
    divisor would make one example's presence rescale every other example's contribution, and the
    sensitivity of the clipped sum would no longer be C.

    Privacy: ``sigma`` is ``noise_multiplier`` or calibrated so that the planned steps
    (``max_steps``, else ``num_train_epochs`` epochs of ``round(1/q)`` steps) spend exactly
    ``target_epsilon`` at ``target_delta``; with a target epsilon the optimizer refuses any step
    beyond it (:class:`~opake_compile.exceptions.PrivacyBudgetExhaustedError`, nothing changes).
    Only parameters with ``requires_grad=True`` are trained and noised (PEFT: the adapters).
    The unit of privacy is one row of ``train_dataset``.

    Checkpoints: ``output_dir/checkpoint-<step>/`` holds ``save_model``'s files, the Trainer state
    and ``dp_state/`` (an :class:`opake_compile.Checkpointer` file: model, optimizer moments, the
    noise key and steps charged, the sampler's position, the compiled step's dropout key, the
    scheduler). ``train(resume_from_checkpoint=True | path)`` continues bit for bit (same machine,
    same torch): the same epsilon and the same noise as the uninterrupted run.

    Raises:
        InputTypeError: ``args`` is not our ``TrainingArguments``; no ``train_dataset``.
        ConfigurationError: ``target_delta > N^-1.1`` (releasing one random record is already
            (0, 1/N)-DP), ``expected_batch_size > N``, sequences of different keys.
        CalibrationError: no sigma in [0.3, 200] meets the target.
        PrivacyBudgetExhaustedError: an explicit ``noise_multiplier`` with a ``target_epsilon``
            that does not allow the planned steps (raised by ``train()`` before any step).
    """

    def __init__(self, model: Any = None, args: TrainingArguments | None = None, *pargs: Any, **kwargs: Any) -> None:
        if not isinstance(args, TrainingArguments):
            raise InputTypeError(
                "DPTrainer needs opake_compile.transformers.TrainingArguments (with the privacy fields), "
                f"got {type(args).__name__}."
            )
        names = ("data_collator", "train_dataset", "eval_dataset", "processing_class", "model_init",
                 "compute_loss_func", "compute_metrics", "callbacks", "optimizers")
        for name, value in zip(names, pargs):
            kwargs[name] = value
        pargs = ()
        args.validate_privacy()  # again: the fields may have changed since construction
        if any(x is not None for x in (kwargs.get("optimizers") or (None, None))):
            raise ConfigurationError(
                "optimizers=(optimizer, scheduler) would be replaced: DPTrainer builds them from the "
                "arguments (optim, learning_rate, weight_decay, lr_scheduler_type, ...), or from "
                "optimizer_cls_and_kwargs, or from your override of create_optimizer / create_scheduler."
            )
        train_dataset = kwargs.get("train_dataset")
        if train_dataset is None:
            raise InputTypeError("DPTrainer needs a train_dataset (its size N enters the privacy accounting).")
        n = len(train_dataset)
        if n < 1:
            raise ConfigurationError("train_dataset is empty.")
        delta = float(args.target_delta)
        if delta > n ** -1.1:
            raise ConfigurationError(
                f"target_delta={delta:g} is larger than N^-1.1 = {n ** -1.1:.3g} (N = {n}): releasing one "
                "random record is already (0, 1/N)-DP, so such a delta protects nobody. Use "
                f"target_delta <= {n ** -1.1:.3g} (e.g. {10 ** math.floor(math.log10(n ** -1.1)):g})."
            )
        if args.sample_rate is not None:
            q = float(args.sample_rate)
        else:
            if float(args.expected_batch_size) > n:
                raise ConfigurationError(
                    f"expected_batch_size={args.expected_batch_size} exceeds the dataset size N = {n}; "
                    "use sample_rate=1.0 for full batches."
                )
            q = float(args.expected_batch_size) / n
        self.dp_dataset_size = n
        self.dp_sample_rate = q
        self._user_collator = kwargs.get("data_collator")
        max_length = args.max_length
        if max_length is None:
            # Padding to the longest training sequence would publish a statistic of the
            # private data (in the compiled shapes and TrainOutput.privacy) without charging it.
            raise ConfigurationError(
                "max_length is required: every sequence is padded or cut to it, and defaulting to the "
                "longest private training sequence would release that length uncharged. Set it to a "
                "public bound (e.g. the tokenizer's model_max_length or your task's length limit)."
            )
        self.dp_max_length = int(max(1, max_length))
        processing = kwargs.get("processing_class")
        pad_id = getattr(processing, "pad_token_id", None)
        if pad_id is None and model is not None:
            config = getattr(model, "config", None)
            pad_id = getattr(config, "pad_token_id", None) or getattr(config, "eos_token_id", None)
        self.dp_pad_token_id = int(pad_id) if isinstance(pad_id, int) else 0
        if kwargs.get("data_collator") is None:
            kwargs["data_collator"] = PadToLength(
                self.dp_max_length, self.dp_pad_token_id, add_attention_mask=True
            )
        super().__init__(model, args, **kwargs)
        self.dp_optimizer: DPOptimizer | None = None
        self._root_key: Any = None
        self.dp_sampler: PoissonSampler | None = None
        self.dp_step: Any = None
        self.dp_noise_multiplier: float | None = None
        self._dp_keys: tuple[str, ...] | None = None
        self._planned_steps: int | None = None
        self._dp_epoch: Any = None  # the sampler's epoch iterator a stopped train() left off in

    # ------------------------------------------------------------------ collation
    def _collate_train(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        """Collate the examples ``indices`` of the training set into fixed-length tensors
        (an empty draw gives ``(0, max_length)`` tensors)."""
        ds = self.train_dataset
        if len(indices) == 0:
            full = self._collate_rows([ds[0]])
            return {k: v[:0] for k, v in full.items()}
        # Each example is collated alone, so that its row depends on nothing else in the draw:
        # a collator that left-pads to the draw's longest row shifted every other row's
        # positions with the presence of that row (GPT-2 numbers positions from the left
        # edge), and removing it moved the clipped sum by 2.1 C at 6 rows, 6 C at 24 (review).
        rows = [self._collate_rows([ds[i]]) for i in indices]
        for k, v in rows[0].items():
            if v.dim() == 0 or v.shape[0] != 1:
                # Each row is clipped as one example: a collator making several rows of one
                # example (or a scalar) would let it move the clipped sum by more than C. (One
                # that packs a draw into one row sees one example at a time here;
                # DataCollatorWithFlattening is then refused below for its unpadded position_ids.)
                raise ConfigurationError(
                    f"The data collator returned '{k}' with shape {tuple(v.shape)} for one example: "
                    f"DPTrainer needs exactly one row per example, since each row is clipped as one "
                    f"example."
                )
        batch = {}
        for k in rows[0]:
            parts = [r.get(k) for r in rows]
            if any(p is None or p.shape[1:] != parts[0].shape[1:] for p in parts):
                raise ConfigurationError(
                    f"The data collator gave '{k}' different shapes for different examples "
                    f"({sorted({tuple(p.shape) for p in parts if p is not None})}) and DPTrainer pads "
                    f"only the sequence dimension of {sorted(_pad_keys(rows[0]))} to max_length: pad it "
                    "to a fixed length in the collator (each example is collated alone)."
                )
            batch[k] = torch.cat(parts)
        return batch

    def _collate_rows(self, rows: list[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.data_collator(rows)
        out = {}
        for k, v in dict(batch).items():
            if not isinstance(v, torch.Tensor):
                continue
            if v.dim() >= 2 and v.shape[1] != self.dp_max_length and k in _pad_keys(batch):
                t = self.dp_max_length
                if v.shape[1] > t:
                    v = v[:, :t]
                else:
                    pad = _SEQUENCE_PAD.get(k, -100 if k.endswith("labels") else self.dp_pad_token_id)
                    v = torch.cat([v, v.new_full((v.shape[0], t - v.shape[1], *v.shape[2:]), pad)], dim=1)
            out[k] = v
        self._set_signature_columns_if_needed()
        columns = set(self._signature_columns or ()) | {"labels", "label_ids"}
        if self.args.remove_unused_columns and self.compute_loss_func is None and type(self).compute_loss is DPTrainer.compute_loss:
            out = {k: v for k, v in out.items() if k in columns}
        return out

    # --------------------------------------------------------------------- setup
    def _planned(self) -> int:
        assert self.dp_sampler is not None
        if self.args.max_steps is not None and self.args.max_steps > 0:
            return int(self.args.max_steps)
        return int(math.ceil(float(self.args.num_train_epochs) * self.dp_sampler.steps))

    def _calibrate(self, planned: int) -> float:
        args = self.args
        if args.noise_multiplier is not None:
            return float(args.noise_multiplier)
        budget = _acc.epsilon_budget(float(args.target_epsilon), delta=float(args.target_delta))
        q, n = self.dp_sample_rate, self.dp_dataset_size
        result = _acc.calibrate(
            budget,
            lambda s: _acc.dpsgd_step_process(s, q, dataset_size=n) * planned,
            0.3,
            200.0,
            accountant=args.accountant,
        )
        return float(result.param)

    def setup_privacy(self, root_key: Any = None) -> None:
        """Build the sampler, the compiled step, the optimizer, the scheduler and the
        ``DPOptimizer`` (called by ``train()``; idempotent). ``root_key``: the run's root
        :mod:`opake_compile.random` key (default: from ``dp_seed``, else OS entropy); the
        sampler, noise and dropout keys are split from it."""
        if self.dp_optimizer is not None and (root_key is None or _same_key(root_key, self._root_key)):
            return
        args = self.args
        if root_key is None:
            root_key = _random.key(args.dp_seed) if args.dp_seed is not None else _random.random_key()
        self._root_key = root_key
        self.optimizer, self.lr_scheduler, self.dp_optimizer = None, None, None
        sampler_key, noise_key, step_key = _random.split(root_key, 3)
        self.dp_sampler = PoissonSampler(self.dp_dataset_size, self.dp_sample_rate, key=sampler_key)
        planned = self._planned()
        self._planned_steps = planned
        sigma = self._calibrate(planned)
        self.dp_noise_multiplier = sigma
        example = self._collate_train([0])
        self._dp_keys = tuple(example)
        keys = self._dp_keys

        def loss_fn(model: torch.nn.Module, *tensors: torch.Tensor) -> torch.Tensor:
            inputs = dict(zip(keys, tensors))
            loss = self.compute_loss(model, inputs)  # never num_items_in_batch: see the class docstring
            if isinstance(loss, tuple):
                loss = loss[0]
            return loss

        self.dp_step = compile_dp(
            loss_fn,
            model=self.model,
            clipping_norm=args.clipping_norm,
            physical_batch_size=args.per_device_train_batch_size,
            backend=args.dp_backend,
            key=step_key,
        )
        self.create_optimizer()
        inner = self.optimizer
        self.create_scheduler(planned, optimizer=inner)
        budget = None
        if args.target_epsilon is not None:
            budget = _acc.epsilon_budget(float(args.target_epsilon), delta=float(args.target_delta))
        self.dp_optimizer = DPOptimizer(
            inner,
            noise_multiplier=sigma,
            sampler=self.dp_sampler,
            key=noise_key,
            accountant=args.accountant,
            budget=budget,
        )
        if budget is not None and args.noise_multiplier is not None:
            allowed = self.dp_optimizer.max_steps()
            if allowed is not None and allowed < planned:
                raise PrivacyBudgetExhaustedError(
                    f"noise_multiplier={sigma} spends target_epsilon={args.target_epsilon} after {allowed} steps, "
                    f"but {planned} are planned: lower max_steps/num_train_epochs, raise noise_multiplier, or "
                    "omit noise_multiplier to calibrate it."
                )

    # ----------------------------------------------------------------- privacy
    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default ``target_delta``); 0.0 before training."""
        delta = float(self.args.target_delta) if delta is None else float(delta)
        if self.dp_optimizer is None:
            return 0.0
        return float(self.dp_optimizer.epsilon(delta))

    def privacy_config(self) -> dict[str, Any]:
        """The privacy configuration used (arguments plus resolved sigma, q, N, planned steps)."""
        cfg = self.args.privacy_config()
        cfg.update(
            noise_multiplier=self.dp_noise_multiplier,
            sample_rate=self.dp_sample_rate,
            expected_batch_size=self.dp_sample_rate * self.dp_dataset_size,
            dataset_size=self.dp_dataset_size,
            max_length=self.dp_max_length,
            planned_steps=self._planned_steps,
            steps=None if self.dp_optimizer is None else self.dp_optimizer.steps,
        )
        return cfg

    # ----------------------------------------------------------------- checkpoints
    def _dp_objects(self) -> dict[str, Any]:
        return dict(
            model=self.model,
            optimizer=self.dp_optimizer,
            sampler=self.dp_sampler,
            step=self.dp_step,
            scheduler=self.lr_scheduler,
        )

    def _save_dp_checkpoint(self) -> Path:
        step = self.state.global_step
        out = Path(self.args.output_dir) / f"checkpoint-{step}"
        out.mkdir(parents=True, exist_ok=True)
        self.save_model(str(out), _internal_call=True)
        Checkpointer(out / _DP_STATE_DIR / _ROOT_DIR, keep=1).save(step, root_key=self._root_key)
        Checkpointer(out / _DP_STATE_DIR, keep=1).save(step, **self._dp_objects())
        self.state.save_to_json(str(out / transformers.trainer.TRAINER_STATE_NAME))
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        limit = self.args.save_total_limit
        if limit is not None and limit > 0:
            found = sorted(
                (int(m.group(1)), p)
                for p in Path(self.args.output_dir).iterdir()
                if (m := _CHECKPOINT_DIR.match(p.name)) and p.is_dir()
            )
            for _, p in found[:-limit]:
                shutil.rmtree(p, ignore_errors=True)
        return out

    def _resume_path(self, resume_from_checkpoint: Any, rewind: bool) -> Path | None:
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        if resume_from_checkpoint is True:
            last = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir)
            if last is None:
                raise CheckpointError(f"No checkpoint-* directory in output_dir={self.args.output_dir!r} to resume from.")
            return Path(last)
        path = Path(resume_from_checkpoint)
        # As Checkpointer.load: a checkpoint older than one saved after it replays the noise
        # of the steps in between; on other rows, the two runs' updates differ by the
        # clipped sums' difference without noise. Compared by the steps each checkpoint's DP
        # state holds, not by folder names: a checkpoint copied to another name ("best_model")
        # was resumed from and replayed the noise (review).
        here = Checkpointer(path / _DP_STATE_DIR).latest_step()
        if here is not None and not rewind:
            # Later checkpoints of the same run (its root key) that were saved completely: an
            # interrupted save, or another run's checkpoint in the folder, replays nothing.
            run = _root_key_of(path)
            newer = sorted(
                p.name
                for folder in {path.parent, Path(self.args.output_dir)}
                if folder.is_dir()
                for p in folder.iterdir()
                if p.is_dir() and p.resolve() != path.resolve()
                and (Checkpointer(p / _DP_STATE_DIR).latest_step() or -1) > here and run is not None
                and (other := _root_key_of(p)) is not None and _same_key(other, run)
            )
            if newer:
                raise CheckpointError(
                    f"{path} is older than {newer[-1]}: resuming from it replays the noise of the steps "
                    "taken after it, and if anything those steps computed was seen (checkpoints, logs, "
                    "models), the replayed steps on other data release the difference without noise. "
                    "Resume from the newest checkpoint, or pass train(..., rewind=True) if nothing "
                    "after this checkpoint was ever seen."
                )
        return path

    # ----------------------------------------------------------------- training
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        *,
        rewind: bool = False,
        **kwargs: Any,
    ) -> TrainOutput:
        """Train with DP-SGD; see the class docstring.

        Args:
            resume_from_checkpoint: ``True`` (the newest ``checkpoint-*`` in ``output_dir``) or a
                checkpoint directory; everything random and every step charged is restored.
            A second call on the same trainer (after an interruption, an early stop or
            ``PrivacyBudgetExhaustedError``) continues its run in memory: the step count,
            scheduler, sampler, noise and accountant go on up to the planned steps; changing
            ``max_steps`` or ``num_train_epochs`` in between is refused.
            rewind: allow resuming from a checkpoint older than another complete checkpoint of
                the same run (beside it or in ``output_dir``, compared by the steps their DP
                states hold, whatever the folders' names): it replays the later steps' noise, so
                only if nothing computed after it was ever seen.

        Returns:
            :class:`~opake_compile.transformers.trainer.types.TrainOutput` (epsilon spent and the
            privacy configuration; ``training_loss`` is not privatised).

        Raises:
            CheckpointError: no or a mismatching checkpoint (another sigma, q, C, shape...); a
                checkpoint older than another one, without ``rewind=True``.
            PrivacyBudgetExhaustedError: see the class docstring.
        """
        if trial is not None:
            raise ConfigurationError("Hyper-parameter search trials are not supported by DPTrainer (each trial spends privacy).")
        args = self.args
        args.validate_privacy()  # fields set after construction (gradient_accumulation_steps, ...)
        self.model.train()
        resume = self._resume_path(resume_from_checkpoint, rewind)
        root_key = None
        if resume is not None:
            found = Checkpointer(resume / _DP_STATE_DIR / _ROOT_DIR).restore_state(root_key=_random.key(0))
            if found is None:
                raise CheckpointError(f"{resume} holds no DP checkpoint ({_DP_STATE_DIR}/{_ROOT_DIR}).")
            root_key = found[1]["root_key"]
        # A second train() on this trainer continues its run in memory, as a resume from its
        # latest state would: the step count, scheduler, sampler, noise and accountant go on
        # (the step count restarted at 0 before, while the accountant went on, and the second
        # call's checkpoint-<n> folders overwrote the first call's with later states).
        continuing = resume is None and self.dp_optimizer is not None and self.dp_optimizer.steps > 0
        if continuing and self._planned() != self._planned_steps:
            raise ConfigurationError(
                f"max_steps / num_train_epochs now plan {self._planned()} steps, but this trainer's noise "
                f"multiplier and scheduler were set up for {self._planned_steps} by its first train(), which "
                f"has taken {self.dp_optimizer.steps}: build a new DPTrainer for a longer run (its epsilon "
                "then composes with this one's), or keep the planned steps to continue this run."
            )
        self.setup_privacy(root_key)
        assert self.dp_optimizer is not None and self.dp_sampler is not None
        planned = self._planned_steps
        if continuing:
            self.state.global_step = self.dp_optimizer.steps
            if self.state.global_step >= planned:
                logger.warning(
                    "train(): this trainer has already taken its %d planned DP steps (epsilon %.4g); "
                    "nothing to do.", planned, self.epsilon()
                )
        else:
            self._dp_epoch = None
            self.state = TrainerState(
                stateful_callbacks=[
                    cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)
                ]
            )
            self.state.train_batch_size = args.per_device_train_batch_size
            self.state.compute_steps(args, planned)
        if resume is not None:
            restored = Checkpointer(resume / _DP_STATE_DIR).restore(**self._dp_objects())
            if restored is None:
                raise CheckpointError(f"{resume / _DP_STATE_DIR} holds no DP checkpoint.")
            state_file = resume / transformers.trainer.TRAINER_STATE_NAME
            if state_file.is_file():
                self.state = TrainerState.load_from_json(str(state_file))
                self.state.compute_steps(args, planned)
            self.state.global_step = restored
        epochs = max(1, math.ceil(planned / self.dp_sampler.steps))
        self.state.init_training_references(self, planned, epochs, None)
        self.state.max_steps = planned
        self.callback_handler.model = self.model
        self.callback_handler.optimizer = self.optimizer
        self.callback_handler.lr_scheduler = self.lr_scheduler
        self.callback_handler.train_dataloader = None
        device = self.args.device
        start = time.time()
        start_step = self.state.global_step
        loss_sum, loss_count, total_sum, total_count = 0.0, 0, 0.0, 0
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        stop = self.state.global_step >= planned
        while not stop:
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            if self._dp_epoch is None:
                self._dp_epoch = iter(self.dp_sampler)
            for draw in self._dp_epoch:
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                if not self.model.training:
                    self.model.train()  # evaluate() in a callback left it in eval mode
                batch = self._collate_train(draw)
                tensors = [batch[k].to(device) for k in self._dp_keys]
                if tuple(batch) != self._dp_keys:
                    raise ConfigurationError(f"Batch keys changed from {self._dp_keys} to {tuple(batch)}.")
                out = self.dp_step(*tensors)
                self.dp_optimizer.step(out.clipped, draw=draw)
                self.lr_scheduler.step()
                self.model.zero_grad(set_to_none=True)
                self.state.global_step += 1
                self.state.epoch = self.state.global_step / self.dp_sampler.steps
                value = float(out.loss)
                if math.isfinite(value):
                    loss_sum, loss_count = loss_sum + value, loss_count + 1
                    total_sum, total_count = total_sum + value, total_count + 1
                self.control = self.callback_handler.on_step_end(args, self.state, self.control)
                if self.control.should_log:
                    logs = {
                        "learning_rate": float(self.lr_scheduler.get_last_lr()[0]),
                        "epsilon": self.epsilon(),
                    }
                    if args.log_training_loss:  # not privatised: the user opted in
                        logs = {"loss": loss_sum / loss_count if loss_count else float("nan"), **logs}
                    loss_sum, loss_count = 0.0, 0
                    self.log(logs)
                    self.control.should_log = False
                if self.control.should_evaluate:
                    metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
                    # As Trainer's loop: the best value of metric_for_best_model, which
                    # EarlyStoppingCallback compares each evaluation with (never set before, so
                    # every evaluation counted as an improvement and training never stopped).
                    self._determine_best_metric(dict(metrics), None)
                    self.control.should_evaluate = False
                if self.control.should_save:
                    self._save_dp_checkpoint()
                    self.control.should_save = False
                if self.state.global_step >= planned or self.control.should_training_stop:
                    stop = True
                    break
            if not stop:
                self._dp_epoch = None  # (the epoch's draws are all taken; a stop keeps its place)
                self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
        runtime = time.time() - start
        eps = self.epsilon()
        metrics = {
            "train_runtime": runtime,
            "train_steps_per_second": (self.state.global_step - start_step) / runtime if runtime > 0 else 0.0,
            "epsilon": eps,
            "noise_multiplier": self.dp_noise_multiplier,
        }
        train_loss = total_sum / total_count if total_count else float("nan")
        if args.log_training_loss:
            metrics["train_loss"] = train_loss
        self.log(dict(metrics))
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        return TrainOutput(
            global_step=self.state.global_step,
            training_loss=train_loss,
            metrics=metrics,
            epsilon=eps,
            delta=float(args.target_delta),
            privacy=self.privacy_config(),
        )

    def evaluate(self, *pargs: Any, **kwargs: Any) -> EvaluationResult:
        """``Trainer.evaluate``, returned as an :class:`EvaluationResult` (a dict of metrics with
        the epsilon spent so far). The metrics are **not privatised**."""
        metrics = super().evaluate(*pargs, **kwargs)
        return EvaluationResult(metrics, epsilon=self.epsilon(), delta=float(self.args.target_delta))

    def training_step(self, *pargs: Any, **kwargs: Any) -> torch.Tensor:
        raise ConfigurationError(
            "DPTrainer.training_step is not the DP step (it would use Hugging Face's non-private "
            "backward); call train(), or use trainer.dp_step and trainer.dp_optimizer directly."
        )


def _root_key_of(checkpoint: Path) -> Any:
    """The run's root key saved in ``checkpoint`` (``None`` if it holds none)."""
    found = Checkpointer(checkpoint / _DP_STATE_DIR / _ROOT_DIR).restore_state(root_key=_random.key(0))
    return None if found is None else found[1]["root_key"]


def _same_key(a: Any, b: Any) -> bool:
    return b is not None and _random.key_to_state(a) == _random.key_to_state(b)


def _pad_keys(batch: Mapping[str, Any]) -> set[str]:
    """Keys of a collated batch padded along dim 1: the sequence keys of token models."""
    return {k for k in batch if k.endswith("input_ids") or k.endswith("attention_mask") or k.endswith("labels")
            or k == "token_type_ids"}
