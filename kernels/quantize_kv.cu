// quantize_kv.cu — fp8 codes of K or V rows: cupydecode.quantize_kv, the standalone quantiser.
//
// A row is one (token, KV head): head_dim elements of x (IN_DTYPE: 0 f16, 1 bf16, 2 f32),
// written as codes of FP8 (0 e4m3, 1 e5m2; fp8.cuh) to out. Its scale s:
//   SCALE_MODE 0: computed, s = amax / the largest finite value (float32 division), amax the
//                 largest |x| of the row (a NaN counts: NaN is not finite); s = 1 where amax is
//                 not finite or is 0; written to scale_out[row];
//   SCALE_MODE 1: one float for every row (per tensor);
//   SCALE_MODE 2: scale_in[head] (per KV head);
//   SCALE_MODE 3: scale_in[row] (per token and head, given).
// code = encode(x / s) with x in float32 and an IEEE division: the rule reference.quantize_kv
// follows bit for bit. One warp per row, rows in grid-stride order.
//
// Layout: x and out (lead0, lead1, num_kv_heads, head_dim) with element strides for the three
// leading axes (the last axis contiguous); rows are numbered (i0 · lead1 + i1) · num_kv_heads + h,
// which is also the index of scale_in / scale_out (contiguous, x's shape without head_dim).
#include "common.cuh"
#include "fp8.cuh"

#if FP8 == 0
typedef cd_e4m3 fmt;
#else
typedef cd_e5m2 fmt;
#endif
typedef cd_elem<IN_DTYPE> in_e;

#define CD_QUANT_PER_LANE 8  // head_dim ≤ 256: at most 8 elements per lane

extern "C" __global__ void __launch_bounds__(256)
cd_quantize_kv(const in_e::storage* __restrict__ x, u8* __restrict__ out,
               const float* __restrict__ scale_in, float* __restrict__ scale_out,
               long long x_s0, long long x_s1, long long x_sh,
               long long o_s0, long long o_s1, long long o_sh,
               long long rows, int lead1, int num_kv_heads, int head_dim, float scale_all) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
         row < rows; row += warps) {
        const int h = (int)(row % num_kv_heads);
        const long long t = row / num_kv_heads;
        const long long i0 = t / lead1, i1 = t % lead1;
        const in_e::storage* xr = x + i0 * x_s0 + i1 * x_s1 + h * x_sh;
        u8* orow = out + i0 * o_s0 + i1 * o_s1 + h * o_sh;
        float v[CD_QUANT_PER_LANE];
        float amax = 0.0f;
#pragma unroll
        for (int j = 0; j < CD_QUANT_PER_LANE; ++j) {
            const int d = lane + 32 * j;
            v[j] = d < head_dim ? in_e::to_float(xr[d]) : 0.0f;
            const float a = fabsf(v[j]);
            amax = (a > amax || a != a) ? a : amax;  // a NaN wins
        }
        float s;
#if SCALE_MODE == 0
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float a = __shfl_xor_sync(0xffffffffu, amax, o);
            amax = (a > amax || a != a) ? a : amax;
        }
        s = amax / cd_fp8_max<fmt>();
        if (!(s > 0.0f && s <= 3.402823466e38f)) s = 1.0f;  // 0, inf or NaN
        if (lane == 0) scale_out[row] = s;
#elif SCALE_MODE == 1
        s = scale_all;
#elif SCALE_MODE == 2
        s = scale_in[h];
#else
        s = scale_in[row];
#endif
#pragma unroll
        for (int j = 0; j < CD_QUANT_PER_LANE; ++j) {
            const int d = lane + 32 * j;
            if (d < head_dim) orow[d] = cd_fp8_encode<fmt>(v[j] / s);
        }
    }
}
