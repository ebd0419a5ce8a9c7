"""Load a script from ``examples/`` as a module, so tests call its functions directly."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(filename: str, module_name: str) -> ModuleType:
    """``examples/<filename>`` imported under ``module_name`` (registered in ``sys.modules``:
    dataclasses resolve annotations through it)."""
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / filename)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
