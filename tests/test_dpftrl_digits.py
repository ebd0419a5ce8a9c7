"""``examples/train_digits.py --noise``: correlated noise at the same epsilon, end to end."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("sklearn")

from opake_compile import accounting, dpftrl  # noqa: E402
from opake_compile.exceptions import ConfigurationError  # noqa: E402

from _examples import load_example  # noqa: E402




td = load_example("train_digits.py", "train_digits_dpftrl")


def _config(**changes):
    base = td.parse_args(["--backend", "aot_eager", "--no-progress", "--quiet"])
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("noise", ["bandmf", "lambda-cgd"])
def test_correlated_noise_run_learns_within_the_same_epsilon(noise):
    config = _config(subset=500, epochs=2, batch_size=100, bands=2, noise=noise, epsilon=3.0)
    private = td.train(config)["private"]
    assert private["noise"] == noise and private["steps"] == 2 * private["steps_per_epoch"]
    assert private["test_accuracy"] > 0.3  # chance is 0.1
    assert private["epsilon"] <= 3.0
    opt = private["optimizer"]
    strategy = opt._noise_fn.strategy
    if noise == "bandmf":
        expected = accounting.mf_poisson(strategy, private["noise_multiplier"], private["sample_rate"], bands=2, steps=opt.steps)
    else:
        expected = accounting.mf_gaussian(
            strategy, private["noise_multiplier"], participations=2, min_separation=private["steps_per_epoch"]
        )
    assert opt.process == expected
    assert private["epsilon"] == pytest.approx(td.make_accountant().epsilon(expected, config.delta), rel=1e-12)


def test_noise_arguments_are_checked():
    assert td.parse_args([]).noise == "gaussian"  # the default run is unchanged
    with pytest.raises(ConfigurationError, match="bands"):
        td.train(_config(subset=300, batch_size=100, bands=4, noise="bandmf", epochs=1))
    with pytest.raises(SystemExit):
        td.parse_args(["--noise", "laplace"])
    assert dpftrl.band_mf_strategy  # the module the example uses
