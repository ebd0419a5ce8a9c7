"""``DPTrainer`` and its return types (:mod:`.types`)."""

from opake_compile.transformers.trainer._trainer import DPTrainer, PadToLength
from opake_compile.transformers.trainer.types import EvaluationResult, TrainOutput

__all__ = ["DPTrainer", "PadToLength", "EvaluationResult", "TrainOutput"]
