"""Round-trip property of ``opake_compile.serialization``: any tree of plain values and tensors
comes back bit for bit (values, Python types, dtypes, shapes), through ``torch.save`` /
``torch.load(weights_only=True)`` and through the checkpoint file, restored into a template of
the same structure holding other values."""

from __future__ import annotations

import io
import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake_compile import serialization as S
from opake_compile.checkpoint import Checkpointer
from opake_compile.exceptions import InputTypeError

_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.bool]


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    tensors(),
)
keys = st.one_of(st.text(alphabet="abcxyz_", min_size=1, max_size=4), st.integers(0, 50))
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
    ),
    max_leaves=12,
)


def _other_values(x):
    """Same structure and kinds, different values: the template."""
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    if isinstance(x, bool):
        return not x
    if isinstance(x, int):
        return x + 1
    if isinstance(x, float):
        return 0.5
    if isinstance(x, str):
        return x + "!"
    if isinstance(x, dict):
        return {k: _other_values(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_other_values(v) for v in x)
    return x


def _identical(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b


def _valid(tree) -> bool:
    try:
        S.state_dict({"t": tree})
        return True
    except InputTypeError:  # dotted-key collisions (e.g. {"a": {"b": 1}, "a.b": 2}) are refused
        return False


@settings(max_examples=60, deadline=None)
@given(tree=trees)
def test_round_trip_through_torch_save(tree):
    if not _valid(tree):
        return
    flat, meta = S.state_dict({"t": tree})
    buf = io.BytesIO()
    torch.save({"tensors": flat, "metadata": meta}, buf)
    buf.seek(0)
    blob = torch.load(buf, weights_only=True)
    out = S.from_state_dict({"t": _other_values(tree)}, blob["tensors"], blob["metadata"])
    assert _identical(out["t"], tree)


@settings(max_examples=25, deadline=None)
@given(tree=trees)
def test_round_trip_through_a_checkpoint_file(tree, tmp_path_factory):
    if not _valid(tree):
        return
    ckpt = Checkpointer(tmp_path_factory.mktemp("ck"))
    ckpt.save(0, t=tree)
    _, out = ckpt.restore_state(t=_other_values(tree))
    assert _identical(out["t"], tree)
