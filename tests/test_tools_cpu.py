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


@pytest.mark.parametrize("tool", ["ab.py", "profile_shape.py", "host_cost.py",
                                  "sass_compare.py"])
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
    spread = [_collected({"CUPYDECODE_TEST_SHARD": f"{i}%3"}) for i in range(3)]
    assert spread == [every[i::3] for i in range(3)]
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


def test_passed_and_failed_tests_are_listed_as_they_end(tmp_path):
    """CUPYDECODE_TEST_PASSED=FILE lists exactly the tests that passed (not the failed or
    skipped ones), one node id a line: the list a stopped sanitizer shard leaves behind;
    CUPYDECODE_TEST_FAILED=FILE those that failed."""
    tests = tmp_path / "test_some.py"
    tests.write_text("import pytest\n"
                     "def test_a(): pass\n"
                     "def test_b(): assert False\n"
                     "@pytest.mark.skip(reason='no')\n"
                     "def test_c(): pass\n"
                     "@pytest.mark.parametrize('x', [1, 2])\n"
                     "def test_d(x): assert x == 2\n")
    passed, failed = tmp_path / "passed.txt", tmp_path / "failed.txt"
    # the suite's conftest as a plugin (it holds the hook) over a file outside the suite
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "conftest", str(tests)],
                         cwd=tmp_path, text=True, capture_output=True,
                         env={**os.environ, "CUPYDECODE_TEST_PASSED": str(passed),
                              "CUPYDECODE_TEST_FAILED": str(failed),
                              "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])})
    assert run.returncode == 1, run.stdout + run.stderr  # test_b and test_d[1] fail
    names = [line.rsplit("::", 1)[-1] for line in passed.read_text().splitlines()]
    assert names == ["test_a", "test_d[2]"], names
    names = [line.rsplit("::", 1)[-1] for line in failed.read_text().splitlines()]
    assert names == ["test_b", "test_d[1]"], names


# a stand-in for compute-sanitizer: runs the command after "env", passes its output through,
# and ends with a summary counting the report lines in it; on SIGTERM (timeout's) it kills the
# command and writes no summary, as a stopped sanitizer leaves a shard's log
FAKE_SANITIZER = """#!/usr/bin/env bash
tool=memcheck
while [ $# -gt 0 ] && [ "$1" != env ]; do [ "$1" = --tool ] && tool=$2; shift; done
log=$(mktemp)
"$@" > "$log" 2>&1 &
pid=$!
trap 'trap "" TERM; kill -9 $pid; cat "$log"; exit 143' TERM  # once: timeout may signal twice
wait $pid; rc=$?
cat "$log"
n=$(grep -E '========= +(Error|Invalid)' "$log" | grep -vc terminate)
if [ "$tool" = racecheck ]; then
  echo "========= RACECHECK SUMMARY: $n hazards displayed ($n errors, 0 warnings)"
else
  echo "========= ERROR SUMMARY: $n errors"
fi
exit $rc
"""

FAKE_TESTS = """import time
def test_ok(): pass
def test_bad(): assert False
def test_report(): print("========= Invalid __shared__ write of size 4 bytes")
def test_child():  # a command the test runs writes its own summary, then the test passes
    print("========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)")
    print("========= Error: process didn't terminate successfully")
def test_slow():
    print("========= Error: Race reported between Write access and Read access")
    time.sleep(600)
"""


def _run_sanitize_suite(cwd, out, tools: list[str], env: dict) -> subprocess.CompletedProcess:
    """tools/sanitize_suite.sh writing to ``out`` with ``tools``, in ``cwd`` under ``env``."""
    return subprocess.run(["bash", str(ROOT / "tools" / "sanitize_suite.sh"), str(out), *tools],
                          cwd=cwd, env=env, text=True, capture_output=True, timeout=120)


def _sanitize_suite(tmp_path, tests: str, tools: list[str], **env):
    """tools/sanitize_suite.sh over the test file ``tests`` (its text) under the stand-in
    sanitizer, with ``env`` added; returns a function giving the test names listed in an output
    file, sorted, and the summary's text."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(0o755)
    (tmp_path / "test_fake.py").write_text(tests)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
           "PYTEST_ADDOPTS": "-p conftest -s", "PY": sys.executable, "TIMEOUT": "45",
           "FILES": "test_fake.py", **env}
    run = _run_sanitize_suite(tmp_path, out, tools, env)
    assert run.returncode == 0, run.stdout + run.stderr
    names = lambda f: sorted(x.rsplit("::", 1)[-1] for x in (out / f).read_text().split())
    return names, (out / "0_sanitize.txt").read_text()


def test_sanitize_suite_counts_stopped_shards_and_child_summaries(tmp_path):
    """tools/sanitize_suite.sh's line: passed and failed from the lists the tests write, a shard
    stopped by the timeout told by its exit status (not by a summary a child process wrote into
    its log), and the errors of every summary plus the reports after a stopped shard's last
    one; a child's non-zero exit is not an error. Over a stand-in sanitizer, no GPU."""
    names, summary = _sanitize_suite(tmp_path, FAKE_TESTS, ["racecheck"], SHARDS="5", SPREAD="1")
    line = summary.strip()
    assert line.startswith("racecheck: "), line
    assert ", 3 passed, 1 failed, 4 errors; 5 of 6 shards finished (5 + heavy, spread)" in line, line
    assert names("racecheck_passed.txt") == ["test_child", "test_ok", "test_report"]
    assert names("racecheck_failed.txt") == ["test_bad"]


def test_sanitize_suite_leaves_torch_tests_out_of_racecheck_only(tmp_path):
    """Tests marked torch run under every tool but racecheck (tools/sanitize_suite.sh says why),
    nccl tests under none. Over the stand-in sanitizer, no GPU."""
    tests = ("import pytest\n"
             "def test_plain(): pass\n"
             "@pytest.mark.torch\n"
             "def test_torch(): pass\n"
             "@pytest.mark.nccl\n"
             "def test_nccl(): pass\n")
    names, _ = _sanitize_suite(tmp_path, tests, ["memcheck", "racecheck"], SHARDS="1")
    assert names("memcheck_passed.txt") == ["test_plain", "test_torch"]
    assert names("racecheck_passed.txt") == ["test_plain"]


def test_sanitize_suite_runs_heavy_tests_one_at_a_time_apart(tmp_path):
    """Tests marked heavy run in one process of their own (hence one after another), the rest
    in the SHARDS shards beside it: each test writes its name and its process id. ONLY picks
    shards by name, and refuses what is not one. Over the stand-in sanitizer, no GPU."""
    tests = ("import os, pytest\n"
             "def _mark(name):\n"
             "    with open('pids.txt', 'a') as f:\n"
             "        f.write(f'{name} {os.getpid()}\\n')\n"
             + "".join(f"@pytest.mark.heavy\ndef test_heavy{i}(): _mark('heavy')\n"
                       for i in range(3))
             + "".join(f"def test_light{i}(): _mark('light')\n" for i in range(3)))
    names, summary = _sanitize_suite(tmp_path, tests, ["memcheck"], SHARDS="3", SPREAD="1")
    assert names("memcheck_passed.txt") == [f"test_heavy{i}" for i in range(3)] + [
        f"test_light{i}" for i in range(3)]
    assert "6 passed, 0 failed, 0 errors; 4 of 4 shards finished (3 + heavy, spread)" in summary
    pids = {"heavy": set(), "light": set()}
    for line in (tmp_path / "pids.txt").read_text().splitlines():
        kind, pid = line.split()
        pids[kind].add(pid)
    assert len(pids["heavy"]) == 1 and len(pids["light"]) == 3, pids
    assert not pids["heavy"] & pids["light"], pids
    for name in ("out", "bin", "pids.txt"):
        (tmp_path / name).rename(tmp_path / f"{name}.0")
    names, summary = _sanitize_suite(tmp_path, tests, ["memcheck"], SHARDS="3", ONLY="heavy")
    assert names("memcheck_passed.txt") == [f"test_heavy{i}" for i in range(3)]
    assert "1 of 1 shards finished (shards run: heavy; of 3 + heavy)" in summary
    for only in ("3", "x", "1 hevy"):
        run = _run_sanitize_suite(tmp_path, tmp_path / "bad", ["memcheck"],
                                  {**os.environ, "SHARDS": "3", "ONLY": only})
        assert run.returncode == 2 and "ONLY takes shard numbers below 3 or heavy" in run.stderr
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("var, value", [("SHARDS", "0"), ("SHARDS", "two"), ("TIMEOUT", "-5")])
def test_sanitize_suite_refuses_counts_that_are_not_positive(tmp_path, var, value):
    """A shard count or timeout that is not a positive integer (e.g. the seconds left in a call,
    computed by the caller, gone negative) is refused before any run, naming the variable and
    the value; nothing is written. No GPU, no sanitizer."""
    out = tmp_path / "out"
    run = _run_sanitize_suite(tmp_path, out, ["memcheck"], {**os.environ, var: value})
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"{var} must be a positive integer, got '{value}'" in run.stderr
    assert not out.exists()


def test_sass_compare_reads_instructions_in_order_and_counts_opcodes(tmp_path):
    """tools/sass_compare.py over a stand-in nvdisasm: addresses and non-instruction lines go,
    registers stay (--exact compares them), opcodes count without predicate or modifiers."""
    import sass_compare

    fake = tmp_path / "nvdisasm"
    fake.write_text("#!/bin/sh\ncat <<'EOF'\n"
                    "\t.section\t.text.cd_decode_split\n"
                    ".L_x_0:\n"
                    "        /*0000*/                   LDC R1, c[0x0][0x28] ;\n"
                    "        /*0010*/              @!P0 BRA `(.L_x_1) ;\n"
                    "        /*0020*/                   HMMA.16816.F32 R4, R8, R12, R4 ;\n"
                    "        /*0030*/                   HMMA.16816.F32 R16, R8, R14, R16 ;\n"
                    "EOF\n")
    fake.chmod(0o755)
    listing = sass_compare.instructions(str(fake), b"cubin")
    assert listing == ["LDC R1, c[0x0][0x28] ;", "@!P0 BRA `(.L_x_1) ;",
                       "HMMA.16816.F32 R4, R8, R12, R4 ;", "HMMA.16816.F32 R16, R8, R14, R16 ;"]
    assert sass_compare.opcodes(listing) == {"LDC": 1, "BRA": 1, "HMMA": 2}
    renamed = [line.replace("R16", "R20") for line in listing]
    assert sass_compare.opcodes(renamed) == sass_compare.opcodes(listing) and renamed != listing
