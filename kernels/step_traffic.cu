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

extern "C" __global__ void __launch_bounds__(512)
cd_step_traffic(const uint4* __restrict__ src, unsigned long long n_read,
                uint4* __restrict__ dst, unsigned long long n_write) {
#if EARLY_TRIGGER && __CUDA_ARCH__ >= 900
    // (a previous kernel that lets a programmatic dependent start before it ends)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    unsigned long long i = first;
    for (; i + 3 * stride < n_read; i += 4 * stride) {
        const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
        acc ^= c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n_read; i += stride) {
        const uint4 a = src[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    for (unsigned long long j = first; j < n_write; j += stride)
        dst[j] = make_uint4(acc ^ (unsigned int)j, (unsigned int)(j >> 32), acc, ~acc);
}
