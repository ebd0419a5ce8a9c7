"""Hypothesis properties of ``compile_dp``: the compiled step equals the eager reference, and
the clipped sum has sensitivity C.

Random small models (MLP with/without LayerNorm, Conv2d + max/avg pooling + GroupNorm, Conv1d +
pooling + LayerNorm, token/position embeddings + Linear over tokens + LayerNorm + mean pooling),
random frozen/trainable partitions, batch sizes from 0 to above the physical batch size
(chunking), small and large clipping norms, float32 and float64, and the two cheap backends
(``None``: the rewritten ATen graph run as is; ``"aot_eager"``). The reference is the eager
``clipped_grad`` (``vmap(grad)``) of the same per-example loss through ``functional_call``.
Every example retraces, so ``max_examples`` is small.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from _models import CASE_FACTORIES, assert_trees_close, freeze_random, reference_clipped, tree_distance
from opake_compile import compile_dp

# No shrink phase: every example retraces (seconds each), so shrinking a failure would take
# many minutes; the falsifying Config is printed as drawn and is small by construction.
SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


@dataclasses.dataclass(frozen=True)
class Config:
    kind: str
    dtype: torch.dtype
    seed: int
    physical: int
    n: int
    clipping_norm: float
    freeze: bool
    backend: str | None
    variant: bool  # mlp: LayerNorm; conv2d: max pooling
    materialize: bool = False  # rewrites=[]: keep every per-example gradient materialised


@st.composite
def configs(draw, min_n: int = 0) -> Config:
    physical = draw(st.integers(1, 5))
    n = draw(
        st.one_of(
            st.sampled_from([v for v in (0, 1, physical, physical + 1) if v >= min_n]),
            st.integers(max(min_n, 0), 3 * physical + 1),
        )
    )
    c = draw(
        st.one_of(
            st.floats(1e-3, 0.05),  # clips every example
            st.floats(0.05, 5.0),  # clips some
            st.floats(50.0, 1e4),  # clips none
        )
    )
    return Config(
        kind=draw(st.sampled_from(sorted(CASE_FACTORIES))),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        seed=draw(st.integers(0, 2**16)),
        physical=physical,
        n=n,
        clipping_norm=c,
        freeze=draw(st.booleans()),
        backend=draw(st.sampled_from([None, "aot_eager"])),
        variant=draw(st.booleans()),
        materialize=draw(st.booleans()),
    )


def _build(cfg: Config):
    kw = {}
    if cfg.kind == "mlp":
        kw["layernorm"] = cfg.variant
    elif cfg.kind == "conv2d":
        kw["pool"] = "max" if cfg.variant else "avg"
    case = CASE_FACTORIES[cfg.kind](seed=cfg.seed, dtype=cfg.dtype, **kw)
    if cfg.freeze:
        freeze_random(case.model, cfg.seed)
    step = compile_dp(
        case.loss_fn,
        model=case.model,
        clipping_norm=cfg.clipping_norm,
        physical_batch_size=cfg.physical,
        backend=cfg.backend,
        rewrites=[] if cfg.materialize else None,
    )
    return case, step


def _norm_tol(dtype: torch.dtype) -> dict:
    eps = torch.finfo(dtype).eps
    return dict(rtol=200 * eps, atol=200 * eps)


@settings(max_examples=15, **SETTINGS)
@given(cfg=configs())
@example(cfg=Config("mlp", torch.float32, 0, 3, 0, 1.0, False, "aot_eager", True))  # empty batch
@example(cfg=Config("embedding", torch.float64, 1, 1, 1, 0.01, True, None, False))  # P = n = 1
@example(cfg=Config("conv2d", torch.float32, 2, 2, 7, 0.3, True, "aot_eager", True, True))  # n > P: chunks
def test_compiled_equals_eager_reference(cfg: Config):
    case, step = _build(cfg)
    args = case.make_batch(cfg.n, cfg.seed + 1)
    out = step(*args)
    ref = reference_clipped(case.model, case.loss_fn, args, cfg.clipping_norm)
    trainable = {k for k, p in case.model.named_parameters() if p.requires_grad}
    assert set(out.clipped.grads) == trainable
    assert out.clipped.num_examples == ref.num_examples == cfg.n
    assert out.clipped.num_nonfinite == 0
    assert out.clipped.per_example_norms.shape == (cfg.n,)
    torch.testing.assert_close(
        out.clipped.per_example_norms.double(), ref.per_example_norms.double(), **_norm_tol(cfg.dtype)
    )
    assert_trees_close(out.clipped.grads, ref.grads, cfg.dtype)
    for k, g in out.clipped.grads.items():  # released sums are float64, one chunk or several
        assert g.dtype == torch.float64 and g.shape == case.model.get_parameter(k).shape
    assert step.num_traces == (1 if cfg.n else 0)
    if cfg.n:
        assert set(out.coverage) == trainable
        if cfg.materialize:
            assert set(out.coverage.values()) == {"materialized"}


@settings(max_examples=10, **SETTINGS)
@given(cfg=configs(min_n=1), which=st.integers(0, 2**16))
@example(cfg=Config("conv1d", torch.float32, 3, 2, 5, 0.02, False, None, False), which=4)
def test_removing_one_example_moves_the_sum_by_at_most_c(cfg: Config, which: int):
    case, step = _build(cfg)
    args = case.make_batch(cfg.n, cfg.seed + 2)
    i = which % cfg.n
    keep = torch.tensor([j for j in range(cfg.n) if j != i], dtype=torch.long)
    full = step(*args).clipped
    reduced = step(*(a[keep] for a in args)).clipped
    assert step.num_traces == 1  # the smaller batch reuses the padded graph
    assert reduced.num_examples == cfg.n - 1
    c = cfg.clipping_norm
    eps = torch.finfo(cfg.dtype).eps
    change = tree_distance(full.grads, reduced.grads)
    assert change <= c * (1 + 1000 * eps) + 1000 * eps, (change, c)
    # The change is exactly example i's clipped gradient: its norm is min(C, ||g_i||).
    expected = min(c, float(full.per_example_norms[i]))
    assert math.isclose(change, expected, rel_tol=1e-3, abs_tol=100 * eps * max(1.0, c)), (change, expected)
