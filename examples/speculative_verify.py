"""Verifying draft tokens (speculative decoding, MTP) with one attention call per step.

Each step the draft model proposes N tokens per sequence; the target model computes their
q, k and v in one forward pass, writes the N keys and values into the cache after each
sequence's accepted tokens, and runs attention once for all N query tokens: token t attends
the cache up to its own position (causal, aligned to the end). The sequences then keep the
tokens they accept — a different number each — and only their lengths move; the rejected
tokens' rows are overwritten by the next step's drafts. The whole step (the cache write, the
attention, the lengths) is one CUDA graph, replayed with the inputs changed in place. (A real
model's kernels would produce q, k_draft and v_draft; here they are random.) The last step is
checked against the float64 reference.

    python examples/speculative_verify.py
"""

from __future__ import annotations

import cupy as cp
import numpy as np

import cupydecode

# k_draft (B, N, Hkv·D) → the cache rows lengths[b] … lengths[b] + N − 1 (rows past the
# capacity are dropped), and seen[b] = min(lengths[b] + N, cap): the tokens the attention sees.
# (16-bit elements copied as they are.)
_WRITE_DRAFTS = cp.RawKernel(r"""
extern "C" __global__ void write_drafts(const unsigned short* kd, const unsigned short* vd,
                                        unsigned short* k, unsigned short* v,
                                        const int* lengths, int* seen, int n, int row, int cap) {
    const int b = blockIdx.y, t = blockIdx.x, len = lengths[b];
    if (t == 0 && threadIdx.x == 0) seen[b] = min(len + n, cap);
    if (len + t >= cap) return;
    const long long src = ((long long)b * n + t) * row;
    const long long dst = ((long long)b * cap + len + t) * row;
    for (int i = threadIdx.x; i < row; i += blockDim.x) {
        k[dst + i] = kd[src + i];
        v[dst + i] = vd[src + i];
    }
}
""", "write_drafts")
# the accepted tokens of each sequence join its length
_ACCEPT = cp.ElementwiseKernel("int32 accepted, int32 cap", "int32 n", "n = min(n + accepted, cap)",
                               "accept_tokens")


def run(batch=4, num_heads=32, num_kv_heads=8, head_dim=128, max_seqlen=4096, drafts=4,
        steps=6, seed=0):
    """Runs ``steps`` graph replays; returns the relative error of the last step's output
    against the float64 reference."""
    rng = cp.random.default_rng(seed)

    def randn(*shape):
        return rng.standard_normal(shape, dtype=cp.float32).astype(cp.float16)

    k = randn(batch, max_seqlen, num_kv_heads, head_dim)
    v = randn(batch, max_seqlen, num_kv_heads, head_dim)
    lengths = cp.asarray(np.linspace(1, max_seqlen // 2, batch).astype(np.int32))  # accepted
    seen = cp.empty_like(lengths)  # accepted + the drafts: what this step's attention attends
    accepted = cp.zeros(batch, cp.int32)
    q = randn(batch, drafts, num_heads, head_dim)
    k_draft, v_draft = (randn(batch, drafts, num_kv_heads, head_dim) for _ in range(2))
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16",
                                 q_len=drafts)
    row = num_kv_heads * head_dim

    def step():
        _WRITE_DRAFTS((drafts, batch), (256,), (k_draft, v_draft, k, v, lengths, seen,
                                                 np.int32(drafts), np.int32(row),
                                                 np.int32(max_seqlen)))
        plan.run(q, k, v, seen)  # writes plan.out (batch, drafts, num_heads, head_dim)
        # (the model's sampler would compare plan.out's logits with the drafts here)
        _ACCEPT(accepted, max_seqlen, lengths)

    cp.cuda.Device().synchronize()  # the data above was made on the default stream
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        step()  # compile everything outside the capture (and a first step)
        stream.begin_capture()
        step()
        graph = stream.end_capture()
        for _ in range(steps):
            # the model's kernels would write these in place; then the whole step is one launch
            q[...] = randn(batch, drafts, num_heads, head_dim)
            k_draft[...] = randn(batch, drafts, num_kv_heads, head_dim)
            v_draft[...] = randn(batch, drafts, num_kv_heads, head_dim)
            accepted[...] = rng.integers(0, drafts + 1, batch, dtype=cp.int32)
            graph.launch(stream)
        stream.synchronize()

    # the last step attended the cache as it was before its accepted tokens joined `lengths`,
    # i.e. over `seen` (which the next step recomputes): its drafts are still in the cache there
    ref_out, _ = cupydecode.reference.decode_attention(q, k, v, seen)
    return cupydecode.reference.relative_error(plan.out, ref_out)


if __name__ == "__main__":
    err = run()
    print(f"6 speculative steps of 4 drafts in one CUDA graph: relative error of the last step "
          f"{err:.2e}")
    assert err < 2e-3, err
