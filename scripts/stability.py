"""Start-state stability of the large batched plans (development tool; results go to
docs/PERFORMANCE.md): each shape timed in the decode-step protocol and in back-to-back graphs of
2 and 10 calls, on two independent allocations of its buffers, beside cuDNN/FA2 through torch
SDPA timed the same way, plus plan variants; the GPU's SM clock and power (NVML, sampled every
2 ms) during each measurement.

Usage: python scripts/stability.py [--quick] [--shapes B:L:H:HKV,...]
"""

import dataclasses
import sys
import threading
import time

import cupy as cp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode import bench as B  # noqa: E402
from cupydecode.workloads import Workload, make_inputs  # noqa: E402
from tune import policy_value  # noqa: E402

DEV = cp.cuda.Device().id
L2 = cp.cuda.runtime.getDeviceProperties(DEV)["l2CacheSize"]


class Clocks:
    """NVML samples (SM MHz, memory MHz, W, throttle reasons) on a thread; ``window()``
    marks a measurement and returns its (min SM MHz, median SM MHz, max W, reasons seen)."""

    def __init__(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nv, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(DEV)
        except Exception as exc:  # noqa: BLE001
            print(f"NVML unavailable: {exc}")
            self.nv = None
            return
        self.samples, self.stop = [], False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        nv, h = self.nv, self.h
        while not self.stop:
            try:
                self.samples.append((time.perf_counter(),
                                     nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                                     nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                                     nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                                     nv.nvmlDeviceGetCurrentClocksThrottleReasons(h)))
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.002)

    def measure(self, fn):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        if self.nv is None:
            return out, ""
        s = [x for x in self.samples if t0 <= x[0] <= t1]
        if not s:
            return out, ""
        sm = [x[1] for x in s]
        reasons = 0
        for x in s:
            reasons |= x[4]
        return out, (f"sm {min(sm)}-{int(np.median(sm))} MHz mem {s[-1][2]} "
                     f"W<={max(x[3] for x in s):.0f} thr=0x{reasons:x}")


def sets_for(w, n):
    return [make_inputs(dataclasses.replace(w, seed=None)) for _ in range(n)]


def main():
    quick = "--quick" in sys.argv
    shapes = [(64, 8192, 32, 8), (16, 32768, 32, 8), (32, 4096, 32, 32), (128, 2048, 32, 8),
              (1, 16384, 32, 8), (4, 8192, 32, 8)]
    for a in sys.argv[1:]:
        if a.startswith("--shapes="):
            shapes = [tuple(int(x) for x in s.split(":")) for s in a.split("=", 1)[1].split(",")]
    clocks = Clocks()
    ceiling = B.measure_read_ceiling()["gbps"]
    print(f"read ceiling {ceiling:.0f} GB/s", flush=True)
    try:
        import torch  # noqa: F401
        have_torch = True
    except Exception:  # noqa: BLE001
        have_torch = False
    keep = []  # spacers stay alive, so that each allocation lands elsewhere
    for (b, L, H, Hkv) in shapes:
        w = Workload(batch=b, seqlen=L, num_heads=H, num_kv_heads=Hkv, head_dim=128,
                     dtype="float16")
        nsets = B.buffer_sets_needed(w, L2)
        floor = w.kv_bytes() / ceiling / 1e3
        step = B.StepTraffic(w, L2)
        big = b * L >= 64 * 4096
        old = None
        for alloc in range(1 if quick else 2):
            keep.append(cp.empty((alloc * 777 + 1) << 20, cp.uint8))  # shift the allocation
            sets = sets_for(w, nsets)  # (the previous allocation is still alive here)
            del old
            B.settle(0.5)
            check = B._subset_checker(w, *sets[0][:3])
            arms = [("shipped", {}, None)]
            if big and not quick:
                arms += [("kv1", {}, ("kv_group_pays", lambda *a: False)),
                         ("S2", {"num_splits": 2}, None),
                         ("S4", {"num_splits": 4}, None),
                         ("no-in-step", {}, ("warps_in_step", lambda *a: False))]
            for label, kw, override in arms:
                if override:
                    with policy_value(*override):
                        plan = cd.DecodePlan(b, H, Hkv, 128, L, "float16", **kw)
                else:
                    plan = cd.DecodePlan(b, H, Hkv, 128, L, "float16", **kw)
                err = check(plan.run(*sets[0][:3])[0])

                def run(i, plan=plan):
                    plan.run(*sets[i % nsets][:3])
                cells = []
                for proto, n, before in (("step", 8, step), ("b2b", 2, None), ("b2b", 10, None)):
                    n = max(n, nsets)
                    (med, p20, p80), clk = clocks.measure(
                        lambda: B.graph_time_cupy(run, n, before=before))
                    cells.append(f"{proto}x{n} {med:7.1f} ({100 * floor / med:3.0f}%) [{clk}]")
                print(f"b{b} L{L} {H}/{Hkv} alloc{alloc} {label:10s} S{plan.num_splits} "
                      f"kpb{plan.kv_per_block} {plan.config.num_warps}x{plan.config.stages} "
                      f"err {err:.1e} | " + " | ".join(cells), flush=True)
                del plan
            if have_torch:
                cells = []
                for proto, n, before in (("step", 8, step), ("b2b", 2, None), ("b2b", 10, None)):
                    n = max(n, nsets)
                    res, clk = clocks.measure(
                        lambda: B.torch_sdpa_times(sets, w, 128 ** -0.5, n, check, before))
                    txt = " ".join(f"{c.split('_')[1]} {us:7.1f}" if us else f"{c}: -"
                                   for c, (us, _) in res.items())
                    cells.append(f"{proto}x{n} {txt} [{clk}]")
                print(f"b{b} L{L} {H}/{Hkv} alloc{alloc} torch      | " + " | ".join(cells),
                      flush=True)
            old = sets
        del old, sets
        del step
        cp.get_default_memory_pool().free_all_blocks()
    del keep


if __name__ == "__main__":
    main()
