"""What ``DPOptimizer`` charges: every release of a step, and one Poisson step per draw.

Two soundness bugs of the first optimizer (issue 13) are pinned here:

* the noisy count of adaptive clipping was a free release (charged as the gradient query
  alone);
* several sampler draws combined into one ``step`` were charged as one step at rate q.

Oracles: dp-accounting's own accountants fed the ``DpEvent`` that describes the mechanism
actually run (two Gaussian queries on one Poisson sample; k Poisson steps), never numbers taken
from the implementation under test.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import dp_accounting
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from torch.utils.data import TensorDataset

import opake_compile as opake
from opake_compile import accounting as acc
from opake_compile._validate import NotPrivateWarning
from opake_compile.dpsgd.clipping import adaptive_clipped_grad, clipped_grad
from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError, PrivacyBudgetExhaustedError
from opake_compile.dpsgd import ClippedPytree
from opake_compile.optim import DPOptimizer, accumulate
from opake_compile.sampling import PoissonSampler, draw_loader

DELTA = 1e-5


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, generator=g), torch.randn(n, generator=g)


def _loss(p, x, y):
    return 0.5 * ((x @ p["w"] + p["b"] - y) ** 2).mean()


def _params():
    return {"w": torch.zeros(3, requires_grad=True), "b": torch.zeros((), requires_grad=True)}


def _optimizer(params, sampler, sigma=1.0, **kw):
    return DPOptimizer(
        torch.optim.SGD(params.values(), lr=0.1), noise_multiplier=sigma, sampler=sampler, key=opake.random.key(7), **kw
    )


def _pld_direct(event, interval=1e-4):
    a = PLDAccountant(value_discretization_interval=interval)
    a.compose(event)
    return a.get_epsilon(DELTA)


def _rdp_direct(event):
    a = RdpAccountant()
    a.compose(event)
    return a.get_epsilon(DELTA)


# ------------------------------------------------------------------ adaptive clipping's count
COARSE = 1e-3  # PLD grid of these tests: pessimistic at any grid, and several times faster


def _adaptive_run(steps, *, sigma=1.0, sigma_b=0.8, q=0.1, n=100, accountant="coarse", budget=None):
    if accountant == "coarse":
        accountant = acc.Accountant("pld", value_discretization_interval=COARSE)
    x, y = _data(n)
    params = _params()
    sampler = PoissonSampler(n, q, key=opake.random.key(0))
    grad_fn, state = adaptive_clipped_grad(
        _loss, 0, batch_argnums=(1, 2), initial_clipping_norm=1.0, key=opake.random.key(1),
        expected_batch_size=q * n, count_noise_multiplier=sigma_b,
    )
    opt = _optimizer(params, sampler, sigma, accountant=accountant, budget=budget)
    it = iter(sampler)
    for _ in range(steps):
        idx = next(it)
        i = torch.as_tensor(idx, dtype=torch.long)
        clipped, state = grad_fn(params, x[i], y[i], state=state)
        opt.step(clipped)
    return opt, grad_fn, state, params, it, (x, y)


def test_adaptive_count_is_charged_pld():
    opt, *_ = _adaptive_run(3)
    sigma_eff = (1.0**-2 + 0.8**-2) ** -0.5  # two Gaussian queries, one sample (closed form)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(sigma_eff)), 3
    )
    assert opt.epsilon(DELTA) == pytest.approx(_pld_direct(event, COARSE), rel=1e-9)
    gradient_only = _pld_direct(
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 3),
        COARSE,
    )
    assert opt.epsilon(DELTA) > 1.5 * gradient_only


def test_adaptive_count_is_charged_rdp_against_composed_events():
    # dp-accounting's RDP accountant composes the two Gaussian events on one Poisson sample itself.
    opt, *_ = _adaptive_run(4, accountant="rdp")
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            0.1, dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(1.0), dp_accounting.GaussianDpEvent(0.8)])
        ),
        4,
    )
    assert opt.epsilon(DELTA) == pytest.approx(_rdp_direct(event), rel=1e-9)


def test_adaptive_budget_guard_counts_the_count():
    per_step = acc.poisson(acc.adaclip(1.0, 0.8), 0.1, dataset_size=100)
    coarse = acc.Accountant("pld", value_discretization_interval=COARSE)
    budget = acc.epsilon_budget(coarse.epsilon(per_step * 3, DELTA) * 1.0001, DELTA)
    opt, grad_fn, state, params, it, (x, y) = _adaptive_run(3, budget=budget)
    idx = next(it)
    i = torch.as_tensor(idx, dtype=torch.long)
    clipped, refused_state = grad_fn(params, x[i], y[i], state=state)
    before = {k: v.detach().clone() for k, v in params.items()}
    with pytest.raises(PrivacyBudgetExhaustedError):
        opt.step(clipped)
    assert opt.steps == 3 and all(torch.equal(before[k], params[k]) for k in params)
    # The refused step's noisy count was not charged: the clipping norm computed from it is
    # not usable either.
    with pytest.raises(ConfigurationError, match="has not been released"):
        grad_fn(params, x[i], y[i], state=refused_state)


def _adaptive_fn(n=40, q=0.25):
    x, y = _data(n)
    params = _params()
    sampler = PoissonSampler(n, q, key=opake.random.key(0))
    grad_fn, state = adaptive_clipped_grad(
        _loss, 0, batch_argnums=(1, 2), initial_clipping_norm=1.0, key=opake.random.key(1),
        expected_batch_size=q * n, count_noise_multiplier=1.0,
    )
    return grad_fn, state, params, sampler, (x, y)


def _rows(data, idx):
    i = torch.as_tensor(idx, dtype=torch.long)
    return data[0][i], data[1][i]


def test_adaptive_results_from_one_state_are_released_once():
    """Two calls with one state (a retry) draw the same count noise: once one result is
    released, the other and its state are refused, and so is a third call with that state
    (a hostile review recovered the exact count difference from two such states, one of them
    from a never-released result, which the next call then accepted)."""
    grad_fn, s0, params, sampler, data = _adaptive_fn()
    opt = _optimizer(params, sampler)
    it = iter(sampler)
    d0, d1 = next(it), next(it)
    r1, s1 = grad_fn(params, *_rows(data, d1), state=s0)  # not the draw being stepped on
    r2, s2 = grad_fn(params, *_rows(data, d0), state=s0)
    assert s1.key == s2.key and s1.clipping_norm != s2.clipping_norm
    opt.step(r2, draw=d0)
    assert opt.steps == 1
    with pytest.raises(ConfigurationError, match="has not been released"):
        grad_fn(params, *_rows(data, d1), state=s1)
    with pytest.raises(ConfigurationError, match="already used"):
        grad_fn(params, *_rows(data, d1), state=s0)
    before = {k: v.detach().clone() for k, v in params.items()}
    with pytest.raises(ConfigurationError, match="same AdaptiveClipState was released"):
        opt.step(r1, draw=d1)
    assert opt.steps == 1 and all(torch.equal(before[k], params[k]) for k in params)
    r3, _ = grad_fn(params, *_rows(data, d1), state=s2)  # the released result's state: usable
    opt.step(r3, draw=d1)
    assert opt.steps == 2
    # The eager path's release (gaussian_noise) supersedes the same way.
    g2, t0, *_ = _adaptive_fn()
    a, _ = g2(params, *_rows(data, d0), state=t0)
    b, _ = g2(params, *_rows(data, d1), state=t0)
    noise_fn, ns = opake.dpsgd.gaussian_noise(1.0, opake.random.key(3))
    noise_fn(b, ns)
    with pytest.raises(ConfigurationError, match="same AdaptiveClipState was released"):
        noise_fn(a, ns)


def test_adaptive_result_without_its_count_is_refused_and_charges_nothing():
    """A result rebuilt around copies of its sums could drop the count's release and keep the
    receipt: the step charged the gradient alone and unlocked the next clipping norm (review)."""
    grad_fn, s0, params, sampler, data = _adaptive_fn()
    opt = _optimizer(params, sampler)
    d0 = next(iter(sampler))
    r, s1 = grad_fn(params, *_rows(data, d0), state=s0)
    stripped = dataclasses.replace(r, grads={k: v.clone() for k, v in r.grads.items()}, releases=())
    assert stripped.receipts == r.receipts and stripped.releases == ()
    with pytest.raises(ConfigurationError, match="not the count's release"):
        opt.step(stripped, draw=d0)
    assert opt.steps == 0
    with pytest.raises(ConfigurationError, match="has not been released"):
        grad_fn(params, *_rows(data, d0), state=s1)
    opt.step(r, draw=d0)  # the result itself: charged with its count
    assert opt.steps == 1 and "gaussian(1.0) | gaussian(1.0)" in repr(opt.process)
    copy_after = dataclasses.replace(r, grads={k: v.clone() for k, v in r.grads.items()})
    with pytest.raises(ConfigurationError, match="already released with another result"):
        opt.step(copy_after, draw=next(iter(sampler)))


def test_a_sum_is_released_once_by_gaussian_noise_or_the_optimizer():
    """gaussian_noise (uncharged, the eager path) and DPOptimizer.step each release a sum; the
    same sum through both (or either twice) is two noisy views of one sample under at most one
    charge: refused, whichever comes second (review: both were accepted)."""
    x, y = _data(40)
    params = _params()
    sampler = PoissonSampler(40, 0.25, key=opake.random.key(0))
    opt = _optimizer(params, sampler)
    grad_fn, st = clipped_grad(_loss, 0, batch_argnums=(1, 2), clipping_norm=1.0)
    noise_fn, ns = opake.dpsgd.gaussian_noise(1.0, opake.random.key(3))
    it = iter(sampler)
    d0 = next(it)
    r0, _ = grad_fn(params, *_rows((x, y), d0), state=st)
    _, ns = noise_fn(r0, ns)
    with pytest.raises(ConfigurationError, match="already released"):
        opt.step(r0, draw=d0)
    with pytest.raises(ConfigurationError, match="already released"):
        noise_fn(r0, ns)
    assert opt.steps == 0
    r1, _ = grad_fn(params, *_rows((x, y), d0), state=st)
    opt.step(r1, draw=d0)
    with pytest.raises(ConfigurationError, match="already released"):
        noise_fn(r1, ns)
    with pytest.raises(ConfigurationError, match="already released"):
        noise_fn(accumulate([r1]), ns)


def test_the_eager_correlated_noise_function_releases_a_sum_once_too():
    """mf_gaussian_noise's noise function (the eager DP-FTRL path, shaped like gaussian_noise)
    noised one sum any number of times, before or after gaussian_noise or a DPOptimizer step
    (a review of the one-release registry)."""
    from opake_compile.dpftrl import mf_gaussian_noise
    from opake_compile.dpftrl.strategies import identity_strategy

    x, y = _data(40)
    params = _params()
    grad_fn, st = clipped_grad(_loss, 0, batch_argnums=(1, 2), clipping_norm=1.0)
    mf_fn, ms = mf_gaussian_noise(identity_strategy(10), 1.0, opake.random.key(5))
    noise_fn, ns = opake.dpsgd.gaussian_noise(1.0, opake.random.key(3))
    r, _ = grad_fn(params, x[:10], y[:10], state=st)
    _, ms2 = mf_fn(r, ms)
    with pytest.raises(ConfigurationError, match="already released"):
        mf_fn(r, ms2)
    with pytest.raises(ConfigurationError, match="already released"):
        noise_fn(r, ns)
    r2, _ = grad_fn(params, x[:10], y[:10], state=st)
    noise_fn(r2, ns)
    with pytest.raises(ConfigurationError, match="already released"):
        mf_fn(r2, ms2)


def test_sum_gradients_releases_the_local_sum_with_the_global_one(tmp_path):
    """In a process group, sum_gradients returns new tensors: stepping on them used to leave the
    local sum unreleased, so it could be reduced and stepped on again on a later draw, charged
    as a fresh step (review; gloo with one rank, in this process)."""
    import torch.distributed as dist

    from opake_compile.distributed import sum_gradients, sum_gradients_

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        x, y = (t.double() for t in _data(40))
        # float64: the eager sums of a float64 model are float64, and sum_gradients_ reduces only
        # float64 sums in place (test_distributed)
        params = {k: v.detach().double().requires_grad_() for k, v in _params().items()}
        sampler = opake.distributed.DistributedPoissonSampler(40, 0.5, key=opake.random.key(0))
        opt = _optimizer(params, sampler)
        grad_fn, st = clipped_grad(_loss, 0, batch_argnums=(1, 2), clipping_norm=1.0)
        it = iter(sampler)
        d0, d1 = next(it), next(it)
        r0, _ = grad_fn(params, *_rows((x, y), d0), state=st)
        opt.step(sum_gradients(r0), draw=d0)
        with pytest.raises(ConfigurationError, match="already released"):
            sum_gradients(r0)
        with pytest.raises(ConfigurationError, match="already released"):
            opt.step(r0, draw=d1)
        r1, _ = grad_fn(params, *_rows((x, y), d1), state=st)
        opt.step(sum_gradients_(r1), draw=d1)
        with pytest.raises(ConfigurationError, match="already released"):
            sum_gradients(r1)
        assert opt.steps == 2
    finally:
        dist.destroy_process_group()


def test_release_that_cannot_be_accounted_is_refused():
    n = 50
    x, y = _data(n)
    params = _params()
    sampler = PoissonSampler(n, 0.2, key=opake.random.key(0))
    opt = _optimizer(params, sampler)
    next(iter(sampler))  # the draw the steps below are charged for
    grad_fn, st = clipped_grad(_loss, 0, batch_argnums=(1, 2), clipping_norm=1.0)
    clipped, _ = grad_fn(params, x[:5], y[:5], state=st)
    with pytest.raises(ConfigurationError, match="cannot account"):
        opt.step(dataclasses.replace(clipped, releases=(acc.eps_delta(1.0, 1e-6),)))
    with pytest.raises(InputTypeError):
        opt.step(dataclasses.replace(clipped, releases=(0.4,)))
    assert opt.steps == 0
    # A private metric of the user's own, attached to the result, is charged with the step.
    opt.step(dataclasses.replace(clipped, releases=(acc.gaussian(2.0),)))
    assert opt.process == acc.poisson(acc.gaussian(1.0) | acc.gaussian(2.0), 0.2, dataset_size=n) * 1


def test_adaclip_checkpoint_keeps_the_charged_releases():
    opt, *_ = _adaptive_run(2)
    state = opt.state_dict()
    params = _params()
    fresh = _optimizer(
        params, PoissonSampler(100, 0.1, key=opake.random.key(0)),
        accountant=acc.Accountant("pld", value_discretization_interval=COARSE),
    )
    fresh.load_state_dict(state)
    assert fresh.steps == 2
    assert fresh.epsilon(DELTA) == pytest.approx(opt.epsilon(DELTA), rel=1e-12)
    bad = dict(state, runs=[[[0.8], 5]])
    with pytest.raises(CheckpointError):
        fresh.load_state_dict(bad)


# ------------------------------------------------------------------ several draws in one step
def _four_draw_setup(n=400, q=0.05):
    x, y = _data(n)
    params = _params()
    sampler = PoissonSampler(n, q, key=opake.random.key(3))
    grad_fn, st = clipped_grad(_loss, 0, batch_argnums=(1, 2), clipping_norm=1.0)

    def clip(idx):
        i = torch.as_tensor(idx, dtype=torch.long)
        return grad_fn(params, x[i], y[i], state=st)[0]

    return params, sampler, clip


def test_several_draws_in_one_step_are_refused():
    params, sampler, clip = _four_draw_setup()
    opt = _optimizer(params, sampler)
    it = iter(sampler)
    draws = [next(it) for _ in range(4)]
    parts = [clip(d) for d in draws]
    before = {k: v.detach().clone() for k, v in params.items()}
    with pytest.raises(ConfigurationError, match="draws"):
        opt.step(parts)  # the issue's reproduction: was accepted and charged as one step
    tagged = [dataclasses.replace(p, draw=d.id) for p, d in zip(parts, draws)]
    with pytest.raises(ConfigurationError, match="different Poisson draws"):
        opt.step(tagged)
    with pytest.raises(ConfigurationError, match="different Poisson draws"):
        accumulate(tagged)
    with pytest.raises(ConfigurationError, match="names draw"):
        opt.step(tagged[0], draw=draws[1])
    assert opt.steps == 0 and all(torch.equal(before[k], params[k]) for k in params)


def test_chunks_of_one_draw_are_one_step_and_skipped_draws_are_charged():
    params, sampler, clip = _four_draw_setup()
    opt = _optimizer(params, sampler)
    it = iter(sampler)
    first = next(it)
    half = len(first) // 2
    opt.step([clip(first[:half]), clip(first[half:])])  # physical chunks of one draw
    assert opt.steps == 1
    skipped = [next(it) for _ in range(2)]
    used = next(it)
    opt.step(clip(used), draw=used)  # the two skipped draws are charged now
    assert opt.steps == 4
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.0)), 4)
    assert opt.epsilon(DELTA) == pytest.approx(_pld_direct(event), rel=1e-9)
    with pytest.raises(ConfigurationError, match="already charged"):
        opt.step(clip(skipped[0]), draw=skipped[0])
    other = PoissonSampler(400, 0.05, key=opake.random.key(3))
    foreign = next(iter(other))
    with pytest.raises(ConfigurationError, match="another sampler"):
        opt.step(clip(foreign), draw=foreign)
    assert opt.steps == 4


def test_issue_reproduction_charges_at_least_the_true_epsilon():
    # Five steps, each on four consecutive draws, done the supported way (one step per draw):
    # 20 steps are charged, more than the lower bound 5 steps at q' = 1 - (1 - q)^4 would be
    # for 5 steps at q (the old charge).
    params, sampler, clip = _four_draw_setup()
    opt = _optimizer(params, sampler)
    it = iter(sampler)
    for _ in range(20):
        d = next(it)
        opt.step(clip(d), draw=d)
    assert opt.steps == 20
    old_charge = (acc.poisson(acc.gaussian(1.0), 0.05) * 5).epsilon_at(DELTA)
    assert opt.epsilon(DELTA) > old_charge


def test_prefetching_dataloader_is_not_overcharged():
    # A loader that runs ahead of the steps (as DataLoader workers do, prefetch_factor batches
    # each), emulated in-process: worker processes after JAX was imported elsewhere in the suite
    # would fork a multithreaded process. The draw travels with its batch, so each step charges
    # exactly up to its own draw, never the prefetched ones.
    n = 60
    x, y = _data(n)
    params = _params()
    sampler = PoissonSampler(n, 0.1, key=opake.random.key(5), steps=6)
    opt = _optimizer(params, sampler)
    grad_fn, st = clipped_grad(_loss, 0, batch_argnums=(1, 2), clipping_norm=1.0)
    it = iter(draw_loader(TensorDataset(x, y), sampler))
    queue = [next(it) for _ in range(3)]  # three batches in flight before the first step
    ahead = 0
    while queue:
        (xb, yb), draw_id = queue.pop(0)
        clipped, _ = grad_fn(params, xb, yb, state=st)
        if sampler.draws_handed_out - opt.steps > 1:
            with pytest.raises(ConfigurationError, match="handed out"):
                opt.step(clipped)  # without the draw it cannot tell: refused, not over-charged
        ahead = max(ahead, sampler.draws_handed_out - opt.steps)
        opt.step(clipped, draw=draw_id)
        assert opt.steps == draw_id.seq + 1
        following = next(it, None)
        if following is not None:
            queue.append(following)
    assert ahead == 3  # the loader was three draws ahead of each step
    assert opt.steps == sampler.steps == sampler.draws_handed_out == 6


# ------------------------------------------------------------------ releases that escape a step
def _clipped_sum(params, x, y, c=1.0):
    grad_fn, st = clipped_grad(_loss, 0, batch_argnums=(1, 2), clipping_norm=c)
    out, _ = grad_fn({k: v.detach() for k, v in params.items()}, x, y, state=st)
    return dataclasses.replace(out, parameters=params)


def test_a_wrapped_step_that_raises_still_charges_the_noise_it_released():
    # The noised gradient is in .grad before the wrapped optimizer steps. Before the fix a
    # raising step left it there uncharged, and a retry on other data reused the same noise:
    # the difference of the two .grad values was the difference of the sums, without noise.
    params = _params()
    sampler = PoissonSampler(50, 0.2, key=opake.random.key(1))
    opt = _optimizer(params, sampler)
    fail = [True]

    def raise_once(*_):
        if fail.pop() if fail else False:
            raise RuntimeError("wrapped step failed")

    opt.optimizer.register_step_pre_hook(raise_once)
    x, y = _data(10)
    idx = next(iter(sampler))
    with pytest.raises(RuntimeError, match="wrapped step failed"):
        opt.step(_clipped_sum(params, x[:5], y[:5]), draw=idx)
    assert opt.steps == 1  # the release is charged
    with pytest.raises(ConfigurationError, match="already"):
        opt.step(_clipped_sum(params, x[5:], y[5:]), draw=idx)  # the same draw cannot step again


def test_restoring_a_checkpoint_into_an_optimizer_that_stepped_since_is_refused():
    params = _params()
    sampler = PoissonSampler(50, 0.2, key=opake.random.key(2))
    opt = _optimizer(params, sampler)
    saved = opt.state_dict()
    x, y = _data(10)
    opt.step(_clipped_sum(params, x, y), draw=next(iter(sampler)))
    with pytest.raises(CheckpointError, match="rewind"):
        opt.load_state_dict(saved)
    assert opt.steps == 1
    fresh = _optimizer(_params(), PoissonSampler(50, 0.2, key=opake.random.key(2)))
    fresh.load_state_dict(saved)  # a new run restores it
    assert fresh.steps == 0


def test_parts_holding_more_examples_than_their_draw_are_refused():
    # The same physical batch passed twice (or backwarded twice) is k C of sensitivity for one
    # charged step; a Draw knows its size, so the sum is refused and nothing changes.
    params = _params()
    sampler = PoissonSampler(50, 0.3, key=opake.random.key(3))
    opt = _optimizer(params, sampler)
    idx = next(iter(sampler))
    assert len(idx) > 0
    x, y = _data(50)
    part = _clipped_sum(params, x[list(idx)], y[list(idx)])
    with pytest.raises(ConfigurationError, match="repeats a part"):
        opt.step([part, part], draw=idx)  # the same object twice: refused whatever the draw
    with pytest.raises(ConfigurationError, match="repeats a part"):
        opt.step([part, part])
    # The same rows clipped twice (other tensors): the draw's size decides, named by its id too
    # (the sampler remembers recent draws' sizes).
    again = _clipped_sum(params, x[list(idx)], y[list(idx)])
    for named in (idx, idx.id):
        with pytest.raises(ConfigurationError, match="more than once"):
            opt.step([part, again], draw=named)
    # No draw named, the one pending is the draw charged: the same bound.
    with pytest.raises(ConfigurationError, match="more than once"):
        opt.step([part, again])
    assert opt.steps == 0 and params["w"].grad is None
    opt.step([part], draw=idx)
    assert opt.steps == 1


def test_a_fixed_batch_beside_a_pending_draw_is_refused_when_it_is_larger():
    # Fixed batches stepped on while the sampler's draws go unused are not Poisson sampling at
    # rate q; without a draw named the optimizer charges the pending draw, so a sum of more
    # examples than it holds is refused and nothing changes (the draw is then still pending).
    params, sampler, opt, x, y = _setup()
    idx = next(iter(sampler))
    assert 0 < len(idx) < 50
    before = _state(params, opt)
    with pytest.raises(ConfigurationError, match=rf"holds 50 examples but draw 0, the one this step is charged for, has only {len(idx)}"):
        opt.step(_clipped_sum(params, x, y))
    _same(before, _state(params, opt))
    opt.step(_clipped_sum(params, x[list(idx)], y[list(idx)]))
    assert opt.steps == 1


def test_a_count_lowered_by_replace_cannot_pass_the_draw_size_check():
    # A newcomer's review: dataclasses.replace(sum_of_two_draws, num_examples=len(draw)) was
    # accepted, one noise draw then covering two draws' rows (an example in both moves the sum
    # by 2C). The count is now one of the fields the sums were made with.
    import dataclasses

    params, sampler, opt, x, y = _setup()
    idx = next(iter(sampler))
    assert 0 < len(idx) < 50
    whole = _clipped_sum(params, x, y)
    before = _state(params, opt)
    with pytest.raises(ConfigurationError, match=rf"num_examples={len(idx)}, not the 50 the sums hold"):
        opt.step(dataclasses.replace(whole, num_examples=len(idx)), draw=idx)
    _same(before, _state(params, opt))
    assert dataclasses.replace(whole, num_examples=50).num_examples == 50  # the same count: allowed


# ---------------------------------------------------------------- one release per sample (review)
# A review found second releases of one Poisson sample charged as fresh Poisson steps: the same
# clipped sum stepped on twice (a retry, or a step without draw= after one with it), a position
# handed out again by batch_at, two optimizers on one draw. Two releases on one sample cost
# poisson(g | g, q) (3.50 at sigma = 1, q = 0.1, delta = 1e-5), not two steps (1.92).
def _setup():
    """Parameters, a sampler of 50 examples at q = 0.3, its optimizer and the data."""
    params = _params()
    sampler = PoissonSampler(50, 0.3, key=opake.random.key(3))
    return (params, sampler, _optimizer(params, sampler), *_data(50))


def _state(params, opt):
    return {k: v.detach().clone() for k, v in params.items()}, opt.steps, opt.state_dict()["key"]


def _same(a, b):
    assert all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1:] == b[1:]


def test_a_released_sum_is_refused_a_second_time():
    params, sampler, opt, x, y = _setup()
    idx = next(iter(sampler))
    clipped = _clipped_sum(params, x[list(idx)], y[list(idx)])
    opt.step(clipped, draw=idx)
    before = _state(params, opt)
    for again in (lambda: opt.step(clipped), lambda: opt.step(dataclasses.replace(clipped, releases=())),
                  lambda: opt.step([clipped]), lambda: opt.step(clipped, draw=next(iter(sampler)))):
        with pytest.raises(ConfigurationError, match="already released"):
            again()
    _same(before, _state(params, opt))


def test_parts_of_a_released_sum_cannot_be_released_again():
    params, sampler, opt, x, y = _setup()
    idx = next(iter(sampler))
    half = len(idx) // 2
    p1 = _clipped_sum(params, x[list(idx[:half])], y[list(idx[:half])])
    p2 = _clipped_sum(params, x[list(idx[half:])], y[list(idx[half:])])
    opt.step(accumulate([p1, p2]), draw=idx)
    with pytest.raises(ConfigurationError, match="already released"):
        accumulate([p2])
    with pytest.raises(ConfigurationError, match="already released"):
        opt.step([p1, p2], draw=next(iter(sampler)))
    assert opt.steps == 1


def test_a_retry_after_the_wrapped_step_raised_is_refused():
    # .grad is written (the release) before the wrapped optimizer steps; if that step raises,
    # the sum was released and is charged; retrying it, with or without the draw, is refused.
    class Flaky(torch.optim.SGD):
        fail = True

        def step(self, closure=None):
            if Flaky.fail:
                Flaky.fail = False
                raise RuntimeError("transient")
            return super().step(closure)

    params = _params()
    sampler = PoissonSampler(50, 0.3, key=opake.random.key(3))
    opt = DPOptimizer(Flaky(params.values(), lr=0.1), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(7))
    x, y = _data(50)
    idx = next(iter(sampler))
    clipped = _clipped_sum(params, x[list(idx)], y[list(idx)])
    with pytest.raises(RuntimeError, match="transient"):
        opt.step(clipped, draw=idx)
    assert opt.steps == 1
    for kw in ({"draw": idx}, {}):
        with pytest.raises(ConfigurationError, match="already released"):
            opt.step(clipped, **kw)
    assert opt.steps == 1


def test_a_step_naming_no_draw_with_none_pending_is_refused():
    params, sampler, opt, x, y = _setup()
    idx = next(iter(sampler))
    opt.step(_clipped_sum(params, x[list(idx)], y[list(idx)]))  # the one pending draw
    before = _state(params, opt)
    with pytest.raises(ConfigurationError, match="handed out no draw"):
        opt.step(_clipped_sum(params, x[list(idx)], y[list(idx)]))  # the same rows, recomputed
    _same(before, _state(params, opt))


def test_a_position_handed_out_again_is_the_same_draw():
    params, sampler, opt, x, y = _setup()
    d1, d2 = sampler.batch_at(0, 0), sampler.batch_at(0, 0)
    assert d1 == d2 and d1.id == d2.id and sampler.draws_handed_out == 1
    opt.step(_clipped_sum(params, x[list(d1)], y[list(d1)]), draw=d1)
    with pytest.raises(ConfigurationError, match="already charged"):
        opt.step(_clipped_sum(params, x[list(d2)], y[list(d2)]), draw=d2)
    with pytest.raises(ConfigurationError, match="handed out no draw"):
        opt.step(_clipped_sum(params, x[list(d2)], y[list(d2)]))
    assert opt.steps == 1
    # The memory of handed-out positions survives a checkpoint.
    fresh = PoissonSampler(50, 0.3, key=opake.random.key(3))
    fresh.load_state_dict(sampler.state_dict())
    assert fresh.batch_at(0, 0).id.seq == 0 and fresh.draws_handed_out == 1


def test_two_optimizers_on_one_sampler_are_refused():
    params = _params()
    sampler = PoissonSampler(50, 0.3, key=opake.random.key(3))
    opt, other = _optimizer(params, sampler), _optimizer(_params(), sampler)
    x, y = _data(50)
    idx = next(iter(sampler))
    opt.step(_clipped_sum(params, x[list(idx)], y[list(idx)]), draw=idx)
    with pytest.raises(ConfigurationError, match="Another DPOptimizer"):
        other.step(_clipped_sum(params, x[list(idx)], y[list(idx)]), draw=idx)
    assert other.steps == 0


def test_a_sampler_never_iterated_refuses_steps():
    # Fixed or shuffled batches stepped on with a sampler that drew none were charged as Poisson
    # draws at rate q: a newcomer's three passes of fixed batches reported epsilon 4.18 where
    # gaussian(1) composed 3 times is 8.39.
    params, sampler, opt, x, y = _setup()
    with pytest.raises(ConfigurationError, match="never iterated"):
        opt.step(_clipped_sum(params, x[:15], y[:15]))
    assert opt.steps == 0 and params["w"].grad is None


def test_a_budget_with_delta_of_at_least_one_over_n_is_refused():
    # (0, 1/N) is what publishing one random record achieves: a newcomer's delta = 0.5 budget
    # was accepted and allowed 11 steps.
    sampler = PoissonSampler(1000, 0.1, key=opake.random.key(3))
    for delta in (0.5, 1e-3):
        with pytest.raises(ConfigurationError, match="1/N"):
            _optimizer(_params(), sampler, budget=acc.epsilon_budget(1.0, delta=delta))
    assert _optimizer(_params(), sampler, budget=acc.epsilon_budget(1.0, delta=1e-5)).budget is not None


# ------------------------------------------- the sampler's draws against the optimizer's charges
def _run_epoch(n=40, q=0.25, seed=0):
    x, y = _data(n)
    params = _params()
    sampler = PoissonSampler(n, q, key=opake.random.key(seed))
    opt = _optimizer(params, sampler)
    grad_fn, st = clipped_grad(_loss, 0, batch_argnums=(1, 2), clipping_norm=1.0)

    def clip(idx):
        i = torch.as_tensor(list(idx), dtype=torch.long)
        return grad_fn(params, x[i], y[i], state=st)[0]

    return opt, sampler, clip, params


def test_the_sampler_cannot_be_swapped():
    """A sampler swapped in after construction drew at its own rate while the steps were
    charged at the first one's (review: 20 steps at q = 1 reported as epsilon 0.199 of q = 0.01,
    28.4 spent)."""
    opt, sampler, clip, _ = _run_epoch()
    with pytest.raises(ConfigurationError, match="read-only"):
        opt.sampler = PoissonSampler(40, 1.0, key=opake.random.key(3))
    assert opt.sampler is sampler


def test_a_sampler_behind_the_optimizer_is_refused():
    """A sampler rewound (or restored without its state) behind the optimizer's charged draws
    made the pending count negative, and such a step passed as a new draw: the same samples were
    released again (review: 9 repeated draws charged as new ones, epsilon 3.53 reported against
    5.74) and whole-data-set sums were charged at rate q. A rewound sampler whose released
    positions came back under new numbers (batch_at) passed as well (second review)."""
    opt, sampler, clip, params = _run_epoch()
    saved = sampler.state_dict()
    for b in sampler:
        opt.step(clip(b), draw=b)
    charged = opt.steps
    with pytest.raises(CheckpointError, match="rewinding"):
        sampler.load_state_dict(saved)  # the live sampler of a live optimizer: not rewound
    assert sampler.draws_handed_out == charged
    # A checkpoint restored without the sampler: a fresh sampler is behind the optimizer.
    opt2, fresh, clip2, params2 = _run_epoch()
    opt2.load_state_dict(opt.state_dict())
    before = {k: v.detach().clone() for k, v in params2.items()}
    with pytest.raises(ConfigurationError, match="behind the optimizer"):
        opt2.step(clip2(range(40)))
    b = next(iter(fresh))
    for draw in (b, None):  # named or not, the message names the cause
        with pytest.raises(ConfigurationError, match="behind the optimizer"):
            opt2.step(clip2(b), draw=draw)
    assert opt2.steps == charged and all(torch.equal(before[k], params2[k]) for k in params2)


def test_a_state_of_another_sampler_cannot_erase_the_released_positions():
    """A state of a sibling sampler (same N, q and key) that handed out other positions passed the
    count check, replaced the record of positions handed out, and the released sample at
    (epoch 0, step 0) came back as a new draw, charged as a fresh step (a charging review)."""
    x, y = _data(40)
    params = _params()
    sampler = PoissonSampler(40, 0.25, key=opake.random.key(0))
    opt = _optimizer(params, sampler)
    grad_fn, st = clipped_grad(_loss, 0, batch_argnums=(1, 2), clipping_norm=1.0)
    d0 = sampler.batch_at(0, 0)
    opt.step(grad_fn(params, *_rows((x, y), d0), state=st)[0], draw=d0)
    sibling = PoissonSampler(40, 0.25, key=opake.random.key(0))
    sibling.batch_at(0, 1)  # one draw handed out, as many as were charged: the count check passes
    with pytest.raises(CheckpointError, match="differs from the sampler's"):
        sampler.load_state_dict(sibling.state_dict())
    assert sampler.batch_at(0, 0).id == d0.id  # still the released draw: refused if stepped on
    later = PoissonSampler(40, 0.25, key=opake.random.key(0))
    later.load_state_dict(sampler.state_dict())  # a fresh sampler: anything may be restored
    d1 = sampler.batch_at(0, 1)
    ahead = sampler.state_dict()
    sampler.load_state_dict(ahead)  # its own later state: the charged draws agree
    assert sampler.batch_at(0, 1).id == d1.id


def test_a_draw_not_handed_out_is_refused():
    """A DrawId made by hand for a draw the sampler never handed out passed every check
    (review: 10 whole-data-set steps charged as Poisson steps at q = 0.1)."""
    from opake_compile.sampling import DrawId

    opt, sampler, clip, _ = _run_epoch()
    with pytest.raises(ConfigurationError, match="has not been handed out"):
        opt.step(clip(range(40)), draw=DrawId(sampler._id, 0, 0, 0))
    assert opt.steps == 0
    b = next(iter(sampler))
    opt.step(clip(b), draw=b)  # the real draw 0
    with pytest.raises(ConfigurationError, match="has not been handed out"):
        opt.step(clip(b), draw=dataclasses.replace(b.id, seq=1, step=1))
    assert opt.steps == 1


def test_noise_that_overflows_the_parameters_is_refused_before_anything_changes():
    opt, sampler, clip, params = _run_epoch()
    opt2 = DPOptimizer(torch.optim.SGD(params.values(), lr=0.1), noise_multiplier=1e30, sampler=sampler, key=opake.random.key(9))
    grad_fn, st = clipped_grad(_loss, 0, batch_argnums=(1, 2), clipping_norm=1e10)
    x, y = _data(40)
    b = next(iter(sampler))
    i = torch.as_tensor(list(b), dtype=torch.long)
    before = {k: v.detach().clone() for k, v in params.items()}
    with pytest.raises(ConfigurationError, match="overflows"):
        opt2.step(grad_fn(params, x[i], y[i], state=st)[0], draw=b)
    assert opt2.steps == 0 and all(torch.equal(before[k], params[k]) for k in params)


def test_accounting_failures_are_the_librarys_errors():
    """A tiny noise multiplier made dp-accounting raise NumPy's MemoryError / ValueError from
    epsilon() and from a budget check (review); 1e-300 overflowed at construction."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        process = acc.dpsgd_step_process(1e-8, 0.1)
    with pytest.raises(ConfigurationError, match="could not evaluate"):
        acc.Accountant().epsilon(process, DELTA)
    with pytest.raises(ConfigurationError, match="too small"):
        acc.dpsgd_step_process(1e-300, 0.1)


def test_the_noise_bound_reads_the_gradient_after_division_in_half_precision():
    """float16 weights: sigma * C = 1000 on the sum is 1 on the gradient at q N = 1000 (fine);
    sigma * C = 1e9 is 1e6 there, past float16's 65504 (refused, nothing changed)."""
    w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    for sigma, ok in ((10.0, True), (1e7, False)):
        sampler = PoissonSampler(2000, 0.5, key=opake.random.key(1))  # (one optimizer per sampler)
        opt = DPOptimizer(torch.optim.SGD([w], lr=0.0), noise_multiplier=sigma, sampler=sampler, key=opake.random.key(int(sigma)))
        b = next(iter(sampler))
        clipped = ClippedPytree(grads={"w": torch.zeros(3)}, clipping_norm=100.0, per_example_norms=torch.zeros(len(b)),
                                num_examples=len(b), parameters={"w": w})
        if ok:
            opt.step(clipped, draw=b)
            assert torch.isfinite(w.grad).all() and opt.steps == 1
        else:
            with pytest.raises(ConfigurationError, match="overflows"):
                opt.step(clipped, draw=b)
            assert opt.steps == 0


# ---------------------------------------------------------------- sums edited after they were made
@pytest.mark.parametrize(
    "edit",
    ["in place", "entry replaced", "entry added", "entry removed"],
)
def test_a_sum_edited_after_it_was_made_is_refused_and_nothing_changes(edit):
    """A newcomer's review: ``clipped.grads[k].mul_(1e4)`` reached the parameters with noise for
    C, and so did an entry swapped in the (mutable) dict. Both are refused at the step, by the
    sum's version counter and the tensors the result was built with; a result left alone then
    steps as usual."""
    params, sampler, opt, x, y = _setup()
    idx = next(iter(sampler))
    clipped = _clipped_sum(params, x[list(idx)], y[list(idx)])
    k = next(iter(clipped.grads))
    if edit == "in place":
        clipped.grads[k].mul_(1e4)
    elif edit == "entry replaced":
        clipped.grads[k] = clipped.grads[k] * 1e4
    elif edit == "entry added":
        clipped.grads["extra"] = torch.zeros(1)
    else:
        del clipped.grads[k]
    before = _state(params, opt)
    with pytest.raises(ConfigurationError, match="changed in place|were edited"):
        opt.step(clipped, draw=idx)
    _same(before, _state(params, opt))
    with pytest.raises(ConfigurationError, match="changed in place|were edited"):
        opake.optim.accumulate([clipped])  # not laundered into a new sum either
    fresh = _clipped_sum(params, x[list(idx)], y[list(idx)])
    opt.step(fresh, draw=idx)
    assert opt.steps == 1


def test_nested_sums_of_an_eager_result_are_sealed_and_released_once():
    """``clipped_grad`` on a nested dict of parameters: the nested sums were never marked (only
    a dict's top level was read), so an edited nested sum and a second release were accepted."""
    params = {"enc": {"w": torch.randn(3, 4, generator=torch.Generator().manual_seed(0))}, "dec": {"b": torch.zeros(3)}}

    def loss(p, x, y):
        return ((x @ p["enc"]["w"].T + p["dec"]["b"] - y) ** 2).sum()

    fn, st = clipped_grad(loss, 0, batch_argnums=(1, 2), clipping_norm=1.0)
    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.randn(8, 3, generator=torch.Generator().manual_seed(2))
    noise_fn, ns = opake.dpsgd.gaussian_noise(1.0, opake.random.key(0))
    edited, st = fn(params, x, y, state=st)
    edited.grads["enc"]["w"].mul_(1e4)
    with pytest.raises(ConfigurationError, match="'enc/w' was changed in place"):
        noise_fn(edited, ns)
    clean, st = fn(params, x, y, state=st)
    _, ns = noise_fn(clean, ns)
    with pytest.raises(ConfigurationError, match="already released"):
        noise_fn(clean, ns)
    with pytest.raises(ConfigurationError, match="below the 1.0"):
        dataclasses.replace(clean, clipping_norm=0.01)


def test_a_second_optimizer_on_a_charged_sampler_is_refused():
    """A notebook cell re-run built a second DPOptimizer on a sampler the first had charged; once
    the first was gone, batch_at handed a released position out again, the second released it
    under fresh noise and reported the epsilon of its own steps only (review). Refused at
    construction, whether the first optimizer is alive or not."""
    import gc

    w = torch.nn.Parameter(torch.zeros(3))
    sampler = PoissonSampler(100, 0.1, key=opake.random.key(1))
    first = DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(2))
    early = DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(6))
    b = next(iter(sampler))
    first.step(ClippedPytree(grads={"w": torch.zeros(3)}, clipping_norm=1.0, per_example_norms=torch.zeros(len(b)),
                             num_examples=len(b), parameters={"w": w}), draw=b)
    for alive in (True, False):
        if not alive:
            del first
            gc.collect()
        with pytest.raises(ConfigurationError, match="already charged by another DPOptimizer"):
            DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(3))
        # One built before the first charged is refused at its step (a diff review's bypass).
        with pytest.raises(ConfigurationError, match="Another DPOptimizer already charges"):
            early.step(ClippedPytree(grads={"w": torch.zeros(3)}, clipping_norm=1.0, per_example_norms=torch.zeros(len(b)),
                                     num_examples=len(b), parameters={"w": w}), draw=b)
    fresh = PoissonSampler(100, 0.1, key=opake.random.key(4))  # a new run: a new sampler
    assert DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=fresh, key=opake.random.key(5)).steps == 0


def test_key_mistakes_name_the_fix():
    """One key object for the sampler and the noise, and an int for a key (a newcomer's review)."""
    w = torch.nn.Parameter(torch.zeros(3))
    k = opake.random.key(1)
    sampler = PoissonSampler(100, 0.1, key=k)
    with pytest.raises(ConfigurationError, match="noise key is the sampler's key object"):
        DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=sampler, key=k)
    with pytest.raises(InputTypeError, match=r"pass opake_compile.random.key\(0\)"):
        DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=sampler, key=0)
    with pytest.raises(InputTypeError, match=r"pass len\(dataset\)"):
        PoissonSampler(torch.utils.data.TensorDataset(torch.zeros(10, 2)), 0.1, key=opake.random.key(2))


def test_an_optimizer_restored_from_an_earlier_time_than_its_sampler_is_refused():
    """The optimizer's state from step 5 and the sampler's from step 10 (saved apart, as the
    Opacus migration guide's loop saves them): the next step charged 6 draws at once and added
    step 6's noise, already released, to draw 10's sum; the two releases differed by their
    clipped sums to 3e-7 (review). Refused at the step; the same time's states still resume."""
    import copy

    w = torch.nn.Parameter(torch.zeros(3))

    def run(steps_opt, steps_sampler):
        sampler = PoissonSampler(40, 0.05, key=opake.random.key(1))
        opt = DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(2))
        states = {}
        it = iter(sampler)
        for t in range(1, max(steps_opt, steps_sampler) + 1):
            b = next(it)
            opt.step(ClippedPytree(grads={"w": torch.zeros(3)}, clipping_norm=1.0, per_example_norms=torch.zeros(len(b)),
                                   num_examples=len(b), parameters={"w": w}), draw=b)
            states[t] = (copy.deepcopy(opt.state_dict()), copy.deepcopy(sampler.state_dict()))
        fresh_sampler = PoissonSampler(40, 0.05, key=opake.random.key(1))
        fresh = DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=fresh_sampler, key=opake.random.key(2))
        fresh.load_state_dict(states[steps_opt][0])
        fresh_sampler.load_state_dict(states[steps_sampler][1])
        b = next(iter(fresh_sampler))
        fresh.step(ClippedPytree(grads={"w": torch.zeros(3)}, clipping_norm=1.0, per_example_norms=torch.zeros(len(b)),
                                 num_examples=len(b), parameters={"w": w}), draw=b)
        return fresh.steps

    assert run(5, 5) == 6
    with pytest.raises(ConfigurationError, match="saved after 10 of its draws had been charged, but this optimizer has charged 5"):
        run(5, 10)


def test_edited_states_that_forget_charged_steps_are_refused():
    """steps edited to 0 (with runs []) loaded and reported epsilon 0, and a sampler state whose
    history was emptied handed released positions out again as new draws (review): an
    optimizer's steps must equal its draws charged, and a sampler's history must cover every
    draw it handed out."""
    import copy

    w = torch.nn.Parameter(torch.zeros(3))
    sampler = PoissonSampler(40, 0.05, key=opake.random.key(1))
    opt = DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=sampler, key=opake.random.key(2))
    it = iter(sampler)
    for _ in range(3):
        b = next(it)
        opt.step(ClippedPytree(grads={"w": torch.zeros(3)}, clipping_norm=1.0, per_example_norms=torch.zeros(len(b)),
                               num_examples=len(b), parameters={"w": w}), draw=b)
    o_state, s_state = copy.deepcopy(opt.state_dict()), copy.deepcopy(sampler.state_dict())
    fresh_sampler = PoissonSampler(40, 0.05, key=opake.random.key(1))
    fresh = DPOptimizer(torch.optim.SGD([w], lr=0.1), noise_multiplier=1.0, sampler=fresh_sampler, key=opake.random.key(2))
    edited = dict(o_state, steps=0, runs=[])
    with pytest.raises(CheckpointError, match="draws_charged=3 differs from steps=0"):
        fresh.load_state_dict(edited)
    with pytest.raises(CheckpointError, match="history records 0 draw.s. but it handed out 3"):
        fresh_sampler.load_state_dict(dict(s_state, epoch=0, position=0, history="[]"))
    fresh.load_state_dict(o_state)
    fresh_sampler.load_state_dict(s_state)
    assert fresh.steps == 3
