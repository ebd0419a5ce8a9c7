"""Tests for the main job, ``examples/train_digits.py``.

One short private run (a 600-example subset of the digits, 3 epochs, ``backend="aot_eager"``)
is shared by the module: it must learn (held-out accuracy far above the 10 % of chance), and
the epsilon it reports must be the accountant's epsilon for the steps actually taken,
recomputed here from the accounting processes and cross-checked against dp-accounting's own
PLD accountant. Bad data files must fail with the project's errors before any training.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")

from opake_compile import accounting  # noqa: E402
from opake_compile.exceptions import ConfigurationError, InputTypeError  # noqa: E402

from _examples import load_example  # noqa: E402




td = load_example("train_digits.py", "train_digits")


def _config(**changes):
    base = td.parse_args(["--backend", "aot_eager", "--no-progress", "--quiet"])
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    plot = tmp_path_factory.mktemp("plot") / "acc_vs_eps.png"
    config = _config(subset=600, epochs=3, batch_size=128, seed=0, non_private_baseline=True, plot=str(plot))
    return config, td.train(config)


# ----------------------------------------------------------------------------- learning
def test_private_run_learns(run):
    _, summary = run
    private = summary["private"]
    assert summary["data"]["n_train"] == 600
    assert summary["data"]["n_test"] == 360  # the held-out split is not subsampled
    assert private["test_accuracy"] > 0.5  # chance is 0.1
    assert summary["baseline"]["test_accuracy"] > 0.5
    assert math.isinf(summary["baseline"]["epsilon"])
    losses = [r["train_loss_not_private"] for r in private["history"]]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_compiles_once(run):
    _, summary = run
    assert summary["private"]["num_backend_compiles"] == 1


def test_plot_written(run):
    config, _ = run
    data = Path(config.plot).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- accounting
def test_reported_epsilon_is_the_accountants_for_the_steps_taken(run):
    config, summary = run
    p = summary["private"]
    n, q, sigma = p["dataset_size"], p["sample_rate"], p["noise_multiplier"]
    steps_per_epoch = round(n / config.batch_size)
    assert p["steps"] == config.epochs * steps_per_epoch == p["optimizer"].steps
    assert q == config.batch_size / n

    accountant = td.make_accountant()
    one_step = accounting.dpsgd_step_process(sigma, q, dataset_size=n)
    for row in p["history"]:
        steps = row["epoch"] * steps_per_epoch
        assert row["steps"] == steps
        assert row["epsilon"] == accountant.epsilon(one_step * steps, config.delta)
    assert p["epsilon"] == p["history"][-1]["epsilon"]

    # The calibration uses the whole budget, never more.
    assert 0.99 * config.epsilon < p["epsilon"] <= config.epsilon


def test_reported_epsilon_matches_dp_accounting_directly(run):
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    config, summary = run
    p = summary["private"]
    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(p["sample_rate"], dp_event.GaussianDpEvent(p["noise_multiplier"])),
        p["steps"],
    )
    reference = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    reference.compose(event)
    assert p["epsilon"] == pytest.approx(reference.get_epsilon(config.delta), rel=1e-3)


def test_calibrate_noise_meets_and_uses_the_budget():
    result = td.calibrate_noise(3.0, 1e-5, 256 / 1437, 1437, 60)
    eps = td.make_accountant().epsilon(accounting.dpsgd_step_process(result.param, 256 / 1437, dataset_size=1437) * 60, 1e-5)
    assert 0.99 * 3.0 < eps <= 3.0
    # A slightly smaller sigma would overspend.
    over = td.make_accountant().epsilon(
        accounting.dpsgd_step_process(result.param * 0.99, 256 / 1437, dataset_size=1437) * 60, 1e-5
    )
    assert over > 3.0


def test_delta_must_be_below_one_over_n():
    with pytest.raises(ConfigurationError, match="delta"):
        td.train(_config(subset=100, delta=0.02))


def test_batch_size_larger_than_dataset_is_refused():
    with pytest.raises(ConfigurationError, match="batch_size"):
        td.train(_config(subset=100, batch_size=200))


def test_physical_batch_size_covers_poisson_fluctuation():
    p = td.physical_batch_size_for(256, 256 / 1437)
    assert p % 8 == 0 and p >= 256 + 4 * math.sqrt(256 * (1 - 256 / 1437))


def test_format_summary_labels_private_and_non_private(run):
    _, summary = run
    text = td.format_summary(summary)
    assert "private" in text and "non-private" in text and "not privatised" in text


# ----------------------------------------------------------------------------- user data
def _digits_arrays():
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.float64), d.target


def test_npz_with_flat_square_features_becomes_images(tmp_path):
    x, y = _digits_arrays()
    path = tmp_path / "digits.npz"
    np.savez(path, x=(x / 16.0).reshape(len(x), 64), y=y)
    data = td.load_data(_config(data=str(path)))
    assert data.input_shape == (1, 8, 8)
    assert data.num_classes == 10
    assert len(data.x_train) + len(data.x_test) == len(x)
    assert float(data.x_train.max()) <= 1.0  # used as given (feature_scale 1 for --data)


def test_csv_with_string_labels(tmp_path):
    path = tmp_path / "toy.csv"
    rng = np.random.default_rng(0)
    lines = ["f1,f2,f3,kind"]
    for i in range(40):
        lines.append(",".join(f"{v:.3f}" for v in rng.random(3)) + ("," + ("cat" if i % 2 else "dog")))
    path.write_text("\n".join(lines) + "\n")
    data = td.load_data(_config(data=str(path), label_column="kind"))
    assert data.classes == ("cat", "dog")
    assert data.input_shape == (1, 1, 3)  # three features: a 1 x 3 strip
    assert len(data.x_test) == 8


def _npz(tmp_path, name, **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def _csv(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


_X = np.random.default_rng(0).random((20, 8, 8))
_Y = np.arange(20) % 2


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda t: _npz(t, "nokey.npz", x=_X), ConfigurationError, r"missing \['y'\]"),
        (lambda t: _npz(t, "renamed.npz", features=_X, labels=_Y), ConfigurationError, "expected arrays 'x'"),
        (lambda t: _npz(t, "x1d.npz", x=_X.reshape(-1), y=_Y), ConfigurationError, "shape"),
        (lambda t: _npz(t, "x5d.npz", x=_X.reshape(20, 1, 1, 8, 8), y=_Y), ConfigurationError, "shape"),
        (lambda t: _npz(t, "onehot.npz", x=_X, y=np.eye(2)[_Y]), ConfigurationError, "one-hot"),
        (lambda t: _npz(t, "nan.npz", x=np.where(np.arange(_X.size).reshape(_X.shape) == 70, np.nan, _X), y=_Y), ConfigurationError, "NaN"),
        (lambda t: _npz(t, "inf.npz", x=np.where(np.arange(_X.size).reshape(_X.shape) == 3, np.inf, _X), y=_Y), ConfigurationError, "infinite"),
        (lambda t: _npz(t, "oneclass.npz", x=_X, y=np.zeros(20, dtype=int)), ConfigurationError, "single class"),
        (lambda t: _npz(t, "mismatch.npz", x=_X, y=_Y[:15]), ConfigurationError, "20 examples but y has 15"),
        (lambda t: _npz(t, "strings.npz", x=np.array([["a"] * 4] * 20), y=_Y), InputTypeError, "real numbers"),
        (lambda t: _npz(t, "floaty.npz", x=_X, y=_Y + 0.5), InputTypeError, "class labels"),
        (lambda t: _npz(t, "rare.npz", x=_X, y=np.r_[np.zeros(19, dtype=int), 1]), ConfigurationError, "single example"),
        (lambda t: _csv(t, "nolabel.csv", "a,b\n1,2\n3,4\n"), ConfigurationError, "no label column 'label'"),
        (lambda t: _csv(t, "text.csv", "a,label\n1,0\nx,1\n"), InputTypeError, "not a number"),
        (lambda t: _csv(t, "nanfeat.csv", "a,label\n" + "".join(f"{'nan' if i == 3 else i},{i % 2}\n" for i in range(10))), ConfigurationError, "NaN"),
        (lambda t: _csv(t, "ragged.csv", "a,b,label\n1,2,0\n3,1\n"), ConfigurationError, "fields"),
        (lambda t: _csv(t, "nolab.csv", "a,label\n" + "".join(f"{i},{'' if i in (2, 5) else i % 2}\n" for i in range(10))), ConfigurationError, "row 4: the label is empty"),
        (lambda t: _csv(t, "one.csv", "a,label\n" + "".join(f"{i},7\n" for i in range(10))), ConfigurationError, "single class"),
        (lambda t: _csv(t, "empty.csv", ""), ConfigurationError, "empty"),
        (lambda t: _csv(t, "data.txt", "a,label\n1,0\n"), ConfigurationError, "expected a .npz"),
        (lambda t: t / "missing.npz", ConfigurationError, "no such file"),
    ],
)
def test_bad_files_fail_clearly_before_training(tmp_path, monkeypatch, make, error, match):
    path = make(tmp_path)

    def no_training(*args, **kwargs):  # pragma: no cover - reached only if validation fails open
        raise AssertionError("training started on a bad file")

    monkeypatch.setattr(td, "train_private", no_training)
    with pytest.raises(error, match=match):
        td.train(_config(data=str(path)))


def test_cli_reports_bad_file_and_exits_2(tmp_path, capsys):
    path = _npz(tmp_path, "nokey.npz", x=_X)
    assert td.main(["--data", str(path), "--backend", "aot_eager", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'y'" in err
