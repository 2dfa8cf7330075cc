"""Launch policy: block shape and split count. Pure functions, no GPU needed.

Everything here is decided from shapes, dtype and the SM count alone — never from device data —
so a call launches a static grid, needs no device→host synchronisation and can be captured in a
CUDA graph. Splits that start past a sequence's live length exit early and write (0, −inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Element type codes shared with kernels/common.cuh.
DTYPE_IDS = {"float16": 0, "bfloat16": 1, "float32": 2}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
# The widths the split kernel computes in (HEAD_DIM in kernels/decode_split.cu). Any head_dim
# that is a multiple of 8 from MIN_HEAD_DIM to MAX_HEAD_DIM runs in the next width up: its K/V
# and Q rows are read as they are and zero-filled to the width in shared memory (REAL_DIM there),
# so the bytes read are the data's; only the tile math and the ring's shared memory are the
# width's. Each head_dim is its own build, compiled when first used. WIDE_HEAD_DIM (512) is a
# width of its own, for itself only, over 16-bit caches (WIDE_DTYPES): the heads-as-N path in
# blocks of 8 query rows (as fp8 caches take it), its own block shape (WIDE_SHAPE).
WIDE_HEAD_DIM = 512
KERNEL_HEAD_DIMS = (64, 128, 256, WIDE_HEAD_DIM)
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_STEP = 32, 256, 8
SUPPORTED_HEAD_DIMS = (*range(MIN_HEAD_DIM, MAX_HEAD_DIM + 1, HEAD_DIM_STEP), WIDE_HEAD_DIM)
HEAD_DIMS_TEXT = (f"a multiple of {HEAD_DIM_STEP} from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}, "
                  f"or {WIDE_HEAD_DIM}")
WIDE_DTYPES = ("float16", "bfloat16")


def kernel_head_dim(head_dim: int) -> int:
    """The width the split kernel computes ``head_dim`` in: the next of KERNEL_HEAD_DIMS."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"unsupported head_dim {head_dim}: expected {HEAD_DIMS_TEXT}")
    return next(w for w in KERNEL_HEAD_DIMS if w >= head_dim)


def width_takes(dtype: str, width: int, kv_dtype: str | None = None) -> bool:
    """Whether the kernel has builds of ``width`` for ``dtype`` (and an fp8 cache of
    ``kv_dtype``): every width but WIDE_HEAD_DIM takes every dtype; that one 16-bit q and caches."""
    return width != WIDE_HEAD_DIM or (dtype in WIDE_DTYPES and kv_dtype is None)


def eight_row_blocks(head_dim: int, kv_dtype: str | None = None) -> bool:
    """Whether a plan's blocks hold 8 query rows (the heads-as-N mma's N) whatever the group,
    several head tiles per KV head beyond 8 (``narrow_plan_shape``): fp8 caches and head_dim
    WIDE_HEAD_DIM."""
    return kv_dtype is not None or kernel_head_dim(head_dim) == WIDE_HEAD_DIM

ROWS = 16     # query rows per M-tile (one mma M dimension) of the G query heads of a KV head
TILE_N = 16   # tokens per warp tile
SPLIT_GRANULE = 64   # chunk lengths are multiples of this (one 16-token tile per warp of a 4-warp block)
MIN_CHUNK = 64       # one tile per warp: a split sweep on the H200 found 64-token chunks fastest at
                     # batch 1 × 1024 tokens (16 splits: 9.1 µs vs 10.2 µs with 256-token chunks)
MAX_SPLITS = 4096
MAX_TOKENS = 2**30   # token counts are int32 in the kernels, with headroom for chunk arithmetic
MAX_BATCH = 65535    # sequences are the grid's z dimension
MAX_Q_LEN = 64       # query tokens per sequence (draft tokens verified in one call)
MAX_APPEND_Q_LEN = 16  # of those, appended in the call (k_new, v_new): NEW_ROWS in decode_split.cu
LOG2E = 1.4426950408889634  # the kernels take softmax_scale · log2(e) (scores in log2 units)
# Any split plan ends in a merge whose fixed tail (partials out, arrival count, merge) costs
# ~2–3 µs on the H200, the time to stream ~8 MB at ~4.5 TB/s: charged to every plan with s > 1.
MERGE_OVERHEAD_BYTES = 8 * 2**20
# On top, a merge is a chain of dependent L2 round trips (~1–1.3 µs each on the H200 as these
# costs were calibrated, ~5 MB of streaming at full speed; ~0.6 µs since the merge issues its
# loads back to back, the performance log, v10): a warp takes 16 partials of a row's pass per trip.
# The fused merge (the last block of a KV head, or of a block's KV heads) has only that block's
# warps, so it is used only where it takes one trip per warp (merge_mode); otherwise
# merge_states.cu runs as a second kernel, which spreads rows, passes and groups of 16 partials
# over many warps (one trip each up to 16 · MERGE_WARPS splits) at the cost of a second launch
# (~1 µs in a graph). Where the merge kernel is launched as a programmatic dependent of the split
# kernel (Hopper on; 0.7–0.9 µs faster, the performance log, v13), it is charged 3 MB instead of 4:
# lower, the split count moves to many-wave plans measured no faster at several points (llama-3-8b
# b4 × 256k 33 splits 934.3 µs vs 4 fused 929.3; qwen2.5-7b b2 × 256k 236.5 vs 235.2) and, for
# G = 7 and 8 at batch 1 × 1k, to 8 fused splits (0.3–0.4 µs slower than 16 with the kernel); at 3
# MB the plans that change are ones measured as fast or faster (the performance log, v14).
MERGE_TRIP_BYTES = 5 * 2**20
MERGE_KERNEL_BYTES = 4 * 2**20
MERGE_KERNEL_BYTES_PROGRAMMATIC = 3 * 2**20
MERGE_STATES_PER_TRIP = 16   # CD_MERGE_GROUP in kernels/common.cuh
MERGE_WARPS = 8              # CD_MERGE_MAX_WARPS in kernels/merge_states.cu: warps per merge block
FUSED_PASS = 128             # elements of head_dim per warp pass in the fused merge (4 per lane)
MERGE_MODES = ("auto", "fused", "kernel")
# Where the merge kernel is launched as a programmatic dependent (Hopper on), merge="auto" fuses
# the merge only where the merging block folds at most this many partial states (its rows × the
# splits): it fetches them all through its one SM, while the kernel spreads them over many.
# Measured on the H200, blocks of 8 warps, one fused trip per warp (fused vs kernel µs, states):
# llama-3-70b b1 × 4k 10.0 vs 9.7, b1 × 16k 21.0 vs 20.8, b1 × 64k 65.1 vs 64.9 (8 rows × 16
# splits = 128 states); b4 × 8k 35.7 vs 35.8, b4 × 16k 65.2 vs 65.4 (32); qwen2.5-7b b16 × 4k
# 35.7 vs 36.0, b16 × 16k 123.6 vs 124.1 (14); llama-3-8b b4 × 8k 35.5 vs 36.1 (16, v13's
# kernel). From 33 to 64 states they tie within 0.1 µs (llama-3-8b b1 × 16k 20.5 vs 20.5 and,
# v13, b1 × 1k 6.41 vs 6.43 (64); qwen2.5-7b b4 × 8k 21.1 vs 21.0 (56)) except 8 fused splits
# of G = 8 or 7 at b1 × 1k (64 and 56 states: 7.2 vs 6.8, 6.5 vs 6.2), which the split count
# does not pick (16 splits with the kernel); 64 keeps llama-3-8b's batch-1 plans on the fused
# merge they were timed with (the performance log, v14).
FUSED_MAX_STATES_PROGRAMMATIC = 64


@dataclass(frozen=True)
class SplitKernelConfig:
    """Compile-time shape of kernels/decode_split.cu for one (dtype, head_dim)."""

    dtype: str
    head_dim: int  # the data's (REAL_DIM); the kernel computes in ``width``
    num_warps: int
    stages: int
    m_tiles: int = 1  # M-tiles of 16 query rows per block; the warps are slots × m_tiles
    heads_as_n: bool = False  # the ≤ 8 query heads as the mma's N dimension (heads_as_n())
    kv_per_block: int = 1  # adjacent KV heads per block, one per warp of a slot (kv_per_block())
    l2_evict_first: bool = True  # K/V copies hint L2 evict-first (l2_evict_first())
    soft_cap: bool = False  # score_mod caps the scores (logits_soft_cap)
    alibi: bool = False  # score_mod adds ALiBi's linear bias (alibi_slopes)
    paged: bool = False  # the KV view reads a paged cache through a block table
    multi_q: bool = False  # q_len > 1 query tokens per sequence (MULTI_Q)
    kv_dtype: str | None = None  # an fp8 cache ("e4m3", "e5m2": KV_FP8), decoded in registers
    kv_scale_token: bool = False  # its scales per (token, KV head) (KV_SCALE_TOKEN)
    # the kernel reads the runtime options (appended tokens, a window, tokens_after, int64
    # lengths, sinks) from its parameters; False: a build for calls with none (runtime_options())
    runtime_options: bool = True

    @property
    def width(self) -> int:
        """The head_dim the kernel computes in (HEAD_DIM): head_dim rounded up to a kernel width."""
        return kernel_head_dim(self.head_dim)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def rings(self) -> int:
        """K/V rings: one per token slot and KV head, each read by its m_tiles warps."""
        return self.num_warps // self.m_tiles

    @property
    def slots(self) -> int:
        """Token slots (each with one ring per KV head of the block)."""
        return self.rings // self.kv_per_block

    @property
    def block_rows(self) -> int:
        return EIGHT_ROWS if eight_row_blocks(self.head_dim, self.kv_dtype) else ROWS * self.m_tiles

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory; mirrors SMEM_BYTES in decode_split.cu, which checks it at compile
        time against this figure (SMEM_BYTES_HOST in :meth:`defines`)."""
        es = ITEMSIZE[self.dtype]
        kv_es = 1 if self.kv_dtype else es
        q_rows = 8 * self.kv_per_block if self.kv_per_block > 1 else self.block_rows
        w = self.width
        q = q_rows * w * es
        pipe = self.rings * self.stages * 2 * TILE_N * w * kv_es
        acc = self.num_warps * ROWS * (w + 8) * 4  # rows padded (ACC_STRIDE)
        ml = 2 * self.num_warps * ROWS * 4
        live = -(-self.rings * self.stages * 4 // 16) * 16 if self.paged else 0  # LIVE_BYTES
        tscale = self.rings * self.stages * 2 * TILE_N * 4 if self.kv_scale_token else 0
        # NEW_BYTES: the appended tokens' rows (MULTI_Q: up to MAX_APPEND_Q_LEN of them), fp8:
        # their codes and one scale per row
        new_rows = MAX_APPEND_Q_LEN if self.multi_q else 1
        new = self.kv_per_block * 2 * w * kv_es * new_rows
        if self.kv_dtype:
            new += -(-2 * new_rows * 4 // 16) * 16
        return q + max(pipe, acc) + ml + live + tscale + new

    def defines(self) -> dict[str, int]:
        # REAL_DIM only where it differs: a kernel width's own build is the one it always was
        real = {"REAL_DIM": self.head_dim} if self.head_dim != self.width else {}
        return {
            "DTYPE_ID": DTYPE_IDS[self.dtype],
            "HEAD_DIM": self.width,
            **real,
            "NUM_WARPS": self.num_warps,
            "STAGES": self.stages,
            "ROWS": ROWS,
            "TILE_N": TILE_N,
            "MTILES": self.m_tiles,
            "HEADS_AS_N": int(self.heads_as_n),
            "KV_PER_BLOCK": self.kv_per_block,
            "L2_EVICT_FIRST": int(self.l2_evict_first),
            "SOFT_CAP": int(self.soft_cap),
            "ALIBI": int(self.alibi),
            "PAGED": int(self.paged),
            **({"MULTI_Q": 1} if self.multi_q else {}),
            **({"KV_FP8": 1 + KV_DTYPES.index(self.kv_dtype)} if self.kv_dtype else {}),
            **({"KV_SCALE_TOKEN": 1} if self.kv_scale_token else {}),
            **({} if self.runtime_options else {"RUNTIME_OPTIONS": 0}),
            "SMEM_BYTES_HOST": self.smem_bytes,
        }


def builds(config: SplitKernelConfig) -> list[SplitKernelConfig]:
    """The split kernel's two builds a plan of this block shape may launch: with the runtime
    options and without them (:func:`runtime_options`)."""
    return [config, replace(config, runtime_options=False)]


def runtime_options(new_tokens: bool, window: bool, sinks: bool, tokens_after: bool,
                    lengths_64: bool) -> bool:
    """Whether a call needs the split kernel's build that reads the runtime options from its
    parameters (SplitKernelConfig.runtime_options): appended tokens (k_new, v_new), a window,
    sinks, tokens_after, int64 device lengths. A call with none takes the build without them,
    where each is a constant: measured on the H200 (tools/ab.py, decode-step protocol, float16),
    the options' checks cost 1.2–4.8% of such a step (1 × 1k and 1 × 16k of 32/8/128, 71/1/64
    16 × 16k, 64/8/128 1 × 16k), nothing at 16 × 64k; without them the step is what it was before
    the options existed. A plan builds the other one at the first call that needs it."""
    return new_tokens or window or sinks or tokens_after or lengths_64


# Blocks of 8 query rows (eight_row_blocks: fp8 caches, head_dim 512) take the heads-as-N path
# whatever the group: G > 8 (or q_len · G > 8) takes several head tiles, each reading its KV
# head's chunk (the siblings' reads of it meet in L2), one KV head a block.
EIGHT_ROWS = 8
# head_dim 512 (WIDE_HEAD_DIM): a K or V tile is 16 KB, so a block's ring holds 3 warps × 2
# stages (192 KB; 96 KB in flight, twice what covers HBM latency at an SM's share of the
# bandwidth, as the other widths' default shapes); with several query tokens the appended
# rows' 32 KB (NEW_BYTES) leave room for 2 × 2.
WIDE_SHAPE = (3, 2)
WIDE_MULTI_Q_SHAPE = (2, 2)

# fp8 KV caches (kernels/decode_split.cu, KV_FP8): the formats, in the kernel's order (1, 2).
# Their blocks are of 8 query rows (EIGHT_ROWS); head_dim a multiple of 16 (whole
# 16-byte chunks of codes per row). (warps, stages) per width: the ring bytes of the 16-bit
# default shapes (128 KB), in tiles of half the bytes, over 8 warps (the decoding is
# instructions the 16-bit path does not have: more warps to issue them).
KV_DTYPES = ("e4m3", "e5m2")
FP8_HEAD_DIM_STEP = 16
FP8_SHAPES = {64: (8, 8), 128: (8, 4), 256: (8, 2)}
# Per-token scales (KV_SCALE_TOKEN): blocks that stream at least FP8_TOKEN_LONG_CHUNK tokens take
# 12 warps × 3 stages instead of 8 × 4 (each scale is a multiply per score and an exp2 per weight
# against a second running maximum: more warps to issue them and to hide their latency).
# Measured on the H200 (tools/ab.py, e4m3, 32/8/128, decode-step protocol): 4 × 64k (16k-token
# chunks) 146.1 → 137.1 µs, 16 × 8k (8k) 76.9 → 73.9; with 4k-token chunks (1 × 64k, 4 × 16k)
# 4–5% slower (42.6 → 44.3, 42.3 → 44.2), where the ring's start costs more than the warps
# gain. 16 × 2 was 2% faster still (133.7, 73.1) but sits at 128 registers a thread and spills
# on sm_90 with the soft-cap or e5m2; per-tensor and per-head scales stay 8 × 4 (16 × 2:
# 0.9–1.6% slower there).
FP8_TOKEN_LONG_CHUNK = 8192
FP8_TOKEN_LONG_SHAPES = {128: (12, 3)}


# Blocks that stream at least this many tokens take the long-chunk shape (below); heads-as-N
# blocks from HEADS_AS_N_LONG_CHUNK.
LONG_CHUNK = 2048


# G > 16 query heads per KV head, 16-bit types: (token slots, most M-tiles, stages) per head_dim.
# A block holds up to that many M-tiles of 16 rows, each computed by its own warp in every slot on
# the slot's shared K/V tiles, so one block reads the KV head's chunk once for all its query
# heads; the warps' register budget (one block of slots × M-tiles warps per SM) sets the most.
# Measured on the H200 (the performance log, v12; automatic splits): falcon-7b (71/1/64)
# b16 × 64k 201.9 µs with one M-tile per block → 133.3 µs with 3 slots × 6 stages (166.5 with
# 2 × 8); 48/1/128 b16 × 16k 58.3 → 44.2 µs with 2 × 4 (51.6 with 3 × 4).
MTILE_SHAPES = {64: (3, 5, 6), 128: (2, 4, 4), 256: (1, 4, 4)}
# A block of m M-tiles does m times the tile math of a one-M-tile block on each K/V tile (the
# math, not the bytes, sets its pace), so it pays only where each block streams long enough for
# that to outweigh spreading the head tiles' math over m times more SMs: with shorter chunks the
# plan keeps one M-tile per block (falcon-7b b1 × 16k: 10.0 µs that way, 26 splits × 5 head
# tiles; 11.1 with M-tiles, 128 splits of 128 tokens; b1 × 64k, 512 tokens: 18.6 vs 18.0).
MTILE_MIN_CHUNK = 512


def m_tiles(dtype: str, head_dim: int, group: int) -> int:
    """M-tiles per block for ``group`` query heads per KV head: as few blocks per KV head as the
    most M-tiles allow, their M-tiles spread evenly (e.g. G = 71 at head_dim 64: one block of 5).
    A plan falls back to 1 where its chunks are shorter than MTILE_MIN_CHUNK."""
    units = -(-group // ROWS)
    width = kernel_head_dim(head_dim)
    if dtype == "float32" or units <= 1 or width not in MTILE_SHAPES:  # (512: blocks of 8 rows)
        return 1
    most = MTILE_SHAPES[width][1]
    return -(-units // -(-units // most))


# The tensor-core path with the group's query heads as the mma's N dimension (8 columns) and the
# tile's tokens as M, instead of 16 query rows as M: for G ≤ 8 that path does half the mma,
# exponentials and accumulator work per tile (kernels/decode_split.cu, HEADS_AS_N).
HEADS_AS_N_MAX_GROUP = 8


def heads_as_n(dtype: str, group: int | None) -> bool:
    """Whether a one-M-tile block of ``group`` query heads per KV head takes the heads-as-N path:
    16-bit types, G ≤ HEADS_AS_N_MAX_GROUP (``group`` None: unknown, the 16-row path). (M-tile
    blocks, G > 16, never do: split_kernel_config gives them their own shapes.)"""
    return dtype != "float32" and group is not None and 1 <= group <= HEADS_AS_N_MAX_GROUP


def split_kernel_config(dtype: str, head_dim: int, chunk_tokens: int = 0,
                        m_tiles: int = 1, group: int | None = None,
                        kv_per_block: int = 1, kv_dtype: str | None = None) -> SplitKernelConfig:
    """Block shape for one specialisation: about 128 KB of K/V ring per block, one block per SM
    (with ``m_tiles`` > 1, 16-bit types only: the M-tile shape of MTILE_SHAPES, 64–72 KB of ring;
    the driver's occupancy calculator says how many such blocks an SM holds).

    Each warp keeps STAGES-1 tiles of K and V in flight; 4 warps × 3 tile pairs of 8 KB (16-bit
    types, head_dim 128) is 96 KB in flight per SM, about 2× what covers HBM latency at an SM's
    share of the bandwidth (4.5 TB/s / 132 SMs ≈ 34 GB/s × ~1.5 µs loaded latency ≈ 51 KB).
    Measured on the H200 (docs/PERFORMANCE.md), one such block per SM beat two blocks of half the
    depth: fewer, longer streams per SM and fewer blocks to start and merge.

    16-bit types spread that ring over 8 warps where the measurements say so (performance log,
    v7): fewer bytes in flight per warp, but twice the warps doing the tile math.
      head_dim 64: always (8 warps × 4 stages): 5–10% faster than 4 × 8 from 4k tokens up
        (same process; 1% slower at b1 × 1k), measured before a register spill of this shape was
        removed, which made batch 1 another 3–13% faster (v7, step 5).
      head_dim 128: for blocks that stream ``chunk_tokens`` ≥ LONG_CHUNK tokens (8 × 2 instead of
        4 × 4): 1–1.5% faster on long streams (b16 × 8k, b16 × 64k, b1 × 64k), slower on short
        ones (b1 × 16k, b16 × 1k), where the deeper ring's head start matters more.
      head_dim 256: 4 × 2 (8 warps would need a single stage).

    ``group`` (query heads per KV head) selects the heads-as-N path where :func:`heads_as_n`
    says so; its blocks take the long-chunk shape from HEADS_AS_N_LONG_CHUNK tokens instead of
    LONG_CHUNK (half the tile math per block: see there).

    ``kv_per_block`` > 1 (:func:`kv_per_block`): blocks of that many KV heads, heads-as-N, in
    the long-chunk shape whatever the chunk (one warp per KV head of each slot).
    """
    if dtype not in DTYPE_IDS:
        raise ValueError(f"unsupported dtype {dtype!r}")
    width = kernel_head_dim(head_dim)  # the shapes are the width's (they size shared memory)
    if not width_takes(dtype, width, kv_dtype) or (width == WIDE_HEAD_DIM
                                                   and (m_tiles > 1 or kv_per_block > 1)):
        raise ValueError(f"no block shape for {dtype} head_dim {head_dim}"
                         f"{f' over a {kv_dtype} cache' if kv_dtype else ''}, {m_tiles} M-tiles, "
                         f"{kv_per_block} KV heads a block")
    if width == WIDE_HEAD_DIM:  # its own shape, whatever the chunk
        warps, stages = WIDE_SHAPE
        return SplitKernelConfig(dtype, head_dim, num_warps=warps, stages=stages, heads_as_n=True)
    if kv_dtype is not None:  # an fp8 cache: its own shape (FP8_SHAPES), whatever the chunk
        if (kv_dtype not in KV_DTYPES or dtype == "float32" or m_tiles > 1 or kv_per_block > 1
                or head_dim % FP8_HEAD_DIM_STEP):
            raise ValueError(f"no fp8 ({kv_dtype!r}) block shape for {dtype} head_dim {head_dim}, "
                             f"{m_tiles} M-tiles, {kv_per_block} KV heads a block")
        warps, stages = FP8_SHAPES[width]
        return SplitKernelConfig(dtype, head_dim, num_warps=warps, stages=stages,
                                 heads_as_n=True, kv_dtype=kv_dtype)
    if m_tiles > 1 and kv_per_block > 1:
        raise ValueError(f"no block shape of {m_tiles} M-tiles and {kv_per_block} KV heads")
    if m_tiles > 1:
        slots, most, stages = MTILE_SHAPES.get(width, (0, 0, 0))
        if dtype == "float32" or m_tiles > most:
            raise ValueError(f"no block shape of {m_tiles} M-tiles for {dtype} head_dim {head_dim}")
        return SplitKernelConfig(dtype, head_dim, num_warps=slots * m_tiles, stages=stages,
                                 m_tiles=m_tiles)
    narrow = heads_as_n(dtype, group)
    if kv_per_block > 1:
        warps, stages = LONG_SHAPES.get(width, (0, 0))
        if not narrow or not warps or warps % kv_per_block:
            raise ValueError(f"no block shape of {kv_per_block} KV heads for {dtype} head_dim "
                             f"{head_dim}, {group} query heads per KV head")
        return SplitKernelConfig(dtype, head_dim, num_warps=warps, stages=stages,
                                 heads_as_n=True, kv_per_block=kv_per_block)
    if dtype == "float32":
        warps, stages = {64: (4, 4), 128: (4, 2), 256: (2, 2)}[width]
    elif (chunk_tokens >= (HEADS_AS_N_LONG_CHUNK if narrow else LONG_CHUNK)
          and width in LONG_SHAPES):
        warps, stages = LONG_SHAPES[width]
    else:
        warps, stages = {64: (8, 4), 128: (4, 4), 256: (4, 2)}[width]
    return SplitKernelConfig(dtype, head_dim, num_warps=warps, stages=stages, heads_as_n=narrow)


# (warps, stages) of the long-chunk shape: the same ring bytes as the default shape.
LONG_SHAPES = {128: (8, 2)}
# The heads-as-N path does half the tile math, so its blocks take the long-chunk shape from the
# chunk on where each of its 8 warps has a tile (measured on the H200, fp16 32/8/128, 8 × 2
# against 4 × 4: b1 × 2k −0.14 µs, b1 × 4k −0.28, b1 × 16k −0.30, b4 × 1k −0.30, b16 × 1k −0.50;
# with 64-token chunks, b1 × 1k, +0.24: half the warps idle).
HEADS_AS_N_LONG_CHUNK = 8 * TILE_N


# Heads-as-N blocks that stream at least this many tokens keep their warps in step: a block-wide
# barrier per tile instead of each warp waiting only for its own ring (kernels/decode_split.cu,
# warps_in_step). A heads-as-N warp's pace is set by its own ring, so (likely) its warps drift
# apart over a long stream. Measured on the H200, flag on vs off with the same plans (the
# performance log, v15): llama-3-8b b64 × 8k −1.41%, b4 × 64k −0.47%, b16 × 64k −0.27%,
# b1 × 256k −0.20%, qwen2.5-7b b16 × 64k ±0, gemma-2b b16 × 64k +0.17%; as a timing experiment
# on 1024-token chunks (b1 × 16k) +1.7%, hence the threshold.
WARPS_IN_STEP_MIN_CHUNK = 8192


# Static shared memory of the split kernel beside its dynamic SMEM_BYTES (the epilogue's row
# states and tokens, the merge's flag): at most this many bytes (ptxas reports 128–964).
SPLIT_STATIC_SMEM_BYTES = 1024


@dataclass(frozen=True)
class Tuning:
    """Overrides of the launch policy's block shape for one :class:`DecodePlan`, for A/B
    measurements of kernel shapes in one process (tools/ab.py). Each field left None keeps the
    policy's choice; the split count stays the policy's (or the plan's num_splits/split_size).

    num_warps, stages: the split kernel's warps per block and K/V ring depth (tiles per warp);
    l2_evict_first: the L2 evict-first hint on the K/V copies; warps_in_step: the block's warps
    meet at a barrier per tile (one-M-tile blocks only; a block whose slots have unequal tile
    counts runs unsynchronised whatever this says); kv_groups: False keeps one KV head a block
    where the policy would take blocks of several adjacent KV heads (:func:`kv_per_block`,
    :func:`burst_kv_per_block`; the split count is then chosen for one-head blocks). An override
    that the kernel cannot build or the GPU cannot hold is refused when the plan is made.
    """

    num_warps: int | None = None
    stages: int | None = None
    l2_evict_first: bool | None = None
    warps_in_step: bool | None = None
    kv_groups: bool | None = None


def tuned(config: SplitKernelConfig, tuning: Tuning | None) -> SplitKernelConfig:
    """``config`` with ``tuning``'s block-shape overrides (the policy's values where None)."""
    if tuning is None:
        return config
    changes = {name: getattr(tuning, name) for name in ("num_warps", "stages", "l2_evict_first")
               if getattr(tuning, name) is not None}
    return replace(config, **changes) if changes else config


def warps_in_step(config: SplitKernelConfig, chunk_tokens: int,
                  tuning: Tuning | None = None) -> bool:
    """Whether a plan's blocks keep their warps in step (a runtime flag of the split kernel):
    heads-as-N blocks of several KV heads always (reading their heads' row pieces together is
    their point), others on chunks of at least WARPS_IN_STEP_MIN_CHUNK tokens; ``tuning``'s
    warps_in_step instead where it sets one."""
    if tuning is not None and tuning.warps_in_step is not None:
        return tuning.warps_in_step
    return config.heads_as_n and (config.kv_per_block > 1
                                  or chunk_tokens >= WARPS_IN_STEP_MIN_CHUNK)


def split_kernel_configs(dtype: str, head_dim: int) -> list[SplitKernelConfig]:
    """Every block shape a plan of this dtype and head_dim can use, with and without the L2
    evict-first hint (for compile checks). (None for a dtype the width does not take.)"""
    width = kernel_head_dim(head_dim)
    if width == WIDE_HEAD_DIM:  # one shape
        configs = [split_kernel_config(dtype, head_dim)] if width_takes(dtype, width) else []
        return configs + [replace(c, l2_evict_first=False) for c in configs]
    most = 1 if dtype == "float32" else MTILE_SHAPES[width][1]
    configs = [split_kernel_config(dtype, head_dim, c, m, g)
               for m in range(1, most + 1) for c in (0, LONG_CHUNK) for g in (None, 1)]
    if heads_as_n(dtype, 1) and head_dim in KV_GROUP_HEAD_DIMS:
        configs.append(split_kernel_config(dtype, head_dim, group=1, kv_per_block=KV_GROUP))
    configs += [replace(c, l2_evict_first=False) for c in configs if l2_hint_is_chosen(dtype)]
    return list(dict.fromkeys(configs))


def multi_q_config(config: SplitKernelConfig) -> SplitKernelConfig:
    """``config`` for several query tokens per sequence (MULTI_Q): at head_dim 512, in
    WIDE_MULTI_Q_SHAPE (its appended rows' shared memory)."""
    if config.width == WIDE_HEAD_DIM:
        config = replace(config, num_warps=WIDE_MULTI_Q_SHAPE[0], stages=WIDE_MULTI_Q_SHAPE[1])
    return replace(config, multi_q=True)


def fp8_kernel_configs(dtype: str, head_dim: int, kv_dtype: str) -> list[SplitKernelConfig]:
    """The block shapes of plans over an fp8 cache of this q dtype and head_dim: scales per
    tensor or head, or per token (both of its shapes); with and without the L2 hint."""
    c = split_kernel_config(dtype, head_dim, kv_dtype=kv_dtype)
    configs = [c, fp8_token_config(c, 0), fp8_token_config(c, FP8_TOKEN_LONG_CHUNK)]
    return configs + [replace(x, l2_evict_first=False) for x in configs]


def fp8_token_config(config: SplitKernelConfig, chunk_tokens: int) -> SplitKernelConfig:
    """The block shape of an fp8 plan (``config``) for caches with per-token scales: the same
    kernel with KV_SCALE_TOKEN, over FP8_TOKEN_LONG_SHAPES' warps and stages where its blocks
    stream at least FP8_TOKEN_LONG_CHUNK tokens."""
    shape = FP8_TOKEN_LONG_SHAPES.get(config.width) if chunk_tokens >= FP8_TOKEN_LONG_CHUNK else None
    if shape is None:
        return replace(config, kv_scale_token=True)
    return replace(config, kv_scale_token=True, num_warps=shape[0], stages=shape[1])


def compile_check_configs() -> list[SplitKernelConfig]:
    """What the compile checks build (tests/test_compile.py, tools/sass_compare.py): every
    block shape of every dtype and head_dim (:func:`split_kernel_configs`) as the build for calls
    without runtime options, and each shape with the compile-time switches on — the soft-cap,
    ALiBi and the paged KV view together, with the runtime options, the most registers any can
    take (each alone is a subset of that code; their code is the same in all shapes, the
    registers not). At head_dims whose row piece is not whole bursts, the blocks of several KV
    heads they take (burst_kv_groups)."""
    configs = [c for dt in DTYPE_IDS for d in KERNEL_HEAD_DIMS
               for c in split_kernel_configs(dt, d)]
    # head_dims between the widths (the zero-filled copies): each dtype's default shape, and the
    # heads-as-N and M-tile shapes of the 16-bit types (bfloat16's copies are float16's)
    for d in COMPILE_CHECK_HEAD_DIMS:
        configs += [split_kernel_config("float32", d), split_kernel_config("float16", d),
                    split_kernel_config("float16", d, group=1),
                    split_kernel_config("float16", d, LONG_CHUNK, m_tiles=2)]
        configs += [split_kernel_config("float16", d, group=1, kv_per_block=k)
                    for k in burst_kv_groups("float16", d, 1, 4)]  # blocks of KV heads (80)
    # fp8 caches: float16 q over e4m3 at every width (each shape a plan can take), and the
    # scale modes of head_dims 80 and 96 between the widths, of e5m2 and of bfloat16 q (their
    # decoding differs by a few instructions; the hint by the copy instruction alone)
    configs += [c for d in KERNEL_HEAD_DIMS if width_takes("float16", d, "e4m3")
                for c in fp8_kernel_configs("float16", d, "e4m3")]
    configs += [c for dt, d, f in (("float16", 80, "e4m3"), ("float16", 96, "e4m3"),
                                   ("float16", 128, "e5m2"), ("bfloat16", 128, "e4m3"))
                for c in fp8_kernel_configs(dt, d, f) if c.l2_evict_first]
    switched = [replace(c, soft_cap=True, alibi=True, paged=True)
                for c in configs if c.l2_evict_first]
    # (several query tokens where a block holds one KV head; at head_dim 512 also without them:
    # its own shape, the single-token plans' paged shape)
    plain = [replace(c, runtime_options=False) for c in configs]
    return plain + [multi_q_config(c) if c.kv_per_block == 1 else c for c in switched] + [
        c for c in switched if c.width == WIDE_HEAD_DIM]


# head_dims the compile checks build besides the widths: the smallest, and models' (StableLM and
# Phi-2 80, Phi-3 96, 192)
COMPILE_CHECK_HEAD_DIMS = (32, 80, 96, 192)


# The split kernel's K/V copies carry an L2 evict-first hint (kernels/decode_split.cu) only on
# calls that read at most this many bytes of K and V (the plan's capacity: batch × max_seqlen).
# In a decode step, L2 holds the other kernels' lines (weights, activations) when attention
# starts; measured on the H200 in the decode-step protocol (fp16 32/8/128, hint → no hint,
# docs/PERFORMANCE.md): b1 × 16k (67 MB) 23.19 → 24.62 µs, b4 × 8k (134 MB) 39.37 → 39.88, but
# b1 × 64k (268 MB) 70.54 → 69.00, b16 × 4k 69.09 → 67.66, b16 × 16k 248.3 → 243.7, b64 × 8k
# 484.0 → 478.3, b16 × 64k 950.9 → 945.6. (Back to back, with L2 holding only K/V lines, the
# hint was 0.3–0.9 µs faster at every one of these points.)
EVICT_FIRST_MAX_KV_BYTES = 192 * 2**20


def l2_hint_is_chosen(dtype: str) -> bool:
    """Whether plans of ``dtype`` choose the hint per call: the 16-bit types, where it was
    measured; float32 plans (not a serving dtype) always take it."""
    return dtype != "float32"


def l2_evict_first(dtype: str, kv_bytes: int) -> bool:
    """Whether a call of ``dtype`` that reads ``kv_bytes`` of K and V streams them with the L2
    evict-first hint (EVICT_FIRST_MAX_KV_BYTES, l2_hint_is_chosen)."""
    return not l2_hint_is_chosen(dtype) or kv_bytes <= EVICT_FIRST_MAX_KV_BYTES


# Blocks of KV_GROUP adjacent KV heads (kernels/decode_split.cu, KV_PER_BLOCK): in the public
# (batch, seqlen, kv_heads, head_dim) cache a KV head's rows are one 256-byte piece of each
# token's row at head_dim 128 fp16 (2 KB apart at 8 KV heads), and a block streaming one head
# over a long chunk read measurably slower than with each head's tokens contiguous (b16 × 64k
# 947 vs 939 µs; cuDNN 942 either way). Blocks of 4 KV heads (1 KB of each token's row), their
# warps in step, stream up to 1.2% faster, but take 4 times fewer blocks per split, so more
# splits and a merge, or fewer, longer blocks (H200, grouped against one head per block;
# the performance log, v17):
#   grouped plan, one wave          b64 × 8k, b64 × 16k, 70b b64 × 8k, qwen b128 × 8k,
#     of 1 split                    llama-2 b16 × 16k–32k: −0.41 to −0.97%
#     of 2–4 splits of 16k tokens   b32 × 32k, b16 × 64k (fp16, bf16, 70b): −0.39 to −1.24%
#     of 2 splits of 8k tokens      b32 × 16k −0.35 to −0.40%, qwen b64 × 16k +0.59%
#     of 4 splits of 4k–8k tokens   b16 × 32k +0.05 to +0.22%, b16 × 16k (8b, 70b) +1.25%, +2.14%
#   grouped plan of two waves       b128 × 8k: +0.92%
# (8 KV heads a block: more splits still, and mixed.) So plans that would stream one split of at
# least KV_GROUP_MIN_TOKENS tokens take grouped blocks where the grouped plan is one wave of one
# split, or of splits of at least 2 · KV_GROUP_MIN_TOKENS tokens (kv_group_pays).
KV_GROUP = 4
KV_GROUP_HEAD_DIMS = (128,)
KV_GROUP_MIN_TOKENS = 8192


def kv_group_pays(num_splits: int, chunk_tokens: int, blocks: int, slots: int) -> bool:
    """Whether a grouped plan of ``blocks`` blocks, ``num_splits`` splits of ``chunk_tokens``
    tokens, on ``slots`` resident blocks, beats one KV head per block (the table above): one
    wave, and one split or splits of at least 2 · KV_GROUP_MIN_TOKENS tokens."""
    return blocks <= slots and (num_splits == 1 or chunk_tokens >= 2 * KV_GROUP_MIN_TOKENS)


def kv_per_block(dtype: str, head_dim: int, group: int, num_kv_heads: int, num_splits: int,
                 chunk_tokens: int, forced: bool = False) -> int:
    """KV heads per block for a plan whose one-KV-head blocks would take ``num_splits`` splits of
    ``chunk_tokens`` tokens: KV_GROUP for long one-split streams of the heads-as-N path at
    KV_GROUP_HEAD_DIMS with a multiple of KV_GROUP KV heads, else 1 (always 1 where the caller
    ``forced`` the split count or size)."""
    if (forced or num_splits != 1 or chunk_tokens < KV_GROUP_MIN_TOKENS
            or not heads_as_n(dtype, group) or head_dim not in KV_GROUP_HEAD_DIMS
            or num_kv_heads % KV_GROUP):
        return 1
    return KV_GROUP


# Blocks of adjacent KV heads also where one KV head's piece of a token's row is not a whole
# number of the 64-byte bursts HBM reads in (2 · head_dim bytes: 160 at head_dim 80, 224 at
# 112; 192 at 96 is three whole ones): a block streaming one such head reads the bursts it
# shares with its neighbour heads' blocks at other times, so some bursts are read twice.
# Measured on the H200 (decode-step protocol, fp16, NHD cache; blocks of k KV heads against one):
#   phi-2 32/32/80   1 × 16k  k=2 (8 splits) 0.965×, k=4 (16 splits) 0.957×
#                    1 × 64k  k=2 (8) 0.948×, k=4 (16) 0.931×
#                   16 × 16k  k=2 (1) 0.938×, k=4 (1) 0.910×;  16 × 64k  0.876×, 0.847×
#   32/8/112         1 × 64k  k=2 (32 splits) 1.004×, k=4 (64) 1.038×
#                   16 × 16k  k=2 (2) 0.920×, k=4 (4) 1.023×
#   32/32/96 (whole bursts)   k=2, 4: 1.12–1.14× (slower): aligned head_dims keep the rule above.
# The same cache stored head-major (HND, each head's rows contiguous) took 0.914× and 0.926× at
# phi-2's 1 × 64k and 16 × 16k. So such head_dims take the grouped plan (BURST_KV_GROUPS whose
# k heads' piece is whole bursts) with the fewest splits, ties to more heads, where that plan
# has at most BURST_GROUP_MAX_SPLITS splits (burst_kv_per_block).
BURST_BYTES = 64
BURST_KV_GROUPS = (4, 2)
BURST_GROUP_MAX_SPLITS = 16


def burst_kv_groups(dtype: str, head_dim: int, group: int, num_kv_heads: int) -> tuple[int, ...]:
    """KV heads per block (BURST_KV_GROUPS) a plan may take because one KV head's piece of a
    token's row is not whole bursts: those whose piece is, that divide ``num_kv_heads``, on the
    heads-as-N path at a width with a block shape of several KV heads; () where none."""
    piece = head_dim * ITEMSIZE[dtype]
    if (piece % BURST_BYTES == 0 or not heads_as_n(dtype, group)
            or kernel_head_dim(head_dim) not in LONG_SHAPES):
        return ()
    return tuple(k for k in BURST_KV_GROUPS
                 if (k * piece) % BURST_BYTES == 0 and num_kv_heads % k == 0)


def block_rows(group: int, m_tiles: int = 1, kv_per_block: int = 1,
               eight_rows: bool = False) -> int:
    """Live query rows of one block: its M-tiles' rows of one KV head (at most the group; blocks
    of ``eight_rows`` (eight_row_blocks): at most EIGHT_ROWS), or all query heads of its KV heads."""
    if eight_rows:
        return min(group, EIGHT_ROWS)
    return kv_per_block * group if kv_per_block > 1 else min(group, ROWS * m_tiles)


def head_tiles(group: int, m_tiles: int = 1, eight_rows: bool = False) -> int:
    """Blocks per KV head: one per ``m_tiles`` · 16 query heads of the group (blocks of
    ``eight_rows``: per 8)."""
    return -(-group // (EIGHT_ROWS if eight_rows else ROWS * m_tiles))


def narrow_plan_shape(dtype: str, kv_dtype: str | None, head_dim: int, group: int, batch: int,
                      num_kv_heads: int, max_seqlen: int, num_sms: int, blocks_per_sm,
                      num_splits: int | None = None, split_size: int | None = None,
                      merge: str = "auto", programmatic: bool = False) -> tuple[int, int]:
    """``(num_splits, chunk_tokens)`` of a plan of blocks of 8 query rows (eight_row_blocks: an
    fp8 cache, head_dim 512; one M-tile, one KV head a block, head tiles of EIGHT_ROWS rows):
    forced, fixed by ``split_size``, or chosen by :func:`choose_num_splits` for its block shape."""
    if num_splits is not None:
        return num_splits, chunk_for_splits(max_seqlen, num_splits)
    if split_size is not None:
        return fixed_split_size(max_seqlen, split_size)
    config = split_kernel_config(dtype, head_dim, group=group, kv_dtype=kv_dtype)
    return choose_num_splits(batch * num_kv_heads * head_tiles(group, 1, True), max_seqlen,
                             num_sms, blocks_per_sm(config),
                             rows_per_block=block_rows(group, eight_rows=True),
                             head_dim=head_dim, merge=merge, dtype=dtype, group=group,
                             programmatic=programmatic, kv_dtype=kv_dtype)


def chunk_for_splits(max_seqlen: int, num_splits: int) -> int:
    """Tokens per split so that ``num_splits`` chunks cover ``max_seqlen`` (≥ 1)."""
    return max(1, -(-max_seqlen // max(1, num_splits)))


def merge_groups(num_states: int) -> int:
    """Groups of MERGE_STATES_PER_TRIP states: one L2 trip of one warp each."""
    return -(-num_states // MERGE_STATES_PER_TRIP)


def fused_merge_trips(num_splits: int, rows_per_block: int, head_dim: int, num_warps: int) -> int:
    """Serial L2 trips of one warp in the fused merge: the merging block's ``num_warps`` warps
    take the (row, pass) items of its ``rows_per_block`` rows, 16 splits per trip."""
    items = rows_per_block * -(-head_dim // FUSED_PASS)
    return merge_groups(num_splits) * -(-items // num_warps)


def merge_mode(num_splits: int, rows_per_block: int, head_dim: int, num_warps: int,
               merge: str = "auto", programmatic: bool = False) -> str:
    """How a plan merges its splits: ``"none"`` (one split), or ``merge`` when forced, else
    ``"fused"`` where the fused merge takes one trip per warp and ``"kernel"`` where it would take
    more (measured on the H200: 7 rows × 16 splits on 4 warps, 18.6 µs with the kernel vs 20.0
    fused at qwen2.5-7b b1 × 16k; 8 rows of head_dim 256 × 64 splits, 26.6 vs 39.3 µs at
    gemma-2b b1 × 16k, even with the kernel's former one warp per row; the performance log, v9).
    With ``programmatic`` (the merge kernel launched as a programmatic dependent), merges of more
    than FUSED_MAX_STATES_PROGRAMMATIC states per block (rows × splits) take the kernel too."""
    if num_splits <= 1:
        return "none"
    if merge != "auto":
        return merge
    if programmatic and rows_per_block * num_splits > FUSED_MAX_STATES_PROGRAMMATIC:
        return "kernel"
    return "fused" if fused_merge_trips(num_splits, rows_per_block, head_dim, num_warps) <= 1 else "kernel"


def merge_launch(rows: int, head_dim: int, num_states: int) -> tuple[int, int, int]:
    """``(blocks, threads, warps_per_item)`` of kernels/merge_states.cu: an item is one pass (32 ·
    merge_vec elements) of one row; its groups of 16 states go to up to MERGE_WARPS warps (a
    power of two, so that items tile a block), MERGE_WARPS warps per block."""
    groups = merge_groups(num_states)
    warps_per_item = 1
    while warps_per_item < min(groups, MERGE_WARPS):
        warps_per_item *= 2
    # the kernel relies on it: whole items per block, no more warps per item than it shares
    assert MERGE_WARPS % warps_per_item == 0
    items = rows * -(-head_dim // (32 * merge_vec(head_dim)))
    items_per_block = MERGE_WARPS // warps_per_item
    return max(1, -(-items // items_per_block)), 32 * MERGE_WARPS, warps_per_item


def merge_cost_bytes(num_splits: int, rows_per_block: int, head_dim: int, num_warps: int,
                     merge: str = "auto", programmatic: bool = False) -> int:
    """The merge's estimated tail in bytes of streaming at full speed (0 for one split)."""
    mode = merge_mode(num_splits, rows_per_block, head_dim, num_warps, merge, programmatic)
    if mode == "none":
        return 0
    if mode == "fused":
        return MERGE_OVERHEAD_BYTES + MERGE_TRIP_BYTES * (
            fused_merge_trips(num_splits, rows_per_block, head_dim, num_warps) - 1)
    warps_per_item = merge_launch(1, head_dim, num_splits)[2]  # one group each per trip
    trips = -(-merge_groups(num_splits) // warps_per_item)
    launch = MERGE_KERNEL_BYTES_PROGRAMMATIC if programmatic else MERGE_KERNEL_BYTES
    return MERGE_OVERHEAD_BYTES + launch + MERGE_TRIP_BYTES * (trips - 1)


def choose_num_splits(work_blocks: int, max_seqlen: int, num_sms: int, blocks_per_sm: int,
                      rows_per_block: int = ROWS, head_dim: int = 128,
                      min_chunk: int = MIN_CHUNK, merge: str = "auto", dtype: str = "float16",
                      m_tiles: int = 1, group: int | None = None,
                      programmatic: bool = False, kv_per_block: int = 1,
                      kv_dtype: str | None = None) -> tuple[int, int]:
    """Split count and chunk length for a grid of ``work_blocks`` (batch × units × head tiles,
    a unit being one KV head, or ``kv_per_block`` of them).

    Returns ``(num_splits, chunk_tokens)``. Chunks are multiples of SPLIT_GRANULE tokens and at
    least ``min_chunk`` long; ``num_splits`` is the number of chunks that cover ``max_seqlen``.

    Estimated cost of ``s`` splits, in bytes of HBM traffic at full speed:
        (KV bytes(s) + partial bytes(s)) / wave_efficiency(s) + merge_cost_bytes(s)
    where wave_efficiency = blocks / (waves · slots), slots = num_sms · blocks_per_sm. KV bytes
    are one KV head's per unit: the cache's for one-KV-head blocks, but 1 / kv_per_block of it for
    blocks of several KV heads, whose merge and partials then weigh kv_per_block times more
    against the stream. The grouped plans were measured and shipped with that weighting (v17);
    counting their whole cache instead moves 26 of 358 grouped plans of a grid of shapes to more
    splits (llama-3-8b b16 × 256k: 33 splits, many waves), which kv_group_pays then refuses; b16 ×
    256k took 3785.7 µs with one KV head per block (v16 sweep) and 3727.0 grouped (v17). So it
    stays until the cost prices what a block's start costs (not yet measured). In one wave, where the
    longest block sets the end, KV bytes are counted as s whole chunks per sequence (s · chunk ≥ max_seqlen tokens: 31 chunks of 2176 tokens for 65536
    end 6% later than 32 of 2048, measured 1.0 µs slower at qwen2.5-7b b1 × 64k). The
    partials are written and read once: work_blocks · s · rows · (head_dim + 1) · 4 · 2 bytes,
    and the merge (fused or a second kernel, as merge_mode picks it for ``merge`` and
    ``programmatic``) costs a fixed tail plus its serial L2 trips beyond the first. The fused
    merge's warps are those of the block shape each candidate's chunk length selects for
    ``dtype``, ``m_tiles``, ``group`` and ``kv_per_block`` (split_kernel_config).
    The smallest s within 3% of the best estimate wins (fewer partials, shorter merge).

    Worked example (H200: 132 SMs, 1 block/SM → 132 slots; llama-3-8b: 8 KV heads, G = 4):
      batch 1, 16384 tokens: 8 blocks. s = 1 uses 8 of 132 slots (efficiency 0.06). s = 16 gives
      chunks of 1024 tokens and 128 blocks in one wave (0.97) for 0.5 MB of partials on 67 MB of
      KV: chosen.
      batch 64, 8192 tokens: 512 blocks = 3.9 waves (0.97) with no split at all: s = 1, and the
      split kernel writes the output directly, no merge kernel.
    """
    if max_seqlen <= 0 or work_blocks <= 0:
        return 1, max(1, max_seqlen)
    slots = max(1, num_sms * blocks_per_sm)
    kv_bytes = work_blocks * max_seqlen * head_dim * (1 if kv_dtype else ITEMSIZE[dtype]) * 2
    granules = -(-max_seqlen // SPLIT_GRANULE)
    min_granules = max(1, min_chunk // SPLIT_GRANULE)
    best: list[tuple[float, int, int]] = []
    seen = set()
    for want in range(1, min(MAX_SPLITS, granules) + 1):
        chunk_granules = -(-granules // want)
        if want > 1 and chunk_granules < min_granules:
            break
        chunk = chunk_granules * SPLIT_GRANULE
        s = -(-max_seqlen // chunk)
        if s in seen:
            continue
        seen.add(s)
        blocks = work_blocks * s
        waves = math.ceil(blocks / slots)
        eff = blocks / (waves * slots)
        stream = kv_bytes if waves > 1 else kv_bytes * (s * min(chunk, max_seqlen)) / max_seqlen
        partial = 0 if s == 1 else work_blocks * s * rows_per_block * (head_dim + 1) * 8
        warps = split_kernel_config(dtype, head_dim, chunk, m_tiles, group, kv_per_block,
                                    kv_dtype).num_warps
        cost = (stream + partial) / eff + merge_cost_bytes(s, rows_per_block, head_dim, warps,
                                                           merge, programmatic)
        best.append((cost, s, chunk))
    if not best:
        return 1, max_seqlen
    lowest = min(c for c, _, _ in best)
    for cost, s, chunk in sorted(best, key=lambda x: x[1]):
        if cost <= lowest * 1.03:
            return s, chunk
    raise AssertionError("unreachable")


def fixed_split_size(max_seqlen: int, split_size: int) -> tuple[int, int]:
    """``(num_splits, chunk_tokens)`` for a caller-fixed split size (batch-independent results)."""
    return max(1, -(-max_seqlen // split_size)), split_size


def plan_shape(dtype: str, head_dim: int, group: int, batch: int, num_kv_heads: int,
               max_seqlen: int, num_sms: int, blocks_per_sm, num_splits: int | None = None,
               split_size: int | None = None, merge: str = "auto",
               programmatic: bool = False, kv_groups: bool = True) -> tuple[int, int, int, int]:
    """``(m_tiles, num_splits, chunk_tokens, kv_per_block)`` of a plan: the split count forced,
    fixed by ``split_size``, or chosen by :func:`choose_num_splits` for the block shape of each candidate
    ``m_tiles`` (``blocks_per_sm(config)``: resident blocks of that shape per SM, from the
    driver). G > 16 takes several M-tiles per block (:func:`m_tiles`) where each block then
    streams at least MTILE_MIN_CHUNK tokens, and one M-tile per block otherwise.
    ``programmatic``: the merge kernel is launched as a programmatic dependent (merge_mode).
    One-M-tile plans then take blocks of several KV heads where :func:`kv_per_block` says so and
    the split count chosen again for their fewer blocks pays for its merge (:func:`kv_group_pays`);
    never where the split count or size is the caller's, nor without ``kv_groups`` (``group``
    is then the q_len · G query rows of several query tokens per KV head: MULTI_Q blocks hold
    one KV head)."""
    forced = num_splits is not None or split_size is not None
    for mt in dict.fromkeys((m_tiles(dtype, head_dim, group), 1)):
        if num_splits is not None:
            splits, chunk = num_splits, chunk_for_splits(max_seqlen, num_splits)
        elif split_size is not None:
            splits, chunk = fixed_split_size(max_seqlen, split_size)
        else:
            splits, chunk = choose_num_splits(
                batch * num_kv_heads * head_tiles(group, mt), max_seqlen, num_sms,
                blocks_per_sm(split_kernel_config(dtype, head_dim, m_tiles=mt, group=group)),
                rows_per_block=block_rows(group, mt), head_dim=head_dim,
                merge=merge, dtype=dtype, m_tiles=mt, group=group,
                programmatic=programmatic)
        if mt > 1 and chunk >= MTILE_MIN_CHUNK:
            return mt, splits, chunk, 1
        if mt == 1 and kv_groups and not forced:
            burst = burst_kv_per_block(dtype, head_dim, group, batch, num_kv_heads, max_seqlen,
                                       num_sms, blocks_per_sm, merge, programmatic)
            if burst is not None:
                return (1, *burst)
        if mt == 1:
            kpb = (kv_per_block(dtype, head_dim, group, num_kv_heads, splits, chunk, forced)
                   if kv_groups else 1)
            if kpb > 1 and not forced:
                units = batch * (num_kv_heads // kpb)
                bps = blocks_per_sm(split_kernel_config(dtype, head_dim, group=group,
                                                        kv_per_block=kpb))
                grouped = choose_num_splits(
                    units, max_seqlen, num_sms, bps, rows_per_block=block_rows(group, 1, kpb),
                    head_dim=head_dim, merge=merge, dtype=dtype, group=group,
                    programmatic=programmatic, kv_per_block=kpb)
                if not kv_group_pays(*grouped, units * grouped[0], num_sms * bps):
                    return 1, splits, chunk, 1
                splits, chunk = grouped
            return 1, splits, chunk, kpb
    raise AssertionError("unreachable: m_tiles 1 always returns")


def burst_kv_per_block(dtype: str, head_dim: int, group: int, batch: int, num_kv_heads: int,
                       max_seqlen: int, num_sms: int, blocks_per_sm, merge: str = "auto",
                       programmatic: bool = False) -> tuple[int, int, int] | None:
    """``(num_splits, chunk_tokens, kv_per_block)`` of the grouped plan a head_dim whose row
    piece is not whole bursts takes (BURST_KV_GROUPS above): of the groups burst_kv_groups
    allows, the one whose split count (choose_num_splits for its fewer blocks) is fewest, ties
    to more KV heads a block, if at most BURST_GROUP_MAX_SPLITS; else None."""
    plans = []
    for k in burst_kv_groups(dtype, head_dim, group, num_kv_heads):
        bps = blocks_per_sm(split_kernel_config(dtype, head_dim, group=group, kv_per_block=k))
        splits, chunk = choose_num_splits(
            batch * (num_kv_heads // k), max_seqlen, num_sms, bps,
            rows_per_block=block_rows(group, 1, k), head_dim=head_dim, merge=merge, dtype=dtype,
            group=group, programmatic=programmatic, kv_per_block=k)
        plans.append((splits, -k, chunk))
    if not plans:
        return None
    splits, neg_k, chunk = min(plans)
    return (splits, chunk, -neg_k) if splits <= BURST_GROUP_MAX_SPLITS else None


def merge_vec(head_dim: int) -> int:
    """Elements per thread in kernels/merge_states.cu."""
    return 4 if head_dim % 4 == 0 else 1


# quantize_kv (kernels/quantize_kv.cu): one warp per (token, KV head) row of at most this many
# elements (8 per lane); blocks of 8 warps, at most 4 blocks per SM in grid-stride order.
QUANTIZE_MAX_HEAD_DIM = 256
QUANTIZE_THREADS = 256


def quantize_launch(rows: int, sm_count: int) -> tuple[int, int]:
    """(blocks, threads) of quantize_kv for ``rows`` rows."""
    per_block = QUANTIZE_THREADS // 32
    return max(1, min(-(-rows // per_block), 4 * sm_count)), QUANTIZE_THREADS
