"""Stage 3 of the pipeline: lower the rewritten graph through a ``torch.compile`` backend.

``backend="inductor"`` (the default of :func:`opake_compile.compile_dp`) generates C++/OpenMP
kernels on the CPU and Triton kernels on the GPU; ``"aot_eager"`` runs the same AOTAutograd
pipeline without code generation (cheap, for tests); ``None`` runs the FX graph as it is.
Shapes are static (the physical batch is padded to a fixed size), so each graph compiles once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from opake_compile.compiler.passes.numerics import check_gradual_underflow
from opake_compile.exceptions import ConfigurationError, UnsupportedOperationError

__all__ = ["CompileCounter", "lower"]


class CompileCounter:
    """Wraps a ``torch.compile`` backend and counts how often it compiles a graph. One counter
    per ``DPStep``: no process-global state."""

    def __init__(self, backend: str | Callable[..., Any]) -> None:
        if isinstance(backend, str):
            try:
                backend = torch._dynamo.lookup_backend(backend)
            except torch._dynamo.exc.InvalidBackend as err:
                raise ConfigurationError(
                    f"backend={backend!r} is not a torch.compile backend: use 'inductor', 'aot_eager', "
                    "another name torch._dynamo.list_backends() gives, a backend callable, or None."
                ) from err
        self.backend = backend
        self.count = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.count += 1
        return self.backend(gm, example_inputs)


class _LazyCompiled:
    """Compiles on the first call, with that call's inputs as the example inputs."""

    def __init__(self, gm: fx.GraphModule, backend: Callable[..., Any]) -> None:
        self.gm = gm
        self.backend = backend
        self.fn: Callable[..., Any] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.fn is None:
            try:
                self.fn = self.backend(self.gm, list(args))
            except UnsupportedOperationError:
                raise
            except Exception as err:  # noqa: BLE001 - re-raised with context, never swallowed
                raise UnsupportedOperationError(
                    f"The backend {_backend_name(self.backend)} could not compile the DP step's graph "
                    f"({type(err).__name__}: {err}). The graph itself is the reference path: run it "
                    "with backend='aot_eager' (or backend=None) to train this model now, and report "
                    "the model and this message."
                ) from err
            # A backend's compiled code may change the floating-point environment when it is
            # loaded (gcc links crtfastmath into code built with -ffast-math or
            # -funsafe-math-optimizations, e.g. Inductor with cpp.enable_unsafe_math_opt_flag:
            # flush-to-zero for the process). Checked before the graph runs: fails closed.
            check_gradual_underflow()
        return self.fn(*args)


def _backend_name(backend: Any) -> str:
    inner = backend.backend if isinstance(backend, CompileCounter) else backend
    return repr(getattr(inner, "__name__", type(inner).__name__))


def lower(gm: fx.GraphModule, backend: str | Callable[..., Any] | None, counter: CompileCounter | None = None) -> Callable[..., Any]:
    """Return a callable that runs ``gm`` through ``backend``.

    The graph is already a functional ATen graph with flat tensor inputs, so it goes straight
    to the backend's compiler entry point (``backend(gm, example_inputs)``) without Dynamo
    re-tracing it: no guards to evaluate per call and exactly one compilation per graph.

    Args:
        gm: the ATen graph after the passes.
        backend: a ``torch.compile`` backend name or callable, or ``None`` for no lowering.
        counter: optional :class:`CompileCounter` wrapping ``backend`` (used instead of it).
    """
    if backend is None:
        return gm
    target = counter if counter is not None else CompileCounter(backend)
    return _LazyCompiled(gm, target)
