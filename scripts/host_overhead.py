"""Where the host time of one eager call goes: µs per call of each layer, no synchronisation.

Usage: python scripts/host_overhead.py [MODEL DTYPE SEQLEN]   (default llama-3-8b float16 1024)
"""
import sys

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
import cupydecode as cd  # noqa: E402
from cupydecode import _validate as V  # noqa: E402
from cupydecode import decode as _decode  # noqa: E402
from cupydecode.bench import host_time_cupy  # noqa: E402
from cupydecode.workloads import make_inputs, workload_for_model  # noqa: E402


def per_call(fn, n=40, batches=25):
    """Median over batches of n back-to-back calls, each batch on an idle GPU (no queue stalls)."""
    return host_time_cupy(lambda i: fn(), n=n, batches=batches)


model, dtype, L = (sys.argv[1], sys.argv[2], int(sys.argv[3])) if len(sys.argv) > 3 else (
    "llama-3-8b", "float16", 1024)
w = workload_for_model(model, 1, L, dtype)
b, H, Hkv, D = w.batch, w.num_heads, w.num_kv_heads, w.head_dim
q, k, v, _ = make_inputs(w)
plan = cd.DecodePlan(b, H, Hkv, D, L, dtype)
print(f"{model} {dtype} b{b} x {L}: {plan.num_splits} splits, merge {plan.merge}")
out = cp.empty((b, H, D), dtype)
_stream = cp.cuda.get_current_stream().ptr
scale = 1 / np.sqrt(D)
rows = {
    "flash_decode": lambda: cd.flash_decode(q, k, v),
    "flash_decode(out=)": lambda: cd.flash_decode(q, k, v, out=out),
    "plan.run": lambda: plan.run(q, k, v),
    "plan._launch": lambda: plan._launch(q, k, v, None, L, scale, out, None),
    "check_decode_inputs": lambda: V.check_decode_inputs(q, k, v),
    "cupy.empty": lambda: cp.empty((b, H, D), dtype),
    "get_current_stream().ptr": lambda: cp.cuda.get_current_stream().ptr,
    "q.strides": lambda: q.strides,
    "q.data.ptr": lambda: q.data.ptr,
    "runtime.getDevice()": lambda: cp.cuda.runtime.getDevice(),
    "seqlens+scale+splits": lambda: (V.check_seqlens(None, b, L), V.check_scale(None, D),
                                     V.check_splits(None, None)),
    "_cached_plan": lambda: _decode._cached_plan(plan._shape, dtype, None, None,
                                                          q.data.device_id, _stream),
}
if hasattr(V, "layout_key"):  # (trees before flash_decode's single lookup lack it)
    rows["layout_key"] = lambda: V.layout_key(q, k, v)
_vals = (q.data.ptr, k.data.ptr, v.data.ptr, 0, *plan._part_ptrs, out.data.ptr, 0,
         plan._counter_ptr, *([0] * 10), L, *plan._static, 0.1, plan._in_step)
rows["struct pack + driver launch"] = lambda: plan._split_launch(_stream, *_vals)
triv3 = cp.RawKernel('extern "C" __global__ void t3(float* a, int n, float s) {}', "t3")
args27 = ", ".join(f"long long a{i}" for i in range(24))
triv27 = cp.RawKernel(f'extern "C" __global__ void t27(float* p, float* r, float* s, {args27}) {{}}', "t27")
x = cp.zeros(4, cp.float32)
a27 = (x, x, x) + tuple(np.int64(i) for i in range(24))
rows["raw launch 3 args"] = lambda: triv3((1,), (32,), (x, np.int32(1), np.float32(1)))
rows["raw launch 27 args"] = lambda: triv27((1,), (32,), a27)
for name, fn in rows.items():
    print(f"{name:24s} {per_call(fn):7.2f} us/call", flush=True)
import cProfile, pstats  # noqa: E401,E402
pr = cProfile.Profile()
pr.enable()
for _ in range(2000):
    cd.flash_decode(q, k, v)
pr.disable()
cp.cuda.Device().synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(14)
