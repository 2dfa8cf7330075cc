"""The developer tools parse their arguments into public overrides (no GPU)."""

import subprocess
import sys
from pathlib import Path

import pytest

import cupydecode

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "tools"))


def test_ab_arms_are_public_tunings_and_plan_arguments():
    ab = pytest.importorskip("ab")
    assert ab.parse_arm("num_warps=8,stages=2,l2_evict_first=false") == (cupydecode.Tuning(
        num_warps=8, stages=2, l2_evict_first=False), {})
    assert ab.parse_arm("stages=2,num_splits=8") == (cupydecode.Tuning(stages=2),
                                                     {"num_splits": 8})
    assert ab.parse_arm("") == (cupydecode.Tuning(), {})
    with pytest.raises(SystemExit, match="unknown field 'warps'"):
        ab.parse_arm("warps=8")


@pytest.mark.parametrize("tool", ["ab.py", "profile_shape.py", "host_cost.py"])
def test_tools_print_their_usage_without_a_gpu(tool):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage" in result.stdout.lower(), result.stderr
