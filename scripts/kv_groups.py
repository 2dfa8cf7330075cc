"""Blocks of several KV heads (the policy's plans for long one-split streams, _policy.kv_per_block)
on and off (development tool): GPU µs per call by graph replay over rotated buffer sets, in one
process, each cell timed twice in alternating order. "on" is the policy's plan; "off" the plan
the policy would make with one KV head per block.

Usage: python scripts/kv_groups.py [--min-tokens N] [MODEL:DTYPE:BxL ...]
       (default: the points below; --min-tokens sets _policy.KV_GROUP_MIN_TOKENS, which also
       moves kv_group_pays' chunk threshold, 2 × N)
"""

import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
from cupydecode import _policy  # noqa: E402
from tune import on_off_points, policy_value, time_model_plans  # noqa: E402

POINTS = ["llama-3-8b:float16:16x65536", "llama-3-8b:float16:64x8192",
          "llama-3-70b:float16:16x65536", "llama-2-7b:bfloat16:16x32768"]
RULE = _policy.kv_per_block


def timed(m, dtype, b, L, sets, on):
    """(µs, a plan) with the policy's KV heads per block (``on``) or one KV head per block."""
    with policy_value("kv_per_block", RULE if on else (lambda *a, **k: 1)):
        return time_model_plans(m, dtype, b, L, sets)


def main():
    args = sys.argv[1:]
    if args[:1] == ["--min-tokens"]:
        _policy.KV_GROUP_MIN_TOKENS = int(args[1])
        args = args[2:]
    on_off_points(args or POINTS, timed,
                  describe=lambda p: f", {p.kv_per_block} KV heads per block")


if __name__ == "__main__":
    main()
