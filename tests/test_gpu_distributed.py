"""Sequence parallelism on one GPU: ranks as threads (distributed.ThreadGroup), each holding a
shard of every sequence, against single-GPU flash_decode on the whole cache and the float64
reference; a rank with bad inputs fails the step on every rank; NCCL with one rank where NCCL
is installed."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import cupydecode
from cupydecode import distributed as D
from cupydecode import reference as R
from cupydecode.workloads import alibi_slopes, sink_logits
from helpers import (LSE_TOL, OUT_TOL, assert_lse_close, assert_out_close, context, nan_tail,
                     randn, shard, to_device, to_paged)

pytestmark = pytest.mark.gpu


def _ranks(size, fn, timeout=30.0):
    """fn(rank, comm) on ``size`` threads of one ThreadGroup; (results, errors) by rank."""
    import cupy

    cupy.cuda.Device().synchronize()  # the inputs the caller made on its stream are written
    group = D.ThreadGroup(size, timeout=timeout)
    results, errors = [None] * size, [None] * size

    def body(r):
        try:
            with cupy.cuda.Stream(non_blocking=True):  # each rank on its own stream
                results[r] = fn(r, group.communicator(r))
                cupy.cuda.get_current_stream().synchronize()
        except Exception as exc:  # noqa: BLE001  (checked by the callers)
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    return results, errors


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_shards_equal_the_whole(cupy, rng, seed, dtype, ranks):
    """Random cuts of each sequence (empty shards too), ALiBi from the sequence's end, sinks
    after the merge, the soft-cap; every rank gets the result; against flash_decode on the whole
    cache and float64."""
    batch, heads, kv_heads, dim, cap = 4, 16, 4, 128, 3000
    lens = [3000, 1, 0, 1234]
    q = randn(rng, (batch, heads, dim), dtype, 3.0)
    k = nan_tail(randn(rng, (batch, cap, kv_heads, dim), dtype), lens)
    v = nan_tail(randn(rng, (batch, cap, kv_heads, dim), dtype), lens)
    cuts = [sorted([0, n, *rng.integers(0, n + 1, ranks - 1)]) for n in lens]
    slopes, sinks = alibi_slopes(heads), sink_logits(heads, seed)
    ref = R.decode_attention(q, k, v, lens, logits_soft_cap=30.0, alibi_slopes=slopes, sinks=sinks)
    whole = cupydecode.flash_decode(to_device(q), to_device(k), to_device(v),
                                    cupy.asarray(np.asarray(lens, np.int32)), return_lse=True,
                                    logits_soft_cap=30.0, alibi_slopes=cupy.asarray(slopes),
                                    sinks=cupy.asarray(sinks))
    shards = shard(k, v, lens, cuts)
    ctx = context(seed, dtype=dtype, ranks=ranks, cuts=cuts)

    def step(r, comm):
        kr, vr, n, after = shards[r]
        plan = D.ShardedDecodePlan(comm, batch, heads, kv_heads, dim, kr.shape[1], dtype,
                                   alibi=True, logits_soft_cap=30.0)
        return [plan.run(to_device(q), to_device(kr), to_device(vr),
                         cupy.asarray(n.astype(np.int32)), cupy.asarray(after.astype(np.int32)),
                         alibi_slopes=cupy.asarray(slopes), sinks=cupy.asarray(sinks))
                for _ in range(2)]  # two steps through the same plan

    results, errors = _ranks(ranks, step)
    assert errors == [None] * ranks, (errors, ctx)
    for r, steps in enumerate(results):
        for out, lse in steps:
            assert_out_close(out, ref[0], OUT_TOL[dtype], f"rank {r} {ctx}")
            assert_lse_close(lse, ref[1], LSE_TOL[dtype], f"rank {r} {ctx}")
            assert_out_close(out, whole[0].get(), 2 * OUT_TOL[dtype], f"rank {r} vs whole {ctx}")


def test_root_only_and_paged_shards(cupy, rng, seed):
    """root=1: only rank 1 gets the result; shards in paged caches (pages of 16, random order)."""
    batch, heads, kv_heads, dim, cap, ranks = 3, 32, 8, 128, 2000, 3
    lens = [2000, 700, 5]
    q = randn(rng, (batch, heads, dim), "float16")
    k = nan_tail(randn(rng, (batch, cap, kv_heads, dim), "float16"), lens)
    v = nan_tail(randn(rng, (batch, cap, kv_heads, dim), "float16"), lens)
    cuts = [[0, n // 3, 2 * n // 3, n] for n in lens]
    ref = R.decode_attention(q, k, v, lens)
    shards = shard(k, v, lens, cuts)

    def step(r, comm):
        kr, vr, n, _ = shards[r]
        kp, vp, table = to_paged(np.random.default_rng(seed + r), kr, vr, 16)
        plan = D.ShardedDecodePlan(comm, batch, heads, kv_heads, dim, kr.shape[1], "float16",
                                   root=1, page_size=16)
        return plan.run(to_device(q), to_device(kp), to_device(vp),
                        cupy.asarray(n.astype(np.int32)), block_table=cupy.asarray(table))

    results, errors = _ranks(ranks, step)
    assert errors == [None] * ranks, errors
    assert results[0] is None and results[2] is None
    out, lse = results[1]
    assert_out_close(out, ref[0], OUT_TOL["float16"], context(seed))
    assert_lse_close(lse, ref[1], LSE_TOL["float16"], context(seed))


def test_a_rank_with_bad_inputs_fails_the_step_everywhere(cupy, rng):
    """Rank 1's lengths are a device array of the wrong shape: it raises its own error, the
    others a RuntimeError naming it; nothing is merged and no rank hangs; the next step of the
    same plans (and their group), with good inputs, works; then a rank whose call fails with
    another error (a RuntimeError inside its plan) fails the step everywhere too."""
    batch, heads, kv_heads, dim, cap = 2, 8, 2, 64, 100
    q = to_device(randn(rng, (batch, heads, dim), "float16"))
    k = to_device(randn(rng, (batch, cap, kv_heads, dim), "float16"))
    plans = {}

    def step(r, comm, bad):
        if r not in plans:
            plans[r] = D.ShardedDecodePlan(comm, batch, heads, kv_heads, dim, cap, "float16")
        lens = cupy.asarray([1, 2, 3], cupy.int32) if bad and r == 1 else 50
        return plans[r].run(q, k, k, lens)

    results, errors = _ranks(3, lambda r, c: step(r, c, True))
    assert isinstance(errors[1], ValueError) and str(errors[1]).startswith("cache_seqlens")
    for r in (0, 2):
        assert isinstance(errors[r], RuntimeError) and "ranks [1] failed" in str(errors[r]), errors
    results, errors = _ranks(3, lambda r, c: step(r, c, False))  # (the plans' own group)
    assert errors == [None] * 3, errors

    def broken(*args, **kwargs):
        raise RuntimeError("the kernel of rank 2 could not be built")

    plans[2].plan.run = broken
    results, errors = _ranks(3, lambda r, c: step(r, c, False))
    assert str(errors[2]) == "the kernel of rank 2 could not be built"
    for r in (0, 1):
        assert isinstance(errors[r], RuntimeError) and "ranks [2] failed" in str(errors[r]), errors


def test_a_rank_a_step_ahead_is_refused_everywhere(cupy, rng):
    """A rank whose plan counts another step (it skipped or retried one): every rank raises,
    nothing is merged."""
    q = to_device(randn(rng, (2, 8, 64), "float16"))
    k = to_device(randn(rng, (2, 100, 2, 64), "float16"))
    plans = {}

    def step(r, comm):
        plans[r] = D.ShardedDecodePlan(comm, 2, 8, 2, 64, 100, "float16")
        plans[r].step += r == 1
        return plans[r].run(q, k, k, 50)

    _, errors = _ranks(2, step)
    for r in range(2):
        assert isinstance(errors[r], RuntimeError) and "sent steps" in str(errors[r]), errors


def test_plans_that_differ_are_refused_on_every_rank(cupy):
    """A different head_dim, soft-cap value or kv_dtype on one rank, or a rank whose plan
    fails to build: every rank raises."""
    for other in ({"head_dim": 64}, {"logits_soft_cap": 20.0}, {"kv_dtype": "e4m3"}):
        def build(r, comm, other=other):
            args = dict(batch=2, num_heads=8, num_kv_heads=2, head_dim=128, max_seqlen=100,
                        dtype="float16", logits_soft_cap=30.0)
            return D.ShardedDecodePlan(comm, **dict(args, **(other if r else {})))

        _, errors = _ranks(2, build)
        for r in range(2):
            assert isinstance(errors[r], ValueError) and "differs from ranks" in str(errors[r]), (
                other, errors)

    def bad(r, comm):
        return D.ShardedDecodePlan(comm, 2, 8, 3 if r == 1 else 2, 128, 100, "float16")

    _, errors = _ranks(3, bad)
    assert isinstance(errors[1], ValueError) and str(errors[1]).startswith("num_kv_heads")
    for r in (0, 2):
        assert isinstance(errors[r], RuntimeError) and "ranks [1] failed" in str(errors[r]), errors


def test_tokens_after_refused_by_name(cupy):
    """DecodePlan.run's tokens_after: an int32 device array of (batch,), not with an append;
    the context is healthy afterwards (a valid call)."""
    plan = cupydecode.DecodePlan(2, 8, 2, 64, 100, "float16")
    q = cupy.ones((2, 8, 64), cupy.float16)
    k = cupy.ones((2, 100, 2, 64), cupy.float16)
    for bad, kind, what in (([1, 2], TypeError, r"a \(batch,\) int32 device array"),
                            (cupy.zeros(2, cupy.int64), TypeError, "dtype int32"),
                            (cupy.zeros(3, cupy.int32), ValueError, r"shape \(2,\)"),
                            (cupy.zeros(4, cupy.int32)[::2], ValueError, "a contiguous array")):
        with pytest.raises(kind, match=rf"^tokens_after: expected {what}"):
            plan.run(q, k, k, 10, tokens_after=bad)
    new = cupy.ones((2, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match=r"^tokens_after: expected None with k_new"):
        plan.run(q, k, k, 10, k_new=new, v_new=new, tokens_after=cupy.zeros(2, cupy.int32))
    out, _ = plan.run(q, k, k, 10, tokens_after=cupy.asarray([0, 5], cupy.int32))
    assert bool(cupy.allclose(out, 1.0))


@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tokens_after_matches_reference(cupy, rng, seed, dtype, q_len):
    """A cache holding one shard of each sequence, with tokens after it (0, a few, more than
    the window, past 2^31 clamped): the query tokens' positions, the window, ALiBi and the causal
    limits of several query tokens count them; every merge mode, contiguous and paged."""
    batch, heads, kv_heads, dim, cap = 4, 16, 4, 128, 1500
    # 150 after 1500 keys: a window of 400 or 1000 covers part of the shard (the splits before
    # its first key empty); 2000 after none; 2^31 − 1 (clamped to 2^30) after 777: no key in
    # any window
    lens = [1500, 300, 0, 777]
    after = np.asarray([150, 3, 2000, 2**31 - 1], np.int64)
    shape = (batch, q_len, heads, dim) if q_len > 1 else (batch, heads, dim)
    q = randn(rng, shape, dtype, 3.0)
    k = nan_tail(randn(rng, (batch, cap, kv_heads, dim), dtype), lens)
    v = nan_tail(randn(rng, (batch, cap, kv_heads, dim), dtype), lens)
    slopes = alibi_slopes(heads)
    d_after = cupy.asarray(after.astype(np.int32))
    for options in ({}, {"window_left": 400}, {"alibi": True, "logits_soft_cap": 30.0,
                                                 "window_left": 1000}):
        ref_opts = {"alibi_slopes": slopes} if options.get("alibi") else {}
        ref_opts.update({n: options[n] for n in ("window_left", "logits_soft_cap") if n in options})
        ref = R.decode_attention(q, k, v, lens, tokens_after=np.minimum(after, 2**30), **ref_opts)
        run_opts = {"alibi_slopes": cupy.asarray(slopes)} if options.get("alibi") else {}
        ctx = context(seed, dtype=dtype, q_len=q_len, options=sorted(options))
        for mode in ({"num_splits": 1}, {"num_splits": 5, "merge": "fused"},
                     {"num_splits": 5, "merge": "kernel"}, {}):
            plan = cupydecode.DecodePlan(batch, heads, kv_heads, dim, cap, dtype, q_len=q_len,
                                         **options, **mode)
            out = cupy.full(shape, np.nan, to_device(q).dtype)
            lse = cupy.full(shape[:-1], np.nan, cupy.float32)
            plan.run(to_device(q), to_device(k), to_device(v), cupy.asarray(lens, cupy.int32),
                     out=out, lse=lse, tokens_after=d_after, **run_opts)
            assert_out_close(out, ref[0], OUT_TOL[dtype], f"{mode} {ctx}")
            assert_lse_close(lse, ref[1], LSE_TOL[dtype], f"{mode} {ctx}")
    kp, vp, table = to_paged(rng, k, v, 16)
    plan = cupydecode.DecodePlan(batch, heads, kv_heads, dim, cap, dtype, q_len=q_len,
                                 page_size=16, window_left=400)
    ref = R.decode_attention(q, k, v, lens, tokens_after=np.minimum(after, 2**30), window_left=400)
    out, lse = plan.run(to_device(q), to_device(kp), to_device(vp), cupy.asarray(lens, cupy.int32),
                        block_table=cupy.asarray(table), tokens_after=d_after)
    assert_out_close(out, ref[0], OUT_TOL[dtype], f"paged {context(seed)}")
    assert_lse_close(lse, ref[1], LSE_TOL[dtype], f"paged {context(seed)}")


@pytest.mark.parametrize("q_len", [1, 3])
def test_shards_with_a_window_and_query_tokens(cupy, rng, seed, q_len):
    """Sequence parallelism with a window and several query tokens (each causal to its own
    position across the cuts): the sharded result equals the whole sequence's."""
    batch, heads, kv_heads, dim, cap, ranks = 3, 16, 4, 128, 2500, 3
    lens = [2500, 900, 40]
    shape = (batch, q_len, heads, dim) if q_len > 1 else (batch, heads, dim)
    q = randn(rng, shape, "float16")
    k = nan_tail(randn(rng, (batch, cap, kv_heads, dim), "float16"), lens)
    v = nan_tail(randn(rng, (batch, cap, kv_heads, dim), "float16"), lens)
    cuts = [sorted([0, n, *rng.integers(0, n + 1, ranks - 1)]) for n in lens]
    slopes = alibi_slopes(heads)
    ref = R.decode_attention(q, k, v, lens, window_left=700, alibi_slopes=slopes)
    shards = shard(k, v, lens, cuts)

    def step(r, comm):
        kr, vr, n, after = shards[r]
        plan = D.ShardedDecodePlan(comm, batch, heads, kv_heads, dim, kr.shape[1], "float16",
                                   window_left=700, alibi=True, q_len=q_len)
        return plan.run(to_device(q), to_device(kr), to_device(vr),
                        cupy.asarray(n.astype(np.int32)), cupy.asarray(after.astype(np.int32)),
                        alibi_slopes=cupy.asarray(slopes))

    results, errors = _ranks(ranks, step)
    assert errors == [None] * ranks, errors
    for r, (out, lse) in enumerate(results):
        ctx = context(seed, q_len=q_len, cuts=cuts, rank=r)
        assert_out_close(out, ref[0], OUT_TOL["float16"], ctx)
        assert_lse_close(lse, ref[1], LSE_TOL["float16"], ctx)


class _QueuedComm:
    """One rank whose all-gather is only queued (as NCCL's): ``wait`` counted, or raising."""

    def __init__(self, fail_wait_at=None):
        self.rank, self.size, self.waits, self.fail_wait_at = 0, 1, 0, fail_wait_at

    def all_gather(self, send):
        return send.reshape(1, -1).copy()

    def wait(self):
        self.waits += 1
        if self.waits == self.fail_wait_at:
            raise TimeoutError("the collective did not finish (planted)")


def test_a_queued_collective_is_waited_for(cupy, rng, seed):
    """A communicator with ``wait`` (its collectives queued): the plan waits once when built
    and once a step, after queuing the merge; a wait that raises fails the step."""
    q = randn(rng, (2, 8, 64), "float16")
    k = randn(rng, (2, 300, 2, 64), "float16")
    v = randn(rng, (2, 300, 2, 64), "float16")
    ref = R.decode_attention(q, k, v, [300, 5])
    comm = _QueuedComm(fail_wait_at=3)
    plan = D.ShardedDecodePlan(comm, 2, 8, 2, 64, 300, "float16")
    assert comm.waits == 1
    lens = cupy.asarray([300, 5], cupy.int32)
    out, lse = plan.run(to_device(q), to_device(k), to_device(v), lens)
    assert comm.waits == 2
    assert_out_close(out, ref[0], OUT_TOL["float16"], context(seed))
    assert_lse_close(lse, ref[1], LSE_TOL["float16"], context(seed))
    with pytest.raises(TimeoutError, match="planted"):
        plan.run(to_device(q), to_device(k), to_device(v), lens)


@pytest.mark.nccl
def test_nccl_one_rank(cupy, rng, seed):
    """The NCCL communicator with one rank (a one-GPU machine): the plan's result is the
    single-GPU one."""
    try:
        from cupy.cuda import nccl  # noqa: F401

        uid = D.nccl_unique_id()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NCCL is not available through CuPy here ({type(exc).__name__}: {exc})")
    comm = D.NcclCommunicator(1, uid, 0, timeout=30)
    q = randn(rng, (2, 8, 128), "float16")
    k = randn(rng, (2, 500, 2, 128), "float16")
    v = randn(rng, (2, 500, 2, 128), "float16")
    ref = R.decode_attention(q, k, v, [500, 77])
    plan = D.ShardedDecodePlan(comm, 2, 8, 2, 128, 500, "float16")
    out, lse = plan.run(to_device(q), to_device(k), to_device(v),
                        cupy.asarray([500, 77], cupy.int32))
    assert_out_close(out, ref[0], OUT_TOL["float16"], context(seed))
    assert_lse_close(lse, ref[1], LSE_TOL["float16"], context(seed))


@pytest.mark.nccl
def test_bench_gpus_one_rank(cupy):
    """`bench --gpus 1` on one GPU: the scaling table's row (NCCL with one rank), its output
    against the single GPU's."""
    try:
        D.nccl_unique_id()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NCCL is not available through CuPy here ({type(exc).__name__}: {exc})")
    from cupydecode.bench import scaling_rows

    rows = scaling_rows(dict(batch=2, seqlen=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                             dtype="float16", seed=5), 1, steps=5)
    assert [r["gpus"] for r in rows] == [1], rows
    row = rows[0]
    assert row["step_us"] > 0 and 0 < row["collective_share"] < 1, row
    assert row["rel_err"] is not None and row["rel_err"] < 2e-3, row


def test_a_shard_shorter_than_the_query_tokens(cupy, rng, seed):
    """With tokens_after, a shard may hold fewer keys than q_len (the query tokens are on
    another rank): an int length of 2 with q_len 4 is taken, and equals the reference."""
    q = randn(rng, (2, 4, 8, 64), "float16")
    k = randn(rng, (2, 10, 2, 64), "float16")
    v = randn(rng, (2, 10, 2, 64), "float16")
    plan = cupydecode.DecodePlan(2, 8, 2, 64, 10, "float16", q_len=4, window_left=6)
    after = np.asarray([5, 1], np.int32)
    ref = R.decode_attention(q, k, v, 2, window_left=6, tokens_after=after)
    for _ in range(2):  # the second through the remembered call
        out, lse = plan.run(to_device(q), to_device(k), to_device(v), 2,
                            tokens_after=cupy.asarray(after))
        assert_out_close(out, ref[0], OUT_TOL["float16"], context(seed))
        assert_lse_close(lse, ref[1], LSE_TOL["float16"], context(seed))
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected lengths >= q_len=4"):
        plan.run(to_device(q), to_device(k), to_device(v), 2)
