"""DP-SGD building blocks: per-example clipping, Gaussian noise, and the accounting re-exports."""

from opake_compile.dpsgd import accounting, clipping, noise
from opake_compile.dpsgd._types import ClippedPytree, NoisedPytree
from opake_compile.dpsgd.clipping import (
    adaptive_clipped_grad,
    auto_clipped_grad,
    clip_pytree,
    clipped_fun,
    clipped_grad,
)
from opake_compile.dpsgd.noise import gaussian_noise

__all__ = [
    "accounting",
    "clipping",
    "noise",
    "ClippedPytree",
    "NoisedPytree",
    "clip_pytree",
    "clipped_grad",
    "clipped_fun",
    "adaptive_clipped_grad",
    "auto_clipped_grad",
    "gaussian_noise",
]
