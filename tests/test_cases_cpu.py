"""The GPU suite's case list, checked without a GPU (test_gpu_decode.py is GPU-marked as a whole)."""

from __future__ import annotations

from test_gpu_decode import BATCHES, CASES, DTYPES, GROUPS, HEAD_DIMS, LENGTHS, SPLITS


def test_case_list_stays_within_budget():
    # What can drift when an axis grows is the number of cases, i.e. the GPU suite's run time.
    assert 50 <= len(CASES) <= 80, len(CASES)


def test_case_list_covers_every_axis_value():
    for axis, values in ((0, DTYPES), (1, HEAD_DIMS), (2, GROUPS), (3, LENGTHS), (4, BATCHES), (5, SPLITS)):
        for value in values:
            assert any(c[axis] == value for c in CASES), (axis, value)
