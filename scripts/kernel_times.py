"""Per-kernel GPU durations (CUPTI, via torch.profiler) of cupydecode and torch's cuDNN SDPA, each
replayed from a CUDA graph over rotating KV sets: kernel time without launch gaps, side by side,
and every kernel torch launches per call. Development tool.

Usage: python scripts/kernel_times.py MODEL BxL[,BxL...] [DTYPE] [SPLITS]
"""
import json
import statistics
import sys
import tempfile
import time

import cupy as cp

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode.bench import _torch_views  # noqa: E402
from cupydecode.workloads import workload_for_model  # noqa: E402
from tune import workload_sets  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

model, points = sys.argv[1], [tuple(map(int, p.split("x"))) for p in sys.argv[2].split(",")]
dtype = sys.argv[3] if len(sys.argv) > 3 else "float16"
splits = [int(s) for s in sys.argv[4].split(",")] if len(sys.argv) > 4 else [None]


def kernels(prof_fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prof_fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as fh:
            trace = json.load(fh)
    return [(e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"]
            if e.get("cat") == "kernel"]


REPLAY_GAP_US = 1000  # the profiled functions sleep 50 ms between replays


def summarise(tag, ks, calls_per_replay):
    """Median over replays of (last kernel end − first kernel start) / calls, then each kernel's
    count and median duration. Replays are told apart by the sleeps between them."""
    by, spans, start, end = {}, [], None, None
    for name, ts, dur in sorted(ks, key=lambda k: k[1]):
        by.setdefault(name, []).append(dur)
        if start is not None and ts - end > REPLAY_GAP_US:
            spans.append(end - start)
            start = None
        start = ts if start is None else start
        end = ts + dur if end is None else max(end, ts + dur)
    if start is not None:
        spans.append(end - start)
    span = statistics.median(spans) / calls_per_replay if spans else 0
    out = [f"{tag}: span/call {span:.2f} us (median of {len(spans)} replays)"]
    for name, durs in by.items():
        out.append(f"    {len(durs):4d} x {statistics.median(durs):8.2f} us  {name[:90]}")
    return "\n".join(out)


for b, L in points:
    w = workload_for_model(model, b, L, dtype)
    sets = workload_sets(w)
    nsets, N = len(sets), max(12, len(sets))  # N calls per graph: every set, at least 12
    stream = cp.cuda.Stream(non_blocking=True)
    lines = [f"== {model} {dtype} b{b} x {L}: {w.kv_bytes()/1e6:.0f} MB, {nsets} sets"]
    for s in splits:
        plan = cd.DecodePlan(b, w.num_heads, w.num_kv_heads, w.head_dim, L, dtype, num_splits=s)
        with stream:
            for i in range(nsets):
                plan.run(*sets[i])
            stream.synchronize()
            stream.begin_capture()
            for i in range(N):
                plan.run(*sets[i % nsets])
            g = stream.end_capture()
            g.launch(stream)
            stream.synchronize()

        def ours():
            for _ in range(5):
                time.sleep(0.05)
                g.launch(stream)
                stream.synchronize()
        lines.append(summarise(f"cupydecode S={plan.num_splits} {plan.merge}", kernels(ours), N))
    views = _torch_views(torch, sets)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        for t in views:
            F.scaled_dot_product_attention(*t, enable_gqa=w.group > 1)
        torch.cuda.synchronize()
        tg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(tg):
            for i in range(N):
                F.scaled_dot_product_attention(*views[i % nsets], enable_gqa=w.group > 1)
    tg.replay()
    torch.cuda.synchronize()

    def cudnn():
        for _ in range(5):
            time.sleep(0.05)
            tg.replay()
            torch.cuda.synchronize()
    lines.append(summarise("cuDNN", kernels(cudnn), N))
    print("\n".join(lines), flush=True)
    del sets, views, tg, g
    cp.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()
