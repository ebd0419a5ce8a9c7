"""Typed results of the DP pipeline: ``ClippedPytree`` and ``NoisedPytree``.

Both are frozen dataclasses deriving from :class:`~opake_compile._markers.DPOutput` and are
deliberately *not* registered as pytree nodes: the pytree helpers refuse them, so a clipped or
noised result cannot be fed back into pytree maths (re-clipped, re-normed) by accident.
"""

from __future__ import annotations

import dataclasses
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
    """

    __slots__ = ("released", "_key", "_pending")

    def __init__(self, key: Any, pending: dict[Any, ReleaseReceipt]) -> None:
        self.released = False
        self._key, self._pending = key, pending
        pending[key] = self

    def __repr__(self) -> str:
        return f"ReleaseReceipt(released={self.released})"


def pending_receipt(pending: dict[Any, ReleaseReceipt], key: Any) -> ReleaseReceipt | None:
    """The unreleased receipt that a state with ``key`` waits for in ``pending`` (one map per
    adaptive clipping function: runs seeded alike do not wait on each other), or None."""
    r = pending.get(key)
    return None if r is None or r.released else r


def mark_released(clipped: "ClippedPytree") -> None:
    """Record that ``clipped`` (and what its receipts stand for) has been released."""
    for r in clipped.receipts:
        r.released = True
        if r._pending.get(r._key) is r:  # (an unreleased entry stays: its state is refused)
            del r._pending[r._key]


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
            contributed exactly zero (selected away, never multiplied by zero).
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
        fresh = []
        for t in _tensors(self.grads):
            held = t.__dict__.get(_MADE)
            if held is None:
                fresh.append(t)
            elif held[0] != self.clipping_norm or held[1:] != (self.normalize_by, self.releases, self.receipts, self.draw):
                self._check_made_with(held)  # (the same fields pass without the detailed test)
        if fresh:
            made = (self.clipping_norm, self.normalize_by, tuple(self.releases), tuple(self.receipts), self.draw)
            for t in fresh:
                t.__dict__[_MADE] = made

    def _check_made_with(self, held: tuple) -> None:
        c0, nb0, rel0, rec0, draw0 = held
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
        if problem is not None:
            raise ConfigurationError(
                f"This ClippedPytree is built around sums made earlier, with {problem}: the noise "
                "and the accounting read these fields, so they must say how the sums were made."
            )

    @property
    def batch_size(self) -> int:
        """Alias of :attr:`num_examples` (the realised, non-private batch size)."""
        return self.num_examples


# The attribute each sum tensor carries: (clipping_norm, normalize_by, releases, receipts, draw)
# of the first ClippedPytree built around it (see ClippedPytree.__post_init__). On the tensor,
# so that it lives exactly as long as the sum; a clone is a new sum.
_MADE = "_opake_made_with"


def lock_releases(clipped: ClippedPytree) -> None:
    """Make ``clipped``'s releases and receipts part of its sums: a copy built around any of
    them may no longer drop them (for releases the library attaches, such as adaptive
    clipping's count; a caller's own additions stay optional, so that a refused attempt can be
    retried)."""
    for t in _tensors(clipped.grads):
        c0, nb0, _, _, draw0 = t.__dict__[_MADE]
        t.__dict__[_MADE] = (c0, nb0, tuple(clipped.releases), tuple(clipped.receipts), draw0)


def _tensors(grads: Any) -> list[torch.Tensor]:
    if isinstance(grads, dict):
        return [v for v in grads.values() if isinstance(v, torch.Tensor)]
    if isinstance(grads, torch.Tensor):
        return [grads]
    return [v for v in optree.tree_leaves(grads, none_is_leaf=True) if isinstance(v, torch.Tensor)]


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
