"""JAX as an independent oracle for the torch reference (``dpsgd.clipping``).

For random linear problems and small one-hidden-layer tanh MLPs, the same float32 weights and
data go to both frameworks: torch's ``clipped_grad`` (per-example ``vmap(grad)``, batch of one,
``normalize_by=N``) and JAX's ``vmap(grad)`` + :func:`opake_compile.jax.clip_by_global_norm`
(or :func:`opake_compile.jax.clipped_mean_grad_linear`) under ``jax.jit``. The two must agree
to within float32 rounding.

Tolerances are scaled by ``finfo(float32).eps`` times a per-example *magnitude* A_n: a bound
on the sum of absolute values of the terms that make up each gradient entry (rounding error is
proportional to it, not to the possibly cancelled result). Clipping multiplies an example's
error by min(1, C/||g_n||) and adds a relative error of the clip factor; averaging divides by N.
XLA on CPU flushes subnormals to zero and torch does not, hence a tiny absolute floor.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")

import jax.numpy as jnp  # noqa: E402
from hypothesis import given, settings, target  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra.numpy import arrays  # noqa: E402

import opake_compile.jax as opj  # noqa: E402
from opake_compile._validate import NotPrivateWarning  # noqa: E402
from opake_compile.compiler.passes.numerics import effective_clipping_norm  # noqa: E402
from opake_compile.dpsgd.clipping import clip_pytree, clipped_grad  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
K = 8  # a few roundings per term, sums of at most ~5 terms
FLOOR = 1e-18  # subnormal flush-to-zero in XLA on CPU (squares below ~1e-38 vanish)

SETTINGS = settings(max_examples=25, deadline=None)


def values(shape, bound):
    return arrays(np.float32, shape, elements=st.floats(-bound, bound, width=32))


clip_norms = st.one_of(st.floats(0.0625, 20.0, width=32), st.just(math.inf))


# --- The two implementations -------------------------------------------------------------------


def c_eff(c: float) -> np.float32:
    """The clipping norm the torch side actually applies to float32 gradients, C / (1 + rho)
    (``compiler/passes/numerics.py``): the JAX oracle clips to exactly the value it is given."""
    return np.float32(effective_clipping_norm(float(c), torch.float32))


def torch_clipped_mean(loss, params: dict[str, np.ndarray], x, y, c):
    """torch reference: ``clipped_grad`` with each example a batch of one, mean over N."""
    n = x.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)  # C = inf is drawn on purpose
        grad_fn, state = clipped_grad(
            loss, argnums=0, batch_argnums=(1, 2), clipping_norm=c, normalize_by=n, keep_batch_dim=True
        )
    p = {k: torch.from_numpy(np.array(v)) for k, v in params.items()}
    clipped, _ = grad_fn(p, torch.from_numpy(x), torch.from_numpy(y), state=state)
    grads = {k: v.detach().numpy() for k, v in clipped.grads.items()}
    return grads, clipped.per_example_norms.detach().numpy()


def torch_linear_loss(p, x, y):  # x (1, D), y (1,): the user's batch loss, mean reduction
    return (0.5 * (x @ p["w"] + p["b"] - y) ** 2).mean()


def torch_mlp_loss(p, x, y):
    out = torch.tanh(x @ p["W1"] + p["b1"]) @ p["w2"] + p["b2"]
    return (0.5 * (out - y) ** 2).mean()


def jax_mlp_loss(p, x_n, y_n):
    hi = jax.lax.Precision.HIGHEST
    out = jnp.dot(jnp.tanh(jnp.dot(x_n, p["W1"], precision=hi) + p["b1"]), p["w2"], precision=hi) + p["b2"]
    return 0.5 * (out - y_n) ** 2


@jax.jit
def jax_mlp_clipped_mean(params, x, y, c):
    per_example = jax.vmap(jax.grad(jax_mlp_loss), in_axes=(None, 0, 0))(params, x, y)
    out = jax.vmap(opj.clip_by_global_norm, in_axes=(0, None))(per_example, c)
    return jax.tree.map(lambda g: g.mean(axis=0), out["clipped"]), out["global_norm"]


# --- Tolerances --------------------------------------------------------------------------------


def clipped_mean_tolerance(magnitude: np.ndarray, norms: np.ndarray, c: float, n_params: int) -> float:
    """Absolute tolerance for one entry of the mean of clipped per-example gradients.

    ``magnitude[n]`` bounds the absolute terms of example n's gradient entries; the error of an
    entry is <= K·eps·magnitude, that of the norm <= sqrt(P) times that, and clipping scales
    both by min(1, C/||g_n||) (plus eps·C for the factor itself).
    """
    factor = np.minimum(1.0, c / np.maximum(norms, 1e-30))
    per_example = K * EPS32 * ((1 + math.sqrt(n_params)) * magnitude * factor + np.minimum(norms, c))
    return float(per_example.mean()) + FLOOR


def assert_close(actual, expected, atol, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    err = np.max(np.abs(actual - expected), initial=0.0)
    target(float(err / atol), label=f"error/tolerance of {what}")  # steer Hypothesis to the worst case
    assert err <= atol, f"{what}: max |jax - torch| = {err:.3g} > tolerance {atol:.3g}"


def assert_norms_close(jax_norms, torch_norms, magnitude, n_params):
    jax_norms, torch_norms = np.asarray(jax_norms, np.float64), np.asarray(torch_norms, np.float64)
    tol = K * EPS32 * (math.sqrt(n_params) * magnitude + torch_norms) + FLOOR
    assert jax_norms.shape == torch_norms.shape
    assert np.all(np.abs(jax_norms - torch_norms) <= tol), (jax_norms, torch_norms, tol)


# --- Linear model ------------------------------------------------------------------------------


def assert_linear_matches(out, t_grads, t_norms, problem) -> None:
    """JAX's clipped mean gradient and norms of the linear model equal torch's, within a
    tolerance scaled by the size of each example's gradient terms."""
    w, b, x, y, c = (problem[k] for k in ("w", "b", "x", "y", "c"))
    # g_n = r_n (x_n, 1); the terms of r_n are |x_n|·|w|, |b|, |y_n|.
    x64 = x.astype(np.float64)
    r_terms = np.abs(x64) @ np.abs(w.astype(np.float64)) + abs(float(b)) + np.abs(y)
    magnitude = r_terms * (1.0 + np.abs(x64).max(axis=1))
    n_params = w.size + 1
    assert_norms_close(out["norms"], t_norms, magnitude, n_params)
    atol = clipped_mean_tolerance(magnitude, t_norms.astype(np.float64), c, n_params)
    assert_close(out["grads"]["w"], t_grads["w"], atol, "w")
    assert_close(out["grads"]["b"], t_grads["b"], atol, "b")


@st.composite
def linear_problems(draw):
    n = draw(st.integers(1, 6))
    d = draw(st.integers(1, 5))
    return {
        "w": draw(values((d,), 4.0)),
        "b": draw(values((), 4.0)),
        "x": draw(values((n, d), 4.0)),
        "y": draw(values((n,), 4.0)),
        "c": draw(clip_norms),
    }


@SETTINGS
@given(problem=linear_problems())
def test_linear_jax_matches_torch_clipped_grad(problem):
    w, b, x, y, c = (problem[k] for k in ("w", "b", "x", "y", "c"))
    out = jax.jit(opj.clipped_mean_grad_linear)({"w": w, "b": b}, x, y, c_eff(c))
    t_grads, t_norms = torch_clipped_mean(torch_linear_loss, {"w": w, "b": b}, x, y, c)

    assert_linear_matches(out, t_grads, t_norms, problem)
    assert out["grads"]["w"].dtype == jnp.float32 and t_grads["w"].dtype == np.float32


# --- One-hidden-layer tanh MLP -----------------------------------------------------------------


@st.composite
def mlp_problems(draw):
    n = draw(st.integers(1, 5))
    d = draw(st.integers(1, 4))
    h = draw(st.integers(1, 4))
    return {
        "params": {
            "W1": draw(values((d, h), 2.0)),
            "b1": draw(values((h,), 2.0)),
            "w2": draw(values((h,), 2.0)),
            "b2": draw(values((), 2.0)),
        },
        "x": draw(values((n, d), 2.0)),
        "y": draw(values((n,), 2.0)),
        "c": draw(clip_norms),
    }


def mlp_magnitude(p, x, y):
    """Per-example bound on the absolute terms of the MLP's gradient entries (float64).

    With a = x·W1 + b1, t = tanh(a), r = t·w2 + b2 − y: S_a = |x|·|W1| + |b1| bounds the terms of
    a (and so the error of t, as |tanh'| <= 1); S_r = |w2|·(|t| + S_a) + |b2| + |y| those of r.
    Entries are r·t, r, r·w2·(1 − t²), r·w2·(1 − t²)·x.
    """
    f = {k: np.abs(np.asarray(v, np.float64)) for k, v in p.items()}
    ax = np.abs(x.astype(np.float64))
    s_a = ax @ f["W1"] + f["b1"]  # (N, H)
    t = np.abs(np.tanh(x.astype(np.float64) @ p["W1"].astype(np.float64) + p["b1"]))
    s_r = (t + s_a) @ f["w2"] + f["b2"] + np.abs(y)  # (N,)
    r = np.abs(np.tanh(x.astype(np.float64) @ p["W1"] + p["b1"]) @ p["w2"] + p["b2"] - y)
    return (s_r + 2 * r * s_a.max(axis=1)) * (1 + f["w2"].max()) * (1 + ax.max(axis=1))


@SETTINGS
@given(problem=mlp_problems())
def test_mlp_jax_matches_torch_clipped_grad(problem):
    p, x, y, c = problem["params"], problem["x"], problem["y"], problem["c"]
    j_grads, j_norms = jax_mlp_clipped_mean(p, x, y, c_eff(c))
    t_grads, t_norms = torch_clipped_mean(torch_mlp_loss, p, x, y, c)

    magnitude = mlp_magnitude(p, x, y)
    n_params = sum(v.size for v in p.values())
    assert_norms_close(j_norms, t_norms, magnitude, n_params)
    atol = clipped_mean_tolerance(magnitude, t_norms.astype(np.float64), c, n_params)
    assert sorted(j_grads) == sorted(t_grads)
    for name in p:
        assert j_grads[name].dtype == jnp.float32 and j_grads[name].shape == p[name].shape
        assert_close(j_grads[name], t_grads[name], atol, name)


# --- Whole-tree clipping: clip_by_global_norm vs clip_pytree ---------------------------------


@st.composite
def trees(draw):
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=1, max_size=4, unique=True))
    tree = {}
    for name in names:
        shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        tree[name] = draw(values(shape, 10.0))
    return tree, draw(clip_norms)


@SETTINGS
@given(case=trees())
def test_clip_by_global_norm_matches_torch_clip_pytree(case):
    tree, c = case
    out = jax.jit(opj.clip_by_global_norm)(tree, c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        t_clipped, t_norm = clip_pytree({k: torch.from_numpy(np.array(v)) for k, v in tree.items()}, c)
    n_entries = sum(v.size for v in tree.values())
    norm = float(t_norm)
    assert abs(float(out["global_norm"]) - norm) <= K * EPS32 * norm + FLOOR
    for name, leaf in tree.items():
        got, want = np.asarray(out["clipped"][name]), t_clipped[name].numpy()
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape == leaf.shape
        # Both scale by the same factor up to its relative error (~n_entries·eps).
        atol = K * EPS32 * (1 + math.sqrt(n_entries)) * np.abs(want) + FLOOR
        assert np.all(np.abs(got - want) <= atol), (name, got, want)


# --- DP sensitivity, on the JAX side alone ------------------------------------------------------


@SETTINGS
@given(problem=linear_problems(), drop=st.integers(0, 5))
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c(problem, drop):
    w, b, x, y, c = (problem[k] for k in ("w", "b", "x", "y", "c"))
    n = x.shape[0]
    if n < 2 or math.isinf(c):
        return
    drop %= n
    keep = np.arange(n) != drop
    f = jax.jit(opj.clipped_mean_grad_linear)
    full, less = f({"w": w, "b": b}, x, y, c), f({"w": w, "b": b}, x[keep], y[keep], c)
    diff = np.concatenate([
        np.asarray(full["grads"]["w"], np.float64) * n - np.asarray(less["grads"]["w"], np.float64) * (n - 1),
        [float(full["grads"]["b"]) * n - float(less["grads"]["b"]) * (n - 1)],
    ])
    assert np.linalg.norm(diff) <= c * (1 + K * n * EPS32)


# --- The compiled path (compile_dp) against JAX ----------------------------------------------


class _LinearModel(torch.nn.Module):
    def __init__(self, w: np.ndarray, b: np.ndarray) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w, dtype=torch.float32))
        self.b = torch.nn.Parameter(torch.tensor(b, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


def _compiled_linear_loss(model, x, y):  # the user's batch loss, mean reduction
    return (0.5 * (model(x) - y) ** 2).mean()


@SETTINGS
@given(problem=linear_problems())
def test_linear_jax_matches_the_compiled_step(problem):
    from opake_compile import compile_dp

    w, b, x, y, c = (problem[k] for k in ("w", "b", "x", "y", "c"))
    out = jax.jit(opj.clipped_mean_grad_linear)({"w": w, "b": b}, x, y, c_eff(c))
    model = _LinearModel(w, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        step = compile_dp(_compiled_linear_loss, model=model, clipping_norm=c, backend=None, physical_batch_size=4)
    res = step(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32))
    n = x.shape[0]
    mean = {k: (g / n).numpy() for k, g in res.clipped.grads.items()}
    assert_linear_matches(out, mean, res.clipped.per_example_norms.numpy(), problem)
