"""``opake_compile.opacus``: an Opacus training script runs by changing its imports.

Oracles: plain (non-private) training of an identical model (sigma = 0, a huge C and
sample_rate = 1, so that every Poisson draw is the whole dataset and q N = N), the per-example
loss written out by hand, and Opacus 1.6 itself (skipped when it is not installed) on the same
script at the same target epsilon.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import opake_compile as opake
from opake_compile._validate import NotPrivateWarning
from opake_compile.exceptions import ConfigurationError, InputTypeError, UnsupportedOperationError
from opake_compile.opacus import (
    BatchMemoryManager,
    GradSampleModule,
    ModuleValidator,
    PrivacyEngine,
    register_grad_sampler,
)

BACKEND = "aot_eager"
_SCRIPT = Path(__file__).resolve().parent / "_opacus_digits_script.py"


def _mlp(seed=0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def _private(mode="hooks", *, n=12, batch_size=12, sigma=0.0, C=1e6, reduction="mean", seed=0, accountant="prv", **kw):
    model = _mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    criterion = nn.CrossEntropyLoss(reduction=reduction)
    engine = PrivacyEngine(backend=BACKEND, accountant=accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        out = engine.make_private(
            module=model, optimizer=opt, criterion=criterion, data_loader=DataLoader(_data(n), batch_size=batch_size),
            noise_multiplier=sigma, max_grad_norm=C, loss_reduction=reduction, grad_sample_mode=mode,
            key=opake.random.key(seed), **kw,
        )
    if mode == "ghost":
        pmodel, popt, criterion, loader = out
    else:
        pmodel, popt, loader = out
    return engine, model, pmodel, popt, criterion, loader


# ------------------------------------------------------------------ equivalence with plain
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sigma0_huge_C_rate1_equals_plain_training(mode, reduction):
    engine, model, pmodel, popt, criterion, loader = _private(mode, reduction=reduction)
    plain = _mlp(0)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    x_all, y_all = _data().tensors
    assert len(loader) == 1  # sample_rate = 1 / len(loader) = 1
    for _ in range(3):
        for x, y in loader:
            assert len(x) == 12  # q = 1: every example in every draw
            popt.zero_grad()
            loss = criterion(pmodel(x), y)
            value = loss.item()  # before backward: the real loss
            loss.backward()
            popt.step()
        plain_opt.zero_grad()
        plain_loss = F.cross_entropy(plain(x_all), y_all, reduction=reduction)
        plain_loss.backward()
        plain_opt.step()
        assert value == pytest.approx(plain_loss.item(), rel=1e-5)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert popt.dp.steps == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        assert math.isinf(engine.get_epsilon(1e-5))  # sigma = 0: not private, and said so


def test_clipping_and_noise_match_the_definition():
    """C small, sigma > 0: the update is (sum of clipped per-example grads + N(0, (sigma C)^2)) / (q N),
    with the noise the underlying opake DPOptimizer draws from its key."""
    engine, model, pmodel, popt, criterion, loader = _private("hooks", sigma=0.0, C=0.05)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = next(iter(loader))
    criterion(pmodel(x), y).backward()
    popt.step()
    ref = _mlp(0)
    total = {k: torch.zeros_like(v) for k, v in before.items()}
    for i in range(len(x)):
        ref.zero_grad()
        F.cross_entropy(ref(x[i : i + 1]), y[i : i + 1]).backward()
        g = {k: p.grad for k, p in ref.named_parameters()}
        norm = torch.sqrt(sum((v**2).sum() for v in g.values()))
        for k in total:
            total[k] += g[k] * min(1.0, 0.05 / float(norm))
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[k] - 0.5 * total[k] / 12, rtol=1e-4, atol=1e-6, msg=k)


# ---------------------------------------------------------------- the Opacus-style script
def _load_script(tmp_path, which):
    source = _SCRIPT.read_text()
    if which == "opake":
        lines = [line for line in source.splitlines() if not line.startswith("from opacus")]
        lines.insert(lines.index("ENGINE_KWARGS = {}"), "from opake_compile.opacus import BatchMemoryManager, ModuleValidator, PrivacyEngine")
        assert len(lines) == len(source.splitlines()) - 2  # three imports became one: nothing else changed
        source = "\n".join(lines)
    path = tmp_path / f"digits_{which}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"_digits_script_{which}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Opacus's ModuleValidator.fix pickles the model class
    spec.loader.exec_module(module)
    if which == "opake":
        module.ENGINE_KWARGS = {"backend": BACKEND}
    return module


def _train(module, **kw):
    with torch.random.fork_rng(devices=[]):
        return module.train(**kw)


def test_opacus_script_runs_with_only_its_imports_changed(tmp_path):
    pytest.importorskip("sklearn")
    script = _load_script(tmp_path, "opake")
    result = _train(script, seed=0, epochs=1)
    assert result["epsilon"] <= 3.0 * 1.001
    assert result["epsilon"] > 2.9  # calibrated to spend the budget, not far below it
    assert result["accuracy"] > 0.5  # chance is 0.1
    assert all(math.isfinite(v) for v in result["losses"])


@pytest.mark.slow
def test_opacus_script_ghost_mode(tmp_path):
    pytest.importorskip("sklearn")
    script = _load_script(tmp_path, "opake")
    result = _train(script, seed=0, epochs=1, grad_sample_mode="ghost")
    assert result["epsilon"] <= 3.0 * 1.001 and result["accuracy"] > 0.5


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sigma_matches_opacus_at_the_same_target_epsilon():
    """Cheap CI check against Opacus: the noise multiplier each engine calibrates for the
    script's setting (prv in Opacus, PLD here) agrees within 2 %."""
    pytest.importorskip("opacus")
    from opacus.accountants.utils import get_noise_multiplier

    q, steps = 1 / 23, 23 * 6
    theirs = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=q, steps=steps, accountant="prv")
    ours = opake.opacus._engine._calibrated_sigma(3.0, 1e-5, q, 1437, steps, "pld")
    print(f"sigma for eps=3, delta=1e-5, q=1/23, {steps} steps: opacus (prv) {theirs:.4f}, opake (pld) {ours:.4f}")
    assert ours == pytest.approx(theirs, rel=0.02)


def _script_net(tmp_path):
    """The digits script's Net after Opacus's ModuleValidator.fix (GroupNorm), its initial
    weights and the script's training set (N = 1437); skips without opacus or sklearn."""
    pytest.importorskip("sklearn")
    opacus = pytest.importorskip("opacus")
    script = _load_script(tmp_path, "opacus")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = opacus.validators.ModuleValidator.fix(script.Net())
    train_set, _ = script.load_data()
    return net, {k: v.clone() for k, v in net.state_dict().items()}, train_set


def _flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_paired_steps_match_opacus_on_the_script_net(tmp_path, mode):
    """Paired check against Opacus 1.6 on the digits script's model: the same initial weights,
    the same Poisson batches, sigma = 0, C = 1, lr 0.5, momentum 0.5, loss_reduction="mean".

    The two libraries differ in exactly two documented constants: Opacus divides by
    int(q N) = 62 and clips to C, we divide by q N = 62.478... and clip to
    C_eff = C / (1 + 2^-10) (the float32 rounding slack). With those two matched, three steps
    (the second and third exercise momentum) give the same parameters; unmatched, the first
    update is Opacus's times (62 / q N) (C_eff / C). Then, with sigma = 1, the update's deviation
    from the sigma = 0 update, times q N / lr, has std sigma C in both libraries."""
    net, init, train_set = _script_net(tmp_path)
    from opacus import PrivacyEngine as OpacusEngine
    from opake_compile.compiler.passes.numerics import effective_clipping_norm

    lr, C = 0.5, 1.0

    def ours(sigma, steps):
        model = copy.deepcopy(net)
        model.load_state_dict(init)
        out = PrivacyEngine(backend=BACKEND).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5),
            criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(train_set, batch_size=64),
            noise_multiplier=sigma, max_grad_norm=C, grad_sample_mode=mode, key=opake.random.key(7),
        )
        pmodel, popt, criterion, loader = out if mode == "ghost" else (out[0], out[1], nn.CrossEntropyLoss(), out[2])
        batches, params = [], []
        for x, y in loader:
            popt.zero_grad()
            criterion(pmodel(x), y).backward()
            popt.step()
            batches.append((x, y))
            params.append(_flat_params(model))
            if len(batches) == steps:
                break
        return batches, params, popt

    def theirs(batches, sigma, *, matched):
        model = copy.deepcopy(net)
        model.load_state_dict(init)
        engine = OpacusEngine(accountant="prv")
        out = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5),
            criterion=nn.CrossEntropyLoss(), data_loader=DataLoader(train_set, batch_size=64),
            noise_multiplier=sigma, max_grad_norm=effective_clipping_norm(C, torch.float32) if matched else C,
            grad_sample_mode=mode, poisson_sampling=True,
        )
        pmodel, popt, loader = out[0], out[1], out[-1]
        criterion = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
        assert loader.sample_rate == 1 / 23 and len(loader) == 23
        assert popt.expected_batch_size == int(1437 / 23) == 62
        if matched:
            popt.expected_batch_size = 1437 / 23
        params = []
        for x, y in batches:
            popt.zero_grad()
            criterion(pmodel(x), y).backward()
            popt.step()
            params.append(_flat_params(model))
        return params

    batches, ours_params, popt = ours(0.0, 3)
    assert popt.dp.sampler.sample_rate == 1 / 23 and popt.expected_batch_size == pytest.approx(1437 / 23)
    start = torch.cat([init[k].flatten() for k, _ in net.named_parameters()])
    for t, (a, b) in enumerate(zip(ours_params, theirs(batches, 0.0, matched=True))):
        torch.testing.assert_close(a - start, b - start, rtol=1e-4, atol=1e-6, msg=f"step {t + 1}")
    unmatched = theirs(batches[:1], 0.0, matched=False)[0]
    ratio = (62 / (1437 / 23)) * effective_clipping_norm(C, torch.float32) / C
    torch.testing.assert_close(ours_params[0] - start, ratio * (unmatched - start), rtol=1e-4, atol=1e-6)

    # sigma = 1: the noise on the clipped sum has std sigma C per coordinate (about 10^4 of them,
    # so the sample std is within 4 % with overwhelming probability: its own std is 0.7 %).
    _, noisy, popt = ours(1.0, 1)
    ours_noise = (ours_params[0] - noisy[0]) * (1437 / 23) / lr
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        theirs_noise = (unmatched - theirs(batches[:1], 1.0, matched=False)[0]) * 62 / lr
    print(f"noise std on the sum (sigma C = 1): ours {ours_noise.std():.4f}, opacus {theirs_noise.std():.4f}, {ours_noise.numel()} coordinates")
    assert float(ours_noise.std()) == pytest.approx(1.0, rel=0.04)
    assert float(theirs_noise.std()) == pytest.approx(1.0, rel=0.04)
    assert abs(float(ours_noise.mean())) < 0.05


ACCURACY_SEEDS = range(20)  # chosen from the per-seed variance, not from the gap: see the docstring below


@pytest.mark.ondemand
def test_accuracy_matches_opacus_over_twenty_seeds(tmp_path):
    """The issue's end-to-end check: the digits script (only its imports changed, backend
    aot_eager) and the same script on Opacus 1.6, each run for seeds 0..19, reach mean test
    accuracies within 2 percentage points; our epsilon stays within the target.

    Why 20 seeds, not 3: one run's test accuracy (360 test digits) varies with the seed by
    1.1-1.3 pp (standard deviation, in both libraries; seeds 0..119: mean gap -0.05 pp,
    standard error 0.16 pp), so the mean of 3 seeds' gap has a standard deviation of about
    1 pp and the 2 pp bound fails about 5 % of the time with no real difference (seeds 0-2
    failed once, 2.04 pp, before our runs were keyed by the seed; seeds 3-5 then gave
    -1.4 pp). Over 20 seeds the gap's standard deviation is about 0.4 pp and a false failure
    has probability below 1e-6. The number of seeds was chosen from that variance, not from
    the gap. The systematic differences are pinned down cheaply elsewhere:
    test_paired_steps_match_opacus_on_the_script_net (the same updates once Opacus's int(q N)
    and our C_eff are matched; ours is 0.9913 of Opacus's otherwise) and
    test_sigma_matches_opacus_at_the_same_target_epsilon.

    Seed s fixes the initial weights in both libraries (torch.manual_seed in the script) and,
    for us, the batches and noise through ``PrivacyEngine(key=opake.random.key(s))`` (Opacus
    draws them from the seeded global generator), so the test repeats exactly.
    """
    pytest.importorskip("opacus")
    pytest.importorskip("sklearn")
    ours_script, theirs_script = _load_script(tmp_path, "opake"), _load_script(tmp_path, "opacus")
    ours, theirs = [], []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two intra-op threads stalled these small runs (~2 s each alone) on a loaded 2-core machine
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for seed in ACCURACY_SEEDS:
                ours_script.ENGINE_KWARGS = {"backend": BACKEND, "key": opake.random.key(seed)}
                ours.append(_train(ours_script, seed=seed))
                theirs.append(_train(theirs_script, seed=seed))
    finally:
        torch.set_num_threads(threads)
    mean = lambda rs, k: sum(float(r[k]) for r in rs) / len(rs)  # noqa: E731
    gap = mean(ours, "accuracy") - mean(theirs, "accuracy")
    sd = lambda rs: math.sqrt(sum((float(r["accuracy"]) - mean(rs, "accuracy")) ** 2 for r in rs) / (len(rs) - 1))  # noqa: E731
    se = math.sqrt((sd(ours) ** 2 + sd(theirs) ** 2) / len(ours))
    print("seed  opake   opacus")
    for seed, a, b in zip(ACCURACY_SEEDS, ours, theirs):
        print(f"{seed:4d}  {a['accuracy']:.4f}  {b['accuracy']:.4f}")
    print(
        f"opake: sigma {ours[0]['sigma']:.4f} eps {mean(ours, 'epsilon'):.4f} acc {mean(ours, 'accuracy'):.4f} (sd {sd(ours):.4f}) | "
        f"opacus: sigma {theirs[0]['sigma']:.4f} eps {mean(theirs, 'epsilon'):.4f} acc {mean(theirs, 'accuracy'):.4f} (sd {sd(theirs):.4f}) | "
        f"gap {gap:+.4f} (standard error {se:.4f})"
    )
    assert all(r["epsilon"] <= 3.0 * 1.001 for r in ours)
    assert abs(gap) <= 0.02


# --------------------------------------------------------------- Poisson, BMM, accounting
def test_empty_poisson_batch_steps_with_pure_noise():
    engine, model, pmodel, popt, criterion, loader = _private("hooks", n=6, batch_size=1, sigma=1.0, C=1.0)
    seen_empty = 0
    for x, y in loader:
        before = [p.detach().clone() for p in model.parameters()]
        popt.zero_grad()
        loss = criterion(pmodel(x), y)
        loss.backward()
        popt.step()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert changed  # every draw is a noisy step, the empty ones included
        seen_empty += len(x) == 0
    assert seen_empty > 0  # q = 1/6, N = 6: (5/6)^6 = 33 % of the draws are empty
    assert popt.dp.steps == len(loader) == 6
    expected = opake.accounting.Accountant("pld").epsilon(opake.accounting.dpsgd_step_process(1.0, 1 / 6, dataset_size=6) * 6, 1e-5)
    assert engine.get_epsilon(1e-5) == pytest.approx(expected)


@pytest.mark.parametrize("accountant, method", [("prv", "pld"), ("rdp", "rdp")])
def test_skipped_draw_is_charged_and_get_epsilon_is_the_accountants(accountant, method):
    engine, model, pmodel, popt, criterion, loader = _private("hooks", n=12, batch_size=4, sigma=1.0, C=1.0, accountant=accountant)
    assert engine.accountant.mechanism() == method
    for i, (x, y) in enumerate(loader):
        if i == 1:
            continue  # e.g. "if len(x) == 0: continue": the draw was still made
        criterion(pmodel(x), y).backward()
        popt.step()
        popt.zero_grad()
    assert popt.dp.steps == len(engine.accountant) == 3
    process = opake.accounting.dpsgd_step_process(1.0, 1 / 3, dataset_size=12) * 3
    assert engine.get_epsilon(1e-5) == pytest.approx(opake.accounting.Accountant(method).epsilon(process, 1e-5))


def test_batch_memory_manager_one_step_per_draw_same_result():
    results = []
    for max_physical in (None, 5):
        engine, model, pmodel, popt, criterion, loader = _private("ghost", n=12, batch_size=12)
        batches = 0
        if max_physical is None:
            it = loader
            for x, y in it:
                criterion(pmodel(x), y).backward()
                popt.step()
                popt.zero_grad()
                batches += 1
        else:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=max_physical, optimizer=popt) as small:
                for x, y in small:
                    assert len(x) <= max_physical
                    popt.zero_grad()
                    criterion(pmodel(x), y).backward()
                    popt.step()
                    batches += 1
        results.append(([p.detach().clone() for p in model.parameters()], popt.dp.steps, batches))
    (p_full, steps_full, b_full), (p_split, steps_split, b_split) = results
    assert steps_full == steps_split == 1 and b_full == 1 and b_split == 3
    for a, b in zip(p_full, p_split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_across_draws_is_refused():
    engine, model, pmodel, popt, criterion, loader = _private("hooks", n=12, batch_size=4, sigma=1.0, C=1.0)
    it = iter(loader)
    x, y = next(it)
    criterion(pmodel(x), y).backward()
    x, y = next(it)
    with pytest.raises(UnsupportedOperationError, match="gradient accumulation over several Poisson batches"):
        criterion(pmodel(x), y).backward()


def test_engine_key_makes_the_run_reproducible():
    """PrivacyEngine(key=...): make_private calls without key= or noise_generator= take the
    next child of the engine's key, so the same key gives the same draws and noise (as
    torch.manual_seed does for Opacus's non-secure mode) and two calls differ."""

    def run(engine):
        model = _mlp(0)
        pmodel, popt, loader = engine.make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(_data(12), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
        )
        sizes = []
        for x, y in loader:
            sizes.append(len(x))
            F.cross_entropy(pmodel(x), y).backward()
            popt.step()
            popt.zero_grad()
        return sizes, torch.cat([p.detach().flatten() for p in model.parameters()])

    a, b = PrivacyEngine(backend=BACKEND, key=opake.random.key(3)), PrivacyEngine(backend=BACKEND, key=opake.random.key(3))
    first_a, first_b = run(a), run(b)
    assert first_a[0] == first_b[0] and torch.equal(first_a[1], first_b[1])
    second_a = run(a)
    assert not torch.equal(first_a[1], second_a[1])  # the next call takes the next key
    other = run(PrivacyEngine(backend=BACKEND, key=opake.random.key(4)))
    assert not torch.equal(first_a[1], other[1])
    with pytest.raises(InputTypeError, match="opake_compile.random.Key"):
        PrivacyEngine(key=3)


def test_one_noise_generator_gives_each_call_its_own_noise():
    """The key came from ``noise_generator.initial_seed()`` alone: two ``make_private`` calls
    with one generator drew the same batches and the same noise (ten bit-identical updates on
    two datasets, so their difference was noise-free). The key is now drawn from the generator:
    the calls differ, and a generator seeded alike reproduces the run."""

    def run(generator):
        model = _mlp(0)
        pmodel, popt, loader = PrivacyEngine(backend=BACKEND).make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
            data_loader=DataLoader(_data(12), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
            noise_generator=generator,
        )
        for x, y in loader:
            F.cross_entropy(pmodel(x), y).backward()
            popt.step()
            popt.zero_grad()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    g = torch.Generator().manual_seed(1234)
    first, second = run(g), run(g)
    assert not torch.equal(first, second)
    assert torch.equal(first, run(torch.Generator().manual_seed(1234)))


# ------------------------------------------------------------------ losses that are refused
@pytest.mark.parametrize(
    "make_loss, match",
    [
        (lambda out, y: F.cross_entropy(out, y) + out.std(), "mixes examples"),  # a batch statistic
        (lambda out, y: F.cross_entropy(out, y, weight=torch.tensor([1.0, 2.0, 3.0])), "mixes examples"),  # weighted mean
        (lambda out, y: F.cross_entropy(out, y, reduction="sum"), "loss_reduction='mean'"),  # not the declared reduction
        (lambda out, y: F.cross_entropy(out, y, reduction="sum") / out.shape[0], "scaled by 12"),  # a baked batch size
        # The mean divided once more by the batch size: the mean of the per-example losses
        # matches, but each one carries n (a newcomer's construction moved a sum by 1.88 C).
        (lambda out, y: F.cross_entropy(out, y) / len(out), "scaled by 12"),
        (lambda out, y: F.cross_entropy(out, y) * (1.0 / y.shape[0]), "scaled by 0.0833"),
        (lambda out, y: F.cross_entropy(out, y).div(torch.tensor(float(y.numel()))), "scaled by 12.0"),
        (lambda out, y: F.cross_entropy(out, y) / F.cross_entropy(out, y).item(), "read out of the batch"),
        (lambda out, y: F.cross_entropy(out.view(12, 3), y), "one example at a time"),
    ],
)
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_losses_that_mix_examples_are_refused(mode, make_loss, match):
    engine, model, pmodel, popt, criterion, loader = _private(mode, sigma=1.0, C=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(loader))
    loss = make_loss(pmodel(x), y)
    with pytest.raises(UnsupportedOperationError, match=match):
        loss.backward()
    with pytest.raises(UnsupportedOperationError, match="without a recorded training forward and loss.backward"):
        popt.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert popt.dp.steps == 0


def _ce_none(out, y):
    return F.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize(
    "make_loss, match",
    [
        # Per-example weights normalised over the batch: each example's loss, evaluated alone,
        # carries the others' weights (each passed every check before, with
        # loss_reduction="sum": evaluated per example, they sum to the batch loss).
        (lambda out, x, y: (_ce_none(out, y) * torch.full((len(y),), 1.0 / len(y))).sum(), "is 1 / n"),
        (lambda out, x, y: (_ce_none(out, y) * ((y != 0).float() / (y != 0).float().sum())).sum(), r"is 1 / \(the (sum|count of non-zero entries) of"),
        # Divided by a statistic of a batched tensor the loss reads: a mask's count, a weight total.
        (lambda out, x, y: (_ce_none(out, y) * (y != 0).float()).sum() / (y != 0).float().sum(), r"is the sum of the batch's tensor of shape \(12,\)"),
        (lambda out, x, y: (_ce_none(out, y) * (y != 0).float()).sum() / float((y != 0).float().sum()), "is the sum of the batch's tensor"),
        (lambda out, x, y: (_ce_none(out, y) * (0.3 + 0.1 * y)).sum() / float((0.3 + 0.1 * y).sum()), "is the sum of the batch's tensor"),
    ],
)
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_losses_normalised_by_a_statistic_of_the_batch_are_refused(mode, make_loss, match):
    engine, model, pmodel, popt, criterion, loader = _private(mode, sigma=1.0, C=1.0, reduction="sum")
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(loader))
    loss = make_loss(pmodel(x), x, y)
    with pytest.raises(UnsupportedOperationError, match=match):
        loss.backward()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert popt.dp.steps == 0


def test_a_token_count_normaliser_is_never_cleared():
    """A reviewer's loop: the division by the batch's mask count, with the refused draws skipped
    as the message allows. One step whose count equalled the previous step's (at another batch
    size) cleared it for good before, and every later step trained with the leak; a statistic
    that follows the batch must be refused at every step of two or more examples."""
    engine, model, pmodel, popt, criterion, loader = _private("hooks", n=48, batch_size=6, sigma=1.0, C=1.0, reduction="sum")
    accepted, refused = [], 0
    for _ in range(4):
        for x, y in loader:
            m = (y != 0).float()
            try:
                ((_ce_none(pmodel(x), y) * m).sum() / float(m.sum())).backward()
            except UnsupportedOperationError as err:
                assert "is the sum of" in str(err) or "is n" in str(err)
                refused += 1
                continue
            popt.step()
            popt.zero_grad()
            accepted.append((len(x), int(m.sum())))
    # Accepted only where the statistic is not one (fewer than 2 examples, or a count below 3).
    assert all(n < 2 or count < 3 for n, count in accepted), accepted
    assert refused > 10


def _steps_of_one_scaled_loss(steps, dtype=torch.float32, width=4, tol=1e-9):
    """:func:`_checked` over ``steps`` of (n, mask count, number the loss is scaled by), with a
    (n, width) mask the loss reads; True where the step was accepted."""
    checked = []
    for n, count, value in steps:
        mask = torch.zeros(n * width)
        mask[:count] = 1.0
        checked.append((n, [mask.view(n, width).to(dtype)], value, tol))
    return _checked(checked)


def test_empty_draws_with_a_scaling_constant_train():
    # An empty Poisson draw after a step scaled by the same constant divided by n = 0 in the
    # statistics check (ZeroDivisionError at loss.backward()).
    engine, model, pmodel, popt, criterion, loader = _private("hooks", n=24, batch_size=1, sigma=1.0, C=1.0, reduction="sum")
    sizes = []
    for _ in range(2):
        for x, y in loader:
            sizes.append(len(x))
            (F.cross_entropy(pmodel(x), y, reduction="sum") / 4.0).backward()
            popt.step()
            popt.zero_grad()
    assert sizes.count(0) > 0 and popt.dp.steps == len(sizes)


def test_a_statistic_is_not_cleared_by_steps_where_it_was_small_or_equal_to_n():
    # A reviewer-style edge: the normaliser is the mask's count throughout. At two steps the
    # count was 2 (below the refusal threshold), or equal to n and then the same at another
    # n; read as "the number stayed while nothing it matched moved", it was cleared for good
    # and every later step leaked. It must be refused wherever its count is 3 or more.
    assert _steps_of_one_scaled_loss([(4, 2, 2.0), (3, 2, 2.0), (5, 10, 10.0), (6, 9, 9.0)]) == [True, True, False, False]
    assert _steps_of_one_scaled_loss([(5, 5, 5.0), (4, 5, 5.0), (6, 9, 9.0)]) == [False, False, False]
    # An empty batch (n = 0) with a scaling constant: no statistic is zero-divided.
    assert _steps_of_one_scaled_loss([(3, 1, 0.25), (0, 0, 0.25), (3, 2, 0.25)]) == [True, True, True]
    # A second reviewer's sequences: a statistic that matched nothing at two steps (a count of
    # 0 clamped to 1, two empty draws, a count of 0 then 1) was cleared as a constant, and so
    # was a bfloat16 count that rounded to the same value at two steps; both leaked after.
    assert _steps_of_one_scaled_loss([(4, 0, 1.0), (4, 1, 1.0), (4, 10, 10.0), (5, 12, 12.0)]) == [True, True, False, False]
    assert _steps_of_one_scaled_loss([(4, 0, 1.0), (5, 0, 1.0), (4, 10, 10.0), (5, 12, 12.0)]) == [True, True, False, False]
    assert _steps_of_one_scaled_loss([(0, 0, 0.0), (0, 0, 0.0), (4, 10, 10.0), (5, 12, 12.0)]) == [True, True, False, False]
    # A rounded count that matched nothing at two steps (1001 and 1002 read as 1000) proves
    # nothing: a later step whose count is exactly 1000 is still refused.
    assert _steps_of_one_scaled_loss([(4, 1001, 1000.0), (4, 1002, 1000.0), (4, 1000, 1000.0)], width=400) == [True, True, False]
    bf16_tol = 4 * torch.finfo(torch.bfloat16).eps  # a one-element bfloat16 sum
    assert _steps_of_one_scaled_loss([(4, 1000, 1000.0), (4, 1001, 1000.0), (4, 1600, 1600.0)],
                                     dtype=torch.bfloat16, width=400, tol=bf16_tol) == [False, False, False]
    # A fixed constant that equals the first batch's size and count by chance is cleared by
    # the next step, where both moved and it did not; one that equals a later step's count
    # is cleared at that step, the step before having shown it.
    assert _steps_of_one_scaled_loss([(8, 8, 8.0), (7, 7, 8.0), (8, 8, 8.0), (9, 8, 8.0)]) == [False, True, True, True]
    assert _steps_of_one_scaled_loss([(5, 4, 8.0), (6, 5, 8.0), (8, 8, 8.0), (7, 9, 8.0)]) == [True, True, True, True]


def _checked(steps):
    """Program.check_batch_size over ``steps`` of (n, tensors the loss reads, the number the
    loss is scaled by, its tolerance); True where the step was accepted."""
    import dataclasses

    from opake_compile.opacus._tape import Program

    @dataclasses.dataclass(frozen=True)
    class Scaled(Program):
        found: tuple = ()

        def scaling_constants(self, externals, n=None):
            return ("one loss",), list(self.found)

    history, out = {}, []
    for n, tensors, value, tol in steps:
        program = Scaled(ops=(), target=0, externals=tuple(range(len(tensors))), tainted=(), found=((0, value, tol),))
        try:
            program.check_batch_size(n, tensors, history)
            out.append(True)
        except UnsupportedOperationError:
            out.append(False)
    return out


def test_rounded_statistics_and_other_tensors_counts_are_not_cleared_or_missed():
    # A third reviewer's cases. A float16 mask count read back in float32 matches nothing at a
    # step where it rounded (2049 -> 2048); the exact count then "moved" by 1 and 2048 was
    # cleared, so every later step with exactly 2048 tokens leaked.
    u32 = 4 * torch.finfo(torch.float32).eps
    steps = []
    for count in (2049, 2048, 2048, 2050, 2048):
        m = torch.zeros(8 * 400)
        m[:count] = 1.0
        m = m.view(8, 400).half()
        steps.append((8, [m], float(m.sum().float()), u32))
    assert _checked(steps) == [True, False, False, False, False]  # the rounded first step is not recognised
    # A float16 weight total (100.03, read as 100.0 within its rounding) and then exact
    # integer weights summing to 100: not a move of the statistic.
    w1 = torch.full((4, 4), 100.03 / 16).half()
    w2 = torch.zeros(4, 4)
    w2.view(-1)[:10] = 10.0
    assert _checked([(4, [w1], float(w1.float().sum()), u32), (4, [w2], 100.0, u32), (4, [w2], 100.0, u32)]) == [False, False, False]
    # A batch-wide weight 1 / count, with the count another tensor's (the mask's).
    for count in (5, 7, 9):
        m = torch.zeros(16)
        m[:count] = 1.0
        m = m.view(4, 4)
        w = torch.ones(4, 4) / m.sum()
        assert _checked([(4, [m, w], float(w[0, 0]), u32)]) == [False]
    # Tensor types without every comparison kernel, and a sparse one: no crash.
    for t in (torch.ones(4, 3, dtype=torch.uint16), torch.ones(4, 3, dtype=torch.uint64), torch.eye(4).to_sparse()):
        assert _checked([(4, [t], 2.5, 1e-9)]) == [True]


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_weights_of_each_examples_own_and_fixed_factors_still_train(mode):
    # Per-example weights that are each example's own (a function of its label) and fixed
    # factors train at every step, with batches of varying size and content.
    engine, model, pmodel, popt, criterion, loader = _private(mode, n=48, batch_size=8, sigma=1.0, C=1.0, reduction="sum")
    steps = 0
    for _ in range(3):
        for x, y in loader:
            out = pmodel(x)
            # ... including 0/1 indicators (a single positive in a batch sums to 1 over it).
            positive = (y == 1).float()
            ((_ce_none(out, y) * (0.3 + 0.1 * y)).sum() * 0.5 + 0.0 * F.cross_entropy(out, y, reduction="sum") / 4.0
             + (_ce_none(out, y) * positive).sum()).backward()
            popt.step()
            popt.zero_grad()
            steps += 1
    assert popt.dp.steps == steps > 0


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_constant_factors_other_than_the_batch_size_are_kept(mode):
    engine, model, pmodel, popt, criterion, loader = _private(mode, sigma=1.0, C=1.0)
    x, y = next(iter(loader))
    (0.5 * F.cross_entropy(pmodel(x), y) / 3.0 + 0.0 * pmodel(x).shape[1]).backward()
    popt.step()
    assert popt.dp.steps == 1


def test_loss_reading_a_batch_statistic_without_batch_dim_refused():
    engine, model, pmodel, popt, criterion, loader = _private("hooks", n=12, batch_size=4, sigma=1.0, C=1.0)
    with pytest.raises(UnsupportedOperationError, match="whose value changed since the first step"):
        for x, y in loader:  # the mean label differs between draws
            (criterion(pmodel(x), y) * (1 + y.float().mean())).backward()
            popt.step()
            popt.zero_grad()


def test_backward_twice_and_two_forwards_refused():
    engine, model, pmodel, popt, criterion, loader = _private("hooks", sigma=1.0, C=1.0)
    x, y = next(iter(loader))
    with pytest.raises(UnsupportedOperationError, match="several model"):
        (criterion(pmodel(x), y) + criterion(pmodel(x), y)).backward()
    loss = criterion(pmodel(x), y)
    loss.backward()
    with pytest.raises(UnsupportedOperationError, match="already called on this forward"):
        loss.backward()


def test_batch_not_from_the_returned_loader_refused():
    engine, model, pmodel, popt, criterion, loader = _private("hooks", sigma=1.0, C=1.0)
    x, y = _data().tensors
    with pytest.raises(ConfigurationError, match="did not come from the DataLoader"):
        criterion(pmodel(x), y).backward()


def test_eval_mode_is_the_plain_module():
    engine, model, pmodel, popt, criterion, loader = _private("hooks")
    x, _ = _data().tensors
    pmodel.eval()
    assert type(pmodel(x)) is torch.Tensor
    torch.testing.assert_close(pmodel(x), model(x))
    with torch.no_grad():
        pmodel.train()
        assert type(pmodel(x)) is torch.Tensor


# ---------------------------------------------------------- refusals at make_private time
def _make(**changes):
    model = _mlp()
    args = dict(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(_data(), batch_size=4),
        noise_multiplier=1.0, max_grad_norm=1.0,
    )
    args.update(changes)
    return PrivacyEngine(backend=BACKEND).make_private(**args)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"clipping": "per_layer"}, "per-layer clipping.*flat clipping"),
        ({"max_grad_norm": [1.0, 1.0, 1.0, 1.0]}, "per-layer clipping"),
        ({"clipping": "adaptive"}, "clipping='adaptive'.*adaptive_clipped_grad"),
        ({"grad_sample_mode": "functorch"}, "custom or functorch grad samplers.*'hooks' or 'ghost'"),
        ({"grad_sample_mode": "ew"}, "grad_sample_mode='ew'"),
        ({"poisson_sampling": False}, "poisson_sampling=False"),
        ({"batch_first": False}, "batch_first=False"),
        ({"wrap_model": False}, "wrap_model=False.*GradSampleHooks"),
        ({"some_opacus_option": 1}, "some_opacus_option"),
        ({"module": nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))}, "BatchNorm.*GroupNorm"),
    ],
)
def test_make_private_refusals_name_feature_and_alternative(changes, match):
    if "module" in changes:
        changes["optimizer"] = torch.optim.SGD(changes["module"].parameters(), lr=0.1)
    with pytest.raises(UnsupportedOperationError, match=match):
        _make(**changes)


def test_other_refusals():
    with pytest.raises(UnsupportedOperationError, match="secure_mode.*random_key"):
        PrivacyEngine(secure_mode=True)
    with pytest.raises(UnsupportedOperationError, match="accountant='gdp'.*'prv'"):
        PrivacyEngine(accountant="gdp")
    with pytest.raises(UnsupportedOperationError, match="GradSampleModule.*compile_dp"):
        GradSampleModule(_mlp())
    with pytest.raises(UnsupportedOperationError, match="custom grad samplers"):
        register_grad_sampler(nn.Linear)
    hooked = _mlp()
    hooked[0].register_full_backward_hook(lambda *a: None)
    with pytest.raises(UnsupportedOperationError, match="backward hooks"):
        _make(module=hooked, optimizer=torch.optim.SGD(hooked.parameters(), lr=0.1))
    with pytest.raises(ConfigurationError, match="not the module's"):
        _make(optimizer=torch.optim.SGD(_mlp().parameters(), lr=0.1))
    with pytest.raises(ConfigurationError, match="reduction='sum' but loss_reduction='mean'"):
        _make(criterion=nn.CrossEntropyLoss(reduction="sum"), grad_sample_mode="ghost")


# ------------------------------------------------------------------------ ModuleValidator
def test_module_validator_fix_as_opacus():
    model = nn.Sequential(nn.Conv2d(1, 48, 3), nn.BatchNorm2d(48), nn.InstanceNorm2d(48, track_running_stats=True))
    errors = ModuleValidator.validate(model)
    assert len(errors) == 2 and all(isinstance(e, UnsupportedOperationError) for e in errors)
    assert not ModuleValidator.is_valid(model)
    with pytest.raises(UnsupportedOperationError, match="BatchNorm"):
        ModuleValidator.validate(model, strict=True)
    fixed = ModuleValidator.fix(model)
    assert isinstance(model[1], nn.BatchNorm2d)  # the original is untouched
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1].num_groups == math.gcd(32, 48) == 16
    assert not fixed[2].track_running_stats
    assert ModuleValidator.validate(fixed) == []
    assert isinstance(ModuleValidator.fix(nn.BatchNorm1d(8), replace_bn_with_in=True), nn.InstanceNorm1d)
    assert ModuleValidator.fix(nn.BatchNorm1d(8), num_groups=2).num_groups == 2


def test_module_validator_fix_agrees_with_opacus():
    opacus = pytest.importorskip("opacus")
    model = nn.Sequential(nn.Conv2d(1, 48, 3), nn.BatchNorm2d(48))
    fixed = ModuleValidator.fix(model)
    theirs = opacus.validators.ModuleValidator.fix(model)
    assert type(theirs[1]) is type(fixed[1]) and theirs[1].num_groups == fixed[1].num_groups


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_backwarding_the_same_batch_twice_before_a_step_is_refused(mode):
    # Before: each backward added a part, so the draw's examples were summed twice (2 C of
    # sensitivity) while one step was charged.
    engine, model, pmodel, popt, criterion, loader = _private(mode, n=12, batch_size=12, sigma=1.0, C=1.0)
    for x, y in loader:
        if len(x) == 0:
            continue
        before = [p.detach().clone() for p in model.parameters()]
        criterion(pmodel(x), y).backward()
        # Refused at the second backward (the chunk index is checked, so that skipping another
        # physical batch cannot keep the count equal to the draw's: 2 C, review).
        with pytest.raises(UnsupportedOperationError, match="already backwarded"):
            criterion(pmodel(x), y).backward()
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert popt.dp.steps == 0
        popt.step()  # the first backward's part alone
        assert popt.dp.steps == 1
        break


@pytest.mark.parametrize("reuse", ["same tensors", "a view"])
def test_reusing_an_earlier_draws_batch_is_refused(reuse):
    # Before: the charged draw was read from the loader's position only, so a loop that kept
    # the first batch and trained on it at every iteration was charged as fresh Poisson draws
    # at rate q while the same examples took part in every step.
    engine, model, pmodel, popt, criterion, loader = _private("hooks", n=40, batch_size=4, sigma=1.0, C=1.0)
    kept = None
    for i, (x, y) in enumerate(loader):
        if kept is None:
            if len(x) == 0:
                continue
            kept = (x, y)
            criterion(pmodel(x), y).backward()
            popt.step()
            popt.zero_grad()
            continue
        steps = popt.dp.steps
        before = [p.detach().clone() for p in model.parameters()]
        kx = kept[0] if reuse == "same tensors" else kept[0].view(len(kept[0]), 5)[:, :]
        with pytest.raises(UnsupportedOperationError, match="earlier Poisson draw"):
            criterion(pmodel(kx), kept[1]).backward()
        assert popt.dp.steps == steps
        assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
        break
    else:
        pytest.fail("the loader yielded fewer than two draws")


def test_part_of_the_yielded_batch_is_refused():
    engine, model, pmodel, popt, criterion, loader = _private("hooks", n=40, batch_size=4, sigma=1.0, C=1.0)
    for x, y in loader:
        if len(x) < 2:
            continue
        with pytest.raises(UnsupportedOperationError, match=f"has {len(x)}"):
            pmodel(x[1:].clone())
        break


def test_batches_sharing_one_storage_still_train():
    # A collate function that slices one dataset-wide tensor yields every batch as a view of
    # the same storage: the current batch shares it, so it is not mistaken for an old one.
    engine, model, pmodel, popt, criterion, loader = _private("hooks", n=40, batch_size=4, sigma=1.0, C=1.0)
    X, Y = _data(40).tensors
    loader.collate_fn.collate_fn = lambda items: (X[: len(items)], Y[: len(items)])
    stepped = 0
    for x, y in loader:
        criterion(pmodel(x), y).backward()
        popt.step()
        popt.zero_grad()
        stepped += 1
    assert stepped == len(loader) and popt.dp.steps == stepped


def test_a_constant_equal_to_one_batch_size_is_cleared_once_another_size_was_seen():
    """Poisson batch sizes vary: a real constant (here / 8.0 at an expected batch of 8) equals
    some step's n by chance. It is refused only before a batch of another size showed it
    fixed (a reviewer saw random refusals mid-training without that); / len(x) is refused at
    every step."""
    engine, model, pmodel, popt, criterion, loader = _private("ghost", n=48, batch_size=8, sigma=1.0, C=1.0)
    refused, accepted = [], []
    for _ in range(4):
        for x, y in loader:
            try:
                (F.cross_entropy(pmodel(x), y) / 8.0).backward()
            except UnsupportedOperationError as err:
                assert "scaled by 8.0" in str(err)
                refused.append((len(accepted), len(x)))
                continue
            popt.step()
            popt.zero_grad()
            accepted.append(len(x))
    first_other = next(i for i, m in enumerate(accepted) if m != 8)
    assert all(at <= first_other for at, _ in refused), (refused, accepted)
    assert 8 in accepted[first_other:], accepted  # a batch of 8 stepped after the evidence
    x, y = next(iter(loader))
    with pytest.raises(UnsupportedOperationError, match="is 1 / n"):
        (F.cross_entropy(pmodel(x), y) * (1.0 / len(x))).backward()


def test_one_key_object_for_two_runs_is_refused():
    # An lr sweep on one dataset: two make_private calls (or two engines) given one key object
    # would split it into the same sampling and noise keys, so the difference of the two runs'
    # updates would carry no noise, while get_epsilon composed them as independent. A review
    # found both accepted (DPOptimizer itself refuses one key for two optimizers).
    from opake_compile import random as opake_random

    k = opake_random.key(7)
    engine = PrivacyEngine(backend=BACKEND)
    model = _mlp()
    loader = DataLoader(_data(), batch_size=4)
    with pytest.raises(UnsupportedOperationError):  # a refused call leaves the key free
        engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
                            noise_multiplier=1.0, max_grad_norm=1.0, key=k, clipping="per_layer")
    engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=loader,
                        noise_multiplier=1.0, max_grad_norm=1.0, key=k)
    other = _mlp()
    with pytest.raises(ConfigurationError, match="already used by another DPOptimizer"):
        engine.make_private(module=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), data_loader=loader,
                            noise_multiplier=1.0, max_grad_norm=1.0, key=k)
    assert len(engine._optimizers) == 1  # the refused call left nothing behind
    # Keys of equal value (seeded alike) stay allowed: two runs of one script.
    engine.make_private(module=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), data_loader=loader,
                        noise_multiplier=1.0, max_grad_norm=1.0, key=opake_random.key(7))
    e = opake_random.key(8)
    PrivacyEngine(backend=BACKEND, key=e)
    with pytest.raises(ConfigurationError, match="already used by another DPOptimizer"):
        PrivacyEngine(backend=BACKEND, key=e)


def test_a_target_delta_of_at_least_one_over_n_is_refused():
    model = _mlp()
    n = len(_data())
    with pytest.raises(ConfigurationError, match="at least 1/N"):
        PrivacyEngine(backend=BACKEND).make_private_with_epsilon(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data_loader=DataLoader(_data(), batch_size=4),
            target_epsilon=1.0, target_delta=1.0 / n, epochs=1, max_grad_norm=1.0)


def test_a_second_engine_on_one_model_and_a_new_max_grad_norm_are_refused():
    """Two PrivacyEngines on one model each reported the epsilon of their own steps (4.206
    each, 5.458 together); optimizer.max_grad_norm = 0.01 (an Opacus clipping schedule) was
    accepted and ignored (review)."""
    engine, model, pmodel, popt, criterion, loader = _private("hooks", sigma=1.0, C=1.0)
    with pytest.raises(ConfigurationError, match="max_grad_norm is fixed at 1.0"):
        popt.max_grad_norm = 0.01
    assert popt.max_grad_norm == 1.0
    other = PrivacyEngine(backend=BACKEND)
    with pytest.raises(ConfigurationError, match="made private by another PrivacyEngine"):
        other.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           data_loader=DataLoader(_data(12), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0)
    again = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                data_loader=DataLoader(_data(12), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0)
    assert len(again) == 3  # the same engine composes its runs


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_a_forward_that_replaces_a_buffer_is_refused_and_the_buffer_put_back(mode):
    """A running statistic kept by reassigning a buffer in forward was computed by the eager
    forward on the whole batch and released with the weights uncharged (12 steps moved it from
    ~0.2 to ~-600 with one outlier: review)."""

    class Tracked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)
            self.register_buffer("mu", torch.zeros(5))

        def forward(self, x):
            if self.training:
                self.mu = (0.9 * self.mu + 0.1 * x.mean(0)).detach()
            return self.lin(x - self.mu)

    model = Tracked()
    engine = PrivacyEngine(backend=BACKEND)
    out = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              data_loader=DataLoader(_data(12), batch_size=4), noise_multiplier=1.0, max_grad_norm=1.0,
                              grad_sample_mode=mode)
    pmodel, loader = out[0], out[-1]
    mu = model.mu
    for x, y in loader:
        if len(x):
            with pytest.raises(UnsupportedOperationError, match="replaced its buffer 'mu'"):
                pmodel(x)
            break
    assert model.mu is mu and torch.equal(mu, torch.zeros(5))


def test_a_loop_left_mid_draw_goes_on_with_the_next_draw():
    """A break inside BatchMemoryManager left the draw's first physical batches pending, and every
    later backward was refused as accumulation across draws, with no way out (review). They are
    dropped unreleased (with a warning) and the draw is charged with the next step."""
    engine, model, pmodel, popt, criterion, loader = _private("hooks", n=40, batch_size=8, sigma=1.0, C=1.0)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=popt) as small:
        for x, y in small:
            criterion(pmodel(x), y).backward()
            popt.step()
            popt.zero_grad()
            if popt.accumulated_iterations > 0:
                break
    assert popt.dp.steps == 0
    with pytest.warns(UserWarning, match="dropped unreleased"):
        with BatchMemoryManager(data_loader=loader, max_physical_batch_size=2, optimizer=popt) as small:
            for x, y in small:
                criterion(pmodel(x), y).backward()
                popt.step()
                popt.zero_grad()
    assert popt.dp.steps >= 6  # the left draw (charged as skipped) and an epoch of 5
