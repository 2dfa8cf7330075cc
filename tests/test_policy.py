"""Launch policy (cupydecode._policy): pure functions of shapes and SM count, no GPU needed."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from cupydecode import _policy as P

SMEM_PER_BLOCK_MAX = 227 * 1024  # sm_80 / sm_90 opt-in limit per block
# the multiple-of-8 family of head_dims (the three narrower widths); 512 has tests of its own
RANGE_HEAD_DIMS = [d for d in P.SUPPORTED_HEAD_DIMS if d != P.WIDE_HEAD_DIM]


def test_worked_example_two_blocks_per_sm():
    # H200: 132 SMs, 2 blocks/SM; llama-3-8b at batch 1: 8 KV heads → 8 blocks.
    assert P.choose_num_splits(8, 16384, 132, 2) == (32, 512)
    # batch 64, 8192 tokens: 512 blocks already fill the machine, no split, no merge kernel.
    assert P.choose_num_splits(512, 8192, 132, 2) == (1, 8192)


def test_worked_example_of_the_docstring_one_block_per_sm():
    assert P.choose_num_splits(8, 16384, 132, 1) == (16, 1024)
    assert P.choose_num_splits(512, 8192, 132, 1) == (1, 8192)


WORK = [1, 2, 3, 8, 31, 64, 132, 264, 1000, 4096]
SEQ = [1, 2, 17, 63, 64, 65, 255, 256, 257, 1000, 4097, 16384, 65536, 131073, 1 << 20, 10_000_000]
MACHINES = [(108, 1), (132, 1), (132, 2), (16, 4)]


@pytest.mark.parametrize("num_sms,blocks_per_sm", MACHINES)
def test_splits_cover_the_sequence(num_sms, blocks_per_sm):
    for work, max_seqlen in itertools.product(WORK, SEQ):
        s, chunk = P.choose_num_splits(work, max_seqlen, num_sms, blocks_per_sm)
        case = dict(work=work, max_seqlen=max_seqlen, sms=num_sms, bps=blocks_per_sm, s=s, chunk=chunk)
        assert 1 <= s <= P.MAX_SPLITS, case
        assert chunk % P.SPLIT_GRANULE == 0, case
        assert s * chunk >= max_seqlen, case            # every token is in some split
        assert (s - 1) * chunk < max_seqlen, case       # no split is empty at full length
        if s > 1:
            assert chunk >= P.MIN_CHUNK, case


def test_more_work_never_needs_more_splits():
    for max_seqlen in (4096, 65536):
        prev = None
        for work in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024):
            s, _ = P.choose_num_splits(work, max_seqlen, 132, 1)
            assert prev is None or s <= prev, (max_seqlen, work, s, prev)
            prev = s


def test_full_machine_is_not_split():
    # Many whole waves of blocks: a split would only add partials and a merge.
    assert P.choose_num_splits(132 * 8, 8192, 132, 1)[0] == 1


def test_short_sequences_are_not_split_below_min_chunk():
    for max_seqlen in (1, 17, 64, P.MIN_CHUNK):
        s, chunk = P.choose_num_splits(1, max_seqlen, 132, 1)
        assert s == 1 and chunk >= max_seqlen


def test_policy_is_deterministic():
    a = [P.choose_num_splits(w, n, 132, 1) for w in WORK for n in SEQ]
    b = [P.choose_num_splits(w, n, 132, 1) for w in WORK for n in SEQ]
    assert a == b


@pytest.mark.parametrize("work,max_seqlen", [(8, 0), (0, 4096), (0, 0), (-1, 5)])
def test_zero_work_or_length(work, max_seqlen):
    s, chunk = P.choose_num_splits(work, max_seqlen, 132, 1)
    assert s == 1 and chunk >= 1
    assert chunk >= max_seqlen


def test_chunk_for_splits():
    for max_seqlen in (0, 1, 2, 17, 255, 256, 257, 4097, 65536):
        for n in (1, 2, 3, 7, 64, P.MAX_SPLITS):
            chunk = P.chunk_for_splits(max_seqlen, n)
            assert chunk >= 1, (max_seqlen, n)
            assert n * chunk >= max_seqlen, (max_seqlen, n, chunk)
            assert (chunk - 1) * n < max_seqlen or chunk == 1, (max_seqlen, n, chunk)  # smallest
    assert P.chunk_for_splits(4097, 3) == 1366
    assert P.chunk_for_splits(100, 0) == 100   # defensive: no division by zero


def test_fixed_split_size():
    assert P.fixed_split_size(4096, 512) == (8, 512)
    assert P.fixed_split_size(4097, 512) == (9, 512)
    assert P.fixed_split_size(1, 512) == (1, 512)
    assert P.fixed_split_size(0, 512) == (1, 512)
    for max_seqlen in (1, 100, 4097, 65536):
        for size in (1, 64, 100, 1024):
            s, chunk = P.fixed_split_size(max_seqlen, size)
            assert chunk == size and s * size >= max_seqlen and (s - 1) * size < max_seqlen


def test_head_tiles():
    assert [P.head_tiles(g) for g in (1, 4, 7, 8, 16)] == [1] * 5
    assert P.head_tiles(17) == 2
    assert P.head_tiles(32) == 2
    assert P.head_tiles(33) == 3
    assert P.head_tiles(64) == 4
    for g in range(1, 200):
        assert (P.head_tiles(g) - 1) * P.ROWS < g <= P.head_tiles(g) * P.ROWS


@pytest.mark.parametrize("dtype", list(P.DTYPE_IDS))
@pytest.mark.parametrize("head_dim", RANGE_HEAD_DIMS)
def test_m_tiles(dtype, head_dim):
    """G > 16: the fewest blocks per KV head the most M-tiles allow, the M-tiles spread evenly
    over them, every query head in exactly one; float32 keeps one M-tile per block."""
    most = 1 if dtype == "float32" else P.MTILE_SHAPES[P.kernel_head_dim(head_dim)][1]
    for g in range(1, 300):
        mt = P.m_tiles(dtype, head_dim, g)
        tiles = P.head_tiles(g, mt)
        units = -(-g // P.ROWS)
        assert 1 <= mt <= most and tiles == -(-units // most), (g, mt, tiles)
        assert (tiles - 1) * mt * P.ROWS < g <= tiles * mt * P.ROWS, (g, mt, tiles)
        assert tiles * mt - units < tiles, (g, mt, tiles)  # no block has a spare M-tile to give
        cfg = P.split_kernel_config(dtype, head_dim, m_tiles=mt)
        assert cfg.m_tiles == mt and cfg.num_warps % mt == 0, (g, cfg)
        assert cfg in P.split_kernel_configs(dtype, head_dim), (g, cfg)
        if mt > 1:
            assert cfg.threads <= 1024 and cfg.stages >= 2 and cfg.slots <= 15, cfg
            assert cfg.smem_bytes <= SMEM_PER_BLOCK_MAX, cfg
            assert P.split_kernel_config(dtype, head_dim, P.LONG_CHUNK, mt) == cfg
    if dtype == "float32":
        with pytest.raises(ValueError):
            P.split_kernel_config(dtype, head_dim, m_tiles=2)
    else:
        with pytest.raises(ValueError):
            P.split_kernel_config(dtype, head_dim, m_tiles=most + 1)
    if dtype != "float32" and head_dim == 64:
        assert P.m_tiles(dtype, 64, 71) == 5 and P.head_tiles(71, 5) == 1  # falcon-7b: one block
    assert P.m_tiles(dtype, head_dim, 16) == 1 and P.m_tiles(dtype, head_dim, 8) == 1


def test_plan_shape_takes_m_tiles_only_where_chunks_are_long():
    one = lambda cfg: 1  # noqa: E731  (blocks per SM of any shape)
    # falcon-7b (71/1/64): batch 1 × 16k would give 128-token chunks to blocks of 5 M-tiles
    assert P.plan_shape("float16", 64, 71, 1, 1, 16384, 132, one)[0] == 1
    mt, _, chunk, kpb = P.plan_shape("float16", 64, 71, 16, 1, 16384, 132, one)
    assert mt == 5 and chunk >= P.MTILE_MIN_CHUNK and kpb == 1
    # forced split counts and split sizes: their chunk length decides
    assert P.plan_shape("float16", 64, 71, 2, 1, 3000, 132, one, num_splits=3) == (5, 3, 1000, 1)
    assert P.plan_shape("float16", 64, 71, 2, 1, 3000, 132, one, num_splits=17)[0] == 1
    assert P.plan_shape("bfloat16", 128, 48, 2, 1, 3000, 132, one, split_size=128) == (1, 24, 128, 1)
    assert P.plan_shape("bfloat16", 128, 48, 2, 1, 3000, 132, one, split_size=1024) == (3, 3, 1024, 1)
    # G ≤ 16, and float32 at any G: one M-tile and choose_num_splits' split count
    assert P.plan_shape("float16", 128, 4, 1, 8, 16384, 132, one) == (
        1, *P.choose_num_splits(8, 16384, 132, 1, rows_per_block=4, dtype="float16"), 1)
    assert P.plan_shape("float32", 64, 71, 16, 1, 16384, 132, one)[0] == 1


def test_kv_per_block_rule():
    """Blocks of KV_GROUP KV heads only for long one-split heads-as-N streams at head_dim 128
    with a multiple of KV_GROUP KV heads, never where the split count or size is the caller's."""
    long, n = P.KV_GROUP_MIN_TOKENS, P.KV_GROUP
    assert P.kv_per_block("float16", 128, 4, 8, 1, long) == n
    assert P.kv_per_block("bfloat16", 128, 1, 32, 1, 4 * long) == n
    for args in [("float16", 128, 4, 8, 1, long - 64),    # shorter chunks
                 ("float16", 128, 4, 8, 2, long),         # more than one split
                 ("float16", 128, 4, n // 2, 1, long),    # fewer KV heads than a group
                 ("float16", 128, 4, n + 2, 1, long),     # not a multiple of the group
                 ("float16", 64, 4, 8, 1, long), ("float16", 256, 4, 8, 1, long),
                 ("float16", 128, 16, 8, 1, long),        # G > 8: not heads-as-N
                 ("float32", 128, 4, 8, 1, long)]:
        assert P.kv_per_block(*args) == 1, args
    assert P.kv_per_block("float16", 128, 4, 8, 1, long, forced=True) == 1


@pytest.mark.h200_pin
def test_plan_shape_takes_kv_groups_for_long_one_split_streams():
    one = lambda cfg: 1  # noqa: E731
    # llama-3-8b (32/8/128) batch 16: one split of one KV head per block, so KV_GROUP KV heads
    # a block, and its fewer units are split again to fill the SMs
    n = P.KV_GROUP
    mt, splits, chunk, kpb = P.plan_shape("float16", 128, 4, 16, 8, 65536, 132, one)
    assert (mt, kpb) == (1, n)
    assert (splits, chunk) == P.choose_num_splits(16 * 8 // n, 65536, 132, 1,
                                                  rows_per_block=4 * n, dtype="float16",
                                                  group=4, kv_per_block=n)
    assert splits > 1 and 16 * 8 // n * splits <= 132  # one wave (kv_group_pays)
    # b16 × 16k: one split of one KV head per block would group, but grouped it takes 4 splits
    # of 4096 tokens, which do not pay for their merge
    assert P.kv_per_block("float16", 128, 4, 8, 1, 16384) == n
    grouped = P.choose_num_splits(16 * 8 // n, 16384, 132, 1, rows_per_block=4 * n,
                                  dtype="float16", group=4, kv_per_block=n)
    assert grouped == (4, 4096) and not P.kv_group_pays(*grouped, 16 * 8 // n * 4, 132)
    assert P.plan_shape("float16", 128, 4, 16, 8, 16384, 132, one) == (
        1, *P.choose_num_splits(128, 16384, 132, 1, rows_per_block=4, dtype="float16",
                                group=4), 1)
    assert P.plan_shape("float16", 128, 4, 64, 8, 8192, 132, one) == (1, 1, 8192, n)  # no split
    assert P.plan_shape("float16", 128, 4, 128, 8, 8192, 132, one)[3] == 1  # two waves
    assert P.plan_shape("float16", 128, 4, 1, 8, 65536, 132, one)[3] == 1   # split at batch 1
    assert P.plan_shape("float16", 128, 4, 16, 8, 65536, 132, one, num_splits=1) == (
        1, 1, 65536, 1)                                                     # forced
    assert P.plan_shape("float16", 128, 4, 16, 8, 65536, 132, one, split_size=65536) == (
        1, 1, 65536, 1)                                                     # fixed


def test_block_rows():
    """A block's live query rows: the group up to its M-tiles' 16 rows each, or every query head
    of its KV heads."""
    assert [P.block_rows(g) for g in (1, 4, 8, 16, 71)] == [1, 4, 8, 16, 16]
    assert P.block_rows(71, 5) == 71 and P.block_rows(48, 2) == 32
    assert P.block_rows(4, 1, P.KV_GROUP) == 4 * P.KV_GROUP and P.block_rows(7, 1, 4) == 28


def test_kv_group_pays():
    """One wave, and one split or splits of at least 2 · KV_GROUP_MIN_TOKENS tokens (the
    measured table in _policy)."""
    t = P.KV_GROUP_MIN_TOKENS
    assert P.kv_group_pays(1, t, 128, 132) and P.kv_group_pays(1, 2 * t, 132, 132)
    assert P.kv_group_pays(2, 2 * t, 128, 132) and P.kv_group_pays(4, 2 * t, 128, 132)
    assert not P.kv_group_pays(1, t, 256, 132)        # two waves (b128 × 8k)
    assert not P.kv_group_pays(2, t, 128, 132)        # two splits of 8k (qwen b64 × 16k)
    assert not P.kv_group_pays(4, t, 128, 132)        # four splits of 8k (b16 × 32k)
    assert not P.kv_group_pays(4, 2 * t - 64, 128, 132)


def test_kv_group_config():
    n = P.KV_GROUP
    cfg = P.split_kernel_config("float16", 128, group=4, kv_per_block=n)
    assert (cfg.num_warps, cfg.heads_as_n, cfg.kv_per_block, cfg.slots, cfg.rings) == (
        8, True, n, 8 // n, 8)
    assert cfg.defines()["KV_PER_BLOCK"] == n
    # Q rows, rings, the warps' (m, l), the appended token's K and V rows per KV head
    assert cfg.smem_bytes == (8 * n * 128 * 2 + 8 * cfg.stages * 2 * 16 * 128 * 2
                              + 2 * 8 * 16 * 4 + n * 2 * 128 * 2)
    assert cfg in P.split_kernel_configs("float16", 128)
    for dt, hd, g in [("float16", 64, 4), ("float16", 256, 4), ("float16", 128, 16),
                      ("float32", 128, 4)]:
        with pytest.raises(ValueError):
            P.split_kernel_config(dt, hd, group=g, kv_per_block=n)
    with pytest.raises(ValueError, match="M-tiles"):
        P.split_kernel_config("float16", 128, m_tiles=2, group=32, kv_per_block=n)
    # its warps always go in step, whatever the chunk (one KV head per block: long chunks only)
    assert P.warps_in_step(cfg, 64) and P.warps_in_step(cfg, 1 << 20)
    one = P.split_kernel_config("float16", 128, 64, group=4)
    assert not P.warps_in_step(one, 64) and P.warps_in_step(
        P.split_kernel_config("float16", 128, P.WARPS_IN_STEP_MIN_CHUNK, group=4),
        P.WARPS_IN_STEP_MIN_CHUNK)


@pytest.mark.parametrize("dtype", list(P.DTYPE_IDS))
@pytest.mark.parametrize("head_dim", RANGE_HEAD_DIMS)
def test_split_kernel_config(dtype, head_dim):
    cfg = P.split_kernel_config(dtype, head_dim)
    assert cfg.dtype == dtype and cfg.head_dim == head_dim
    assert cfg.threads == 32 * cfg.num_warps and 32 <= cfg.threads <= 1024
    assert cfg.stages >= 2, "a ring of one stage cannot overlap loads with math"
    assert 0 < cfg.smem_bytes <= SMEM_PER_BLOCK_MAX
    # The kernel computes in the next width up; its shape (and shared memory) is the width's.
    width = P.kernel_head_dim(head_dim)
    assert cfg.width == width and width in P.KERNEL_HEAD_DIMS and head_dim <= width
    assert all(w < head_dim for w in P.KERNEL_HEAD_DIMS if w < width)  # the next width up
    assert dataclasses.replace(cfg, head_dim=width) == P.split_kernel_config(dtype, width)
    # The ring (K and V tiles of every stage of every warp) must fit in what is allocated.
    es = P.ITEMSIZE[dtype]
    ring = cfg.num_warps * cfg.stages * 2 * P.TILE_N * width * es
    assert cfg.smem_bytes >= ring + P.ROWS * width * es
    d = cfg.defines()
    assert d["DTYPE_ID"] == P.DTYPE_IDS[dtype] and d["HEAD_DIM"] == width
    assert d.get("REAL_DIM", width) == head_dim  # (only where it differs: the widths' builds)
    assert d["NUM_WARPS"] == cfg.num_warps and d["STAGES"] == cfg.stages
    assert all(isinstance(v, int) for v in d.values())
    assert P.split_kernel_config(dtype, head_dim) == cfg  # hashable, equal: usable as a cache key
    assert hash(P.split_kernel_config(dtype, head_dim)) == hash(cfg)


@pytest.mark.parametrize("dtype", list(P.DTYPE_IDS))
@pytest.mark.parametrize("head_dim", RANGE_HEAD_DIMS)
def test_long_chunk_config(dtype, head_dim):
    """Long streams may take another shape with the same K/V ring (so the same occupancy the
    split count was costed with), never one of a single stage."""
    short = P.split_kernel_config(dtype, head_dim)
    assert P.split_kernel_config(dtype, head_dim, P.LONG_CHUNK - 1) == short
    long = P.split_kernel_config(dtype, head_dim, P.LONG_CHUNK)
    assert P.split_kernel_config(dtype, head_dim, 1 << 20) == long
    ring = lambda c: c.num_warps * c.stages  # noqa: E731  (tiles of K and V per block)
    assert ring(long) == ring(short) and long.stages >= 2
    assert long.smem_bytes <= SMEM_PER_BLOCK_MAX
    narrow = {P.split_kernel_config(dtype, head_dim, c, 1, 4) for c in (0, P.LONG_CHUNK)}
    groups = {P.split_kernel_config(dtype, head_dim, group=1, kv_per_block=P.KV_GROUP)
              for _ in (1,) if P.heads_as_n(dtype, 1) and head_dim in P.KV_GROUP_HEAD_DIMS}
    shapes = {short, long} | narrow | groups
    plain = {dataclasses.replace(c, l2_evict_first=False) for c in shapes}
    assert {c for c in P.split_kernel_configs(dtype, head_dim) if c.m_tiles == 1} == (
        shapes | (plain if P.l2_hint_is_chosen(dtype) else set()))
    if dtype != "float32" and P.kernel_head_dim(head_dim) == 128:
        assert (long.num_warps, long.stages) == (8, 2)


@pytest.mark.parametrize("dtype", list(P.DTYPE_IDS))
@pytest.mark.parametrize("head_dim", RANGE_HEAD_DIMS)
def test_heads_as_n_only_for_small_groups(dtype, head_dim):
    """The heads-as-N path takes 16-bit blocks of one M-tile with G ≤ 8 (the mma's N); G > 8,
    float32 and M-tile blocks keep the 16-row path. Its blocks take the long-chunk shape from
    HEADS_AS_N_LONG_CHUNK tokens on (a tile for each of its warps), the 16-row path's from
    LONG_CHUNK; the shapes themselves are the same two."""
    long = P.split_kernel_config(dtype, head_dim, P.LONG_CHUNK)
    short = P.split_kernel_config(dtype, head_dim)
    for chunk in (0, P.MIN_CHUNK, P.HEADS_AS_N_LONG_CHUNK - 1, P.HEADS_AS_N_LONG_CHUNK,
                  P.LONG_CHUNK - 1, P.LONG_CHUNK):
        rows16 = P.split_kernel_config(dtype, head_dim, chunk)
        assert not rows16.heads_as_n and rows16.defines()["HEADS_AS_N"] == 0
        for g in range(1, 40):
            cfg = P.split_kernel_config(dtype, head_dim, chunk, 1, g)
            narrow = dtype != "float32" and g <= 8
            assert cfg.heads_as_n == narrow, (g, cfg)
            assert cfg.defines()["HEADS_AS_N"] == int(cfg.heads_as_n)
            want = long if chunk >= (P.HEADS_AS_N_LONG_CHUNK if narrow else P.LONG_CHUNK) else short
            assert (cfg.num_warps, cfg.stages, cfg.smem_bytes) == (
                want.num_warps, want.stages, want.smem_bytes), (g, chunk, cfg)
            assert cfg in P.split_kernel_configs(dtype, head_dim), cfg
    if dtype != "float32":
        mt = P.split_kernel_config(dtype, head_dim, 0, 2, 8)
        assert mt.m_tiles == 2 and not mt.heads_as_n
    # the plan's block: llama-3-8b (G = 4) takes it, llama-3-405b (G = 16) does not
    one = lambda cfg: 1  # noqa: E731
    for g, want in ((4, True), (8, True), (16, False)):
        mt, _, chunk, _ = P.plan_shape(dtype, head_dim, g, 1, 8, 16384, 132, one)
        cfg = P.split_kernel_config(dtype, head_dim, chunk, mt, g)
        assert cfg.heads_as_n == (want and dtype != "float32"), (g, cfg)


@pytest.mark.parametrize("dtype,head_dim", [("float64", 128), ("int32", 128), ("bf16", 128),
                                            ("float16", 100), ("float16", 24), ("float16", 0),
                                            ("float16", 264), ("float32", 512),
                                            ("float16", 384), ("float16", 520)])
def test_split_kernel_config_rejects(dtype, head_dim):
    with pytest.raises(ValueError):
        P.split_kernel_config(dtype, head_dim)


def test_merge_vec():
    for d in (4, 8, 64, 128, 256, 260):
        assert P.merge_vec(d) == 4
    for d in (1, 2, 3, 5, 6, 130):
        assert P.merge_vec(d) == 1


def test_fused_merge_only_with_one_trip_per_warp():
    # llama-3-8b (4 rows, head_dim 128, 4 warps): 16 splits are one trip per warp → fused.
    assert P.fused_merge_trips(16, 4, 128, 4) == 1 and P.merge_mode(16, 4, 128, 4) == "fused"
    # 17 splits: two groups of 16 → two trips → the merge kernel.
    assert P.fused_merge_trips(17, 4, 128, 4) == 2 and P.merge_mode(17, 4, 128, 4) == "kernel"
    # qwen2.5-7b (7 rows on 4 warps) and gemma-2b (8 rows × 2 passes of head_dim 256).
    assert P.fused_merge_trips(16, 7, 128, 4) == 2 and P.merge_mode(16, 7, 128, 4) == "kernel"
    assert P.fused_merge_trips(2, 8, 256, 4) == 4 and P.merge_mode(2, 8, 256, 4) == "kernel"
    assert P.fused_merge_trips(16, 2, 256, 4) == 1 and P.merge_mode(16, 2, 256, 4) == "fused"
    # One split needs no merge; a forced mode is kept.
    assert P.merge_mode(1, 4, 128, 4) == "none" and P.merge_mode(1, 4, 128, 4, "kernel") == "none"
    assert P.merge_mode(128, 8, 256, 4, "fused") == "fused"
    assert P.merge_mode(2, 4, 128, 4, "kernel") == "kernel"


@pytest.mark.parametrize("rows,head_dim,states", [(1, 128, 1), (8, 256, 128), (7, 128, 32),
                                                   (4096, 64, 2), (3, 5, 300), (2, 128, 17)])
def test_merge_launch_covers_every_item(rows, head_dim, states):
    blocks, threads, wpi = P.merge_launch(rows, head_dim, states)
    groups = -(-states // P.MERGE_STATES_PER_TRIP)
    assert threads == 32 * P.MERGE_WARPS and P.MERGE_WARPS % wpi == 0
    assert wpi == min(P.MERGE_WARPS, 1 << (groups - 1).bit_length())   # power of two ≥ groups, capped
    passes = -(-head_dim // (32 * P.merge_vec(head_dim)))
    items_per_block = P.MERGE_WARPS // wpi
    assert (blocks - 1) * items_per_block < rows * passes <= blocks * items_per_block


def test_merge_cost_grows_with_trips():
    one = P.merge_cost_bytes(16, 4, 128, 4)
    assert one == P.MERGE_OVERHEAD_BYTES and P.merge_cost_bytes(1, 4, 128, 4) == 0
    # A forced fused merge pays for its extra trips; the kernel for its launch.
    assert P.merge_cost_bytes(64, 8, 256, 4, "fused") == one + 15 * P.MERGE_TRIP_BYTES  # 4 groups × 4 items per warp
    assert P.merge_cost_bytes(64, 8, 256, 4) == one + P.MERGE_KERNEL_BYTES
    assert P.merge_cost_bytes(129, 8, 256, 4) == one + P.MERGE_KERNEL_BYTES + P.MERGE_TRIP_BYTES
    # a merge kernel launched as a programmatic dependent costs less
    assert P.merge_cost_bytes(64, 8, 256, 4, programmatic=True) == (
        one + P.MERGE_KERNEL_BYTES_PROGRAMMATIC) < P.merge_cost_bytes(64, 8, 256, 4)


def test_programmatic_merge_kernel_takes_larger_merges():
    """With a programmatic merge kernel, merge="auto" fuses only merges of at most
    FUSED_MAX_STATES_PROGRAMMATIC states per block (rows × splits); a plain launch fuses every
    one-trip merge; forced modes stay forced."""
    most = P.FUSED_MAX_STATES_PROGRAMMATIC
    for rows, splits, warps in ((4, 16, 4), (8, 16, 8), (8, 8, 8), (7, 8, 8), (2, 16, 4), (1, 4, 8),
                                (8, 4, 8), (7, 2, 8)):
        assert P.fused_merge_trips(splits, rows, 128, warps) == 1, (rows, splits)
        assert P.merge_mode(splits, rows, 128, warps) == "fused"
        want = "fused" if rows * splits <= most else "kernel"
        assert P.merge_mode(splits, rows, 128, warps, programmatic=True) == want, (rows, splits)
        for forced in ("fused", "kernel"):
            assert P.merge_mode(splits, rows, 128, warps, forced, programmatic=True) == forced
    assert P.merge_mode(1, 8, 128, 8, programmatic=True) == "none"
    assert P.merge_mode(32, 7, 128, 8, programmatic=True) == "kernel"  # two trips: kernel anyway


@pytest.mark.h200_pin
def test_llama_batch1_choice_is_sixteen_fused_splits():
    # llama-3-8b at batch 1 (8 KV heads, 4 rows): 16 splits fill 128 of 132 SMs and merge fused.
    for max_seqlen in (1024, 4096, 16384, 65536):
        s = P.choose_num_splits(8, max_seqlen, 132, 1, rows_per_block=4)[0]
        assert s == 16 and P.merge_mode(s, 4, 128, 4) == "fused"


@pytest.mark.h200_pin
def test_one_kv_head_fills_the_machine():
    # gemma-2b at batch 1 (one KV head, 8 rows of head_dim 256): the merge kernel's cost does
    # not grow with the split count up to 128, so the splits fill every SM.
    s, chunk = P.choose_num_splits(1, 65536, 132, 1, rows_per_block=8, head_dim=256)
    assert s == 128 and s * chunk >= 65536


@pytest.mark.h200_pin
def test_short_caches_split_to_64_token_chunks():
    # batch 1 × 1024 tokens, 8 KV heads: 16 splits of 64 tokens (measured fastest on the H200).
    assert P.choose_num_splits(8, 1024, 132, 1, rows_per_block=4) == (16, 64)


def test_one_wave_counts_whole_chunks():
    """In one wave the longest block sets the end, so s chunks cost s · chunk tokens, not the
    cache's: qwen2.5-7b (4 KV heads, G = 7) at batch 1 takes 32 chunks of 2048 tokens (128
    blocks) over 31 of 2176 for 65536 tokens (measured 1.0 µs faster on the H200), and 32 of
    1024 over 31 of 1088 for 32768."""
    for max_seqlen, want in ((65536, (32, 2048)), (32768, (32, 1024))):
        assert P.choose_num_splits(4, max_seqlen, 132, 1, rows_per_block=7,
                                   dtype="bfloat16") == want, max_seqlen


@pytest.mark.h200_pin
def test_programmatic_split_choices():
    """Split counts with the merge kernel launched as a programmatic dependent (H200 figures:
    the performance log, v14): G = 8 at batch 1 × 1k keeps 16 splits merged by the kernel rather
    than 8 fused ones; llama-2-7b (32 KV heads, G = 1) at batch 1 × 256k takes 33 splits merged by the
    kernel (951.7 µs, against 960.9 with 4 fused), and keeps 4 fused ones where the kernel's
    launch is plain."""
    one = lambda cfg: 1  # noqa: E731
    assert P.plan_shape("float16", 128, 8, 1, 8, 1024, 132, one, programmatic=True) == (1, 16, 64, 1)
    # with a plain merge launch, the group's 8-warp heads-as-N blocks (128-token chunks) fold
    # the 8 rows of 8 splits in one trip each: 8 fused splits (the group must reach the choice)
    assert P.plan_shape("float16", 128, 8, 1, 8, 1024, 132, one) == (1, 8, 128, 1)
    assert P.plan_shape("float16", 128, 1, 1, 32, 262144, 132, one, programmatic=True)[1] == 33
    assert P.plan_shape("float16", 128, 1, 1, 32, 262144, 132, one)[1] == 4


@pytest.mark.h200_pin
def test_warps_in_step_only_for_long_heads_as_n_chunks():
    """The block-wide barrier per tile is asked for where it was measured to pay: heads-as-N
    blocks from WARPS_IN_STEP_MIN_CHUNK tokens; never for the 16-row path or float32."""
    long, short = P.WARPS_IN_STEP_MIN_CHUNK, P.WARPS_IN_STEP_MIN_CHUNK - 1
    for dtype in ("float16", "bfloat16"):
        for group in (1, 4, 8):
            assert P.warps_in_step(P.split_kernel_config(dtype, 128, long, 1, group), long)
            assert not P.warps_in_step(P.split_kernel_config(dtype, 128, short, 1, group), short)
        assert not P.warps_in_step(P.split_kernel_config(dtype, 128, long, 1, 16), long)
    assert not P.warps_in_step(P.split_kernel_config("float32", 128, long, 1, 4), long)



@pytest.mark.h200_pin
def test_l2_evict_first_only_on_short_16_bit_calls():
    """Calls of up to EVICT_FIRST_MAX_KV_BYTES of K and V stream with the evict-first hint,
    longer ones without (measured in the decode-step protocol); float32 always with it."""
    limit = P.EVICT_FIRST_MAX_KV_BYTES
    for dtype in ("float16", "bfloat16"):
        assert P.l2_evict_first(dtype, 67 << 20) and P.l2_evict_first(dtype, limit)
        assert not P.l2_evict_first(dtype, limit + 1) and not P.l2_evict_first(dtype, 2 << 30)
    assert P.l2_evict_first("float32", 2 << 30)
    assert P.split_kernel_config("float16", 128).defines()["L2_EVICT_FIRST"] == 1
    plain = dataclasses.replace(P.split_kernel_config("float16", 128), l2_evict_first=False)
    assert plain.defines()["L2_EVICT_FIRST"] == 0 and plain.smem_bytes == P.split_kernel_config(
        "float16", 128).smem_bytes


def test_burst_kv_groups():
    """Blocks of several KV heads are offered where one KV head's row piece is not whole 64-byte
    bursts: the group sizes whose piece is, dividing the KV heads, on the heads-as-N path of the
    128 width; none for whole-burst pieces, float32, G > 8 or the other widths."""
    assert P.burst_kv_groups("float16", 80, 1, 32) == (4, 2)      # 160 B: 2 heads are 320
    assert P.burst_kv_groups("bfloat16", 112, 4, 8) == (4, 2)     # 224 B
    assert P.burst_kv_groups("float16", 72, 4, 8) == (4,)         # 144 B: 4 heads are 576
    assert P.burst_kv_groups("float16", 80, 4, 6) == (2,)         # 4 does not divide 6
    assert P.burst_kv_groups("float16", 72, 4, 6) == ()
    for args in [("float16", 96, 1, 32), ("float16", 128, 4, 8),  # whole bursts
                 ("float32", 80, 1, 32),                          # 320 B, and CUDA cores
                 ("float16", 80, 16, 8),                          # G > 8: not heads-as-N
                 ("float16", 40, 4, 8), ("float16", 136, 4, 8)]:  # widths 64 and 256
        assert P.burst_kv_groups(*args) == (), args


@pytest.mark.h200_pin
def test_plan_shape_groups_kv_heads_whose_rows_are_not_whole_bursts():
    """The grouped plan with the fewest splits, ties to more KV heads, at most
    BURST_GROUP_MAX_SPLITS splits; the measured shapes of the table in _policy."""
    one = lambda cfg: 1  # noqa: E731
    shape = lambda d, g, b, h, n, **kw: P.plan_shape("float16", d, g, b, h, n, 132, one, **kw)  # noqa: E731
    assert shape(80, 1, 1, 32, 16384) == (1, 8, 2048, 2)     # k=4 would take 16 splits
    assert shape(80, 1, 16, 32, 65536) == (1, 1, 65536, 4)   # one split either way: k=4
    assert shape(112, 4, 16, 8, 16384) == (1, 2, 8192, 2)    # k=4 would take 4
    # 1 × 64k at 112: k=2 takes 32 splits (measured 1.004×), so one KV head a block
    assert shape(112, 4, 1, 8, 65536)[3] == 1
    assert shape(96, 1, 1, 32, 65536)[3] == 1                # whole bursts
    assert shape(80, 1, 16, 32, 65536, num_splits=2)[3] == 1  # forced: never grouped
    assert P.plan_shape("float16", 80, 4, 16, 8, 16384, 132, one, kv_groups=False)[3] == 1
    for d, g, b, h, n in [(80, 1, 1, 32, 16384), (80, 1, 16, 32, 65536), (112, 4, 16, 8, 16384)]:
        splits, chunk, k = P.burst_kv_per_block("float16", d, g, b, h, n, 132, one)
        assert splits <= P.BURST_GROUP_MAX_SPLITS and shape(d, g, b, h, n) == (1, splits, chunk, k)


def test_fp8_per_token_scales_take_more_warps_on_long_chunks():
    """Per-token fp8 scales: more warps (12 × 3 instead of 8 × 4) from FP8_TOKEN_LONG_CHUNK
    tokens a block at head_dim 128 (the measured width), the plan's own shape below that and at
    other widths; per-tensor/per-head plans never change shape; a Tuning applies to both."""
    base = P.split_kernel_config("float16", 128, kv_dtype="e4m3")
    from cupydecode import _validate as V

    replace = dataclasses.replace
    short = P.fp8_token_config(base, P.FP8_TOKEN_LONG_CHUNK - 1)
    assert short == replace(base, kv_scale_token=True)
    long = P.fp8_token_config(base, P.FP8_TOKEN_LONG_CHUNK)
    assert (long.num_warps, long.stages) == P.FP8_TOKEN_LONG_SHAPES[128] == (12, 3)
    assert long.kv_scale_token and long.kv_dtype == "e4m3"
    assert long.num_warps > base.num_warps
    for d in (64, 256):
        c = P.split_kernel_config("float16", d, kv_dtype="e4m3")
        assert P.fp8_token_config(c, 1 << 20) == replace(c, kv_scale_token=True), d
    assert long in P.fp8_kernel_configs("float16", 128, "e4m3")  # (compile-checked)
    tuned = V.check_tuning(P.Tuning(num_warps=8, stages=4), long, 0)
    assert (tuned.num_warps, tuned.stages, tuned.kv_scale_token) == (8, 4, True)


def test_head_dim_512_family():
    """head_dim 512 is a width of its own, for itself only (264 … 504 and 520 are refused),
    16-bit q and cache only."""
    assert P.WIDE_HEAD_DIM == 512 and P.KERNEL_HEAD_DIMS[-1] == 512
    assert 512 in P.SUPPORTED_HEAD_DIMS and P.kernel_head_dim(512) == 512
    assert [d for d in P.SUPPORTED_HEAD_DIMS if d > P.MAX_HEAD_DIM] == [512]
    for d in (264, 384, 504, 520, 1024):
        with pytest.raises(ValueError, match="or 512"):
            P.kernel_head_dim(d)
    assert P.width_takes("float16", 512) and P.width_takes("bfloat16", 512)
    assert not P.width_takes("float32", 512) and not P.width_takes("float16", 512, "e4m3")
    assert all(P.width_takes(dt, w, kv) for dt in P.DTYPE_IDS for w in (64, 128, 256)
               for kv in (None,))
    assert P.split_kernel_configs("float32", 512) == []
    with pytest.raises(ValueError):
        P.split_kernel_config("float16", 512, kv_dtype="e4m3")


@pytest.mark.parametrize("dtype", P.WIDE_DTYPES)
def test_head_dim_512_shape(dtype):
    """One heads-as-N shape whatever the chunk or group (blocks of 8 query rows), with and
    without the L2 hint; several query tokens take the smaller shape (the appended rows' shared
    memory); every switch on fits the opt-in shared memory."""
    cfg = P.split_kernel_config(dtype, 512)
    assert (cfg.num_warps, cfg.stages) == P.WIDE_SHAPE and cfg.heads_as_n
    assert cfg.block_rows == P.EIGHT_ROWS and cfg.m_tiles == 1 and cfg.kv_per_block == 1
    for chunk, g in itertools.product((0, P.LONG_CHUNK, 1 << 20), (None, 1, 4, 8, 16, 64)):
        assert P.split_kernel_config(dtype, 512, chunk, 1, g) == cfg
    for mt, kpb in ((2, 1), (1, 2)):
        with pytest.raises(ValueError):
            P.split_kernel_config(dtype, 512, m_tiles=mt, group=1, kv_per_block=kpb)
    assert P.split_kernel_configs(dtype, 512) == [cfg, dataclasses.replace(cfg, l2_evict_first=False)]
    assert P.m_tiles(dtype, 512, 64) == 1
    mq = P.multi_q_config(dataclasses.replace(cfg, paged=True, soft_cap=True, alibi=True))
    assert mq.multi_q and (mq.num_warps, mq.stages) == P.WIDE_MULTI_Q_SHAPE
    assert P.multi_q_config(P.split_kernel_config(dtype, 128)).num_warps == (
        P.split_kernel_config(dtype, 128).num_warps)  # other widths keep their shape
    for c in (cfg, dataclasses.replace(cfg, paged=True, soft_cap=True, alibi=True), mq):
        assert c.smem_bytes + P.SPLIT_STATIC_SMEM_BYTES <= SMEM_PER_BLOCK_MAX, c
        d = c.defines()
        assert d["HEAD_DIM"] == 512 and "REAL_DIM" not in d and d["HEADS_AS_N"] == 1
    wide = [c for c in P.compile_check_configs() if c.width == 512]
    # the compile checks build both shapes, every switch on (the plain one without the runtime
    # options, the switched ones with them)
    assert dataclasses.replace(cfg, runtime_options=False) in wide and mq in wide
    assert dataclasses.replace(cfg, paged=True, soft_cap=True, alibi=True) in wide


def test_head_dim_512_plan():
    """Plans of head_dim 512 tile the query rows by 8 (one KV head a block), like fp8 caches:
    every query head in exactly one block, the split count chosen for that grid."""
    one = lambda cfg: 1  # noqa: E731
    assert P.eight_row_blocks(512) and P.eight_row_blocks(128, "e4m3")
    assert not P.eight_row_blocks(256) and not P.eight_row_blocks(128)
    for g in (1, 4, 7, 8, 9, 16, 64):
        tiles = P.head_tiles(g, 1, True)
        assert (tiles - 1) * 8 < g <= tiles * 8
        assert P.block_rows(g, eight_rows=True) == min(g, 8)
    splits, chunk = P.narrow_plan_shape("float16", None, 512, 4, 1, 8, 16384, 132, one)
    assert splits * chunk >= 16384 and 8 * splits <= 132 * 2  # one KV head a block: about a wave
    assert P.narrow_plan_shape("float16", None, 512, 4, 1, 8, 16384, 132, one, num_splits=3) == (
        3, P.chunk_for_splits(16384, 3))
    assert P.narrow_plan_shape("float16", None, 512, 4, 1, 8, 16384, 132, one,
                               split_size=4096) == (4, 4096)
