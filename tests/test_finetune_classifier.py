"""The sequence-classification example, ``examples/finetune_classifier.py``, in its ``--quick`` mode.

One run (``aot_eager``) of the whole script: real labelled data (standard-library docstrings
labelled by package), a locally trained tokenizer, public pre-training, a private fine-tune with
``DPTrainer`` and a non-private one with the plain ``Trainer``. The epsilon it reports must be
within the target and equal to the accountant's epsilon for the steps it took; the accuracies
must be real accuracies on the held-out split (counts over its size). Whether the models learn
is the full run's business (examples/README.md): ``--quick`` is too short to beat the majority
class reliably.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("peft")
pytest.importorskip("tokenizers")

from opake_compile import accounting  # noqa: E402

from _examples import load_example  # noqa: E402




def test_quick_run_reports_accuracy_within_the_budget(tmp_path, capsys):
    fc = load_example("finetune_classifier.py", "finetune_classifier")
    out = fc.main(["--quick", "--backend", "aot_eager", "--no-progress", "--output-dir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "majority class" in printed and "private fine-tune" in printed
    n, n_test = out["n_train"], out["n_test"]
    assert n > 500 and n_test > 100  # six packages' docstrings, 80/20
    assert out["delta"] <= n ** -1.1
    # epsilon: within the target, and the accountant's for the steps actually taken
    assert 0.0 < out["epsilon"] <= out["target_epsilon"] + 1e-9
    step = accounting.dpsgd_step_process(out["sigma"], out["sample_rate"], dataset_size=n)
    expected = accounting.Accountant("pld").epsilon(step * out["steps"], out["delta"])
    assert out["steps"] > 0 and math.isclose(out["epsilon"], expected, rel_tol=1e-9)
    for key in ("majority", "before", "private", "non_private"):
        assert 0.0 <= out[key] <= 1.0
        assert math.isclose(out[key] * n_test, round(out[key] * n_test), abs_tol=1e-6)  # a count / n_test
    # the majority-class baseline is the largest package's share of the held-out split
    assert out["majority"] >= 1.0 / len(fc.PACKAGES)
