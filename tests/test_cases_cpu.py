"""The GPU suite's case list, checked without a GPU (test_gpu_decode.py is GPU-marked as a whole)."""

from __future__ import annotations

from test_gpu_decode import CASES


def test_case_list_stays_within_budget():
    # What can drift when an axis grows is the number of cases, i.e. the GPU suite's run time.
    # (Every axis value is in some case by construction: _covering_cases adds what is missing.)
    assert 50 <= len(CASES) <= 80, len(CASES)
