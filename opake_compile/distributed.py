"""Data-parallel DP-SGD on ``torch.distributed`` (Gloo on CPU, NCCL on GPU).

The recipe (one logical step, ``W`` ranks)::

    clipped = step(x_local, y_local).clipped           # 1. local clipped sum S_r
    clipped = distributed.sum_gradients(clipped)       # 2. all-reduce: S = sum_r S_r
    optimizer.step(clipped)                            # 3. DPOptimizer, SAME key on every rank

1. Rank ``r`` computes, with the compiled step, the unnormalised sum ``S_r`` of the clipped
   per-example gradients of *its* examples (its local Poisson batch ``B_r``).
2. :func:`sum_gradients` adds the sums of all ranks with explicit collectives
   (``torch.distributed.all_reduce``; ``DistributedDataParallel``'s reducer hooks are never
   involved, the compiled step does not even run a module backward). Every rank now holds
   ``S = sum over B of clip(g_i)`` with ``B`` the union of the local batches.
3. Every rank calls :class:`~opake_compile.optim.DPOptimizer` ``.step(S)``. All optimizers were
   built with the **same key** (:func:`broadcast_key`, :func:`check_same_key`), so all ranks
   draw the *identical* noise ``Z ~ N(0, (sigma C)^2 I)``, write the identical gradient
   ``(S + Z) / (q N)`` and take the identical parameter update: the replicas stay in sync.

Why this is private. The shards partition the dataset, so each example lies on exactly one
rank and enters ``S`` at most once, clipped to norm C: adding or removing one example changes
``S`` by at most C in L2, exactly as in one process. The noise ``Z`` is *one* draw: the ``W``
ranks hold ``W`` copies of the same number, not ``W`` independent draws, so what leaves the
group of ranks (parameters, checkpoints, any rank's gradient) is the output of a single
Gaussian mechanism ``S + Z`` on the global sum, post-processed by the optimizer. With
:class:`DistributedPoissonSampler` the global batch ``B`` is a Poisson sample of the whole
dataset with rate q, so the accountant of every rank (which sees the global ``q`` and ``N``)
accounts for the mechanism that actually ran, and ``q N`` is the right normaliser. Had every
rank added its own independent noise, the sum would carry ``W`` times the variance (a wasted
factor in utility); had each added ``1/W`` of it, a rank's own un-noised share would be the
whole release. Drawing the same noise after the reduction also means no rank is special, the
noise code is the single-process code unchanged, and the optimizer state (key, step count,
accountant) is identical on every rank, so any rank's checkpoint is the checkpoint.
(Equally private alternative, not chosen: rank 0 alone adds the noise before the reduction.)

Threat model: central DP with trusted ranks. The *un-noised* local sums ``S_r`` travel between
ranks inside the all-reduce; the guarantee covers what is released outside the group, not what
one rank could learn from the others' traffic. As in one process, the noise key is secret:
whoever knows it can subtract ``Z``.

Requirements (otherwise results are wrong or a collective hangs):

* every rank runs the same model (same trainable parameters, shapes, dtypes, clipping norm)
  from identical initial parameters (:func:`broadcast_parameters`), and the same number of
  steps, **including steps whose local batch is empty**: the compiled step returns a zero
  ``ClippedPytree`` for an empty batch, so that rank still joins every collective (skipping
  it would deadlock the others and, for the accountant, leak that the batch was empty);
* every ``DPOptimizer`` uses the same key; the noise is drawn on the parameters' device, so
  ranks need identical device types (on GPUs, the same model: CUDA random streams depend on
  the kernel launch configuration);
* Gloo reduces CPU tensors, NCCL CUDA tensors; keep parameters on the backend's device.

What ``DPOptimizer.step`` checks in a group (one collective, refused on every rank before
anything changes): the same key, noise multiplier, sampler
configuration and position on every rank; samplers of distinct ranks; a global sum of no more
examples than the ranks' draws hold together. :func:`sum_gradients` refuses a sum that was
already reduced. What it cannot check is the rows themselves (as in one process: the
optimizer sees counts, not examples).

Not privatised, and documented so where returned: the per-example norms of a reduced
``ClippedPytree`` stay *local* (this rank's examples only); its ``num_examples`` and
``num_nonfinite`` are the *global* realised counts.

Every helper works without an initialised process group (one process): the reductions are the
identity, :func:`get_rank` is 0, :func:`get_world_size` is 1.

Example (run with ``torchrun --nproc_per_node 2 script.py``; see
``examples/train_distributed.py``)::

    >>> dist.init_process_group("gloo")                                  # doctest: +SKIP
    >>> key = distributed.broadcast_key(oprandom.random_key())           # doctest: +SKIP
    >>> noise_key, sampler_key = oprandom.split(key)                     # doctest: +SKIP
    >>> sampler = distributed.DistributedPoissonSampler(len(ds), 0.01, key=sampler_key)  # doctest: +SKIP
    >>> opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
    ...                   sampler=sampler, key=noise_key)                # doctest: +SKIP
    >>> for idx in sampler:                                              # doctest: +SKIP
    ...     opt.step(distributed.sum_gradients(step(x_shard[idx], y_shard[idx]).clipped))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import Dataset, Subset

from opake_compile import pytree as _pytree
from opake_compile import random as oprandom
from opake_compile._validate import check_nonnegative_int, check_positive_int
from opake_compile.compiler.passes import numerics as _num
from opake_compile.dpsgd._types import SOURCES, ClippedPytree, check_not_released, mark_ranks, reseal, sum_tensors
from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError
from opake_compile.optim import accumulate
from opake_compile.sampling import PoissonSampler

__all__ = [
    "is_distributed",
    "get_rank",
    "get_world_size",
    "local_shard",
    "all_reduce",
    "reduce_pytree",
    "reduce_pytree_",
    "sum_gradients",
    "sum_gradients_",
    "sync",
    "broadcast_key",
    "check_same_key",
    "broadcast_parameters",
    "DistributedPoissonSampler",
]

_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # followed by a division by the world size (Gloo has no AVG)
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


# ----------------------------------------------------------------------------- process group
def is_distributed() -> bool:
    """``True`` when ``torch.distributed`` is available and a default process group is
    initialised (whatever its size).

    Example::

        >>> is_distributed()  # in a plain Python process
        False
    """
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's rank in the default group; 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    """The number of ranks in the default group; 1 without a process group."""
    return dist.get_world_size() if is_distributed() else 1


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    w = get_world_size() if world_size is None else check_positive_int(world_size, name="world_size")
    r = get_rank() if rank is None else check_nonnegative_int(rank, name="rank")
    if r >= w:
        raise ConfigurationError(f"Expected rank={r} < world_size={w}.")
    return r, w


def _collective_device() -> torch.device:
    """Where small bookkeeping tensors (keys, counts) must live for the default backend."""
    if str(dist.get_backend()) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_shard(dataset: Dataset, *, rank: int | None = None, world_size: int | None = None) -> Subset:
    """This rank's fixed shard of ``dataset``: the examples ``i`` with ``i % world_size == rank``.

    The shards of all ranks partition ``range(len(dataset))`` (sizes differ by at most one),
    which is what makes the union of the ranks' Poisson batches a Poisson sample of the whole
    dataset (:class:`DistributedPoissonSampler` yields positions into this subset).

    Args:
        dataset: a map-style dataset with ``len``.
        rank, world_size: default: the default process group's (0 and 1 without one).

    Returns:
        ``torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))``.

    Raises:
        InputTypeError: ``dataset`` has no length.
        ConfigurationError: ``rank >= world_size``.

    Example::

        >>> ds = torch.utils.data.TensorDataset(torch.arange(5))
        >>> list(local_shard(ds, rank=1, world_size=2).indices)
        [1, 3]
    """
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError as err:
        raise InputTypeError(f"local_shard needs a dataset with a length, got {type(dataset).__name__}.") from err
    r, w = _resolve_rank(rank, world_size)
    return Subset(dataset, range(r, n, w))


# ----------------------------------------------------------------------------- reductions
def _op(op: str | dist.ReduceOp) -> tuple[Any, bool]:
    if isinstance(op, str):
        if op not in _OPS:
            raise ConfigurationError(f"Expected op in {sorted(_OPS)} or a torch.distributed.ReduceOp, got {op!r}.")
        return _OPS[op], op == "mean"
    if isinstance(op, dist.ReduceOp):
        return op, False
    raise InputTypeError(f"Expected op to be a str or torch.distributed.ReduceOp, got {type(op).__name__}.")


def all_reduce(tensor: torch.Tensor, op: str | dist.ReduceOp = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return the result; the input is not modified.

    Args:
        tensor: any tensor on the backend's device (CPU for Gloo, CUDA for NCCL), of the same
            shape and dtype on every rank.
        op: ``"sum"`` (default), ``"mean"`` (floating tensors; sum divided by the world size),
            ``"max"``, ``"min"``, ``"product"``, or a ``torch.distributed.ReduceOp``.

    Returns:
        A new tensor holding the reduction (identical on every rank); without a process group,
        ``tensor`` itself (the reduction over one rank).

    Raises:
        InputTypeError: ``tensor`` is not a tensor; a bad ``op`` type.
        ConfigurationError: an unknown ``op`` name; ``"mean"`` of a non-floating tensor.

    Example::

        >>> all_reduce(torch.ones(2), "sum")  # one process: the identity
        tensor([1., 1.])
    """
    if not isinstance(tensor, torch.Tensor):
        raise InputTypeError(f"all_reduce expects a tensor, got {type(tensor).__name__}.")
    return reduce_pytree(tensor, op)


def _check_leaves(leaves: list, mean: bool, name: str) -> None:
    """Every leaf a tensor, and floating when the reduction is a mean."""
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise InputTypeError(f"{name} expects tensor leaves only, got {type(leaf).__name__}.")
        if mean and not (leaf.dtype.is_floating_point or leaf.dtype.is_complex):
            raise ConfigurationError(f"op='mean' needs floating tensors, got dtype {leaf.dtype}.")


def reduce_pytree(tree: Any, op: str | dist.ReduceOp = "sum") -> Any:
    """Reduce every tensor leaf of ``tree`` over all ranks; returns a new tree.

    Leaves are packed into one flat buffer per (dtype, device), in the tree's traversal order
    (dict keys sorted), so a dict of many parameters costs one collective per dtype, not one
    per leaf. Every rank must pass a tree of the same structure, shapes and dtypes.

    Args:
        tree: a pytree of tensors (a ``ClippedPytree`` is refused: use :func:`sum_gradients`).
        op: as for :func:`all_reduce`.

    Returns:
        A tree of the same structure with new, reduced tensors; without a process group,
        ``tree`` itself.

    Raises:
        InputTypeError: a leaf is not a tensor; ``tree`` is a DP output wrapper; a bad ``op``.
        ConfigurationError: an unknown ``op``; ``"mean"`` of a non-floating leaf.

    Example::

        >>> reduce_pytree({"w": torch.zeros(2)}, "max")  # one process: the identity
        {'w': tensor([0., 0.])}
    """
    red_op, mean = _op(op)
    leaves, treedef = _pytree.tree_flatten(tree)
    _check_leaves(leaves, mean, "reduce_pytree")
    if not is_distributed():
        return tree
    world = dist.get_world_size()
    buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, leaf in enumerate(leaves):
        buckets.setdefault((leaf.dtype, leaf.device), []).append(i)
    out: list[Any] = [None] * len(leaves)
    for members in buckets.values():  # insertion order = traversal order, identical on all ranks
        flat = torch.cat([leaves[i].detach().reshape(-1) for i in members])
        dist.all_reduce(flat, op=red_op)
        if mean:
            flat = flat / world
        for i, part in zip(members, flat.split([leaves[i].numel() for i in members])):
            out[i] = part.view(leaves[i].shape)
    return _pytree.tree_unflatten(treedef, out)


_BUCKET_BYTES = 32 * 2**20


def reduce_pytree_(tree: Any, op: str | dist.ReduceOp = "sum", *, bucket_bytes: int = _BUCKET_BYTES) -> Any:
    """Reduce every tensor leaf of ``tree`` over all ranks **in place**; returns ``tree``.

    The in-place form of :func:`reduce_pytree`, for models where a second copy of every
    gradient does not fit: a contiguous leaf of at least ``bucket_bytes`` is all-reduced where
    it lies; smaller leaves are packed, per (dtype, device), into buckets of at most about
    ``bucket_bytes`` (so the extra memory is one bucket, not a copy of the tree) and copied
    back. Leaves are visited in the tree's traversal order (dict keys sorted), identically on
    every rank, so every rank must pass a tree of the same structure, shapes and dtypes.

    Args:
        tree: a pytree of tensors (a ``ClippedPytree`` is refused: use :func:`sum_gradients_`).
        op: as for :func:`all_reduce`.
        bucket_bytes: the packing threshold and bucket size in bytes, >= 1 (default 32 MiB).

    Returns:
        ``tree`` itself, its leaves now holding the reduction (identical on every rank).
        Without a process group the leaves are left as they are.

    Raises:
        InputTypeError: a leaf is not a tensor; ``tree`` is a DP output wrapper; a bad ``op``.
        ConfigurationError: an unknown ``op``; ``"mean"`` of a non-floating leaf.

    Example::

        >>> g = {"w": torch.ones(3)}
        >>> reduce_pytree_(g, "sum")["w"] is g["w"]  # one process: untouched, same tensor
        True
    """
    red_op, mean = _op(op)
    bucket_bytes = check_positive_int(bucket_bytes, name="bucket_bytes")
    leaves, _ = _pytree.tree_flatten(tree)
    _check_leaves(leaves, mean, "reduce_pytree_")
    if not is_distributed():
        return tree
    world = dist.get_world_size()

    @torch.no_grad()
    def finish(t: torch.Tensor) -> None:
        if mean:
            t.div_(world)

    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    @torch.no_grad()
    def flush(members: list[torch.Tensor]) -> None:
        if not members:
            return
        flat = torch.cat([m.detach().reshape(-1) for m in members])
        dist.all_reduce(flat, op=red_op)
        finish(flat)
        for m, part in zip(members, flat.split([m.numel() for m in members])):
            m.detach().copy_(part.view(m.shape))
        members.clear()

    with torch.no_grad():
        for leaf in leaves:  # traversal order, identical on every rank
            t = leaf.detach()
            nbytes = t.numel() * t.element_size()
            if nbytes >= bucket_bytes and t.is_contiguous():
                dist.all_reduce(t, op=red_op)
                finish(t)
                continue
            key = (t.dtype, t.device)
            members = buckets.setdefault(key, [])
            members.append(leaf)
            if sum(m.numel() * m.element_size() for m in members) >= bucket_bytes:
                flush(members)
        for members in buckets.values():  # insertion order: identical on every rank
            flush(members)
    return tree


def _sum_clipped(clipped: Any, reduce: Any, name: str, *, in_place: bool) -> ClippedPytree:
    if not isinstance(clipped, ClippedPytree):
        if isinstance(clipped, Sequence) and not isinstance(clipped, (str, bytes)):
            clipped = accumulate(clipped)
        else:
            raise InputTypeError(f"{name} expects a ClippedPytree, got {type(clipped).__name__}.")
    if clipped.normalize_by is not None:
        raise ConfigurationError(
            f"{name} expects the unnormalised clipped sum; this one was divided by "
            f"normalize_by={clipped.normalize_by}. DPOptimizer normalises after the reduction."
        )
    if clipped.num_ranks != 1:
        raise ConfigurationError(
            f"{name} expects this rank's own clipped sum; this one is already the sum over "
            f"{clipped.num_ranks} ranks: summing it again would add every example {clipped.num_ranks} "
            "times (sensitivity above C). Call it once per step, on the local sum."
        )
    # A sum stepped on (or noised) before may not come back as a new global sum: the reduced
    # sum is released with its local parts (SOURCES), as accumulate's sum is with its parts.
    check_not_released(clipped, "This clipped sum")
    if not is_distributed():
        return clipped
    world = get_world_size()
    params = clipped.parameters
    if world > _num.MAX_FLOAT32_RANKS and (params is None or any(p.dtype != torch.float64 for p in params.values())):
        # (Every rank sees the same world size and parameter dtypes: every rank refuses, before
        # any collective.)
        raise ConfigurationError(
            f"{name}: {world} ranks of a float32 (or lower-precision) model exceed {_num.MAX_FLOAT32_RANKS}: "
            "adding that many ranks' float64 sums in an order the collective chooses rounds by up to about "
            "world_size^2 2^-31 C, past what the clipping norm's slack leaves for it (numerics, point 3). "
            "Train with fewer ranks or a float64 model. Nothing was reduced."
        )
    device = _collective_device()
    c = float(clipped.clipping_norm)
    bounds = all_reduce(torch.tensor([c, -c], dtype=torch.float64, device=device), "max")
    if float(bounds[0]) != -float(bounds[1]):
        raise ConfigurationError(
            f"Ranks clip at different norms (from {-float(bounds[1])} to {float(bounds[0])}); "
            "every rank must use the same clipping_norm."
        )
    counts = torch.tensor([clipped.num_examples, clipped.num_nonfinite], dtype=torch.int64, device=device)
    counts = all_reduce(counts, "sum").tolist()
    grads = clipped.grads
    if not in_place:
        # The ranks' partial sums add up in float64 (numerics.MAX_FLOAT32_SUM_ROWS).
        grads = optree.tree_map(lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) else t, grads)
    elif any(isinstance(t, torch.Tensor) and t.dtype != torch.float64 for t in optree.tree_leaves(grads)):
        # (Every rank holds the same dtypes, so every rank refuses: no rank is left waiting.)
        # Compiled sums are float64; the eager reference's are float32, and a float32 reduction
        # across ranks rounds at each addition, by up to 2^-12 C per rank (review, estimated).
        raise ConfigurationError(
            f"sum_gradients_ reduces in place in the gradients' dtype, and these sums ({int(counts[0])} examples) "
            "are not float64: use sum_gradients (it adds the ranks' sums in float64), or compile_dp's sums "
            "(float64)."
        )
    reduced = reduce(grads)
    mark_ranks(reduced, get_world_size(), int(counts[0]))  # (the library's own relabelling: refused otherwise)
    out = dataclasses.replace(
        clipped,
        grads=reduced,
        num_examples=int(counts[0]),
        num_nonfinite=int(counts[1]),
        num_ranks=get_world_size(),
    )
    if in_place:
        reseal(out)  # the library's own in-place reduction
    SOURCES[out] = tuple(sum_tensors(clipped))  # released with the global sum
    return out


def sum_gradients_(clipped: ClippedPytree | Sequence[ClippedPytree], *, bucket_bytes: int = _BUCKET_BYTES) -> ClippedPytree:
    """:func:`sum_gradients` without a copy of the gradients: the tensors of ``clipped.grads``
    are overwritten with the global sum (:func:`reduce_pytree_`), for models where a second copy
    of every gradient does not fit.

    Same guarantee, edge cases and call discipline as :func:`sum_gradients` (every rank, every
    step, empty local batches included). After the call ``clipped.grads`` holds the *global*
    sum: use only the returned ``ClippedPytree`` (its ``num_ranks`` is the world size; the
    input still says 1, so ``DPOptimizer`` refuses the input object by mistake).

    Returns:
        A new ``ClippedPytree`` whose ``grads`` are the input's own tensors, reduced in place;
        counts summed as in :func:`sum_gradients`. Without a process group: ``clipped`` itself.

    Raises:
        As :func:`sum_gradients`; also ``ConfigurationError`` for sums that are not float64 (the
        eager reference's float32 sums: a float32 reduction across ranks rounds at each addition;
        use :func:`sum_gradients`, which adds them in float64). ``compile_dp``'s sums are float64.

    Example::

        >>> total = sum_gradients_(step(x, y).clipped)  # doctest: +SKIP
        >>> optimizer.step(total)                       # doctest: +SKIP
    """
    return _sum_clipped(clipped, lambda g: reduce_pytree_(g, "sum", bucket_bytes=bucket_bytes), "sum_gradients_", in_place=True)


def sum_gradients(clipped: ClippedPytree | Sequence[ClippedPytree]) -> ClippedPytree:
    """Sum a :class:`ClippedPytree` over all ranks: the global clipped sum of one logical step.

    Call it on every rank at every step, an empty local batch included (the compiled step
    returns a zero ``ClippedPytree`` then), and pass the result to ``DPOptimizer.step``; all
    optimizers must share one key (module docstring: why the noise is then added exactly once).

    Guarantee: if each input is the sum of ``clip_C(g_i)`` over that rank's examples and the
    ranks' examples are disjoint, the result is the sum over their union; its sensitivity to
    one example is C. No noise is added here.

    Edge cases: an empty local batch contributes zeros; C = inf sums unclipped gradients (not
    private, as in one process); non-finite examples were already selected away per rank and
    the counts are summed; ranks with different C raise (on every rank) before any sum.

    Args:
        clipped: this rank's ``ClippedPytree`` (``grads`` a dict of unnormalised sums), or a
            sequence of them (physical batches of one logical batch: accumulated first).

    Returns:
        A new ``ClippedPytree``: ``grads`` summed over ranks; ``num_examples`` and
        ``num_nonfinite`` summed (global counts, **not privatised**); ``per_example_norms`` and
        ``aux`` are this rank's, **local and not privatised**; ``clipping_norm`` and the
        ``parameters`` references unchanged. Without a process group: ``clipped`` itself.

    Raises:
        InputTypeError: not a ``ClippedPytree``; ``grads`` not a pytree of tensors.
        ConfigurationError: a normalised input (``normalize_by`` set); ranks disagree on C; a
            sum released before (stepped on or noised): the global sum is released with it.

    Example::

        >>> total = sum_gradients(step(x, y).clipped)  # doctest: +SKIP
        >>> optimizer.step(total)                      # doctest: +SKIP
    """
    return _sum_clipped(clipped, lambda g: reduce_pytree(g, "sum"), "sum_gradients", in_place=False)


# ----------------------------------------------------------------------------- shared state
def broadcast_key(key: oprandom.Key, *, src: int = 0) -> oprandom.Key:
    """Rank ``src``'s key, on every rank: build every ``DPOptimizer`` from it.

    Args:
        key: this rank's :class:`~opake_compile.random.Key` (only ``src``'s value matters).
        src: the rank whose key wins.

    Returns:
        ``src``'s key (``key`` itself without a process group).

    Raises:
        InputTypeError: ``key`` is not a Key.

    Example::

        >>> k = oprandom.key(0)
        >>> broadcast_key(k) == k  # one process
        True
    """
    oprandom._check_key(key)
    if not is_distributed():
        return key
    words = torch.tensor(oprandom.key_to_state(key), dtype=torch.int64, device=_collective_device())
    dist.broadcast(words, src=src)
    return oprandom.key_from_state(words.tolist())


def check_same_key(key: oprandom.Key) -> None:
    """Raise on every rank unless all ranks hold the same key (an all-gather of its words).

    Call it before the first step with the key given to ``DPOptimizer``: with different keys
    the ranks would add different noise and their parameters would drift apart.

    Raises:
        InputTypeError: ``key`` is not a Key.
        ConfigurationError: the ranks' keys differ (names the ranks that disagree with rank 0).
    """
    oprandom._check_key(key)
    if not is_distributed():
        return
    words = torch.tensor(oprandom.key_to_state(key), dtype=torch.int64, device=_collective_device())
    gathered = [torch.empty_like(words) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, words)
    differ = [r for r, w in enumerate(gathered) if not torch.equal(w, gathered[0])]
    if differ:
        raise ConfigurationError(
            f"Rank(s) {differ} hold a different noise key than rank 0. Every DPOptimizer must use "
            "the same key (distributed.broadcast_key) so that the noise is added once."
        )


def _check_step_agreement(
    optimizer: Any, clipped: ClippedPytree, draw: Any, draw_size: int | None, failure: BaseException | None
) -> None:
    """The group check of ``DPOptimizer.step`` (collective: one ``all_gather_object``): every
    rank's step must be the same step of the same mechanism on disjoint shards, or every rank
    refuses it, before anything changes.

    Compared across ranks: the noise key (:func:`check_same_key`), the noise multiplier, the
    sampler's ``sample_rate`` and ``dataset_size``, the accountant and the budget, the
    optimizer's step and draw counts and
    the draw named; the samplers' ranks must be ``0 .. W-1``,
    each once (two ranks sampling one shard add its examples twice: sensitivity 2C). The
    global sum's ``num_examples`` may not exceed the ranks' local draws added up (a shard
    summed whole, or a sum passed through :func:`sum_gradients` twice, holds more). A rank
    whose own checks failed (``failure``) re-raises its error; the others raise naming it.
    Disagreements are reported first (they usually explain a rank's failure).

    Raises:
        ConfigurationError: on every rank, naming what differs (or the rank that failed).
    """
    from opake_compile.sampling import draw_of

    named = draw_of(draw) or clipped.draw
    mine = {
        "key": optimizer._key.words,
        "noise_multiplier": float(optimizer.noise_multiplier),
        "sample_rate": float(getattr(optimizer.sampler, "sample_rate", float("nan"))),
        "dataset_size": getattr(optimizer.sampler, "dataset_size", None),
        "steps": optimizer.steps,
        "draws_charged": optimizer._draws_charged,
        "draw": None if named is None else (named.epoch, named.step, named.seq),
        "correlated_noise": None if optimizer._plan is None else optimizer._plan.kind,
        # The budget check runs on each rank after this one: ranks on different budgets or
        # accountants refused and stepped apart (review: one rank refused at its budget while
        # the other stepped, and the replicas held different models).
        "accountant": repr(optimizer.accountant),
        "budget": repr(optimizer.budget),
        "sampler_rank": getattr(optimizer.sampler, "rank", None),
        "draw_size": draw_size,
        "failure": None if failure is None else f"{type(failure).__name__}: {failure}",
    }
    world = dist.get_world_size()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    differ = [r for r, g in enumerate(gathered) if g["key"] != gathered[0]["key"]]
    if differ:
        raise ConfigurationError(
            f"Rank(s) {differ} hold a different noise key than rank 0. Every DPOptimizer must use "
            "the same key (distributed.broadcast_key) so that the noise is added once."
        )
    # (Not the draws handed out: a DataLoader's workers prefetch a rank-dependent number.)
    for field in ("noise_multiplier", "sample_rate", "dataset_size", "correlated_noise", "accountant", "budget",
                  "steps", "draws_charged", "draw"):
        values = [g[field] for g in gathered]
        odd = [r for r, v in enumerate(values) if not _same(v, values[0])]
        if odd:
            raise ConfigurationError(
                f"Ranks disagree on {field} (rank 0: {values[0]!r}, rank {odd[0]}: {values[odd[0]]!r}): "
                "every rank must take the same step of the same mechanism (same noise multiplier, "
                "sampler configuration and position). Nothing changed."
            )
    ranks = [g["sampler_rank"] for g in gathered]
    if None in ranks or sorted(ranks) != list(range(world)):
        raise ConfigurationError(
            f"The ranks' samplers draw as sampler ranks {ranks}, not 0..{world - 1} once each: two "
            "ranks sampling one shard add its examples twice (sensitivity 2C). Leave "
            "DistributedPoissonSampler's rank= to the process group (or pass each process its global rank)."
        )
    if failure is not None:
        raise failure
    failed = [(r, g["failure"]) for r, g in enumerate(gathered) if g["failure"] is not None]
    if failed:
        r, why = failed[0]
        raise ConfigurationError(f"Rank {r} refused this step ({why}); every rank refuses it with it. Nothing changed.")
    sizes = [g["draw_size"] for g in gathered]
    if all(v is not None for v in sizes) and clipped.num_examples > sum(sizes):
        raise ConfigurationError(
            f"The global clipped sum holds {clipped.num_examples} examples but the ranks' draws of this "
            f"step hold {sum(sizes)} together ({sizes}): a sum was reduced twice, a shard was summed "
            "beyond its draw, or the rows were not the ones the samplers drew. Nothing changed."
        )


@torch.no_grad()
def broadcast_parameters(module: nn.Module, *, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers into ``module`` on every rank, in place.

    Replicas must start identical (DDP does the same at construction). A no-op without a
    process group.

    Raises:
        InputTypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, nn.Module):
        raise InputTypeError(f"Expected an nn.Module, got {type(module).__name__}.")
    if not is_distributed():
        return
    for t in [*module.parameters(), *module.buffers()]:
        dist.broadcast(t.data, src=src)


def _plain(x: Any) -> Any:
    """A picklable, comparable form of a decoded configuration value."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), x.detach().cpu().tolist())
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    if isinstance(x, oprandom.Key):
        return ("key", x.words)
    return x


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def sync(obj: Any, *, src: int = 0) -> Any:
    """Bring any state object of this library, or a tree of them, into agreement across ranks.

    Dispatches on the type through :mod:`opake_compile.serialization` (so every type with a
    serializer works, user types included): the **configuration** of every object (for
    example a ``DPOptimizer``'s noise multiplier, sample rate and dataset size, its accountant,
    a ``ClipState``'s or ``DPStep``'s clipping norm, a sampler's q, N, steps and key, the world
    size) must already agree, and the **state** (keys, step and call counts, a sampler's epoch
    and position, an adaptive clipping norm, the wrapped optimizer's moments, parameters,
    plain tensors and numbers) is set to rank ``src``'s everywhere. Fields that differ per
    rank by design are kept: a ``DistributedPoissonSampler``'s ``rank`` and a ``DPStep``'s
    dropout key. Stateful objects (modules, optimizers, ``DPOptimizer``, samplers, steps) are
    updated in place; value types (keys, clip and noise states) come back in the result.

    Typical use: after restoring a checkpoint on every rank. (Adaptive clipping is refused in a
    process group of several ranks: each rank's norm update would read its own count.)

    Every rank must call it with a tree of the same structure. It is collective: one gather of
    the metadata, one broadcast per dtype, one gather of the validation result.

    Args:
        obj: an object or a tree (dict, list, tuple, NamedTuple) of objects.
        src: the rank whose state wins.

    Returns:
        The synchronised tree (stateful objects are the same objects). Without a process group:
        ``obj`` itself.

    Raises:
        ConfigurationError: on every rank, naming the field, when ranks disagree on
            configuration (e.g. a different sigma), or when rank ``src``'s state does not fit
            another rank's objects (shapes, dtypes, structure); nothing has changed then.
        InputTypeError: an object without a serializer (a ``ClippedPytree``: use
            :func:`sum_gradients`).

    Example::

        >>> clip_state = sync(clip_state)           # doctest: +SKIP
        >>> sync({"optimizer": opt, "sampler": sampler})  # doctest: +SKIP
    """
    from opake_compile import serialization as _ser

    if isinstance(obj, ClippedPytree):
        raise InputTypeError("sync brings state into agreement; a ClippedPytree is summed with sum_gradients.")
    flat, meta = _ser.state_dict(obj)
    if not is_distributed():
        return obj
    world = dist.get_world_size()
    src = check_nonnegative_int(src, name="src")
    if src >= world:
        raise ConfigurationError(f"Expected src={src} < world_size={world}.")

    # 1. Configuration must agree; local fields are set aside.
    decoder = _ser._Decoder(flat)
    config: dict[str, Any] = {}
    local_keys: set[str] = set()
    for path, ser, fields in _ser._object_fields(meta["tree"]):
        for name in ser.local:
            if name in fields:
                local_keys.update(_ser._tensor_keys(fields[name]))
        for name in ser.config:
            if name in fields and name not in ser.local:
                config[_ser._join(path, name)] = _plain(decoder.free(fields[name], _ser._join(path, name)))
    signature = [(k, str(t.dtype), tuple(t.shape)) for k, t in flat.items()]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"config": config, "meta": meta, "signature": signature})
    for name in sorted(set().union(*(g["config"] for g in gathered))):
        values = [g["config"].get(name, "<missing>") for g in gathered]
        odd = [r for r, v in enumerate(values) if not _same(v, values[src])]
        if odd:
            raise ConfigurationError(
                f"{name}: ranks disagree on configuration (rank {src}: {values[src]!r}, rank {odd[0]}: "
                f"{values[odd[0]]!r}); it cannot be reconciled: build every rank's objects with the same {name.rsplit('.', 1)[-1]}."
            )

    # 2. Rank src's tensors, one broadcast per dtype, into buffers shaped by its signature.
    dtypes = {str(d): d for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)}
    src_sig = gathered[src]["signature"]
    device = _collective_device()
    received: dict[str, torch.Tensor] = {}
    groups: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for k, dt, shape in src_sig:
        if dt not in dtypes:
            raise ConfigurationError(f"{k}: cannot broadcast dtype {dt}.")
        groups.setdefault(dt, []).append((k, tuple(shape)))
    for dt, members in groups.items():  # src's order: identical on every rank
        dtype = dtypes[dt]
        wire = torch.uint8 if dtype == torch.bool else dtype  # Gloo has no bool
        sizes = [math.prod(shape) for _, shape in members]
        if get_rank() == src:
            buf = torch.cat([flat[k].detach().reshape(-1).to(device=device, dtype=wire) for k, _ in members])
        else:
            buf = torch.empty(sum(sizes), dtype=wire, device=device)
        dist.broadcast(buf, src=src)
        for (k, shape), part in zip(members, buf.split(sizes)):
            received[k] = part.to(dtype).view(shape).cpu().clone()
    for k in local_keys:  # rank-specific fields keep this rank's values
        if k in flat and k in received:
            received[k] = flat[k]

    # 3. Validate rank src's state against this rank's objects everywhere, then commit.
    decoder = _ser._Decoder(received)
    error = None
    try:
        out = decoder.restore(obj, gathered[src]["meta"]["tree"], "")
    except (CheckpointError, InputTypeError) as err:
        error, out = f"{type(err).__name__}: {err}", None
    errors: list[Any] = [None] * world
    dist.all_gather_object(errors, error)
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        r, e = bad[0]
        raise ConfigurationError(f"sync: rank {src}'s state does not fit rank {r}'s objects ({e}). Nothing was changed.")
    for commit in decoder.commits:
        commit()
    return out


# ----------------------------------------------------------------------------- sampling
class DistributedPoissonSampler(PoissonSampler):
    """Poisson subsampling of the *whole* dataset, split across ranks.

    Construction: the dataset is partitioned into fixed strided shards, rank ``r`` owning the
    global indices ``i % world_size == r`` (:func:`local_shard`). For batch ``step`` of epoch
    ``epoch``, rank ``r`` includes each index of its shard independently with probability q,
    using ``generator_from_key(fold_in(fold_in(fold_in(key, epoch), step), r))``. Shards are
    disjoint and cover ``range(N)``, and the ranks' draws are independent, so every example of
    the dataset is included independently with probability q: the union of the local batches
    is exactly a Poisson sample of the whole dataset (its size is Binomial(N, q)). Hence
    ``dataset_size``, ``sample_rate`` and ``expected_batch_size`` are the **global** ``N``,
    ``q`` and ``q N`` (what ``DPOptimizer`` normalises by and the accountant analyses), and the
    same on every rank; so is ``len(sampler)``, so every rank runs the same number of steps.

    The sampler yields **positions into** ``local_shard(dataset)`` (0-based, increasing), so
    use ``DataLoader(local_shard(ds), batch_sampler=sampler, ...)`` or index the shard's
    tensors; ``sampler.shard[pos]`` is the global index. Local batches are often empty (with
    probability ``(1-q)**len(shard)``): the rank still takes the step.

    Pass the same ``key`` on every rank (e.g. a :func:`~opake_compile.random.split` child of a
    :func:`broadcast_key` key); the rank is folded in here.

    Args:
        dataset_size: N, the size of the whole dataset.
        sample_rate: q in [0, 1].
        key: an :class:`opake_compile.random.Key`, not used for anything else.
        rank, world_size: default: the default process group's (0 and 1 without one).
        steps: batches per epoch, as for :class:`~opake_compile.sampling.PoissonSampler`.
        truncated_batch_size: must be ``None``: refused (a per-rank cap is not the
            truncated-Poisson mechanism on the global batch that the accountant would analyse).

    Attributes:
        rank, world_size: this sampler's place.
        shard: ``range(rank, N, world_size)``, the global indices of this rank's shard.
        is_poisson: ``True``.

    Raises:
        InputTypeError, ConfigurationError: as for ``PoissonSampler``; ``rank >= world_size``;
            a ``truncated_batch_size``.

    Example::

        >>> s = DistributedPoissonSampler(10, 0.5, key=oprandom.key(0), rank=1, world_size=2)
        >>> s.expected_batch_size, list(s.shard)
        (5.0, [1, 3, 5, 7, 9])
        >>> all(0 <= p < len(s.shard) for p in s.batch_at(0, 0))
        True
    """

    def __init__(
        self,
        dataset_size: int,
        sample_rate: float,
        *,
        key: oprandom.Key,
        rank: int | None = None,
        world_size: int | None = None,
        steps: int | None = None,
        truncated_batch_size: int | None = None,
    ) -> None:
        if truncated_batch_size is not None:
            raise ConfigurationError(
                f"DistributedPoissonSampler does not truncate (got truncated_batch_size="
                f"{truncated_batch_size!r}): a cap on each rank's batch is not the truncated-Poisson "
                "mechanism on the global batch that the accountant would analyse. Use a smaller "
                "sample_rate or a physical_batch_size in compile_dp to bound memory."
            )
        super().__init__(dataset_size, sample_rate, None, key=key, steps=steps)
        self._rank, self._world_size = _resolve_rank(rank, world_size)
        self._shard = range(self._rank, self._dataset_size, self._world_size)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def shard(self) -> range:
        """The global indices of this rank's shard; position ``p`` of a batch is ``shard[p]``."""
        return self._shard

    def _batch(self, epoch_key: oprandom.Key, step: int) -> list[int]:
        g = oprandom.generator_from_key(oprandom.fold_in(oprandom.fold_in(epoch_key, step), self._rank))
        mask = torch.rand(len(self._shard), generator=g, dtype=torch.float64) < self._sample_rate
        return mask.nonzero().flatten().tolist()

    def state_dict(self) -> dict[str, Any]:
        """As ``PoissonSampler.state_dict``, plus ``rank`` and ``world_size``."""
        return {**super().state_dict(), "rank": self._rank, "world_size": self._world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the epoch counter; the rank layout must match too.

        Raises:
            CheckpointError: as for ``PoissonSampler``; another rank or world size.
        """
        if isinstance(state, dict):
            for name in ("rank", "world_size"):
                if state.get(name) != getattr(self, name):
                    raise CheckpointError(
                        f"DistributedPoissonSampler state has {name}={state.get(name)!r}, this sampler "
                        f"{getattr(self, name)!r}; restore each rank's own state with the same world size."
                    )
        super().load_state_dict(state)

    def __repr__(self) -> str:
        return (
            f"DistributedPoissonSampler(dataset_size={self._dataset_size}, sample_rate={self._sample_rate}, "
            f"rank={self._rank}, world_size={self._world_size}, steps={self._steps}, key={self._key!r})"
        )
