"""The float64 NumPy reference against a direct softmax written out here, element by element.

Everything else is checked against cupydecode.reference, so it is checked first, on its own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from cupydecode import reference as R
from helpers import context, np_dtype, randn, to_paged


def direct_attention(q, k, v, lens, scale, soft_cap=None):
    """Softmax attention with plain loops and math.exp: (out, lse) in float64 (``soft_cap`` t:
    each score s becomes t · tanh(s / t)); one query token per sequence (:func:`direct_general`
    with q_len 1)."""
    out, lse = direct_general(np.asarray(q)[:, None], k, v, lens, scale, soft_cap)
    return out[:, 0], lse[:, 0]


def direct_row(scores, values):
    """One query row: (out, lse) from the scores and values directly."""
    m = max(scores)
    weights = [math.exp(s - m) for s in scores]
    total = sum(weights)
    out = sum(w * values[j] for j, w in enumerate(weights)) / total
    return out, m + math.log(total)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_decode_attention_matches_direct_softmax(rng, seed, group, dtype):
    batch, num_kv_heads, head_dim, max_seqlen = 4, 2, 16, 23
    num_heads = group * num_kv_heads
    q = randn(rng, (batch, num_heads, head_dim), dtype)
    k = randn(rng, (batch, max_seqlen, num_kv_heads, head_dim), dtype)
    v = randn(rng, (batch, max_seqlen, num_kv_heads, head_dim), dtype)
    lens = [0, 1, int(rng.integers(2, max_seqlen)), max_seqlen]
    ctx = context(seed, group=group, dtype=dtype, lens=lens)

    out, lse = R.decode_attention(q, k, v, lens)
    want_out, want_lse = direct_attention(q, k, v, lens, 1 / math.sqrt(head_dim))
    assert out.dtype == np.float64 and lse.dtype == np.float64, ctx
    assert out.shape == (batch, num_heads, head_dim) and lse.shape == (batch, num_heads), ctx
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12, err_msg=ctx)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12, err_msg=ctx)
    # Length 0: out exactly 0, lse exactly -inf.
    assert np.all(out[0] == 0.0) and np.all(np.isneginf(lse[0])), ctx


def test_decode_attention_seqlens_forms(rng, seed):
    q, k, v = (randn(rng, s, "float32") for s in [(3, 4, 8), (3, 9, 2, 8), (3, 9, 2, 8)])
    ctx = context(seed)
    full = direct_attention(q, k, v, [9, 9, 9], 1 / math.sqrt(8))
    five = direct_attention(q, k, v, [5, 5, 5], 1 / math.sqrt(8))
    for lens, want in [(None, full), (9, full), (5, five), (np.int32(5), five),
                       ([5, 5, 5], five), (np.array([5, 5, 5], np.int32), five)]:
        got = R.decode_attention(q, k, v, lens)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12, err_msg=f"{lens} {ctx}")
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-12, err_msg=f"{lens} {ctx}")
    # Lengths past max_seqlen are clamped, like the kernel does for device arrays.
    got = R.decode_attention(q, k, v, [100, 9, 12])
    np.testing.assert_allclose(got[0], full[0], rtol=1e-12, atol=1e-12, err_msg=ctx)


def test_decode_attention_custom_scale(rng, seed):
    q, k, v = (randn(rng, s, "float32") for s in [(2, 6, 16), (2, 11, 3, 16), (2, 11, 3, 16)])
    ctx = context(seed)
    for scale in (0.37, 1.0, 2.5):
        got = R.decode_attention(q, k, v, [11, 4], softmax_scale=scale)
        want = direct_attention(q, k, v, [11, 4], scale)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12, err_msg=f"{scale} {ctx}")
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-12, err_msg=f"{scale} {ctx}")
    default = R.decode_attention(q, k, v, [11, 4])
    explicit = R.decode_attention(q, k, v, [11, 4], softmax_scale=1 / math.sqrt(16))
    np.testing.assert_array_equal(default[0], explicit[0], err_msg=ctx)


CHUNKINGS = [
    lambda n: [0, n],                         # one chunk
    lambda n: [0, 1, n],                      # a single-token chunk
    lambda n: [0, 0, n],                      # empty first chunk
    lambda n: [0, n, n],                      # empty last chunk
    lambda n: [0, n // 2, n // 2, n],         # empty middle chunk
    lambda n: list(range(0, n, 7)) + [n],     # many short chunks
    lambda n: list(range(n + 1)),             # one token each
]


@pytest.mark.parametrize("chunking", range(len(CHUNKINGS)))
@pytest.mark.parametrize("logit_scale", [1.0, 1e4])
def test_split_then_merge_equals_direct(rng, seed, chunking, logit_scale):
    n, head_dim = 40, 8
    ctx = context(seed, chunking=chunking, logit_scale=logit_scale)
    if logit_scale == 1.0:
        scores = rng.standard_normal(n)
    else:  # |s| up to 1e4: exp(s) overflows even float64, the log domain must not
        scores = rng.uniform(-logit_scale, logit_scale, n)
        scores[rng.integers(n)] = logit_scale
    values = rng.standard_normal((n, head_dim))
    edges = CHUNKINGS[chunking](n)

    o_parts, lse_parts = R.split_states(scores, values, edges)
    assert o_parts.shape == (len(edges) - 1, head_dim) and lse_parts.shape == (len(edges) - 1,)
    for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        if b <= a:
            assert lse_parts[i] == -np.inf and np.all(o_parts[i] == 0), ctx
        else:
            want_o, want_lse = direct_row(scores[a:b], values[a:b])
            np.testing.assert_allclose(o_parts[i], want_o, rtol=1e-12, atol=1e-12, err_msg=ctx)
            assert math.isclose(lse_parts[i], want_lse, rel_tol=1e-14, abs_tol=1e-12), ctx

    with np.errstate(invalid="raise", divide="raise", over="raise"):
        o, lse = R.merge_states(o_parts, lse_parts)
    want_o, want_lse = direct_row(scores, values)
    assert np.all(np.isfinite(o)) and np.isfinite(lse), ctx
    np.testing.assert_allclose(o, want_o, rtol=1e-10, atol=1e-12, err_msg=ctx)
    assert math.isclose(lse, want_lse, rel_tol=1e-14, abs_tol=1e-10), ctx


def test_merge_states_row_dims_and_empty_states(rng, seed):
    """(S, *rows, D) states, some empty with garbage (NaN) outputs that must not leak."""
    num_states, rows, head_dim = 5, (3, 4), 6
    ctx = context(seed)
    o = rng.standard_normal((num_states, *rows, head_dim))
    lse = rng.uniform(-50, 50, (num_states, *rows))
    empty = rng.random((num_states, *rows)) < 0.4
    empty[:, 0, 0] = True                       # one row with every state empty
    lse[empty] = -np.inf
    o[empty] = np.nan
    with np.errstate(invalid="raise", divide="raise", over="raise"):
        got_o, got_lse = R.merge_states(o, lse)
    assert got_o.shape == (*rows, head_dim) and got_lse.shape == rows, ctx
    assert not np.any(np.isnan(got_o)) and not np.any(np.isnan(got_lse)), ctx
    for r in np.ndindex(*rows):
        live = [i for i in range(num_states) if not empty[(i, *r)]]
        if not live:
            assert np.all(got_o[r] == 0) and got_lse[r] == -np.inf, f"{r} {ctx}"
            continue
        ls = [lse[(i, *r)] for i in live]
        m = max(ls)
        ws = [math.exp(x - m) for x in ls]
        want_lse = m + math.log(sum(ws))
        want_o = sum(w * o[(i, *r)] for w, i in zip(ws, live)) / sum(ws)
        np.testing.assert_allclose(got_o[r], want_o, rtol=1e-12, atol=1e-12, err_msg=f"{r} {ctx}")
        assert math.isclose(got_lse[r], want_lse, rel_tol=1e-14, abs_tol=1e-12), f"{r} {ctx}"


def test_merge_all_empty_gives_zero_and_neg_inf():
    o = np.full((3, 2, 4), np.nan)
    lse = np.full((3, 2), -np.inf)
    with np.errstate(all="raise"):
        got_o, got_lse = R.merge_states(o, lse)
    assert np.all(got_o == 0) and np.all(np.isneginf(got_lse))


def test_merge_large_lse_spread(rng, seed):
    """LSE of ±1e4 across states: the small ones vanish, nothing overflows or turns NaN."""
    ctx = context(seed)
    o = rng.standard_normal((4, 3, 8))
    lse = np.array([[1e4, -1e4, 0.0], [1e4 - 1.0, 1e4, -1e4], [-1e4, 1e4, 0.5], [-np.inf, -1e4, 0.0]])
    with np.errstate(invalid="raise", divide="raise", over="raise"):
        got_o, got_lse = R.merge_states(o, lse)
    for r in range(3):
        ls = lse[:, r]
        m = ls.max()
        ws = np.exp(ls - m)
        np.testing.assert_allclose(got_o[r], (ws[:, None] * o[:, r]).sum(0) / ws.sum(),
                                   rtol=1e-12, atol=1e-12, err_msg=ctx)
        assert math.isclose(got_lse[r], m + math.log(ws.sum()), rel_tol=1e-15), ctx


def test_merge_accepts_low_precision_inputs(rng):
    o = randn(rng, (2, 3, 8), "bfloat16")
    lse = rng.standard_normal((2, 3)).astype(np.float32)
    got_o, got_lse = R.merge_states(o, lse)
    assert got_o.dtype == np.float64 and np.all(np.isfinite(got_o)) and np.all(np.isfinite(got_lse))


def test_relative_error():
    ref = np.array([[3.0, 4.0], [0.0, 0.0]])
    assert R.relative_error(ref, ref) == 0.0
    assert math.isclose(R.relative_error(ref * (1 + 1e-3), ref), 1e-3, rel_tol=1e-9)
    assert math.isclose(R.relative_error(ref + np.array([[0, 0], [0.5, 0]]), ref), 0.1, rel_tol=1e-12)
    # A zero reference: the absolute norm.
    assert R.relative_error(np.array([3.0, 4.0]), np.zeros(2)) == 5.0
    assert R.relative_error(np.zeros(2), np.zeros(2)) == 0.0
    # Any NaN or inf in the result is an infinite error, never a silent pass.
    assert R.relative_error(np.array([np.nan, 1.0]), np.array([1.0, 1.0])) == math.inf
    assert R.relative_error(np.array([np.inf, 1.0]), np.array([1.0, 1.0])) == math.inf
    # Low-precision inputs are compared in float64.
    assert R.relative_error(ref.astype(np_dtype("bfloat16")), ref) == 0.0


def test_lse_error():
    ref = np.array([1.0, -np.inf, 3.0])
    assert R.lse_error(ref, ref) == 0.0
    assert math.isclose(R.lse_error(np.array([1.5, -np.inf, 2.9]), ref), 0.5)
    # -inf must match -inf exactly; NaN is never accepted.
    assert R.lse_error(np.array([1.0, -1e30, 3.0]), ref) == math.inf
    assert R.lse_error(np.array([-np.inf, -np.inf, 3.0]), ref) == math.inf
    assert R.lse_error(np.array([1.0, np.nan, 3.0]), ref) == math.inf
    assert R.lse_error(np.array([np.nan, -np.inf, 3.0]), ref) == math.inf
    # All rows empty and matching.
    assert R.lse_error(np.full(2, -np.inf), np.full(2, -np.inf)) == 0.0


def test_attention_rows_selects_sequences_and_kv_heads(rng, seed):
    """The one reference computation (NumPy here, CuPy in `check` and bench) on a subset of
    sequences and KV heads equals those rows of the full result."""
    from cupydecode.check import select_rows

    q = rng.standard_normal((3, 12, 16))
    k = rng.standard_normal((3, 40, 4, 16))
    v = rng.standard_normal((3, 40, 4, 16))
    lens = [40, 0, 17]
    out, lse = R.decode_attention(q, k, v, lens)
    sub, sub_lse = R.attention_rows(q, k, v, lens, None, [2, 1], [3, 0])
    assert sub.shape == (2, 2, 3, 16) and sub_lse.shape == (2, 2, 3)
    assert np.array_equal(sub, select_rows(out, 4, [2, 1], [3, 0])), seed
    assert np.array_equal(sub_lse, select_rows(lse, 4, [2, 1], [3, 0])), seed
    assert np.all(np.isneginf(sub_lse[1])) and not np.any(sub[1])  # the empty sequence



@pytest.mark.parametrize("cap", [50.0, 2.5])
def test_soft_cap_matches_direct_softmax(rng, seed, cap):
    """logits_soft_cap (Gemma-2's 50, and a cap below the logits' spread) against the direct
    loop, on logits large enough that the cap changes the result."""
    q = randn(rng, (3, 8, 16), "float32", 40.0)  # logits of about ±160 before the cap
    k = randn(rng, (3, 30, 2, 16), "float32")
    v = randn(rng, (3, 30, 2, 16), "float32")
    lens = [30, 0, 11]
    ctx = context(seed, cap=cap)
    out, lse = R.decode_attention(q, k, v, lens, logits_soft_cap=cap)
    want_out, want_lse = direct_attention(q, k, v, lens, 0.25, soft_cap=cap)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12, err_msg=ctx)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12, err_msg=ctx)
    plain, _ = R.decode_attention(q, k, v, lens)
    assert R.relative_error(out, plain) > 1e-2, ctx  # the cap matters on these logits
    assert np.all(lse[0] <= cap + math.log(30) + 1e-9), ctx  # LSE bounded by cap + ln(n)


@pytest.mark.parametrize("cap", [-1.0, float("inf"), float("nan")])
def test_soft_cap_must_be_positive_and_finite(cap):  # (0: no cap, test_soft_cap_zero_is_no_cap)
    x = np.ones((1, 2, 8))
    with pytest.raises(ValueError, match="logits_soft_cap"):
        R.decode_attention(x, np.ones((1, 4, 1, 8)), np.ones((1, 4, 1, 8)), logits_soft_cap=cap)


@pytest.mark.parametrize("page_size", [1, 3, 16, 100])
def test_paged_cache_equals_the_contiguous_one(rng, seed, page_size):
    q = rng.standard_normal((3, 8, 16))
    k = rng.standard_normal((3, 250, 2, 16))
    v = rng.standard_normal((3, 250, 2, 16))
    lens = [250, 0, 101]  # full, empty, ending mid-page
    pk, pv, table = to_paged(np.random.default_rng(seed), k, v, page_size)
    want = R.decode_attention(q, k, v, lens)
    got = R.decode_attention(q, pk, pv, lens, block_table=table)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-13, atol=1e-14, err_msg=str(seed))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-13, atol=1e-14, err_msg=str(seed))
    # the (num_pages, num_kv_heads, page_size, head_dim) memory order, as a transposed view
    hnd = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3) for x in (pk, pv)]
    again = R.decode_attention(q, *hnd, lens, block_table=table)
    assert np.array_equal(again[0], got[0]) and np.array_equal(again[1], got[1])


def test_out_of_range_pages_contribute_nothing(rng, seed):
    q = rng.standard_normal((2, 4, 8))
    k = rng.standard_normal((2, 12, 1, 8))
    v = rng.standard_normal((2, 12, 1, 8))
    pk, pv, table = to_paged(np.random.default_rng(seed), k, v, 4)
    table[0, 1] = -1                # tokens 4..7 of sequence 0
    table[1, :] = pk.shape[0]       # every page of sequence 1
    out, lse = R.decode_attention(q, pk, pv, [12, 12], block_table=table)
    keep = [0, 1, 2, 3, 8, 9, 10, 11]
    want, want_lse = R.decode_attention(q[:1], k[:1, keep], v[:1, keep])
    np.testing.assert_allclose(out[0], want[0], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse[0], want_lse[0], rtol=1e-13, atol=1e-14)
    assert not np.any(out[1]) and np.all(np.isneginf(lse[1]))


@pytest.mark.parametrize("paged", [False, True])
def test_append_writes_exactly_the_new_rows_then_attends_them(rng, seed, paged):
    q = rng.standard_normal((3, 2, 4, 8))  # two new tokens per sequence, two query tokens
    k = rng.standard_normal((3, 20, 2, 8))
    v = rng.standard_normal((3, 20, 2, 8))
    k_new, v_new = rng.standard_normal((3, 2, 2, 8)), rng.standard_normal((3, 2, 2, 8))
    lens = np.array([5, 0, 19])  # the last one has room for one of its two new tokens
    want_k, want_v = k.copy(), v.copy()
    for b, n in enumerate(lens):
        for i in range(2):
            if n + i < 20:
                want_k[b, n + i], want_v[b, n + i] = k_new[b, i], v_new[b, i]
    want = R.decode_attention(q, want_k, want_v, [7, 2, 20])
    if not paged:
        k2, v2, lens2 = R.append_kv(k, v, lens, k_new, v_new)
        assert np.array_equal(k2, want_k) and np.array_equal(v2, want_v)  # nothing else moved
        got = R.decode_attention(q, k, v, lens, k_new=k_new, v_new=v_new)
    else:
        # pages of 4 tokens: the same capacity (20) as the contiguous cache
        pk, pv, table = to_paged(np.random.default_rng(seed), k, v, 4)
        k2, v2, lens2 = R.append_kv(pk, pv, lens, k_new, v_new, table)
        ck, _, _ = to_paged(np.random.default_rng(seed), want_k, want_v, 4)  # the same pages
        used = np.unique(table)
        assert np.array_equal(k2[used], ck[used])  # the pages in use hold exactly want_k
        spare = np.setdiff1d(np.arange(pk.shape[0]), used)
        assert np.array_equal(k2[spare], pk[spare], equal_nan=True)  # spare pages: NaN, untouched
        assert np.array_equal(v2[spare], pv[spare], equal_nan=True)
        got = R.decode_attention(q, pk, pv, lens, block_table=table, k_new=k_new, v_new=v_new)
    assert list(lens2) == [7, 2, 20]
    np.testing.assert_allclose(got[0], want[0], rtol=1e-13, atol=1e-14, err_msg=str(seed))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-13, atol=1e-14, err_msg=str(seed))
    with pytest.raises(ValueError, match="k_new and v_new"):
        R.decode_attention(q, k, v, lens, k_new=k_new)


def direct_general(q4, k, v, lens, scale, cap=None, window=None, slopes=None, sinks=None):
    """Every score option of the API, with plain loops: q4 (B, T, H, D); query token t of a
    sequence of L tokens sits at position L − T + t; returns (out (B, T, H, D), lse (B, T, H))."""
    q4, k, v = (np.asarray(x, np.float64) for x in (q4, k, v))
    batch, q_len, num_heads, head_dim = q4.shape
    group = num_heads // k.shape[2]
    out = np.zeros(q4.shape)
    lse = np.full(q4.shape[:3], -math.inf)
    for b in range(batch):
        for t in range(q_len):
            pos = lens[b] - q_len + t
            for h in range(num_heads):
                kvh = h // group
                keys = [j for j in range(lens[b]) if j <= pos and (window is None or j >= pos - window)]
                scores = []
                for j in keys:
                    x = scale * float(np.dot(q4[b, t, h], k[b, j, kvh]))
                    if cap is not None:
                        x = cap * math.tanh(x / cap)
                    if slopes is not None:
                        x -= slopes[h] * (pos - j)
                    scores.append(x)
                terms = scores + ([float(sinks[h])] if sinks is not None else [])
                if not terms:
                    continue
                m = max(terms)
                weights = [math.exp(x - m) for x in scores]
                total = sum(weights) + (math.exp(sinks[h] - m) if sinks is not None else 0.0)
                for j, w in zip(keys, weights):
                    out[b, t, h] += (w / total) * v[b, j, kvh]
                lse[b, t, h] = m + math.log(total)
    return out, lse


@pytest.mark.parametrize("q_len", [1, 2, 7])
@pytest.mark.parametrize("window", [None, 0, 5])
@pytest.mark.parametrize("alibi,sink,cap", [(False, False, None), (True, False, None),
                                            (False, True, None), (True, True, 30.0)])
def test_score_options_match_the_direct_loop(rng, seed, q_len, window, alibi, sink, cap):
    """Several query tokens per sequence (causal, aligned to the end; sequences shorter than
    q_len included), windows, ALiBi, sinks and the soft-cap, alone and together."""
    num_heads, num_kv_heads, head_dim = 6, 2, 8
    lens = [0, 1, 3, 40]
    q4 = rng.standard_normal((4, q_len, num_heads, head_dim)) * 2.0
    k = rng.standard_normal((4, 40, num_kv_heads, head_dim))
    v = rng.standard_normal((4, 40, num_kv_heads, head_dim))
    slopes = rng.uniform(0.01, 0.5, num_heads) if alibi else None
    sinks = rng.normal(1.0, 2.0, num_heads) if sink else None
    ctx = context(seed, q_len=q_len, window=window, alibi=alibi, sink=sink, cap=cap)
    out, lse = R.decode_attention(q4, k, v, lens, logits_soft_cap=cap, window_left=window,
                                  alibi_slopes=slopes, sinks=sinks)
    want_out, want_lse = direct_general(q4, k, v, lens, head_dim ** -0.5, cap, window, slopes,
                                        sinks)
    assert out.shape == q4.shape and lse.shape == q4.shape[:3], ctx
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12, err_msg=ctx)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12, err_msg=ctx)
    if q_len == 1:  # one token: the 3-dimensional q gives the same rows
        out3, lse3 = R.decode_attention(q4[:, 0], k, v, lens, logits_soft_cap=cap,
                                        window_left=window, alibi_slopes=slopes, sinks=sinks)
        assert np.array_equal(out3, out[:, 0]) and np.array_equal(lse3, lse[:, 0]), ctx


def test_window_reads_only_the_window(rng):
    """A window of W keys gives the result of a cache holding only those keys."""
    q = rng.standard_normal((1, 4, 8))
    k, v = rng.standard_normal((1, 100, 2, 8)), rng.standard_normal((1, 100, 2, 8))
    got = R.decode_attention(q, k, v, [90], window_left=9)
    want = R.decode_attention(q, k[:, 80:90], v[:, 80:90])
    np.testing.assert_allclose(got[0], want[0], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("bad,name,kind", [
    (dict(window_left=-2), "window_left", ValueError),
    (dict(window_left=1.5), "window_left", TypeError),
    (dict(window_left=True), "window_left", TypeError),
    (dict(alibi_slopes=np.ones(3)), "alibi_slopes", ValueError),
    (dict(sinks=np.ones((2, 2))), "sinks", ValueError)])
def test_score_options_are_checked(bad, name, kind):
    """The reference refuses what flash_decode refuses, with the same kind of error."""
    x = np.ones((1, 4, 8))
    with pytest.raises(kind, match=name):
        R.decode_attention(x, np.ones((1, 5, 2, 8)), np.ones((1, 5, 2, 8)), **bad)


def test_soft_cap_zero_is_no_cap(rng):
    """logits_soft_cap=0 means no cap in the reference, as in flash_decode (FlashAttention's
    convention), and a cap changes large logits."""
    q, k, v = rng.standard_normal((2, 4, 8)) * 8, rng.standard_normal((2, 9, 2, 8)), \
        rng.standard_normal((2, 9, 2, 8))
    plain = R.decode_attention(q, k, v)
    zero = R.decode_attention(q, k, v, logits_soft_cap=0)
    capped = R.decode_attention(q, k, v, logits_soft_cap=1.0)
    np.testing.assert_array_equal(zero[0], plain[0])
    np.testing.assert_array_equal(zero[1], plain[1])
    assert not np.allclose(capped[1], plain[1])


def test_merge_applies_a_sink_once(rng, seed):
    """Attention over two halves merged with the sink equals attention with the sink over all
    tokens (the sink given to the merge only, never to the partial calls)."""
    q = rng.standard_normal((2, 4, 8))
    k, v = rng.standard_normal((2, 30, 2, 8)), rng.standard_normal((2, 30, 2, 8))
    sinks = rng.normal(0.5, 1.0, 4)
    lens = np.array([30, 12])
    first = R.decode_attention(q, k[:, :16], v[:, :16], np.minimum(lens, 16))
    second = R.decode_attention(q, k[:, 16:], v[:, 16:], np.maximum(lens - 16, 0))
    o, lse = R.merge_states(np.stack([first[0], second[0]]), np.stack([first[1], second[1]]),
                            sinks=sinks)
    want, want_lse = R.decode_attention(q, k, v, lens, sinks=sinks)
    np.testing.assert_allclose(o, want, rtol=1e-12, atol=1e-13, err_msg=str(seed))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-13, err_msg=str(seed))
    # all states empty: out 0, lse the sink itself
    empty_o, empty_lse = R.merge_states(np.zeros((2, 1, 4, 8)), np.full((2, 1, 4), -np.inf),
                                        sinks=sinks)
    assert not np.any(empty_o) and np.allclose(empty_lse, sinks)


def test_non_finite_values_reach_exactly_their_own_rows(rng):
    """The contract the kernels are held to (docs/DESIGN.md): a NaN or inf in a token that a
    row attends makes that row non-finite (rows of other KV heads, sequences and query
    tokens stay finite and unchanged); one in a token no row attends — past the length, outside
    the window, before a query token's causal limit — changes nothing."""
    q = rng.standard_normal((3, 2, 4, 8))           # 2 query tokens, 4 heads, 2 KV heads
    k, v = rng.standard_normal((3, 30, 2, 8)), rng.standard_normal((3, 30, 2, 8))
    lens = [30, 20, 10]
    clean = R.decode_attention(q, k, v, lens, window_left=12)
    bad_k, bad_v = k.copy(), v.copy()
    bad_k[0, 25, 1] = np.nan        # sequence 0, KV head 1, attended by both query tokens
    bad_v[1, 19, 0] = np.inf        # sequence 1, KV head 0: only the last query token sees it
    bad_k[2, 15:, :] = np.nan       # past sequence 2's length
    bad_v[0, 3, :] = np.nan         # outside sequence 0's window (positions 28, 29 − 12)
    out, lse = R.decode_attention(q, bad_k, bad_v, lens, window_left=12)
    nan = ~np.isfinite(out).all(axis=-1) | ~np.isfinite(lse)
    expect = np.zeros_like(nan)
    expect[0, :, 2:] = True          # query heads 2, 3 of KV head 1, both query tokens
    expect[1, 1, :2] = True          # query heads 0, 1 of KV head 0, the second query token
    assert np.array_equal(nan, expect), np.argwhere(nan != expect)
    same = ~expect
    assert np.array_equal(out[same], clean[0][same]) and np.array_equal(lse[same], clean[1][same])


def test_merge_treats_pos_inf_as_empty_and_keeps_nan_in_its_row(rng, seed):
    """+inf LSE (some libraries' empty row) weighs like −inf; a NaN LSE or a NaN output of a
    live state makes its own row NaN and leaves every other row as it was."""
    ctx = context(seed)
    o = rng.standard_normal((4, 5, 8))
    lse = rng.uniform(-20, 20, (4, 5))
    want_o, want_lse = R.merge_states(o, lse)
    o2, lse2 = o.copy(), lse.copy()
    lse2[1, 0], o2[1, 0] = np.inf, np.nan         # row 0: state 1 empty (+inf)
    lse2[:, 1] = np.inf                           # row 1: every state empty
    lse2[2, 2] = np.nan                           # row 2: a NaN LSE
    o2[0, 3, 5] = np.nan                          # row 3: a NaN in a live state's output
    got_o, got_lse = R.merge_states(o2, lse2)
    keep = [i for i in range(4) if i != 1]
    ref0_o, ref0_lse = R.merge_states(o[keep, :1], lse[keep, :1])
    np.testing.assert_allclose(got_o[0], ref0_o[0], rtol=1e-12, err_msg=ctx)
    assert math.isclose(got_lse[0], ref0_lse[0], rel_tol=1e-14), ctx
    assert np.all(got_o[1] == 0) and np.isneginf(got_lse[1]), ctx
    assert np.all(np.isnan(got_o[2])) and np.isnan(got_lse[2]), ctx
    assert np.isnan(got_o[3, 5]), ctx
    np.testing.assert_array_equal(got_o[4], want_o[4], err_msg=ctx)
    assert got_lse[4] == want_lse[4], ctx


# ---------------------------------------------------------------- fp8 KV caches (kv_dtype)

def _direct_values(codes, kv_dtype, scale):
    """Each code's value times its scale, element by element from the format's definition
    (sign, exponent, mantissa), not through the reference's table."""
    ebits, mbits, bias = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}[kv_dtype]
    flat = np.asarray(codes, np.uint8).reshape(-1)
    vals = np.empty(flat.size)
    for i, c in enumerate(flat):
        c = int(c)
        sign = -1.0 if c >> 7 else 1.0
        e, m = (c >> mbits) & ((1 << ebits) - 1), c & ((1 << mbits) - 1)
        if kv_dtype == "e4m3" and e == 15 and m == 7:
            vals[i] = math.nan
        elif kv_dtype == "e5m2" and e == 31:
            vals[i] = math.nan if m else sign * math.inf
        elif e == 0:
            vals[i] = sign * m * 2.0 ** (1 - bias - mbits)
        else:
            vals[i] = sign * (1 + m / 2 ** mbits) * 2.0 ** (e - bias)
    s = np.asarray(scale, np.float64)
    return vals.reshape(np.shape(codes)) * (s[..., None] if s.ndim else s)


@pytest.mark.parametrize("kv_dtype, top", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_fp8_codes_are_the_formats_values(kv_dtype, top):
    codes = np.arange(256, dtype=np.uint8)
    got, want = R.fp8_values(kv_dtype), _direct_values(codes, kv_dtype, 1.0)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])
    assert np.nanmax(got[np.isfinite(got)]) == top


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2"])
def test_quantize_rounds_to_the_nearest_code_and_saturates(rng, seed, kv_dtype):
    """Every code is the nearest representable value of x / scale (ties aside), finite values
    beyond the range and infinities saturate, NaN stays NaN; the computed per-(token, head)
    scale maps each row's largest |x| to the largest finite code."""
    top = R.FP8_FORMATS[kv_dtype][1]
    x = (rng.standard_normal((3, 5, 2, 16)) * rng.uniform(0.01, 50, (3, 5, 2, 1))).astype(np.float32)
    x[0, 0, 0, :3] = [np.inf, -np.inf, np.nan]
    x[0, 0, 1, 0] = 1e30
    values = R.fp8_values(kv_dtype)
    finite = np.sort(values[np.isfinite(values)])
    for scale in (0.05, np.float32([0.02, 0.3]), None):
        codes, got_scale = R.quantize_kv(x, kv_dtype, scale)
        s = np.float32(scale) if scale is None or np.ndim(scale) == 0 else np.float32(scale)
        s = got_scale if scale is None else s
        y = (x / (s[..., None] if np.ndim(s) else s)).astype(np.float64)
        got = values[codes]
        assert np.isnan(got[0, 0, 0, 2]), (seed, kv_dtype)
        live = np.isfinite(y)
        clipped = np.clip(y, -top, top)
        # the nearest finite value to each clipped x / scale
        idx = np.clip(np.searchsorted(finite, clipped), 1, finite.size - 1)
        lo, hi = finite[idx - 1], finite[idx]
        best = np.minimum(np.abs(clipped - lo), np.abs(clipped - hi))
        assert np.all(np.abs(got[live] - clipped[live]) <= best[live] * (1 + 1e-12)), (seed, scale)
        assert got[0, 0, 0, 0] == top and got[0, 0, 0, 1] == -top, (seed, scale)
        if scale is None:
            assert got_scale.dtype == np.float32 and got_scale.shape == x.shape[:-1]
            rows = np.isfinite(x).all(axis=-1)
            peak = np.abs(got).max(axis=-1)
            assert np.all(peak[rows] == top), seed


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "head", "token"])
def test_fp8_attention_is_attention_on_the_dequantised_cache(rng, seed, kv_dtype, granularity):
    """decode_attention with kv_dtype equals the direct softmax over code · scale computed from
    the format's definition; a reference that ignored the scales (or used another head's or
    token's) would differ."""
    batch, seqlen, heads, kv_heads, dim = 2, 23, 4, 2, 8
    q = randn(rng, (batch, heads, dim), "float16")
    codes_k = rng.integers(0, 256, (batch, seqlen, kv_heads, dim)).astype(np.uint8)
    codes_v = rng.integers(0, 256, (batch, seqlen, kv_heads, dim)).astype(np.uint8)
    for codes in (codes_k, codes_v):  # no NaN or infinite codes (their rows are tested apart)
        codes[~np.isfinite(R.fp8_values(kv_dtype)[codes])] = 0x38
    shape = {"tensor": (), "head": (kv_heads,), "token": (batch, seqlen, kv_heads)}[granularity]
    k_scale = rng.uniform(0.001, 0.01, shape).astype(np.float32)
    v_scale = rng.uniform(0.5, 2.0, shape).astype(np.float32)
    if granularity == "tensor":
        k_scale, v_scale = float(k_scale), float(v_scale)
    lens = [seqlen, 9]
    kd = _direct_values(codes_k, kv_dtype, k_scale)
    vd = _direct_values(codes_v, kv_dtype, v_scale)
    scale = dim ** -0.5
    want_out, want_lse = direct_attention(q, kd, vd, lens, scale)
    out, lse = R.decode_attention(q, codes_k, codes_v, lens, kv_dtype=kv_dtype,
                                  k_scale=k_scale, v_scale=v_scale)
    ctx = context(seed, kv_dtype=kv_dtype, granularity=granularity)
    assert np.allclose(out, want_out, rtol=1e-10, atol=1e-12), ctx
    assert np.allclose(lse, want_lse, rtol=1e-10, atol=1e-12), ctx
    unscaled, _ = R.decode_attention(q, codes_k, codes_v, lens, kv_dtype=kv_dtype,
                                     k_scale=1.0, v_scale=1.0)
    assert R.relative_error(unscaled, want_out) > 1e-2, ctx
    if granularity != "tensor":  # another head's (or token's) scales give other outputs
        flip = np.flip(np.asarray(v_scale), axis=-1)
        other, _ = R.decode_attention(q, codes_k, codes_v, lens, kv_dtype=kv_dtype,
                                      k_scale=k_scale, v_scale=flip)
        assert R.relative_error(other, want_out) > 1e-3, ctx
    # ml_dtypes float8 arrays are their codes
    import ml_dtypes

    fp8 = getattr(ml_dtypes, R.FP8_FORMATS[kv_dtype][0])
    out2, _ = R.decode_attention(q, codes_k.view(fp8), codes_v.view(fp8), lens,
                                 kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
    assert np.array_equal(out2, out), ctx


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_append_quantises_the_new_tokens(rng, seed, per_token, paged):
    """append_kv with kv_dtype writes quantize_kv's codes of the new tokens (and, per token,
    their computed scales) at their slots, through the table when paged; nothing else changes;
    decode_attention with k_new attends the appended cache."""
    batch, cap, kv_heads, dim, q_len, page = 3, 20, 2, 8, 3, 4
    k = rng.integers(0, 0x70, (batch, cap, kv_heads, dim)).astype(np.uint8)
    v = rng.integers(0, 0x70, (batch, cap, kv_heads, dim)).astype(np.uint8)
    sk = (rng.uniform(0.01, 0.1, (batch, cap, kv_heads)) if per_token
          else rng.uniform(0.01, 0.1, (kv_heads,))).astype(np.float32)
    sv = (rng.uniform(0.01, 0.1, (batch, cap, kv_heads)) if per_token
          else rng.uniform(0.01, 0.1, (kv_heads,))).astype(np.float32)
    k_new = randn(rng, (batch, q_len, kv_heads, dim), "float16")
    v_new = randn(rng, (batch, q_len, kv_heads, dim), "float16")
    lens = [5, cap - 1, 0]
    table = None
    if paged:  # pages of `page` tokens in a random order; scales paged alike
        per_seq = cap // page
        table = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)

        def pages_of(x):
            out = np.zeros((batch * per_seq, page) + x.shape[2:], x.dtype)
            for b in range(batch):
                for j in range(per_seq):
                    out[table[b, j]] = x[b, j * page:(j + 1) * page]
            return out
        k, v = pages_of(k), pages_of(v)
        if per_token:
            sk, sv = pages_of(sk), pages_of(sv)
    k2, v2, lens2, sk2, sv2 = R.append_kv(k, v, lens, k_new, v_new, table, kv_dtype="e4m3",
                                          k_scale=sk, v_scale=sv)
    ck, tk = R.quantize_kv(k_new, "e4m3", None if per_token else sk)
    cv, tv = R.quantize_kv(v_new, "e4m3", None if per_token else sv)
    ctx = context(seed, per_token=per_token, paged=paged)
    assert list(lens2) == [5 + q_len, cap, q_len], ctx
    written = np.zeros(k.shape[:2], bool)
    for b in range(batch):
        for i in range(q_len):
            t = lens[b] + i
            if t >= cap:
                continue
            slot = (b, t) if table is None else (table[b, t // page], t % page)
            written[slot] = True
            assert np.array_equal(k2[slot], ck[b, i]) and np.array_equal(v2[slot], cv[b, i]), ctx
            if per_token:
                assert np.array_equal(sk2[slot], tk[b, i]) and np.array_equal(sv2[slot], tv[b, i])
    assert np.array_equal(k2[~written], k[~written]) and np.array_equal(v2[~written], v[~written])
    if per_token:
        assert np.array_equal(sk2[~written], sk[~written]), ctx
    else:
        assert np.array_equal(sk2, sk) and np.array_equal(sv2, sv), ctx
    q = randn(rng, (batch, q_len, 4, dim), "float16")
    got = R.decode_attention(q, k, v, lens, block_table=table, k_new=k_new, v_new=v_new,
                             kv_dtype="e4m3", k_scale=sk, v_scale=sv)
    want = R.decode_attention(q, k2, v2, lens2, block_table=table, kv_dtype="e4m3",
                              k_scale=sk2, v_scale=sv2)
    assert np.array_equal(got[0], want[0]), ctx


@pytest.mark.parametrize("call, match", [
    (lambda c, s: R.fp8_values("e3m4"), r"kv_dtype: expected one of 'e4m3', 'e5m2', got 'e3m4'"),
    (lambda c, s: R.dequantize_kv(c, "e4m3", np.ones(3, np.float32)),
     r"scale: expected a float, shape \(2,\) or \(2, 5, 2\), got shape \(3,\)"),
    (lambda c, s: R.decode_attention(np.zeros((2, 4, 8)), c, c, kv_dtype="e4m3", k_scale=s),
     r"v_scale: expected a scale with kv_dtype"),
    (lambda c, s: R.decode_attention(np.zeros((2, 4, 8)), c.astype(np.float16), c,
                                     kv_dtype="e4m3", k_scale=s, v_scale=s),
     r"fp8 cache: expected uint8 codes"),
])
def test_fp8_reference_refuses_what_it_cannot_read(call, match):
    codes = np.zeros((2, 5, 2, 8), np.uint8)
    with pytest.raises((ValueError, TypeError), match=match):
        call(codes, 0.5)
