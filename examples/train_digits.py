"""Train a small CNN with differential privacy on scikit-learn's digits (or your own data).

The main job of opake_compile, end to end:

* data: the 1,797 real 8x8 handwritten digits that ship inside scikit-learn (pixels 0..16,
  divided by the public constant 16), or your own ``.npz`` (arrays ``x``, ``y``) / ``.csv``
  (one label column, every other column a feature); a stratified 20 % is held out for testing;
* ``compile_dp`` turns the ordinary batch loss into per-example clipped gradients (one compile:
  the physical batch size is fixed, Poisson batches are padded or split to it);
* ``PoissonSampler`` draws the batches, ``DPOptimizer`` adds Gaussian noise and steps
  SGD or Adam, and the noise multiplier is calibrated with ``accounting.calibrate`` so that the
  whole run spends exactly the target (epsilon, delta);
* every epoch reports the training loss (**not privatised**: it is computed on the private
  data without noise, for your eyes only), the accuracy on the held-out test split, the
  epsilon spent so far (from the optimizer's accountant) and examples/s.

Run it::

    python examples/train_digits.py                          # DP at epsilon = 3
    python examples/train_digits.py --non-private-baseline --plot digits.png
    python examples/train_digits.py --data mine.csv --label-column target --epsilon 8
    python examples/train_digits.py --checkpoint-dir runs/digits --resume   # pre-emptible
    python examples/train_digits.py --noise bandmf --bands 4             # DP-FTRL, same epsilon

Correlated noise (``--noise``, DP-FTRL / matrix factorisation, :mod:`opake_compile.dpftrl`):
``gaussian`` (default) is DP-SGD with Poisson sampling. ``bandmf`` is BandMF with ``--bands``
bands amplified by cyclic Poisson sampling over ``--bands`` groups (the expected batch stays
``--batch-size``; accounted by ``accounting.mf_poisson``). ``blt``, ``bisr`` and ``lambda-cgd``
use fixed batches (``SequentialBatchSampler``: ``N // batch`` batches, the same every epoch) and
are accounted without amplification by ``accounting.mf_gaussian`` for ``epochs``
participations one epoch apart: no known closed-form amplification covers them. Each noise is
calibrated to the same (epsilon, delta).

Checkpoints: with ``--checkpoint-dir`` the whole state of the run (model, optimizer moments, the
``DPOptimizer``'s noise key and step count, the sampler's epoch and position, the compiled
step's dropout key, the LR scheduler) is written atomically every ``--checkpoint-every`` steps
(default: every epoch) and after the last step, keeping the newest three. ``--resume`` continues
from the newest one: the resumed run takes exactly the steps, noise, batches and dropout masks
the uninterrupted run would have taken, so its final parameters and epsilon are bit for bit
those of a run that was never stopped (same machine, torch version and thread count). The
per-epoch history of a resumed run starts at the first epoch it finishes.

From Python (tests do this)::

    from train_digits import main, parse_args, train
    summary = train(parse_args(["--epochs", "2", "--backend", "aot_eager"]))
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

import opake_compile as opake
from opake_compile import accounting
from opake_compile.exceptions import ConfigurationError, InputTypeError, OpakeError

__all__ = [
    "Config",
    "Data",
    "build_model",
    "load_data",
    "main",
    "parse_args",
    "physical_batch_size_for",
    "train",
]

# Fixed range of the scikit-learn digits pixels (0..16): a public constant, not a statistic
# of the private data, so scaling by it costs no privacy.
DIGITS_PIXEL_MAX = 16.0

# Learning rates tuned for DP training on digits at epsilon = 3 (batch 256, 30 epochs, C = 1;
# Adam was the better of the two there). SGD uses momentum 0.9.
DEFAULT_LR = {"adam": 5e-3, "sgd": 0.5}

NOISES = ("gaussian", "bandmf", "blt", "bisr", "lambda-cgd")


# ----------------------------------------------------------------------------- configuration
@dataclasses.dataclass(frozen=True)
class Config:
    """Everything a run depends on. Build it with :func:`parse_args` (the CLI defaults)."""

    epsilon: float = 3.0
    delta: float = 1e-5
    epochs: int = 30
    batch_size: int = 256  # expected (Poisson) batch size q * N
    clipping_norm: float = 1.0
    lr: float | None = None  # None: DEFAULT_LR[optimizer]
    optimizer: str = "adam"
    seed: int = 0
    non_private_baseline: bool = False
    plot: str | None = None
    data: str | None = None
    label_column: str = "label"
    feature_scale: float | None = None
    test_fraction: float = 0.2
    backend: str = "inductor"
    subset: int | None = None
    progress: bool = True
    verbose: bool = True
    dropout: float = 0.0
    lr_schedule: str = "constant"
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None  # steps; None: once per epoch
    resume: bool = False
    noise: str = "gaussian"
    bands: int = 4


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse command-line arguments into a :class:`Config`."""
    d = Config()
    p = argparse.ArgumentParser(
        prog="train_digits.py",
        description="Differentially private training of a small CNN on scikit-learn's digits "
        "(or your own .npz/.csv) with opake_compile.",
    )
    p.add_argument("--epsilon", type=float, default=d.epsilon, help="target epsilon of the whole run (default %(default)s)")
    p.add_argument("--delta", type=float, default=d.delta, help="target delta, must be < 1/N_train (default %(default)s)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="epochs; one epoch = round(N/batch) Poisson steps (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="expected Poisson batch size q*N (default %(default)s)")
    p.add_argument("--clipping-norm", type=float, default=d.clipping_norm, help="per-example L2 clipping norm C (default %(default)s)")
    p.add_argument("--lr", type=float, default=None, help=f"learning rate (default: {DEFAULT_LR['adam']:g} for adam, {DEFAULT_LR['sgd']:g} for sgd)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default=d.optimizer, help="wrapped torch.optim optimizer (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the run's root key, the split and the initialisation (default %(default)s)")
    p.add_argument(
        "--non-private-baseline",
        action="store_true",
        help="also train the same model, optimizer, lr, epochs and batch size WITHOUT privacy "
        "(plain autograd on shuffled fixed-size batches, no clipping, no noise) for comparison",
    )
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG of test accuracy against epsilon spent")
    p.add_argument("--data", metavar="PATH", default=None, help="your own data: .npz with arrays x and y, or .csv with a label column")
    p.add_argument("--label-column", default=d.label_column, help="label column of a --data CSV (default %(default)r)")
    p.add_argument(
        "--feature-scale",
        type=float,
        default=None,
        help="divide features by this PUBLIC constant (default: 16 for digits, 1 for --data). "
        "Do not derive it from the private data: that would be a non-private release.",
    )
    p.add_argument("--backend", default=d.backend, help="torch.compile backend (default %(default)s; aot_eager compiles faster)")
    p.add_argument("--subset", type=int, default=None, metavar="N", help="train on a stratified subset of N training examples (test split unchanged)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm progress bar")
    p.add_argument("--quiet", dest="verbose", action="store_false", help="print only the summary")
    p.add_argument("--dropout", type=float, default=d.dropout, help="dropout before the classifier head, in [0, 1) (default %(default)s)")
    p.add_argument(
        "--lr-schedule",
        choices=("constant", "cosine", "one-minus-sqrt"),
        default=d.lr_schedule,
        help="learning-rate multiplier over the run's steps (opake_compile.schedules; default %(default)s)",
    )
    p.add_argument("--checkpoint-dir", metavar="DIR", default=None, help="write checkpoints of the whole DP state to DIR (keeps the newest 3)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS", help="checkpoint every STEPS steps (default: every epoch)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir (start fresh if there is none)")
    p.add_argument(
        "--noise",
        choices=NOISES,
        default=d.noise,
        help="noise mechanism: gaussian (DP-SGD) or correlated DP-FTRL noise, each calibrated to the same "
        "epsilon (default %(default)s)",
    )
    p.add_argument("--bands", type=int, default=d.bands, help="bands of BandMF / BISR (default %(default)s)")
    ns = p.parse_args(argv)
    return Config(**vars(ns))


# ----------------------------------------------------------------------------- data
@dataclasses.dataclass(frozen=True)
class Data:
    """A train/test split. ``x_*``: float32 ``(n, channels, height, width)``; ``y_*``: int64
    class indices in ``[0, num_classes)``; ``classes``: the original label of each index."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: tuple[Any, ...]
    source: str

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]


def _read_npz(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as f:
            names = sorted(f.files)
            missing = [k for k in ("x", "y") if k not in names]
            if missing:
                raise ConfigurationError(
                    f"{path}: expected arrays 'x' (features) and 'y' (labels); missing {missing}, "
                    f"the file holds {names}. Save it with np.savez(path, x=features, y=labels)."
                )
            return f["x"], f["y"]
    except OpakeError:
        raise
    except ValueError as err:  # object arrays (allow_pickle=False), not a zip file, ...
        raise InputTypeError(f"{path}: cannot read as a numeric .npz file ({err}).") from err
    except OSError as err:
        raise ConfigurationError(f"{path}: cannot read the .npz file ({err}).") from err


def _read_csv(path: Path, label_column: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigurationError(f"{path}: cannot read the CSV file ({err}).") from err
    rows = [r for r in rows if any(cell.strip() for cell in r)]
    if not rows:
        raise ConfigurationError(f"{path}: the CSV file is empty (expected a header row and data rows).")
    header = [h.strip() for h in rows[0]]
    if label_column not in header:
        shown = header if len(header) <= 12 else [*header[:5], "...", *header[-5:]]
        raise ConfigurationError(
            f"{path}: no label column {label_column!r}; the header has {len(header)} columns {shown}. "
            "Pass --label-column NAME."
        )
    if len(header) < 2:
        raise ConfigurationError(f"{path}: the CSV has a label column but no feature column.")
    body = rows[1:]
    if not body:
        raise ConfigurationError(f"{path}: the CSV has a header but no data rows.")
    li = header.index(label_column)
    features, labels = [], []
    for lineno, r in enumerate(body, start=2):
        if len(r) != len(header):
            raise ConfigurationError(f"{path}, row {lineno}: {len(r)} fields, the header has {len(header)}.")
        if not r[li].strip():
            raise ConfigurationError(f"{path}, row {lineno}: the label is empty (every example needs a class label).")
        labels.append(r[li].strip())
        try:
            features.append([float(v) for j, v in enumerate(r) if j != li])
        except ValueError as err:
            raise InputTypeError(f"{path}, row {lineno}: a feature is not a number ({err}).") from err
    y = np.asarray(labels)
    try:  # numeric labels stay numeric (so "10" sorts after "9")
        y_num = y.astype(np.float64)
        y = y_num.astype(np.int64) if np.all(np.isfinite(y_num)) and np.all(y_num == np.round(y_num)) else y_num
    except ValueError:
        pass
    return np.asarray(features, dtype=np.float64), y


def _check_and_shape(x: np.ndarray, y: np.ndarray, *, where: str) -> tuple[np.ndarray, np.ndarray, tuple]:
    """Validate features/labels; return float features of shape (n, c, h, w), labels, classes."""
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_) or np.iscomplexobj(x):
        raise InputTypeError(f"{where}: features x must be real numbers, got dtype {x.dtype}.")
    if x.ndim not in (2, 3, 4):
        raise ConfigurationError(
            f"{where}: features x must have shape (n, d), (n, h, w) or (n, c, h, w); got {tuple(x.shape)}."
        )
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ConfigurationError(
            f"{where}: labels y must have shape (n,) (one class label per example, not one-hot); got {tuple(y.shape)}."
        )
    if x.shape[0] != y.shape[0]:
        raise ConfigurationError(f"{where}: x has {x.shape[0]} examples but y has {y.shape[0]} labels.")
    if x.shape[0] == 0 or math.prod(x.shape[1:]) == 0:
        raise ConfigurationError(f"{where}: no data (x has shape {tuple(x.shape)}).")
    x = x.astype(np.float64)
    bad = ~np.isfinite(x)
    if bad.any():
        rows = np.unique(np.nonzero(bad.reshape(len(x), -1))[0])
        raise ConfigurationError(
            f"{where}: {int(bad.sum())} feature value(s) are NaN or infinite, in {len(rows)} example(s) "
            f"(first: example {int(rows[0])}, counting examples from 0). Clean or impute them first."
        )
    if np.issubdtype(y.dtype, np.floating):
        if not np.all(np.isfinite(y)):
            raise ConfigurationError(f"{where}: labels y contain NaN or infinite values.")
        if not np.all(y == np.round(y)):
            raise InputTypeError(f"{where}: labels y must be class labels (integers or strings), got non-integer floats.")
        y = y.astype(np.int64)
    elif not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.str_) or y.dtype == np.bool_):
        raise InputTypeError(f"{where}: labels y must be integers or strings, got dtype {y.dtype}.")
    classes, y_idx = np.unique(y, return_inverse=True)
    if len(classes) < 2:
        raise ConfigurationError(f"{where}: labels y hold a single class ({classes.tolist()}); need at least two.")
    counts = np.bincount(y_idx)
    if counts.min() < 2:
        rare = [classes[i].item() for i in np.nonzero(counts < 2)[0]]
        raise ConfigurationError(
            f"{where}: class(es) {rare} have a single example; a stratified train/test split needs at least two per class."
        )
    if x.ndim == 2:  # flat features: a square number of them is an image, otherwise a 1 x d strip
        d = x.shape[1]
        s = math.isqrt(d)
        x = x.reshape(len(x), 1, s, s) if s * s == d else x.reshape(len(x), 1, 1, d)
    elif x.ndim == 3:
        x = x[:, None]
    return x, y_idx, tuple(c.item() for c in classes)


def load_data(config: Config) -> Data:
    """Load digits (or ``config.data``), validate it and make a stratified train/test split.

    Raises:
        ConfigurationError: a missing file or array, wrong shapes, NaN/inf features, a single
            class, mismatched lengths, a bad ``subset``.
        InputTypeError: non-numeric features, labels that are not class labels.
    """
    from sklearn.model_selection import train_test_split

    if config.data is None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, y, where = digits.images, digits.target, "sklearn digits"
        scale = DIGITS_PIXEL_MAX if config.feature_scale is None else config.feature_scale
    else:
        path = Path(config.data)
        where = str(path)
        if not path.is_file():
            raise ConfigurationError(f"--data {path}: no such file.")
        suffix = path.suffix.lower()
        if suffix == ".npz":
            x, y = _read_npz(path)
        elif suffix == ".csv":
            x, y = _read_csv(path, config.label_column)
        else:
            raise ConfigurationError(f"--data {path}: expected a .npz (arrays x, y) or .csv file, got {suffix or 'no suffix'!r}.")
        scale = 1.0 if config.feature_scale is None else config.feature_scale
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigurationError(f"Expected feature_scale={scale!r} > 0.")
    x, y, classes = _check_and_shape(np.asarray(x), np.asarray(y), where=where)
    x = x / scale
    try:
        x_tr, x_te, y_tr, y_te = train_test_split(
            x, y, test_size=config.test_fraction, stratify=y, random_state=config.seed
        )
    except ValueError as err:
        raise ConfigurationError(f"{where}: cannot make a stratified {config.test_fraction:.0%} test split ({err}).") from err
    if config.subset is not None:
        n_classes = len(classes)
        if not n_classes <= config.subset <= len(x_tr):
            raise ConfigurationError(
                f"Expected subset={config.subset} between the number of classes ({n_classes}) and the "
                f"training set size ({len(x_tr)})."
            )
        if config.subset < len(x_tr):
            try:
                x_tr, _, y_tr, _ = train_test_split(
                    x_tr, y_tr, train_size=config.subset, stratify=y_tr, random_state=config.seed
                )
            except ValueError:  # too few per class to stratify: plain random subset
                keep = np.random.default_rng(config.seed).permutation(len(x_tr))[: config.subset]
                x_tr, y_tr = x_tr[keep], y_tr[keep]

    def t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype)

    return Data(t(x_tr, torch.float32), t(y_tr, torch.int64), t(x_te, torch.float32), t(y_te, torch.int64), classes, where)


# ----------------------------------------------------------------------------- model
def build_model(input_shape: tuple[int, int, int], num_classes: int, dropout: float = 0.0) -> nn.Module:
    """A small CNN (about 29k parameters for 8x8 inputs), tanh activations (bounded, which
    suits clipped noisy gradients; Papernot et al. 2021). GroupNorm, not BatchNorm: BatchNorm
    mixes the examples of a batch, so per-example gradients (and DP-SGD) are undefined for it.
    ``dropout > 0`` adds dropout before the head (its masks come from the DP step's key)."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Conv2d(c, 32, 3, padding=1),
        nn.GroupNorm(4, 32),
        nn.Tanh(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2),
        nn.GroupNorm(4, 64),
        nn.Tanh(),
        nn.Flatten(),
        *([nn.Dropout(dropout)] if dropout > 0 else []),
        nn.Linear(64 * ((h + 1) // 2) * ((w + 1) // 2), num_classes),
    )


def _init_model(config: Config, data: Data) -> nn.Module:
    # The same initial weights for the private and the baseline run; the global generator is
    # restored afterwards so nothing leaks into the caller's randomness.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return build_model(data.input_shape, data.num_classes, config.dropout)


def learning_rate(config: Config) -> float:
    """``config.lr``, or the tuned default of ``config.optimizer``."""
    return DEFAULT_LR[config.optimizer] if config.lr is None else config.lr


def _make_optimizer(config: Config, model: nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=learning_rate(config), momentum=0.9)
    if config.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=learning_rate(config))
    raise ConfigurationError(f"Expected optimizer in ('sgd', 'adam'), got {config.optimizer!r}.")


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The ordinary batch loss; ``compile_dp`` derives the per-example losses from it."""
    return F.cross_entropy(model(x), y)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy on held-out data."""
    was_training = model.training
    model.eval()
    try:
        return float((model(x).argmax(dim=1) == y).float().mean())
    finally:
        model.train(was_training)


def physical_batch_size_for(expected: float, sample_rate: float) -> int:
    """A fixed physical batch for Poisson batches of mean ``expected``: mean + 4 standard
    deviations, rounded up to a multiple of 8. Larger batches (rare) are split into padded
    chunks of this size inside the step, so the graph compiles exactly once."""
    std = math.sqrt(expected * (1.0 - sample_rate))
    return max(8, int(math.ceil((expected + 4.0 * std) / 8.0)) * 8)


def make_accountant() -> accounting.Accountant:
    """The accountant of the run (calibration, budget and reported epsilon): PLD with a value
    discretisation of 1e-3 instead of the default 1e-4. PLD is pessimistic at any
    discretisation (the reported epsilon is never below the true one); the coarser grid is
    several times faster and changes epsilon here by about 1e-4."""
    return accounting.Accountant("pld", value_discretization_interval=1e-3)


def calibrate_noise(
    epsilon: float, delta: float, sample_rate: float, dataset_size: int, steps: int, process_of: Any = None
) -> accounting.CalibrationResult:
    """The smallest noise multiplier with which ``steps`` Poisson-subsampled Gaussian steps
    spend at most (epsilon, delta) under the PLD accountant (the optimizer's default).

    PLD accounting gets slow at small sigma (a wide privacy-loss range), so a cheap RDP
    calibration first brackets the answer: RDP is the looser bound, so its sigma is (up to
    discretisation) an upper end, and the PLD search runs in [sigma_rdp / 2, 1.25 sigma_rdp].
    The result is accounted with :func:`make_accountant`, the accountant the optimizer uses.

    ``process_of(sigma)``, when given, is the privacy process of the whole run instead (the
    correlated-noise mechanisms).

    Raises:
        CalibrationError: the budget cannot be met with sigma <= 1000 (epsilon too small).
    """
    budget = accounting.epsilon_budget(epsilon, delta)

    def process(sigma: float) -> accounting.PrivacyProcess:
        if process_of is not None:
            return process_of(sigma)
        return accounting.dpsgd_step_process(sigma, sample_rate, dataset_size=dataset_size) * steps

    absl = logging.getLogger("absl")  # dp-accounting's RDP code logs harmless convergence notes
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        rough = accounting.calibrate(budget, process, 0.1, 1000.0, tol=1e-2, accountant="rdp", increasing=False).param
    finally:
        absl.setLevel(level)
    return accounting.calibrate(budget, process, 0.5 * rough, 1.25 * rough, tol=2e-3, accountant=make_accountant(), increasing=False)


def _check_config(config: Config) -> None:
    if not (math.isfinite(config.epsilon) and config.epsilon > 0):
        raise ConfigurationError(f"Expected epsilon={config.epsilon!r} > 0 and finite.")
    for name in ("epochs", "batch_size"):
        if getattr(config, name) < 1:
            raise ConfigurationError(f"Expected {name}={getattr(config, name)!r} >= 1.")
    if config.optimizer not in DEFAULT_LR:
        raise ConfigurationError(f"Expected optimizer in {tuple(DEFAULT_LR)}, got {config.optimizer!r}.")
    if config.lr is not None and not (math.isfinite(config.lr) and config.lr > 0):
        raise ConfigurationError(f"Expected lr={config.lr!r} > 0.")
    if not (math.isfinite(config.clipping_norm) and config.clipping_norm > 0):
        raise ConfigurationError(f"Expected clipping_norm={config.clipping_norm!r} > 0 and finite (inf would not be private).")
    if not 0 < config.test_fraction < 1:
        raise ConfigurationError(f"Expected test_fraction={config.test_fraction!r} in (0, 1).")
    if not 0 <= config.dropout < 1:
        raise ConfigurationError(f"Expected dropout={config.dropout!r} in [0, 1).")
    if config.lr_schedule not in ("constant", "cosine", "one-minus-sqrt"):
        raise ConfigurationError(f"Expected lr_schedule in ('constant', 'cosine', 'one-minus-sqrt'), got {config.lr_schedule!r}.")
    if config.checkpoint_every is not None and config.checkpoint_every < 1:
        raise ConfigurationError(f"Expected checkpoint_every={config.checkpoint_every!r} >= 1.")
    if config.noise not in NOISES:
        raise ConfigurationError(f"Expected noise in {NOISES}, got {config.noise!r}.")
    if config.bands < 1:
        raise ConfigurationError(f"Expected bands={config.bands!r} >= 1.")
    if config.resume and config.checkpoint_dir is None:
        raise ConfigurationError("--resume needs --checkpoint-dir (where the checkpoints are).")


def _lr_schedule(config: Config, total_steps: int) -> opake.schedules.Schedule:
    if config.lr_schedule == "cosine":
        return opake.schedules.cosine_schedule(total_steps)
    if config.lr_schedule == "one-minus-sqrt":
        return opake.schedules.one_minus_sqrt_schedule(total_steps)
    return opake.schedules.constant_schedule()


# ----------------------------------------------------------------------------- training
def _log(config: Config, msg: str) -> None:
    if config.verbose:
        tqdm.write(msg)


def train_private(config: Config, data: Data) -> dict[str, Any]:
    """DP-SGD/DP-Adam on ``data`` with sigma calibrated to (epsilon, delta) over the run."""
    n = len(data.x_train)
    if not 0 < config.delta < 1.0 / n:
        raise ConfigurationError(
            f"Expected 0 < delta={config.delta:g} < 1/N = {1.0 / n:.3g} (N = {n} training examples): "
            "a larger delta allows releasing a few examples outright."
        )
    if config.batch_size > n:
        raise ConfigurationError(f"Expected batch_size={config.batch_size} <= N = {n} training examples: pass a smaller --batch-size (the expected Poisson batch size).")
    q = config.batch_size / n
    steps_per_epoch = max(1, round(n / config.batch_size))
    strategy = None
    t0 = time.perf_counter()
    if config.noise == "bandmf":
        # cyclic Poisson over `bands` groups: rate q * bands within the group keeps the batch
        if config.bands * config.batch_size > n:
            raise ConfigurationError(
                f"--bands {config.bands} x --batch-size {config.batch_size} exceeds N = {n}: each of the "
                "bands groups must hold at least one expected batch."
            )
        q = config.batch_size * config.bands / n
    elif config.noise != "gaussian":
        steps_per_epoch = n // config.batch_size  # fixed batches of exactly batch_size
    total_steps = config.epochs * steps_per_epoch
    process_of = None
    if config.noise == "bandmf":
        strategy = opake.dpftrl.band_mf_strategy(total_steps, config.bands)

        def process_of(sigma: float) -> accounting.PrivacyProcess:
            return accounting.mf_poisson(strategy, sigma, q, bands=config.bands, steps=total_steps)
    elif config.noise != "gaussian":
        pattern = {"participations": config.epochs, "min_separation": steps_per_epoch}
        if config.noise == "blt":
            strategy = opake.dpftrl.blt_strategy(total_steps, 3, **pattern)
        elif config.noise == "bisr":
            strategy = opake.dpftrl.bisr_strategy(total_steps, min(config.bands, total_steps))
        else:
            strategy = opake.dpftrl.lambda_cgd_strategy(total_steps, **pattern)

        def process_of(sigma: float) -> accounting.PrivacyProcess:
            return accounting.mf_gaussian(strategy, sigma, **pattern)

    calibration = calibrate_noise(config.epsilon, config.delta, q, n, total_steps, process_of)
    sigma = calibration.param
    calibrate_s = time.perf_counter() - t0
    _log(
        config,
        f"[private] N={n}, q={q:.4f} (expected batch {config.batch_size}), {steps_per_epoch} steps/epoch x "
        f"{config.epochs} epochs = {total_steps} steps; noise {config.noise}"
        f"{'' if strategy is None else f' ({strategy!r}, prefix-sum RMSE {strategy.rmse():.3g} x sigma C)'}; "
        f"noise multiplier sigma={sigma:.4f} calibrated to "
        f"epsilon={calibration.epsilon:.4f} <= {config.epsilon:g} at delta={config.delta:g} ({make_accountant()!r}, {calibrate_s:.1f} s)",
    )

    root = opake.random.key(config.seed)
    sampler_key, noise_key, step_key = opake.random.split(root, 3)
    model = _init_model(config, data)
    p = physical_batch_size_for(config.batch_size, q)
    step = opake.compile_dp(
        loss_fn,
        model=model,
        clipping_norm=config.clipping_norm,
        physical_batch_size=p,
        backend=config.backend,
        key=step_key,
    )
    budget = accounting.epsilon_budget(config.epsilon, config.delta)
    if config.noise == "gaussian":
        sampler = opake.PoissonSampler(n, q, key=sampler_key, steps=steps_per_epoch)
        optimizer = opake.DPOptimizer(
            _make_optimizer(config, model),
            noise_multiplier=sigma,
            sampler=sampler,
            key=noise_key,
            accountant=make_accountant(),
            budget=budget,
        )
    else:
        if config.noise == "bandmf":
            sampler = opake.sampling.CyclicPoissonSampler(n, q, config.bands, sampler_key, steps=steps_per_epoch)
        else:
            sampler = opake.sampling.SequentialBatchSampler(n, config.batch_size, sampler_key)
        optimizer = opake.DPOptimizer(
            _make_optimizer(config, model),
            sampler=sampler,
            noise=opake.dpftrl.mf_gaussian_noise(strategy, sigma, noise_key),
            accountant=make_accountant(),
            budget=budget,
        )

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, _lr_schedule(config, total_steps))

    t0 = time.perf_counter()
    allowed = optimizer.max_steps()  # the budget check of every step; computed (and cached) here
    calibrate_s += time.perf_counter() - t0
    if allowed < total_steps:  # cannot happen: sigma was calibrated for total_steps
        raise ConfigurationError(f"The budget allows {allowed} steps, fewer than the planned {total_steps}.")

    # Compile once on a dummy all-zero batch (no private data), so examples/s is not skewed.
    t0 = time.perf_counter()
    step(torch.zeros(p, *data.input_shape), torch.zeros(p, dtype=torch.int64))
    compile_s = time.perf_counter() - t0
    _log(
        config,
        f"[private] {config.optimizer} lr={learning_rate(config):g}, clipping norm C={config.clipping_norm:g}; compiled the "
        f"DP step (backend={config.backend}, physical batch {p}) in {compile_s:.1f} s",
    )

    # Everything the run's future depends on; restored after the compile call above (which
    # drew dropout randomness from the step's key, in the interrupted run as in this one).
    state = {"model": model, "optimizer": optimizer, "sampler": sampler, "step": step, "scheduler": scheduler}
    ckpt = opake.Checkpointer(config.checkpoint_dir, keep=3) if config.checkpoint_dir else None
    every = config.checkpoint_every or steps_per_epoch
    start_step = 0
    if ckpt is not None and config.resume:
        restored = ckpt.restore(**state)
        if restored is not None:
            if optimizer.steps != restored:
                raise ConfigurationError(f"Checkpoint {restored} holds an optimizer at step {optimizer.steps}.")
            start_step = restored
            _log(config, f"[private] resumed from {ckpt.path(restored)} (step {restored} of {total_steps}, epsilon spent {optimizer.epsilon(config.delta):.3f})")

    history = []
    train_s = 0.0
    for epoch in range(start_step // steps_per_epoch + 1, config.epochs + 1):
        t0 = time.perf_counter()
        loss_sum, seen, steps_before = 0.0, 0, optimizer.steps
        # One iter() per epoch (tqdm.auto would call iter() on a sampler once more itself, which
        # starts, and discards, one more epoch); after a restore it resumes mid-epoch.
        left = config.epochs * steps_per_epoch - optimizer.steps - (config.epochs - epoch) * steps_per_epoch
        batches = iter(sampler)
        bar = tqdm(batches, total=left, desc=f"private epoch {epoch}/{config.epochs}", leave=False, disable=not config.progress, unit="step")
        for idx in bar:  # indexing the tensors directly; an empty batch is a pure-noise step
            idx_t = torch.as_tensor(idx, dtype=torch.int64)
            out = step(data.x_train[idx_t], data.y_train[idx_t])
            optimizer.step(out.clipped, draw=idx)  # charged per Poisson draw
            scheduler.step()
            if ckpt is not None and (optimizer.steps % every == 0 or optimizer.steps == total_steps):
                ckpt.save(optimizer.steps, **state)
            if len(idx):
                loss_sum += float(out.loss) * len(idx)
                seen += len(idx)
            bar.set_postfix(loss=f"{loss_sum / max(seen, 1):.3f}")
        epoch_s = time.perf_counter() - t0
        train_s += epoch_s
        acc = evaluate(model, data.x_test, data.y_test)
        eps = optimizer.epsilon(config.delta)
        row = {
            "epoch": epoch,
            "steps": optimizer.steps,
            "train_loss_not_private": loss_sum / seen if seen else float("nan"),
            "test_accuracy": acc,
            "epsilon": eps,
            # From the expected batch size q N: the realised count of sampled examples is a
            # statistic of the data (one example's presence moves it), and is not privatised.
            "examples_per_s": (optimizer.steps - steps_before) * optimizer.expected_batch_size / epoch_s
            if epoch_s > 0 else float("nan"),
        }
        history.append(row)
        _log(
            config,
            f"[private]  epoch {epoch:3d}  train loss (not privatised) {row['train_loss_not_private']:.4f}  "
            f"test acc {acc:.4f}  eps spent {eps:.3f}  {row['examples_per_s']:.0f} ex/s (expected)",
        )
    return {
        "test_accuracy": history[-1]["test_accuracy"] if history else evaluate(model, data.x_test, data.y_test),
        "epsilon": history[-1]["epsilon"] if history else optimizer.epsilon(config.delta),
        "delta": config.delta,
        "noise_multiplier": sigma,
        "noise": config.noise,
        "strategy": None if strategy is None else repr(strategy),
        "prefix_sum_rmse": None if strategy is None else strategy.rmse(),
        "calibrated_epsilon": calibration.epsilon,
        "sample_rate": q,
        "dataset_size": n,
        "steps": optimizer.steps,
        "steps_per_epoch": steps_per_epoch,
        "physical_batch_size": p,
        "num_backend_compiles": step.num_backend_compiles,
        "compile_s": compile_s,
        "calibrate_s": calibrate_s,  # calibration + the budget's max_steps
        "train_s": train_s,
        "history": history,
        "model": model,
        "optimizer": optimizer,
        "resumed_from_step": start_step,
        "checkpoint_dir": config.checkpoint_dir,
    }


def train_baseline(config: Config, data: Data) -> dict[str, Any]:
    """The non-private baseline: the same model, initial weights, optimizer, lr, epochs and
    batch size, trained with plain autograd on shuffled fixed-size batches (no clipping, no
    noise, no Poisson sampling). Its epsilon is infinite."""
    n = len(data.x_train)
    model = _init_model(config, data)
    opt = _make_optimizer(config, model)
    gen = torch.Generator().manual_seed(config.seed)
    b = min(config.batch_size, n)
    history = []
    t_start = time.perf_counter()
    for epoch in range(1, config.epochs + 1):
        t0 = time.perf_counter()
        perm = torch.randperm(n, generator=gen)
        loss_sum = 0.0
        bar = tqdm(range(0, n, b), desc=f"baseline epoch {epoch}/{config.epochs}", leave=False, disable=not config.progress, unit="step")
        for start in bar:
            idx = perm[start : start + b]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, data.x_train[idx], data.y_train[idx])
            loss.backward()
            opt.step()
            loss_sum += loss.item() * len(idx)
        epoch_s = time.perf_counter() - t0
        acc = evaluate(model, data.x_test, data.y_test)
        row = {
            "epoch": epoch,
            "train_loss_not_private": loss_sum / n,
            "test_accuracy": acc,
            "epsilon": math.inf,
            "examples_per_s": n / epoch_s if epoch_s > 0 else float("nan"),
        }
        history.append(row)
        _log(
            config,
            f"[baseline] epoch {epoch:3d}  train loss (not privatised) {row['train_loss_not_private']:.4f}  "
            f"test acc {acc:.4f}  eps = inf (no DP)  {row['examples_per_s']:.0f} ex/s",
        )
    return {
        "test_accuracy": history[-1]["test_accuracy"],
        "epsilon": math.inf,
        "train_s": time.perf_counter() - t_start,
        "history": history,
        "model": model,
    }


def _plot(path: str, private: dict[str, Any], baseline: dict[str, Any] | None, config: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    eps = [0.0] + [r["epsilon"] for r in private["history"]]
    acc = [private["initial_test_accuracy"]] + [r["test_accuracy"] for r in private["history"]]
    ax.plot(eps, acc, marker="o", label=f"DP ({config.optimizer}, C={config.clipping_norm:g}, sigma={private['noise_multiplier']:.2f})")
    if baseline is not None:
        ax.axhline(baseline["test_accuracy"], color="gray", linestyle="--", label="non-private baseline (final, eps = inf)")
    ax.set_xlabel(f"epsilon spent (delta = {config.delta:g})")
    ax.set_ylabel("test accuracy (held out)")
    ax.set_ylim(0, 1.02)
    ax.set_title("opake_compile: test accuracy vs privacy spent")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(config: Config) -> dict[str, Any]:
    """Run the whole job; return a summary dict.

    Returns:
        ``{"private": {...}, "baseline": {...} | None, "wall_time_s", "data": {...}}``; the
        private part holds ``test_accuracy``, ``epsilon`` (spent, from the optimizer's
        accountant), ``delta``, ``noise_multiplier``, ``sample_rate``, ``dataset_size``,
        ``steps``, ``history`` (one dict per epoch), the trained ``model`` and ``optimizer``.
    """
    t_start = time.perf_counter()
    _check_config(config)
    data = load_data(config)
    _log(
        config,
        f"data: {data.source}, {len(data.x_train)} train / {len(data.x_test)} held-out test examples, "
        f"input {tuple(data.input_shape)}, {data.num_classes} classes",
    )
    private = train_private(config, data)
    private["initial_test_accuracy"] = evaluate(_init_model(config, data), data.x_test, data.y_test)
    baseline = train_baseline(config, data) if config.non_private_baseline else None
    if config.plot:
        _plot(config.plot, private, baseline, config)
    wall = time.perf_counter() - t_start
    return {
        "private": private,
        "baseline": baseline,
        "wall_time_s": wall,
        "data": {"source": data.source, "n_train": len(data.x_train), "n_test": len(data.x_test), "num_classes": data.num_classes},
        "config": dataclasses.asdict(config),
    }


def format_summary(summary: dict[str, Any]) -> str:
    p, b = summary["private"], summary["baseline"]
    lines = [
        "=" * 72,
        f"summary ({summary['data']['source']}, {summary['data']['n_train']} train / {summary['data']['n_test']} test)",
        f"  private:      test accuracy {p['test_accuracy']:.4f} at epsilon = {p['epsilon']:.3f}, delta = {p['delta']:g} "
        f"({p.get('noise', 'gaussian')} noise, sigma = {p['noise_multiplier']:.3f}, {p['steps']} steps)",
    ]
    if b is not None:
        lines.append(f"  non-private:  test accuracy {b['test_accuracy']:.4f} (baseline, epsilon = inf)")
    lines.append(
        f"  wall time {summary['wall_time_s']:.1f} s (compile {p['compile_s']:.1f} s, accounting {p['calibrate_s']:.1f} s, "
        f"DP training {p['train_s']:.1f} s; {torch.get_num_threads()} threads)"
    )
    lines.append("  (training losses above are computed on private data without noise: not privatised)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 for a configuration or data error)."""
    config = parse_args(argv)
    try:
        summary = train(config)
    except OpakeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    if config.plot:
        print(f"plot written to {config.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
