"""Input checks registered while tracing (``opake_compile.compiler._input_checks``): run by the
compiled step on the real rows of every chunk before any graph runs; a refusal changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opake_compile as opake
from _models import seeded
from opake_compile.compiler._input_checks import require


def _nonnegative(rows: torch.Tensor, first_row: int) -> str | None:
    bad = (rows < 0).nonzero()
    return None if len(bad) == 0 else f"row {first_row + int(bad[0, 0])} holds {float(rows[int(bad[0, 0])].min())}"


def _model() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 2))


def test_check_runs_on_real_rows_of_every_chunk_before_the_step() -> None:
    """A check on a value computed from a batch argument (a view and an arithmetic op of it):
    the step refuses a batch whose real row fails it, names the row's position in the logical
    batch, and leaves the step's key, the global generator and the sizes untouched; padded rows
    (zeros here, shifted to -1 by the value's computation) are never checked; outside a trace
    ``require`` records nothing."""
    model = _model()
    recorded = []

    def loss(m: nn.Module, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        recorded.append(require(w[:, 0] - 1.0, _nonnegative, "w >= 1"))
        return (F.softplus(m(x)).sum(-1) * w[:, 0]).mean()

    x = torch.randn(7, 3, generator=seeded(0))
    w = torch.rand(7, 1, generator=seeded(1)) + 1.0  # padding (zeros) would fail: it is never checked
    step = opake.compile_dp(loss, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=3, key=opake.random.key(0))
    first = step.state_dict()
    want = step(x, w).clipped
    assert recorded == [True] and step.num_traces == 1
    state, rng = step.state_dict(), torch.random.get_rng_state()
    bad = w.clone()
    bad[5, 0] = 0.5  # the third chunk (rows 6..) passes; the second holds row 5
    with pytest.raises(opake.exceptions.ConfigurationError, match=r"row 5 holds -0\.5"):
        step(x, bad)
    assert step.state_dict() == state and torch.equal(torch.random.get_rng_state(), rng) and step.num_calls == 1
    assert step.num_traces == 1 and step(x, w).clipped.num_examples == 7
    step.load_state_dict(first)  # the same key as the first call: the same draws, the same sums
    again = step(x, w).clipped
    assert all(torch.equal(again.grads[k], want.grads[k]) for k in want.grads)
    assert require(w, _nonnegative, "outside a trace") is False


def test_check_on_a_value_that_depends_on_parameters_is_dropped_with_a_warning() -> None:
    """A value that needs the parameters cannot be computed before the step: no check, a warning."""
    model = _model()

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = m(x)
        require(out, _nonnegative, "the model's outputs")
        return out.square().mean()

    step = opake.compile_dp(loss, model=model, clipping_norm=1.0, backend="aot_eager", physical_batch_size=4)
    with pytest.warns(UserWarning, match="cannot check the model's outputs"):
        step(torch.randn(4, 3, generator=seeded(2)))
    assert next(iter(step._cache.values())).traced.input_checks == ()


def test_value_batched_along_another_dimension_is_checked_rows_first() -> None:
    """The recorded value is the physical tensor under ``vmap``; when its batch dimension is not
    the first (here ``in_dims=1``) the check still sees one row per example."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from opake_compile.compiler import _input_checks

    def f(w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def inner(w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            assert require(y, lambda rows, first: repr(rows.tolist()), "y")
            return (w * y.float()).sum()

        return torch.func.vmap(torch.func.grad(inner), in_dims=(None, 1))(w, y)

    y = torch.arange(12).reshape(3, 4)
    with _input_checks.recording() as rec:
        gm = make_fx(f, tracing_mode="fake")(torch.randn(3), y)
    (check,) = rec.build(gm, [n for n in gm.graph.nodes if n.op == "placeholder"][1:])
    assert check.run([y], 2, 0) == repr(y.t()[:2].tolist())
