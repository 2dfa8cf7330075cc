"""Constants that the launch policy (cupydecode/_policy.py) and the CUDA sources must agree on,
read from the kernel sources themselves (no GPU needed)."""

from __future__ import annotations

import re
from cupydecode import _policy as P
from cupydecode._kernels import kernel_dir

KERNELS = kernel_dir()


def _define(filename: str, name: str, pattern: str = r"^#define {name} (\d+)") -> int:
    """The integer a source line of kernels/``filename`` gives ``name`` (a #define by default)."""
    text = (KERNELS / filename).read_text()
    m = re.search(pattern.format(name=name), text, re.M)
    assert m, f"{name} not found in kernels/{filename}"
    return int(m.group(1))


def test_merge_group_matches_states_per_trip():
    assert _define("common.cuh", "CD_MERGE_GROUP") == P.MERGE_STATES_PER_TRIP


def test_merge_kernel_warps_match_launch_policy():
    assert _define("merge_states.cu", "CD_MERGE_MAX_WARPS") == P.MERGE_WARPS


def test_fused_merge_pass_matches_policy():
    nv = _define("decode_split.cu", "MERGE_NV", r"constexpr int {name} = (\d+);")
    assert 32 * nv == P.FUSED_PASS
