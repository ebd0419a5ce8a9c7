"""Connectionist temporal classification loss as plain tensor operations (no data-dependent
shapes, no host values), so it traces into a static graph and batches under ``vmap``.

``torch.nn.functional.ctc_loss`` cannot be traced by ``make_fx`` (its kernel's output shape
depends on the target lengths' values) and has no ``vmap`` batching rule; while
:func:`~opake_compile.compile_dp` traces, :mod:`opake_compile.patches` routes it here. The
recursion is the forward ("alpha") recursion of Graves et al. 2006, "Connectionist Temporal
Classification: Labelling Unsegmented Sequence Data with Recurrent Neural Networks", §4.1, in
log space; gradients come from autograd through it.
"""

from __future__ import annotations

import torch

__all__ = ["ctc_loss"]

# Stands for log(0): finite, so that log-sum-exp over unreachable states has finite gradients
# (exactly 0 toward them); far below any reachable path's log-probability (a path of 10^4
# frames at -10^20 per frame is still 10^6 times above it). Impossible alignments end at this
# floor and are reported as +inf.
_LOG_ZERO = -1e30


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

    Returns:
        The negative log-likelihood, in nats, reduced as asked (a scalar, or ``(N,)``).

    Edge cases: an impossible alignment gives ``+inf`` (0 with ``zero_infinity``) and a zero
    gradient (PyTorch's kernel gives a non-finite one there); a target of length 0 is the
    all-blank path; repeated labels need a blank between them. Lengths stay tensors: the
    recursion runs ``T`` steps (``T`` is static), each sequence frozen after its own input
    length, so the graph holds ``O(T)`` operations of size ``(N, 2S+1)``.

    Raises:
        ValueError: an unknown ``reduction``. Class indices outside ``[0, C)`` fail in the
            gather (an index error, as indexing does).

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
    # Extended sequence: blank, y1, blank, y2, ..., yS, blank (length 2S + 1).
    blanks = torch.full_like(targets, blank)
    ext = torch.cat([torch.stack([blanks, targets], dim=-1).reshape(batch, 2 * width), blanks[:, :1].new_full((batch, 1), blank)], dim=1)
    length = ext.shape[1]
    pos = torch.arange(length, device=device)
    # Skipping the blank between two labels is allowed unless they are equal.
    prev2 = torch.cat([ext.new_full((batch, 2), -1), ext], dim=1)[:, :length]
    skip = (pos[None, :] % 2 == 1) & (ext != prev2) & (pos[None, :] >= 2)
    log_zero = torch.tensor(_LOG_ZERO, dtype=log_probs.dtype, device=device)

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
    inf = torch.tensor(float("inf"), dtype=total.dtype, device=device)
    loss = torch.where(impossible, 0.0 if zero_infinity else inf, -total)
    if unbatched:
        loss = loss[0]
        tgt_len = tgt_len[0]
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return (loss / tgt_len.clamp_min(1).to(loss.dtype)).mean()
