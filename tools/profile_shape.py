"""Launch one decode shape a few times for a profiler (Nsight Compute, Nsight Systems), with the
policy's block shape or a ``cupydecode.Tuning`` override, on buffers larger than L2 (each call
reads a cache the previous ones did not):

  ncu --set full -k regex:cd_decode_split python tools/profile_shape.py 16 65536 [--arm num_warps=8,stages=2]

Usage: python tools/profile_shape.py BATCH SEQLEN [--layout 32/8/128] [--dtype float16] [--calls 4]
                               [--q-len 1] [--kv-dtype e4m3|e5m2] [--kv-scale tensor|head|token]
                               [--arm FIELD=VALUE,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupydecode as cd  # noqa: E402
from ab import buffer_sets, parse_arm  # noqa: E402
from cupydecode.workloads import Workload  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("batch", type=int)
    ap.add_argument("seqlen", type=int)
    ap.add_argument("--layout", default="32/8/128", help="num_heads/num_kv_heads/head_dim")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--q-len", type=int, default=1, help="query tokens per sequence")
    ap.add_argument("--kv-dtype", choices=("e4m3", "e5m2"), default=None, help="an fp8 cache")
    ap.add_argument("--kv-scale", choices=("tensor", "head", "token"), default="tensor")
    ap.add_argument("--arm", default="", help="Tuning fields, e.g. num_warps=8,stages=2, and "
                    "num_splits")
    args = ap.parse_args(argv)
    import cupy

    heads, kv_heads, dim = (int(x) for x in args.layout.split("/"))
    w = Workload(batch=args.batch, seqlen=args.seqlen, num_heads=heads, num_kv_heads=kv_heads,
                 head_dim=dim, dtype=args.dtype, q_len=args.q_len, kv_dtype=args.kv_dtype,
                 kv_scale=args.kv_scale)
    sets = buffer_sets(w)
    tuning, plan_args = parse_arm(args.arm)
    plan = cd.DecodePlan(args.batch, heads, kv_heads, dim, args.seqlen, args.dtype,
                         q_len=args.q_len, kv_dtype=args.kv_dtype, tuning=tuning, **plan_args)
    for i in range(args.calls):
        q, k, v, scales = sets[i % len(sets)]
        plan.run(q, k, v, **scales)
    cupy.cuda.Device().synchronize()
    cfg = plan.config
    print(f"b{args.batch} L{args.seqlen} {args.layout} {args.dtype} q_len {args.q_len}: "
          f"{plan.num_splits} splits of "
          f"{plan.chunk_tokens} tokens, {cfg.num_warps} warps x {cfg.stages} stages, "
          f"{cfg.m_tiles} M-tile(s), merge {plan.merge}; {args.calls} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
