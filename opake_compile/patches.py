"""What ``compile_dp`` changes while it traces a loss, and the explicit global opt-in.

The compiler traces ``vmap(grad(per-example loss))`` into one static graph. Library model code
sometimes looks at tensor values in Python, or draws random numbers on the host, which a
static per-example graph cannot do. Seven patterns are handled while
:func:`~opake_compile.compile_dp` traces, and only then (every change is undone when tracing
returns or raises):

1. **Shortcuts that inspect data.** Code that checks a tensor's values to skip work that would
   not change the result (transformers 5 skips building the attention mask when
   ``attention_mask.all()``) is told that a graph is being compiled
   (``torch.compiler.is_compiling()`` is true while tracing, as under ``torch.export``), so it
   takes the branch that is valid for every value. The few library functions that do not
   consult that flag are shimmed (the *runtime patches* below) to answer "cannot skip" when
   the tensor they would inspect is batched by ``vmap``.
2. **In-place masked writes.** ``x[mask] = v`` with a boolean ``mask`` over the leading
   dimensions of ``x`` and a value ``v`` that is one element or one row (Wav2Vec2 zeroes its
   padded frames this way) is rewritten as ``x.copy_(torch.where(mask, v, x))``: the same
   values, without the data-dependent ``nonzero`` that ``vmap`` cannot batch. A write of
   per-example values into a tensor the model creates itself cannot be batched in place; the
   one such method of transformers' speech models (``_get_feature_vector_attention_mask``) is
   replaced, on the traced model's instances, by a functional one with the same values.
3. **LayerDrop** (Fan et al. 2019, "Reducing Transformer Depth on Demand with Structured
   Dropout"). A module in training mode whose ``forward`` loops over ``self.layers`` and skips a
   layer when a Python coin (``torch.rand([])``, NumPy's or the standard library's) falls below
   a positive probability, ``self.config.layerdrop`` (Wav2Vec2, HuBERT, ...) or
   ``self.layerdrop`` (BART, mBART, Marian, Pegasus, M2M100, Whisper, Speech2Text, ..., set from
   ``encoder_layerdrop``/``decoder_layerdrop``), is recognised from its source. While tracing,
   that probability reads 0 (the coin never skips) and every droppable layer's output becomes
   ``where(u_i >= p, layer(h), h)``, where ``u`` is a graph input drawn **once per logical
   batch** from the step's key (``InputLayout.batch_draws`` counts them; WavLM's first layer,
   which it never drops, is not gated). This is a documented exception to per-example
   randomness: the draw selects layers, not any example's data, and a non-private batch also
   draws it once for all its rows. Each layer's decision is drawn once per step, so a loss that
   runs the model twice drops the same layers in both runs. The probability is read when the
   loss is traced. A LayerDrop the graph cannot select is refused by name
   (:class:`~opake_compile.exceptions.UnsupportedOperationError`): layers kept in parallel lists
   (Flaubert, Informer's encoder) and layers whose output shape differs from their input
   (the speech models' adapters).
4. **SpecAugment** (Park et al. 2019, "SpecAugment: A Simple Data Augmentation Method for
   Automatic Speech Recognition"). transformers' speech models (Wav2Vec2 and the ten that copy
   its ``_mask_hidden_states``: HuBERT, WavLM, Data2VecAudio, SEW, SEW-D, UniSpeech, ...) draw
   their time and feature masks with NumPy on the host, which a graph would freeze into one
   mask for every step. While tracing, that method is replaced on the model's instances by one
   that draws the masks in the graph with the same distribution as ``_compute_mask_indices``
   (per-row span count with a random rounding, uniform span starts without replacement within
   the row's own length, spans of ``mask_length``), filling masked frames with the trainable
   ``masked_spec_embed`` through ``where`` and zeroing masked features. The draws are per
   example, like dropout's (``vmap(randomness="different")``, seeded from the step's key), and
   depend on that example's length only; transformers shares one rounding draw across the
   batch, which changes no example's mask distribution. Code that is not the recognised one
   (another transformers version) is refused by name when it would draw.

5. **CTC** (Graves et al. 2006, "Connectionist Temporal Classification"). PyTorch's
   ``ctc_loss`` kernel cannot be traced (its output shape depends on the target lengths'
   values) and has no ``vmap`` rule. While tracing, ``torch.nn.functional.ctc_loss`` and
   ``torch.ctc_loss`` are routed (a ``TorchFunctionMode``) to :func:`opake_compile._ctc.ctc_loss`:
   PyTorch's own kernel wrapped as custom ops with static output shapes and vmap rules (one
   kernel call per batch; the graph does not grow with the number of frames ``T``), or where
   it does not apply the forward recursion in log space unrolled over the frames (about 40
   graph nodes per frame); the kernel's values (``blank``, ``reduction``, ``zero_infinity``;
   padded targets, or concatenated ones where they are batched per example: concatenated
   targets outside the batch are refused, since each example, traced as a batch of one,
   would read the first example's labels; so is ``embedding_bag``'s flat 1-dim input outside
   the batch beside per-example offsets), lengths kept as tensors. What the eager kernel checks
   (class indices, lengths) is checked on the real batch before the step runs
   (:mod:`opake_compile.compiler._input_checks`). transformers' ``ForCTCLoss``
   (``model.loss_function`` of the ``*ForCTC`` heads) flattens the labels with a
   data-dependent ``masked_select``; the recognised code is replaced in ``LOSS_MAPPING`` by one
   that moves each row's kept labels to its front with a stable sort (the same targets, at a
   static shape). The heads' ``forward`` checks ``labels.max() >= config.vocab_size`` in
   Python; on the traced model's recognised ``*ForCTC`` instances (Wav2Vec2, HuBERT, WavLM,
   Data2VecAudio, SEW, SEW-D, UniSpeech, UniSpeechSat, Wav2Vec2-Conformer) ``forward`` runs the
   model without labels when they are batched and builds the loss from the logits exactly as
   transformers does. Under an eager ``vmap`` (``opake.verify``'s reference) the labels' values
   are real and transformers' check runs on the whole batch; in the traced graph they are not,
   so the check is registered with the compiled step instead, which runs it on the real labels
   of every chunk before anything runs (:mod:`opake_compile.compiler._input_checks`): a label
   ``>= config.vocab_size`` is refused with a ``ConfigurationError`` naming the model, the
   value and the vocabulary size, and nothing changes.

6. **Index ranges.** An eager ``embedding`` or ``cross_entropy`` refuses an index outside its
   table or class range; a compiled kernel may not (on a GPU it is a device-side assert that
   ends the process, on a CPU an error from inside the step). While tracing, the indices of
   ``F.embedding``, ``F.embedding_bag``, ``F.cross_entropy`` and ``F.nll_loss`` (class-index
   targets), ``gather`` and ``index_select`` that are computed from the batch arguments alone
   are registered as input checks
   (:mod:`opake_compile.compiler._input_checks`): a token id outside ``[0, num_embeddings)``
   or a target outside ``[0, C)`` (other than ``ignore_index``) is refused with a
   ``ConfigurationError`` naming the function, the value and the example, before the step
   runs. Indices the model computes (a codebook's ``argmin``) are in range by construction and
   are not checked.

7. **Sequence-first layouts.** ``compile_dp`` takes the batch along dim 0 of every batched
   argument. A ``batch_first=False`` recurrent layer or ``nn.MultiheadAttention`` (and the
   ``nn.Transformer*`` layers built on it) fed a ``(T, B, F)`` batch as it is would treat each
   time step as an example holding every sequence: no sequence's influence would be bounded by
   C. While tracing, such a layer whose per-example input is one time step of several
   sequences (a 3-d input of shape ``(1, S, F)``, S > 1: the trace of a split ``(T, B, F)``
   batch) is refused by name; a loss that transposes a ``(B, T, F)`` batch for it, or an
   example that runs its own several sequences over their time steps (a document's
   sentences), traces as before.

``apply_runtime_patches()`` installs the library shims of item 1 for the whole process (useful
when the model is run under ``vmap`` outside ``compile_dp``, e.g. by the eager reference
:func:`opake_compile.clipped_grad`); ``is_runtime_patched()`` says whether they are installed;
``remove_runtime_patches()`` restores the originals. Nothing is patched globally otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

from opake_compile.exceptions import UnsupportedOperationError

__all__ = ["apply_runtime_patches", "is_runtime_patched", "remove_runtime_patches", "tracing_patches"]


# ----------------------------------------------------------------------------- library shims
def _is_vmapped(t: Any) -> bool:
    """Whether ``t`` is a tensor batched by an enclosing ``vmap`` (its values are per example),
    under any number of other functorch wrappers (``grad`` levels)."""
    ft = torch._C._functorch
    while isinstance(t, torch.Tensor):
        if ft.is_batchedtensor(t):
            return True
        if not ft.is_functorch_wrapped_tensor(t):
            return False
        t = ft.get_unwrapped(t)
    return False


def _unwrapped(t: torch.Tensor) -> torch.Tensor:
    """The tensor under every functorch wrapper (``vmap`` and ``grad`` levels) of ``t``."""
    ft = torch._C._functorch
    while ft.is_functorch_wrapped_tensor(t) or ft.is_batchedtensor(t):
        t = ft.get_unwrapped(t)
    return t


def _cannot_skip_when_batched(original: Callable[..., bool]) -> Callable[..., bool]:
    """Wrap a transformers "can the mask be skipped?" predicate: with a padding mask that is
    batched by ``vmap`` the answer depends on each example's values, which a traced graph
    cannot branch on; answering ``False`` (build the explicit mask) is right for every value."""

    def predicate(padding_mask: Any = None, *args: Any, **kwargs: Any) -> bool:
        if _is_vmapped(padding_mask):
            return False
        return original(padding_mask, *args, **kwargs)

    predicate.__wrapped__ = original  # type: ignore[attr-defined]
    predicate.__name__ = getattr(original, "__name__", "predicate")
    predicate.__doc__ = getattr(original, "__doc__", None)
    predicate._opake_shim = True  # type: ignore[attr-defined]
    return predicate


# (module, attribute, wrapper factory): library functions whose behaviour depends on tensor
# values in a way that only shortcuts work. Missing modules or attributes are skipped.
_SHIMS: tuple[tuple[str, str, Callable[[Callable[..., Any]], Callable[..., Any]]], ...] = (
    ("transformers.masking_utils", "_ignore_bidirectional_mask_sdpa", _cannot_skip_when_batched),
    ("transformers.masking_utils", "_ignore_causal_mask_sdpa", _cannot_skip_when_batched),
)

_runtime_saved: list[tuple[Any, str, Any]] | None = None


def _install_shims(*, import_missing: bool) -> list[tuple[Any, str, Any]]:
    """Install every shim whose target exists; return ``(owner, name, original)`` to restore.
    Without ``import_missing`` only modules already imported are patched (tracing a plain
    torch model must not import transformers)."""
    saved = []
    for module_name, attr, factory in _SHIMS:
        owner = sys.modules.get(module_name)
        if owner is None and import_missing:
            try:
                owner = importlib.import_module(module_name)
            except Exception:  # noqa: BLE001 - an optional library that is absent or broken
                continue
        if owner is None:
            continue
        original = getattr(owner, attr, None)
        if original is None or getattr(original, "_opake_shim", False):
            continue
        saved.append((owner, attr, original))
        setattr(owner, attr, factory(original))
    return saved


def _restore(saved: list[tuple[Any, str, Any]]) -> None:
    for owner, attr, original in reversed(saved):
        setattr(owner, attr, original)


def apply_runtime_patches() -> None:
    """Install the library shims for the whole process (idempotent).

    ``compile_dp`` applies them by itself while it traces; call this only to run library
    models under ``vmap`` yourself (for instance with the eager :func:`opake_compile.clipped_grad`
    and a 2-D ``attention_mask``). Undo with :func:`remove_runtime_patches`. Library modules
    that cannot be imported are skipped.

    Example::

        >>> opake.patches.apply_runtime_patches()
        >>> opake.patches.is_runtime_patched()
        True
        >>> opake.patches.remove_runtime_patches()
    """
    global _runtime_saved
    if _runtime_saved is None:
        _runtime_saved = _install_shims(import_missing=True)


def remove_runtime_patches() -> None:
    """Restore the library functions that :func:`apply_runtime_patches` replaced."""
    global _runtime_saved
    if _runtime_saved is not None:
        _restore(_runtime_saved)
        _runtime_saved = None


def is_runtime_patched() -> bool:
    """Whether :func:`apply_runtime_patches` installed the shims (and they were not removed)."""
    return _runtime_saved is not None


# ----------------------------------------------------------------------------- masked writes
def _functional_masked_write(target: torch.Tensor, index: Any, value: Any) -> bool:
    """``target[index] = value`` as ``target.copy_(where(index, value, target))`` when ``index``
    is a boolean mask over leading dimensions and ``value`` is one element or one trailing row;
    returns whether it was rewritten."""
    if not (isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.dim() >= 1):
        return False
    k = index.dim()
    if tuple(index.shape) != tuple(target.shape[:k]):
        return False
    trailing = tuple(target.shape[k:])
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            value = value.reshape(())
        elif value.dim() > len(trailing) or _broadcast(tuple(value.shape), trailing) != trailing:
            # One value per selected element: cannot be placed without knowing how many there are.
            return False
        value = value.to(target.dtype)
    elif not isinstance(value, (bool, int, float)):
        return False
    cond = index.reshape(index.shape + (1,) * len(trailing))
    target.copy_(torch.where(cond, value, target))
    return True


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(torch.broadcast_shapes(a, b))
    except RuntimeError:
        return None


class _FunctionalMaskedWrites(TorchFunctionMode):
    """Rewrites ``x[bool_mask] = v`` functionally (see the module docstring, item 2)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.Tensor.__setitem__ and len(args) == 3 and not kwargs:
            if _functional_masked_write(*args):
                return None
        return func(*args, **kwargs)


# ----------------------------------------------------------------------------- LayerDrop
@dataclasses.dataclass
class _BatchDraws:
    """The per-logical-batch uniform draws (a graph input of shape ``(count,)``)."""

    count: int = 0
    values: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class _LayerDropSite:
    owner: Any  # the object holding the probability: the module or its config
    attr: str  # the probability's attribute on ``owner``
    probability: float
    layers: tuple[nn.Module, ...]  # the layers that are dropped (WavLM never drops its first)
    module: str  # the module's name in the model, for messages


@dataclasses.dataclass(frozen=True)
class _LayerDropKind:
    """How a class's ``forward`` draws LayerDrop over ``self.layers``, read from its source."""

    on_config: bool  # ``self.config.<attr>`` (Wav2Vec2) rather than ``self.<attr>`` (BART)
    attr: str  # ``layerdrop``, ``speech_encoder_layerdrop``, ...
    skip_first: bool  # ``i > 0 and ...``: the first layer is never dropped (WavLM)


# A host-side coin in Python: torch's, NumPy's or the standard library's.
_COIN = re.compile(r"torch\.rand\(|np\.random\.|numpy\.random\.|\brandom\.(?:uniform|random)\(")
_PROBABILITY = re.compile(r"\bself\.(config\.)?(\w*layerdrop)\b")
_LOOP_OVER_LAYERS = re.compile(r"\bfor\b[^\n]*\bin\s+(?:enumerate\()?self\.layers\b")
_FIRST_KEPT = re.compile(r"\b\w+\s*>\s*0\s+and\s+self\.(?:config\.)?\w*layerdrop\b")
_LAYERDROP_KIND: dict[type, _LayerDropKind | str | None] = {}


def _layerdrop_kind(cls: type) -> _LayerDropKind | str | None:
    """Whether ``cls.forward`` flips a LayerDrop coin in Python, read once per class from its
    source: ``None`` if it does not, a :class:`_LayerDropKind` if it is the pattern that can be
    selected in the graph (a loop over ``self.layers`` that skips a layer when a host draw is
    below one probability attribute: ``self.layerdrop`` as in BART, Whisper, Marian, ...,
    ``self.config.layerdrop`` as in Wav2Vec2), else the reason it cannot."""
    if cls not in _LAYERDROP_KIND:
        try:
            src = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            src = ""
        names = {(bool(m.group(1)), m.group(2)) for m in _PROBABILITY.finditer(src)}
        if not names or not _COIN.search(src):
            kind: _LayerDropKind | str | None = None
        elif len(names) > 1:
            kind = f"it reads several LayerDrop probabilities ({sorted(n for _, n in names)})"
        elif not _LOOP_OVER_LAYERS.search(src):
            kind = "its layers are not one `self.layers` list looped over in forward"
        else:
            on_config, attr = names.pop()
            kind = _LayerDropKind(on_config=on_config, attr=attr, skip_first=bool(_FIRST_KEPT.search(src)))
        _LAYERDROP_KIND[cls] = kind
    return _LAYERDROP_KIND[cls]


def _probability_of(mod: nn.Module, on_config: bool, attr: str) -> tuple[Any, float | None]:
    owner = getattr(mod, "config", None) if on_config else mod
    p = getattr(owner, attr, None)
    return owner, (float(p) if isinstance(p, (int, float)) and not isinstance(p, bool) else None)


def _layerdrop_sites(model: nn.Module) -> list[_LayerDropSite]:
    """Modules in training mode whose ``forward`` draws LayerDrop with a positive probability.

    Raises:
        UnsupportedOperationError: such a module draws it in a form that cannot be selected in
            the graph (named, with the probability to set to 0).
    """
    sites = []
    for name, mod in model.named_modules():
        kind = _layerdrop_kind(type(mod)) if mod.training else None
        if kind is None:
            continue
        where = f"'{name or '<root>'}' ({type(mod).__name__})"
        if isinstance(kind, str):
            probabilities = [
                (f"config.{attr}" if on_config else attr, p)
                for on_config, attr in sorted({(bool(m.group(1)), m.group(2)) for m in _PROBABILITY.finditer(inspect.getsource(type(mod).forward))})
                for _, p in [_probability_of(mod, on_config, attr)]
                if p is not None and p > 0
            ]
            if probabilities:
                raise UnsupportedOperationError(
                    f"Module {where} applies LayerDrop in training mode ({', '.join(f'{a}={p}' for a, p in probabilities)}) "
                    f"with a coin drawn in Python that compile_dp cannot move into the graph: {kind}. "
                    "Set that probability to 0 (or put the module in eval mode) to train it with compile_dp."
                )
            continue
        owner, p = _probability_of(mod, kind.on_config, kind.attr)
        layers = getattr(mod, "layers", None)
        if p is None or p <= 0:
            continue
        if not isinstance(layers, nn.ModuleList):
            raise UnsupportedOperationError(
                f"Module {where} applies LayerDrop in training mode ({kind.attr}={p}) over `self.layers`, which is "
                f"a {type(layers).__name__}, not an nn.ModuleList: compile_dp cannot gate its layers in the graph. "
                "Set that probability to 0 (or put the module in eval mode) to train it with compile_dp."
            )
        chosen = tuple(layers)[1:] if kind.skip_first else tuple(layers)
        sites.append(_LayerDropSite(owner=owner, attr=kind.attr, probability=p, layers=chosen, module=where))
    return sites


def _gated_forward(layer: nn.Module, draws: _BatchDraws, slot: int, p: float, where: str) -> Callable[..., Any]:
    forward = layer.forward

    def gated(*args: Any, **kwargs: Any) -> Any:
        hidden_states = args[0] if args else kwargs.get("hidden_states")
        out = forward(*args, **kwargs)
        u = draws.values
        if u is None:  # not inside the traced step (no draws): run the layer as built
            return out
        keep = u[slot] >= p
        first = out if isinstance(out, torch.Tensor) else (out[0] if isinstance(out, tuple) and out else None)
        if not isinstance(hidden_states, torch.Tensor) or not isinstance(first, torch.Tensor) or first.shape != hidden_states.shape:
            raise UnsupportedOperationError(
                f"LayerDrop of {where}: its layer {type(layer).__name__} does not map hidden states to hidden states "
                f"of the same shape (got {type(out).__name__}), so whether it ran cannot be selected in a static graph. "
                "Set that module's LayerDrop probability to 0 to train it with compile_dp."
            )
        if isinstance(out, torch.Tensor):
            return torch.where(keep, out, hidden_states)
        return (torch.where(keep, out[0], hidden_states), *out[1:])

    return gated


@contextlib.contextmanager
def _layerdrop_in_graph(model: nn.Module, draws: _BatchDraws) -> Iterator[None]:
    sites = _layerdrop_sites(model)
    saved_p: list[tuple[Any, str, float]] = []
    gated: list[tuple[nn.Module, Any]] = []
    try:
        slot = 0
        for site in sites:
            for layer in site.layers:
                gated.append((layer, layer.__dict__.get("forward", _NO_ATTR)))
                layer.forward = _gated_forward(layer, draws, slot, site.probability, f"{site.module} ({'' if isinstance(site.owner, nn.Module) else 'config.'}{site.attr}={site.probability})")
                slot += 1
        for site in sites:
            if not any(owner is site.owner and attr == site.attr for owner, attr, _ in saved_p):
                saved_p.append((site.owner, site.attr, getattr(site.owner, site.attr)))
                setattr(site.owner, site.attr, 0.0)  # the Python coin never skips a layer
        draws.count = slot
        yield
    finally:
        for owner, attr, p in reversed(saved_p):
            setattr(owner, attr, p)
        for layer, before in reversed(gated):
            if before is _NO_ATTR:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = before


_NO_ATTR = object()


def count_batch_draws(model: nn.Module) -> int:
    """How many per-logical-batch uniform draws tracing ``model`` needs (one per LayerDrop
    layer in training mode).

    Raises:
        UnsupportedOperationError: a module draws LayerDrop in a form that cannot be selected
            in the graph (see :func:`_layerdrop_sites`).
    """
    return sum(len(s.layers) for s in _layerdrop_sites(model))


# ----------------------------------------------------------------------------- method shims
def _feature_vector_attention_mask(mod: nn.Module) -> Callable[..., torch.Tensor]:
    """A functional ``_get_feature_vector_attention_mask`` for the speech models of transformers
    (Wav2Vec2 and its copies): theirs writes ones into a fresh ``zeros`` tensor at per-example
    indices, which ``vmap`` cannot do (the fresh tensor is not batched, the indices are). Same
    values: position ``t`` is attended iff ``t <= (length - 1) mod T`` (a length of 0 writes
    the last position there, so every position is attended, and so here)."""

    def get_mask(feature_vector_length: int, attention_mask: torch.Tensor, add_adapter: Any = None) -> torch.Tensor:
        lengths = attention_mask.cumsum(dim=-1)[:, -1]
        # HuBERT and some other copies take no ``add_adapter`` (nor pass one).
        extra = {} if add_adapter is None else {"add_adapter": add_adapter}
        lengths = mod._get_feat_extract_output_lengths(lengths, **extra).to(torch.long)
        last = torch.remainder(lengths - 1, feature_vector_length)
        positions = torch.arange(feature_vector_length, device=attention_mask.device)
        return positions[None, :] <= last[:, None]

    return get_mask


def _span_mask(
    batch: int, size: int, prob: float, span: int, min_spans: int, lengths: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """SpecAugment's random spans (Park et al. 2019, "SpecAugment: A Simple Data Augmentation
    Method for Automatic Speech Recognition"), drawn in the graph with the distribution of
    transformers' ``_compute_mask_indices``, independently for each row.

    Row ``i`` of length ``L_i`` (``lengths[i]``, or ``size`` without lengths) masks ``n_i`` spans
    of ``span`` positions: ``n_i = floor(prob * L_i / span + eps_i)`` with ``eps_i ~ U[0, 1)``, at
    least ``min_spans``, at most ``size // span`` spans when ``n_i * span > size``, and at most
    ``max(L_i - span + 1, 0)``; the span starts are a uniform sample without replacement of the
    valid starts ``0 .. L_i - span`` (uniform keys, the ``n_i`` smallest ranks), and each start
    covers ``span`` positions (a difference of cumulative sums). Like transformers, a row that
    draws no span while a full-length row would have (same ``eps_i``) masks position
    ``size - 1`` (a padded one). transformers draws one ``eps`` for the whole batch; here each
    row draws its own, so every row's mask has the same distribution as there but depends on
    nothing of the other rows (a per-example transform under ``vmap`` sees one row).

    Returns a bool tensor ``(batch, size)``. Raises ``ValueError`` as transformers does when
    ``span < 1`` or ``span > size``.
    """
    if span < 1:
        raise ValueError("`mask_length` has to be bigger than 0.")
    if span > size:
        raise ValueError(f"`mask_length` has to be smaller than `sequence_length`, but got `mask_length`: {span} and `sequence_length`: {size}`")
    starts_n = size - span + 1
    eps = torch.rand(batch, dtype=torch.float64, device=device)
    keys = torch.rand(batch, starts_n, device=device)
    full = torch.full((batch,), float(size), dtype=torch.float64, device=device)
    length = full if lengths is None else lengths.to(torch.float64)

    def num_spans(n_frames: torch.Tensor) -> torch.Tensor:
        n = torch.floor(prob * n_frames / span + eps).clamp_min(min_spans)
        n = torch.where(n * span > size, float(size // span), n)
        return torch.minimum(n, (n_frames - (span - 1)).clamp_min(0))

    n = num_spans(length)
    positions = torch.arange(starts_n, device=device)
    valid = positions[None, :] <= (length - span)[:, None]
    ranks = torch.where(valid, keys, 2.0).argsort(dim=-1).argsort(dim=-1)
    starts = (valid & (ranks < n[:, None])).to(torch.int32)
    counts = torch.nn.functional.pad(starts, (0, span - 1)).cumsum(dim=-1)  # (batch, size)
    before = torch.nn.functional.pad(counts, (span, 0))[:, :size]  # starts more than span-1 back
    mask = (counts - before) > 0
    dummy = (n == 0) & (num_spans(full) > 0)
    last = torch.arange(size, device=device) == size - 1
    return mask | (last[None, :] & dummy[:, None])


def _fingerprint(fn: Any) -> str:
    """A digest of a function's syntax tree without docstrings (comments and layout do not count)."""
    import ast
    import hashlib
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:16]


# (``_mask_hidden_states``, ``_compute_mask_indices``) fingerprints of the transformers code whose
# distribution ``_span_mask`` reproduces (Wav2Vec2 and the ten speech models that copy it,
# transformers 5). Other code is refused rather than guessed.
_KNOWN_SPEC_AUGMENT = frozenset({("487ca55588afe1c1", "574a9b55f067a14f")})
_SPEC_AUGMENT_KIND: dict[type, bool] = {}


def _is_known_spec_augment(cls: type) -> bool:
    if cls not in _SPEC_AUGMENT_KIND:
        try:
            method = cls._mask_hidden_states
            draw = method.__globals__["_compute_mask_indices"]
            _SPEC_AUGMENT_KIND[cls] = (_fingerprint(method), _fingerprint(draw)) in _KNOWN_SPEC_AUGMENT
        except Exception:  # noqa: BLE001 - no source, another structure: not recognised
            _SPEC_AUGMENT_KIND[cls] = False
    return _SPEC_AUGMENT_KIND[cls]


def _spec_augment_in_graph(mod: nn.Module) -> Callable[..., torch.Tensor]:
    """transformers' SpecAugment (``_mask_hidden_states``) with its masks drawn in the graph.

    transformers draws the masks with NumPy on the host, which a traced graph would freeze into
    one mask for every step. This replacement draws them with torch (:func:`_span_mask`, same
    distribution) inside the per-example transform, so, like dropout, each example draws its own
    mask from the step's key (``vmap(randomness="different")``), from its own length only. The
    time mask writes the trainable ``masked_spec_embed`` with ``where`` (its gradient is per
    example); the feature mask zeroes features. A ``_mask_hidden_states`` whose code is not the
    one recognised is refused by name (:class:`UnsupportedOperationError`) when it would draw.
    """
    original = mod._mask_hidden_states
    known = _is_known_spec_augment(type(mod))

    def mask_hidden_states(hidden_states: torch.Tensor, mask_time_indices: Any = None, attention_mask: Any = None) -> torch.Tensor:
        config = mod.config
        if not getattr(config, "apply_spec_augment", True):
            return hidden_states
        draws_time = mask_time_indices is None and config.mask_time_prob > 0 and mod.training
        draws_feature = config.mask_feature_prob > 0 and mod.training
        if not known and (draws_time or draws_feature):
            raise UnsupportedOperationError(
                f"{type(mod).__name__} applies SpecAugment in training mode (config.mask_time_prob="
                f"{config.mask_time_prob}, mask_feature_prob={config.mask_feature_prob}) with a "
                "_mask_hidden_states that compile_dp does not recognise (another transformers version?): its "
                "NumPy masks would be frozen into the graph. Set config.mask_time_prob = config.mask_feature_prob = 0 "
                "(or apply_spec_augment=False), or pass mask_time_indices drawn in your data pipeline."
            )
        if not known:
            return original(hidden_states, mask_time_indices=mask_time_indices, attention_mask=attention_mask)
        batch, frames, features = hidden_states.shape
        if mask_time_indices is not None or draws_time:
            embed = mod.masked_spec_embed.to(hidden_states.dtype)
        if mask_time_indices is not None:
            if mask_time_indices.dtype == torch.bool:
                hidden_states = torch.where(mask_time_indices[..., None], embed, hidden_states)
            else:  # transformers indexes with it as given
                hidden_states[mask_time_indices] = embed
        elif draws_time:
            lengths = None if attention_mask is None else attention_mask.sum(-1)
            time_mask = _span_mask(
                batch, frames, config.mask_time_prob, config.mask_time_length, config.mask_time_min_masks,
                lengths, hidden_states.device,
            )
            hidden_states = torch.where(time_mask[..., None], embed, hidden_states)
        if draws_feature:
            feature_mask = _span_mask(
                batch, features, config.mask_feature_prob, config.mask_feature_length, config.mask_feature_min_masks,
                None, hidden_states.device,
            )
            hidden_states = torch.where(feature_mask[:, None, :], 0.0, hidden_states)
        return hidden_states

    return mask_hidden_states


#: Fingerprints of Whisper's ``_mask_input_features`` (and the ``_compute_mask_indices`` it
#: calls) whose masks :func:`_whisper_spec_augment_in_graph` reproduces (transformers 5).
_KNOWN_INPUT_FEATURE_MASKS = frozenset({("48d5b2ce1e6b8c8b", "574a9b55f067a14f")})


def _whisper_spec_augment_in_graph(mod: nn.Module) -> Callable[..., torch.Tensor]:
    """Whisper's SpecAugment (``_mask_input_features``: zeroed frames and zeroed feature rows of
    the log-mel input) with its masks drawn in the graph, per example, as
    :func:`_spec_augment_in_graph` does for the wav2vec2 family. transformers draws them with
    NumPy, so a trace froze one mask into the graph for every example and every step (review:
    four steps gave bit-identical sums). Code not recognised is refused when it would draw."""
    original = mod._mask_input_features
    try:
        known = (_fingerprint(type(mod)._mask_input_features),
                 _fingerprint(type(mod)._mask_input_features.__globals__["_compute_mask_indices"])) in _KNOWN_INPUT_FEATURE_MASKS
    except Exception:  # noqa: BLE001 - no source, another structure: not recognised
        known = False

    def mask_input_features(input_features: torch.Tensor, attention_mask: Any = None) -> torch.Tensor:
        config = mod.config
        if not getattr(config, "apply_spec_augment", True) or not mod.training:
            return input_features
        draws_time, draws_feature = config.mask_time_prob > 0, config.mask_feature_prob > 0
        if not (draws_time or draws_feature):
            return input_features
        if not known:
            raise UnsupportedOperationError(
                f"{type(mod).__name__} applies SpecAugment in training mode (config.mask_time_prob="
                f"{config.mask_time_prob}, mask_feature_prob={config.mask_feature_prob}) with a "
                "_mask_input_features that compile_dp does not recognise (another transformers version?): its "
                "NumPy masks would be frozen into the graph. Set config.apply_spec_augment = False, or mask "
                "the features in your data pipeline."
            )
        batch, features, frames = input_features.shape
        if draws_time:
            lengths = None if attention_mask is None else attention_mask.sum(-1)
            time_mask = _span_mask(batch, frames, config.mask_time_prob, config.mask_time_length,
                                   config.mask_time_min_masks, lengths, input_features.device)
            input_features = torch.where(time_mask[:, None, :], 0.0, input_features)
        if draws_feature:
            feature_mask = _span_mask(batch, features, config.mask_feature_prob, config.mask_feature_length,
                                      config.mask_feature_min_masks, None, input_features.device)
            input_features = torch.where(feature_mask[:, :, None], 0.0, input_features)
        return input_features

    return mask_input_features


# (method name, the methods it needs, shim factory): methods replaced on the instances of the
# traced model that have them, as instance attributes, while tracing only.
_METHOD_SHIMS: tuple[tuple[str, tuple[str, ...], Callable[[nn.Module], Callable[..., Any]]], ...] = (
    ("_get_feature_vector_attention_mask", ("_get_feat_extract_output_lengths",), _feature_vector_attention_mask),
    ("_mask_hidden_states", ("_get_feat_extract_output_lengths",), _spec_augment_in_graph),
    ("_mask_input_features", (), _whisper_spec_augment_in_graph),
)


@contextlib.contextmanager
def _method_shims(model: nn.Module) -> Iterator[None]:
    done: list[tuple[nn.Module, str, Any]] = []
    try:
        for mod in model.modules():
            for name, needs, factory in _METHOD_SHIMS:
                if callable(getattr(mod, name, None)) and all(callable(getattr(mod, n, None)) for n in needs):
                    done.append((mod, name, mod.__dict__.get(name, _NO_ATTR)))
                    setattr(mod, name, factory(mod))
        yield
    finally:
        for mod, name, before in reversed(done):
            if before is _NO_ATTR:
                mod.__dict__.pop(name, None)
            else:
                mod.__dict__[name] = before


# ----------------------------------------------------------------------------- CTC
class _TraceableCTC(TorchFunctionMode):
    """Routes ``F.ctc_loss`` and ``torch.ctc_loss`` to :func:`opake_compile._ctc.ctc_loss` (same
    values, plain tensor operations) while tracing (see the module docstring, item 5)."""

    _REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # torch.ctc_loss takes the enum

    _NAMES = ("log_probs", "targets", "input_lengths", "target_lengths", "blank", "reduction", "zero_infinity")

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.nn.functional.ctc_loss or func is torch.ctc_loss:
            from opake_compile._ctc import ctc_loss

            bound = dict(zip(self._NAMES, args), **kwargs)
            _refuse_shared_concatenated_targets(bound.get("log_probs"), bound.get("targets"))
            if func is torch.ctc_loss:
                bound["reduction"] = self._REDUCTIONS[int(bound.get("reduction", 1))]
            return ctc_loss(**bound)
        if func is torch.nn.functional.embedding_bag:
            bound = dict(zip(("input", "weight", "offsets"), args), **kwargs)
            _refuse_shared_bag_input(bound.get("input"), bound.get("offsets"))
        return func(*args, **kwargs)


def _refuse_shared_bag_input(tokens: Any, offsets: Any) -> None:
    """``embedding_bag`` in its flat form (1-dim input, per-bag offsets) with the flat input
    outside the batch and the offsets in it: each example, traced as a batch of one, reads the
    shared input from its own offset to the end, that is other examples' tokens (offsets of 0
    moved the clipped sum by 2.24 C at 5 examples; other offsets failed in the kernel)."""
    if (isinstance(tokens, torch.Tensor) and tokens.dim() == 1 and isinstance(offsets, torch.Tensor)
            and _is_vmapped(offsets) and not _is_vmapped(tokens)):
        raise UnsupportedOperationError(
            "embedding_bag with a flat 1-dim input passed outside batch_argnums and per-example offsets: "
            "each example would read the shared input from its offset to the end, other examples' tokens "
            "included. Pass the bags as a batched 2-dim input, one row per example, padded with padding_idx "
            "(nn.EmbeddingBag(..., padding_idx=p)), or per-example per_sample_weights of 0 on the padding."
        )


def _refuse_shared_concatenated_targets(log_probs: Any, targets: Any) -> None:
    """Targets outside the batch, beside per-example log-probabilities: each example is traced
    as a batch of one, so every example read the start of the shared targets. Concatenated
    ones gave every example the first example's labels (review: removing it moved the clipped
    sum by 4.0 C at 6 examples, and ``opake.verify`` agreed, removing rows of batched arguments
    only); padded ones the same (a second review: one example's norm moved from 23.4 to 18.8
    when another was removed). One row of targets shared by every example is public and kept."""
    if (isinstance(targets, torch.Tensor) and isinstance(log_probs, torch.Tensor) and log_probs.dim() == 3
            and _is_vmapped(log_probs) and not _is_vmapped(targets) and (targets.dim() == 1 or targets.shape[0] != 1)):
        raise UnsupportedOperationError(
            f"ctc_loss with targets of shape {tuple(targets.shape)} passed outside batch_argnums, beside "
            "per-example log-probabilities: each example, traced as a batch of one, would read the first "
            "row of the whole batch's targets (concatenated targets: the first example's labels; padded "
            "ones: another example's row, so that one example's labels move the others' gradients). Pass "
            "the targets padded, one row per example ((N, S), entries past each target length ignored), "
            "as a batched argument."
        )


# ----------------------------------------------------------------------------- sequence-first layers
@contextlib.contextmanager
def _one_sequence_per_example(model: nn.Module) -> Iterator[None]:
    """Forward pre-hooks on the ``batch_first=False`` sequence layers of ``model`` refusing a
    per-example input that holds several sequences (see the module docstring, item 7)."""
    handles = []

    def check(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs.get("input", kwargs.get("query"))
        # A (T, B, F) batch split along dim 0 reaches the layer as one time step holding every
        # sequence: (1, B, F). Several sequences of one example (a document's sentences) run
        # over their own time steps and pass.
        if isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[0] == 1 and x.shape[1] != 1:
            raise UnsupportedOperationError(
                f"{type(mod).__name__} (batch_first=False) sees {x.shape[1]} sequences in one example's "
                f"forward: its input {tuple(x.shape)} is read as (T, B, F), but compile_dp takes the "
                "batch along dim 0 of every argument, so each 'example' would hold every sequence and "
                "no sequence's influence would be bounded by the clipping norm. Pass batches as "
                "(B, T, F) and build the layer with batch_first=True (or transpose inside the loss)."
            )

    try:
        for mod in model.modules():
            if isinstance(mod, (nn.RNNBase, nn.MultiheadAttention)) and not getattr(mod, "batch_first", True):
                handles.append(mod.register_forward_pre_hook(check, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- index ranges
class _IndexRanges(TorchFunctionMode):
    """Registers the index ranges of embedding lookups and class-index losses as input checks
    of the compiled step while tracing (see the module docstring, item 6)."""

    _SIGNATURES: dict[Any, inspect.Signature] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in _INDEXED:
            sig = self._SIGNATURES.get(func)
            if sig is None:
                gather = _INDEXED[func] is _gather_indices
                sig = self._SIGNATURES[func] = _GATHER_SIGNATURE if gather else inspect.signature(func)
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                bound = None  # the call itself is malformed: torch raises its own error below
            if bound is not None:
                _INDEXED[func](func.__name__, bound.arguments, sig)
        return func(*args, **kwargs)


def _arg(arguments: dict[str, Any], sig: inspect.Signature, name: str) -> Any:
    return arguments[name] if name in arguments else sig.parameters[name].default


def _check_indices(value: Any, what: str, size: int, *, ignore: int | None = None, hint: str = "") -> None:
    from opake_compile.compiler._input_checks import range_test, require

    if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool:
        require(value, range_test(what, 0, size - 1, ignore=ignore, hint=hint), f"{what} in [0, {size})", quiet=True)


def _embedding_indices(name: str, arguments: dict[str, Any], sig: inspect.Signature) -> None:
    weight = _arg(arguments, sig, "weight")
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        rows = int(weight.shape[0])
        _check_indices(_arg(arguments, sig, "input"), f"{name}: index", rows, hint=f" (the table has {rows} rows)")


def _class_targets(name: str, arguments: dict[str, Any], sig: inspect.Signature) -> None:
    logits, target = _arg(arguments, sig, "input"), _arg(arguments, sig, "target")
    if not isinstance(logits, torch.Tensor) or logits.dim() == 0:
        return
    classes = int(logits.shape[0] if logits.dim() == 1 else logits.shape[1])
    ignore = int(_arg(arguments, sig, "ignore_index"))
    _check_indices(target, f"{name}: target class", classes, ignore=ignore, hint=f" ({classes} classes, ignore_index {ignore})")


def _gather_indices(name: str, arguments: dict[str, Any], sig: inspect.Signature) -> None:
    source, dim, index = (_arg(arguments, sig, k) for k in ("input", "dim", "index"))
    if isinstance(source, torch.Tensor) and isinstance(dim, int) and source.dim() > 0:
        size = int(source.shape[dim])
        _check_indices(index, f"{name}: index", size, hint=f" (dimension {dim} has {size} entries)")


# function -> handler(name, bound arguments, signature): registers the checks of one call
_INDEXED: dict[Any, Callable[[str, dict[str, Any], inspect.Signature], None]] = {
    torch.nn.functional.embedding: _embedding_indices,
    torch.nn.functional.embedding_bag: _embedding_indices,
    torch.nn.functional.cross_entropy: _class_targets,
    torch.nn.functional.nll_loss: _class_targets,
    torch.gather: _gather_indices,
    torch.Tensor.gather: _gather_indices,
    torch.index_select: _gather_indices,
    torch.Tensor.index_select: _gather_indices,
}
# Methods and builtins without a signature torch can report: (input, dim, index) positionally.
_GATHER_SIGNATURE = inspect.Signature(
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in ("input", "dim", "index")]
    + [inspect.Parameter("sparse_grad", inspect.Parameter.KEYWORD_ONLY, default=False),
       inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY, default=None)]
)


def _traceable_for_ctc_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    logit_lengths: torch.Tensor,
    blank_token_id: int,
    reduction: str = "mean",
    zero_infinity: bool = False,
    ignore_index: int = -100,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' ``ForCTCLoss`` without its data-dependent ``masked_select``: the labels kept
    (neither ``ignore_index`` nor blank) are moved to the front of each row by a stable sort,
    in order, and passed as padded targets with their counts as target lengths: the same
    targets as the flattened ones, at a static shape."""
    from opake_compile._ctc import ctc_loss

    labels = labels.to(logits.device)
    keep = (labels != ignore_index) & (labels != blank_token_id)
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True)
    targets = labels.gather(-1, order)
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    return ctc_loss(
        log_probs, targets, logit_lengths, keep.sum(-1), blank=blank_token_id, reduction=reduction, zero_infinity=zero_infinity
    )


# Fingerprints of transformers' ``ForCTCLoss`` that ``_traceable_for_ctc_loss`` reproduces.
_KNOWN_FOR_CTC_LOSS = frozenset({"c4b0ad3699b48e2c"})


@contextlib.contextmanager
def _traceable_loss_mapping() -> Iterator[None]:
    """Replace transformers' ``LOSS_MAPPING["ForCTC"]`` (what ``model.loss_function`` returns for
    the ``*ForCTC`` heads) by :func:`_traceable_for_ctc_loss` if it is the recognised code."""
    mapping_module = sys.modules.get("transformers.loss.loss_utils")
    mapping = getattr(mapping_module, "LOSS_MAPPING", None)
    original = mapping.get("ForCTC") if isinstance(mapping, dict) else None
    try:
        known = original is not None and _fingerprint(original) in _KNOWN_FOR_CTC_LOSS
    except Exception:  # noqa: BLE001 - no source: not recognised, left as it is
        known = False
    if known:
        mapping["ForCTC"] = _traceable_for_ctc_loss
    try:
        yield
    finally:
        if known:
            mapping["ForCTC"] = original


# transformers' ``*ForCTC.forward`` (Wav2Vec2, HuBERT, WavLM, Data2VecAudio, SEW, SEW-D,
# UniSpeech, UniSpeechSat, Wav2Vec2-Conformer): the label check and the loss it builds.
_CTC_HEAD_LINES = (
    "if labels is not None and labels.max() >= self.config.vocab_size:",
    "input_lengths = self._get_feat_extract_output_lengths(attention_mask.sum(-1)).to(torch.long)",
    "blank_token_id=self.config.pad_token_id, reduction=self.config.ctc_loss_reduction, "
    "zero_infinity=self.config.ctc_zero_infinity,",
)
_CTC_HEAD_KIND: dict[type, bool] = {}


def _is_ctc_head(cls: type) -> bool:
    if cls not in _CTC_HEAD_KIND:
        try:
            src = " ".join(inspect.getsource(cls.forward).split())
        except (OSError, TypeError):
            src = ""
        _CTC_HEAD_KIND[cls] = all(line in src for line in _CTC_HEAD_LINES)
    return _CTC_HEAD_KIND[cls]


def _label_check(model: str, vocab_size: int) -> Callable[[torch.Tensor, int], str | None]:
    """transformers' ``labels.max() >= config.vocab_size`` test on real label rows, as an input
    check of the compiled step (:func:`opake_compile.compiler._input_checks.require`)."""

    def test(rows: torch.Tensor, first_row: int) -> str | None:
        if rows.numel() == 0:
            return None
        flat = rows.reshape(rows.shape[0], -1)
        worst = flat.max(dim=1).values
        if not bool((worst >= vocab_size).any()):
            return None
        row = int(torch.argmax((worst >= vocab_size).to(torch.int8)))
        return (
            f"{model}: label value {int(worst[row])} in example {first_row + row} of the batch is outside "
            f"the vocabulary (labels must be < config.vocab_size = {vocab_size}, or -100 for padding)."
        )

    return test


def _ctc_head_forward(mod: nn.Module) -> Callable[..., Any]:
    """A recognised ``*ForCTC.forward`` whose label check is skipped when the labels are batched
    by ``vmap`` (their values are per example: a Python ``if`` on them cannot be traced). The
    model runs without labels and the loss is built from its logits exactly as transformers
    does (input lengths from the attention mask, ``self.loss_function`` with the config's blank,
    reduction and ``zero_infinity``). transformers' label check is registered as an input check
    of the compiled step (:mod:`opake_compile.compiler._input_checks`): a batch with a label
    ``>= config.vocab_size`` is refused with a ``ConfigurationError`` before the step runs."""
    forward = mod.forward

    def ctc_forward(input_values: Any = None, attention_mask: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        if labels is None or not _is_vmapped(labels):
            return forward(input_values, attention_mask=attention_mask, labels=labels, **kwargs)
        whole = _unwrapped(labels)
        if not is_fake(whole) and bool(whole.max() >= mod.config.vocab_size):
            # Real values under an eager ``vmap`` (``opake.verify``): transformers' check, on the batch.
            raise ValueError(f"Label values must be <= vocab_size: {mod.config.vocab_size}")
        if is_fake(whole):
            # Traced: the compiled step runs transformers' check on the real labels first.
            from opake_compile.compiler._input_checks import require

            require(labels, _label_check(type(mod).__name__, int(mod.config.vocab_size)), "labels < config.vocab_size")
        out = forward(input_values, attention_mask=attention_mask, **kwargs)
        logits = out.logits if not isinstance(out, tuple) else out[0]
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_values, dtype=torch.long)
        input_lengths = mod._get_feat_extract_output_lengths(mask.sum(-1)).to(torch.long)
        config = mod.config
        loss = mod.loss_function(
            logits=logits, labels=labels, logit_lengths=input_lengths, blank_token_id=config.pad_token_id,
            reduction=config.ctc_loss_reduction, zero_infinity=config.ctc_zero_infinity, **kwargs,
        )
        if isinstance(out, tuple):
            return (loss, *out)
        return type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})

    return ctc_forward


@contextlib.contextmanager
def _ctc_heads(model: nn.Module) -> Iterator[None]:
    done: list[tuple[nn.Module, Any]] = []
    try:
        for mod in model.modules():
            if _is_ctc_head(type(mod)):
                done.append((mod, mod.__dict__.get("forward", _NO_ATTR)))
                mod.forward = _ctc_head_forward(mod)
        yield
    finally:
        for mod, before in reversed(done):
            if before is _NO_ATTR:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = before


# ----------------------------------------------------------------------------- the scope
@contextlib.contextmanager
def tracing_patches(model: nn.Module, draws: _BatchDraws | None = None) -> Iterator[_BatchDraws]:
    """Everything :func:`~opake_compile.compile_dp` changes while tracing ``model`` (see the
    module docstring), undone on exit whether tracing returned or raised.

    Yields the :class:`_BatchDraws` holder: set ``values`` to the graph input of shape
    ``(count,)`` (uniform on [0, 1), drawn once per logical batch) before the model runs.
    """
    draws = _BatchDraws() if draws is None else draws
    with contextlib.ExitStack() as stack:
        saved = _install_shims(import_missing=False)
        stack.callback(_restore, saved)
        stack.enter_context(_layerdrop_in_graph(model, draws))
        stack.enter_context(_method_shims(model))
        stack.enter_context(_ctc_heads(model))
        stack.enter_context(_traceable_loss_mapping())
        stack.enter_context(_TraceableCTC())
        stack.enter_context(_IndexRanges())
        stack.enter_context(_one_sequence_per_example(model))
        stack.enter_context(_compiling_flag())
        stack.enter_context(_FunctionalMaskedWrites())
        yield draws


@contextlib.contextmanager
def _compiling_flag() -> Iterator[None]:
    """``torch.compiler.is_compiling()`` is true inside (as under ``torch.export``'s tracing)."""
    import torch.compiler as tc

    old = tc._is_compiling_flag
    tc._is_compiling_flag = True
    try:
        yield
    finally:
        tc._is_compiling_flag = old
