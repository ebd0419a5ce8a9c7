"""``ModuleValidator``: Opacus's module check and fix, against what ``compile_dp`` refuses."""

from __future__ import annotations

import copy
import math

import torch.nn as nn

from opake_compile.exceptions import UnsupportedOperationError

__all__ = ["ModuleValidator"]

_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


class ModuleValidator:
    """Opacus's ``ModuleValidator``: which modules DP training refuses, and a fixed copy.

    What is reported (each as an :class:`UnsupportedOperationError` naming the module):

    ============================================ ===============================================
    module                                       why, and what :meth:`fix` does
    ============================================ ===============================================
    ``BatchNorm1d/2d/3d``, ``SyncBatchNorm``     batch statistics mix examples (and the running
                                                 statistics would record every example); fix:
                                                 ``GroupNorm(gcd(32, C), C)`` as Opacus does,
                                                 ``InstanceNorm`` with ``replace_bn_with_in=True``
    ``InstanceNorm*`` with running statistics    the running-statistics buffers are updated
                                                 from every example without noise; fix:
                                                 ``track_running_stats=False``
    modules with backward hooks                  ``register_full_backward_hook`` (and Opacus's
                                                 ``GradSampleModule`` hooks) do not run inside
                                                 the compiled per-example graph; no fix
    an Opacus ``GradSampleModule``               already wrapped by Opacus; pass the inner
                                                 module (no fix)
    no trainable parameter                       nothing to train privately (no fix)
    ============================================ ===============================================

    Operations that cannot be made per-example are found when the loss is traced (the first
    ``loss.backward()``), with the op named in the error.

    Example::

        >>> model = ModuleValidator.fix(nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8)))
        >>> ModuleValidator.validate(model, strict=True)
        []
    """

    @staticmethod
    def validate(module: nn.Module, *, strict: bool = False) -> list[UnsupportedOperationError]:
        """The problems of ``module`` as a list of errors (empty: valid).

        Args:
            module: the model to check.
            strict: raise the first problem (all of them in its message) instead of returning.

        Raises:
            UnsupportedOperationError: ``strict=True`` and the list is not empty.
        """
        errors: list[UnsupportedOperationError] = []
        if type(module).__module__.startswith("opacus"):
            errors.append(
                UnsupportedOperationError(
                    f"The module is an Opacus {type(module).__name__}: Opacus's GradSampleModule "
                    "hooks are not used here. Pass the plain nn.Module; per-example gradients "
                    "come from compile_dp's traced graph."
                )
            )
        for name, mod in module.named_modules():
            where = f"Module {name or '<root>'!r} ({type(mod).__name__})"
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                errors.append(
                    UnsupportedOperationError(
                        f"{where}: BatchNorm normalises with the statistics of the batch, which "
                        "mixes examples, so per-example gradients are not defined. Replace it with "
                        "GroupNorm (ModuleValidator.fix does) or LayerNorm."
                    )
                )
            elif isinstance(mod, _INSTANCE_NORMS) and mod.track_running_stats:
                errors.append(
                    UnsupportedOperationError(
                        f"{where}: track_running_stats=True updates the running statistics from "
                        "every example without noise. Use track_running_stats=False "
                        "(ModuleValidator.fix does)."
                    )
                )
            if getattr(mod, "_backward_hooks", None) or getattr(mod, "_backward_pre_hooks", None):
                errors.append(
                    UnsupportedOperationError(
                        f"{where} has backward hooks (register_full_backward_hook, or Opacus "
                        "GradSampleModule hooks used directly): they do not run inside the compiled "
                        "per-example graph. Remove them; compile_dp computes per-example gradients "
                        "from the traced graph."
                    )
                )
        if not any(p.requires_grad for p in module.parameters()):
            errors.append(UnsupportedOperationError("The module has no trainable parameter (requires_grad=True)."))
        if strict and errors:
            raise UnsupportedOperationError(
                "The module cannot be trained with DP-SGD as it is:\n  " + "\n  ".join(str(e) for e in errors)
            )
        return errors

    @staticmethod
    def is_valid(module: nn.Module) -> bool:
        """``True`` when :meth:`validate` finds nothing."""
        return not ModuleValidator.validate(module)

    @staticmethod
    def fix(module: nn.Module, **kwargs) -> nn.Module:
        """A copy of ``module`` with BatchNorm replaced and InstanceNorm statistics switched off.

        Args:
            module: the model; it is not modified.
            num_groups: GroupNorm groups for every replaced BatchNorm (default
                ``gcd(32, num_features)``, as Opacus).
            replace_bn_with_in: replace BatchNorm with InstanceNorm instead of GroupNorm.

        Returns:
            The fixed copy (the same type as ``module`` when the root itself is not replaced).

        Raises:
            UnsupportedOperationError: an unknown keyword, or both ``num_groups`` and
                ``replace_bn_with_in``.
        """
        unknown = set(kwargs) - {"num_groups", "replace_bn_with_in"}
        if unknown:
            raise UnsupportedOperationError(f"ModuleValidator.fix got unknown keyword(s) {sorted(unknown)}.")
        num_groups = kwargs.get("num_groups")
        to_in = bool(kwargs.get("replace_bn_with_in", False))
        if to_in and num_groups is not None:
            raise UnsupportedOperationError("num_groups and replace_bn_with_in=True are mutually exclusive.")
        module = copy.deepcopy(module)

        def replacement(mod: nn.Module) -> nn.Module | None:
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                c = mod.num_features
                if to_in:
                    dims = {nn.BatchNorm1d: nn.InstanceNorm1d, nn.BatchNorm3d: nn.InstanceNorm3d}
                    cls = next((v for k, v in dims.items() if isinstance(mod, k)), nn.InstanceNorm2d)
                    new = cls(c, affine=mod.affine)
                else:
                    new = nn.GroupNorm(num_groups or math.gcd(32, c), c, affine=mod.affine)
            elif isinstance(mod, _INSTANCE_NORMS) and mod.track_running_stats:
                new = type(mod)(mod.num_features, eps=mod.eps, momentum=mod.momentum, affine=mod.affine, track_running_stats=False)
                if mod.affine:
                    new.load_state_dict({"weight": mod.weight.detach(), "bias": mod.bias.detach()}, strict=False)
            else:
                return None
            p = next(mod.parameters(), None)
            return new.to(p.device) if p is not None else new

        root = replacement(module)
        if root is not None:
            return root
        for name, mod in list(module.named_modules()):
            for child_name, child in list(mod.named_children()):
                new = replacement(child)
                if new is not None:
                    setattr(mod, child_name, new)
        return module

    @staticmethod
    def fix_and_validate(module: nn.Module, **kwargs) -> nn.Module:
        """:meth:`fix`, then :meth:`validate` with ``strict=True``."""
        module = ModuleValidator.fix(module, **kwargs)
        ModuleValidator.validate(module, strict=True)
        return module
