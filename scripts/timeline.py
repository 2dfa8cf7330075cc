"""Per-block timeline of the split kernel (development tool; results go to docs/PERFORMANCE.md).

Instruments a copy of kernels/decode_split.cu (the shipped source is untouched) so that thread 0
of every block records %globaltimer at: entry (t0), first K/V tile ready (t1), end of streaming
(t2), partials written and counted in (t3), and, in the merging block, end of the merge (t4).
Prints, per shape, when blocks start and stop streaming relative to the first block's entry.

Also: (t6) warp states in shared memory, (t7) before the combine loop, (t5) after the arrival count.
The timed call is the last of 10 graph-replayed calls (rotating K/V sets), as the benchmark runs it.

Usage: python scripts/timeline.py [merge]      (merge: also stamps inside the merging block)
"""

import sys

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
import cupydecode as cd  # noqa: E402
from cupydecode import _kernels  # noqa: E402

STAMP = ("{ unsigned long long gt_; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(gt_)); "
         "cd_dbg[((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * 16 + {K}] = gt_; }")


def stamp(k: int, indent: str = "    ", guard: str = "tid == 0", sync: bool = False) -> str:
    """Source line(s) that record %globaltimer in slot k of this block (after a barrier if sync)."""
    pre = f"{indent}__syncthreads();\n" if sync else ""
    return f"{pre}{indent}if ({guard}) " + STAMP.replace("{K}", str(k)) + "\n"


MERGE_WARPS = ("    __syncthreads();\n\n    // " + "=" * 64 + " 4. epilogue\n    // " + "-" * 64
               + " merge the warps, write\n")
# (anchor in decode_split.cu, text to insert, before/after the anchor)
INJECT = [
    ("#define CD_MERGE_GROUP 16\n", "__device__ unsigned long long cd_dbg[1 << 18];\n", "before"),
    ("    const int h0 = unit * KV_PER_BLOCK * vgroup + row0;\n", stamp(0)
     + "    if (tid == 0) { unsigned smid_; asm volatile(\"mov.u32 %0, %%smid;\" : \"=r\"(smid_)); "
       "cd_dbg[((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * 16 + 8] = smid_; }\n",
     "after"),
    ("                if (in_step) __syncthreads();\n                else __syncwarp();\n",
     stamp(1, " " * 16, "i == 0 && tid == 0"), "after"),  # (the one-M-tile path of next_tile)
    ("        __syncthreads();  // every warp is done with the ring before it becomes sm_acc\n",
     stamp(2, " " * 8), "after"),
    (MERGE_WARPS, stamp(6), "before"),
    ("    // Row r's token and head (MULTI_Q: from shared memory, above; else token 0, head h0 + r),\n",
     stamp(7), "before"),
    ("    if (!o_part || !counters) return;\n", stamp(3, sync=True), "before"),
    ("    if (!s_last) return;\n", stamp(5), "before"),
    ("                                           lane, p.sinks ? p.sinks[head] * CD_LOG2E : CD_NEG_INF);\n"
     "    }\n",
     stamp(4, sync=True), "after"),
]

# `timeline.py merge`: stamps inside the merging block too — (13) the arrival atomic returned
# (thread 0), and in cd_merge_fold, thread 0 of the block: (9) after the loads in source order
# (the compiler may sink it past their first use), (10) the LSE loads used (max taken), (11) the
# Õ loads used (weighted sum done). Guards that read the loaded values keep the compiler from
# moving stamps 10 and 11 before the values are there.
MERGE_INJECT = [
    ("        s_last = cd_atomic_inc_acq_rel(ctr, num_splits - 1) == (unsigned)(num_splits - 1);\n",
     stamp(13, " " * 8, "true"), "after"),
    ("        float mg = st.m;\n", stamp(9, " " * 8, "threadIdx.x == 0"), "before"),
    ("        const float ref = (mg == CD_NEG_INF) ? 0.f : mg;  // all empty so far: weights stay 0\n",
     stamp(10, " " * 8, "threadIdx.x == 0 && mg != 12345.f"), "after"),
    ("        st.m = mg;\n", stamp(11, " " * 8, "threadIdx.x == 0 && st.acc[0] != 12345.f"), "before"),
]
if sys.argv[1:2] == ["merge"]:
    INJECT += MERGE_INJECT

_orig_source = _kernels.program_source


def instrumented_source(filename, defines):
    src = _orig_source(filename, defines)
    if filename != "decode_split.cu":
        return src
    for anchor, text, where in INJECT:
        assert anchor in src, anchor
        # (every occurrence: the end-of-stream anchor is in both tensor-core paths)
        src = src.replace(anchor, text + anchor if where == "before" else anchor + text)
    return src


_kernels.program_source = instrumented_source


def timeline(b, L, H=32, Hkv=8, D=128, splits=None, rotate=True):
    q = cp.random.standard_normal((b, H, D), dtype=cp.float32).astype(cp.float16)
    k = cp.random.standard_normal((b, L, Hkv, D), dtype=cp.float32).astype(cp.float16)
    v = cp.random.standard_normal((b, L, Hkv, D), dtype=cp.float32).astype(cp.float16)
    flush = cp.empty(512 << 20, cp.uint8)
    plan = cd.DecodePlan(b, H, Hkv, D, L, "float16", num_splits=splits)
    cfg = plan.config
    mod = _kernels._module(_kernels.program_source("decode_split.cu", cfg.defines()),
                           _kernels.COMPILE_OPTIONS)
    dbg = mod.get_global("cd_dbg")
    buf = cp.ndarray((1 << 18,), cp.uint64, dbg)
    for _ in range(3):
        plan.run(q, k, v)
    # In graph replay, 10 calls rotating over sets > 4x L2, as the benchmark times them; the stamps
    # left in the buffer are the last call's.
    nsets = max(2, -(-4 * cp.cuda.runtime.getDeviceProperties(0)["l2CacheSize"] // (2 * k.nbytes)) + 1)
    if not rotate:  # the same K/V every call: page-table entries stay cached (L2 is still too small)
        nsets = 1
    sets = [(q, k, v)] + [(q, cp.random.standard_normal(k.shape, dtype=cp.float32).astype(k.dtype),
                           cp.random.standard_normal(v.shape, dtype=cp.float32).astype(v.dtype))
                          for _ in range(nsets - 1)]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for i in range(max(10, nsets)):
            plan.run(*sets[(i + 1) % nsets])
        graph = stream.end_capture()
    rows = []
    for rep in range(5):
        flush.fill(rep)  # evict K/V from L2
        buf.fill(0)
        cp.cuda.Device().synchronize()
        graph.launch(stream)
        stream.synchronize()
        nblk = plan._grid[0] * plan._grid[1] * plan._grid[2]
        t = buf[: nblk * 16].get().reshape(nblk, 16).astype(np.int64)
        rows.append(t)
    t = rows[-1]
    base = t[:, 0].min()
    # (stamps of earlier calls in the graph stay where this call's merging block was another
    # block: only stamps from this call's first entry on count)
    rel = lambda c: (t[:, c][t[:, c] >= base] - base) / 1e3  # noqa: E731  µs
    out = [f"b{b} L{L} splits {plan.num_splits} blocks {t.shape[0]}{'' if rotate else ' (one K/V set)'}:"]
    for name, c in (("entry", 0), ("first tile", 1), ("stream end", 2), ("warps in smem", 6),
                    ("pre-combine", 7), ("partials out", 3),
                    ("counted in", 5), ("merge end", 4)):
        x = rel(c)
        if x.size:
            out.append(f"  {name:12s} min {x.min():6.2f}  p10 {np.percentile(x, 10):6.2f}  "
                       f"med {np.median(x):6.2f}  p90 {np.percentile(x, 90):6.2f}  max {x.max():6.2f} us"
                       f"  (n={x.size})")
    # Stream end per block: spread within each (batch, KV head) vs between them, and per SM.
    end = (t[:, 2] - base) / 1e3
    gx = plan._grid[0]
    heads = np.arange(t.shape[0]) % gx + gx * (np.arange(t.shape[0]) // (gx * plan._grid[1]))
    within = [np.ptp(end[heads == h]) for h in np.unique(heads)]
    means = [end[heads == h].mean() for h in np.unique(heads)]
    out.append(f"  stream end spread within a KV head: median {np.median(within):.2f} max {max(within):.2f} us;"
               f" between head means {np.ptp(means):.2f} us")
    smid = t[:, 8]
    order = np.argsort(end)
    out.append(f"  slowest 8 blocks' SMs: {smid[order[-8:]].tolist()}; fastest 8: {smid[order[:8]].tolist()}")
    if len(rows) > 1:  # is slowness a property of the SM? correlate per-SM stream time over two runs
        def per_sm(tt):
            st = (tt[:, 2] - tt[:, 1]).astype(float)
            return {int(sm): st[tt[:, 8] == sm].mean() for sm in np.unique(tt[:, 8])}
        a, c = per_sm(rows[-1]), per_sm(rows[-2])
        common = sorted(set(a) & set(c))
        if len(common) > 3:
            r = np.corrcoef([a[x] for x in common], [c[x] for x in common])[0, 1]
            out.append(f"  per-SM stream time, correlation between two runs: {r:.2f} (n={len(common)})")
    if sys.argv[1:2] == ["merge"]:  # the merging blocks of the last call, relative to their arrival
        last = t[:, 4] > base
        for name, c in (("atomic back", 13), ("counted in", 5), ("loads issued", 9),
                        ("LSEs used", 10), ("Õ used", 11), ("merge end", 4)):
            x = (t[last, c] - t[last, 3]) / 1e3
            out.append(f"  merging blocks, {name:12s} after partials out: med {np.median(x):5.2f}  "
                       f"max {x.max():5.2f} us (n={x.size})")
    # over the 5 repetitions: total = last merge end (or counted-in) - first entry
    tot = []
    for t in rows:
        end = max(t[:, 4].max(), t[:, 3].max())
        tot.append((end - t[:, 0].min()) / 1e3)
    out.append(f"  first entry → last finish, 5 runs: {' '.join(f'{x:.2f}' for x in tot)} us")
    ts = np.unique(np.diff(np.unique(rows[-1][:, 0])))
    out.append(f"  globaltimer steps seen (ns): {ts[:6].tolist()}")
    print("\n".join(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["tlb"]:
        for rotate in (True, False):
            timeline(1, 65536, rotate=rotate)
        sys.exit(0)
    for b, L, s in ((1, 16384, None), (1, 1024, None), (1, 1024, 16), (4, 8192, None),
                    (1, 65536, None))[:(3 if sys.argv[1:2] == ["merge"] else 5)]:
        timeline(b, L, splits=s)
