"""New tokens appended in the call (k_new, v_new) on the GPU: each sequence's new K/V rows are
written at position cache_seqlens[b] (through the block table when paged), then attended with
the rest, against reference.decode_attention(..., k_new=, v_new=) in float64.

The rows past each length are NaN (so the row a new token goes to is NaN until it is written),
paged caches sit among unused NaN pages, outputs are NaN-poisoned, and the whole cache after a
call is compared bit for bit with the cache before it with exactly the addressed rows replaced
(reference.append_kv): a row written in the wrong place, or not at all, fails the test.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import (DTYPES, LSE_TOL, OUT_TOL, assert_lse_close, assert_out_close, context,
                     decode_inputs, nan_tail, randn, to_device, to_paged)

pytestmark = pytest.mark.gpu

# (num_heads, num_kv_heads, head_dim): GQA 4 (heads as N), MQA with M-tiles (G 48), MQA with
# head_dim 64 (rows of 8 16-byte chunks in 16-bit types), GQA 4 at head_dim 256 (64 chunks in
# float32)
LAYOUTS = [(32, 8, 128), (48, 1, 128), (8, 1, 64), (16, 4, 256)]
PAGE_SIZES = (None, 1, 16, 100)
MAX_SEQLEN = 800  # a multiple of every page size: a plan's capacity is the table's
# full (nothing written), empty (written at 0), the last free slot, page boundaries of 16 and
# 100 (the new token in a page's last row, in a new page's first row), mid-page
LENGTHS = [800, 0, 799, 15, 16, 99, 100, 401]
MODES = [{"num_splits": 1}, {"num_splits": 3, "merge": "fused"},
         {"num_splits": 3, "merge": "kernel"}, {}, {"enable_pdl": True}]


def _bits(x) -> np.ndarray:
    """The bytes of a host or device array (NaN payloads included) in C order of its shape, as
    a host uint8 array."""
    if hasattr(x, "get"):
        import cupy

        return cupy.ascontiguousarray(x).view(np.uint8).get()
    return np.ascontiguousarray(x).view(np.uint8)


def assert_same_bits(got, expected, ctx: str, what: str) -> None:
    """Every byte of ``got`` (device) equals ``expected`` (host); else the first token rows
    (leading two axes: sequence and position, or page and row) that differ."""
    g, e = _bits(got), _bits(expected)
    assert g.shape == e.shape, (g.shape, e.shape, ctx)
    rows = np.argwhere((g != e).reshape(g.shape[0], g.shape[1], -1).any(axis=-1))
    assert rows.size == 0, f"{what}: {len(rows)} token row(s) differ, first {rows[:5].tolist()} {ctx}"


class AppendCase:
    """Fresh inputs with a new token per sequence, the float64 reference, the expected cache
    after the append, and NaN-poisoned calls. ``lengths`` go to the device as given (they may be
    out of range: the kernels clamp them, as the reference does)."""

    def __init__(self, cupy, rng, seed, batch, num_heads, num_kv_heads, head_dim, max_seqlen,
                 dtype, lengths, page_size=None, new_dims=4, hnd=False, **options):
        self.dtype, self.page_size, self.options = dtype, page_size, options
        self.lengths = list(lengths)
        held = np.clip(np.asarray(lengths, np.int64), 0, max_seqlen)
        q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype)
        k, v = nan_tail(k, held), nan_tail(v, held)
        k_new = randn(rng, (batch, 1, num_kv_heads, head_dim), dtype)
        v_new = randn(rng, (batch, 1, num_kv_heads, head_dim), dtype)
        self.host = q, k, v, k_new, v_new
        self.ref_out, self.ref_lse = R.decode_attention(q, k, v, self.lengths, k_new=k_new,
                                                        v_new=v_new, **options)
        self.table = self.host_table = None
        cache = (k, v)
        if page_size:
            kp, vp, table = to_paged(rng, k, v, page_size)
            cache, self.host_table, self.table = (kp, vp), table, cupy.asarray(table)
        self.before = cache
        self.expected = R.append_kv(*cache, self.lengths, k_new, v_new, self.host_table)[:2]
        self.written = sum(0 <= n < max_seqlen for n in held)  # rows the append must write
        self.q = to_device(q)
        if hnd:  # pages stored (num_pages, kv_heads, page_size, dim), passed as transposed views
            self.k, self.v = (to_device(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))
                              .transpose(0, 2, 1, 3) for x in cache)
        else:
            self.k, self.v = to_device(cache[0]), to_device(cache[1])
        self.k_new, self.v_new = to_device(k_new), to_device(v_new)
        if new_dims == 3:
            self.k_new, self.v_new = self.k_new[:, 0], self.v_new[:, 0]
        self.seqlens = cupy.asarray(np.asarray(lengths, np.int64).astype(np.int32))
        self.shape = (batch, num_heads, num_kv_heads, head_dim, max_seqlen)
        self.ctx = context(seed, dtype=dtype, shape=self.shape, page_size=page_size, hnd=hnd,
                           lens=self.lengths[:8], new_dims=new_dims, **options)

    def reset(self) -> None:
        """The cache as it was before any append (so that every call has its rows to write)."""
        self.k[...] = to_device(self.before[0])
        self.v[...] = to_device(self.before[1])

    def poisoned(self, cupy):
        return (cupy.full(self.q.shape, np.nan, self.q.dtype),
                cupy.full(self.q.shape[:2], np.nan, cupy.float32))

    def flash_decode(self, cupy, lengths="device", **kw):
        """flash_decode with the append into a poisoned output; ``lengths``: the cache_seqlens
        argument ("device": the case's device array)."""
        self.reset()
        out, _ = self.poisoned(cupy)
        got, lse = cupydecode.flash_decode(
            self.q, self.k, self.v, self.seqlens if lengths == "device" else lengths, out=out,
            return_lse=True, block_table=self.table, k_new=self.k_new, v_new=self.v_new,
            **self.options, **kw)
        return got, lse

    def plan_run(self, cupy, plan):
        self.reset()
        out, lse = self.poisoned(cupy)
        plan.run(self.q, self.k, self.v, self.seqlens, out=out, lse=lse, block_table=self.table,
                 k_new=self.k_new, v_new=self.v_new)
        return out, lse

    def check(self, out, lse, what: str = "") -> None:
        """The output against the reference, and the whole cache against the expected one."""
        ctx = f"{what} {self.ctx}"
        assert_out_close(out, self.ref_out, OUT_TOL[self.dtype], ctx)
        assert_lse_close(lse, self.ref_lse, LSE_TOL[self.dtype], ctx)
        assert_same_bits(self.k, self.expected[0], ctx, "k_cache")
        assert_same_bits(self.v, self.expected[1], ctx, "v_cache")


def _written_rows(before, after) -> int:
    diff = _bits(before) != _bits(after)
    return int(diff.reshape(diff.shape[0], diff.shape[1], -1).any(axis=-1).sum())


@pytest.mark.parametrize("page_size", PAGE_SIZES, ids=lambda p: f"page{p}" if p else "contiguous")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "{}-{}-{}".format(*x))
@pytest.mark.parametrize("dtype", DTYPES)
def test_append_matches_reference(cupy, rng, seed, dtype, layout, page_size):
    """flash_decode and DecodePlan in every merge mode (and with enable_pdl): the output over
    the grown sequences, and exactly the addressed rows written."""
    case = AppendCase(cupy, rng, seed, len(LENGTHS), *layout, MAX_SEQLEN, dtype, LENGTHS,
                      page_size)
    # the expected cache differs from the one before in one row per sequence with room
    assert _written_rows(case.before[0], case.expected[0]) == case.written == len(LENGTHS) - 1
    case.check(*case.flash_decode(cupy), "flash_decode")
    for mode in MODES:
        plan = cupydecode.DecodePlan(*case.shape, dtype, page_size=page_size, **mode)
        case.check(*case.plan_run(cupy, plan), f"{mode} merge={plan.merge}")


@pytest.mark.parametrize("page_size", [16, 3])
def test_paged_append_with_mtile_blocks(cupy, rng, seed, page_size):
    """Blocks of several M-tiles (falcon-7b's 71 query heads on one KV head of head_dim 64: 3
    rings × 6 stages), paged, with the append: their page masks take a number of words that is
    not a multiple of 4, after which the new rows' 16-byte vectors must still be aligned.
    max_seqlen 816 is a multiple of both page sizes, so that flash_decode's capacity (the
    table's: whole pages) and the plan's (max_seqlen) are the reference's."""
    max_seqlen = 816
    lengths = [max_seqlen, 0, max_seqlen - 1, 15, 16, 99]
    case = AppendCase(cupy, rng, seed, len(lengths), 71, 1, 64, max_seqlen, "float16", lengths,
                      page_size)
    case.check(*case.flash_decode(cupy), "flash_decode")
    # one split streams all 816 tokens: long enough a chunk for the M-tile shape
    plan = cupydecode.DecodePlan(*case.shape, "float16", page_size=page_size, num_splits=1)
    cfg = plan.config
    assert cfg.m_tiles > 1 and cfg.rings * cfg.stages % 4, cfg  # (the shape this test is about)
    case.check(*case.plan_run(cupy, plan), f"m_tiles={cfg.m_tiles}")


@pytest.mark.parametrize("page_size", [None, 16])
def test_host_lengths_and_new_token_forms(cupy, rng, seed, page_size):
    """Host lengths (a list, copied; an int, every sequence alike), k_new/v_new of 3 dims and as
    strided views (every other KV head of a wider array): the same rows and outputs."""
    lens = [319, 0, 17, 318]  # (host lengths must leave room for the new token)
    case = AppendCase(cupy, rng, seed, 4, 32, 8, 128, 320, "float16", lens, page_size,
                      new_dims=3)
    case.check(*case.flash_decode(cupy, lengths=list(lens)), "host list, 3-dim k_new")
    wide_k = cupy.full((4, 1, 16, 128), np.nan, cupy.float16)
    wide_v = cupy.full((4, 1, 16, 128), np.nan, cupy.float16)
    wide_k[:, :, ::2] = case.k_new[:, None]
    wide_v[:, :, ::2] = case.v_new[:, None]
    case.k_new, case.v_new = wide_k[:, :, ::2], wide_v[:, :, ::2]
    case.check(*case.flash_decode(cupy), "strided 4-dim k_new")
    same = AppendCase(cupy, rng, seed, 3, 32, 8, 128, 320, "bfloat16", [37] * 3, page_size)
    same.check(*same.flash_decode(cupy, lengths=37), "int length")


def test_full_sequences_write_nothing(cupy, rng, seed):
    """Device lengths at the capacity (never read on the host): nothing is written, every
    sequence attends max_seqlen tokens. Host-given ones (cache_seqlens=None: every sequence
    full; an int; a list) that leave no room for the new token are refused before any launch."""
    case = AppendCase(cupy, rng, seed, 3, 16, 4, 128, 256, "float16", [256] * 3)
    assert case.written == 0
    case.check(*case.flash_decode(cupy), "device lengths")
    assert_same_bits(case.k, case.before[0], case.ctx, "k_cache unchanged")
    plan = cupydecode.DecodePlan(*case.shape, "float16")
    for given in (None, 256, [255, 256, 0]):
        with pytest.raises(ValueError, match=r"^cache_seqlens: expected lengths <= max_seqlen - 1"):
            case.flash_decode(cupy, lengths=given)
        if not isinstance(given, list):  # (a plan takes no host arrays)
            with pytest.raises(ValueError, match=r"^cache_seqlens: expected lengths <= max_seqlen"):
                plan.run(case.q, case.k, case.v, given, k_new=case.k_new, v_new=case.v_new)
    assert_same_bits(case.k, case.before[0], case.ctx, "k_cache unchanged")


@pytest.mark.parametrize("page_size", [None, 16])
def test_device_lengths_out_of_range_are_clamped(cupy, rng, seed, page_size):
    """Device lengths below 0 (the token goes to position 0, one token attended), and past the
    capacity (2³¹ − 1, capacity + 5: nothing written, capacity attended): as the reference."""
    lens = [-3, 2**31 - 1, 512 + 5, 511, 512]
    case = AppendCase(cupy, rng, seed, len(lens), 32, 8, 128, 512, "bfloat16", lens, page_size)
    assert case.written == 2
    case.check(*case.flash_decode(cupy), "flash_decode")
    plan = cupydecode.DecodePlan(*case.shape, "bfloat16", page_size=page_size, num_splits=3)
    case.check(*case.plan_run(cupy, plan), "plan, 3 splits")


def test_capacity_is_whole_pages_for_flash_decode_and_max_seqlen_for_a_plan(cupy, rng, seed):
    """Pages of 3 over max_seqlen 800 (267 pages per sequence: 801 rows): flash_decode's capacity
    is the table's, so a sequence of 800 gets its new token at row 800 and attends 801 tokens;
    a DecodePlan of max_seqlen 800 writes nothing there and attends 800 (the plan's capacity).
    Both with one split and with several (the splits must reach the last row)."""
    lens = [800, 799, 0, 401]
    case = AppendCase(cupy, rng, seed, len(lens), 16, 4, 128, 800, "float16", lens, 3)
    kp, vp = case.before
    table = case.host_table
    assert table.shape[1] * 3 == 801
    q, _, _, k_new, v_new = case.host
    ref = {cap: R.attention_rows(q, *R.append_kv(kp, vp, lens, k_new, v_new, table,
                                                 max_seqlen=cap), block_table=table)
           for cap in (801, 800)}
    expected = {cap: R.append_kv(kp, vp, lens, k_new, v_new, table, max_seqlen=cap)[:2]
                for cap in (801, 800)}
    assert _written_rows(kp, expected[801][0]) == 4 and _written_rows(kp, expected[800][0]) == 3
    for splits in (1, 4, None):
        case.ref_out, case.ref_lse = (x.reshape(*x.shape[:1], -1, *x.shape[3:])
                                      for x in ref[801])
        case.expected = expected[801]
        case.check(*case.flash_decode(cupy, num_splits=splits), f"flash_decode splits={splits}")
        plan = cupydecode.DecodePlan(*case.shape, "float16", page_size=3, num_splits=splits)
        case.ref_out, case.ref_lse = (x.reshape(*x.shape[:1], -1, *x.shape[3:])
                                      for x in ref[800])
        case.expected = expected[800]
        case.check(*case.plan_run(cupy, plan), f"plan splits={plan.num_splits}")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_new_token_on_an_out_of_range_page_is_not_written(cupy, rng, seed, dtype):
    """The new token's page index −1, num_pages or 2³¹ − 1: nothing is written anywhere, and
    that page's tokens count for nothing (the reference on the same pages and table agrees)."""
    lens = [100, 37, 64, 500]
    case = AppendCase(cupy, rng, seed, 4, 16, 4, 128, 512, dtype, lens, 32)
    kp, vp = case.before
    table = case.host_table.copy()
    table[0, 100 // 32] = -1
    table[1, 37 // 32] = kp.shape[0]
    table[2, 64 // 32] = 2**31 - 1  # (the new token opens this page)
    q, _, _, k_new, v_new = case.host
    case.ref_out, case.ref_lse = R.decode_attention(q, kp, vp, lens, block_table=table,
                                                    k_new=k_new, v_new=v_new)
    case.expected = R.append_kv(kp, vp, lens, k_new, v_new, table)[:2]
    assert _written_rows(kp, case.expected[0]) == 1  # only sequence 3's
    case.table = cupy.asarray(table)
    for splits in (1, 3, None):
        case.check(*case.flash_decode(cupy, num_splits=splits), f"splits={splits}")


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("enable_pdl", [False, True])
def test_plan_in_a_graph_with_lengths_advanced_in_place(cupy, rng, seed, page_size, enable_pdl):
    """One capture of DecodePlan.run with the append; before each replay new q, k_new and v_new
    are written in place, and after it the lengths advance by one on the device (past the
    capacity too: clamped). Each replay matches the reference of the cache as it was, and
    writes exactly its rows."""
    M = 512
    lens = np.array([M - 2, 0, 100, M], np.int64)
    case = AppendCase(cupy, rng, seed, 4, 32, 8, 128, M, "float16", lens, page_size)
    plan = cupydecode.DecodePlan(*case.shape, "float16", page_size=page_size,
                                 enable_pdl=enable_pdl)
    out, lse = case.poisoned(cupy)
    stream = cupy.cuda.Stream(non_blocking=True)

    def run():
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse, block_table=case.table,
                 k_new=case.k_new, v_new=case.v_new)
    cupy.cuda.Device().synchronize()  # the case's data was made on the default stream
    with stream:
        run()  # the plan's first run outside the capture (its workspace is then ready)
        case.reset()  # (that run appended)
        stream.begin_capture()
        run()
        graph = stream.end_capture()
    rng2 = np.random.default_rng(seed + 1)
    for step in range(3):
        q = randn(rng2, case.q.shape, "float16")
        k_new = randn(rng2, case.k_new.shape, "float16")
        v_new = randn(rng2, case.v_new.shape, "float16")
        with stream:  # every update in stream order with the replays
            case.q[...], case.k_new[...], case.v_new[...] = (to_device(x) for x in (q, k_new,
                                                                                   v_new))
            k_before, v_before = case.k.get(), case.v.get()
            out.fill(np.nan)
            lse.fill(np.nan)
            graph.launch(stream)
            case.seqlens += 1  # the caller advances the lengths, on the device
        ref_out, ref_lse = R.decode_attention(q, k_before, v_before, lens,
                                              block_table=case.host_table, k_new=k_new,
                                              v_new=v_new)
        exp_k, exp_v, _ = R.append_kv(k_before, v_before, lens, k_new, v_new, case.host_table)
        stream.synchronize()
        ctx = f"replay {step} lens={lens.tolist()} {case.ctx}"
        assert_out_close(out, ref_out, OUT_TOL["float16"], ctx)
        assert_lse_close(lse, ref_lse, LSE_TOL["float16"], ctx)
        assert_same_bits(case.k, exp_k, ctx, "k_cache")
        assert_same_bits(case.v, exp_v, ctx, "v_cache")
        lens = lens + 1


@pytest.mark.parametrize("mode", ["relaxed", "global", "thread_local"])
def test_the_build_with_options_first_needed_inside_a_capture(cupy, rng, seed, tmp_path, mode):
    """A plan holds the split kernel built without runtime options; the first call with new
    tokens builds the one with them. That call may come inside a graph capture of any mode
    (torch captures in global mode, where a stray cudaFree invalidates the capture), and the
    build is then compiled, loaded and first launched there (kernels of a fresh folder: nothing
    of it was loaded before). Replayed, the graph appends and attends as the reference does."""
    from cupydecode import _kernels
    from cupydecode.decode import _split_function

    runtime = cupy.cuda.runtime
    capture_mode = {"relaxed": runtime.streamCaptureModeRelaxed,
                    "global": runtime.streamCaptureModeGlobal,
                    "thread_local": runtime.streamCaptureModeThreadLocal}[mode]

    text = (_kernels.kernel_dir() / "decode_split.cu").read_text()
    (tmp_path / "decode_split.cu").write_text(f"// {seed}\n" + text)  # a source of its own
    lens = np.array([510, 0, 100, 300], np.int64)
    case = AppendCase(cupy, rng, seed, 4, 32, 8, 128, 512, "float16", lens)
    out, lse = case.poisoned(cupy)
    stream = cupy.cuda.Stream(non_blocking=True)
    with _kernels.kernel_sources(tmp_path):
        plan = cupydecode.DecodePlan(*case.shape, "float16")
    assert [c.runtime_options for c in plan._launches] == [False], plan._launches
    cupy.cuda.Device().synchronize()
    with stream:
        stream.begin_capture(capture_mode)
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse, k_new=case.k_new,
                 v_new=case.v_new)
        graph = stream.end_capture()
    [built] = [c for c in plan._launches if c.runtime_options]
    with _kernels.kernel_sources(tmp_path):  # built from the sources the plan was built under
        assert plan._launches[built]._kernel is _split_function(built)
    graph.launch(stream)
    stream.synchronize()
    case.check(out, lse, "built inside the capture")


def test_append_with_the_soft_cap_and_hnd_pages(cupy, rng, seed):
    """The append with the soft-cap (contiguous and paged), and into HND pages (num_pages,
    kv_heads, page_size, dim) passed as transposed views; automatic and forced splits."""
    lens = [704, 0, 333, 703]
    for page_size, hnd in ((None, False), (64, False), (16, True), (1, True)):
        case = AppendCase(cupy, rng, seed, 4, 32, 8, 128, 704, "bfloat16", lens, page_size,
                          hnd=hnd, logits_soft_cap=5.0)
        for splits in (None, 1, 4):
            case.check(*case.flash_decode(cupy, num_splits=splits),
                       f"page_size={page_size} hnd={hnd} splits={splits}")


def test_reference_append_on_the_gpu_matches_numpy(cupy, rng):
    """reference.append_kv(..., xp=cupy) (what `cupydecode check` compares the cache with on
    the GPU) writes the same rows as on the host, contiguous and paged."""
    q, k, v = decode_inputs(rng, 3, 8, 2, 64, 48, "bfloat16")
    k_new = randn(rng, (3, 1, 2, 64), "bfloat16")
    v_new = randn(rng, (3, 1, 2, 64), "bfloat16")
    lens = [48, 0, 17]
    for kc, vc, table in ((k, v, None), to_paged(rng, k, v, 16)):
        want = R.append_kv(kc, vc, lens, k_new, v_new, table)
        got = R.append_kv(*(to_device(x) for x in (kc, vc)), lens, to_device(k_new),
                          to_device(v_new), table, xp=cupy)
        for g, w in zip(got[:2], want[:2]):
            assert np.array_equal(_bits(g), _bits(w))
        assert np.array_equal(got[2], want[2])

