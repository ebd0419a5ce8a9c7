"""``opake_compile.transformers``: DP-SGD for Hugging Face models (``pip install opake-compile[hf]``).

:class:`DPTrainer` is a :class:`transformers.Trainer` whose training step is a compiled
per-example clipped step (:func:`opake_compile.compile_dp`) plus :class:`opake_compile.DPOptimizer`,
with Poisson sampling and accounting; :class:`TrainingArguments` adds the privacy fields to
Hugging Face's. TRL-style trainers are in :mod:`opake_compile.transformers.trl`.
"""

from opake_compile.transformers.trainer import DPTrainer, EvaluationResult, PadToLength, TrainOutput
from opake_compile.transformers.training_args import TrainingArguments

__all__ = ["DPTrainer", "TrainingArguments", "EvaluationResult", "TrainOutput", "PadToLength"]
