"""The split kernel's warps in step (a block-wide barrier per tile) on and off, same plans
(development tool): GPU µs per call by graph replay over rotated buffer sets, in one process,
each cell timed twice in alternating order. "on" is the policy's choice (long heads-as-N chunks:
_policy.warps_in_step); "off" the same plans with every warp waiting only for its own ring.

Usage: python scripts/in_step.py [--min-chunk N] [MODEL:DTYPE:BxL ...]   (default: the points
below; --min-chunk N: "on" keeps the warps in step from N-token chunks instead of the policy's
threshold, to try other thresholds)
"""

import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
from cupydecode import _policy  # noqa: E402
from tune import on_off_points, policy_value, time_model_plans  # noqa: E402

POINTS = ["llama-3-8b:float16:64x8192", "llama-3-8b:float16:16x16384",
          "llama-3-8b:float16:16x65536", "llama-3-8b:float16:4x65536",
          "llama-3-8b:float16:4x16384", "llama-3-8b:float16:1x262144",
          "qwen2.5-7b:bfloat16:16x65536", "gemma-2b:bfloat16:16x65536", "gpt-2:bfloat16:16x16384"]
MIN_CHUNK = _policy.WARPS_IN_STEP_MIN_CHUNK


def timed(m, dtype, b, L, sets, on, min_chunk=MIN_CHUNK):
    """(µs, a plan) with the warps in step from ``min_chunk``-token heads-as-N chunks (``on``)
    or nowhere."""
    # one KV head per block in both arms: blocks of several KV heads always go in step
    with policy_value("WARPS_IN_STEP_MIN_CHUNK", min_chunk if on else 1 << 62), \
            policy_value("kv_per_block", lambda *a, **k: 1):
        return time_model_plans(m, dtype, b, L, sets)


def main():
    args = sys.argv[1:]
    min_chunk = MIN_CHUNK
    if args[:1] == ["--min-chunk"]:
        min_chunk, args = int(args[1]), args[2:]
        print(f"on = warps in step from {min_chunk}-token chunks", flush=True)
    on_off_points(args or POINTS,
                  lambda *a: timed(*a, min_chunk=min_chunk),
                  describe=lambda p: f", chunk {p.chunk_tokens}, in step {p._in_step}")


if __name__ == "__main__":
    main()
