// step_traffic.cu — the other kernels of a decode step in `cupydecode bench --protocol step`
// (not part of decoding).
//
// In a served model attention never runs back to back with itself: each call follows the
// previous layer's MLP (whose output writes push the KV cache's lines out of L2) and the QKV
// projection (a read of the layer's weights), inside one CUDA graph per decode step. The
// benchmark puts two launches of this kernel before every timed attention call — one that only
// writes (the L2-evicting write), one that reads the QKV weights and writes q/k/v's bytes (the
// projection's traffic) — and subtracts the time of the same graph without the attention calls.
// It moves exactly the bytes it is given: n_read 16-byte words of src (XOR-folded, so the loads
// cannot be removed), then n_write 16-byte words of dst. Launched with 512 threads per block,
// 4 blocks per SM. EARLY_TRIGGER (default 0) lets a programmatic dependent start as soon as
// every block of this grid is running, as a kernel written for programmatic launch would.
#ifndef EARLY_TRIGGER
#define EARLY_TRIGGER 0
#endif

#include "stream_read.cuh"

extern "C" __global__ void __launch_bounds__(512)
cd_step_traffic(const uint4* __restrict__ src, unsigned long long n_read,
                uint4* __restrict__ dst, unsigned long long n_write) {
#if EARLY_TRIGGER && __CUDA_ARCH__ >= 900
    // (a previous kernel that lets a programmatic dependent start before it ends)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const unsigned int acc = cd_stream_read(src, n_read);
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long j = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         j < n_write; j += stride)
        dst[j] = make_uint4(acc ^ (unsigned int)j, (unsigned int)(j >> 32), acc, ~acc);
}
