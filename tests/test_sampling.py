"""Tests for opake_compile.sampling.PoissonSampler.

The statistical tests use fixed keys, so they are deterministic; their thresholds (p > 1e-3,
|z| < 5) are what a correct Poisson sampler passes with overwhelming probability for any key,
and each test also checks that its criterion rejects a wrong distribution.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader, TensorDataset, default_collate

from opake_compile import random as oprandom
from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError
from opake_compile.functional import empty_collate
from opake_compile.sampling import PoissonSampler

P_MIN = 1e-3


def _masks(batches, n):
    m = np.zeros((len(batches), n), dtype=bool)
    for t, b in enumerate(batches):
        m[t, b] = True
    return m


def _binomial_gof_pvalue(sizes, n, q):
    """Chi-square goodness of fit of observed sizes to Binomial(n, q), tails pooled so every
    bin expects >= 5 observations."""
    sizes = np.asarray(sizes)
    t = len(sizes)
    dist = stats.binom(n, q)
    lo, hi = int(dist.ppf(1e-4)), int(dist.isf(1e-4))
    edges = list(range(lo, hi + 1))
    # Merge bins from both ends until each expects >= 5.
    probs = [dist.cdf(lo)] + [dist.pmf(k) for k in edges[1:-1]] + [dist.sf(edges[-2])]
    counts = [np.sum(sizes <= lo)] + [np.sum(sizes == k) for k in edges[1:-1]] + [np.sum(sizes > edges[-2])]
    merged_p, merged_c, acc_p, acc_c = [], [], 0.0, 0
    for p, c in zip(probs, counts):
        acc_p += p
        acc_c += c
        if acc_p * t >= 5:
            merged_p.append(acc_p)
            merged_c.append(acc_c)
            acc_p, acc_c = 0.0, 0
    merged_p[-1] += acc_p
    merged_c[-1] += acc_c
    exp = np.array(merged_p) / np.sum(merged_p) * t
    return stats.chisquare(merged_c, exp).pvalue


def test_batch_sizes_are_binomial():
    n, q, steps = 500, 0.04, 3000
    sampler = PoissonSampler(n, q, key=oprandom.key(0), steps=steps)
    sizes = np.array([len(b) for b in sampler])
    assert len(sizes) == steps
    assert _binomial_gof_pvalue(sizes, n, q) > P_MIN
    # Mean and variance within 5 standard errors / 15 %.
    mean, var = n * q, n * q * (1 - q)
    assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / steps)
    assert abs(sizes.var(ddof=1) / var - 1) < 0.15
    # The criterion rejects a wrong rate and fixed-size (shuffling) batches.
    assert _binomial_gof_pvalue(sizes, n, q * 1.15) < P_MIN
    assert _binomial_gof_pvalue(np.full(steps, int(mean)), n, q) < P_MIN
    assert sizes.min() >= 0 and len(set(sizes.tolist())) > 10


def test_each_index_is_included_with_probability_q():
    n, q, steps = 200, 0.1, 3000
    m = _masks(list(PoissonSampler(n, q, key=oprandom.key(1), steps=steps)), n)
    counts = m.sum(axis=0)
    expected, sd = steps * q, math.sqrt(steps * q * (1 - q))
    assert np.all(np.abs(counts - expected) < 5 * sd), (counts.min(), counts.max())
    chi2 = np.sum((counts - expected) ** 2 / (steps * q * (1 - q)))
    assert stats.chi2.sf(chi2, df=n) > P_MIN
    # The criterion can fail: indices with rate 1.2 q in one half are rejected.
    skewed = counts.astype(float).copy()
    skewed[: n // 2] *= 1.2
    assert stats.chi2.sf(np.sum((skewed - expected) ** 2 / (steps * q * (1 - q))), df=n) < P_MIN


def test_inclusions_are_independent_across_steps_and_indices():
    n, q, steps = 300, 0.2, 2000
    m = _masks(list(PoissonSampler(n, q, key=oprandom.key(2), steps=steps)), n)
    pairs = m.shape[0] - 1

    def z_joint(a, b, count):
        # Fraction of (a, b) both included vs q**2, as a z-score.
        p = q * q
        return (np.mean(a & b) - p) / math.sqrt(p * (1 - p) / count)

    assert abs(z_joint(m[:-1], m[1:], pairs * n)) < 5  # same index, consecutive steps
    assert abs(z_joint(m[:, :-1], m[:, 1:], steps * (n - 1))) < 5  # neighbouring indices
    sizes = m.sum(axis=1).astype(float)
    r = np.corrcoef(sizes[:-1], sizes[1:])[0, 1]
    assert abs(r) < 5 / math.sqrt(steps)
    # The criterion detects a repeated batch.
    assert abs(z_joint(m[:-1], m[:-1], pairs * n)) > 5


def test_reproducible_from_key_and_epochs_differ():
    a = PoissonSampler(100, 0.2, key=oprandom.key(3))
    b = PoissonSampler(100, 0.2, key=oprandom.key(3))
    c = PoissonSampler(100, 0.2, key=oprandom.key(4))
    a0, a1 = list(a), list(a)
    assert a0 == list(b) and a1 == list(b)
    assert a0 != a1
    assert a0 != list(c)
    assert a.epoch == 2
    assert a.batch_at(1, 3) == a1[3]
    assert a.epoch == 2  # batch_at does not advance the counter


def test_iter_advances_epoch_eagerly():
    s = PoissonSampler(10, 0.5, key=oprandom.key(5))
    it1 = iter(s)
    it2 = iter(s)
    assert s.epoch == 2
    assert list(it1) == [s.batch_at(0, i) for i in range(s.steps)]
    assert list(it2) == [s.batch_at(1, i) for i in range(s.steps)]


def test_sampler_does_not_touch_global_rng():
    before = torch.get_rng_state()
    list(PoissonSampler(50, 0.3, key=oprandom.key(6)))
    assert torch.equal(before, torch.get_rng_state())


def test_batches_are_sorted_unique_in_range():
    for b in PoissonSampler(60, 0.5, key=oprandom.key(7), steps=50):
        assert b == sorted(set(b))
        assert all(isinstance(i, int) and 0 <= i < 60 for i in b)


def test_truncation_caps_and_keeps_uniform_subset():
    n, q, cap, steps = 100, 0.5, 40, 1500
    k = oprandom.key(8)
    plain = list(PoissonSampler(n, q, key=k, steps=steps))
    trunc = list(PoissonSampler(n, q, cap, key=k, steps=steps))
    capped = 0
    for p, t in zip(plain, trunc):
        assert len(t) == min(len(p), cap)
        assert set(t) <= set(p)
        if len(p) <= cap:
            assert t == p  # small batches are untouched
        else:
            capped += 1
    assert capped > steps // 2
    # Uniform subset: every index keeps the same inclusion frequency.
    counts = _masks(trunc, n).sum(axis=0)
    exp = counts.mean()
    chi2 = np.sum((counts - exp) ** 2 / exp)
    assert stats.chi2.sf(chi2, df=n - 1) > P_MIN
    # It can fail: keeping the smallest indices instead is detected.
    biased = _masks([p[:cap] for p in plain], n).sum(axis=0)
    assert stats.chi2.sf(np.sum((biased - biased.mean()) ** 2 / biased.mean()), df=n - 1) < P_MIN


def test_attributes_and_defaults():
    s = PoissonSampler(1000, 0.01, 25, key=oprandom.key(9))
    assert s.dataset_size == 1000 and s.sample_rate == 0.01
    assert s.truncated_batch_size == 25
    assert isinstance(s.expected_batch_size, float) and s.expected_batch_size == pytest.approx(10.0)
    assert s.steps == len(s) == 100
    assert s.key == oprandom.key(9)
    assert s.is_poisson is True and PoissonSampler.is_poisson is True
    for name in ("dataset_size", "sample_rate", "truncated_batch_size", "expected_batch_size", "steps", "key", "epoch"):
        with pytest.raises(AttributeError):
            setattr(s, name, 1)
    assert PoissonSampler(10, 0.3, key=s.key).steps == 3
    assert PoissonSampler(10, 0.4, key=s.key).steps == round(2.5) == 2
    assert PoissonSampler(10, 0.6, key=s.key).steps == 2
    assert PoissonSampler(10, 1.0, key=s.key).steps == 1
    assert PoissonSampler(10, 0.9, key=s.key, steps=7).steps == 7
    assert "PoissonSampler(" in repr(s)


def test_edge_rates():
    zero = PoissonSampler(10, 0.0, key=oprandom.key(10), steps=5)
    assert list(zero) == [[]] * 5
    one = PoissonSampler(10, 1.0, key=oprandom.key(10), steps=3)
    assert list(one) == [list(range(10))] * 3
    with pytest.raises(ConfigurationError, match="steps"):
        PoissonSampler(10, 0.0, key=oprandom.key(10))


@pytest.mark.parametrize(
    "args, kwargs, exc",
    [
        ((0, 0.1), {}, ConfigurationError),
        ((10.0, 0.1), {}, InputTypeError),
        ((10, -0.1), {}, ConfigurationError),
        ((10, 1.1), {}, ConfigurationError),
        ((10, float("nan")), {}, ConfigurationError),
        ((10, "0.1"), {}, InputTypeError),
        ((10, 0.1, 0), {}, ConfigurationError),
        ((10, 0.1, 2.5), {}, InputTypeError),
        ((10, 0.1), {"steps": 0}, ConfigurationError),
        ((10, 0.1), {"key": 0}, InputTypeError),
        ((10, 0.1), {"key": [1, 2, 3, 4]}, InputTypeError),
    ],
)
def test_validation(args, kwargs, exc):
    kwargs = {"key": oprandom.key(0), **kwargs}
    with pytest.raises(exc):
        PoissonSampler(*args, **kwargs)


def test_key_is_keyword_only():
    with pytest.raises(TypeError):
        PoissonSampler(10, 0.1, None, oprandom.key(0))  # type: ignore[misc]


def test_batch_at_validation():
    s = PoissonSampler(10, 0.5, key=oprandom.key(0))
    with pytest.raises(ConfigurationError):
        s.batch_at(0, 2)
    with pytest.raises(ConfigurationError):
        s.batch_at(-1, 0)


def test_state_dict_round_trip(tmp_path):
    k = oprandom.key(11)
    a = PoissonSampler(50, 0.2, 8, key=k)
    list(a)
    list(a)
    path = tmp_path / "sampler.pt"
    torch.save(a.state_dict(), path)
    b = PoissonSampler(50, 0.2, 8, key=k)
    b.load_state_dict(torch.load(path, weights_only=True))
    assert b.epoch == 2
    assert list(b) == list(a)


@pytest.mark.parametrize(
    "change",
    [
        {"dataset_size": 51},
        {"sample_rate": 0.25},
        {"truncated_batch_size": None},
        {"steps": 6},
        {"key": oprandom.key_to_state(oprandom.key(12))},
        {"key": [1, 2, 3]},
        {"version": 99},
        {"epoch": -1},
        {"epoch": 1.0},
    ],
)
def test_load_state_dict_rejects_mismatch(change):
    s = PoissonSampler(50, 0.2, 8, key=oprandom.key(11))
    state = {**s.state_dict(), **change}
    with pytest.raises(CheckpointError):
        s.load_state_dict(state)
    assert s.epoch == 0


def test_load_state_dict_rejects_missing_entries():
    s = PoissonSampler(50, 0.2, key=oprandom.key(11))
    state = s.state_dict()
    del state["epoch"]
    with pytest.raises(CheckpointError):
        s.load_state_dict(state)
    with pytest.raises(CheckpointError):
        s.load_state_dict([("epoch", 1)])


def test_dataloader_with_empty_collate():
    n = 20
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 3, generator=g), torch.arange(n))
    # Find (deterministically) a key whose first batch is non-empty and some later one empty.
    for seed in range(200):
        sampler = PoissonSampler(n, 0.05, key=oprandom.key(seed), steps=20)
        batches = [sampler.batch_at(0, i) for i in range(sampler.steps)]
        if batches[0] and any(not b for b in batches):
            break
    else:  # pragma: no cover
        pytest.fail("no suitable key found")
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=empty_collate(default_collate))
    assert len(loader) == 20
    seen_empty = 0
    for (x, y), idx in zip(loader, batches):
        assert x.shape == (len(idx), 3) and x.dtype == torch.float32
        assert y.tolist() == idx and y.dtype == torch.int64
        seen_empty += len(idx) == 0
    assert seen_empty >= 1
