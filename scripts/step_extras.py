"""Three decode-step questions in one process (development tool; results go to
docs/PERFORMANCE.md):

  heat  — does a GPU slowed by its power cap (SM clock below its maximum after heavy work) slow
          cupydecode more than cuDNN? Each arm timed right after 0.4 s of bf16 matrix products,
          with NVML's SM clock over the timed window.
  pdl   — the split kernel launched as a programmatic dependent of the kernel before it
          (DecodePlan(enable_pdl=True)), in the decode-step protocol, with a previous kernel that
          triggers its dependents early and one that does not.
  host  — where the host time of DecodePlan.run and flash_decode goes (cProfile).
  hint  — the split kernel's K/V copies with and without the L2 evict-first hint, in the
          decode-step protocol and back to back.

Usage: python scripts/step_extras.py [heat] [pdl] [host] [hint]
"""

import cProfile
import dataclasses
import io
import pstats
import sys
import time

import cupy as cp

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode import bench as B  # noqa: E402
from cupydecode.workloads import Workload, make_inputs  # noqa: E402
from stability import Clocks  # noqa: E402
from tune import alternating, policy_value  # noqa: E402

L2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"]


def workload(b, L, H=32, Hkv=8):
    w = Workload(batch=b, seqlen=L, num_heads=H, num_kv_heads=Hkv, head_dim=128, dtype="float16")
    n = B.buffer_sets_needed(w, L2)
    return w, n, [make_inputs(dataclasses.replace(w, seed=None)) for _ in range(n)]


def heat(seconds=0.4):
    a = cp.random.standard_normal((8192, 8192), dtype=cp.float32).astype(cp.float16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            cp.matmul(a, a)
        cp.cuda.Device().synchronize()


def heat_part(clocks):
    for (b, L) in [(64, 8192), (16, 32768), (4, 8192)]:
        w, n, sets = workload(b, L)
        check = B._subset_checker(w, *sets[0][:3])
        plan = cd.DecodePlan(b, 32, 8, 128, L, "float16")
        calls = max(10, n)
        for rep in range(3):
            for hot in (False, True):
                if hot:
                    heat()
                else:
                    B.settle(1.0)
                ours, c1 = clocks.measure(lambda: B.graph_time_cupy(
                    lambda i: plan.run(*sets[i % n][:3]), calls, trials=5, span=n)[0])
                if hot:
                    heat()
                else:
                    B.settle(1.0)
                res, c2 = clocks.measure(lambda: B.torch_sdpa_times(
                    sets, w, 128 ** -0.5, calls, check, span=n))
                cudnn = res["torch_cudnn_us"][0]
                print(f"heat b{b} L{L} rep{rep} {'hot ' if hot else 'idle'}: ours {ours:7.1f} "
                      f"[{c1}]  cuDNN {cudnn:7.1f} (FA2 {res['torch_flash_us'][0]:.1f}) [{c2}]  "
                      f"ours/cuDNN {ours / cudnn:.3f}", flush=True)
        del sets, plan
        cp.get_default_memory_pool().free_all_blocks()


def pdl_part():
    points = [(1, 1024), (1, 16384), (4, 8192), (16, 1024), (1, 65536), (16, 16384), (64, 8192)]
    for (b, L) in points:
        w, n, sets = workload(b, L)
        steps = {trig: B.StepTraffic(w, L2, early_trigger=trig) for trig in (False, True)}

        def time_arm(arm):
            prog, trig = arm
            plan = cd.DecodePlan(b, 32, 8, 128, L, "float16", enable_pdl=prog)
            assert plan._split_launch.programmatic == prog
            us = B.graph_time_cupy(lambda i: plan.run(*sets[i % n][:3]), max(10, n),
                                   before=steps[trig], span=n)[0]
            return us, plan
        arms = [(False, False), (True, False), (False, True), (True, True)]
        times, _ = alternating(arms, time_arm, reps=2)
        floor = w.kv_bytes() / 4550e3  # µs at ~4550 GB/s
        txt = "  ".join(f"{'pdl' if p else 'plain'}/{'trig' if t else 'notrig'} "
                        f"{min(times[(p, t)]):7.2f}" for p, t in arms)
        print(f"pdl b{b} L{L} ({w.kv_bytes() / 1e6:.0f} MB, floor~{floor:.1f}): {txt}", flush=True)
        del sets, steps
        cp.get_default_memory_pool().free_all_blocks()


def host_part():
    b, L = 1, 16384
    w, n, sets = workload(b, L)
    q, k, v, _ = sets[0]
    plan = cd.DecodePlan(b, 32, 8, 128, L, "float16")
    empty = B.empty_launch_host_us()
    run_us = B.host_time_cupy(lambda i: plan.run(q, k, v))
    fd_us = B.host_time_cupy(lambda i: cd.flash_decode(q, k, v))
    print(f"host: empty launch {empty:.2f} us, plan.run {run_us:.2f} ({run_us / empty:.2f}x), "
          f"flash_decode {fd_us:.2f} ({fd_us / empty:.2f}x)", flush=True)
    for label, fn in (("plan.run", lambda: plan.run(q, k, v)), ("flash_decode",
                                                                lambda: cd.flash_decode(q, k, v))):
        prof = cProfile.Profile()
        prof.enable()
        for i in range(3000):
            fn()
            if i % 200 == 0:
                cp.cuda.Device().synchronize()
        prof.disable()
        cp.cuda.Device().synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(f"--- {label}\n" + "\n".join(s.getvalue().splitlines()[4:30]), flush=True)


def hint_part():
    """Both arms forced through the policy (_policy.l2_evict_first), whatever the call's size."""
    points = [(1, 16384), (4, 8192), (1, 65536), (16, 4096), (16, 16384), (64, 8192),
              (16, 65536)]
    for (b, L) in points:
        w, n, sets = workload(b, L)
        step = B.StepTraffic(w, L2)
        check = B._subset_checker(w, *sets[0][:3])

        def time_arm(arm):
            variant, proto = arm
            with policy_value("l2_evict_first", lambda dtype, nbytes: variant == "hint"):
                plan = cd.DecodePlan(b, 32, 8, 128, L, "float16")
            assert plan.config.l2_evict_first == (variant == "hint")
            assert check(plan.run(*sets[0][:3])[0]) < 2e-3
            us = B.graph_time_cupy(lambda i: plan.run(*sets[i % n][:3]), max(10, n),
                                   before=step if proto == "step" else None, span=n)[0]
            return us, plan
        arms = [(v, p) for p in ("step", "b2b") for v in ("hint", "nohint")]
        times, _ = alternating(arms, time_arm, reps=2)
        txt = "  ".join(f"{v}/{p} {min(times[(v, p)]):7.2f}" for v, p in arms)
        print(f"hint b{b} L{L}: {txt}", flush=True)
        del sets, step
        cp.get_default_memory_pool().free_all_blocks()


def issue_part():
    """The compositions of the issue's table: 8 × [4 MB CuPy fill, attention] minus the fills,
    and back-to-back graphs of 2 calls with and without the held stream."""
    for (b, L, H, Hkv) in [(64, 8192, 32, 8), (16, 32768, 32, 8), (32, 4096, 32, 32)]:
        w, n, sets = workload(b, L, H, Hkv)
        plan = cd.DecodePlan(b, H, Hkv, 128, L, "float16")
        fill = cp.empty(1 << 20, cp.float32)
        run = lambda i: plan.run(*sets[i % n][:3])  # noqa: E731
        cells = []
        for label, kw in (("fill4MB x8", dict(n_calls=8, before=lambda i: fill.fill(i))),
                          ("b2b x2 held", dict(n_calls=2)), ("b2b x2 idle", dict(n_calls=2, hold=False)),
                          ("b2b x10", dict(n_calls=10))):
            us = B.graph_time_cupy(run, span=n, **kw)[0]
            cells.append(f"{label} {us:7.1f}")
        print(f"issue b{b} L{L} {H}/{Hkv}: " + "  ".join(cells), flush=True)
        del sets, plan
        cp.get_default_memory_pool().free_all_blocks()


def main():
    parts = sys.argv[1:] or ["heat", "pdl", "host", "hint", "issue"]
    if "issue" in parts:
        issue_part()
    if "hint" in parts:
        hint_part()
    if "host" in parts:
        host_part()
    if "pdl" in parts:
        pdl_part()
    if "heat" in parts:
        heat_part(Clocks())


if __name__ == "__main__":
    main()
