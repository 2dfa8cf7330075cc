"""A/B timing of kernel shapes and kernel versions side by side, in one process, on the same
buffers, in the decode-step protocol (the bench's): each arm is a DecodePlan built with a
``cupydecode.Tuning`` (block-shape overrides) and/or from another folder of kernel sources; the
arms are timed in turn, every second pass in reverse order, and each arm's output is checked
against float64 before it is timed.

Usage:
  python tools/ab.py [--points 1x16384,1x65536,16x8192,16x65536] [--layout 32/8/128]
                     [--dtype float16]
                     [--protocol step|back-to-back] [--passes 2]
                     [--kv-dtype e4m3|e5m2] [--kv-scale tensor|head|token]
                     [--arm LABEL=FIELD=VALUE,...]... [--kernels LABEL=FOLDER]...
                     [--tree LABEL=FOLDER]... [--sub 'LABEL|OLD|NEW[|OLD|NEW]...']...
  --arm 'w8s2=num_warps=8,stages=2'   a plan with those Tuning fields (num_warps, stages,
                                      l2_evict_first, warps_in_step, kv_groups; true/false for
                                      the flags), and num_splits (the plan's split count)
  --kernels 'prev=/tmp/prev'          the kernels of a folder (files it lacks: the shipped
                                      ones), e.g. filled with `git show REV:kernels/FILE`
  --tree 'v0=/tmp/v0'                 the DecodePlan of another version, library and kernels:
                                      a folder holding its cupydecode/ and kernels/ (e.g.
                                      `git archive REV cupydecode kernels | tar -x -C /tmp/v0`),
                                      imported under a name of its own, with its own policy
  --sub 'nohint|L2::evict_first|L2::evict_normal'
                                      the shipped decode_split.cu with OLD replaced by NEW
                                      (every occurrence; several OLD|NEW pairs in turn)
  --kv-dtype e4m3 --kv-scale token   an fp8 cache (workloads.quantize_inputs: scales of that
                                      mode), every arm over the same codes and scales
The first arm is always the shipped kernels with the policy's shape ("policy"); the table gives
each arm's median GPU µs per call and its ratio to the first.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupydecode as cd  # noqa: E402
from cupydecode import _kernels  # noqa: E402
from cupydecode.bench import (StepTraffic, _subset_checker, buffer_sets_needed,  # noqa: E402
                              graph_time_cupy, settle)
from cupydecode.check import REL_TOL  # noqa: E402
from cupydecode.workloads import Workload, fresh_seed, make_inputs, quantize_inputs  # noqa: E402

TUNING_FIELDS = {f.name: f.type for f in dataclasses.fields(cd.Tuning)}
PLAN_FIELDS = ("num_splits",)  # arm fields that are DecodePlan arguments, not Tuning's


def buffer_sets(w: Workload) -> list:
    """Fresh (q, k, v, scales) sets of workload ``w``, enough that together they exceed 4x L2
    (at least 2): each call of a rotation reads a cache the calls before it did not. An fp8
    workload's k and v are its codes and ``scales`` their {k_scale, v_scale}; otherwise {}."""
    import cupy

    l2 = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"]
    sets = []
    for _ in range(max(2, buffer_sets_needed(w, l2))):
        wi = dataclasses.replace(w, seed=fresh_seed())
        q, k, v = make_inputs(wi)[:3]
        scales = {}
        if w.kv_dtype:
            k, v, ks, vs = quantize_inputs(wi, k, v)
            scales = {"k_scale": ks, "v_scale": vs}
        sets.append((q, k, v, scales))
    return sets


def parse_arm(text: str) -> tuple[cd.Tuning, dict]:
    """'num_warps=8,stages=2,num_splits=8' → (Tuning(num_warps=8, stages=2), {"num_splits": 8})."""
    values, plan = {}, {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name in PLAN_FIELDS:
            plan[name] = int(value)
            continue
        if name not in TUNING_FIELDS:
            raise SystemExit(f"--arm: unknown field {name!r} (fields: "
                             f"{', '.join([*TUNING_FIELDS, *PLAN_FIELDS])})")
        if value.lower() in ("true", "false"):
            values[name] = value.lower() == "true"
        else:
            values[name] = int(value)
    return cd.Tuning(**values), plan


def describe(plan) -> str:
    """A plan's shape in a few words (attributes every version's DecodePlan has)."""
    c = plan.config
    return (f"{plan.num_splits} splits of {plan.chunk_tokens}, {plan.merge} merge, "
            f"{c.num_warps}w{c.stages}s, m_tiles {plan.m_tiles}, kv/block {plan.kv_per_block}, "
            f"L2 hint {int(getattr(c, 'l2_evict_first', True))}")


def package_of(folder: str, label: str):
    """The cupydecode package of another version in ``folder`` (its cupydecode/ beside its
    kernels/), imported as a package of its own name so that both versions run in one process."""
    root = Path(folder).resolve() / "cupydecode"
    name = f"cupydecode_{label}".replace("-", "_")
    if not (root / "__init__.py").is_file():
        raise SystemExit(f"--tree: no cupydecode package in {folder}")
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def parse_sub(spec: str) -> list[tuple[str, str]]:
    """'LABEL|OLD|NEW[|OLD|NEW]...' → [(OLD, NEW), ...]"""
    parts = spec.split("|")[1:]
    if not parts or len(parts) % 2:
        raise SystemExit(f"--sub: expected 'LABEL|OLD|NEW[|OLD|NEW]...', got {spec!r}")
    return list(zip(parts[::2], parts[1::2]))


@contextlib.contextmanager
def kernels_of(folder: str | None, subs: list[tuple[str, str]] | None):
    """Plans built inside use the kernels of ``folder``, or the shipped decode_split.cu with
    the substitutions ``subs`` ((OLD, NEW), ...) applied in turn."""
    with contextlib.ExitStack() as stack:
        if folder is not None:
            stack.enter_context(_kernels.kernel_sources(folder))
        elif subs is not None:
            src = (_kernels.kernel_dir() / "decode_split.cu").read_text()
            for old, new in subs:
                if old not in src:
                    raise SystemExit(f"--sub: {old!r} is not in kernels/decode_split.cu")
                src = src.replace(old, new)
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            (tmp / "decode_split.cu").write_text(src)
            stack.enter_context(_kernels.kernel_sources(tmp))
        yield


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="1x16384,1x65536,16x8192,16x65536")
    ap.add_argument("--layout", default="32/8/128", help="num_heads/num_kv_heads/head_dim")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--protocol", default="step", choices=("step", "back-to-back"))
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--arm", action="append", default=[])
    ap.add_argument("--kernels", action="append", default=[])
    ap.add_argument("--tree", action="append", default=[])
    ap.add_argument("--sub", action="append", default=[])
    ap.add_argument("--kv-dtype", choices=("e4m3", "e5m2"), default=None)
    ap.add_argument("--kv-scale", choices=("tensor", "head", "token"), default="tensor")
    args = ap.parse_args(argv)

    # (label, Tuning, DecodePlan arguments, kernel folder, substitution, DecodePlan class)
    arms = [("policy", None, {}, None, None, cd.DecodePlan)]
    arms += [(a.partition("=")[0], *parse_arm(a.partition("=")[2]), None, None, cd.DecodePlan)
             for a in args.arm]
    arms += [(k.partition("=")[0], None, {}, k.partition("=")[2], None, cd.DecodePlan)
             for k in args.kernels]
    arms += [(t.partition("=")[0], None, {}, None, None,
              package_of(t.partition("=")[2], t.partition("=")[0]).DecodePlan)
             for t in args.tree]
    arms += [(s.split("|")[0], None, {}, None, parse_sub(s), cd.DecodePlan) for s in args.sub]
    labels = [label for label, *_ in arms]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"arm labels must differ (the first is 'policy'), got {labels}")
    heads, kv_heads, dim = (int(x) for x in args.layout.split("/"))
    import cupy

    l2 = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"]
    print(f"{'point':>12s}" + "".join(f"  {label:>14s}" for label, *_ in arms), flush=True)
    for point in args.points.split(","):
        batch, seqlen = (int(x) for x in point.split("x"))
        w = Workload(batch=batch, seqlen=seqlen, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=dim, dtype=args.dtype, kv_dtype=args.kv_dtype,
                     kv_scale=args.kv_scale)
        sets = buffer_sets(w)
        check = _subset_checker(w, *sets[0][:3], scales=sets[0][3])
        before = StepTraffic(w, l2) if args.protocol == "step" else None
        n_calls = max(10, len(sets))
        times = {label: [] for label, *_ in arms}
        plans = {}
        for label, tuning, plan_args, folder, subs, plan_class in arms:  # build, check each
            if plan_class is not cd.DecodePlan:  # another version: its own arguments only
                plan_args = dict(plan_args, **({"kv_dtype": args.kv_dtype} if args.kv_dtype
                                               else {}))
            else:
                plan_args = dict(plan_args, kv_dtype=args.kv_dtype, tuning=tuning)
            try:
                with kernels_of(folder, subs):
                    made = [plan_class(batch, heads, kv_heads, dim, seqlen, args.dtype,
                                       **plan_args) for _ in sets]  # a workspace per set
            except (TypeError, ValueError, RuntimeError) as e:  # a shape the kernel or the GPU
                # cannot take, or an arm's kernels that do not build (e.g. a --sub that changes
                # the shared-memory layout the host sizes: SMEM_BYTES_HOST)
                print(f"  {label} at {point}: refused ({e})", flush=True)
                continue
            made[0].run(*sets[0][:3], **sets[0][3])
            err = check(made[0].out)
            if not err <= REL_TOL[args.dtype]:
                raise SystemExit(f"{label} at {point}: relative error {err:.2e} against float64")
            plans[label] = made
        settle()
        for rep in range(args.passes):
            for label in (list(plans) if rep % 2 == 0 else list(plans)[::-1]):
                made = plans[label]

                def call(i, made=made, sets=sets):
                    q, k, v, scales = sets[i % len(sets)]
                    made[i % len(sets)].run(q, k, v, **scales)
                times[label].append(graph_time_cupy(call, n_calls, before=before,
                                                    span=len(sets))[0])
        first = statistics.median(times[arms[0][0]])
        cells = []
        for label, *_ in arms:
            if label not in plans:
                cells.append("refused")
                continue
            us = statistics.median(times[label])
            cells.append(f"{us:8.2f} x{us / first:.3f}")
        print(f"{point:>12s}" + "".join(f"  {c:>14s}" for c in cells), flush=True)
        for label, made in plans.items():  # what each arm ran (its plan: policy or kernel?)
            print(f"{'':>14s}{label}: {describe(made[0])}", flush=True)
        del sets, plans, before
        cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
