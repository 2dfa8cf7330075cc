// read_ceiling.cu — the HBM read-bandwidth probe of `cupydecode bench` (not part of decoding).
//
// Every time the benchmark reports is compared with floor_us = bytes(K + V) / this kernel's
// bandwidth, measured in the same run. Each thread streams 16-byte (uint4) loads in a
// grid-stride loop, four independent loads in flight per iteration, and XOR-folds them so the
// loads cannot be removed; each block writes one word. No writes to speak of: the result is the
// read ceiling a decode kernel (which only reads K and V) can hope for. Launched with 512 threads
// per block and 2, 4 or 8 blocks per SM (cupydecode/bench.py takes the fastest).

extern "C" __global__ void __launch_bounds__(512)
cd_read_ceiling(const uint4* __restrict__ src, unsigned long long n, unsigned int* __restrict__ out) {
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
    for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
    __shared__ unsigned int warp_acc[32];
    if ((threadIdx.x & 31) == 0) warp_acc[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int r = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) r ^= warp_acc[w];
        out[blockIdx.x] = r;
    }
}
