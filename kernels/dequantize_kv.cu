// dequantize_kv.cu — values of fp8 K or V codes: cupydecode.dequantize_kv.
//
// A row is one (token, KV head): head_dim codes of FP8 (0 e4m3, 1 e5m2; fp8.cuh) in ``codes``,
// written to out (OUT_DTYPE: 0 f16, 1 bf16, 2 f32) as value(code) · s in float32, rounded once to
// out's type, s the row's scale:
//   SCALE_MODE 1: one float for every row (per tensor);
//   SCALE_MODE 2: scale_in[head] (per KV head);
//   SCALE_MODE 3: scale_in[row] (per token and head).
// value(code) comes from the decoding the attention kernels' tile math is to use
// (cd_fp8x4_to_16x2: exact in float16 and bfloat16, so in float32 too), four codes at a time.
// One warp per row, rows in grid-stride order; lane l decodes codes 4·(l + 32·j) … + 3.
//
// Layout: codes and out (lead0, lead1, num_kv_heads, head_dim) with element strides for the three
// leading axes (the last axis contiguous); rows are numbered (i0 · lead1 + i1) · num_kv_heads + h,
// which is also the index of a per-token scale_in (contiguous, the shape without head_dim).
#include "common.cuh"
#include "fp8.cuh"

#if FP8 == 0
typedef cd_e4m3 fmt;
#else
typedef cd_e5m2 fmt;
#endif
typedef cd_elem<OUT_DTYPE> out_e;

#define CD_DEQUANT_GROUPS 2  // head_dim ≤ 256: at most 2 groups of 4 codes per lane

extern "C" __global__ void __launch_bounds__(256)
cd_dequantize_kv(const u8* __restrict__ codes, out_e::storage* __restrict__ out,
                 const float* __restrict__ scale_in,
                 long long c_s0, long long c_s1, long long c_sh,
                 long long o_s0, long long o_s1, long long o_sh,
                 long long rows, int lead1, int num_kv_heads, int head_dim, float scale_all) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
         row < rows; row += warps) {
        const int h = (int)(row % num_kv_heads);
        const long long t = row / num_kv_heads;
        const long long i0 = t / lead1, i1 = t % lead1;
        const u8* crow = codes + i0 * c_s0 + i1 * c_s1 + h * c_sh;
        out_e::storage* orow = out + i0 * o_s0 + i1 * o_s1 + h * o_sh;
#if SCALE_MODE == 1
        const float s = scale_all;
#elif SCALE_MODE == 2
        const float s = scale_in[h];
#else
        const float s = scale_in[row];
#endif
#pragma unroll
        for (int j = 0; j < CD_DEQUANT_GROUPS; ++j) {
            const int d0 = 4 * (lane + 32 * j);
            if (d0 >= head_dim) break;
            u32 four = 0;  // byte loads: rows need no alignment, head_dim no multiple of 4
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (d0 + i < head_dim) four |= (u32)crow[d0 + i] << (8 * i);
            u32 lo, hi;
            cd_fp8x4_to_16x2<fmt, OUT_DTYPE == 1 ? 1 : 0>(four, lo, hi);
            const u32 pairs[2] = {lo, hi};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (d0 + i >= head_dim) break;
                const u16 bits = (u16)(pairs[i >> 1] >> (16 * (i & 1)));
                const float v = OUT_DTYPE == 1 ? cd_bf16_to_float(bits) : cd_half_to_float(bits);
                orow[d0 + i] = out_e::from_float(v * s);
            }
        }
    }
}
