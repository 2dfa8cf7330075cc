"""Does the host's graph-launch latency land inside the timed interval? (development tool)

Times the same graphs three ways: events around one graph launch on an idle stream (the
benchmark's protocol), the same with 4x the calls per graph, and with the stream held busy by a
spin kernel while the events and the graph are queued (the GPU then reaches e0 with the graph
already submitted). Also the read-ceiling probe: one launch per event pair vs held graphs.
"""
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode.bench import _stats, measure_read_ceiling  # noqa: E402
from tune import make_sets  # noqa: E402

SPIN = cp.RawKernel(r'''
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns);
}''', "spin")


def graph_us(call, n_calls, hold, trials=20):
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(n_calls):
            call(i)
        stream.synchronize()
        stream.begin_capture()
        for i in range(n_calls):
            call(i)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(trials):
            if hold:
                SPIN((1,), (1,), (np.uint64(200_000),), stream=stream)
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            graph.launch(stream)
            e1.record(stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / n_calls)
    return _stats(times)


def main():
    H, Hkv, D = 32, 8, 128
    print(f"{'point':10s} {'10 calls':>9s} {'40 calls':>9s} {'10 held':>9s} {'40 held':>9s}")
    for b, L in [(1, 1024), (1, 16384), (4, 8192), (16, 8192)]:
        _, sets = make_sets(b, L, H, Hkv, D, "float16")
        plans = [cd.DecodePlan(b, H, Hkv, D, L, "float16") for _ in sets]

        def call(i):
            plans[i % len(plans)].run(*sets[i % len(sets)])
        n = max(10, len(sets))
        r = [graph_us(call, n, False)[0], graph_us(call, 4 * n, False)[0],
             graph_us(call, n, True)[0], graph_us(call, 4 * n, True)[0]]
        print(f"b{b}x{L // 1024}k".ljust(10) + "".join(f" {x:9.2f}" for x in r), flush=True)
    ceil = measure_read_ceiling()
    print("ceiling (bench, 1 launch per event pair):", ceil)
    from cupydecode._kernels import get_function, launch
    from cupydecode.decode import _sm_count
    nbytes = ceil["nbytes"]
    buf = cp.random.randint(0, 2**31 - 1, size=nbytes // 4, dtype=cp.int32)
    kernel = get_function("read_ceiling.cu", "cd_read_ceiling", {})
    for bps in (2, 4, 8):
        grid = _sm_count(cp.cuda.Device().id) * bps
        args = (buf, np.uint64(nbytes // 16), cp.empty(grid, cp.uint32))
        call = lambda i: launch(kernel, (grid, 1, 1), (512, 1, 1), args)  # noqa: E731
        for n, hold in ((1, False), (1, True), (3, True)):
            us = graph_us(call, n, hold, trials=10)[0]
            print(f"  probe {bps}/SM graph of {n} hold={hold}: {us:.1f} us = {nbytes / us / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
