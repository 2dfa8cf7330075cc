"""Where the host's time per call goes: DecodePlan.run and flash_decode against CuPy's own
launch of an empty kernel (the yardstick of the host-cost targets), in one quiet process, and
the parts a call is made of (the key of a seen kind of inputs, the stream, an output
allocation); DecodePlan.run of a paged cache with the new token appended as well. Timed with
cupydecode.bench's host timer (launches queued, no synchronise).

Usage: python tools/host_cost.py [--points 1x512,16x16384] [--layout 32/8/128]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupydecode as cd  # noqa: E402
from cupydecode import _validate as V  # noqa: E402
from cupydecode import bench as B  # noqa: E402


def per_call_us(stmt: str, scope: dict, n: int = 20000) -> float:
    """Best of 5 runs of ``n`` executions of ``stmt``, µs per execution."""
    return min(timeit.repeat(stmt, number=n, repeat=5, globals=scope)) / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="1x512,16x16384", help="BATCHxSEQLEN,...")
    ap.add_argument("--layout", default="32/8/128", help="num_heads/num_kv_heads/head_dim")
    args = ap.parse_args(argv)
    import cupy

    heads, kv_heads, dim = (int(x) for x in args.layout.split("/"))
    for point in args.points.split(","):
        batch, seqlen = (int(x) for x in point.split("x"))

        def randn(*shape):
            return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)

        q = randn(batch, heads, dim)
        k, v = randn(batch, seqlen, kv_heads, dim), randn(batch, seqlen, kv_heads, dim)
        lengths = cupy.full((batch,), seqlen, cupy.int32)
        out = cupy.empty_like(q)
        plan = cd.DecodePlan(batch, heads, kv_heads, dim, seqlen, "float16")
        # a serving loop's call: pages of 16 through a block table, the new token appended
        page = 16
        pages = batch * seqlen // page
        kp, vp = randn(pages, page, kv_heads, dim), randn(pages, page, kv_heads, dim)
        table = cupy.arange(pages, dtype=cupy.int32).reshape(batch, -1)
        k_new, v_new = randn(batch, 1, kv_heads, dim), randn(batch, 1, kv_heads, dim)
        short = cupy.full((batch,), seqlen - 1, cupy.int32)
        paged = cd.DecodePlan(batch, heads, kv_heads, dim, seqlen, "float16", page_size=page)
        empty = B.empty_launch_host_us()
        run = B.host_time_cupy(lambda i: plan.run(q, k, v, lengths))
        run_paged = B.host_time_cupy(lambda i: paged.run(q, kp, vp, short, block_table=table,
                                                         k_new=k_new, v_new=v_new))
        eager = B.host_time_cupy(lambda i: cd.flash_decode(q, k, v, lengths))
        given = B.host_time_cupy(lambda i: cd.flash_decode(q, k, v, lengths, out=out))
        print(f"{batch} x {seqlen} ({plan.num_splits} splits, merge {plan.merge}): empty launch "
              f"{empty:.2f} µs; run {run:.2f} ({run / empty:.2f}x); paged + append run "
              f"{run_paged:.2f} ({run_paged / empty:.2f}x); flash_decode {eager:.2f} "
              f"({eager / empty:.2f}x), with out= {given:.2f} ({given / empty:.2f}x)")
    scope = dict(V=V, q=q, k=k, v=v, lengths=lengths, cupy=cupy, batch=batch, seqlen=seqlen,
                 device=q.data.device_id)
    for name, stmt in [
            ("the call's key", "V.call_key(q, k, v, (lengths, None, None, None), (None,) * 7)"),
            ("the current stream", "cupy.cuda.get_current_stream()"),
            ("an output allocation", "cupy.empty(q.shape, q.dtype)")]:
        print(f"  {name:22s} {per_call_us(stmt, scope):.2f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
