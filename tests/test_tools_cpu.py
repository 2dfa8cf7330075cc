"""The developer tools parse their arguments into public overrides (no GPU)."""

import os
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
    assert ab.parse_arm("kv_groups=false") == (cupydecode.Tuning(kv_groups=False), {})


def test_ab_tree_arm_imports_another_version_beside_this_one(tmp_path):
    """--tree: another checkout's package (here a copy of this one) under a name of its own,
    its kernels found beside it; the shipped package is untouched."""
    import shutil

    ab = pytest.importorskip("ab")
    shutil.copytree(ROOT / "cupydecode", tmp_path / "cupydecode")
    shutil.copytree(ROOT / "kernels", tmp_path / "kernels")
    other = ab.package_of(str(tmp_path), "copy-1")
    assert other.__name__ == "cupydecode_copy_1" and other.DecodePlan is not cupydecode.DecodePlan
    assert Path(other.__file__).parent == tmp_path / "cupydecode"
    assert other._kernels.kernel_dir() == tmp_path / "kernels"
    with pytest.raises(SystemExit, match="no cupydecode package"):
        ab.package_of(str(tmp_path / "nowhere"), "none")


@pytest.mark.parametrize("tool", ["ab.py", "profile_shape.py", "host_cost.py"])
def test_tools_print_their_usage_without_a_gpu(tool):
    result = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--help"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage" in result.stdout.lower(), result.stderr


def _collected(env: dict) -> list[str]:
    """The node ids pytest collects from tests/test_policy.py under ``env`` (the suite's own
    conftest: sharding and exclusion)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", "tests/test_policy.py"], cwd=ROOT, text=True,
                         capture_output=True, env={**os.environ, **env})
    assert run.returncode == 0, run.stdout + run.stderr
    return [line for line in run.stdout.splitlines() if "::" in line]


def test_shards_split_the_suite_and_exclusion_comes_first(tmp_path):
    """tools/sanitize_suite.sh's shards (CUPYDECODE_TEST_SHARD) take disjoint runs that together
    are the whole suite; CUPYDECODE_TEST_EXCLUDE leaves out the listed tests before sharding,
    so a tool's run can go on where an earlier call stopped."""
    every = _collected({})
    assert len(every) > 20
    shards = [_collected({"CUPYDECODE_TEST_SHARD": f"{i}/3"}) for i in range(3)]
    assert sum(shards, []) == every
    done = tmp_path / "done.txt"
    done.write_text("\n".join(every[::2]) + "\n")
    left = [_collected({"CUPYDECODE_TEST_EXCLUDE": str(done), "CUPYDECODE_TEST_SHARD": f"{i}/2"})
            for i in range(2)]
    assert sum(left, []) == every[1::2]
    assert abs(len(left[0]) - len(left[1])) <= 1
    bad = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", "tests/test_policy.py"], cwd=ROOT, text=True,
                         capture_output=True,
                         env={**os.environ,
                              "CUPYDECODE_TEST_EXCLUDE": str(tmp_path / "missing.txt")})
    assert bad.returncode != 0 and "CUPYDECODE_TEST_EXCLUDE" in bad.stdout + bad.stderr


def test_passed_tests_are_listed_as_they_pass(tmp_path):
    """CUPYDECODE_TEST_PASSED=FILE lists exactly the tests that passed (not the failed or
    skipped ones), one node id a line: the list a stopped sanitizer shard leaves behind."""
    tests = tmp_path / "test_some.py"
    tests.write_text("import pytest\n"
                     "def test_a(): pass\n"
                     "def test_b(): assert False\n"
                     "@pytest.mark.skip(reason='no')\n"
                     "def test_c(): pass\n"
                     "@pytest.mark.parametrize('x', [1, 2])\n"
                     "def test_d(x): assert x == 2\n")
    passed = tmp_path / "passed.txt"
    # the suite's conftest as a plugin (it holds the hook) over a file outside the suite
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "conftest", str(tests)],
                         cwd=tmp_path, text=True, capture_output=True,
                         env={**os.environ, "CUPYDECODE_TEST_PASSED": str(passed),
                              "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])})
    assert run.returncode == 1, run.stdout + run.stderr  # test_b and test_d[1] fail
    names = [line.rsplit("::", 1)[-1] for line in passed.read_text().splitlines()]
    assert names == ["test_a", "test_d[2]"], names
