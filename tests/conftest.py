"""pytest setup: the ``gpu`` marker skips (with the reason) where no CUDA GPU is usable, and the
``seed`` / ``rng`` fixtures give every test fresh random data with a recorded seed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py

import helpers  # noqa: E402


SHARD_ENV = "CUPYDECODE_TEST_SHARD"
EXCLUDE_ENV = "CUPYDECODE_TEST_EXCLUDE"
PASSED_ENV = "CUPYDECODE_TEST_PASSED"


def _exclude(config, items) -> None:
    """With CUPYDECODE_TEST_EXCLUDE=FILE, leave out the tests whose node ids FILE lists (one a
    line): the ones a sanitizer already passed in an earlier call, so that a tool's run over the
    whole suite can be split across calls (tools/sanitize_suite.sh, EXCLUDE). Before the
    sharding, so that the tests left are spread over the shards."""
    path = os.environ.get(EXCLUDE_ENV)
    if not path:
        return
    try:
        done = {line.strip() for line in Path(path).read_text().splitlines() if line.strip()}
    except OSError as exc:
        raise pytest.UsageError(f"{EXCLUDE_ENV}: cannot read {path!r}: {exc}") from None
    left = [item for item in items if item.nodeid not in done]
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = left


def _shard(config, items) -> None:
    """With CUPYDECODE_TEST_SHARD=i/n, keep the i-th (0-based) of n equal runs of the collected
    tests: n processes, each under its own compute-sanitizer (tools/sanitize_suite.sh), run the
    whole suite between them. Runs, not every n-th test, so that the tests of one file, which
    share compiled kernels, mostly fall into one process."""
    spec = os.environ.get(SHARD_ENV)
    if not spec:
        return
    try:
        index, count = (int(x) for x in spec.split("/"))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        raise pytest.UsageError(f"{SHARD_ENV}: expected i/n with 0 <= i < n, got {spec!r}") from None
    lo, hi = len(items) * index // count, len(items) * (index + 1) // count
    config.hook.pytest_deselected(items=items[:lo] + items[hi:])
    items[:] = items[lo:hi]


def _record_passed(nodeid: str) -> None:
    """With CUPYDECODE_TEST_PASSED=FILE, append each passed test's node id to FILE as it passes
    (a line, flushed at once): a run that a timeout stops still leaves the list of what it
    passed, for an EXCLUDE= run after it (tools/sanitize_suite.sh)."""
    path = os.environ.get(PASSED_ENV)
    if path:
        with open(path, "a") as f:
            f.write(nodeid + "\n")


def pytest_collection_modifyitems(config, items):
    _exclude(config, items)
    _shard(config, items)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    reason = helpers.gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"no CUDA GPU available: {reason}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (or CUPYDECODE_TEST_SEED); shown in the report if the test fails."""
    value = helpers.new_seed()
    request.node._cupydecode_seed = value
    print(f"random seed: {value} (replay with {helpers.SEED_ENV}={value})")
    return value


@pytest.fixture
def runner():
    """A click test runner for the CLI tests."""
    from click.testing import CliRunner

    return CliRunner()


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.passed:
        _record_passed(report.nodeid)
    value = getattr(item, "_cupydecode_seed", None)
    if value is not None and report.failed:
        report.sections.append(("random seed",
                                f"{value} (replay with {helpers.SEED_ENV}={value})"))


@pytest.fixture
def cupy():
    """The cupy module, with the memory pool released after the test."""
    import cupy as cp

    yield cp
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
