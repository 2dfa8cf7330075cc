"""Development scripts that edit kernel sources by text anchors still find them (no GPU)."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("cupy")

from cupydecode import _kernels, _policy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_timeline_anchors_are_in_the_split_kernel(monkeypatch):
    """scripts/timeline.py stamps the kernel at fixed source lines; a kernel edit that moves
    one must fail here rather than in the script on a GPU machine. (Importing the script
    instruments _kernels.program_source and extends sys.path: both are undone after the test.)"""
    monkeypatch.setattr(_kernels, "program_source", _kernels.program_source)
    monkeypatch.setattr(sys, "path", sys.path[:])
    spec = importlib.util.spec_from_file_location("timeline", ROOT / "scripts" / "timeline.py")
    timeline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timeline)
    for dtype in ("float16", "float32"):
        defines = _policy.split_kernel_config(dtype, 128).defines()
        src = timeline._orig_source("decode_split.cu", defines)  # the shipped source
        for anchor, _, _ in timeline.INJECT + timeline.MERGE_INJECT:
            assert src.count(anchor) >= 1, (dtype, anchor)
        assert timeline.instrumented_source("decode_split.cu", defines).count("cd_dbg[") >= 8
