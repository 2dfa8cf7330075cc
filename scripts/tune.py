"""Block-shape exploration on the GPU: time (warps, stages) configs and split counts side by side
with torch's cuDNN and FlashAttention-2 SDPA. Development tool; results go to docs/PERFORMANCE.md.

Usage: python scripts/tune.py [--quick]
"""

import contextlib
import dataclasses
import sys

import cupy as cp

sys.path.insert(0, ".")
import cupydecode as cd  # noqa: E402
from cupydecode import _policy  # noqa: E402
from cupydecode.bench import (_subset_checker, buffer_sets_needed, graph_time_cupy,  # noqa: E402
                              measure_read_ceiling, settle, torch_sdpa_times)
from cupydecode.workloads import Workload, make_inputs  # noqa: E402

L2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"]


def workload_sets(w):
    """Enough fresh (q, k, v, None) sets of workload ``w`` to exceed 4× L2 together (≥ 2), made
    as the benchmark makes them (``plan.run(*s)`` takes a set as it is)."""
    nsets = max(2, buffer_sets_needed(w, L2))
    sets = [make_inputs(dataclasses.replace(w, seed=None)) for _ in range(nsets)]
    settle()  # the first variant timed would otherwise pay for the data generation
    return sets


def make_sets(b, L, H, Hkv, D, dtype):
    """KV bytes per call, and :func:`workload_sets` of that layout."""
    w = Workload(batch=b, seqlen=L, num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype=dtype)
    return w.kv_bytes(), workload_sets(w)


def graph_time(fn_list, reps=10, trials=15):
    """Median GPU µs per call of the calls in ``fn_list`` (rotated), by graph replay."""
    n = max(reps, len(fn_list))
    return graph_time_cupy(lambda i: fn_list[i % len(fn_list)](), n, trials)[0]


def time_plans(make_plan, sets):
    """(median GPU µs per call, first plan): one plan ``make_plan()`` per set, each running its
    set, rotated by :func:`graph_time` (a plan's workspace is never shared by two sets)."""
    plans = [make_plan() for _ in sets]
    return graph_time([lambda p=p, s=s: p.run(*s) for p, s in zip(plans, sets)]), plans[0]


def force_shape(num_warps, stages):
    """A stand-in for ``_policy.split_kernel_config`` that gives one-M-tile plans the block shape
    ``num_warps`` × ``stages`` (M-tile shapes, G > 16, and blocks of several KV heads stay the
    policy's). Assign it, then put the original back (or use :func:`forced_shape`)."""
    orig = _policy.split_kernel_config

    def config(dt, hd, chunk=0, m_tiles=1, group=None, kv_per_block=1):
        cfg = orig(dt, hd, chunk, m_tiles, group, kv_per_block)
        return (cfg if m_tiles > 1 or kv_per_block > 1
                else dataclasses.replace(cfg, num_warps=num_warps, stages=stages))

    return config


@contextlib.contextmanager
def policy_value(name, value):
    """``_policy.<name>`` is ``value`` inside the ``with`` block (plans read the policy when they
    are built); the original is put back on leaving it."""
    orig = getattr(_policy, name)
    setattr(_policy, name, value)
    try:
        yield
    finally:
        setattr(_policy, name, orig)


def forced_shape(num_warps, stages):
    """:func:`force_shape` in place of ``_policy.split_kernel_config`` inside a ``with`` block
    (plans take their config when they are built); the original is put back on leaving it."""
    return policy_value("split_kernel_config", force_shape(num_warps, stages))


def alternating(arms, time_arm, reps=2):
    """Each of ``arms`` timed ``reps`` times by ``time_arm(arm)`` -> (µs, plan), every second
    pass in reverse order: ({arm: [µs per pass]}, {arm: its last plan}), in the order of ``arms``."""
    arms = list(arms)
    times, plans = {arm: [] for arm in arms}, {}
    for rep in range(reps):
        for arm in (arms if rep % 2 == 0 else arms[::-1]):
            us, plans[arm] = time_arm(arm)
            times[arm].append(us)
    return times, plans


def main():
    quick = "--quick" in sys.argv
    ceil_gbs = measure_read_ceiling()["gbps"]
    print(f"read ceiling {ceil_gbs:.0f} GB/s", flush=True)
    H, Hkv, D, dtype = 32, 8, 128, "float16"
    for (b, L) in [(1, 16384), (1, 65536), (4, 8192), (16, 32768), (64, 8192)]:
        w = Workload(batch=b, seqlen=L, num_heads=H, num_kv_heads=Hkv, head_dim=D, dtype=dtype)
        nbytes, sets = w.kv_bytes(), workload_sets(w)
        floor = nbytes / ceil_gbs / 1e3
        row = [f"b{b:<3d} L{L:<6d} floor {floor:6.1f}us"]
        for (nw, st) in [(4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (2, 4)]:
            try:
                with forced_shape(nw, st):
                    us, plan = time_plans(lambda: cd.DecodePlan(b, H, Hkv, D, L, dtype), sets)
                row.append(f"w{nw}s{st}:{us:6.1f}({100*floor/us:3.0f}%,S{plan.num_splits})")
            except Exception as e:  # noqa: BLE001
                row.append(f"w{nw}s{st}:ERR {type(e).__name__}")
        for S in ([] if quick else [1, 2, 4, 8, 16, 32, 64]):
            us = time_plans(lambda: cd.DecodePlan(b, H, Hkv, D, L, dtype, num_splits=S), sets)[0]
            row.append(f"S{S}:{us:.1f}")
        check = _subset_checker(w, *sets[0][:3])
        for col, (us, note) in torch_sdpa_times(sets, w, D ** -0.5, max(10, len(sets)), check).items():
            row.append((f"{col}:{us:.1f}({100*floor/us:.0f}%)" if us else f"{col}:")
                       + (f" {note}" if note else ""))
        print("  ".join(row), flush=True)
        del sets


if __name__ == "__main__":
    main()
