// decode_params.cuh — the split kernel's parameters, declared once.
//
// One entry per parameter: its kind (PTR: an address, I64, I32, F32), its C type and its name.
// decode_split.cu builds its parameter struct from this list, and cupydecode/decode.py reads the
// list from this file to pack the same fields in the same order (little-endian, no padding: the
// list keeps falling alignment). A new parameter is one entry here, and its value in
// DecodePlan._launch, whose order decode.py checks against this list when it is imported.
// (The struct's tail may be padded to its 8-byte alignment: CD_PARAM_ALIGN in common.cuh.)
// (q_t, kv_t, out_t: the element types, defined by the file that includes this one.) A paged
// cache (PAGED) is (num_pages, page_size, num_kv_heads, head_dim): k_sb/v_sb are then the page
// strides and k_ss/v_ss the token strides within a page.
#pragma once

#define CD_DECODE_PARAMS(X)                                                                   \
    X(PTR, const q_t*, q)            /* (batch, num_heads, head_dim); MULTI_Q: (batch, q_len, …) */ \
    X(PTR, const kv_t*, k)           /* (batch, max_seqlen, kv heads, dim); PAGED: pages */   \
    X(PTR, const kv_t*, v)                                                                    \
    X(PTR, const int*, seqlens)      /* (batch,) lengths (int64: seqlens_64); null: all */    \
    X(PTR, float*, o_part)           /* partials; null for a single split (direct output) */  \
    X(PTR, float*, lse_part)                                                                  \
    X(PTR, out_t*, out)                                                                       \
    X(PTR, float*, lse_out)          /* may be null */                                        \
    X(PTR, int*, counters)           /* non-null: fused merge */                              \
    X(PTR, const int*, block_table)  /* PAGED: (batch, pages per sequence) page indices */    \
    X(PTR, const q_t*, k_new)        /* n_new > 0: (batch, n_new, kv heads, dim) new tokens */ \
    X(PTR, const q_t*, v_new)        /* (q's type: the cache's, or 16-bit for fp8 KV) */     \
    X(PTR, const float*, alibi_slopes) /* ALIBI: (num_heads,) float32 slopes */               \
    X(PTR, const float*, sinks)      /* (num_heads,) float32 sink logits (natural log), or null */ \
    X(PTR, float*, k_scale)          /* fp8 KV: (kv heads,) or per token (KV_SCALE_TOKEN), or null */ \
    X(PTR, float*, v_scale)                                                                   \
    X(PTR, const int*, tokens_after) /* (batch,) each sequence's tokens after this cache's, or null */ \
    X(I64, long long, q_sb)          /* strides, in elements */                               \
    X(I64, long long, q_sh)                                                                   \
    X(I64, long long, k_sb)                                                                   \
    X(I64, long long, k_ss)                                                                   \
    X(I64, long long, k_sh)                                                                   \
    X(I64, long long, v_sb)                                                                   \
    X(I64, long long, v_ss)                                                                   \
    X(I64, long long, v_sh)                                                                   \
    X(I64, long long, out_sb)                                                                 \
    X(I64, long long, out_sh)                                                                 \
    X(I64, long long, bt_sb)         /* PAGED: block_table's row stride */                    \
    X(I64, long long, kn_sb)         /* k_new's batch, token and head strides */              \
    X(I64, long long, kn_ss)                                                                  \
    X(I64, long long, kn_sh)                                                                  \
    X(I64, long long, vn_sb)                                                                  \
    X(I64, long long, vn_ss)                                                                  \
    X(I64, long long, vn_sh)                                                                  \
    X(I64, long long, q_st)          /* MULTI_Q: q's and out's token strides */               \
    X(I64, long long, out_st)                                                                 \
    X(I32, int, num_pages)           /* PAGED: pages in the cache; other indices read nothing */ \
    X(I32, int, seqlen_all)                                                                   \
    X(I32, int, max_seqlen)                                                                   \
    X(I32, int, num_heads)                                                                    \
    X(I32, int, group)                                                                        \
    X(I32, int, head_tiles)                                                                   \
    X(I32, int, chunk_tokens)                                                                 \
    X(I32, int, page_size)           /* PAGED: tokens per page (any ≥ 1) */                   \
    X(F32, float, scale_log2)        /* softmax scale · log2(e) */                            \
    X(I32, int, warps_in_step)       /* 1: the block's warps take their tiles in step */     \
    X(F32, float, soft_cap_in)       /* SOFT_CAP: 2·log2(e) · scale / cap (else unused) */   \
    X(F32, float, soft_cap_out)      /* SOFT_CAP: cap · log2(e) */                           \
    X(I32, int, n_new)               /* new tokens per sequence (k_new, v_new); 0: none */    \
    X(I32, int, window_left)         /* W ≥ 0: only keys ≥ position − W; −1: no window */    \
    X(I32, int, seqlens_64)          /* 1: seqlens holds int64 lengths (torch's default) */  \
    X(I32, int, table_64)            /* PAGED, 1: block_table holds int64 page indices */     \
    X(I32, int, q_len)               /* MULTI_Q: query tokens per sequence (else 1) */     \
    X(F32, float, k_scale_all)       /* fp8 KV: the per-tensor scales (null k_scale/v_scale) */ \
    X(F32, float, v_scale_all)

#define CD_PARAM_FIELD(kind, type, name) type name;
#define CD_PARAM_SIZE(kind, type, name) +sizeof(type)
