// merge_states.cu — FlashDecoding, kernel 2 of 2: merge S partial states through their LSE.
//
// Math (notation of docs/DESIGN.md). For one row with states (Õ_i, LSE_i), i = 0..S-1:
//   LSE = max_i LSE_i + log Σ_i exp(LSE_i − max_i LSE_i)
//   w_i = exp(LSE_i − LSE)            every exponent ≤ 0: nothing can overflow
//   O   = Σ_i w_i Õ_i
// A state with LSE_i = −inf is empty: its weight is exactly 0 and its Õ_i is selected out, never
// multiplied in, so even a NaN there cannot leak. All states empty: O = 0, LSE = −inf — no −inf − (−inf) is ever formed.
// One ex2 per weight, of (LSE_i − max) · log2 e: the difference first, so a large LSE loses
// nothing (common.cuh); LSE in and out is natural log.
//
// Layout: o_parts (S, rows, head_dim) in IN_DTYPE, lse_parts (S, rows) float32, both contiguous;
// out (rows, head_dim) in OUT_DTYPE, lse_out (rows) float32 or null.
// Grid mapping (launch policy: cupydecode/_policy.py, merge_launch): an ITEM is one pass of one
// row (32·VEC elements of head_dim, see cd_merge_row_pass in common.cuh); warps_per_item warps
// take an item's groups of 16 states in turn, so S ≤ 16 · warps_per_item states cost every warp
// ONE trip to L2, and the item's first warp combines the warps' running states through shared
// memory and writes the result. A block holds blockDim / 32 / warps_per_item items. The math is
// the same code the fused merge at the end of decode_split.cu runs. This kernel is the public
// merge_states, and a plan's merge where merge="auto" finds that the fused one would take more
// than one trip per warp or, with this kernel launched as a programmatic dependent, fold more
// than 64 states in one block (_policy.merge_mode), or where merge="kernel" is asked for.
//
// Compile-time constants: IN_DTYPE, OUT_DTYPE (0 f16, 1 bf16, 2 f32), VEC (4 if head_dim % 4 == 0).
#include "common.cuh"

#define CD_MERGE_MAX_WARPS 8  // blockDim.x ≤ 32 · CD_MERGE_MAX_WARPS

// (…, 1): no minimum of resident blocks, so that no variant is squeezed into spilling registers
extern "C" __global__ void __launch_bounds__(32 * CD_MERGE_MAX_WARPS, 1)
cd_merge_states(const cd_elem<IN_DTYPE>::storage* __restrict__ o_parts,
                const float* __restrict__ lse_parts,
                cd_elem<OUT_DTYPE>::storage* __restrict__ out, float* __restrict__ lse_out,
                int num_states, long long rows, int head_dim, int warps_per_item,
                const float* __restrict__ sinks, int num_sinks) {
    __shared__ float share[CD_MERGE_MAX_WARPS][VEC + 2][32];  // a warp's running state, per lane
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int passes = (head_dim + 32 * VEC - 1) / (32 * VEC);
    const long long item = (long long)blockIdx.x * ((blockDim.x >> 5) / warps_per_item) + warp / warps_per_item;
    const int sub = warp % warps_per_item;  // this warp's first group of states
    const bool valid = item < rows * passes;
    const long long row = valid ? item / passes : 0;
    const int pass = valid ? (int)(item % passes) : 0;
    const int d0 = pass * 32 * VEC + lane * VEC;
    const bool mine = d0 < head_dim;
    cd_merge_state<VEC> st;
    st.clear();
    cd_wait_prerequisites();  // a plan's merge may start before the split kernel ends (common.cuh)
    if (valid)
        cd_merge_fold<cd_elem<IN_DTYPE>, VEC>(o_parts + row * head_dim, rows * head_dim,
                                             lse_parts + row, rows, num_states, sub,
                                             warps_per_item, d0, mine, st);
    if (warps_per_item > 1) {  // uniform across the block
        share[warp][0][lane] = st.m;
        share[warp][1][lane] = st.sum;
#pragma unroll
        for (int e = 0; e < VEC; ++e) share[warp][2 + e][lane] = st.acc[e];
        __syncthreads();
        if (sub == 0) {
            for (int w = warp + 1; w < warp + warps_per_item; ++w) {
                float acc[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[e] = share[w][2 + e][lane];
                cd_merge_combine<VEC>(st, share[w][0][lane], share[w][1][lane], acc);
            }
        }
    }
    if (valid && sub == 0 && sinks)  // row r's sink: sinks[r % num_sinks] (broadcast over rows)
        cd_merge_sink<VEC>(st, sinks[row % num_sinks]);
    if (valid && sub == 0)
        cd_merge_store<cd_elem<OUT_DTYPE>, VEC>(st, out + row * head_dim, d0, mine,
                                                pass == 0 && lse_out ? lse_out + row : nullptr, lane);
}
