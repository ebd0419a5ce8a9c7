"""Tests for opake_compile.functional: make_functional, with_batch_dim, empty_collate."""

from __future__ import annotations

import inspect
import pickle
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from opake_compile import functional as F
from opake_compile import pytree
from opake_compile.exceptions import ConfigurationError, InputTypeError


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mlp(seed: int = 0, dtype=torch.float32) -> nn.Module:
    g = _gen(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=dtype))
    return model


def _tol(dtype):
    eps = torch.finfo(dtype).eps
    return dict(rtol=100 * eps, atol=100 * eps)


# ---------------------------------------------------------------------------------- make_functional


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_make_functional_matches_module(dtype):
    model = _mlp(dtype=dtype)
    fmodel, params = F.make_functional(model)
    assert fmodel.param_names == tuple(n for n, _ in model.named_parameters())
    assert all(a is b for a, b in zip(params, model.parameters()))
    x = torch.randn(5, 4, generator=_gen(1), dtype=dtype)
    torch.testing.assert_close(fmodel(params, x), model(x), **_tol(dtype))
    # The output really depends on the params passed in.
    zeros = tuple(torch.zeros_like(p) for p in params)
    assert torch.count_nonzero(fmodel(zeros, x)) == 0
    assert torch.count_nonzero(model(x)) > 0  # the module itself is untouched


def test_make_functional_passes_kwargs_and_list_params():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x, *, scale=1.0):
            return (x * self.w).sum(-1) * scale

    m = M()
    fmodel, params = F.make_functional(m)
    x = torch.ones(2, 3)
    assert torch.equal(fmodel(list(params), x, scale=2.0), torch.full((2,), 6.0))


def test_make_functional_rejects_bad_params():
    fmodel, params = F.make_functional(_mlp())
    x = torch.zeros(1, 4)
    with pytest.raises(InputTypeError):
        fmodel(params[:-1], x)
    with pytest.raises(InputTypeError):
        fmodel({"0.weight": params[0]}, x)
    with pytest.raises(InputTypeError):
        F.make_functional(lambda x: x)


def test_disable_autograd_tracking_detaches():
    model = _mlp()
    fmodel, params = F.make_functional(model, disable_autograd_tracking=True)
    assert all(not p.requires_grad for p in params)
    assert all(p.data_ptr() == q.data_ptr() for p, q in zip(params, model.parameters()))
    x = torch.randn(3, 4, generator=_gen(2))
    out = fmodel(params, x)
    assert not out.requires_grad
    torch.testing.assert_close(out, model(x))


def test_buffers_come_from_the_module():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).eval()
    fmodel, params = F.make_functional(model)
    assert len(params) == 4  # linear w, b; bn w, b (no buffers)
    x = torch.randn(4, 3, generator=_gen(3))
    before = fmodel(params, x)
    with torch.no_grad():
        model[1].running_mean.fill_(5.0)
    after = fmodel(params, x)
    torch.testing.assert_close(after, model(x))
    assert not torch.allclose(before, after)


def test_tied_parameters_stay_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(2, 2, bias=False)
            self.b = nn.Linear(2, 2, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    m = Tied()
    fmodel, params = F.make_functional(m)
    assert fmodel.param_names == ("a.weight",)
    w = torch.eye(2) * 2
    x = torch.ones(1, 2)
    assert torch.equal(fmodel((w,), x), torch.full((1, 2), 4.0))


def _loop_grads(model, x, y, names):
    out = []
    for i in range(x.shape[0]):
        model.zero_grad()
        loss = nn.functional.mse_loss(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        loss.backward()
        params = dict(model.named_parameters())
        out.append({n: params[n].grad.clone() for n in names})
    return {n: torch.stack([o[n] for o in out]) for n in names}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vmap_grad_matches_per_example_loop(dtype):
    model = _mlp(dtype=dtype)
    fmodel, params = F.make_functional(model, disable_autograd_tracking=True)
    g = _gen(4)
    x = torch.randn(6, 4, generator=g, dtype=dtype)
    y = torch.randn(6, 3, generator=g, dtype=dtype)

    def loss(params, xi, yi):
        pred = fmodel(params, xi.unsqueeze(0))
        return ((pred - yi.unsqueeze(0)) ** 2).sum()

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, y)
    expected = _loop_grads(model, x, y, fmodel.param_names)
    for name, gr in zip(fmodel.param_names, grads):
        assert gr.shape == (6, *dict(model.named_parameters())[name].shape)
        torch.testing.assert_close(gr, expected[name], **_tol(dtype))


@pytest.mark.parametrize("disable", [False, True])
def test_partition_trainable(disable):
    model = _mlp()
    model[0].weight.requires_grad_(False)
    fmodel, trainable, frozen = F.make_functional(model, disable_autograd_tracking=disable, partition_trainable=True)
    assert list(trainable) == ["0.bias", "2.weight", "2.bias"]
    assert list(frozen) == ["0.weight"]
    assert fmodel.trainable_names == ("0.bias", "2.weight", "2.bias")
    assert fmodel.frozen_names == ("0.weight",)
    if disable:
        # Detached: nothing requires grad, yet the partition was decided on the originals.
        assert not any(p.requires_grad for p in (*trainable.values(), *frozen.values()))
    else:
        assert all(p.requires_grad for p in trainable.values())
    x = torch.randn(5, 4, generator=_gen(5))
    expected = model(x)
    torch.testing.assert_close(fmodel(trainable, x), expected)
    torch.testing.assert_close(fmodel(pytree.merge(trainable, frozen), x), expected)
    torch.testing.assert_close(fmodel(F.merge(trainable, frozen), x), expected)
    # An explicitly passed frozen value wins over the captured one.
    zero_frozen = {"0.weight": torch.zeros_like(frozen["0.weight"])}
    assert not torch.allclose(fmodel(F.merge(trainable, zero_frozen), x), expected)


def test_partition_rejects_missing_or_unknown_names():
    model = _mlp()
    model[2].bias.requires_grad_(False)
    fmodel, trainable, frozen = F.make_functional(model, partition_trainable=True)
    x = torch.zeros(1, 4)
    with pytest.raises(InputTypeError, match="Missing trainable"):
        fmodel({k: v for k, v in trainable.items() if k != "0.weight"}, x)
    with pytest.raises(InputTypeError, match="Unknown"):
        fmodel({**trainable, "nope": torch.zeros(1)}, x)
    with pytest.raises(InputTypeError):
        fmodel(tuple(trainable.values()), x)


def test_partition_vmap_grad_only_trainable():
    model = _mlp(dtype=torch.float64)
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    fmodel, trainable, frozen = F.make_functional(model, disable_autograd_tracking=True, partition_trainable=True)
    g = _gen(6)
    x = torch.randn(5, 4, generator=g, dtype=torch.float64)
    y = torch.randn(5, 3, generator=g, dtype=torch.float64)

    def loss(tr, xi, yi):
        return ((fmodel(tr, xi.unsqueeze(0)) - yi.unsqueeze(0)) ** 2).sum()

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(trainable, x, y)
    assert sorted(grads) == ["2.bias", "2.weight"]
    expected = _loop_grads(model, x, y, list(grads))
    for n in grads:
        torch.testing.assert_close(grads[n], expected[n])


# ---------------------------------------------------------------------------------- with_batch_dim


def _shape_recorder():
    seen = []

    def f(x, y, z=None, *, w=None):
        """Doc of f."""
        seen.append(
            (
                None if x is None else tuple(x.shape),
                None if not isinstance(y, torch.Tensor) else tuple(y.shape),
                None if not isinstance(z, torch.Tensor) else tuple(z.shape),
                None if not isinstance(w, torch.Tensor) else tuple(w.shape),
            )
        )
        return x

    return f, seen


def test_with_batch_dim_always_mode_unsqueezes_and_keeps_output():
    f, seen = _shape_recorder()
    wrapped = F.with_batch_dim(f, batch_argnums=0, batch_kwargs="w")
    x = torch.zeros(1, 3)  # already has a leading 1: still unsqueezed in always-mode
    out = wrapped(x, torch.zeros(2), w=torch.zeros(5))
    assert seen[-1] == ((1, 1, 3), (2,), None, (1, 5))
    assert out.shape == (1, 1, 3)  # output untouched


def test_with_batch_dim_nested_args_and_non_tensor_leaves():
    got = {}

    def f(batch):
        got.update(batch)
        return 0

    wrapped = F.with_batch_dim(f, batch_argnums=(0,))
    wrapped({"x": torch.zeros(3), "meta": 7, "pair": (torch.zeros(()), "s")})
    assert got["x"].shape == (1, 3)
    assert got["meta"] == 7
    assert got["pair"][0].shape == (1,) and got["pair"][1] == "s"


@pytest.mark.parametrize("positional", [True, False])
def test_with_batch_dim_kwargs_recognised_positionally(positional):
    f, seen = _shape_recorder()
    wrapped = F.with_batch_dim(f, batch_kwargs=("y", "z"))
    x, y, z = torch.zeros(2), torch.zeros(3), torch.zeros(4)
    if positional:
        wrapped(x, y, z)
    else:
        wrapped(x, z=z, y=y)
    assert seen[-1] == ((2,), (1, 3), (1, 4), None)


def test_with_batch_dim_argnum_and_kwarg_naming_the_same_argument_unsqueeze_once():
    f, seen = _shape_recorder()
    wrapped = F.with_batch_dim(f, batch_argnums=(1, -1), batch_kwargs=("y",))
    wrapped(torch.zeros(2), torch.zeros(3))
    assert seen[-1] == ((2,), (1, 3), None, None)


def test_with_batch_dim_is_idempotent():
    f, seen = _shape_recorder()
    once = F.with_batch_dim(f, batch_argnums=0)
    twice = F.with_batch_dim(once, batch_argnums=0)
    assert twice is once
    twice(torch.zeros(3), None)
    assert seen[-1][0] == (1, 3)
    with pytest.raises(ConfigurationError):
        F.with_batch_dim(once, batch_argnums=1)
    m1 = F.with_batch_dim(f, batch_argnums=0, min_ndim=2)
    assert F.with_batch_dim(m1, batch_argnums=[0], min_ndim=2) is m1


def test_with_batch_dim_keeps_signature_and_metadata():
    f, _ = _shape_recorder()
    wrapped = F.with_batch_dim(f, batch_argnums=0, min_ndim=2)
    assert inspect.signature(wrapped) == inspect.signature(f)
    assert wrapped.__name__ == "f" and wrapped.__doc__ == "Doc of f."


def test_with_batch_dim_min_ndim_mode():
    def f(x):
        return x * 2, {"sum": x.sum(-1)}, x.sum(), 3

    wrapped = F.with_batch_dim(f, batch_argnums=0, min_ndim=2)
    # Unbatched input: unsqueezed, then top-level tensors squeezed back.
    out = wrapped(torch.ones(3))
    assert out[0].shape == (3,)
    assert out[1]["sum"].shape == (1,)  # nested: not squeezed
    assert out[2].shape == () and out[3] == 3
    # Already batched, even with batch size 1: a no-op, output untouched.
    x = torch.ones(1, 3)
    out = wrapped(x)
    assert out[0].shape == (1, 3)
    assert torch.equal(out[0], f(x)[0])


def test_with_batch_dim_min_ndim_dict_per_kwarg():
    f, seen = _shape_recorder()
    wrapped = F.with_batch_dim(f, batch_argnums=0, batch_kwargs=("w",), min_ndim={0: 2, "w": 3})
    out = wrapped(torch.zeros(4), None, w=torch.zeros(2, 2))
    assert seen[-1] == ((1, 4), None, None, (1, 2, 2))
    assert out.shape == (4,)
    out = wrapped(torch.zeros(5, 4), None, w=torch.zeros(1, 2, 2))
    assert seen[-1] == ((5, 4), None, None, (1, 2, 2))
    assert out.shape == (5, 4)
    # Only w needs a batch dim: output still squeezed (something was unsqueezed).
    out = wrapped(torch.zeros(1, 4), None, w=torch.zeros(2, 2))
    assert out.shape == (4,)


def test_with_batch_dim_under_vmap():
    def batch_loss(w, x, y):  # expects x: (batch, d), y: (batch,)
        assert x.dim() == 2 and y.dim() == 1
        return ((x @ w - y) ** 2).mean()

    g = _gen(7)
    w = torch.randn(3, generator=g, dtype=torch.float64)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    y = torch.randn(6, generator=g, dtype=torch.float64)
    per_ex = F.with_batch_dim(batch_loss, batch_argnums=(1, 2))
    grads = torch.func.vmap(torch.func.grad(per_ex), in_dims=(None, 0, 0))(w, x, y)
    expected = torch.stack([2 * (x[i] @ w - y[i]) * x[i] for i in range(6)])
    torch.testing.assert_close(grads, expected)
    # min_ndim mode also works per example and is transparent on the full batch.
    idem = F.with_batch_dim(batch_loss, batch_argnums=(1, 2), min_ndim={1: 2, 2: 1})
    losses = torch.func.vmap(idem, in_dims=(None, 0, 0))(w, x, y)
    torch.testing.assert_close(losses, (x @ w - y) ** 2)
    torch.testing.assert_close(idem(w, x, y), batch_loss(w, x, y))


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(batch_argnums="0"), InputTypeError),
        (dict(batch_argnums=(0.0,)), InputTypeError),
        (dict(batch_argnums=True), InputTypeError),
        (dict(batch_kwargs=(1,)), InputTypeError),
        (dict(batch_argnums=0, min_ndim=0), ConfigurationError),
        (dict(batch_argnums=0, min_ndim=1.5), InputTypeError),
        (dict(batch_argnums=0, min_ndim={1: 2}), ConfigurationError),
        (dict(batch_argnums=0, min_ndim={}), ConfigurationError),
        (dict(batch_kwargs="nope"), ConfigurationError),
    ],
)
def test_with_batch_dim_validation(kwargs, exc):
    f, _ = _shape_recorder()
    with pytest.raises(exc):
        F.with_batch_dim(f, **kwargs)


def test_with_batch_dim_errors_on_missing_positional_arg_and_accepts_var_kwargs():
    f, _ = _shape_recorder()
    with pytest.raises(InputTypeError):
        F.with_batch_dim(f, batch_argnums=3)(torch.zeros(1), None)

    def g(x, **kw):
        return kw["extra"]

    assert F.with_batch_dim(g, batch_kwargs="extra")(0, extra=torch.zeros(2)).shape == (1, 2)
    with pytest.raises(InputTypeError):
        F.with_batch_dim(42)


# ---------------------------------------------------------------------------------- empty_collate

Pair = namedtuple("Pair", ["image", "label"])


def _examples(kind, n):
    g = _gen(8)
    out = []
    for i in range(n):
        img = torch.randn(2, 3, generator=g)
        lbl = torch.tensor(i % 3, dtype=torch.int64)
        if kind == "tuple":
            out.append((img, lbl))
        elif kind == "dict":
            out.append({"image": img, "label": lbl, "name": f"ex{i}", "w": float(i)})
        elif kind == "namedtuple":
            out.append(Pair(img, lbl))
        elif kind == "nested":
            out.append({"inputs": (img, img[0].to(torch.float64)), "label": lbl})
    return out


@pytest.mark.parametrize("kind", ["tuple", "dict", "namedtuple", "nested"])
def test_empty_collate_matches_structure(kind):
    collate = F.empty_collate(default_collate)
    full = collate(_examples(kind, 4))
    empty = collate([])
    assert type(empty) is type(full)
    if kind == "dict":
        assert empty["name"] == []  # strings are per-example: an empty list
        full = {k: v for k, v in full.items() if k != "name"}
        empty = {k: v for k, v in empty.items() if k != "name"}
    full_leaves, full_def = pytree.tree_flatten(full)
    empty_leaves, empty_def = pytree.tree_flatten(empty)
    assert full_def == empty_def
    assert len(full_leaves) >= 2
    for a, b in zip(full_leaves, empty_leaves):
        assert isinstance(b, torch.Tensor)
        assert b.shape == (0, *a.shape[1:]) and b.dtype == a.dtype
    # Non-empty batches still go through the collate function unchanged.
    again = collate(_examples(kind, 2))
    assert pytree.tree_leaves(again)[0].shape[0] == 2


def test_empty_collate_before_structure_is_known_calls_collate_fn():
    calls = []

    def collate_fn(batch):
        calls.append(list(batch))
        if not batch:
            raise IndexError("empty batch")
        return torch.stack(batch)

    collate = F.empty_collate(collate_fn)
    with pytest.raises(IndexError):
        collate([])
    assert calls == [[]]
    collate([torch.zeros(3), torch.ones(3)])
    out = collate([])
    assert out.shape == (0, 3)
    assert len(calls) == 2  # the empty batch no longer reaches collate_fn


def test_empty_collate_with_default_collate_reraises_default_error():
    collate = F.empty_collate()
    with pytest.raises(Exception):
        collate([])


def test_empty_collate_numpy_ordered_dict_and_pickle():
    def collate_fn(batch):
        return OrderedDict(a=np.stack(batch), n=len(batch))

    collate = F.empty_collate(collate_fn)
    collate([np.zeros((2,), dtype=np.int16)])
    out = collate([])
    assert isinstance(out, OrderedDict)
    assert out["a"].shape == (0, 2) and out["a"].dtype == np.int16
    assert out["n"] == 1  # other leaves repeat as first seen (documented)
    c2 = pickle.loads(pickle.dumps(F.empty_collate(default_collate)))
    c2([(torch.zeros(3),)])
    assert c2([])[0].shape == (0, 3)
    # The learned structure travels with the pickle (DataLoader workers).
    c3 = F.empty_collate(default_collate)
    c3([torch.zeros(2, dtype=torch.float16)])
    assert pickle.loads(pickle.dumps(c3))([]).dtype == torch.float16


def test_empty_collate_rejects_non_callable():
    with pytest.raises(InputTypeError):
        F.empty_collate(3)


def test_module_exports():
    assert set(F.__all__) == {"make_functional", "with_batch_dim", "empty_collate", "merge"}
    assert F.merge is pytree.merge


# ------------------------------------------------------------------- empty_collate(example=...)
@pytest.mark.parametrize("kind", ["tuple", "dict", "namedtuple", "nested"])
def test_empty_collate_with_example_knows_the_structure_before_any_batch(kind):
    calls = []

    def collate_fn(batch):
        calls.append(len(batch))
        return default_collate(batch)

    examples = _examples(kind, 4)
    collate = F.empty_collate(collate_fn, example=examples[0])
    empty = collate([])  # the very first batch is empty
    assert 0 not in calls, "an empty batch reached collate_fn"
    full = collate(examples)
    assert type(empty) is type(full)
    if kind == "dict":
        assert empty["name"] == []
        full = {k: v for k, v in full.items() if k != "name"}
        empty = {k: v for k, v in empty.items() if k != "name"}
    full_leaves, full_def = pytree.tree_flatten(full)
    empty_leaves, empty_def = pytree.tree_flatten(empty)
    assert full_def == empty_def and len(full_leaves) >= 2
    for a, b in zip(full_leaves, empty_leaves):
        assert isinstance(b, torch.Tensor)
        assert b.shape == (0, *a.shape[1:]) and b.dtype == a.dtype
    # The learned structure travels with the pickle (DataLoader workers).
    again = pickle.loads(pickle.dumps(F.empty_collate(default_collate, example=examples[0])))
    assert type(again([])) is type(full)


def test_empty_collate_example_that_cannot_be_collated_is_a_configuration_error():
    def collate_fn(batch):
        return torch.stack(batch)

    with pytest.raises(ConfigurationError, match="example"):
        F.empty_collate(collate_fn, example="not a tensor")
    with pytest.raises(InputTypeError):
        F.empty_collate(42, example=torch.zeros(2))


def test_poisson_loader_whose_first_batch_is_empty_runs_with_the_example_form():
    """The README's DataLoader recipe with a small q*N: the first Poisson batch is empty."""
    from torch.utils.data import DataLoader, TensorDataset

    from opake_compile import random as oprandom
    from opake_compile.sampling import PoissonSampler

    ds = TensorDataset(torch.randn(20, 3, generator=_gen(3)), torch.arange(20) % 2)
    rate = 0.05  # q*N = 1: about a third of the batches are empty
    seed = next(s for s in range(200) if len(next(iter(PoissonSampler(len(ds), rate, key=oprandom.key(s))))) == 0)
    sampler = PoissonSampler(len(ds), rate, key=oprandom.key(seed))
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=F.empty_collate(default_collate, example=ds[0]))
    sizes = []
    for x, y in loader:
        assert x.shape[1:] == (3,) and x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.shape[0] == y.shape[0]
        sizes.append(x.shape[0])
    assert sizes[0] == 0 and len(sizes) == len(sampler)
    # Without the example the same first batch reaches default_collate, which refuses it.
    plain = DataLoader(ds, batch_sampler=PoissonSampler(len(ds), rate, key=oprandom.key(seed)),
                       collate_fn=F.empty_collate(default_collate))
    with pytest.raises(IndexError):
        next(iter(plain))
