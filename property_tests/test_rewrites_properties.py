"""Properties of the ghost-norm / book-keeping rewrites (``compiler/passes/rewrites.py``).

For random models (MLP, a small transformer with math-form attention, a small CNN), random
layer shapes, sequence lengths, batch sizes (0, 1, many, more than the physical batch size, so
padded rows), random frozen/trainable masks, float32/float64 and random clipping norms C:

- the rewritten step (``rewrites=None``) equals the unrewritten one (``rewrites=[]``): clipped
  sums within a dtype-scaled relative tolerance, per-example norms equal;
- the rewrites actually engage (coverage labels of the trainable weights);
- sensitivity: removing one example moves the rewritten clipped sum by at most C (1 + tol).

``backend=None`` throughout (the FX graph run unlowered), so each example costs two traces.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from _models import MathTransformer

from opake_compile import compile_dp
from opake_compile.compiler.passes.rewrites import GhostClipping

SETTINGS = settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

LINEAR = {"ghost:linear", "bk:linear (norm materialized)"}
CONV = {"ghost:conv", "materialized (cheaper than ghost)"}
DIRECT = "direct (per-example vector)"


# ----------------------------------------------------------------------------- models
def _build(fn, seed: int, dtype: torch.dtype) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = fn()
    return model.to(dtype)


class MLP(nn.Module):
    def __init__(self, sizes: list[int], bias: bool, layernorm: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b, bias=bias))
            if i < len(sizes) - 2:
                layers += [nn.LayerNorm(b)] if layernorm else []
                layers.append(nn.Tanh())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int, padding: int, dilation: int, groups: int, norm: bool, classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride=stride, padding=padding, dilation=dilation, groups=groups)
        self.norm = nn.GroupNorm(groups, cout) if norm else nn.Identity()
        self.conv2 = nn.Conv2d(cout, cout, 1)
        self.head = nn.Linear(cout, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(torch.tanh(self.norm(self.conv(x))))
        return self.head(h.mean((2, 3)))


def _ce(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = m(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# ----------------------------------------------------------------------------- strategies
@st.composite
def _common(draw):
    p = draw(st.integers(1, 5))
    # 0 and 1 are always tried; "many" (up to 2P + 1: padded chunks) is drawn most often.
    n = draw(st.one_of(st.just(0), st.just(1), *[st.integers(2, 2 * p + 1)] * 4))
    return dict(
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        p=p,
        n=n,
        c=draw(st.floats(0.02, 5.0)),
        seed=draw(st.integers(0, 2**16)),
    )


def _freeze(data, model: nn.Module) -> list[str]:
    """Freeze a random subset of the parameters (at least one stays trainable)."""
    named = list(model.named_parameters())
    mask = data.draw(st.lists(st.booleans(), min_size=len(named), max_size=len(named)), label="trainable")
    if not any(mask):
        mask[data.draw(st.integers(0, len(named) - 1), label="keep")] = True
    for (_, q), m in zip(named, mask):
        q.requires_grad_(m)
    return [k for k, q in model.named_parameters() if q.requires_grad]


# ----------------------------------------------------------------------------- the check
def _check(model: nn.Module, loss_fn, args: tuple, *, c: float, p: int, dtype: torch.dtype, trainable: list[str]) -> dict[str, str]:
    """Rewritten == unrewritten, sensitivity <= C (1 + tol); returns the rewritten coverage."""
    kw = dict(model=model, clipping_norm=c, physical_batch_size=p, backend=None)
    ghost = compile_dp(loss_fn, **kw)
    fused = compile_dp(loss_fn, rewrites=[GhostClipping(bookkeeping="fused")], **kw)
    plain = compile_dp(loss_fn, rewrites=[], **kw)
    got, want = ghost(*args), plain(*args)
    alt = fused(*args)
    n = int(args[0].shape[0])
    rtol = 1e-10 if dtype == torch.float64 else 1e-4

    assert set(got.clipped.grads) == set(want.clipped.grads) == set(trainable)
    scale = max([1.0] + [float(w.double().abs().max()) for w in want.clipped.grads.values()])
    for k, w in want.clipped.grads.items():
        g = got.clipped.grads[k]
        # released sums are float64 (one graph or several chunks)
        assert g.shape == w.shape and g.dtype == w.dtype == torch.float64, k
        diff = float((g.double() - w.double()).abs().max())
        assert diff <= rtol * scale, f"{k}: max |diff| {diff:.3g} > {rtol * scale:.3g}"
    # The opt-in fused book-keeping form computes the same sums as the default operator.
    for k, w in want.clipped.grads.items():
        diff = float((alt.clipped.grads[k].double() - w.double()).abs().max())
        assert diff <= rtol * scale, f"fused {k}: max |diff| {diff:.3g} > {rtol * scale:.3g}"
    gn, wn = got.clipped.per_example_norms.double(), want.clipped.per_example_norms.double()
    assert gn.shape == wn.shape == (n,)
    if n:
        assert bool(torch.isfinite(wn).all())
        torch.testing.assert_close(gn, wn, rtol=rtol, atol=rtol)
    assert got.clipped.num_examples == n and got.clipped.num_nonfinite == want.clipped.num_nonfinite == 0

    # Sensitivity (the DP guarantee): removing example i changes the clipped sum by at most C.
    for i in sorted({0, n - 1})[: 2 if n else 0]:
        reduced = ghost(*(torch.cat([a[:i], a[i + 1 :]]) for a in args)).clipped.grads
        moved = math.sqrt(sum(float((got.clipped.grads[k].double() - reduced[k].double()).square().sum()) for k in reduced))
        assert moved <= c * (1 + rtol), f"removing example {i} moved the sum by {moved:.6g} > C = {c:.6g}"
        # ... and by exactly that example's clipped norm min(C, ||g_i||).
        assert abs(moved - min(c, float(wn[i]))) <= 10 * rtol * max(scale, c), (moved, c, float(wn[i]))
    event(f"batch: {'empty' if not n else 'one' if n == 1 else 'padded' if n % p else 'full chunks'}")
    if not n:
        return {}  # an empty batch traces nothing: no coverage to check
    for label in set(got.coverage.values()):
        event(f"path: {label}")
    assert set(got.coverage) == set(trainable)
    return got.coverage


def _inputs(common, *shape, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(common["seed"] + 1)
    return torch.randn(common["n"], *shape, generator=g, dtype=common["dtype"]) * scale


def _labels(common, high: int, *shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(common["seed"] + 2)
    return torch.randint(0, high, (common["n"], *shape), generator=g)


# ----------------------------------------------------------------------------- properties
@SETTINGS
@given(
    common=_common(),
    sizes=st.lists(st.integers(1, 9), min_size=2, max_size=4),
    seq=st.one_of(st.none(), st.integers(1, 12)),
    bias=st.booleans(),
    layernorm=st.booleans(),
    data=st.data(),
)
def test_mlp_rewritten_equals_unrewritten(common, sizes, seq, bias, layernorm, data):
    sizes = sizes[:-1] + [max(2, sizes[-1])]
    model = _build(lambda: MLP(sizes, bias, layernorm), common["seed"], common["dtype"])
    trainable = _freeze(data, model)
    pos = () if seq is None else (seq,)
    args = (_inputs(common, *pos, sizes[0], scale=2.0), _labels(common, sizes[-1], *pos))
    cov = _check(model, _ce, args, trainable=trainable, **_kw(common))
    for k, label in cov.items():
        assert label in (LINEAR if k.endswith("weight") and model.get_parameter(k).dim() == 2 else {DIRECT}), (k, label)


class Projections(nn.Module):
    """Separate q/k/v-style projections of one input, mixed non-linearly: the layers share
    their input's Gram matrix in the rewritten graph."""

    def __init__(self, d: int, n_out: int, heads: int) -> None:
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(d, d) for _ in range(heads))
        self.out = nn.Linear(d, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.stack([p(x) for p in self.proj]).tanh().prod(0)
        return self.out(h).mean(1)


@SETTINGS
@given(
    common=_common(),
    d=st.integers(1, 6),
    seq=st.integers(1, 8),
    heads=st.integers(2, 3),
    data=st.data(),
)
def test_projections_of_one_input_rewritten_equals_unrewritten(common, d, seq, heads, data):
    model = _build(lambda: Projections(d, 3, heads), common["seed"], common["dtype"])
    trainable = _freeze(data, model)
    args = (_inputs(common, seq, d, scale=2.0), _labels(common, 3))
    _check(model, _ce, args, trainable=trainable, **_kw(common))


@SETTINGS
@given(
    common=_common(),
    vocab=st.integers(2, 30),
    d_head=st.integers(1, 4),
    heads=st.integers(1, 2),
    seq=st.integers(1, 6),
    tied=st.booleans(),
    data=st.data(),
)
def test_transformer_rewritten_equals_unrewritten(common, vocab, d_head, heads, seq, tied, data):
    model = _build(lambda: MathTransformer(vocab, d_head * heads, heads, seq, tied, mlp_ratio=2), common["seed"], common["dtype"])
    trainable = _freeze(data, model)
    g = torch.Generator().manual_seed(common["seed"] + 3)
    ids = torch.randint(0, vocab, (common["n"], seq), generator=g)
    cov = _check(model, _ce, (ids, _labels(common, vocab, seq)), trainable=trainable, **_kw(common))
    # Embeddings take the Gram form or, where the cost model finds it cheaper (small tables),
    # the norm from one scatter-add.
    emb = {"ghost:embedding", "bk:embedding (norm materialized)"}
    tied_emb = {"ghost:embedding+linear", "bk:embedding+linear (norm materialized)"}
    expected = {"tok.weight": tied_emb if tied else emb, "pos.weight": emb}
    for k, label in cov.items():
        want = expected.get(k, LINEAR if model.get_parameter(k).dim() == 2 else {DIRECT})
        assert label in want, (k, label)


@SETTINGS
@given(
    common=_common(),
    cin=st.integers(1, 4),
    cout=st.integers(1, 3),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.integers(0, 1),
    dilation=st.integers(1, 2),
    grouped=st.booleans(),
    norm=st.booleans(),
    extra=st.integers(0, 4),
    data=st.data(),
)
def test_cnn_rewritten_equals_unrewritten(common, cin, cout, k, stride, padding, dilation, grouped, norm, extra, data):
    groups = 2 if grouped else 1
    if norm and cout == 1:
        extra = max(extra, stride)  # GroupNorm needs more than one value per group
    cin, cout = cin * groups, cout * groups
    size = dilation * (k - 1) + 1 - 2 * padding + extra
    size = max(size, 1)
    model = _build(lambda: CNN(cin, cout, k, stride, padding, dilation, groups, norm, 3), common["seed"], common["dtype"])
    trainable = _freeze(data, model)
    args = (_inputs(common, cin, size, size), _labels(common, 3))
    cov = _check(model, _ce, args, trainable=trainable, **_kw(common))
    for name, label in cov.items():
        q = model.get_parameter(name)
        if name == "conv.weight":
            assert label in CONV, (name, label)  # grouped too (per-group factor blocks)
        elif name == "conv2.weight":
            assert label in CONV, (name, label)
        elif name == "head.weight":
            assert label in LINEAR, (name, label)
        else:
            assert q.dim() == 1 and label == DIRECT, (name, label)


def _kw(common) -> dict:
    return dict(c=common["c"], p=common["p"], dtype=common["dtype"])
