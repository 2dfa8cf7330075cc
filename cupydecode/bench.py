"""Benchmark: HBM read ceiling, flash_decode timings, baselines, result rows.

Protocol (see docs/PERFORMANCE.md):
  * The read ceiling is measured in the same run by a read-only kernel over a ~2 GB buffer, and
    every time is compared with floor_us = bytes(K + V) / ceiling.
  * GPU time per call from CUDA graphs replayed 20 times (median, p20, p80), every replay and
    its start event queued behind a short spin kernel (:func:`hold_stream`) so that the host's
    launch latency is not counted; peers are timed the same way, on the same buffers. Two
    protocols (:data:`PROTOCOLS`): "step" (default), the decode-step protocol — each attention
    call follows the other kernels of a decode step in the graph (:class:`StepTraffic`: an
    L2-evicting write and the QKV projection's traffic), and the graph without the attention
    calls is subtracted, trial by trial — and "back-to-back", a graph of attention calls alone
    (an optimistic view: each call starts on SMs its predecessor just left).
  * Host costs in the same process: eager (wall time of one ``flash_decode`` call, launch and
    synchronise included), the host µs of ``flash_decode`` and of ``DecodePlan.run`` alone, and
    of CuPy's own launch of an empty kernel, the yardstick of both.
  * Calls rotate among enough independent KV buffer sets that together they exceed 4× L2, so
    no call finds its cache in L2.
  * Data is fresh random data (seed recorded in the row); the timed configuration's output is
    checked once against float64 (a few heads, on the GPU). The GPU idles for SETTLE_S after
    the data is made and before anything is timed (see :func:`settle`).
  * With ``--append`` each timed call also appends a new token per sequence (k_new, v_new; every
    sequence holds seqlen − 1 tokens, the new one fills it), and the same call without the
    append, over the same seqlen tokens, is timed in every protocol too (``no_append_us``).
  * Baselines: the same kernels forced to num_splits=1; a naive CuPy version (cuBLAS matmul,
    softmax in float32; timed by events over back-to-back calls, because CuPy refuses cuBLAS
    calls inside a graph capture); optionally torch SDPA (cuDNN, FlashAttention-2) and
    FlashInfer, each imported only when asked for and never a dependency.

Rows are plain dicts (one per point and protocol), ready for CSV or JSON.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings

import numpy as np

from .check import REL_TOL, append_on_gpu, fp8_options, reference_gpu, select_rows
from . import reference as R
from .workloads import (Workload, alibi_slopes, fresh_seed, make_inputs, new_tokens, page_inputs,
                        page_like, quantize_inputs,
                        sink_logits)

# How much each measurement repeats. Read when a measurement runs (not bound as defaults), so
# that a run can take fewer: the tests of the CLI's wiring do, whose every launch is slow under
# compute-sanitizer.
GRAPH_TRIALS = 20          # graph replays per measurement
HOST_CALLS = 40            # host_time_cupy: back-to-back calls per batch …
HOST_BATCHES = 7           # … and batches (the median of theirs)
EAGER_CALLS = (20, 200)    # eager_time_cupy's calls per point: ~0.25 s of them, within these
CEILING_BYTES = 2 << 30    # measure_read_ceiling's buffer …
CEILING_TRIALS = 10        # … and graph replays per blocks-per-SM tried
MIN_GRAPH_CALLS = 10       # calls captured per graph (more if there are more buffer sets)
MAX_BUFFER_SETS = 256
L2_FACTOR = 4              # rotate over more than this many L2's worth of KV
MARGIN_BYTES = 512 << 20   # kept free for workspaces, cuBLAS, the reference
SETTLE_S = 1.0             # idle time before a point is timed (settle)
HOLD_NS = 200_000          # hold_stream: ≫ the host's time to queue a start event and a graph


def _given(value, default):
    """``value``, or ``default`` (one of the repeat counts above, read now) when None."""
    return default if value is None else value


# ---------------------------------------------------------------------------- device facts

def device_info() -> dict:
    """GPU and software facts for headers and ``cupydecode info`` (needs a working GPU)."""
    import cupy

    dev = cupy.cuda.Device()
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    free, total = cupy.cuda.runtime.memGetInfo()
    name = props["name"]
    return {
        "device_id": dev.id,
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sm_count": props["multiProcessorCount"],
        "l2_bytes": props["l2CacheSize"],
        "total_mem": total,
        "free_mem": free,
        "cupy": cupy.__version__,
        "cuda_runtime": _cuda_version(cupy.cuda.runtime.runtimeGetVersion()),
        "cuda_driver": _cuda_version(cupy.cuda.runtime.driverGetVersion()),
    }


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


# ---------------------------------------------------------------------------- read ceiling

def measure_read_ceiling(nbytes: int | None = None, trials: int | None = None) -> dict:
    """HBM read bandwidth in GB/s (1e9 B/s) of kernels/read_ceiling.cu over ``nbytes`` (default
    CEILING_BYTES) of random data: the best of 2, 4 and 8 blocks per SM, each the median of
    ``trials`` (default CEILING_TRIALS) replays of a graph of three launches, timed like every
    decode kernel (:func:`graph_time_cupy`).

    Returns {"gbps", "nbytes", "us", "blocks_per_sm"}. Uses a smaller buffer if free memory is
    short (the buffer must still be far larger than L2 for the number to mean anything).
    """
    import cupy

    from ._kernels import get_function, launch
    from .decode import _sm_count

    trials = _given(trials, CEILING_TRIALS)
    free = cupy.cuda.runtime.memGetInfo()[0]
    nbytes = int(min(_given(nbytes, CEILING_BYTES), free // 4)) // (16 << 20) * (16 << 20)
    if nbytes <= 0:
        raise MemoryError("not enough free GPU memory to measure the read ceiling")
    kernel = get_function("read_ceiling.cu", "cd_read_ceiling", {})  # kernels/read_ceiling.cu
    # Random bytes, not a constant: never time on data a memory system could compress.
    buf = cupy.random.randint(0, 2**31 - 1, size=nbytes // 4, dtype=cupy.int32)
    sms, best = _sm_count(cupy.cuda.Device().id), None
    for blocks_per_sm in (2, 4, 8):
        grid = sms * blocks_per_sm
        args = (buf, np.uint64(nbytes // 16), cupy.empty(grid, cupy.uint32))
        us = graph_time_cupy(lambda i: launch(kernel, (grid, 1, 1), (512, 1, 1), args), 3, trials)[0]
        if best is None or us < best[0]:
            best = (us, blocks_per_sm)
    del buf
    cupy.get_default_memory_pool().free_all_blocks()
    us, bps = best
    return {"gbps": nbytes / (us * 1e3), "nbytes": nbytes, "us": us, "blocks_per_sm": bps}


# ---------------------------------------------------------------------------- timing

def settle(seconds: float = SETTLE_S) -> None:
    """Wait for the GPU to finish, then let it idle for ``seconds``.

    Measured on the H200 (the performance log, v8): for up to about a second after heavy work
    (generating GBs of random data, or a multi-GB point), a memory-bound kernel runs up to 19%
    slower (batch 16 × 1k: 23.4 µs, then 20.3 µs, then 19.7 µs 0.5 s later). Whatever is timed
    first at a point would pay for it, so every point starts from an idle GPU.
    """
    import cupy

    cupy.cuda.Device().synchronize()
    time.sleep(seconds)


def _stats(times_us) -> tuple[float, float, float]:
    """(median, p20, p80)."""
    a = np.asarray(times_us, np.float64)
    return float(np.median(a)), float(np.percentile(a, 20)), float(np.percentile(a, 80))


def hold_stream(stream) -> None:
    """Start kernels/hold.cu (a ~0.2 ms spin) on the CuPy ``stream`` (or an ExternalStream
    around torch's), so that what the host queues next starts only once it is all queued.

    Every graph timing here records its start event behind this kernel. On an idle stream the
    event would fire as soon as the host submits it, and the host's latency to submit the graph
    launch would count as GPU time (measured on the H200, the performance log, v11: 0.2 µs per
    call at batch 1 × 16k in graphs of 10 calls; 1.6–2.5% of the read-ceiling probe timed one
    launch per event pair, which made every % of floor read that much high).
    """
    from ._kernels import get_function

    kernel = get_function("hold.cu", "cd_hold", {})  # kernels/hold.cu
    kernel((1,), (1,), (np.uint64(HOLD_NS),), stream=stream)


def _event_once(run, stream, hold: bool) -> float:
    """GPU ms of what ``run()`` queues on ``stream``, between two events (queued behind
    :func:`hold_stream` if ``hold``)."""
    import cupy

    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    if hold:
        hold_stream(stream)
    e0.record(stream)
    run()
    e1.record(stream)
    e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1)


def _event_times(run, stream, n_calls: int, trials: int, hold: bool, run_without=None
                 ) -> tuple[float, float, float]:
    """GPU µs per call of ``run()``, which queues ``n_calls`` calls on ``stream``: (median, p20,
    p80) over ``trials`` event pairs on ``stream``, each queued behind :func:`hold_stream` if
    ``hold``. The one timing loop of every GPU time the benchmark reports, ours and the peers'.

    With ``run_without`` (the decode-step protocol: the same work without the timed calls),
    each trial times ``run()`` and then ``run_without()``, and the time per call is their
    difference over ``n_calls``: paired trials, so a slow drift of the GPU cancels."""
    times = []
    for _ in range(trials):
        ms = _event_once(run, stream, hold)
        if run_without is not None:
            ms -= _event_once(run_without, stream, hold)
        times.append(ms * 1e3 / n_calls)
    return _stats(times)


def _capture_cupy(stream, calls):
    """A CUDA graph of ``calls()`` captured on the CuPy ``stream`` (ended on error too)."""
    stream.begin_capture()
    try:
        calls()
    except BaseException:
        try:
            stream.end_capture()
        except Exception:
            pass
        raise
    return stream.end_capture()


def _graphs_for(n_calls: int, span: int | None) -> int:
    """Graphs of ``n_calls`` calls that cover call indices 0..span-1 (at least one)."""
    return -(-max(span or n_calls, n_calls) // n_calls)


def graph_time_cupy(call, n_calls: int, trials: int | None = None,
                    hold: bool = True, before=None, span: int | None = None
                    ) -> tuple[float, float, float]:
    """GPU µs per call of ``call(i)``, i = 0..n_calls-1, captured in one CUDA graph.

    ``call`` launches work on the current CuPy stream. It is run once per i first (compiles,
    allocates, initialises cuBLAS) on the capture stream, then captured and replayed, each
    replay queued behind :func:`hold_stream` with its events (``hold=False``: recorded on an
    idle stream, as a caller without the spin kernel sees it).
    With ``before`` (the decode-step protocol, :class:`StepTraffic`), ``before(i)`` is captured
    ahead of every ``call(i)``, and the time of the graph of the ``before`` calls alone is
    subtracted (:func:`_event_times`).
    ``span`` > n_calls (e.g. more buffer sets than calls per graph): i runs over 0..span-1 in
    ceil(span / n_calls) graphs of n_calls calls, replayed in turn, so that short graphs still
    rotate over every buffer set.
    Temporaries that ``call`` allocates during capture go back to CuPy's pool and are written
    by every replay: nothing must be allocated between capture and the last replay.
    """
    import itertools

    import cupy

    n_graphs = _graphs_for(n_calls, span)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(n_calls * n_graphs):
            if before is not None:
                before(i)
            call(i)
        stream.synchronize()

        def calls(g, timed=True):
            for i in range(g * n_calls, (g + 1) * n_calls):
                if before is not None:
                    before(i)
                if timed:
                    call(i)
        graphs = [_capture_cupy(stream, lambda g=g: calls(g)) for g in range(n_graphs)]
        without = None if before is None else _capture_cupy(stream, lambda: calls(0, False))
        for graph in graphs:
            graph.launch(stream)
        stream.synchronize()
        turn = itertools.cycle(graphs)
        stats = _event_times(lambda: next(turn).launch(stream), stream, n_calls,
                             _given(trials, GRAPH_TRIALS), hold,
                             None if without is None else (lambda: without.launch(stream)))
    del graphs, without
    return stats


def stream_time_cupy(call, n_calls: int, trials: int | None = None) -> tuple[float, float, float]:
    """GPU µs per call from events around ``n_calls`` back-to-back eager calls (no graph).

    For work that CuPy refuses to capture (it raises on cuBLAS calls during stream capture):
    any gap the host leaves between launches is included, as a plain caller would see it.
    """
    import cupy

    stream = cupy.cuda.get_current_stream()

    def run():
        for i in range(n_calls):
            call(i)
    run()
    stream.synchronize()
    return _event_times(run, stream, n_calls, _given(trials, GRAPH_TRIALS), hold=False)


def _warmed_up(call):
    """Run ``call(0..2)`` once (compile, allocate) and wait; returns the current stream."""
    import cupy

    stream = cupy.cuda.get_current_stream()
    for i in range(3):
        call(i)
    stream.synchronize()
    return stream


def host_time_cupy(call, n: int | None = None, batches: int | None = None) -> float:
    """Host µs per ``call(i)`` alone: median over ``batches`` runs of ``n`` back-to-back calls
    (default HOST_BATCHES and HOST_CALLS).

    The launches are asynchronous, so this is the Python + launch cost a caller pays per call
    (validation, plan lookup, argument packing, launch), without the GPU time. Batches are short
    and start on an idle stream, so the launch queue never fills and blocks the host; the median
    drops batches disturbed by other threads of the process.
    """
    n, batches = _given(n, HOST_CALLS), _given(batches, HOST_BATCHES)
    stream = _warmed_up(call)
    per_batch = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for i in range(n):
            call(i)
        per_batch.append((time.perf_counter() - t0) * 1e6 / n)
        stream.synchronize()
    return statistics.median(per_batch)


def eager_time_cupy(call, n: int) -> float:
    """Median host wall µs of ``call(i)`` followed by a stream synchronise."""
    stream = _warmed_up(call)
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        call(i)
        stream.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


# ---------------------------------------------------------------------------- naive baseline

_MATMUL_OK: dict[str, bool] = {}


def _matmul_dtype(dtype: str):
    """The dtype the naive baseline multiplies in: the input's if cuBLAS takes it, else float32."""
    import cupy

    if dtype not in _MATMUL_OK:
        try:
            a = cupy.ones((2, 16, 16), dtype)
            cupy.matmul(a, a)
            cupy.cuda.get_current_stream().synchronize()
            _MATMUL_OK[dtype] = True
        except Exception:
            _MATMUL_OK[dtype] = False
    return dtype if _MATMUL_OK[dtype] else "float32"


def naive_decode(q, k, v, scale: float, mm_dtype=None, soft_cap=None):
    """Decode attention the obvious CuPy way: cuBLAS for q·Kᵀ and P·V, softmax in float32
    (``soft_cap`` c: the scores capped to c·tanh(s/c) first).

    GQA without copies: q is viewed as (B, Hkv, G, D) and multiplied by Kᵀ viewed as
    (B, Hkv, D, L), which broadcasts the G query heads over their KV head.
    Traffic: reads K and V (and whatever copies cuBLAS's layout needs), writes and reads the
    (B, H, L) scores several times in float32.
    """
    import cupy

    B, H, D = q.shape
    Hkv = k.shape[2]
    mm = q.dtype if mm_dtype is None else cupy.dtype(mm_dtype)
    qg = q.reshape(B, Hkv, H // Hkv, D).astype(mm, copy=False)
    kt = k.transpose(0, 2, 3, 1).astype(mm, copy=False)          # (B, Hkv, D, L)
    vt = v.transpose(0, 2, 1, 3).astype(mm, copy=False)          # (B, Hkv, L, D)
    s = cupy.matmul(qg, kt).astype(cupy.float32)                 # (B, Hkv, G, L)
    s *= scale
    if soft_cap is not None:
        s /= soft_cap
        cupy.tanh(s, out=s)
        s *= soft_cap
    s -= s.max(axis=-1, keepdims=True)
    cupy.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    o = cupy.matmul(s.astype(mm), vt)                             # (B, Hkv, G, D)
    return o.reshape(B, H, D).astype(q.dtype, copy=False)


def naive_bytes(w: Workload) -> int:
    """Rough peak extra memory of :func:`naive_decode`: a copy of K and V plus the scores."""
    return w.kv_bytes() * (2 if w.dtype == "bfloat16" else 1) + 16 * w.batch * w.num_heads * w.seqlen


# ---------------------------------------------------------------------------- peers (optional)

def torch_available() -> str | None:
    """None if torch with CUDA can be used, else why not."""
    try:
        import torch
    except Exception as exc:
        return f"PyTorch is not importable ({type(exc).__name__}: {exc}); install torch to compare"
    if not torch.cuda.is_available():
        return "PyTorch is installed but sees no CUDA device"
    return None


def flashinfer_available() -> str | None:
    reason = torch_available()
    if reason:
        return reason
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:
        return f"FlashInfer is not importable ({type(exc).__name__}: {exc}); install flashinfer to compare"
    return None


def _torch_graph_time(torch, call, n_calls: int, trials: int | None = None, before=None,
                      span: int | None = None):
    """Like :func:`graph_time_cupy` (held stream, ``before`` and ``span`` too) with
    torch.cuda.CUDAGraph; returns (stats, first output)."""
    import itertools

    import cupy

    def torch_stream():
        return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def run(i, timed=True):
        if before is not None:
            before(i, torch_stream())
        return call(i) if timed else None

    n_graphs = _graphs_for(n_calls, span)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(n_calls, 3)):
            run(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graphs, outs = [], []
    for g in range(n_graphs):
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            outs.append([run(i) for i in range(g * n_calls, (g + 1) * n_calls)])
    without = None
    if before is not None:
        without = torch.cuda.CUDAGraph()
        with torch.cuda.graph(without):
            for i in range(n_calls):
                run(i, timed=False)
    for graph in graphs:
        graph.replay()
    torch.cuda.synchronize()
    turn = itertools.cycle(graphs)
    # events on the stream torch replays on, through the same loop as ours
    stats = _event_times(lambda: next(turn).replay(), torch_stream(), n_calls,
                         _given(trials, GRAPH_TRIALS), hold=True,
                         run_without=None if without is None else without.replay)
    first = outs[0][0].clone()
    del graphs, without, outs
    return stats, first


def _torch_views(torch, sets, window=None):
    """torch tensors sharing memory with the CuPy sets: q (B,H,1,D) (several query tokens:
    (B,H,q_len,D)), k/v (B,Hkv,L,D) views; ``window`` W: k/v only the last W + 1 tokens (full
    sequences: the keys a window keeps)."""
    views = []
    for q, k, v, *_ in sets:
        if window is not None:
            k, v = k[:, -(window + 1):], v[:, -(window + 1):]
        tq = torch.from_dlpack(q)
        tq = tq.unsqueeze(2) if tq.dim() == 3 else tq.permute(0, 2, 1, 3)
        tk = torch.from_dlpack(k).permute(0, 2, 1, 3)
        tv = torch.from_dlpack(v).permute(0, 2, 1, 3)
        views.append((tq, tk, tv))
    return views


def torch_sdpa_times(sets, w: Workload, scale: float, n_calls: int, check, before=None,
                     span=None) -> dict:
    """GPU µs per call of torch SDPA with the cuDNN and FlashAttention-2 backends (``before``:
    the decode-step protocol's other kernels, as for ours).

    Returns {column: (µs or None, note)} for PEERS["torch"]'s columns; a backend that
    refuses these inputs gives None with the reason, never an exception.
    """
    import cupy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if (w.logits_soft_cap is not None or w.page_size or w.alibi or w.sinks or w.kv_dtype
            or (w.window_left is not None and (w.lengths is not None or w.q_len > 1))):
        what = ("fp8 cache" if w.kv_dtype else
                "soft-cap" if w.logits_soft_cap is not None else "paged cache" if w.page_size
                else "ALiBi here" if w.alibi else "sinks" if w.sinks
                else "sliding window over ragged lengths or several query tokens")
        return {col: (None, f"{col}: torch SDPA has no {what}") for col in PEERS["torch"][2]}
    cupy.cuda.Device().synchronize()
    # a window over full sequences: SDPA over the window's tokens (a view), what it would read
    views = _torch_views(torch, sets, w.window_left)
    gqa = w.group > 1
    # several query tokens: the causal mask aligned to the end (the last q_len positions)
    mask = None
    if w.q_len > 1:
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(w.q_len, w.seqlen)

    def call(i):
        tq, tk, tv = views[i % len(views)]
        if mask is None:
            return F.scaled_dot_product_attention(tq, tk, tv, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=scale,
                                              enable_gqa=gqa)

    # its output (B, H, q_len, D) in our layout: (B, H, D), or (B, q_len, H, D)
    def to_ours(t):
        return t.squeeze(2) if w.q_len == 1 else t.permute(0, 2, 1, 3)

    def timed(col, backend):
        # a backend that cannot take these inputs warns before raising: keep stderr clean,
        # the reason lands in the row's notes
        with warnings.catch_warnings(), sdpa_kernel([backend]):
            warnings.simplefilter("ignore")
            return _timed_peer(torch, call, n_calls, check, w.dtype, col, to_ours,
                               before, span)

    backends = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION)
    results = {col: _peer_column(torch, col, lambda col=col, b=b: timed(col, b))
               for col, b in zip(PEERS["torch"][2], backends)}
    del views
    torch.cuda.empty_cache()
    return results


def _timed_peer(torch, call, n_calls: int, check, dtype: str, col: str, view=lambda t: t,
                before=None, span=None):
    """(GPU µs per call, note) of a peer's graph-replayed ``call``, its first output checked."""
    import cupy

    (med, _, _), first = _torch_graph_time(torch, call, n_calls, before=before, span=span)
    err = check(cupy.from_dlpack(view(first).contiguous()))
    return med, "" if err <= REL_TOL[dtype] else f"{col}: rel err {err:.1e}"


def _peer_column(torch, col: str, timed) -> tuple:
    """``timed()`` → (µs, note); a peer that fails gives (None, the reason) instead. The peer's
    work is finished before the next column starts."""
    try:
        result = timed()
    except Exception as exc:
        text = str(exc).splitlines()[0][:120] if str(exc) else ""
        result = None, f"{col}: {type(exc).__name__}: {text}"
    torch.cuda.synchronize()
    return result


# The head_dims FlashInfer's decode kernels are built and documented for. Others compile (its
# kernels are generated per head_dim) but are not supported: on the H200 (FlashInfer 0.5.3)
# head_dim 192 failed in its merge (VariableLengthMergeStates), and bench processes at 80, 96
# and 112 that timed it after ours stopped on an illegal memory access in their first point,
# as FlashInfer's issue #4299 reports for its FA2 prefill kernels (its tensor-core decode) at
# head_dims that are not multiples of 64.
FLASHINFER_HEAD_DIMS = (64, 128, 256, 512)


def flashinfer_times(sets, w: Workload, scale: float, n_calls: int, check, before=None,
                     span=None) -> dict:
    """GPU µs per call of FlashInfer's batch decode (CUDA-core and tensor-core variants).

    A paged workload (``w.page_size``) gives FlashInfer the same pages and page order as ours.
    Otherwise the cache is used as a paged cache without copying: our contiguous (B, L, Hkv, D)
    cache viewed as NHD pages (B·L/page, page, Hkv, D) with page = 16 tokens (1 if L is not a
    multiple of 16), sequence b owning pages [b·L/page, (b+1)·L/page). One giant page per
    sequence is a layout FlashInfer's decode kernels are not built for (they run an order of
    magnitude slower).
    """
    import cupy
    import flashinfer
    import torch

    if w.alibi or w.sinks or w.q_len > 1:  # its own ALiBi slopes; no sinks; one query token
        what = "ALiBi" if w.alibi else "sinks" if w.sinks else "several query tokens"
        return {col: (None, f"{col}: {what} not compared") for col in PEERS["flashinfer"][2]}
    if w.kv_dtype and w.kv_scale != "tensor":
        return {col: (None, f"{col}: fp8 scales per {w.kv_scale} not compared (FlashInfer "
                            f"takes one k_scale and v_scale per tensor)")
                for col in PEERS["flashinfer"][2]}
    if w.head_dim not in FLASHINFER_HEAD_DIMS:
        return {col: (None, f"{col}: head_dim {w.head_dim} is not one FlashInfer's decode takes "
                            f"({', '.join(map(str, FLASHINFER_HEAD_DIMS))})")
                for col in PEERS["flashinfer"][2]}
    cupy.cuda.Device().synchronize()
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[w.dtype]
    # an fp8 cache: our uint8 codes viewed as torch's float8 type, the scales given to run()
    kv_dt = {None: dt, "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[w.kv_dtype]

    def kv_view(x):
        t = torch.from_dlpack(x)
        return t.view(kv_dt) if w.kv_dtype else t
    dev = torch.device("cuda", cupy.cuda.Device().id)
    B, L = w.batch, w.seqlen
    if w.page_size:
        page = w.page_size
        pages_per_seq = -(-L // page)
        tsets = [(torch.from_dlpack(q), kv_view(k), kv_view(v)) for q, k, v, *_ in sets]
        table = torch.from_dlpack(sets[0][4])  # every set has the same page order

    else:
        page = 16 if L % 16 == 0 else 1
        pages_per_seq = L // page
        tsets = [(torch.from_dlpack(q), *(kv_view(x).reshape(
            B * pages_per_seq, page, w.num_kv_heads, w.head_dim) for x in (k, v)))
            for q, k, v, *_ in sets]
        table = torch.arange(B * pages_per_seq, dtype=torch.int32, device=dev).reshape(B, -1)

    def timed(col, tensor_cores):
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        indptr = torch.arange(B + 1, dtype=torch.int32, device=dev) * pages_per_seq
        indices = table.reshape(-1).contiguous()
        last = torch.full((B,), L - (pages_per_seq - 1) * page, dtype=torch.int32, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last)
        cap = {"logits_soft_cap": w.logits_soft_cap} if w.logits_soft_cap else {}
        if w.window_left is not None:
            cap["window_left"] = w.window_left
        try:
            wrapper.plan(indptr, indices, last, w.num_heads, w.num_kv_heads, w.head_dim, page,
                         data_type=kv_dt, q_data_type=dt, sm_scale=scale, **cap)
        except TypeError:  # older signature (no q_data_type: q in the cache's type, not for fp8)
            if w.kv_dtype:
                raise
            wrapper.plan(indptr, indices, last, w.num_heads, w.num_kv_heads, w.head_dim, page,
                         data_type=kv_dt, sm_scale=scale, **cap)

        def call(i, _w=wrapper):
            tq, tk, tv = tsets[i % len(tsets)]
            if not w.kv_dtype:
                return _w.run(tq, (tk, tv))
            sc = sets[i % len(sets)][6]
            return _w.run(tq, (tk, tv), k_scale=sc["k_scale"], v_scale=sc["v_scale"])
        return _timed_peer(torch, call, n_calls, check, w.dtype, col, before=before, span=span)

    results = {col: _peer_column(torch, col, lambda col=col, tc=tc: timed(col, tc))
               for col, tc in zip(PEERS["flashinfer"][2], (False, True))}
    del tsets
    torch.cuda.empty_cache()
    return results


# Peers: name → (availability check, timing function, {result column: table label}). The one
# place their columns are named: the timing functions fill them in this order (cuDNN then FA2;
# FlashInfer's CUDA-core then tensor-core decode), rows and tables take them from here.
PEERS = {
    "torch": (torch_available, torch_sdpa_times,
              {"torch_cudnn_us": "cuDNN µs", "torch_flash_us": "FA2 µs"}),
    "flashinfer": (flashinfer_available, flashinfer_times,
                   {"flashinfer_us": "FlashInfer µs", "flashinfer_tc_us": "FI-TC µs"}),
}


# ---------------------------------------------------------------------------- one point

# How GPU µs are measured (``cupydecode bench --protocol``): "step" puts the other kernels of a
# decode step (:class:`StepTraffic`) ahead of every attention call in the graph and subtracts
# the graph without the attention calls; "back-to-back" times a graph of attention calls alone.
# ":N" sets the calls per graph (default MIN_GRAPH_CALLS, more if there are more buffer sets).
PROTOCOLS = ("step", "back-to-back")
DEFAULT_PROTOCOL = "step"


def parse_protocol(text: str) -> tuple[str, int | None]:
    """"step", "back-to-back", "step:8", "back-to-back:2" → (name, calls per graph or None)."""
    name, sep, calls = str(text).strip().partition(":")
    if name not in PROTOCOLS:
        raise ValueError(f"protocol: expected one of {', '.join(PROTOCOLS)} (optionally "
                         f"followed by :CALLS), got {text!r}")
    if not sep:
        return name, None
    if not calls.isdigit() or not 1 <= int(calls) <= 1000:
        raise ValueError(f"protocol: the calls per graph after ':' must be 1..1000, got {text!r}")
    return name, int(calls)


class StepTraffic:
    """The other kernels of one decode step, put ahead of each timed attention call by the "step"
    protocol (kernels/step_traffic.cu): a write of ``l2_bytes`` (the MLP output that pushes the
    cache out of L2), then the QKV projection's traffic — a read of its weights, hidden ×
    (H + 2·Hkv)·D elements with hidden = H·D, and a write of its output, batch × (H + 2·Hkv)·D.

    A CuPy kernel of the projection's traffic rather than a cuBLAS GEMM: CuPy refuses cuBLAS
    calls during stream capture, and at decode batch sizes the projection is a read of its
    weights (llama-3-8b: 50 MB, ~11 µs at the read ceiling) with little arithmetic per byte.
    """

    def __init__(self, w: Workload, l2_bytes: int, early_trigger: bool = False):
        import cupy

        from ._kernels import get_function
        from .decode import _sm_count

        self.fill_bytes, self.weight_bytes, self.proj_out_bytes = self.sizes(w, l2_bytes)
        self._fill = cupy.empty(self.fill_bytes // 4, cupy.uint32)
        # random weights: never read a constant a memory system could compress
        self._weights = cupy.random.randint(0, 2**31 - 1, size=self.weight_bytes // 4,
                                            dtype=cupy.int32)
        self._proj_out = cupy.empty(self.proj_out_bytes // 4, cupy.uint32)
        self._fn = get_function("step_traffic.cu", "cd_step_traffic",
                                {"EARLY_TRIGGER": int(early_trigger)})
        self._grid = (4 * _sm_count(cupy.cuda.Device().id), 1, 1)
        self._fill_args = (self._weights, np.uint64(0), self._fill, np.uint64(self.fill_bytes // 16))
        self._proj_args = (self._weights, np.uint64(self.weight_bytes // 16), self._proj_out,
                           np.uint64(self.proj_out_bytes // 16))

    @staticmethod
    def sizes(w: Workload, l2_bytes: int) -> tuple[int, int, int]:
        """(L2 write, projection weights read, projection output write) in bytes, each a
        whole number of 16-byte words."""
        from .workloads import ITEMSIZE

        es = ITEMSIZE[w.dtype]
        qkv = (w.num_heads + 2 * w.num_kv_heads) * w.head_dim
        return tuple(16 * max(1, -(-int(n) // 16)) for n in
                     (l2_bytes, w.num_heads * w.head_dim * qkv * es,
                      w.batch * w.q_len * qkv * es))

    @classmethod
    def describe(cls, w: Workload, l2_bytes: int) -> str:
        fill, weights, out = cls.sizes(w, l2_bytes)
        return (f"{fill / 1e6:.0f} MB write (L2), then {weights / 1e6:.1f} MB read + "
                f"{out / 1e6:.2f} MB write (QKV projection traffic)")

    def __call__(self, i: int = 0, stream=None) -> None:
        """Queue both kernels on ``stream`` (a CuPy stream; default: the current one)."""
        import contextlib

        from ._kernels import launch

        with (stream if stream is not None else contextlib.nullcontext()):
            launch(self._fn, self._grid, (512, 1, 1), self._fill_args)
            launch(self._fn, self._grid, (512, 1, 1), self._proj_args)


def buffer_sets_needed(w: Workload, l2_bytes: int) -> int:
    """Independent KV sets so that together they exceed L2_FACTOR × L2 (at least one)."""
    return int(min(MAX_BUFFER_SETS, max(1, math.ceil(L2_FACTOR * l2_bytes / max(1, w.kv_bytes()) + 1e-9))))


def napkin(w: Workload, symbolic: bool = False) -> str:
    """The KV byte count written out (``symbolic``: batch and seqlen left as names)."""
    bl = "batch × seqlen" if symbolic else f"{w.batch} seq × {w.seqlen} tok"
    text = (f"K+V = 2 × {bl} × {w.num_kv_heads} kv heads × {w.head_dim} dims × "
            f"{w.kv_itemsize} B" + (" (+ 4 B of scale per token and KV head)"
                                    if w.kv_per_token_scales else ""))
    return text if symbolic else f"{text} = {w.kv_bytes() / 1e6:.1f} MB"


def empty_row(w: Workload, model: str) -> dict:
    return {
        "model": model, "layer": w.layer, "dtype": w.dtype, "kv_dtype": w.kv_dtype,
        "kv_scale": w.kv_scale if w.kv_dtype else None, "batch": w.batch, "seqlen": w.seqlen,
        "num_heads": w.num_heads, "num_kv_heads": w.num_kv_heads, "head_dim": w.head_dim,
        "logits_soft_cap": w.logits_soft_cap, "page_size": w.page_size, "append": w.append,
        "window_left": w.window_left, "alibi": w.alibi, "sinks": w.sinks, "q_len": w.q_len,
        "splits_requested": w.splits_label, "num_splits": None, "chunk_tokens": None,
        "kv_per_block": None, "kv_bytes": w.kv_bytes(), "buffer_sets": None, "ceiling_gbps": None,
        "floor_us": None, "protocol": None, "graph_calls": None,
        "eager_us": None, "host_us": None, "plan_host_us": None, "launch_host_us": None,
        "gpu_us": None, "gpu_us_p20": None, "gpu_us_p80": None, "gbps": None,
        "pct_of_floor": None, "no_append_us": None, "append_cost_us": None,
        "split1_us": None, "speedup_vs_split1": None, "naive_us": None,
        "speedup_vs_naive": None,
        **{col: None for _, _, cols in PEERS.values() for col in cols},
        "best_peer_us": None, "speedup_vs_best_peer": None,
        "rel_err": None, "check": "",
        "seed": w.seed, "skipped": "", "notes": "",
    }


def empty_launch_host_us() -> float:
    """Host µs of CuPy's own launch of an empty kernel (kernels/hold.cu, cd_empty): the yardstick
    of the host cost of ``flash_decode`` and ``DecodePlan.run``, measured in the same process."""
    from ._kernels import get_function

    kernel = get_function("hold.cu", "cd_empty", {})
    return host_time_cupy(lambda i: kernel((1,), (1,), ()))


def _score_options(w: Workload) -> dict:
    """The workload's score options, as flash_decode and the reference take them (ALiBi: its
    standard slopes, on the device; a DecodePlan takes ``alibi=True`` and the slopes per run)."""
    import cupy

    return {"logits_soft_cap": w.logits_soft_cap, "window_left": w.window_left,
            "alibi_slopes": cupy.asarray(alibi_slopes(w.num_heads)) if w.alibi else None,
            "sinks": cupy.asarray(sink_logits(w.num_heads, w.seed)) if w.sinks else None}


def _subset_checker(w: Workload, q, k, v, new=None, scales=None):
    """A function out → relative error on two sequences × two KV heads (float64 on the GPU);
    ``new``: the (k_new, v_new) an append workload's call appends first; ``scales``: an fp8
    workload's {k_scale, v_scale} (k and v its codes)."""
    b_ids = sorted({0, w.batch - 1})
    h_ids = sorted({0, w.num_kv_heads - 1})
    opts = _score_options(w)
    k_scale, v_scale = (scales or {}).get("k_scale"), (scales or {}).get("v_scale")
    if new is None:
        ref_out, _ = reference_gpu(q, k, v, None, None, b_ids, h_ids, **opts,
                                   **fp8_options(w, k_scale, v_scale))
    else:  # those sequences' caches (copies) with their new tokens appended
        lens = None if w.lengths is None else np.asarray(w.lengths)[b_ids]
        # the selected sequences' per-token scales
        k_scale, v_scale = (s[b_ids] if getattr(s, "ndim", 0) == 3 else s
                            for s in (k_scale, v_scale))
        ks, vs, lens, fp8 = append_on_gpu(k[b_ids], v[b_ids], lens,
                                          (new[0][b_ids], new[1][b_ids]),
                                          fp8_options(w, k_scale, v_scale))
        ref_out, _ = reference_gpu(q[b_ids], ks, vs, lens, None, None, h_ids, **opts, **fp8)
        del ks, vs

    def check(out) -> float:
        return R.relative_error(select_rows(out, w.num_kv_heads, b_ids, h_ids, w.q_len > 1),
                                ref_out)
    return check


def bench_point(w: Workload, ceiling_gbps: float, l2_bytes: int, model: str = "",
                peers=(), protocols=(DEFAULT_PROTOCOL,)) -> list[dict]:
    """Measure one workload: one result row per protocol of ``protocols`` (see
    :func:`parse_protocol`), on the same buffers, with the peers timed the same way in each.

    The host costs, the split-1 and naive baselines and the correctness check are measured once
    and copied into every row. A row's ``skipped`` says why if the point could not run.
    """
    import cupy

    from .decode import DecodePlan, flash_decode

    if w.seed is None:
        w.seed = fresh_seed()
    base = empty_row(w, model)
    base["ceiling_gbps"] = ceiling_gbps
    base["floor_us"] = w.kv_bytes() / (ceiling_gbps * 1e3)
    nsets = buffer_sets_needed(w, l2_bytes)
    base["buffer_sets"] = nsets
    specs = [str(p) for p in protocols]
    protocols = [parse_protocol(p) for p in specs]
    rows = [dict(base, protocol=spec) for spec in specs]
    free = cupy.cuda.runtime.memGetInfo()[0]
    # the sets, a paging copy, and an fp8 cache's draw in dtype before it is quantised (with
    # quantize_inputs' float32 temporaries of one sequence, ~12 bytes an element)
    need = ((nsets + (1 if w.page_size else 0)) * w.cache_bytes() + MARGIN_BYTES
            + (w.draw_bytes() + 12 * w.seqlen * w.num_kv_heads * w.head_dim if w.kv_dtype
               else 0))
    if need > free:
        why = (f"needs {need / 1e9:.1f} GB ({nsets} buffer set(s) of "
               f"{w.cache_bytes() / 1e9:.2f} GB + margin), {free / 1e9:.1f} GB free")
        return [dict(r, skipped=why) for r in rows]
    notes = []
    # (q, k, v, lengths, block table or None, (k_new, v_new) or None, fp8 scales {k_scale,
    # v_scale} or {}) per buffer set; paged: k, v (and per-token scales) are pools of pages
    sets = []
    for i in range(nsets):
        wi = dataclasses.replace(w, seed=(w.seed + i) % 2**32)
        inputs = make_inputs(wi)
        scales = {}
        if w.kv_dtype:  # the cache as fp8 codes, its scales beside
            q, k, v, lens = inputs
            *codes, ks, vs = quantize_inputs(wi, k, v)
            inputs = (q, *codes, lens)
            scales = {"k_scale": ks, "v_scale": vs}
            del k, v, codes
        new = new_tokens(wi) if w.append else None
        if i == 0:  # the float64 check's reference, from the contiguous cache
            check = _subset_checker(w, *inputs[:3], new, scales)
        # paged: one page order (and block table) for every set, as a peer's plan fixes it
        if w.page_size and w.kv_per_token_scales:
            scales = {n: page_like(x, w.page_size, w.seed) for n, x in scales.items()}
        sets.append((*(page_inputs(inputs, w.page_size, w.seed) if w.page_size
                       else (*inputs, None)), new, scales))
        del inputs, new, scales
    step = StepTraffic(w, l2_bytes) if any(n == "step" for n, _ in protocols) else None
    settle()
    try:
        scale = 1.0 / math.sqrt(w.head_dim)
        opts = _score_options(w)  # flash_decode's
        run_opts = {k: opts[k] for k in ("alibi_slopes", "sinks") if opts[k] is not None}
        plan_opts = {"logits_soft_cap": w.logits_soft_cap, "window_left": w.window_left,
                     "alibi": w.alibi, "page_size": w.page_size, "q_len": w.q_len,
                     "kv_dtype": w.kv_dtype}
        plan = DecodePlan(w.batch, w.num_heads, w.num_kv_heads, w.head_dim, w.seqlen, w.dtype,
                          num_splits=w.num_splits, **plan_opts)
        base.update(num_splits=plan.num_splits, chunk_tokens=plan.chunk_tokens,
                    kv_per_block=plan.kv_per_block)

        def runner(p, append: bool):
            """The timed call of plan ``p`` on buffer set i: with the append or without."""
            if append:
                def run(i):
                    q, k, v, lens, table, (k_new, v_new), sc = sets[i % nsets]
                    p.run(q, k, v, lens, block_table=table, k_new=k_new, v_new=v_new, **sc,
                          **run_opts)
            else:
                def run(i):
                    q, k, v, _, table, _, sc = sets[i % nsets]
                    p.run(q, k, v, block_table=table, **sc, **run_opts)
            return run
        run_plan = runner(plan, w.append)
        timing = [(calls or max(MIN_GRAPH_CALLS, nsets), step if name == "step" else None)
                  for name, calls in protocols]  # (calls per graph, other kernels) per protocol
        for row, (n_calls, before) in zip(rows, timing):
            med, p20, p80 = graph_time_cupy(run_plan, n_calls, before=before, span=nsets)
            row.update(graph_calls=n_calls, gpu_us=med, gpu_us_p20=p20, gpu_us_p80=p80,
                       gbps=w.kv_bytes() / (med * 1e3), pct_of_floor=100.0 * base["floor_us"] / med)
        if w.append:  # the same call without the append, over the same tokens (the rows written)
            for row, (n_calls, before) in zip(rows, timing):
                us = graph_time_cupy(runner(plan, False), n_calls, before=before, span=nsets)[0]
                row.update(no_append_us=us, append_cost_us=row["gpu_us"] - us)
        # the point's own baselines are timed in the first protocol
        med = rows[0]["gpu_us"]
        first_calls, first_before = timing[0]

        fp8 = {"kv_dtype": w.kv_dtype} if w.kv_dtype else {}
        if w.append:
            def eager(i):
                q, k, v, lens, table, (k_new, v_new), sc = sets[i % nsets]
                flash_decode(q, k, v, lens, num_splits=w.num_splits, block_table=table,
                             k_new=k_new, v_new=v_new, **opts, **fp8, **sc)
        else:
            def eager(i):
                q, k, v, _, table, _, sc = sets[i % nsets]
                # paged: the capacity may exceed seqlen (whole pages); attend seqlen, as the
                # plan does
                flash_decode(q, k, v, None if table is None else w.seqlen,
                             num_splits=w.num_splits, block_table=table, **opts, **fp8, **sc)
        fewest, most = EAGER_CALLS
        base["eager_us"] = eager_time_cupy(eager, int(min(most, max(fewest, 2.5e5 / (med + 20)))))
        base["host_us"] = host_time_cupy(eager)
        base["plan_host_us"] = host_time_cupy(run_plan)
        base["launch_host_us"] = empty_launch_host_us()

        run_plan(0)
        out = plan.out
        base["rel_err"] = check(out)
        base["check"] = "ok" if base["rel_err"] <= REL_TOL[w.dtype] else "FAIL"

        if plan.num_splits == 1:
            base["split1_us"] = med
        else:
            plan1 = DecodePlan(w.batch, w.num_heads, w.num_kv_heads, w.head_dim, w.seqlen,
                               w.dtype, num_splits=1, **plan_opts)
            base["split1_us"] = graph_time_cupy(runner(plan1, w.append), first_calls,
                                                before=first_before, span=nsets)[0]
            del plan1
        base["speedup_vs_split1"] = base["split1_us"] / med

        if w.append:
            notes.append("naive and peers: attention alone, without the append")
        _naive(base, w, sets, first_calls, scale, check, notes)
        if base["naive_us"]:
            base["speedup_vs_naive"] = base["naive_us"] / med
        if peers:
            settle()  # the peers start from an idle GPU too, not right after the naive baseline
        for name in peers:
            _, fn, _ = PEERS[name]
            for row, (n_calls, before) in zip(rows, timing):
                if cupy.cuda.runtime.memGetInfo()[0] < MARGIN_BYTES:
                    notes.append(f"{name}: skipped, GPU memory is full")
                    break
                for col, (us, note) in fn(sets, w, scale, n_calls, check, before, nsets).items():
                    row[col] = us
                    if note and note not in notes:
                        notes.append(note)
    except Exception as exc:
        notes.append(f"error: {type(exc).__name__}: {exc}")
        base["check"] = base["check"] or "ERROR"
    finally:
        del sets, step
        cupy.get_default_memory_pool().free_all_blocks()
    base["notes"] = "; ".join(notes)
    shared = {k: v for k, v in base.items() if k not in _PER_PROTOCOL}
    for row in rows:
        row.update(shared)
        peer_us = [row[c] for _, _, cols in PEERS.values() for c in cols if row[c]]
        if peer_us and row["gpu_us"]:
            row["best_peer_us"] = min(peer_us)
            row["speedup_vs_best_peer"] = row["best_peer_us"] / row["gpu_us"]
    return rows


# Row fields that each protocol measures for itself (everything else is the point's).
_PER_PROTOCOL = frozenset({"protocol", "graph_calls", "gpu_us", "gpu_us_p20", "gpu_us_p80",
                           "gbps", "pct_of_floor", "best_peer_us", "speedup_vs_best_peer",
                           "no_append_us", "append_cost_us",
                           *(c for _, _, cols in PEERS.values() for c in cols)})


def _naive(row: dict, w: Workload, sets, n_calls: int, scale: float, check, notes: list) -> None:
    import cupy

    if (w.page_size or w.alibi or w.sinks or w.q_len > 1 or w.kv_dtype
            or (w.window_left is not None and w.lengths is not None)):
        notes.append("naive: contiguous caches in dtype of full sequences, one query token, "
                      "without ALiBi or sinks, only")
        return
    free = cupy.cuda.runtime.memGetInfo()[0]
    if naive_bytes(w) + MARGIN_BYTES > free:
        notes.append(f"naive: skipped, needs ~{naive_bytes(w) / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
        return
    try:
        mm = _matmul_dtype(w.dtype)
        cap = w.logits_soft_cap
        # a window over full sequences: the window's tokens (views; ragged lengths: all of them)
        lo = 0 if w.window_left is None else max(0, w.seqlen - 1 - w.window_left)

        def inputs(i):
            q, k, v = sets[i % len(sets)][:3]
            return q, k[:, lo:], v[:, lo:]
        err = check(naive_decode(*inputs(0), scale, mm, cap))
        if err > REL_TOL[w.dtype] * 5:
            notes.append(f"naive: rel err {err:.1e}")
        # CuPy cannot capture cuBLAS in a graph: back-to-back calls timed by events instead.
        row["naive_us"] = stream_time_cupy(
            lambda i: naive_decode(*inputs(i), scale, mm, cap), n_calls,
            trials=max(3, GRAPH_TRIALS // 4))[0]
        if mm != w.dtype:
            notes.append(f"naive: matmul in {mm}")
    except Exception as exc:
        notes.append(f"naive: {type(exc).__name__}: {exc}")
    finally:
        cupy.get_default_memory_pool().free_all_blocks()


def sweep(model: str, dtype: str, seqlens, batches, num_splits=None,
          soft_cap: float | None = None, page_sizes=(None,),
          append: bool = False, window: int | None = None,
          alibi: bool = False, sinks: bool = False,
          head_dim: int | None = None, q_len: int = 1, kv_dtype: str | None = None,
          kv_scale: str = "tensor") -> list[Workload]:
    """The points of a bench run: per layer type of the model (ModelPreset.layers: Gemma-2's
    sliding and full layers, each with the model's options), batch-major, then by seqlen, then
    by page size (None: the contiguous cache), each with a fresh seed. ``soft_cap`` None: the
    model's logits_soft_cap, 0: none, else that cap; ``append``: every sequence holds
    seqlen − 1 tokens and each call appends the last one; ``window``: window_left of every point
    instead of the model's (one layer type then); ``alibi``, ``sinks``: on (else the model's);
    ``head_dim``: instead of the model's; ``q_len``: query tokens per sequence; ``kv_dtype``,
    ``kv_scale``: an fp8 cache with scales of that mode (:func:`workloads.quantize_inputs`)."""
    from .workloads import MODELS, workload_for_model

    opts = {} if soft_cap is None else {"logits_soft_cap": soft_cap or None}
    if window is not None:
        opts["window_left"] = window
    opts.update({k: True for k, on in (("alibi", alibi), ("sinks", sinks)) if on})
    layers = list(MODELS[model].layers())[:1 if window is not None else None]

    def appended(L: int, b: int) -> dict:
        return {"lengths": (L - 1,) * b, "append": True} if append else {}
    return [workload_for_model(model, b, L, dtype, head_dim=head_dim, layer=layer,
                               num_splits=num_splits, seed=fresh_seed(), page_size=page,
                               q_len=q_len, kv_dtype=kv_dtype, kv_scale=kv_scale, **opts,
                               **appended(L, b))
            for layer in layers for b in batches for L in seqlens for page in page_sizes]


# ---------------------------------------------------------------------------- plot

def plot_rows(rows: list[dict], path: str, title: str = "") -> None:
    """µs per call and % of floor vs sequence length, one line per batch size (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_us, ax_pct) = plt.subplots(1, 2, figsize=(11, 4.2))
    for batch in sorted({r["batch"] for r in rows}):
        pts = sorted((r["seqlen"], r["gpu_us"], r["pct_of_floor"], r["floor_us"]) for r in rows
                     if r["batch"] == batch and r["gpu_us"] is not None)
        if not pts:
            continue
        L, us, pct, floor = zip(*pts)
        line = ax_us.plot(L, us, marker="o", label=f"batch {batch}")[0]
        ax_us.plot(L, floor, linestyle=":", color=line.get_color())
        ax_pct.plot(L, pct, marker="o", label=f"batch {batch}")
    for ax in (ax_us, ax_pct):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_us.set_yscale("log")
    ax_us.set_ylabel("GPU µs per call (graph replay); dotted: floor")
    ax_pct.set_ylabel("% of floor (floor / time)")
    ax_pct.set_ylim(0, 105)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- several GPUs

def gpu_counts(most: int) -> list[int]:
    """The rank counts of a scaling table up to ``most``: 1, the powers of two below, ``most``."""
    return sorted({1, most} | {1 << i for i in range(most.bit_length()) if 1 << i <= most})


def _shard_inputs(spec: dict, ranks: int, rank: int):
    """Rank ``rank``'s piece of a sharded decode step: q (the same on every rank), its contiguous
    shard of each sequence's tokens ([r·S, (r+1)·S) ∩ [0, seqlen), S = ceil(seqlen / ranks)),
    the shard's lengths and the tokens after it (device arrays, fresh random values)."""
    import cupy

    b, n, h, hk, d = (spec[x] for x in ("batch", "seqlen", "num_heads", "num_kv_heads",
                                         "head_dim"))
    per = -(-n // ranks)
    lo, hi = min(n, rank * per), min(n, (rank + 1) * per)
    rs = cupy.random.RandomState(spec["seed"])
    q = rs.standard_normal((b, h, d), cupy.float32).astype(spec["dtype"])
    rs = cupy.random.RandomState(spec["seed"] + 1 + rank)
    k = rs.standard_normal((b, max(1, per), hk, d), cupy.float32).astype(spec["dtype"])
    v = rs.standard_normal((b, max(1, per), hk, d), cupy.float32).astype(spec["dtype"])
    lens = cupy.full(b, hi - lo, cupy.int32)
    after = cupy.full(b, n - hi, cupy.int32)
    return q, k, v, lens, after


class _TimedComm:
    """A communicator that records each all-gather between two events on the stream: its time
    runs from the moment the stream reaches it (the rank's own attention done) to its end, so
    that the collective's share does not count the attention, and the host does not wait where
    the plan would not. The events of ``calls`` all-gathers are made up front, off the timed
    steps."""

    def __init__(self, comm, calls: int):
        import cupy

        self.comm, self.rank, self.size, self.calls = comm, comm.rank, comm.size, 0
        self.events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(calls)]
        self._cupy = cupy

    def all_gather(self, send):
        stream = self._cupy.cuda.get_current_stream()
        start, end = self.events[self.calls]
        start.record(stream)
        recv = self.comm.all_gather(send)
        end.record(stream)
        self.calls += 1
        return recv

    def wait(self) -> None:
        from .distributed import _wait

        _wait(self.comm)

    def spent(self) -> list[float]:
        """Seconds of each all-gather so far (once the stream has passed them)."""
        return [self._cupy.cuda.get_elapsed_time(a, b) * 1e-3 for a, b in self.events[:self.calls]]


def sharded_rank_times(comm, spec: dict, steps: int) -> dict:
    """One rank of a scaling point (run by distributed.spawn): µs per decode step of a
    ShardedDecodePlan over this rank's shard (host to completion, median over ``steps``), of its
    collective, and the step's output (rank 0: on the host, for the check)."""
    import cupy

    from .distributed import ShardedDecodePlan

    timed = _TimedComm(comm, steps + 4)  # the plan's own all-gather, 3 to warm up, steps
    q, k, v, lens, after = _shard_inputs(spec, comm.size, comm.rank)
    plan = ShardedDecodePlan(timed, spec["batch"], spec["num_heads"], spec["num_kv_heads"],
                             spec["head_dim"], k.shape[1], spec["dtype"])
    total = []
    for i in range(steps + 3):  # 3 to warm up
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        out, _ = plan.run(q, k, v, lens, after)
        cupy.cuda.Device().synchronize()
        total.append(time.perf_counter() - t0)
    return {"step_us": statistics.median(total[3:]) * 1e6,
            "collective_us": statistics.median(timed.spent()[4:]) * 1e6,  # (1: the plan's own)
            "out": cupy.asnumpy(out.astype(cupy.float32)) if comm.rank == 0 else None}


def single_gpu_step(spec: dict, steps: int) -> tuple[float, object]:
    """µs per step (host to completion, median) of one DecodePlan over every rank's shards
    concatenated on this GPU, and its output (float32, host): the scaling table's yardstick."""
    import cupy

    from .decode import DecodePlan

    ranks = spec["ranks"]
    parts = [_shard_inputs(spec, ranks, r) for r in range(ranks)]
    q = parts[0][0]
    n = spec["seqlen"]
    k = cupy.concatenate([p[1][:, :int(p[3][0])] for p in parts], axis=1)[:, :n]
    v = cupy.concatenate([p[2][:, :int(p[3][0])] for p in parts], axis=1)[:, :n]
    del parts
    plan = DecodePlan(spec["batch"], spec["num_heads"], spec["num_kv_heads"], spec["head_dim"],
                      n, spec["dtype"])
    times = []
    for _ in range(steps + 3):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        out, _ = plan.run(q, k, v, n)
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) * 1e6, cupy.asnumpy(out.astype(cupy.float32))


def scaling_rows(spec: dict, most: int, steps: int = 20) -> list[dict]:
    """The scaling table of one (batch, seqlen) point: per rank count n, the step's µs (the
    slowest rank's), the collective's µs and share, and one GPU holding the n shards together
    (None where they do not fit): its µs, the ratio, and the merged output's relative error
    against its output."""
    from . import distributed as Dist
    from .reference import relative_error

    rows = []
    for n in gpu_counts(most):
        try:
            single_us, single_out = single_gpu_step(dict(spec, ranks=n), steps)
        except Exception:  # noqa: BLE001  (out of memory on one GPU: the row says so)
            single_us, single_out = None, None
        got = Dist.spawn(sharded_rank_times, n, dict(spec, ranks=n), steps)
        step = max(g["step_us"] for g in got)
        coll = max(g["collective_us"] for g in got)
        rows.append({"gpus": n, "tokens_per_gpu": -(-spec["seqlen"] // n), "step_us": step,
                     "collective_us": coll, "collective_share": coll / step,
                     "single_gpu_us": single_us,
                     "speedup": None if single_us is None else single_us / step,
                     "rel_err": None if single_out is None
                     else relative_error(got[0]["out"], single_out)})
    return rows
