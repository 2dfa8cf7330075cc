"""DecodePlan: same results as flash_decode, fixed workspace, and CUDA graph capture/replay."""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import _kernels, _policy
from cupydecode import reference as R
from helpers import (DTYPES, LSE_TOL, OUT_TOL, DecodeCase, assert_lse_close, assert_out_close,
                     context, decode_inputs, np_dtype, poison_pool, to_device)

pytestmark = pytest.mark.gpu

MERGES = ("fused", "kernel")


def _captured_run(cupy, plan, seqlens=None):
    """Zeroed q, K, V and outputs of ``plan``'s shape, and ``plan.run`` on them captured as a CUDA
    graph on a new non-blocking stream after one eager run (compile, opt in to shared memory).
    Returns ``(stream, graph, (q, k, v, out, lse))``; tests change the arrays in place."""
    q = cupy.zeros((plan.batch, plan.num_heads, plan.head_dim), np_dtype(plan.dtype))
    k = cupy.zeros((plan.batch, plan.max_seqlen, plan.num_kv_heads, plan.head_dim), q.dtype)
    v = cupy.zeros_like(k)
    out = cupy.empty(q.shape, q.dtype)
    lse = cupy.empty((plan.batch, plan.num_heads), cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(q, k, v, seqlens, out=out, lse=lse)  # warm up: compile, opt in to shared memory
        stream.synchronize()
        stream.begin_capture()
        plan.run(q, k, v, seqlens, out=out, lse=lse)
        graph = stream.end_capture()
    return stream, graph, (q, k, v, out, lse)


@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("dtype", DTYPES)
def test_plan_matches_flash_decode(cupy, rng, seed, dtype, splits):
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 3, 28, 4, 128, 2500
    lens = [2500, 0, 999]
    ctx = context(seed, dtype=dtype, splits=splits)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype,
                                 num_splits=splits)
    out, lse = plan.run(dq, dk, dv, seqlens)
    assert out is plan.out and lse is plan.lse, ctx
    # Same split choice (forced or automatic) as the plan, hence the same chunks and bits.
    want, want_lse = cupydecode.flash_decode(dq, dk, dv, seqlens, num_splits=splits,
                                             return_lse=True)
    assert cupy.array_equal(out.view(cupy.uint8), want.view(cupy.uint8)), ctx
    assert cupy.array_equal(lse, want_lse), ctx
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    assert_out_close(out, ref_out, OUT_TOL[dtype], ctx)
    assert_lse_close(lse, ref_lse, LSE_TOL[dtype], ctx)
    # Caller-provided outputs.
    my_out = cupy.full(q.shape, np.nan, dtype=dq.dtype)
    my_lse = cupy.full(lse.shape, np.nan, dtype=cupy.float32)
    got, got_lse = plan.run(dq, dk, dv, seqlens, out=my_out, lse=my_lse)
    assert got is my_out and got_lse is my_lse, ctx
    assert cupy.array_equal(my_out.view(cupy.uint8), want.view(cupy.uint8)), ctx
    assert cupy.array_equal(my_lse, want_lse), ctx


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,splits",
                         [(32, 8, 128, 7), (8, 1, 256, 40), (16, 2, 64, 20), (28, 4, 128, 33),
                          (71, 1, 64, 3), (48, 1, 128, 3)])
def test_merge_modes_agree(cupy, rng, seed, num_heads, num_kv_heads, head_dim, splits):
    """The fused last-block merge and the separate merge kernel give the same result: one and
    two passes of head_dim per row, one and several groups of 16 splits (several warps per row
    in the kernel, several trips per warp in the fused merge), and blocks of several M-tiles
    (G > 16: up to 80 rows merged by one block)."""
    batch, max_seqlen = 2, 5000
    ctx = context(seed, layout=(num_heads, num_kv_heads, head_dim), splits=splits)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, "bfloat16")
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    plans = {m: cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen,
                                      "bfloat16", num_splits=splits, merge=m) for m in MERGES}
    assert [plans[m].merge for m in MERGES] == list(MERGES), ctx
    want_m_tiles = _policy.m_tiles("bfloat16", head_dim, num_heads // num_kv_heads)
    assert all(p.m_tiles == want_m_tiles for p in plans.values()), ctx  # 5000 / splits ≥ 512
    refs = {}
    for length in (5000, 4321, 1, 0, 5000):  # repeated runs: the fused counters reset themselves
        if length not in refs:
            refs[length] = R.decode_attention(q, k, v, length)
        ref_out, ref_lse = refs[length]
        results = {}
        for m, plan in plans.items():
            out, lse = plan.run(dq, dk, dv, length)
            step = f"merge={m} length={length} {ctx}"
            assert_out_close(out, ref_out, OUT_TOL["bfloat16"], step)
            assert_lse_close(lse, ref_lse, LSE_TOL["bfloat16"], step)
            results[m] = (out.copy(), lse.copy())
        assert_out_close(results["fused"][0], results["kernel"][0], OUT_TOL["bfloat16"], ctx,
                         "fused vs kernel")
        assert_lse_close(results["fused"][1], results["kernel"][1], LSE_TOL["bfloat16"], ctx)


@pytest.mark.parametrize("merge", MERGES)
def test_merge_reads_partials_only_after_the_split_kernel(cupy, rng, seed, merge):
    """The merge kernel is launched as a programmatic dependent of the split kernel where the GPU
    allows it (compute capability 9.0), so its blocks start while the split kernel still runs,
    and it must still read every partial only after the split kernel wrote it. Here the split
    kernel runs long (4 blocks of 8192 tokens each), eagerly and in graph replay; the workspace
    is poisoned with NaN before each run and each run has fresh inputs, so an early read shows as
    NaN. (Reads moved before the wait fail this test on the
    H200; the performance log, v13.) merge="fused" runs the same steps as a control: one
    launch, the last split block merging."""
    from cupydecode import _kernels

    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 1, 8, 1, 256, 32768
    ctx = context(seed, merge=merge)
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen,
                                 "bfloat16", num_splits=4, merge=merge)
    # programmatic where supported (on the H200: `cupydecode info` says so, test_cli_gpu.py)
    supported = _kernels.programmatic_launch_supported(plan.device_id)
    if merge == "kernel":
        assert plan._merge_call.programmatic == supported, ctx
    stream, graph, (q, k, v, out, lse) = _captured_run(cupy, plan)
    for run in range(4):
        hq, hk, hv = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen,
                                   "bfloat16")
        with stream:
            q[...], k[...], v[...] = to_device(hq), to_device(hk), to_device(hv)
            for a in (plan.o_part, plan.lse_part, out, lse):
                a.fill(np.nan)
            if run % 2:
                graph.launch(stream)
            else:
                plan.run(q, k, v, out=out, lse=lse)
        stream.synchronize()
        ref_out, ref_lse = R.decode_attention(hq, hk, hv)
        step = f"run {run} ({'graph' if run % 2 else 'eager'}) {ctx}"
        assert_out_close(out, ref_out, OUT_TOL["bfloat16"], step)
        assert_lse_close(lse, ref_lse, LSE_TOL["bfloat16"], step)
    if merge == "kernel":  # and no launch was refused (that would fall back to plain launches)
        assert plan._merge_call.programmatic == supported, ctx


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,splits,plain,programmatic",
                         [(32, 8, 128, 16, "fused", "fused"), (28, 4, 128, 16, "fused", "kernel"),
                          (8, 1, 256, 128, "kernel", "kernel"), (8, 1, 256, 3, "kernel", "kernel"),
                          (2, 1, 256, 16, "fused", "fused"), (32, 8, 128, 1, "none", "none")])
def test_auto_merge_mode(cupy, rng, seed, num_heads, num_kv_heads, head_dim, splits, plain,
                         programmatic):
    """merge="auto" takes the fused merge only where each warp of the merging block has one
    trip (≤ 16 splits, rows × passes ≤ warps) and, where the merge kernel is launched as a
    programmatic dependent, the block folds at most 64 states (G = 7 × 16 splits: 112); it is
    right either way."""
    from cupydecode import _kernels

    batch, max_seqlen = 1, 4100
    ctx = context(seed, layout=(num_heads, num_kv_heads, head_dim), splits=splits)
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen,
                                 "float16", num_splits=splits)
    pdl = _kernels.programmatic_launch_supported(plan.device_id)
    assert plan.merge == (programmatic if pdl else plain), (pdl, ctx)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    for length in (4100, 777):
        ref_out, ref_lse = R.decode_attention(q, k, v, length)
        out, lse = plan.run(dq, dk, dv, length)
        assert_out_close(out, ref_out, OUT_TOL["float16"], f"length={length} {ctx}")
        assert_lse_close(lse, ref_lse, LSE_TOL["float16"], f"length={length} {ctx}")


def test_plan_attributes(cupy):
    for batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype in [
            (1, 32, 8, 128, 16384, "float16"), (64, 32, 8, 128, 8192, "bfloat16"),
            (3, 71, 1, 64, 4097, "float32"), (1, 8, 1, 256, 1, "float16"),
            (2, 8, 2, 128, 0, "float16")]:
        plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
        case = repr(plan)
        assert 1 <= plan.num_splits <= _policy.MAX_SPLITS, case
        assert plan.chunk_tokens >= 1, case
        assert plan.num_splits * plan.chunk_tokens >= max_seqlen, case
        assert (plan.num_splits - 1) * plan.chunk_tokens < max(1, max_seqlen), case
        assert plan.out.shape == (batch, num_heads, head_dim), case
        assert np.dtype(plan.out.dtype).name == dtype, case
        assert plan.lse.shape == (batch, num_heads) and plan.lse.dtype == np.float32, case
        if plan.num_splits == 1:
            assert plan.workspace_bytes == 0, case
        else:
            partials = plan.num_splits * batch * num_heads * (head_dim + 1) * 4
            assert plan.workspace_bytes >= partials, case
    forced = cupydecode.DecodePlan(2, 8, 2, 128, 4097, "float16", num_splits=3)
    assert forced.num_splits == 3 and forced.chunk_tokens * 3 >= 4097
    sized = cupydecode.DecodePlan(2, 8, 2, 128, 4097, "float16", split_size=1024)
    assert sized.num_splits == 5 and sized.chunk_tokens == 1024
    # A small batch at a long context must be split to fill the machine; a full one need not.
    assert cupydecode.DecodePlan(1, 32, 8, 128, 65536, "float16").num_splits > 1
    assert cupydecode.DecodePlan(64, 32, 8, 128, 8192, "float16").num_splits == 1


def test_plan_run_rejects(cupy, rng):
    plan = cupydecode.DecodePlan(2, 8, 2, 128, 64, "float16")
    q, k, v = (to_device(x) for x in decode_inputs(rng, 2, 8, 2, 128, 64, "float16"))
    with pytest.raises(TypeError, match="cache_seqlens"):
        plan.run(q, k, v, [64, 3])
    with pytest.raises(TypeError, match="cache_seqlens"):
        plan.run(q, k, v, np.array([64, 3], np.int32))
    with pytest.raises(ValueError, match=r"^q/k_cache/v_cache: expected the plan's shape"):
        plan.run(q, cupy.ascontiguousarray(k[:, :32]), cupy.ascontiguousarray(v[:, :32]))
    with pytest.raises(ValueError, match=r"^q/k_cache/v_cache: expected the plan's shape"):
        plan.run(q[:1], k[:1], v[:1])
    with pytest.raises(ValueError, match=r"^q/k_cache/v_cache: expected the plan's shape"):
        plan.run(q.astype(cupy.float32), k.astype(cupy.float32), v.astype(cupy.float32))
    with pytest.raises(ValueError, match=r"^out: expected shape"):
        plan.run(q, k, v, out=cupy.empty((2, 8, 64), cupy.float16))
    with pytest.raises(ValueError, match=r"^lse: expected shape"):
        plan.run(q, k, v, lse=cupy.empty((2, 4), cupy.float32))
    # Still usable: device lengths and ints are fine.
    plan.run(q, k, v, cupy.asarray(np.array([64, 3], np.int32)))
    plan.run(q, k, v, 17)


def test_remembered_inputs_still_take_their_own_values(cupy, rng, seed):
    """run and flash_decode skip the checks of a kind of inputs that passed before (same shapes,
    strides, dtypes, alignment, devices and host values: _validate.call_key; an int length by
    its type alone), never the values of a new kind: host lengths and softmax scales taken in
    turn each give their own reference in both rounds (the second all remembered: the kernel's
    parameters follow each), and bad inputs between them are still refused by name."""
    batch, heads, kv_heads, dim, cap = 2, 8, 2, 128, 700
    hq, hk, hv = decode_inputs(rng, batch, heads, kv_heads, dim, cap, "float16")
    q, k, v = to_device(hq), to_device(hk), to_device(hv)
    lens = cupy.asarray(np.array([700, 251], np.int32))
    plan = cupydecode.DecodePlan(batch, heads, kv_heads, dim, cap, "float16", num_splits=3)
    for rnd in range(2):
        for length, scale in ((None, None), (700, 0.05), (123, None), (700, 0.2), (lens, 0.05),
                              (77, 0.05), (lens, None)):
            ctx = context(seed, round=rnd, length=length if isinstance(length, int) else "dev",
                          scale=scale)
            out = cupy.full(q.shape, np.nan, q.dtype)
            plan.run(q, k, v, length, out=out, softmax_scale=scale)
            want = [700, 251] if length is lens else length
            ref, _ = R.decode_attention(hq, hk, hv, want, softmax_scale=scale)
            assert_out_close(out, ref, OUT_TOL["float16"], ctx)
            out = cupy.full(q.shape, np.nan, q.dtype)
            cupydecode.flash_decode(q, k, v, length, softmax_scale=scale, num_splits=2, out=out)
            assert_out_close(out, ref, OUT_TOL["float16"], f"flash_decode {ctx}")
        with pytest.raises(ValueError, match="^cache_seqlens:"):
            plan.run(q, k, v, cap + 1)
        with pytest.raises(ValueError, match="^cache_seqlens:"):
            cupydecode.flash_decode(q, k, v, -1, num_splits=2)
        with pytest.raises(TypeError, match="^cache_seqlens:"):
            plan.run(q, k, v, True)
        with pytest.raises(ValueError, match="^cache_seqlens:"):
            plan.run(q, k, v, cupy.zeros(batch + 1, cupy.int32))
        with pytest.raises(ValueError, match="^softmax_scale:"):
            plan.run(q, k, v, lens, softmax_scale=float("nan"))
        with pytest.raises(ValueError, match="^num_splits:"):
            cupydecode.flash_decode(q, k, v, lens, num_splits=0)
        with pytest.raises(TypeError, match="^num_splits:"):
            cupydecode.flash_decode(q, k, v, lens, num_splits=2.0)
        with pytest.raises(ValueError, match="^q: .*contiguous"):  # every other column
            plan.run(cupy.zeros((batch, heads, 2 * dim), q.dtype)[:, :, ::2], k, v, lens)


def test_plain_build_refuses_runtime_options(cupy, rng):
    """The split kernel's build without runtime options ignores sinks and tokens_after: a call
    prepared for that build (no sinks) launched with a sinks pointer is a host bug, refused
    before the launch; the same plan with sinks prepares the other build and runs."""
    batch, heads, dim, cap = 2, 4, 128, 64
    hq, hk, hv = decode_inputs(rng, batch, heads, heads, dim, cap, "float16")
    q, k, v = to_device(hq), to_device(hk), to_device(hv)
    plan = cupydecode.DecodePlan(batch, heads, heads, dim, cap, "float16", num_splits=1)
    plan.run(q, k, v, cap)
    (call,) = plan._calls.values()
    sinks = cupy.asarray(rng.standard_normal(heads).astype(np.float32))
    seqlens_dummy = cupy.zeros(batch, cupy.int32)
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, 0, 0, 0, 0)  # (a launch would still be valid)
    with pytest.raises(RuntimeError, match="without runtime options"):
        plan._launch(call, None, ptrs, plan.out.data.ptr, 0, 0, sinks.data.ptr, 0, 0)
    with pytest.raises(RuntimeError, match="without runtime options"):  # tokens_after
        plan._launch(call, None, ptrs, plan.out.data.ptr, 0, 0, 0, 0, 0, seqlens_dummy.data.ptr)
    out, _ = plan.run(q, k, v, cap, sinks=sinks)
    ref, _ = R.decode_attention(hq, hk, hv, cap, sinks=cupy.asnumpy(sinks))
    assert_out_close(out, ref, OUT_TOL["float16"], "sinks after the refusal")


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("dtype,splits", [("float16", None), ("bfloat16", 3), ("float32", 1),
                                          ("float16", 5)])
def test_graph_capture_and_replay(cupy, rng, seed, dtype, splits, merge):
    """Capture plan.run once; change q, K, V and the device lengths in place; replay."""
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 3, 32, 8, 128, 3000
    ctx = context(seed, dtype=dtype, splits=splits, merge=merge)
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype,
                                 num_splits=splits, merge=merge)
    seqlens = cupy.zeros(batch, cupy.int32)
    stream, graph, (q, k, v, out, lse) = _captured_run(cupy, plan, seqlens)

    for step, lens in enumerate(([3000, 1, 0], [17, 2999, 1500], [0, 0, 3000])):
        hq, hk, hv = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
        with stream:
            q[...] = to_device(hq)
            k[...] = to_device(hk)
            v[...] = to_device(hv)
            seqlens[...] = cupy.asarray(np.asarray(lens, np.int32))
            out.fill(np.nan)
            lse.fill(np.nan)
            graph.launch(stream)
        stream.synchronize()
        ref_out, ref_lse = R.decode_attention(hq, hk, hv, lens)
        step_ctx = f"step {step} lens={lens} {ctx}"
        assert_out_close(out, ref_out, OUT_TOL[dtype], step_ctx)
        assert_lse_close(lse, ref_lse, LSE_TOL[dtype], step_ctx)


def test_plan_on_its_own_stream_many_replays(cupy, rng, seed):
    """Many graph replays back to back, then one check: no state leaks between replays."""
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 1, 32, 8, 128, 16384
    ctx = context(seed)
    hq, hk, hv = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
    q, k, v = to_device(hq), to_device(hk), to_device(hv)
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
    assert plan.num_splits > 1, repr(plan)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(q, k, v)
        stream.begin_capture()
        for _ in range(10):
            plan.run(q, k, v)
        graph = stream.end_capture()
        for _ in range(20):
            graph.launch(stream)
    stream.synchronize()
    ref_out, ref_lse = R.decode_attention(hq, hk, hv)
    assert_out_close(plan.out, ref_out, OUT_TOL["float16"], ctx)
    assert_lse_close(plan.lse, ref_lse, LSE_TOL["float16"], ctx)


def test_fused_merge_many_launches_changing_lengths(cupy, rng, seed):
    """The fused merge over many launches whose lengths change every time (splits past a length
    sit idle), with the partials poisoned before each launch: a merging block that read a partial
    before it was written, or a counter that did not come back to 0, would show. Every result is
    bit-identical to that length's first one, which matches the reference."""
    batch, num_heads, num_kv_heads, head_dim, max_seqlen, splits = 2, 8, 2, 64, 1024, 8
    ctx = context(seed)
    hq, hk, hv = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
    q, k, v = to_device(hq), to_device(hk), to_device(hv)
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16",
                                 num_splits=splits, merge="fused")
    assert plan.merge == "fused", repr(plan)
    lengths = (1024, 130, 1, 1000, 0, 640)  # 8, 2, 1, 8, 0 and 5 live splits of 128 tokens
    first = {}
    mismatches = []
    for i in range(20 * len(lengths) + 1):
        length = lengths[i % len(lengths)]
        plan.o_part.fill(np.nan)  # a partial read before it is written would show
        plan.lse_part.fill(np.nan)
        out, lse = plan.run(q, k, v, length)
        if length not in first:
            ref_out, ref_lse = R.decode_attention(hq, hk, hv, length)
            assert_out_close(out, ref_out, OUT_TOL["float16"], f"length={length} {ctx}")
            assert_lse_close(lse, ref_lse, LSE_TOL["float16"], f"length={length} {ctx}")
            first[length] = (out.copy(), lse.copy())
        elif not (cupy.array_equal(out.view(cupy.uint16), first[length][0].view(cupy.uint16))
                  and cupy.array_equal(lse.view(cupy.uint32), first[length][1].view(cupy.uint32))):
            mismatches.append((i, length))
    assert not mismatches, f"launches (index, length) that differ from the first: {mismatches[:10]} {ctx}"
    assert not plan._counters.any(), ctx  # every counter back at 0 for the next launch


def _in_new_thread(fn, *args):
    """Run ``fn(*args)`` in a new thread, so that its CUDA work is the thread's first; return its
    result, or raise here what it raised."""
    import threading

    got = {}

    def worker():
        try:
            got["result"] = fn(*args)
        except BaseException as exc:  # raised again in the calling thread
            got["error"] = exc

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    if "error" in got:
        raise got["error"]
    return got["result"]


def test_first_cuda_work_of_a_new_thread(cupy, rng, seed):
    """A thread whose first CUDA work is a launch (no context bound to it yet) still computes."""
    ctx = context(seed)
    hq, hk, hv = decode_inputs(rng, 2, 8, 2, 128, 300, "float16")
    q, k, v = to_device(hq), to_device(hk), to_device(hv)
    plan = cupydecode.DecodePlan(2, 8, 2, 128, 300, "float16", num_splits=3)
    cupy.cuda.Device().synchronize()

    def work():
        out, _ = plan.run(q, k, v)  # the thread's first CUDA call
        return cupy.asnumpy(out), cupy.asnumpy(cupydecode.flash_decode(q, k, v, num_splits=2))

    got_plan, got_eager = _in_new_thread(work)
    ref_out, _ = R.decode_attention(hq, hk, hv)
    assert_out_close(got_plan, ref_out, OUT_TOL["float16"], f"plan.run {ctx}")
    assert_out_close(got_eager, ref_out, OUT_TOL["float16"], f"flash_decode {ctx}")


def test_plan_built_in_a_new_thread(cupy, rng, seed):
    """A thread whose first CUDA work is building a plan with automatic splits (an occupancy
    query and a shared-memory opt-in: driver calls that need a context bound to the thread),
    or an eager call with the plan caches cleared (so it builds its own plan), still computes."""
    from cupydecode import _kernels
    from cupydecode import decode as D

    ctx = context(seed)
    hq, hk, hv = decode_inputs(rng, 1, 12, 3, 64, 777, "bfloat16")
    q, k, v = to_device(hq), to_device(hk), to_device(hv)
    cupy.cuda.Device().synchronize()
    got = {}

    def work(kind):  # the thread's first CUDA work:
        if kind == "plan":
            out = cupydecode.DecodePlan(1, 12, 3, 64, 777, "bfloat16").run(q, k, v)[0]
        else:
            out = cupydecode.flash_decode(q, k, v)
        return cupy.asnumpy(out)

    for kind in ("plan", "eager"):
        D._blocks_per_sm.cache_clear()  # so that the thread makes these driver calls itself
        D._PLAN_CACHE.clear()
        D._EAGER.clear()
        _kernels._smem_opted_in.clear()
        got[kind] = _in_new_thread(work, kind)
    ref_out, _ = R.decode_attention(hq, hk, hv)
    assert_out_close(got["plan"], ref_out, OUT_TOL["bfloat16"], f"plan {ctx}")
    assert_out_close(got["eager"], ref_out, OUT_TOL["bfloat16"], f"flash_decode {ctx}")


def test_eager_plans_are_not_shared_across_per_thread_default_streams(cupy):
    """flash_decode's cached plans (workspaces) are per stream; the per-thread default stream is
    a different stream in each thread although its handle is the same."""
    import threading

    from cupydecode import decode as D

    shape = dict(batch=1, q_len=1, num_heads=8, num_kv_heads=2, head_dim=64, max_seqlen=128)
    plans = []

    def cached():  # as flash_decode looks its plan up: by the current stream's handle
        return D._cached_plan(shape, "float16", None, None, None, None, False,
                              cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)

    def worker():
        with cupy.cuda.Stream.ptds:
            plans.append(cached())
            plans.append(cached())

    for _ in range(2):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert plans[0] is plans[1] and plans[2] is plans[3]   # reused within a thread
    assert plans[0] is not plans[2]                        # not across threads
    a = cached()                   # the legacy default stream is one stream for all threads:
    assert a is cached()           # shared


def _counter_case(cupy, rng):
    """A fused-merge shape (several splits), its device inputs and float64 reference."""
    args = (2, 16, 4, 128, 3000, "float16")
    hq, hk, hv = decode_inputs(rng, 2, 16, 4, 128, 3000, "float16")
    ref_out, ref_lse = R.decode_attention(hq, hk, hv)
    return args, (to_device(hq), to_device(hk), to_device(hv)), ref_out, ref_lse


def test_plan_built_on_one_stream_runs_on_another(cupy, rng, seed):
    """The fused merge's counters are zeroed on the stream that builds the plan; a run on another
    (non-blocking) stream right after must still see zeros, even over a pool full of NaN."""
    ctx = context(seed)
    args, (q, k, v), ref_out, ref_lse = _counter_case(cupy, rng)
    cupydecode.DecodePlan(*args).run(q, k, v)  # compile first: the build below is then quick
    cupy.cuda.Device().synchronize()
    poison_pool(cupy, 1 << 20)  # the plan's buffers then come from NaN-filled pool blocks
    plan = cupydecode.DecodePlan(*args)
    assert plan.num_splits > 1 and plan.merge == "fused", repr(plan)
    other = cupy.cuda.Stream(non_blocking=True)
    with other:
        out, lse = plan.run(q, k, v)
        again = plan.run(q, k, v, out=cupy.empty_like(out))[0]
    other.synchronize()
    assert_out_close(out, ref_out, OUT_TOL["float16"], ctx)
    assert_lse_close(lse, ref_lse, LSE_TOL["float16"], ctx)
    assert cupy.array_equal(again, out), ctx


def test_plan_built_during_capture_runs_eagerly_before_replay(cupy, rng, seed):
    """A plan built while its stream is captured gets its counter fill as a graph node; an eager
    run before the graph's first replay zeroes them itself, and the replay is right too."""
    ctx = context(seed)
    args, (q, k, v), ref_out, ref_lse = _counter_case(cupy, rng)
    cupydecode.DecodePlan(*args).run(q, k, v)  # compile outside the capture
    cupy.cuda.Device().synchronize()
    poison_pool(cupy, 1 << 20)  # the plan's buffers then come from NaN-filled pool blocks
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        plan = cupydecode.DecodePlan(*args)
        plan.run(q, k, v)
        graph = stream.end_capture()
        assert plan.num_splits > 1 and plan.merge == "fused", repr(plan)
        plan.out.fill(np.nan)
        plan.run(q, k, v)  # eager, before any replay
    stream.synchronize()
    assert_out_close(plan.out, ref_out, OUT_TOL["float16"], f"eager {ctx}")
    with stream:
        plan.out.fill(np.nan)
        graph.launch(stream)
        graph.launch(stream)
    stream.synchronize()
    assert_out_close(plan.out, ref_out, OUT_TOL["float16"], f"replay {ctx}")
    assert_lse_close(plan.lse, ref_lse, LSE_TOL["float16"], f"replay {ctx}")


_LATE_WRITER = r"""
// Lets its dependents start at once, spins, and only then copies four 16-bit buffers.
extern "C" __global__ void late_copy(const unsigned short* s0, unsigned short* d0, long long n0,
                                     const unsigned short* s1, unsigned short* d1, long long n1,
                                     const unsigned short* s2, unsigned short* d2, long long n2,
                                     const unsigned short* s3, unsigned short* d3, long long n3,
                                     unsigned long long spin_ns) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // dependents may start now
#endif
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < spin_ns);
    const long long first = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = first; i < n0; i += stride) d0[i] = s0[i];
    for (long long i = first; i < n1; i += stride) d1[i] = s1[i];
    for (long long i = first; i < n2; i += stride) d2[i] = s2[i];
    for (long long i = first; i < n3; i += stride) d3[i] = s3[i];
}
"""


@pytest.mark.parametrize("splits", [1, 4])
def test_enable_pdl_waits_for_the_kernel_before_it(cupy, rng, seed, splits):
    """With enable_pdl, the split kernel may be resident before the kernel ahead of it ends: it
    must still see everything that kernel writes. Here one kernel lets its dependents start at
    once, spins 50 µs, and only then writes q, the lengths, K and V over NaN / zero, right
    before plan.run: reading any of them early shows in the output. Eager and graph."""
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 3, 32, 8, 128, 1500
    lens = [1500, 7, 1024]
    ctx = context(seed, splits=splits)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
    srcs = [to_device(q), cupy.asarray(np.asarray(lens, np.int32)), to_device(k), to_device(v)]
    dsts = [cupy.empty_like(x) for x in srcs]
    dq, seqlens, dk, dv = dsts
    copy = cupy.RawKernel(_LATE_WRITER, "late_copy")
    args = []
    for src, dst in zip(srcs, dsts):
        args += [src.view(cupy.uint16), dst.view(cupy.uint16), np.int64(dst.nbytes // 2)]
    args.append(np.uint64(50_000))
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen,
                                 "float16", num_splits=splits, enable_pdl=True)
    programmatic = _kernels.programmatic_launch_supported(cupy.cuda.Device().id)
    assert plan._launches and all(launch.programmatic == programmatic
                                  for launch in plan._launches.values()), ctx
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)

    def step():
        for x in (dq, dk, dv, plan.out):
            x.fill(np.nan)
        seqlens.fill(0)
        copy((64,), (256,), tuple(args))
        return plan.run(dq, dk, dv, seqlens)

    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()
    with stream:
        out, lse = step()
        assert_out_close(out, ref_out, OUT_TOL["float16"], ctx, "eager out")
        assert_lse_close(lse, ref_lse, LSE_TOL["float16"], ctx)
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        for _ in range(3):
            graph.launch(stream)
        stream.synchronize()
        assert_out_close(plan.out, ref_out, OUT_TOL["float16"], ctx, "graph out")
        assert_lse_close(plan.lse, ref_lse, LSE_TOL["float16"], ctx)


@pytest.mark.parametrize("dtype,splits", [("float16", None), ("bfloat16", 3), ("float16", 1)])
@pytest.mark.parametrize("evict_first", [False, True])
def test_l2_hint_and_plain_copies_agree_with_the_reference(cupy, rng, seed, monkeypatch,
                                                           dtype, splits, evict_first):
    """Both K/V copy variants (the L2 evict-first hint on short calls, plain copies on long
    ones: _policy.l2_evict_first), forced here on a small case, NaN-poisoned outputs."""
    monkeypatch.setattr(_policy, "l2_evict_first", lambda dt, nbytes: evict_first)
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 3, 32, 8, 128, 3000
    lens = [3000, 1, 1777]
    ctx = context(seed, dtype=dtype, splits=splits, evict_first=evict_first)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype,
                                 num_splits=splits)
    assert plan.config.l2_evict_first == evict_first, ctx
    out = cupy.full(q.shape, np.nan, np_dtype(dtype))
    lse = cupy.full((batch, num_heads), np.nan, cupy.float32)
    plan.run(to_device(q), to_device(k), to_device(v), cupy.asarray(np.asarray(lens, np.int32)),
             out=out, lse=lse)
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    assert_out_close(out, ref_out, OUT_TOL[dtype], ctx)
    assert_lse_close(lse, ref_lse, LSE_TOL[dtype], ctx)


def test_long_calls_take_plain_copies(cupy):
    short = cupydecode.DecodePlan(1, 32, 8, 128, 16384, "float16")         # 67 MB of K and V
    long = cupydecode.DecodePlan(16, 32, 8, 128, 65536, "float16")         # 4.3 GB
    assert short.config.l2_evict_first and not long.config.l2_evict_first
    assert cupydecode.DecodePlan(16, 32, 8, 128, 65536, "float32").config.l2_evict_first


@pytest.mark.parametrize("tuning", [
    dict(num_warps=8, stages=2), dict(num_warps=2, stages=6), dict(l2_evict_first=False),
    dict(warps_in_step=True), dict(warps_in_step=False, num_warps=8, stages=3),
    dict(kv_groups=False)])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tuned_block_shapes_agree_with_the_reference(cupy, rng, seed, dtype, tuning):
    """Block shapes and flags set through cupydecode.Tuning (the A/B tool's override) build and
    give the reference's outputs, split and not; the plan reports the shape it runs."""
    case = DecodeCase(rng, seed, 3, 32, 8, 128, 3000, dtype, [3000, 1111, 0])
    for splits in (1, 5):
        plan = case.plan(num_splits=splits, tuning=cupydecode.Tuning(**tuning))
        for name in ("num_warps", "stages", "l2_evict_first"):
            if name in tuning:
                assert getattr(plan.config, name) == tuning[name], (name, plan.config)
        case.check(*case.run(plan), f"{tuning} splits={splits}")


def test_kv_groups_off_keeps_one_kv_head_a_block(cupy, rng, seed):
    """Tuning(kv_groups=False) where the policy takes blocks of adjacent KV heads (the burst
    groups of head_dim 80, long one-split streams at 128): one KV head a block, and the
    reference's outputs. (The policy's grouped shapes are those of the H200's cost model.)"""
    case = DecodeCase(rng, seed, 2, 8, 8, 80, 2000, "float16", [2000, 777])
    assert case.plan().kv_per_block > 1, repr(case.plan())  # (H200 cost model)
    plan = case.plan(tuning=cupydecode.Tuning(kv_groups=False))
    assert plan.kv_per_block == 1, repr(plan)
    case.check(*case.run(plan), "head_dim 80, kv_groups=False")
    shape = (64, 32, 8, 128, 8192, "float16")
    assert cupydecode.DecodePlan(*shape).kv_per_block > 1  # (H200 cost model)
    off = cupydecode.DecodePlan(*shape, tuning=cupydecode.Tuning(kv_groups=False))
    assert off.kv_per_block == 1, repr(off)
