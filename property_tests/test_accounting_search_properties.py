"""``last_fitting``: the integer boundary search behind ``Accountant.max_steps``.

Oracle: a linear scan over k for a random non-decreasing excess function.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from opake_compile.accounting._accountant import last_fitting


@settings(max_examples=200, deadline=None)
@given(
    boundary=st.integers(-5, 3000),
    limit=st.integers(0, 3000),
    hint=st.integers(0, 4000),
    power=st.floats(0.3, 3.0),
    jump=st.booleans(),
)
def test_last_fitting_finds_the_linear_scan_answer(boundary, limit, hint, power, jump):
    calls = []

    def excess(k):
        calls.append(k)
        if jump and k > boundary:
            return math.inf
        return math.copysign(abs(k - boundary - 0.5) ** power, k - boundary - 0.5)

    expected = max([k for k in range(limit + 1) if excess(k) <= 0], default=0)
    calls.clear()
    assert last_fitting(excess, limit, hint) == expected
    assert len(set(calls)) <= 80  # about 2 log2 range from a bad hint, a handful from a good one
