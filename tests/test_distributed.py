"""Tests for opake_compile.distributed.

Distributed scenarios run once per module: the fixture ``runs`` starts two worker processes
(this file run as a script, Gloo on CPU, a ``FileStore`` rendezvous in a temporary directory)
that go through every scenario and save what they saw; the tests then compare the ranks with
each other and with single-process references computed here. Each worker sets a 60 s collective
timeout and the fixture a wall-clock limit, so a deadlock fails instead of hanging.

Statistical tests use fixed keys (deterministic); their thresholds are passed by a correct
implementation with overwhelming probability for any key, and each test also checks that its
criterion rejects the wrong alternative (noise added once per rank; ranks sharing one stream).
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _models, also when run as a worker

from _models import mlp_case, seeded  # noqa: E402

from opake_compile import distributed as D  # noqa: E402
from opake_compile import random as oprandom  # noqa: E402
from opake_compile._validate import NotPrivateWarning  # noqa: E402
from opake_compile.compiler import compile_dp  # noqa: E402
from opake_compile.dpsgd import ClippedPytree  # noqa: E402
from opake_compile.dpsgd.noise import add_gaussian_noise  # noqa: E402
from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError  # noqa: E402
from opake_compile.optim import DPOptimizer  # noqa: E402
from opake_compile import accounting as opake_accounting  # noqa: E402

WORLD = 2
N, B, STEPS = 32, 8, 3  # fixed global batches of B = q N examples: steps t use rows [B t, B t + B)
Q = B / N
LR, MOMENTUM = 0.5, 0.9
SIGMA, C_NOISE, Z_SIZE = 2.0, 1.0, 20_000  # the noise scenario
P_MIN = 1e-3


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = seeded(123)
    return torch.randn(N, 5, generator=g, dtype=torch.float64) * 2, torch.randint(0, 3, (N,), generator=g)


def _global_batches() -> list[list[int]]:
    """The global batch of each step: STEPS fixed batches, then rank 1 empty, then all empty."""
    return [list(range(B * t, B * t + B)) for t in range(STEPS)] + [[0, 2, 4], []]


def _local(idx: list[int], rank: int) -> list[int]:
    return [i for i in idx if i % WORLD == rank]  # the strided shard, as local_shard/the sampler


def _config_sampler(rank: int | None = None, world_size: int | None = None) -> D.DistributedPoissonSampler:
    """The fixed batches' sampler: q = 1 over B examples, so q N = B and every draw holds B
    examples over the ranks (the optimizer refuses a global sum of more examples than the
    ranks' draws hold together)."""
    return D.DistributedPoissonSampler(B, 1.0, key=oprandom.key(1), rank=rank, world_size=world_size)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


class _NoiseNet(nn.Module):
    """A classifier plus a parameter ``z`` whose loss gradient is exactly 0: its ``.grad``
    after a DP step is pure noise / (q N)."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.lin = nn.Linear(5, 3).double()
        self.z = nn.Parameter(torch.zeros(Z_SIZE, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _noise_loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m(x), y) + 0.0 * m.z.sum()


# ----------------------------------------------------------------------------- the worker
def _worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60)
    )
    res: dict = {"rank": D.get_rank(), "world_size": D.get_world_size(), "is_distributed": D.is_distributed()}
    x, y = _data()
    batches = _global_batches()

    # (1) sigma = 0, C = inf: the DP path over 2 ranks, fixed batches; then (3) empty local batches.
    case = mlp_case(0, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = compile_dp(case.loss_fn, model=case.model, clipping_norm=math.inf, backend=None, physical_batch_size=8)
        opt = DPOptimizer(
            torch.optim.SGD(case.model.parameters(), lr=LR, momentum=MOMENTUM),
            noise_multiplier=0.0, sampler=_config_sampler(), key=D.broadcast_key(oprandom.key(7)),
        )
    res["not_private_warnings"] = sum(issubclass(w.category, NotPrivateWarning) for w in caught)
    res["num_examples"], res["dp_params"] = [], []
    for idx in batches:
        local = _local(idx, rank)
        clipped = D.sum_gradients(step(x[local], y[local]).clipped)
        res["num_examples"].append((clipped.num_examples, clipped.per_example_norms.numel()))
        next(iter(opt.sampler))  # the draw this step is charged for (the batches are fixed)
        opt.step(clipped)
        res["dp_params"].append(_params(case.model))
    # A local (unreduced) sum inside the group is refused before anything changes.
    before = (_params(case.model), opt.steps)
    try:
        opt.step(step(x[_local(batches[0], rank)], y[_local(batches[0], rank)]).clipped)
        res["local_sum_refused"] = False
    except ConfigurationError:
        res["local_sum_refused"] = True
    res["unchanged_after_refusal"] = all(
        torch.equal(before[0][k], v) for k, v in _params(case.model).items()
    ) and before[1] == opt.steps

    # A review's two ways to release more than one step's worth in a group: a noise key per
    # rank (each replica a separate noisy release of one sum), and a plain sampler on every
    # rank (the same key draws the same positions in every shard: correlated inclusions).
    from opake_compile.sampling import PoissonSampler

    lin = nn.Linear(3, 1, bias=False)
    refusals = {}
    for name, sampler, key in (("keys", _config_sampler(), oprandom.key(100 + rank)),
                               ("sampler", PoissonSampler(N, Q, key=oprandom.key(3)), D.broadcast_key(oprandom.key(9)))):
        other = DPOptimizer(torch.optim.SGD(lin.parameters(), lr=1.0), noise_multiplier=1.0, sampler=sampler, key=key)
        one = ClippedPytree(grads={"weight": torch.ones(1, 3)}, clipping_norm=1.0, per_example_norms=torch.ones(1),
                            num_examples=1, parameters={"weight": lin.weight})
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", NotPrivateWarning)
                other.step(D.sum_gradients(one))
            refusals[name] = "accepted"
        except ConfigurationError as err:
            refusals[name] = str(err)
    res["group_refusals"] = refusals
    res["group_hostile"] = _group_hostile_scenario(rank, x, y)

    # Plain non-private DDP on the same local batches (mean loss; DDP averages over ranks).
    ddp_case = mlp_case(0, dtype=torch.float64)
    ddp = DDP(ddp_case.model)
    sgd = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    for idx in batches[:STEPS]:
        local = _local(idx, rank)
        sgd.zero_grad()
        ddp_case.loss_fn(ddp, x[local], y[local]).backward()
        sgd.step()
    res["ddp_params"] = _params(ddp_case.model)

    # (2) sigma > 0: z's gradient is pure noise. Rank 1's batch is empty, at its first call.
    net = _NoiseNet()
    nstep = compile_dp(_noise_loss, model=net, clipping_norm=C_NOISE, backend=None, physical_batch_size=8)
    key = D.broadcast_key(oprandom.key(100 + rank))  # rank 0's key wins
    res["broadcast_key"] = oprandom.key_to_state(key)
    D.check_same_key(key)
    nopt = DPOptimizer(torch.optim.SGD(net.parameters(), lr=1.0), noise_multiplier=SIGMA, sampler=_config_sampler(), key=key)
    local = [0, 2, 4, 6] if rank == 0 else []
    clipped = D.sum_gradients(nstep(x[local], y[local]).clipped)
    res["noise_num_examples"] = clipped.num_examples
    next(iter(nopt.sampler))
    nopt.step(clipped)
    res["noise_grad_z"] = net.z.grad.detach().clone()
    res["noise_params"] = _params(net)
    # The wrong design, for the test's power: every rank adds its own noise before the sum.
    local_noise = add_gaussian_noise(torch.zeros(Z_SIZE, dtype=torch.float64), SIGMA * C_NOISE, oprandom.fold_in(key, rank))
    res["per_rank_noise_grad"] = D.all_reduce(local_noise, "sum") / (Q * N)

    # Keys, clipping norms, collectives, parameters, sampler defaults.
    try:
        D.check_same_key(oprandom.key(rank))
        res["mismatched_keys_raise"] = False
    except ConfigurationError:
        res["mismatched_keys_raise"] = True
    odd = ClippedPytree(grads={"w": torch.ones(2)}, clipping_norm=float(rank + 1), per_example_norms=torch.zeros(1), num_examples=1)
    try:
        D.sum_gradients(odd)
        res["mismatched_c_raise"] = False
    except ConfigurationError:
        res["mismatched_c_raise"] = True
    # The ranks' float32 sums add up in float64; the in-place reduction refuses a float32
    # global sum of more examples than one float32 sum may hold (on every rank alike).
    f32 = ClippedPytree(grads={"w": torch.ones(2)}, clipping_norm=1.0, per_example_norms=torch.zeros(1), num_examples=1)
    res["sum_dtype"] = D.sum_gradients(f32).grads["w"].dtype
    # Any float32 sums, however few examples: a float32 reduction across ranks rounds at each
    # addition (compile_dp's sums are float64 and reduce in place).
    for name, count in (("inplace_big", 3000), ("inplace_small_f32", 1)):
        part = ClippedPytree(grads={"w": torch.ones(2)}, clipping_norm=1.0, per_example_norms=torch.zeros(1), num_examples=count)
        try:
            D.sum_gradients_(part)
            res[name + "_refused"] = False
        except ConfigurationError:
            res[name + "_refused"] = True
        if count == 3000:
            res["inplace_big_unchanged"] = torch.equal(part.grads["w"], torch.ones(2))
    t = torch.tensor([rank + 1.0, 10.0 * rank])
    res["all_reduce"] = {op: D.all_reduce(t, op) for op in ("sum", "mean", "max", "min")}
    res["all_reduce_input_unchanged"] = torch.equal(t, torch.tensor([rank + 1.0, 10.0 * rank]))
    tree = {"a": torch.full((2, 3), float(rank)), "b": torch.tensor([rank], dtype=torch.int64), "c": torch.ones(4, dtype=torch.float64)}
    res["reduce_pytree"] = D.reduce_pytree(tree, "sum")
    lin = nn.Linear(3, 2)
    with torch.no_grad():
        lin.weight.fill_(float(rank))
    D.broadcast_parameters(lin)
    res["broadcast_weight"] = lin.weight.detach().clone()
    sampler = D.DistributedPoissonSampler(N, 0.3, key=oprandom.key(5))
    res["sampler"] = (sampler.rank, sampler.world_size, list(sampler.shard), sampler.batch_at(0, 0))
    res["local_shard"] = list(D.local_shard(torch.utils.data.TensorDataset(x)).indices)

    # In-place reductions: small leaves packed into buckets, large ones reduced where they lie,
    # a non-contiguous leaf; the same tensors come back, holding the sums.
    res["inplace"] = _inplace_scenario(rank, x, y)
    # sync: configuration must agree, state comes from rank 0, rank-local fields stay.
    res["sync"] = _sync_scenario(rank)

    dist.barrier()
    dist.destroy_process_group()
    torch.save(res, Path(out) / f"rank{rank}.pt")


def _group_hostile_scenario(rank: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """A review's ways to have one example move the released sum by more than C, or to run
    another mechanism than the one charged, in a group: each must be refused on every rank
    before anything changes; the honest step beside them goes through."""
    out: dict = {}
    case = mlp_case(0, dtype=torch.float64)
    step = compile_dp(case.loss_fn, model=case.model, clipping_norm=1.0, backend=None, physical_batch_size=8)
    shard = list(range(rank, N, WORLD))

    def attempt(name: str, sampler_kw: dict, rows, sigma: float = 1.0, twice: bool = False, **opt_kw) -> None:
        kw = {"rank": None, "q": Q} | sampler_kw
        sampler = D.DistributedPoissonSampler(N, kw["q"], key=oprandom.key(2), rank=kw["rank"])
        opt = DPOptimizer(torch.optim.SGD(case.model.parameters(), lr=0.1), noise_multiplier=sigma,
                          sampler=sampler, key=oprandom.key(8), **opt_kw)
        local = next(iter(sampler))
        picked = [shard[p] for p in local] if rows is None else rows
        before = (_params(case.model), opt.steps, opt.epsilon(1e-5))
        try:
            clipped = D.sum_gradients(step(x[picked], y[picked]).clipped)
            if twice:
                clipped = D.sum_gradients(clipped)
            opt.step(clipped)
            out[name] = "accepted"
        except ConfigurationError as err:
            out[name] = str(err)
            after = (_params(case.model), opt.steps, opt.epsilon(1e-5))
            out[name + "_unchanged"] = _same_view({"p": before[0]}, {"p": after[0]}) and before[1:] == after[1:]

    attempt("honest", {}, None)
    attempt("summed_twice", {}, None, twice=True)
    attempt("one_sampler_rank", {"rank": 0}, None)  # both ranks sample shard 0
    attempt("sample_rates", {"q": Q * (1 + 3 * rank)}, None)
    attempt("noise_multipliers", {}, None, sigma=1.0 / (1 + rank))
    attempt("whole_shard", {}, shard)  # every example of the shard, stepped on as one draw
    # Ranks on different budgets or accountants: one refused at its budget while the other
    # stepped (review); now the group refuses before either checks its budget.
    attempt("budgets", {}, None, budget=opake_accounting.epsilon_budget(1.0 + 9.0 * rank, delta=1e-5))
    attempt("accountants", {}, None, accountant=("pld", "rdp")[rank])
    # Adaptive clipping: each rank's next norm would follow its own count with the shared
    # count noise, and the ranks' norms would give their counts' difference exactly (review).
    from opake_compile.dpsgd.clipping import adaptive_clipped_grad

    grad_fn, state = adaptive_clipped_grad(lambda p, xb, yb: (xb @ p["w"]).pow(2).mean(), 0,
                                           batch_argnums=(1, 2), initial_clipping_norm=1.0, key=oprandom.key(5),
                                           expected_batch_size=4.0, count_noise_multiplier=5.0)
    try:
        grad_fn({"w": torch.zeros(x.shape[1], dtype=x.dtype)}, x[shard[:4]], y[shard[:4]], state=state)
        out["adaptive"] = "accepted"
    except ConfigurationError as err:
        out["adaptive"] = str(err)
    return out


def _inplace_tree(rank: int) -> dict:
    big = torch.arange(40, dtype=torch.float32).reshape(8, 5) * (rank + 1)
    return {
        "big": big,  # 160 bytes >= bucket_bytes: reduced in place
        "small": torch.full((3,), float(rank + 1)),
        "ints": torch.tensor([rank, 10 * rank], dtype=torch.int64),
        "strided": torch.arange(12, dtype=torch.float64).reshape(3, 4).t() * (rank + 1),  # not contiguous
    }


def _inplace_scenario(rank: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    out: dict = {}
    tree = _inplace_tree(rank)
    ids = {k: id(v) for k, v in tree.items()}
    expect = D.reduce_pytree(_inplace_tree(rank), "sum")
    got = D.reduce_pytree_(tree, "sum", bucket_bytes=64)
    out["same_objects"] = got is tree and all(id(tree[k]) == ids[k] for k in ids)
    out["equals_copy_form"] = all(torch.equal(tree[k], expect[k]) for k in expect)
    mean_tree = {"a": torch.full((2,), float(rank)), "b": torch.full((70,), 2.0 * rank, dtype=torch.float64)}
    D.reduce_pytree_(mean_tree, "mean", bucket_bytes=64)
    out["mean"] = mean_tree
    case = mlp_case(0, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        step = compile_dp(case.loss_fn, model=case.model, clipping_norm=1.0, backend=None, physical_batch_size=8)
    local = _local(list(range(8)), rank)
    copy_form = D.sum_gradients(step(x[local], y[local]).clipped)
    clipped = step(x[local], y[local]).clipped
    grads_ids = {k: id(v) for k, v in clipped.grads.items()}
    inplace = D.sum_gradients_(clipped, bucket_bytes=64)
    out["sum_gradients_"] = (
        inplace.num_ranks == WORLD
        and inplace.num_examples == copy_form.num_examples == 8
        and all(id(inplace.grads[k]) == grads_ids[k] for k in grads_ids)
        and all(torch.equal(inplace.grads[k], copy_form.grads[k]) for k in copy_form.grads)
        and _releasable(inplace)  # its own in-place reduction is not an edit of the sums
    )
    return out


def _releasable(clipped) -> bool:
    from opake_compile.dpsgd._types import check_release

    try:
        check_release(clipped)
    except ConfigurationError:
        return False
    return True


def _pure_noise_steps(model: nn.Module, opt: DPOptimizer, k: int) -> None:
    for _ in range(k):
        next(iter(opt.sampler))
        opt.step(D.sum_gradients(ClippedPytree(
            grads={n: torch.zeros_like(p) for n, p in model.named_parameters()}, clipping_norm=1.0,
            per_example_norms=torch.zeros(0), num_examples=0, parameters=dict(model.named_parameters()),
        )))


def _sync_objects(rank: int, sigma: float = 1.0, width: int = 3) -> dict:
    from opake_compile.dpsgd.clipping import AdaptiveClipState, ClipState
    from opake_compile.dpsgd.noise import NoiseState

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(rank)
        model = nn.Linear(4, width)
    sampler = D.DistributedPoissonSampler(N, Q, key=oprandom.key(11))
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), noise_multiplier=sigma, sampler=sampler, key=oprandom.key(20))
    step = compile_dp(lambda m, a: m(a).sum(), model=model, clipping_norm=1.0, backend=None, key=oprandom.key(30 + rank))
    return {
        "model": model, "optimizer": opt, "sampler": sampler, "step": step,
        "clip": ClipState(1.0), "adaptive": AdaptiveClipState(0.5 + rank, oprandom.key(40 + rank)),
        "noise": NoiseState(oprandom.key(50 + rank)), "count": 7 * (rank + 1),
    }


def _sync_view(objs: dict) -> dict:
    """What the tests compare: every state that sync must align, and the rank-local fields."""
    return {
        "params": _params(objs["model"]),
        "opt": {k: v for k, v in objs["optimizer"].state_dict().items() if k != "optimizer"},
        "moments": {i: s["momentum_buffer"].clone() for i, s in objs["optimizer"].optimizer.state_dict()["state"].items()},
        "sampler": objs["sampler"].state_dict(),
        "step": objs["step"].state_dict(),
        "adaptive": objs["adaptive"], "noise": objs["noise"], "count": objs["count"],
    }


def _sync_scenario(rank: int) -> dict:
    out: dict = {}
    objs = _sync_objects(rank)
    # Both ranks take two steps (a collective each) from their own initial parameters; then
    # their keys and moments are made to differ (steps with per-rank keys are refused), and
    # rank 0 alone draws a batch and calls its step twice.
    _pure_noise_steps(objs["model"], objs["optimizer"], 2)
    objs["optimizer"]._key = oprandom.key(20 + rank)
    for st in objs["optimizer"].optimizer.state.values():
        st["momentum_buffer"].add_(float(rank))
    if rank == 0:
        next(iter(objs["sampler"]))
        objs["step"](torch.randn(3, 4))
        objs["step"](torch.randn(2, 4))
    out["before"] = _sync_view(objs)
    synced = D.sync(objs)
    objs.update({k: synced[k] for k in ("adaptive", "noise", "count", "clip")})
    out["after"] = _sync_view(objs)
    out["same_objects"] = synced["optimizer"] is objs["optimizer"] and synced["model"] is objs["model"]
    # Configuration that cannot be reconciled: a different sigma on rank 1.
    bad = _sync_objects(rank, sigma=1.0 + rank)
    snapshot = _sync_view(bad)
    try:
        D.sync(bad)
        out["sigma_error"] = None
    except ConfigurationError as err:
        out["sigma_error"] = str(err)
    out["sigma_unchanged"] = _same_view(snapshot, _sync_view(bad))
    # Structure that does not fit: another width on rank 1 (detected on every rank).
    bad = _sync_objects(rank, width=3 + rank)
    snapshot = _sync_view(bad)
    try:
        D.sync({"model": bad["model"], "adaptive": bad["adaptive"]})
        out["shape_error"] = None
    except ConfigurationError as err:
        out["shape_error"] = str(err)
    out["shape_unchanged"] = _same_view(snapshot, _sync_view(bad))
    return out


def _same_view(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        return x == y
    return eq(a, b)


# ----------------------------------------------------------------------------- the fixture
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    # The workers import this checkout's package (not another installed copy).
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(tmp / "store"), str(tmp)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(WORLD)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("distributed workers timed out (deadlock?)")
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-6000:]}"
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _single_process_dp(batches: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """The same DP run in one process on the union of the ranks' batches (no process group:
    ``sum_gradients`` is the identity)."""
    x, y = _data()
    case = mlp_case(0, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        step = compile_dp(case.loss_fn, model=case.model, clipping_norm=math.inf, backend=None, physical_batch_size=8)
        opt = DPOptimizer(
            torch.optim.SGD(case.model.parameters(), lr=LR, momentum=MOMENTUM),
            # q = 1 over B examples: every draw holds B rows (the optimizer refuses a sum of more
            # examples than the draw it charges), and q N = B as in the group's runs.
            noise_multiplier=0.0, sampler=D.DistributedPoissonSampler(B, 1.0, key=oprandom.key(1)), key=oprandom.key(7),
        )
    out = []
    for idx in batches:
        clipped = step(x[idx], y[idx]).clipped
        assert D.sum_gradients(clipped) is clipped
        next(iter(opt.sampler))
        opt.step(clipped)
        out.append(_params(case.model))
    return out


def _non_private(batches: list[list[int]]) -> dict[str, torch.Tensor]:
    x, y = _data()
    case = mlp_case(0, dtype=torch.float64)
    sgd = torch.optim.SGD(case.model.parameters(), lr=LR, momentum=MOMENTUM)
    for idx in batches:
        sgd.zero_grad()
        case.loss_fn(case.model, x[idx], y[idx]).backward()
        sgd.step()
    return _params(case.model)


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-10, msg=lambda m, k=k: f"{k}: {m}")


# ----------------------------------------------------------------------------- distributed tests
def test_ranks_see_the_process_group(runs):
    for r, res in enumerate(runs):
        assert (res["rank"], res["world_size"], res["is_distributed"]) == (r, WORLD, True)


def test_sigma0_two_ranks_equal_one_process_and_ddp(runs):
    """sigma = 0, C = inf, fixed batches with q N = B: the 2-rank DP run equals the 1-process DP
    run on the union of the batches, plain DDP, and plain full-batch training."""
    assert all(res["not_private_warnings"] >= 2 for res in runs)  # C = inf and sigma = 0
    batches = _global_batches()
    single = _single_process_dp(batches)
    reference = _non_private(batches[:STEPS])
    for res in runs:
        for got, want in zip(res["dp_params"], single):
            _assert_close(got, want)
        _assert_close(res["dp_params"][STEPS - 1], res["ddp_params"])
        _assert_close(res["dp_params"][STEPS - 1], reference)
    for a, b in zip(runs[0]["dp_params"], runs[1]["dp_params"]):
        assert all(torch.equal(a[k], b[k]) for k in a)  # replicas bitwise in sync
    assert single[STEPS - 1]["0.weight"].sub(mlp_case(0, dtype=torch.float64).model[0].weight).abs().max() > 1e-3


def test_ranks_add_their_sums_in_float64(runs):
    for res in runs:
        assert res["sum_dtype"] == torch.float64
        assert res["inplace_big_refused"] and res["inplace_big_unchanged"] and res["inplace_small_f32_refused"]


def test_optimizer_refuses_a_local_sum_in_a_process_group(runs):
    for res in runs:
        assert res["local_sum_refused"] and res["unchanged_after_refusal"]


def test_per_rank_keys_and_plain_samplers_are_refused_in_a_group(runs):
    for res in runs:
        assert "different noise key" in res["group_refusals"]["keys"]
        assert "DistributedPoissonSampler" in res["group_refusals"]["sampler"]


def test_group_refuses_steps_that_release_more_than_they_charge(runs):
    """Sums reduced twice, two ranks sampling one shard, a whole shard stepped on as one draw
    (sensitivity or sample rate above what is charged), and ranks on different noise
    multipliers or sample rates (another mechanism per replica): refused on every rank, nothing
    changed; the honest step is accepted."""
    want = {
        "summed_twice": "already the sum over 2 ranks",
        "one_sampler_rank": "sampler ranks [0, 0]",
        "sample_rates": "disagree on sample_rate",
        "noise_multipliers": "disagree on noise_multiplier",
        "whole_shard": "the ranks' draws of this step hold",
        "budgets": "disagree on budget",
        "accountants": "disagree on accountant",
        "adaptive": "adaptive clipping across ranks is not supported",
    }
    for res in runs:
        got = res["group_hostile"]
        assert got["honest"] == "accepted"
        for name, text in want.items():
            assert text in got[name], (name, got[name])
            assert got.get(name + "_unchanged", True), name


def test_empty_local_batch_completes_the_step(runs):
    """Step STEPS: rank 1's local batch is empty; step STEPS + 1: every local batch is empty.
    Both ranks join the all-reduce, see the global count and stay in sync (and equal to the
    single-process run, checked above)."""
    for r, res in enumerate(runs):
        n_global, n_local = res["num_examples"][STEPS]
        assert (n_global, n_local) == (3, 3 if r == 0 else 0)  # per-example norms stay local
        assert res["num_examples"][STEPS + 1] == (0, 0)
        assert [n for n, _ in res["num_examples"][:STEPS]] == [B] * STEPS
        assert len(res["dp_params"]) == len(_global_batches())
    # rank 1's empty batch was also its first call of an uncompiled step, with sigma > 0:
    assert [res["noise_num_examples"] for res in runs] == [4, 4]


def test_noise_is_added_once_to_the_global_sum(runs):
    """sigma > 0: z's gradient is pure noise with std sigma C / (q N) (the single-noise
    variance), identical on both ranks; parameters stay in sync.

    Criterion: the sample variance of the 20,000 entries within 10 % of (sigma C / q N)^2
    (its relative standard error is sqrt(2 / 20000) = 1 %, so 10 standard errors), and a
    Kolmogorov-Smirnov test against N(0, (sigma C / q N)^2) with p > 1e-3. The same criterion
    rejects noise added once per rank (variance x2) and a variance of half.
    """
    expected_var = (SIGMA * C_NOISE / (Q * N)) ** 2
    sd = math.sqrt(expected_var)

    def accepts(sample: torch.Tensor, var: float) -> bool:
        s = sample.numpy()
        ratio = float(np.var(s)) / var
        return abs(ratio - 1) < 0.1 and stats.kstest(s / math.sqrt(var), "norm").pvalue > P_MIN

    g0, g1 = runs[0]["noise_grad_z"], runs[1]["noise_grad_z"]
    assert torch.equal(g0, g1)
    assert accepts(g0, expected_var)
    assert not accepts(g0, 2 * expected_var) and not accepts(g0, expected_var / 2)
    wrong = runs[0]["per_rank_noise_grad"]
    assert not accepts(wrong, expected_var) and accepts(wrong, WORLD * expected_var)
    assert abs(float(g0.mean())) < 5 * sd / math.sqrt(Z_SIZE)
    p0, p1 = runs[0]["noise_params"], runs[1]["noise_params"]
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    assert torch.equal(p0["z"], -g0)  # SGD, lr = 1, from z = 0


def test_keys_collectives_and_parameters(runs):
    for res in runs:
        assert oprandom.key_from_state(res["broadcast_key"]) == oprandom.key(100)
        assert res["mismatched_keys_raise"] and res["mismatched_c_raise"]
        ar = res["all_reduce"]
        torch.testing.assert_close(ar["sum"], torch.tensor([3.0, 10.0]))
        torch.testing.assert_close(ar["mean"], torch.tensor([1.5, 5.0]))
        torch.testing.assert_close(ar["max"], torch.tensor([2.0, 10.0]))
        torch.testing.assert_close(ar["min"], torch.tensor([1.0, 0.0]))
        assert res["all_reduce_input_unchanged"]
        tree = res["reduce_pytree"]
        assert torch.equal(tree["a"], torch.ones(2, 3)) and torch.equal(tree["b"], torch.tensor([1]))
        assert torch.equal(tree["c"], torch.full((4,), 2.0, dtype=torch.float64))
        assert torch.equal(res["broadcast_weight"], torch.zeros(2, 3))
    for r, res in enumerate(runs):
        rank, world, shard, batch = res["sampler"]
        assert (rank, world, shard) == (r, WORLD, list(range(r, N, WORLD)))
        assert batch == D.DistributedPoissonSampler(N, 0.3, key=oprandom.key(5), rank=r, world_size=WORLD).batch_at(0, 0)
        assert res["local_shard"] == list(range(r, N, WORLD))


def test_in_place_reductions_reduce_where_the_tensors_lie(runs):
    want = {k: sum(_inplace_tree(r)[k] for r in range(WORLD)) for k in _inplace_tree(0)}
    for res in runs:
        r = res["inplace"]
        assert r["same_objects"] and r["equals_copy_form"] and r["sum_gradients_"]
        assert torch.equal(r["mean"]["a"], torch.full((2,), 0.5))
        assert torch.equal(r["mean"]["b"], torch.full((70,), 1.0, dtype=torch.float64))
    assert all(torch.equal(want[k], D.reduce_pytree(_inplace_tree(0))[k] + _inplace_tree(1)[k]) for k in want)


def test_sync_aligns_state_and_keeps_rank_local_fields(runs):
    r0, r1 = runs[0]["sync"], runs[1]["sync"]
    assert not _same_view(r0["before"], r1["before"])  # the scenario starts out of agreement
    assert r0["same_objects"] and r1["same_objects"]
    assert _same_view(r0["after"], r0["before"])  # rank 0 is the source: unchanged
    a0, a1 = r0["after"], r1["after"]
    assert _same_view(a1["params"], a0["params"]) and _same_view(a1["moments"], a0["moments"])
    assert a1["opt"] == a0["opt"] and a1["opt"]["steps"] == 2
    assert a1["adaptive"] == a0["adaptive"] and a1["noise"] == a0["noise"] and a1["count"] == 7
    assert a1["sampler"] == {**a0["sampler"], "rank": 1} and a1["sampler"]["position"] == 1
    assert a1["step"]["num_calls"] == 2 and a1["step"]["key"] == r1["before"]["step"]["key"] != a0["step"]["key"]


def test_sync_refuses_configuration_and_structure_it_cannot_reconcile(runs):
    for res in runs:
        s = res["sync"]
        assert s["sigma_error"] is not None and s["sigma_error"].startswith("optimizer.noise_multiplier: ranks disagree")
        assert s["sigma_unchanged"]
        assert s["shape_error"] is not None and "model.weight" in s["shape_error"]
        assert s["shape_unchanged"]


# ----------------------------------------------------------------------------- one process
def test_helpers_without_process_group():
    assert not D.is_distributed() and D.get_rank() == 0 and D.get_world_size() == 1
    t = torch.arange(3.0)
    assert D.all_reduce(t, "mean") is t
    tree = {"a": t, "b": [torch.ones(2, dtype=torch.int64)]}
    assert D.reduce_pytree(tree, "sum") is tree
    k = oprandom.key(3)
    assert D.broadcast_key(k) == k
    D.check_same_key(k)
    lin = nn.Linear(2, 2)
    before = _params(lin)
    D.broadcast_parameters(lin)
    _assert_close(_params(lin), before)
    ds = torch.utils.data.TensorDataset(torch.arange(5))
    assert list(D.local_shard(ds).indices) == [0, 1, 2, 3, 4]
    assert list(D.local_shard(ds, rank=2, world_size=3).indices) == [2]
    clipped = ClippedPytree(grads={"w": torch.ones(2)}, clipping_norm=1.0, per_example_norms=torch.ones(1), num_examples=1)
    assert D.sum_gradients(clipped) is clipped
    other = ClippedPytree(grads={"w": torch.ones(2)}, clipping_norm=1.0, per_example_norms=torch.ones(1), num_examples=1)
    acc = D.sum_gradients([clipped, other])  # (the same part twice is refused: tests/test_optim_charging.py)
    assert acc.num_examples == 2 and torch.equal(acc.grads["w"], torch.full((2,), 2.0))
    assert D.reduce_pytree_(tree, "sum") is tree and torch.equal(tree["a"], torch.arange(3.0))
    assert D.sum_gradients_(clipped) is clipped
    assert D.sync(tree) is tree


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_more_ranks_than_the_slack_covers_are_refused_for_float32_models(monkeypatch, dtype):
    # numerics point 3: W ranks' float64 sums add in the collective's order, rounding by up to
    # about W^2 2^-31 C; past 512 ranks that leaves the slack, so a float32 model is refused
    # before any collective (every rank sees the same world size: every rank refuses).
    monkeypatch.setattr(D, "is_distributed", lambda: True)
    monkeypatch.setattr(D, "get_world_size", lambda: 513)

    def no_collective(*a, **k):
        raise AssertionError("a collective ran")

    monkeypatch.setattr(D, "all_reduce", no_collective)
    monkeypatch.setattr(D, "_collective_device", lambda: torch.device("cpu"))
    w = torch.ones(2, dtype=dtype)
    clipped = ClippedPytree(grads={"w": torch.ones(2, dtype=torch.float64)}, clipping_norm=1.0,
                            per_example_norms=torch.ones(1), num_examples=1, parameters={"w": w})
    if dtype == torch.float32:
        with pytest.raises(ConfigurationError, match="513 ranks"):
            D.sum_gradients(clipped)
    else:  # float64 models are not limited: it goes on to the collectives
        with pytest.raises(AssertionError, match="a collective ran"):
            D.sum_gradients(clipped)
    monkeypatch.setattr(D, "get_world_size", lambda: 512)
    with pytest.raises(AssertionError, match="a collective ran"):
        D.sum_gradients(clipped)


def test_helpers_validate_arguments():
    t = torch.ones(2)
    with pytest.raises(ConfigurationError, match="op"):
        D.all_reduce(t, "avg")
    with pytest.raises(InputTypeError):
        D.all_reduce(t, 3)
    with pytest.raises(InputTypeError):
        D.all_reduce([1.0])
    with pytest.raises(ConfigurationError, match="mean"):
        D.reduce_pytree({"i": torch.ones(2, dtype=torch.int64)}, "mean")
    with pytest.raises(InputTypeError):
        D.reduce_pytree({"x": 1.0})
    clipped = ClippedPytree(grads={"w": t}, clipping_norm=1.0, per_example_norms=t, num_examples=2)
    with pytest.raises(InputTypeError):
        D.reduce_pytree(clipped)
    with pytest.raises(InputTypeError):
        D.sum_gradients({"w": t})
    normalised = ClippedPytree(grads={"w": t.clone()}, clipping_norm=1.0, per_example_norms=t, num_examples=2, normalize_by=2.0)
    with pytest.raises(ConfigurationError, match="normalize_by"):
        D.sum_gradients(normalised)
    with pytest.raises(InputTypeError):
        D.broadcast_key([0, 0, 0, 0])
    with pytest.raises(ConfigurationError, match="rank"):
        D.local_shard(torch.utils.data.TensorDataset(t), rank=2, world_size=2)


def test_sampler_configuration():
    key = oprandom.key(0)
    s = D.DistributedPoissonSampler(10, 0.2, key=key)
    assert (s.rank, s.world_size, s.is_poisson, s.truncated_batch_size) == (0, 1, True, None)
    assert (s.dataset_size, s.sample_rate, s.expected_batch_size, len(s)) == (10, 0.2, 2.0, 5)
    with pytest.raises(ConfigurationError, match="truncat"):
        D.DistributedPoissonSampler(10, 0.2, key=key, truncated_batch_size=3)
    with pytest.raises(ConfigurationError, match="rank"):
        D.DistributedPoissonSampler(10, 0.2, key=key, rank=2, world_size=2)
    with pytest.raises(InputTypeError):
        D.DistributedPoissonSampler(10, 0.2, key=0)
    # the optimizer reads the global configuration
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        opt = DPOptimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), noise_multiplier=1.0,
                          sampler=D.DistributedPoissonSampler(10, 0.2, key=key, rank=1, world_size=2), key=oprandom.key(1))
    assert (opt.sample_rate, opt.dataset_size, opt.expected_batch_size) == (0.2, 10, 2.0)


def test_sampler_state_dict():
    key = oprandom.key(0)
    s = D.DistributedPoissonSampler(10, 0.5, key=key, rank=1, world_size=2)
    first = list(s)
    state = s.state_dict()
    again = D.DistributedPoissonSampler(10, 0.5, key=key, rank=1, world_size=2)
    again.load_state_dict(state)
    assert again.epoch == 1 and list(again) != first
    other = D.DistributedPoissonSampler(10, 0.5, key=key, rank=0, world_size=2)
    with pytest.raises(CheckpointError, match="rank"):
        other.load_state_dict(state)


def _union_batches(n: int, q: float, steps: int, world: int, key: oprandom.Key) -> tuple[list[list[int]], list]:
    samplers = [D.DistributedPoissonSampler(n, q, key=key, rank=r, world_size=world, steps=steps) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    union = []
    for t in range(steps):
        idx = [samplers[r].shard[p] for r in range(world) for p in per_rank[r][t]]
        assert len(set(idx)) == len(idx)
        union.append(sorted(idx))
    return union, per_rank


def _binomial_gof_pvalue(sizes: np.ndarray, n: int, q: float) -> float:
    """Chi-square goodness of fit of ``sizes`` to Binomial(n, q), tails pooled."""
    dist = stats.binom(n, q)
    lo, hi = int(dist.ppf(1e-3)), int(dist.isf(1e-3))
    clipped = np.clip(sizes, lo, hi)
    observed = np.array([(clipped == k).sum() for k in range(lo, hi + 1)])
    probs = np.array([dist.cdf(lo)] + [dist.pmf(k) for k in range(lo + 1, hi)] + [dist.sf(hi - 1)])
    return float(stats.chisquare(observed, probs / probs.sum() * len(sizes)).pvalue)


def test_sampler_union_is_a_poisson_sample_of_the_whole_dataset():
    """Over 3,000 steps, 3 ranks, N = 50, q = 0.2: the union's size fits Binomial(N, q)
    (chi-square, p > 1e-3) and every index's inclusion count fits Binomial(steps, q) (sum of
    squared z-scores against chi2(N), p > 1e-3). The size criterion rejects ranks that share one
    random stream (the union of identical shard masks)."""
    n, q, steps, world = 50, 0.2, 3000, 3
    union, per_rank = _union_batches(n, q, steps, world, oprandom.key(11))
    sizes = np.array([len(b) for b in union])
    assert _binomial_gof_pvalue(sizes, n, q) > P_MIN
    counts = np.zeros(n)
    for b in union:
        counts[b] += 1
    z = (counts - steps * q) / math.sqrt(steps * q * (1 - q))
    assert stats.chi2.sf(float((z**2).sum()), n) > P_MIN
    # Wrong: every rank draws with the same generator -> the same positions on every shard.
    lens = [len(range(r, n, world)) for r in range(world)]
    shared = np.array([sum(sum(p < m for p in per_rank[0][t]) for m in lens) for t in range(steps)])
    assert _binomial_gof_pvalue(shared, n, q) < 1e-6


def test_sampler_streams_differ_per_rank():
    key = oprandom.key(2)
    a = D.DistributedPoissonSampler(40, 0.5, key=key, rank=0, world_size=2, steps=5)
    b = D.DistributedPoissonSampler(40, 0.5, key=key, rank=1, world_size=2, steps=5)
    assert list(a) != list(b)
    assert all(a.batch_at(0, t) != b.batch_at(0, t) for t in range(5))
    assert set(a.shard).isdisjoint(b.shard) and sorted([*a.shard, *b.shard]) == list(range(40))


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
