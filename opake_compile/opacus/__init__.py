"""Opacus migration: run an Opacus training script on opake_compile by changing its imports.

Replace ``from opacus import PrivacyEngine`` (and friends) with the same names from
``opake_compile.opacus``; the ordinary eager loop ``loss = criterion(model(x), y);
loss.backward(); optimizer.step(); optimizer.zero_grad()`` then runs ``compile_dp`` (per-example
clipping in a compiled graph) and :class:`opake_compile.DPOptimizer` (noise, accounting)
underneath. See ``docs/migrating-from-opacus.md`` for the side-by-side table and the real
differences.

Names provided:

- :class:`PrivacyEngine`: ``make_private``, ``make_private_with_epsilon``, ``get_epsilon``,
  ``accountant`` (``get_epsilon``, ``len``, ``mechanism``), ``is_compatible``, ``validate``;
  ``accountant="prv"`` maps to our PLD accountant, ``"rdp"`` to RDP.
- :class:`BatchMemoryManager`: physical batches within one Poisson draw (maps onto
  ``compile_dp``'s ``physical_batch_size``).
- :class:`ModuleValidator`: ``validate``, ``is_valid``, ``fix`` (BatchNorm -> GroupNorm as
  Opacus), ``fix_and_validate``.
- :class:`PrivateModule`, :class:`DPOptimizer`, :class:`DPDataLoader`: the objects
  ``make_private`` returns (Opacus's ``GradSampleModule``, ``DPOptimizer``, ``DPDataLoader``).
- :class:`GradSampleModule`, :func:`register_grad_sampler`: refused with the alternative
  (Opacus's hooks and custom grad samplers have no counterpart: per-example gradients are
  never stored on parameters).

Refused at ``make_private`` (``UnsupportedOperationError`` naming the Opacus feature and the
alternative): per-layer and adaptive clipping, ``secure_mode`` (at ``PrivacyEngine()``), grad
sample modes other than hooks/ghost, ``poisson_sampling=False``, ``batch_first=False``,
``wrap_model=False``, distributed modules, modules ``ModuleValidator`` rejects. Refused at
``loss.backward()``: losses that mix examples or do not use the declared ``loss_reduction``,
gradient accumulation across Poisson draws, a second backward on the same forward.
"""

from opake_compile.opacus._engine import (
    BatchMemoryManager,
    DPDataLoader,
    DPOptimizer,
    GradSampleModule,
    PrivacyEngine,
    PrivateModule,
    register_grad_sampler,
)
from opake_compile.opacus._validator import ModuleValidator

__all__ = [
    "PrivacyEngine",
    "BatchMemoryManager",
    "ModuleValidator",
    "PrivateModule",
    "DPOptimizer",
    "DPDataLoader",
    "GradSampleModule",
    "register_grad_sampler",
]
