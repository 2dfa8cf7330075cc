"""Kernel-shape exploration on the GPU: time block configs and split counts side by side.

Usage: python scripts/tune.py [--quick]. Development tool; results go to docs/PERFORMANCE.md.
"""

import itertools
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
import cupydecode as cd  # noqa: E402
from cupydecode import _policy  # noqa: E402

L2 = cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"]


def rnd(shape, dtype):
    return cp.random.standard_normal(shape, dtype=cp.float32).astype(dtype)


def make_sets(b, L, H, Hkv, D, dtype):
    nbytes = 2 * b * L * Hkv * D * np.dtype(dtype).itemsize
    nsets = max(2, -(-4 * L2 // nbytes))
    return nbytes, [(rnd((b, H, D), dtype), rnd((b, L, Hkv, D), dtype), rnd((b, L, Hkv, D), dtype))
                    for _ in range(nsets)]


def graph_time(fn_list, reps=10, trials=15):
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for f in fn_list:
            f()
        stream.synchronize()
        stream.begin_capture()
        for i in range(reps):
            fn_list[i % len(fn_list)]()
        g = stream.end_capture()
        g.launch(stream)
        stream.synchronize()
        ts = []
        for _ in range(trials):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            g.launch(stream)
            e1.record(stream)
            e1.synchronize()
            ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps)
    return float(np.median(ts))


def ceiling():
    n = 2 * 2**30 // 16
    buf = cp.random.randint(0, 2**31, size=n * 4, dtype=cp.int32).view(cp.uint32)
    k = cp.RawKernel(r'''
    extern "C" __global__ void rd(const uint4* __restrict__ p, long long n, unsigned* out) {
        unsigned acc = 0;
        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
            uint4 v = __ldcs(p + i); acc ^= v.x ^ v.y ^ v.z ^ v.w; }
        if (acc == 0x12345678u) out[0] = acc;
    }''', "rd")
    out = cp.zeros(1, cp.uint32)
    sms = cp.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    f = lambda: k((sms * 8,), (512,), (buf, np.int64(n), out))  # noqa: E731
    us = graph_time([f], reps=5, trials=10)
    return n * 16 / us / 1e3


def main():
    quick = "--quick" in sys.argv
    ceil_gbs = ceiling()
    print(f"read ceiling {ceil_gbs:.0f} GB/s", flush=True)
    orig = _policy.split_kernel_config
    points = [(1, 16384), (1, 65536), (4, 8192), (16, 32768), (64, 8192)]
    configs = [(4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (2, 4)]
    H, Hkv, D, dtype = 32, 8, 128, "float16"
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for (b, L) in points:
        nbytes, sets = make_sets(b, L, H, Hkv, D, dtype)
        floor = nbytes / ceil_gbs / 1e3
        row = [f"b{b:<3d} L{L:<6d} floor {floor:6.1f}us"]
        for (nw, st) in configs:
            _policy.split_kernel_config = (
                lambda dt, hd, nw=nw, st=st: _policy.SplitKernelConfig(dt, hd, nw, st))
            try:
                plans = [cd.DecodePlan(b, H, Hkv, D, L, dtype) for _ in sets]
                us = graph_time([lambda p=p, s=s: p.run(*s) for p, s in zip(plans, sets)])
                row.append(f"w{nw}s{st}:{us:6.1f}({100*floor/us:3.0f}%,S{plans[0].num_splits})")
            except Exception as e:  # noqa: BLE001
                row.append(f"w{nw}s{st}:ERR {type(e).__name__}")
            finally:
                _policy.split_kernel_config = orig
        # split sweep with the default config
        for S in ([1, 2, 4, 8, 16, 32, 64] if not quick else []):
            plans = [cd.DecodePlan(b, H, Hkv, D, L, dtype, num_splits=S) for _ in sets]
            us = graph_time([lambda p=p, s=s: p.run(*s) for p, s in zip(plans, sets)])
            row.append(f"S{S}:{us:.1f}")
        # cuDNN side by side
        tsets = [(torch.from_dlpack(q).view(b, H, 1, D), torch.from_dlpack(k).permute(0, 2, 1, 3),
                  torch.from_dlpack(v).permute(0, 2, 1, 3)) for q, k, v in sets]
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(be):
                    fns = [lambda t=t: F.scaled_dot_product_attention(*t, enable_gqa=True) for t in tsets]
                    s = torch.cuda.Stream()
                    with torch.cuda.stream(s):
                        for f in fns:
                            f()
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for i in range(10):
                            fns[i % len(fns)]()
                    g.replay()
                    torch.cuda.synchronize()
                    ts = []
                    for _ in range(15):
                        e0 = torch.cuda.Event(enable_timing=True)
                        e1 = torch.cuda.Event(enable_timing=True)
                        e0.record()
                        g.replay()
                        e1.record()
                        e1.synchronize()
                        ts.append(e0.elapsed_time(e1) * 1e3 / 10)
                row.append(f"{name}:{np.median(ts):.1f}({100*floor/np.median(ts):.0f}%)")
            except Exception as e:  # noqa: BLE001
                row.append(f"{name}:ERR {type(e).__name__}: {str(e)[:80]}")
        print("  ".join(row), flush=True)
        del sets, tsets


if __name__ == "__main__":
    main()
