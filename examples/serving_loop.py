"""A decode loop the way serving engines run attention: one DecodePlan, one decode step captured
in a CUDA graph once, then replayed step after step with the inputs changed in place.

Each step writes the new token's K and V into the cache at position cache_seqlens[b], advances
cache_seqlens on the device, and attends over the grown cache — all inside the graph, with no
allocation and no host synchronisation. (A real model's kernels would produce q, k_new and v_new
before the append; here they are random.) The last step is checked against the float64 reference.

    python examples/serving_loop.py
"""

from __future__ import annotations

import cupy as cp
import numpy as np

import cupydecode

# The new token's K/V rows into the cache at each sequence's length, which then grows by one;
# a sequence already at max_seqlen keeps its cache and length. One block per sequence.
_APPEND = cp.RawKernel(r"""
extern "C" __global__ void append_token(unsigned short* k, unsigned short* v,
                                        const unsigned short* k_new, const unsigned short* v_new,
                                        int* lengths, int row, long long batch_stride,
                                        long long token_stride, int max_seqlen) {
    const int b = blockIdx.x;
    const int pos = lengths[b];
    if (pos >= max_seqlen) return;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        k[b * batch_stride + pos * token_stride + i] = k_new[(long long)b * row + i];
        v[b * batch_stride + pos * token_stride + i] = v_new[(long long)b * row + i];
    }
    __syncthreads();
    if (threadIdx.x == 0) lengths[b] = pos + 1;
}
""", "append_token")


def run(batch=4, num_heads=32, num_kv_heads=8, head_dim=128, max_seqlen=4096, steps=8, seed=0):
    """Runs ``steps`` graph replays; returns the relative error of the last step's output
    against the float64 reference."""
    rng = cp.random.default_rng(seed)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16)

    k_cache, v_cache = randn(batch, max_seqlen, num_kv_heads, head_dim), randn(
        batch, max_seqlen, num_kv_heads, head_dim)
    lengths = cp.asarray(np.linspace(1, max_seqlen // 2, batch).astype(np.int32))  # on the device
    q = randn(batch, num_heads, head_dim)
    k_new, v_new = randn(batch, num_kv_heads, head_dim), randn(batch, num_kv_heads, head_dim)
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")

    row = num_kv_heads * head_dim
    itemsize = k_cache.itemsize
    append_args = (k_cache.view(cp.uint16), v_cache.view(cp.uint16), k_new.view(cp.uint16),
                   v_new.view(cp.uint16), lengths, np.int32(row),
                   np.int64(k_cache.strides[0] // itemsize), np.int64(k_cache.strides[1] // itemsize),
                   np.int32(max_seqlen))

    def step():
        _APPEND((batch,), (128,), append_args)
        plan.run(q, k_cache, v_cache, lengths)   # writes plan.out and plan.lse

    cp.cuda.Device().synchronize()  # the data above was made on the default stream
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        graph_lengths = lengths.copy()
        step()                                   # compile, allocate, opt in: outside the capture
        lengths[...] = graph_lengths             # undo that step's append
        stream.synchronize()
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        for _ in range(steps):
            # the model's kernels would write these in place; then the whole step is one launch
            q[...] = randn(batch, num_heads, head_dim)
            k_new[...] = randn(batch, num_kv_heads, head_dim)
            v_new[...] = randn(batch, num_kv_heads, head_dim)
            graph.launch(stream)
        stream.synchronize()

    ref_out, _ = cupydecode.reference.decode_attention(q, k_cache, v_cache, lengths)
    return cupydecode.reference.relative_error(plan.out, ref_out)


if __name__ == "__main__":
    err = run()
    print(f"8 decode steps in one CUDA graph: relative error of the last step {err:.2e}")
    assert err < 2e-3, err
