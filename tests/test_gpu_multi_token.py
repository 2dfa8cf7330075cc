"""Several query tokens per sequence (q_len > 1: verifying draft tokens) on the GPU, against the
float64 reference.

Query token t of a sequence of L cached tokens sits at position L − q_len + t and attends the
keys up to it: the tokens after it are in the cache (the later draft tokens) and must not count.
The cache is NaN past each length, outputs are NaN-poisoned, and lengths include one shorter
than q_len (its first query rows attend nothing: out 0, lse −inf) and an empty sequence.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from cupydecode.workloads import alibi_slopes, sink_logits
from helpers import (DTYPES, LSE_TOL, OUT_TOL, assert_lse_close, assert_out_close, context,
                     nan_tail, randn, to_device, to_paged)

pytestmark = pytest.mark.gpu

# (num_heads, num_kv_heads, head_dim): heads as N (G 4: q_len 2 fills its 8 columns), the
# 16-row path (G 16), M-tiles (MQA 48), MHA, head_dim 256 and 80
LAYOUTS = [(32, 8, 128), (32, 2, 128), (48, 1, 128), (16, 16, 64), (16, 8, 256), (32, 32, 80)]
MODES = [{"num_splits": 1}, {"num_splits": 3, "merge": "fused"},
         {"num_splits": 3, "merge": "kernel"}, {}]
LENGTHS = [1500, 3, 0, 777]


class MultiCase:
    """Fresh inputs for q_len query tokens per sequence, the reference, poisoned outputs."""

    def __init__(self, rng, seed, layout, q_len, dtype, lengths=LENGTHS, max_seqlen=1500,
                 **options):
        import cupy

        heads, kv_heads, dim = layout
        batch = len(lengths)
        self.dtype, self.q_len, self.lengths, self.options = dtype, q_len, list(lengths), options
        self.shape = (batch, heads, kv_heads, dim, max_seqlen)
        q = randn(rng, (batch, q_len, heads, dim), dtype)
        k = nan_tail(randn(rng, (batch, max_seqlen, kv_heads, dim), dtype), lengths)
        v = nan_tail(randn(rng, (batch, max_seqlen, kv_heads, dim), dtype), lengths)
        self.host = q, k, v
        self.ref = R.decode_attention(q, k, v, self.lengths, **self._host_options())
        self.q, self.k, self.v = to_device(q), to_device(k), to_device(v)
        self.seqlens = cupy.asarray(np.asarray(lengths, np.int32))
        self.ctx = context(seed, dtype=dtype, layout=layout, q_len=q_len, lens=lengths,
                           **{k: v for k, v in options.items() if k in ("window_left",
                                                                        "logits_soft_cap")})

    def _host_options(self) -> dict:
        return {k: (v.get() if hasattr(v, "get") else v) for k, v in self.options.items()}

    def poisoned(self):
        import cupy

        return (cupy.full(self.q.shape, np.nan, self.q.dtype),
                cupy.full(self.q.shape[:3], np.nan, cupy.float32))

    def check(self, got, what=""):
        import cupy

        out, lse = got
        ctx = f"{what} {self.ctx}"
        assert out.shape == self.q.shape and lse.shape == self.q.shape[:3], (out.shape, ctx)
        assert_out_close(out, self.ref[0], OUT_TOL[self.dtype], ctx)
        assert_lse_close(lse, self.ref[1], LSE_TOL[self.dtype], ctx)
        for b, n in enumerate(self.lengths):  # rows before the sequence's start attend nothing
            for t in range(max(0, self.q_len - n)):
                assert not cupy.any(out[b, t]), (b, t, ctx)
                if self.options.get("sinks") is None:
                    assert bool(cupy.all(cupy.isneginf(lse[b, t]))), (b, t, ctx)

    def plan(self, **kw):
        plan_opts = {k: v for k, v in self.options.items() if k in ("logits_soft_cap",
                                                                     "window_left")}
        if "alibi_slopes" in self.options:
            plan_opts["alibi"] = True
        return cupydecode.DecodePlan(*self.shape, self.dtype, q_len=self.q_len, **plan_opts, **kw)

    def run(self, plan, **kw):
        out, lse = self.poisoned()
        run_opts = {k: v for k, v in self.options.items() if k in ("alibi_slopes", "sinks")}
        return plan.run(self.q, self.k, self.v, self.seqlens, out=out, lse=lse, **run_opts, **kw)

    def flash_decode(self, **kw):
        out, _ = self.poisoned()
        return cupydecode.flash_decode(self.q, self.k, self.v, self.seqlens, out=out,
                                       return_lse=True, **self.options, **kw)


@pytest.mark.parametrize("q_len", [2, 4, 7, 16])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "{}-{}-{}".format(*x))
@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_token_matches_reference(cupy, rng, seed, dtype, layout, q_len):
    """Every merge mode and the automatic plan, flash_decode; each query token causal to its
    own position; a sequence shorter than q_len and an empty one."""
    case = MultiCase(rng, seed, layout, q_len, dtype)
    for mode in MODES:
        plan = case.plan(**mode)
        assert plan.q_len == q_len and plan.kv_per_block == 1, plan
        case.check(case.run(plan), f"{mode} merge={plan.merge}")
    case.check(case.flash_decode(), "flash_decode")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_multi_token_with_window_alibi_sinks_and_soft_cap(cupy, rng, seed, dtype):
    """Each query row's own window (the last W + 1 keys up to its position), ALiBi from its
    position, sinks and the soft-cap, alone and together, through the plans and flash_decode."""
    heads = 32
    slopes = cupy.asarray(alibi_slopes(heads))
    sinks = cupy.asarray(sink_logits(heads, seed))
    for options in ({"window_left": 100}, {"alibi_slopes": slopes}, {"sinks": sinks},
                    {"logits_soft_cap": 30.0},
                    {"window_left": 37, "alibi_slopes": slopes, "sinks": sinks,
                     "logits_soft_cap": 30.0}):
        case = MultiCase(rng, seed, (heads, 8, 128), 5, dtype, lengths=[1500, 4, 0, 120],
                         **options)
        for mode in MODES:
            case.check(case.run(case.plan(**mode)), f"{mode} {sorted(options)}")
        case.check(case.flash_decode(), f"flash_decode {sorted(options)}")
        case.check(case.flash_decode(num_splits=4), f"flash_decode splits=4 {sorted(options)}")


@pytest.mark.parametrize("page_size", [1, 16, 100])
def test_multi_token_on_paged_caches(cupy, rng, seed, page_size):
    """Pages in random order (NaN in unused pages and rows), through DecodePlan and flash_decode."""
    case = MultiCase(rng, seed, (32, 8, 128), 4, "float16", lengths=[1000, 2, 0, 513],
                     max_seqlen=1000)
    kp, vp, table = to_paged(rng, case.host[1], case.host[2], page_size)
    k, v, t = to_device(kp), to_device(vp), cupy.asarray(table)
    for mode in MODES:
        plan = cupydecode.DecodePlan(*case.shape, "float16", q_len=4, page_size=page_size, **mode)
        out, lse = case.poisoned()
        case.check(plan.run(case.q, k, v, case.seqlens, out=out, lse=lse, block_table=t),
                   f"paged {page_size} {mode}")
    out, _ = case.poisoned()
    case.check(cupydecode.flash_decode(case.q, k, v, case.seqlens, block_table=t, out=out,
                                       return_lse=True), f"flash_decode paged {page_size}")


def test_multi_token_plan_in_a_graph_with_lengths_changed_in_place(cupy, rng, seed):
    """A plan captured once; lengths grown in place between replays (the accepted drafts):
    every replay against the reference at its lengths."""
    case = MultiCase(rng, seed, (32, 8, 128), 4, "float16", lengths=[3000, 900, 10],
                     max_seqlen=4096)
    q, k, v = case.host
    k = randn(rng, k.shape, "float16")
    v = randn(rng, v.shape, "float16")
    dk, dv = to_device(k), to_device(v)
    plan = case.plan()
    out, lse = case.poisoned()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(case.q, dk, dv, case.seqlens, out=out, lse=lse)  # compile, outside
        stream.synchronize()
        stream.begin_capture()
        plan.run(case.q, dk, dv, case.seqlens, out=out, lse=lse)
        graph = stream.end_capture()
    for lens in ([3000, 900, 10], [3004, 904, 14], [4096, 4, 4]):
        with stream:  # (the replay's stream does not wait for the legacy default stream)
            case.seqlens[...] = cupy.asarray(np.asarray(lens, np.int32))
            out.fill(np.nan)
            graph.launch(stream)
        stream.synchronize()
        ref = R.decode_attention(q, k, v, lens)
        ctx = context(seed, lens=lens)
        assert_out_close(out, ref[0], OUT_TOL["float16"], ctx)
        assert_lse_close(lse, ref[1], LSE_TOL["float16"], ctx)


def test_one_token_in_four_dimensions_is_the_one_token_call(cupy, rng, seed):
    """q (batch, 1, num_heads, head_dim) gives (batch, 1, ...) outputs equal to the
    3-dimensional call's."""
    q = to_device(randn(rng, (3, 1, 32, 128), "float16"))
    k = to_device(randn(rng, (3, 500, 8, 128), "float16"))
    lens = cupy.asarray(np.asarray([500, 17, 0], np.int32))
    out4, lse4 = cupydecode.flash_decode(q, k, k, lens, return_lse=True)
    out3, lse3 = cupydecode.flash_decode(q[:, 0], k, k, lens, return_lse=True)
    assert out4.shape == (3, 1, 32, 128) and lse4.shape == (3, 1, 32)
    assert bool(cupy.all(out4[:, 0] == out3)) and bool(cupy.all(
        (lse4[:, 0] == lse3) | (cupy.isneginf(lse4[:, 0]) & cupy.isneginf(lse3))))


def test_multi_token_bad_inputs_are_refused(cupy):
    q = cupy.zeros((2, 4, 8, 64), cupy.float16)
    k = cupy.zeros((2, 64, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match=r"q: expected q_len.*\[1, 64\].*65"):
        cupydecode.flash_decode(cupy.zeros((2, 65, 8, 64), cupy.float16), k, k)
    with pytest.raises(ValueError, match=r"q: expected a 3-D .* or 4-D \(batch, q_len, num_heads, "
                                         r"head_dim\) array, got 5-D"):
        cupydecode.flash_decode(cupy.zeros((2, 1, 4, 8, 64), cupy.float16), k, k)
    with pytest.raises(ValueError, match=r"cache_seqlens: expected lengths >= q_len=4.*3"):
        cupydecode.flash_decode(q, k, k, [64, 3])
    with pytest.raises(ValueError, match=r"cache_seqlens: expected lengths >= q_len=4.*2"):
        cupydecode.flash_decode(q, k, k, 2)
    cupydecode.flash_decode(q, k, k, [64, 0])  # an empty slot (length 0) is accepted
    one_new = cupy.zeros((2, 1, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match=r"k_new: expected shape \(batch=2, q_len=4, "):
        cupydecode.flash_decode(q, k, k, [10, 10], k_new=one_new, v_new=one_new)
    q17, new17 = cupy.zeros((2, 17, 8, 64), cupy.float16), cupy.zeros((2, 17, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match=r"k_new: expected None with q_len=17.*at most 16"):
        cupydecode.flash_decode(q17, k, k, [10, 10], k_new=new17, v_new=new17)
    plan = cupydecode.DecodePlan(2, 8, 2, 64, 64, "float16", q_len=4)
    with pytest.raises(ValueError, match=r"q/k_cache/v_cache: expected the plan's shape"):
        plan.run(cupy.zeros((2, 8, 64), cupy.float16), k, k)  # one token for a plan of 4
    with pytest.raises(ValueError, match=r"q_len: expected .*\[1, 64\]"):
        cupydecode.DecodePlan(2, 8, 2, 64, 64, "float16", q_len=0)
    with pytest.raises(ValueError, match=r"cache_seqlens: expected lengths >= q_len=4.*2"):
        plan.run(q, k, k, 2)
    one = cupydecode.DecodePlan(2, 8, 2, 64, 64, "float16")
    with pytest.raises(ValueError, match=r"q: expected \(batch, num_heads, head_dim\) for a plan"):
        one.run(q[:, :1], k, k)  # four dimensions for a plan of one token
    out, lse = plan.run(q, k, k, cupy.asarray([64, 10], cupy.int32))  # still usable
    assert out.shape == (2, 4, 8, 64) and lse.shape == (2, 4, 8)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_each_query_token_equals_the_one_token_call_at_its_length(cupy, rng, seed, dtype):
    """Independent of the reference: token t of a q_len call equals the one-token call on the
    same cache with the length cut to its position + 1 (what a token-by-token decode computes),
    to the tolerance of the two plans' different split counts."""
    q_len, lens = 6, [2000, 700, 6]
    q = to_device(randn(rng, (3, q_len, 32, 128), dtype))
    k = to_device(randn(rng, (3, 2000, 8, 128), dtype))
    v = to_device(randn(rng, (3, 2000, 8, 128), dtype))
    out, lse = cupydecode.flash_decode(q, k, v, cupy.asarray(np.asarray(lens, np.int32)),
                                       return_lse=True)
    for t in range(q_len):
        cut = cupy.asarray(np.asarray([n - q_len + t + 1 for n in lens], np.int32))
        o1, l1 = cupydecode.flash_decode(q[:, t], k, v, cut, return_lse=True)
        ctx = context(seed, dtype=dtype, t=t)
        assert_out_close(out[:, t], o1, OUT_TOL[dtype], ctx)
        assert_lse_close(lse[:, t], l1, LSE_TOL[dtype], ctx)


@pytest.mark.parametrize("page_size", [None, 16, 3])
@pytest.mark.parametrize("q_len", [2, 5, 16])
def test_multi_token_append(cupy, rng, seed, q_len, page_size):
    """k_new, v_new of q_len tokens: written into the cache at cache_seqlens[b] … + q_len − 1
    (through the block table when paged; nothing at or past the capacity) and attended, each
    query token causal to its own new position; the rest of the cache unchanged, bit for bit.
    Lengths: one that fills the capacity exactly, one that runs past it, an empty one; tokens
    across a chunk boundary (forced splits) and page boundaries."""
    heads, kv_heads, dim, cap = 32, 8, 128, 600
    lens = [250, cap - q_len, cap - 1, 0]
    q = randn(rng, (4, q_len, heads, dim), "float16")
    k = nan_tail(randn(rng, (4, cap, kv_heads, dim), "float16"), lens)
    v = nan_tail(randn(rng, (4, cap, kv_heads, dim), "float16"), lens)
    k_new = randn(rng, (4, q_len, kv_heads, dim), "float16")
    v_new = randn(rng, (4, q_len, kv_heads, dim), "float16")
    ref = R.decode_attention(q, k, v, lens, k_new=k_new, v_new=v_new)
    if page_size is None:
        caches, table, exp = (to_device(k), to_device(v)), None, R.append_kv(k, v, lens, k_new, v_new)
    else:
        kp, vp, tab = to_paged(rng, k, v, page_size)
        caches, table = (to_device(kp), to_device(vp)), cupy.asarray(tab)
        exp = R.append_kv(kp, vp, lens, k_new, v_new, tab, max_seqlen=cap)  # (pages: 608)
    ctx = context(seed, q_len=q_len, page_size=page_size, lens=lens)
    for mode in ({"num_splits": 1}, {"num_splits": 7, "merge": "fused"}, {}):
        kc, vc = caches[0].copy(), caches[1].copy()
        plan = cupydecode.DecodePlan(4, heads, kv_heads, dim, cap, "float16", q_len=q_len,
                                     page_size=page_size, **mode)
        out = cupy.full(q.shape, np.nan, cupy.float16)
        lse = cupy.full(q.shape[:3], np.nan, cupy.float32)
        plan.run(to_device(q), kc, vc, cupy.asarray(np.asarray(lens, np.int32)), out=out,
                 lse=lse, block_table=table, k_new=to_device(k_new), v_new=to_device(v_new))
        assert_out_close(out, ref[0], OUT_TOL["float16"], f"{mode} {ctx}")
        assert_lse_close(lse, ref[1], LSE_TOL["float16"], f"{mode} {ctx}")
        for got, want in ((kc, exp[0]), (vc, exp[1])):
            assert np.array_equal(got.get().view(np.uint16), want.view(np.uint16)), (mode, ctx)
