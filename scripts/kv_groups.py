"""Blocks of several KV heads (the policy's plans for long one-split streams, _policy.kv_per_block)
on and off (development tool): GPU µs per call by graph replay over rotated buffer sets, in one
process, each cell timed twice in alternating order. "on" is the policy's plan; "off" the plan
the policy would make with one KV head per block.

Usage: python scripts/kv_groups.py [--min-tokens N] [MODEL:DTYPE:BxL ...]
       (default: the points below; --min-tokens sets _policy.KV_GROUP_MIN_TOKENS)
"""

import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode import _policy  # noqa: E402
from tune import on_off_points, time_plans  # noqa: E402

POINTS = ["llama-3-8b:float16:16x65536", "llama-3-8b:float16:16x32768",
          "llama-3-70b:float16:16x65536", "llama-2-7b:bfloat16:16x32768"]
RULE = _policy.kv_per_block


def timed(m, dtype, b, L, sets, on):
    """(µs, a plan) with the policy's KV heads per block (``on``) or one KV head per block."""
    _policy.kv_per_block = RULE if on else (lambda *a, **k: 1)
    try:
        return time_plans(lambda: cd.DecodePlan(b, m.num_heads, m.num_kv_heads, m.head_dim, L,
                                                dtype), sets)
    finally:
        _policy.kv_per_block = RULE


def main():
    args = sys.argv[1:]
    if args[:1] == ["--min-tokens"]:
        _policy.KV_GROUP_MIN_TOKENS = int(args[1])
        args = args[2:]
    on_off_points(args or POINTS, timed,
                  describe=lambda p: f", {p.kv_per_block} KV heads per block")


if __name__ == "__main__":
    main()
