"""The KV cache's memory order side by side (development tool): the public (batch, seqlen,
kv_heads, head_dim) buffer ("NHD": a token's KV heads adjacent) against the same shape as a
strided view of a (batch, kv_heads, seqlen, head_dim) buffer ("HND": each KV head's tokens
contiguous), for cupydecode and torch SDPA's cuDNN backend (for torch, HND is its own
contiguous layout). Tells whether a block's stream of one KV head, 256-byte rows 2 KB apart in NHD, reads
slower than a contiguous one. GPU µs per call by graph replay over rotated buffer sets; every
output checked against float64.

Usage: python scripts/kv_layout.py [MODEL:DTYPE:BxL ...]   (default: the points below)
"""

import dataclasses
import math
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupy as cp  # noqa: E402
import cupydecode as cd  # noqa: E402
from cupydecode import bench  # noqa: E402
from cupydecode.workloads import MODELS, Workload  # noqa: E402
from tune import workload_sets  # noqa: E402

POINTS = ["llama-3-8b:float16:16x65536", "llama-3-8b:float16:16x32768",
          "llama-3-8b:float16:1x16384", "llama-3-8b:float16:4x8192"]


def as_hnd(t):
    """``t`` (B, L, Hkv, D) copied into (B, Hkv, L, D) memory, viewed as (B, L, Hkv, D)."""
    return cp.ascontiguousarray(t.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


def main():
    ceiling = bench.measure_read_ceiling()["gbps"]
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    for spec in sys.argv[1:] or POINTS:
        model, dtype, bl = spec.split(":")
        b, L = (int(x) for x in bl.split("x"))
        m = MODELS[model]
        w = Workload(batch=b, seqlen=L, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                     head_dim=m.head_dim, dtype=dtype)
        sets = workload_sets(dataclasses.replace(w))
        n_calls = max(bench.MIN_GRAPH_CALLS, len(sets))
        scale = 1.0 / math.sqrt(w.head_dim)
        floor = w.kv_bytes() / ceiling / 1e3
        cells = []
        for order in ("NHD", "HND", "NHD"):
            if order == "HND":
                sets = [(q, as_hnd(k), as_hnd(v), s) for q, k, v, s in sets]
            else:
                sets = [(q, cp.ascontiguousarray(k), cp.ascontiguousarray(v), s)
                        for q, k, v, s in sets]
            bench.settle()
            plan = cd.DecodePlan(b, w.num_heads, w.num_kv_heads, w.head_dim, L, dtype)
            us = bench.graph_time_cupy(lambda i: plan.run(*sets[i % len(sets)][:3]), n_calls)[0]
            check = bench._subset_checker(w, *sets[0][:3])
            err = check(plan.run(*sets[0][:3])[0])
            peers = bench.torch_sdpa_times(sets, w, scale, n_calls, check)
            cudnn, note = peers["torch_cudnn_us"]
            ok = "ok" if err <= bench.REL_TOL[dtype] and not note else f"CHECK {err:.1e} {note}"
            cells.append(f"{order} ours {us:.2f} ({100 * floor / us:.1f}%) cuDNN "
                         f"{cudnn if cudnn is None else f'{cudnn:.2f}'} {ok}")
        print(f"{model} {dtype} b{b}x{L // 1024}k S{plan.num_splits}: " + "  |  ".join(cells),
              flush=True)
        sets = None  # free the buffers before the next point


if __name__ == "__main__":
    main()
