"""Attention over fp8 KV caches (kv_dtype "e4m3"/"e5m2") on the GPU, against the float64
reference on the exact values code · scale (reference.decode_attention(..., kv_dtype=)).

The caches hold fresh random values whose magnitude differs per token and KV head by up to e^±2,
quantised by reference.quantize_kv with scales per tensor, per KV head or per (token, KV head):
every scale differs from 1 and from its neighbours, so a kernel that ignored them, or took one
head's or token's for another's, fails (test_the_scales_change_the_answer shows by how much).
Codes past each length are NaN codes and per-token scales there NaN; paged caches sit among NaN
pages; outputs are NaN-poisoned.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import (LSE_TOL, OUT_TOL, assert_lse_close, assert_out_close, context, randn,
                     to_device)

pytestmark = pytest.mark.gpu

FORMATS = ("e4m3", "e5m2")
NAN_CODE = {"e4m3": 0x7F, "e5m2": 0x7E}
SCALES = ("tensor", "head", "token")
# (num_heads, num_kv_heads, head_dim): GQA 4, MQA G = 8 at 64, G = 16 (two head tiles), MHA at
# 256, head_dims between the widths (80: StableLM, 96: Phi-3)
LAYOUTS = [(32, 8, 128), (8, 1, 64), (64, 4, 128), (4, 4, 256), (32, 32, 80), (24, 8, 96)]


def _values(rng, shape) -> np.ndarray:
    """float32 K or V whose magnitude differs per (token, KV head) by up to e^±2."""
    x = rng.standard_normal(shape, dtype=np.float32)
    return x * np.exp(rng.uniform(-2, 2, shape[:-1] + (1,))).astype(np.float32)


def _scale_of(x: np.ndarray, kv_dtype: str, mode: str):
    """A scale of ``mode`` for ``x`` (…, kv_heads, head_dim): per tensor a float, per head
    (kv_heads,) float32, per token None (reference.quantize_kv computes them per row)."""
    top = R.FP8_FORMATS[kv_dtype][1]
    if mode == "tensor":
        return float(np.abs(x).max() / top)
    if mode == "head":
        return (np.abs(x).max(axis=(0, 1, 3)) / top * np.float32(1.5)).astype(np.float32)
    return None


def _quantized(rng, shape, kv_dtype, mode, lengths):
    """(codes, scale) of a fresh cache: NaN codes (and NaN per-token scales) past each length."""
    x = _values(rng, shape)
    codes, scale = R.quantize_kv(x, kv_dtype, _scale_of(x, kv_dtype, mode))
    for b, n in enumerate(lengths):
        codes[b, n:] = NAN_CODE[kv_dtype]
        if mode == "token":
            scale[b, n:] = np.nan
    return codes, scale


def _dev_scale(scale):
    import cupy

    return scale if isinstance(scale, float) else cupy.asarray(scale)


class Fp8Case:
    """One problem over an fp8 cache: host codes and scales, the exact reference, device
    copies and NaN-poisoned calls (``options``: the API's score options, given alike to both)."""

    def __init__(self, rng, seed, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype,
                 kv_dtype, mode, lengths, q_len=1, **options):
        import cupy

        self.dtype, self.kv_dtype, self.options = dtype, kv_dtype, options
        self.lengths = list(lengths)
        shape = (batch, max_seqlen, num_kv_heads, head_dim)
        self.kc, self.ks = _quantized(rng, shape, kv_dtype, mode, self.lengths)
        self.vc, self.vs = _quantized(rng, shape, kv_dtype, mode, self.lengths)
        qs = (batch, num_heads, head_dim) if q_len == 1 else (batch, q_len, num_heads, head_dim)
        self.q_host = randn(rng, qs, dtype)
        self.shape = (batch, num_heads, num_kv_heads, head_dim, max_seqlen)
        self.q, self.k, self.v = to_device(self.q_host), cupy.asarray(self.kc), cupy.asarray(self.vc)
        self.k_scale, self.v_scale = _dev_scale(self.ks), _dev_scale(self.vs)
        self.seqlens = cupy.asarray(np.asarray(self.lengths, np.int32))
        self.ctx = context(seed, dtype=dtype, kv_dtype=kv_dtype, scale=mode, shape=self.shape,
                           q_len=q_len, lens=self.lengths[:8], **options)

    def reference(self, k=None, v=None, **kw):
        return R.decode_attention(self.q_host, self.kc if k is None else k,
                                  self.vc if v is None else v, self.lengths,
                                  kv_dtype=self.kv_dtype, k_scale=self.ks, v_scale=self.vs,
                                  **self.options, **kw)

    def poisoned(self):
        import cupy

        return (cupy.full(self.q.shape, np.nan, self.q.dtype),
                cupy.full(self.q.shape[:-1], np.nan, cupy.float32))

    def flash_decode(self, **kw):
        out, _ = self.poisoned()
        return cupydecode.flash_decode(self.q, self.k, self.v, self.seqlens, out=out,
                                       return_lse=True, kv_dtype=self.kv_dtype,
                                       k_scale=self.k_scale, v_scale=self.v_scale,
                                       **self.options, **kw)

    def check(self, out, lse, ref=None, what=""):
        ref_out, ref_lse = self.reference() if ref is None else ref
        ctx = f"{what} {self.ctx}".strip()
        err = assert_out_close(out, ref_out, OUT_TOL[self.dtype], ctx)
        assert_lse_close(lse, ref_lse, LSE_TOL[self.dtype], ctx)
        return err


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "x".join(map(str, l)))
@pytest.mark.parametrize("mode", SCALES)
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_fp8_matches_the_reference(cupy, rng, seed, kv_dtype, mode, layout):
    """Every layout, format and scale mode, with one split, fused and kernel merges and the
    policy's own plan (float16 and bfloat16 q alternating); lengths 0 (out 0, lse −inf), 1, a
    partial tile and the full cache."""
    dtype = "bfloat16" if (LAYOUTS.index(layout) + SCALES.index(mode)) % 2 else "float16"
    case = Fp8Case(rng, seed, 4, *layout, 600, dtype, kv_dtype, mode, [600, 0, 1, 333])
    ref = case.reference()
    for kw in ({"num_splits": 1}, {"num_splits": 5}, {}):
        out, lse = case.flash_decode(**kw)
        case.check(out, lse, ref, what=str(kw))
    plan = cupydecode.DecodePlan(*case.shape, dtype, num_splits=5, merge="kernel",
                                 kv_dtype=kv_dtype)
    out, lse = case.poisoned()
    plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse, k_scale=case.k_scale,
             v_scale=case.v_scale)
    case.check(out, lse, ref, what="merge kernel")
    assert not cupy.any(out[1]) and bool(cupy.all(cupy.isneginf(lse[1]))), case.ctx


@pytest.mark.parametrize("num_splits", (1, 2))
def test_fp8_per_token_long_chunks(cupy, rng, seed, num_splits):
    """Per-token scales on blocks streaming ≥ FP8_TOKEN_LONG_CHUNK tokens (their own block shape,
    _policy.fp8_token_config), one split and two with the fused merge, a length that ends
    inside a tile of the last chunk; the same plan's per-head run keeps the 8-warp shape."""
    from cupydecode import _policy

    chunk = _policy.FP8_TOKEN_LONG_CHUNK
    case = Fp8Case(rng, seed, 2, 32, 8, 128, chunk * num_splits, "float16", "e4m3", "token",
                   [chunk * num_splits, chunk * num_splits - 77])
    plan = cupydecode.DecodePlan(*case.shape, "float16", num_splits=num_splits, kv_dtype="e4m3")
    assert plan.chunk_tokens == chunk
    assert plan.token_config.num_warps == _policy.FP8_TOKEN_LONG_SHAPES[128][0], plan.token_config
    assert plan.token_config.num_warps != plan.config.num_warps
    out, lse = case.poisoned()
    plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse, k_scale=case.k_scale,
             v_scale=case.v_scale)
    case.check(out, lse, what=f"per token, {num_splits} split(s) of {chunk}")
    head_k = np.full(8, 0.75, np.float32)  # the same codes read with per-head scales
    head_v = np.full(8, 1.25, np.float32)
    out, lse = case.poisoned()
    plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse,
             k_scale=cupy.asarray(head_k), v_scale=cupy.asarray(head_v))
    ref = R.decode_attention(case.q_host, case.kc, case.vc, case.lengths, kv_dtype="e4m3",
                             k_scale=head_k, v_scale=head_v)
    case.check(out, lse, ref, what="per head, same plan")


def test_the_scales_change_the_answer(rng, seed):
    """The tests above can fail: with the scales of another head, or of another token, or with
    none, the reference moves by far more than the tolerance."""
    codes, scale = _quantized(rng, (2, 300, 4, 128), "e4m3", "token", [300, 300])
    vcodes, vscale = _quantized(rng, (2, 300, 4, 128), "e4m3", "token", [300, 300])
    q = randn(rng, (2, 16, 128), "float16")
    base = R.decode_attention(q, codes, vcodes, None, kv_dtype="e4m3", k_scale=scale,
                              v_scale=vscale)[0]
    for k_sc, v_sc in ((scale[:, :, ::-1].copy(), vscale), (scale, vscale[:, ::-1].copy()),
                       (1.0, vscale), (scale, 1.0)):
        other = R.decode_attention(q, codes, vcodes, None, kv_dtype="e4m3", k_scale=k_sc,
                                   v_scale=v_sc)[0]
        err = R.relative_error(other, base)
        assert err > 20 * OUT_TOL["float16"], f"{err:.3e} {context(seed)}"


@pytest.mark.parametrize("page_size", (1, 16, 100))
@pytest.mark.parametrize("mode", SCALES)
def test_fp8_paged(cupy, rng, seed, page_size, mode):
    """A paged fp8 cache (pages in random order among NaN pages, per-token scales paged alike),
    against the same cache contiguous."""
    case = Fp8Case(rng, seed, 3, 32, 8, 128, 400, "float16", "e4m3", mode, [400, 17, 250])
    per_seq = -(-400 // page_size)
    num_pages = 3 * per_seq + 2
    table = rng.permutation(num_pages)[:3 * per_seq].reshape(3, per_seq).astype(np.int32)

    def pages(x, fill):
        p = np.full((num_pages, page_size) + x.shape[2:], fill, x.dtype)
        for b in range(3):
            for j in range(per_seq):
                rows = x[b, j * page_size:(j + 1) * page_size]
                p[table[b, j], :len(rows)] = rows
        return p

    kp, vp = pages(case.kc, NAN_CODE["e4m3"]), pages(case.vc, NAN_CODE["e4m3"])
    ks = case.k_scale if mode != "token" else cupy.asarray(pages(case.ks, np.nan))
    vs = case.v_scale if mode != "token" else cupy.asarray(pages(case.vs, np.nan))
    ref = case.reference()
    for kw in ({"num_splits": 1}, {"num_splits": 4}, {}):
        out, _ = case.poisoned()
        out, lse = cupydecode.flash_decode(case.q, cupy.asarray(kp), cupy.asarray(vp),
                                           case.seqlens, block_table=cupy.asarray(table),
                                           kv_dtype="e4m3", k_scale=ks, v_scale=vs, out=out,
                                           return_lse=True, **kw)
        case.check(out, lse, ref, what=f"page_size={page_size} {kw}")


@pytest.mark.parametrize("options", [{"logits_soft_cap": 8.0}, {"window_left": 100},
                                     {"alibi_slopes": "alibi"}, {"sinks": "sinks"}],
                         ids=("softcap", "window", "alibi", "sinks"))
@pytest.mark.parametrize("mode", ("head", "token"))
def test_fp8_with_score_options(cupy, rng, seed, options, mode):
    """The score hook's options over an fp8 cache, as the 16-bit paths take them."""
    options = dict(options)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = rng.uniform(0.01, 0.2, 32).astype(np.float32)
    if "sinks" in options:
        options["sinks"] = rng.uniform(-2, 4, 32).astype(np.float32)
    case = Fp8Case(rng, seed, 3, 32, 8, 128, 700, "float16", "e5m2", mode, [700, 0, 350],
                   **options)
    ref = case.reference()
    dev = {k: (cupy.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in options.items()}
    case.options = dev
    for kw in ({"num_splits": 1}, {"num_splits": 6}):
        case.check(*case.flash_decode(**kw), ref=ref, what=str(kw))


@pytest.mark.parametrize("q_len", (2, 5))
@pytest.mark.parametrize("mode", ("tensor", "token"))
def test_fp8_several_query_tokens(cupy, rng, seed, q_len, mode):
    """q_len query tokens whose K/V are in the cache already (causal, aligned to the end), G = 4:
    q_len · G rows in head tiles of 8, with and without a window."""
    case = Fp8Case(rng, seed, 3, 16, 4, 128, 500, "bfloat16", "e4m3", mode, [500, 3, 260],
                   q_len=q_len)
    for window in (None, 40):
        case.options = {"window_left": window}
        ref = case.reference()
        for kw in ({"num_splits": 1}, {"num_splits": 3}):
            case.check(*case.flash_decode(**kw), ref=ref, what=f"window={window} {kw}")


def _bytes(x) -> np.ndarray:
    import cupy

    return cupy.ascontiguousarray(x).view(cupy.uint8).get() if hasattr(x, "get") else \
        np.ascontiguousarray(x).view(np.uint8)


@pytest.mark.parametrize("paged", (False, True))
@pytest.mark.parametrize("q_len", (1, 3))
@pytest.mark.parametrize("mode", SCALES)
def test_fp8_append_quantises_into_the_cache(cupy, rng, seed, mode, q_len, paged):
    """k_new/v_new (float16) appended in the call: the cache afterwards holds exactly the codes
    (and, per token, the scales) reference.append_kv writes, and the output attends them; a full
    sequence appends nothing, an empty one at 0."""
    lengths = [500, 0, 123, 498]
    case = Fp8Case(rng, seed, 4, 32, 8, 128, 500, "float16", "e4m3", mode, lengths, q_len=q_len)
    kn = randn(rng, (4, q_len, 8, 128), "float16", 3.0)
    vn = randn(rng, (4, q_len, 8, 128), "float16", 0.5)
    kn[2, 0, 3, :5] = 0  # a row's largest value elsewhere
    ref = R.decode_attention(case.q_host, case.kc, case.vc, lengths, k_new=kn, v_new=vn,
                             kv_dtype="e4m3", k_scale=case.ks, v_scale=case.vs)
    want = R.append_kv(case.kc, case.vc, lengths, kn, vn, kv_dtype="e4m3", k_scale=case.ks,
                       v_scale=case.vs)
    table = None
    k, v, ks, vs = case.k, case.v, case.k_scale, case.v_scale
    if paged:  # one page of 100 tokens per sequence in reverse order: pages (b, p) → 4·5 − …
        table = cupy.asarray(np.arange(20, dtype=np.int32)[::-1].reshape(4, 5).copy())
        k = case.k.reshape(20, 100, 8, 128)[::-1].copy()
        v = case.v.reshape(20, 100, 8, 128)[::-1].copy()
        if mode == "token":
            ks = case.k_scale.reshape(20, 100, 8)[::-1].copy()
            vs = case.v_scale.reshape(20, 100, 8)[::-1].copy()
    for kw in ({"num_splits": 1}, {"num_splits": 4}):
        kk, vv = k.copy(), v.copy()
        kss = ks if isinstance(ks, float) else ks.copy()
        vss = vs if isinstance(vs, float) else vs.copy()
        out, _ = case.poisoned()
        out, lse = cupydecode.flash_decode(case.q, kk, vv, case.seqlens, k_new=to_device(kn),
                                           v_new=to_device(vn), block_table=table,
                                           kv_dtype="e4m3", k_scale=kss, v_scale=vss, out=out,
                                           return_lse=True, **kw)
        case.check(out, lse, ref, what=f"append {kw}")
        if paged:  # back to the contiguous order of the reference
            kk, vv = kk[::-1].reshape(4, 500, 8, 128), vv[::-1].reshape(4, 500, 8, 128)
            if mode == "token":
                kss, vss = kss[::-1].reshape(4, 500, 8), vss[::-1].reshape(4, 500, 8)
        assert (_bytes(kk) == _bytes(want[0])).all(), f"k codes {kw} {case.ctx}"
        assert (_bytes(vv) == _bytes(want[1])).all(), f"v codes {kw} {case.ctx}"
        if mode == "token":
            for got, exp, name in ((kss, want[3], "k_scale"), (vss, want[4], "v_scale")):
                got = got.get()
                same = (got == exp) | (np.isnan(got) & np.isnan(exp))
                assert same.all(), f"{name} {np.argwhere(~same)[:4].tolist()} {kw} {case.ctx}"


def test_fp8_plan_in_a_graph_follows_new_scales(cupy, rng, seed):
    """A DecodePlan over an fp8 cache captured in a CUDA graph: replays take the scales' new
    values (per KV head and per token), as they take new lengths."""
    for mode in ("head", "token"):
        case = Fp8Case(rng, seed, 2, 32, 8, 128, 1000, "float16", "e4m3", mode, [1000, 640])
        plan = cupydecode.DecodePlan(*case.shape, "float16", kv_dtype="e4m3")
        out, lse = case.poisoned()
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse,
                     k_scale=case.k_scale, v_scale=case.v_scale)  # (builds the kernel)
            stream.begin_capture()
            plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse,
                     k_scale=case.k_scale, v_scale=case.v_scale)
            graph = stream.end_capture()
        for step in range(2):
            with stream:  # (a non-blocking stream: the updates must be ordered before the replay)
                if step:
                    case.ks = (case.ks * rng.uniform(0.5, 2.0, case.ks.shape)).astype(np.float32)
                    case.vs = (case.vs * rng.uniform(0.5, 2.0, case.vs.shape)).astype(np.float32)
                    case.k_scale[...] = cupy.asarray(case.ks)
                    case.v_scale[...] = cupy.asarray(case.vs)
                out.fill(np.nan)
                graph.launch(stream)
            stream.synchronize()
            case.check(out, lse, what=f"{mode} replay {step}")


def test_fp8_nan_code_stays_in_its_sequence(cupy, rng, seed):
    """A NaN code in one token of one sequence's K makes that sequence's rows of that KV head NaN
    and leaves every other row as the reference says."""
    case = Fp8Case(rng, seed, 3, 32, 8, 128, 300, "float16", "e4m3", "head", [300, 300, 300])
    case.kc[1, 77, 2, 5] = NAN_CODE["e4m3"]
    case.k = cupy.asarray(case.kc)
    ref_out, ref_lse = case.reference()
    for kw in ({"num_splits": 1}, {"num_splits": 4}):
        out, lse = case.flash_decode(**kw)
        bad = np.zeros((3, 32), bool)
        bad[1, 8:12] = True
        o, l = out.get().astype(np.float64), lse.get()
        assert np.isnan(o[bad]).all() and np.isnan(l[bad]).all(), case.ctx
        assert_out_close(o[~bad], ref_out[~bad], OUT_TOL["float16"], case.ctx)
        assert_lse_close(l[~bad], ref_lse[~bad], LSE_TOL["float16"], case.ctx)


def test_fp8_bad_inputs_are_refused(cupy):
    """Every fp8 argument checked before any launch, named in the message."""
    q = cupy.zeros((2, 8, 128), cupy.float16)
    k = cupy.zeros((2, 64, 2, 128), cupy.uint8)
    good = dict(kv_dtype="e4m3", k_scale=1.0, v_scale=1.0)

    def refused(exc, match, q=q, k=k, v=None, **kw):
        args = dict(good, **kw)
        with pytest.raises(exc, match=match):
            cupydecode.flash_decode(q, k, k if v is None else v, 64, **args)

    refused(ValueError, "kv_dtype", kv_dtype="fp8")
    refused(TypeError, "k_cache", k=cupy.zeros((2, 64, 2, 128), cupy.float16))
    refused(TypeError, "q", q=q.astype(cupy.float32))
    refused(ValueError, "head_dim a multiple of 16", q=cupy.zeros((2, 8, 72), cupy.float16),
            k=cupy.zeros((2, 64, 2, 72), cupy.uint8))
    refused(ValueError, "k_scale", k_scale=None)
    refused(ValueError, "v_scale", v_scale=-1.0)
    refused(ValueError, "k_scale", k_scale=float("nan"))
    refused(TypeError, "k_scale", k_scale=np.ones(2, np.float32))
    refused(TypeError, "v_scale", v_scale=cupy.ones(2, cupy.float64))
    refused(ValueError, "k_scale", k_scale=cupy.ones(3, cupy.float32))
    refused(ValueError, "v_scale", k_scale=cupy.ones((2, 64, 2), cupy.float32), v_scale=1.0)
    with pytest.raises(ValueError, match="k_scale"):
        cupydecode.flash_decode(q, k.view(cupy.uint8).astype(cupy.float16),
                                k.astype(cupy.float16), 64, k_scale=1.0)
    with pytest.raises(TypeError, match="dtype"):
        cupydecode.DecodePlan(2, 8, 2, 128, 64, "float32", kv_dtype="e4m3")
    with pytest.raises(ValueError, match="head_dim"):
        cupydecode.DecodePlan(2, 8, 2, 72, 64, "float16", kv_dtype="e5m2")
    out = cupydecode.flash_decode(q, k, k, 64, **good)  # the context is healthy afterwards
    assert not cupy.isnan(out).any()
