// append_kv.cu — each sequence's new token into its KV cache, right before the split kernel.
//
// flash_decode / DecodePlan.run with k_new, v_new (batch, 1, num_kv_heads, head_dim): the K and V
// rows of sequence b's new token go to position n_b = cache_seqlens[b] of its cache — row
// [b, n_b] of a contiguous cache, row n_b % page_size of page block_table[b, n_b / page_size] of
// a paged one — and the split kernel, launched next on the same stream, attends n_b + 1 tokens
// (its seqlen_add, kernels/decode_params.cuh), the new one included.
//
// Bounds: the device lengths are read here, never on the host, and clamped to [0, max_seqlen] as
// the split kernel clamps them; a position at or past max_seqlen (a full sequence) writes nothing,
// and neither does a page index outside [0, num_pages). Only the entry of the new token's page is
// read from the block table; that entry exists because the table holds at least
// ceil(max_seqlen / page_size) pages per sequence (the host checks). The caller advances
// cache_seqlens; this kernel never writes it.
//
// Grid: (num_kv_heads, batch); one thread per 16-byte chunk of a row (head_dim · itemsize / 16:
// 8 … 64 chunks), each copying its chunk of the K row and of the V row. Element types do not
// matter here: rows are copied as 16-byte vectors (the host checks that every base pointer and
// stride is a multiple of 16 bytes), strides are in 16-byte units. Contiguous or paged is a
// runtime switch (block_table null or not), so one build serves every dtype, head_dim and cache.
//
// A split kernel launched as a programmatic dependent of this one (DecodePlan(enable_pdl=True))
// may be scheduled once every block of this grid has started (cd_launch_dependents below); it
// reads nothing before its cd_wait_prerequisites, which waits for this grid to complete and for
// its writes to be visible (common.cuh).
#include "common.cuh"

// The kernel's parameters, declared once: cupydecode/decode.py reads this list to pack the same
// fields in the same order (as for the split kernel's list in decode_params.cuh).
#define CD_APPEND_PARAMS(X)                                                                   \
    X(PTR, uint4*, k)                /* (batch, max_seqlen, kv heads, dim); paged: pages */     \
    X(PTR, uint4*, v)                                                                         \
    X(PTR, const uint4*, k_new)      /* (batch, [1,] kv heads, dim) */                        \
    X(PTR, const uint4*, v_new)                                                               \
    X(PTR, const int*, seqlens)      /* (batch,) device lengths, or null: use seqlen_all */   \
    X(PTR, const int*, block_table)  /* (batch, pages per sequence); null: contiguous */      \
    X(I64, long long, k_sb)          /* 16-byte units: batch (paged: page) stride */          \
    X(I64, long long, k_ss)          /* token (paged: row within a page) stride */            \
    X(I64, long long, k_sh)          /* head stride */                                        \
    X(I64, long long, v_sb)                                                                   \
    X(I64, long long, v_ss)                                                                   \
    X(I64, long long, v_sh)                                                                   \
    X(I64, long long, kn_sb)         /* k_new's batch and head strides, 16-byte units */      \
    X(I64, long long, kn_sh)                                                                  \
    X(I64, long long, vn_sb)                                                                  \
    X(I64, long long, vn_sh)                                                                  \
    X(I64, long long, bt_sb)         /* block_table's row stride, in elements */              \
    X(I32, int, seqlen_all)                                                                   \
    X(I32, int, max_seqlen)          /* capacity: positions at or past it are not written */  \
    X(I32, int, page_size)           /* paged: tokens per page (≥ 1) */                      \
    X(I32, int, num_pages)           /* paged: pages in the cache */                          \
    X(I32, int, row_chunks)          /* 16-byte chunks per row: head_dim · itemsize / 16 */

#define CD_APPEND_FIELD(kind, type, name) type name;
#define CD_APPEND_SIZE(kind, type, name) +sizeof(type)
struct cd_append_params {
    CD_APPEND_PARAMS(CD_APPEND_FIELD)
};
// The host packs the fields back to back: interior padding would shift every field after it.
static_assert(cd_falling_alignment({CD_APPEND_PARAMS(CD_PARAM_ALIGN)}) &&
                  sizeof(cd_append_params) == (0 CD_APPEND_PARAMS(CD_APPEND_SIZE) + 7) / 8 * 8,
              "cd_append_params: the list must keep falling alignment (no padding)");

#define CD_APPEND_MAX_THREADS 64  // a row of head_dim 256 in float32: 64 chunks

extern "C" __global__ void __launch_bounds__(CD_APPEND_MAX_THREADS)
cd_append_kv(const cd_append_params p) {
    cd_launch_dependents();
    const int h = blockIdx.x, b = blockIdx.y;
    // The split kernel's clamp: a sequence holds [0, max_seqlen] tokens whatever the device says.
    int pos = p.seqlens ? p.seqlens[b] : p.seqlen_all;
    pos = max(0, min(pos, p.max_seqlen));
    if (pos >= p.max_seqlen) return;  // full: nothing written (the split kernel attends max_seqlen)
    long long kr, vr;  // the new row's place in the cache, 16-byte units
    if (p.block_table) {
        if (p.page_size < 1) return;
        const int pj = pos / p.page_size;  // < ceil(max_seqlen / page_size): an entry of the row
        const int page = p.block_table[b * p.bt_sb + pj];
        if ((unsigned)page >= (unsigned)p.num_pages) return;  // out of range: nothing written
        const long long row = pos - pj * p.page_size;
        kr = page * p.k_sb + row * p.k_ss;
        vr = page * p.v_sb + row * p.v_ss;
    } else {
        kr = b * p.k_sb + pos * p.k_ss;
        vr = b * p.v_sb + pos * p.v_ss;
    }
    uint4* kd = p.k + kr + h * p.k_sh;
    uint4* vd = p.v + vr + h * p.v_sh;
    const uint4* ks = p.k_new + b * p.kn_sb + h * p.kn_sh;
    const uint4* vs = p.v_new + b * p.vn_sb + h * p.vn_sh;
    for (int c = threadIdx.x; c < p.row_chunks; c += blockDim.x) {
        kd[c] = ks[c];
        vd[c] = vs[c];
    }
}
