"""CLI tests on a real GPU: the check matrix, a varlen check, a tiny bench, explain --gpu, info."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from cupydecode import cli, explain
from cupydecode import reference as R
from helpers import mutant_source

pytestmark = pytest.mark.gpu


@pytest.fixture
def few_repeats(monkeypatch):
    """The bench's measurements repeated a few times only: the bench tests check what the CLI
    measures and writes, not how fast, and every launch of theirs is slow under
    compute-sanitizer (with the default repeats one such test ran past 570 s under racecheck)."""
    from cupydecode import bench as B

    for name, value in (("GRAPH_TRIALS", 5), ("HOST_CALLS", 4), ("HOST_BATCHES", 2),
                        ("EAGER_CALLS", (3, 3)), ("CEILING_BYTES", 256 << 20),
                        ("CEILING_TRIALS", 2)):
        assert hasattr(B, name), name
        monkeypatch.setattr(B, name, value)


@pytest.mark.heavy
def test_check_default_matrix_passes(runner, tmp_path):
    out = tmp_path / "check.json"
    result = runner.invoke(cli.main, ["check", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) >= 20 and all(r["passed"] for r in rows)
    assert {r["reference"] for r in rows} == {"numpy f64", "gpu f64"}
    assert any(r["max_abs_lse"] > 5e3 for r in rows)  # the ±1e4 logits workload ran


def test_check_single_varlen(runner, tmp_path):
    out = tmp_path / "one.json"
    result = runner.invoke(cli.main, ["check", "--model", "llama-3-8b", "--seqlen", "300",
                                      "--batch", "2", "--varlen", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output
    (row,) = json.loads(out.read_text())["rows"]
    assert row["num_heads"] == 32 and row["num_kv_heads"] == 8 and row["batch"] == 2
    assert row["lengths"][0] == 300


def test_check_soft_cap_of_the_model(runner, tmp_path):
    """gemma-2-9b's cap of 50 on logits past it, on both its layer types (the sliding one with
    its window); the rows record it; --soft-cap 0 drops it."""
    out = tmp_path / "cap.json"
    args = ["check", "--model", "gemma-2-9b", "--seqlen", "600", "--batch", "2", "--q-scale",
            "60", "--json", str(out)]
    result = runner.invoke(cli.main, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["window_left"] for r in rows] == [4095, None], rows
    assert "gemma-2-9b sliding" in result.output and "gemma-2-9b full" in result.output
    for row in rows:
        assert row["logits_soft_cap"] == 50.0 and row["passed"] and "cap=50" in result.output
        assert row["max_abs_lse"] < 50 + np.log(600)  # every logit capped below 50
    result = runner.invoke(cli.main, args[:-2] + ["--soft-cap", "0", "--json", str(out)])
    assert result.exit_code == 0, result.output
    for row in json.loads(out.read_text())["rows"]:
        assert row["logits_soft_cap"] is None and row["max_abs_lse"] > 100


def test_check_replay_uses_the_same_data(runner, tmp_path):
    outs = []
    for i in range(2):
        path = tmp_path / f"r{i}.json"
        result = runner.invoke(cli.main, ["check", "--heads", "28", "--kv-heads", "4",
                                          "--seqlen", "257", "--splits", "3", "--seed", "1234",
                                          "--json", str(path)])
        assert result.exit_code == 0, result.output
        outs.append(json.loads(path.read_text())["rows"][0])
    # same seed, same data: the reference's LSE depends on the data alone
    assert outs[0]["seed"] == outs[1]["seed"] == 1234
    assert outs[0]["max_abs_lse"] == outs[1]["max_abs_lse"]


def test_check_append(runner, tmp_path):
    """check --append: contiguous and paged, with varlen lengths (a full sequence, an empty
    one); the cache after the call matched the expected one."""
    for extra in ([], ["--page-size", "16"]):
        out = tmp_path / "append.json"
        result = runner.invoke(cli.main, ["check", "--seqlen", "300", "--batch", "4", "--varlen",
                                          "--append", *extra, "--json", str(out)])
        assert result.exit_code == 0, result.output
        (row,) = json.loads(out.read_text())["rows"]
        assert row["append"] and row["passed"] and row["cache_rows_wrong"] == 0, row
        assert 300 in row["lengths"] and 0 in row["lengths"]


def test_check_catches_a_missing_append(cupy, tmp_path):
    """`cupydecode check`'s append rows fail where the kernel attends the new token but never
    writes it into the cache (a variant without the store): the cache comparison says so, for
    each of the 3 sequences' K and V rows."""
    from cupydecode import _kernels
    from cupydecode import check as C
    from cupydecode.workloads import Workload

    def workload(page_size):
        return Workload(3, 300, 32, 8, 128, "float16", None, (299, 0, 17), append=True,
                        page_size=page_size)
    assert C.run_check(workload(16))["passed"]
    (tmp_path / "decode_split.cu").write_text(mutant_source("append_not_stored"))
    with _kernels.kernel_sources(tmp_path):
        for page_size in (None, 16):
            row = C.run_check(workload(page_size))
            assert not row["passed"] and row["cache_rows_wrong"] == 6, row
        assert "differs from reference.append_kv's" in row["error"]


def test_gpu_reference_matches_numpy(cupy, seed):
    from cupydecode.check import reference_gpu, select_rows
    from cupydecode.workloads import Workload, make_inputs

    w = Workload(3, 130, 28, 4, 64, "bfloat16", lengths=(130, 0, 7), seed=seed)
    q, k, v, _ = make_inputs(w)
    ref_out, ref_lse = R.decode_attention(q, k, v, np.array(w.lengths))
    out, lse = reference_gpu(q, k, v, w.lengths, batch_ids=[0, 2], kv_heads=[1, 3])
    want = select_rows(ref_out, 4, [0, 2], [1, 3])
    assert np.allclose(out.get(), want, rtol=1e-12, atol=1e-12)
    got_lse, want_lse = lse.get(), select_rows(ref_lse, 4, [0, 2], [1, 3])
    assert np.array_equal(np.isneginf(got_lse), np.isneginf(want_lse))  # the empty sequence
    live = ~np.isneginf(want_lse)
    assert live.any() and np.allclose(got_lse[live], want_lse[live], rtol=1e-12, atol=1e-12)


@pytest.mark.heavy
def test_bench_tiny_sweep_writes_files(runner, tmp_path, few_repeats):
    csv_path, json_path = tmp_path / "b.csv", tmp_path / "b.json"
    result = runner.invoke(cli.main, ["bench", "--seqlens", "1024", "--batch", "1",
                                      "--csv", str(csv_path), "--json", str(json_path)])
    assert result.exit_code == 0, result.output
    assert "HBM read ceiling" in result.output
    payload = json.loads(json_path.read_text())
    (row,) = payload["rows"]
    # a measured rate, not a speed floor: under compute-sanitizer the same run reads ~40 GB/s
    assert 0 < payload["ceiling"]["gbps"] < float("inf")
    assert row["check"] == "ok" and row["gpu_us"] > 0 and row["eager_us"] > 0
    assert row["buffer_sets"] * row["kv_bytes"] > 4 * payload["device"]["l2_bytes"]
    assert row["naive_us"] is not None and row["split1_us"] is not None
    assert row["kv_per_block"] == 1  # one short stream: one KV head per block
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and float(rows[0]["gpu_us"]) == pytest.approx(row["gpu_us"])
    assert int(rows[0]["kv_per_block"]) == 1


@pytest.mark.heavy
def test_bench_append(runner, tmp_path, few_repeats):
    """bench --append: the call with the append checked against float64, and the same call
    without it timed in the same protocol."""
    json_path = tmp_path / "b.json"
    result = runner.invoke(cli.main, ["bench", "--seqlens", "4096", "--batch", "2", "--append",
                                      "--page-size", "16", "--json", str(json_path)])
    assert result.exit_code == 0, result.output
    assert "no-append µs" in result.output
    (row,) = json.loads(json_path.read_text())["rows"]
    assert row["append"] and row["check"] == "ok" and row["page_size"] == 16
    assert row["gpu_us"] > 0 and row["no_append_us"] > 0
    assert row["append_cost_us"] == pytest.approx(row["gpu_us"] - row["no_append_us"])


def test_explain_gpu_matches_cpu(runner):
    for tokens, splits, head_dim in [(12, 3, 4), (5, 4, 8), (40, 1, 128)]:
        wk = explain.walk(tokens, splits, head_dim, seed=tokens)
        d = explain.gpu_differences(wk, explain.gpu_partials(wk))
        assert d["O_part"] < 1e-5 and d["O"] < 1e-5, d
        assert d["lse_part"] < 1e-4 and d["lse"] < 1e-4, d   # |LSE| ≈ 120: a few fp32 ulps
    result = runner.invoke(cli.main, ["explain", "--gpu"])
    assert result.exit_code == 0, result.output
    assert "max |GPU − CPU|" in result.output


def test_info_names_the_gpu(runner, cupy):
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    result = runner.invoke(cli.main, ["info"])
    assert result.exit_code == 0, result.output
    assert name in result.output
    from cupydecode import _kernels

    programmatic = _kernels.programmatic_launch_supported(cupy.cuda.Device().id)
    assert ("merge kernel launch: programmatic" in result.output) == programmatic, result.output
    assert ("merge kernel launch: plain" in result.output) != programmatic, result.output


@pytest.mark.heavy
def test_info_compile_builds_every_specialisation(runner, cupy):
    """`info --compile` lists every split-kernel block shape a plan can pick at each kernel
    width and the merge kernel (the head_dims between the widths build on first use)."""
    from cupydecode import _policy

    result = runner.invoke(cli.main, ["info", "--compile"])
    assert result.exit_code == 0, result.output
    for dt in _policy.DTYPE_IDS:
        for d in _policy.KERNEL_HEAD_DIMS:
            for cfg in _policy.split_kernel_configs(dt, d):
                shape = " ".join(f"{k}={v}" for k, v in sorted(cfg.defines().items()))
                assert shape in result.output, (shape, result.output)
    assert "merge_states.cu:cd_merge_states" in result.output, result.output


@pytest.mark.heavy
def test_bench_protocols_side_by_side(runner, tmp_path, few_repeats):
    """One row per protocol on the same point, the host costs measured in the same process, and
    the spread table over the protocols."""
    json_path = tmp_path / "b.json"
    result = runner.invoke(cli.main, ["bench", "--seqlens", "4096", "--batch", "2", "--protocol",
                                      "step,back-to-back:2", "--json", str(json_path)])
    assert result.exit_code == 0, result.output
    assert "step: before each attention call" in result.output
    assert "spread per point" in result.output
    payload = json.loads(json_path.read_text())
    step, b2b = payload["rows"]
    assert (step["protocol"], b2b["protocol"]) == ("step", "back-to-back:2")
    assert b2b["graph_calls"] == 2 and step["graph_calls"] >= 10
    for row in (step, b2b):
        assert row["check"] == "ok" and row["gpu_us"] > 0
        assert row["host_us"] > 0 and row["plan_host_us"] > 0 and row["launch_host_us"] > 0
        assert row["eager_us"] == step["eager_us"]  # measured once per point
    (point,) = payload["stability"]
    assert point["runs"] == 2 and point["spread_pct"] >= 0


def test_check_kv_dtype(runner, tmp_path):
    """check --kv-dtype for each scale mode, appended into a paged cache: every row passes and
    the codes and per-token scales the call wrote match reference.append_kv's."""
    for fmt, mode in (("e4m3", "tensor"), ("e5m2", "head"), ("e4m3", "token")):
        out = tmp_path / f"{fmt}-{mode}.json"
        result = runner.invoke(cli.main, ["check", "--seqlen", "300", "--batch", "4", "--varlen",
                                          "--append", "--page-size", "16", "--kv-dtype", fmt,
                                          "--kv-scale", mode, "--json", str(out)])
        assert result.exit_code == 0, result.output
        (row,) = json.loads(out.read_text())["rows"]
        assert row["passed"] and row["cache_rows_wrong"] == 0, row
        assert (row["kv_dtype"], row["kv_scale"]) == (fmt, mode)


@pytest.mark.parametrize("ignored", ["k", "v"])
def test_check_catches_a_kernel_that_ignores_the_scales(cupy, tmp_path, ignored):
    """`cupydecode check`'s fp8 rows fail for a kernel that takes every K (or V) scale as 1 (per
    token, V: that drops the weights' factor 2^(mv − m2), which carries log2 v_scale), in each
    scale mode: its scales differ from 1, per head and per token."""
    from cupydecode import _kernels
    from cupydecode import check as C
    from cupydecode.workloads import Workload

    def workload(mode):
        return Workload(3, 700, 32, 8, 128, "float16", None, (700, 300, 0), kv_dtype="e4m3",
                        kv_scale=mode)
    modes = ("tensor", "head", "token")
    assert all(C.run_check(workload(mode))["passed"] for mode in modes)
    (tmp_path / "decode_split.cu").write_text(mutant_source(f"{ignored}_scales_ignored"))
    with _kernels.kernel_sources(tmp_path):
        for mode in modes:
            row = C.run_check(workload(mode))
            assert not row["passed"] and row["rel_err"] > 10 * row["rel_tol"], row


@pytest.mark.heavy
def test_bench_kv_dtype(runner, tmp_path, few_repeats):
    """bench --kv-dtype: the fp8 call checked against float64, its floor from the fp8 bytes
    (half of fp16's; per-token scales add 4 bytes per token and KV head), the naive version left
    out with the reason."""
    rows = {}
    for mode in ("tensor", "token"):
        json_path = tmp_path / f"{mode}.json"
        result = runner.invoke(cli.main, ["bench", "--seqlens", "4096", "--batch", "2",
                                          "--kv-dtype", "e4m3", "--kv-scale", mode,
                                          "--json", str(json_path)])
        assert result.exit_code == 0, result.output
        (rows[mode],) = json.loads(json_path.read_text())["rows"]
    for mode, row in rows.items():
        assert row["check"] == "ok" and row["gpu_us"] > 0 and row["kv_dtype"] == "e4m3", row
        assert row["naive_us"] is None and "naive" in row["notes"]
    assert rows["tensor"]["kv_bytes"] == 2 * 2 * 4096 * 8 * 128
    assert rows["token"]["kv_bytes"] == 2 * 2 * 4096 * 8 * (128 + 4)
