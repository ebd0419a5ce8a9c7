"""Pass interface and pipeline driver."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch.fx as fx

__all__ = ["PassReport", "GraphPass", "run_pipeline"]


@dataclasses.dataclass(frozen=True)
class PassReport:
    """What one pass did.

    Attributes:
        name: the pass name.
        modified: whether the graph changed.
        matches: rule name -> number of matches.
        coverage: parameter name -> path label (e.g. ``"materialized"``, ``"ghost:linear"``)
            for the parameters this pass decided.
        notes: parameter name -> why the pass left it alone (shown by ``DPStep.describe``).
        methods: parameter name -> what fixes its norm's value beyond rounding (the form of
            each block and its precisions); ``DPStep`` refuses graphs of one step that differ
            in it (an example's norm must not depend on the batch it came in).
    """

    name: str
    modified: bool
    matches: dict[str, int] = dataclasses.field(default_factory=dict)
    coverage: dict[str, str] = dataclasses.field(default_factory=dict)
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    methods: dict[str, str] = dataclasses.field(default_factory=dict)


class GraphPass(Protocol):
    name: str

    def __call__(self, gm: fx.GraphModule) -> PassReport: ...


def run_pipeline(gm: fx.GraphModule, passes: Sequence[Callable[[fx.GraphModule], PassReport]]) -> list[PassReport]:
    """Run ``passes`` in order on ``gm`` (in place), lint and recompile; return their reports."""
    reports = []
    for p in passes:
        report = p(gm)
        if report.modified:
            gm.graph.eliminate_dead_code()
            gm.graph.lint()
            gm.recompile()
        reports.append(report)
    return reports
