"""Connectionist temporal classification loss in a form that traces into a static graph and
batches under ``vmap``.

``torch.nn.functional.ctc_loss`` cannot be traced by ``make_fx`` (its kernel's ``log_alpha``
output has a shape that depends on the target lengths' values) and has no ``vmap`` batching
rule; while :func:`~opake_compile.compile_dp` traces, :mod:`opake_compile.patches` routes it
here. Two implementations of the same values:

- ``"kernel"`` (the default where it applies: float32/float64 on CPU or CUDA): PyTorch's own
  ``aten::_ctc_loss`` and ``aten::_ctc_loss_backward`` wrapped as the custom ops
  ``opake::ctc_nll`` and ``opake::ctc_nll_backward``, whose outputs have static shapes and whose
  vmap rules fold the vmapped dimension into the kernel's batch: under ``vmap(grad(...))`` a
  batch is one kernel call forward and one backward, whatever the number of frames ``T``
  (Inductor calls them as external kernels). Gradients are the kernel's (which are correct
  through a ``log_softmax``, as PyTorch's are), with its non-finite cases made 0 (below).
- ``"recursion"``: the forward ("alpha") recursion of Graves et al. 2006, "Connectionist
  Temporal Classification: Labelling Unsegmented Sequence Data with Recurrent Neural
  Networks", §4.1, in log space, unrolled over the ``T`` frames (about 40 graph nodes per frame
  with its gradient); gradients from autograd through it. Used where the kernel does not apply
  (other dtypes or devices, ``T = 0``).
"""

from __future__ import annotations

import torch

__all__ = ["ctc_loss"]

# Stands for log(0): finite, so that log-sum-exp over unreachable states has finite gradients
# (exactly 0 toward them); far below any reachable path's log-probability (a path of 10^4
# frames at -10^20 per frame is still 10^6 times above it). Impossible alignments end at this
# floor and are reported as +inf.
_LOG_ZERO = -1e30


def _require_valid(targets: torch.Tensor, in_len: torch.Tensor, tgt_len: torch.Tensor, n_frames: int, classes: int) -> None:
    """While ``compile_dp`` traces, ask the step to check what the eager kernel checks (lengths)
    or fails on (class indices) on the real rows before it runs (see
    :mod:`opake_compile.compiler._input_checks`); nothing otherwise."""
    from opake_compile.compiler._input_checks import range_test, require

    require(targets, range_test("CTC loss: target class", 0, classes - 1), "CTC targets in [0, C)")
    require(in_len, range_test("CTC loss: input length", 0, n_frames), "CTC input lengths in [0, T]")
    require(tgt_len, range_test("CTC loss: target length", 0, targets.shape[-1]), "CTC target lengths in [0, S]")


def _kernel_applies(log_probs: torch.Tensor) -> bool:
    """Whether PyTorch's own kernel (:func:`_nll_by_kernel`) can compute the loss here."""
    return (
        log_probs.dtype in (torch.float32, torch.float64)
        and log_probs.device.type in ("cpu", "cuda")
        and log_probs.shape[0] > 0
    )


def _shift(alpha: torch.Tensor, k: int) -> torch.Tensor:
    """``alpha`` moved ``k`` states right along the last axis, log(0) entering (one op)."""
    if alpha.shape[-1] <= k:
        return torch.full_like(alpha, _LOG_ZERO)
    return torch.nn.functional.pad(alpha, (k, -k), value=_LOG_ZERO)


def ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor | list[int] | tuple[int, ...],
    target_lengths: torch.Tensor | list[int] | tuple[int, ...],
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
    impl: str = "auto",
) -> torch.Tensor:
    """The CTC loss with the signature and values of ``torch.nn.functional.ctc_loss``.

    Args:
        log_probs: ``(T, N, C)`` log-probabilities over ``C`` classes (or ``(T, C)`` for one
            sequence), e.g. a ``log_softmax`` over the last axis.
        targets: ``(N, S)`` padded targets (entries past a sequence's target length are
            ignored), or the concatenated targets ``(sum(target_lengths),)`` (any static
            length at least the sum), or ``(S,)`` for one sequence. Class indices in
            ``[0, C)``, never ``blank``.
        input_lengths: ``(N,)`` frames used per sequence, each in ``[0, T]``.
        target_lengths: ``(N,)`` target length per sequence.
        blank: the blank class.
        reduction: ``"none"`` (``(N,)`` losses), ``"sum"``, or ``"mean"`` (each loss divided by
            its target length, at least 1, then the mean over the batch).
        zero_infinity: replace infinite losses (no alignment of the target fits the input
            length) and their gradients by 0.
        impl: ``"kernel"``, ``"recursion"`` or ``"auto"`` (the kernel where it applies; see
            the module docstring).

    Returns:
        The negative log-likelihood, in nats, reduced as asked (a scalar, or ``(N,)``).

    Edge cases (both implementations): an impossible alignment gives ``+inf`` (0 with
    ``zero_infinity``) and a zero gradient (PyTorch's kernel gives a non-finite one there
    unless ``zero_infinity``); a log-probability of ``-inf`` gets a zero gradient (the kernel's
    is NaN); a target of length 0 is the all-blank path; repeated labels need a blank between
    them. Lengths stay tensors. Values the eager kernel refuses or cannot read (a class index
    outside ``[0, C)``, an input length outside ``[0, T]``, a target length outside
    ``[0, S]``): while ``compile_dp`` traces, checks of the real rows are registered with the
    step (:mod:`opake_compile.compiler._input_checks`), which refuses such a batch before it
    runs; otherwise (a padded row, an unbatched call) the kernel path gives that sequence a NaN
    loss and gradient, and the recursion an index error (class) or 0 / ``+inf`` (lengths).

    Raises:
        ValueError: an unknown ``reduction`` or ``impl``.

    Example::

        >>> lp = torch.randn(6, 2, 4).log_softmax(-1)
        >>> y = torch.tensor([[1, 2], [3, 3]])
        >>> loss = ctc_loss(lp, y, torch.tensor([6, 5]), torch.tensor([2, 2]))
    """
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"Expected reduction='{reduction}' to be one of 'none', 'mean', 'sum'.")
    unbatched = log_probs.dim() == 2
    if unbatched:
        log_probs = log_probs.unsqueeze(1)
        targets = targets.unsqueeze(0)
    n_frames, batch, _ = log_probs.shape
    device = log_probs.device
    in_len = torch.as_tensor(input_lengths, device=device).reshape(batch).to(torch.long)
    tgt_len = torch.as_tensor(target_lengths, device=device).reshape(batch).to(torch.long)
    targets = targets.to(device=device, dtype=torch.long)
    if targets.dim() == 1:  # concatenated: sequence n starts after the lengths before it
        width = targets.shape[0]
        starts = tgt_len.cumsum(0) - tgt_len
        index = (starts[:, None] + torch.arange(width, device=device)[None, :]).clamp(max=max(width - 1, 0))
        targets = targets[index] if width > 0 else targets.new_zeros(batch, 0)
    width = targets.shape[1]
    s = torch.arange(width, device=device)
    targets = torch.where(s[None, :] < tgt_len[:, None], targets, blank)
    _require_valid(targets, in_len, tgt_len, n_frames, log_probs.shape[-1])
    if impl == "auto":
        impl = "kernel" if _kernel_applies(log_probs) else "recursion"
    if impl == "kernel":
        loss = _nll_by_kernel(log_probs, targets, in_len, tgt_len, blank)
    elif impl == "recursion":
        loss = _nll_by_recursion(log_probs, targets, in_len, tgt_len, blank)
    else:
        raise ValueError(f"Expected impl={impl!r} to be one of 'auto', 'kernel', 'recursion'.")
    if zero_infinity:
        loss = torch.where(torch.isinf(loss) & (loss > 0), 0.0, loss)
    if unbatched:
        loss = loss[0]
        tgt_len = tgt_len[0]
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return (loss / tgt_len.clamp_min(1).to(loss.dtype)).mean()


def _nll_by_recursion(
    log_probs: torch.Tensor, targets: torch.Tensor, in_len: torch.Tensor, tgt_len: torch.Tensor, blank: int
) -> torch.Tensor:
    """``(N,)`` negative log-likelihoods (``+inf`` when impossible) by the forward recursion,
    unrolled over the ``T`` frames; ``targets`` ``(N, S)`` already blank past each length."""
    n_frames, batch, _ = log_probs.shape
    device = log_probs.device
    width = targets.shape[1]
    # Extended sequence: blank, y1, blank, y2, ..., yS, blank (length 2S + 1).
    blanks = torch.full_like(targets, blank)
    ext = torch.cat([torch.stack([blanks, targets], dim=-1).reshape(batch, 2 * width), blanks[:, :1].new_full((batch, 1), blank)], dim=1)
    length = ext.shape[1]
    pos = torch.arange(length, device=device)
    # Skipping the blank between two labels is allowed unless they are equal.
    prev2 = torch.cat([ext.new_full((batch, 2), -1), ext], dim=1)[:, :length]
    skip = (pos[None, :] % 2 == 1) & (ext != prev2) & (pos[None, :] >= 2)
    log_zero = torch.full((), _LOG_ZERO, dtype=log_probs.dtype, device=device)  # (torch.tensor detaches in place: refused under grad off the CPU)

    emit = log_probs.gather(2, ext[None, :, :].expand(n_frames, batch, length)).clamp_min(_LOG_ZERO)
    start = pos[None, :] < 2
    alpha = torch.where(start, emit[0], log_zero)
    # No frame at all: only the empty target is produced, with probability 1.
    alpha = torch.where(in_len[:, None] > 0, alpha, torch.where(pos[None, :] == 0, 0.0, log_zero).to(alpha.dtype))
    skip_penalty = torch.where(skip, 0.0, _LOG_ZERO).to(alpha.dtype)  # a skip that is not allowed adds log(0)
    active = in_len[None, :, None] > torch.arange(n_frames, device=device)[:, None, None]  # (T, N, 1)
    # Unreachable states stay at or below log(0) (log(0) plus emissions, at most log 3 per step
    # above it): no clamp is needed for the impossible-alignment test below.
    for t in range(1, n_frames):
        moves = torch.stack(
            [
                alpha,
                _shift(alpha, 1),
                _shift(alpha, 2) + skip_penalty,
            ]
        )
        # log-sum-exp over the three moves; the shift by the maximum carries no gradient
        # (its derivative cancels exactly), so it is detached.
        top = moves.amax(0).detach()
        step = top + (moves - top).exp().sum(0).log() + emit[t]
        alpha = torch.where(active[t], step, alpha)
    last = alpha.gather(1, (2 * tgt_len)[:, None])[:, 0]
    before = alpha.gather(1, (2 * tgt_len - 1).clamp_min(0)[:, None])[:, 0]
    before = torch.where(tgt_len > 0, before, log_zero)
    m = torch.maximum(last, before)
    total = m + ((last - m).exp() + (before - m).exp()).log()
    impossible = total <= _LOG_ZERO / 2
    inf = torch.full((), float("inf"), dtype=total.dtype, device=device)
    return torch.where(impossible, inf, -total)


# ----------------------------------------------------------------------------- PyTorch's kernel
# ``opake::ctc_nll`` wraps ``aten::_ctc_loss`` (its ``log_alpha`` output, whose shape depends on
# the target lengths' values, stays inside) and ``opake::ctc_nll_backward`` wraps
# ``aten::_ctc_loss_backward``. Both have static output shapes (fake implementations), an
# autograd formula and a vmap rule that folds the vmapped dimension into the kernel's batch
# dimension: under ``vmap(grad(...))`` a batch of P examples is one kernel call forward and one
# backward, and the traced graph holds two nodes whatever ``T`` is (Inductor calls them as
# external kernels).


@torch.library.custom_op("opake::ctc_nll", mutates_args=())
def _ctc_nll(
    log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: torch.Tensor, target_lengths: torch.Tensor, blank: int
) -> torch.Tensor:
    """``(N,)`` negative log-likelihoods from ``(T, N, C)`` log-probabilities and ``(N, S)``
    targets (``+inf`` when no alignment fits)."""
    nll, _ = torch.ops.aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, False)
    return nll


@_ctc_nll.register_fake
def _(log_probs, targets, input_lengths, target_lengths, blank):  # noqa: ANN001, ANN202
    return log_probs.new_empty(log_probs.shape[1])


@torch.library.custom_op("opake::ctc_nll_backward", mutates_args=())
def _ctc_nll_backward(
    grad: torch.Tensor,
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
) -> torch.Tensor:
    """The gradient of :func:`_ctc_nll` with respect to ``log_probs`` given ``grad`` ``(N,)``:
    the kernel's, with two non-finite cases made 0 as in the recursion: a sequence whose
    alignment is impossible (the kernel's ``zero_infinity``) and a log-probability of ``-inf``
    (a class never emitted, where the kernel's formula is ``-inf + inf``)."""
    # The forward again, for log_alpha (its shape depends on the targets' lengths, so it cannot
    # be an output of the traced forward op): one more O(T S) pass, no graph growth.
    nll, log_alpha = torch.ops.aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, False)
    g = torch.ops.aten._ctc_loss_backward.Tensor(
        grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank, True
    )
    return torch.where(log_probs == float("-inf"), 0.0, g)


@_ctc_nll_backward.register_fake
def _(grad, log_probs, targets, input_lengths, target_lengths, blank):  # noqa: ANN001, ANN202
    return torch.empty_like(log_probs)


class _KernelNLL(torch.autograd.Function):
    """Autograd for ``opake::ctc_nll`` in the form functorch's ``grad`` accepts (a separate
    ``setup_context``; ``torch.library``'s ``register_autograd`` builds an
    ``autograd.Function`` without one, which ``grad`` refuses on torch 2.13). Under ``vmap``
    the forward and backward run batched, where the two ops' vmap rules apply."""

    generate_vmap_rule = True

    @staticmethod
    def forward(log_probs, targets, input_lengths, target_lengths, blank):  # noqa: ANN001, ANN205
        return _ctc_nll(log_probs, targets, input_lengths, target_lengths, blank)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
        log_probs, targets, input_lengths, target_lengths, blank = inputs
        ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths)
        ctx.blank = blank

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        log_probs, targets, input_lengths, target_lengths = ctx.saved_tensors
        return _KernelNLLGrad.apply(grad, log_probs, targets, input_lengths, target_lengths, ctx.blank), None, None, None, None


class _KernelNLLGrad(torch.autograd.Function):
    """``opake::ctc_nll_backward`` as an ``autograd.Function`` (``grad`` records the backward
    for higher derivatives): first derivatives only."""

    generate_vmap_rule = True

    @staticmethod
    def forward(grad, log_probs, targets, input_lengths, target_lengths, blank):  # noqa: ANN001, ANN205
        return _ctc_nll_backward(grad, log_probs, targets, input_lengths, target_lengths, blank)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
        pass

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        raise RuntimeError("The CTC loss computed by PyTorch's kernel has no second derivative; use impl='recursion'.")


def _front(x: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """``x`` with its vmapped dimension first (expanded to ``size`` if it has none)."""
    return x.movedim(dim, 0) if dim is not None else x.expand(size, *x.shape)


def _fold(info, in_dims, log_probs, targets, input_lengths, target_lengths):  # noqa: ANN001, ANN202
    """Fold the vmapped dimension ``V`` into the kernel's batch: ``(T, V*N, C)``, ``(V*N, S)``,
    ``(V*N,)``, ``(V*N,)``."""
    v = info.batch_size
    lp = _front(log_probs, in_dims[0], v)
    n_frames, n, c = lp.shape[1:]
    lp = lp.movedim(0, 1).reshape(n_frames, v * n, c)
    tg = _front(targets, in_dims[1], v).reshape(v * n, targets.shape[-1] if in_dims[1] is None else -1)
    il = _front(input_lengths, in_dims[2], v).reshape(v * n)
    tl = _front(target_lengths, in_dims[3], v).reshape(v * n)
    return lp, tg, il, tl, v, n


def _ctc_nll_vmap(info, in_dims, log_probs, targets, input_lengths, target_lengths, blank):  # noqa: ANN001, ANN202
    lp, tg, il, tl, v, n = _fold(info, in_dims, log_probs, targets, input_lengths, target_lengths)
    return _ctc_nll(lp, tg, il, tl, blank).reshape(v, n), 0


def _ctc_nll_backward_vmap(info, in_dims, grad, log_probs, targets, input_lengths, target_lengths, blank):  # noqa: ANN001, ANN202
    lp, tg, il, tl, v, n = _fold(info, in_dims[1:], log_probs, targets, input_lengths, target_lengths)
    g = _front(grad, in_dims[0], v).reshape(v * n)
    out = _ctc_nll_backward(g, lp, tg, il, tl, blank)
    return out.reshape(out.shape[0], v, n, out.shape[-1]), 1


_ctc_nll.register_vmap(_ctc_nll_vmap)
_ctc_nll_backward.register_vmap(_ctc_nll_backward_vmap)


def _nll_by_kernel(
    log_probs: torch.Tensor, targets: torch.Tensor, in_len: torch.Tensor, tgt_len: torch.Tensor, blank: int
) -> torch.Tensor:
    """``(N,)`` negative log-likelihoods (``+inf`` when impossible) by PyTorch's kernel, through
    ``opake::ctc_nll``; ``targets`` ``(N, S)`` already blank past each length.

    The kernel reads ``log_probs[t, n, targets[n, s]]`` without a bounds check and refuses
    lengths outside ``[0, T]`` and ``[0, S]``, which a graph cannot report per sequence (padded
    rows of a compiled step hold such values): values outside their range are clamped into it
    for the kernel, and such a sequence's loss and gradient are made NaN (a non-finite example,
    which clipping drops and counts; the recursion gives 0 or ``+inf`` there instead)."""
    n_frames, _, classes = log_probs.shape
    width = targets.shape[1]
    bad = ((targets < 0) | (targets >= classes)).any(dim=-1)
    bad = bad | (in_len < 0) | (in_len > n_frames) | (tgt_len < 0) | (tgt_len > width)
    nll = _KernelNLL.apply(
        log_probs, targets.clamp(0, classes - 1), in_len.clamp(0, n_frames), tgt_len.clamp(0, width), blank
    )
    # NaN in the loss and in every entry of the gradient of a bad sequence (also when no frame
    # of it reaches the kernel), exactly 0 elsewhere (``where`` selects, it does not multiply).
    poison = torch.where(bad, float("nan"), 0.0).to(log_probs.dtype)[None, :, None]
    picked = torch.where(bad[None, :, None], log_probs, 0.0)
    return nll + (picked * poison).sum(dim=(0, 2))
