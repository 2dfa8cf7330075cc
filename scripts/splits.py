"""Split-count sweep for one layout: GPU µs per call at forced split counts, fused merge and the
separate merge kernel, next to the automatic choice (development tool; feeds _policy's costs).

Usage: python scripts/splits.py MODEL DTYPE BxL[,BxL...] [S,S,...]
  e.g. python scripts/splits.py gemma-2b bfloat16 1x16384,1x65536 8,16,32,64,128
"""

import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode import _policy  # noqa: E402
from cupydecode.workloads import workload_for_model  # noqa: E402
from tune import make_sets, time_plans  # noqa: E402


def main():
    model, dtype = sys.argv[1], sys.argv[2]
    points = [tuple(int(x) for x in p.split("x")) for p in sys.argv[3].split(",")]
    counts = [int(s) for s in sys.argv[4].split(",")] if len(sys.argv) > 4 else [4, 8, 16, 32, 64, 128]
    w = workload_for_model(model, 1, 1, dtype)
    H, Hkv, D = w.num_heads, w.num_kv_heads, w.head_dim
    for b, L in points:
        _, sets = make_sets(b, L, H, Hkv, D, dtype)

        def timed(**kw):
            us, plan = time_plans(lambda: cd.DecodePlan(b, H, Hkv, D, L, dtype, **kw), sets)
            return us, plan.num_splits

        auto, s_auto = timed()
        cells = [f"auto(S={s_auto}) {auto:.1f}"]
        for s in counts:
            if _policy.chunk_for_splits(L, s) < _policy.MIN_CHUNK:
                continue
            cells.append(f"S{s} {timed(num_splits=s, merge='fused')[0]:.1f}"
                         f"/{timed(num_splits=s, merge='kernel')[0]:.1f}")
        print(f"{model} {dtype} b{b} L{L}: " + "  ".join(cells) + "   (fused/kernel µs)", flush=True)
        del sets


if __name__ == "__main__":
    main()
