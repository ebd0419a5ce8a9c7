"""``DPOptimizer``: privatise a clipped sum and step any ``torch.optim`` optimizer.

DP-SGD (Abadi et al. 2016) with Poisson subsampling: the step adds Gaussian noise
``N(0, (noise_multiplier * C)^2)`` once to the *sum* of clipped per-example gradients, divides by
the *expected* batch size ``q * N`` (never the realised size, which depends on the data and
would leak), writes ``.grad`` of the trainable parameters and steps the wrapped optimizer. Any
update rule then works on the privatised gradient (DP-Adam is ``Adam`` wrapped here).

Every logical step is counted for the accountant, an empty batch included: it releases pure
noise, and skipping it would reveal that the batch was empty.

Every release is charged. The accountant charges what each ``ClippedPytree`` says was released
from its sample (the gradient query, plus ``clipped.releases`` such as the noisy count of
adaptive clipping, accounted as ``poisson(gaussian(sigma) | release, q)``), and it charges per
Poisson *draw* of the sampler, not per call: several draws in one step are refused, and a draw
handed out but never stepped on is charged at the next step that names a later draw. One sample
is released once: two noisy releases of one Poisson sample cost ``poisson(g | g, q)``, more
than two Poisson steps, so a clipped sum (or a part of one) already released, a step naming no
draw when the sampler has none pending, and a second optimizer charging the same sampler are
refused.

What the optimizer cannot see: the rows. It checks the sampler's bookkeeping (a draw handed
out and not yet charged, by this sampler, never one ahead of it or behind it) and that a sum
holds no more examples than its draw; that the rows summed are the draw's rows, each once, is
the caller's loop (``x[draw]``; chunks that cover the draw once), as with any DP training
library. A sum of other rows (one example in every step, a chunk passed twice under two
objects, a copy of a sum already released) is charged as the draw and the reported epsilon is
then too small.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from opake_compile import accounting as _acc
from opake_compile import random as _random
from opake_compile._validate import NotPrivateWarning, check_noise_multiplier, check_optimizer_state
from opake_compile.compiler.passes import numerics as _num
from opake_compile.dpsgd._types import ClippedPytree
from opake_compile.dpsgd._types import SOURCES as _SOURCES
from opake_compile.dpsgd._types import check_not_released as _check_not_released
from opake_compile.dpsgd._types import check_release as _check_release
from opake_compile.dpsgd._types import record_release as _record_release
from opake_compile.dpsgd._types import sum_tensors as _sum_tensors
from opake_compile.dpftrl.noise import mark_held_by_optimizer
from opake_compile.dpsgd.noise import add_gaussian_noise
from opake_compile.exceptions import (
    CheckpointError,
    ConfigurationError,
    InputTypeError,
    PrivacyBudgetExhaustedError,
)

__all__ = ["DPOptimizer", "accumulate"]

_STATE_VERSION = 1


#: How a correlated-noise run goes on after a draw was handed out and not stepped on (a review
#: found one peek at the sampler wedged the run for good, with no way out named).
_MF_RECOVERY = (
    " A draw handed out and not stepped on (a peek with next(iter(sampler)) or list(sampler)) cannot "
    "be charged later under correlated noise: to go on, restore the run's last checkpoint "
    "(opake_compile.Checkpointer) into a new optimizer and sampler, or start a new run."
)

#: The attribute a sampler records the optimizer charging its draws in: a weak reference to
#: the first DPOptimizer that released one of them, kept once that optimizer is gone (one per
#: sampler: two optimizers stepping on one draw release it twice, each charging it once).
_CHARGED_BY = "_opake_charged_by"


def _draws_charged_from(sampler: Any) -> int:
    """How many of ``sampler``'s draws the live DPOptimizer charging it has charged (0: none)."""
    ref = getattr(sampler, _CHARGED_BY, None)
    opt = None if ref is None else ref()
    return 0 if opt is None else opt._draws_charged


#: The live optimizer that each key object was given to (by identity: keys are values, and two
#: runs seeded alike are not refused, but one key object or one noise pair reused is a mistake).
_KEY_OWNERS: dict[int, tuple[Any, weakref.ref]] = {}


def _claim_key(key: Any, opt: Any) -> None:
    """Refuse a key object (or the key of a ``noise=`` pair) that a live ``DPOptimizer`` already
    draws from: the two would add identical noise, and the difference of their releases would
    be the difference of the clipped sums, without noise."""
    held = _KEY_OWNERS.get(id(key))
    if held is not None and held[0] is key and held[1]() is not None:
        raise ConfigurationError(
            "This key (or noise=(fn, state) pair) is already used by another DPOptimizer (or an "
            "Opacus-style PrivacyEngine / make_private call): both would add the same noise, so the "
            "difference of their updates would carry no noise. Give each optimizer its own key "
            "(opake_compile.random.split) or its own mf_gaussian_noise(...)."
        )
    _KEY_OWNERS[id(key)] = (key, weakref.ref(opt))


def _check_delta(delta: float, dataset_size: int, what: str) -> None:
    """Refuse a target delta of at least 1/N: releasing one random record in full is already
    (0, 1/N)-DP, so such a guarantee protects nobody."""
    if delta >= 1.0 / dataset_size:
        raise ConfigurationError(
            f"{what}={delta:g} is at least 1/N = {1.0 / dataset_size:.3g} (N = {dataset_size}): "
            "releasing one random record in full is already (0, 1/N)-DP, so such a delta protects "
            "nobody. Use delta well below 1/N (e.g. 1/N^1.1 or smaller)."
        )


def _check_noise_scale(std: float, targets: Mapping[str, torch.Tensor], divisor: float) -> None:
    """Refuse noise whose draws would overflow (inf or NaN weights, on a step that would still be
    charged): std = sigma * C on the float32 (or float64) sum, and std / ``divisor`` (the
    expected batch size) in each parameter's dtype, must each stay 2^-7 of the largest value."""
    for name, p in targets.items():
        if not p.dtype.is_floating_point:
            continue
        sum_max = torch.finfo(torch.float64 if p.dtype == torch.float64 else torch.float32).max
        if not (std * 128 <= sum_max and std * 128 / divisor <= torch.finfo(p.dtype).max):
            raise ConfigurationError(
                f"The noise std sigma * C = {std!r} (on the sum; {std / divisor!r} on the gradient) "
                f"overflows {name}'s dtype {p.dtype} (largest {torch.finfo(p.dtype).max:.3g}): the "
                "update would be inf or NaN. Lower the clipping norm or the noise multiplier."
            )


def accumulate(parts: Sequence[ClippedPytree]) -> ClippedPytree:
    """Add the clipped sums of several physical batches that form one logical batch.

    Args:
        parts: ``ClippedPytree`` s with the same clipping norm, parameters and keys, none of
            them normalised, all of the same Poisson draw (or of an unknown one).

    Returns:
        One ``ClippedPytree``: grads added, per-example norms concatenated, counts added, the
        parts' other releases all kept (each part's release was made on the same sample).

    Raises:
        InputTypeError: an element is not a ``ClippedPytree``; the list is empty.
        ConfigurationError: the parts disagree on C or on the parameters, one is normalised, or
            they come from different Poisson draws (one noise on the sum of several draws is
            not a Poisson-subsampled Gaussian at rate q); a part is passed twice (its examples
            would count twice: sensitivity 2 C under one charge) or was already released.
    """
    parts = list(parts)
    if not parts:
        raise InputTypeError("accumulate needs at least one ClippedPytree.")
    seen: set[int] = set()
    for i, p in enumerate(parts):
        if not isinstance(p, ClippedPytree):
            raise InputTypeError(f"accumulate expects ClippedPytree parts, got {type(p).__name__}.")
        if p.normalize_by is not None:
            raise ConfigurationError("accumulate expects unnormalised sums (normalize_by=None).")
        tensors = {id(t) for t in _sum_tensors(p)}
        if tensors & seen:
            raise ConfigurationError(
                f"Part {i} repeats a part passed before it (the same gradient tensors): its examples "
                "would be summed twice, so one example could move the sum by 2 C under one charge. "
                "Pass each physical batch once."
            )
        seen |= tensors
        _check_not_released(p, f"Part {i}")
    first = parts[0]
    for p in parts[1:]:
        if p.clipping_norm != first.clipping_norm:
            raise ConfigurationError(
                f"Cannot accumulate sums clipped at different norms ({first.clipping_norm} and {p.clipping_norm})."
            )
        if not isinstance(p.grads, dict) or set(p.grads) != set(first.grads):
            raise ConfigurationError("Cannot accumulate sums over different parameters.")
        if p.num_ranks != first.num_ranks:
            raise ConfigurationError("Cannot accumulate a local sum with a sum reduced over ranks.")
    draws = {p.draw for p in parts if p.draw is not None}
    if len(draws) > 1:
        raise ConfigurationError(
            f"Cannot accumulate parts of {len(draws)} different Poisson draws into one step: "
            "each draw is one logical batch; take one optimizer step per draw."
        )
    # Several partial sums add up in float64 (numerics.MAX_FLOAT32_SUM_ROWS): a float32 sum
    # of many examples rounds on a grid the sensitivity slack cannot absorb. Their own rounding
    # still adds up over a large logical batch (numerics.MAX_FLOAT32_LOGICAL_ROWS).
    # (By the parameters' dtypes where known: a compiled call of several float32 chunks returns
    # float64 sums, whose chunks rounded in float32 all the same; review.)
    _num.check_float32_rows(sum(p.num_examples for p in parts),
                            {t.dtype for p in parts for t in (p.parameters or p.grads).values()},
                            "accumulate")
    grads = {k: functools.reduce(_num.add_partial, [p.grads[k] for p in parts]) for k in first.grads}
    out = ClippedPytree(
        grads=grads,
        clipping_norm=first.clipping_norm,
        per_example_norms=torch.cat([p.per_example_norms.reshape(-1) for p in parts]),
        num_examples=sum(p.num_examples for p in parts),
        num_nonfinite=sum(p.num_nonfinite for p in parts),
        num_ranks=first.num_ranks,
        parameters=first.parameters,
        releases=tuple(r for p in parts for r in p.releases),
        draw=next(iter(draws), None),
        receipts=tuple(r for p in parts for r in p.receipts),
    )
    _SOURCES[out] = tuple(t for p in parts for t in _sum_tensors(p))  # released with the sum
    return out


def _view_key(t: torch.Tensor) -> tuple:
    """Identity of a tensor's memory view: detached copies of a parameter share it."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _check_no_closure(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose ``step`` needs a closure (``LBFGS``): it re-evaluates the loss
    on the batch, non-privately, and ``DPOptimizer.step`` cannot pass one. Known at
    construction; otherwise every step would be charged and then fail."""
    import inspect

    try:  # the class's method: wrappers (accelerate's) may replace the instance's step
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigurationError(
            f"{type(optimizer).__name__}.step needs a closure: an optimizer that re-evaluates "
            "the loss (a closure) would compute non-private gradients of the batch. Use a first-order "
            "torch.optim optimizer (SGD, Adam, AdamW, ...)."
        )


def _check_dense_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Refuse ``SparseAdam``: it takes sparse gradients only, and a noised gradient is dense
    (noise on every entry; a sparse one would say which rows the batch touched). Known at
    construction; otherwise every step would be charged, write ``.grad`` and then fail."""
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ConfigurationError(
            "SparseAdam takes sparse gradients only, and a DP gradient is dense: Gaussian noise is "
            "added to every entry (a sparse gradient would reveal which rows the batch touched). "
            "Use Adam or AdamW."
        )


class DPOptimizer:
    """Wraps a ``torch.optim`` optimizer into a DP-SGD / DP-Adam / DP-anything step.

    Each step adds Gaussian noise of std sigma C to the clipped sum of one Poisson draw,
    divides by the expected batch size q N, and steps the wrapped optimizer on that gradient:
    DP-SGD (Abadi et al. 2016, "Deep learning with differential privacy"), with the optimizer's
    own update applied to the privatised gradient (post-processing); the accountant charges
    one Poisson-subsampled Gaussian per step (or the correlated-noise mechanism of
    :mod:`opake_compile.dpftrl`, Kairouz et al. 2021 / Choquette-Choo et al. 2023).

    Args:
        optimizer: any ``torch.optim.Optimizer`` over (at least) the trainable parameters.
        noise_multiplier: sigma >= 0; the noise std on the clipped *sum* is sigma * C, C being
            read from each ``ClippedPytree``. sigma = 0 warns: not private.
        sampler: the batch sampler that drew the batches, a
            :class:`~opake_compile.sampling.PoissonSampler`. The sample rate q, the dataset size
            N and the truncation are read from it, so the accounted sampling is the one used.
            A sampler that is not Poisson is refused (accounting it as Poisson would overstate
            the privacy).
        key: an :mod:`opake_compile.random` key for the noise; advanced every step and saved
            in :meth:`state_dict`.
        accountant: an :class:`opake_compile.accounting.Accountant`, or ``"pld"`` (default) /
            ``"rdp"``.
        budget: optional privacy budget (``accounting.epsilon_budget(eps, delta)``). A step
            that would exceed it raises :class:`PrivacyBudgetExhaustedError` before any
            parameter, optimizer or random state changes.
        noise: the noise mechanism; ``None`` (default) is the Gaussian mechanism above. Or the
            ``(noise_fn, noise_state)`` pair of
            :func:`opake_compile.dpftrl.mf_gaussian_noise` (correlated noise, DP-FTRL): sigma
            and the key then come from it (``noise_multiplier`` may repeat sigma, ``key`` must
            be omitted), and the accounting is derived from the mechanism and the sampler
            together (:func:`opake_compile.accounting.mf_plan`): the samplers it declares
            (``CyclicPoissonSampler`` with BandMF, Poisson with the identity strategy;
            ``SequentialBatchSampler``, ``BMinSepSampler`` and ``BallsInBinsSampler`` with any
            strategy, charged without amplification) are accepted, every other combination is
            refused with the reason. The noised sum is divided by the sampler's
            ``expected_batch_size``. With the non-Poisson samplers every step names its draw,
            in the sampler's order (the draw's position is the noise's step, on which the
            accounted participation pattern rests).

    Raises:
        InputTypeError: ``optimizer`` is not a ``torch.optim.Optimizer``; bad key; ``noise``
            is not a mechanism's pair.
        ConfigurationError: sigma < 0 or non-finite; a sampler that is not Poisson (without a
            mechanism that declares it); q * N = 0; a noise mechanism that cannot be accounted
            with this sampler; a budget whose delta is at least 1/N; an optimizer whose step
            needs a closure (``LBFGS``) or sparse gradients (``SparseAdam``).

    Example::

        >>> opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
        ...                   sampler=sampler, key=opake.random.key(0),
        ...                   budget=opake.accounting.epsilon_budget(3.0, delta=1e-5))
        >>> for idx in sampler:                      # every batch a draw of the sampler
        ...     opt.step(step(x[idx], y[idx]).clipped, draw=idx)
        >>> opt.epsilon()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float | None = None,
        sampler: Any,
        key: Any = None,
        accountant: Any = None,
        budget: Any = None,
        noise: Any = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputTypeError(f"Expected a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        _check_no_closure(optimizer)
        _check_dense_gradients(optimizer)
        self.optimizer = optimizer
        self._noise_fn = self._noise_state = self._plan = None
        self._mf_allowed: int | None = None
        if noise is not None:
            if not (isinstance(noise, tuple) and len(noise) == 2 and hasattr(noise[0], "accounting_plan")):
                raise InputTypeError(
                    "Expected noise=(noise_fn, noise_state) from opake_compile.dpftrl.mf_gaussian_noise "
                    f"(or None for Gaussian noise), got {type(noise).__name__}."
                )
            self._noise_fn, self._noise_state = noise
            if noise_multiplier is not None and check_noise_multiplier(noise_multiplier) != self._noise_fn.noise_multiplier:
                raise ConfigurationError(
                    f"noise_multiplier={noise_multiplier} differs from the noise mechanism's "
                    f"{self._noise_fn.noise_multiplier}; pass it once (to the mechanism)."
                )
            if key is not None:
                raise ConfigurationError("With noise=..., the noise state carries the key; do not pass key=.")
            noise_multiplier, key = self._noise_fn.noise_multiplier, self._noise_state.key
            self._plan = self._noise_fn.accounting_plan(sampler)  # refuses with the reason
        if noise_multiplier is None or key is None:
            missing = " and ".join(n for n, v in (("noise_multiplier=", noise_multiplier), ("key=", key)) if v is None)
            what = []
            if noise_multiplier is None:
                what.append(
                    "The noise multiplier sigma sets the noise's standard deviation, sigma * clipping_norm; "
                    "opake_compile.accounting.calibrate finds the sigma that spends a target epsilon."
                )
            if key is None:
                what.append(
                    "The key draws the noise: a fresh secret one is opake_compile.random.random_key() (OS "
                    "entropy); save it with the checkpoint, and never publish it (whoever holds it can "
                    "subtract the noise)."
                )
            raise InputTypeError(f"DPOptimizer needs {missing} (or noise=...). " + " ".join(what))
        self._noise_multiplier = check_noise_multiplier(noise_multiplier)
        if self._plan is None and not getattr(sampler, "is_poisson", False):
            raise ConfigurationError(
                f"DPOptimizer needs a Poisson sampler (opake_compile.sampling.PoissonSampler); got "
                f"{type(sampler).__name__}. Fixed-size shuffled batches are not Poisson subsampling, "
                "and accounting them as such would overstate the privacy guarantee."
                + (
                    " For independent noise with this sampler, pass noise=opake_compile.dpftrl.mf_gaussian_noise("
                    "identity_strategy(total_steps), sigma, key): it is accounted without amplification."
                    if getattr(sampler, "sampling", None) in ("fixed", "b_min_sep", "balls_in_bins")
                    else ""
                )
            )
        if getattr(sampler, _CHARGED_BY, None) is not None:
            raise ConfigurationError(
                "This sampler's draws were already charged by another DPOptimizer (alive or not): a new "
                "optimizer would count them from zero, so a position handed out again (batch_at) would be "
                "released a second time and its epsilon would leave out the earlier steps (review: a "
                "notebook cell re-run). Keep stepping the first optimizer, build a new sampler with a fresh "
                "key for a new run, or restore both from a checkpoint into new objects."
            )
        self._sampler = sampler
        self._sample_rate = float(sampler.sample_rate)
        self._dataset_size = int(sampler.dataset_size)
        self._truncated_batch_size = sampler.truncated_batch_size
        if not self.expected_batch_size > 0:
            raise ConfigurationError(
                f"Expected batch size q*N = {self.sample_rate}*{self.dataset_size} must be > 0."
            )
        _random._check_key(key)
        if key is getattr(sampler, "_key", None):
            raise ConfigurationError(
                "The optimizer's noise key is the sampler's key object: give each its own key, e.g. "
                "sampler_key, noise_key = opake_compile.random.split(key) (a key is used for one purpose; "
                "two optimizers sharing one key object are refused the same way)."
            )
        self._key = key
        if accountant is None or isinstance(accountant, str):
            accountant = _acc.Accountant(accountant or "pld")
        if not isinstance(accountant, _acc.Accountant):
            raise InputTypeError(f"Expected an accounting.Accountant or 'pld'/'rdp', got {type(accountant).__name__}.")
        self.accountant = accountant
        self._budget = self._checked_budget(budget)
        self._steps = 0
        self._draws_charged = 0  # draws of the sampler with seq < this are charged
        self._runs: tuple[tuple[Any, int], ...] = ()  # ((step process, count), ...) in order
        with warnings.catch_warnings():
            # sigma = 0 was already reported above; do not repeat it on every accounting query.
            warnings.simplefilter("ignore", NotPrivateWarning)
            self._step_process = _acc.dpsgd_step_process(
                self.noise_multiplier,
                self.sample_rate,
                dataset_size=self.dataset_size,
                truncated_batch_size=self.truncated_batch_size,
            )
        _claim_key(key, self)
        if self._noise_state is not None:
            mark_held_by_optimizer(self._noise_state)  # (built: a refused construction marks nothing)

    # ------------------------------------------------- the privacy configuration
    # Read-only: the noise, the normalisation and the accounting must always use the same
    # values (changing sigma after construction would under-report the privacy spent).
    @property
    def noise_multiplier(self) -> float:
        """sigma: the noise std on the clipped sum is sigma * C."""
        return self._noise_multiplier

    @property
    def sampler(self) -> Any:
        """The Poisson sampler whose draws this optimizer charges (q and N are read from it at
        construction). Read-only: a sampler swapped in later would draw at its own rate while
        the steps were charged at the first one's (q = 1 draws charged as q = 0.01: epsilon
        0.2 reported against 28 spent in 20 steps)."""
        return self._sampler

    @sampler.setter
    def sampler(self, value: Any) -> None:
        raise ConfigurationError(
            "DPOptimizer.sampler is read-only: the accounting uses the q and N of the sampler it was "
            "built with. Build a new DPOptimizer (and carry its state with state_dict) for another sampler."
        )

    @property
    def sample_rate(self) -> float:
        """q, read from the sampler."""
        return self._sample_rate

    @property
    def dataset_size(self) -> int:
        """N, read from the sampler."""
        return self._dataset_size

    @property
    def truncated_batch_size(self) -> int | None:
        """The sampler's truncation (``None``: plain Poisson)."""
        return self._truncated_batch_size

    @property
    def expected_batch_size(self) -> float:
        """q * N: the divisor of the noised sum (never the realised batch size); with
        correlated noise, the sampler's ``expected_batch_size``."""
        if self._plan is not None:
            return self._plan.divisor
        return self._sample_rate * self._dataset_size

    @property
    def steps(self) -> int:
        """Poisson steps charged (empty batches and skipped draws included): what the
        accountant charges for. Equal to the number of ``step`` calls when each call names the
        next draw."""
        return self._steps

    # ---------------------------------------------------------------- accounting
    @property
    def step_process(self) -> Any:
        """The privacy process of one logical step of the gradient query alone
        (``poisson(gaussian(sigma), q, ...)``); steps with other releases charge more."""
        return self._step_process

    @property
    def process(self) -> Any:
        """The privacy process of all steps charged so far, in order (``p1 * k1 | p2 * k2``);
        with correlated noise, the mechanism's process of the steps taken."""
        if self._plan is not None:
            return self._plan.process(self._steps)
        return _runs_process(self._runs, self.step_process)

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (default: the budget's delta)."""
        if delta is None:
            delta = getattr(self.budget, "delta", None)
            if delta is None:
                raise ConfigurationError("Pass delta (no epsilon budget was configured to take it from).")
        if self.steps == 0:
            return 0.0
        return self.accountant.epsilon(self.process, delta)

    @property
    def budget(self) -> Any:
        """The privacy budget steps are refused past (``None``: no limit). Assignable: the
        new budget is checked as at construction and every later step is held to it."""
        return self._budget

    @budget.setter
    def budget(self, budget: Any) -> None:
        self._budget = self._checked_budget(budget)
        self._mf_allowed = None  # max_steps() of the correlated noise is recomputed for it

    def _checked_budget(self, budget: Any) -> Any:
        if budget is not None and not isinstance(budget, _acc.PrivacyBudget):
            raise InputTypeError(
                f"Expected budget from accounting.epsilon_budget/delta_budget, got {type(budget).__name__}."
            )
        delta = getattr(budget, "delta", None)
        if delta is not None:
            _check_delta(delta, self.dataset_size, "The budget's delta")
        return budget

    def max_steps(self) -> int | None:
        """How many logical steps the budget allows in total (``None`` without a budget)."""
        if self.budget is None:
            return None
        if self._plan is not None:
            if self._mf_allowed is None:
                self._mf_allowed = self._plan.max_steps(self.accountant, self.budget)
            return self._mf_allowed
        return self.accountant.max_steps(self.step_process, self.budget)

    # ---------------------------------------------------------------- the step
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _write_and_step(self, noised: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], commit: Any) -> None:
        """Divide the noised sums by the expected batch size, write them to ``.grad`` in each
        parameter's dtype (other parameters of the wrapped optimizer get ``None``), run
        ``commit()`` (the key, the noise state and the charge advance) and step. The release
        is the write to ``.grad``, so it is charged before the wrapped step runs: if that step
        raises, a retry draws fresh noise and is charged again (reusing the noise on other
        data would reveal the difference of two sums without noise)."""
        new_grads = {
            name: (noised[name] / self.expected_batch_size).to(dtype=p.dtype, device=p.device)
            for name, p in targets.items()
        }
        written = {id(p) for p in targets.values()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in written:
                    p.grad = None
        for name, p in targets.items():
            p.grad = new_grads[name]
        commit()
        self.optimizer.step()

    def step(self, clipped: ClippedPytree | Sequence[ClippedPytree], *, draw: Any = None) -> None:
        """Privatise ``clipped`` (one logical batch) and step the wrapped optimizer.

        Writes ``p.grad = (sum + N(0, (sigma C)^2 I)) / (q N)`` for every trainable parameter in
        ``clipped`` and sets ``.grad = None`` on every other parameter of the optimizer (a stale
        non-private gradient is never applied). A sequence of ``ClippedPytree`` (physical
        batches of one logical batch) is accumulated first.

        What is charged: ``poisson(gaussian(sigma) | *clipped.releases, q, ...)`` once per Poisson
        draw up to the draw this step used. Name it with ``draw=`` (the
        :class:`~opake_compile.sampling.Draw` the sampler yielded, or its ``.id``; see
        :func:`~opake_compile.sampling.draw_loader` for a ``DataLoader``) or in
        ``clipped.draw``. Then every draw of the sampler up to that one not charged yet is
        charged now (a draw handed out and skipped may have been used elsewhere), and later
        draws (prefetched) are not. Without a draw, the step charges the one draw handed out
        since the last step, and is refused when none is pending (a sum of batches the sampler did not draw) or when
        several were handed out: one noise on the sum of several draws is not a step at rate q.

        Args:
            clipped: the ``ClippedPytree`` of one logical batch, or its physical parts.
            draw: optional :class:`~opake_compile.sampling.Draw` / ``DrawId`` of that batch.

        Raises:
            InputTypeError: not a ``ClippedPytree`` (a ``NoisedPytree`` is refused: no double
                noising); it carries no parameter references.
            ConfigurationError: the sum was already normalised; C = inf with sigma > 0; a
                gradient whose parameter is not in the optimizer or has another shape; parts or
                a ``draw`` from different draws, a draw of another sampler, a draw already
                charged, or several draws handed out and none named; a release in
                ``clipped.releases`` that cannot be accounted for; a sum (or part) released
                before (a retry after the wrapped step raised included: ``.grad`` was written);
                no draw named while the sampler has none pending (never iterated included); more
                examples than the draw charged (named, or the one pending) holds; another ``DPOptimizer`` charging this
                sampler; in a process group, a sampler that is not a
                ``DistributedPoissonSampler`` of its size, or ranks that disagree on the key, the
                noise multiplier, the sampler's q, N or position, share a sampler rank, or
                whose draws together hold fewer examples than the global sum
                (refused on every rank, before anything changes); with correlated noise
                (``noise=``), a step past the strategy's length. (A ``ClippedPytree`` whose
                fields differ from those its sums were made with, or that mixes sums of
                different results or new tensors with the library's, is refused when it is
                built, by ``dataclasses.replace``.)

            PrivacyBudgetExhaustedError: this step would exceed the budget. Nothing changes.
            Any error of the wrapped optimizer's own ``step`` (e.g. a hyperparameter a scheduler
                set to ``None``) propagates after the charge: the release is the write to
                ``.grad``, and the parameter groups it updated before failing stay updated.
        """
        if not isinstance(clipped, ClippedPytree):
            if isinstance(clipped, Sequence) and not isinstance(clipped, (str, bytes)):
                clipped = accumulate(clipped)
            else:
                hint = " (did you mean result.clipped?)" if hasattr(clipped, "clipped") else ""
                raise InputTypeError(
                    f"DPOptimizer.step expects the ClippedPytree of one logical batch, got "
                    f"{type(clipped).__name__}{hint}."
                )
        if clipped.normalize_by is not None:
            raise ConfigurationError(
                f"The ClippedPytree was already normalised (normalize_by={clipped.normalize_by}); "
                "DPOptimizer adds noise to the sum and divides by the expected batch size itself."
            )
        _check_release(clipped)
        ahead = getattr(self.sampler, "_charged_at_load", 0)
        if ahead > self._draws_charged:
            raise ConfigurationError(
                f"The sampler's state was saved after {ahead} of its draws had been charged, but this "
                f"optimizer has charged {self._draws_charged}: the two states come from different times of "
                "the run, and this step would add the noise of an earlier step (already released) to "
                "another sample, so that the two releases differ by their clipped sums without noise "
                "(review). Restore the optimizer and the sampler from the same checkpoint. Nothing changed."
            )
        charger = getattr(self.sampler, _CHARGED_BY, None)
        if charger is not None and charger() is not self:  # (a dead one included)
            raise ConfigurationError(
                "Another DPOptimizer already charges this sampler's draws: two optimizers stepping on "
                "one draw release it twice while each charges it once. Use one DPOptimizer per sampler "
                "(or one sampler per optimizer, each with its own key)."
            )
        world = torch.distributed.get_world_size() if torch.distributed.is_available() and torch.distributed.is_initialized() else 1
        if clipped.num_ranks != world:
            raise ConfigurationError(
                f"This ClippedPytree holds the sum of {clipped.num_ranks} process(es), but the process "
                f"group has {world}: call opake_compile.distributed.sum_gradients(clipped) first, so "
                "that every rank adds the same noise to the same global sum."
            )
        if world > 1:
            if getattr(self.sampler, "world_size", None) != world:
                # The same key on every rank's plain sampler draws the same positions in every
                # shard: inclusions correlated across ranks, not a Poisson sample at rate q.
                raise ConfigurationError(
                    f"In a process group of {world} ranks, draw the batches with "
                    f"opake_compile.distributed.DistributedPoissonSampler (one Poisson sample of the "
                    f"whole dataset, split across ranks), not {type(self.sampler).__name__}."
                )
            from opake_compile.distributed import _check_step_agreement

            # Every rank validates, then all of them compare in one collective and refuse
            # together: a rank refusing alone would leave the others waiting in the collective.
            failure, checked = None, None
            try:
                checked = self._validate_step(clipped, draw)
            except (ConfigurationError, InputTypeError) as err:
                failure = err
            size = None if checked is None else self._draw_size(draw, checked[2])
            _check_step_agreement(self, clipped, draw, size, failure)
            targets, charge, draws_charged = checked
        else:
            targets, charge, draws_charged = self._validate_step(clipped, draw)
            self._check_draw_size(clipped, draw, draws_charged)
        if self._plan is not None:
            self._mf_step(clipped, targets, charge, draws_charged, draw)
            return
        c = clipped.clipping_norm
        step_process = self._release_process(clipped.releases)
        runs = _append_run(self._runs, step_process, charge)
        if self.budget is not None:
            self._check_budget(runs, step_process, charge)
        next_key, draw_key = _random.split(self._key, 2)
        std = self.noise_multiplier * c if self.noise_multiplier > 0 else 0.0
        _check_noise_scale(std, targets, self.expected_batch_size)
        noised = add_gaussian_noise(clipped.grads, std, draw_key)
        # Validation and noise are done: from here on the state changes.
        def commit() -> None:
            self._key = next_key
            self._steps += charge
            self._runs = runs
            self._draws_charged = draws_charged
            self._released(clipped)

        self._write_and_step(noised, targets, commit)

    def _validate_step(self, clipped: ClippedPytree, draw: Any) -> tuple[dict[str, torch.Tensor], int, int]:
        """The checks of a step that read only this process's state: ``(targets, Poisson
        steps to charge, draws charged afterwards)``."""
        c = clipped.clipping_norm
        if not (isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0):  # NaN included
            raise ConfigurationError(
                f"The ClippedPytree's clipping_norm={c!r} is not a positive number: the noise is "
                "scaled by it, so it must be the C the sum was clipped with."
            )
        if math.isinf(c) and self.noise_multiplier > 0:
            raise ConfigurationError("clipping_norm=inf cannot be privatised with noise_multiplier > 0.")
        targets = self._match_parameters(clipped)
        charge, draws_charged = self._charge(clipped, draw)
        return targets, charge, draws_charged

    def _draw_size(self, draw: Any, draws_charged: int) -> int | None:
        """How many examples the draw this step is charged for holds (the one named, or else
        the one pending: sequence number ``draws_charged - 1``), or ``None`` if unknown."""
        from opake_compile.sampling import Draw

        if isinstance(draw, Draw):
            return len(draw)
        size_of = getattr(self.sampler, "_size_of", None)
        if size_of is None or getattr(self.sampler, "draws_handed_out", None) is None:
            return None
        return size_of(draws_charged - 1)

    def _check_draw_size(self, clipped: ClippedPytree, draw: Any, draws_charged: int) -> None:
        """Refuse a sum of more examples than the draw this step is charged for holds.

        That draw is the one named, or else the one draw pending (sequence number
        ``draws_charged - 1`` either way). Parts of one draw hold disjoint examples, so more
        examples than the draw has means an example was summed twice (a part passed again),
        several draws were summed, or the rows were not the sampler's (a fixed batch stepped on
        beside a pending Poisson draw): one example could then move the sum by more than C, or
        the batch was not sampled at rate q, while one Poisson step is charged.
        """
        size, seq = self._draw_size(draw, draws_charged), draws_charged - 1
        if size is not None and clipped.num_examples > size:
            raise ConfigurationError(
                f"The clipped sum holds {clipped.num_examples} examples but draw {seq}, the one this "
                f"step is charged for, has only {size}: a part was passed more than once, parts of "
                "several draws were summed, or the rows were not the ones the sampler drew. Pass "
                "each physical batch of the draw once, one step per draw."
            )

    def _mf_step(
        self, clipped: ClippedPytree, targets: dict[str, torch.Tensor], charge: int, draws_charged: int, draw: Any
    ) -> None:
        """A step with correlated noise (``noise=`` given); validation done by ``step``."""
        from opake_compile.sampling import draw_of

        if self._plan.kind in ("cyclic_poisson", "fixed", "b_min_sep", "balls_in_bins"):
            # The participation pattern (group t mod bands; epoch position; separation) is accounted in
            # terms of the noise's step index, so the draw must be the sampler's step t.
            named = draw_of(draw) or clipped.draw
            if named is None:
                raise ConfigurationError(
                    f"With correlated noise and a {type(self.sampler).__name__}, name the draw of every step "
                    "(step(clipped, draw=batch_indices)): its position in the sampler's stream must be the "
                    "noise's step, or the accounted participation pattern could break."
                )
            position = named.epoch * self.sampler.steps + named.step
            if position != self._steps:
                raise ConfigurationError(
                    f"Draw (epoch {named.epoch}, step {named.step}) is step {position} of the sampler's stream, "
                    f"but the correlated noise is at step {self._steps}: take the draws in order, one step each."
                    + _MF_RECOVERY
                )
        if clipped.releases:
            raise ConfigurationError(
                f"The ClippedPytree carries other releases {clipped.releases!r}; their accounting with "
                "correlated noise is not built, so the step is refused."
            )
        if charge != 1:
            raise ConfigurationError(
                f"This step would charge {charge} draws (draws handed out and skipped): correlated noise "
                "needs exactly one step per draw, in order (the participation pattern it is accounted "
                "for would break). Step on every draw." + _MF_RECOVERY
            )
        # The strategy's own length first: a budget's step limit is capped by it, and running past
        # it is a configuration to change, not a budget spent (a newcomer's review).
        check_step = getattr(self._noise_fn, "check_step", None)
        if check_step is not None:
            check_step(self._noise_state.step)
        if self.budget is not None and self._steps + 1 > self.max_steps():
            raise PrivacyBudgetExhaustedError(
                f"Step {self.steps + 1} would exceed the privacy budget {self.budget}: it allows "
                f"{self.max_steps()} step(s) of {self._noise_fn!r} with {type(self.sampler).__name__}. "
                "No state was changed."
            )
        _check_noise_scale(self.noise_multiplier * clipped.clipping_norm, targets, self.expected_batch_size)
        noised, new_state = self._noise_fn(clipped, self._noise_state, _by_optimizer=True)

        def commit() -> None:
            mark_held_by_optimizer(new_state)
            self._noise_state = new_state
            self._key = new_state.key
            self._steps += 1
            self._runs = _append_run(self._runs, self._step_process, 1)  # keeps the checkpoint's count
            self._draws_charged = draws_charged
            self._released(clipped)

        self._write_and_step(noised.grads, targets, commit)

    def _released(self, clipped: ClippedPytree) -> None:
        """Record a release (at the write to ``.grad``): the sum and its parts may not be
        released again, and this optimizer charges its sampler's draws from now on."""
        _record_release(clipped)  # receipts included: adaptive clipping's next norm may now be used
        if getattr(self.sampler, _CHARGED_BY, None) is None:
            try:  # for good: any other optimizer on this sampler is refused, even once this one is gone
                setattr(self.sampler, _CHARGED_BY, weakref.ref(self))
            except AttributeError:  # a sampler object without attributes: not tracked
                pass

    @property
    def noise_state(self) -> Any:
        """The correlated noise's state (``None`` with the default Gaussian noise)."""
        return self._noise_state

    # ------------------------------------------------------- what a step charges
    def _charge(self, clipped: ClippedPytree, draw: Any) -> tuple[int, int]:
        """(Poisson steps to charge, draws charged afterwards) for a step on ``clipped``."""
        from opake_compile.sampling import draw_of

        named = draw_of(draw)
        if named is not None and clipped.draw is not None and named != clipped.draw:
            raise ConfigurationError(
                f"step(draw=...) names draw {named.seq} but the ClippedPytree comes from draw "
                f"{clipped.draw.seq}: one step per draw."
            )
        named = named if named is not None else clipped.draw
        handed_out = getattr(self.sampler, "draws_handed_out", None)
        if handed_out is not None and handed_out < self._draws_charged:
            raise ConfigurationError(
                f"The sampler has handed out {handed_out} draw(s) but this optimizer has charged "
                f"{self._draws_charged}: the sampler is behind the optimizer (rewound with "
                "load_state_dict, or a checkpoint restored without the sampler's state), so its next "
                "draws repeat samples already released. Restore the sampler's state with the "
                "optimizer's (Checkpointer.save(..., sampler=sampler); with the Opacus shim, "
                "the data loader's sampler_ too)."
            )
        if named is not None:
            if named.source != getattr(self.sampler, "_id", None):
                raise ConfigurationError(
                    "This draw was handed out by another sampler than the optimizer's; q and N "
                    "are read from the optimizer's sampler, so its draws must be used."
                )
            if handed_out is not None and named.seq >= handed_out:
                raise ConfigurationError(
                    f"Draw {named.seq} has not been handed out by the sampler (it has handed out "
                    f"{handed_out}): a DrawId made by hand, or a sampler rewound (load_state_dict) "
                    "behind its draws. Step on the draws the sampler yields."
                )
            if named.seq < self._draws_charged:
                raise ConfigurationError(
                    f"Draw {named.seq} (epoch {named.epoch}, step {named.step}) is already "
                    f"charged (draws 0..{self._draws_charged - 1} are): one step per draw, in the "
                    "order the sampler handed them out."
                )
            return named.seq + 1 - self._draws_charged, named.seq + 1
        pending = 0 if handed_out is None else handed_out - self._draws_charged
        if pending == 0 and handed_out is not None:
            raise ConfigurationError(
                "The sampler handed out no draw since the last charged step"
                + (f" (draws 0..{handed_out - 1} are charged)" if handed_out else " (it was never iterated)")
                + " and this step names none: its sum is a second release of a draw already stepped on "
                "(two views of one sample, not a new Poisson step) or comes from batches this sampler did "
                "not draw (fixed or shuffled batches are not Poisson sampling at rate q, and the reported "
                "epsilon would be too small). Draw each batch from the sampler (for idx in sampler: ...) "
                "and step on it."
            )
        if pending > 1:
            raise ConfigurationError(
                f"The sampler handed out {pending} draws since the last charged step and this step "
                "names none, so the optimizer cannot tell chunks of one draw from several draws "
                "(one noise on the sum of several draws is not a step at rate q). Pass "
                "step(clipped, draw=batch_indices) with the Draw the sampler yielded (with a "
                "prefetching DataLoader use opake_compile.sampling.draw_loader), and take one "
                "step per draw."
            )
        return 1, self._draws_charged + max(pending, 0)

    def _release_process(self, releases: tuple[Any, ...]) -> Any:
        """The privacy process of one step that also made ``releases`` from its sample."""
        if not releases:
            return self._step_process
        for r in releases:
            if not isinstance(r, _acc.PrivacyProcess):
                raise InputTypeError(
                    f"ClippedPytree.releases must hold privacy processes (accounting.gaussian(...)), "
                    f"got {type(r).__name__}; the optimizer refuses a release it cannot account for."
                )
        from opake_compile.accounting._mechanisms import _inverse_variance

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NotPrivateWarning)
            mechanism = _acc.gaussian(self.noise_multiplier)
            try:
                for r in releases:  # each as the one Gaussian it is equivalent to
                    inverse_variance = _inverse_variance(r)
                    if inverse_variance > 0:
                        mechanism = mechanism | _acc.gaussian(0.0 if math.isinf(inverse_variance) else inverse_variance**-0.5)
                return _acc.poisson(
                    mechanism,
                    self.sample_rate,
                    truncated_batch_size=self.truncated_batch_size,
                    dataset_size=self.dataset_size,
                )
            except ConfigurationError as err:
                raise ConfigurationError(
                    f"DPOptimizer cannot account for the releases {releases!r} made with this step, "
                    f"so it refuses the step: {err}"
                ) from err

    def _check_budget(self, runs: tuple[tuple[Any, int], ...], step_process: Any, charge: int) -> None:
        if len(runs) == 1:  # the common case: one kind of step, answered from a cached search
            # A coarser PLD grid (pessimistic too, so sound) decides cheaply while far from the
            # end; the exact count of the optimizer's own accountant decides near it.
            allowed = self.accountant.max_steps(step_process, self.budget, exact=False)
            if runs[0][1] > 0.95 * allowed:
                allowed = self.accountant.max_steps(step_process, self.budget)
            ok = runs[0][1] <= allowed
            detail = f"it allows {allowed} step(s) of {step_process!r}"
        else:
            spent = self.budget.spent(_runs_process(runs, self.step_process), self.accountant)
            ok = spent <= self.budget.target
            detail = f"the {self.budget.quantity} spent would be {spent:g}"
        if not ok:
            raise PrivacyBudgetExhaustedError(
                f"Step {self.steps + 1} (charging {charge} Poisson step(s)) would exceed the "
                f"privacy budget {self.budget}: {detail}, with noise_multiplier="
                f"{self.noise_multiplier}, sample_rate={self.sample_rate}. No state was changed."
            )

    def _match_parameters(self, clipped: ClippedPytree) -> dict[str, torch.Tensor]:
        if clipped.parameters is None or not isinstance(clipped.grads, dict):
            raise InputTypeError(
                "This ClippedPytree carries no parameter references; build it with compile_dp or "
                "with clipped_grad on a dict of parameters (e.g. from make_functional)."
            )
        by_view = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                by_view[_view_key(p)] = p
        targets = {}
        for name, g in clipped.grads.items():
            ref = clipped.parameters.get(name)
            p = None if ref is None else by_view.get(_view_key(ref))
            if p is None:
                raise ConfigurationError(
                    f"Parameter {name!r} of the clipped gradients is not in the wrapped optimizer. Every "
                    "trainable parameter (requires_grad=True) is clipped and released: freeze the ones "
                    "you do not train (p.requires_grad_(False)) before the step, or give them to the "
                    "optimizer (a layer added or replaced since: "
                    "dp_optimizer.optimizer.add_param_group({'params': [...]}))."
                )
            if tuple(g.shape) != tuple(p.shape):
                raise ConfigurationError(
                    f"Gradient of {name!r} has shape {tuple(g.shape)}, the parameter {tuple(p.shape)}."
                )
            targets[name] = p
        return targets

    # ---------------------------------------------------------------- checkpoints
    def __reduce_ex__(self, protocol: Any) -> Any:
        # copy.copy, copy.deepcopy and pickle all come here.
        raise ConfigurationError(
            "A DPOptimizer is not copied or pickled: the copy would draw the same noise as this "
            "optimizer (its key's value), so that two runs' updates differ by their clipped sums "
            "without noise (review: copy.deepcopy((model, optimizer))). Save and restore it with "
            "state_dict() / load_state_dict() or opake_compile.Checkpointer; for a second run, "
            "build a new DPOptimizer with a fresh key."
        )

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus the noise key, the step count and the privacy
        configuration (checked on load)."""
        return {
            "version": _STATE_VERSION,
            "optimizer": self.optimizer.state_dict(),
            "key": _random.key_to_state(self._key),
            "steps": self.steps,
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.sample_rate,
            "dataset_size": self.dataset_size,
            "truncated_batch_size": self.truncated_batch_size,
            "draws_charged": self._draws_charged,
            # Each run of identical steps: the noise multipliers of the other releases, count.
            "runs": [[_release_sigmas(proc, self.step_process), count] for proc, count in self._runs],
            **({} if self._plan is None else {
                "noise_state": _mf_state_to_dict(self._noise_state),
                "noise": repr(self._noise_fn),
                "sampler_scheme": _scheme_of(self._sampler),
            }),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Raises:
            CheckpointError: missing keys, another version, a different privacy configuration
                (noise multiplier, sample rate, dataset size, truncation), or fewer steps than
                this optimizer has already charged (a rewind).
        """
        key, steps, runs, noise_state = self._validated_state(state)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
        except (KeyError, TypeError, ValueError) as err:  # torch's own checks (group sizes), before it writes
            raise CheckpointError(f"The wrapped optimizer's state does not fit it: {err}") from err
        if noise_state is not None:
            mark_held_by_optimizer(noise_state)
            self._noise_state = noise_state
        self._key = key
        self._steps = steps
        self._runs = runs
        self._draws_charged = int(state.get("draws_charged", 0))

    def _validated_state(self, state: Any) -> tuple[Any, int, tuple[tuple[Any, int], ...], Any]:
        """Every check of :meth:`load_state_dict`, changing nothing: ``(key, steps, runs,
        noise_state)`` to assign. (The checkpoint loader runs it on every object before it
        loads any, so that a refused optimizer leaves the model unrestored too.)"""
        required = {"version", "optimizer", "key", "steps", "noise_multiplier", "sample_rate", "dataset_size", "truncated_batch_size"}
        if not isinstance(state, dict) or not required <= set(state):
            missing = sorted(required - set(state)) if isinstance(state, dict) else sorted(required)
            raise CheckpointError(f"DPOptimizer state is missing {missing}.")
        if state["version"] != _STATE_VERSION:
            raise CheckpointError(f"DPOptimizer state version {state['version']} is not {_STATE_VERSION}.")
        if int(state["steps"]) < self._steps:
            # Going back would forget charged steps and replay their noise keys on new data.
            raise CheckpointError(
                f"This optimizer has charged {self._steps} step(s) and the checkpoint only "
                f"{int(state['steps'])}: restoring would rewind the accountant and reuse noise. Restore "
                "into a fresh DPOptimizer, never into one that has stepped since, and only to replace this run: "
                "the restored run draws the same noise for its next steps as this one did for its, so "
                "releasing both (on different data) exposes their difference without noise."
            )
        for field in ("noise_multiplier", "sample_rate", "dataset_size", "truncated_batch_size"):
            if state[field] != getattr(self, field):
                raise CheckpointError(
                    f"Checkpoint has {field}={state[field]!r}, this optimizer {getattr(self, field)!r}: "
                    "the privacy accounting would not match."
                )
        key = _random.key_from_state(state["key"])
        steps = int(state["steps"])
        if self._steps > 0 and steps != self._steps:
            # This optimizer's own steps were released; a checkpoint of another point would
            # replace their charge by the checkpoint's. (At the same count the state may be a
            # process group's rank 0 aligning the others: distributed.sync.)
            raise CheckpointError(
                f"This optimizer has charged {self._steps} step(s) of its own and the checkpoint is at "
                f"step {steps}: loading it would forget the releases it made. Restore into a fresh "
                "DPOptimizer (a new run), never into one that has stepped since."
            )
        saved_runs = state.get("runs", [[[], steps]] if steps else [])
        runs: tuple[tuple[Any, int], ...] = ()
        try:
            for sigmas, count in saved_runs:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", NotPrivateWarning)
                    releases = tuple(_acc.gaussian(float(sg)) for sg in sigmas)
                runs = _append_run(runs, self._release_process(releases), int(count))
        except (TypeError, ValueError, ConfigurationError, InputTypeError) as err:
            raise CheckpointError(f"DPOptimizer state has invalid runs {saved_runs!r}: {err}") from err
        if sum(count for _, count in runs) != steps:
            raise CheckpointError(f"DPOptimizer state: runs {saved_runs!r} do not add up to steps={steps}.")
        draws = state.get("draws_charged", steps)  # (absent in states saved before it was kept)
        if isinstance(draws, bool) or not isinstance(draws, int) or draws != steps:
            # Every step charges the draws it covers, one step each: they never differ in a state
            # this optimizer wrote (an edited steps=0 reported epsilon 0: review).
            raise CheckpointError(f"DPOptimizer state: draws_charged={draws!r} differs from steps={steps}.")
        noise_state = None
        if self._plan is not None:
            if state.get("noise") != repr(self._noise_fn) or "noise_state" not in state:
                raise CheckpointError(
                    f"Checkpoint has noise {state.get('noise')!r}, this optimizer {self._noise_fn!r}: the "
                    "correlated noise and its accounting would not match."
                )
            _check_sampler_scheme(state, self._sampler, steps)
            noise_state = _mf_state_from_dict(state["noise_state"], self._noise_state)
            if noise_state.step != steps:
                raise CheckpointError(f"DPOptimizer state: noise step {noise_state.step} != steps={steps}.")
        check_optimizer_state(self.optimizer, state["optimizer"], "optimizer.")
        return key, steps, runs, noise_state


def _mf_state_to_dict(state: Any) -> dict[str, Any]:
    return {
        "key": _random.key_to_state(state.key),
        "step": int(state.step),
        "buffers": None if state.buffers is None else [[t.detach().clone() for t in bufs] for bufs in state.buffers],
        "replay_keys": [_random.key_to_state(k) for k in state.replay_keys],
    }


def _mf_state_from_dict(d: Any, template: Any) -> Any:
    try:
        buffers = d["buffers"]
        if buffers is not None:
            buffers = tuple(tuple(torch.as_tensor(t) for t in bufs) for bufs in buffers)
        return type(template)(
            _random.key_from_state(d["key"]),
            int(d["step"]),
            buffers,
            tuple(_random.key_from_state(k) for k in d["replay_keys"]),
        )
    except (KeyError, TypeError, ValueError, InputTypeError) as err:
        raise CheckpointError(f"DPOptimizer state has an invalid noise_state: {err}") from err


def _append_run(runs: tuple[tuple[Any, int], ...], process: Any, count: int) -> tuple[tuple[Any, int], ...]:
    """``runs`` with ``count`` more steps of ``process`` (merged into the last run if equal)."""
    if runs and runs[-1][0] == process:
        return (*runs[:-1], (process, runs[-1][1] + count))
    return (*runs, (process, count))


def _runs_process(runs: tuple[tuple[Any, int], ...], step_process: Any) -> Any:
    """The privacy process of ``runs``: ``p * k`` for one run (the plain DP-SGD history)."""
    if not runs:
        return step_process * 0
    process = runs[0][0] * runs[0][1]
    for proc, count in runs[1:]:
        process = process | proc * count
    return process


def _release_sigmas(process: Any, base: Any) -> list[float]:
    """The noise multipliers of the releases in a step process beyond the gradient query."""
    if process == base:
        return []
    mechanism = process.mechanism
    parts = mechanism.parts[1:] if isinstance(mechanism, _acc.Composed) else ()
    return [float(p.noise_multiplier) for p in parts]


def _scheme_of(sampler: Any) -> dict[str, Any] | None:
    """The sampler's scheme (which examples each draw holds, position apart), or ``None`` for
    a sampler that does not describe one."""
    scheme = getattr(sampler, "_scheme_state", None)
    return None if scheme is None else scheme()


def _check_sampler_scheme(state: Mapping[str, Any], sampler: Any, steps: int) -> None:
    """Refuse a correlated-noise state saved beside a sampler of another scheme.

    The strategy's sensitivity depends on who took part when (bands, minimum separation, the
    cyclic groups and every draw, all fixed by the sampler's key and settings), and the
    accountant charges the whole run under the sampler it holds now. A checkpoint restored with
    a sampler built otherwise (another key, bands or separation; same q and N) and fast-forwarded
    past the saved steps was charged as if the new pattern had run from the start: one example
    took part in two steps 1 apart where the charge assumed at least 4 (review: epsilon 2.57
    reported, 5.75 for the participation that ran)."""
    if steps == 0:
        return
    current = _scheme_of(sampler)
    saved = state.get("sampler_scheme")
    if saved is None or current is None:
        raise CheckpointError(
            "This correlated-noise checkpoint does not record its sampler's scheme"
            + (" (saved by an earlier version)" if saved is None else f", and {type(sampler).__name__} describes none")
            + ": its sensitivity depends on who took part in which step, so a run cannot resume under "
            "a sampler that may differ. Resume from a checkpoint saved by this version."
        )
    for name in sorted(set(saved) | set(current)):
        if saved.get(name) != current.get(name):
            raise CheckpointError(
                f"Checkpoint's sampler has {name}={saved.get(name)!r}, this optimizer's sampler "
                f"{current.get(name)!r}: with correlated noise the sensitivity depends on who took part "
                "in which step, and resuming under another scheme would charge the steps already run "
                "as if the new one had drawn them. Build the sampler with the saved arguments and key, "
                "and restore its state from the same checkpoint."
            )
