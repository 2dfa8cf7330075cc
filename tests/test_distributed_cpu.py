"""Sequence parallelism without a GPU: the sharded math on the float64 reference (any cut of
each sequence into per-rank shards, merged through the LSEs, equals the whole sequence's
attention, with ALiBi counted from the sequence's end, the soft-cap and sinks joined once), and
the in-process communicator's collective and timeout."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cupydecode import distributed as D
from cupydecode import reference as R
from cupydecode.workloads import alibi_slopes, sink_logits
from helpers import shard

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 5), q_len=st.sampled_from([1, 3]),
       options=st.sampled_from(["plain", "alibi", "sinks", "cap", "window", "all"]))
def test_shards_merge_to_the_whole(seed, ranks, q_len, options):
    """Any cut of each sequence into per-rank shards (empty ones too), each attended with its
    tokens after it counted in the query tokens' positions (tokens_after), merged through the
    LSEs with the sinks once: the whole sequence's attention, with ALiBi, a window, the soft-cap
    and several query tokens (causal across the cuts)."""
    rng = np.random.default_rng(seed)
    batch, heads, kv_heads, dim, cap = 3, 8, 2, 16, 60
    lens = [int(rng.integers(0, cap + 1)) for _ in range(batch)]
    q = rng.standard_normal((batch, q_len, heads, dim) if q_len > 1 else (batch, heads, dim)) * 2
    k = rng.standard_normal((batch, cap, kv_heads, dim))
    v = rng.standard_normal((batch, cap, kv_heads, dim))
    # each sequence cut at random points (shards may be empty), rank order = token order
    cuts = [sorted([0, n, *rng.integers(0, n + 1, ranks - 1)]) for n in lens]
    slopes = alibi_slopes(heads)
    opts = {"alibi": {"alibi_slopes": slopes}, "cap": {"logits_soft_cap": 5.0}, "sinks": {},
            "plain": {}, "window": {"window_left": 9},
            "all": {"alibi_slopes": slopes, "logits_soft_cap": 5.0, "window_left": 20}}[options]
    sinks = sink_logits(heads, seed) if options in ("sinks", "all") else None
    whole = R.decode_attention(q, k, v, lens, sinks=sinks, **opts)
    o_parts, lse_parts = [], []
    for kr, vr, n, after in shard(k, v, lens, cuts):
        o, lse = R.decode_attention(q, kr, vr, n, tokens_after=after, **opts)
        o_parts.append(o)
        lse_parts.append(lse)
    out, lse = R.merge_states(np.stack(o_parts), np.stack(lse_parts), sinks=sinks)
    np.testing.assert_allclose(out, whole[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(lse, whole[1], rtol=1e-12, atol=1e-12)


def test_tokens_after_moves_the_query_positions():
    """A cache of 5 keys with 3 tokens after it: the query sits at position 7, so a window of 2
    keeps nothing of it (keys 5..7 are elsewhere) and ALiBi charges key j 7 − j."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s) for s in ((1, 2, 4), (1, 5, 1, 4), (1, 5, 1, 4)))
    out, lse = R.decode_attention(q, k, v, [5], window_left=2, tokens_after=[3])
    assert np.all(out == 0) and np.all(np.isneginf(lse))
    slopes = np.asarray([0.5, 0.25])
    got = R.decode_attention(q, k, v, [5], alibi_slopes=slopes, tokens_after=[3])[1]
    plain = R.decode_attention(q, k, v, [5], alibi_slopes=slopes)[1]
    np.testing.assert_allclose(got, plain - 3 * slopes[None, :], rtol=1e-12)
    with pytest.raises(ValueError, match=r"^tokens_after: expected None with k_new"):
        R.decode_attention(q, k, v, [4], k_new=k[:, :1], v_new=v[:, :1], tokens_after=[1])


def _run_ranks(group, fn):
    results, errors = [None] * group.size, [None] * group.size

    def body(r):
        try:
            results[r] = fn(group.communicator(r))
        except Exception as exc:  # noqa: BLE001  (checked by the caller)
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(group.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return results, errors


def test_thread_group_all_gather_in_rank_order():
    group = D.ThreadGroup(3, timeout=10)
    for step in range(3):  # the slots are reused from step to step
        results, errors = _run_ranks(group, lambda c: c.all_gather(
            np.full(4, 10 * step + c.rank, np.uint8)))
        assert errors == [None] * 3
        for got in results:
            np.testing.assert_array_equal(got, [[10 * step + r] * 4 for r in range(3)])


def test_thread_group_rank_that_never_arrives_fails_the_others_in_time():
    group = D.ThreadGroup(3, timeout=0.5)

    def step(c):
        if c.rank == 1:
            raise RuntimeError("rank 1 broke before the collective")
        return c.all_gather(np.zeros(2, np.uint8))

    results, errors = _run_ranks(group, step)
    assert str(errors[1]) == "rank 1 broke before the collective"
    for r in (0, 2):
        assert isinstance(errors[r], RuntimeError) and "did not reach the collective" in str(errors[r])
        assert f"rank {r}" in str(errors[r])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_thread_group_size_checked(bad):
    with pytest.raises((TypeError, ValueError), match=r"^size: expected"):
        D.ThreadGroup(bad)


def test_thread_group_rank_checked():
    with pytest.raises(ValueError, match=r"^rank: expected"):
        D.ThreadGroup(2).communicator(2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("rows_shape", [(1, 1), (3, 5), (2, 8)])
def test_pieces_round_trip(dtype, rows_shape):
    """Each rank's piece (header, LSEs, outputs) packed, gathered and unpacked in rank order,
    bit for bit, for row counts whose LSEs do not fill 16 bytes; a failed rank's piece carries
    only its header."""
    import ml_dtypes

    npdt = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[dtype]
    rng = np.random.default_rng(3)
    rows, dim = int(np.prod(rows_shape)), 24
    nbytes = D.piece_layout(rows, dim, np.dtype(npdt).itemsize)[2]
    assert D.piece_layout(rows, dim, 2)[1] % 16 == 0
    lses = [rng.standard_normal(rows_shape).astype(np.float32) for _ in range(3)]
    outs = [rng.standard_normal((*rows_shape, dim)).astype(npdt) for _ in range(3)]
    pieces = []
    for r in range(3):
        send = np.zeros(nbytes, np.uint8)
        if r == 2:
            D.pack_piece(send, D.FAILED, r, 7)
        else:
            D.pack_piece(send, D.OK, r, 7, lses[r], outs[r])
        pieces.append(send)
    headers, lse, out = D.unpack_pieces(np.stack(pieces), rows_shape, dim, npdt)
    np.testing.assert_array_equal(headers, [[0, 0, 7, 0], [0, 1, 7, 0], [1, 2, 7, 0]])
    for r in range(2):
        assert np.array_equal(lse[r].view(np.uint32), lses[r].view(np.uint32))
        assert np.array_equal(out[r].view(np.uint8), outs[r].view(np.uint8))
    with pytest.raises(RuntimeError, match=r"^rank 0: ranks \[2\] failed this step"):
        D.check_headers(headers, 0, 7)
    with pytest.raises(ValueError, match=r"^recv: expected pieces of"):
        D.unpack_pieces(np.stack(pieces)[:, :-1], rows_shape, dim, npdt)


def test_piece_views_write_through():
    """piece_views are views of the piece (a plan writes its output and LSEs there, no copy),
    at 16-byte offsets, and agree with pack_piece's layout."""
    rows_shape, dim = (3, 5), 24
    rng = np.random.default_rng(4)
    lse = rng.standard_normal(rows_shape).astype(np.float32)
    out = rng.standard_normal((*rows_shape, dim)).astype(np.float16)
    packed = np.zeros(D.piece_layout(15, dim, 2)[2], np.uint8)
    D.pack_piece(packed, D.OK, 1, 9, lse, out)
    send = np.zeros_like(packed)
    header, lse_view, out_view = D.piece_views(send, rows_shape, dim, np.float16)
    assert all(np.shares_memory(x, send) for x in (header, lse_view, out_view))
    assert all(x.ctypes.data % 16 == send.ctypes.data % 16 for x in (header, lse_view, out_view))
    header[:], lse_view[...], out_view[...] = (D.OK, 1, 9, 0), lse, out
    assert np.array_equal(send, packed)
    with pytest.raises(ValueError, match=r"^send: expected a piece of"):
        D.piece_views(send[:-1], rows_shape, dim, np.float16)


def test_headers_of_another_step_are_refused():
    ok = np.asarray([[0, 0, 4, 0], [0, 1, 5, 0], [0, 2, 4, 0]], np.int32)
    with pytest.raises(RuntimeError, match=r"^rank 2: ranks \[1\] sent steps \[5\] to step 4"):
        D.check_headers(ok, 2, 4)
    D.check_headers(ok[[0, 2]], 0, 4)


def test_broken_thread_group_says_so():
    group = D.ThreadGroup(2, timeout=0.2)
    _, errors = _run_ranks(group, lambda c: c.all_gather(np.zeros(1, np.uint8)) if c.rank else None)
    assert isinstance(errors[1], RuntimeError)
    with pytest.raises(RuntimeError, match="broken by an earlier failure"):
        group.communicator(0).all_gather(np.zeros(1, np.uint8))


def test_gpu_counts_of_a_scaling_table():
    from cupydecode.bench import gpu_counts

    assert gpu_counts(1) == [1] and gpu_counts(2) == [1, 2]
    assert gpu_counts(8) == [1, 2, 4, 8] and gpu_counts(6) == [1, 2, 4, 6]


def test_bench_gpus_is_checked_before_any_gpu_use():
    from click.testing import CliRunner

    from cupydecode.cli import main

    result = CliRunner().invoke(main, ["bench", "--gpus", "0"])
    assert result.exit_code == 2 and "--gpus" in result.output


@pytest.mark.parametrize("extra, named", [
    (["--append", "--page-size", "16"], "--page-size, --append"),
    (["--baseline", "torch", "--protocol", "back-to-back"], "--protocol, --baseline"),
    (["--splits", "4", "--plot", "x.png"], "--splits, --plot"),
    (["--kv-dtype", "e4m3", "--window", "8", "--sinks"], "--window, --sinks, --kv-dtype"),
])
def test_bench_gpus_refuses_the_options_it_would_ignore(extra, named):
    """bench --gpus times the plain decode step: the single-GPU sweep's options are refused by
    name before any GPU use, not dropped silently."""
    from click.testing import CliRunner

    from cupydecode.cli import main

    result = CliRunner().invoke(main, ["bench", "--gpus", "2", *extra])
    assert result.exit_code == 2, result.output
    assert f"--gpus times the plain decode step (shapes and dtype only): drop {named}" in (
        result.output), result.output
