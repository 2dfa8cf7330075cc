// read_ceiling.cu — the HBM read-bandwidth probe of `cupydecode bench` (not part of decoding).
//
// Every time the benchmark reports is compared with floor_us = bytes(K + V) / this kernel's
// bandwidth, measured in the same run. Each thread streams 16-byte (uint4) loads in a
// grid-stride loop, four independent loads in flight per iteration, and XOR-folds them so the
// loads cannot be removed; each block writes one word. No writes to speak of: the result is the
// read ceiling a decode kernel (which only reads K and V) can hope for. Launched with 512 threads
// per block and 2, 4 or 8 blocks per SM (cupydecode/bench.py takes the fastest).

#include "stream_read.cuh"

extern "C" __global__ void __launch_bounds__(512)
cd_read_ceiling(const uint4* __restrict__ src, unsigned long long n, unsigned int* __restrict__ out) {
    unsigned int acc = cd_stream_read(src, n);
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
