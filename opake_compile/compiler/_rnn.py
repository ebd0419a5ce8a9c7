"""Recurrent layers and packed sequences under the per-example transform.

``nn.RNN``, ``nn.GRU``, ``nn.LSTM`` and their ``*Cell`` forms call fused kernels
(``torch._VF.rnn_tanh``, ``gru``, ``lstm``, ``gru_cell``, ...). Under ``torch.func.vmap`` with
a batched input and an *unbatched* initial state (``hx=None`` makes zeros, the same for every
example) those kernels add a batched gate into the unbatched state in place, which vmap cannot
do ("output with shape [1, 8] doesn't match the broadcast shape [6, 1, 8]"); ``nn.LSTM`` on CPU
traces, but through ``mkldnn_rnn_layer``, which has no batching rule, so vmap unrolls one copy of
the whole layer per example into the graph. :func:`recurrent_ops` replaces these calls, while it
is active, by the same recurrences written with out-of-place tensor ops (one ``linear`` over
all time steps for the input weights, one cell per step, and the recurrent weights' gradient
routed through one product over all steps: see :func:`_direction`), which vmap and ``make_fx``
handle like any other layer. Two generic in-place forms that packing uses are also replaced by
out-of-place ones with vmap rules (``Tensor.scatter_`` with a tensor source, and
``index_select``, computed as a ``gather``), so no op is looped over examples.

Packed sequences. Under the per-example transform every example is a batch of one with its own
length, so the packed layout (``data`` of shape ``(sum of lengths, *)``, ``batch_sizes`` with one
entry per time step) has a data-dependent shape. While :func:`recurrent_ops` is active,
``pack_padded_sequence(x, lengths, ...)`` returns a :class:`~torch.nn.utils.rnn.PackedSequence`
in a fixed-shape form: ``data`` holds every padded position, time-major, ``(T * b, *)``, and
``batch_sizes`` says ``b`` for each of the ``T`` steps; the lengths travel beside it. The
recurrent layers then run over all T steps with a mask ``t < length``: at a masked step the
state is carried over unchanged and the output is zero, so the final state of each direction is
its state at the sequence's last valid position (the reverse direction starts there) and the
gradient is exactly that of the example run alone with its length (positions at or beyond the
length have no effect; lengths are clamped to ``[0, T]``). ``pad_packed_sequence`` returns the
padded form, with ``padding_value`` at masked positions, padded to T (or ``total_length``): the
example's own output padded to the batch's length, as in the ordinary batch. Any other use of a
packed sequence's ``data`` (which would see the padded positions) raises
:class:`~opake_compile.exceptions.UnsupportedOperationError` naming the operation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, resolve_name

from opake_compile.exceptions import UnsupportedOperationError

__all__ = ["recurrent_ops"]

# Tensor methods and properties that only read metadata: allowed on a fixed-shape packed
# sequence's data (the recurrent modules' argument checks use them).
_METADATA = frozenset(
    {"dim", "ndimension", "size", "shape", "ndim", "dtype", "device", "is_cuda", "layout", "numel",
     "nelement", "requires_grad", "is_floating_point", "is_complex", "element_size", "stride",
     "is_contiguous", "__len__", "__hash__"}
)


def _cell(kind: str, gx: torch.Tensor, gh: torch.Tensor, state: tuple[torch.Tensor, ...], w_hr: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """One step from the input projection ``gx`` and the hidden projection ``gh`` (both
    ``(b, gates * H)``, biases included), in PyTorch's gate order (LSTM i, f, g, o; GRU r, z, n)."""
    if kind == "lstm":
        i, f, g, o = (gx + gh).chunk(4, -1)
        c = torch.sigmoid(f) * state[1] + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (h if w_hr is None else F.linear(h, w_hr), c)
    if kind == "gru":
        xr, xz, xn = gx.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (n + z * (state[0] - n),)
    pre = gx + gh
    return (torch.relu(pre) if kind == "rnn_relu" else torch.tanh(pre),)


def _scan(
    kind: str, gx: Sequence[torch.Tensor], state: tuple[torch.Tensor, ...], w_hh: torch.Tensor, b_hh: torch.Tensor | None,
    w_hr: torch.Tensor | None, order: Sequence[int], keep: Sequence[torch.Tensor] | None, extra: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """The recurrence over the steps in ``order``. Returns the outputs and the hidden state
    *entering* each step (both indexed by time) and the final state. ``extra[t]`` is added to
    step t's hidden projection."""
    outs: list[torch.Tensor] = [None] * len(gx)  # type: ignore[list-item]
    entering: list[torch.Tensor] = [None] * len(gx)  # type: ignore[list-item]
    for t in order:
        entering[t] = state[0]
        gh = F.linear(state[0], w_hh, b_hh)
        if extra is not None:
            gh = gh + extra[t]
        new = _cell(kind, gx[t], gh, state, w_hr)
        if keep is None:
            state, outs[t] = new, new[0]
        else:
            m = keep[t].unsqueeze(-1)
            state = tuple(torch.where(m, n, s) for n, s in zip(new, state))
            outs[t] = torch.where(m, new[0], torch.zeros_like(new[0]))
    return outs, entering, state


def _direction(
    kind: str, x: torch.Tensor, state: tuple[torch.Tensor, ...], w: dict[str, Any], reverse: bool, mask: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One direction of one layer over a time-major input ``x`` (T, b, F); ``mask`` (T, b)
    bool or None. Returns the outputs (T, b, H_out) and the final state.

    The input weights see all steps in one product. The recurrent weights ``w_hh`` enter once
    per step, so their per-example gradient would be a sum of T rank-one terms accumulated
    into a materialised ``(P, gates * H, H)`` tensor. When ``w_hh`` is differentiated, the
    steps use its value only (``w_hh.detach()``), and its gradient flows through one product
    over all steps, ``Z = linear(H_prev, w_hh)`` with ``H_prev`` the (detached) hidden states
    entering each step, added to the steps as ``Z_t - Z_t.detach()`` (exactly zero in value;
    its gradient is step t's gate gradient). ``H_prev`` comes from a first, value-only pass of
    the same recurrence (the same operations on the same values), so the gradient is unchanged
    and ``w_hh`` is a linear layer over T positions for the ghost-norm and book-keeping rules
    (Li et al. 2022; Bu et al. 2023), at the price of a second forward recurrence.
    """
    gx = F.linear(x, w["w_ih"], w["b_ih"]).unbind(0)  # all steps in one product
    order = range(len(gx) - 1, -1, -1) if reverse else range(len(gx))
    keep = mask.unbind(0) if mask is not None else None
    w_hh, b_hh, w_hr = w["w_hh"], w["b_hh"], w["w_hr"]
    extra = None
    if w_hh.requires_grad and len(gx) > 1:
        det = [t.detach() for t in gx]
        _, entering, _ = _scan(
            kind, det, tuple(s.detach() for s in state), w_hh.detach(),
            None if b_hh is None else b_hh.detach(), None if w_hr is None else w_hr.detach(), order, keep,
        )
        z = F.linear(torch.stack(entering, 0), w_hh)
        extra = (z - z.detach()).unbind(0)
        w_hh = w_hh.detach()
    outs, _, state = _scan(kind, gx, state, w_hh, b_hh, w_hr, order, keep, extra)
    return torch.stack(outs, 0), state


def _run(
    kind: str,
    x: torch.Tensor,
    hx: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stacked recurrence on a time-major ``x`` (T, b, F); ``hx`` holds the initial state
    tensors (num_layers * directions, b, H) (two for an LSTM). Returns the last layer's outputs
    (T, b, directions * H_out) and the final states stacked like ``hx``."""
    dirs = 2 if bidirectional else 1
    per = len(params) // (num_layers * dirs)
    proj = kind == "lstm" and per == (5 if has_biases else 3)
    finals: list[list[torch.Tensor]] = [[] for _ in hx]
    layer_in = x
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            p = list(params[k * per : (k + 1) * per])
            w = {
                "w_ih": p[0],
                "w_hh": p[1],
                "b_ih": p[2] if has_biases else None,
                "b_hh": p[3] if has_biases else None,
                "w_hr": p[-1] if proj else None,
            }
            y, state = _direction(kind, layer_in, tuple(h[k] for h in hx), w, d == 1, mask)
            outs.append(y)
            for acc, s in zip(finals, state):
                acc.append(s)
        layer_in = outs[0] if dirs == 1 else torch.cat(outs, -1)
        if dropout > 0 and train and layer < num_layers - 1:
            layer_in = F.dropout(layer_in, dropout, training=True)
    return layer_in, [torch.stack(f, 0) for f in finals]


class _RecurrentMode(TorchFunctionMode):
    """Replaces the fused recurrent kernels and the packed-sequence ops (see the module
    docstring). Fixed-shape packed data is recognised by identity."""

    def __init__(self) -> None:
        super().__init__()
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(data) -> (data, lengths)
        self._batch_sizes: dict[int, tuple[torch.Tensor, int]] = {}  # id -> (tensor, b)
        self._handlers = {
            torch.rnn_tanh: lambda *a, **k: self._layer("rnn_tanh", *a, **k),
            torch.rnn_relu: lambda *a, **k: self._layer("rnn_relu", *a, **k),
            torch.gru: lambda *a, **k: self._layer("gru", *a, **k),
            torch.lstm: lambda *a, **k: self._layer("lstm", *a, **k),
            torch.rnn_tanh_cell: lambda *a, **k: self._cell("rnn_tanh", *a, **k),
            torch.rnn_relu_cell: lambda *a, **k: self._cell("rnn_relu", *a, **k),
            torch.gru_cell: lambda *a, **k: self._cell("gru", *a, **k),
            torch.lstm_cell: lambda *a, **k: self._cell("lstm", *a, **k),
            torch._pack_padded_sequence: self._pack,
            torch._pad_packed_sequence: self._pad,
        }

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        handler = self._handlers.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func is torch.Tensor.scatter_ and len(args) == 4 and not kwargs and isinstance(args[3], torch.Tensor):
            # invert_permutation (PackedSequence's unsorted_indices) scatters in place into a
            # batched tensor: vmap has no rule for that and would loop over examples. The
            # out-of-place form has one.
            return args[0].copy_(torch.scatter(*args))
        if func in (torch.index_select, torch.Tensor.index_select) and len(args) == 3 and not kwargs:
            # Sorting by length and unsorting (pack_padded_sequence, pad_packed_sequence,
            # permute_hidden) index_select with a batched index, whose backward (index_add)
            # vmap loops over examples; a gather's backward (scatter_add) is batched.
            return _index_select_as_gather(*args)
        if self._packed or self._batch_sizes:
            marked = self._marked_arg(args, kwargs)
            if marked is not None:
                return self._on_marked(func, marked, args, kwargs)
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ packed sequences
    def _marked_arg(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        for a in (*args, *kwargs.values()):
            items = a if isinstance(a, (list, tuple)) else (a,)
            for t in items:
                if isinstance(t, torch.Tensor) and (id(t) in self._packed or id(t) in self._batch_sizes):
                    return t
        return None

    def _on_marked(self, func: Any, marked: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        name = resolve_name(func) or getattr(func, "__name__", repr(func))
        short = name.removesuffix(".__get__").rsplit(".", 1)[-1]
        if short in _METADATA:
            return func(*args, **kwargs)
        if id(marked) in self._batch_sizes and short == "__getitem__" and len(args) == 2 and isinstance(args[1], int):
            # nn.RNN reads the batch size as int(batch_sizes[0]): the same for every step here.
            return self._batch_sizes[id(marked)][1]
        if id(marked) in self._packed and short == "to" and args and args[0] is marked:
            out = func(*args, **kwargs)
            if out is not marked:
                self._packed[id(out)] = (out, self._packed[id(marked)][1])
            return out
        raise UnsupportedOperationError(
            f"{name} on a PackedSequence's data or batch_sizes is not supported by compile_dp. "
            "Under the per-example transform a packed sequence keeps a fixed shape (every padded "
            "position, with the lengths beside it), so an operation on its .data would also see "
            "the padded positions. Use packed sequences only as inputs to nn.RNN/GRU/LSTM and "
            "pad_packed_sequence, and apply other layers to the padded tensor (masking by length)."
        )

    def _pack(self, x: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if batch_first:
            x = x.transpose(0, 1)
        steps, b = x.shape[0], x.shape[1]
        data = x.reshape(steps * b, *x.shape[2:])
        batch_sizes = torch.full((steps,), b, dtype=torch.int64)
        self._packed[id(data)] = (data, lengths.to(device=x.device, dtype=torch.int64).clamp(0, steps))
        self._batch_sizes[id(batch_sizes)] = (batch_sizes, b)
        return data, batch_sizes

    def _unpacked(self, data: torch.Tensor, batch_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, b, *) view of fixed-shape packed data, its lengths (b,) and mask (T, b)."""
        if id(data) not in self._packed or id(batch_sizes) not in self._batch_sizes:
            raise UnsupportedOperationError(
                "compile_dp supports packed sequences made inside the loss by "
                "torch.nn.utils.rnn.pack_padded_sequence (with the lengths as a batched tensor "
                "argument); this PackedSequence was made otherwise."
            )
        lengths = self._packed[id(data)][1]
        b = self._batch_sizes[id(batch_sizes)][1]
        x = data.reshape(-1, b, *data.shape[1:])
        mask = torch.arange(x.shape[0], device=x.device).unsqueeze(1) < lengths.unsqueeze(0)
        return x, lengths, mask

    def _pad(self, data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool, padding_value: float, total_length: int):  # noqa: ANN202
        x, lengths, mask = self._unpacked(data, batch_sizes)
        m = mask.reshape(*mask.shape, *([1] * (x.dim() - 2)))
        out = torch.where(m, x, torch.full_like(x, padding_value))
        if total_length > x.shape[0]:
            pad = torch.full((total_length - x.shape[0], *x.shape[1:]), padding_value, dtype=x.dtype, device=x.device)
            out = torch.cat([out, pad], 0)
        return (out.transpose(0, 1) if batch_first else out), lengths

    # ------------------------------------------------------------------ layers and cells
    def _layer(self, kind: str, x: torch.Tensor, *rest: Any) -> Any:
        if isinstance(rest[2], (list, tuple)):
            # Packed overload: (data, batch_sizes, hx, params, has_biases, layers, dropout, train, bidir).
            batch_sizes, hx, params, has_biases, layers, dropout, train, bidir = rest
            seq, lengths, mask = self._unpacked(x, batch_sizes)
            # Padded positions must not reach the arithmetic at all (a NaN there would turn a
            # zero gradient into NaN): the packed kernel never reads them.
            seq = torch.where(mask.reshape(*mask.shape, *([1] * (seq.dim() - 2))), seq, torch.zeros_like(seq))
            out, finals = _run(kind, seq, _states(kind, hx), params, has_biases, layers, dropout, train, bidir, mask)
            data = out.reshape(-1, *out.shape[2:])
            self._packed[id(data)] = (data, lengths)
            return (data, *finals)
        hx, params, has_biases, layers, dropout, train, bidir, batch_first = rest
        seq = x.transpose(0, 1) if batch_first else x
        out, finals = _run(kind, seq, _states(kind, hx), params, has_biases, layers, dropout, train, bidir, None)
        return (out.transpose(0, 1) if batch_first else out, *finals)

    def _cell(self, kind: str, x: torch.Tensor, hx: Any, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih=None, b_hh=None):  # noqa: ANN001, ANN202
        state = tuple(hx) if kind == "lstm" else (hx,)
        new = _cell(kind, F.linear(x, w_ih, b_ih), F.linear(state[0], w_hh, b_hh), state, None)
        return new if kind == "lstm" else new[0]


def _index_select_as_gather(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0 or index.dim() != 1:
        return torch.index_select(x, dim, index)
    dim = dim % x.dim()
    index = index.to(torch.int64)  # index_select also takes int32 indices; gather does not
    shape = [index.shape[0] if d == dim else n for d, n in enumerate(x.shape)]
    view = [-1 if d == dim else 1 for d in range(x.dim())]
    return torch.gather(x, dim, index.view(view).expand(shape))


def _states(kind: str, hx: Any) -> list[torch.Tensor]:
    return list(hx) if kind == "lstm" else [hx]


@contextlib.contextmanager
def recurrent_ops() -> Iterator[None]:
    """While active, recurrent layers, cells and packed sequences run in the out-of-place,
    fixed-shape form described in the module docstring (same values and gradients as the
    fused kernels, up to rounding). Use around tracing only: the recurrence is unrolled in
    Python, one cell per time step."""
    with _RecurrentMode():
        yield
