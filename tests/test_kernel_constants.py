"""Constants that the launch policy (cupydecode/_policy.py) and the CUDA sources must agree on,
read from the kernel sources themselves (no GPU needed)."""

from __future__ import annotations

import re
from cupydecode import _policy as P
from cupydecode._kernels import kernel_dir

KERNELS = kernel_dir()


def _define(filename: str, name: str) -> int:
    text = (KERNELS / filename).read_text()
    m = re.search(rf"^#define {name} (\d+)", text, re.M)
    assert m, f"#define {name} not found in kernels/{filename}"
    return int(m.group(1))


def test_merge_group_matches_states_per_trip():
    assert _define("common.cuh", "CD_MERGE_GROUP") == P.MERGE_STATES_PER_TRIP


def test_merge_kernel_warps_match_launch_policy():
    assert _define("merge_states.cu", "CD_MERGE_MAX_WARPS") == P.MERGE_WARPS
    blocks, threads, wpi = P.merge_launch(1, 128, 16 * P.MERGE_WARPS)
    assert threads == 32 * P.MERGE_WARPS and wpi == P.MERGE_WARPS


def test_fused_merge_pass_matches_policy():
    text = (KERNELS / "decode_split.cu").read_text()
    m = re.search(r"constexpr int MERGE_NV = (\d+);", text)
    assert m, "MERGE_NV not found in kernels/decode_split.cu"
    assert 32 * int(m.group(1)) == P.FUSED_PASS
