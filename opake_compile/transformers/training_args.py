"""``TrainingArguments``: Hugging Face's training arguments plus the privacy fields of DP-SGD.

Fields added to :class:`transformers.TrainingArguments`, by concern:

* privacy: ``clipping_norm`` (C), ``target_epsilon`` / ``target_delta`` (the budget) or
  ``noise_multiplier`` (sigma), ``accountant`` (``"pld"`` / ``"rdp"``), ``noise_mechanism``
  (``"gaussian"``), ``dp_seed`` (keys of the sampler, the noise and dropout);
* batches: exactly one of ``expected_batch_size`` (q N) and ``sample_rate`` (q) sets the logical
  Poisson batch; ``per_device_train_batch_size`` is the physical chunk the compiled step runs
  (it never changes what is computed, only memory); ``poisson_sampling`` must stay ``True``;
* logging: ``log_training_loss`` (default ``False``: the training loss is a noise-free
  statistic of the private batches, and the Trainer's logs go into every checkpoint's
  ``trainer_state.json``, ``push_to_hub`` and the ``report_to`` integrations; set it to log
  ``loss`` and ``train_loss`` anyway, not privatised);
* compute: ``max_length`` (required: every training sequence is padded or cut to it, so the
  compiled step never recompiles; there is no default from the data, since the longest training
  sequence is a statistic of the private data: set a public bound), ``dp_backend`` (the
  ``compile_dp`` backend).

What is refused up front (:class:`~opake_compile.exceptions.ConfigurationError`, naming the
alternative): ``gradient_accumulation_steps > 1`` (each optimizer step must add noise once to
one Poisson draw; raise ``expected_batch_size`` instead), ``poisson_sampling=False``, both or
neither of the batch fields, neither sigma nor a target epsilon, an unknown accountant or
mechanism. ``target_delta`` larger than ``N^-1.1`` is refused by :class:`DPTrainer` once it
knows the dataset size N.

Hugging Face's ``max_grad_norm`` (clipping of the *batch* gradient) is not used: DP-SGD clips
each example's gradient to ``clipping_norm`` instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import transformers

from opake_compile._validate import check_clipping_norm, check_noise_multiplier
from opake_compile.exceptions import ConfigurationError, InputTypeError

__all__ = ["TrainingArguments"]

_ACCOUNTANTS = ("pld", "rdp")
_MECHANISMS = ("gaussian",)


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """:class:`transformers.TrainingArguments` with the DP-SGD fields (see the module docstring).

    Raises:
        ConfigurationError: an invalid or unsupported privacy setting (the message names the
            field and the alternative).
        InputTypeError: a privacy field of the wrong type.
    """

    # -- privacy ---------------------------------------------------------------------------
    clipping_norm: float = dataclasses.field(
        default=1.0, metadata={"help": "C: each example's gradient is clipped to this L2 norm."}
    )
    target_epsilon: float | None = dataclasses.field(
        default=None, metadata={"help": "Epsilon budget; sigma is calibrated to spend it over the planned steps."}
    )
    target_delta: float | None = dataclasses.field(
        default=None, metadata={"help": "Delta of the guarantee (required); at most N^-1.1."}
    )
    noise_multiplier: float | None = dataclasses.field(
        default=None, metadata={"help": "Explicit sigma (noise std sigma*C on the clipped sum)."}
    )
    accountant: str = dataclasses.field(default="pld", metadata={"help": "'pld' or 'rdp'."})
    noise_mechanism: str = dataclasses.field(default="gaussian", metadata={"help": "'gaussian'."})
    dp_seed: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Seed of the sampler/noise/dropout keys; None: fresh OS entropy (keep it secret)."},
    )
    # -- batches ---------------------------------------------------------------------------
    expected_batch_size: float | None = dataclasses.field(
        default=None, metadata={"help": "Expected logical batch size q*N (exclusive with sample_rate)."}
    )
    sample_rate: float | None = dataclasses.field(
        default=None, metadata={"help": "Poisson sample rate q (exclusive with expected_batch_size)."}
    )
    poisson_sampling: bool = dataclasses.field(
        default=True, metadata={"help": "Must be True: the accounting assumes Poisson subsampling."}
    )
    # -- compute ---------------------------------------------------------------------------
    max_length: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Required by DPTrainer: sequences are padded/cut to this public length (a default from the data would release a private statistic)."},
    )
    dp_backend: str | None = dataclasses.field(
        default="inductor",
        metadata={"help": "compile_dp backend: 'inductor', 'aot_eager', ...; None runs the traced graph as is."},
    )
    # -- logging ---------------------------------------------------------------------------
    log_training_loss: bool = dataclasses.field(
        default=False,
        metadata={"help": "Log the training loss (NOT privatised: a noise-free statistic of the private batches) "
                  "into log_history, checkpoints' trainer_state.json and every report_to integration."},
    )

    def to_dict(self) -> dict[str, Any]:
        """As transformers' (what trackers and ``print(args)`` show), ``dp_seed`` left out: with
        it anyone can regenerate the run's Poisson draws and noise, and subtract the noise
        from the released updates."""
        d = super().to_dict()
        d["dp_seed"] = None
        return d

    def __str__(self) -> str:
        """As transformers' (``print(args)``, and example scripts log the arguments this way),
        with ``dp_seed`` shown as ``<DP_SEED>``: transformers' own builds it from every field."""
        fields = dataclasses.asdict(self)
        fields = {k: f"<{k.upper()}>" if k.endswith("_token") else v for k, v in fields.items()}
        if fields.get("dp_seed") is not None:
            fields["dp_seed"] = "<DP_SEED>"
        body = "".join(f"{k}={v},\n" for k, v in sorted(fields.items()))
        return f"{type(self).__name__}(\n{body})"

    __repr__ = __str__

    def __getstate__(self) -> dict[str, Any]:
        """Pickles (``training_args.bin``, which transformers writes beside the weights and
        ``push_to_hub`` uploads) carry no ``dp_seed``; nor do copies made by pickling protocols
        (``copy.deepcopy``). The DP checkpoint's ``dp_state`` holds the keys a resume needs:
        keep checkpoints as private as the training data."""
        state = self.__dict__.copy()
        state["dp_seed"] = None
        return state

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate_privacy()

    def validate_privacy(self) -> None:
        """Check the privacy fields (called at construction). See the module docstring."""
        if self.gradient_accumulation_steps != 1:
            raise ConfigurationError(
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} is refused: accumulating "
                "several Poisson draws under one noise is not a step at rate q. Set expected_batch_size "
                "(the logical batch) instead; per_device_train_batch_size only sets the physical chunk."
            )
        if not self.poisson_sampling:
            raise ConfigurationError(
                "poisson_sampling=False is refused: shuffled fixed-size batches are not Poisson "
                "subsampling and accounting them as such overstates privacy. Keep poisson_sampling=True "
                "and set expected_batch_size or sample_rate."
            )
        if (self.expected_batch_size is None) == (self.sample_rate is None):
            raise ConfigurationError(
                "Set exactly one of expected_batch_size (q*N) and sample_rate (q); got "
                f"expected_batch_size={self.expected_batch_size!r}, sample_rate={self.sample_rate!r}."
            )
        if self.sample_rate is not None and not (0.0 < float(self.sample_rate) <= 1.0):
            raise ConfigurationError(f"sample_rate must be in (0, 1], got {self.sample_rate!r}.")
        if self.expected_batch_size is not None and not (
            math.isfinite(float(self.expected_batch_size)) and float(self.expected_batch_size) > 0
        ):
            raise ConfigurationError(f"expected_batch_size must be > 0, got {self.expected_batch_size!r}.")
        self.clipping_norm = check_clipping_norm(self.clipping_norm)
        if self.noise_multiplier is not None:
            self.noise_multiplier = check_noise_multiplier(self.noise_multiplier)
        elif self.target_epsilon is None:
            raise ConfigurationError(
                "Set target_epsilon (sigma is then calibrated over the planned steps) or noise_multiplier."
            )
        if self.target_epsilon is not None and not (float(self.target_epsilon) > 0):
            raise ConfigurationError(f"target_epsilon must be > 0, got {self.target_epsilon!r}.")
        if self.target_delta is None or not (0.0 < float(self.target_delta) < 1.0):
            raise ConfigurationError(
                f"target_delta must be in (0, 1) (and at most N^-1.1), got {self.target_delta!r}: it is "
                "required with a fixed noise_multiplier too, since the epsilon logged and returned is "
                "spent at that delta."
            )
        if self.accountant not in _ACCOUNTANTS:
            raise ConfigurationError(f"accountant must be one of {_ACCOUNTANTS}, got {self.accountant!r}.")
        if self.noise_mechanism not in _MECHANISMS:
            raise ConfigurationError(
                f"noise_mechanism={self.noise_mechanism!r} is not supported by DPOptimizer here; use 'gaussian'."
            )
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            raise ConfigurationError(f"max_length must be a positive int, got {self.max_length!r}.")
        if self.dp_seed is not None and (not isinstance(self.dp_seed, int) or isinstance(self.dp_seed, bool)):
            raise InputTypeError(f"dp_seed must be an int or None, got {type(self.dp_seed).__name__}.")
        # Trainer options DPTrainer's loop does not apply: refused rather than silently ignored.
        unapplied = {
            "auto_find_batch_size": (self.auto_find_batch_size,
                                     "lower per_device_train_batch_size (the compiled chunk) for memory"),
            "neftune_noise_alpha": (self.neftune_noise_alpha is not None,
                                    "NEFTune's embedding noise is not part of the DP step"),
            "load_best_model_at_end": (self.load_best_model_at_end,
                                       "the last model is kept; choosing one by an evaluation metric of "
                                       "private data would release that choice uncharged"),
            "save_strategy='best'": (str(getattr(self.save_strategy, "value", self.save_strategy)) == "best",
                                     "use save_strategy='steps' or 'epoch'"),
            "bf16": (self.bf16, "cast the model to torch.bfloat16 yourself: the step runs it in its own dtype"),
            "fp16": (self.fp16, "cast the model to torch.float16 yourself: the step runs it in its own dtype"),
        }
        for name, (set_, instead) in unapplied.items():
            if set_:
                raise ConfigurationError(f"{name} is not applied by DPTrainer and is refused: {instead}.")

    def privacy_config(self) -> dict[str, Any]:
        """The privacy fields as a plain dict (what ``TrainOutput.privacy`` reports)."""
        return {
            "clipping_norm": self.clipping_norm,
            "target_epsilon": self.target_epsilon,
            "target_delta": self.target_delta,
            "noise_multiplier": self.noise_multiplier,
            "accountant": self.accountant,
            "noise_mechanism": self.noise_mechanism,
            "expected_batch_size": self.expected_batch_size,
            "sample_rate": self.sample_rate,
            "max_length": self.max_length,
        }
