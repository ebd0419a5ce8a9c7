"""Shared configuration of the Hypothesis suites."""

# --- tests/ on sys.path, so property tests share the model factories of tests/_models.py ---
import pathlib as _pathlib
import sys as _sys

_TESTS_DIR = str(_pathlib.Path(__file__).resolve().parent.parent / "tests")
if _TESTS_DIR not in _sys.path:
    _sys.path.insert(0, _TESTS_DIR)
