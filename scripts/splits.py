"""Split-count sweep for one layout: GPU µs per call at forced split counts, fused merge and the
separate merge kernel, next to the automatic choice (development tool; feeds _policy's costs).

Usage: python scripts/splits.py MODEL DTYPE BxL[,BxL...] [S,S,...]
  e.g. python scripts/splits.py gemma-2b bfloat16 1x16384,1x65536 8,16,32,64,128
"""

import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode.workloads import MODELS  # noqa: E402
from tune import graph_time, make_sets  # noqa: E402


def main():
    model, dtype = sys.argv[1], sys.argv[2]
    points = [tuple(int(x) for x in p.split("x")) for p in sys.argv[3].split(",")]
    counts = [int(s) for s in sys.argv[4].split(",")] if len(sys.argv) > 4 else [4, 8, 16, 32, 64, 128]
    p = MODELS[model]
    H, Hkv, D = p.num_heads, p.num_kv_heads, p.head_dim
    for b, L in points:
        _, sets = make_sets(b, L, H, Hkv, D, dtype)

        def timed(**kw):
            plans = [cd.DecodePlan(b, H, Hkv, D, L, dtype, **kw) for _ in sets]
            us = graph_time([lambda q=q, s=s: q.run(*s) for q, s in zip(plans, sets)])
            return us, plans[0].num_splits

        auto, s_auto = timed()
        cells = [f"auto(S={s_auto}) {auto:.1f}"]
        for s in counts:
            if -(-L // s) < 64:
                continue
            cells.append(f"S{s} {timed(num_splits=s, merge='fused')[0]:.1f}"
                         f"/{timed(num_splits=s, merge='kernel')[0]:.1f}")
        print(f"{model} {dtype} b{b} L{L}: " + "  ".join(cells) + "   (fused/kernel µs)", flush=True)
        del sets


if __name__ == "__main__":
    main()
