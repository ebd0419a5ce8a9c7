"""The compiler: a batch loss in, a compiled per-example clipped-gradient step out.

Stages, one module each:

1. :mod:`.trace`  - ``make_fx`` of ``vmap(grad(per-example loss))`` over the trainable
   parameters: an ATen graph with materialised per-example gradients.
2. :mod:`.passes` - graph passes: clipping insertion (norms, clip factors, weighted sum), then
   algebraic rewrites that avoid materialising per-example gradients where they match.
3. :mod:`.lower`  - hand the rewritten graph to Inductor (or any ``torch.compile`` backend).

:mod:`.step` ties them together behind :func:`compile_dp`.
"""

from opake_compile.compiler.step import DPStep, DPStepResult, compile_dp

__all__ = ["DPStep", "DPStepResult", "compile_dp"]
