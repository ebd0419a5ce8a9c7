"""DP-FTRL properties: for any strategy parameters, the streamed noise is the dense M^-1 Z,
and no participation pattern beats the reported sensitivity."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import opake_compile as opake
from opake_compile import dpftrl
from opake_compile.dpsgd._types import ClippedPytree


def _strategy(kind, n, bands, lam):
    bands = min(bands, n)
    return {
        "bandmf": lambda: dpftrl.band_mf_strategy(n, bands, max_iterations=20),
        "bisr": lambda: dpftrl.bisr_strategy(n, bands),
        "lambda-cgd": lambda: dpftrl.lambda_cgd_strategy(n, lam),
    }[kind]()


@settings(max_examples=15, deadline=None)
@given(
    kind=st.sampled_from(["bandmf", "bisr", "lambda-cgd"]),
    n=st.integers(1, 10),
    bands=st.integers(1, 5),
    lam=st.floats(0.0, 0.95),
    seed=st.integers(0, 2**31 - 1),
)
def test_streamed_noise_is_dense_inverse_times_z(kind, n, bands, lam, seed):
    s = _strategy(kind, n, bands, lam)
    noise_fn, state = dpftrl.mf_gaussian_noise(s, 1.0, opake.random.key(seed))
    rows = []
    for _ in range(n):
        clipped = ClippedPytree(grads={"w": torch.zeros(3, dtype=torch.float64)}, clipping_norm=1.0,
                                per_example_norms=torch.zeros(0), num_examples=0)
        out, state = noise_fn(clipped, state)
        rows.append(out.grads["w"].numpy())
    key, zs = opake.random.key(seed), []
    for _ in range(n):
        key, dk = opake.random.split(key, 2)
        zs.append(torch.randn(3, generator=opake.random.generator_from_key(dk), dtype=torch.float64).numpy())
    ref = s.inverse_matrix() @ np.stack(zs)
    np.testing.assert_allclose(np.stack(rows), ref, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(ref).max()))


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["bandmf", "bisr", "lambda-cgd"]),
    n=st.integers(2, 16),
    bands=st.integers(1, 5),
    lam=st.floats(0.0, 0.95),
    k=st.integers(1, 5),
    b=st.integers(1, 8),
    data=st.data(),
)
def test_no_pattern_exceeds_the_sensitivity(kind, n, bands, lam, k, b, data):
    s = _strategy(kind, n, bands, lam)
    sens = s.sensitivity(k, b)
    steps, t = [], data.draw(st.integers(0, n - 1))
    while len(steps) < k and t < n:
        steps.append(t)
        t += b + data.draw(st.integers(0, 3))
    signs = np.array(data.draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=len(steps), max_size=len(steps))))
    delta = s.matrix()[:, steps] @ signs
    assert np.linalg.norm(delta) <= sens * (1 + 1e-12)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["bandmf", "bisr", "lambda-cgd"]),
    n=st.integers(1, 14),
    bands=st.integers(1, 5),
    lam=st.floats(0.0, 0.95),
    s=st.integers(1, 6),
    data=st.data(),
)
def test_no_one_per_epoch_pattern_exceeds_the_epoch_sensitivity(kind, n, bands, lam, s, data):
    """Balls-in-bins: one participation anywhere in each epoch of s steps (any gradients of
    norm <= 1) never moves the first T rows of M x by more than epoch_sensitivity(s, T)."""
    strat = _strategy(kind, n, bands, lam)
    t = data.draw(st.integers(1, n))
    sens = strat.epoch_sensitivity(s, t)
    steps = [data.draw(st.integers(e * s, min(e * s + s, t) - 1)) for e in range(-(-t // s))]
    g = np.array(data.draw(st.lists(st.floats(-1.0, 1.0), min_size=2 * len(steps), max_size=2 * len(steps)))).reshape(-1, 2)
    g /= np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1.0)
    delta = strat.matrix(t)[:, steps] @ g
    assert np.linalg.norm(delta) <= sens * (1 + 1e-12)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    q=st.floats(0.05, 1.0),
    b=st.integers(1, 6),
    steps=st.integers(1, 8),
    epochs=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_bminsep_sampler_keeps_the_separation_and_replays(n, q, b, steps, epochs, seed):
    s = opake.sampling.BMinSepSampler(n, q, b, key=opake.random.key(seed), steps=steps)
    last, stream = {}, []
    for e in range(epochs):
        for step, batch in enumerate(s):
            t = e * steps + step
            stream.append(list(batch))
            assert batch == sorted(set(batch)) and all(0 <= i < n for i in batch)
            for i in batch:
                assert t - last.get(i, -b) >= b
                last[i] = t
    t = seed % len(stream)
    assert s.batch_at(t // steps, t % steps) == stream[t]  # random access replays the stream


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 40), steps=st.integers(1, 8), seed=st.integers(0, 2**31 - 1))
def test_balls_in_bins_one_participation_per_epoch(n, steps, seed):
    s = opake.sampling.BallsInBinsSampler(n, steps, key=opake.random.key(seed))
    for _ in range(3):
        epoch = list(s)
        assert len(epoch) == steps and sorted(i for batch in epoch for i in batch) == list(range(n))
