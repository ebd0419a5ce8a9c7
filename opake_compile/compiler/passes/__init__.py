"""Stage 2 of the pipeline: graph passes on the per-example gradient graph.

The pipeline always starts with :func:`~opake_compile.compiler.passes.clip.insert_clipping`,
which turns the materialised per-example gradients into per-example norms, the clip factor
``min(1, C / ||g_i||)`` (zero for padded or non-finite examples) and the weighted sum. Later
passes are algebraic rewrites that replace, parameter by parameter, the ``sq_norm`` and
``clipped_sum`` nodes the clip pass tagged, so that the per-example gradient is never
materialised (ghost norms, book-keeping). Each pass returns a :class:`PassReport`.
"""

from __future__ import annotations

from opake_compile.compiler.passes._base import GraphPass, PassReport, run_pipeline
from opake_compile.compiler.passes.clip import insert_clipping

__all__ = ["GraphPass", "PassReport", "run_pipeline", "insert_clipping"]

