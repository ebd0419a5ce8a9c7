"""Privacy auditing: measure the privacy a training run actually delivers, in one run.

The accountant gives an *upper* bound on epsilon that holds if the code does what it claims.
An audit gives a *lower* bound, measured on the trained model: if it exceeds the accountant's
epsilon, something is broken (noise not added, clipping skipped, data leaking through a side
channel). Three steps (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training
Run"):

1. :func:`coin_flip` designates m canaries and flips a fair coin for each; the training loop
   adds the included ones to the training data (``record.select(x_canary, y_canary)``).
2. After training, score every canary: :func:`loss_scores` (black-box: minus the loss) or
   :func:`gradient_scores` (white-box: alignment of the canary's gradient at theta_0 with the
   total update theta_T - theta_0).
3. :func:`one_run` turns scores and coins into a :class:`OneRunEstimate`: lower bounds at a
   stated confidence, by default through mu-GDP (Mahloujifar, Melis & Chaudhuri 2024,
   "Auditing f-Differential Privacy in One Run"), or with ``.eps_delta()`` through the
   mechanism-agnostic (eps, delta) test of Steinke et al.

Example::

    >>> import numpy as np, opake_compile as opake
    >>> record = opake.auditing.coin_flip(2000, opake.random.key(0))
    >>> # ... train with record.select(canaries) added, then score:
    >>> scores = np.random.default_rng(1).normal(size=2000) + 1.0 * record.mask()
    >>> est = opake.auditing.one_run(scores, record, confidence=0.95)
    >>> 0.0 < est.epsilon_at(1e-5)          # a lower bound, holds with probability >= 95 %
    True
"""

from opake_compile.auditing._one_run import OneRunEstimate, guess_counts, one_run
from opake_compile.auditing._record import CanaryRecord, coin_flip
from opake_compile.auditing._scores import gradient_scores, loss_scores

__all__ = [
    "coin_flip",
    "CanaryRecord",
    "loss_scores",
    "gradient_scores",
    "one_run",
    "OneRunEstimate",
    "guess_counts",
]
