"""DP-FTRL with b-min-separation and balls-in-bins batches: the sensitivity of their
participation patterns against brute force, their accounting, the optimizer's charge and
refusals, and the b-min-sep sampler."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import opake_compile as opake
from opake_compile import accounting as acc
from opake_compile import dpftrl
from opake_compile.dpsgd._types import ClippedPytree
from opake_compile.exceptions import CheckpointError, ConfigurationError, PrivacyBudgetExhaustedError
from opake_compile.sampling import BallsInBinsSampler, BMinSepSampler, CyclicPoissonSampler, PoissonSampler, SequentialBatchSampler

T = 9
FAST = acc.Accountant("pld", value_discretization_interval=1e-3)


def _strategies():
    return {
        "identity": dpftrl.identity_strategy(T),
        "bandmf3": dpftrl.band_mf_strategy(T, 3),
        "bandmf5": dpftrl.band_mf_strategy(T, 5),
        "lambda-cgd": dpftrl.lambda_cgd_strategy(T, 0.7),  # dense M
        "blt": dpftrl.blt_strategy(T, 2, restarts=1),  # dense M
    }


STRATS = _strategies()


def _worst(m: np.ndarray, patterns) -> float:
    """max over patterns of max ||M[:, p] g|| over gradients of norm <= 1: sqrt(sum |G|) is
    attained (equal gradients) when G = M^T M >= 0, checked here."""
    g = m.T @ m
    assert np.all(g >= -1e-15), "the brute force below is exact only for G >= 0"
    return max(math.sqrt(g[np.ix_(p, p)].sum()) for p in patterns if p)


def _epoch_patterns(t: int, s: int):
    return itertools.product(*[range(e * s, min(e * s + s, t)) for e in range(-(-t // s))])


def _minsep_patterns(t: int, b: int):
    """Every set of steps in [0, t) with pairwise gaps >= b (at most ceil(t / b) of them)."""
    out = []
    for r in range(1, -(-t // b) + 1):
        for p in itertools.combinations(range(t), r):
            if all(y - x >= b for x, y in zip(p, p[1:])):
                out.append(list(p))
    return out


@pytest.mark.parametrize("name", list(STRATS))
@pytest.mark.parametrize("s", [1, 2, 3, 4])
def test_epoch_sensitivity_against_brute_force(name, s):
    strategy = STRATS[name]
    for steps in (5, 7, T):
        m = strategy.matrix(steps)
        worst = _worst(m, [list(p) for p in _epoch_patterns(steps, s)])
        sens = strategy.epoch_sensitivity(s, steps)
        assert sens >= worst * (1 - 1e-12)  # an upper bound, never an underestimate
        bands = strategy.bands
        if bands is not None and bands <= s + 1:  # identity, BandMF with few bands: exact
            assert sens == pytest.approx(worst, rel=1e-12)
        else:  # dense strategies: the bound for non-neighbouring epochs stays close
            assert sens <= worst * 1.06
    assert STRATS["identity"].epoch_sensitivity(4, T) == pytest.approx(math.sqrt(3), rel=1e-15)


@pytest.mark.parametrize("name", list(STRATS))
@pytest.mark.parametrize("b", [1, 2, 3, 5])
def test_b_min_sep_charge_against_brute_force(name, b):
    """b_min_sep charges gaussian(sigma / sens) with sens the worst case over every pattern of
    gaps >= b in the steps taken (exact for these nonnegative, nonincreasing strategies)."""
    strategy = STRATS[name]
    m = strategy.matrix()
    coefs = strategy.strategy_coefs()
    for steps in (4, T):
        worst_prefix = _worst(m[:steps, :steps], _minsep_patterns(steps, b))
        proc = acc.b_min_sep(strategy, 2.0, b, steps=steps)
        sens = 2.0 / proc.noise_multiplier
        assert sens >= worst_prefix * (1 - 1e-12)
    if np.all(coefs >= 0) and np.all(np.diff(coefs) <= 0):  # full run: exact
        assert 2.0 / acc.b_min_sep(strategy, 2.0, b, steps=T).noise_multiplier == pytest.approx(
            _worst(m, _minsep_patterns(T, b)), rel=1e-12)


def test_processes_values_monotone_and_errors():
    band = dpftrl.band_mf_strategy(40, 4)
    ident = dpftrl.identity_strategy(40)
    assert acc.b_min_sep(band, 2.0, 10, steps=40) == acc.gaussian(1.0)  # 4 participations, disjoint rows
    assert acc.b_min_sep(band, 2.0, 10, steps=31) == acc.gaussian(1.0)
    assert acc.b_min_sep(band, 2.0, 10, steps=10) == acc.gaussian(2.0)
    assert acc.balls_in_bins(ident, 2.0, 10, steps=40) == acc.gaussian(1.0)  # 4 epochs: sqrt(4)
    assert acc.balls_in_bins(ident, 2.0, 10, steps=0).epsilon_at(1e-5) == 0.0
    # b = 10 with 4 bands: participations 1 step apart overlap, so balls-in-bins costs more
    assert acc.balls_in_bins(band, 2.0, 10, steps=40).noise_multiplier < 1.0
    for strategy in (band, dpftrl.lambda_cgd_strategy(40, 0.8)):
        for fn in (lambda t: acc.balls_in_bins(strategy, 3.0, 8, steps=t), lambda t: acc.b_min_sep(strategy, 3.0, 8, steps=t)):
            eps = [fn(t).epsilon_at(1e-5, accountant=FAST) for t in range(0, 41, 4)]
            assert all(x <= y for x, y in zip(eps, eps[1:])) and eps[-1] > eps[1] > 0
    with pytest.raises(ConfigurationError, match="exceeds"):
        acc.balls_in_bins(band, 1.0, 10, steps=41)
    with pytest.raises(ConfigurationError, match="exceeds"):
        acc.b_min_sep(band, 1.0, 10, steps=41)
    with pytest.raises(ConfigurationError):
        acc.b_min_sep(band, 1.0, 0, steps=4)
    assert dpftrl.b_min_sep is acc.b_min_sep and dpftrl.balls_in_bins is acc.balls_in_bins


# ----------------------------------------------------------------------------- sampler
def test_bminsep_sampler_separation_divisor_and_replay():
    s = BMinSepSampler(300, 0.4, 3, key=opake.random.key(1))
    assert s.steps == round(2 + 1 / 0.4) and s.sampling == "b_min_sep" and not s.is_poisson
    assert s.expected_batch_size == pytest.approx(300 * 0.4 / 1.8)
    last, sizes, draws = {}, [], []
    for epoch in range(8):
        for step, batch in enumerate(s):
            t = epoch * s.steps + step
            draws.append(list(batch))
            sizes.append(len(batch))
            for i in batch:
                assert t - last.get(i, -(10**9)) >= 3
                last[i] = t
    # warm start: stationary from step 0 (mean of the first steps near the divisor too)
    first = np.mean([len(BMinSepSampler(300, 0.4, 3, key=opake.random.key(k)).batch_at(0, 0)) for k in range(30)])
    sd = math.sqrt(s.expected_batch_size) / math.sqrt(30)
    assert abs(first - s.expected_batch_size) < 5 * sd
    assert abs(np.mean(sizes) - s.expected_batch_size) < 5 * math.sqrt(s.expected_batch_size / len(sizes)) * 2
    # random access replays the same stream
    assert s.batch_at(2, 1) == draws[2 * s.steps + 1] and s.batch_at(0, 0) == draws[0]
    # b = 1 is Poisson: every example eligible; q = 1 makes every example take part every b steps
    full = BMinSepSampler(40, 1.0, 4, key=opake.random.key(3), steps=4)
    epochs = [list(full) for _ in range(3)]
    for e in epochs:
        assert sorted(i for b in e for i in b) == list(range(40))
    assert epochs[0] == epochs[1] == epochs[2]


def test_new_samplers_checkpoint_round_trip_and_empty_collate():
    from torch.utils.data import DataLoader, TensorDataset, default_collate

    for make in (
        lambda: BMinSepSampler(60, 0.3, 3, key=opake.random.key(2), steps=5),
        lambda: BallsInBinsSampler(60, 5, key=opake.random.key(2)),
    ):
        a = make()
        list(a)
        it = iter(a)
        [next(it) for _ in range(2)]
        state = a.state_dict()
        rest = list(it) + list(a)
        b = make()
        b.load_state_dict(state)
        assert list(b) + list(b) == rest
    with pytest.raises(CheckpointError, match="min_separation"):
        BMinSepSampler(60, 0.3, 2, key=opake.random.key(2), steps=5).load_state_dict(
            BMinSepSampler(60, 0.3, 3, key=opake.random.key(2), steps=5).state_dict())
    ds = TensorDataset(torch.randn(30, 2))
    s = BMinSepSampler(30, 0.02, 4, key=opake.random.key(5), steps=8)
    loader = DataLoader(ds, batch_sampler=s, collate_fn=opake.empty_collate(default_collate, example=ds[0]))
    sizes = [b[0].shape[0] for b in loader]
    assert len(sizes) == 8 and 0 in sizes
    with pytest.raises(ConfigurationError):
        BMinSepSampler(30, 0.0, 4, key=opake.random.key(5), steps=8)


# ----------------------------------------------------------------------------- DPOptimizer


def _opt(strategy, sigma, sampler, budget=None):
    param = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = opake.DPOptimizer(torch.optim.SGD([param], lr=0.1), sampler=sampler, accountant=FAST, budget=budget,
                            noise=dpftrl.mf_gaussian_noise(strategy, sigma, opake.random.key(9)))
    return param, opt


def _step(opt, param, draw):
    g = torch.full((4,), 0.1 * len(draw), dtype=torch.float64)
    clipped = ClippedPytree(grads={"w": g}, clipping_norm=1.0, per_example_norms=torch.zeros(0),
                            num_examples=len(draw), parameters={"w": param})
    opt.step(clipped, draw=draw)


@pytest.mark.parametrize("kind", ["b_min_sep", "balls_in_bins"])
def test_optimizer_charges_new_samplers_and_respects_budget(kind):
    band = dpftrl.band_mf_strategy(24, 3)

    def sampler():
        if kind == "b_min_sep":
            return BMinSepSampler(80, 0.5, 4, key=opake.random.key(1), steps=6)
        return BallsInBinsSampler(80, 6, key=opake.random.key(1))

    def expected(t):
        if kind == "b_min_sep":
            return acc.b_min_sep(band, 2.0, 4, steps=t)
        return acc.balls_in_bins(band, 2.0, 6, steps=t)

    s = sampler()
    param, opt = _opt(band, 2.0, s)
    assert opt.expected_batch_size == s.expected_batch_size
    for epoch in range(2):
        for draw in s:
            _step(opt, param, draw)
    assert opt.steps == 12 and opt.process == expected(12)
    assert opt.epsilon(1e-5) == pytest.approx(expected(12).epsilon_at(1e-5, accountant=FAST), rel=1e-9)
    # out of order: the same draw twice is refused, nothing charged
    before = opt.steps
    with pytest.raises(ConfigurationError, match="in order|already charged"):
        _step(opt, param, s.batch_at(0, 0))
    assert opt.steps == before
    # budget: between the epsilon of 12 and 18 steps
    e12 = expected(12).epsilon_at(1e-5, accountant=FAST)
    e18 = expected(18).epsilon_at(1e-5, accountant=FAST)
    s = sampler()
    param, opt = _opt(band, 2.0, s, budget=acc.epsilon_budget((e12 + e18) / 2, 1e-5))
    allowed = opt.max_steps()
    assert 12 <= allowed < 18 and expected(allowed).epsilon_at(1e-5, accountant=FAST) <= (e12 + e18) / 2
    with pytest.raises(PrivacyBudgetExhaustedError):
        while True:
            for draw in s:
                _step(opt, param, draw)
    assert opt.steps == allowed


def test_optimizer_identity_with_balls_in_bins_and_refusals():
    ident = dpftrl.identity_strategy(20)
    s = BallsInBinsSampler(50, 5, key=opake.random.key(1))
    param, opt = _opt(ident, 1.5, s)
    for _ in range(3):
        for draw in s:
            _step(opt, param, draw)
    assert opt.process.noise_multiplier == pytest.approx(1.5 / math.sqrt(3), rel=1e-12)  # 3 plain Gaussian steps
    # the default Gaussian noise refuses them, naming the identity route
    for sampler in (s, BMinSepSampler(50, 0.5, 3, key=opake.random.key(1))):
        with pytest.raises(ConfigurationError, match="identity_strategy"):
            opake.DPOptimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), noise_multiplier=1.0,
                              sampler=sampler, key=opake.random.key(0))
    # the sequential sampler is charged as b-min-sep with b = steps per epoch
    seq = SequentialBatchSampler(60, 10, key=opake.random.key(1))
    band = dpftrl.band_mf_strategy(18, 3)
    param, opt = _opt(band, 2.0, seq)
    for draw in list(seq) + list(seq):
        _step(opt, param, draw)
    assert opt.process == acc.b_min_sep(band, 2.0, 6, steps=12)
    assert opt.process.noise_multiplier == pytest.approx(2.0 / math.sqrt(2), rel=1e-12)  # 3 bands <= 6: disjoint rows


@pytest.mark.parametrize(
    "make",
    [
        lambda n: PoissonSampler(n, 0.3, key=opake.random.key(1)),
        lambda n: CyclicPoissonSampler(n, 0.3, 3, opake.random.key(1), steps=6),
        lambda n: BMinSepSampler(n, 0.3, 3, opake.random.key(1)),
        lambda n: BMinSepSampler(n, 0.2, 5, opake.random.key(4)),
        lambda n: BallsInBinsSampler(n, 5, opake.random.key(1)),
    ],
    ids=["poisson", "cyclic", "bminsep3", "bminsep5", "balls_in_bins"],
)
def test_adding_an_example_leaves_every_other_examples_participation_unchanged(make):
    """The add-or-remove charge of these samplers assumes that example N (added) changes no one
    else's steps. ``BMinSepSampler``'s warm start drew every example's age after N + 1 uniforms
    from one stream, so adding an example moved the others' ages (4 of 20 steps differed at
    N = 50): its charge held for zero-out neighbours only (review)."""

    def steps_of_the_first(sampler, n, count):
        out, it = [], iter(sampler)
        while len(out) < count:
            try:
                draw = next(it)
            except StopIteration:
                it = iter(sampler)
                continue
            out.append(sorted(i for i in draw if i < n))
        return out

    for n in (50, 301):
        assert steps_of_the_first(make(n), n, 30) == steps_of_the_first(make(n + 1), n, 30)
