"""flash_decode against the float64 reference, on the GPU.

Every case draws fresh random data; outputs are poisoned with NaN before each call (through
``out=`` and, for the no-``out`` path, through the memory pool), and the cache past each
sequence's length is NaN, so an unwritten output element or an out-of-range read fails the test.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import (DTYPES, LSE_TOL, OUT_TOL, assert_lse_close, assert_out_close, context,
                     decode_inputs, nan_tail, poison_pool, randn, to_device)

pytestmark = pytest.mark.gpu

HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 4, 7, 8, 12, 16)  # 16-bit types: ≤ 8 the heads-as-N path, 12 and 16 the 16-row path
LENGTHS = (1, 2, 17, 255, 256, 257, 4097, 65536)
BATCHES = (1, 3, 8)
SPLITS = (1, 3, None)
# Elements of K per case at most (the float64 reference reads K and V in float64).
MAX_KV_ELEMS = 1 << 24


def _fits(dtype, head_dim, group, length, batch, splits):
    if length >= 65536 and batch > 1:
        return False
    return batch * length * head_dim <= MAX_KV_ELEMS


def _covering_cases(n_extra: int = 36):
    """Every length × dtype, the other axes drawn from a fixed generator (stable test ids; the
    data itself is fresh every run), then extra draws from the whole product, then one case
    for any axis value still missing. Each case: (dtype, head_dim, group, length, batch, splits)."""
    pick = random.Random(0x5EED)
    cases = []
    for length, dtype in itertools.product(LENGTHS, DTYPES):
        while True:
            c = (dtype, pick.choice(HEAD_DIMS), pick.choice(GROUPS), length,
                 pick.choice(BATCHES), pick.choice(SPLITS))
            if _fits(*c):
                cases.append(c)
                break
    product = [c for c in itertools.product(DTYPES, HEAD_DIMS, GROUPS, LENGTHS, BATCHES, SPLITS)
               if _fits(*c) and c not in cases]
    cases += pick.sample(product, n_extra)
    for axis, values in enumerate((DTYPES, HEAD_DIMS, GROUPS, LENGTHS, BATCHES, SPLITS)):
        for value in values:
            if not any(c[axis] == value for c in cases):
                cases.append(next(c for c in product if c[axis] == value and c not in cases))
    return cases


CASES = _covering_cases()


def _case_id(c):
    dtype, head_dim, group, length, batch, splits = c
    return f"{dtype}-D{head_dim}-G{group}-L{length}-B{batch}-S{'auto' if splits is None else splits}"


def _lengths(rng, batch, length, varlen):
    """Per-sequence lengths: all full, or random with one full and (batch ≥ 3) one empty."""
    if not varlen or batch == 1:
        return [length] * batch
    lens = rng.integers(0, length + 1, batch)
    lens[rng.integers(batch)] = length
    if batch >= 3:
        lens[(np.argmax(lens) + 1) % batch] = 0
    return [int(x) for x in lens]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_flash_decode_matches_reference(cupy, rng, seed, case):
    dtype, head_dim, group, length, batch, splits = case
    num_kv_heads = 2 if batch * length * head_dim * 2 <= MAX_KV_ELEMS else 1
    num_heads = group * num_kv_heads
    varlen = batch > 1 and CASES.index(case) % 2 == 0
    lens = _lengths(rng, batch, length, varlen)
    ctx = context(seed, case=_case_id(case), num_heads=num_heads, num_kv_heads=num_kv_heads,
                  lens=lens if batch <= 8 else "...")
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, length, dtype)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)

    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    seqlens = cupy.asarray(np.asarray(lens, np.int32)) if varlen else None
    out = cupy.full(q.shape, np.nan, dtype=dq.dtype)
    got, lse = cupydecode.flash_decode(dq, dk, dv, seqlens, num_splits=splits, return_lse=True,
                                       out=out)
    assert got is out, ctx
    assert got.dtype == dq.dtype and got.shape == q.shape, ctx
    assert lse.dtype == np.float32 and lse.shape == (batch, num_heads), ctx
    assert_out_close(got, ref_out, OUT_TOL[dtype], ctx)
    assert_lse_close(lse, ref_lse, LSE_TOL[dtype], ctx)
    for b, n in enumerate(lens):
        if n == 0:
            assert not cupy.any(got[b]), f"empty sequence {b}: out not exactly 0 {ctx}"

    # The no-out path, over a memory pool full of NaN: same kernels, same bits.
    poison_pool(cupy, got.nbytes)
    again = cupydecode.flash_decode(dq, dk, dv, seqlens, num_splits=splits)
    assert again.dtype == got.dtype and again.shape == got.shape, ctx
    assert cupy.array_equal(again.view(cupy.uint8), got.view(cupy.uint8)), f"no-out path differs {ctx}"


SPLIT_AGREEMENT = [  # (dtype, batch, num_heads, num_kv_heads, head_dim, length)
    ("float16", 2, 32, 8, 128, 4097),
    ("bfloat16", 3, 28, 4, 128, 2000),
    ("float32", 1, 16, 2, 64, 8191),
    ("float16", 1, 8, 1, 256, 65536),
    ("bfloat16", 8, 8, 8, 64, 257),
]


@pytest.mark.parametrize("dtype,batch,num_heads,num_kv_heads,head_dim,length", SPLIT_AGREEMENT)
def test_split_counts_agree(cupy, rng, seed, dtype, batch, num_heads, num_kv_heads, head_dim, length):
    ctx = context(seed, dtype=dtype, batch=batch, heads=f"{num_heads}/{num_kv_heads}",
                  head_dim=head_dim, length=length)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, length, dtype)
    ref_out, ref_lse = R.decode_attention(q, k, v)
    splits = (1, 3, None)
    results = dict(zip(splits, splits_match_reference(cupy, q, k, v, None, ref_out, ref_lse,
                                                      dtype, ctx, splits)))
    for a, b in itertools.combinations(results, 2):
        what = f"splits {a} vs {b}"
        assert_out_close(results[a][0], results[b][0], OUT_TOL[dtype], ctx, what)
        assert_lse_close(results[a][1], results[b][1], LSE_TOL[dtype], f"{what} {ctx}")


def splits_match_reference(cupy, q, k, v, cache_seqlens, ref_out, ref_lse, dtype, ctx,
                           splits=(1, 3, None)) -> list:
    """flash_decode with each split count (into a NaN-poisoned ``out``) against the float64
    reference; returns the (out, lse) of each, in the order of ``splits``."""
    results = []
    dq, dk, dv = to_device(q), to_device(k), to_device(v)  # once, not per split count
    for s in splits:
        out = cupy.full(q.shape, np.nan, dtype=q.dtype)
        got, lse = cupydecode.flash_decode(dq, dk, dv, cache_seqlens, num_splits=s, out=out,
                                           return_lse=True)
        assert_out_close(got, ref_out, OUT_TOL[dtype], f"splits={s} {ctx}")
        assert_lse_close(lse, ref_lse, LSE_TOL[dtype], f"splits={s} {ctx}")
        results.append((got, lse))
    return results


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [4, 5, 16])
def test_long_chunk_shape(cupy, rng, seed, dtype, group):
    """Blocks that stream ≥ LONG_CHUNK tokens run another block shape at head_dim 128 (more
    warps, fewer stages; G ≤ 8 takes it from HEADS_AS_N_LONG_CHUNK, so both 16-bit paths are
    here: G = 4, 5 heads-as-N, G = 16 the 16-row path): direct output and a merge of 2 splits
    (fused for G = 4, 5, the merge kernel for G = 16), ragged ends and an empty sequence."""
    from cupydecode import _policy

    batch, num_kv_heads, head_dim, max_seqlen = 4, 2, 128, 5000
    lens = [max_seqlen, 0, 2049, 4113]
    ctx = context(seed, dtype=dtype, head_dim=head_dim, group=group, lens=lens)
    q, k, v = decode_inputs(rng, batch, group * num_kv_heads, num_kv_heads, head_dim, max_seqlen,
                            dtype)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    for splits in (1, 2):
        plan = cupydecode.DecodePlan(batch, group * num_kv_heads, num_kv_heads, head_dim,
                                     max_seqlen, dtype, num_splits=splits)
        assert plan.chunk_tokens >= _policy.LONG_CHUNK, ctx
        assert plan.config == _policy.split_kernel_config(dtype, head_dim, _policy.LONG_CHUNK,
                                                          1, group), ctx
        assert plan.config.heads_as_n == (group <= 8), ctx
        assert plan.config != _policy.split_kernel_config(dtype, head_dim, 0, 1, group), ctx
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    for got, lse in splits_match_reference(cupy, q, k, v, seqlens, ref_out, ref_lse, dtype, ctx,
                                           splits=(1, 2)):
        assert not cupy.any(got[1]) and bool(cupy.all(cupy.isneginf(lse[1]))), ctx


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_warps_in_step(cupy, rng, seed, dtype, group):
    """Long heads-as-N chunks run with the block's warps in step (a barrier per tile), but only
    in blocks whose tiles divide evenly over the warps: one launch holds both kinds of block and
    empty ones (lengths 8192 = 512 tiles, 8200 and 8208 = 513 tiles, 16400 with a 1-tile last
    chunk, 0), one split of 16400 tokens and 8192-token splits, against float64."""
    from cupydecode import _policy

    num_kv_heads, head_dim, max_seqlen = 2, 128, 16400
    lens = [8192, 8200, 0, max_seqlen, 8208]
    ctx = context(seed, dtype=dtype, group=group, lens=lens)
    q, k, v = decode_inputs(rng, len(lens), group * num_kv_heads, num_kv_heads, head_dim,
                            max_seqlen, dtype)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    for opts in ({"num_splits": 1}, {"split_size": 8192}):
        plan = cupydecode.DecodePlan(len(lens), group * num_kv_heads, num_kv_heads, head_dim,
                                     max_seqlen, dtype, **opts)
        assert plan.config.heads_as_n and plan._in_step == 1, (ctx, opts)
        assert plan.chunk_tokens >= _policy.WARPS_IN_STEP_MIN_CHUNK, (ctx, opts)
        out = cupy.full(q.shape, np.nan, dtype=q.dtype)
        lse = cupy.full(q.shape[:2], np.nan, dtype=cupy.float32)
        for _ in range(2):  # again, after the first launch
            got, got_lse = plan.run(dq, dk, dv, seqlens, out=out, lse=lse)
            assert_out_close(got, ref_out, OUT_TOL[dtype], f"{opts} {ctx}")
            assert_lse_close(got_lse, ref_lse, LSE_TOL[dtype], f"{opts} {ctx}")
        assert not cupy.any(got[2]) and bool(cupy.all(cupy.isneginf(got_lse[2]))), ctx


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("opts", [{"num_splits": 1}, {"num_splits": 3, "merge": "kernel"},
                                  {"num_splits": 3, "merge": "fused"}], ids=["one", "kernel", "fused"])
@pytest.mark.parametrize("order", ["nhd", "hnd"])
def test_kv_groups(cupy, rng, seed, monkeypatch, dtype, group, opts, order):
    """Blocks of KV_GROUP KV heads (the policy's choice for long one-split streams; forced here
    on a small shape) against float64: two groups of KV heads, ragged lengths (0, 1, chunk
    boundaries, max_seqlen), one split (direct output) and three merged by the kernel or fused,
    the cache as a (batch, seqlen, kv_heads, head_dim) buffer or a view of (batch, kv_heads,
    seqlen, head_dim) memory; each plan run twice. One launch mixes blocks whose warps go in
    step (an even tile count per slot: 1024 tokens = 64 tiles, chunks of 342 = 22 tiles; the
    only way the policy's plans run) with blocks whose warps cannot (odd tile counts)."""
    from cupydecode import _policy

    monkeypatch.setattr(_policy, "kv_per_block", lambda *a, **k: _policy.KV_GROUP)
    num_kv_heads, head_dim, max_seqlen = 2 * _policy.KV_GROUP, 128, 1024
    lens = [max_seqlen, 0, 1, 333, 352, 1023]
    ctx = context(seed, dtype=dtype, group=group, opts=opts, order=order)
    q, k, v = decode_inputs(rng, len(lens), group * num_kv_heads, num_kv_heads, head_dim,
                            max_seqlen, dtype)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    if order == "hnd":
        dk = cupy.ascontiguousarray(dk.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        dv = cupy.ascontiguousarray(dv.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    plan = cupydecode.DecodePlan(len(lens), group * num_kv_heads, num_kv_heads, head_dim,
                                 max_seqlen, dtype, **opts)
    assert plan.kv_per_block == _policy.KV_GROUP and plan.config.kv_per_block == plan.kv_per_block
    assert plan._grid[0] == 2 and plan.merge == ("none" if opts["num_splits"] == 1 else opts["merge"])
    slots = plan.config.slots
    assert plan._in_step == 1 and slots == 2 and (-(-plan.chunk_tokens // 16)) % slots == 0, plan
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    lse = cupy.full(q.shape[:2], np.nan, dtype=cupy.float32)
    for _ in range(2):  # again, after the first launch (the fused merge's counters wrap)
        got, got_lse = plan.run(dq, dk, dv, seqlens, out=out, lse=lse)
        assert_out_close(got, ref_out, OUT_TOL[dtype], ctx)
        assert_lse_close(got_lse, ref_lse, LSE_TOL[dtype], ctx)
    assert not cupy.any(got[1]) and bool(cupy.all(cupy.isneginf(got_lse[1]))), ctx


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["device", "host_list", "host_ndarray", "int", "none"])
def test_cache_seqlens_forms(cupy, rng, seed, dtype, form):
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 4, 16, 4, 128, 700
    lens = {"int": [333] * batch, "none": [max_seqlen] * batch}.get(form, [0, 1, 700, 301])
    arg = {"device": cupy.asarray(np.asarray(lens, np.int32)), "host_list": lens,
           "host_ndarray": np.asarray(lens, np.int64), "int": 333, "none": None}[form]
    ctx = context(seed, dtype=dtype, form=form, lens=lens)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    for got, lse in splits_match_reference(cupy, q, k, v, arg, ref_out, ref_lse, dtype, ctx):
        for b, n in enumerate(lens):
            if n == 0:
                assert not cupy.any(got[b]) and bool(cupy.all(cupy.isneginf(lse[b]))), ctx


@pytest.mark.parametrize("splits", [1, 3, None])
def test_device_seqlens_are_clamped(cupy, rng, seed, splits):
    """Device lengths are never read on the host: out-of-range ones are clamped in the kernel."""
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 4, 8, 2, 64, 300
    ctx = context(seed, splits=splits)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    wild = cupy.asarray(np.array([max_seqlen + 1, 2**31 - 1, -5, -(2**31)], np.int32))
    got, lse = cupydecode.flash_decode(dq, dk, dv, wild, num_splits=splits, return_lse=True)
    clamped = [max_seqlen, max_seqlen, 0, 0]
    ref_out, ref_lse = R.decode_attention(q, k, v, clamped)
    assert_out_close(got, ref_out, OUT_TOL["float16"], ctx)
    assert_lse_close(lse, ref_lse, LSE_TOL["float16"], ctx)
    full, full_lse = cupydecode.flash_decode(dq, dk, dv, max_seqlen, num_splits=splits, return_lse=True)
    assert cupy.array_equal(got[:2], full[:2]) and cupy.array_equal(lse[:2], full_lse[:2]), ctx


@pytest.mark.parametrize("splits", [1, 3, None])
def test_int64_device_seqlens(cupy, rng, seed, splits):
    """int64 device lengths (torch's default integer type) work as int32 ones do, in
    flash_decode and a plan (eager and in a graph), and are clamped in 64 bits: 2³² + 5 is past
    max_seqlen (full), not 5; −2³² is empty."""
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 5, 32, 8, 128, 700
    ctx = context(seed, splits=splits)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    lens64 = cupy.asarray(np.array([700, 17, 2**32 + 5, -(2**32), 0], np.int64))
    want = [700, 17, 700, 0, 0]
    ref_out, ref_lse = R.decode_attention(q, k, v, want)
    got, lse = cupydecode.flash_decode(dq, dk, dv, lens64, num_splits=splits, return_lse=True)
    assert_out_close(got, ref_out, OUT_TOL["float16"], ctx)
    assert_lse_close(lse, ref_lse, LSE_TOL["float16"], ctx)
    lens32 = cupy.asarray(np.array(want, np.int32))
    same, same_lse = cupydecode.flash_decode(dq, dk, dv, lens32, num_splits=splits,
                                             return_lse=True)
    assert cupy.array_equal(got, same) and cupy.array_equal(lse, same_lse), ctx
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen,
                                 "float16", num_splits=splits)
    out, plan_lse = plan.run(dq, dk, dv, lens64)
    assert cupy.array_equal(out, same) and cupy.array_equal(plan_lse, same_lse), ctx


@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_cache(cupy, rng, seed, dtype):
    """A (batch, kv_heads, seq, dim) cache passed as its (0, 2, 1, 3) view."""
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 3, 28, 4, 128, 1000
    lens = [1000, 17, 0]
    ctx = context(seed, dtype=dtype)
    q = randn(rng, (batch, num_heads, head_dim), dtype)
    k_bhsd = randn(rng, (batch, num_kv_heads, max_seqlen, head_dim), dtype)
    v_bhsd = randn(rng, (batch, num_kv_heads, max_seqlen, head_dim), dtype)
    k, v = k_bhsd.transpose(0, 2, 1, 3), v_bhsd.transpose(0, 2, 1, 3)
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    dk = to_device(k_bhsd).transpose(0, 2, 1, 3)
    dv = to_device(v_bhsd).transpose(0, 2, 1, 3)
    assert not dk.flags.c_contiguous
    dq = to_device(q)
    for splits in (1, 3, None):
        got, lse = cupydecode.flash_decode(dq, dk, dv, lens, num_splits=splits, return_lse=True)
        assert_out_close(got, ref_out, OUT_TOL[dtype], f"splits={splits} {ctx}")
        assert_lse_close(lse, ref_lse, LSE_TOL[dtype], f"splits={splits} {ctx}")


def test_cache_that_is_a_slice_of_a_longer_buffer(cupy, rng, seed):
    """k_cache[:, :L] of a longer preallocated cache: the batch stride is not L·Hkv·D."""
    batch, num_heads, num_kv_heads, head_dim, capacity, length = 2, 8, 2, 128, 1024, 700
    ctx = context(seed)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, capacity, "bfloat16")
    ref_out, ref_lse = R.decode_attention(q, k[:, :length], v[:, :length])
    dk, dv = to_device(k)[:, :length], to_device(v)[:, :length]
    got, lse = cupydecode.flash_decode(to_device(q), dk, dv, return_lse=True)
    assert_out_close(got, ref_out, OUT_TOL["bfloat16"], ctx)
    assert_lse_close(lse, ref_lse, LSE_TOL["bfloat16"], ctx)


def test_out_and_return_lse(cupy, rng, seed):
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 2, 32, 8, 128, 513
    ctx = context(seed)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    plain = cupydecode.flash_decode(dq, dk, dv)
    assert isinstance(plain, cupy.ndarray), ctx
    pair = cupydecode.flash_decode(dq, dk, dv, return_lse=True)
    assert isinstance(pair, tuple) and len(pair) == 2, ctx
    out = cupy.full(q.shape, np.nan, dtype=cupy.float16)
    same = cupydecode.flash_decode(dq, dk, dv, out=out)
    assert same is out, ctx
    assert cupy.array_equal(plain, pair[0]) and cupy.array_equal(plain, out), ctx
    ref_out, ref_lse = R.decode_attention(q, k, v)
    assert_out_close(out, ref_out, OUT_TOL["float16"], ctx)
    assert_lse_close(pair[1], ref_lse, LSE_TOL["float16"], ctx)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_scale(cupy, rng, seed, dtype):
    q, k, v = decode_inputs(rng, 2, 8, 2, 64, 300, dtype)
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    for scale in (0.01, 0.5, 1.0):
        ctx = context(seed, dtype=dtype, scale=scale)
        got, lse = cupydecode.flash_decode(dq, dk, dv, softmax_scale=scale, return_lse=True)
        ref_out, ref_lse = R.decode_attention(q, k, v, softmax_scale=scale)
        assert_out_close(got, ref_out, OUT_TOL[dtype], ctx)
        assert_lse_close(lse, ref_lse, LSE_TOL[dtype], ctx)


@pytest.mark.parametrize("split_size", [64, 256, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_size_is_batch_independent(cupy, rng, seed, dtype, split_size):
    """With a fixed split_size, a sequence's result is bitwise the same alone or in a batch."""
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 5, 28, 4, 128, 3000
    lens = [3000, 1, 2222, 0, 1500]
    ctx = context(seed, dtype=dtype, split_size=split_size)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    whole, whole_lse = cupydecode.flash_decode(dq, dk, dv, seqlens, split_size=split_size,
                                               return_lse=True)
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    assert_out_close(whole, ref_out, OUT_TOL[dtype], ctx)
    assert_lse_close(whole_lse, ref_lse, LSE_TOL[dtype], ctx)
    for b in (0, 2, 4):
        alone, alone_lse = cupydecode.flash_decode(
            cupy.ascontiguousarray(dq[b:b + 1]), cupy.ascontiguousarray(dk[b:b + 1]),
            cupy.ascontiguousarray(dv[b:b + 1]), seqlens[b:b + 1], split_size=split_size,
            return_lse=True)
        assert cupy.array_equal(alone[0].view(cupy.uint8), whole[b].view(cupy.uint8)), f"b={b} {ctx}"
        assert cupy.array_equal(alone_lse[0], whole_lse[b]), f"b={b} {ctx}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_large_logits(cupy, rng, seed, dtype, splits):
    """max |s| ≈ 1e4: exp(s) overflows every float type; the log-domain path must not.

    LSE values near 1e4 are resolved by float32 only to about 1e-3 (its spacing there), and the
    fp32 dot product of ~1e5 adds a few of those spacings, so the LSE bound here is
    1e-3 + 1e-5·|LSE| instead of a flat 1e-3.
    """
    batch, num_heads, num_kv_heads, head_dim, max_seqlen = 2, 32, 8, 128, 3000
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
    # Calibrate: scale q so that max |s| ≈ 1e4.
    group = num_heads // num_kv_heads
    s = np.einsum("bkgd,bnkd->bkgn", R.to_float64(q).reshape(batch, num_kv_heads, group, head_dim),
                  R.to_float64(k)) / math.sqrt(head_dim)
    q = (R.to_float64(q) * (1e4 / np.abs(s).max())).astype(q.dtype)
    ref_out, ref_lse = R.decode_attention(q, k, v)
    ctx = context(seed, dtype=dtype, splits=splits, max_lse=f"{np.abs(ref_lse).max():.4g}")
    assert np.abs(ref_lse).max() > 5e3, ctx
    out = cupy.full(q.shape, np.nan, dtype=q.dtype)
    got, lse = cupydecode.flash_decode(to_device(q), to_device(k), to_device(v), num_splits=splits,
                                       return_lse=True, out=out)
    assert bool(cupy.all(cupy.isfinite(got.astype(cupy.float32)))), ctx
    assert bool(cupy.all(cupy.isfinite(lse))), ctx
    assert_out_close(got, ref_out, OUT_TOL[dtype], ctx)
    assert_lse_close(lse, ref_lse, 1e-3, ctx, rtol=1e-5)


GQA_LAYOUTS = [  # (num_heads, num_kv_heads): GQA 7, 8, MQA beyond one 16-row tile, odd tiles
    (28, 4), (64, 8), (32, 1), (17, 1), (71, 1), (48, 2),
]


@pytest.mark.parametrize("num_heads,num_kv_heads", GQA_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gqa_and_mqa_layouts(cupy, rng, seed, dtype, num_heads, num_kv_heads):
    batch, head_dim, max_seqlen = 3, 128, 1100
    lens = [1100, 0, 513]
    ctx = context(seed, dtype=dtype, heads=f"{num_heads}/{num_kv_heads}")
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    splits_match_reference(cupy, q, k, v, seqlens, ref_out, ref_lse, dtype, ctx)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_both_tensor_core_paths(cupy, rng, seed, monkeypatch, dtype, head_dim):
    """G ≤ 8 runs the heads-as-N path (Sᵀ = K·Qᵀ, Oᵀ = Vᵀ·Pᵀ) by default; with it switched off
    the same plans run the 16-row path. Both match the reference on the same inputs (G = 1, 2,
    3, 5, 8, direct output, fused merge and the merge kernel, ragged ends, a 1-token sequence and
    an empty one), and they agree with each other."""
    from cupydecode import _policy

    batch, num_kv_heads, max_seqlen = 4, 2, 1500
    lens = [max_seqlen, 1, 0, 1037]
    for group in (1, 2, 3, 5, 8):
        num_heads = group * num_kv_heads
        ctx = context(seed, dtype=dtype, head_dim=head_dim, group=group, lens=lens)
        q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
        k, v = nan_tail(k, lens), nan_tail(v, lens)
        ref_out, ref_lse = R.decode_attention(q, k, v, lens)
        dq, dk, dv = to_device(q), to_device(k), to_device(v)
        seqlens = cupy.asarray(np.asarray(lens, np.int32))
        for splits, merge in ((1, "auto"), (3, "fused"), (3, "kernel")):
            got = {}
            for most in (_policy.HEADS_AS_N_MAX_GROUP, 0):
                monkeypatch.setattr(_policy, "HEADS_AS_N_MAX_GROUP", most)
                plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen,
                                             dtype, num_splits=splits, merge=merge)
                assert plan.config.heads_as_n == (most > 0), (plan.config, ctx)
                out = cupy.full(q.shape, np.nan, dtype=dq.dtype)
                lse = cupy.full(q.shape[:2], np.nan, dtype=cupy.float32)
                plan.run(dq, dk, dv, seqlens, out=out, lse=lse)
                what = f"heads_as_n={most > 0} splits={splits} merge={plan.merge} {ctx}"
                assert_out_close(out, ref_out, OUT_TOL[dtype], what)
                assert_lse_close(lse, ref_lse, LSE_TOL[dtype], what)
                assert not cupy.any(out[2]) and bool(cupy.all(cupy.isneginf(lse[2]))), what
                got[most > 0] = out
            monkeypatch.undo()
            assert_out_close(got[True], got[False], OUT_TOL[dtype], ctx, "heads-as-N vs 16 rows")


def test_m_tiles_chosen_automatically(cupy, rng, seed):
    """Automatic splits pick blocks of several M-tiles where the chunks are long enough (falcon-7b
    at batch 8 × 16k tokens: one block of 5 M-tiles per split) and one M-tile per block where
    they are not (batch 1 × 16k); both match the reference."""
    from cupydecode import _policy

    ctx = context(seed)
    for batch, want in ((8, 5), (1, 1)):
        q, k, v = decode_inputs(rng, batch, 71, 1, 64, 16384, "float16")
        plan = cupydecode.DecodePlan(batch, 71, 1, 64, 16384, "float16")
        assert plan.m_tiles == want and plan.head_tiles == -(-71 // (16 * want)), (plan, ctx)
        # (with one M-tile per block the plan has more blocks and so longer chunks than the
        # M-tile candidate it fell back from: only the M-tile plan's chunk bound is checkable)
        assert want == 1 or plan.chunk_tokens >= _policy.MTILE_MIN_CHUNK, (plan, ctx)
        out = cupy.full(q.shape, np.nan, dtype=q.dtype)
        got, lse = plan.run(to_device(q), to_device(k), to_device(v), out=out)
        ref_out, ref_lse = R.decode_attention(q, k, v)
        assert_out_close(got, ref_out, OUT_TOL["float16"], f"batch={batch} {ctx}")
        assert_lse_close(lse, ref_lse, LSE_TOL["float16"], f"batch={batch} {ctx}")


MTILE_LAYOUTS = [  # (num_heads, num_kv_heads, head_dim), G > 16: several M-tiles per block
    (32, 1, 64), (71, 1, 64), (100, 1, 64), (48, 1, 128), (71, 1, 128), (40, 2, 256), (71, 1, 256),
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", MTILE_LAYOUTS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_m_tile_layouts(cupy, rng, seed, dtype, num_heads, num_kv_heads, head_dim):
    """More than 16 query heads per KV head: one block computes several M-tiles on shared K/V
    tiles (one or two blocks per KV head, a partly or wholly padded last M-tile), direct output
    and the merge kernel (a block of these layouts has more rows than warps, so merge="auto"
    never fuses here: test_merge_modes_agree covers the fused merge with M-tiles), ragged ends
    and an empty sequence."""
    from cupydecode import _policy

    batch, max_seqlen = 3, 3000
    lens = [max_seqlen, 0, 2005]  # with 3 splits, 2005 leaves the third split 5 tokens: 1 tile
    group = num_heads // num_kv_heads
    ctx = context(seed, dtype=dtype, heads=f"{num_heads}/{num_kv_heads}", head_dim=head_dim)
    assert _policy.m_tiles(dtype, head_dim, group) > 1, ctx
    # 1 and 3 splits stream ≥ MTILE_MIN_CHUNK tokens per block (M-tiles), 17 fewer (one M-tile)
    shapes = [cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype,
                                    num_splits=s).m_tiles for s in (1, 3, 17)]
    assert shapes[0] > 1 and shapes[1] > 1 and shapes[2] == 1, (shapes, ctx)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    for got, lse in splits_match_reference(cupy, q, k, v, seqlens, ref_out, ref_lse, dtype, ctx,
                                           splits=(1, 3, 17, None)):
        assert not cupy.any(got[1]) and bool(cupy.all(cupy.isneginf(lse[1]))), ctx


def test_many_forced_splits(cupy, rng, seed):
    """More splits than tokens: most splits are empty and must merge to nothing."""
    q, k, v = decode_inputs(rng, 2, 8, 2, 64, 100, "float16")
    ctx = context(seed)
    ref_out, ref_lse = R.decode_attention(q, k, v, [100, 3])
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    for splits in (7, 100, 333):
        got, lse = cupydecode.flash_decode(dq, dk, dv, [100, 3], num_splits=splits,
                                           return_lse=True)
        assert_out_close(got, ref_out, OUT_TOL["float16"], f"splits={splits} {ctx}")
        assert_lse_close(lse, ref_lse, LSE_TOL["float16"], f"splits={splits} {ctx}")


def test_empty_batch(cupy):
    q = cupy.zeros((0, 8, 128), cupy.float16)
    k = cupy.zeros((0, 16, 2, 128), cupy.float16)
    got, lse = cupydecode.flash_decode(q, k, k, return_lse=True)
    assert got.shape == (0, 8, 128) and lse.shape == (0, 8)


def test_empty_cache(cupy, rng):
    """max_seqlen = 0: every sequence is empty, out = 0 and lse = -inf."""
    q = to_device(randn(rng, (2, 8, 128), "float16"))
    k = cupy.zeros((2, 0, 2, 128), cupy.float16)
    for splits in (None, 1, 3):
        got, lse = cupydecode.flash_decode(q, k, k, num_splits=splits, return_lse=True)
        assert not cupy.any(got) and bool(cupy.all(cupy.isneginf(lse))), splits


@pytest.mark.parametrize("mode", [{"num_splits": 1}, {"num_splits": 4, "merge": "fused"},
                                  {"num_splits": 4, "merge": "kernel"}, {}],
                         ids=["split1", "fused", "kernel", "auto"])
@pytest.mark.parametrize("layout", [(32, 8, 128), (48, 1, 128), (12, 4, 64)],
                         ids=lambda x: "{}-{}-{}".format(*x))
def test_non_finite_values_reach_exactly_their_own_rows(cupy, rng, seed, layout, mode):
    """A NaN in one attended key, an inf in one attended value: exactly the rows that attend
    them are non-finite (out and lse), in every merge (a NaN must not turn a row empty); a NaN
    past a length or before a window changes nothing; every other row matches the reference."""
    num_heads, num_kv_heads, head_dim = layout
    batch, max_seqlen, window = 4, 900, 400
    ctx = context(seed, layout=layout, mode=mode)
    q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
    lens = [900, 600, 300, 900]
    k[0, 850, num_kv_heads - 1] = np.nan   # sequence 0, last KV head
    v[1, 599, 0] = np.inf                  # sequence 1, KV head 0 (its last token)
    k[2, 300:] = np.nan                    # past sequence 2's length
    v[3, :400] = np.nan                    # before sequence 3's window (keys 499 … 899)
    ref_out, ref_lse = R.decode_attention(q, k, v, lens, window_left=window)
    bad = ~np.isfinite(ref_out).all(axis=-1) | ~np.isfinite(ref_lse)
    group = num_heads // num_kv_heads
    expect = np.zeros_like(bad)
    expect[0, (num_kv_heads - 1) * group:] = True
    expect[1, :group] = True
    assert np.array_equal(bad, expect), ctx
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16",
                                 window_left=window, **mode)
    out, lse = plan.run(to_device(q), to_device(k), to_device(v),
                        cupy.asarray(np.asarray(lens, np.int32)))
    got_out, got_lse = R.to_float64(out), R.to_float64(lse)
    got_bad = ~np.isfinite(got_out).all(axis=-1) | ~np.isfinite(got_lse)
    assert np.array_equal(got_bad, expect), (np.argwhere(got_bad != expect)[:8].tolist(), ctx)
    good = ~expect
    assert_out_close(got_out[good], ref_out[good], OUT_TOL["float16"], ctx)
    assert_lse_close(got_lse[good], ref_lse[good], LSE_TOL["float16"], ctx)
