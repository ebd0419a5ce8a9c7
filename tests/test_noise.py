"""Tests for opake_compile.dpsgd.noise: the Gaussian mechanism on a ClippedPytree."""

from __future__ import annotations

import math

import numpy as np
import optree
import pytest
import torch
from scipy import stats

from opake_compile import random as oprandom
from opake_compile._validate import NotPrivateWarning
from opake_compile.dpsgd import ClippedPytree, NoisedPytree
from opake_compile.dpsgd.clipping import clipped_grad
from opake_compile.dpsgd.noise import NoiseState, add_gaussian_noise, gaussian_noise
from opake_compile.exceptions import ConfigurationError, InputTypeError

N_ENTRIES = 20_000


def _clipped(grads, c=0.7, normalize_by=None) -> ClippedPytree:
    """A new clipped sum holding copies of ``grads`` (each sum is released once, so the tests
    that noise the same values twice need two sums)."""
    return ClippedPytree(
        grads=optree.tree_map(torch.clone, grads), clipping_norm=c, per_example_norms=torch.zeros(0), num_examples=0, normalize_by=normalize_by
    )


def _noise_sample(sigma: float, c: float, seed: int = 0) -> np.ndarray:
    base = {"big": torch.full((N_ENTRIES // 2,), 3.0), "m": torch.full((100, N_ENTRIES // 200), -1.0)}
    noise_fn, state = gaussian_noise(sigma, oprandom.key(seed))
    noised, _ = noise_fn(_clipped(base, c), state)
    return np.concatenate([(noised.grads[k] - base[k]).reshape(-1).numpy() for k in base]).astype(np.float64)


@pytest.mark.parametrize("sigma, c", [(1.3, 0.7), (0.5, 4.0)])
def test_ks_accepts_right_std_and_rejects_wrong(sigma, c):
    z = _noise_sample(sigma, c)
    assert z.size == N_ENTRIES
    std = sigma * c
    # Fixed key: deterministic, so the thresholds cannot flake.
    assert stats.kstest(z, "norm", args=(0.0, std)).pvalue > 1e-3
    for wrong in (2 / 3, 1.5):
        assert stats.kstest(z, "norm", args=(0.0, wrong * std)).pvalue < 1e-6
    # Also reject a noise std computed from sigma alone (C ignored) and a shifted mean.
    assert stats.kstest(z, "norm", args=(0.0, sigma)).pvalue < 1e-6
    assert stats.kstest(z, "norm", args=(0.1 * std, std)).pvalue < 1e-6


def test_result_type_fields_and_dtypes():
    grads = {"a": torch.zeros(3, 2), "h": torch.zeros(4, dtype=torch.bfloat16), "d": torch.zeros(2, dtype=torch.float64)}
    noise_fn, state = gaussian_noise(2.0, oprandom.key(1))
    noised, new_state = noise_fn(_clipped(grads, c=0.5), state)
    assert isinstance(noised, NoisedPytree) and isinstance(new_state, NoiseState)
    assert noised.clipping_norm == 0.5 and noised.noise_multiplier == 2.0 and noised.noise_std == 1.0
    assert noised.normalize_by is None
    for k, g in grads.items():
        assert noised.grads[k].shape == g.shape and noised.grads[k].dtype == g.dtype
        assert torch.count_nonzero(noised.grads[k]) == g.numel()
    assert new_state.key != state.key


def test_same_key_same_noise_and_state_advances():
    grads = {"w": torch.zeros(1000)}
    noise_fn, state = gaussian_noise(1.0, oprandom.key(5))
    first, s1 = noise_fn(_clipped(grads), state)
    again, s1b = noise_fn(_clipped(grads), state)
    assert torch.equal(first.grads["w"], again.grads["w"]) and s1.key == s1b.key
    other_fn, other_state = gaussian_noise(1.0, oprandom.key(5))
    third, _ = other_fn(_clipped(grads), other_state)
    assert torch.equal(first.grads["w"], third.grads["w"])
    second, _ = noise_fn(_clipped(grads), s1)  # the advanced state draws fresh noise
    assert not torch.equal(first.grads["w"], second.grads["w"])


def test_split_keys_give_independent_noise():
    grads = {"w": torch.zeros(N_ENTRIES)}
    k1, k2 = oprandom.split(oprandom.key(9), 2)
    draws = []
    for k in (k1, k2):
        noise_fn, state = gaussian_noise(1.0, k)
        draws.append(noise_fn(_clipped(grads, c=1.0), state)[0].grads["w"].double().numpy())
    assert not np.array_equal(draws[0], draws[1])
    corr = np.corrcoef(draws[0], draws[1])[0, 1]
    assert abs(corr) < 4 / math.sqrt(N_ENTRIES)  # ~4 standard errors
    # Successive draws from one advancing state are independent too.
    noise_fn, state = gaussian_noise(1.0, oprandom.key(9))
    a, state = noise_fn(_clipped(grads, c=1.0), state)
    b, _ = noise_fn(_clipped(grads, c=1.0), state)
    assert abs(np.corrcoef(a.grads["w"].numpy(), b.grads["w"].numpy())[0, 1]) < 4 / math.sqrt(N_ENTRIES)


def test_leaves_get_independent_noise():
    grads = {"a": torch.zeros(N_ENTRIES // 2), "b": torch.zeros(N_ENTRIES // 2)}
    noise_fn, state = gaussian_noise(1.0, oprandom.key(2))
    noised, _ = noise_fn(_clipped(grads, c=1.0), state)
    assert abs(np.corrcoef(noised.grads["a"].numpy(), noised.grads["b"].numpy())[0, 1]) < 4 / math.sqrt(N_ENTRIES // 2)


def test_normalised_input_noise_added_to_sum_then_divided():
    def loss(p, x):
        return (p * x).sum()

    x = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    p = torch.zeros(50)
    summed, _ = clipped_grad(loss, batch_argnums=1, clipping_norm=0.5)[0](p, x)
    mean, _ = clipped_grad(loss, batch_argnums=1, clipping_norm=0.5, normalize_by=8)[0](p, x)
    noise_fn, state = gaussian_noise(1.0, oprandom.key(3))
    noised_sum, _ = noise_fn(summed, state)
    noised_mean, _ = noise_fn(mean, state)
    assert noised_mean.normalize_by == 8.0 and noised_sum.normalize_by is None
    # (sum + z) / n with the same z: the noise std on the mean is sigma * C / n, not sigma * C.
    torch.testing.assert_close(noised_mean.grads, noised_sum.grads / 8)
    z = (noised_mean.grads - mean.grads) * 8
    assert 0.3 < float(z.std()) < 0.7


def test_refuses_raw_trees_and_noised_pytrees():
    noise_fn, state = gaussian_noise(1.0, oprandom.key(0))
    noised, _ = noise_fn(_clipped({"w": torch.zeros(2)}), state)
    for bad in (noised, {"w": torch.zeros(2)}, torch.zeros(2), noised.grads):
        with pytest.raises(InputTypeError):
            noise_fn(bad, state)


def test_inf_clipping_norm_with_noise_is_refused():
    noise_fn, state = gaussian_noise(1.0, oprandom.key(0))
    with pytest.raises(ConfigurationError):
        noise_fn(_clipped({"w": torch.zeros(2)}, c=math.inf), state)
    # sigma = 0 (non-private, warned at construction) passes C = inf through unchanged.
    with pytest.warns(NotPrivateWarning):
        zero_fn, zstate = gaussian_noise(0.0, oprandom.key(0))
    grads = {"w": torch.tensor([1.0, 2.0])}
    out, _ = zero_fn(_clipped(grads, c=math.inf), zstate)
    assert torch.equal(out.grads["w"], grads["w"]) and out.noise_std == 0.0


@pytest.mark.parametrize("sigma", [-1.0, math.nan, math.inf])
def test_bad_noise_multiplier(sigma):
    with pytest.raises(ConfigurationError):
        gaussian_noise(sigma, oprandom.key(0))


def test_add_gaussian_noise_low_precision_draws_in_float32():
    tree = {"h": torch.zeros(N_ENTRIES, dtype=torch.bfloat16), "skip": 3}
    out = add_gaussian_noise(tree, 2.0, oprandom.key(4))
    assert out["skip"] == 3 and out["h"].dtype == torch.bfloat16
    z = out["h"].double().numpy()
    assert abs(z.std() - 2.0) < 0.05
    zero = add_gaussian_noise({"a": torch.ones(3)}, 0.0, oprandom.key(4))
    assert torch.equal(zero["a"], torch.ones(3))
