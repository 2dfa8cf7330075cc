"""The split kernel's two tensor-core paths for G ≤ 8 query heads per KV head, side by side
(development tool): the heads-as-N path (Sᵀ = K·Qᵀ, Oᵀ = Vᵀ·Pᵀ, the default) against the 16-row
path (S = Q·Kᵀ with 16 query rows as M), with the block shape, split count and merge of the
heads-as-N plan in both, GPU µs per call by graph replay over rotated buffer sets, in one
process, each cell timed twice in alternating order. Both arms fix the plan's split size, and a
plan with a fixed split size keeps one KV head per block: where the policy's plan reads several
KV heads per block (_policy.kv_per_block), both arms here read one.

Usage: python scripts/heads_as_n.py [MODEL:DTYPE:BxL ...]   (default: the points below)
"""

import sys
from contextlib import nullcontext

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode import _policy  # noqa: E402
from tune import forced_shape, on_off_points, time_plans  # noqa: E402

POINTS = ["llama-3-8b:float16:1x1024", "llama-3-8b:float16:1x16384", "llama-3-8b:float16:1x65536",
          "llama-3-8b:float16:4x8192", "llama-3-8b:float16:16x8192", "llama-3-8b:float16:16x65536",
          "llama-3-70b:float16:1x16384", "llama-3-70b:float16:16x16384",
          "qwen2.5-7b:bfloat16:1x65536", "gemma-2b:bfloat16:1x65536", "gemma-2b:bfloat16:16x16384",
          "gemma-2-9b:float16:1x16384", "gpt-2:bfloat16:1x65536", "llama-2-7b:float16:1x16384"]
ON = _policy.HEADS_AS_N_MAX_GROUP


def timed(m, dtype, b, L, sets, on):
    """(µs, a plan) with the heads-as-N path allowed (``on``) or not; without it, the plans
    take the heads-as-N plan's block shape, split count and merge mode."""
    ref = cd.DecodePlan(b, m.num_heads, m.num_kv_heads, m.head_dim, L, dtype)
    if not on:  # (the plans consult these when they are built)
        _policy.HEADS_AS_N_MAX_GROUP = 0
    try:
        with (nullcontext() if on else forced_shape(ref.config.num_warps, ref.config.stages)):
            us, plan = time_plans(
                lambda: cd.DecodePlan(b, m.num_heads, m.num_kv_heads, m.head_dim, L, dtype,
                                      split_size=ref.chunk_tokens,
                                      merge=ref.merge if ref.merge != "none" else "auto"), sets)
    finally:
        _policy.HEADS_AS_N_MAX_GROUP = ON
    assert plan.config.heads_as_n == (on and _policy.heads_as_n(dtype, plan.group)), plan.config
    assert (plan.config.num_warps, plan.config.stages, plan.num_splits, plan.merge) == (
        ref.config.num_warps, ref.config.stages, ref.num_splits, ref.merge), (plan, ref)
    return us, plan


def main():
    on_off_points(sys.argv[1:] or POINTS, timed, labels=("heads-as-N", "16 rows"))


if __name__ == "__main__":
    main()
