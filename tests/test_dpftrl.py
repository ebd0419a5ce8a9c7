"""DP-FTRL: strategies, streaming correlated noise, samplers, accounting, DPOptimizer(noise=)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import opake_compile as opake
from opake_compile import accounting as acc
from opake_compile import dpftrl
from opake_compile.dpsgd._types import ClippedPytree
from opake_compile.dpsgd.noise import gaussian_noise
from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError, PrivacyBudgetExhaustedError
from opake_compile.sampling import BallsInBinsSampler, CyclicPoissonSampler, PoissonSampler, SequentialBatchSampler

N_STEPS = 12


def _strategies(n=N_STEPS):
    return [
        dpftrl.identity_strategy(n),
        dpftrl.band_mf_strategy(n, 3),
        dpftrl.blt_strategy(n, 2, restarts=2),
        dpftrl.bisr_strategy(n, 4),
        dpftrl.lambda_cgd_strategy(n),
    ]


STRATEGIES = _strategies()
IDS = [s.name for s in STRATEGIES]


def _clipped(grads, c=1.0, params=None, normalize_by=None):
    # Fresh tensors: a ClippedPytree keeps the norm and normalisation its sums were made with.
    grads = {k: v.clone() for k, v in grads.items()} if isinstance(grads, dict) else grads
    return ClippedPytree(grads=grads, clipping_norm=c, per_example_norms=torch.zeros(0), num_examples=0,
                         parameters=params, normalize_by=normalize_by)


def _reference_z(key, shapes, steps, dtype=torch.float64):
    """Z_t drawn as gaussian_noise draws them: split the key, one generator per draw."""
    zs = []
    for _ in range(steps):
        key, dk = opake.random.split(key, 2)
        g = opake.random.generator_from_key(dk)
        zs.append(torch.cat([torch.randn(s, generator=g, dtype=dtype).flatten() for s in shapes]))
    return torch.stack(zs).numpy()


# ----------------------------------------------------------------------------- strategies
@pytest.mark.parametrize("s", STRATEGIES, ids=IDS)
def test_strategy_is_normalised_lower_triangular_and_inverse_is_exact(s):
    m, inv = s.matrix(), s.inverse_matrix()
    assert np.allclose(np.triu(m, 1), 0)
    assert np.linalg.norm(m, axis=0).max() == pytest.approx(1.0, rel=1e-12)
    np.testing.assert_allclose(inv @ m, np.eye(s.n), atol=1e-12)
    assert s.sensitivity() == 1.0
    with pytest.raises(AttributeError):
        s.n = 3  # immutable


def test_bandmf_and_blt_beat_dpsgd_and_optimiser_improves_its_start():
    n = 64
    ident = dpftrl.identity_strategy(n).mean_squared_error()
    band = dpftrl.band_mf_strategy(n, 4)
    start = dpftrl.band_mf_strategy(n, 4, max_iterations=0)
    assert band.mean_squared_error() < start.mean_squared_error() * (1 - 1e-3)
    assert band.mean_squared_error() < 0.5 * ident
    assert dpftrl.blt_strategy(n, 2).mean_squared_error() < band.mean_squared_error()
    assert band.num_buffers == 3 and dpftrl.lambda_cgd_strategy(n).num_buffers == 0


def test_strategy_argument_errors():
    with pytest.raises(ConfigurationError):
        dpftrl.band_mf_strategy(4, 5)
    with pytest.raises(ConfigurationError):
        dpftrl.lambda_cgd_strategy(10, 1.0)
    with pytest.raises(ConfigurationError):
        dpftrl.band_mf_strategy(10, 2, objective="median")
    with pytest.raises(InputTypeError):
        dpftrl.bisr_strategy(10.0, 2)
    with pytest.raises(ConfigurationError):
        STRATEGIES[1].sensitivity(3)  # participations without separation


@pytest.mark.parametrize("s", STRATEGIES, ids=IDS)
@pytest.mark.parametrize("k,b", [(2, 5), (3, 4), (4, 3)])
def test_sensitivity_bounds_every_participation_pattern(s, k, b):
    """Changing one example's gradients (norm <= 1) in <= k steps >= b apart changes M x by
    at most sens; the bound is attained when it is computed exactly."""
    rng = np.random.default_rng(k * 10 + b)
    m = s.matrix()
    sens = s.sensitivity(k, b)
    worst = 0.0
    for _ in range(300):
        steps, t = [], int(rng.integers(0, b))
        while len(steps) < k and t < s.n:
            steps.append(t)
            t += b + int(rng.integers(0, 3))
        g = rng.normal(size=(len(steps), 3))
        g /= np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1.0) * rng.uniform(1.0, 1.5, (len(steps), 1))
        delta = m[:, steps] @ g
        worst = max(worst, np.linalg.norm(delta))
    assert worst <= sens * (1 + 1e-12)
    coefs = s.strategy_coefs()
    if np.all(coefs >= 0) and np.all(np.diff(coefs) <= 0):  # exact: attained at 0, b, 2b, ... with equal gradients
        kk = min(k, -(-s.n // b))
        assert np.linalg.norm(m[:, [i * b for i in range(kk)]].sum(axis=1)) == pytest.approx(sens, rel=1e-12)


# ----------------------------------------------------------------------------- streaming noise
@pytest.mark.parametrize("s", STRATEGIES, ids=IDS)
def test_streaming_noise_equals_dense_inverse_times_z(s):
    sigma, c = 1.7, 0.6
    noise_fn, state = dpftrl.mf_gaussian_noise(s, sigma, opake.random.key(3))
    grads = {"a": torch.zeros(5, dtype=torch.float64), "b": torch.zeros(2, 3, dtype=torch.float64)}
    rows = []
    for _ in range(s.n):
        out, state = noise_fn(_clipped(grads, c), state)
        rows.append(torch.cat([out.grads["a"], out.grads["b"].flatten()]).numpy())
        assert state.buffers is None or all(len(b) == s.num_buffers for b in state.buffers)
    z = _reference_z(opake.random.key(3), [(5,), (2, 3)], s.n)
    ref = sigma * c * (s.inverse_matrix() @ z)
    np.testing.assert_allclose(np.stack(rows), ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    with pytest.raises(ConfigurationError, match="past the"):
        noise_fn(_clipped(grads, c), state)


def test_identity_strategy_is_bit_for_bit_gaussian_noise():
    s = dpftrl.identity_strategy(6)
    mf_fn, mf_state = dpftrl.mf_gaussian_noise(s, 1.3, opake.random.key(9))
    g_fn, g_state = gaussian_noise(1.3, opake.random.key(9))
    grads = {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(0)), "b": torch.ones(3, dtype=torch.bfloat16)}
    for normalize_by in (None, 7.0, None):
        a, mf_state = mf_fn(_clipped(grads, 0.8, normalize_by=normalize_by), mf_state)
        b, g_state = g_fn(_clipped(grads, 0.8, normalize_by=normalize_by), g_state)
        for k in grads:
            assert torch.equal(a.grads[k], b.grads[k])
        assert a.noise_std == b.noise_std
    assert mf_state.key == g_state.key


def _box_m_pvalue(samples: np.ndarray, cov: np.ndarray) -> float:
    """p-value of the likelihood-ratio test that zero-mean samples (rows) have covariance cov."""
    from scipy.stats import chi2

    d, p = samples.shape
    s = samples.T @ samples / d
    a = np.linalg.solve(cov, s)
    stat = d * (np.trace(a) - np.linalg.slogdet(a)[1] - p)
    return float(chi2.sf(stat, p * (p + 1) / 2))


@pytest.mark.parametrize("s", STRATEGIES[1:], ids=IDS[1:])
def test_noise_covariance_across_steps(s):
    """Each coordinate's noise over the steps is N(0, (sigma C)^2 M^-1 M^-T); the same test
    rejects DP-SGD's covariance (sigma C)^2 I."""
    n, d, sigma, c = 6, 20_000, 1.1, 0.5
    s = _small(s, n)
    noise_fn, state = dpftrl.mf_gaussian_noise(s, sigma, opake.random.key(11))
    rows = []
    for _ in range(n):
        out, state = noise_fn(_clipped({"w": torch.zeros(d, dtype=torch.float64)}, c), state)
        rows.append(out.grads["w"].numpy())
    y = np.stack(rows).T  # (d, n)
    inv = s.inverse_matrix()
    right = (sigma * c) ** 2 * inv @ inv.T
    assert _box_m_pvalue(y, right) > 1e-4
    assert _box_m_pvalue(y, (sigma * c) ** 2 * np.eye(n)) < 1e-8


def _small(s, n):
    return {
        "bandmf": lambda: dpftrl.band_mf_strategy(n, 3),
        "blt": lambda: dpftrl.blt_strategy(n, 2, restarts=1),
        "bisr": lambda: dpftrl.bisr_strategy(n, 3),
        "lambda-cgd": lambda: dpftrl.lambda_cgd_strategy(n, 0.7),
    }[s.name]()


def test_noise_refuses_bad_inputs():
    noise_fn, state = dpftrl.mf_gaussian_noise(STRATEGIES[1], 1.0, opake.random.key(0))
    with pytest.raises(InputTypeError):
        noise_fn({"w": torch.zeros(2)}, state)
    with pytest.raises(ConfigurationError):
        noise_fn(_clipped({"w": torch.zeros(2)}, math.inf), state)
    _, state = noise_fn(_clipped({"w": torch.zeros(2)}), state)
    with pytest.raises(ConfigurationError, match="buffers"):
        noise_fn(_clipped({"w": torch.zeros(3)}), state)
    with pytest.raises(InputTypeError):
        dpftrl.mf_gaussian_noise("bandmf", 1.0, opake.random.key(0))


# ----------------------------------------------------------------------------- samplers
def test_cyclic_poisson_sampler_groups_and_divisor():
    s = CyclicPoissonSampler(100, 0.5, bands=4, key=opake.random.key(1), steps=8)
    assert s.expected_batch_size == pytest.approx(12.5)
    groups = [s.group_of(i) for i in range(100)]
    assert len(np.bincount(groups)) == 4 and min(np.bincount(groups)) >= 10
    other = CyclicPoissonSampler(101, 0.5, bands=4, key=opake.random.key(1), steps=8)
    assert [other.group_of(i) for i in range(100)] == groups  # adding an example moves no other
    for epoch in range(2):
        for step, batch in enumerate(s):
            assert all(groups[i] == (epoch * 8 + step) % 4 for i in batch)
    assert not s.is_poisson and s.sampling == "cyclic_poisson"


def test_samplers_checkpoint_mid_epoch_and_refuse_other_config():
    for make in (
        lambda: CyclicPoissonSampler(60, 0.3, bands=3, key=opake.random.key(2), steps=6),
        lambda: SequentialBatchSampler(60, 9, key=opake.random.key(2)),
        lambda: BallsInBinsSampler(60, 5, key=opake.random.key(2)),
    ):
        a = make()
        it = iter(a)
        [next(it) for _ in range(3)]
        state = a.state_dict()
        rest = list(it) + list(a)
        b = make()
        b.load_state_dict(state)
        assert list(b) + list(b) == rest
    with pytest.raises(CheckpointError):
        CyclicPoissonSampler(60, 0.3, bands=2, key=opake.random.key(2), steps=6).load_state_dict(
            CyclicPoissonSampler(60, 0.3, bands=3, key=opake.random.key(2), steps=6).state_dict())


def test_sequential_and_balls_in_bins_partitions():
    s = SequentialBatchSampler(23, 5, key=opake.random.key(0))
    e1, e2 = list(s), list(s)
    assert e1 == e2 and len(e1) == 4 and all(len(b) == 5 for b in e1)
    assert len(set().union(*map(set, e1))) == 20 and s.expected_batch_size == 5.0
    bb = BallsInBinsSampler(50, 7, key=opake.random.key(0))
    for _ in range(2):
        epoch = list(bb)
        assert sorted(i for b in epoch for i in b) == list(range(50))
    assert bb.expected_batch_size == pytest.approx(50 / 7)


def test_cyclic_sampler_with_empty_collate_dataloader():
    from torch.utils.data import DataLoader, TensorDataset, default_collate

    ds = TensorDataset(torch.randn(40, 2))
    s = CyclicPoissonSampler(40, 0.02, bands=4, key=opake.random.key(5), steps=8)
    loader = DataLoader(ds, batch_sampler=s, collate_fn=opake.empty_collate(default_collate, example=ds[0]))
    sizes = [b[0].shape[0] for b in loader]
    assert len(sizes) == 8 and 0 in sizes


# ----------------------------------------------------------------------------- accounting
def test_mf_gaussian_and_mf_poisson_processes():
    band = dpftrl.band_mf_strategy(40, 4)
    assert acc.mf_gaussian(band, 2.0, participations=4, min_separation=10) == acc.gaussian(1.0)
    ident = dpftrl.identity_strategy(40)
    assert acc.mf_gaussian(ident, 2.0, participations=4, min_separation=1).epsilon_at(1e-5) == pytest.approx(
        (acc.gaussian(2.0) * 4).epsilon_at(1e-5), rel=1e-3)
    assert dpftrl.poisson(band, 1.0, 0.1, bands=4, steps=40) == acc.poisson(acc.gaussian(1.0), 0.1) * 10
    assert dpftrl.poisson(band, 1.0, 0.1, bands=5, steps=41 - 1) == acc.poisson(acc.gaussian(1.0), 0.1) * 8
    with pytest.raises(ConfigurationError, match="bands"):
        dpftrl.poisson(band, 1.0, 0.1, bands=3, steps=40)
    with pytest.raises(ConfigurationError, match="non-banded"):
        dpftrl.poisson(dpftrl.bisr_strategy(40, 3), 1.0, 0.1, bands=4, steps=40)


# ----------------------------------------------------------------------------- DPOptimizer
FAST = acc.Accountant("pld", value_discretization_interval=1e-3)


def _opt_with(noise, sampler, budget=None, lr=0.1):
    param = nn.Parameter(torch.zeros(10, dtype=torch.float64))
    opt = opake.DPOptimizer(torch.optim.SGD([param], lr=lr), sampler=sampler, noise=noise, budget=budget, accountant=FAST)
    return param, opt


def _run(opt, param, sampler, steps):
    done = 0
    while done < steps:
        for draw in sampler:  # one epoch per iter()
            g = torch.full((10,), float(len(draw)), dtype=torch.float64)
            opt.step(_clipped({"w": g}, 1.0, params={"w": param}), draw=draw)
            done += 1
            if done == steps:
                break


def test_optimizer_with_bandmf_and_cyclic_poisson_charges_amplified_process():
    band = dpftrl.band_mf_strategy(16, 4)
    sampler = CyclicPoissonSampler(80, 0.5, bands=4, key=opake.random.key(1), steps=8)
    param, opt = _opt_with(dpftrl.mf_gaussian_noise(band, 1.5, opake.random.key(2)), sampler)
    assert opt.expected_batch_size == 10.0 and opt.noise_multiplier == 1.5
    _run(opt, param, sampler, 6)
    assert opt.steps == 6 and opt.process == acc.poisson(acc.gaussian(1.5), 0.5) * 2
    assert opt.epsilon(1e-5) == pytest.approx((acc.poisson(acc.gaussian(1.5), 0.5) * 2).epsilon_at(1e-5, accountant=FAST), rel=1e-9)


def test_a_step_past_the_strategy_is_a_configuration_error_with_or_without_a_budget():
    # A newcomer's review: with a budget, the step past the strategy's n was reported as an
    # exhausted budget (epsilon 2.35 of 50 spent); without one, as a configuration error
    # numbered one lower. Both now name the strategy, counting steps from 1, and change nothing.
    for budget in (acc.epsilon_budget(50.0, 1e-5), None):
        sampler = SequentialBatchSampler(40, 10, key=opake.random.key(1))
        param, opt = _opt_with(dpftrl.mf_gaussian_noise(dpftrl.band_mf_strategy(8, 2), 2.0, opake.random.key(2)),
                               sampler, budget=budget)
        _run(opt, param, sampler, 8)
        before, eps = param.detach().clone(), opt.epsilon(1e-5)
        with pytest.raises(ConfigurationError, match=r"Step 9 is past the 8 steps the strategy"):
            _run(opt, param, sampler, 1)
        assert torch.equal(param.detach(), before) and opt.steps == 8 and opt.epsilon(1e-5) == eps


def test_optimizer_refuses_combinations_without_accounting():
    key = opake.random.key
    cyc = CyclicPoissonSampler(80, 0.5, bands=4, key=key(1), steps=8)
    with pytest.raises(ConfigurationError, match="Poisson sampler"):  # default Gaussian noise
        opake.DPOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), noise_multiplier=1.0, sampler=cyc, key=key(0))
    for strategy, sampler, match in [
        (dpftrl.blt_strategy(16, 1, restarts=1), cyc, "non-banded"),
        (dpftrl.band_mf_strategy(16, 5), cyc, "5 bands"),
        (dpftrl.band_mf_strategy(16, 2), PoissonSampler(80, 0.1, key=key(1)), "Monte Carlo"),
    ]:
        with pytest.raises(ConfigurationError, match=match):
            _opt_with(dpftrl.mf_gaussian_noise(strategy, 1.0, key(2)), sampler)
    with pytest.raises(ConfigurationError, match="key"):
        opake.DPOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), sampler=cyc, key=key(0),
                          noise=dpftrl.mf_gaussian_noise(dpftrl.identity_strategy(8), 1.0, key(2)))
    with pytest.raises(InputTypeError):
        _opt_with(gaussian_noise(1.0, key(2)), cyc)


def test_optimizer_identity_noise_equals_default_gaussian_path():
    key = opake.random.key
    params = []
    for noise in (None, "mf"):
        sampler = PoissonSampler(50, 0.2, key=key(4))
        param = nn.Parameter(torch.zeros(10, dtype=torch.float64))
        if noise is None:
            opt = opake.DPOptimizer(torch.optim.SGD([param], lr=0.1), noise_multiplier=1.2, sampler=sampler, key=key(6),
                                    accountant=FAST)
        else:
            opt = opake.DPOptimizer(torch.optim.SGD([param], lr=0.1), sampler=sampler, accountant=FAST,
                                    noise=dpftrl.mf_gaussian_noise(dpftrl.identity_strategy(10), 1.2, key(6)))
        _run(opt, param, sampler, 5)
        params.append(param.detach().clone())
        eps = opt.epsilon(1e-5)
    assert torch.equal(params[0], params[1])
    assert eps == pytest.approx((acc.poisson(acc.gaussian(1.2), 0.2) * 5).epsilon_at(1e-5, accountant=FAST), rel=1e-9)


def test_optimizer_sequential_batches_budget_and_checkpoint():
    key = opake.random.key
    strategy = dpftrl.blt_strategy(24, 2, participations=4, min_separation=6, restarts=1)

    def make(budget=None):
        sampler = SequentialBatchSampler(60, 10, key=key(1))
        param, opt = _opt_with(dpftrl.mf_gaussian_noise(strategy, 4.0, key(2)), sampler, budget=budget)
        return param, opt, sampler

    param, opt, sampler = make()
    _run(opt, param, sampler, 6)
    k1 = opt.epsilon(1e-5)
    assert k1 == pytest.approx(acc.mf_gaussian(strategy, 4.0).epsilon_at(1e-5, accountant=FAST), rel=1e-9)
    state = {"opt": opt.state_dict(), "sampler": sampler.state_dict(), "param": param.detach().clone()}
    _run(opt, param, sampler, 6)
    assert opt.epsilon(1e-5) > k1
    final = param.detach().clone()

    stepped = make()
    _run(stepped[1], stepped[0], stepped[2], 1)
    with pytest.raises(CheckpointError, match="charged 1 step"):
        stepped[1].load_state_dict(state["opt"])  # its own release would be forgotten
    param2, opt2, sampler2 = make()
    with torch.no_grad():
        param2.copy_(state["param"])
    opt2.load_state_dict(state["opt"])
    sampler2.load_state_dict(state["sampler"])
    assert opt2.noise_state.step == 6 and len(opt2.noise_state.buffers[0]) == 2
    _run(opt2, param2, sampler2, 6)
    assert torch.equal(param2.detach(), final)
    bad = dict(state["opt"], noise="mf_gaussian_noise(other)")
    with pytest.raises(CheckpointError):
        make()[1].load_state_dict(bad)

    # budget: the epsilon of 2 epochs fits, 3 do not
    eps2 = acc.mf_gaussian(strategy, 4.0, participations=2, min_separation=6).epsilon_at(1e-5, accountant=FAST)
    eps3 = acc.mf_gaussian(strategy, 4.0, participations=3, min_separation=6).epsilon_at(1e-5, accountant=FAST)
    param, opt, sampler = make(budget=acc.epsilon_budget((eps2 + eps3) / 2, 1e-5))
    assert opt.max_steps() == 12
    _run(opt, param, sampler, 12)
    before = param.detach().clone()
    with pytest.raises(PrivacyBudgetExhaustedError):
        _run(opt, param, sampler, 1)
    assert torch.equal(param.detach(), before) and opt.steps == 12


def test_optimizer_refuses_skipped_draws_with_correlated_noise():
    band = dpftrl.band_mf_strategy(16, 2)
    sampler = CyclicPoissonSampler(80, 0.5, bands=2, key=opake.random.key(1), steps=8)
    param, opt = _opt_with(dpftrl.mf_gaussian_noise(band, 1.0, opake.random.key(2)), sampler)
    it = iter(sampler)
    next(it)
    draw = next(it)
    zero = _clipped({"w": torch.zeros(10, dtype=torch.float64)}, params={"w": param})
    with pytest.raises(ConfigurationError, match="in order|one step per draw"):  # draw 0 was skipped
        opt.step(zero, draw=draw)
    assert opt.steps == 0
    # a draw out of the sampler's order (same group twice in a row) is refused
    sampler = CyclicPoissonSampler(80, 0.5, bands=2, key=opake.random.key(1), steps=8)
    param, opt = _opt_with(dpftrl.mf_gaussian_noise(band, 1.0, opake.random.key(2)), sampler)
    zero = _clipped({"w": torch.zeros(10, dtype=torch.float64)}, params={"w": param})
    opt.step(zero, draw=sampler.batch_at(0, 0))
    with pytest.raises(ConfigurationError, match="in order|already released|already charged"):
        opt.step(zero, draw=sampler.batch_at(0, 0))
    assert opt.steps == 1
    sampler = CyclicPoissonSampler(80, 0.5, bands=2, key=opake.random.key(1), steps=8)
    param, opt = _opt_with(dpftrl.mf_gaussian_noise(band, 1.0, opake.random.key(2)), sampler)
    sampler.batch_at(0, 0)
    with pytest.raises(ConfigurationError, match="name the draw"):
        opt.step(_clipped({"w": torch.zeros(10, dtype=torch.float64)}, params={"w": param}))
    assert opt.steps == 0


# ----------------------------------------------------------------------------- JAX-Privacy oracle
@pytest.fixture
def x64_jax():
    """JAX with 64-bit floats for the oracle, restored afterwards (the setting is global and
    other JAX tests check float32 behaviour)."""
    pytest.importorskip("jax_privacy")
    import jax

    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        yield jax
    finally:
        jax.config.update("jax_enable_x64", before)


def test_jax_privacy_oracle_bandmf_and_toeplitz_sensitivity_and_error(x64_jax):
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import toeplitz

    n, bands = 64, 4
    ours = dpftrl.band_mf_strategy(n, bands)
    theirs = toeplitz.optimize_banded_toeplitz(n, bands)
    their_loss = float(toeplitz.loss(theirs, n))
    assert ours.mean_squared_error() <= their_loss * (1 + 1e-6)
    assert ours.mean_squared_error() == pytest.approx(float(toeplitz.loss(jnp.asarray(ours.strategy_coefs()[:bands]), n)), rel=1e-9)
    for s in (ours, dpftrl.blt_strategy(n, 2, restarts=1), dpftrl.bisr_strategy(n, 5), dpftrl.lambda_cgd_strategy(n)):
        m = jnp.asarray(s.strategy_coefs())
        np.testing.assert_allclose(s.per_step_squared_error(), np.asarray(toeplitz.per_query_error(strategy_coef=m)), rtol=1e-9)
        for k, b in [(1, 1), (3, 16), (5, 10)]:
            if np.all(np.diff(s.strategy_coefs()) <= 0):
                assert s.sensitivity(k, b) ** 2 == pytest.approx(float(toeplitz.minsep_sensitivity_squared(m, b, k)), rel=1e-9)


def test_jax_privacy_oracle_blt_sensitivity_and_max_error(x64_jax):
    import jax.numpy as jnp
    from jax_privacy.matrix_factorization import buffered_toeplitz as bt

    n = 200
    s = dpftrl.blt_strategy(n, 2, restarts=1)
    params = dict(s.params)
    scale = s.numerator[0]  # m_0 after normalisation
    blt = bt.BufferedToeplitz.build(buf_decay=jnp.asarray(params["theta"]), output_scale=jnp.asarray(params["omega"]))
    assert float(bt.sensitivity_squared(blt, n)) * scale**2 == pytest.approx(1.0, rel=1e-9)
    inv = blt.inverse()
    assert float(bt.max_error(inv, n)) / scale**2 == pytest.approx(s.max_squared_error(), rel=1e-7)


def test_jax_privacy_oracle_amplified_bandmf_epsilon(x64_jax):
    import dp_accounting
    from jax_privacy.experimental import accounting as jpa

    sigma, steps, bands, q = 1.3, 100, 5, 0.2
    event = jpa.amplified_bandmf_event(sigma, steps, num_bands=bands, sampling_prob=q)
    theirs = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(1e-6)
    ours = dpftrl.poisson(dpftrl.band_mf_strategy(steps, bands), sigma, q, bands=bands, steps=steps).epsilon_at(1e-6)
    assert ours == pytest.approx(theirs, rel=1e-3)


def test_checkpointer_restores_correlated_noise_mid_epoch(tmp_path):
    def make():
        s = dpftrl.band_mf_strategy(20, 3)
        sampler = CyclicPoissonSampler(60, 0.5, bands=3, key=opake.random.key(1), steps=6)
        model = nn.Linear(2, 2, bias=False)
        opt = opake.DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sampler=sampler, accountant=FAST,
                                noise=dpftrl.mf_gaussian_noise(s, 1.0, opake.random.key(2)))
        return model, opt, sampler

    def run(model, opt, it, k):
        for _ in range(k):
            d = next(it)
            opt.step(_clipped({"weight": torch.ones(2, 2)}, params={"weight": model.weight}), draw=d)

    model, opt, sampler = make()
    it = iter(sampler)
    run(model, opt, it, 3)
    ck = opake.Checkpointer(tmp_path)
    ck.save(3, model=model, opt=opt, sampler=sampler)
    run(model, opt, it, 3)
    model2, opt2, sampler2 = make()
    assert ck.restore(model=model2, opt=opt2, sampler=sampler2) == 3
    run(model2, opt2, iter(sampler2), 3)
    assert torch.equal(model.weight, model2.weight) and opt2.noise_state.step == 6


def test_a_correlated_noise_state_resumes_only_under_the_sampler_it_was_saved_with():
    """The accountant charges the whole run under the sampler the optimizer holds. An optimizer
    state restored beside a fresh sampler of another scheme (same q and N), fast-forwarded past
    the saved steps, was charged as if the new pattern had drawn the steps already run: b = 2
    -> 6 reported epsilon 2.57 for a participation worth 5.75, and a new key alone let one
    example take part twice 1 step apart where b = 4 was charged (review). Refused; the same
    scheme and key, fast-forwarded the same way, resumes bit for bit."""
    from opake_compile.sampling import BMinSepSampler

    key = opake.random.key
    cases = [
        (lambda: BMinSepSampler(40, 0.5, 2, key(1)), lambda: BMinSepSampler(40, 0.5, 6, key(1)), "min_separation"),
        (lambda: BMinSepSampler(40, 0.5, 4, key(1)), lambda: BMinSepSampler(40, 0.5, 4, key(3)), "key"),
        (lambda: CyclicPoissonSampler(40, 0.5, 2, key(1), steps=12),
         lambda: CyclicPoissonSampler(40, 0.5, 4, key(1), steps=12), "bands"),
    ]

    def forever(sampler):  # epoch after epoch
        while True:
            yield from sampler

    def step(opt, param, draw):
        g = torch.full((10,), float(len(draw)), dtype=torch.float64)
        opt.step(_clipped({"w": g}, 1.0, params={"w": param}), draw=draw)

    for make_old, make_new, field in cases:
        strategy = dpftrl.band_mf_strategy(24, 2) if field == "bands" else dpftrl.blt_strategy(24, 2, restarts=1)
        noise = lambda: dpftrl.mf_gaussian_noise(strategy, 4.0, key(2))
        param, opt = _opt_with(noise(), make_old())
        draws = forever(opt.sampler)
        for _ in range(5):
            step(opt, param, next(draws))
        state, saved_param = opt.state_dict(), param.detach().clone()
        step(opt, param, next(draws))

        fresh_param, fresh = _opt_with(noise(), make_new())
        with pytest.raises(CheckpointError, match=f"sampler has {field}="):
            fresh.load_state_dict(state)
        assert fresh.steps == 0 and fresh.noise_state.step == 0  # nothing restored

        # The sampler it was saved with, built again and fast-forwarded: the same sixth step.
        again_param, again = _opt_with(noise(), make_old())
        with torch.no_grad():
            again_param.copy_(saved_param)
        again.load_state_dict(state)
        again_draws = forever(again.sampler)
        for _ in range(5):
            next(again_draws)
        step(again, again_param, next(again_draws))
        assert torch.equal(again_param.detach(), param.detach()) and again.steps == 6


def test_a_correlated_noise_state_without_its_samplers_scheme_is_refused():
    """A state from before the scheme was recorded cannot show which sampler it ran under."""
    from opake_compile.sampling import BMinSepSampler

    make = lambda: _opt_with(dpftrl.mf_gaussian_noise(dpftrl.band_mf_strategy(12, 2), 4.0, opake.random.key(2)),
                             BMinSepSampler(40, 0.5, 2, opake.random.key(1)))
    param, opt = make()
    draw = next(iter(opt.sampler))
    opt.step(_clipped({"w": torch.ones(10, dtype=torch.float64)}, 1.0, params={"w": param}), draw=draw)
    state = opt.state_dict()
    del state["sampler_scheme"]
    with pytest.raises(CheckpointError, match="does not record its sampler's scheme"):
        make()[1].load_state_dict(state)
    unstepped = make()[1]
    unstepped.load_state_dict(make()[1].state_dict())  # a state at step 0 charged nothing yet


# ------------------------------------------------------- what a review found (correlated noise)
def test_the_mechanisms_configuration_cannot_change_after_it_is_accounted():
    """``fn.noise_multiplier = 0.05`` after the optimizer was built cut the noise 80-fold while
    the accountant kept charging sigma = 4 (epsilon 0.93 reported where one step spent ~284)."""
    strategy = dpftrl.band_mf_strategy(10, 3)
    fn, state = dpftrl.mf_gaussian_noise(strategy, 4.0, opake.random.key(2))
    for name, value in (("noise_multiplier", 0.05), ("strategy", dpftrl.band_mf_strategy(10, 2))):
        with pytest.raises(ConfigurationError, match=f"MFGaussianNoise.{name} is fixed"):
            setattr(fn, name, value)
    assert fn.noise_multiplier == 4.0 and fn.strategy is strategy


def test_one_noise_pair_or_key_object_for_two_optimizers_is_refused():
    """Two optimizers built from one ``mf_gaussian_noise(...)`` pair (or one key object) add the
    same noise: the difference of their releases on [1, 0, 0, 0] and [0, 0, 0, 0] was exactly
    [1, 0, 0, 0]. Refused; an optimizer that is gone frees its key."""
    noise = dpftrl.mf_gaussian_noise(dpftrl.band_mf_strategy(10, 3), 5.0, opake.random.key(2))
    first = _opt_with(noise, SequentialBatchSampler(60, 10, key=opake.random.key(1)))
    with pytest.raises(ConfigurationError, match="already used by another DPOptimizer"):
        _opt_with(noise, SequentialBatchSampler(60, 10, key=opake.random.key(1)))
    k = opake.random.key(3)
    make = lambda: opake.DPOptimizer(
        torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=1.0), noise_multiplier=1.0,
        sampler=PoissonSampler(10, 0.5, key=opake.random.key(4)), key=k,
    )
    held = make()
    with pytest.raises(ConfigurationError, match="already used by another DPOptimizer"):
        make()
    del held
    import gc

    gc.collect()
    assert make().steps == 0
    assert first[1].steps == 0


def test_a_second_device_draws_its_own_stream():
    """One generator per device, seeded alike, gave leaves of one shape on two GPUs the same
    noise (their difference noise-free). The first device keeps the key's stream; each other
    device folds in its position (shown with two distinct CPU device objects)."""
    gen = opake.random.device_generators(opake.random.key(5))
    a = torch.randn(1000, generator=gen(torch.device("cpu")))
    b = torch.randn(1000, generator=gen(torch.device("cpu", 0)))
    same = torch.randn(1000, generator=opake.random.generator_from_key(opake.random.key(5)))
    assert torch.equal(a, same) and not torch.equal(a, b)
    assert gen(torch.device("cpu")) is gen(torch.device("cpu"))


def test_a_budget_assigned_later_holds_with_correlated_noise():
    """``max_steps()`` of the correlated noise was computed once: a tighter budget assigned
    mid-run was ignored (9 more steps to epsilon 2.77 under a 0.5 budget). It is checked as at
    construction and recomputed."""
    strategy = dpftrl.blt_strategy(24, 2, participations=4, min_separation=6, restarts=1)
    sampler = SequentialBatchSampler(60, 10, key=opake.random.key(1))
    param, opt = _opt_with(dpftrl.mf_gaussian_noise(strategy, 4.0, opake.random.key(2)), sampler, budget=acc.epsilon_budget(50.0, 1e-5))
    loose = opt.max_steps()
    opt.budget = acc.epsilon_budget(1e-3, 1e-5)
    assert opt.max_steps() == 0 < loose
    with pytest.raises(PrivacyBudgetExhaustedError):
        _run(opt, param, sampler, 1)
    with pytest.raises(ConfigurationError, match="at least 1/N"):
        opt.budget = acc.epsilon_budget(1.0, 0.5)


def test_a_strategy_that_is_not_normalised_is_refused():
    """The accounting charges sensitivity 1 per participation: a hand-built M with column norm
    2.24 was charged epsilon 1.99 where 4.98 was spent; a BLT stretched past the steps it was
    normalised for (``replace(n=200)`` of one built for 20) has norm 1.001. Both are refused; a
    shorter horizon (norm below 1) is kept."""
    import dataclasses

    from opake_compile.dpftrl.strategies import Strategy

    with pytest.raises(ConfigurationError, match=r"largest column norm of M over n=10 steps is 2.23607"):
        Strategy("bandmf", 10, (2.0, 1.0), (1.0,))
    blt = dpftrl.blt_strategy(20, 2)
    with pytest.raises(ConfigurationError, match=r"n=200 steps is 1.00"):
        dataclasses.replace(blt, n=200)
    assert dataclasses.replace(blt, n=10).n == 10


def test_a_noise_state_an_optimizer_holds_or_used_is_refused_to_anyone_else():
    """``noise_fn(other_sum, opt.noise_state)`` drew the optimizer's next noise, and the pair the
    optimizer was built with its first (review): two releases with one noise, their difference
    noiseless. The mechanism refuses such states; a refused construction marks nothing, and a
    user's own pair keeps the JAX-style semantics (same state, same noise)."""
    key = opake.random.key
    fn, first_state = dpftrl.mf_gaussian_noise(dpftrl.band_mf_strategy(12, 2), 4.0, key(2))
    with pytest.raises(ConfigurationError):  # not a Poisson-like sampler for this strategy: refused
        _opt_with((fn, first_state), PoissonSampler(40, 0.5, key=key(1)))
    fn(_clipped({"w": torch.zeros(10, dtype=torch.float64)}), first_state)  # still the user's

    fn, state = dpftrl.mf_gaussian_noise(dpftrl.band_mf_strategy(12, 2), 4.0, key(3))
    param, opt = _opt_with((fn, state), SequentialBatchSampler(60, 10, key=key(1)))
    other = {"w": torch.ones(10, dtype=torch.float64)}
    for held in (opt.noise_state, state):
        with pytest.raises(ConfigurationError, match="belongs to a DPOptimizer"):
            fn(_clipped(other), held)
    _run(opt, param, opt.sampler, 2)
    for held in (opt.noise_state, state):
        with pytest.raises(ConfigurationError, match="belongs to a DPOptimizer"):
            fn(_clipped(other), held)
    restored_param, restored = _opt_with(dpftrl.mf_gaussian_noise(dpftrl.band_mf_strategy(12, 2), 4.0, key(3)),
                                         SequentialBatchSampler(60, 10, key=key(1)))
    restored.load_state_dict(opt.state_dict())
    with pytest.raises(ConfigurationError, match="belongs to a DPOptimizer"):
        fn(_clipped(other), restored.noise_state)
