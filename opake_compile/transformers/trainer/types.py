"""Return types of :class:`~opake_compile.transformers.DPTrainer`.

Privacy note: the *evaluation metrics* and the *training loss* are computed from the data without
noise. Evaluating on private data and publishing the numbers is a release that the accountant does
not charge: only the model parameters (and anything computed from them and public data) are
covered by the reported (epsilon, delta). Evaluate on public or held-out data you may disclose.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

__all__ = ["EvaluationResult", "TrainOutput"]


class EvaluationResult(dict):
    """The metrics dict of ``evaluate()`` (a ``dict``, as Hugging Face's), plus the privacy state
    of the model evaluated.

    Attributes:
        epsilon: epsilon spent by training up to the evaluated model (0.0 before training), at
            ``delta``.
        delta: the delta of that guarantee.
        privatised: always ``False``: the metrics themselves are *not privatised*; if computed on
            private data they leak it (see the module docstring).
    """

    privatised = False

    def __init__(self, metrics: Mapping[str, Any], *, epsilon: float, delta: float) -> None:
        super().__init__(metrics)
        self.epsilon = float(epsilon)
        self.delta = float(delta)

    def __repr__(self) -> str:
        return f"EvaluationResult({dict.__repr__(self)}, epsilon={self.epsilon:.4g}, delta={self.delta:.3g}, not privatised)"


@dataclasses.dataclass(frozen=True)
class TrainOutput:
    """What ``DPTrainer.train()`` returns.

    Attributes:
        global_step: optimizer steps taken in total (a resumed run counts the earlier ones).
        training_loss: **not privatised**: mean of the logged per-step losses (noise-free, from
            the private batches); for monitoring only.
        metrics: Hugging Face's train metrics (runtime, samples/s, ...) plus ``epsilon``.
        epsilon: epsilon spent by the whole run at ``delta`` (the accountant's, over every
            Poisson step charged, empty batches included).
        delta: the delta of that guarantee (``target_delta``).
        privacy: the privacy configuration actually used: the fields of
            ``TrainingArguments.privacy_config()`` with the resolved ``noise_multiplier``,
            ``sample_rate``, ``dataset_size`` and ``steps``.
    """

    global_step: int
    training_loss: float
    metrics: Mapping[str, Any]
    epsilon: float
    delta: float
    privacy: Mapping[str, Any]

    def __iter__(self):  # unpack like Hugging Face's TrainOutput: step, loss, metrics
        return iter((self.global_step, self.training_loss, self.metrics))

    @property
    def is_private(self) -> bool:
        """False when the run was not private (sigma = 0 or C = inf)."""
        return math.isfinite(self.epsilon)
