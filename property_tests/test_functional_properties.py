"""Hypothesis properties of opake_compile.functional."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

from opake_compile import functional as F

DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool]

shapes = st.lists(st.integers(min_value=1, max_value=4), min_size=0, max_size=4)


def _tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    min_ndim=st.integers(min_value=1, max_value=3),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(min_value=0, max_value=2**31 - 1),
    as_kwarg=st.booleans(),
)
def test_min_ndim_mode_is_noop_on_batched_input(data, min_ndim, dtype, seed, as_kwarg):
    """Input that already has >= min_ndim dims reaches fn unchanged and the output is untouched
    (even with a leading dimension of size 1)."""
    shape = data.draw(st.lists(st.integers(min_value=1, max_value=4), min_size=min_ndim, max_size=min_ndim + 2))
    x = _tensor(shape, dtype, seed)
    y = _tensor([2], torch.float32, seed + 1)  # not a batch argument: never touched
    received = []

    def fn(a, b=None):
        received.append((a, b))
        return a, {"b": b}, a.shape

    wrapped = F.with_batch_dim(
        fn,
        batch_argnums=() if as_kwarg else 0,
        batch_kwargs=("a",) if as_kwarg else (),
        min_ndim=min_ndim,
    )
    out = wrapped(a=x, b=y) if as_kwarg else wrapped(x, b=y)
    ((a_in, b_in),) = received
    assert a_in is x and b_in is y
    assert out[0] is x and out[1]["b"] is y and out[2] == x.shape


@settings(max_examples=60, deadline=None)
@given(base=shapes, min_ndim=st.integers(min_value=1, max_value=4), seed=st.integers(0, 2**31 - 1))
def test_min_ndim_mode_round_trips_unbatched_input(base, min_ndim, seed):
    """fn(x) for an identity-shaped fn: unsqueezed when short, squeezed back to x's shape."""
    x = _tensor(base, torch.float32, seed)
    wrapped = F.with_batch_dim(lambda a: a * 2, batch_argnums=0, min_ndim=min_ndim)
    out = wrapped(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out, x * 2)


@settings(max_examples=40, deadline=None)
@given(base=shapes, depth=st.integers(min_value=1, max_value=3), seed=st.integers(0, 2**31 - 1))
def test_always_mode_adds_exactly_one_dim_and_rewrapping_is_noop(base, depth, seed):
    x = _tensor(base, torch.float32, seed)
    shapes_seen = []

    def fn(a):
        shapes_seen.append(tuple(a.shape))
        return a

    wrapped = fn
    for _ in range(depth):
        wrapped = F.with_batch_dim(wrapped, batch_argnums=0)
    out = wrapped({"t": x, "n": 3}["t"])
    assert shapes_seen == [(1, *base)]
    assert out.shape == (1, *base)


@settings(max_examples=40, deadline=None)
@given(
    trailing=st.lists(st.integers(min_value=0, max_value=3), min_size=0, max_size=3),
    batch=st.integers(min_value=1, max_value=4),
    dtype=st.sampled_from(DTYPES),
)
def test_empty_collate_keeps_trailing_shape_and_dtype(trailing, batch, dtype):
    collate = F.empty_collate(default_collate)
    examples = [(torch.zeros(trailing, dtype=dtype), {"y": torch.zeros((), dtype=dtype)}) for _ in range(batch)]
    x, d = collate(examples)
    ex, ed = collate([])
    assert ex.shape == (0, *trailing) and ex.dtype == dtype
    assert ed["y"].shape == (0,) and ed["y"].dtype == dtype
