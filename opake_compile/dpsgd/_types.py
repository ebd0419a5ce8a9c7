"""Typed results of the DP pipeline: ``ClippedPytree`` and ``NoisedPytree``.

Both are frozen dataclasses deriving from :class:`~opake_compile._markers.DPOutput` and are
deliberately *not* registered as pytree nodes: the pytree helpers refuse them, so a clipped or
noised result cannot be fed back into pytree maths (re-clipped, re-normed) by accident.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping
from typing import Any

import optree
import torch

from opake_compile._markers import DPOutput
from opake_compile.exceptions import ConfigurationError

__all__ = ["ClippedPytree", "NoisedPytree", "ReleaseReceipt"]


class ReleaseReceipt:
    """Whether a value derived from a sample outside its :class:`ClippedPytree` (adaptive
    clipping's next clipping norm, computed from a noisy count) has been released with the
    sum: set when the sum is released (``DPOptimizer.step``, ``gaussian_noise``), so that the
    accountant charged the count with it (or, on the eager path, the caller's accounting of
    ``clipped.releases`` covers it).

    A state carrying such a value is *pending* until then: the next call that would use it
    refuses it (:func:`~opake_compile.dpsgd.clipping.adaptive_clipped_grad`), since the
    training run would otherwise depend on a release no accountant saw (a step that was refused
    or never taken).

    Results computed from one state (a retry after a refused step) draw the same count noise:
    once one of them is released, the others are *superseded* (their release is refused, and
    so are their states): two of them released would give the difference of two counts
    without noise. ``release`` is the count's privacy process, which the result must still
    carry when it is released.
    """

    __slots__ = ("released", "superseded", "release", "_state", "_parent", "_book")

    def __init__(self, book: ReceiptBook, parent: Any, state: tuple[Any, float], release: Any) -> None:
        self.released = False
        self.superseded = False
        self.release = release
        self._state, self._parent, self._book = state, parent, book
        book.pending[state] = self
        book.children.setdefault(parent, []).append(self)

    def __repr__(self) -> str:
        return f"ReleaseReceipt(released={self.released}, superseded={self.superseded})"


class ReceiptBook:
    """The receipts of one adaptive clipping function (one book per function: runs seeded
    alike do not wait on each other).

    ``pending``: ``(key, clipping_norm)`` of a state returned with a result not released yet
    -> its receipt. ``children``: a state's key -> the receipts of the results computed from
    it (until one is released). ``used``: the hashes of the keys of states one of whose
    results was released (a further call with such a state would draw the same count noise
    again; a hash, about 70 bytes a step, since this set grows by one per step).
    ``claimed``: a key -> the clipping norm of the first state a call returned a result for
    (results computed from one state in parts, then accumulated, return states of one key and
    different norms, each from a count with the same noise: only one of them may carry the run
    on); dropped once that key is used."""

    def __init__(self) -> None:
        self.pending: dict[tuple[Any, float], ReleaseReceipt] = {}
        self.children: dict[Any, list[ReleaseReceipt]] = {}
        self.used: set[int] = set()
        self.claimed: dict[Any, float] = {}

    def refusal(self, key: Any, clipping_norm: float) -> str | None:
        """Why a state ``(key, clipping_norm)`` may not be used now, or None."""
        if (key, clipping_norm) in self.pending:
            return "pending"
        if hash(key) in self.used:
            return "used"
        if self.claimed.get(key, clipping_norm) != clipping_norm:
            return "claimed"
        return None

    def claim(self, key: Any, clipping_norm: float) -> None:
        """Record that a call with ``(key, clipping_norm)`` returned a result (a call that
        raised claims nothing)."""
        self.claimed.setdefault(key, clipping_norm)


def pending_receipt(book: ReceiptBook, key: Any, clipping_norm: float) -> ReleaseReceipt | None:
    """The unreleased receipt that the state ``(key, clipping_norm)`` waits for, or None."""
    return book.pending.get((key, clipping_norm))


def check_releasable(clipped: "ClippedPytree") -> None:
    """Refuse to release ``clipped`` if one of its receipts was released already (a copy of a
    released result), was superseded (a result computed from the same state as one released:
    the same count noise), or lost the release it stands for (``clipped.releases`` must still
    hold the count's process: a result rebuilt around copies of the sums could drop it)."""
    for r in clipped.receipts:
        problem = None
        if r.released:
            problem = "its adaptive clipping count was already released with another result"
        elif r.superseded:
            problem = (
                "another result computed from the same AdaptiveClipState was released: both counts "
                "carry the same noise draw, so releasing both would reveal their difference without noise"
            )
        elif not any(x is r.release for x in clipped.releases):
            problem = (
                f"it carries adaptive clipping's receipt but not the count's release {r.release!r} "
                "(dropped from releases): the count would go uncharged"
            )
        if problem is not None:
            raise ConfigurationError(
                f"This ClippedPytree cannot be released: {problem}. Nothing was charged or changed."
            )


def mark_released(clipped: "ClippedPytree") -> None:
    """Record that ``clipped`` (and what its receipts stand for) has been released: its states
    may be used; results from the same states that were not released with it are superseded."""
    mine = {id(r) for r in clipped.receipts}
    for r in clipped.receipts:
        r.released = True
        book = r._book
        book.pending.pop(r._state, None)  # (an equal state of a sibling says the same)
        book.used.add(hash(r._parent))
        book.claimed.pop(r._parent, None)  # (refused as used from now on)
        for sibling in book.children.pop(r._parent, ()):
            if id(sibling) not in mine:
                sibling.superseded = True


# ------------------------------------------------------------ released sums (by tensor identity)
#: The clipped sums released (by a ``DPOptimizer`` step or ``gaussian_noise``), by the identity
#: of their gradient tensors (``id -> weakref``): releasing one again is a second noisy view of
#: the same sample, which no per-draw charge covers (``poisson(g | g, q)``, not two Poisson steps).
_RELEASED: dict[int, weakref.ref] = {}
#: The gradient tensors of the sums a sum was made from (``accumulate``'s parts, the local sum
#: of ``sum_gradients``), released with it.
SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _was_released(t: Any) -> bool:
    ref = _RELEASED.get(id(t))
    return ref is not None and ref() is t


def sum_tensors(clipped: "ClippedPytree") -> list[Any]:
    """The gradient tensors of ``clipped`` and of the sums it was made from."""
    return _tensors(clipped.grads) + list(SOURCES.get(clipped, ()))


def check_not_released(clipped: "ClippedPytree", what: str) -> None:
    """Refuse ``clipped`` if it, or a sum it was made from, was released before, or if one of
    its sums was changed in place since it was made (:func:`check_unchanged`)."""
    if any(_was_released(t) for t in sum_tensors(clipped)):
        raise ConfigurationError(
            f"{what} was already released (by a DPOptimizer step or gaussian_noise): a second noisy "
            "release of the same clipped sum is two views of one sample, not a new Poisson step. "
            "Compute a new clipped sum on a new draw."
        )
    check_unchanged(clipped, what)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter
        return None


def check_unchanged(clipped: "ClippedPytree", what: str) -> None:
    """Refuse ``clipped`` if one of its sum tensors was changed in place (``mul_``, ``add_``,
    an indexed assignment) after the first ``ClippedPytree`` built around it sealed it: the
    noise is calibrated to the clipping norm of the sum as it was made, and a sum scaled by
    10^4 in place reached the parameters with noise for C (a newcomer's review)."""
    named = _named_tensors(clipped.grads)
    built = clipped.__dict__.get(_SUMS)
    if built is not None and (len(built) != len(named) or any(a is not b for a, (_, b) in zip(built, named))):
        raise ConfigurationError(
            f"{what}: its grads were edited after it was made (an entry replaced, added or "
            "removed): the noise is calibrated to the sums the library made. Compute a new clipped "
            "sum; to transform the update, wrap the optimizer or edit the parameters after the step."
        )
    for name, t in named:
        sealed = t.__dict__.get(_SEALED)
        if sealed is not None and _version(t) != sealed:
            raise ConfigurationError(
                f"{what}: its sum {name!r} was changed in place after it was made, or is a copy of "
                f"such a sum (deepcopy, pickle, torch.load) (version {sealed} -> {_version(t)}): the noise "
                "is calibrated to the clipping norm of the sum as made, and a copy could be released "
                "next to the original. Compute a new clipped sum; to transform the update, wrap the "
                "optimizer or edit the parameters after the step."
            )


def reseal(clipped: "ClippedPytree") -> None:
    """Record the current version of ``clipped``'s sums (after the library itself has changed
    them in place: ``sum_gradients_``)."""
    for t in _tensors(clipped.grads):
        t.__dict__[_SEALED] = _version(t)


def mark_sum_released(clipped: "ClippedPytree") -> None:
    """Record that ``clipped``'s sums (and the sums it was made from) were released."""
    for t in sum_tensors(clipped):
        key = id(t)

        def forget(ref: weakref.ref, key: int = key) -> None:
            if _RELEASED.get(key) is ref:
                del _RELEASED[key]

        _RELEASED[key] = weakref.ref(t, forget)


def check_release(clipped: "ClippedPytree") -> None:
    """Refuse to release ``clipped`` (a DPOptimizer step, ``gaussian_noise``, the correlated
    noise of ``mf_gaussian_noise``) unless it is releasable: not released before, in whole or
    in part (:func:`check_not_released`), and its receipts releasable (:func:`check_releasable`)."""
    check_not_released(clipped, "This clipped sum")
    check_releasable(clipped)


def record_release(clipped: "ClippedPytree") -> None:
    """Record that ``clipped`` was released: its sums, the sums it was made from, and its
    receipts (adaptive clipping's next norm may be used from now on)."""
    mark_sum_released(clipped)
    mark_released(clipped)


@dataclasses.dataclass(frozen=True, eq=False)
class ClippedPytree(DPOutput):
    """The clipped sum of per-example gradients (or of any per-example outputs).

    Attributes:
        grads: the **unnormalised sum** over the real examples of the per-example gradients,
            each clipped to L2 norm ``clipping_norm`` over all its leaves together. For
            ``compile_dp`` a dict keyed like ``named_parameters()`` of the trainable partition;
            for the eager ``clipped_grad`` the structure of the differentiated argument. When
            ``normalize_by`` is set, the sum has been divided by it (eager convenience only).
        clipping_norm: C as a Python float (L2 norm, gradient units). The sensitivity of the
            sum to adding or removing one example is C.
        per_example_norms: **not privatised.** Shape ``(batch,)``: each example's global L2
            norm before clipping (padded positions of a compiled step are excluded).
        num_examples: **not privatised.** The realised number of real examples summed.
        normalize_by: the divisor applied to ``grads`` or ``None`` (the optimizer wrapper
            refuses a normalised input).
        num_nonfinite: **not privatised.** How many examples had a non-finite gradient and so
            contributed exactly zero (selected away, never multiplied by zero). A compiled step
            counts here, too, examples whose entries reached twice the magnitude their norm can
            be computed at (``compiler.passes.numerics.magnitude_limit``; they are weighted down
            from once it).
        aux: **not privatised.** Per-example auxiliary outputs (``has_aux=True``) or ``None``.
        num_ranks: how many processes' clipped sums ``grads`` adds up (1, or the world size after
            :func:`opake_compile.distributed.sum_gradients`); ``DPOptimizer`` refuses a local
            sum inside a multi-process group.
        parameters: the tensors ``grads`` belong to, keyed like ``grads`` (set by
            ``compile_dp`` and by ``clipped_grad`` on a dict of parameters), so that
            ``DPOptimizer`` maps gradients to parameters without trusting an ordering.
        releases: the *other* private releases computed from the same sample, as privacy
            processes of one application with sensitivity-normalised noise (e.g.
            ``(accounting.gaussian(count_noise_multiplier),)`` for the noisy count of
            :func:`~opake_compile.dpsgd.clipping.adaptive_clipped_grad`). ``DPOptimizer``
            charges them together with the gradient query on the same Poisson sample, and
            refuses a release it cannot account for. Attach a private metric of your own with
            ``dataclasses.replace(clipped, releases=clipped.releases + (acc.gaussian(s),))``.
        draw: the :class:`~opake_compile.sampling.DrawId` of the Poisson draw the examples came
            from, or ``None`` (unknown). ``accumulate`` refuses parts of different draws.
        receipts: :class:`ReleaseReceipt` objects of values computed from this sample that
            left in a state rather than in this result (adaptive clipping's next clipping
            norm); marked when the sum is released, and carried by ``accumulate`` and
            ``sum_gradients``.
    """

    grads: Any
    clipping_norm: float
    per_example_norms: torch.Tensor
    num_examples: int
    normalize_by: float | None = None
    num_nonfinite: int = 0
    aux: Any = None
    num_ranks: int = 1
    parameters: Mapping[str, torch.Tensor] | None = dataclasses.field(default=None, repr=False)
    releases: tuple[Any, ...] = ()
    draw: Any = None
    receipts: tuple[ReleaseReceipt, ...] = dataclasses.field(default=(), repr=False)

    def __post_init__(self) -> None:
        # ``dataclasses.replace`` builds a new result around the same sum tensors (the README's
        # way to attach a release). What the sums were made with stays theirs, recorded on each
        # sum tensor: a smaller ``clipping_norm`` would calibrate the noise below one example's
        # contribution, a ``normalize_by`` set on an unnormalised sum would divide the noise
        # alone (gaussian_noise adds ``z / n`` to a sum taken as already divided), and dropping
        # a release, a receipt or the draw would leave something made from the sample
        # uncharged. Releases may only be added.
        marks = (self.clipping_norm, self.normalize_by, tuple(self.releases), tuple(self.receipts), self.draw,
                 self.num_ranks, self.num_examples)
        fresh, made, origins = [], [], set()
        for name, t in _named_tensors(self.grads):
            held = t.__dict__.get(_MADE)
            if held is None:
                fresh.append(t)
                continue
            made.append(name)
            origins.add(id(t.__dict__.get(_ORIGIN)))
            if held != marks:
                self._check_made_with(held)  # (the same fields pass without the detailed test)
        if fresh and made:
            # A sum that is partly the library's and partly new tensors (a replace that swaps
            # one entry): the new entries would be released with noise calibrated to the
            # library's clipping, and the rest carries its marks. A sum wholly of new tensors is
            # the caller's own, taken at its word (the eager API's contract).
            raise ConfigurationError(
                f"This ClippedPytree mixes sums the library made ({', '.join(map(repr, made[:3]))}"
                f"{', ...' if len(made) > 3 else ''}) with {len(fresh)} new tensor(s): the noise is "
                "calibrated to the sums the library made. Compute a new clipped sum; to transform the "
                "update, wrap the optimizer or edit the parameters after the step."
            )
        if len(origins) > 1:
            # Sums of two results (two batches) under one result, charged as one draw (review).
            raise ConfigurationError(
                "This ClippedPytree puts together sums of different results (made by different calls): "
                "one result is one batch, charged as one draw. Pass the parts to accumulate (or "
                "DPOptimizer.step([...])), which checks their draws and sizes."
            )
        # The sum tensors themselves, so that an entry of ``grads`` swapped later (the dict stays
        # mutable) is seen by check_unchanged.
        object.__setattr__(self, _SUMS, tuple(_tensors(self.grads)))
        if fresh:
            origin = object()  # (one per result: its sums belong together)
            for t in fresh:
                t.__dict__[_MADE] = marks
                t.__dict__[_ORIGIN] = origin
                t.__dict__[_SEALED] = _version(t)

    def _check_made_with(self, held: tuple) -> None:
        c0, nb0, rel0, rec0, draw0, ranks0, n0 = _seven(held)
        c, nb = self.clipping_norm, self.normalize_by
        problem = None
        if _is_number(c) and _is_number(c0) and c < c0:
            problem = f"clipping_norm={c!r} below the {c0!r} the sums were clipped with (it may only be raised)"
        elif nb != nb0:
            problem = f"normalize_by={nb!r}, not the {nb0!r} the sums were made with"
        elif tuple(self.releases[: len(rel0)]) != rel0 or tuple(self.receipts[: len(rec0)]) != rec0:
            problem = f"releases {self.releases!r} that drop some of {rel0!r} (releases may only be added)"
        elif draw0 is not None and self.draw != draw0:
            problem = f"draw={self.draw!r}, not the {draw0!r} the sums came from"
        elif self.num_ranks != ranks0:
            # Only sum_gradients sets it (mark_ranks): a local sum relabelled as the global one
            # would be stepped on every rank with the shared noise, and the ranks' models would
            # then differ by their local sums, without noise.
            problem = (f"num_ranks={self.num_ranks!r}, not the {ranks0!r} the sums were made by "
                       "(opake_compile.distributed.sum_gradients sets it)")
        elif n0 is not None and self.num_examples != n0:
            # The draw-size check (a sum of more examples than its draw holds is refused) reads
            # it: a lowered count let a sum of two draws be charged as one (a newcomer's review).
            problem = f"num_examples={self.num_examples!r}, not the {n0!r} the sums hold"
        if problem is not None:
            raise ConfigurationError(
                f"This ClippedPytree is built around sums made earlier, with {problem}: the noise "
                "and the accounting read these fields, so they must say how the sums were made."
            )

    @property
    def batch_size(self) -> int:
        """Alias of :attr:`num_examples` (the realised, non-private batch size)."""
        return self.num_examples


# The attribute each sum tensor carries: (clipping_norm, normalize_by, releases, receipts, draw, num_ranks,
# num_examples)
# of the first ClippedPytree built around it (see ClippedPytree.__post_init__). On the tensor,
# so that it lives exactly as long as the sum; a clone is a new sum.
_MADE = "_opake_made_with"
# A token shared by the sum tensors of one result (see ClippedPytree.__post_init__).
_ORIGIN = "_opake_origin"
# The version counter of each sum tensor when it was made (see check_unchanged).
_SEALED = "_opake_sealed_version"
# On each ClippedPytree: the sum tensors it was built with (see check_unchanged).
_SUMS = "_opake_sums"


def lock_releases(clipped: ClippedPytree) -> None:
    """Make ``clipped``'s releases and receipts part of its sums: a copy built around any of
    them may no longer drop them (for releases the library attaches, such as adaptive
    clipping's count; a caller's own additions stay optional, so that a refused attempt can be
    retried)."""
    for t in _tensors(clipped.grads):
        c0, nb0, _, _, draw0, ranks0, n0 = _seven(t.__dict__[_MADE])
        t.__dict__[_MADE] = (c0, nb0, tuple(clipped.releases), tuple(clipped.receipts), draw0, ranks0, n0)


def mark_ranks(grads: Any, num_ranks: int, num_examples: int) -> None:
    """Record that the sum tensors of ``grads`` hold the sum of ``num_ranks`` processes over
    ``num_examples`` examples (the library's own cross-rank reduction, ``sum_gradients``; a
    ``dataclasses.replace`` that changes ``num_ranks`` or ``num_examples`` is refused
    otherwise)."""
    for t in _tensors(grads):
        held = t.__dict__.get(_MADE)
        if held is not None:
            t.__dict__[_MADE] = _seven(held)[:5] + (num_ranks, num_examples)


def _seven(held: tuple) -> tuple:
    """A sum tensor's marks as seven fields (tensors saved before the count was recorded
    carry six: their count reads as unknown)."""
    return tuple(held) + (None,) * (7 - len(held))


def _named_tensors(grads: Any) -> list[tuple[Any, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of ``grads``, nested dicts included (an eager
    ``clipped_grad`` on a nested dict of parameters: only the top level was read, so its nested
    sums were never marked); a nested tensor is named by its path, ``"enc/w"``."""
    if isinstance(grads, torch.Tensor):
        return [(0, grads)]
    if isinstance(grads, dict) and all(isinstance(v, torch.Tensor) for v in grads.values()):
        return list(grads.items())  # compile_dp's flat dict, without a tree walk
    paths, leaves, _ = optree.tree_flatten_with_path(grads, none_is_leaf=True)
    return [("/".join(map(str, p)), v) for p, v in zip(paths, leaves) if isinstance(v, torch.Tensor)]


def _tensors(grads: Any) -> list[torch.Tensor]:
    """Every tensor of ``grads`` (:func:`_named_tensors`)."""
    return [t for _, t in _named_tensors(grads)]


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True, eq=False)
class NoisedPytree(DPOutput):
    """A clipped sum with Gaussian noise added: a differentially private release.

    Attributes:
        grads: ``(sum of clipped gradients + N(0, (noise_multiplier * clipping_norm)^2))`` per
            entry, divided by ``normalize_by`` when set.
        clipping_norm: C, copied from the ``ClippedPytree``.
        noise_multiplier: sigma.
        noise_std: sigma * C, the standard deviation of the noise added to the *sum*.
        normalize_by: the divisor applied after adding noise, or ``None``.
    """

    grads: Any
    clipping_norm: float
    noise_multiplier: float
    noise_std: float
    normalize_by: float | None = None
