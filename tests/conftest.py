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
FAILED_ENV = "CUPYDECODE_TEST_FAILED"


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
    share compiled kernels, mostly fall into one process. With i%n, every n-th test from the
    i-th instead: the slow tests of one file (the CLI's, under racecheck) spread over the
    shards, the better order for the tail left after an EXCLUDE= run."""
    spec = os.environ.get(SHARD_ENV)
    if not spec:
        return
    sep = "%" if "%" in spec else "/"
    try:
        index, count = (int(x) for x in spec.split(sep))
        assert 0 <= index < count
    except (ValueError, AssertionError):
        raise pytest.UsageError(
            f"{SHARD_ENV}: expected i/n or i%n with 0 <= i < n, got {spec!r}") from None
    if sep == "%":
        keep = items[index::count]
    else:
        keep = items[len(items) * index // count:len(items) * (index + 1) // count]
    kept = {id(item) for item in keep}
    config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
    items[:] = keep


def _record(env: str, nodeid: str) -> None:
    """With CUPYDECODE_TEST_PASSED=FILE (CUPYDECODE_TEST_FAILED=FILE), append each passed
    (failed) test's node id to FILE as it passes (fails), a line flushed at once: a run that a
    timeout stops still leaves the lists of what it passed and failed, for an EXCLUDE= run after
    it and for the summary (tools/sanitize_suite.sh)."""
    path = os.environ.get(env)
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
        _record(PASSED_ENV, report.nodeid)
    elif report.failed:  # in the test, or in its set-up or tear-down
        _record(FAILED_ENV, report.nodeid)
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
