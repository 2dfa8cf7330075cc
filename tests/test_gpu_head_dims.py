"""head_dims between the kernel widths (64, 128, 256), and 512, on the GPU, against the float64
reference.

Such a head_dim runs in the next width up, its rows zero-filled in shared memory; 512 is a width
of its own (blocks of 8 query rows, Qᵀ read from shared memory per pair of k steps). q, K and V are
views of wider arrays whose extra columns are NaN, so a kernel that reads one element past
head_dim turns its output NaN; out is followed in memory by NaN that must stay NaN (nothing is
written past the last row's head_dim). Outputs are NaN-poisoned; the cache is NaN past each
length.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import (LSE_TOL, OUT_TOL, assert_lse_close, assert_out_close, context,
                     decode_inputs, nan_tail, randn, to_device, to_paged)

pytestmark = pytest.mark.gpu

# (num_heads, num_kv_heads): heads as N (G 4), the 16-row path (G 16), M-tiles (MQA 48), MHA
LAYOUTS = [(32, 8), (32, 2), (48, 1), (16, 16)]
MODES = [{"num_splits": 1}, {"num_splits": 3, "merge": "fused"},
         {"num_splits": 3, "merge": "kernel"}, {}]
# (dtype, head_dim): float16 from the smallest through each width's range (widths 64, 128,
# 256), bfloat16 and float32 (the CUDA-core path) at a few; 512 in both 16-bit types (with
# LAYOUTS: one, two and six head tiles of 8 rows, and MHA)
CASES = ([("float16", d) for d in (32, 80, 96, 112, 136, 192, 248)]
         + [("bfloat16", d) for d in (40, 96, 192)] + [("float32", d) for d in (40, 96, 136)]
         + [("float16", 512), ("bfloat16", 512)])
WIDER = 8  # extra NaN columns of the arrays q, K and V are views of


def _wide_view(x: np.ndarray):
    """``x`` on the device as the first head_dim columns of a wider array, NaN beyond."""
    wide = np.full(x.shape[:-1] + (x.shape[-1] + WIDER,), np.nan, x.dtype)
    wide[..., :x.shape[-1]] = x
    return to_device(wide)[..., :x.shape[-1]]


class _Out:
    """A NaN-filled out with NaN after it in the same allocation."""

    def __init__(self, cupy, shape, dtype):
        n = int(np.prod(shape))
        self.buf = cupy.full(n + 256, np.nan, dtype)
        self.out = self.buf[:n].reshape(shape)
        self.lse = cupy.full(shape[:2], np.nan, cupy.float32)
        self.n = n

    def tail_untouched(self, cupy) -> bool:
        return bool(cupy.all(cupy.isnan(self.buf[self.n:])))


def _check(cupy, got, ref, dtype, lens, ctx):
    out, lse = got
    assert_out_close(out, ref[0], OUT_TOL[dtype], ctx)
    assert_lse_close(lse, ref[1], LSE_TOL[dtype], ctx)
    for b, n in enumerate(lens):
        if n == 0:
            assert not cupy.any(out[b]), ctx


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "{}-{}".format(*x))
@pytest.mark.parametrize("dtype,head_dim", CASES, ids=lambda x: str(x))
def test_head_dim_matches_reference(cupy, rng, seed, dtype, head_dim, layout):
    """Every merge mode and the automatic plan, flash_decode, varlen with an empty sequence;
    inputs read only through head_dim, out written only there."""
    heads, kv_heads = layout
    lens = [1500, 0, 777, 64]
    q, k, v = decode_inputs(rng, 4, heads, kv_heads, head_dim, 1500, dtype)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    ref = R.decode_attention(q, k, v, lens)
    dq, dk, dv = _wide_view(q), _wide_view(k), _wide_view(v)
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    ctx = context(seed, dtype=dtype, head_dim=head_dim, layout=layout, lens=lens)
    for mode in MODES:
        plan = cupydecode.DecodePlan(4, heads, kv_heads, head_dim, 1500, dtype, **mode)
        o = _Out(cupy, q.shape, dk.dtype)
        _check(cupy, plan.run(dq, dk, dv, seqlens, out=o.out, lse=o.lse), ref, dtype, lens,
               f"{mode} merge={plan.merge} {ctx}")
        assert o.tail_untouched(cupy), f"written past out {mode} {ctx}"
    o = _Out(cupy, q.shape, dk.dtype)
    out, lse = cupydecode.flash_decode(dq, dk, dv, seqlens, out=o.out, return_lse=True)
    _check(cupy, (out, lse), ref, dtype, lens, f"flash_decode {ctx}")
    assert o.tail_untouched(cupy), f"flash_decode wrote past out {ctx}"


@pytest.mark.parametrize("head_dim", [80, 96, 192, 512])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_head_dim_paged_with_append(cupy, rng, seed, dtype, head_dim):
    """Paged caches (pages of 16, random order) with the new token appended: attended, and
    written into its page's row through head_dim only (the rest of the cache unchanged)."""
    lens = [299, 15, 16, 0]
    q, k, v = decode_inputs(rng, 4, 32, 8, head_dim, 300, dtype)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    k_new = randn(rng, (4, 1, 8, head_dim), dtype)
    v_new = randn(rng, (4, 1, 8, head_dim), dtype)
    ref = R.decode_attention(q, k, v, lens, k_new=k_new, v_new=v_new)
    grown = [n + 1 for n in lens]
    kp, vp, table = to_paged(rng, k, v, 16)
    dkp, dvp = to_device(kp), to_device(vp)
    before_k, before_v = dkp.copy(), dvp.copy()
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    ctx = context(seed, dtype=dtype, head_dim=head_dim, lens=lens)
    plan = cupydecode.DecodePlan(4, 32, 8, head_dim, 300, dtype, page_size=16)
    o = _Out(cupy, q.shape, dkp.dtype)
    got = plan.run(to_device(q), dkp, dvp, seqlens, out=o.out, lse=o.lse,
                   block_table=cupy.asarray(table), k_new=to_device(k_new),
                   v_new=to_device(v_new))
    _check(cupy, got, ref, dtype, grown, ctx)
    assert o.tail_untouched(cupy), ctx
    # the caches now hold each new row at its length, and nothing else changed (bit for bit)
    for cache, before, new in ((dkp, before_k, k_new), (dvp, before_v, v_new)):
        expected = before.copy()
        for b, n in enumerate(lens):
            expected[int(table[b, n // 16]), n % 16] = to_device(new[b, 0])
        assert bool(cupy.all(cache.view(cupy.uint16) == expected.view(cupy.uint16))), ctx


def test_head_dims_outside_the_range_are_refused(cupy):
    q = cupy.zeros((1, 4, 100), cupy.float16)
    k = cupy.zeros((1, 16, 4, 100), cupy.float16)
    with pytest.raises(ValueError, match="head_dim.*multiple of 8 from 32 to 256, or 512.*100"):
        cupydecode.flash_decode(q, k, k, cupy.asarray([16], cupy.int32))
    with pytest.raises(ValueError, match="head_dim.*multiple of 8 from 32 to 256, or 512.*264"):
        cupydecode.DecodePlan(1, 4, 4, 264, 16, "float16")
    # 512 takes 16-bit types only (refused on the host); a valid call after the refusals
    q32 = cupy.ones((1, 4, 512), cupy.float32)
    k32 = cupy.ones((1, 16, 4, 512), cupy.float32)
    with pytest.raises(ValueError, match=r"^q: expected .* for float32 \(512 takes float16 or "
                                         r"bfloat16\), got 512$"):
        cupydecode.flash_decode(q32, k32, k32, cupy.asarray([16], cupy.int32))
    with pytest.raises(ValueError, match=r"^head_dim: expected .*512 takes float16"):
        cupydecode.DecodePlan(1, 4, 4, 512, 16, "float32")
    out = cupydecode.flash_decode(q32[..., :256], k32[..., :256], k32[..., :256],
                                  cupy.asarray([16], cupy.int32))
    assert bool(cupy.allclose(out, 1.0))  # every value 1: the mean of ones


# head_dims whose KV head's row piece is not whole 64-byte bursts, and the policy's blocks of
# adjacent KV heads for them (_policy.burst_kv_per_block): 72, 88, 120 take 4, 80 and 112 2 or 4
BURST_CASES = [(d, hk, n) for d in (72, 80, 112, 120) for hk, n in (((32, 8), 1500), ((16, 16), 300))]


@pytest.mark.parametrize("head_dim,layout,max_seqlen", BURST_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_burst_groups_match_reference(cupy, rng, seed, dtype, head_dim, layout, max_seqlen):
    """The automatic plan takes blocks of several KV heads at these head_dims; against float64
    with each merge mode, ragged lengths (0, 1, max_seqlen), inputs read only through head_dim
    (NaN beyond), out written only there, each plan run twice; then the same plan over a paged
    cache (pages of 16, random order) appending the new token."""
    heads, kv_heads = layout
    lens = [max_seqlen, 0, 1, max_seqlen // 3 + 5]
    q, k, v = decode_inputs(rng, 4, heads, kv_heads, head_dim, max_seqlen, dtype)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    ref = R.decode_attention(q, k, v, lens)
    dq, dk, dv = _wide_view(q), _wide_view(k), _wide_view(v)
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    ctx = context(seed, dtype=dtype, head_dim=head_dim, layout=layout, lens=lens)
    for merge in ("auto", "kernel", "fused"):
        plan = cupydecode.DecodePlan(4, heads, kv_heads, head_dim, max_seqlen, dtype, merge=merge)
        assert plan.kv_per_block > 1 and plan.config.kv_per_block == plan.kv_per_block, plan
        for _ in range(2):
            o = _Out(cupy, q.shape, dk.dtype)
            _check(cupy, plan.run(dq, dk, dv, seqlens, out=o.out, lse=o.lse), ref, dtype, lens,
                   f"merge={plan.merge} {plan.num_splits} splits kv_per_block={plan.kv_per_block} {ctx}")
            assert o.tail_untouched(cupy), f"written past out {ctx}"
    # paged, appending the new token (the cache holds one row less than the plan's capacity)
    short = [min(n, max_seqlen - 1) for n in lens]
    k_new = randn(rng, (4, 1, kv_heads, head_dim), dtype)
    v_new = randn(rng, (4, 1, kv_heads, head_dim), dtype)
    ref = R.decode_attention(q, k, v, short, k_new=k_new, v_new=v_new)
    kp, vp, table = to_paged(rng, k, v, 16)
    plan = cupydecode.DecodePlan(4, heads, kv_heads, head_dim, max_seqlen, dtype, page_size=16)
    assert plan.kv_per_block > 1, plan
    o = _Out(cupy, q.shape, dk.dtype)
    got = plan.run(to_device(q), to_device(kp), to_device(vp),
                   cupy.asarray(np.asarray(short, np.int32)), out=o.out, lse=o.lse,
                   block_table=cupy.asarray(table), k_new=to_device(k_new), v_new=to_device(v_new))
    _check(cupy, got, ref, dtype, [n + 1 for n in short], f"paged append {ctx}")
    assert o.tail_untouched(cupy), ctx


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_head_dim_512_with_score_options(cupy, rng, seed, dtype):
    """head_dim 512 with a window, ALiBi, sinks and the soft-cap, alone and together (large
    logits: q scaled by 4), through the automatic plan, one split and the merge kernel; its plans
    tile the query heads by 8."""
    from cupydecode.workloads import alibi_slopes, sink_logits

    heads, kv_heads, cap = 24, 2, 2000  # G 12: two head tiles of 8 rows
    lens = [2000, 300, 1, 0]
    q, k, v = decode_inputs(rng, 4, heads, kv_heads, 512, cap, dtype, q_scale=4.0)
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    seqlens = cupy.asarray(np.asarray(lens, np.int32))
    slopes, sinks = alibi_slopes(heads), sink_logits(heads, seed)
    for options in ({"window_left": 99}, {"alibi_slopes": slopes}, {"sinks": sinks},
                    {"logits_soft_cap": 30.0},
                    {"window_left": 517, "alibi_slopes": slopes, "sinks": sinks,
                     "logits_soft_cap": 30.0}):
        ref = R.decode_attention(q, k, v, lens, **options)
        dev = {n: cupy.asarray(x) if isinstance(x, np.ndarray) else x for n, x in options.items()}
        ctx = context(seed, dtype=dtype, options=sorted(options), lens=lens)
        for kw in ({}, {"num_splits": 1}, {"num_splits": 5}):
            o = _Out(cupy, q.shape, dk.dtype)
            got = cupydecode.flash_decode(dq, dk, dv, seqlens, out=o.out, return_lse=True,
                                          **dev, **kw)
            _check(cupy, got, ref, dtype, lens, f"{kw} {ctx}")
            assert o.tail_untouched(cupy), ctx
    # the fused merge (the automatic plans at 512 take the merge kernel), every option at once
    plan = cupydecode.DecodePlan(4, heads, kv_heads, 512, cap, dtype, num_splits=5, merge="fused",
                                 window_left=517, alibi=True, logits_soft_cap=30.0)
    assert plan.head_tiles == 2 and plan.config.width == 512 and plan.merge == "fused", plan
    ref = R.decode_attention(q, k, v, lens, window_left=517, alibi_slopes=slopes, sinks=sinks,
                             logits_soft_cap=30.0)
    o = _Out(cupy, q.shape, dk.dtype)
    _check(cupy, plan.run(dq, dk, dv, seqlens, out=o.out, lse=o.lse,
                          alibi_slopes=cupy.asarray(slopes), sinks=cupy.asarray(sinks)),
           ref, dtype, lens, f"fused merge {context(seed, dtype=dtype)}")


@pytest.mark.parametrize("q_len", [3, 16])
def test_head_dim_512_multi_token_append(cupy, rng, seed, q_len):
    """Several query tokens at head_dim 512 (its smaller shape), appending them: attended, each
    causal to its own position, and written into the cache bit for bit."""
    heads, kv_heads, cap = 8, 2, 400
    lens = [250, cap - q_len, 0, 40]
    q = randn(rng, (4, q_len, heads, 512), "bfloat16")
    k = nan_tail(randn(rng, (4, cap, kv_heads, 512), "bfloat16"), lens)
    v = nan_tail(randn(rng, (4, cap, kv_heads, 512), "bfloat16"), lens)
    k_new = randn(rng, (4, q_len, kv_heads, 512), "bfloat16")
    v_new = randn(rng, (4, q_len, kv_heads, 512), "bfloat16")
    ref = R.decode_attention(q, k, v, lens, k_new=k_new, v_new=v_new)
    exp = R.append_kv(k, v, lens, k_new, v_new)
    ctx = context(seed, q_len=q_len, lens=lens)
    for mode in ({"num_splits": 1}, {"num_splits": 3, "merge": "fused"}, {}):
        kc, vc = to_device(k), to_device(v)
        plan = cupydecode.DecodePlan(4, heads, kv_heads, 512, cap, "bfloat16", q_len=q_len, **mode)
        assert plan.config.multi_q and plan.config.num_warps == 2, plan.config
        out = cupy.full(q.shape, np.nan, kc.dtype)
        lse = cupy.full(q.shape[:3], np.nan, cupy.float32)
        plan.run(to_device(q), kc, vc, cupy.asarray(np.asarray(lens, np.int32)), out=out,
                 lse=lse, k_new=to_device(k_new), v_new=to_device(v_new))
        assert_out_close(out, ref[0], OUT_TOL["bfloat16"], f"{mode} {ctx}")
        assert_lse_close(lse, ref[1], LSE_TOL["bfloat16"], f"{mode} {ctx}")
        for got, want in ((kc, exp[0]), (vc, exp[1])):
            assert np.array_equal(got.get().view(np.uint16), want.view(np.uint16)), (mode, ctx)


def test_head_dim_512_append_over_head_tiles(cupy, rng, seed):
    """One new token appended into a contiguous cache at head_dim 512 with G = 12 (two head
    tiles: only tile 0's blocks write the cache, every tile patches its ring): attended, and
    written bit for bit, K and V; a sequence at full capacity appends nothing."""
    heads, kv_heads, cap = 24, 2, 700
    lens = [300, cap, 0, 699]
    q, k, v = decode_inputs(rng, 4, heads, kv_heads, 512, cap, "float16")
    k, v = nan_tail(k, lens), nan_tail(v, lens)
    k_new = randn(rng, (4, 1, kv_heads, 512), "float16")
    v_new = randn(rng, (4, 1, kv_heads, 512), "float16")
    ref = R.decode_attention(q, k, v, lens, k_new=k_new, v_new=v_new)
    exp = R.append_kv(k, v, lens, k_new, v_new)
    ctx = context(seed, lens=lens)
    for mode in ({"num_splits": 1}, {"num_splits": 4, "merge": "fused"}, {}):
        dk, dv = to_device(k), to_device(v)
        plan = cupydecode.DecodePlan(4, heads, kv_heads, 512, cap, "float16", **mode)
        assert plan.head_tiles == 2, plan
        o = _Out(cupy, q.shape, dk.dtype)
        got = plan.run(to_device(q), dk, dv, cupy.asarray(np.asarray(lens, np.int32)), out=o.out,
                       lse=o.lse, k_new=to_device(k_new), v_new=to_device(v_new))
        _check(cupy, got, ref, "float16", [min(n + 1, cap) for n in lens], f"{mode} {ctx}")
        for cache, want in ((dk, exp[0]), (dv, exp[1])):
            assert np.array_equal(cache.get().view(np.uint16), want.view(np.uint16)), (mode, ctx)


def test_head_dim_512_long_chunk_warps_in_step(cupy, rng, seed):
    """A chunk long enough for the policy to keep the warps in step (9216 tokens, 576 tiles: a
    multiple of the 3 warps), and a paged cache of several query tokens without an append."""
    q, k, v = decode_inputs(rng, 1, 8, 2, 512, 9216, "bfloat16")
    plan = cupydecode.DecodePlan(1, 8, 2, 512, 9216, "bfloat16", num_splits=1)
    assert plan._in_step, plan
    ref = R.decode_attention(q, k, v, [9216])
    o = _Out(cupy, q.shape, to_device(k).dtype)
    _check(cupy, plan.run(to_device(q), to_device(k), to_device(v), 9216, out=o.out, lse=o.lse),
           ref, "bfloat16", [9216], context(seed))
    # several query tokens over pages of 16 (no append): its smaller shape, paged
    lens = [1000, 3, 0]
    q4 = randn(rng, (3, 4, 8, 512), "float16")
    k4 = nan_tail(randn(rng, (3, 1000, 2, 512), "float16"), lens)
    v4 = nan_tail(randn(rng, (3, 1000, 2, 512), "float16"), lens)
    ref = R.decode_attention(q4, k4, v4, lens)
    kp, vp, table = to_paged(rng, k4, v4, 16)
    plan = cupydecode.DecodePlan(3, 8, 2, 512, 1000, "float16", q_len=4, page_size=16)
    assert plan.config.multi_q and plan.config.paged and plan.config.num_warps == 2, plan.config
    out = cupy.full(q4.shape, np.nan, cupy.float16)
    lse = cupy.full(q4.shape[:3], np.nan, cupy.float32)
    plan.run(to_device(q4), to_device(kp), to_device(vp), cupy.asarray(np.asarray(lens, np.int32)),
             out=out, lse=lse, block_table=cupy.asarray(table))
    assert_out_close(out, ref[0], OUT_TOL["float16"], context(seed, q_len=4))
    assert_lse_close(lse, ref[1], LSE_TOL["float16"], context(seed, q_len=4))
