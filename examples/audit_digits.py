"""Audit a DP training run on the digits in one run, and catch a broken (non-private) one.

The same job as ``train_digits.py`` (a small CNN on scikit-learn's 8x8 digits, DP-Adam, sigma
calibrated to epsilon = 3), with a one-run privacy audit (``opake.auditing``; Steinke, Nasr &
Jagielski 2023; Mahloujifar, Melis & Chaudhuri 2024), trained for **80 epochs** (both runs; the
main job trains 30). The audit of the non-private run is only as strong as its memorisation of
the included canaries: with 30 epochs it certified 54 % of the ceiling (one excluded canary
among the top 2 scores, 10 among the top 354), with 60 epochs 83 %, with 80 epochs 89 % (seed 0;
90 % and 99 % for seeds 2 and 1).

1. **Canaries** (default ``--canary-kind noise``): m *out-of-distribution* inputs -- images of
   i.i.d. uniform noise pixels in [0, 1] (the digits' scaled range), each with a uniformly
   random label, drawn from a key of their own (public randomness, nothing about the private
   data), added to the training data. Easy to memorise, impossible to fit by generalising.
   ``--canary-kind mislabelled`` takes m digits out of the training split instead and gives
   each a wrong label: memorised far less (non-private run, 30 epochs: epsilon >= 1.76 for
   m = 1000, 2.15 for m = 500, against 3.76 for 1000 noise canaries), and it shrinks the data.
2. ``auditing.coin_flip(m, key)`` decides which canaries join the training data (fair coins);
   the training set is the digits' training split plus the included canaries.
3. **Two runs** on that same training set, from the same initial weights:

   * DP: ``compile_dp`` (C = 1) + ``DPOptimizer`` with sigma calibrated by the accountant to
     (epsilon, delta) = (3, 1e-5) for the run's N, q and steps;
   * **explicitly non-private**: the same code path with ``clipping_norm=math.inf`` (no
     clipping) and ``noise_multiplier=0.0`` (no noise). The library allows both, emits a
     ``NotPrivateWarning`` for each (printed below), and its accountant reports epsilon = inf.
     This is the "broken pipeline" the audit has to catch.

4. **Scores**, black-box by default: ``auditing.loss_scores`` = minus each canary's loss under
   the trained model; ``--scores gradient`` uses ``auditing.gradient_scores`` (cosine of the
   canary's gradient at theta_0 with theta_T - theta_0; this script keeps theta_0; here it
   separates far worse than the loss: non-private epsilon >= 0.6 at most in our runs). Pick the
   score before looking at the results: trying several and reporting the best would need a
   split of the confidence level.
5. ``auditing.one_run(scores, record)`` -> lower bounds at 95 % confidence, printed next to the
   accountant's epsilon (an upper bound) and next to the *ceiling*: the largest epsilon m
   canaries can certify at all (every included canary scored above every excluded one), the
   share of it the run certifies, and the guess rule that certified it.

Run it::

    python examples/audit_digits.py                         # m = 1000 canaries, plot audit_digits.png (4-8 min)
    python examples/audit_digits.py --canaries 500 --scores gradient --plot g.png

From Python (tests do this)::

    from audit_digits import parse_args, run
    summary = run(parse_args(["--epochs", "2", "--backend", "aot_eager", "--subset", "300"]))
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

import train_digits as td  # noqa: E402  (the data, model, loss and calibration of the main job)

import opake_compile as opake  # noqa: E402
from opake_compile import accounting, auditing  # noqa: E402
from opake_compile._validate import NotPrivateWarning  # noqa: E402
from opake_compile.exceptions import ConfigurationError, OpakeError  # noqa: E402

__all__ = ["AuditConfig", "make_canaries", "parse_args", "run", "main"]


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    """Everything an audit run depends on (see :func:`parse_args` for the meaning)."""

    epsilon: float = 3.0
    delta: float = 1e-5
    epochs: int = 80
    batch_size: int = 256
    clipping_norm: float = 1.0
    lr: float = td.DEFAULT_LR["adam"]
    canaries: int = 1000
    scores: str = "loss"
    canary_kind: str = "noise"
    confidence: float = 0.95
    seed: int = 0
    backend: str = "inductor"
    subset: int | None = None
    plot: str | None = "audit_digits.png"
    non_private: bool = True
    progress: bool = True
    verbose: bool = True


def parse_args(argv: Sequence[str] | None = None) -> AuditConfig:
    d = AuditConfig()
    p = argparse.ArgumentParser(prog="audit_digits.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--epsilon", type=float, default=d.epsilon, help="target epsilon of the DP run (default %(default)s)")
    p.add_argument("--delta", type=float, default=d.delta, help="target delta (default %(default)s)")
    p.add_argument("--epochs", type=int, default=d.epochs, help="epochs of each run (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="expected Poisson batch size (default %(default)s)")
    p.add_argument("--clipping-norm", type=float, default=d.clipping_norm, help="C of the DP run (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate of both runs (default %(default)s)")
    p.add_argument("--canaries", type=int, default=d.canaries, help="m, the number of canaries (default %(default)s)")
    p.add_argument(
        "--scores",
        choices=("loss", "gradient"),
        default=d.scores,
        help="black-box loss scores (default) or white-box gradient scores",
    )
    p.add_argument(
        "--canary-kind",
        choices=("noise", "mislabelled"),
        default=d.canary_kind,
        help="noise: out-of-distribution noise images with random labels (added to the data); mislabelled: "
        "m digits taken out of the training split, each given a wrong label (default %(default)s)",
    )
    p.add_argument("--confidence", type=float, default=d.confidence, help="confidence of the lower bounds (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="root seed (default %(default)s)")
    p.add_argument("--backend", default=d.backend, help="torch.compile backend (default %(default)s)")
    p.add_argument("--subset", type=int, default=None, help="train on a stratified subset of the digits' training split")
    p.add_argument("--plot", default=d.plot, help="PNG of the in/out score histograms ('' for none; default %(default)s)")
    p.add_argument("--skip-non-private", dest="non_private", action="store_false", help="only the DP run")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--quiet", dest="verbose", action="store_false")
    ns = p.parse_args(argv)
    if ns.plot == "":
        ns.plot = None
    return AuditConfig(**vars(ns))


def make_canaries(m: int, key: opake.random.Key, input_shape: tuple[int, ...], num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m out-of-distribution canaries: ``(m, *input_shape)`` float32 images of i.i.d.
    U[0, 1] pixels and ``(m,)`` int64 labels uniform in [0, num_classes). Public randomness."""
    gen = opake.random.generator_from_key(key)
    x = torch.rand((m, *input_shape), generator=gen)
    y = torch.randint(0, num_classes, (m,), generator=gen)
    return x, y


def make_mislabelled_canaries(
    m: int, key: opake.random.Key, x: torch.Tensor, y: torch.Tensor, num_classes: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Take m random examples out of (x, y) and give each a uniformly random *wrong* label.

    Returns ``((x_canary, y_canary), (x_rest, y_rest))``: the canaries (never in the training
    data unless their coin says so) and the remaining training data."""
    if not 2 <= m < len(x):
        raise ConfigurationError(f"Expected 2 <= canaries={m} < {len(x)} training examples for mislabelled canaries.")
    gen = opake.random.generator_from_key(key)
    perm = torch.randperm(len(x), generator=gen)
    pick, rest = perm[:m], perm[m:]
    shift = torch.randint(1, num_classes, (m,), generator=gen)
    return (x[pick], (y[pick] + shift) % num_classes), (x[rest], y[rest])


def _log(config: AuditConfig, msg: str) -> None:
    if config.verbose:
        tqdm.write(msg)


def _train(
    config: AuditConfig,
    x: torch.Tensor,
    y: torch.Tensor,
    model: torch.nn.Module,
    *,
    private: bool,
    keys: tuple[opake.random.Key, ...],
) -> dict[str, Any]:
    """One run through compile_dp + DPOptimizer on (x, y); ``private=False``: C = inf, sigma = 0."""
    n = len(x)
    q = config.batch_size / n
    steps_per_epoch = max(1, round(n / config.batch_size))
    total = config.epochs * steps_per_epoch
    sampler_key, noise_key, step_key = keys
    caught: list[str] = []
    if private:
        sigma = td.calibrate_noise(config.epsilon, config.delta, q, n, total).param
        clipping_norm: float = config.clipping_norm
        budget = accounting.epsilon_budget(config.epsilon, config.delta)
    else:
        sigma, clipping_norm, budget = 0.0, math.inf, None
    p = td.physical_batch_size_for(config.batch_size, q)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always", NotPrivateWarning)
        step = opake.compile_dp(td.loss_fn, model=model, clipping_norm=clipping_norm, physical_batch_size=p, backend=config.backend, key=step_key)
        sampler = opake.PoissonSampler(n, q, key=sampler_key, steps=steps_per_epoch)
        optimizer = opake.DPOptimizer(
            torch.optim.Adam(model.parameters(), lr=config.lr),
            noise_multiplier=sigma,
            sampler=sampler,
            key=noise_key,
            accountant=td.make_accountant(),
            budget=budget,
        )
    caught = [f"{type(r.message).__name__}: {r.message}" for r in w if issubclass(r.category, NotPrivateWarning)]
    label = "private" if private else "NON-PRIVATE"
    for msg in caught:
        _log(config, f"[{label}] {msg}")
    t0 = time.perf_counter()
    for epoch in range(config.epochs):
        for idx in tqdm(sampler, desc=f"{label} epoch {epoch + 1}/{config.epochs}", leave=False, disable=not config.progress):
            idx_t = torch.as_tensor(idx, dtype=torch.int64)
            optimizer.step(step(x[idx_t], y[idx_t]).clipped)
    eps = optimizer.epsilon(config.delta) if private else math.inf
    return {
        "noise_multiplier": sigma,
        "clipping_norm": clipping_norm,
        "epsilon_accountant": eps,
        "steps": optimizer.steps,
        "dataset_size": n,
        "sample_rate": q,
        "train_s": time.perf_counter() - t0,
        "not_private_warnings": caught,
    }


def _audit(config: AuditConfig, model, theta0, canaries, record) -> tuple[np.ndarray, auditing.OneRunEstimate]:
    if config.scores == "loss":
        scores = auditing.loss_scores(model, canaries, td.loss_fn)
    else:
        scores = auditing.gradient_scores(model, canaries, td.loss_fn, initial_params=theta0)
    return scores, auditing.one_run(scores, record, confidence=config.confidence)


def run(config: AuditConfig) -> dict[str, Any]:
    """Both runs and their audits; returns a summary dict (see :func:`format_summary`)."""
    if config.canaries < 2:
        raise ConfigurationError(f"Expected canaries={config.canaries} >= 2.")
    if not 0 < config.confidence < 1:
        raise ConfigurationError(f"Expected confidence={config.confidence} in (0, 1).")
    t_start = time.perf_counter()
    data = td.load_data(dataclasses.replace(td.Config(), seed=config.seed, subset=config.subset))
    root = opake.random.key(config.seed)
    canary_key, coin_key, init_key, dp_root, np_root = opake.random.split(root, 5)
    if config.canary_kind == "noise":
        canaries = make_canaries(config.canaries, canary_key, data.input_shape, data.num_classes)
        base_x, base_y = data.x_train, data.y_train
    else:
        canaries, (base_x, base_y) = make_mislabelled_canaries(config.canaries, canary_key, data.x_train, data.y_train, data.num_classes)
    record = auditing.coin_flip(config.canaries, coin_key)
    x_in, y_in = record.select(*canaries)
    x = torch.cat([base_x, x_in])
    y = torch.cat([base_y, y_in])
    if not 0 < config.delta < 1.0 / len(x):
        raise ConfigurationError(f"Expected 0 < delta={config.delta:g} < 1/N = {1 / len(x):.3g}.")
    _log(
        config,
        f"data: {len(base_x)} digits + {record.num_included} of {config.canaries} canaries ({config.canary_kind}) "
        f"= N = {len(x)} training examples; {len(data.x_test)} held-out test digits",
    )
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=opake.random.generator_from_key(init_key)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        init = td.build_model(data.input_shape, data.num_classes)
    theta0 = {n: p.detach().clone() for n, p in init.named_parameters()}

    runs: dict[str, Any] = {}
    for name, private, rkey in (("dp", True, dp_root), ("non_private", False, np_root)):
        if not private and not config.non_private:
            continue
        model = td.build_model(data.input_shape, data.num_classes)
        model.load_state_dict(init.state_dict())
        info = _train(config, x, y, model, private=private, keys=opake.random.split(rkey, 3))
        scores, est = _audit(config, model, theta0, canaries, record)
        info.update(
            test_accuracy=td.evaluate(model, data.x_test, data.y_test),
            scores=scores,
            estimate=est,
            epsilon_lower_bound=est.epsilon_at(config.delta),
            epsilon_lower_bound_eps_delta=est.eps_delta().epsilon_at(config.delta),
            ceiling=est.ceiling().epsilon_at(config.delta),
            ceiling_eps_delta=est.ceiling().eps_delta().epsilon_at(config.delta),
        )
        runs[name] = info
        _log(config, _format_run(name, info, config))
    if config.plot:
        _plot(config.plot, runs, record, config)
    return {"runs": runs, "record": record, "config": dataclasses.asdict(config), "wall_time_s": time.perf_counter() - t_start}


def _format_run(name: str, r: dict[str, Any], config: AuditConfig) -> str:
    est: auditing.OneRunEstimate = r["estimate"]
    head = (
        f"DP run (sigma = {r['noise_multiplier']:.3f}, C = {r['clipping_norm']:g})"
        if name == "dp"
        else "NON-PRIVATE run (sigma = 0, C = inf: no noise, no clipping)"
    )
    return "\n".join(
        [
            f"{head}: {r['steps']} steps, N = {r['dataset_size']}, test accuracy {r['test_accuracy']:.4f}",
            f"  accountant (upper bound):     epsilon = {r['epsilon_accountant']:.3f} at delta = {config.delta:g}",
            f"  audit (lower bound, {100 * config.confidence:g} % confidence, {config.scores} scores, m = {est.num_canaries}):",
            f"    mu-GDP view:     epsilon >= {r['epsilon_lower_bound']:.3f}   (mu >= {est.mu_lower_bound:.3f})",
            f"    (eps, delta) view: epsilon >= {r['epsilon_lower_bound_eps_delta']:.3f}",
            f"    ceiling (perfect attack, these m canaries): epsilon >= {r['ceiling']:.3f} (GDP), {r['ceiling_eps_delta']:.3f} ((eps, delta))"
            f" -> this run certifies {_pct(r['epsilon_lower_bound'], r['ceiling'])} of the GDP ceiling",
            f"    {_best_rule(est)}",
            f"    attack AUC {est.attack_auc():.3f}, beta at FPR 0.01: {est.attack_beta_at(0.01):.3f} (empirical, not bounds)",
        ]
    )


def _pct(value: float, ceiling: float) -> str:
    return f"{100 * value / ceiling:.0f} %" if ceiling > 0 else "n/a"


def _best_rule(est: auditing.OneRunEstimate) -> str:
    """The guess rule behind the GDP bound: how many canaries it guessed 'included', how many right."""
    if est.threshold is None:
        return "no guess rule gave evidence of a privacy loss"
    k_in = int(np.sum(est.in_scores >= est.threshold))
    k = k_in + int(np.sum(est.out_scores >= est.threshold))
    return f"best guess rule: the top {k} scores guessed 'included', {k_in} right, {k - k_in} wrong ({est.num_included} were included)"


def _plot(path: str, runs: dict[str, Any], record: auditing.CanaryRecord, config: AuditConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mask = record.mask()
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 3.8), squeeze=False)
    for ax, (name, r) in zip(axes[0], runs.items()):
        s = r["scores"]
        bins = np.linspace(np.min(s), np.max(s), 41) if np.ptp(s) > 0 else 10
        ax.hist(s[mask], bins=bins, alpha=0.6, label=f"included ({mask.sum()})")
        ax.hist(s[~mask], bins=bins, alpha=0.6, label=f"excluded ({(~mask).sum()})")
        acc_eps = "inf" if math.isinf(r["epsilon_accountant"]) else f"{r['epsilon_accountant']:.2f}"
        title = "DP (C=%g, sigma=%.2f)" % (r["clipping_norm"], r["noise_multiplier"]) if name == "dp" else "NON-PRIVATE (C=inf, sigma=0)"
        ax.set_title(f"{title}\naccountant eps={acc_eps}; audit eps >= {r['epsilon_lower_bound']:.2f}", fontsize=9)
        ax.set_xlabel(f"{config.scores} score (higher = more likely trained on)")
        ax.set_ylabel("canaries")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_summary(summary: dict[str, Any]) -> str:
    cfg = summary["config"]
    lines = ["=" * 72, f"one-run audit, delta = {cfg['delta']:g}, {100 * cfg['confidence']:g} % confidence, m = {cfg['canaries']} canaries"]
    for name, r in summary["runs"].items():
        lines.append(_format_run(name, r, AuditConfig(**cfg)))
    dp, nonp = summary["runs"].get("dp"), summary["runs"].get("non_private")
    if dp is not None and nonp is not None:
        caught = nonp["epsilon_lower_bound"] > cfg["epsilon"]
        lines.append(
            f"verdict: the DP run's lower bound {dp['epsilon_lower_bound']:.3f} is "
            f"{'below' if dp['epsilon_lower_bound'] <= dp['epsilon_accountant'] else 'ABOVE'} its accountant's "
            f"{dp['epsilon_accountant']:.3f}; the non-private run's {nonp['epsilon_lower_bound']:.3f} "
            f"({_pct(nonp['epsilon_lower_bound'], nonp['ceiling'])} of the {nonp['ceiling']:.3f} these canaries can certify at most) "
            f"{'exceeds' if caught else 'does not exceed'} the claimed epsilon = {cfg['epsilon']:g}"
            f"{' -> the audit catches the broken pipeline' if caught else ''}."
        )
    lines.append(f"wall time {summary['wall_time_s']:.1f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        summary = run(config)
    except OpakeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    if config.plot:
        print(f"score histograms written to {config.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
