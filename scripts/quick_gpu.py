"""Quick GPU smoke run: correctness on a few shapes, then rough timings. For development."""

import sys
import time

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
import cupydecode as cd  # noqa: E402
from cupydecode import reference as R  # noqa: E402


def rnd(shape, dtype, scale=1.0):
    x = cp.random.standard_normal(shape, dtype=cp.float32) * scale
    return x.astype(dtype)


def check(batch, H, Hkv, D, L, dtype, splits=None, lens=None, qscale=1.0):
    q = rnd((batch, H, D), dtype, qscale)
    k = rnd((batch, L, Hkv, D), dtype)
    v = rnd((batch, L, Hkv, D), dtype)
    out = cp.full((batch, H, D), np.nan, dtype=dtype)
    seq = None if lens is None else cp.asarray(np.array(lens, np.int32))
    o, lse = cd.flash_decode(q, k, v, seq, num_splits=splits, return_lse=True, out=out)
    ro, rl = R.decode_attention(q, k, v, None if lens is None else np.array(lens))
    err = R.relative_error(o, ro)
    lerr = R.lse_error(lse, rl)
    return err, lerr


def main():
    fails = 0
    for dtype in ("float16", "bfloat16", "float32"):
        tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-4}[dtype]
        for (b, H, Hkv, D, L, s, lens) in [
            (1, 32, 8, 128, 1, None, None), (2, 32, 8, 128, 257, None, None),
            (3, 28, 4, 64, 4097, 3, None), (1, 8, 1, 256, 1000, None, None),
            (3, 32, 32, 128, 255, 1, [0, 17, 255]), (2, 64, 8, 128, 2048, None, [2048, 5]),
            (1, 56, 2, 128, 300, None, None), (1, 32, 8, 128, 65536, None, None),
        ]:
            t = time.time()
            e, le = check(b, H, Hkv, D, L, dtype, s, lens)
            ok = e <= tol and le < 1e-2
            fails += not ok
            print(f"{dtype:9s} b{b} H{H}/{Hkv} D{D} L{L} s={s} lens={lens}: rel {e:.2e} lse {le:.2e} "
                  f"{'ok' if ok else 'FAIL'} ({time.time()-t:.1f}s)", flush=True)
    # large logits
    for dtype in ("float16", "bfloat16"):
        e, le = check(2, 32, 8, 128, 3000, dtype, None, None, qscale=300.0)
        print(f"big logits {dtype}: rel {e:.2e} lse {le:.2e}", flush=True)

    if "--no-timing" in sys.argv:
        print("FAILS", fails)
        return
    # rough timing, graph replay, 32/8/128 fp16
    from cupy.cuda import Graph  # noqa
    dev = cp.cuda.Device()
    print("device", cp.cuda.runtime.getDeviceProperties(dev.id)["name"])
    for (b, L) in [(1, 16384), (1, 65536), (1, 262144), (4, 8192), (16, 8192), (64, 8192), (16, 32768)]:
        H, Hkv, D = 32, 8, 128
        nbytes = 2 * b * L * Hkv * D * 2
        nsets = max(2, int(4 * 60e6 // nbytes) + 1)
        sets = [(rnd((b, H, D), "float16"), rnd((b, L, Hkv, D), "float16"), rnd((b, L, Hkv, D), "float16"))
                for _ in range(nsets)]
        plan = cd.DecodePlan(b, H, Hkv, D, L, "float16")
        for s in sets:
            plan.run(*s)
        stream = cp.cuda.Stream(non_blocking=True)
        reps = 10
        with stream:
            stream.begin_capture()
            for i in range(reps):
                plan.run(*sets[i % nsets])
            g = stream.end_capture()
            g.launch(stream)
            stream.synchronize()
            ts = []
            for _ in range(10):
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record(stream)
                g.launch(stream)
                e1.record(stream)
                e1.synchronize()
                ts.append(cp.cuda.get_elapsed_time(e0, e1) * 1e3 / reps)
        us = float(np.median(ts))
        print(f"b{b} L{L} splits={plan.num_splits} chunk={plan.chunk_tokens}: {us:.1f} us, "
              f"{nbytes/us/1e3:.0f} GB/s ({nbytes/1e6:.0f} MB)", flush=True)
        del sets
    print("FAILS", fails)


if __name__ == "__main__":
    main()
