"""Tests for opake_compile.dpsgd.clipping against the spec's reference values and a per-example
loop oracle (batch of one, plain ``torch.autograd.grad``, clip, sum)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from opake_compile import pytree
from opake_compile import random as oprandom
from opake_compile._validate import NotPrivateWarning
from opake_compile.dpsgd import ClippedPytree, NoisedPytree
from opake_compile.dpsgd.noise import gaussian_noise
from opake_compile.dpsgd.clipping import (
    AdaptiveClipState,
    ClipState,
    adaptive_clipped_grad,
    auto_clipped_grad,
    clip_and_sum,
    clip_pytree,
    clipped_fun,
    clipped_grad,
    per_example_global_norms,
)
from opake_compile.exceptions import ConfigurationError, InputTypeError
from opake_compile.compiler.passes.numerics import clip_scale, effective_clipping_norm, rho
from opake_compile.functional import make_functional


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


#: The numerical contract clips float32 sums to C / (1 + RHO32) (compiler/passes/numerics.py).
RHO32 = rho(torch.float32)
S32 = clip_scale(torch.float32)


def _sq_loss(p, x, y):
    """loss_n = 1/2 (x_n . w + b - y_n)^2, mean over the batch."""
    return 0.5 * ((x @ p["w"] + p["b"] - y) ** 2).mean()


def _t(v, dtype=torch.float32):
    return torch.tensor(v, dtype=dtype)


# ------------------------------------------------------------------ SPEC section 3 reference values

_PER_EXAMPLE_CASES = [
    # w, b, x, y, C, expected mean grad w, expected b, expected norms, decimals of w/b, of norms
    ([1.0, -1.0], 0.0, [[1, 0], [2, 2], [0, 3]], [0, 1, 1], 1.0,
     [0.01348, -0.53845], 0.019182, [1.414214, 3.0, 12.649111], (5, 6), 6),
    ([0.5], 0.5, [[1], [-1], [2], [0]], [1.5, 0.5, 1, 0], 10.0,
     [0.25], 0.0, [0.707107, 0.707107, 1.118034, 0.5], (2, 1), 6),
    ([2.0, 1.0], -1.0, [[1, 1], [0.5, -1]], [2, -4], 2.0,
     [0.333333, -0.666667], 0.666667, [0.0, 4.5], (6, 6), 6),
]


@pytest.mark.parametrize("case", _PER_EXAMPLE_CASES, ids=["case1", "case2", "case3"])
def test_spec_per_example_reference_values(case):
    w, b, x, y, c, exp_w, exp_b, exp_norms, (dw, db), dn = case
    params = {"w": _t(w), "b": _t(b)}
    n = len(y)
    grad_fn, state = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=c, normalize_by=n)
    clipped, new_state = grad_fn(params, _t(x), _t(y), state=state)
    assert isinstance(clipped, ClippedPytree)
    assert new_state == state == ClipState(c)
    assert clipped.grads["w"].dtype == torch.float32 and clipped.grads["w"].shape == (len(w),)
    assert clipped.grads["b"].dtype == torch.float32 and clipped.grads["b"].shape == ()
    # Exact to the printed rounding (within half a unit of the last printed digit), plus the
    # slack rho C of the numerical contract: the spec's values clip to C exactly, the library to
    # C / (1 + rho) (compiler/passes/numerics.py).
    slack = RHO32 * c
    for got, want, d in ((clipped.grads["w"], exp_w, dw), (clipped.grads["b"], exp_b, db)):
        assert torch.all((got - _t(want)).abs() <= 0.5 * 10.0**-d + 1e-7 + slack), (got, want)
    assert clipped.per_example_norms.shape == (n,)
    assert torch.all((clipped.per_example_norms - _t(exp_norms)).abs() <= 0.5 * 10.0**-dn + 1e-6)
    assert clipped.num_examples == clipped.batch_size == n
    assert clipped.normalize_by == float(n) and clipped.num_nonfinite == 0
    assert clipped.clipping_norm == c
    assert clipped.parameters is params


_GLOBAL_CASES = [
    ({"w": [3.0, 0.0], "b": 4.0}, 1.0, {"w": [0.6, 0.0], "b": 0.8}, 5.0, 6),
    (
        {"dense": {"w": [[0.1, -0.2], [0.2, 0.0]], "b": [0.4, 0.0]}, "head": [-0.4]},
        2.0,
        None,  # unchanged
        0.640312,
        6,
    ),
    ({"layers": [{"w": [0.6, 0.6]}] * 3}, 1.0, {"layers": [{"w": [0.408248] * 2}] * 3}, 1.469694, 6),
]


def _to_tensors(tree):
    if isinstance(tree, dict):
        return {k: _to_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list) and tree and isinstance(tree[0], dict):
        return [_to_tensors(v) for v in tree]
    return _t(tree)


@pytest.mark.parametrize("case", _GLOBAL_CASES, ids=["w_b", "unchanged", "layers"])
def test_spec_global_norm_reference_values(case):
    raw, c, expected, norm, decimals = case
    tree = _to_tensors(raw)
    clipped, got_norm = clip_pytree(tree, c)
    assert got_norm.dtype == torch.float32 and got_norm.dim() == 0
    assert abs(float(got_norm) - norm) <= 0.5 * 10.0**-decimals
    want = tree if expected is None else _to_tensors(expected)
    got_leaves, got_def = pytree.tree_flatten(clipped)
    want_leaves, want_def = pytree.tree_flatten(want)
    assert got_def == want_def
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == torch.float32 and g.shape == w.shape
        if expected is None:
            assert torch.equal(g, w)  # trees within C come back unchanged
        else:
            assert torch.all((g - w).abs() <= 0.5 * 10.0**-decimals), (g, w)


# ----------------------------------------------------------------------- per-example loop oracle


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)
        self.head = nn.Linear(3 * 3 * 3, 3)

    def forward(self, x):
        h = F.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.head(h.flatten(1))


class _Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens):
        h = self.norm(torch.tanh(self.mix(self.emb(tokens))))
        return self.head(h.mean(dim=1))


def _model_and_data(kind: str, dtype: torch.dtype, batch: int = 5):
    g = _gen(7)
    if kind == "mlp":
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        frozen = ["0.weight"]
        x = torch.randn(batch, 4, generator=g).to(dtype)
    elif kind == "cnn":
        model = _CNN()
        frozen = ["conv.bias"]
        x = torch.randn(batch, 1, 8, 8, generator=g).to(dtype)
    else:
        model = _Seq()
        frozen = ["emb.weight"]
        x = torch.randint(0, 11, (batch, 7), generator=g)
    model = model.to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            std = 1.5 / math.sqrt(p[0].numel()) if p.dim() > 1 else 0.5
            p.copy_(torch.randn(p.shape, generator=g) * std)  # same draws for every dtype
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    y = torch.randint(0, 3, (batch,), generator=g)
    return model, frozen, x, y


def _oracle(fmodel, trainable, x, y, c):
    """Loop over examples at batch size one with plain autograd; clip; sum (float64 norms)."""
    names = list(trainable)
    total = {n: torch.zeros_like(trainable[n]) for n in names}
    norms = []
    for i in range(x.shape[0]):
        params = {n: trainable[n].detach().clone().requires_grad_(True) for n in names}
        loss = F.cross_entropy(fmodel(params, x[i : i + 1]), y[i : i + 1])
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
        norms.append(norm)
        factor = min(1.0, effective_clipping_norm(c, grads[0].dtype) / norm)
        for n, gr in zip(names, grads):
            total[n] += factor * gr
    return total, torch.tensor(norms, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["mlp", "cnn", "seq"])
def test_clipped_grad_matches_per_example_loop(kind, dtype):
    model, frozen, x, y = _model_and_data(kind, dtype)
    fmodel, trainable, frozen_params = make_functional(model, partition_trainable=True)
    assert sorted(frozen_params) == frozen and not set(frozen) & set(trainable)

    def loss(p, xb, yb):
        return F.cross_entropy(fmodel(p, xb), yb)

    _, ref_norms = _oracle(fmodel, trainable, x, y, math.inf)
    eps = torch.finfo(dtype).eps
    assert float(ref_norms.min()) > 1e-3  # non-degenerate gradients
    # Several C: small (every example clipped), the median (some clipped), large (none clipped).
    small, large = 0.5 * float(ref_norms.min()), 2.0 * float(ref_norms.max())
    for c in (small, float(ref_norms.median()), large):
        want, want_norms = _oracle(fmodel, trainable, x, y, c)
        grad_fn, state = clipped_grad(loss, batch_argnums=(1, 2), clipping_norm=c)
        got, _ = grad_fn(trainable, x, y, state=state)
        assert list(got.grads) == list(trainable)  # only the trainable partition
        assert got.num_examples == x.shape[0] and got.num_nonfinite == 0
        torch.testing.assert_close(
            got.per_example_norms.double(), want_norms, rtol=64 * eps, atol=64 * eps
        )
        scale = max(1.0, max(float(v.abs().max()) for v in want.values()))
        for n in trainable:
            assert got.grads[n].dtype == dtype and got.grads[n].shape == trainable[n].shape
            torch.testing.assert_close(got.grads[n], want[n], rtol=64 * eps, atol=64 * eps * scale)
        # Sanity: the clipped sum has global norm at most B * C.
        assert float(pytree.global_norm(got.grads).detach()) <= x.shape[0] * c * (1 + 64 * eps)


def test_clipping_is_joint_over_all_leaves_not_per_leaf():
    # Per-leaf clipping would give each of w, b norm <= C separately; the spec clips jointly.
    params = {"w": _t([3.0]), "b": _t(0.0)}
    grad_fn, state = clipped_grad(lambda p, x: 3.0 * (p["w"] * x).sum() + 4.0 * p["b"] * x.sum(), batch_argnums=1, clipping_norm=1.0)
    got, _ = grad_fn(params, _t([[1.0]]), state=state)
    torch.testing.assert_close(got.grads["w"], _t([0.6 * S32]))
    torch.testing.assert_close(got.grads["b"], _t(0.8 * S32))


# ----------------------------------------------------------------------------------- edge cases


def _case1():
    return {"w": _t([1.0, -1.0]), "b": _t(0.0)}, _t([[1.0, 0], [2, 2], [0, 3]]), _t([0.0, 1, 1])


def test_inf_clipping_norm_warns_and_equals_unclipped_sum():
    params, x, y = _case1()
    with pytest.warns(NotPrivateWarning):
        grad_fn, state = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=math.inf)
    got, _ = grad_fn(params, x, y, state=state)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    total = 0.5 * ((x @ leaves["w"] + leaves["b"] - y) ** 2).sum()
    gw, gb = torch.autograd.grad(total, [leaves["w"], leaves["b"]])
    torch.testing.assert_close(got.grads["w"], gw)
    torch.testing.assert_close(got.grads["b"], gb)
    assert got.clipping_norm == math.inf


@pytest.mark.parametrize("c", [0, 0.0, -1.0, math.nan, torch.tensor(-2.0), torch.tensor(math.nan)])
def test_bad_clipping_norm_is_configuration_error(c):
    for make in (
        lambda: clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=c),
        lambda: clipped_fun(lambda x: x, clipping_norm=c),
        lambda: auto_clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=c),
        lambda: clip_pytree({"a": torch.ones(2)}, c),
    ):
        with pytest.raises(ConfigurationError):
            make()


@pytest.mark.parametrize("c", ["1.0", None, True, [1.0], torch.ones(2), 1j])
def test_non_numeric_clipping_norm_is_input_type_error(c):
    with pytest.raises(InputTypeError):
        clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=c)
    with pytest.raises(InputTypeError):
        clip_pytree({"a": torch.ones(2)}, c)


def test_tensor_and_int_clipping_norm_accepted():
    params, x, y = _case1()
    a, _ = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=torch.tensor(1.0))[0](params, x, y)
    b, _ = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=1)[0](params, x, y)
    assert a.clipping_norm == b.clipping_norm == 1.0 and isinstance(a.clipping_norm, float)
    torch.testing.assert_close(a.grads, b.grads)


def test_mismatched_batch_sizes_are_configuration_error():
    params, x, y = _case1()
    grad_fn, state = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=1.0)
    with pytest.raises(ConfigurationError, match="batch size"):
        grad_fn(params, x, y[:2], state=state)
    with pytest.raises(ConfigurationError):  # a 0-d "batched" tensor has no batch dimension
        grad_fn(params, x, _t(1.0), state=state)
    fn, st = clipped_fun(lambda a, b: a * b, batch_argnums=(0, 1), clipping_norm=1.0)
    with pytest.raises(ConfigurationError):
        fn(torch.ones(3, 2), torch.ones(4, 2), state=st)


def test_argument_configuration_errors():
    params, x, y = _case1()
    with pytest.raises(ConfigurationError):  # differentiated and batched
        clipped_grad(_sq_loss, 1, batch_argnums=(1, 2), clipping_norm=1.0)[0](params, x, y)
    with pytest.raises(ConfigurationError):  # batch argument out of range
        clipped_grad(_sq_loss, batch_argnums=(1, 5), clipping_norm=1.0)[0](params, x, y)
    with pytest.raises(InputTypeError):
        clipped_grad(_sq_loss, argnums=True, batch_argnums=(1, 2), clipping_norm=1.0)[0](params, x, y)


@pytest.mark.parametrize("normalize_by", [None, 1, 4.0])
def test_empty_batch_gives_zero_sum_with_param_shapes(normalize_by):
    params = {"w": _t([1.0, -1.0]), "b": _t(0.0), "m": torch.ones(3, 2, dtype=torch.float64)}
    grad_fn, state = clipped_grad(
        lambda p, x, y: _sq_loss(p, x, y) + p["m"].sum(), batch_argnums=(1, 2), clipping_norm=1.0,
        normalize_by=normalize_by,
    )
    got, _ = grad_fn(params, torch.zeros(0, 2), torch.zeros(0), state=state)
    assert got.num_examples == 0 and got.num_nonfinite == 0
    assert got.per_example_norms.shape == (0,)
    assert got.normalize_by == (None if normalize_by is None else float(normalize_by))
    for k, p in params.items():
        assert got.grads[k].shape == p.shape and got.grads[k].dtype == p.dtype
        assert torch.count_nonzero(got.grads[k]) == 0


@pytest.mark.parametrize("bad", ["nan", "inf", "overflow"])
def test_nonfinite_example_contributes_exactly_zero(bad):
    params, x, y = _case1()
    x = torch.cat([x, _t([[0.5, 0.5]])])
    y = torch.cat([y, _t([2.0])])
    bad_x = {"nan": [math.nan, 1.0], "inf": [math.inf, 1.0], "overflow": [0.0, 1e20]}[bad]
    x_bad = x.clone()
    x_bad[1] = _t(bad_x)  # example 1's gradient becomes NaN / inf / overflows float32 (1e40)
    if bad == "overflow":
        params = {"w": _t([1.0, 1.0]), "b": _t(0.0)}
    grad_fn, state = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=1.0)
    got, _ = grad_fn(params, x_bad, y, state=state)
    keep = torch.tensor([True, False, True, True])
    want, _ = grad_fn(params, x[keep], y[keep], state=state)
    assert got.num_nonfinite == 1 and got.num_examples == 4
    assert not torch.isfinite(got.per_example_norms[1])
    torch.testing.assert_close(got.per_example_norms[keep], want.per_example_norms)
    for k in params:
        assert bool(torch.isfinite(got.grads[k]).all())
        torch.testing.assert_close(got.grads[k], want.grads[k], rtol=0, atol=1e-6)


def test_all_nonfinite_examples_give_exact_zero_not_nan():
    # A multiplication by a zero factor would give 0 * NaN = NaN here; the spec requires a select.
    params = {"w": _t([1.0, -1.0]), "b": _t(0.0)}
    x = _t([[math.nan, 0.0], [math.inf, -math.inf]])
    grad_fn, state = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=1.0)
    got, _ = grad_fn(params, x, _t([0.0, 1.0]), state=state)
    assert got.num_nonfinite == 2
    for k in params:
        assert torch.equal(got.grads[k], torch.zeros_like(params[k]))


def test_clip_and_sum_mask_and_nonfinite_rows():
    g = {"a": _t([[3.0, 4.0], [math.nan, 0.0], [0.3, 0.4], [6.0, 8.0]])}
    summed, norms, kept = clip_and_sum(g, 1.0, mask=torch.tensor([True, True, True, False]))
    assert kept.tolist() == [True, False, True, False]
    torch.testing.assert_close(summed["a"], _t([0.6 * S32 + 0.3, 0.8 * S32 + 0.4]))
    torch.testing.assert_close(per_example_global_norms(g)[[0, 2, 3]], _t([5.0, 0.5, 10.0]))
    with pytest.raises(InputTypeError):
        per_example_global_norms({})


def test_per_example_norms_complex_and_float64_leaves():
    z = torch.tensor([[0.0011 - 0.0002j], [3.0 + 4.0j]], dtype=torch.complex64)
    tree = {"z": z, "d": torch.zeros(2, 1, dtype=torch.float64)}
    norms = per_example_global_norms(tree)
    want = torch.from_numpy(abs(z.numpy().astype("complex128")).reshape(2))
    assert norms.dtype == torch.float64
    torch.testing.assert_close(norms, want, rtol=4 * torch.finfo(torch.float64).eps, atol=0)


def test_zero_gradient_example_is_not_nan():
    grad_fn, state = clipped_grad(lambda p, x: (p * x).sum(), batch_argnums=1, clipping_norm=1.0)
    got, _ = grad_fn(torch.ones(2), torch.zeros(3, 2), state=state)
    assert torch.equal(got.grads, torch.zeros(2)) and got.num_nonfinite == 0


def test_dp_outputs_refused_by_clipping():
    params, x, y = _case1()
    grad_fn, state = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=1.0)
    clipped, _ = grad_fn(params, x, y, state=state)
    noised = NoisedPytree(grads=clipped.grads, clipping_norm=1.0, noise_multiplier=1.0, noise_std=1.0)
    for dp in (clipped, noised):
        with pytest.raises(InputTypeError):
            clip_pytree(dp, 1.0)
        with pytest.raises(InputTypeError):
            clip_pytree({"nested": dp}, 1.0)
        with pytest.raises(InputTypeError):
            grad_fn(dp, x, y, state=state)
        with pytest.raises(InputTypeError):
            per_example_global_norms({"g": dp})


@pytest.mark.parametrize("bad, err", [(0, ConfigurationError), (-2.0, ConfigurationError), (math.nan, ConfigurationError),
                                      (math.inf, ConfigurationError), ("3", InputTypeError), (True, InputTypeError),
                                      (torch.tensor(3.0), InputTypeError)])
def test_bad_normalize_by(bad, err):
    with pytest.raises(err):
        clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=1.0, normalize_by=bad)


def test_normalize_by_divides_and_is_recorded():
    params, x, y = _case1()
    summed, _ = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=1.0)[0](params, x, y)
    mean, _ = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=1.0, normalize_by=4)[0](params, x, y)
    assert summed.normalize_by is None and mean.normalize_by == 4.0
    for k in params:
        torch.testing.assert_close(mean.grads[k], summed.grads[k] / 4)


def test_has_aux_returns_per_example_aux():
    params, x, y = _case1()

    def loss(p, xb, yb):
        pred = xb @ p["w"] + p["b"]
        return 0.5 * ((pred - yb) ** 2).mean(), {"pred": pred}

    grad_fn, state = clipped_grad(loss, batch_argnums=(1, 2), clipping_norm=1.0, has_aux=True)
    got, _ = grad_fn(params, x, y, state=state)
    plain, _ = clipped_grad(_sq_loss, batch_argnums=(1, 2), clipping_norm=1.0)[0](params, x, y)
    torch.testing.assert_close(got.grads, plain.grads)
    assert got.aux["pred"].shape == (3, 1)  # each example ran as a batch of one
    torch.testing.assert_close(got.aux["pred"].reshape(3), x @ params["w"] + params["b"])


def test_argnums_tuple_clips_jointly_over_arguments():
    _, x, y = _case1()

    def loss(w, b, xb, yb):
        return 0.5 * ((xb @ w + b - yb) ** 2).mean()

    grad_fn, state = clipped_grad(loss, argnums=(0, 1), batch_argnums=(2, 3), clipping_norm=1.0, normalize_by=3)
    got, _ = grad_fn(_t([1.0, -1.0]), _t(0.0), x, y, state=state)
    gw, gb = got.grads  # a tuple, in argnums order
    assert torch.all((gw - _t([0.01348, -0.53845])).abs() <= 0.5e-5 + RHO32)
    assert abs(float(gb) - 0.019182) <= 0.5e-6 + RHO32
    assert got.parameters is None  # not a dict of parameters


def test_keep_batch_dim_false_and_broadcast_argument():
    w = _t([1.0, -1.0])
    grad_fn, state = clipped_grad(
        lambda w, x, scale: scale * (x @ w), batch_argnums=1, clipping_norm=100.0, keep_batch_dim=False
    )
    x = _t([[1.0, 2.0], [3.0, 4.0]])
    got, _ = grad_fn(w, x, _t(2.0), state=state)  # `scale` is broadcast, not batched
    torch.testing.assert_close(got.grads, 2 * x.sum(0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_leaves_keep_dtype_and_shape(dtype):
    tree = {"a": torch.full((3, 2), 2.0, dtype=dtype), "b": [torch.full((4,), -1.0, dtype=dtype)]}
    clipped, norm = clip_pytree(tree, 1.0)
    assert norm.dtype == torch.float32
    for got, orig in zip(pytree.tree_leaves(clipped), pytree.tree_leaves(tree)):
        assert got.dtype == dtype and got.shape == orig.shape
    assert float(pytree.global_norm(clipped)) == pytest.approx(1.0, rel=4 * torch.finfo(dtype).eps)
    params = {"w": torch.ones(3, dtype=dtype)}
    got, _ = clipped_grad(lambda p, x: (p["w"] * x).sum(), batch_argnums=1, clipping_norm=1.0)[0](
        params, torch.full((2, 3), 5.0, dtype=dtype)
    )
    # The released sum is float32 whatever the leaf dtype (a low-precision sum rounds on a grid
    # proportional to its own size: compiler/passes/numerics.py).
    assert got.grads["w"].dtype == torch.float32 and got.grads["w"].shape == (3,)
    torch.testing.assert_close(got.grads["w"].float(), torch.full((3,), 2 / math.sqrt(3)), rtol=1e-2, atol=1e-2)


def test_clip_pytree_within_bound_zero_tree_and_inf():
    tree = {"a": _t([0.3, -0.4]), "b": [_t([[0.0]])]}
    same, norm = clip_pytree(tree, 0.5)  # exactly at the bound
    assert float(norm) == pytest.approx(0.5) and torch.equal(same["a"], tree["a"])
    zero, norm = clip_pytree({"z": torch.zeros(3)}, 1.0)
    assert float(norm) == 0.0 and torch.equal(zero["z"], torch.zeros(3))
    with pytest.warns(NotPrivateWarning):
        big, _ = clip_pytree({"a": _t([1e30])}, math.inf)
    assert torch.equal(big["a"], _t([1e30]))


def test_clip_pytree_under_torch_compile_with_tensor_norm():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(clip_pytree, backend=counter, fullgraph=True)
    tree = {"w": _t([3.0, 0.0]), "b": _t(4.0), "h": torch.ones(2, dtype=torch.bfloat16)}
    for c in (1.0, 2.5, 100.0):  # clipped and unclipped take the same graph (no data branch)
        got, norm = compiled(tree, torch.tensor(c))
        want, want_norm = clip_pytree(tree, c)
        torch.testing.assert_close(norm, want_norm)
        for k in tree:
            assert got[k].dtype == tree[k].dtype
            torch.testing.assert_close(got[k], want[k])
    assert counter.frame_count == 1


# ------------------------------------------------------------------------------------ clipped_fun


def test_clipped_fun_clips_and_sums_outputs():
    fn, state = clipped_fun(lambda x: {"x": x, "sq": x.square().sum()}, clipping_norm=2.0)
    x = _t([[3.0, 0.0], [0.5, 0.5], [0.0, 0.0]])
    got, new_state = fn(x, state=state)
    assert new_state == state and got.num_examples == 3
    out0 = torch.cat([x[0], x[0].square().sum().reshape(1)])  # [3, 0, 9], norm sqrt(90)
    out1 = torch.cat([x[1], x[1].square().sum().reshape(1)])
    want = out0 * 2.0 * S32 / math.sqrt(90.0) + out1  # out1 norm is below 2
    torch.testing.assert_close(torch.cat([got.grads["x"].reshape(2), got.grads["sq"].reshape(1)]), want)
    with pytest.raises(ConfigurationError):
        fn(torch.zeros(0, 2), state=state)


# ----------------------------------------------------------------------- adaptive / automatic


def test_adaptive_clipping_tracks_target_quantile():
    # Gradient of (p * x).sum() is x itself: the per-example norms are fixed at 1, 2, ..., 20.
    norms = torch.arange(1.0, 21.0)
    x = torch.stack([norms, torch.zeros(20)], dim=1)
    p = torch.zeros(2)
    quantile = 0.75
    grad_fn, state = adaptive_clipped_grad(
        lambda p, xb: (p * xb).sum(), batch_argnums=1, initial_clipping_norm=0.5, key=oprandom.key(0),
        expected_batch_size=20, target_quantile=quantile, learning_rate=0.3, count_noise_multiplier=0.01,
    )
    assert isinstance(state, AdaptiveClipState) and state.clipping_norm == 0.5
    noise_fn, noise_state = gaussian_noise(1.0, oprandom.key(1))
    history = []
    for _ in range(60):
        old = state
        got, state = grad_fn(p, x, state=state)
        _, noise_state = noise_fn(got, noise_state)  # the release: the next C may be used
        assert got.clipping_norm == old.clipping_norm  # this call clipped with the old C
        assert state.key != old.key  # the count-noise key advances
        history.append(state.clipping_norm)
    assert history[0] > 0.5  # all norms were above C: the norm grew
    # It ends near the 0.75 quantile of {1..20} (15), oscillating within a few examples' worth.
    assert 13.0 <= sum(history[-10:]) / 10 <= 17.0
    below = float((norms <= state.clipping_norm).float().mean())
    assert abs(below - quantile) <= 0.15


def test_adaptive_clipping_validation():
    kw = dict(batch_argnums=1, key=oprandom.key(0), expected_batch_size=4)
    with pytest.raises(ConfigurationError):
        adaptive_clipped_grad(_sq_loss, initial_clipping_norm=1.0, target_quantile=1.5, count_noise_multiplier=1.0, **kw)
    with pytest.raises(ConfigurationError):
        adaptive_clipped_grad(_sq_loss, initial_clipping_norm=-1.0, count_noise_multiplier=1.0, **kw)
    with pytest.raises(ConfigurationError), warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        adaptive_clipped_grad(_sq_loss, initial_clipping_norm=math.inf, count_noise_multiplier=1.0, **kw)
    with pytest.warns(NotPrivateWarning):
        adaptive_clipped_grad(_sq_loss, initial_clipping_norm=1.0, count_noise_multiplier=0.0, **kw)
    # NaN / inf would silently turn the next clipping norm into NaN / 0 / inf.
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(ConfigurationError, match="count_noise_multiplier"):
            adaptive_clipped_grad(_sq_loss, initial_clipping_norm=1.0, count_noise_multiplier=bad, **kw)
    for bad in (math.nan, math.inf, 0.0, -0.2):
        with pytest.raises(ConfigurationError, match="learning_rate"):
            adaptive_clipped_grad(_sq_loss, initial_clipping_norm=1.0, count_noise_multiplier=1.0, learning_rate=bad, **kw)


def test_auto_clipping_bounds_each_example_below_r():
    r, gamma = 0.7, 0.01
    x = torch.randn(6, 3, generator=_gen(3)) * torch.tensor([[1e-4], [1e-2], [1.0], [10.0], [1e3], [0.0]])
    p = torch.zeros(3)
    grad_fn, state = auto_clipped_grad(lambda p, xb: (p * xb).sum(), batch_argnums=1, clipping_norm=r, stability_constant=gamma)
    total, _ = grad_fn(p, x, state=state)
    contributions = []
    for i in range(6):
        one, _ = grad_fn(p, x[i : i + 1], state=state)
        n = float(one.grads.norm())
        assert n < r
        # AUTO-S, R g / (||g|| + gamma), with R shrunk by the float32 sum's slack (clip_scale).
        want = r * clip_scale(torch.float32) * x[i] / (float(x[i].norm()) + gamma)
        torch.testing.assert_close(one.grads, want)
        contributions.append(one.grads)
    torch.testing.assert_close(total.grads, torch.stack(contributions).sum(0))
    # Sensitivity <= R: removing any one example moves the sum by < R.
    for i in range(6):
        rest, _ = grad_fn(p, torch.cat([x[:i], x[i + 1 :]]), state=state)
        assert float((total.grads - rest.grads).double().norm()) <= r
    with pytest.raises(ConfigurationError):
        auto_clipped_grad(_sq_loss, clipping_norm=1.0, stability_constant=0.0)
    with pytest.raises(ConfigurationError), warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        auto_clipped_grad(_sq_loss, clipping_norm=math.inf)


def test_auto_clipping_holds_r_in_float32_at_large_norms():
    """With R itself, float32 norms and no rounding down, one example of norm 1e3-1e8
    contributed up to 1 + 8.4e-8 R (review: 200 trials)."""
    grad_fn, _ = auto_clipped_grad(lambda p, xb: (p * xb).sum(), batch_argnums=1, clipping_norm=1.0, stability_constant=1e-6)
    g = _gen(11)
    worst = 0.0
    for _ in range(200):
        x = torch.randn(1, 64, generator=g) * 10 ** float(torch.empty(1).uniform_(3, 8, generator=g))
        got, _ = grad_fn(torch.zeros(64), x)
        worst = max(worst, float(got.grads.double().norm()))
    assert 0.99 < worst <= 1.0


def test_auto_clipping_nonfinite_example_is_zero():
    x = _t([[1.0, 0.0], [math.nan, 1.0]])
    grad_fn, state = auto_clipped_grad(lambda p, xb: (p * xb).sum(), batch_argnums=1, clipping_norm=1.0)
    got, _ = grad_fn(torch.zeros(2), x, state=state)
    assert got.num_nonfinite == 1
    torch.testing.assert_close(got.grads, _t([clip_scale(torch.float32) / 1.01, 0.0]))


def test_clipped_sum_is_detached_from_the_autograd_graph():
    """Gradients of trainable nn.Parameters come back as plain data (no grad_fn kept alive)."""
    lin = torch.nn.Linear(3, 2)
    params = dict(lin.named_parameters())

    def loss(p, x):
        return torch.func.functional_call(lin, p, (x,)).square().mean()

    grad_fn, state = clipped_grad(loss, batch_argnums=1, clipping_norm=1.0)
    clipped, _ = grad_fn(params, torch.randn(4, 3), state=state)
    for g in clipped.grads.values():
        assert g.grad_fn is None and not g.requires_grad


@pytest.mark.parametrize("c, error", [(float("nan"), ConfigurationError), (-1.0, ConfigurationError), ("1", InputTypeError)])
def test_a_clipping_state_passed_in_is_checked_like_clipping_norm(c, error):
    """``state=ClipState(C)`` used to be taken as it came: NaN sums (that DPOptimizer then wrote
    into every weight) from C = NaN, sign-flipped ones from C = -1."""
    params = {"w": _t([3.0])}
    loss = lambda p, x: (p["w"] * x).sum()
    grad_fn, _ = clipped_grad(loss, batch_argnums=1, clipping_norm=1.0)
    with pytest.raises(error, match="state.clipping_norm"):
        grad_fn(params, _t([[1.0]]), state=ClipState(c))
    adaptive, state = adaptive_clipped_grad(
        loss, batch_argnums=1, initial_clipping_norm=1.0, expected_batch_size=1.0, key=oprandom.key(0), count_noise_multiplier=1.0
    )
    with pytest.raises(error, match="state.clipping_norm"):
        adaptive(params, _t([[1.0]]), state=state._replace(clipping_norm=c))
    got, _ = grad_fn(params, _t([[1.0]]), state=ClipState(0.5))
    torch.testing.assert_close(got.grads["w"], _t([0.5 * S32]))


def _adaptive_setup():
    loss = lambda p, x: (p["w"] * x).sum()
    grad_fn, state = adaptive_clipped_grad(
        loss, batch_argnums=1, initial_clipping_norm=1.0, expected_batch_size=2.0, key=oprandom.key(3),
        count_noise_multiplier=1.0,
    )
    return grad_fn, state, {"w": _t([3.0])}, _t([[1.0], [4.0]])


def test_adaptive_state_of_an_unreleased_result_is_refused():
    """The next clipping norm is computed from a noisy count that is charged only when its result
    is released: a state whose result was never stepped on (a refused step) used to clip the
    next batch with it, so the run depended on a count no accountant saw."""
    grad_fn, state, params, x = _adaptive_setup()
    got, nxt = grad_fn(params, x, state=state)
    with pytest.raises(ConfigurationError, match="has not been released"):
        grad_fn(params, x, state=nxt)
    again, nxt2 = grad_fn(params, x, state=state)  # the state that call was given: allowed
    assert nxt2 == nxt and again.clipping_norm == got.clipping_norm
    noise_fn, ns = gaussian_noise(1.0, oprandom.key(4))
    noise_fn(again, ns)
    later, _ = grad_fn(params, x, state=nxt)
    assert later.clipping_norm == nxt.clipping_norm


def test_adaptive_state_is_released_by_the_optimizer_step_and_through_accumulate():
    from opake_compile.optim import DPOptimizer, accumulate
    from opake_compile.sampling import PoissonSampler

    grad_fn, state, params, x = _adaptive_setup()
    w = torch.nn.Parameter(_t([3.0]))
    sampler = PoissonSampler(2, 1.0, key=oprandom.key(6))
    opt = DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=sampler, key=oprandom.key(5))
    assert sorted(next(iter(sampler))) == [0, 1]  # q = 1: the draw is the whole data set
    a, nxt_a = grad_fn({"w": w}, x[:1], state=state)
    b, nxt = grad_fn({"w": w}, x[1:], state=state)
    with pytest.raises(ConfigurationError, match="has not been released"):
        grad_fn({"w": w}, x, state=nxt)
    opt.step(accumulate([a, b]))
    with pytest.raises(InputTypeError):  # a call that raises (no tensor in the batch) claims nothing
        grad_fn({"w": w}, "rows", state=nxt_a)
    got, _ = grad_fn({"w": w}, x, state=nxt)
    assert got.clipping_norm == nxt.clipping_norm
    # The parts' states share a key and their counts share a noise draw: one carries the run on.
    assert nxt_a.key == nxt.key and nxt_a.clipping_norm != nxt.clipping_norm
    with pytest.raises(ConfigurationError, match="different clipping_norm"):
        grad_fn({"w": w}, x, state=nxt_a)


def test_replace_cannot_lower_the_clipping_norm_or_change_the_normalisation():
    """``dataclasses.replace`` (the documented way to attach a release) keeps the sum tensors:
    it used to accept a smaller clipping_norm too, and DPOptimizer then added noise calibrated to
    it (sigma * 0.001 on sums clipped at 10: review), a normalize_by that divides the noise
    alone, or releases=() that dropped adaptive clipping's count (epsilon 2.85 reported against
    15.5 in 10 steps: review)."""
    import dataclasses

    params = {"w": _t([3.0, -1.0])}
    grad_fn, st = clipped_grad(lambda p, x: (p["w"] * x).sum(), batch_argnums=1, clipping_norm=1.0)
    got, _ = grad_fn(params, _t([[1.0, 2.0], [4.0, 0.5]]), state=st)
    with pytest.raises(ConfigurationError, match="may only be raised"):
        dataclasses.replace(got, clipping_norm=0.1)
    two, _ = clipped_grad(lambda p, x: (p["w"] * x).sum() + p["b"] * x.sum(), batch_argnums=1, clipping_norm=1.0)[0](
        {"w": _t([3.0, -1.0]), "b": _t(0.5)}, _t([[1.0, 2.0], [4.0, 0.5]]))
    with pytest.raises(ConfigurationError, match="may only be raised"):  # any sum tensor, in any order (review)
        dataclasses.replace(two, grads={"b": two.grads["b"], "w": two.grads["w"]}, clipping_norm=0.001)
    with pytest.raises(ConfigurationError, match="may only be raised"):
        dataclasses.replace(two, grads={"b": two.grads["b"]}, clipping_norm=0.001)
    with pytest.raises(ConfigurationError, match="normalize_by=1000.0"):
        dataclasses.replace(got, normalize_by=1000.0)
    # A local sum relabelled as the sum of every rank would be stepped on each rank with the
    # shared noise, the ranks' models then differing by their local sums (review); only
    # distributed.sum_gradients sets num_ranks.
    with pytest.raises(ConfigurationError, match="num_ranks=4, not the 1"):
        dataclasses.replace(got, num_ranks=4)
    assert dataclasses.replace(got, clipping_norm=2.0).clipping_norm == 2.0  # more noise: allowed
    assert dataclasses.replace(got, releases=got.releases).clipping_norm == 1.0
    from opake_compile import accounting as acc

    more = dataclasses.replace(got, releases=(acc.gaussian(2.0),))  # adding a release: allowed
    assert dataclasses.replace(more, releases=()).releases == ()  # (a caller's own: optional)
    # Adaptive clipping's count is the library's: a copy without it is refused.
    grad_fn, state, params, x = _adaptive_setup()
    ada, _ = grad_fn(params, x, state=state)
    with pytest.raises(ConfigurationError, match="drop some of"):
        dataclasses.replace(ada, releases=())
    with pytest.raises(ConfigurationError, match="drop some of"):
        dataclasses.replace(ada, receipts=())
    # The count is what the draw-size check reads (a newcomer's review: a sum of two draws
    # relabelled with one draw's count was charged as one step).
    with pytest.raises(ConfigurationError, match="num_examples=1, not the 2 the sums hold"):
        dataclasses.replace(got, num_examples=1)
    with pytest.raises(ConfigurationError, match="num_examples=3, not the 2"):
        dataclasses.replace(got, num_examples=3)
    # One entry swapped for a new tensor beside the library's own (the same edit made in the
    # dict is refused at the release; review): refused when the result is built.
    with pytest.raises(ConfigurationError, match=r"mixes sums the library made \('b'\) with 1 new tensor"):
        dataclasses.replace(two, grads={"b": two.grads["b"], "w": two.grads["w"] * 100})
    # Sums of two results (two batches, the same fields) under one result: charged as one draw
    # while holding two batches' rows (review).
    other, _ = clipped_grad(lambda p, x: (p["w"] * x).sum() + p["b"] * x.sum(), batch_argnums=1, clipping_norm=1.0)[0](
        {"w": _t([3.0, -1.0]), "b": _t(0.5)}, _t([[2.0, 1.0], [0.5, 4.0]]))
    with pytest.raises(ConfigurationError, match="sums of different results"):
        dataclasses.replace(two, grads={"b": two.grads["b"], "w": other.grads["w"]})
    # Fresh tensors are a new sum: the check is about the tensors a result was built around.
    fresh = ClippedPytree(grads={"w": got.grads["w"].clone()}, clipping_norm=0.5,
                          per_example_norms=got.per_example_norms, num_examples=2)
    assert fresh.clipping_norm == 0.5


def test_adaptive_runs_seeded_alike_do_not_wait_on_each_other():
    """Two adaptive clipping functions with the same key, stepped in lockstep (comparing two
    optimizers on one seed): each state waits only for its own function's result."""
    (fa, sa, params, x), (fb, sb, _, _) = _adaptive_setup(), _adaptive_setup()
    noise_fn, ns = gaussian_noise(1.0, oprandom.key(8))
    ra, sa = fa(params, x, state=sa)
    rb, sb = fb(params, x, state=sb)
    assert sa == sb
    _, ns = noise_fn(ra, ns)
    ra, sa = fa(params, x, state=sa)  # a's result was released; b's is pending, and not a's business
    with pytest.raises(ConfigurationError, match="has not been released"):
        fb(params, x, state=sb)
    _, ns = noise_fn(rb, ns)
    rb, sb = fb(params, x, state=sb)
    assert sa == sb


def test_eager_sums_of_many_examples_keep_the_bound():
    """One float32 sum of 2^18 aligned examples moved by 1.019 C on removing one (review): the
    eager reference sums more than 4096 rows in float64, chunk by chunk."""
    def loss(p, x):  # each example's gradient is its row
        return (p * x).sum()

    grad_fn, _ = clipped_grad(loss, 0, batch_argnums=1, clipping_norm=1.0)
    p = torch.zeros(4)
    g = torch.Generator().manual_seed(0)
    for b in (4096, 2**18):
        x = torch.zeros(b, 4)
        x[:, 0], x[:, 1] = 10.0, torch.rand(b, generator=g) * 3
        full, _ = grad_fn(p, x)
        assert full.grads.dtype == (torch.float32 if b <= 4096 else torch.float64)
        for drop in (0, b // 3, b - 1):
            reduced, _ = grad_fn(p, torch.cat([x[:drop], x[drop + 1:]]))
            assert (full.grads.double() - reduced.grads.double()).norm() <= 1.0


def test_clip_pytree_clips_a_tree_whose_float32_squares_underflow():
    """global_norm squares float32 entries in float32: 10^6 entries of 1e-24 have norm 0 there,
    and the tree came back unclipped at 10^4 C for C = 1e-25 (review)."""
    from opake_compile.dpsgd.clipping import clip_pytree

    for value, c in ((1e-24, 1e-25), (1e-23, 1e-22), (3e-20, 1e-19)):
        tree = {"w": torch.full((1000, 1000), value), "b": torch.full((3,), value)}
        clipped, _ = clip_pytree(tree, c)
        out = math.sqrt(sum(float(x.double().square().sum()) for x in clipped.values()))
        assert out <= c * (1 + 1e-6)
    small = {"w": torch.tensor([3e-3, 4e-3])}  # within C: unchanged
    assert torch.equal(clip_pytree(small, 5e-3 * (1 + 1e-7))[0]["w"], small["w"])
