"""A decode loop the way serving engines run attention: a paged KV cache, one DecodePlan, one
decode step captured in a CUDA graph once, then replayed step after step with the inputs changed
in place.

Each step appends the new token (k_new, v_new: written into its sequence's page at position
cache_seqlens[b] and attended in the same launch), then advances cache_seqlens on the device — all
inside the graph, with no allocation and no host synchronisation. (A real model's kernels would
produce q, k_new and v_new before the attention; here they are random.) The last step is checked
against the float64 reference.

    python examples/serving_loop.py
"""

from __future__ import annotations

import cupy as cp
import numpy as np

import cupydecode

# The lengths grow by one per step; a sequence already at its capacity keeps its length (the
# attention appends nothing there).
_ADVANCE = cp.ElementwiseKernel("int32 cap", "int32 n", "n = min(n + 1, cap)", "advance_lengths")


def run(batch=4, num_heads=32, num_kv_heads=8, head_dim=128, max_seqlen=4096, page_size=16,
        steps=8, seed=0):
    """Runs ``steps`` graph replays; returns the relative error of the last step's output
    against the float64 reference."""
    rng = cp.random.default_rng(seed)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16)

    pages_per_seq = max_seqlen // page_size
    num_pages = batch * pages_per_seq + 7  # a pool with some pages no sequence owns
    k_pages = randn(num_pages, page_size, num_kv_heads, head_dim)
    v_pages = randn(num_pages, page_size, num_kv_heads, head_dim)
    # each sequence's pages anywhere in the pool, in any order
    order = np.random.default_rng(seed).permutation(num_pages)[:batch * pages_per_seq]
    block_table = cp.asarray(order.reshape(batch, pages_per_seq).astype(np.int32))
    lengths = cp.asarray(np.linspace(1, max_seqlen // 2, batch).astype(np.int32))  # on the device
    q = randn(batch, num_heads, head_dim)
    k_new, v_new = randn(batch, 1, num_kv_heads, head_dim), randn(batch, 1, num_kv_heads, head_dim)
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16",
                                 page_size=page_size)

    def step():
        plan.run(q, k_pages, v_pages, lengths, block_table=block_table, k_new=k_new,
                 v_new=v_new)                    # writes plan.out and plan.lse
        _ADVANCE(max_seqlen, lengths)

    cp.cuda.Device().synchronize()  # the data above was made on the default stream
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        _ADVANCE(max_seqlen, cp.zeros(1, cp.int32))  # compile: outside the capture
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        for _ in range(steps):
            # the model's kernels would write these in place; then the whole step is one launch
            q[...] = randn(batch, num_heads, head_dim)
            k_new[...] = randn(batch, 1, num_kv_heads, head_dim)
            v_new[...] = randn(batch, 1, num_kv_heads, head_dim)
            graph.launch(stream)
        stream.synchronize()

    # the last step attended the cache as it is now (its new token included) over `lengths`
    ref_out, _ = cupydecode.reference.decode_attention(q, k_pages, v_pages, lengths,
                                                       block_table=block_table)
    return cupydecode.reference.relative_error(plan.out, ref_out)


if __name__ == "__main__":
    err = run()
    print(f"8 paged decode steps in one CUDA graph: relative error of the last step {err:.2e}")
    assert err < 2e-3, err
