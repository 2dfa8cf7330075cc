"""CLI tests that need no GPU: help texts, `explain`, option errors, the no-GPU exit path."""

from __future__ import annotations

import dataclasses
import re
import types

import numpy as np
import pytest

from cupydecode import _policy as P
from cupydecode import bench as B
from cupydecode import cli, explain
from cupydecode.workloads import MODELS, Workload, default_check_matrix, random_lengths

COMMANDS = ["check", "bench", "explain", "info", "models"]


@pytest.fixture
def no_gpu(monkeypatch):
    """Make GPU detection say no, whatever this machine has."""
    monkeypatch.setattr(cli, "detect_gpu", lambda: (False, "simulated: no CUDA device"))


@pytest.mark.parametrize("command", [[], *[[c] for c in COMMANDS]])
def test_help_has_example(runner, command):
    result = runner.invoke(cli.main, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert re.search(r"Examples?:", result.output), result.output
    assert "cupydecode" in result.output.split("Example")[1]


def test_explain_prints_every_quantity(runner):
    result = runner.invoke(cli.main, ["explain"])
    assert result.exit_code == 0, result.output
    for token in ["s_j", "m_i", "l_i", "V_i", "Õ_i", "LSE_i", "w_i", "O_direct", "LSE_direct"]:
        assert token in result.output, token
    assert "12 tokens" in result.output and "3 split" in result.output


def _reported(output: str, label: str) -> float:
    m = re.search(re.escape(label) + r" = ([0-9.e+-]+)", output)
    assert m, f"{label!r} not in output"
    return float(m.group(1))


@pytest.mark.parametrize("args", [[], ["--tokens", "10", "--splits", "4", "--head-dim", "8",
                                       "--seed", "3"], ["--tokens", "5", "--splits", "7"]])
def test_explain_merge_matches_direct_softmax(runner, args):
    result = runner.invoke(cli.main, ["explain", *args])
    assert result.exit_code == 0, result.output
    assert _reported(result.output, "max |O − O_direct|") < 1e-12
    assert _reported(result.output, "|LSE − LSE_direct|") < 1e-10


@pytest.mark.parametrize("tokens,splits", [(12, 3), (1, 1), (5, 4), (3, 8), (64, 5)])
def test_walk_numbers(tokens, splits, seed):
    wk = explain.walk(tokens, splits, 4, seed)
    assert np.allclose(wk.O, wk.O_direct, rtol=0, atol=1e-12)
    assert abs(wk.lse - wk.lse_direct) < 1e-10
    assert abs(wk.w.sum() - 1) < 1e-12
    assert np.all(wk.s > 100)  # logits near 120: the overflow regime
    assert wk.edges[0] == 0 and wk.edges[-1] == tokens and len(wk.edges) == splits + 1
    empty = np.diff(wk.edges) == 0
    assert np.all(np.isneginf(wk.lse_part[empty])) and np.all(wk.O_part[empty] == 0)
    assert np.all(np.isfinite(wk.lse_part[~empty]))
    live = ~empty
    assert np.allclose(wk.lse_part[live], wk.m[live] + np.log(wk.l[live]))
    assert np.allclose(wk.O_part[live], wk.V[live] / wk.l[live, None])
    assert np.all(wk.l[live] >= 1)


def test_overflow_demo_shows_inf_and_nan(runner):
    result = runner.invoke(cli.main, ["explain"])
    assert result.exit_code == 0, result.output
    lines = [ln for ln in result.output.splitlines() if "direct in float" in ln]
    assert len(lines) == 2, result.output
    for ln in lines:
        assert "Σ_j exp(s_j) = inf" in ln
        assert "nan" in ln
    assert _reported(result.output, "max |ΔO|") < 1e-5, result.output


def test_direct_softmax_overflows_lse_path_does_not():
    wk = explain.walk()
    for dt in (np.float16, np.float32):
        den, out = explain.direct_softmax(wk.s, wk.v, dt)
        assert np.isinf(den) and np.all(np.isnan(out))
    r = explain.split_merge(wk.s, wk.v, wk.edges, np.float32)
    assert np.all(np.isfinite(r["O"]))
    assert np.max(np.abs(r["O"] - wk.O_direct)) < 1e-5


@pytest.mark.parametrize("args", [
    ["check", "--dtype", "float64"],
    ["check", "--splits", "0"],
    ["check", "--splits", "many"],
    ["check", "--head-dim", "100"],
    ["check", "--head-dim", "264"],
    ["check", "--heads", "32", "--kv-heads", "5"],
    ["check", "--batch", "3", "--lengths", "1,2"],
    ["check", "--seqlen", "10", "--lengths", "4,11"],
    ["check", "--model", "llama-9"],
    ["bench", "--seqlens", "a,b"],
    ["bench", "--seqlens", "1024,0"],
    ["bench", "--batch", "1,,4"],
    ["bench", "--dtype", "int8"],
    ["bench", "--baseline", "jax"],
    ["explain", "--tokens", "0"],
    ["explain", "--head-dim", "300"],
    ["explain", "--center", "-1"],
    ["explain", "--center", "0"],
    ["explain", "--center", "nan"],
    ["explain", "--center", "inf"],
    ["check", "--soft-cap", "nan"],
    ["bench", "--soft-cap", "inf"],
    ["check", "--batch", "65536"],
    ["bench", "--batch", "1,65536"],
    ["check", "--dtype", "float32", "--head-dim", "512"],
    ["bench", "--dtype", "float32", "--head-dim", "512"],
    ["check", "--model", "gemma-2-9b", "--dtype", "float32", "--head-dim", "512"],
    ["check", "--kv-dtype", "e4m3", "--head-dim", "40"],
    ["bench", "--kv-dtype", "e5m2", "--head-dim", "72"],
])
def test_bad_usage_exits_2(runner, no_gpu, args):
    """Refused as usage errors before any GPU is looked for (the missing GPU also exits 2)."""
    result = runner.invoke(cli.main, args)
    assert result.exit_code == 2, result.output
    assert "Error" in result.output or "error" in result.output
    assert "no usable GPU" not in result.output, result.output
    assert args[-2] in result.output, result.output  # the message names the option


@pytest.mark.parametrize("args", [["check"], ["check", "--model", "gpt-2", "--seqlen", "17"],
                                  ["bench"], ["bench", "--seqlens", "1024", "--batch", "1"],
                                  ["explain", "--gpu"]])
def test_no_gpu_exits_2_with_message(runner, no_gpu, args):
    result = runner.invoke(cli.main, args)
    assert result.exit_code == 2, result.output
    assert "no usable GPU" in result.output
    assert "simulated: no CUDA device" in result.output
    assert "Kernel 1" not in result.output  # explain --gpu: refused before the walk is printed


def test_info_without_gpu_says_so(runner, no_gpu):
    result = runner.invoke(cli.main, ["info"])
    assert result.exit_code == 0, result.output
    assert "cupydecode" in result.output
    assert "no GPU found" in result.output


def test_models_lists_presets(runner):
    result = runner.invoke(cli.main, ["models"])
    assert result.exit_code == 0
    for name in MODELS:
        assert name in result.output
    assert re.search(r"falcon-7b\s+71\s+1\s+64", result.output)


def test_option_types():
    assert cli.SplitsType().convert("auto", None, None) == "auto"
    assert cli.SplitsType().convert("3", None, None) == 3
    assert cli.IntListType().convert("1024, 4k,64K", None, None) == [1024, 4096, 65536]


def test_single_workload_from_options():
    w = cli._single_workload(2, 300, None, None, None, None, None, 7, True, None, 1.0, "llama-3-8b")
    assert (w.num_heads, w.num_kv_heads, w.head_dim) == (32, 8, 128)
    assert w.lengths == random_lengths(2, 300, 7) and w.lengths[0] == 300
    w = cli._single_workload(None, None, 28, None, "64", "bfloat16", 3, None, False, [5, 0, 9],
                             1.0, None)
    assert (w.batch, w.seqlen, w.num_heads, w.num_kv_heads, w.head_dim) == (3, 9, 28, 28, 64)
    assert w.num_splits == 3 and w.seed is not None
    assert w.logits_soft_cap is None


def test_soft_cap_from_the_model_or_the_option():
    """gemma-2 presets carry their cap of 50; --soft-cap overrides it (0: none), and a replay
    command carries it."""
    from cupydecode.check import _row_skeleton, repro_command

    args = (1, 300, None, None, None, None, None, 7, False, None, 1.0)
    assert cli._single_workload(*args, "gemma-2-9b").logits_soft_cap == 50.0
    assert cli._single_workload(*args, "gemma-2-9b", 0.0).logits_soft_cap is None
    assert cli._single_workload(*args, "llama-3-8b").logits_soft_cap is None
    w = cli._single_workload(*args, None, 30.0)
    assert w.logits_soft_cap == 30.0 and "cap=30" in cli._workload_label(w)
    assert repro_command(_row_skeleton(w)).endswith("--soft-cap 30.0")
    assert "--soft-cap" not in repro_command(_row_skeleton(cli._single_workload(*args, None)))
    ctx = cli.check.make_context("check", ["--soft-cap", "50"])
    assert ctx.params["soft_cap"] == 50.0
    ctx = cli.bench.make_context("bench", ["--model", "gemma-2-9b"])
    assert ctx.params["soft_cap"] is None  # the model's
    assert {w.logits_soft_cap for w in B.sweep("gemma-2-9b", "float16", [1024], [1, 2])} == {50.0}
    assert {w.logits_soft_cap for w in B.sweep("gemma-2-9b", "float16", [1024], [1], None, 0.0)} == {None}
    assert {w.logits_soft_cap for w in B.sweep("llama-3-8b", "float16", [1024], [1], None, 50)} == {50}


def test_model_presets_carry_their_layer_types():
    """Each preset's layer types with the options the model runs: Mistral's window on every
    layer, Gemma-2's and gpt-oss's windows on alternate layers (the others attend everything),
    gpt-oss's sinks and BLOOM's ALiBi on all of them."""
    from cupydecode.workloads import workload_for_model

    assert list(MODELS["llama-3-8b"].layers()) == [""]
    assert MODELS["mistral-7b"].layers()[""]["window_left"] == 4095
    for name, window in (("gemma-2-9b", 4095), ("gemma-2-2b", 4095), ("gpt-oss-20b", 127)):
        layers = MODELS[name].layers()
        assert list(layers) == ["sliding", "full"], name
        assert layers["sliding"]["window_left"] == window and "window_left" not in layers["full"]
    assert all(o["sinks"] for o in MODELS["gpt-oss-20b"].layers().values())
    assert MODELS["bloom-7b1"].layers()[""]["alibi"] and MODELS["mpt-7b"].alibi
    w = workload_for_model("gemma-2-9b", 1, 8192, layer="full")
    assert (w.name, w.layer, w.window_left, w.logits_soft_cap) == ("gemma-2-9b full", "full",
                                                                    None, 50.0)
    w = workload_for_model("gpt-oss-20b", 1, 8192)  # the first layer type
    assert (w.layer, w.window_left, w.sinks) == ("sliding", 127, True)
    assert workload_for_model("gpt-oss-20b", 1, 8192, window_left=5).window_left == 5
    with pytest.raises(ValueError, match="layer.*'sliding', 'full'.*'local'"):
        workload_for_model("gemma-2-9b", 1, 8192, layer="local")
    for name, preset in MODELS.items():  # every preset's every layer type makes a workload
        for layer in preset.layers():
            assert workload_for_model(name, 1, 64, layer=layer).kv_bytes() > 0


def test_check_and_bench_run_every_layer_type_of_a_model():
    """check --model and bench --model cover each layer type; --window, --alibi and --sinks
    set (one layer type then, for a window), they do not drop the model's others."""
    args = (1, 5000, None, None, None, None, None, 7, False, None, 1.0, "gemma-2-9b")
    sliding = cli._single_workload(*args, layer="sliding")
    full = cli._single_workload(*args, layer="full")
    assert (sliding.window_left, full.window_left) == (4095, None)
    assert sliding.name == "gemma-2-9b sliding" and sliding.logits_soft_cap == 50.0
    assert cli._single_workload(*args, window=100, layer="full").window_left == 100
    gpt = (1, 300, None, None, None, None, None, 7, False, None, 1.0, "gpt-oss-20b")
    assert cli._single_workload(*gpt, layer="full").sinks
    assert cli._single_workload(*gpt[:-1], None).sinks is False  # no model: none of its options
    points = B.sweep("gpt-oss-20b", "float16", [1024, 4096], [1, 4])
    assert [(w.layer, w.batch, w.seqlen) for w in points[:5]] == [
        ("sliding", 1, 1024), ("sliding", 1, 4096), ("sliding", 4, 1024), ("sliding", 4, 4096),
        ("full", 1, 1024)] and len(points) == 8
    assert {(w.layer, w.window_left, w.sinks) for w in points} == {("sliding", 127, True),
                                                                   ("full", None, True)}
    assert [(w.layer, w.window_left) for w in B.sweep("gemma-2-9b", "float16", [1024], [1],
                                                      window=10)] == [("sliding", 10)]
    assert all(w.alibi for w in B.sweep("llama-3-8b", "float16", [1024], [1], alibi=True))
    assert all(w.alibi for w in B.sweep("bloom-7b1", "float16", [1024], [1]))
    row = B.empty_row(points[-1], "gpt-oss-20b")
    assert row["layer"] == "full"


def test_q_len_option(runner, no_gpu):
    """--q-len reaches check's and bench's workloads (q of four dimensions, the replay command,
    the forwarded bench options) and is refused with --append before any GPU is looked for."""
    from cupydecode.check import _row_skeleton, repro_command

    args = (2, 300, None, None, None, None, None, 7, False, None, 1.0, None)
    w = cli._single_workload(*args, q_len=4)
    assert w.q_len == 4 and w.q_shape == (2, 4, 32, 128)
    assert "q_len=4" in cli._workload_label(w)
    assert repro_command(_row_skeleton(w)).endswith("--q-len 4")
    assert "--q-len" not in repro_command(_row_skeleton(cli._single_workload(*args)))
    assert {w.q_len for w in B.sweep("llama-3-8b", "float16", [1024], [1, 4], q_len=7)} == {7}
    argv = cli._forwarded_bench_args("llama-3-8b", "float16", [1024], [1], "auto", ["step"], [],
                                     q_len=3)
    assert argv[argv.index("--q-len") + 1] == "3"
    for command in (["check"], ["bench"]):
        result = runner.invoke(cli.main, [*command, "--q-len", "4", "--append"])
        assert result.exit_code == 2 and "--q-len" in result.output, result.output
    result = runner.invoke(cli.main, ["check", "--q-len", "65"])
    assert result.exit_code == 2, result.output


def test_page_size_option(runner):
    """--page-size reaches the workloads of check and bench (and the replay command)."""
    from cupydecode.check import _row_skeleton, repro_command

    args = (1, 300, None, None, None, None, None, 7, False, None, 1.0, None, None)
    w = cli._single_workload(*args, 16)
    assert w.page_size == 16 and "page=16" in cli._workload_label(w)
    assert repro_command(_row_skeleton(w)).endswith("--page-size 16")
    assert cli.check.make_context("check", ["--page-size", "5"]).params["page_size"] == 5
    assert {w.page_size for w in B.sweep("llama-3-8b", "float16", [1024], [1, 4], None, None,
                                         [64])} == {64}
    points = B.sweep("llama-3-8b", "float16", [1024, 4096], [1, 4], None, None, [None, 1, 16])
    assert [(w.batch, w.seqlen, w.page_size) for w in points[:4]] == [
        (1, 1024, None), (1, 1024, 1), (1, 1024, 16), (1, 4096, None)] and len(points) == 12
    argv = cli._forwarded_bench_args("llama-3-8b", "float16", [1024], [1], "auto", ["step"], [],
                                     None, [None, 64])
    assert cli.bench.make_context("bench", argv).params["page_sizes"] == [None, 64]
    assert cli.bench.make_context("bench", []).params["page_sizes"] == [None]
    assert "--page-size" not in cli._forwarded_bench_args("llama-3-8b", "float16", [1024], [1],
                                                          "auto", ["step"], [])
    for bad, why in (("0", ">= 1"), ("x", "or 'none'"), ("16,-1", ">= 1")):
        result = runner.invoke(cli.main, ["bench", "--page-size", bad])
        assert result.exit_code == 2 and why in result.output, result.output
    labels = [c[1] for c in cli._bench_columns({}, paged=True)]
    assert "page_label" in labels and "page_label" not in [c[1] for c in cli._bench_columns({})]
    rows = [{"batch": 1, "seqlen": 1024, "page_size": p, "gpu_us": us, "protocol": "step",
             "graph_calls": 10, "speedup_vs_best_peer": None} for p, us in ((None, 10.0), (16, 11.0))]
    assert {(r["page_size"], r["runs"]) for r in cli.stability(rows)} == {(None, 1), (16, 1)}
    assert any(w.page_size == 1 for w in default_check_matrix())


def test_append_option():
    """--append reaches the workloads of check (lengths seqlen − 1 unless given; the replay
    command) and bench (every sequence one short of seqlen), and the forwarded options."""
    from cupydecode.check import _row_skeleton, repro_command

    args = (2, 300, None, None, None, None, None, 7, False, None, 1.0, None, None, None)
    w = cli._single_workload(*args, True)
    assert w.append and w.lengths == (299, 299) and "append" in cli._workload_label(w)
    assert w.live_tokens() == 600 and w.kv_bytes() == Workload(2, 300, 32, 8, 128).kv_bytes()
    assert repro_command(_row_skeleton(w)).endswith("--lengths 299,299 --append")
    assert not cli._single_workload(*args).append
    w = cli._single_workload(2, 300, None, None, None, None, None, 7, True, None, 1.0, None,
                             None, 16, True)
    assert w.lengths == random_lengths(2, 300, 7) and w.page_size == 16 and w.append
    assert cli.check.make_context("check", ["--append"]).params["append"] is True
    assert cli.check.make_context("check", []).params["append"] is False
    points = B.sweep("llama-3-8b", "float16", [1024, 17], [1, 3], None, None, [16], True)
    assert all(w.append and w.lengths == (w.seqlen - 1,) * w.batch for w in points)
    assert all(w.kv_bytes() == dataclasses.replace(w, lengths=None, append=False).kv_bytes()
               for w in points)
    assert not any(w.append for w in B.sweep("llama-3-8b", "float16", [1024], [1]))
    argv = cli._forwarded_bench_args("llama-3-8b", "float16", [1024], [1], "auto", ["step"], [],
                                     None, [None], True)
    assert cli.bench.make_context("bench", argv).params["append"] is True
    labels = [c[1] for c in cli._bench_columns({}, False, True)]
    assert "no_append_us" in labels and "append_cost_us" in labels
    assert "no_append_us" not in [c[1] for c in cli._bench_columns({})]
    # a full sequence appends nothing: it attends seqlen tokens, no more
    assert Workload(2, 10, 8, 2, 64, lengths=(10, 0), append=True).live_tokens() == 11
    with pytest.raises(ValueError, match=r"^lengths: expected per-sequence lengths with append"):
        Workload(2, 10, 8, 2, 64, append=True)  # None: every sequence full, no room


def test_default_matrix_covers_the_contract():
    m = default_check_matrix()
    assert {w.dtype for w in m} == {"float16", "bfloat16", "float32"}
    assert {64, 128, 256, 32, 80, 96, 192} <= {w.head_dim for w in m}
    assert {1, 2, 4, 7, 16} <= {w.q_len for w in m}
    assert any(w.q_len > 1 and w.lengths and min(w.lengths) < w.q_len for w in m)
    assert {w.dtype for w in m if w.head_dim not in (64, 128, 256)} == {"float16", "bfloat16", "float32"}
    groups = {w.group for w in m}
    assert 7 in groups and 1 in groups and any(w.num_kv_heads == 1 for w in m)
    lengths = {w.seqlen for w in m}
    assert {1, 17, 255, 257, 4097, 65536} <= lengths
    assert any(w.lengths is not None and 0 in w.lengths for w in m)
    assert {1, 3, None} <= {w.num_splits for w in m}
    assert any(w.q_scale > 1000 for w in m)
    # the soft-cap on every math path: heads as N, 16 rows, M-tiles, fp32; each 16-bit type
    capped = [w for w in m if w.logits_soft_cap]
    assert {w.dtype for w in capped} == {"float16", "bfloat16", "float32"}
    assert {2, 4, 16, 48} <= {w.group for w in capped}
    # blocks of several M-tiles (G > 16, chunks of at least MTILE_MIN_CHUNK) in both 16-bit types
    assert {w.dtype for w in m if w.num_splits
            and P.m_tiles(w.dtype, w.head_dim, w.group) > 1
            and P.chunk_for_splits(w.seqlen, w.num_splits) >= P.MTILE_MIN_CHUNK} == {"float16", "bfloat16"}
    # appended tokens: every math path, contiguous and paged (pages of 1, 16 and 100), a full
    # sequence (nothing written) and an empty one (written at 0)
    appended = [w for w in m if w.append]
    assert {w.dtype for w in appended} == {"float16", "bfloat16", "float32"}
    assert {None, 1, 16, 100} <= {w.page_size for w in appended}
    assert {4, 16, 48} <= {w.group for w in appended}  # heads as N, 16 rows, M-tiles
    assert any(w.logits_soft_cap for w in appended)
    assert all(w.lengths is not None for w in appended)
    assert any(w.seqlen in w.lengths for w in appended) and any(0 in w.lengths for w in appended)
    assert any(w.page_size and any(n % w.page_size == 0 and 0 < n < w.seqlen for n in w.lengths)
               for w in appended)  # the new token opens a page
    # keep the float64 reference cheap: no cache above ~70M elements
    assert max(w.batch * w.seqlen * w.num_kv_heads * w.head_dim for w in m) <= 70_000_000
    for w in m:
        assert w.num_heads % w.num_kv_heads == 0 and w.seed is None


def test_workload_bytes_and_lengths():
    w = Workload(2, 100, 8, 2, 64, "float16", lengths=(100, 10))
    assert w.kv_bytes() == 2 * 110 * 2 * 64 * 2
    with pytest.raises(ValueError, match="lengths"):
        Workload(2, 100, 8, 2, 64, lengths=(101, 3))
    assert random_lengths(4, 50, 1) == random_lengths(4, 50, 1)
    lens = random_lengths(5, 50, 2)
    assert lens[0] == 50 and lens[-1] == 0 and all(0 <= n <= 50 for n in lens)


def test_plot_without_matplotlib_exits_2(runner, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ModuleNotFoundError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    result = runner.invoke(cli.main, ["bench", "--plot", "out.png"])
    assert result.exit_code == 2, result.output
    assert "matplotlib" in result.output


def test_bench_protocol_parsing():
    from cupydecode.bench import parse_protocol

    assert parse_protocol("step") == ("step", None)
    assert parse_protocol("back-to-back:2") == ("back-to-back", 2)
    for bad in ("steps", "step:0", "step:x", "back-to-back:", ":3"):
        with pytest.raises(ValueError, match="protocol"):
            parse_protocol(bad)


def test_bench_rejects_unknown_protocol_before_any_gpu_work(runner):
    result = runner.invoke(cli.main, ["bench", "--protocol", "warm"])
    assert result.exit_code == 2 and "protocol" in result.output


def test_stability_table_over_protocols_and_processes():
    rows = [dict(batch=1, seqlen=16, protocol="step", graph_calls=10, gpu_us=10.0,
                 speedup_vs_best_peer=1.2, process=1),
            dict(batch=1, seqlen=16, protocol="back-to-back:2", graph_calls=2, gpu_us=12.0,
                 speedup_vs_best_peer=1.05, process=2),
            dict(batch=4, seqlen=16, protocol="step", graph_calls=10, gpu_us=None)]
    (point,) = cli.stability(rows)
    assert point["best_us"] == 10.0 and point["worst_us"] == 12.0
    assert point["spread_pct"] == pytest.approx(20.0)
    assert point["worst_in"] == "back-to-back×2 (process 2)"
    assert point["min_speedup_vs_best_peer"] == 1.05


@pytest.mark.parametrize("command", [["bench"], ["check"]])
def test_unwritable_output_fails_before_any_gpu_work(runner, tmp_path, command):
    missing = tmp_path / "no" / "such" / "dir" / "rows.json"
    result = runner.invoke(cli.main, [*command, "--json", str(missing)])
    assert result.exit_code == 2 and "--json" in result.output and "does not exist" in result.output


def test_info_compile_without_gpu_compiles_with_nvrtc_or_says_not(runner, monkeypatch):
    from cupydecode import _kernels

    monkeypatch.setattr(cli, "detect_gpu", lambda: (False, "no NVIDIA driver found (test)"))
    calls = []

    def fake_compile(filename, defines, arch, ptxas_info=False):
        calls.append((filename, arch))
        return b"\x7fELF", "ptxas . 0 bytes stack frame, 0 bytes spill stores"
    monkeypatch.setattr(_kernels, "compile_for_arch", fake_compile)
    result = runner.invoke(cli.main, ["info", "--compile"])
    assert result.exit_code == 0, result.output
    if "NVRTC is not available" in result.output:
        assert not calls
    else:
        assert "compiled with NVRTC for sm_90" in result.output and calls
        assert {f for f, _ in calls} == {"decode_split.cu", "merge_states.cu"}


def test_gpu_problem_names_the_fix(monkeypatch):
    import builtins
    import sys

    from cupydecode import _kernels

    real_import = builtins.__import__

    def no_cupy(name, *args, **kwargs):
        if name == "cupy" or name.startswith("cupy."):
            raise ImportError("No module named 'cupy'")
        return real_import(name, *args, **kwargs)
    with monkeypatch.context() as m:
        m.delitem(sys.modules, "cupy", raising=False)
        m.setattr(builtins, "__import__", no_cupy)
        why = _kernels.gpu_problem()
        assert 'pip install "cupydecode[cuda12]"' in why and '"cupydecode[cuda13]"' in why
        with pytest.raises(ImportError, match=r"cupydecode\[cuda12\]"):
            _kernels.import_cupy()
    cupy = pytest.importorskip("cupy")

    def refuse():
        raise cupy.cuda.runtime.CUDARuntimeError(35)  # cudaErrorInsufficientDriver
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", refuse)
    monkeypatch.setattr(_kernels, "_driver_loadable", lambda: False)
    assert _kernels.gpu_problem().startswith("no NVIDIA driver found")
    monkeypatch.setattr(_kernels, "_driver_loadable", lambda: True)
    why = _kernels.gpu_problem()
    assert "older than the CUDA runtime" in why and "reinstall" in why, why


def test_step_traffic_sizes_follow_the_layer():
    """The decode-step protocol's other kernels move an L2's worth of writes, the QKV
    projection's weights (hidden × (H + 2·Hkv)·D, hidden = H·D) and its output."""
    from cupydecode.bench import StepTraffic

    w = Workload(batch=16, seqlen=1024, num_heads=32, num_kv_heads=8, head_dim=128,
                 dtype="float16")
    fill, weights, out = StepTraffic.sizes(w, 60 * 2**20)
    assert fill == 60 * 2**20
    assert weights == 4096 * (32 + 16) * 128 * 2          # llama-3-8b: 50.3 MB
    assert out == 16 * (32 + 16) * 128 * 2
    odd = Workload(batch=3, seqlen=1024, num_heads=7, num_kv_heads=7, head_dim=64,
                   dtype="float32")
    assert all(n % 16 == 0 for n in StepTraffic.sizes(odd, 1000))
    assert "50.3 MB read" in StepTraffic.describe(w, 60 * 2**20)


def test_processes_forward_the_sweep_options():
    """--processes re-runs the same sweep: the forwarded options parse back to the same values."""
    argv = cli._forwarded_bench_args("qwen2.5-7b", "bfloat16", [1024, 65536], [1, 16], "auto",
                                     ["step", "back-to-back:2"], ["torch"], 30.0)
    ctx = cli.bench.make_context("bench", argv + ["--processes", "1"])
    p = ctx.params
    assert p["soft_cap"] == 30.0
    assert (p["model"], p["dtype"], p["seqlens"], p["batches"], p["splits"]) == (
        "qwen2.5-7b", "bfloat16", [1024, 65536], [1, 16], "auto")
    assert p["protocols"] == ["step", "back-to-back:2"] and p["baselines"] == ("torch",)


def test_window_option():
    """--window reaches check's workload (its label, the replay command, the bytes it reads) and
    the default matrix has windowed rows on every math path's kind of shape."""
    from cupydecode.check import _row_skeleton, repro_command

    args = (3, 20000, None, None, None, None, None, 7, False, (20000, 4000, 0), 1.0, None,
            None, None, False)
    w = cli._single_workload(*args, 4095)
    assert w.window_left == 4095 and "window=4095" in cli._workload_label(w)
    assert repro_command(_row_skeleton(w)).endswith("--window 4095")
    assert w.live_tokens() == 4096 + 4000 + 0
    assert cli.check.make_context("check", ["--window", "0"]).params["window"] == 0
    windowed = [w for w in default_check_matrix() if w.window_left is not None]
    assert {0, 9, 100, 4095} <= {w.window_left for w in windowed}
    assert any(w.page_size for w in windowed) and any(w.append for w in windowed)
    assert any(w.window_left + 1 < w.seqlen for w in windowed)


def test_bench_window_option():
    """--window reaches bench's points (the bytes a windowed call reads) and the forwarded
    options of --processes."""
    points = B.sweep("llama-3-8b", "float16", [65536], [1, 2], window=4095)
    assert all(w.window_left == 4095 for w in points)
    assert points[0].kv_bytes() == Workload(1, 4096, 32, 8, 128).kv_bytes()
    argv = cli._forwarded_bench_args("llama-3-8b", "float16", [65536], [1], "auto", ["step"], [],
                                     window=4095)
    assert cli.bench.make_context("bench", argv).params["window"] == 4095
    assert cli.bench.make_context("bench", []).params["window"] is None


def test_alibi_option_and_slopes():
    """--alibi reaches check's workload (label, replay command) and bench's points; the standard
    slopes: 2^(−8(i+1)/H) for H a power of two, the interleaved extension otherwise; the default
    matrix has ALiBi rows, one with the soft-cap, a window and pages."""
    from cupydecode.check import _row_skeleton, repro_command
    from cupydecode.workloads import alibi_slopes

    assert np.allclose(alibi_slopes(8), [2.0 ** -(i + 1) for i in range(8)])
    s12 = alibi_slopes(12)
    assert s12.dtype == np.float32 and s12.shape == (12,)
    assert np.allclose(s12[:8], alibi_slopes(8))
    assert np.allclose(s12[8:], [2.0 ** (-0.5 * (2 * i + 1)) for i in range(4)])
    args = (2, 300, None, None, None, None, None, 7, False, None, 1.0, None, None, None, False,
            None)
    w = cli._single_workload(*args, True)
    assert w.alibi and "alibi" in cli._workload_label(w)
    assert repro_command(_row_skeleton(w)).endswith("--alibi")
    assert cli.check.make_context("check", ["--alibi"]).params["alibi"] is True
    assert all(p.alibi for p in B.sweep("llama-3-8b", "float16", [1024], [1], alibi=True))
    argv = cli._forwarded_bench_args("llama-3-8b", "float16", [1024], [1], "auto", ["step"], [],
                                     alibi=True)
    assert cli.bench.make_context("bench", argv).params["alibi"] is True
    rows = [w for w in default_check_matrix() if w.alibi]
    assert len(rows) >= 4 and any(w.page_size and w.window_left and w.logits_soft_cap
                                  for w in rows)


def test_sinks_option():
    """--sinks reaches check's workload (label, replay command); its sink logits come from the
    seed (the same run replays them); the matrix has sink rows in each merge of a plan."""
    from cupydecode.check import _row_skeleton, repro_command
    from cupydecode.workloads import sink_logits

    args = (2, 300, None, None, None, None, None, 7, False, None, 1.0, None, None, None, False,
            None, False)
    w = cli._single_workload(*args, True)
    assert w.sinks and "sinks" in cli._workload_label(w)
    assert repro_command(_row_skeleton(w)).endswith("--sinks")
    assert np.array_equal(sink_logits(32, 7), sink_logits(32, 7))
    assert not np.array_equal(sink_logits(32, 7), sink_logits(32, 8))
    rows = [w for w in default_check_matrix() if w.sinks]
    assert {1, 40, None} <= {w.num_splits for w in rows} and any(w.window_left for w in rows)
    assert any(w.lengths and 0 in w.lengths for w in rows)


def test_bench_sinks_option():
    assert all(p.sinks for p in B.sweep("llama-3-8b", "float16", [1024], [1, 2], sinks=True))
    argv = cli._forwarded_bench_args("llama-3-8b", "float16", [1024], [1], "auto", ["step"], [],
                                     sinks=True)
    assert cli.bench.make_context("bench", argv).params["sinks"] is True


def test_kv_dtype_option(runner, no_gpu):
    """--kv-dtype and --kv-scale reach check's workload (its label, the bytes it reads, the
    replay command) and bench's points and forwarded options; float32 q with an fp8 cache and
    an unknown format are refused before any GPU is looked for."""
    from cupydecode.check import _row_skeleton, repro_command

    args = (2, 300, None, None, None, None, None, 7, False, None, 1.0, None)
    w = cli._single_workload(*args, kv_dtype="e5m2", kv_scale="token")
    assert (w.kv_dtype, w.kv_scale) == ("e5m2", "token") and "e5m2/token" in cli._workload_label(w)
    plain = cli._single_workload(*args)
    assert plain.kv_dtype is None and "--kv-dtype" not in repro_command(_row_skeleton(plain))
    # codes of one byte, and a 4-byte scale per token and KV head of K and of V
    assert w.kv_bytes() == 2 * 600 * 8 * (128 + 4) and plain.kv_bytes() == 2 * 600 * 8 * 256
    assert dataclasses.replace(w, kv_scale="head").kv_bytes() == 2 * 600 * 8 * 128
    assert repro_command(_row_skeleton(w)).endswith("--kv-dtype e5m2 --kv-scale token")
    points = B.sweep("llama-3-8b", "float16", [1024], [1, 4], kv_dtype="e4m3", kv_scale="head")
    assert {(w.kv_dtype, w.kv_scale) for w in points} == {("e4m3", "head")}
    assert "1 B" in B.napkin(points[0]) and "scale" in B.napkin(dataclasses.replace(
        points[0], kv_scale="token"))
    argv = cli._forwarded_bench_args("llama-3-8b", "float16", [1024], [1], "auto", ["step"], [],
                                     kv_dtype="e4m3", kv_scale="token")
    p = cli.bench.make_context("bench", argv).params
    assert (p["kv_dtype"], p["kv_scale"]) == ("e4m3", "token")
    assert cli.check.make_context("check", []).params["kv_scale"] is None  # "tensor" then
    for command in (["check"], ["bench"]):
        result = runner.invoke(cli.main, [*command, "--kv-scale", "token"])
        assert result.exit_code == 2 and "--kv-dtype" in result.output, result.output
    for command in (["check"], ["bench"]):
        result = runner.invoke(cli.main, [*command, "--kv-dtype", "e4m3", "--dtype", "fp32"])
        assert result.exit_code == 2 and "--dtype" in result.output, result.output
        result = runner.invoke(cli.main, [*command, "--kv-dtype", "e3m4"])
        assert result.exit_code == 2 and "--kv-dtype" in result.output, result.output
    with pytest.raises(ValueError, match="kv_scale"):
        Workload(1, 10, 8, 2, 64, kv_dtype="e4m3", kv_scale="row")
    with pytest.raises(ValueError, match="kv_dtype"):
        Workload(1, 10, 8, 2, 64, kv_dtype="int8")
    fp8 = [w for w in default_check_matrix() if w.kv_dtype]
    assert {w.kv_dtype for w in fp8} == {"e4m3", "e5m2"}
    assert {w.kv_scale for w in fp8} == {"tensor", "head", "token"}
    assert {w.dtype for w in fp8} == {"float16", "bfloat16"}
    assert any(w.append and w.page_size and w.kv_scale == "token" for w in fp8)
    assert any(w.q_len > 1 for w in fp8) and any(w.sinks and w.alibi for w in fp8)


def test_a_gpu_with_too_little_shared_memory_is_refused_plainly(runner, monkeypatch):
    """A GPU whose blocks get less shared memory than every block shape needs (99 KB: sm_86,
    sm_89, sm_120): check and bench exit 2 with the reason, before any row runs."""
    from cupydecode import decode

    why = decode.smem_shortfall(0, 101376, "float16", 64)
    assert why and why.startswith("cupydecode needs ") and "GPU 0 allows 101376" in why, why
    assert decode.smem_shortfall(0, 232448, "float16", 128) is None  # H100, H200
    assert decode.smem_shortfall(0, 0, "float32", 256) is None  # not reported: the launch checks
    assert decode.smem_shortfall(0, 232448, "bfloat16", 512) is None
    assert decode.smem_shortfall(0, 166912, "bfloat16", 512)  # A100: head_dim 512 does not fit
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda, "Device", lambda: types.SimpleNamespace(id=0))
    monkeypatch.setattr(decode, "_smem_per_block", lambda device_id: 232448)
    assert decode.device_shortfall() is None
    monkeypatch.setattr(decode, "_smem_per_block", lambda device_id: 101376)
    why = decode.device_shortfall()
    least = min(max(c.smem_bytes for c in P.split_kernel_configs(dt, w))
                for dt in P.DTYPE_IDS for w in (64, 128, 256))
    assert why == (f"GPU 0 allows 101376 bytes of shared memory per block; cupydecode's kernels "
                   f"need at least {least}: supported are GPUs with >= 160 KB per block (A100, "
                   "H100, H200, B200)"), why
    monkeypatch.setattr(cli, "detect_gpu", lambda: (True, "1 CUDA device(s)"))
    for command in (["check"], ["bench"]):
        result = runner.invoke(cli.main, command)
        assert result.exit_code == 2, result.output
        assert f"error: no usable GPU: {why}" in result.output, result.output
