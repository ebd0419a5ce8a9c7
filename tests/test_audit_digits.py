"""Smoke test of ``examples/audit_digits.py``: a small DP run and an explicitly non-private run
(sigma = 0, C = inf) with canaries, both audited. Short training (2 epochs on a 300-digit
subset, 100 canaries, ``aot_eager``), so the bounds are not compared with each other, only
with what must hold whatever the training: lower bounds in [0, ceiling], the DP run's lower
bound below its accountant's epsilon, the non-private run flagged as such."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from _examples import load_example  # noqa: E402




@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    ad = load_example("audit_digits.py", "audit_digits")
    plot = tmp_path_factory.mktemp("audit") / "hist.png"
    config = ad.parse_args(
        ["--epochs", "2", "--subset", "300", "--canaries", "100", "--backend", "aot_eager", "--no-progress", "--quiet", "--plot", str(plot)]
    )
    return ad, config, ad.run(config)


def test_both_runs_are_audited(summary):
    ad, config, s = summary
    rec = s["record"]
    assert rec.num_canaries == 100 and 0 < rec.num_included < 100
    dp, nonp = s["runs"]["dp"], s["runs"]["non_private"]
    assert dp["dataset_size"] == nonp["dataset_size"] == 300 + rec.num_included
    for r in (dp, nonp):
        assert r["scores"].shape == (100,) and np.isfinite(r["scores"]).all()
        assert 0.0 <= r["epsilon_lower_bound"] <= r["ceiling"] + 1e-9
        assert 0.0 <= r["epsilon_lower_bound_eps_delta"] <= r["ceiling_eps_delta"] + 1e-9
    assert dp["epsilon_accountant"] <= config.epsilon + 1e-6
    assert dp["epsilon_lower_bound"] <= dp["epsilon_accountant"]
    assert dp["noise_multiplier"] > 0 and dp["clipping_norm"] == config.clipping_norm and not dp["not_private_warnings"]
    # the broken pipeline is explicit: C = inf and sigma = 0, each announced by the library
    assert math.isinf(nonp["clipping_norm"]) and nonp["noise_multiplier"] == 0.0 and math.isinf(nonp["epsilon_accountant"])
    warned = " ".join(nonp["not_private_warnings"])
    assert "clipping_norm=inf" in warned and "noise_multiplier=0" in warned
    text = ad.format_summary(s)
    assert "lower bound" in text and "verdict" in text and "of the GDP ceiling" in text
    assert "guess rule" in text


def test_histogram_png_written(summary):
    _, config, _ = summary
    assert Path(config.plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
