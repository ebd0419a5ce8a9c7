"""Shared configuration of the Hypothesis suites."""

# --- tests/ on sys.path, so property tests share the model factories of tests/_models.py ---
import pathlib as _pathlib
import sys as _sys

_TESTS_DIR = str(_pathlib.Path(__file__).resolve().parent.parent / "tests")
if _TESTS_DIR not in _sys.path:
    _sys.path.insert(0, _TESTS_DIR)

# --- Hypothesis profiles -------------------------------------------------------------------
# Locally every run explores new examples. CI (CI=true) uses a fixed, derandomised example
# sequence so a green main stays green; run locally to keep hunting for counterexamples.
import os as _os

from hypothesis import settings as _settings

_settings.register_profile("ci", derandomize=True, print_blob=True)
if _os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    _settings.load_profile("ci")
