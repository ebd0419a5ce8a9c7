"""Hypothesis properties of opake_compile.dpsgd.clipping: the clip bound, the no-op inside the
bound, shape/dtype preservation, and the DP sensitivity of the clipped sum."""

from __future__ import annotations

import math


import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from opake_compile import pytree
from opake_compile.dpsgd.clipping import clip_pytree, clipped_grad

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _leaf(shape, dtype, seed, scale):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


leaves = st.builds(
    _leaf,
    shape=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([1e-2, 1.0, 30.0]),
)
trees = st.recursive(
    leaves,
    lambda c: st.one_of(
        st.dictionaries(st.sampled_from("abcd"), c, min_size=1, max_size=3), st.lists(c, min_size=1, max_size=3)
    ),
    max_leaves=6,
)
clip_norms = st.floats(min_value=1e-3, max_value=1e3)


def _eps(tree) -> float:
    return max(torch.finfo(leaf.dtype).eps for leaf in pytree.tree_leaves(tree))


@settings(max_examples=50, deadline=None)
@given(tree=trees, c=clip_norms, as_tensor=st.booleans())
@example(tree=_leaf([3, 4, 4], torch.float16, 136, 30.0), c=1e-3, as_tensor=False)  # subnormal float16 entries
def test_clip_pytree_bound_shapes_and_dtypes(tree, c, as_tensor):
    if as_tensor:  # a float32 0-d tensor: C is what the tensor holds
        c_arg = torch.tensor(c)
        c = float(c_arg)
    else:
        c_arg = c
    clipped, norm = clip_pytree(tree, c_arg)
    assert pytree.tree_structure(clipped) == pytree.tree_structure(tree)
    for got, orig in zip(pytree.tree_leaves(clipped), pytree.tree_leaves(tree)):
        assert got.shape == orig.shape and got.dtype == orig.dtype
    torch.testing.assert_close(norm, pytree.global_norm(tree), rtol=0, atol=0)
    after = float(pytree.global_norm(clipped))
    # Up to the leaves' rounding: relative eps for normal results, and an absolute half-spacing
    # of the subnormal range per entry (a float16 tree scaled to C = 1e-3 has entries below
    # 6.1e-5, which round on a grid of 6e-8: 0.45 % of C over 48 entries, found by Hypothesis).
    tiny = math.sqrt(sum(l.numel() for l in pytree.tree_leaves(tree))) * max(
        torch.finfo(l.dtype).smallest_normal * torch.finfo(l.dtype).eps for l in pytree.tree_leaves(tree)
    )
    assert after <= c * (1 + 4 * _eps(tree)) + tiny  # ||clip(g)|| <= C
    if float(norm) > c:
        assert after >= c * (1 - 4 * _eps(tree)) - tiny  # clipped onto the sphere, not below it


@settings(max_examples=50, deadline=None)
@given(tree=trees, slack=st.floats(min_value=1.0, max_value=100.0))
def test_trees_within_the_bound_are_unchanged(tree, slack):
    c = float(pytree.global_norm(tree)) * slack + 1e-12
    clipped, _ = clip_pytree(tree, c)
    for got, orig in zip(pytree.tree_leaves(clipped), pytree.tree_leaves(tree)):
        assert torch.equal(got, orig)


def _mlp_loss(p, x, y):
    h = torch.tanh(x @ p["w1"] + p["b1"])
    return 0.5 * ((h @ p["w2"]).squeeze(-1) - y).square().mean()


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 6),
    c=st.floats(min_value=1e-2, max_value=1e2),
    seed=st.integers(0, 2**31 - 1),
    x_scale=st.sampled_from([0.1, 1.0, 10.0]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_removing_one_example_moves_the_sum_by_at_most_c(batch, c, seed, x_scale, dtype):
    g = torch.Generator().manual_seed(seed)
    p = {
        "w1": torch.randn(3, 4, generator=g, dtype=dtype),
        "b1": torch.randn(4, generator=g, dtype=dtype),
        "w2": torch.randn(4, 1, generator=g, dtype=dtype),
    }
    x = torch.randn(batch, 3, generator=g, dtype=dtype) * x_scale
    y = torch.randn(batch, generator=g, dtype=dtype) * x_scale
    grad_fn, state = clipped_grad(_mlp_loss, batch_argnums=(1, 2), clipping_norm=c)
    full, _ = grad_fn(p, x, y, state=state)
    eps = torch.finfo(dtype).eps
    tol = c * (1 + 16 * eps) + 16 * eps * batch * c  # summation rounding of the B clipped terms
    for i in range(batch):
        keep = torch.arange(batch) != i
        rest, _ = grad_fn(p, x[keep], y[keep], state=state)
        diff = {k: full.grads[k] - rest.grads[k] for k in p}
        assert float(pytree.global_norm(diff)) <= tol
    # The empty neighbour of a batch of one: the difference is the single clipped gradient.
    assert float(pytree.global_norm(full.grads)) <= batch * c * (1 + 16 * eps)
