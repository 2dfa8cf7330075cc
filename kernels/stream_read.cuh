// stream_read.cuh — the read loop of the benchmark's own kernels (read_ceiling.cu,
// step_traffic.cu; not part of decoding).
#pragma once

// XOR-fold of this thread's share of n 16-byte words of src in a grid-stride loop, four
// independent loads in flight per iteration (the fold keeps the loads from being removed).
__device__ __forceinline__ unsigned int cd_stream_read(const uint4* __restrict__ src,
                                                       unsigned long long n) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned int acc = 0;
    for (; i + 3 * stride < n; i += 4 * stride) {
        const uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
        acc ^= c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n; i += stride) {
        const uint4 a = src[i];
        acc ^= a.x ^ a.y ^ a.z ^ a.w;
    }
    return acc;
}
