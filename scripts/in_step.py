"""The split kernel's warps in step (a block-wide barrier per tile) on and off, same plans
(development tool): GPU µs per call by graph replay over rotated buffer sets, in one process,
each cell timed twice in alternating order. "on" is the policy's choice (long heads-as-N chunks:
_policy.warps_in_step); "off" the same plans with every warp waiting only for its own ring.

Usage: python scripts/in_step.py [MODEL:DTYPE:BxL ...]   (default: the points below)
"""

import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode import _policy  # noqa: E402
from cupydecode.bench import measure_read_ceiling  # noqa: E402
from cupydecode.workloads import MODELS  # noqa: E402
from tune import alternating, make_sets, time_plans  # noqa: E402

POINTS = ["llama-3-8b:float16:64x8192", "llama-3-8b:float16:16x16384",
          "llama-3-8b:float16:16x65536", "llama-3-8b:float16:4x65536",
          "llama-3-8b:float16:4x16384", "llama-3-8b:float16:1x262144",
          "qwen2.5-7b:bfloat16:16x65536", "gemma-2b:bfloat16:16x65536", "gpt-2:bfloat16:16x16384"]
MIN_CHUNK = _policy.WARPS_IN_STEP_MIN_CHUNK


def timed(m, dtype, b, L, sets, on):
    """(µs, a plan) with the warps in step where the policy says so (``on``) or nowhere."""
    _policy.WARPS_IN_STEP_MIN_CHUNK = MIN_CHUNK if on else 1 << 62
    try:
        return time_plans(lambda: cd.DecodePlan(b, m.num_heads, m.num_kv_heads, m.head_dim, L,
                                                dtype), sets)
    finally:
        _policy.WARPS_IN_STEP_MIN_CHUNK = MIN_CHUNK


def main():
    ceiling = measure_read_ceiling()["gbps"]
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    for spec in sys.argv[1:] or POINTS:
        model, dtype, bl = spec.split(":")
        b, L = (int(x) for x in bl.split("x"))
        m = MODELS[model]
        nbytes, sets = make_sets(b, L, m.num_heads, m.num_kv_heads, m.head_dim, dtype)
        cells, plans = alternating((True, False), lambda on, sets=sets: timed(m, dtype, b, L, sets, on))
        floor = nbytes / ceiling / 1e3
        best = {on: min(us) for on, us in cells.items()}
        p = plans[True]
        print(f"{model} {dtype} b{b}x{L // 1024}k (S{p.num_splits}, {p.merge}, "
              f"{p.config.num_warps}x{p.config.stages}, in step {p._in_step}): on "
              f"{'/'.join(f'{u:.2f}' for u in cells[True])} ({100 * floor / best[True]:.1f}%)  off "
              f"{'/'.join(f'{u:.2f}' for u in cells[False])} ({100 * floor / best[False]:.1f}%)  "
              f"delta {best[True] - best[False]:+.2f} us ({100 * (best[True] / best[False] - 1):+.2f}%)",
              flush=True)
        del sets


if __name__ == "__main__":
    main()
