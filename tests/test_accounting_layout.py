"""The ``opake_compile.accounting`` package: layered modules, no import cycles, stable names."""

from __future__ import annotations

import ast
import importlib
import pathlib

import opake_compile
from opake_compile import accounting as acc
from opake_compile.dpsgd import accounting as dpsgd_acc

PACKAGE = pathlib.Path(opake_compile.__file__).parent / "accounting"
# Each module may import only modules of a lower layer (listed first).
LAYERS = ["_bridge", "_fdp", "_budgets", "_accountant", "_process", "_mechanisms", "_matrix", "_calibration", "__init__"]


def _internal_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.startswith("opake_compile.accounting."):
                found.add(name.split(".")[2])
    return found


def test_modules_are_layered_without_cycles():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert set(modules) <= set(LAYERS), f"new module {set(modules) - set(LAYERS)}: place it in LAYERS"
    for name in modules:
        for dep in _internal_imports(PACKAGE / f"{name}.py") & set(LAYERS):
            assert LAYERS.index(dep) < LAYERS.index(name), f"{name} imports {dep}, a layer above it"


def test_public_names_are_kept_and_shared():
    for name in (
        "gaussian", "poisson", "eps_delta", "identity", "nonprivate", "dpsgd_step_process", "calibrate",
        "epsilon_budget", "delta_budget", "Accountant", "PrivacyProcess", "CalibrationResult",
        "adaclip", "parallel_poisson", "advantage_budget", "beta_budget", "risk_budget",
    ):
        assert hasattr(acc, name) and name in acc.__all__
    for name in dpsgd_acc.__all__:
        assert getattr(dpsgd_acc, name) is getattr(acc, name)
    for name in acc.__all__:
        assert getattr(acc, name).__module__.startswith("opake_compile.accounting")
    assert importlib.import_module("opake_compile.accounting") is acc
