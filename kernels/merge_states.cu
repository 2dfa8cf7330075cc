// merge_states.cu — FlashDecoding, kernel 2 of 2: merge S partial states through their LSE.
//
// Math (notation of DESIGN.md). For one row with states (Õ_i, LSE_i), i = 0..S-1:
//   LSE = max_i LSE_i + log Σ_i exp(LSE_i − max_i LSE_i)
//   w_i = exp(LSE_i − LSE)            every exponent ≤ 0: nothing can overflow
//   O   = Σ_i w_i Õ_i
// A state with LSE_i = −inf is empty: its weight is exactly 0 and its Õ_i is selected out, never
// multiplied in, so even a NaN there cannot leak. All states empty: O = 0, LSE = −inf — no −inf − (−inf) is ever formed.
// Computed in the log2 domain (one ex2 per weight); LSE in and out is natural log.
//
// Layout: o_parts (S, rows, head_dim) in IN_DTYPE, lse_parts (S, rows) float32, both contiguous;
// out (rows, head_dim) in OUT_DTYPE, lse_out (rows) float32 or null.
// Grid mapping: one warp per row; the row's math is cd_merge_row in common.cuh, the same code
// the fused merge at the end of decode_split.cu runs. This kernel is the public merge_states
// (and flash_decode's merge when a plan asks for two kernels).
//
// Compile-time constants: IN_DTYPE, OUT_DTYPE (0 f16, 1 bf16, 2 f32), VEC (4 if head_dim % 4 == 0).
#include "common.cuh"

extern "C" __global__ void
cd_merge_states(const cd_elem<IN_DTYPE>::storage* __restrict__ o_parts,
                const float* __restrict__ lse_parts,
                cd_elem<OUT_DTYPE>::storage* __restrict__ out, float* __restrict__ lse_out,
                int num_states, long long rows, int head_dim) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (row >= rows) return;  // whole warps leave together
    cd_merge_row<cd_elem<IN_DTYPE>, cd_elem<OUT_DTYPE>, VEC>(
        o_parts + row * head_dim, rows * head_dim, lse_parts + row, rows, num_states, head_dim,
        out + row * head_dim, lse_out ? lse_out + row : nullptr, threadIdx.x & 31);
}
