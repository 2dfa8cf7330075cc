"""Does the host's graph-launch latency land inside the timed interval? (development tool)

Times the same graphs four ways: events around one graph launch on an idle stream (the
benchmark's protocol before v11), the same with 4x the calls per graph, and both with the stream
held busy by bench.hold_stream's spin kernel while the events and the graph are queued (the GPU
then reaches e0 with the graph already submitted). Also the read-ceiling probe: one launch per
event pair (the bench before v11) vs graphs, idle and held.
"""
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode.bench import graph_time_cupy, measure_read_ceiling, stream_time_cupy  # noqa: E402
from tune import make_sets  # noqa: E402


def main():
    H, Hkv, D = 32, 8, 128
    # n calls per graph: every buffer set, at least 10
    print(f"{'point':10s} {'n':>4s} {'n calls':>9s} {'4n calls':>9s} {'n held':>9s} {'4n held':>9s}")
    for b, L in [(1, 1024), (1, 16384), (4, 8192), (16, 8192)]:
        _, sets = make_sets(b, L, H, Hkv, D, "float16")
        plans = [cd.DecodePlan(b, H, Hkv, D, L, "float16") for _ in sets]

        def call(i):
            plans[i % len(plans)].run(*sets[i % len(sets)])
        n = max(10, len(sets))
        r = [graph_time_cupy(call, calls, hold=hold)[0]
             for hold in (False, True) for calls in (n, 4 * n)]
        print(f"b{b}x{L // 1024}k".ljust(10) + f" {n:4d}" + "".join(f" {x:9.2f}" for x in r),
              flush=True)
    ceil = measure_read_ceiling()
    print("ceiling (bench since v11: graphs of 3 launches, held):", ceil)
    from cupydecode._kernels import get_function, launch
    from cupydecode.decode import _sm_count
    nbytes = ceil["nbytes"]
    buf = cp.random.randint(0, 2**31 - 1, size=nbytes // 4, dtype=cp.int32)
    kernel = get_function("read_ceiling.cu", "cd_read_ceiling", {})
    for bps in (2, 4, 8):
        grid = _sm_count(cp.cuda.Device().id) * bps
        args = (buf, np.uint64(nbytes // 16), cp.empty(grid, cp.uint32))
        call = lambda i: launch(kernel, (grid, 1, 1), (512, 1, 1), args)  # noqa: E731
        us = stream_time_cupy(call, 1, 10)[0]  # the bench's probe timing before v11
        print(f"  probe {bps}/SM one launch per event pair: {us:.1f} us = {nbytes / us / 1e3:.0f} GB/s")
        for n, hold in ((1, False), (1, True), (3, True)):
            us = graph_time_cupy(call, n, 10, hold=hold)[0]
            print(f"  probe {bps}/SM graph of {n} hold={hold}: {us:.1f} us = {nbytes / us / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
