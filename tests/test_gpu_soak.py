"""Soak: many random calls from several threads and streams, with a graph captured and replayed
from another thread, sampled outputs checked against the float64 reference, and the caches and
the memory pool bounded.

Runs only with CUPYDECODE_SOAK=1 (it takes minutes); CUPYDECODE_SOAK_CALLS sets the number of
calls (default 100000, spread over the threads). Layouts and options are drawn from a small set so
that the kernels it compiles stay few (each specialisation is compiled once per machine).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import OUT_TOL, to_device

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    os.environ.get("CUPYDECODE_SOAK") != "1", reason="soak: set CUPYDECODE_SOAK=1 to run it")]

LAYOUTS = [(32, 8, 128), (8, 1, 256), (12, 12, 64)]
THREADS = 4
CHECK_EVERY = 997  # a prime: the checked calls move through the option combinations


def _input_sets(rng, cupy, count: int = 12):
    """Random (host, device) inputs of each layout and 16-bit dtype, made once: the calls draw
    their lengths and options afresh and reuse these (making new caches per call would be the
    soak's whole cost)."""
    import ml_dtypes

    sets = []
    for i in range(count):
        num_heads, num_kv_heads, head_dim = LAYOUTS[i % len(LAYOUTS)]
        dtype = ("float16", "bfloat16")[(i // len(LAYOUTS)) % 2]
        npdt = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
        batch, max_seqlen = int(rng.integers(1, 6)), int(rng.integers(1, 3000))
        shapes = ((batch, num_heads, head_dim), (batch, max_seqlen, num_kv_heads, head_dim),
                  (batch, max_seqlen, num_kv_heads, head_dim))
        host = tuple(rng.standard_normal(sh, np.float32).astype(npdt) for sh in shapes)
        sets.append((dtype, host, tuple(to_device(x) for x in host)))
    return sets


def _random_options(rng, cupy, num_heads: int):
    """flash_decode's options and the reference's, drawn from ``rng``."""
    opts, ref_opts = {}, {}
    if rng.random() < 0.3:
        opts["logits_soft_cap"] = ref_opts["logits_soft_cap"] = 30.0
    if rng.random() < 0.3:
        opts["window_left"] = ref_opts["window_left"] = int(rng.integers(0, 1000))
    if rng.random() < 0.2:
        sinks = rng.uniform(-2, 4, num_heads).astype(np.float32)
        opts["sinks"], ref_opts["sinks"] = cupy.asarray(sinks), sinks
    if rng.random() < 0.2:
        opts["num_splits"] = int(rng.integers(1, 9))
    return opts, ref_opts


def _worker(seed, calls, errors, cupy, sets):
    rng = np.random.default_rng(seed)
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:
            for i in range(calls):
                dtype, host, dev = sets[rng.integers(len(sets))]
                batch, max_seqlen = host[1].shape[:2]
                lens = rng.integers(0, max_seqlen + 1, batch).astype(np.int32)
                opts, ref_opts = _random_options(rng, cupy, host[0].shape[1])
                out = cupydecode.flash_decode(*dev, cupy.asarray(lens), **opts)
                if i % CHECK_EVERY == 0:
                    stream.synchronize()
                    ref, _ = R.decode_attention(*host, lens, **ref_opts)
                    err = R.relative_error(out, ref)
                    if not err <= OUT_TOL[dtype]:
                        errors.append(f"seed {seed} call {i}: rel err {err:.2e} {opts}")
            stream.synchronize()
    except BaseException as exc:  # reported by the test, in the main thread
        errors.append(f"seed {seed}: {type(exc).__name__}: {exc}")


def test_soak_threads_streams_and_a_graph_from_another_thread(cupy, seed):
    from cupydecode import _kernels, decode

    total = int(os.environ.get("CUPYDECODE_SOAK_CALLS", "100000"))
    errors: list = []
    pool = cupy.get_default_memory_pool()
    sets = _input_sets(np.random.default_rng(seed), cupy)
    # warm-up: every layout and option once, so that compiles and pool growth happen here
    _worker(seed, 200, errors, cupy, sets)
    pool.free_all_blocks()
    base = pool.total_bytes()

    # a plan captured and replayed from a thread of its own, beside the eager callers
    def graph_thread():
        try:
            rng = np.random.default_rng(seed + 99)
            q, k, v = (to_device(rng.standard_normal(s, np.float32).astype(np.float16))
                       for s in ((2, 32, 128), (2, 2000, 8, 128), (2, 2000, 8, 128)))
            lens = cupy.asarray(np.array([2000, 1000], np.int32))
            plan = cupydecode.DecodePlan(2, 32, 8, 128, 2000, "float16")
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                plan.run(q, k, v, lens)
                stream.synchronize()
                stream.begin_capture()
                plan.run(q, k, v, lens)
                graph = stream.end_capture()
                for _ in range(max(10, total // 100)):
                    graph.launch(stream)
                stream.synchronize()
            ref, _ = R.decode_attention(q, k, v, [2000, 1000])
            err = R.relative_error(plan.out, ref)
            if not err <= OUT_TOL["float16"]:
                errors.append(f"graph thread: rel err {err:.2e}")
        except BaseException as exc:
            errors.append(f"graph thread: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=_worker,
                                args=(seed + 1 + t, total // THREADS, errors, cupy, sets))
               for t in range(THREADS)] + [threading.Thread(target=graph_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    pool.free_all_blocks()
    # bounded: the pool holds no more after the soak than after the warm-up (plans' workspaces
    # of the bounded plan caches aside), the caches stay within their bounds
    assert pool.total_bytes() <= base + (64 << 20), (pool.total_bytes(), base)
    assert len(decode._PLAN_CACHE) <= decode._PLAN_CACHE_SIZE
    assert len(decode._EAGER) <= decode._EAGER_SIZE
    assert len(_kernels._compiled) <= 64, len(_kernels._compiled)
