"""The flag merge (split partials as flagged 64-bit words, merged by the last block to start)
against the shipped plans (development tool): correctness on ragged lengths, graph replays and
repeated runs, then GPU µs per call by graph replay over rotated buffer sets, same split size,
in one process, each cell timed twice in alternating order.

Usage: python scripts/flag_merge.py [MODEL:DTYPE:BxL ...]
"""

import sys

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode import _kernels, reference  # noqa: E402
from cupydecode import decode as _decode  # noqa: E402
from cupydecode.bench import measure_read_ceiling  # noqa: E402
from cupydecode.workloads import MODELS, Workload, make_inputs  # noqa: E402
from tune import make_sets, time_plans  # noqa: E402

POINTS = ["llama-3-8b:float16:1x1024", "llama-3-8b:float16:1x16384", "llama-3-8b:float16:4x4096",
          "llama-3-8b:float16:4x8192", "llama-3-8b:float16:1x65536", "llama-3-70b:float16:1x16384",
          "gemma-2-9b:float16:1x16384", "qwen2.5-7b:bfloat16:1x65536", "gpt-2:bfloat16:1x65536",
          "gemma-2b:bfloat16:1x65536"]


def flag_plan(b, H, Hkv, D, L, dtype, split_size, num_splits=None, **extra):
    """A plan whose split kernel merges with flags (workspace and launch swapped in)."""
    p = cd.DecodePlan(b, H, Hkv, D, L, dtype, split_size=split_size, num_splits=num_splits,
                      merge="fused")
    assert p.merge == "fused", p
    rows = b * H
    p.o_part = cp.zeros((p.num_splits, rows, 2 * D), cp.float32)   # (value, flag) words
    p.lse_part = cp.zeros((p.num_splits, rows, 2), cp.float32)
    p._counters = cp.zeros(2 * b * Hkv * p.head_tiles, cp.int32)   # (ticket, epoch) per group
    p._part_ptrs = (p.o_part.data.ptr, p.lse_part.data.ptr)
    p._counter_ptr = p._counters.data.ptr
    p._counters_wait = None
    fn = _kernels.get_function(_decode._SPLIT_FILE, _decode._SPLIT_KERNEL,
                               {**p.config.defines(), "FLAG_MERGE": 1, **extra})
    p._split_launch = _kernels.StructLaunch(fn, p._grid, (p.config.threads, 1, 1),
                                            p.config.smem_bytes, _decode._PARAMS)
    cp.cuda.Device().synchronize()
    return p


def check(m, dtype, b, L):
    """Flag plans against the float64 reference: ragged lengths (0, 1, partial chunks, NaN past
    each length), several runs of one plan, and graph replays with new inputs copied in place."""
    H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
    rs = np.random.default_rng()
    worst = 0.0
    p = flag_plan(b, H, Hkv, D, L, dtype, None, num_splits=max(2, min(16, L // 64)))

    def inputs(first):
        lens = [int(x) for x in rs.integers(0, L + 1, b)]
        lens[0] = first
        return make_inputs(Workload(b, L, H, Hkv, D, dtype, lengths=tuple(lens)))

    def verify(out, lse, q, k, v, sl, what):
        ro, rl = reference.decode_attention(q, k, v, cp.asnumpy(sl))
        e = reference.relative_error(out, ro)
        assert e < 2e-2, (what, e)
        assert np.isfinite(cp.asnumpy(out.astype(cp.float32))).all(), what
        assert reference.lse_error(lse, rl) < 1e-3, what
        return e

    for trial, first in enumerate([0, 1, L, p.chunk_tokens, p.chunk_tokens + 1, L - 1]):
        q, k, v, sl = inputs(first)
        out, lse = p.run(q, k, v, sl, out=cp.full((b, H, D), np.nan, dtype),
                         lse=cp.full((b, H), np.nan, cp.float32))
        worst = max(worst, verify(out, lse, q, k, v, sl, f"eager {trial}"))
    q, k, v, sl = inputs(L)
    out = cp.empty((b, H, D), dtype)
    lse = cp.empty((b, H), cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        p.run(q, k, v, sl, out=out, lse=lse)
        g = s.end_capture()
    for trial in range(4):
        q2, k2, v2, sl2 = inputs(int(rs.integers(0, L + 1)))
        for dst, src in ((q, q2), (k, k2), (v, v2), (sl, sl2)):
            dst[...] = src
        out.fill(np.nan)
        lse.fill(np.nan)
        g.launch(s)
        s.synchronize()
        worst = max(worst, verify(out, lse, q, k, v, sl, f"graph {trial}"))
    return worst


def main():
    for spec in () if "--no-check" in sys.argv else ("llama-3-8b:float16:3x2000", "gemma-2b:bfloat16:2x3000", "gpt-2:bfloat16:2x1000",
                 "llama-3-70b:float16:2x1500", "gemma-2-9b:float16:2x777"):
        model, dtype, bl = spec.split(":")
        b, L = (int(x) for x in bl.split("x"))
        print(f"check {spec}: worst rel err {check(MODELS[model], dtype, b, L):.2e}", flush=True)
    ceiling = measure_read_ceiling()["gbps"]
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    for spec in [a for a in sys.argv[1:] if not a.startswith("--")] or POINTS:
        model, dtype, bl = spec.split(":")
        b, L = (int(x) for x in bl.split("x"))
        m = MODELS[model]
        H, Hkv, D = m.num_heads, m.num_kv_heads, m.head_dim
        nbytes, sets = make_sets(b, L, H, Hkv, D, dtype)
        ref = cd.DecodePlan(b, H, Hkv, D, L, dtype)
        makers = {
            "shipped": lambda: cd.DecodePlan(b, H, Hkv, D, L, dtype),
            "flag": lambda: flag_plan(b, H, Hkv, D, L, dtype, ref.chunk_tokens),
            "sleep128": lambda: flag_plan(b, H, Hkv, D, L, dtype, ref.chunk_tokens, FLAG_SLEEP=128),
            "sleep512": lambda: flag_plan(b, H, Hkv, D, L, dtype, ref.chunk_tokens, FLAG_SLEEP=512),
            "nowait": lambda: flag_plan(b, H, Hkv, D, L, dtype, ref.chunk_tokens, FLAG_NOWAIT=1),
        }
        if ref.merge != "fused":
            makers["fused"] = lambda: cd.DecodePlan(b, H, Hkv, D, L, dtype,
                                                    split_size=ref.chunk_tokens, merge="fused")
        cells = {k: [] for k in makers}
        for rep in range(2):
            for name in (list(makers) if rep == 0 else list(makers)[::-1]):
                us, plan = time_plans(makers[name], sets)
                cells[name].append(us)
        # the timed flag plan's output against the shipped plan's on one set
        fp, sp = makers["flag"](), makers["shipped"]()
        o1, _ = fp.run(*sets[0])
        o2, _ = sp.run(*sets[0])
        diff = float(cp.abs(o1.astype(cp.float32) - o2.astype(cp.float32)).max())
        floor = nbytes / ceiling / 1e3
        print(f"{model} {dtype} b{b}x{L // 1024}k (S{ref.num_splits}, {ref.merge}, "
              f"{ref.config.num_warps}x{ref.config.stages}): " + "  ".join(
                  f"{k} {'/'.join(f'{u:.2f}' for u in v)} ({100 * floor / min(v):.1f}%)"
                  for k, v in cells.items())
              + f"  flag-shipped {min(cells['flag']) - min(cells['shipped']):+.2f} us, max|diff| {diff:.1e}",
              flush=True)
        del sets


if __name__ == "__main__":
    main()
