"""Poisson subsampling of a dataset, as a ``DataLoader`` batch sampler (and the DP-FTRL samplers).

The samplers of correlated noise (:mod:`opake_compile.dpftrl`) live here too:
:class:`CyclicPoissonSampler` (Poisson within one of ``bands`` fixed groups per step),
:class:`SequentialBatchSampler` (the same fixed batches every epoch),
:class:`BallsInBinsSampler` (a random partition per epoch) and :class:`BMinSepSampler`
(Poisson among the examples idle for the last ``b - 1`` steps). They are not ``is_poisson``:
``DPOptimizer`` accepts them only with a noise mechanism that declares their scheme.

DP-SGD's privacy amplification by subsampling (Abadi et al. 2016, "Deep Learning with
Differential Privacy"; Mironov, Talwar and Zhang 2019 for the Rényi analysis) assumes that every
example joins every batch independently with probability q. Shuffling into fixed-size batches is
a different mechanism, and accounting for it as Poisson overstates the privacy.

Example::

    >>> import torch
    >>> from torch.utils.data import DataLoader, TensorDataset, default_collate
    >>> from opake_compile import random as oprandom
    >>> from opake_compile.functional import empty_collate
    >>> from opake_compile.sampling import PoissonSampler
    >>> ds = TensorDataset(torch.randn(100, 3), torch.randint(0, 2, (100,)))
    >>> sampler = PoissonSampler(len(ds), 0.1, key=oprandom.key(0))
    >>> loader = DataLoader(ds, batch_sampler=sampler, collate_fn=empty_collate(default_collate, example=ds[0]))
    >>> len(loader)
    10
"""

from __future__ import annotations

import array
import dataclasses
import json
import secrets
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from opake_compile import random as oprandom
from opake_compile._validate import check_nonnegative_int, check_positive_int, check_probability
from opake_compile.exceptions import CheckpointError, ConfigurationError, InputTypeError

__all__ = [
    "PoissonSampler",
    "CyclicPoissonSampler",
    "SequentialBatchSampler",
    "BallsInBinsSampler",
    "BMinSepSampler",
    "Draw",
    "DrawId",
    "draw_of",
    "draw_loader",
]

_STATE_VERSION = 2  # 2 adds "position" (batches of the current epoch already drawn); 1 still loads

def _draws_charged_from_live(sampler: Any) -> int:
    from opake_compile.optim import _draws_charged_from

    return _draws_charged_from(sampler)


def _new_sampler_id() -> int:
    """A sampler's id: random, so that a sampler made in another process cannot share it (a
    per-process counter made the first sampler of two processes alike)."""
    return secrets.randbits(62)


@dataclasses.dataclass(frozen=True)
class DrawId:
    """The identity of one Poisson draw: which sampler handed it out, and when.

    Attributes:
        source: an id of the sampler object (random, 62 bits: unique across processes).
        seq: 0-based hand-out number: the draw is the ``seq``-th the sampler handed out (over
            all epochs and :meth:`PoissonSampler.batch_at` calls). ``DPOptimizer`` charges every
            draw up to and including the one a step names.
        epoch, step: where the draw sits in the sampler's reproducible stream.
    """

    source: int
    seq: int
    epoch: int
    step: int


class Draw(list):
    """The indices of one Poisson draw (a ``list`` of ints, increasing) and its :class:`DrawId`.

    A ``Draw`` is what :class:`PoissonSampler` yields; it is an ordinary list for a
    ``DataLoader``, ``torch.as_tensor`` or ``len``, and compares equal to a list of the same
    indices. ``draw.id`` tells ``DPOptimizer.step(..., draw=draw)`` which draw a step used, so
    that several draws combined into one step are refused and skipped draws are charged.
    """

    __slots__ = ("id",)

    def __init__(self, indices: list[int], draw_id: DrawId) -> None:
        super().__init__(indices)
        self.id = draw_id

    def __reduce__(self):  # DataLoader workers receive the indices pickled
        return (Draw, (list(self), self.id))


def draw_of(value: Any) -> DrawId | None:
    """The :class:`DrawId` of a :class:`Draw` or ``DrawId`` (``None`` for ``None``).

    Raises:
        InputTypeError: anything else.
    """
    if value is None or isinstance(value, DrawId):
        return value
    if isinstance(value, Draw):
        return value.id
    raise InputTypeError(
        f"Expected a Draw yielded by a PoissonSampler (or its .id), got {type(value).__name__}."
    )


class PoissonSampler(Sampler[list[int]]):
    """Batch sampler where every index joins every batch independently with probability q.

    Use it as ``DataLoader(ds, batch_sampler=sampler, collate_fn=empty_collate(collate, example=ds[0]))``
    (batches can be empty, the first one included: see :func:`~opake_compile.functional.empty_collate`).
    Each batch is drawn from its own generator, seeded by
    ``fold_in(fold_in(key, epoch), step)``: the ``N`` inclusion decisions are one Bernoulli(q)
    mask (``torch.rand(N) < q``), so batch sizes are Binomial(N, q), vary, and can be empty
    (probability ``(1-q)**N``). Batches list indices in increasing order. Every ``iter()`` (an
    epoch) uses the next epoch number, so epochs differ while the whole run is reproducible
    from ``key``; :meth:`state_dict` saves the epoch counter.

    Truncation: with ``truncated_batch_size=B``, a batch of more than B indices is replaced by a
    uniformly random subset of exactly B of them (drawn from the same per-batch generator;
    smaller batches are unchanged). This changes the mechanism: the accountant must use the
    truncated-Poisson analysis, which is why the cap is exposed as ``truncated_batch_size``.
    ``expected_batch_size`` stays the untruncated ``q·N``, the normaliser DP-SGD divides by.

    Draws: every batch is a :class:`Draw`, a list of indices that also carries its
    :class:`DrawId` (the sampler and a hand-out number). ``DPOptimizer`` charges one Poisson step
    per draw, so pass the draw a step used: ``optimizer.step(clipped, draw=idx)``. Without it the
    optimizer charges the one draw handed out since its last step and refuses the step when
    several were handed out (it cannot tell chunks of one draw from several draws). A
    ``DataLoader`` with workers prefetches (hands out draws ahead of the step that uses them); use
    :func:`draw_loader`, which yields ``(batch, draw_id)`` so the draw travels with its batch and
    nothing is over-charged.

    Edge cases: q = 1 puts every index in every batch (no amplification); q = 0 gives only empty
    batches and then ``steps`` must be given explicitly.

    Args:
        dataset_size: N, the number of examples (indices ``0..N-1``), >= 1. It must equal the
            dataset's length; the sampler cannot check that.
        sample_rate: q in [0, 1].
        truncated_batch_size: optional cap B >= 1 on the batch size.
        key: an :class:`opake_compile.random.Key`; use a key not used for anything else (e.g. a
            :func:`~opake_compile.random.split` child of the run's root key).
        steps: batches per epoch (``len(sampler)``), >= 1. Default ``max(1, round(1/q))``
            (Python's ``round``, ties to even), so one epoch visits each example once in
            expectation; required when q = 0.

    Attributes:
        dataset_size, sample_rate, truncated_batch_size, steps, key: the configuration
            (read-only).
        expected_batch_size: ``q·N`` as a float (read-only).
        epoch: the number of the next epoch ``iter()`` will start (read-only).
        is_poisson: ``True``; lets optimizers and accountants recognise the mechanism.

    Raises:
        InputTypeError: an argument has the wrong type (``key`` not a Key, a non-int size).
        ConfigurationError: N < 1, q outside [0, 1], B < 1, steps < 1, or q = 0 without steps.

    Example::

        >>> from opake_compile import random as oprandom
        >>> s = PoissonSampler(1000, 0.01, key=oprandom.key(1))
        >>> len(s), s.expected_batch_size
        (100, 10.0)
        >>> batches = list(s)
        >>> len(batches)
        100
    """

    is_poisson = True
    sampling = "poisson"  # the scheme a noise mechanism's accounting recognises

    def __init__(
        self,
        dataset_size: int,
        sample_rate: float,
        truncated_batch_size: int | None = None,
        *,
        key: oprandom.Key,
        steps: int | None = None,
    ) -> None:
        super().__init__()
        if hasattr(dataset_size, "__len__") and not isinstance(dataset_size, (str, bytes)):
            raise InputTypeError(
                f"Expected dataset_size to be an int, got {type(dataset_size).__name__}: pass len(dataset)."
            )
        self._dataset_size = check_positive_int(dataset_size, name="dataset_size")
        self._sample_rate = check_probability(sample_rate, name="sample_rate")
        self._truncated_batch_size = (
            None
            if truncated_batch_size is None
            else check_positive_int(truncated_batch_size, name="truncated_batch_size")
        )
        self._key = oprandom._check_key(key)
        if steps is None:
            if self._sample_rate == 0.0:
                raise ConfigurationError(
                    "sample_rate=0.0 gives only empty batches and no default number of steps; "
                    "pass steps= explicitly."
                )
            steps = max(1, round(1.0 / self._sample_rate))
        self._steps = check_positive_int(steps, name="steps")
        self._epoch = 0
        self._id = _new_sampler_id()
        self._handed_out = 0
        # Which draw each (epoch, step) was handed out as, in runs [epoch, step0, seq0, count]
        # (iteration hands out consecutive steps as consecutive draws: one run per epoch): a
        # position handed out again (batch_at) is the same sample, so it keeps its draw, and
        # DPOptimizer then refuses a second step on it instead of charging a fresh draw.
        self._history: list[list[int]] = []
        # Sizes of the draws handed out since construction or the last load (index: seq minus
        # _sizes_from), for DPOptimizer's bound on the examples a step on a named draw sums.
        self._sizes = array.array("q")
        self._sizes_from = 0
        # Mid-epoch position, for checkpoints: (epoch, batches of it drawn so far) while an
        # epoch is being iterated; a restored position makes the next iter() resume there.
        self._position: tuple[int, int] | None = None
        self._resume_at = 0
        # Bumped by load_state_dict: an iterator made before it stops there (it would hand out
        # positions the loaded state does not know, and overwrite the restored position).
        self._loads = 0
        # Draws the run had charged when the state last loaded was saved (DPOptimizer.step
        # refuses an optimizer behind it: its next noise was released with later draws).
        self._charged_at_load = 0

    # -- read-only configuration --------------------------------------------------------------

    @property
    def dataset_size(self) -> int:
        """N, the number of indices sampled from."""
        return self._dataset_size

    @property
    def sample_rate(self) -> float:
        """q, each index's inclusion probability per batch."""
        return self._sample_rate

    @property
    def truncated_batch_size(self) -> int | None:
        """The cap on the batch size, or ``None`` (plain Poisson)."""
        return self._truncated_batch_size

    @property
    def expected_batch_size(self) -> float:
        """``q·N`` (before truncation), the normaliser of the noisy sum."""
        return self._sample_rate * self._dataset_size

    @property
    def steps(self) -> int:
        """Batches per epoch."""
        return self._steps

    @property
    def key(self) -> oprandom.Key:
        """The root key of this sampler's randomness."""
        return self._key

    @property
    def epoch(self) -> int:
        """The epoch number the next ``iter()`` starts."""
        return self._epoch

    @property
    def draws_handed_out(self) -> int:
        """How many draws this sampler has handed out so far (iteration and ``batch_at``).

        ``DPOptimizer`` charges for draws, not for calls: a draw handed out and never stepped on
        is charged at the next step that names a later draw (it may have been used to release
        something), and several draws in one step are refused.
        """
        return self._handed_out

    # -- sampling -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._steps

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self._epoch
        self._epoch += 1
        start, self._resume_at = self._resume_at, 0
        self._position = (epoch, start)
        return self._iterate(epoch, start)

    def _iterate(self, epoch: int, start: int = 0) -> Iterator[list[int]]:
        epoch_key = oprandom.fold_in(self._key, epoch)
        loads = self._loads
        for step in range(start, self._steps):
            if self._loads != loads:
                raise ConfigurationError(
                    "This iterator of the sampler was made before its load_state_dict: it would go on "
                    "from where it was, not from the restored position (and move the restored position "
                    "on). Iterate the sampler again (iter(sampler), or a new DataLoader iterator)."
                )
            draw = self._draw(epoch_key, step, epoch)
            self._position = (epoch, step + 1)  # counted as drawn once handed out
            yield draw

    def _draw(self, epoch_key: oprandom.Key, step: int, epoch: int) -> Draw:
        """Hand out batch ``step`` of ``epoch`` as the next :class:`Draw`, or, for a position
        handed out before, as the draw it was then (the same indices: the same sample)."""
        seq = self._seq_at(epoch, step)
        if seq is None:
            seq = self._handed_out
            self._handed_out += 1
            last = self._history[-1] if self._history else None
            if last is not None and last[0] == epoch and last[1] + last[3] == step and last[2] + last[3] == seq:
                last[3] += 1
            else:
                self._history.append([epoch, step, seq, 1])
        draw = Draw(self._batch(epoch_key, step), DrawId(self._id, seq, epoch, step))
        if seq == self._sizes_from + len(self._sizes):
            self._sizes.append(len(draw))
        return draw

    def _size_of(self, seq: int) -> int | None:
        """How many examples draw number ``seq`` holds, or ``None`` for a draw handed out before
        the last :meth:`load_state_dict` (or not yet). (Never drawn again: some schemes' batches
        depend on the sampler's state.)"""
        i = seq - self._sizes_from
        return self._sizes[i] if 0 <= i < len(self._sizes) else None

    def _seq_at(self, epoch: int, step: int) -> int | None:
        """The draw number position ``(epoch, step)`` was handed out as, or ``None``."""
        for e, s0, q0, n in reversed(self._history):
            if e == epoch and s0 <= step < s0 + n:
                return q0 + step - s0
        return None

    def _batch(self, epoch_key: oprandom.Key, step: int) -> list[int]:
        g = oprandom.generator_from_key(oprandom.fold_in(epoch_key, step))
        mask = torch.rand(self._dataset_size, generator=g, dtype=torch.float64) < self._sample_rate
        idx = mask.nonzero().flatten()
        cap = self._truncated_batch_size
        if cap is not None and idx.numel() > cap:
            keep = torch.randperm(idx.numel(), generator=g)[:cap]
            idx = idx[keep.sort().values]
        return idx.tolist()

    def batch_at(self, epoch: int, step: int) -> Draw:
        """The indices of batch ``step`` of epoch ``epoch``, without touching the epoch counter.

        The result is handed out like any other draw (it counts in :attr:`draws_handed_out`),
        except that a position handed out before (by iteration or an earlier call) comes back
        as that same draw, ``.id`` included: it is the same sample, so ``DPOptimizer`` refuses
        a second step on it (two releases of one sample are not two Poisson steps).

        Raises:
            InputTypeError: a non-int argument.
            ConfigurationError: ``epoch < 0`` or ``step`` outside ``[0, steps)``.
        """
        epoch = check_nonnegative_int(epoch, name="epoch")
        step = check_nonnegative_int(step, name="step")
        if step >= self._steps:
            raise ConfigurationError(f"Expected step={step} < steps={self._steps}.")
        return self._draw(oprandom.fold_in(self._key, epoch), step, epoch)

    # -- checkpointing ------------------------------------------------------------------------

    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.copy, copy.deepcopy and pickle all come here.
        raise ConfigurationError(
            f"A {type(self).__name__} is not copied or pickled: the copy would hand out the same "
            "draws under the same identity, so that one sample was charged as two independent "
            "draws (review: deepcopy, and a sampler pickled in another process at another sample "
            "rate). Save and restore its state with state_dict() / load_state_dict() or "
            "opake_compile.Checkpointer, into a sampler built with the same arguments."
        )

    def _scheme_state(self) -> dict[str, Any]:
        """The configuration that fixes which examples each draw holds, position apart (plain
        Python values): two samplers with equal schemes hand out the same draw at every position.
        ``DPOptimizer`` saves it beside a correlated-noise state, whose sensitivity depends on
        who took part when."""
        return {
            "key": oprandom.key_to_state(self._key),
            "dataset_size": self._dataset_size,
            "sample_rate": self._sample_rate,
            "truncated_batch_size": self._truncated_batch_size,
            "steps": self._steps,
        }

    def state_dict(self) -> dict[str, Any]:
        """The epoch counter, the position inside the epoch being iterated, and the
        configuration they belong to (plain Python values).

        Saved in the middle of an epoch (after ``k`` of its batches were handed out), ``epoch``
        is that epoch and ``position`` is ``k``: a restored sampler's next ``iter()`` yields
        batches ``k, k+1, ...`` of it, the ones the interrupted run would have drawn next.
        (With a ``DataLoader`` that prefetches, ``k`` counts batches drawn, not consumed.)
        """
        epoch, position = self._epoch, self._resume_at
        if self._position is not None and self._position[0] == self._epoch - 1 and self._position[1] < self._steps:
            epoch, position = self._position
        return {
            "version": _STATE_VERSION,
            "epoch": epoch,
            "position": position,
            **self._scheme_state(),
            "draws_handed_out": self._handed_out,
            # How many of its draws the optimizer charging it had charged: an optimizer restored
            # from an earlier time of the run is refused at its next step (DPOptimizer.step).
            "draws_charged": max(self._charged_at_load, _draws_charged_from_live(self)),
            # One string: a checkpoint restores into a template of fixed structure.
            "history": json.dumps(self._history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the epoch counter saved by :meth:`state_dict`.

        The configuration must match this sampler's (a different q, N, cap or key would silently
        change the privacy accounting or the random stream). An iterator made before the load
        raises :class:`~opake_compile.exceptions.ConfigurationError` at its next draw: iterate
        the sampler again to resume at the restored position.

        Raises:
            CheckpointError: a missing key, an unknown version, or a configuration mismatch; a
                state behind the draws a live ``DPOptimizer`` charged, or whose record of the
                positions handed out as those draws differs from this sampler's.
        """
        if not isinstance(state, dict):
            raise CheckpointError(f"Expected a dict state, got {type(state).__name__}.")
        required = ("version", "epoch", "key", "dataset_size", "sample_rate", "truncated_batch_size", "steps")
        missing = [k for k in required if k not in state]
        if missing:
            raise CheckpointError(f"PoissonSampler state lacks {missing}.")
        if state["version"] not in (1, _STATE_VERSION):
            raise CheckpointError(f"Unknown PoissonSampler state version {state['version']!r}.")
        try:
            saved_key = oprandom.key_from_state(state["key"])
        except InputTypeError as err:
            raise CheckpointError(f"Invalid key in PoissonSampler state: {err}") from err
        current = self.state_dict()
        for name in ("dataset_size", "sample_rate", "truncated_batch_size", "steps"):
            if state[name] != current[name]:
                raise CheckpointError(
                    f"PoissonSampler state has {name}={state[name]!r}, this sampler "
                    f"{current[name]!r}; construct the sampler with the saved configuration."
                )
        if saved_key != self._key:
            raise CheckpointError(
                "PoissonSampler state was saved with a different key; construct the sampler "
                "with the saved key (opake_compile.random.key_from_state(state['key']))."
            )
        epoch = state["epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise CheckpointError(f"Invalid epoch {epoch!r} in PoissonSampler state.")
        handed_out = state.get("draws_handed_out", 0)
        if isinstance(handed_out, bool) or not isinstance(handed_out, int) or handed_out < 0:
            raise CheckpointError(f"Invalid draws_handed_out {handed_out!r} in PoissonSampler state.")
        position = state.get("position", 0)
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= self._steps:
            raise CheckpointError(f"Invalid position {position!r} in PoissonSampler state (steps={self._steps}).")
        history = state.get("history", "[]")  # absent in states saved before it was kept
        try:
            history = json.loads(history)
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"Invalid history in PoissonSampler state: {err}") from err
        if not isinstance(history, list) or not all(
            isinstance(run, list) and len(run) == 4
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in run)
            and run[3] > 0 and run[1] + run[3] <= self._steps and run[2] + run[3] <= handed_out
            for run in history
        ):
            raise CheckpointError("Invalid history in PoissonSampler state (runs [epoch, step, seq, count]).")
        if "history" in state and sum(run[3] for run in history) != handed_out:
            # Every draw handed out is recorded (an emptied history handed released positions
            # out again as new draws: review).
            raise CheckpointError(
                f"PoissonSampler state: its history records {sum(run[3] for run in history)} draw(s) but it "
                f"handed out {handed_out}."
            )
        charged_at_save = state.get("draws_charged", 0)  # absent in states saved before it was kept
        if isinstance(charged_at_save, bool) or not isinstance(charged_at_save, int) or not 0 <= charged_at_save <= handed_out:
            raise CheckpointError(f"Invalid draws_charged {charged_at_save!r} in PoissonSampler state.")
        charged = _draws_charged_from_live(self)
        if handed_out < charged:
            raise CheckpointError(
                f"This state has handed out {handed_out} draw(s), but a live DPOptimizer has charged "
                f"{charged} of this sampler's: rewinding it would hand the released samples out again "
                "under new numbers, charged as new draws. Restore an earlier state into fresh "
                "objects (a new sampler and optimizer), both from the same checkpoint."
            )
        if charged and _runs_below(history, charged) != _runs_below(self._history, charged):
            raise CheckpointError(
                f"This state's record of which positions were handed out as this sampler's first "
                f"{charged} draw(s) differs from the sampler's, and a live DPOptimizer has charged "
                "them (a state of another sampler with the same key, or an edited one): loading it "
                "would forget positions already released and hand them out again as new draws. "
                "Restore into fresh objects (a new sampler and optimizer), both from the same checkpoint."
            )
        if position == self._steps:
            epoch, position = epoch + 1, 0
        self._epoch = epoch
        self._resume_at = position
        self._position = None
        self._loads += 1
        self._handed_out = handed_out
        self._charged_at_load = charged_at_save
        self._history = [list(run) for run in history]
        self._sizes, self._sizes_from = array.array("q"), handed_out

    def __repr__(self) -> str:
        return (
            f"PoissonSampler(dataset_size={self._dataset_size}, sample_rate={self._sample_rate}, "
            f"truncated_batch_size={self._truncated_batch_size}, steps={self._steps}, "
            f"key={self._key!r})"
        )


def _runs_below(history: list, upto: int) -> list[list[int]]:
    """The runs ``[epoch, step, seq, count]`` of ``history`` cut to the draws numbered below
    ``upto``, in draw order, adjacent runs merged (one canonical form per record)."""
    out: list[list[int]] = []
    for epoch, step, seq, count in sorted(history, key=lambda run: run[2]):
        count = min(count, upto - seq)
        if count <= 0:
            continue
        last = out[-1] if out else None
        if last is not None and last[0] == epoch and last[1] + last[3] == step and last[2] + last[3] == seq:
            last[3] += count
        else:
            out.append([epoch, step, seq, count])
    return out


class _DrawItems(list):
    """The items of one draw, as a dataset wrapper hands them to the collate function."""

    __slots__ = ("draw_id",)

    def __init__(self, items: list[Any], draw_id: DrawId | None) -> None:
        super().__init__(items)
        self.draw_id = draw_id


class _DrawDataset(torch.utils.data.Dataset):
    """Wraps a map-style dataset so that a batch fetch keeps the draw's identity."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: Any) -> _DrawItems:
        # DataLoader calls this with the batch sampler's element (here a Draw, pickled to the
        # worker with its id) and passes the result to collate_fn.
        return _DrawItems([self.dataset[i] for i in indices], getattr(indices, "id", None))


class _CollateWithDraw:
    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: Any) -> tuple[Any, DrawId | None]:
        return self.collate_fn(list(items)), getattr(items, "draw_id", None)


def draw_loader(
    dataset: Any, sampler: PoissonSampler, *, collate_fn: Any = None, **loader_kwargs: Any
) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` over ``sampler``'s draws that yields ``(batch, draw_id)``.

    How the draw travels: the loader is ``DataLoader(wrapped, batch_sampler=sampler,
    collate_fn=wrapped_collate, **loader_kwargs)``. The batch sampler hands each :class:`Draw`
    (indices and :class:`DrawId`) to the dataset wrapper's ``__getitems__`` (in a worker when
    ``num_workers > 0``; the id is pickled with the indices), which passes the id on to the
    collate wrapper, which returns ``(collate_fn(items), draw_id)``. Workers prefetch draws
    before the steps that use them; because each batch names its own draw,
    ``optimizer.step(clipped, draw=draw_id)`` charges exactly the draws up to that one and the
    prefetched ones only when their steps come (or when a later draw is stepped on).

    Args:
        dataset: a map-style dataset of length ``sampler.dataset_size``.
        sampler: the :class:`PoissonSampler` the optimizer reads q and N from.
        collate_fn: collates a list of items; default ``empty_collate(default_collate)``
            (Poisson batches can be empty).
        **loader_kwargs: passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ...); not
            ``batch_size``, ``shuffle``, ``sampler`` or ``batch_sampler``.

    Raises:
        InputTypeError: ``sampler`` is not a :class:`PoissonSampler`.
        ConfigurationError: a conflicting ``DataLoader`` argument.

    Example::

        >>> import torch
        >>> from torch.utils.data import TensorDataset
        >>> from opake_compile import random as oprandom
        >>> ds = TensorDataset(torch.randn(50, 3))
        >>> sampler = PoissonSampler(50, 0.1, key=oprandom.key(0))
        >>> (x,), draw_id = next(iter(draw_loader(ds, sampler)))
        >>> draw_id.seq
        0
    """
    if not isinstance(sampler, PoissonSampler):
        raise InputTypeError(f"Expected a PoissonSampler, got {type(sampler).__name__}.")
    clash = sorted({"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"} & set(loader_kwargs))
    if clash:
        raise ConfigurationError(f"draw_loader sets the batching itself; drop {clash}.")
    if collate_fn is None:
        from torch.utils.data import default_collate

        from opake_compile.functional import empty_collate

        collate_fn = empty_collate(default_collate)
    return torch.utils.data.DataLoader(
        _DrawDataset(dataset), batch_sampler=sampler, collate_fn=_CollateWithDraw(collate_fn), **loader_kwargs
    )


# ----------------------------------------------------------------------------- DP-FTRL samplers
class _SchemeSampler(PoissonSampler):
    """Shared machinery (draw ids, epochs, checkpoints) of the samplers of other schemes.

    ``is_poisson`` is ``False``: ``DPOptimizer`` with its default Gaussian noise refuses them;
    a noise mechanism that declares the scheme (``sampling``) accepts them.
    """

    is_poisson = False
    sampling = "none"

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _scheme_state(self) -> dict[str, Any]:
        return {**super()._scheme_state(), "sampling": self.sampling, **self._extra_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise CheckpointError(f"Expected a dict state, got {type(state).__name__}.")
        for name, value in {"sampling": self.sampling, **self._extra_state()}.items():
            if state.get(name) != value:
                raise CheckpointError(
                    f"{type(self).__name__} state has {name}={state.get(name)!r}, this sampler {value!r}."
                )
        super().load_state_dict(state)

    def _global_step(self, epoch: int, step: int) -> int:
        return epoch * self._steps + step

    def _draw(self, epoch_key: oprandom.Key, step: int, epoch: int) -> Draw:
        self._current_epoch = epoch  # _batch gets the epoch key only; the cyclic scheme needs the epoch
        return super()._draw(epoch_key, step, epoch)


class CyclicPoissonSampler(_SchemeSampler):
    """Cyclic Poisson sampling over ``bands`` fixed groups (amplified BandMF).

    Every index ``i`` belongs to group ``h(key, i) mod bands`` for a 64-bit hash ``h``
    (splitmix64 of the key's seed and ``i``): an example's group depends only on the key and
    its own index, not on ``N`` or on the other examples, so adding or removing an example (the
    last index, or with stable indices) moves no other example between groups, as the
    add-or-remove analysis needs (group sizes are then multinomial, about ``N / bands``). At
    global step ``T`` (``epoch * steps + step``), every index of
    group ``T mod bands`` joins the batch independently with probability ``sample_rate``;
    the other groups sit out. So an example takes part only in steps ``bands`` apart, which is
    what amplifies BandMF with at most ``bands`` bands (Choquette-Choo et al. 2023;
    accounted by :func:`opake_compile.accounting.mf_poisson`). ``bands=1`` is plain Poisson.

    Divisor: ``expected_batch_size = sample_rate * N / bands`` (the optimizer divides the
    noised sum by it, never by the realised size; it is the expectation over the hash too).

    Args:
        dataset_size: N >= bands.
        sample_rate: q in [0, 1], the rate within the group of the step.
        bands: the number of groups, >= 1.
        key: the sampler's key (partition and draws).
        steps: batches per epoch; default ``bands * max(1, round(1/q))`` (each example once
            per epoch in expectation).

    Raises:
        InputTypeError, ConfigurationError: as :class:`PoissonSampler`; ``bands > N``.
    """

    sampling = "cyclic_poisson"

    def __init__(self, dataset_size: int, sample_rate: float, bands: int, key: oprandom.Key, *, steps: int | None = None) -> None:
        bands = check_positive_int(bands, name="bands")
        q = check_probability(sample_rate, name="sample_rate")
        if steps is None and q > 0:
            steps = bands * max(1, round(1.0 / q))
        super().__init__(dataset_size, q, key=key, steps=steps)
        if bands > self._dataset_size:
            raise ConfigurationError(f"Expected bands={bands} <= dataset_size={self._dataset_size}.")
        self._bands = bands
        self._group = torch.from_numpy(_hash_groups(key, self._dataset_size, bands))

    @property
    def bands(self) -> int:
        """The number of groups."""
        return self._bands

    @property
    def expected_batch_size(self) -> float:
        """``q * N / bands``."""
        return self._sample_rate * self._dataset_size / self._bands

    def group_of(self, index: int) -> int:
        """The group of example ``index`` (public: it depends only on the key and N)."""
        return int(self._group[index])

    def _extra_state(self) -> dict[str, Any]:
        return {"bands": self._bands}

    def _batch(self, epoch_key: oprandom.Key, step: int) -> list[int]:
        group = self._global_step(self._current_epoch, step) % self._bands
        g = oprandom.generator_from_key(oprandom.fold_in(epoch_key, step))
        mask = torch.rand(self._dataset_size, generator=g, dtype=torch.float64) < self._sample_rate
        return (mask & (self._group == group)).nonzero().flatten().tolist()

    def __repr__(self) -> str:
        return (
            f"CyclicPoissonSampler(dataset_size={self._dataset_size}, sample_rate={self._sample_rate}, "
            f"bands={self._bands}, steps={self._steps}, key={self._key!r})"
        )


def _hash_groups(key: oprandom.Key, n: int, bands: int) -> Any:
    """``splitmix64(seed + (i + 1) * golden) mod bands`` for ``i < n`` (numpy int64)."""
    import numpy as np

    seed = np.uint64(oprandom.generator_from_key(oprandom.fold_in(key, 2**62)).initial_seed() & (2**64 - 1))
    with np.errstate(over="ignore"):
        x = seed + (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(bands)).astype(np.int64)


class SequentialBatchSampler(_SchemeSampler):
    """Deterministic batches: the same fixed partition into ``steps`` batches every epoch.

    A permutation drawn once from ``key`` (data independent) is cut into ``steps =
    N // batch_size`` consecutive batches of exactly ``batch_size`` indices; the last
    ``N mod batch_size`` indices of the permutation are never used. Every epoch repeats the
    same batches in the same order, so each example takes part at most once per epoch and its
    participations are exactly ``steps`` apart: the ``(k, b)``-min-separation pattern with
    ``b = steps`` that :func:`opake_compile.accounting.mf_gaussian` accounts for (no
    amplification). Used with BLT, BISR, lambda-CGD.

    Neighbouring datasets: the positions come from a permutation of all ``N`` indices, so the
    guarantee is for datasets that differ in one example's *content* with the slots fixed
    (the zero-out relation of DP-FTRL, Kairouz et al. 2021: the example's gradient replaced
    by zero), not for adding or removing an example, which would move others between batches.

    Divisor: ``expected_batch_size = batch_size`` (every batch has exactly that size).

    Args:
        dataset_size: N >= batch_size.
        batch_size: indices per batch, >= 1.
        key: the key of the one permutation.
    """

    sampling = "fixed"

    def __init__(self, dataset_size: int, batch_size: int, key: oprandom.Key) -> None:
        n = check_positive_int(dataset_size, name="dataset_size")
        b = check_positive_int(batch_size, name="batch_size")
        if b > n:
            raise ConfigurationError(f"Expected batch_size={b} <= dataset_size={n}.")
        super().__init__(n, b / n, key=key, steps=n // b)
        self._batch_size = b
        g = oprandom.generator_from_key(oprandom.fold_in(key, 2**62))
        self._perm = torch.randperm(n, generator=g)

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def expected_batch_size(self) -> float:
        """``batch_size`` (exact)."""
        return float(self._batch_size)

    def _extra_state(self) -> dict[str, Any]:
        return {"batch_size": self._batch_size}

    def _batch(self, epoch_key: oprandom.Key, step: int) -> list[int]:
        idx = self._perm[step * self._batch_size : (step + 1) * self._batch_size]
        return idx.sort().values.tolist()

    def __repr__(self) -> str:
        return f"SequentialBatchSampler(dataset_size={self._dataset_size}, batch_size={self._batch_size}, key={self._key!r})"


class BallsInBinsSampler(_SchemeSampler):
    """Balls-in-bins: each epoch, every example lands in exactly one of ``steps`` batches,
    chosen uniformly at random and independently (Chua et al. 2024, "Balls-and-bins sampling
    for DP-SGD").

    Batch sizes are Binomial(N, 1/steps) and can be empty (use ``empty_collate``). Divisor:
    ``expected_batch_size = N / steps``. The bins are drawn anew every epoch, so an example
    takes part once per epoch, possibly in the last step of one epoch and the first of the
    next: :func:`opake_compile.accounting.balls_in_bins` charges that pattern's sensitivity
    (:meth:`~opake_compile.dpftrl.Strategy.epoch_sensitivity`) without amplification; the
    amplified analyses are Monte Carlo only and are not built. ``DPOptimizer`` takes it with
    ``noise=mf_gaussian_noise(...)`` (the identity strategy for independent noise).

    Args:
        dataset_size: N >= 1.
        steps: batches per epoch, >= 1.
        key: the sampler's key.
    """

    sampling = "balls_in_bins"

    def __init__(self, dataset_size: int, steps: int, key: oprandom.Key) -> None:
        steps = check_positive_int(steps, name="steps")
        super().__init__(dataset_size, 1.0 / steps, key=key, steps=steps)

    @property
    def expected_batch_size(self) -> float:
        """``N / steps``."""
        return self._dataset_size / self._steps

    def _batch(self, epoch_key: oprandom.Key, step: int) -> list[int]:
        g = oprandom.generator_from_key(epoch_key)
        bins = torch.randint(self._steps, (self._dataset_size,), generator=g)
        return (bins == step).nonzero().flatten().tolist()

    def __repr__(self) -> str:
        return f"BallsInBinsSampler(dataset_size={self._dataset_size}, steps={self._steps}, key={self._key!r})"


class BMinSepSampler(_SchemeSampler):
    """Warm-start b-min-separation sampling (Dong & Ganesh 2026, "Privacy amplification for
    BandMF via b-min-sep subsampling", Alg. 2; JAX-Privacy's ``BMinSepSampling``).

    At global step ``T`` (``epoch * steps + step``) every example that took part in none of
    the previous ``b - 1`` steps joins the batch independently with probability
    ``sample_rate``; the others sit out. So any two participations of an example are at least
    ``b = min_separation`` steps apart, and in ``T`` steps it takes part at most
    ``ceil(T / b)`` times: the ``(k, b)``-min-separation pattern that
    :func:`opake_compile.accounting.b_min_sep` charges (without amplification).
    ``min_separation=1`` is plain Poisson sampling; ``sample_rate=1`` makes every example take
    part exactly every ``b`` steps from a random offset.

    Warm start: before step 0 each example is, independently, "recently sampled" with
    probability ``(b - 1) q / (1 + (b - 1) q)``, at a step ``-1 .. -(b - 1)`` chosen uniformly;
    that is the stationary law of the per-example chain, so every step has the same expected
    batch size. These virtual steps release nothing.

    Divisor: ``expected_batch_size = N q / (1 + (b - 1) q)`` (exact at every step, by the warm
    start).

    State: the batch of step ``T`` depends on the batches before it; this sampler keeps each
    example's last step and rebuilds it by replaying the draws from step 0 (``O(T N)``) when a
    step is asked out of order (``batch_at`` of an earlier step, a restored checkpoint). The
    checkpoint stores no history, so a restored sampler cannot break the separation.

    Args:
        dataset_size: N >= 1.
        sample_rate: q in (0, 1], the rate among the eligible examples.
        min_separation: b >= 1.
        key: the sampler's key (warm start and draws).
        steps: batches per epoch; default ``max(1, round(b - 1 + 1 / q))``, the mean gap
            between two participations (each example about once per epoch).

    Raises:
        InputTypeError, ConfigurationError: as :class:`PoissonSampler`; ``sample_rate = 0``.
    """

    sampling = "b_min_sep"

    def __init__(
        self, dataset_size: int, sample_rate: float, min_separation: int, key: oprandom.Key, *, steps: int | None = None
    ) -> None:
        b = check_positive_int(min_separation, name="min_separation")
        q = check_probability(sample_rate, name="sample_rate")
        if q == 0.0:
            raise ConfigurationError("BMinSepSampler needs sample_rate > 0.")
        if steps is None:
            steps = max(1, round(b - 1 + 1.0 / q))
        super().__init__(dataset_size, q, key=key, steps=steps)
        self._b = b
        self._last: torch.Tensor | None = None  # last participation step of each example
        self._next = 0  # the global step whose batch _last has not taken in yet
        self._cached: tuple[int, list[int]] | None = None

    @property
    def min_separation(self) -> int:
        """b, the fewest steps between two participations of an example."""
        return self._b

    @property
    def expected_batch_size(self) -> float:
        """``N q / (1 + (b - 1) q)``."""
        q = self._sample_rate
        return self._dataset_size * q / (1.0 + (self._b - 1) * q)

    def _extra_state(self) -> dict[str, Any]:
        return {"min_separation": self._b}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._last, self._next, self._cached = None, 0, None

    def _warm_start(self) -> torch.Tensor:
        n, b, q = self._dataset_size, self._b, self._sample_rate
        last = torch.full((n,), -b, dtype=torch.int64)
        if b > 1:
            # Two streams, so that example i's warm start reads the i-th value of each whatever
            # N is: with one, adding an example shifted every other example's age (its
            # ``randint`` started after N + 1 uniforms), and the charge held for zero-out
            # neighbours only (review).
            g = oprandom.generator_from_key(oprandom.fold_in(self._key, 2**62))
            recent = torch.rand(n, generator=g, dtype=torch.float64) < (b - 1) * q / (1.0 + (b - 1) * q)
            g_ago = oprandom.generator_from_key(oprandom.fold_in(self._key, 2**62 + 1))
            ago = torch.randint(1, b, (n,), generator=g_ago)
            last = torch.where(recent, -ago, last)
        return last

    def _advance(self) -> list[int]:
        """The batch of global step ``self._next``; records it in ``_last``."""
        t = self._next
        epoch, step = divmod(t, self._steps)
        g = oprandom.generator_from_key(oprandom.fold_in(oprandom.fold_in(self._key, epoch), step))
        mask = torch.rand(self._dataset_size, generator=g, dtype=torch.float64) < self._sample_rate
        mask &= self._last <= t - self._b
        self._last[mask] = t
        self._next = t + 1
        batch = mask.nonzero().flatten().tolist()
        self._cached = (t, batch)
        return batch

    def _batch(self, epoch_key: oprandom.Key, step: int) -> list[int]:
        t = self._global_step(self._current_epoch, step)
        if self._cached is not None and self._cached[0] == t:
            return list(self._cached[1])
        if self._last is None or t < self._next:
            self._last, self._next = self._warm_start(), 0  # replay from the start
        while self._next < t:
            self._advance()
        return self._advance()

    def __repr__(self) -> str:
        return (
            f"BMinSepSampler(dataset_size={self._dataset_size}, sample_rate={self._sample_rate}, "
            f"min_separation={self._b}, steps={self._steps}, key={self._key!r})"
        )
