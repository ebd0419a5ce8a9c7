"""Tests of opake_compile.jax: SPEC §3's reference values, edge cases and input validation.

Skipped when JAX is not installed; CI installs the ``jax`` extra and runs them.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import opake_compile.jax as opj  # noqa: E402
from opake_compile._markers import DPOutput  # noqa: E402
from opake_compile._validate import NotPrivateWarning  # noqa: E402
from opake_compile.exceptions import ConfigurationError, InputTypeError  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)


def assert_rounds_to(actual, expected, decimals=6):
    """``actual`` agrees with ``expected`` to the decimals SPEC gives, allowing only float32
    rounding on top of the half unit in the last decimal place."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    tol = 0.5 * 10.0**-decimals + 4 * EPS32 * np.abs(expected)
    assert np.all(np.abs(actual - expected) <= tol), (actual, expected)


# --- SPEC §3 "Reference values" ---------------------------------------------------------------
# Written exactly as in the spec (Python ints and lists), with the decimals the spec rounds to.

LINEAR_CASES = [
    pytest.param(
        {"w": [1, -1], "b": 0}, [[1, 0], [2, 2], [0, 3]], [0, 1, 1], 1,
        ([0.01348, -0.53845], 5), (0.019182, 6), [1.414214, 3.0, 12.649111],
        id="D2-N3-C1",
    ),
    pytest.param(
        {"w": [0.5], "b": 0.5}, [[1], [-1], [2], [0]], [1.5, 0.5, 1, 0], 10,
        ([0.25], 6), (0.0, 6), [0.707107, 0.707107, 1.118034, 0.5],
        id="D1-N4-C10",
    ),
    pytest.param(
        {"w": [2, 1], "b": -1}, [[1, 1], [0.5, -1]], [2, -4], 2,
        ([0.333333, -0.666667], 6), (0.666667, 6), [0.0, 4.5],
        id="D2-N2-C2-zero-residual",
    ),
]


@pytest.mark.parametrize("as_arrays", [False, True], ids=["python-lists", "float32-arrays"])
@pytest.mark.parametrize("params, x, y, c, w_ref, b_ref, norms_ref", LINEAR_CASES)
def test_clipped_mean_grad_linear_reference_values(params, x, y, c, w_ref, b_ref, norms_ref, as_arrays):
    if as_arrays:
        f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
        params, x, y, c = {k: f32(v) for k, v in params.items()}, f32(x), f32(y), f32(c)
    out = jax.jit(opj.clipped_mean_grad_linear)(params, x, y, c)
    d, n = len(w_ref[0]), len(norms_ref)
    assert out["grads"]["w"].shape == (d,) and out["grads"]["w"].dtype == jnp.float32
    assert out["grads"]["b"].shape == () and out["grads"]["b"].dtype == jnp.float32
    assert out["norms"].shape == (n,) and out["norms"].dtype == jnp.float32
    assert_rounds_to(out["grads"]["w"], w_ref[0], decimals=w_ref[1])
    assert_rounds_to(out["grads"]["b"], b_ref[0], decimals=b_ref[1])
    assert_rounds_to(out["norms"], norms_ref)


def test_clip_by_global_norm_reference_scale_down():
    out = jax.jit(opj.clip_by_global_norm)({"w": [3, 0], "b": 4}, 1)
    clipped = out["clipped"]
    assert jax.tree.structure(clipped) == jax.tree.structure({"w": [0, 0], "b": 0})
    assert_rounds_to(clipped["w"], [0.6, 0.0])
    assert_rounds_to(clipped["b"], 0.8)
    assert_rounds_to(out["global_norm"], 5.0)
    assert out["global_norm"].dtype == jnp.float32 and out["global_norm"].shape == ()


def test_clip_by_global_norm_reference_within_norm_is_unchanged():
    tree = {"dense": {"w": [[0.1, -0.2], [0.2, 0]], "b": [0.4, 0]}, "head": [-0.4]}
    out = jax.jit(opj.clip_by_global_norm)(tree, 2)
    assert jax.tree.structure(out["clipped"]) == jax.tree.structure(tree)
    # "unchanged": bit for bit the float32 values of the input.
    for got, want in zip(jax.tree.leaves(out["clipped"]), jax.tree.leaves(tree)):
        assert np.asarray(got) == np.float32(want)
    assert_rounds_to(out["global_norm"], 0.640312)


def test_clip_by_global_norm_reference_list_of_layers():
    tree = {"layers": [{"w": [0.6, 0.6]}] * 3}
    out = jax.jit(opj.clip_by_global_norm)(tree, 1)
    leaves = jax.tree.leaves(out["clipped"])
    assert len(leaves) == 6
    assert_rounds_to(leaves, [0.408248] * 6)
    assert_rounds_to(out["global_norm"], 1.469694)


# --- Edge cases ---------------------------------------------------------------------------------


def test_all_zero_gradients_are_not_nan():
    tree = {"a": jnp.zeros((2, 3)), "b": jnp.zeros((), jnp.bfloat16)}
    out = jax.jit(opj.clip_by_global_norm)(tree, 1.0)
    assert float(out["global_norm"]) == 0.0
    for got, want in zip(jax.tree.leaves(out["clipped"]), jax.tree.leaves(tree)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert not np.any(np.isnan(np.asarray(got, np.float32)))
        assert np.all(np.asarray(got, np.float32) == 0)

    # Linear model with zero residual everywhere: y = x·w + b.
    w, b = jnp.array([1.0, -2.0]), jnp.float32(0.5)
    x = jnp.array([[1.0, 0.0], [0.0, 1.0], [2.0, 3.0]])
    out = jax.jit(opj.clipped_mean_grad_linear)({"w": w, "b": b}, x, x @ w + b, 1.0)
    np.testing.assert_array_equal(out["norms"], np.zeros(3, np.float32))
    np.testing.assert_array_equal(out["grads"]["w"], np.zeros(2, np.float32))
    assert float(out["grads"]["b"]) == 0.0


@pytest.mark.parametrize("c", [0.5, 100.0])
def test_single_example_is_its_own_clipped_gradient(c):
    # r = 0·3 + 0·4 + 0 − 1 = −1, g = (−3, −4, −1), ||g|| = sqrt(26).
    out = jax.jit(opj.clipped_mean_grad_linear)({"w": [0.0, 0.0], "b": 0.0}, [[3.0, 4.0]], [1.0], c)
    g = np.array([-3.0, -4.0, -1.0])
    expected = g * min(1.0, c / math.sqrt(26.0))
    np.testing.assert_allclose(out["grads"]["w"], expected[:2], rtol=4 * EPS32)
    np.testing.assert_allclose(out["grads"]["b"], expected[2], rtol=4 * EPS32)
    np.testing.assert_allclose(out["norms"], [math.sqrt(26.0)], rtol=4 * EPS32)


def test_infinite_max_norm_is_the_identity_and_warns_when_concrete():
    tree = {"w": jnp.array([300.0, -400.0]), "b": jnp.array(1e6, jnp.float32)}
    with pytest.warns(NotPrivateWarning, match="max_norm=inf"):
        out = opj.clip_by_global_norm(tree, math.inf)
    for got, want in zip(jax.tree.leaves(out["clipped"]), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(got, want)

    # Traced C = inf (no warning possible): the plain mean gradient, r_n x_n averaged.
    x = np.array([[1.0, 2.0], [-3.0, 0.5], [0.0, 4.0]], np.float32)
    y = np.array([10.0, -20.0, 30.0], np.float32)
    w, b = np.array([0.5, -1.0], np.float32), np.float32(2.0)
    out = jax.jit(opj.clipped_mean_grad_linear)({"w": w, "b": b}, x, y, jnp.inf)
    r = x.astype(np.float64) @ w + b - y
    np.testing.assert_allclose(out["grads"]["w"], (r[:, None] * x).mean(0), rtol=16 * EPS32)
    np.testing.assert_allclose(out["grads"]["b"], r.mean(), rtol=16 * EPS32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_leaf_keeps_dtype_and_norm_accumulates_in_float32(dtype):
    # 1 + 2**-16 is 1 in bfloat16/float16 but not in float32: the norm must see it.
    leaf = jnp.array([[1.0, 2.0**-8]], dtype)
    out = jax.jit(opj.clip_by_global_norm)({"h": leaf, "f": jnp.zeros(3)}, 10.0)
    assert out["global_norm"].dtype == jnp.float32
    assert float(out["global_norm"]) == float(np.sqrt(np.float32(1.0 + 2.0**-16)))
    assert float(out["global_norm"]) > 1.0
    assert out["clipped"]["h"].dtype == dtype and out["clipped"]["h"].shape == (1, 2)
    np.testing.assert_array_equal(out["clipped"]["h"], leaf)  # within C: unchanged

    # Squares overflow float16 (300² > 65504) but not float32; the clipped value is rounded
    # once from float32.
    big = jnp.array([300.0, 400.0], dtype)
    out = jax.jit(opj.clip_by_global_norm)([big], 1.0)
    assert float(out["global_norm"]) == 500.0
    assert out["clipped"][0].dtype == dtype
    np.testing.assert_array_equal(out["clipped"][0], jnp.array([0.6, 0.8], dtype))


def test_empty_tree_and_empty_batch():
    out = opj.clip_by_global_norm({}, 1.0)
    assert out["clipped"] == {} and float(out["global_norm"]) == 0.0
    assert out["global_norm"].dtype == jnp.float32
    out = opj.clipped_mean_grad_linear({"w": [1.0, 2.0], "b": 0.0}, jnp.zeros((0, 2)), jnp.zeros((0,)), 1.0)
    assert out["norms"].shape == (0,)
    np.testing.assert_array_equal(out["grads"]["w"], [0.0, 0.0])
    assert float(out["grads"]["b"]) == 0.0


def test_non_finite_example_contributes_exactly_zero():
    x = jnp.array([[jnp.nan], [jnp.inf], [1.0]])
    out = jax.jit(opj.clipped_mean_grad_linear)({"w": [1.0], "b": 0.0}, x, [0.0, 0.0, 0.0], 1.0)
    norms = np.asarray(out["norms"])
    assert not np.isfinite(norms[0]) and not np.isfinite(norms[1])
    # Only example 3 counts: g = (1, 1), clipped to (1, 1)/sqrt(2), averaged over N = 3.
    np.testing.assert_allclose(out["grads"]["w"], [1 / math.sqrt(2) / 3], rtol=4 * EPS32)
    np.testing.assert_allclose(out["grads"]["b"], 1 / math.sqrt(2) / 3, rtol=4 * EPS32)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_non_finite_tree_is_nan_not_partially_clipped(bad):
    out = jax.jit(opj.clip_by_global_norm)({"a": jnp.array([bad, 1.0]), "b": jnp.array([2.0])}, 1.0)
    assert all(np.all(np.isnan(leaf)) for leaf in jax.tree.leaves(out["clipped"]))


def test_traced_max_norm_recompiles_nothing_and_invalid_values_give_nan():
    f = jax.jit(opj.clip_by_global_norm)
    tree = {"w": jnp.array([3.0, 4.0])}
    np.testing.assert_allclose(f(tree, 1.0)["clipped"]["w"], [0.6, 0.8], rtol=4 * EPS32)
    np.testing.assert_allclose(f(tree, 2.5)["clipped"]["w"], [1.5, 2.0], rtol=4 * EPS32)
    np.testing.assert_array_equal(f(tree, 10.0)["clipped"]["w"], [3.0, 4.0])
    for bad in (0.0, -1.0, jnp.nan):
        assert np.all(np.isnan(f(tree, bad)["clipped"]["w"]))
    g = jax.jit(opj.clipped_mean_grad_linear)
    assert np.all(np.isnan(g({"w": [1.0], "b": 0.0}, [[1.0]], [0.0], -1.0)["grads"]["w"]))


def test_clip_by_global_norm_under_vmap_clips_each_example():
    batch = {"w": jnp.array([[3.0, 0.0], [0.3, 0.0]]), "b": jnp.array([4.0, 0.4])}
    out = jax.vmap(opj.clip_by_global_norm, in_axes=(0, None))(batch, 1.0)
    np.testing.assert_allclose(out["clipped"]["w"], [[0.6, 0.0], [0.3, 0.0]], rtol=4 * EPS32)
    np.testing.assert_allclose(out["global_norm"], [5.0, 0.5], rtol=4 * EPS32)


def test_differentiable_through_clipping_including_at_zero():
    def total(t):
        return jnp.sum(opj.clip_by_global_norm(t, 1.0)["clipped"]["w"])

    # Within C the map is the identity: gradient of the sum is all ones, not NaN (at 0 too).
    np.testing.assert_array_equal(jax.grad(total)({"w": jnp.zeros(2)})["w"], [1.0, 1.0])
    # Clipped, t -> C t/||t||: d/dt sum = C (1/||t|| - t (1·t)/||t||³) = [0.032, -0.024].
    np.testing.assert_allclose(jax.grad(total)({"w": jnp.array([3.0, 4.0])})["w"], [0.032, -0.024], rtol=16 * EPS32)


# --- Validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("c", [0, -1.0, math.nan, jnp.float32(0.0), np.array(-2.0)])
def test_concrete_max_norm_out_of_range_is_a_configuration_error(c):
    with pytest.raises(ConfigurationError, match="max_norm"):
        opj.clip_by_global_norm({"w": jnp.ones(2)}, c)
    with pytest.raises(ConfigurationError, match="max_norm"):
        opj.clipped_mean_grad_linear({"w": [1.0], "b": 0.0}, [[1.0]], [0.0], c)


@pytest.mark.parametrize("c", [True, "1.0", None, jnp.ones(2), 1 + 0j])
def test_max_norm_of_wrong_type_is_an_input_type_error(c):
    with pytest.raises(InputTypeError, match="max_norm"):
        opj.clip_by_global_norm({"w": jnp.ones(2)}, c)


def test_max_norm_shape_is_checked_under_jit():
    with pytest.raises(InputTypeError, match="scalar"):
        jax.jit(opj.clip_by_global_norm)({"w": jnp.ones(2)}, jnp.ones(2))


class _FakeDPResult(DPOutput):
    pass


@pytest.mark.parametrize(
    "tree",
    [{"w": "1.0"}, {"w": object()}, _FakeDPResult(), {"w": _FakeDPResult()}],
    ids=["string-leaf", "object-leaf", "dp-output", "dp-output-leaf"],
)
def test_bad_leaves_are_input_type_errors(tree):
    with pytest.raises(InputTypeError):
        opj.clip_by_global_norm(tree, 1.0)


def test_torch_tensor_leaf_is_refused_with_its_path():
    torch = pytest.importorskip("torch")
    with pytest.raises(InputTypeError, match=r"\['w'\].*Tensor"):
        opj.clip_by_global_norm({"w": torch.ones(2)}, 1.0)


@pytest.mark.parametrize(
    "params, x, y, error",
    [
        ({"w": [1.0]}, [[1.0]], [0.0], InputTypeError),
        ({"w": [1.0], "b": 0.0, "c": 1.0}, [[1.0]], [0.0], InputTypeError),
        ([[1.0], 0.0], [[1.0]], [0.0], InputTypeError),
        ({"w": [[1.0]], "b": 0.0}, [[1.0]], [0.0], InputTypeError),
        ({"w": [1.0], "b": [0.0]}, [[1.0]], [0.0], InputTypeError),
        ({"w": [1.0], "b": 0.0}, [1.0], [0.0], InputTypeError),
        ({"w": [1.0], "b": 0.0}, [[1.0]], [[0.0]], InputTypeError),
        ({"w": [1.0], "b": 0.0}, [[1.0], [2.0, 3.0]], [0.0, 1.0], InputTypeError),
        ({"w": [1.0], "b": 0.0}, [["a"]], [0.0], InputTypeError),
        ({"w": [1.0, 2.0], "b": 0.0}, [[1.0]], [0.0], ConfigurationError),
        ({"w": [1.0], "b": 0.0}, [[1.0], [2.0]], [0.0], ConfigurationError),
    ],
    ids=[
        "missing-b", "extra-key", "not-a-mapping", "w-2d", "b-1d", "x-1d", "y-2d", "ragged-x",
        "string-x", "D-mismatch", "N-mismatch",
    ],
)
def test_linear_structure_errors(params, x, y, error):
    with pytest.raises(error):
        opj.clipped_mean_grad_linear(params, x, y, 1.0)
    if x == [["a"]]:
        return  # jax.jit itself refuses a string argument before the function runs
    with pytest.raises(error):  # shapes are static, so jit checks them too
        jax.jit(opj.clipped_mean_grad_linear)(params, x, y, 1.0)


# --- Packaging ----------------------------------------------------------------------------------


def test_module_imports_the_real_jax():
    assert opj.jax is jax and opj.jnp is jnp
    assert hasattr(opj.jax, "jit")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def test_importing_without_jax_gives_an_install_hint():
    proc = _run(
        """
        import sys
        sys.modules["jax"] = None  # makes `import jax` raise ImportError
        try:
            import opake_compile.jax
        except ImportError as err:
            print("MESSAGE:", err)
        else:
            raise SystemExit("imported without JAX")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install" in proc.stdout and "opake-compile[jax]" in proc.stdout


def test_the_rest_of_the_library_never_imports_jax():
    proc = _run(
        """
        import importlib, pkgutil, sys
        import opake_compile
        names = sorted(
            m.name for m in pkgutil.walk_packages(opake_compile.__path__, "opake_compile.")
            if m.name != "opake_compile.jax"
        )
        for name in names:
            importlib.import_module(name)
        loaded = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib")))
        print(len(names), "modules imported")
        assert not loaded, loaded
        """
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
