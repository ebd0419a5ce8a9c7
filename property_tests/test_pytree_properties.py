"""Hypothesis properties of opake_compile.pytree: partition/merge round trip, global_norm."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from opake_compile import pytree

SETTINGS = settings(max_examples=50, deadline=None)

LEAF_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]


def _leaf(shape, dtype, seed, scale):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)
    base = torch.randn(shape, generator=g, dtype=torch.complex128 if dtype.is_complex else torch.float64)
    return (base * scale).to(dtype)


leaves = st.builds(
    _leaf,
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=3),
    dtype=st.sampled_from(LEAF_DTYPES),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([1e-3, 1.0, 10.0, 100.0]),
)
keys = st.text(alphabet="abcxyz_.0", min_size=1, max_size=3)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.dictionaries(keys, children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3),
        st.lists(children, min_size=1, max_size=3).map(tuple),
    ),
    max_leaves=8,
)


def _assert_same_tree(a, b):
    """Same structure (container types, keys, positions) and the very same leaf objects."""
    if isinstance(a, torch.Tensor):
        assert b is a
    elif isinstance(a, dict):
        assert type(b) is type(a) and set(b) == set(a)
        for k in a:
            _assert_same_tree(a[k], b[k])
    else:
        assert type(b) is type(a) and len(b) == len(a)
        for x, y in zip(a, b):
            _assert_same_tree(x, y)


@SETTINGS
@given(tree=trees, data=st.data())
def test_merge_of_partition_is_identity(tree, data):
    paths, leaf_list, _ = pytree.tree_flatten_with_paths(tree)
    chosen = set(data.draw(st.lists(st.sampled_from(paths), max_size=len(paths))) if paths else [])
    seen = []

    def pred(path, leaf):
        seen.append(path)
        assert isinstance(path, tuple)
        return path in chosen

    yes, no = pytree.partition(pred, tree)
    assert sorted(map(repr, seen)) == sorted(map(repr, paths))  # predicate gets every leaf's path
    yes_leaves = pytree.tree_leaves(yes)
    no_leaves = pytree.tree_leaves(no)
    assert len(yes_leaves) + len(no_leaves) == len(leaf_list)
    yes_paths, _, _ = pytree.tree_flatten_with_paths(yes)
    no_paths, _, _ = pytree.tree_flatten_with_paths(no)
    # Each half keeps the input's paths (positions keep None placeholders).
    assert set(yes_paths) == chosen and set(no_paths) == set(paths) - chosen
    _assert_same_tree(tree, pytree.merge(yes, no))
    _assert_same_tree(tree, pytree.merge(no, yes))  # disjoint halves: order does not matter
    if isinstance(tree, dict):
        assert isinstance(yes, dict) and isinstance(no, dict)


def _numpy_norm(tree) -> float:
    total = 0.0
    for leaf in pytree.tree_leaves(tree):
        a = leaf.to(torch.complex128 if leaf.dtype.is_complex else torch.float64).numpy()
        total += float(np.sum(np.abs(a) ** 2))
    return float(np.sqrt(total))


@SETTINGS
@given(tree=trees)
def test_global_norm_matches_float64_numpy(tree):
    got = pytree.global_norm(tree)
    dtypes = [leaf.dtype for leaf in pytree.tree_leaves(tree)]
    wide = any(d in (torch.float64, torch.complex128) for d in dtypes)
    assert got.dim() == 0 and got.dtype == (torch.float64 if wide else torch.float32)
    want = _numpy_norm(tree)
    eps = torch.finfo(got.dtype).eps
    n = max(1, sum(leaf.numel() for leaf in pytree.tree_leaves(tree)))
    assert abs(float(got) - want) <= (4 + n) * eps * want + 1e-30


@SETTINGS
@given(tree=trees, compute_dtype=st.sampled_from([torch.float32, torch.float64]))
def test_global_norm_explicit_compute_dtype_matches_numpy(tree, compute_dtype):
    got = pytree.global_norm(tree, compute_dtype=compute_dtype)
    assert got.dtype == compute_dtype
    n = max(1, sum(leaf.numel() for leaf in pytree.tree_leaves(tree)))
    want = _numpy_norm(tree)
    # Leaves wider than compute_dtype are rounded to it first: allow that rounding too.
    assert abs(float(got) - want) <= (4 + n) * torch.finfo(compute_dtype).eps * want + 1e-30
