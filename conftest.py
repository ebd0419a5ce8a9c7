"""Test tiers shared by tests/ and property_tests/.

``@pytest.mark.ondemand`` marks checks too long for CI's 2-core budget (multi-seed accuracy
comparisons, large shapes). They are skipped unless asked for::

    OPAKE_ONDEMAND=1 python -m pytest -m ondemand
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("OPAKE_ONDEMAND", "").lower() in ("1", "true", "yes"):
        return
    skip = pytest.mark.skip(reason="on-demand tier: set OPAKE_ONDEMAND=1 to run it")
    for item in items:
        if "ondemand" in item.keywords:
            item.add_marker(skip)
