// decode_split.cu — FlashDecoding, kernel 1 of 2: one chunk of the KV cache per block.
//
// Math (notation of docs/DESIGN.md). For one query row q, keys k_j, values v_j, scale c:
//   s_j   = c · q·k_j
//   m_i   = max_{j∈i} s_j,  l_i = Σ_{j∈i} exp(s_j − m_i),  V_i = Σ_{j∈i} exp(s_j − m_i) v_j
//   Õ_i   = V_i / l_i,      LSE_i = m_i + log(l_i)
// Inside the kernel scores live in the log2 domain, s2_j = s_j · log2(e), so every exponential
// is one ex2 instruction; LSE_i leaves the kernel in natural log (LSE = ln2 · (m2 + log2 l)).
// An empty chunk (or empty sequence) writes Õ_i = 0 and LSE_i = −inf and never forms NaN.
//
// Grid mapping:  blockIdx.x = kv_head · head_tiles + head_tile,  blockIdx.y = split,
//                blockIdx.z = batch  (with KV_PER_BLOCK > 1, below: blockIdx.x = the block's
//                group of KV_PER_BLOCK KV heads; head_tiles is 1 there).
// KV heads vary fastest, so the blocks that start together read the same tokens of every KV head
// (one token's heads are adjacent in memory: 2 KB rows at 8 heads × 128 × fp16) — measured 4–8%
// faster than splits-fastest on large batches (docs/PERFORMANCE.md). Sibling head tiles of one KV
// head (G > 16) are adjacent too, so they share the chunk through L2.
// A block owns MTILES M-tiles of ROWS (16) query rows, BLOCK_ROWS in all: query heads
// kv_head·G + head_tile·BLOCK_ROWS + r, r < BLOCK_ROWS and < G. All query heads of a KV head are
// in the block where G ≤ BLOCK_ROWS (the host makes it so up to its largest MTILES), so each K/V
// byte is read once.
//
// Block: NUM_WARPS warps = SLOTS token slots × MTILES M-tiles; warp w has M-tile w % MTILES and
// slot w / MTILES. The chunk is cut into tiles of TILE_N tokens; slot t takes tiles t, t + SLOTS,
// ... (so the block streams contiguous memory), each through its slot's STAGES-deep cp.async ring
// of K and V tiles in shared memory. Every warp keeps its own online-softmax state for its
// M-tile's 16 rows over its slot's tiles; the warps' states are merged once at the end (the same
// merge as kernel 2). MTILES = 1 (G ≤ 16): each warp is a slot with a ring of its own. MTILES > 1
// (G > 16): the slot's first warp loads each tile once and the slot's MTILES warps all compute
// on it, meeting at a named barrier per tile. (KV_PER_BLOCK > 1, below: NUM_WARPS = SLOTS ×
// KV_PER_BLOCK, one warp and ring per KV head of each slot.)
//
// Two compute paths on the same pipeline:
//   float16 / bfloat16: tensor cores (mma.m16n8k16, fp32 accumulate). Few instructions per byte
//     is what lets one SM keep up with HBM. Two fragment arrangements:
//     HEADS_AS_N = 0: S = Q·Kᵀ with the 16 query rows as the M dimension (rows ≥ G are zero
//       padding); P·V with P taken straight from the S accumulator registers.
//     HEADS_AS_N = 1 (G ≤ 8, one M-tile): the transposed products Sᵀ = K·Qᵀ and Oᵀ = Vᵀ·Pᵀ, the
//       tile's 16 tokens as M and the group's ≤ 8 query heads as N, so no mma works on padding
//       rows: half the mma, exponentials and accumulator registers per tile. Pᵀ reaches the B
//       operand of the second product through one register transpose (movmatrix) per 8 tokens.
//   float32: CUDA cores, fp32 throughout (tensor-core tf32 would miss fp32 accuracy).
//
// Partial-state contract (consumed by cd_merge_fold, common.cuh):
//   o_part  (num_splits, batch·q_len·num_heads, REAL_DIM) float32, Õ_i
//   lse_part(num_splits, batch·q_len·num_heads)           float32, LSE_i (natural log)
// Three ways to finish, chosen by the host:
//   single split (`o_part` null): the block writes the final output (input dtype) and LSE.
//   fused merge (`counters` non-null): every block writes its partials, then counts itself in
//     on its (batch, unit, head_tile) counter (unit: the block's KV head, or its KV_PER_BLOCK
//     KV heads); the last block of the group to arrive merges
//     the live splits with cd_merge_row_pass and writes the final output — one launch in all, which
//     saves the ~0.9 µs a second dependent kernel costs in a graph (the performance log, v9). The
//     host's merge="auto" picks it only where each warp of that block has one L2 trip to make
//     (_policy.merge_mode); merge="fused" forces it.
//     The counter wraps back to 0 on the last arrival (atomicInc), so the next launch (or graph
//     replay) starts clean.
//   partials only (`counters` null): merge_states.cu runs next as a second kernel.
//
// Compile-time constants (prepended by cupydecode/_kernels.py, chosen by cupydecode/_policy.py):
//   DTYPE_ID (0 f16, 1 bf16, 2 f32), HEAD_DIM (64, 128, 256 or 512: the width computed in), REAL_DIM
//   (the data's head_dim, ≤ HEAD_DIM, below), NUM_WARPS, STAGES, ROWS (16), TILE_N (16), MTILES,
//   HEADS_AS_N (0 or 1), KV_PER_BLOCK (1, or a divisor of NUM_WARPS for HEADS_AS_N: below),
//   L2_EVICT_FIRST (1: K/V copies hint L2 evict-first; 0: plain copies), SOFT_CAP (0 or 1:
//   score_mod caps the scores), ALIBI (0 or 1: score_mod adds ALiBi's bias), PAGED (0 or 1: the
//   cache is paged, read through block_table).
//
// KV_PER_BLOCK > 1 (heads-as-N only): a block holds KV_PER_BLOCK adjacent KV heads, warp w
// computing KV head (unit · KV_PER_BLOCK + w % KV_PER_BLOCK) in token slot w / KV_PER_BLOCK,
// every warp through its own ring; the host keeps the block's warps in step (warps_in_step).
// Where KV heads are adjacent in a token's row (the public (batch, seqlen, kv_heads, head_dim)
// cache), the block then reads KV_PER_BLOCK heads' pieces of each row together instead of one
// head's 2·HEAD_DIM-byte piece a row apart: with 4 KV heads, measured 0.4–1.2% faster on long
// batch-16–64 streams at head_dim 128 where the plan stays one wave (the performance log, v17).
// The block's rows are the KV_PER_BLOCK · G query heads of its KV heads (contiguous query
// heads); each warp's state is its own head's, so the warps' merge at the end folds only the
// warps of one KV head.
#include "common.cuh"

// Element types of q, of the K/V cache and of out: q and out are DTYPE_ID's; K/V too, or with
// KV_FP8 (1 e4m3, 2 e5m2; fp8.cuh) one-byte codes, decoded in registers by the heads-as-N path
// (below: "fp8 KV") into DTYPE_ID's 16-bit type. A key is code · k_scale, a value code · v_scale:
// per tensor (k_scale_all), per KV head (k_scale[kv_head]) or, with KV_SCALE_TOKEN, per token and
// KV head (k_scale[(row of the cache's leading axes) · num_kv_heads + kv_head]).
#ifndef KV_FP8
#define KV_FP8 0
#endif
#ifndef KV_SCALE_TOKEN
#define KV_SCALE_TOKEN 0
#endif
typedef cd_elem<DTYPE_ID> E;  // conversions of q and out
typedef E::storage q_t;
typedef E::storage out_t;
#if KV_FP8
#include "fp8.cuh"
typedef u8 kv_t;
#if KV_FP8 == 1
typedef cd_e4m3 kv_fmt;
#else
typedef cd_e5m2 kv_fmt;
#endif
#else
typedef E::storage kv_t;
static_assert(sizeof(q_t) == sizeof(kv_t), "the tile math multiplies q and K/V of one width");
#endif

#define NUM_THREADS (NUM_WARPS * 32)
#ifndef KV_PER_BLOCK
#define KV_PER_BLOCK 1
#endif
#define RINGS (NUM_WARPS / MTILES)          // K/V rings: one per token slot and KV head
#define SLOTS (RINGS / KV_PER_BLOCK)        // token slots
// WIDE: head_dim 512, the widest width. Its rows take the heads-as-N path with blocks of 8 query
// rows, the mma's N (more query heads per KV head: several head tiles, as with fp8 KV), and Qᵀ's
// fragments are read from shared memory per pair of k steps instead of held in registers (they
// would take 64 registers beside the 128 of the accumulators).
#define WIDE (HEAD_DIM > 256)
// query rows of one block: its M-tiles' (fp8 KV and WIDE: the 8 of the heads-as-N path's N)
#define BLOCK_ROWS ((KV_FP8 || WIDE) ? 8 : ROWS * MTILES)
// Query rows held in shared memory: BLOCK_ROWS, or 8 (the mma's N) per KV head of the block
#define Q_ROWS (KV_PER_BLOCK > 1 ? KV_PER_BLOCK * 8 : BLOCK_ROWS)
#define ES ((int)sizeof(kv_t))
#define CPR (HEAD_DIM * ES / 16)            // 16-byte chunks per K/V row
#define QES ((int)sizeof(q_t))
#define QCPR (HEAD_DIM * QES / 16)          // 16-byte chunks per Q row (and k_new/v_new's, fp8)
#define QEPC (16 / QES)
// REAL_DIM: the head_dim of q, the cache and out, a multiple of 8 up to HEAD_DIM, the width the
// kernel computes in (the host rounds REAL_DIM up to 64, 128 or 256; 512 only for itself). Every copy into shared
// memory zero-fills a row's chunks past REAL_DIM, which leaves the scores and the first REAL_DIM
// output dims as they are, and only those are read from or written to memory.
#ifndef REAL_DIM
#define REAL_DIM HEAD_DIM
#endif
#define RCPR (REAL_DIM * ES / 16)           // 16-byte chunks per row in memory
// chunk c of a row is in memory (a compile-time true where REAL_DIM == HEAD_DIM)
#define CHUNK_IN_MEMORY(c) (REAL_DIM == HEAD_DIM || (c) < RCPR)
#define Q_CHUNK_IN_MEMORY(c) (REAL_DIM == HEAD_DIM || (c) < REAL_DIM * QES / 16)
#define EPC (16 / ES)                       // elements per 16-byte chunk
#define TILE_BYTES (TILE_N * HEAD_DIM * ES) // one K (or V) tile of one slot
#define Q_BYTES (Q_ROWS * HEAD_DIM * QES)
#define PIPE_BYTES (RINGS * STAGES * 2 * TILE_BYTES)
// Per-warp accumulators in shared memory, rows padded by 8 floats: the mma-layout float2 stores
// (lanes g = 0..7 write rows g) would otherwise hit the same banks 8 times.
#define ACC_STRIDE (HEAD_DIM + 8)
#define ACC_BYTES (NUM_WARPS * ROWS * ACC_STRIDE * 4)
#define BODY_BYTES (PIPE_BYTES > ACC_BYTES ? PIPE_BYTES : ACC_BYTES)
#define ML_BYTES (2 * NUM_WARPS * ROWS * 4)
#ifndef PAGED
#define PAGED 0
#endif
// PAGED: one word per ring stage, the rows of its tile that hold a key (the KV view's mask),
// rounded up to 16 bytes: sm_new after it is read and written in 16-byte vectors
#define LIVE_BYTES (PAGED ? (RINGS * STAGES * 4 + 15) / 16 * 16 : 0)
// The appended token's K and V rows (k_new, v_new) of each of the block's KV heads
// (MULTI_Q: up to NEW_ROWS appended tokens per sequence, one per query token)
// (fp8 KV: their codes, then one float scale per row, rounded up to 16 bytes)
#define NEW_ROWS (MULTI_Q ? 16 : 1)
#define NEW_CODE_BYTES (KV_PER_BLOCK * 2 * NEW_ROWS * HEAD_DIM * ES)
#define NEW_BYTES (NEW_CODE_BYTES + (KV_FP8 ? (2 * NEW_ROWS * 4 + 15) / 16 * 16 : 0))
// KV_SCALE_TOKEN: per ring stage the K and V scales of its tile's TILE_N rows (the KV view's)
#define TSCALE_BYTES (KV_SCALE_TOKEN ? RINGS * STAGES * 2 * TILE_N * 4 : 0)
#define SMEM_BYTES (Q_BYTES + BODY_BYTES + ML_BYTES + LIVE_BYTES + TSCALE_BYTES + NEW_BYTES)

#if (HEAD_DIM * 2 / 16) < 8
#error "HEAD_DIM too small for the 8-row XOR swizzle"
#endif
#if REAL_DIM > HEAD_DIM || REAL_DIM % 8 != 0 || REAL_DIM < 8
#error "REAL_DIM must be a multiple of 8 no larger than HEAD_DIM"
#endif
#if ROWS != 16 || TILE_N != 16
#error "the mma fragment layouts below assume ROWS == TILE_N == 16"
#endif
#if MTILES < 1 || NUM_WARPS % MTILES != 0 || (MTILES > 1 && SLOTS > 15) || STAGES < 2
#error "NUM_WARPS must be a multiple of MTILES, with 2+ stages and, for MTILES > 1, at most 15 slots (named barriers 1..15)"
#endif
#if DTYPE_ID == 2 && MTILES != 1
#error "the float32 path holds one M-tile per block"
#endif
#if MULTI_Q && KV_PER_BLOCK > 1
#error "MULTI_Q blocks hold one KV head (a block of several maps its rows to one token's heads)"
#endif
#if HEADS_AS_N && (DTYPE_ID == 2 || MTILES != 1)
#error "HEADS_AS_N is a 16-bit tensor-core path of one M-tile per block"
#endif
#if KV_PER_BLOCK < 1 || (KV_PER_BLOCK > 1 && (!HEADS_AS_N || NUM_WARPS % KV_PER_BLOCK != 0))
#error "KV_PER_BLOCK > 1 is a heads-as-N layout whose warps split evenly over the KV heads"
#endif
#if KV_FP8 && (!HEADS_AS_N || KV_PER_BLOCK != 1 || DTYPE_ID == 2 || (REAL_DIM % 16) != 0)
#error "fp8 KV is a heads-as-N path of one KV head per block, 16-bit q, head_dim a multiple of 16"
#endif
#if KV_SCALE_TOKEN && !KV_FP8
#error "KV_SCALE_TOKEN: scales of an fp8 cache"
#endif
#if WIDE && (HEAD_DIM != 512 || !HEADS_AS_N || KV_PER_BLOCK != 1 || KV_FP8)
#error "HEAD_DIM 512 is a heads-as-N path of one KV head per block over a 16-bit cache"
#endif

// Rows of 128+ bytes put every row's chunk c in the same banks; XOR-ing the chunk index with
// (row mod 8) spreads the 8 rows an ldmatrix (or a quarter-warp) touches over all 32 banks.
__device__ __forceinline__ int swz(int row, int chunk) {
    return row * CPR + (chunk ^ (row & 7));
}
// The Q tile's (16-bit rows of QCPR chunks; the same as swz where K/V are 16-bit too).
__device__ __forceinline__ int swz_q(int row, int chunk) {
    return row * QCPR + (chunk ^ (row & 7));
}
// A K/V ring row's chunk. fp8 rows (HEAD_DIM bytes) are read as 16-byte chunks (K: rows g and
// g + 8, chunk t of a 64-byte group) and as 8-byte pieces of rows 2t, 2t + 1 (V): XOR-ing with
// 4·(row & 1) + 2·((row >> 1) & 3) puts the rows each phase of those loads touches on distinct
// banks (conflict-free at HEAD_DIM ≥ 128; two-way for some rows at 64).
__device__ __forceinline__ int ring_chunk(int row, int chunk) {
#if KV_FP8
    return row * CPR + (chunk ^ ((((row & 1) << 2) | (((row >> 1) & 3) << 1)) & (CPR - 1)));
#else
    return swz(row, chunk);
#endif
}

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16-byte global→shared copy that bypasses L1 (streamed once). src_bytes = 0 zero-fills the
// destination without reading: rows past the chunk end become zeros, never garbage or NaN.
// K and V are read once per call. With L2_EVICT_FIRST (the host's choice for calls of up to
// ~192 MB of K and V, _policy.l2_evict_first) they are streamed with an L2 evict-first policy,
// so that they do not push out of L2 what is used again — the partials, the arrival counters, q,
// the code: faster on short calls; on long ones, with L2 full of the other kernels' lines of a
// decode step, the plain copy is faster (docs/PERFORMANCE.md).
#ifndef L2_EVICT_FIRST
#define L2_EVICT_FIRST 1
#endif
__device__ __forceinline__ unsigned long long l2_evict_first_policy() {
    unsigned long long policy = 0;
#if L2_EVICT_FIRST
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
#endif
    return policy;
}
__device__ __forceinline__ void cp_async16_stream(u32 dst, const void* src, bool valid,
                                                  unsigned long long policy) {
#if L2_EVICT_FIRST
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0), "l"(policy) : "memory");
#else
    (void)policy;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
#endif
}
// 4-byte global→shared copy (per-token scales); src_bytes = 0 zero-fills without reading.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}

// The MTILES warps of token slot `slot` meet here (named barrier 1 + slot; 0 is __syncthreads').
__device__ __forceinline__ void slot_barrier(int slot) {
    asm volatile("bar.sync %0, %1;" :: "r"(1 + slot), "n"(32 * MTILES) : "memory");
}

__device__ __forceinline__ float warp_max16(float x) {  // over lanes sharing lane>>4
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
    return x;
}
__device__ __forceinline__ float warp_sum16(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    x += __shfl_xor_sync(0xffffffffu, x, 4);
    x += __shfl_xor_sync(0xffffffffu, x, 8);
    return x;
}

// The score hook: every score of every math path passes through here once, as the raw dot
// product q·k of query head `head` and key position `key`, before the online softmax. It returns
// the score in log2 units, or −inf for a key that does not count (past the chunk's end). Every
// change to the scores (a soft-cap, ALiBi, a window, sinks) goes here, and only here, behind a
// compile-time switch, so that a plan without the change runs exactly the code it ran before.
//   SOFT_CAP (logits_soft_cap c): s ← c·tanh(s/c). In log2 units, with x = s/c:
//     c·log2(e) · tanh(x) = cap_out − 2·cap_out / (e^{2x} + 1),   e^{2x} = 2^{qk · cap_in},
//   one ex2 and one fast division. Its error in the capped score is a few ulps of c (~1e-5 at
//   c = 50), which is what the softmax sees; tanh.approx's 2⁻¹¹ relative error would move a
//   capped logit of 50 by 0.02, 2% of its weight. ±inf scores give ±c, NaN stays NaN.
//   ALIBI (alibi_slopes, one per query head, natural units): s ← s − slope_h · (pos − key), after
//   the cap (the reference's order), pos the query's position (the sequence's last token); in
//   log2 units the slope is multiplied by log2(e). The slope is read through the read-only
//   cache: one 4-byte load per score, the same address for a thread's scores of one head.
#ifndef SOFT_CAP
#define SOFT_CAP 0
#endif
#ifndef ALIBI
#define ALIBI 0
#endif
// MULTI_Q (0 or 1): q_len > 1 query tokens per sequence (verifying draft tokens). A KV head's
// query rows are then its q_len × G (token, head) pairs: row vr = t·G + h of KV head u is query
// head u·G + h of token t, which sits at position seqlen − q_len + t (+ tokens_after: a shard)
// and attends the keys up to it (causal, aligned to the end), and with a window only the last W + 1 of those. Every path
// takes these rows as it takes the G heads of one token (the host sizes tiles by q_len · G);
// only the score hook (each row's own key range and position), the Q load and the epilogue's
// addresses know the pairs. Without it (one token) the code is what it was.
#ifndef MULTI_Q
#define MULTI_Q 0
#endif
struct cd_qrow {
    int t, head;  // the row's query token and query head
};
// query row vh (KV head vh / vgroup, row vh % vgroup of its q_len · G): its token and head
__device__ __forceinline__ cd_qrow qrow_of(int vh, int group, int vgroup) {
#if MULTI_Q
    const int vr = vh % vgroup;
    return {vr / group, (vh / vgroup) * group + vr % group};
#else
    (void)group;
    (void)vgroup;
    return {0, vh};
#endif
}
struct cd_score_params {
    float scale_log2;  // softmax scale · log2(e)
    int chunk_end;     // keys at or past this position do not count
    float cap_in;      // SOFT_CAP: 2·log2(e) · scale / c
    float cap_out;     // SOFT_CAP: c · log2(e)
    const float* __restrict__ slopes;  // ALIBI: (num_heads,) slopes
    int pos;           // query token 0's position: seqlen − q_len (+ tokens_after) (ALIBI, MULTI_Q)
    int last_head;     // ALIBI: num_heads − 1 (a block's padding rows read the last slope)
};
__device__ __forceinline__ float cd_raw_score(float qk, const cd_score_params& sp) {
#if SOFT_CAP
    return sp.cap_out - __fdividef(2.f * sp.cap_out, cd_exp2(qk * sp.cap_in) + 1.f);
#else
    return qk * sp.scale_log2;
#endif
}
// ``row``: the score's query row, its query head (one token per sequence).
__device__ __forceinline__ float score_mod(float qk, int key, int row,
                                           const cd_score_params& sp) {
    (void)row;
    float s = cd_raw_score(qk, sp);
#if ALIBI
    s -= __ldg(sp.slopes + min(row, sp.last_head)) * CD_LOG2E * (float)(sp.pos - key);
#endif
    return key < sp.chunk_end ? s : CD_NEG_INF;
}
#if MULTI_Q
// MULTI_Q: a query row's own keys [lo, hi] — up to its position (sp.pos + t) and, with a
// window W, from its position − W — within the chunk, and its ALiBi slope (log2 units) and
// position: computed once per row (qmask_of), out of the tile loop, so that each score costs
// two compares.
struct cd_qmask {
    int lo, hi;
#if ALIBI
    float slope2;
    int pos;
#endif
};
__device__ __forceinline__ cd_qmask qmask_of(int vh, int group, int vgroup, int window,
                                             const cd_score_params& sp) {
    const cd_qrow qr = qrow_of(vh, group, vgroup);
    const int pos = sp.pos + qr.t;
    cd_qmask m;
    m.hi = min(sp.chunk_end - 1, pos);
    m.lo = window >= 0 ? pos - window : -0x7fffffff - 1;
#if ALIBI
    m.slope2 = __ldg(sp.slopes + min(qr.head, sp.last_head)) * CD_LOG2E;
    m.pos = pos;
#endif
    return m;
}
__device__ __forceinline__ float score_mod(float qk, int key, const cd_qmask& m,
                                           const cd_score_params& sp) {
    float s = cd_raw_score(qk, sp);
#if ALIBI
    s -= m.slope2 * (float)(m.pos - key);
#endif
    return key >= m.lo && key <= m.hi ? s : CD_NEG_INF;
}
#endif

// The KV view's mask (PAGED): a score of tile row r whose page index was out of range is −inf,
// so that its zero-filled key and value count for nothing. Without paging, nothing to mask.
__device__ __forceinline__ float kv_mask(float s, u32 live, int r) {
#if PAGED
    return (live >> r) & 1u ? s : CD_NEG_INF;
#else
    (void)live;
    (void)r;
    return s;
#endif
}

#if DTYPE_ID != 2
// ---------------------------------------------------------------- tensor-core helpers (f16/bf16)
// The online-softmax state of one tensor-core thread for its two rows — query rows g, g + 8 on
// the 16-row path, query heads 2t, 2t + 1 with the heads as N — in log2 units:
//   m2[h]      the row's running maximum score (−inf while it has seen none)
//   l2[h]      this thread's share of Σ 2^(s − m2) (the lanes of a row are summed at the end)
//   acc[n][e]  this thread's mma fragments of Σ 2^(s − m2) · v; element e is row (e >> SHIFT) & 1
//   mv[h]      (fp8 KV with per-token V scales only) the running maximum of s + log2(v_scale):
//              acc then holds Σ 2^(s + log2 v_scale − mv) · code, so that the 16-bit weights
//              that multiply the codes stay ≤ 1 whatever the scales; the row's output is
//              acc · 2^(mv − m2) / l
// The lanes that share a row are lane masks FIRST, 2·FIRST, … LAST apart. Its merge with the other
// warps' states, and across splits, is cd_merge_scales / cd_merge_* (common.cuh).
template <int N, int SHIFT, int FIRST, int LAST>
struct cd_tc_state {
    float m2[2], l2[2], acc[N][4], mv[2];

    __device__ __forceinline__ void init() {
        m2[0] = m2[1] = mv[0] = mv[1] = CD_NEG_INF;
        l2[0] = l2[1] = 0.f;
#pragma unroll
        for (int n = 0; n < N; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    }

    // A tile's maxima mx (this thread's), reduced over the lanes of each row, become the running
    // maxima m (m2, or mv); alpha is what rescales the old state, ref what the tile's
    // exponentials subtract (0 while a row has seen only −inf, so no NaN forms).
    __device__ __forceinline__ void max_step_of(float (&m)[2], float (&mx)[2], float (&alpha)[2],
                                                float (&ref)[2]) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
#pragma unroll
            for (int x = FIRST; x <= LAST; x *= 2)
                mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], x));
            const cd_rescale sc = cd_merge_scales(m[h], mx[h]);
            alpha[h] = sc.a;
            m[h] = sc.m;
            ref[h] = (sc.m == CD_NEG_INF) ? 0.f : sc.m;
        }
    }
    __device__ __forceinline__ void max_step(float (&mx)[2], float (&alpha)[2], float (&ref)[2]) {
        max_step_of(m2, mx, alpha, ref);
    }

    // After the tile's exponentials: the denominators take the tile's sums rs, and where a row's
    // maximum moved in any lane (alpha ≠ 1) the accumulator fragments are scaled too (by
    // alpha_acc: mv's where it has its own maximum).
    __device__ __forceinline__ void rescale(const float (&alpha)[2], const float (&rs)[2],
                                            const float (&alpha_acc)[2]) {
        l2[0] = l2[0] * alpha[0] + rs[0];
        l2[1] = l2[1] * alpha[1] + rs[1];
        if (__any_sync(0xffffffffu, alpha_acc[0] != 1.f || alpha_acc[1] != 1.f)) {
#pragma unroll
            for (int n = 0; n < N; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[n][e] *= alpha_acc[(e >> SHIFT) & 1];
        }
    }
    __device__ __forceinline__ void rescale(const float (&alpha)[2], const float (&rs)[2]) {
        rescale(alpha, rs, alpha);
    }

    // At the end of the stream: each row's denominator, summed over the lanes that share it.
    __device__ __forceinline__ void sum_rows() {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int x = FIRST; x <= LAST; x *= 2) l2[h] += __shfl_xor_sync(0xffffffffu, l2[h], x);
    }
};

__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32& r0, u32& r1, u32& r2, u32& r3, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if DTYPE_ID == 0
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
// The 8×8 16-bit matrix held in mma fragment layout (lane g·4 + t: row g, columns 2t, 2t+1),
// transposed in registers: the lane then holds row g, columns 2t, 2t+1 of the transpose.
__device__ __forceinline__ u32 movmatrix_t(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(x));
    return r;
}
// (lo, hi) → one register of two 16-bit values, lo in the low half (the lower k index).
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if DTYPE_ID == 0
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
#endif

#if DTYPE_ID == 2
// The online-softmax state of one float32 warp (CUDA cores): for each of its ROWS query rows the
// running maximum m2 (log2 units; −inf while none), the denominator l2 (every lane holds the
// row's whole sum) and this lane's share of Σ 2^(s − m2) · v, head dims 2·lane + 64·d (+1).
struct cd_f32_state {
    float m2[ROWS], l2[ROWS], acc[ROWS][HEAD_DIM / 64][2];

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            m2[r] = CD_NEG_INF;
            l2[r] = 0.f;
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 64; ++i) acc[r][i][0] = acc[r][i][1] = 0.f;
        }
    }

    // Row r takes the scores x of a tile (lane n: token n, lanes 16..31 repeat them): the new
    // maximum rescales the old state; returns this lane's token's weight 2^(x − m2).
    __device__ __forceinline__ float step(int r, float x) {
        const cd_rescale sc = cd_merge_scales(m2[r], warp_max16(x));
        const float ref = (sc.m == CD_NEG_INF) ? 0.f : sc.m;
        const float p = cd_exp2(x - ref);
        l2[r] = l2[r] * sc.a + warp_sum16(p);
        m2[r] = sc.m;
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 64; ++d) { acc[r][d][0] *= sc.a; acc[r][d][1] *= sc.a; }
        return p;
    }
};
#endif

// All kernel parameters in one struct passed by value: one launch argument instead of 27 keeps
// the host cost of a launch from Python low (each argument costs ~0.5 µs to marshal in CuPy).
// The fields are declared once, in decode_params.cuh; the host packs the same list.
#include "decode_params.cuh"
struct cd_decode_params {
    CD_DECODE_PARAMS(CD_PARAM_FIELD)
};
// The host packs the fields back to back: interior padding would shift every field after it
// (the tail may be padded to the struct's 8-byte alignment: common.cuh, CD_PARAM_ALIGN).
static_assert(cd_falling_alignment({CD_DECODE_PARAMS(CD_PARAM_ALIGN)}) &&
                  sizeof(cd_decode_params) == (0 CD_DECODE_PARAMS(CD_PARAM_SIZE) + 7) / 8 * 8,
              "cd_decode_params: the list must keep falling alignment (no padding)");

// Sequence parallelism (cupydecode.distributed): this cache may hold one shard of each sequence,
// with tokens_after[b] more of sequence b's tokens after its last key here (null: none). The query
// tokens' positions count them, and so do the window and ALiBi's distances; the keys read are
// still this cache's [0, seqlen). Clamped to [0, 2³⁰]: a position stays an int.
__device__ __forceinline__ int cd_tokens_after(const int* tokens_after, int b) {
    return tokens_after ? min(max(tokens_after[b], 0), 1 << 30) : 0;
}

// The options a call turns on at run time: appended tokens (n_new), a window (window_left), a
// shard's tokens after it (tokens_after), int64 lengths (seqlens_64) and sinks. The host builds the
// kernel without RUNTIME_OPTIONS for the calls that use none of them (_policy.SplitKernelConfig
// .runtime_options, chosen per kind of call): each is then its constant "none", and no check of
// them is left in the code (what the plain call still costs against the kernel before these
// options: docs/PERFORMANCE.md, "What the features cost the plain call"). The kernel reads them
// only through cd_options_of.
#ifndef RUNTIME_OPTIONS
#define RUNTIME_OPTIONS 1
#endif
struct cd_options {
    int n_new, window_left, seqlens_64;
    const int* tokens_after;
    const float* sinks;
};
__device__ __forceinline__ cd_options cd_options_of(const cd_decode_params& p) {
#if RUNTIME_OPTIONS
    return {p.n_new, p.window_left, p.seqlens_64, p.tokens_after, p.sinks};
#else
    return {0, -1, 0, nullptr, nullptr};
#endif
}

// The host launches with its own figure (SplitKernelConfig.smem_bytes) and passes it in as
// SMEM_BYTES_HOST: a mismatch fails the build instead of scribbling past the allocation. (A check
// of %dynamic_smem_size at every block's entry, with the traps on options, cost about 2% at 1 x 512
// and 1 x 1k tokens; docs/PERFORMANCE.md.)
#ifndef SMEM_BYTES_HOST
#error "SMEM_BYTES_HOST: the host's dynamic shared memory size (SplitKernelConfig.defines)"
#endif
static_assert(SMEM_BYTES == SMEM_BYTES_HOST,
              "the host's dynamic shared memory (SplitKernelConfig.smem_bytes) is not SMEM_BYTES");

// ================================================================ appended rows
// Where an appended token's K and V rows go in the cache: their offsets kr, vr (elements, KV
// head 0's) and the row's index `at` among the cache's rows (batch · max_seqlen + position, or
// page · page_size + row; the per-token scales of KV head h are at at · num_kv_heads + h); ok is
// false where a page index is outside [0, num_pages), and nothing is written there.
struct cd_cache_row {
    bool ok;
    long long at, kr, vr;
};

#if KV_FP8
// fp8 KV: the chunk's appended tokens j0 … j0 + new_rows − 1 (k_new, v_new: q's 16-bit type),
// quantised as quantize_kv.cu quantises (code = encode(x / s), an IEEE division; per-token scales
// s = amax / the largest finite value, 1 where that is 0 or not finite), one warp per (token, K
// or V) row, lane c its 16-bit chunk c: into sm_codes and sm_new_scale (row 2j: K of appended
// token j, 2j + 1: V) and, by head tile 0's block, into the cache and (per token) the scale array
// (cache_row: where; a page index outside [0, num_pages) writes nothing, and its row counts for
// nothing: tile_live).
template <class CacheRow>
__device__ __forceinline__ void cd_quantize_new_rows(const cd_decode_params& p, int b, int new_lo,
                                                     int j0, int new_rows, int kv_head,
                                                     int head_tile, int num_kv_heads,
                                                     unsigned char* sm_codes, float* sm_new_scale,
                                                     CacheRow cache_row) {
    static_assert(QCPR <= 32, "a lane per 16-bit chunk of a new row");
    const kv_t* __restrict__ k = p.k;
    const kv_t* __restrict__ v = p.v;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int item = warp; item < 2 * new_rows; item += NUM_WARPS) {
        const int j = j0 + item / 2, kvi = item & 1, tok = new_lo + j;
        const q_t* src = kvi ? p.v_new + b * p.vn_sb + j * p.vn_ss + (long long)kv_head * p.vn_sh
                             : p.k_new + b * p.kn_sb + j * p.kn_ss + (long long)kv_head * p.kn_sh;
        const int c = lane;
        float x[8];
        float amax = 0.f;
        {
            uint4 raw = make_uint4(0u, 0u, 0u, 0u);
            if (c < QCPR && Q_CHUNK_IN_MEMORY(c))
                raw = *reinterpret_cast<const uint4*>(src + c * QEPC);
            const q_t* e = reinterpret_cast<const q_t*>(&raw);
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                x[u] = E::to_float(e[u]);
                const float a = fabsf(x[u]);
                amax = (a > amax || a != a) ? a : amax;  // a NaN wins
            }
        }
#if KV_SCALE_TOKEN
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float a = __shfl_xor_sync(0xffffffffu, amax, o);
            amax = (a > amax || a != a) ? a : amax;
        }
        float sc = amax / cd_fp8_max<kv_fmt>();
        if (!(sc > 0.0f && sc <= 3.402823466e38f)) sc = 1.0f;  // 0, inf or NaN
#else
        const float* arr = kvi ? p.v_scale : p.k_scale;
        const float sc = arr ? arr[kv_head] : (kvi ? p.v_scale_all : p.k_scale_all);
        (void)num_kv_heads;
#endif
        u32 w[2] = {0u, 0u};
#pragma unroll
        for (int u = 0; u < 8; ++u)
            w[u >> 2] |= (u32)cd_fp8_encode<kv_fmt>(__fdiv_rn(x[u], sc)) << (8 * (u & 3));
        const uint2 codes = make_uint2(w[0], w[1]);
        if (c < QCPR)
            *reinterpret_cast<uint2*>(sm_codes + (2 * j + kvi) * HEAD_DIM + 8 * c) = codes;
        if (lane == 0) sm_new_scale[2 * j + kvi] = sc;
        if (head_tile != 0) continue;
        const cd_cache_row cr = cache_row(tok);
        if (!cr.ok) continue;
        kv_t* dst = const_cast<kv_t*>(kvi ? v + cr.vr + (long long)kv_head * p.v_sh
                                          : k + cr.kr + (long long)kv_head * p.k_sh);
        if (c < QCPR && Q_CHUNK_IN_MEMORY(c)) *reinterpret_cast<uint2*>(dst + 8 * c) = codes;
#if KV_SCALE_TOKEN
        if (lane == 0) (kvi ? p.v_scale : p.k_scale)[cr.at * num_kv_heads + kv_head] = sc;
#endif
    }
}
#elif MULTI_Q
// MULTI_Q: the chunk's appended tokens [new_in, new_out) (one KV head per block): k_new's and
// v_new's token j into sm_new's rows 2j, 2j + 1, and, by head tile 0's block, into the cache
// (cache_row: where; a page index outside [0, num_pages) writes nothing, and its row counts for
// nothing: tile_live).
template <class CacheRow>
__device__ __forceinline__ void cd_stage_new_rows(const cd_decode_params& p, int b, int new_lo,
                                                  int new_in, int new_out, int kv_head,
                                                  int head_tile, uint4* sm_new,
                                                  CacheRow cache_row) {
    const kv_t* __restrict__ k = p.k;
    const kv_t* __restrict__ v = p.v;
    for (int i = threadIdx.x; i < (new_out - new_in) * CPR; i += NUM_THREADS) {
        const int j = new_in - new_lo + i / CPR, c = i % CPR, tok = new_lo + j;
        uint4 nk = make_uint4(0u, 0u, 0u, 0u), nv = nk;
        if (CHUNK_IN_MEMORY(c)) {
            nk = *reinterpret_cast<const uint4*>(p.k_new + b * p.kn_sb + j * p.kn_ss
                                                 + (long long)kv_head * p.kn_sh + c * EPC);
            nv = *reinterpret_cast<const uint4*>(p.v_new + b * p.vn_sb + j * p.vn_ss
                                                 + (long long)kv_head * p.vn_sh + c * EPC);
        }
        sm_new[(2 * j) * CPR + c] = nk;
        sm_new[(2 * j + 1) * CPR + c] = nv;
        if (head_tile != 0 || !CHUNK_IN_MEMORY(c)) continue;
        const cd_cache_row cr = cache_row(tok);
        if (!cr.ok) continue;
        *reinterpret_cast<uint4*>(const_cast<kv_t*>(k) + cr.kr + (long long)kv_head * p.k_sh + c * EPC) = nk;
        *reinterpret_cast<uint4*>(const_cast<kv_t*>(v) + cr.vr + (long long)kv_head * p.v_sh + c * EPC) = nv;
    }
}
#endif

// ================================================================ 3. tile compute
// What the tile compute sees of the KV view (phase 2): this warp's `count` tiles, and the
// `loops` turns its slot takes (more than count only where an M-tile slot has fewer tiles than
// the first: its idle turns); tile i is in the ring (`ring`, `ring_u32`) at stage i % STAGES
// once next(i) has returned, from token start(i), its rows with a key live(i) (all but where a
// page index was out of range), and, per-token fp8 scales, its K and V scales at scales(i).
// The callables are held by value (they reference the kernel's view): held by reference, ptxas
// gave the M-tile paths more registers (and spills at head_dim 192/256).
template <class Next, class Start, class Live, class Scales>
struct cd_kv_tiles {
    int count, loops;
    unsigned char* ring;
    u32 ring_u32;
    Next next;
    Start start;
    Live live;
    Scales scales;
};
template <class Next, class Start, class Live, class Scales>
__device__ __forceinline__ cd_kv_tiles<Next, Start, Live, Scales> cd_kv_tiles_of(
    int count, int loops, unsigned char* ring, Next next, Start start, Live live, Scales scales) {
    return {count, loops, ring, smem_u32(ring), next, start, live, scales};
}

// The block's query rows as one warp computes them: the first query row h0 (MULTI_Q: a row of
// qrow_of), G query heads per KV head, vgroup = q_len · G rows per KV head, the block's live rows,
// the window (window_left, −1: none), and the warp's KV head within the block (kh), M-tile (mt)
// and KV head (kv_head).
struct cd_rows {
    int h0, group, vgroup, rows, window, kh, mt, kv_head;
};

#if DTYPE_ID != 2
// A tensor-core lane's coordinates in the mma.m16n8k16 fragments: g = lane / 4, t = lane % 4,
// and the ldmatrix row addresses of pattern A (Q as the A operand, V transposed) and pattern B
// (K as the col-major B operand).
struct cd_mma_lane {
    int g, t, rowA, offA, rowB, offB;
};
__device__ __forceinline__ cd_mma_lane cd_mma_lane_of(int lane) {
    return {lane >> 2, lane & 3, (lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4,
            (lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1};
}
#endif

#if DTYPE_ID != 2 && HEADS_AS_N
// The heads-as-N path over the warp's tiles, then its state into shared memory (sm_m, sm_l: row
// r of warp w at w · ROWS + r; sm_acc: ROWS rows of ACC_STRIDE floats per warp).
template <class Tiles>
__device__ __forceinline__ void cd_chunk_heads_as_n(const Tiles& kv, const cd_decode_params& p,
                                                    const cd_score_params& score_params,
                                                    const cd_rows rw, const q_t* sq, float* sm_m,
                                                    float* sm_l, float* sm_acc) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const cd_mma_lane ml = cd_mma_lane_of(lane);
    const int g = ml.g, t = ml.t, rowA = ml.rowA, offA = ml.offA, rowB = ml.rowB, offB = ml.offB;
    const u32 sq_u32 = smem_u32(sq);
#if KV_FP8
    (void)rowA; (void)offA; (void)rowB; (void)offB;  // (fp8 tiles are read by plain loads)
#endif
    // ---------------------------------------------------- heads as N: Sᵀ = K·Qᵀ, Oᵀ = Vᵀ·Pᵀ
    // The mma's N holds 8 heads: a launch with more (a host bug) must not read unset rows.
    // (Blocks of several KV heads checked their group at entry, before any write.)
    if (KV_PER_BLOCK == 1 && rw.rows > 8) __trap();
    // Here pattern A reads K as the A operand and pattern B reads Vᵀ (V transposed) as the A
    // operand. The thread's query heads (columns of Sᵀ and Oᵀ) are 2t and 2t + 1.
    // Qᵀ as B operands (k = head dims, n = query heads 0..7), in registers for the whole chunk:
    // qb[kk] holds Q[g][16kk + 2t, +1] and Q[g][16kk + 8 + 2t, +1]. One ldmatrix.x4 reads the
    // 16-byte chunks 4kk2 .. 4kk2 + 3 of query rows 0..7 (lanes 8j..8j+7 address chunk j).
    // (WIDE: the same loads, inside the tile loop; q_frags.)
#if !WIDE
    u32 qb[HEAD_DIM / 16][2];
#endif
#if !KV_FP8
    auto q_frags = [&](u32 (&qw)[4], int kk2) {
        ldsm_x4(qw[0], qw[1], qw[2], qw[3], sq_u32 + swz(8 * rw.kh + (lane & 7), 4 * kk2 + (lane >> 3)) * 16);
    };
#endif
#if KV_FP8
    // fp8 KV: the K·Qᵀ step takes each lane's K codes as whole 16-byte chunks (below), which
    // orders the head dims differently: k step 4·grp + j (grp a 64-dim group) pairs logical
    // k 2t, 2t + 1 with dims 64·grp + 16t + 4j + {0, 1} and k 2t + 8, 2t + 9 with + {2, 3}
    // (a permutation of the dims: the dot products are the same). Q follows it.
#pragma unroll
    for (int grp = 0; grp < HEAD_DIM / 64; ++grp)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint2 w = *reinterpret_cast<const uint2*>(
                reinterpret_cast<const unsigned char*>(sq) + swz_q(g, 8 * grp + 2 * t + (j >> 1)) * 16
                + 8 * (j & 1));
            qb[4 * grp + j][0] = w.x;
            qb[4 * grp + j][1] = w.y;
        }
    // the K and V scales: per KV head (and tensor) here; per token from the tile's (below)
#if !KV_SCALE_TOKEN
    const float k_mul = (p.k_scale ? p.k_scale[rw.kv_head] : 1.f) * p.k_scale_all;
    const float v_mul = (p.v_scale ? p.v_scale[rw.kv_head] : 1.f) * p.v_scale_all;
#endif
#elif !WIDE
#pragma unroll
    for (int kk2 = 0; kk2 < HEAD_DIM / 32; ++kk2) {
        u32 qw[4];
        q_frags(qw, kk2);
        qb[2 * kk2][0] = qw[0];
        qb[2 * kk2][1] = qw[1];
        qb[2 * kk2 + 1][0] = qw[2];
        qb[2 * kk2 + 1][1] = qw[3];
    }
#endif

    // The state of query heads 2t, 2t + 1; Oᵀ accumulators: st.acc[d][e] is head dim
    // 16d + g + 8·(e >> 1) of query head 2t + (e & 1).
    cd_tc_state<HEAD_DIM / 16, 0, 4, 16> st;
    // the score hook's row of this thread's heads 2t (e even) and 2t + 1 (e odd)
#if MULTI_Q
    const cd_qmask qrow_n[2] = {qmask_of(rw.h0 + 2 * t, rw.group, rw.vgroup, rw.window, score_params),
                                qmask_of(rw.h0 + 2 * t + 1, rw.group, rw.vgroup, rw.window,
                                         score_params)};
#define SCORE_ROW_N(e) qrow_n[(e) & 1]
#else
#define SCORE_ROW_N(e) (rw.h0 + rw.kh * rw.group + 2 * t + ((e) & 1))
#endif
    st.init();

    for (int i = 0; i < kv.count; ++i) {
        kv.next(i);
        const u32 live = kv.live(i);  // the KV view's rows with a key (all, unpaged)
        const u32 ks = kv.ring_u32 + (i % STAGES) * 2 * TILE_BYTES;
        const u32 vs = ks + TILE_BYTES;
        // Sᵀ for 16 tokens × 8 heads; two accumulators (even and odd k steps) so that two mma
        // chains are in flight. s[e]: token g + 8·(e >> 1) of the tile, head 2t + (e & 1).
        float s[4] = {0.f, 0.f, 0.f, 0.f}, s_odd[4] = {0.f, 0.f, 0.f, 0.f};
#if KV_FP8
        // K codes as the A operand (16 tokens × 16 dims per k step): rows g and g + 8, one
        // 16-byte chunk each per 64-dim group (its 16 codes are 4 k steps: the order above),
        // decoded in registers, two codes per conversion.
#pragma unroll
        for (int grp = 0; grp < HEAD_DIM / 64; ++grp) {
            uint4 klo, khi;
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(klo.x), "=r"(klo.y),
                         "=r"(klo.z), "=r"(klo.w) : "r"(ks + ring_chunk(g, 4 * grp + t) * 16));
            asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(khi.x), "=r"(khi.y),
                         "=r"(khi.z), "=r"(khi.w) : "r"(ks + ring_chunk(g + 8, 4 * grp + t) * 16));
            const u32 lo4[4] = {klo.x, klo.y, klo.z, klo.w}, hi4[4] = {khi.x, khi.y, khi.z, khi.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                u32 a[4];
                cd_fp8x4_to_16x2<kv_fmt, DTYPE_ID>(lo4[j], a[0], a[2]);
                cd_fp8x4_to_16x2<kv_fmt, DTYPE_ID>(hi4[j], a[1], a[3]);
                if (j % 2) mma16816(s_odd, a, qb[4 * grp + j][0], qb[4 * grp + j][1]);
                else       mma16816(s, a, qb[4 * grp + j][0], qb[4 * grp + j][1]);
            }
        }
        // the scores' K scale (k_mul; per token: tile rows g and g + 8's), and per token the
        // log2 of the V scale of those rows (−inf for a row without a key: zero-filled)
#if KV_SCALE_TOKEN
        const float* tsc = kv.scales(i);
        const float kmul[2] = {tsc[g], tsc[g + 8]};
        const float lv[2] = {log2f(tsc[TILE_N + g]), log2f(tsc[TILE_N + g + 8])};
#else
        const float kmul[2] = {k_mul, k_mul};
#endif
#define KV_SCORE_MUL(e) * kmul[(e) >> 1]
#else
        u32 qw[4];  // WIDE: Qᵀ's fragments of k steps kk, kk + 1 (kk even)
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            u32 a[4];
            ldsm_x4(a[0], a[1], a[2], a[3], ks + swz(rowA, 2 * kk + offA) * 16);
#if WIDE
            if (kk % 2 == 0) q_frags(qw, kk / 2);
            const u32 q0 = qw[2 * (kk % 2)], q1 = qw[2 * (kk % 2) + 1];
#else
            const u32 q0 = qb[kk][0], q1 = qb[kk][1];
#endif
            if (kk % 2) mma16816(s_odd, a, q0, q1);
            else        mma16816(s, a, q0, q1);
        }
        (void)qw;
#define KV_SCORE_MUL(e)
#endif
        // Online softmax per head, one max and one rescale per tile: the head's 16 tokens are
        // in the 8 lanes of its t (lane bits 2..4), two per lane.
        const int t0 = kv.start(i);
        float mx[2] = {CD_NEG_INF, CD_NEG_INF};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[e] = kv_mask(score_mod((s[e] + s_odd[e]) KV_SCORE_MUL(e), t0 + g + 8 * (e >> 1),
                                     SCORE_ROW_N(e), score_params),
                           live, g + 8 * (e >> 1));
            mx[e & 1] = fmaxf(mx[e & 1], s[e]);
        }
#undef KV_SCORE_MUL
        float alpha[2], ref[2];
        st.max_step(mx, alpha, ref);
        float rs[2] = {0.f, 0.f};
#if KV_SCALE_TOKEN
        // per-token V scales: the weights that multiply the codes are 2^(s + lv − mv), with
        // their own running maximum mv (cd_tc_state), so that none exceeds 1
        float mxv[2] = {CD_NEG_INF, CD_NEG_INF}, alpha_v[2], ref_v[2], pv[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) mxv[e & 1] = fmaxf(mxv[e & 1], s[e] + lv[e >> 1]);
        st.max_step_of(st.mv, mxv, alpha_v, ref_v);
#pragma unroll
        for (int e = 0; e < 4; ++e) pv[e] = cd_exp2(s[e] + lv[e >> 1] - ref_v[e & 1]);
#endif
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s[e] = cd_exp2(s[e] - ref[e & 1]);
            rs[e & 1] += s[e];
        }
#if KV_SCALE_TOKEN
        st.rescale(alpha, rs, alpha_v);
        const u32 pb0 = movmatrix_t(pack2(pv[0], pv[1]));
        const u32 pb1 = movmatrix_t(pack2(pv[2], pv[3]));
#else
        st.rescale(alpha, rs);
        // Pᵀ as the B operand (k = tokens, n = heads) is the transpose of the Sᵀ accumulator
        // (tokens × heads) in fragment layout: one movmatrix per 8 tokens.
        const u32 pb0 = movmatrix_t(pack2(s[0], s[1]));
        const u32 pb1 = movmatrix_t(pack2(s[2], s[3]));
#endif
#if KV_FP8
        // Vᵀ codes as the A operand (16 dims × 16 tokens): lane (g, t) reads the 8 codes of
        // dims 64·grp + 8g … + 7 of tokens 2t, 2t + 1, 2t + 8, 2t + 9 (the k order of Pᵀ);
        // byte-permutes pair the two tokens of one dim, and d-block 4·grp + k holds dims
        // 64·grp + 8g + 2k (row g) and + 1 (row g + 8): the epilogue knows that order.
#pragma unroll
        for (int grp = 0; grp < HEAD_DIM / 64; ++grp) {
            uint2 w[4];
#pragma unroll
            for (int q4 = 0; q4 < 4; ++q4) {
                const int row = 2 * t + (q4 & 1) + 8 * (q4 >> 1);
                asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(w[q4].x), "=r"(w[q4].y)
                             : "r"(vs + ring_chunk(row, 4 * grp + (g >> 1)) * 16 + 8 * (g & 1)));
            }
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u32 w0 = h ? w[0].y : w[0].x, w1 = h ? w[1].y : w[1].x;
                const u32 w2 = h ? w[2].y : w[2].x, w3 = h ? w[3].y : w[3].x;
#pragma unroll
                for (int bsel = 0; bsel < 2; ++bsel) {
                    u32 x01, x23, a[4];
                    if (bsel) {
                        asm("prmt.b32 %0, %1, %2, 0x7362;" : "=r"(x01) : "r"(w0), "r"(w1));
                        asm("prmt.b32 %0, %1, %2, 0x7362;" : "=r"(x23) : "r"(w2), "r"(w3));
                    } else {
                        asm("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(x01) : "r"(w0), "r"(w1));
                        asm("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(x23) : "r"(w2), "r"(w3));
                    }
                    cd_fp8x4_to_16x2<kv_fmt, DTYPE_ID>(x01, a[0], a[1]);
                    cd_fp8x4_to_16x2<kv_fmt, DTYPE_ID>(x23, a[2], a[3]);
                    mma16816(st.acc[4 * grp + 2 * h + bsel], a, pb0, pb1);
                }
            }
        }
#else
#pragma unroll
        for (int d = 0; d < HEAD_DIM / 16; ++d) {
            u32 a[4];
            ldsm_x4_t(a[0], a[1], a[2], a[3], vs + swz(rowB, 2 * d + offB) * 16);
            mma16816(st.acc[d], a, pb0, pb1);
        }
#endif
        __syncwarp();
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring before it becomes sm_acc

    // Warp state → shared: the eight lanes of a head sum their shares of l.
    st.sum_rows();
    if (g == 0) {  // rows 8..15 (no query head here) are never read: rows ≤ 8
        sm_m[warp * ROWS + 2 * t] = st.m2[0];     sm_l[warp * ROWS + 2 * t] = st.l2[0];
        sm_m[warp * ROWS + 2 * t + 1] = st.m2[1]; sm_l[warp * ROWS + 2 * t + 1] = st.l2[1];
    }
    float* wacc = sm_acc + warp * ROWS * ACC_STRIDE;
#if KV_FP8
    // fp8 KV: the V scale (per head and tensor; per token: acc's own maximum mv, 2^(mv − m2)
    // brings it to m2's, 0 for a row that saw no key) on the way out, and d-block 4·grp + k's
    // rows are dims 64·grp + 8g + 2k (+ 1: row g + 8)
    float vfac[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#if KV_SCALE_TOKEN
        vfac[h] = st.m2[h] == CD_NEG_INF ? 0.f : cd_exp2(st.mv[h] - st.m2[h]);
#else
        vfac[h] = v_mul;
#endif
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 16; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            wacc[(2 * t + (e & 1)) * ACC_STRIDE + 64 * (d >> 2) + 8 * g + 2 * (d & 3) + (e >> 1)] =
                st.acc[d][e] * vfac[e & 1];
#else
#pragma unroll
    for (int d = 0; d < HEAD_DIM / 16; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            wacc[(2 * t + (e & 1)) * ACC_STRIDE + 16 * d + g + 8 * (e >> 1)] = st.acc[d][e];
#endif
}
#undef SCORE_ROW_N
#endif

#if DTYPE_ID != 2 && !HEADS_AS_N
// The M-tile path (16 query rows as the mma's M) over the warp's tiles, then its state into
// shared memory, as cd_chunk_heads_as_n.
template <class Tiles>
__device__ __forceinline__ void cd_chunk_m_tiles(const Tiles& kv,
                                                 const cd_score_params& score_params,
                                                 const cd_rows rw, const q_t* sq, float* sm_m,
                                                 float* sm_l, float* sm_acc) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const cd_mma_lane ml = cd_mma_lane_of(lane);
    const int g = ml.g, t = ml.t, rowA = ml.rowA, offA = ml.offA, rowB = ml.rowB, offB = ml.offB;
    const u32 sq_u32 = smem_u32(sq);
    cd_tc_state<HEAD_DIM / 8, 1, 1, 2> st;  // rows g, g + 8; st.acc[n][e]: row g + 8 · (e >> 1)
    // the score hook's row of this thread's rows g (e < 2) and g + 8 (e ≥ 2)
#if MULTI_Q
    const cd_qmask qrow_m[2] = {
        qmask_of(rw.h0 + rw.mt * ROWS + g, rw.group, rw.vgroup, rw.window, score_params),
        qmask_of(rw.h0 + rw.mt * ROWS + g + 8, rw.group, rw.vgroup, rw.window, score_params)};
#define SCORE_ROW_M(e) qrow_m[(e) >> 1]
#else
#define SCORE_ROW_M(e) (rw.h0 + rw.mt * ROWS + g + 8 * ((e) >> 1))
#endif
    st.init();

#if HEAD_DIM <= 128
    u32 qf[HEAD_DIM / 16][4];  // Q fragments stay in registers for the whole chunk
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk)
        ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3],
                sq_u32 + swz(rw.mt * ROWS + rowA, 2 * kk + offA) * 16);
#endif

    for (int i = 0; i < kv.count; ++i) {
        kv.next(i);
        const u32 live = kv.live(i);  // the KV view's rows with a key (all, unpaged)
        const u32 ks = kv.ring_u32 + (i % STAGES) * 2 * TILE_BYTES;
        const u32 vs = ks + TILE_BYTES;
        // S = Q·Kᵀ for 16 rows × 16 tokens: two n-tiles of 8 tokens.
        float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
            u32 b0, b1, b2, b3;
            ldsm_x4(b0, b1, b2, b3, ks + swz(rowB, 2 * kk + offB) * 16);
#if HEAD_DIM <= 128
            mma16816(s[0], qf[kk], b0, b1);
            mma16816(s[1], qf[kk], b2, b3);
#else
            u32 qa[4];
            ldsm_x4(qa[0], qa[1], qa[2], qa[3], sq_u32 + swz(rw.mt * ROWS + rowA, 2 * kk + offA) * 16);
            mma16816(s[0], qa, b0, b1);
            mma16816(s[1], qa, b2, b3);
#endif
        }
        // Online softmax, one max and one rescale per tile. s[j][e]: row g (e<2) or g+8,
        // token 8j + 2t + (e&1) of the tile.
        const int t0 = kv.start(i);
        float mx[2] = {CD_NEG_INF, CD_NEG_INF};
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[j][e] = kv_mask(score_mod(s[j][e], t0 + 8 * j + 2 * t + (e & 1),
                                            SCORE_ROW_M(e), score_params),
                                  live, 8 * j + 2 * t + (e & 1));
                mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
            }
        float alpha[2], ref[2];
        st.max_step(mx, alpha, ref);
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[j][e] = cd_exp2(s[j][e] - ref[e >> 1]);
                rs[e >> 1] += s[j][e];
            }
        st.rescale(alpha, rs);
        // The S accumulator layout of two n-tiles is exactly the A layout of one k16 step.
        const u32 pa[4] = {pack2(s[0][0], s[0][1]), pack2(s[0][2], s[0][3]),
                           pack2(s[1][0], s[1][1]), pack2(s[1][2], s[1][3])};
#pragma unroll
        for (int jj = 0; jj < HEAD_DIM / 16; ++jj) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(b0, b1, b2, b3, vs + swz(rowA, 2 * jj + offA) * 16);
            mma16816(st.acc[2 * jj], pa, b0, b1);
            mma16816(st.acc[2 * jj + 1], pa, b2, b3);
        }
        if (MTILES == 1) __syncwarp();
    }
    for (int i = kv.count; i < kv.loops; ++i) kv.next(i);  // the idle turn (MTILES > 1)
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the ring before it becomes sm_acc

    // Warp state → shared: the four lanes of a row group sum their shares of l.
    st.sum_rows();
    if (t == 0) {
        sm_m[warp * ROWS + g] = st.m2[0];     sm_l[warp * ROWS + g] = st.l2[0];
        sm_m[warp * ROWS + g + 8] = st.m2[1]; sm_l[warp * ROWS + g + 8] = st.l2[1];
    }
    float* wacc = sm_acc + warp * ROWS * ACC_STRIDE;
#pragma unroll
    for (int n = 0; n < HEAD_DIM / 8; ++n) {
        *reinterpret_cast<float2*>(wacc + g * ACC_STRIDE + 8 * n + 2 * t) =
            make_float2(st.acc[n][0], st.acc[n][1]);
        *reinterpret_cast<float2*>(wacc + (g + 8) * ACC_STRIDE + 8 * n + 2 * t) =
            make_float2(st.acc[n][2], st.acc[n][3]);
    }
}
#undef SCORE_ROW_M
#endif

#if DTYPE_ID == 2
// The float32 path (CUDA cores) over the warp's tiles, then its state into shared memory, as
// cd_chunk_heads_as_n.
template <class Tiles>
__device__ __forceinline__ void cd_chunk_f32(const Tiles& kv, const cd_score_params& score_params,
                                             const cd_rows rw, const q_t* sq, float* sm_m,
                                             float* sm_l, float* sm_acc) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    // ---------------------------------------------------------------- float32 path
    // Scores: lane owns token (lane & 15) and half (lane >> 4) of the head dimension.
    // P·V: lane owns dims 2·lane + 64·i (float2), i < HEAD_DIM / 64.
    const int tn = lane & 15, hf = lane >> 4;
    const float* sqf = reinterpret_cast<const float*>(sq);
    cd_f32_state st;
    st.init();
    for (int i = 0; i < kv.count; ++i) {
        kv.next(i);
        const u32 live = kv.live(i);  // the KV view's rows with a key (all, unpaged)
        const float4* ks = reinterpret_cast<const float4*>(kv.ring + (i % STAGES) * 2 * TILE_BYTES);
        const float* vs = reinterpret_cast<const float*>(kv.ring + (i % STAGES) * 2 * TILE_BYTES + TILE_BYTES);
        float s[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) s[r] = 0.f;
#pragma unroll 4
        for (int cc = 0; cc < CPR / 2; ++cc) {
            const int c = hf * (CPR / 2) + cc;
            const float4 k4 = ks[swz(tn, c)];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < rw.rows) {
                    const float4 qv = reinterpret_cast<const float4*>(sqf)[r * CPR + c];
                    s[r] = fmaf(qv.x, k4.x, fmaf(qv.y, k4.y, fmaf(qv.z, k4.z, fmaf(qv.w, k4.w, s[r]))));
                }
            }
        }
        const int key = kv.start(i) + tn;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (r < rw.rows) {
                s[r] += __shfl_xor_sync(0xffffffffu, s[r], 16);
#if MULTI_Q
                const cd_qmask qm = qmask_of(rw.h0 + r, rw.group, rw.vgroup, rw.window, score_params);
#define SCORE_ROW_F qm
#else
#define SCORE_ROW_F (rw.h0 + r)
#endif
                s[r] = st.step(r, kv_mask(score_mod(s[r], key, SCORE_ROW_F, score_params), live, tn));
#undef SCORE_ROW_F
            }
        }
#pragma unroll 2
        for (int n = 0; n < TILE_N; ++n) {
            float2 vv[HEAD_DIM / 64];
#pragma unroll
            for (int d = 0; d < HEAD_DIM / 64; ++d) {
                const int e = 2 * lane + 64 * d;  // element index within the row
                vv[d] = *reinterpret_cast<const float2*>(vs + swz(n, e / 4) * 4 + (e & 3));
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (r < rw.rows) {
                    const float p = __shfl_sync(0xffffffffu, s[r], n);
#pragma unroll
                    for (int d = 0; d < HEAD_DIM / 64; ++d) {
                        st.acc[r][d][0] = fmaf(p, vv[d].x, st.acc[r][d][0]);
                        st.acc[r][d][1] = fmaf(p, vv[d].y, st.acc[r][d][1]);
                    }
                }
            }
        }
        __syncwarp();  // (MTILES is 1 here)
    }
    cp_async_wait<0>();
    __syncthreads();
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            sm_m[warp * ROWS + r] = st.m2[r];
            sm_l[warp * ROWS + r] = st.l2[r];
        }
    }
    float* wacc = sm_acc + warp * ROWS * ACC_STRIDE;
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
        if (r < rw.rows)
#pragma unroll
            for (int d = 0; d < HEAD_DIM / 64; ++d)
                *reinterpret_cast<float2*>(wacc + r * ACC_STRIDE + 2 * lane + 64 * d) =
                    make_float2(st.acc[r][d][0], st.acc[r][d][1]);
}
#endif

// ================================================================ 4. epilogue
// The block's place in the grid and in its sequence, as the epilogue needs it (phase 1 finds it).
struct cd_block {
    int b, batch, split, num_splits, unit, num_units, head_tile, head_tiles;
    int q_len, group, vgroup, rows, h0, seqlen, chunk_tokens;
};

// Phase 4: the warps' states (sm_m, sm_l, sm_acc: every warp's, an empty chunk's too) merge into
// the block's rows, which go out as the final output (a single split) or as partials; with the
// fused merge the last block of its (batch, unit, head tile) to arrive then merges the splits.
__device__ __forceinline__ void cd_epilogue(const cd_decode_params& p, const cd_options& opt,
                                            const cd_block blk, float* sm_m, float* sm_l,
                                            float* sm_acc) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int b = blk.b, batch = blk.batch, split = blk.split, num_splits = blk.num_splits;
    const int unit = blk.unit, num_units = blk.num_units, head_tile = blk.head_tile;
    const int head_tiles = blk.head_tiles, group = blk.group, rows = blk.rows, h0 = blk.h0;
    const int seqlen = blk.seqlen, chunk_tokens = blk.chunk_tokens, num_heads = p.num_heads;
#if MULTI_Q
    const int q_len = blk.q_len, vgroup = blk.vgroup;
#else
    constexpr int q_len = 1;  // (blk.q_len and blk.vgroup unused)
#endif
    float* __restrict__ o_part = p.o_part;
    float* __restrict__ lse_part = p.lse_part;
    out_t* __restrict__ out = p.out;
    float* __restrict__ lse_out = p.lse_out;
    int* __restrict__ counters = p.counters;
    const long long out_sb = p.out_sb, out_sh = p.out_sh;
    // ---------------------------------------------------------------- merge the warps, write
    // Block row R is row R % 16 of M-tile R / 16, held by that M-tile's warp in every slot:
    // warps R / 16 + MTILES·t, t < SLOTS (the index of (warp, row) in sm_m, sm_l, sm_acc is below).
    // One thread per row turns those warps' (m, l) into final weights, in place: sm_l[w][r]
    // becomes 2^(m_w − m) / l (0 for an empty row) and s_lse[R] the row's LSE (natural log).
    __shared__ float s_lse[KV_PER_BLOCK > 1 ? KV_PER_BLOCK * 8 : BLOCK_ROWS];
    // With several KV heads, row R is query head R % G of KV head R / G, held by warps
    // (R / G + KV_PER_BLOCK·t), t < SLOTS.
    auto wrow = [group](int R, int t) {
        return KV_PER_BLOCK > 1 ? (R / group + t * KV_PER_BLOCK) * ROWS + R % group
                                : (R / ROWS + t * MTILES) * ROWS + R % ROWS;
    };
#if MULTI_Q
    __shared__ int s_qt[BLOCK_ROWS], s_qh[BLOCK_ROWS];  // each row's token and head (qrow_of)
#endif
    if (tid < rows) {
        const int R = tid;
#if MULTI_Q
        const cd_qrow qr = qrow_of(h0 + R, group, vgroup);
        s_qt[R] = qr.t;
        s_qh[R] = qr.head;
        const int head = qr.head;
#else
        const int head = h0 + R;
#endif
        // A single split's output is final: its sink (sinks: a logit per query head, a key with
        // no value) joins here. Partials never hold it: the merge adds it once (cd_merge_sink).
        const float sink2 = !o_part && opt.sinks ? opt.sinks[head] * CD_LOG2E : CD_NEG_INF;
        float mmax = sink2;
#pragma unroll
        for (int t = 0; t < SLOTS; ++t) mmax = fmaxf(mmax, sm_m[wrow(R, t)]);
        const float ref = (mmax == CD_NEG_INF) ? 0.f : mmax;
        float sc[SLOTS], l = cd_exp2(sink2 - ref);  // 0 without a sink
#pragma unroll
        for (int t = 0; t < SLOTS; ++t) {
            sc[t] = cd_exp2(sm_m[wrow(R, t)] - ref);
            l += sm_l[wrow(R, t)] * sc[t];
        }
        // empty: l is exactly 0; a NaN l (a NaN in a key or value this row attends) must reach
        // the row, so the test is != 0, not > 0 (which would turn it into an empty row)
        const float inv = l != 0.f ? 1.f / l : 0.f;
#pragma unroll
        for (int t = 0; t < SLOTS; ++t) sm_l[wrow(R, t)] = sc[t] * inv;
        s_lse[R] = l != 0.f ? (mmax + log2f(l)) * CD_LN2 : CD_NEG_INF;
    }
    __syncthreads();
    // Row r's token and head (MULTI_Q: from shared memory, above; else token 0, head h0 + r),
    // its state: row (b·q_len + t)·num_heads + head of the (batch, q_len, num_heads) outputs (lse,
    // each split's partials), and its output row.
#if MULTI_Q
    auto row_t = [&](int r) { return s_qt[r]; };
    auto row_head = [&](int r) { return s_qh[r]; };
#else
    auto row_t = [](int r) { (void)r; return 0; };
    auto row_head = [&](int r) { return h0 + r; };
#endif
    auto state_row = [&](int r) -> long long {
        return ((long long)b * q_len + row_t(r)) * num_heads + row_head(r);
    };
    auto out_row = [&](int r) -> out_t* {
        return out + b * out_sb + row_t(r) * p.out_st + (long long)row_head(r) * out_sh;
    };
    if (!o_part) {  // single split: the final output, in the input dtype
        for (int i = tid; i < rows * REAL_DIM; i += NUM_THREADS) {
            const int r = i / REAL_DIM, d = i % REAL_DIM;
            float o = 0.f;
#pragma unroll
            for (int t = 0; t < SLOTS; ++t) {
                const float wt = sm_l[wrow(r, t)];
                o = wt != 0.f ? fmaf(wt, sm_acc[wrow(r, t) * ACC_STRIDE + d], o) : o;
            }
            out_row(r)[d] = E::from_float(o);
            if (lse_out && d == 0) lse_out[state_row(r)] = s_lse[r];
        }
    } else {  // partials (float32, 16-byte aligned workspace): four elements per thread
        for (int i = tid; i < rows * (REAL_DIM / 4); i += NUM_THREADS) {
            const int r = i / (REAL_DIM / 4), d = (i % (REAL_DIM / 4)) * 4;
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int t = 0; t < SLOTS; ++t) {
                const float wt = sm_l[wrow(r, t)];
                if (wt != 0.f) {
                    const float4 a = *reinterpret_cast<const float4*>(sm_acc + wrow(r, t) * ACC_STRIDE + d);
                    o.x = fmaf(wt, a.x, o.x); o.y = fmaf(wt, a.y, o.y);
                    o.z = fmaf(wt, a.z, o.z); o.w = fmaf(wt, a.w, o.w);
                }
            }
            const long long row = (long long)split * batch * q_len * num_heads + state_row(r);
            *reinterpret_cast<float4*>(o_part + row * REAL_DIM + d) = o;
            if (d == 0) lse_part[row] = s_lse[r];
        }
    }
    if (!o_part || !counters) return;

    // ---------------------------------------------------------------- fused merge (last block)
    // Arrival count with acquire-release semantics at GPU scope (PTX memory model): the barrier
    // orders every thread's partial stores before thread 0's release; the last block's acquire,
    // spread to its threads by the next barrier, orders its loads of all partials after them.
    // No sequentially consistent fences (__threadfence) are needed on either side.
    __shared__ int s_last;
    __syncthreads();
    if (tid == 0) {
        unsigned* ctr = reinterpret_cast<unsigned*>(counters) +
                        ((long long)b * num_units + unit) * head_tiles + head_tile;
        // inc wraps to 0 on the last arrival: the counter is clean for the next launch without a
        // second access.
        s_last = cd_atomic_inc_acq_rel(ctr, num_splits - 1) == (unsigned)(num_splits - 1);
    }
    __syncthreads();
    if (!s_last) return;
    // the tokens the splits cover: seqlen − lo (recomputed: no register held through the loop)
    const int covered = opt.window_left >= 0
        ? max(0, min(seqlen, opt.window_left + q_len - cd_tokens_after(opt.tokens_after, b))) : seqlen;
    const int live_splits = min(num_splits, (covered + chunk_tokens - 1) / chunk_tokens);
    const long long state_rows = (long long)batch * q_len * num_heads;
    // One warp per pass of a row (32 lanes × MERGE_NV elements). merge="auto" picks this merge
    // only where every warp gets at most one pass of ≤ 16 splits: one trip to L2
    // (_policy.merge_mode; FUSED_PASS there is 32 · MERGE_NV).
    constexpr int MERGE_NV = 4;
    constexpr int PASSES = (REAL_DIM + 32 * MERGE_NV - 1) / (32 * MERGE_NV);
    for (int item = warp; item < rows * PASSES; item += NUM_WARPS) {
        const int r = item / PASSES, pass = item % PASSES;
        const long long row = state_row(r);
        const int head = row_head(r);
        cd_merge_row_pass<cd_elem<2>, E, MERGE_NV>(o_part + row * REAL_DIM, state_rows * REAL_DIM,
                                           lse_part + row, state_rows, live_splits, REAL_DIM,
                                           pass, out_row(r), lse_out ? lse_out + row : nullptr,
                                           lane, opt.sinks ? opt.sinks[head] : CD_NEG_INF);
    }
}

// One block per SM by design for G ≤ 16 (its shared memory alone fills most of an SM), so the
// register budget is the whole SM's: stated as minBlocks = 1, ptxas no longer caps 256-thread
// shapes at 128 registers (head_dim 64 spilled 24 bytes there) or spills the float32 path. (Some
// M-tile shapes leave room for a second block; the host asks the driver's occupancy calculator.)
extern "C" __global__ void __launch_bounds__(NUM_THREADS, 1)
cd_decode_split(const cd_decode_params p) {
    // Phases (docs/DESIGN.md): 1 entry (here) — 2 KV view (here: load_tile, next_tile, the
    // appended rows; cd_quantize_new_rows, cd_stage_new_rows; and the Q tile into shared
    // memory) — 3 tile compute (one math path:
    // cd_chunk_heads_as_n, cd_chunk_m_tiles or cd_chunk_f32, every score through score_mod, the
    // state in cd_tc_state or cd_f32_state) — 4 epilogue (cd_epilogue: merge the warps, write the
    // output or the partials, the fused merge's last block).
    // ================================================================ 1. entry
    // Launched as a programmatic dependent of the kernel before it (DecodePlan(enable_pdl=True)),
    // the grid may be resident before that kernel ends: nothing it wrote (q, lengths, the cache's
    // new rows) is read before this wait. A no-op for a plain launch (common.cuh).
    cd_wait_prerequisites();
    const q_t* __restrict__ q = p.q;
    const kv_t* __restrict__ k = p.k;
    const kv_t* __restrict__ v = p.v;
    const int* __restrict__ seqlens = p.seqlens;
    const long long q_sb = p.q_sb, q_sh = p.q_sh, k_sb = p.k_sb, k_ss = p.k_ss, k_sh = p.k_sh;
    const long long v_sb = p.v_sb, v_ss = p.v_ss, v_sh = p.v_sh;
    const int seqlen_all = p.seqlen_all, max_seqlen = p.max_seqlen, num_heads = p.num_heads;
    const int group = p.group, head_tiles = p.head_tiles, chunk_tokens = p.chunk_tokens;
    const float scale_log2 = p.scale_log2;
    extern __shared__ __align__(128) unsigned char smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int split = blockIdx.y, head_tile = blockIdx.x % head_tiles;
    // unit: the block's group of KV_PER_BLOCK KV heads (one KV head where KV_PER_BLOCK is 1)
    const int unit = blockIdx.x / head_tiles, b = blockIdx.z, batch = gridDim.z;
    const int num_units = gridDim.x / head_tiles, num_splits = gridDim.y;
#if MULTI_Q
    const int q_len = p.q_len;  // query tokens per sequence
#else
    constexpr int q_len = 1;
#endif
    const int vgroup = q_len * group;  // query rows of a KV head: q_len tokens × G heads
    const int row0 = head_tile * BLOCK_ROWS;               // first row of this tile in the group
    // live query rows in this block: its M-tiles' rows, or all query heads of its KV heads
    const int rows = KV_PER_BLOCK > 1 ? KV_PER_BLOCK * group : min(BLOCK_ROWS, vgroup - row0);
    const int mt = warp % MTILES;                          // this warp's M-tile
    const int ring_id = warp / MTILES;                     // its ring (its slot's, for M-tiles)
    const int slot = ring_id / KV_PER_BLOCK;               // its token slot
    const int kh = ring_id % KV_PER_BLOCK;                 // its KV head within the block
    const int kv_head = unit * KV_PER_BLOCK + kh;          // the KV head this warp computes
    // the block's first query row: its first query head (MULTI_Q: a row of qrow_of)
    const int h0 = unit * KV_PER_BLOCK * vgroup + row0;
    // A block of several KV heads holds 8 query rows per KV head (the mma's N): a launch with
    // more (a host bug) must not index past them, even on an empty chunk.
    if (KV_PER_BLOCK > 1 && group > 8) __trap();
    // sm_new holds NEW_ROWS appended rows: the host checks q_len against the same figure
    // (MAX_APPEND_Q_LEN, which its SMEM_BYTES_HOST counts: a mismatch fails the build)
    const cd_options opt = cd_options_of(p);
    // Once every block of this grid has passed here (so none is left to be scheduled), a merge
    // kernel launched after it may start and wait on the SMs for this grid's end (common.cuh).
    cd_launch_dependents();

    // Clamp device-provided lengths: nothing is ever read outside [0, max_seqlen). An appended
    // token (k_new, v_new: n_new = 1) takes position new_lo, the clamped length, if that is
    // inside the capacity (a full sequence appends nothing; reference.append_kv's order), so a
    // length below 0 appends at 0 and one near 2³¹ cannot overflow.
    int seqlen = seqlen_all;
    if (seqlens)  // int64 lengths clamped in 64 bits: one past 2³¹ must not wrap to a small one
        seqlen = opt.seqlens_64 ? (int)max(0LL, min(reinterpret_cast<const long long*>(seqlens)[b],
                                                  (long long)max_seqlen))
                              : seqlens[b];
    seqlen = max(0, min(seqlen, max_seqlen));
    const int new_lo = seqlen;
    seqlen += min(opt.n_new, max_seqlen - seqlen);
    // Query token 0's position: seqlen − q_len, or past this cache's keys where it holds a shard
    // of the sequence (cd_tokens_after).
    const int qpos = seqlen + cd_tokens_after(opt.tokens_after, b) - q_len;
    // A window (window_left W ≥ 0) keeps the keys [qpos + q_len − 1 − W, seqlen): the splits cover
    // only those (the host sizes them from min(max_seqlen, W + q_len)), so nothing before is read at
    // all. (MULTI_Q: from the first query token's window, qpos − W; each row masks the rest)
    const int lo = opt.window_left >= 0 ? min(seqlen, max(0, qpos - opt.window_left)) : 0;
    const int chunk_start = lo + split * chunk_tokens;
    const int chunk_end = min(chunk_start + chunk_tokens, seqlen);
    const cd_score_params score_params{scale_log2, chunk_end, p.soft_cap_in, p.soft_cap_out,
                                       p.alibi_slopes, qpos, num_heads - 1};

    float* sm_acc = reinterpret_cast<float*>(smem + Q_BYTES);                // aliases the ring
    float* sm_m = reinterpret_cast<float*>(smem + Q_BYTES + BODY_BYTES);
    float* sm_l = sm_m + NUM_WARPS * ROWS;

    if (chunk_start < chunk_end) {
        q_t* sq = reinterpret_cast<q_t*>(smem);
        // ================================================================ 2. KV view
        // ------------------------------------------------- this warp's K/V ring (its slot's)
        unsigned char* ring = smem + Q_BYTES + ring_id * (STAGES * 2 * TILE_BYTES);
        const u32 ring_u32 = smem_u32(ring);
#if PAGED
        // Paged: the cache is a pool of pages (k_sb, v_sb: the page stride); token t of this
        // sequence is row t % page_size of page table[t / page_size]. Only entries of tokens
        // below the length are read, and a page index outside [0, num_pages) reads nothing.
        const int* __restrict__ table = p.block_table + b * p.bt_sb * (p.table_64 ? 2 : 1);
        // entry j of this sequence's row; an int64 table (torch's default) is read in 64 bits,
        // and an entry outside [0, num_pages) there becomes −1 (read nothing), not a wrapped one
        auto entry = [&](int j) -> int {
            if (!p.table_64) return table[j];
            const long long e = reinterpret_cast<const long long*>(table)[j];
            return e >= 0 && e < p.num_pages ? (int)e : -1;
        };
        const int page_size = p.page_size, num_pages = p.num_pages;
        u32* sm_live = reinterpret_cast<u32*>(smem + Q_BYTES + BODY_BYTES + ML_BYTES);
        const kv_t* kbase = k + (long long)kv_head * k_sh;
        const kv_t* vbase = v + (long long)kv_head * v_sh;
#else
        const kv_t* kbase = k + b * k_sb + (long long)kv_head * k_sh;
        const kv_t* vbase = v + b * v_sb + (long long)kv_head * v_sh;
#endif
        const int n_tiles = (chunk_end - chunk_start + TILE_N - 1) / TILE_N;
        const int my_tiles = slot < n_tiles ? (n_tiles - slot + SLOTS - 1) / SLOTS : 0;
        // One M-tile: each warp streams through its own ring, and by default waits only for its
        // own tiles. With warps_in_step (the host's choice for long heads-as-N chunks,
        // _policy.warps_in_step) the block's warps meet at a barrier per tile instead, so they
        // stay in step: measured 0.2–1.4% faster on long streams, slower on short chunks
        // (the performance log, v15); the host sets it for every plan of several KV heads per
        // block. Only where every slot has as many tiles, so that every warp meets the barrier
        // equally often (a uniform condition over the block).
        const bool in_step = MTILES == 1 && p.warps_in_step && n_tiles % SLOTS == 0;
        const bool loader = mt == 0;  // the slot's warp that copies its tiles
        // With MTILES > 1, a slot with fewer tiles than the first meets its named barrier once
        // more after its loop (an idle turn), so that every slot meets its barrier equally often.
        // Each slot only ever waits for its own warps, so the synchronisation does not need it;
        // compute-sanitizer's racecheck does: with unequal counts it reported hazards between
        // accesses that a __syncthreads() separates (the performance log, v12).
        const int loop_tiles = MTILES == 1 ? my_tiles : (n_tiles + SLOTS - 1) / SLOTS;

        auto tile_start = [&](int i) { return chunk_start + (slot + i * SLOTS) * TILE_N; };
        const unsigned long long policy = l2_evict_first_policy();
        // Each lane copies the same slots of every tile: rows r0, r0 + RSTEP, … of 16-byte column
        // c0 (WIDE rows, 64 chunks: columns c0 and c0 + 32 of every row). A whole tile is then one
        // 64-bit pointer step per copy, with no per-row index math or masks (that math was half of
        // the loop's instructions; the performance log, v10); only a chunk's partial last tile
        // takes the masked path below. (float32 head_dim 256, 64 chunks a row, always takes the
        // masked path: walking, it spills 16 more bytes at its 255 registers.)
        constexpr bool WALK = CPR <= 32 || WIDE;
        constexpr int RSTEP = CPR <= 32 ? 32 / CPR : 1;  // rows apart of a lane's copies
        constexpr int LCOLS = CPR <= 32 ? 1 : CPR / 32;  // a lane's columns per row
        static_assert(!WALK || ((32 % CPR == 0 || CPR % 32 == 0) && TILE_N % RSTEP == 0),
                      "the walking copy needs whole rows per 32 lanes and whole steps per tile");
        const int r0 = lane / CPR, c0 = lane % CPR;
        // this lane's column is in memory; one that is not copies zeros (from a valid address)
        const bool c0_live = CHUNK_IN_MEMORY(c0);
        const int c0m = c0_live ? c0 : 0;
        const long long k_rows = (long long)RSTEP * k_ss, v_rows = (long long)RSTEP * v_ss;
        const long long k_tiles = (long long)SLOTS * TILE_N * k_ss;  // from a slot's tile to its next
        const long long v_tiles = (long long)SLOTS * TILE_N * v_ss;
        // The walking copy of one whole tile whose lane's first K and V addresses are kp, vp
        // (column c0's; column c0 + 32u, u > 0, is 32u chunks on, or zeros read from column 0).
        auto walk_tile = [&](u32 kdst, u32 vdst, const kv_t* kp, const kv_t* vp) {
#pragma unroll
            for (int j = 0; j < TILE_N / RSTEP; ++j) {
#pragma unroll
                for (int u = 0; u < LCOLS; ++u) {
                    const int cu = c0 + 32 * u;
                    const bool live = CHUNK_IN_MEMORY(cu);
                    const int at = u == 0 ? 0 : ((live ? cu : 0) - c0m) * EPC;
                    const int so = ring_chunk(r0 + j * RSTEP, cu) * 16;
                    cp_async16_stream(kdst + so, kp + at, live, policy);
                    cp_async16_stream(vdst + so, vp + at, live, policy);
                }
                kp += k_rows;
                vp += v_rows;
            }
        };
        // KV_SCALE_TOKEN: lane l copies the scale of its tile's row l % 16, K's (l < 16) or V's,
        // at ``at`` (the row's (token, KV head) index) where ``ok``; zeros (no key) otherwise.
        const int num_kv_heads = num_heads / group;
#if KV_SCALE_TOKEN
        float* sm_tsc = reinterpret_cast<float*>(smem + Q_BYTES + BODY_BYTES + ML_BYTES + LIVE_BYTES);
        // tile i's scales: K's of row r at [r], V's at [TILE_N + r]
        auto tile_scales = [&](int i) -> const float* {
            return sm_tsc + (ring_id * STAGES + i % STAGES) * 2 * TILE_N;
        };
        auto copy_scales = [&](int stage, bool ok, long long at) {
            const float* src = lane < TILE_N ? p.k_scale : p.v_scale;
            cp_async4(smem_u32(sm_tsc + (ring_id * STAGES + stage) * 2 * TILE_N + lane),
                      ok ? src + at : src, ok);
        };
#else
        auto tile_scales = [](int i) -> const float* { (void)i; return nullptr; };
        auto copy_scales = [](int stage, bool ok, long long at) { (void)stage; (void)ok; (void)at; };
#endif
#if PAGED
        // A tile inside one page takes the walking copy from that page; any other tile (pages of
        // < 16 tokens, a tile across a page boundary, the chunk's partial last tile) has the
        // lanes that copy a row take that row's page from the lane that looked it up. Lane l
        // (mod 16) looks up row l of the next tile this warp loads while it copies the current
        // one, so the table read's latency hides behind a tile instead of stalling every copy
        // (measured on the H200 at 16 × 32k tokens with pages of 1 token: 563.5 µs with the
        // lookup in line). Rows without a key are zero-filled and masked (kv_mask).
        int pf_page = 0, pf_row = 0;  // this lane's row of the next tile: its page entry and row
        bool pf_key = false;          // the row is below the chunk's end (its entry was read)
        auto look_up = [&](int i) {
            const int tok = tile_start(i) + (lane & (TILE_N - 1));
            pf_key = tok < chunk_end;
            pf_page = pf_row = 0;
            if (pf_key) {
                const int pj = tok / page_size;
                pf_page = entry(pj);  // only consumed by the next load_tile: not waited for here
                pf_row = tok - pj * page_size;
            }
        };
        if (loader && my_tiles > 0) look_up(0);
        auto load_tile = [&](int i, int stage) {
            const int t0 = tile_start(i);
            const u32 kdst = ring_u32 + stage * 2 * TILE_BYTES;
            const u32 vdst = kdst + TILE_BYTES;
            const bool ok = pf_key && (unsigned)pf_page < (unsigned)num_pages;
            const int pg = ok ? pf_page : 0, row = ok ? pf_row : 0;  // a valid address if not
            if (i + 1 < my_tiles) look_up(i + 1);
            const u32 live = __ballot_sync(0xffffffffu, ok) & 0xffffu;
            const int off = __shfl_sync(0xffffffffu, row, 0);  // row 0's place in its page
            // every row has a key and the tile ends inside row 0's page: one page, walked
            if (WALK && live == 0xffffu && off + TILE_N <= page_size) {
                const long long page0 = __shfl_sync(0xffffffffu, pg, 0);
                const kv_t* kp = kbase + page0 * k_sb + (long long)(off + r0) * k_ss + c0m * EPC;
                const kv_t* vp = vbase + page0 * v_sb + (long long)(off + r0) * v_ss + c0m * EPC;
                walk_tile(kdst, vdst, kp, vp);
            } else {
#pragma unroll
                for (int j = 0; j < TILE_N * CPR / 32; ++j) {
                    const int cid = lane + 32 * j;
                    const int r = cid / CPR, c = cid % CPR;
                    const long long rp = __shfl_sync(0xffffffffu, pg, r);
                    const long long rr = __shfl_sync(0xffffffffu, row, r);
                    const bool rok = ((live >> r) & 1u) && CHUNK_IN_MEMORY(c);
                    const int so = ring_chunk(r, c) * 16, cm = CHUNK_IN_MEMORY(c) ? c : 0;
                    cp_async16_stream(kdst + so, kbase + rp * k_sb + rr * k_ss + cm * EPC, rok, policy);
                    cp_async16_stream(vdst + so, vbase + rp * v_sb + rr * v_ss + cm * EPC, rok, policy);
                }
            }
            if (lane == 0) sm_live[ring_id * STAGES + stage] = live;
            copy_scales(stage, ok, ((long long)pg * page_size + row) * num_kv_heads + kv_head);
        };
        // the mask of tile i, visible to the slot's warps once next_tile(i) has returned
        auto tile_live = [&](int i) -> u32 { return sm_live[ring_id * STAGES + i % STAGES]; };
        (void)k_tiles;
        (void)v_tiles;
#else
        auto tile_live = [&](int i) -> u32 { (void)i; return 0xffffu; };
        // this lane's first K and V addresses of the next tile load_tile walks (tiles are loaded
        // in order, each walked one slot stride after the last)
        const kv_t* k_lane = kbase + (long long)(tile_start(0) + r0) * k_ss + c0m * EPC;  // tile 0
        const kv_t* v_lane = vbase + (long long)(tile_start(0) + r0) * v_ss + c0m * EPC;
        auto load_tile = [&](int i, int stage) {
            const int t0 = tile_start(i);
            const u32 kdst = ring_u32 + stage * 2 * TILE_BYTES;
            const u32 vdst = kdst + TILE_BYTES;
            {
                const int tok = t0 + (lane & (TILE_N - 1));
                copy_scales(stage, tok < chunk_end,
                            ((long long)b * max_seqlen + tok) * num_kv_heads + kv_head);
            }
            if (WALK && t0 + TILE_N <= chunk_end) {
                walk_tile(kdst, vdst, k_lane, v_lane);
                k_lane += k_tiles;
                v_lane += v_tiles;
                return;
            }
#pragma unroll
            for (int j = 0; j < TILE_N * CPR / 32; ++j) {
                const int cid = lane + 32 * j;
                const int r = cid / CPR, c = cid % CPR;
                const bool ok = t0 + r < chunk_end && CHUNK_IN_MEMORY(c);
                const long long tok = ok ? t0 + r : chunk_start;  // valid address even if unused
                const int so = ring_chunk(r, c) * 16, cm = CHUNK_IN_MEMORY(c) ? c : 0;
                cp_async16_stream(kdst + so, kbase + tok * k_ss + cm * EPC, ok, policy);
                cp_async16_stream(vdst + so, vbase + tok * v_ss + cm * EPC, ok, policy);
            }
        };
#endif

        // The appended token (position new_lo, in this block's chunk when new_lo < chunk_end):
        // the view copies its row from the cache like any other (stale there: its place is only
        // written now) and then overwrites it in the ring from sm_new, the rows k_new and v_new
        // hold (patch_new_row); the blocks of head tile 0 also write them into the cache. No part
        // of this launch reads those cache rows after the copy.
        uint4* sm_new = reinterpret_cast<uint4*>(smem + Q_BYTES + BODY_BYTES + ML_BYTES + LIVE_BYTES
                                                 + TSCALE_BYTES);
#if KV_FP8
        // fp8 KV: the scales the appended rows were quantised with, after their codes (row 2j: K
        // of appended token j, 2j + 1: V)
        float* sm_new_scale = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(sm_new)
                                                       + NEW_CODE_BYTES);
#endif
#if KV_FP8 || MULTI_Q
        // where appended token tok goes in the cache (the KV view's rows; cd_cache_row)
        auto cache_row = [&](int tok) -> cd_cache_row {
#if PAGED
            const int pj = tok / page_size;
            const int page = entry(pj);
            const int row = tok - pj * page_size;
            return {(unsigned)page < (unsigned)num_pages, (long long)page * page_size + row,
                    page * k_sb + (long long)row * k_ss, page * v_sb + (long long)row * v_ss};
#else
            return {true, (long long)b * max_seqlen + tok, b * k_sb + (long long)tok * k_ss,
                    b * v_sb + (long long)tok * v_ss};
#endif
        };
#endif
        // KV_SCALE_TOKEN: tile i's row r is appended token j: its scales into the tile's, by the
        // lanes that copied them (r: K's, TILE_N + r: V's)
        auto patch_new_scales = [&](int i, int r, int j) {
#if KV_SCALE_TOKEN
            if ((lane & (TILE_N - 1)) == r)
                sm_tsc[(ring_id * STAGES + i % STAGES) * 2 * TILE_N + lane] =
                    sm_new_scale[2 * j + (lane >= TILE_N)];
#else
            (void)i; (void)r; (void)j;
#endif
        };
#if MULTI_Q
        // MULTI_Q: the appended tokens are [new_lo, seqlen), n_new of them (fewer at capacity);
        // this chunk holds [new_in, new_out) of them, token new_lo + j in sm_new's rows 2j, 2j + 1
        const int new_in = max(new_lo, chunk_start), new_out = min(seqlen, chunk_end);
        const bool has_new = opt.n_new > 0 && new_in < new_out;  // (a constant false without options)
        auto patch_new_row = [&](int i) {
            if (!has_new) return;
            const int t0 = tile_start(i);
            const int r_lo = max(new_in - t0, 0), r_hi = min(new_out - t0, TILE_N);
            unsigned char* st = ring + (i % STAGES) * 2 * TILE_BYTES;
            for (int r = r_lo; r < r_hi; ++r) {
                if (!((tile_live(i) >> r) & 1u)) continue;
                const int j = t0 + r - new_lo;
                for (int c = (lane - r * CPR) & 31; c < CPR; c += 32) {  // lane (r·CPR + c) % 32
                    *reinterpret_cast<uint4*>(st + ring_chunk(r, c) * 16) = sm_new[(2 * j) * CPR + c];
                    *reinterpret_cast<uint4*>(st + TILE_BYTES + ring_chunk(r, c) * 16) =
                        sm_new[(2 * j + 1) * CPR + c];
                }
                patch_new_scales(i, r, j);
            }
        };
#else
        const bool has_new = opt.n_new > 0 && new_lo < chunk_end;  // (a constant false without options)
        // after tile i's copies have landed (this lane's: it copied the same 16-byte chunks, in
        // either copy of load_tile, so program order covers it), before the tile is shown
        auto patch_new_row = [&](int i) {
            const int r = new_lo - tile_start(i);
            if (!has_new || (unsigned)r >= TILE_N || !((tile_live(i) >> r) & 1u)) return;
            unsigned char* st = ring + (i % STAGES) * 2 * TILE_BYTES;
            for (int c = (lane - r * CPR) & 31; c < CPR; c += 32) {  // chunk (r, c): lane (r·CPR + c) % 32
                *reinterpret_cast<uint4*>(st + ring_chunk(r, c) * 16) = sm_new[(2 * kh) * CPR + c];
                *reinterpret_cast<uint4*>(st + TILE_BYTES + ring_chunk(r, c) * 16) = sm_new[(2 * kh + 1) * CPR + c];
            }
            patch_new_scales(i, r, 0);
        };
#endif

        // Start streaming K/V first: the Q load and its barrier then overlap the first
        // tiles' latency instead of delaying it.
        if (loader) {
#pragma unroll
            for (int i = 0; i < STAGES - 1; ++i) {
                if (i < my_tiles) load_tile(i, i);
                cp_async_commit();
            }
        }
        // The new rows' 16-byte chunks (KV head of the block, column), one per thread, loaded
        // here and stored after the Q load, so that the latencies overlap; a page index outside
        // [0, num_pages) writes nothing (and its row counts for nothing: tile_live).
        static_assert(KV_PER_BLOCK * CPR <= NUM_THREADS, "a thread per chunk of the new rows");
        const bool app = !MULTI_Q && !KV_FP8 && has_new && tid < KV_PER_BLOCK * CPR;
        const int app_head = unit * KV_PER_BLOCK + tid / CPR, app_c = tid % CPR;
        uint4 app_k = make_uint4(0u, 0u, 0u, 0u), app_v = app_k;
        long long app_kr = -1, app_vr = -1;  // the row's place in the cache; -1: not written
        if (app && CHUNK_IN_MEMORY(app_c)) {  // (a chunk past REAL_DIM stays zero)
            app_k = *reinterpret_cast<const uint4*>(p.k_new + b * p.kn_sb + (long long)app_head * p.kn_sh + app_c * EPC);
            app_v = *reinterpret_cast<const uint4*>(p.v_new + b * p.vn_sb + (long long)app_head * p.vn_sh + app_c * EPC);
#if PAGED
            const int pj = new_lo / page_size;  // an entry of the row: new_lo < max_seqlen
            const int page = entry(pj);
            if ((unsigned)page < (unsigned)num_pages) {
                app_kr = page * k_sb + (long long)(new_lo - pj * page_size) * k_ss;
                app_vr = page * v_sb + (long long)(new_lo - pj * page_size) * v_ss;
            }
#else
            app_kr = b * k_sb + (long long)new_lo * k_ss;
            app_vr = b * v_sb + (long long)new_lo * v_ss;
#endif
        }
        // ---------------------------------------------------------------- Q tile → shared
        for (int i = tid; i < Q_ROWS * QCPR; i += NUM_THREADS) {
            const int r = i / QCPR, c = i % QCPR;
            // shared row r: the block's row r, or query head r % 8 of the block's KV head r / 8
            const bool live = KV_PER_BLOCK > 1 ? (r & 7) < group : r < rows;
            const int qh = KV_PER_BLOCK > 1 ? h0 + (r >> 3) * group + (r & 7) : h0 + r;
            const cd_qrow qr = qrow_of(qh, group, vgroup);
            uint4 val = make_uint4(0u, 0u, 0u, 0u);
            if (live && Q_CHUNK_IN_MEMORY(c))
                val = *reinterpret_cast<const uint4*>(q + b * q_sb + qr.t * p.q_st
                                                      + (long long)qr.head * q_sh + c * QEPC);
#if DTYPE_ID != 2
            reinterpret_cast<uint4*>(sq)[swz_q(r, c)] = val;
#else
            reinterpret_cast<uint4*>(sq)[r * QCPR + c] = val;
#endif
        }
#if KV_FP8
        // fp8 KV: the chunk's appended tokens, quantised into sm_new and the cache
        {
#if MULTI_Q
            const int new_rows = new_out - new_in, j0 = new_in - new_lo;
#else
            const int new_rows = has_new ? 1 : 0, j0 = 0;
#endif
            cd_quantize_new_rows(p, b, new_lo, j0, new_rows, kv_head, head_tile, num_kv_heads,
                                 reinterpret_cast<unsigned char*>(sm_new), sm_new_scale, cache_row);
        }
#elif MULTI_Q
        cd_stage_new_rows(p, b, new_lo, new_in, new_out, kv_head, head_tile, sm_new, cache_row);
#endif
        if (app) {
            sm_new[(2 * (tid / CPR)) * CPR + app_c] = app_k;
            sm_new[(2 * (tid / CPR) + 1) * CPR + app_c] = app_v;
            if (head_tile == 0 && app_kr >= 0) {  // the cache is only read by cp.async, and not there
                const long long at = (long long)app_head * k_sh + app_c * EPC;
                *reinterpret_cast<uint4*>(const_cast<kv_t*>(k) + app_kr + at) = app_k;
                *reinterpret_cast<uint4*>(const_cast<kv_t*>(v) + app_vr + (long long)app_head * v_sh + app_c * EPC) = app_v;
            }
        }
        __syncthreads();

        // Tile i is in the ring for every warp of the slot when this returns, and the stage tile
        // i + STAGES − 1 goes to (read in iteration i − 1) is free again, so it is loaded here.
        auto next_tile = [&](int i) {
            if constexpr (MTILES == 1) {  // the warp's own ring: load ahead, then wait; program order frees
                if (i + STAGES - 1 < my_tiles) load_tile(i + STAGES - 1, (i + STAGES - 1) % STAGES);
                cp_async_commit();
                cp_async_wait<STAGES - 1>();
                patch_new_row(i);
                if (in_step) __syncthreads();
                else __syncwarp();
            } else {  // shared by the slot's warps: the barrier shows the tile and frees the stage
                if (loader) {
                    cp_async_wait<STAGES - 2>();
                    patch_new_row(i);
                }
                slot_barrier(slot);
                if (loader) {
                    if (i + STAGES - 1 < my_tiles) load_tile(i + STAGES - 1, (i + STAGES - 1) % STAGES);
                    cp_async_commit();
                }
            }
        };

        // the warp's tiles through the block's math path, its state into sm_m, sm_l, sm_acc
        const auto tiles = cd_kv_tiles_of(my_tiles, loop_tiles, ring, next_tile, tile_start,
                                          tile_live, tile_scales);
        const cd_rows qrows{h0, group, vgroup, rows, opt.window_left, kh, mt, kv_head};
#if DTYPE_ID == 2
        cd_chunk_f32(tiles, score_params, qrows, sq, sm_m, sm_l, sm_acc);
#elif HEADS_AS_N
        cd_chunk_heads_as_n(tiles, p, score_params, qrows, sq, sm_m, sm_l, sm_acc);
#else
        cd_chunk_m_tiles(tiles, score_params, qrows, sq, sm_m, sm_l, sm_acc);
#endif
    } else {
        // Empty chunk (or empty sequence): every warp holds the empty state (−inf, 0, 0).
        for (int i = tid; i < NUM_WARPS * ROWS; i += NUM_THREADS) { sm_m[i] = CD_NEG_INF; sm_l[i] = 0.f; }
        for (int i = tid; i < NUM_WARPS * ROWS * ACC_STRIDE; i += NUM_THREADS) sm_acc[i] = 0.f;
    }
    __syncthreads();

    cd_epilogue(p, opt, {b, batch, split, num_splits, unit, num_units, head_tile, head_tiles,
                         q_len, group, vgroup, rows, h0, seqlen, chunk_tokens},
                sm_m, sm_l, sm_acc);
}
