"""Launch one decode shape a few times (for ncu), or time the fused merge against the separate
merge kernel, with a forced block shape.

Usage: python scripts/profile_one.py BATCH SEQLEN WARPS STAGES [ncu]
"""
import sys

import cupy as cp

sys.path.insert(0, ".")
import cupydecode as cd  # noqa: E402
from cupydecode import _policy  # noqa: E402
sys.path.insert(0, "scripts")
from tune import force_shape, make_sets, time_plans  # noqa: E402

b, L = int(sys.argv[1]), int(sys.argv[2])
nw, st = int(sys.argv[3]), int(sys.argv[4])
mode = sys.argv[5] if len(sys.argv) > 5 else "time"
_policy.split_kernel_config = force_shape(nw, st)
H, Hkv, D = 32, 8, 128
nbytes, sets = make_sets(b, L, H, Hkv, D, "float16")
if mode == "ncu":
    for p, s in zip([cd.DecodePlan(b, H, Hkv, D, L, "float16") for _ in sets], sets):
        p.run(*s)
    cp.cuda.Device().synchronize()
    sys.exit(0)
res = {}
splits = cd.DecodePlan(b, H, Hkv, D, L, "float16").num_splits  # the same split count for both
for merge in ("fused", "kernel"):
    res[merge] = time_plans(
        lambda: cd.DecodePlan(b, H, Hkv, D, L, "float16", num_splits=splits, merge=merge), sets)[0]
print(f"b{b} L{L} w{nw}s{st} S={splits}: fused {res['fused']:.1f} us, two kernels "
      f"{res['kernel']:.1f} us, floor {nbytes/4.55e6:.1f} us", flush=True)
