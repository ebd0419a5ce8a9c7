"""Tests for opake_compile.exceptions (stable categories) and opake_compile._validate."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from opake_compile import _validate as V
from opake_compile import exceptions as E

# ---------------------------------------------------------------------------------- exceptions


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (E.InputTypeError, TypeError),
        (E.ConfigurationError, ValueError),
        (E.CalibrationError, ValueError),
        (E.PrivacyBudgetExhaustedError, RuntimeError),
        (E.CheckpointError, ValueError),
        (E.UnsupportedOperationError, RuntimeError),
    ],
)
def test_categories_derive_from_base_and_builtin(cls, builtin):
    assert issubclass(cls, E.OpakeError) and issubclass(cls, builtin)
    with pytest.raises(E.OpakeError, match="boom"):
        raise cls("boom")


def test_categories_are_distinct_and_exported():
    names = [n for n in E.__all__ if n != "OpakeError"]
    cats = [getattr(E, n) for n in names if issubclass(getattr(E, n), E.OpakeError)]
    assert len(set(cats)) == len(cats) == 6
    # The one warning exported beside them is a warning, not an error category.
    assert [n for n in names if not issubclass(getattr(E, n), E.OpakeError)] == ["SoundnessWarning"]
    assert issubclass(E.SoundnessWarning, UserWarning) and not issubclass(E.SoundnessWarning, E.OpakeError)
    for a in cats:
        for b in cats:
            assert (a is b) == issubclass(a, b)


# ------------------------------------------------------------------------------ clipping_norm


@pytest.mark.parametrize("value", [1, 0.5, 1e-12, 3.0e6, torch.tensor(2.0), torch.tensor(2, dtype=torch.int64), np.float32(0.25)])
def test_clipping_norm_accepts_positive_numbers(value):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = V.check_clipping_norm(value)
    assert isinstance(c, float) and c == pytest.approx(float(value))


def test_clipping_norm_inf_warns():
    with pytest.warns(V.NotPrivateWarning, match="clipping_norm=inf"):
        assert V.check_clipping_norm(math.inf) == math.inf
    with pytest.warns(V.NotPrivateWarning):
        V.check_clipping_norm(torch.tensor(math.inf))


@pytest.mark.parametrize("value", [0, 0.0, -1, -1e-9, math.nan, -math.inf, torch.tensor(0.0), torch.tensor(math.nan)])
def test_clipping_norm_nonpositive_or_nan_is_configuration_error(value):
    with pytest.raises(E.ConfigurationError, match="clipping_norm"):
        V.check_clipping_norm(value)


@pytest.mark.parametrize(
    "value",
    [True, False, "1.0", None, [1.0], 1 + 0j, torch.ones(1), torch.ones(2), torch.tensor(True), torch.tensor(1 + 1j)],
)
def test_clipping_norm_non_numeric_is_input_type_error(value):
    with pytest.raises(E.InputTypeError):
        V.check_clipping_norm(value)


def test_error_message_names_argument_and_range():
    with pytest.raises(E.ConfigurationError, match=r"my_c=-1\.0 > 0"):
        V.check_clipping_norm(-1.0, name="my_c")


# ------------------------------------------------------------------------------- other checks


def test_noise_multiplier():
    assert V.check_noise_multiplier(1.5) == 1.5
    with pytest.warns(V.NotPrivateWarning):
        assert V.check_noise_multiplier(0) == 0.0
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(E.ConfigurationError):
            V.check_noise_multiplier(bad)
    with pytest.raises(E.InputTypeError):
        V.check_noise_multiplier("1")


def test_probability_and_ints():
    assert V.check_probability(0, name="q") == 0.0 and V.check_probability(1, name="q") == 1.0
    for bad in (-0.01, 1.01, math.nan):
        with pytest.raises(E.ConfigurationError, match="q="):
            V.check_probability(bad, name="q")
    assert V.check_positive_int(np.int64(3), name="n") == 3
    assert V.check_nonnegative_int(0, name="n") == 0
    with pytest.raises(E.ConfigurationError):
        V.check_positive_int(0, name="n")
    with pytest.raises(E.ConfigurationError):
        V.check_nonnegative_int(-1, name="n")
    for bad in (True, 1.0, "1"):
        with pytest.raises(E.InputTypeError):
            V.check_positive_int(bad, name="n")


# ------------------------------------------------------------ per-example values that are not tensors
def test_per_example_values_that_are_not_tensors_are_refused_in_a_batched_argument():
    """Only tensor leaves are split into examples. A NumPy array, or a list of B floats, in a
    batched argument would be one constant seen by every example: with per-example loss weights
    ``[0.01] * 15 + [500]`` one example moved the compiled step's clipped sum by 15.9 C. Refused
    naming the leaf; a config value (a short tuple, a string, a 0-d NumPy scalar) is kept."""
    x = torch.zeros(16, 3)
    for bad, what in (([0.01] * 15 + [500.0], r"\['w'\] is a list of 16 numbers"),
                      (np.ones((16, 2)), r"\['w'\] holds a ndarray of 16 rows"),
                      (tuple(range(16)), r"\['w'\] is a tuple of 16 numbers")):
        with pytest.raises(E.InputTypeError, match=what):
            V.check_batch_size(({"x": x, "w": bad},), (0,))
    # Constants: strings (default_collate's string fields), torch.Size, other lengths, 0-d arrays.
    ok = {"x": x, "w": (2, 3), "name": "mlp", "t": np.float32(0.5), "ids": [f"row{i}" for i in range(16)],
          "shape": torch.Size([4] * 16), "classes": np.ones(10)}
    assert V.check_batch_size((ok,), (0,)) == 16
    assert V.check_batch_size(({"x": x}, np.ones(16)), (0,)) == 16  # outside batch_argnums: a constant


def test_a_batched_argument_without_a_tensor_says_what_it_is():
    """A newcomer's two likely slips get their own advice: passing the bound model to the step
    (it used to say "leave it out of batch_argnums") and a NumPy batch (convert it)."""
    import torch.nn as nn

    x = torch.zeros(4, 2)
    with pytest.raises(E.InputTypeError, match=r"Linear module.*not step\(model, x, y\)"):
        V.check_batch_size((nn.Linear(2, 1), x), (0, 1))
    with pytest.raises(E.InputTypeError, match="ndarray, not a tensor.*torch.as_tensor"):
        V.check_batch_size((np.zeros((4, 2)), x), (0, 1))
    with pytest.raises(E.InputTypeError, match=r"holds no tensor \(str\)"):
        V.check_batch_size(("text", x), (0, 1))


def test_the_compiled_step_refuses_a_per_example_list_before_anything_runs():
    import torch.nn.functional as F

    import opake_compile as opake

    model = torch.nn.Linear(3, 2)
    step = opake.compile_dp(
        lambda m, b: (F.cross_entropy(m(b["x"]), b["y"], reduction="none") * torch.as_tensor(b["w"])).mean(),
        model=model, clipping_norm=1.0, backend="aot_eager",
    )
    batch = {"x": torch.randn(4, 3), "y": torch.tensor([0, 1, 0, 1]), "w": [1.0, 1.0, 1.0, 9.0]}
    state = step.state_dict()
    with pytest.raises(E.InputTypeError, match="list of 4 numbers"):
        step(batch)
    assert step.state_dict() == state and step.num_traces == 0
    assert step({**batch, "w": torch.tensor(batch["w"])}).clipped.num_examples == 4
