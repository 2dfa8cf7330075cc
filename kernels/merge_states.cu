// merge_states.cu — FlashDecoding, kernel 2 of 2: merge S partial states through their LSE.
//
// Math (notation of DESIGN.md). For one row with states (Õ_i, LSE_i), i = 0..S-1:
//   LSE = max_i LSE_i + log Σ_i exp(LSE_i − max_i LSE_i)
//   w_i = exp(LSE_i − LSE)            every exponent ≤ 0: nothing can overflow
//   O   = Σ_i w_i Õ_i
// A state with LSE_i = −inf is empty and skipped outright (its Õ_i is never read, so even a NaN
// there cannot leak). All states empty: O = 0, LSE = −inf — no −inf − (−inf) is ever formed.
// Computed in the log2 domain (one ex2 per weight); LSE in and out is natural log.
//
// Layout: o_parts (S, rows, HEAD_DIM) in IN_DTYPE, lse_parts (S, rows) float32, both contiguous;
// out (rows, HEAD_DIM) in OUT_DTYPE, lse_out (rows) float32 or null.
// Grid mapping: one thread per (row, VEC consecutive elements); VEC = 4 when HEAD_DIM % 4 == 0.
// This kernel is both the second half of flash_decode and the public merge_states.
//
// Compile-time constants: IN_DTYPE, OUT_DTYPE (0 f16, 1 bf16, 2 f32), VEC.
#include "common.cuh"

typedef cd_elem<IN_DTYPE> EI;
typedef cd_elem<OUT_DTYPE> EO;

extern "C" __global__ void
cd_merge_states(const EI::storage* __restrict__ o_parts, const float* __restrict__ lse_parts,
                EO::storage* __restrict__ out, float* __restrict__ lse_out,
                int num_states, long long rows, int head_dim) {
    const int vecs = head_dim / VEC;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * vecs) return;
    const long long row = idx / vecs;
    const int d0 = (int)(idx % vecs) * VEC;

    float mx = CD_NEG_INF;
    for (int i = 0; i < num_states; ++i) mx = fmaxf(mx, lse_parts[i * rows + row] * CD_LOG2E);
    float o[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) o[e] = 0.f;
    float sum = 0.f;
    if (mx != CD_NEG_INF) {
        for (int i = 0; i < num_states; ++i) {
            const float lse2 = lse_parts[i * rows + row] * CD_LOG2E;
            if (lse2 == CD_NEG_INF) continue;
            const float w = cd_exp2(lse2 - mx);  // ≤ 1; normalised by the sum below
            sum += w;
            const EI::storage* src = o_parts + ((long long)i * rows + row) * head_dim + d0;
#pragma unroll
            for (int e = 0; e < VEC; ++e) o[e] = fmaf(w, EI::to_float(src[e]), o[e]);
        }
    }
    // sum ≥ 1 whenever any state is live (the maximum contributes exactly 1).
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    EO::storage* dst = out + row * head_dim + d0;
#pragma unroll
    for (int e = 0; e < VEC; ++e) dst[e] = EO::from_float(o[e] * inv);
    if (lse_out && d0 == 0) lse_out[row] = sum > 0.f ? (mx + log2f(sum)) * CD_LN2 : CD_NEG_INF;
}
