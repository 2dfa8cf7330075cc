"""The merge kernel as a programmatic dependent of the split kernel, on and off (development tool):
GPU µs per call by graph replay over rotated buffer sets, for layouts whose plans merge in a
second kernel (and, forced, for plans that would fuse the merge), in one process, each cell
timed twice in alternating order.

Usage: python scripts/pdl.py
"""

import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupy as cp  # noqa: E402

import cupydecode as cd  # noqa: E402
from cupydecode import _kernels  # noqa: E402
from cupydecode.workloads import MODELS  # noqa: E402
from tune import alternating, make_sets, time_plans  # noqa: E402

POINTS = [("llama-3-70b", "float16", 1, 16384), ("qwen2.5-7b", "bfloat16", 1, 16384),
          ("qwen2.5-7b", "bfloat16", 1, 65536), ("gemma-2b", "bfloat16", 1, 16384),
          ("gemma-2b", "bfloat16", 1, 65536), ("llama-3-8b", "float16", 1, 1024),
          ("llama-3-8b", "float16", 1, 16384), ("llama-3-8b", "float16", 4, 8192),
          ("gemma-2-9b", "float16", 1, 16384)]
supported = _kernels.programmatic_launch_supported


def timed(m, dtype, b, L, sets, merge, pdl):
    """(µs, a plan) with the merge kernel launched programmatically or not (``pdl``)."""
    _kernels.programmatic_launch_supported = supported if pdl else (lambda device_id: False)
    try:  # (the plans consult it when they are built)
        us, plan = time_plans(
            lambda: cd.DecodePlan(b, m.num_heads, m.num_kv_heads, m.head_dim, L, dtype, merge=merge),
            sets)
    finally:
        _kernels.programmatic_launch_supported = supported
    call = plan._merge_call
    on = pdl and supported(plan.device_id)
    assert (call is not None and call.programmatic) == (on and plan.merge == "kernel")
    return us, plan


def main():
    dev = cp.cuda.Device().id
    print(f"programmatic launch supported on GPU {dev}: {supported(dev)}")
    for model, dtype, b, L in POINTS:
        m = MODELS[model]
        _, sets = make_sets(b, L, m.num_heads, m.num_kv_heads, m.head_dim, dtype)
        order = [("auto", True), ("auto", False), ("kernel", True), ("kernel", False), ("fused", False)]
        cells, plans = alternating(order, lambda arm, sets=sets: timed(m, dtype, b, L, sets, *arm))
        row = " ".join(f"{mg}{'+pdl' if pdl else ''}={'/'.join(f'{u:.2f}' for u in us)}"
                       for (mg, pdl), us in cells.items())
        auto = plans["auto", True]
        print(f"{model} {dtype} b{b}x{L // 1024}k (S{auto.num_splits}, auto={auto.merge}): {row}",
              flush=True)
        del sets


if __name__ == "__main__":
    main()
