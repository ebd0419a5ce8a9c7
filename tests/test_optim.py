"""``DPOptimizer`` and ``accumulate``.

Oracles: plain (non-private) ``torch.optim`` training of an identical model (sigma = 0,
C = inf, fixed batches with q*N = B, as the spec prescribes), and closed-form statistics of the
Gaussian noise (a Kolmogorov-Smirnov test that accepts the right sigma*C and rejects a wrong one).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn as nn
from scipy import stats

import opake_compile as opake
from _models import assert_trees_close, conv2d_case, mlp_case, reference_clipped
from opake_compile import accounting as acc
from opake_compile import compile_dp
from opake_compile._validate import NotPrivateWarning
from opake_compile.dpsgd.clipping import clipped_grad
from opake_compile.dpsgd.noise import gaussian_noise
from opake_compile.dpsgd._types import ClippedPytree
from opake_compile.exceptions import (
    CheckpointError,
    ConfigurationError,
    InputTypeError,
    PrivacyBudgetExhaustedError,
)
from opake_compile.optim import DPOptimizer, accumulate
from opake_compile.sampling import PoissonSampler

N, B = 24, 6


def _sampler(n=N, q=B / N, seed=0, trunc=None):
    return PoissonSampler(n, q, trunc, key=opake.random.key(seed))


def _dp(optimizer, sigma=1.0, sampler=None, key=0, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        return DPOptimizer(optimizer, noise_multiplier=sigma, sampler=sampler or _sampler(), key=opake.random.key(key), **kw)


def _drawn(opt):
    """``opt`` after its sampler handed out one more draw. These tests build the sums they step
    on directly; a step is charged for a draw the sampler handed out, and one with none pending
    is refused (it would be a sum of batches the sampler did not draw), as is one summing more
    examples than that draw holds: tests stepping on fixed batches of n rows use a sampler of
    n examples at q = 1 (every draw is the whole dataset)."""
    next(iter(opt.sampler))
    return opt


def _nonprivate_step(case, c=math.inf, p=4):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        return compile_dp(case.loss_fn, model=case.model, clipping_norm=c, physical_batch_size=p, backend=None)


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _opt_state(opt):
    return copy.deepcopy(opt.state_dict())


def _assert_state_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_state_equal(x, y)
    else:
        assert a == b


# ----------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.05),
    ],
    ids=["sgd", "adam"],
)
@pytest.mark.parametrize("factory", [mlp_case, conv2d_case], ids=["mlp", "conv2d"])
def test_sigma0_cinf_fixed_batches_equal_nonprivate_training(factory, make_opt):
    dp_case = factory(seed=21, dtype=torch.float64)
    dp_case.model[0].bias.requires_grad_(False)  # a frozen parameter on both sides
    plain = copy.deepcopy(dp_case.model)
    step = _nonprivate_step(dp_case, p=4)  # B = 6 > P = 4: chunked as well
    with pytest.warns(NotPrivateWarning):
        opt = DPOptimizer(make_opt(dp_case.model.parameters()), noise_multiplier=0.0, sampler=_sampler(n=B, q=1.0), key=opake.random.key(0))
    assert opt.expected_batch_size == pytest.approx(B)
    plain_opt = make_opt(plain.parameters())
    data = dp_case.make_batch(N, 3)
    for t in range(4):
        batch = tuple(a[t * B : (t + 1) * B] for a in data)
        _drawn(opt).step(step(*batch).clipped)
        plain_opt.zero_grad()
        dp_case.loss_fn(plain, *batch).backward()
        plain_opt.step()
    assert opt.steps == 4
    moved = False
    for (name, p), q in zip(dp_case.model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-11, msg=name)
        moved |= not torch.equal(p, factory(seed=21, dtype=torch.float64).model.get_parameter(name))
    assert moved


# ----------------------------------------------------------------------------- noise
def _zero_clipped(param, c, n=0):
    return ClippedPytree(
        grads={"w": torch.zeros_like(param).detach()},
        clipping_norm=c,
        per_example_norms=torch.zeros(n),
        num_examples=n,
        parameters={"w": param},
    )


@pytest.mark.parametrize("sigma,c", [(1.3, 0.7), (0.5, 4.0)])
def test_noise_std_is_sigma_c_on_the_sum(sigma, c):
    param = nn.Parameter(torch.zeros(200_000))
    sampler = _sampler(n=200, q=0.05)
    opt = _dp(torch.optim.SGD([param], lr=0.0), sigma=sigma, sampler=sampler, key=5)
    _drawn(opt).step(_zero_clipped(param, c))
    z = (param.grad * sampler.expected_batch_size).double().numpy()  # = the noise on the sum
    std = sigma * c
    assert abs(z.std() / std - 1) < 0.01
    assert abs(z.mean()) < 5 * std / math.sqrt(z.size)
    assert stats.kstest(z, "norm", args=(0, std)).pvalue > 1e-3
    # The same test rejects a wrong noise level (5% off) and a wrong normaliser (realised size).
    assert stats.kstest(z, "norm", args=(0, 1.05 * std)).pvalue < 1e-6
    assert stats.kstest(z / 2, "norm", args=(0, std)).pvalue < 1e-6


def test_noise_is_added_once_to_the_sum_then_divided_by_expected_batch_size():
    case = mlp_case(seed=2, dtype=torch.float64)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=0.5, physical_batch_size=8, backend=None)
    clipped = step(*case.make_batch(7, 1)).clipped
    zero = ClippedPytree(
        grads={k: torch.zeros_like(g) for k, g in clipped.grads.items()},
        clipping_norm=0.5,
        per_example_norms=torch.zeros(0),
        num_examples=0,
        parameters=clipped.parameters,
    )
    grads = []
    for cl in (clipped, zero):
        # qN = 10, realised size 7; a sampler each (one optimizer charges a sampler's draws)
        opt = _dp(torch.optim.SGD(case.model.parameters(), lr=0.0), sigma=2.0, sampler=_sampler(n=40, q=0.25), key=9)
        _drawn(opt).step(cl)
        grads.append({k: p.grad.clone() for k, p in case.model.named_parameters()})
    for k, s in clipped.grads.items():
        torch.testing.assert_close(grads[0][k] - grads[1][k], s / 10.0)
        assert grads[1][k].abs().min() > 0  # the noise is really there


def test_key_advances_and_noise_differs_between_steps():
    param = nn.Parameter(torch.zeros(1000))
    opt = _dp(torch.optim.SGD([param], lr=0.0), sigma=1.0, key=1)
    _drawn(opt).step(_zero_clipped(param, 1.0))
    g1 = param.grad.clone()
    _drawn(opt).step(_zero_clipped(param, 1.0))
    assert not torch.equal(g1, param.grad)
    fresh = nn.Parameter(torch.zeros(1000))
    opt2 = _dp(torch.optim.SGD([fresh], lr=0.0), sigma=1.0, key=1)
    _drawn(opt2).step(_zero_clipped(fresh, 1.0))
    assert torch.equal(g1, fresh.grad)  # same key, same noise


# ----------------------------------------------------------------------------- frozen, stale
@pytest.mark.parametrize(
    "make_opt",
    [lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, weight_decay=0.1), lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1)],
    ids=["sgd-wd", "adamw"],
)
def test_frozen_parameters_and_their_state_never_change(make_opt):
    case = mlp_case(seed=4)
    frozen = case.model[0].weight
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=1.0, physical_batch_size=4, backend=None)
    opt = _dp(make_opt(case.model.parameters()), sigma=1.0, sampler=_sampler(n=5, q=1.0))
    for t in range(3):
        frozen.grad = torch.ones_like(frozen)  # a stale, non-private gradient
        _drawn(opt).step(step(*case.make_batch(5, t)).clipped)
        assert frozen.grad is None
    assert torch.equal(frozen, before)
    assert frozen not in opt.optimizer.state or not opt.optimizer.state[frozen]
    assert case.model[3].weight in opt.optimizer.state


def test_stale_grad_on_trainable_parameter_outside_the_clipped_tree_is_cleared():
    case = mlp_case(seed=4)
    extra = nn.Parameter(torch.ones(3))
    extra.grad = torch.full((3,), 7.0)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=1.0, physical_batch_size=4, backend=None)
    opt = _dp(torch.optim.SGD([*case.model.parameters(), extra], lr=1.0), sigma=0.5)
    _drawn(opt).step(step(*case.make_batch(3, 0)).clipped)
    assert extra.grad is None
    assert torch.equal(extra, torch.ones(3))


def test_gradient_for_parameter_not_in_optimizer_refused():
    case = mlp_case(seed=4)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=1.0, physical_batch_size=4, backend=None)
    opt = _dp(torch.optim.SGD(case.model[3].parameters(), lr=1.0))
    before = _snapshot(case.model)
    # (The message says how to leave a parameter out, or put it in: a newcomer's review.)
    with pytest.raises(ConfigurationError, match=r"not in the wrapped optimizer\. .*requires_grad_\(False\).*add_param_group"):
        opt.step(step(*case.make_batch(3, 0)).clipped)
    assert opt.steps == 0
    for k, v in case.model.state_dict().items():
        assert torch.equal(v, before[k])


# ----------------------------------------------------------------------------- budget
def test_budget_exhausted_changes_nothing():
    case = mlp_case(seed=5)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=1.0, physical_batch_size=4, backend=None)
    sampler = PoissonSampler(100, 0.1, key=opake.random.key(0))
    opt = DPOptimizer(
        torch.optim.Adam(case.model.parameters(), lr=0.1),
        noise_multiplier=1.0,
        sampler=sampler,
        key=opake.random.key(1),
        accountant=acc.Accountant("pld", value_discretization_interval=1e-2),
        budget=acc.epsilon_budget(2.0, delta=1e-5),
    )
    allowed = opt.max_steps()
    assert allowed is not None and 1 <= allowed <= 5
    for t in range(allowed):
        _drawn(opt).step(step(*case.make_batch(4, t)).clipped)
    assert opt.steps == allowed
    params, state, sd = _snapshot(case.model), _opt_state(opt.optimizer), opt.state_dict()
    grads = {k: p.grad.clone() for k, p in case.model.named_parameters()}
    with pytest.raises(PrivacyBudgetExhaustedError):
        _drawn(opt).step(step(*case.make_batch(4, 99)).clipped)
    assert opt.steps == allowed
    assert opt.state_dict()["key"] == sd["key"]
    _assert_state_equal(_opt_state(opt.optimizer), state)
    for k, v in case.model.state_dict().items():
        assert torch.equal(v, params[k])
    for k, p in case.model.named_parameters():
        assert torch.equal(p.grad, grads[k])
    assert 0 < opt.epsilon() <= 2.0


# ----------------------------------------------------------------------------- empty batch
def test_empty_batch_step_counts_and_is_pure_noise():
    case = mlp_case(seed=6)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=0.8, physical_batch_size=4, backend=None)
    sampler = _sampler(n=50, q=0.1)
    opt = _dp(torch.optim.SGD(case.model.parameters(), lr=1.0), sigma=1.5, sampler=sampler, key=2)
    before = _snapshot(case.model)
    out = step(*case.make_batch(0, 0))
    _drawn(opt).step(out.clipped)
    assert opt.steps == 1
    deltas = torch.cat([(before[k] - v).flatten() for k, v in case.model.state_dict().items()])
    assert torch.isfinite(deltas).all() and (deltas != 0).all()
    # The update is the noise alone: N(0, (sigma C / qN)^2) per entry.
    z = deltas.double() * sampler.expected_batch_size / (1.5 * 0.8)
    assert stats.kstest(z.numpy(), "norm").pvalue > 1e-3
    # And it equals the update of an explicit all-zero sum with the same key.
    twin = mlp_case(seed=6)
    # (Its own sampler: one DPOptimizer charges a sampler's draws.)
    opt2 = _dp(torch.optim.SGD(twin.model.parameters(), lr=1.0), sigma=1.5, sampler=_sampler(n=50, q=0.1), key=2)
    params = dict(twin.model.named_parameters())
    # (The step's sums are float64, and the noise is drawn in the sum's dtype.)
    _drawn(opt2).step(ClippedPytree(grads={k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}, clipping_norm=0.8,
                            per_example_norms=torch.zeros(0), num_examples=0, parameters=params))
    for (k, p), q in zip(case.model.named_parameters(), twin.model.parameters()):
        assert torch.equal(p, q), k


# ----------------------------------------------------------------------------- refusals
def test_refusals():
    case = mlp_case(seed=0)
    params = {k: p.detach() for k, p in case.model.named_parameters()}
    opt = _dp(torch.optim.SGD(case.model.parameters(), lr=0.1), sigma=1.0)

    def loss(ps, x, y):
        return nn.functional.cross_entropy(torch.func.functional_call(case.model, ps, (x,)), y)

    args = case.make_batch(4, 0)
    grad_fn, st = clipped_grad(loss, 0, batch_argnums=(1, 2), clipping_norm=1.0, normalize_by=4.0)
    normalised, _ = grad_fn(params, *args, state=st)
    with pytest.raises(ConfigurationError, match="normalised"):
        opt.step(normalised)
    grad_fn, st = clipped_grad(loss, 0, batch_argnums=(1, 2), clipping_norm=1.0)
    clipped, _ = grad_fn(params, *args, state=st)
    noise_fn, ns = gaussian_noise(1.0, opake.random.key(0))
    noised, _ = noise_fn(clipped, ns)
    with pytest.raises(InputTypeError):
        opt.step(noised)
    with pytest.raises(InputTypeError):
        opt.step({k: torch.zeros_like(v) for k, v in params.items()})
    with pytest.raises(InputTypeError):
        opt.step([noised])
    assert opt.steps == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        inf_clipped = ClippedPytree(grads={k: v.clone() for k, v in clipped.grads.items()}, clipping_norm=math.inf, per_example_norms=torch.zeros(0),
                                    num_examples=0, parameters=clipped.parameters)
    with pytest.raises(ConfigurationError, match="inf"):
        opt.step(inf_clipped)
    assert opt.steps == 0


def test_eager_clipped_grad_on_parameter_dict_is_accepted():
    case = mlp_case(seed=0, dtype=torch.float64)
    params = dict(case.model.named_parameters())
    args = case.make_batch(5, 0)
    ref = reference_clipped(case.model, case.loss_fn, args, 0.5)
    clipped = ClippedPytree(grads=ref.grads, clipping_norm=0.5, per_example_norms=ref.per_example_norms,
                            num_examples=5, parameters=params)
    opt = _dp(torch.optim.SGD(case.model.parameters(), lr=0.0), sigma=0.0, sampler=_sampler(n=20, q=0.25))
    _drawn(opt).step(clipped)
    for k, p in params.items():
        torch.testing.assert_close(p.grad, ref.grads[k] / 5.0)


def test_constructor_refusals():
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)

    class FixedBatches:
        sample_rate, dataset_size, truncated_batch_size = 0.1, 100, None

    with pytest.raises(ConfigurationError, match="Poisson"):
        DPOptimizer(sgd, noise_multiplier=1.0, sampler=FixedBatches(), key=opake.random.key(0))
    with pytest.raises(ConfigurationError, match="Poisson"):
        DPOptimizer(sgd, noise_multiplier=1.0, sampler=torch.utils.data.BatchSampler(range(10), 2, False), key=opake.random.key(0))
    with pytest.raises(ConfigurationError):
        DPOptimizer(sgd, noise_multiplier=-1.0, sampler=_sampler(), key=opake.random.key(0))
    with pytest.raises(InputTypeError):
        DPOptimizer(sgd, noise_multiplier=1.0, sampler=_sampler(), key=0)
    with pytest.raises(InputTypeError):
        DPOptimizer("sgd", noise_multiplier=1.0, sampler=_sampler(), key=opake.random.key(0))
    # What is missing is what the message explains (a newcomer's review: a missing noise
    # multiplier was answered with an explanation of the key).
    with pytest.raises(InputTypeError, match=r"needs noise_multiplier= \(or noise=\.\.\.\)\. The noise multiplier") as err:
        DPOptimizer(sgd, sampler=_sampler(), key=opake.random.key(0))
    assert "random_key" not in str(err.value)
    with pytest.raises(InputTypeError, match=r"needs key= \(or noise=\.\.\.\)\. The key draws the noise") as err:
        DPOptimizer(sgd, noise_multiplier=1.0, sampler=_sampler())
    assert "calibrate" not in str(err.value)
    with pytest.warns(NotPrivateWarning):
        DPOptimizer(sgd, noise_multiplier=0.0, sampler=_sampler(), key=opake.random.key(0))
    opt = _dp(sgd, sampler=_sampler(n=100, q=0.1, trunc=20))
    assert (opt.sample_rate, opt.dataset_size, opt.truncated_batch_size) == (0.1, 100, 20)
    assert opt.expected_batch_size == pytest.approx(10.0)


# ----------------------------------------------------------------------------- checkpoints
def test_state_dict_round_trip_gives_the_same_next_noise():
    case = mlp_case(seed=7)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=1.0, physical_batch_size=4, backend=None)
    make = lambda m, key: _dp(torch.optim.Adam(m.parameters(), lr=0.05), sigma=1.0, key=key, sampler=_sampler(n=4, q=1.0))
    opt = make(case.model, key=3)
    for t in range(2):
        _drawn(opt).step(step(*case.make_batch(4, t)).clipped)
    sd = copy.deepcopy(opt.state_dict())
    twin = copy.deepcopy(case.model)
    twin_step = compile_dp(case.loss_fn, model=twin, clipping_norm=1.0, physical_batch_size=4, backend=None)
    opt2 = make(twin, key=77)  # a different key, replaced by the checkpoint's
    opt2.load_state_dict(sd)
    opt2.sampler.load_state_dict(copy.deepcopy(opt.sampler.state_dict()))  # (else it is behind: refused)
    assert opt2.steps == 2
    batch = case.make_batch(4, 10)
    _drawn(opt).step(step(*batch).clipped)
    _drawn(opt2).step(twin_step(*batch).clipped)
    for p, q in zip(case.model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    assert opt.state_dict()["key"] == opt2.state_dict()["key"]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda sd: sd.update(noise_multiplier=2.0),
        lambda sd: sd.update(sample_rate=0.5),
        lambda sd: sd.update(dataset_size=1000),
        lambda sd: sd.update(truncated_batch_size=3),
        lambda sd: sd.update(version=99),
        lambda sd: sd.pop("key"),
    ],
    ids=["sigma", "q", "N", "truncation", "version", "missing"],
)
def test_load_state_dict_refuses_mismatched_config(mutate):
    param = nn.Parameter(torch.zeros(3))
    opt = _dp(torch.optim.SGD([param], lr=0.1), sigma=1.0, key=0)
    _drawn(opt).step(_zero_clipped(param, 1.0))
    sd = copy.deepcopy(opt.state_dict())
    mutate(sd)
    fresh = _dp(torch.optim.SGD([param], lr=0.1), sigma=1.0, key=4)
    with pytest.raises(CheckpointError):
        fresh.load_state_dict(sd)
    assert fresh.steps == 0


# ----------------------------------------------------------------------------- accumulate
def test_accumulate_two_halves_equals_one_batch():
    case = conv2d_case(seed=8, dtype=torch.float64)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=0.3, physical_batch_size=4, backend=None)
    x, y = case.make_batch(9, 0)
    whole = step(x, y).clipped
    a, b = step(x[:5], y[:5]).clipped, step(x[5:], y[5:]).clipped
    acc_ = accumulate([a, b])
    assert acc_.num_examples == 9 and acc_.clipping_norm == 0.3
    assert_trees_close(acc_.grads, whole.grads, torch.float64)
    torch.testing.assert_close(acc_.per_example_norms, whole.per_example_norms)
    # DPOptimizer.step on the list is step on the accumulation.
    results = []
    for arg in ([a, b], acc_):
        model = copy.deepcopy(case.model)
        params = dict(model.named_parameters())
        remap = lambda cl: ClippedPytree(grads=cl.grads, clipping_norm=cl.clipping_norm, per_example_norms=cl.per_example_norms,
                                         num_examples=cl.num_examples, parameters=params)
        arg = [remap(c) for c in arg] if isinstance(arg, list) else remap(arg)
        opt = _dp(torch.optim.SGD(model.parameters(), lr=1.0), sigma=1.0, key=3)
        _drawn(opt).step(arg)
        assert opt.steps == 1
        results.append([p.detach().clone() for p in model.parameters()])
    for p, q in zip(*results):
        torch.testing.assert_close(p, q)


def test_accumulate_refusals():
    param = nn.Parameter(torch.zeros(3))
    a = _zero_clipped(param, 1.0)
    with pytest.raises(InputTypeError):
        accumulate([])
    with pytest.raises(InputTypeError):
        accumulate([a, {"w": torch.zeros(3)}])
    with pytest.raises(ConfigurationError):
        accumulate([a, _zero_clipped(param, 2.0)])
    norm = ClippedPytree(grads={k: v.clone() for k, v in a.grads.items()}, clipping_norm=1.0, per_example_norms=torch.zeros(0), num_examples=0,
                         normalize_by=2.0, parameters=a.parameters)
    with pytest.raises(ConfigurationError):
        accumulate([a, norm])
    other = ClippedPytree(grads={"v": torch.zeros(3)}, clipping_norm=1.0, per_example_norms=torch.zeros(0),
                          num_examples=0, parameters={"v": param})
    with pytest.raises(ConfigurationError):
        accumulate([a, other])
    # More than 2^16 examples from float32 parts: their rounding adds up past the slack as the
    # rows shift between parts on a removal (numerics.MAX_FLOAT32_LOGICAL_ROWS; review).
    big = [ClippedPytree(grads={"w": torch.zeros(3)}, clipping_norm=1.0, per_example_norms=torch.zeros(0),
                         num_examples=40000, parameters={"w": param}) for _ in range(2)]
    with pytest.raises(ConfigurationError, match="80000 examples of a float32 .or lower-precision. model in one logical batch"):
        accumulate(big)
    # A float32 parameter's float64 sums (a compiled call of several float32 chunks) are counted
    # too (review); a float64 parameter's are not limited.
    chunked = [ClippedPytree(grads={"w": torch.zeros(3, dtype=torch.float64)}, clipping_norm=1.0,
                             per_example_norms=torch.zeros(0), num_examples=40000, parameters={"w": param}) for _ in range(2)]
    with pytest.raises(ConfigurationError, match="80000 examples of a float32 .or lower-precision. model in one logical batch"):
        accumulate(chunked)
    param64 = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    wide = [ClippedPytree(grads={"w": torch.zeros(3, dtype=torch.float64)}, clipping_norm=1.0,
                          per_example_norms=torch.zeros(0), num_examples=40000, parameters={"w": param64}) for _ in range(2)]
    assert accumulate(wide).num_examples == 80000


def test_passing_the_step_result_instead_of_its_clipped_sum_gets_a_hint():
    case = mlp_case(seed=0)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=1.0, physical_batch_size=4, backend=None)
    opt = _dp(torch.optim.SGD(case.model.parameters(), lr=0.1))
    with pytest.raises(InputTypeError, match=r"did you mean result\.clipped"):
        opt.step(step(*case.make_batch(3, 0)))
    assert opt.steps == 0


def test_privacy_configuration_is_read_only():
    """sigma, q and N feed both the noise and the accountant: they cannot drift apart."""
    opt = _dp(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1), sigma=1.0)
    for name in ("noise_multiplier", "sample_rate", "dataset_size", "truncated_batch_size", "expected_batch_size", "steps"):
        with pytest.raises(AttributeError):
            setattr(opt, name, 0.5)
    assert opt.noise_multiplier == 1.0


def test_an_optimizer_that_needs_a_closure_is_refused_at_construction():
    """``LBFGS.step(closure)`` re-evaluates the loss non-privately and DPOptimizer cannot pass a
    closure: every step used to be charged and then fail with torch's TypeError."""
    param = nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigurationError, match="LBFGS.step needs a closure"):
        _dp(torch.optim.LBFGS([param]))
    assert _dp(torch.optim.Adam([param])).steps == 0


def test_sparse_adam_is_refused_at_construction():
    """SparseAdam takes sparse gradients only and a noised gradient is dense: every step used to
    be charged, write .grad and then fail with torch's RuntimeError (a charging review)."""
    param = nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigurationError, match="SparseAdam takes sparse gradients only"):
        _dp(torch.optim.SparseAdam([param]))


@pytest.mark.parametrize("c", [float("nan"), -1.0, 0.0, "1"])
def test_a_clipped_sum_with_a_clipping_norm_that_is_not_positive_is_refused(c):
    """The noise is sigma times ``clipped.clipping_norm``: a NaN, zero, negative or non-numeric
    C (edited in, or from an unchecked clipping state) is refused before anything changes."""
    param = nn.Parameter(torch.zeros(3))
    opt = _dp(torch.optim.SGD([param], lr=1.0))
    if isinstance(c, float) and c <= 0:  # edited in: refused where the copy is made
        with pytest.raises(ConfigurationError, match="may only be raised"):
            dataclasses.replace(_zero_clipped(param, 1.0), clipping_norm=c)
    clipped = _zero_clipped(param, c)
    with pytest.raises(ConfigurationError, match="is not a positive number"):
        _drawn(opt).step(clipped)
    assert opt.steps == 0 and param.grad is None and torch.equal(param, torch.zeros(3))
