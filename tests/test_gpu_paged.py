"""Paged KV caches on the GPU: (num_pages, page_size, num_kv_heads, head_dim) pools read through
a block table, against the float64 reference of the same tokens.

Pages are in random order among unused NaN pages, rows past each length are NaN, outputs are
NaN-poisoned: a wrong page, row or unwritten output fails the test.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import (DTYPES, LSE_TOL, OUT_TOL, assert_lse_close, assert_out_close, context,
                     decode_inputs, nan_tail, randn, to_device, to_paged)

pytestmark = pytest.mark.gpu

# page sizes: 1 (every row looked up), odd and prime, 16 (one tile per page), 17 (tiles across
# pages), 64 and 256 (several tiles per page)
PAGE_SIZES = (1, 3, 16, 17, 64, 256)
# (num_heads, num_kv_heads, head_dim): heads as N (G 4), 16 rows (G 16), M-tiles (MQA 48),
# head_dim 64 and 256
LAYOUTS = [(32, 8, 128), (32, 2, 128), (48, 1, 128), (12, 4, 64), (16, 8, 256)]
MODES = [{"num_splits": 1}, {"num_splits": 3, "merge": "fused"},
         {"num_splits": 3, "merge": "kernel"}, {}]


class PagedCase:
    """Fresh inputs, their paged form (page_size), the reference, NaN-poisoned calls."""

    def __init__(self, cupy, rng, seed, batch, num_heads, num_kv_heads, head_dim, max_seqlen,
                 dtype, lengths, page_size, hnd=False, **options):
        q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
        k, v = nan_tail(k, lengths), nan_tail(v, lengths)
        self.host = q, k, v
        self.lengths, self.dtype, self.options, self.page_size = lengths, dtype, options, page_size
        self.ref_out, self.ref_lse = R.decode_attention(q, k, v, lengths, **options)
        kp, vp, table = to_paged(rng, k, v, page_size)
        self.host_paged = kp, vp, table
        self.q = to_device(q)
        if hnd:  # pages stored (num_pages, kv_heads, page_size, dim), passed as a transposed view
            self.k = to_device(np.ascontiguousarray(kp.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
            self.v = to_device(np.ascontiguousarray(vp.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
        else:
            self.k, self.v = to_device(kp), to_device(vp)
        self.table = cupy.asarray(table)
        self.seqlens = cupy.asarray(np.asarray(lengths, np.int32))
        self.shape = (batch, num_heads, num_kv_heads, head_dim, max_seqlen)
        self.ctx = context(seed, dtype=dtype, shape=self.shape, page_size=page_size, hnd=hnd,
                           lens=lengths[:8], **options)

    def poisoned(self, cupy):
        return (cupy.full(self.q.shape, np.nan, self.q.dtype),
                cupy.full(self.q.shape[:2], np.nan, cupy.float32))

    def check(self, cupy, out, lse, what=""):
        ctx = f"{what} {self.ctx}"
        assert_out_close(out, self.ref_out, OUT_TOL[self.dtype], ctx)
        assert_lse_close(lse, self.ref_lse, LSE_TOL[self.dtype], ctx)
        for b, n in enumerate(self.lengths):
            if n == 0:
                assert not cupy.any(out[b]) and bool(cupy.all(cupy.isneginf(lse[b]))), ctx


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "{}-{}-{}".format(*x))
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_matches_reference(cupy, rng, seed, dtype, layout, page_size):
    """Every merge mode through DecodePlan and flash_decode; ragged lengths (full, 1, empty, a
    page boundary ± 1, mid-page)."""
    num_heads, num_kv_heads, head_dim = layout
    max_seqlen = 700
    lens = [700, 1, 0, 2 * page_size + 1 if 2 * page_size < 700 else 699, 333]
    case = PagedCase(cupy, rng, seed, len(lens), num_heads, num_kv_heads, head_dim, max_seqlen,
                     dtype, lens, page_size)
    for mode in MODES:
        plan = cupydecode.DecodePlan(*case.shape, dtype, page_size=page_size, **mode)
        assert plan.config.paged, plan
        out, lse = case.poisoned(cupy)
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse, block_table=case.table)
        case.check(cupy, out, lse, f"{mode} merge={plan.merge}")
    out, _ = case.poisoned(cupy)
    got, lse = cupydecode.flash_decode(case.q, case.k, case.v, case.seqlens, out=out,
                                       return_lse=True, block_table=case.table[:, :])
    case.check(cupy, got, lse, "flash_decode")


@pytest.mark.parametrize("page_size", (1, 16, 64))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_hnd_views_and_soft_cap(cupy, rng, seed, dtype, page_size):
    """Pages in the HND order (num_pages, kv_heads, page_size, dim) passed as a transposed
    view, with the soft-cap; automatic splits and forced ones."""
    lens = [2000, 1500, 0, 17]
    case = PagedCase(cupy, rng, seed, len(lens), 32, 8, 128, 2000, dtype, lens, page_size,
                     hnd=True, logits_soft_cap=1.5)
    for splits in (None, 1, 5):
        out, _ = case.poisoned(cupy)
        got, lse = cupydecode.flash_decode(case.q, case.k, case.v, case.seqlens, out=out,
                                           return_lse=True, block_table=case.table,
                                           num_splits=splits, logits_soft_cap=1.5)
        case.check(cupy, got, lse, f"splits={splits}")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_out_of_range_pages_count_for_nothing(cupy, rng, seed, dtype):
    """Page indices −1, num_pages and 2³¹ − 1 in the table: their tokens are left out (as the
    reference does), nothing is read there, every other token counts."""
    lens = [600, 600, 300]
    case = PagedCase(cupy, rng, seed, 3, 16, 4, 128, 600, dtype, lens, 64)
    kp, vp, table = case.host_paged
    table = table.copy()
    num_pages = kp.shape[0]
    table[0, 2] = -1
    table[1, 0] = num_pages
    table[1, 5] = 2**31 - 1
    table[2, 5] = -7  # tokens 320–383, past sequence 2's length of 300: never read (memcheck)
    ref_out, ref_lse = R.decode_attention(case.host[0], kp, vp, lens, block_table=table)
    dtable = cupy.asarray(table)
    for splits in (1, 3, None):
        out, _ = case.poisoned(cupy)
        got, lse = cupydecode.flash_decode(case.q, case.k, case.v, case.seqlens, out=out,
                                           return_lse=True, block_table=dtable, num_splits=splits)
        ctx = f"splits={splits} {case.ctx}"
        assert_out_close(got, ref_out, OUT_TOL[dtype], ctx)
        assert_lse_close(lse, ref_lse, LSE_TOL[dtype], ctx)
    # the reference agrees that those tokens are gone: sequence 0 differs from the full one
    assert R.relative_error(ref_out[0], case.ref_out[0]) > 10 * OUT_TOL[dtype]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_int64_block_tables(cupy, rng, seed, dtype):
    """An int64 block table (torch's default integer type) gives what its int32 copy gives, in
    flash_decode and a plan; int64 entries outside [0, num_pages) — 2³² + a valid page, −2³² —
    count for nothing (they must not wrap to a valid int32 page)."""
    lens = [600, 600, 300]
    case = PagedCase(cupy, rng, seed, 3, 32, 8, 128, 600, dtype, lens, 16)
    kp, vp, table = case.host_paged
    t64 = table.astype(np.int64)
    t64[0, 3] = 2**32 + int(table[0, 3])  # would wrap to a valid page in 32 bits
    t64[1, 10] = -(2**32)
    t32 = table.copy()
    t32[0, 3] = -1
    t32[1, 10] = -1
    ref_out, ref_lse = R.decode_attention(case.host[0], kp, vp, lens, block_table=t32)
    want = cupydecode.flash_decode(case.q, case.k, case.v, case.seqlens,
                                   block_table=cupy.asarray(t32), return_lse=True)
    out, _ = case.poisoned(cupy)
    got = cupydecode.flash_decode(case.q, case.k, case.v, case.seqlens, out=out,
                                  block_table=cupy.asarray(t64), return_lse=True)
    assert_out_close(got[0], ref_out, OUT_TOL[dtype], case.ctx)
    assert_lse_close(got[1], ref_lse, LSE_TOL[dtype], case.ctx)
    assert cupy.array_equal(got[0], want[0]) and cupy.array_equal(got[1], want[1]), case.ctx
    plan = cupydecode.DecodePlan(3, 32, 8, 128, 600, dtype, page_size=16)
    out, lse = plan.run(case.q, case.k, case.v, case.seqlens, block_table=cupy.asarray(t64))
    assert cupy.array_equal(out, want[0]) and cupy.array_equal(lse, want[1]), case.ctx


def test_paged_kv_groups(cupy, rng, seed, monkeypatch):
    """Blocks of several KV heads (forced) read pages alike (page sizes 16 and 5)."""
    from cupydecode import _policy

    monkeypatch.setattr(_policy, "kv_per_block", lambda *a, **k: _policy.KV_GROUP)
    for page_size in (16, 5):
        lens = [1024, 0, 333, 1000]
        case = PagedCase(cupy, rng, seed, 4, 32, 2 * _policy.KV_GROUP, 128, 1024, "float16", lens,
                         page_size)
        for mode in MODES[:3]:
            plan = cupydecode.DecodePlan(*case.shape, "float16", page_size=page_size, **mode)
            assert plan.kv_per_block == _policy.KV_GROUP, plan
            out, lse = case.poisoned(cupy)
            plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse,
                     block_table=case.table)
            case.check(cupy, out, lse, f"kv groups {mode} page_size={page_size}")


def test_paged_plan_in_a_graph_with_tables_changed_in_place(cupy, rng, seed):
    """One capture; between replays the block table and the lengths change in place (pages
    moved to other slots of the pool, sequences grown): each replay matches the reference."""
    page_size, max_seqlen = 16, 512
    lens = [512, 100, 0, 257]
    case = PagedCase(cupy, rng, seed, 4, 32, 8, 128, max_seqlen, "bfloat16", lens, page_size)
    plan = cupydecode.DecodePlan(*case.shape, "bfloat16", page_size=page_size)
    out, lse = case.poisoned(cupy)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse, block_table=case.table)
        stream.begin_capture()
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse, block_table=case.table)
        graph = stream.end_capture()
        out.fill(np.nan)
        lse.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    case.check(cupy, out, lse, "first replay")
    # new tokens everywhere, every page moved to another slot of the pool, sequences resized
    kp, vp, table = case.host_paged
    q, k, v = case.host
    new_lens = [500, 101, 16, 300]
    rng2 = np.random.default_rng(seed + 1)
    k2 = nan_tail(randn(rng2, k.shape, "bfloat16"), new_lens)
    v2 = nan_tail(randn(rng2, v.shape, "bfloat16"), new_lens)
    new_table = rng2.permutation(kp.shape[0])[table].astype(np.int32)
    kp, vp = np.full_like(kp, np.nan), np.full_like(vp, np.nan)
    for b in range(table.shape[0]):
        for j in range(table.shape[1]):
            rows = slice(j * page_size, (j + 1) * page_size)
            kp[new_table[b, j]] = k2[b, rows]
            vp[new_table[b, j]] = v2[b, rows]
    case.lengths = new_lens
    case.ref_out, case.ref_lse = R.decode_attention(q, k2, v2, new_lens)
    with stream:  # every update in stream order with the replay (a non-blocking stream)
        case.k[...] = to_device(kp)
        case.v[...] = to_device(vp)
        case.table[...] = cupy.asarray(new_table)
        case.seqlens[...] = cupy.asarray(np.asarray(new_lens, np.int32))
        out.fill(np.nan)
        lse.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    case.check(cupy, out, lse, "replay after the table, cache and lengths changed")


def test_paged_validation(cupy, rng):
    """Every bad paged input is refused before any launch, naming the argument."""
    q, k, v = (to_device(x) for x in decode_inputs(rng, 2, 8, 2, 64, 64, "float16"))
    kp, vp, table = (to_device(x) for x in to_paged(rng, *(x.get() for x in (k, v)), 16))
    f = cupydecode.flash_decode

    with pytest.raises(TypeError, match=r"^block_table: expected dtype int32 or int64, got uint32"):
        f(q, kp, vp, block_table=table.astype(cupy.uint32))
    with pytest.raises(ValueError, match=r"^block_table: expected shape \(2, max_pages_per_seq"):
        f(q, kp, vp, block_table=table[:1])
    with pytest.raises(ValueError, match=r"^block_table: expected rows contiguous"):
        f(q, kp, vp, block_table=cupy.asfortranarray(cupy.concatenate([table, table], 1)))
    with pytest.raises(ValueError, match=r"^block_table: expected page indices in \[0, num_pages"):
        f(q, kp, vp, block_table=[[0, 1, 2, 99], [4, 5, 6, 7]])  # host tables are range-checked
    with pytest.raises(ValueError, match=r"^k_cache: expected shape \(num_pages, page_size"):
        f(q, kp[..., :32], vp[..., :32], block_table=table)
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected lengths in \[0, max_seqlen=64\]"):
        f(q, kp, vp, [65, 1], block_table=table)
    # a host table that is in range works, and equals the device table's result
    a = f(q, kp, vp, [64, 30], block_table=table.get())
    b = f(q, kp, vp, [64, 30], block_table=table)
    assert bool(cupy.all(a == b))
    plan = cupydecode.DecodePlan(2, 8, 2, 64, 64, "float16", page_size=16)
    with pytest.raises(ValueError, match=r"^block_table: expected a \(batch, max_pages_per_seq\)"):
        plan.run(q, kp, vp)
    with pytest.raises(TypeError, match=r"^block_table: expected a \(2, max_pages_per_seq >= 4\)"):
        plan.run(q, kp, vp, block_table=table.get())
    with pytest.raises(ValueError, match=r"^block_table: expected shape \(2, max_pages_per_seq >= 4\)"):
        plan.run(q, kp, vp, block_table=table[:, :3])
    with pytest.raises(ValueError, match=r"^k_cache: expected pages of the plan's page_size 16"):
        plan.run(q, kp.reshape(-1, 8, 2, 64), vp.reshape(-1, 8, 2, 64), block_table=table)
    contiguous = cupydecode.DecodePlan(2, 8, 2, 64, 64, "float16")
    with pytest.raises(ValueError, match=r"^block_table: expected None \(the plan is for contiguous"):
        contiguous.run(q, k, v, block_table=table)
    with pytest.raises(ValueError, match=r"^page_size: expected an int in \[1, "):
        cupydecode.DecodePlan(2, 8, 2, 64, 64, "float16", page_size=0)
