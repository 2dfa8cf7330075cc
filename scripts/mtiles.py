"""M-tile shapes for G > 16 query heads per KV head (development tool): GPU µs per call of one
layout with the shipped shape, other (slots, stages) shapes, and one M-tile per block (the
layout's head tiles then each stream the chunk, as before M-tiles); graph replay, rotated sets.

Usage: python scripts/mtiles.py MODEL|H/HKV/D DTYPE BxL[,BxL...] [SLOTSxSTAGES,...] [--splits S,S,...]
  e.g. python scripts/mtiles.py falcon-7b float16 1x16384,16x16384 1x8,3x6 --splits 16,64
  (--splits: also each forced split count, for every shape)
  --dir LABEL=PATH: also time the shipped shape with the kernel files PATH holds (others shipped)
"""

import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode import _kernels, _policy  # noqa: E402
from cupydecode import decode as _decode  # noqa: E402
from cupydecode.workloads import MODELS  # noqa: E402
from tune import make_sets, time_plans  # noqa: E402


def main():
    spec, dtype = sys.argv[1], sys.argv[2]
    if spec in MODELS:
        H, Hkv, D = MODELS[spec].num_heads, MODELS[spec].num_kv_heads, MODELS[spec].head_dim
    else:
        H, Hkv, D = (int(x) for x in spec.split("/"))
    points = [tuple(int(x) for x in p.split("x")) for p in sys.argv[3].split(",")]
    args = sys.argv[4:]
    dirs = []
    while "--dir" in args:
        k = args.index("--dir")
        dirs.append(tuple(args[k + 1].split("=", 1)))
        del args[k:k + 2]
    forced = []
    if "--splits" in args:
        forced = [int(x) for x in args[args.index("--splits") + 1].split(",")]
        del args[args.index("--splits"):args.index("--splits") + 2]
    shapes = [tuple(int(x) for x in s.split("x")) for s in args[0].split(",")] if args else []
    shipped, m_tiles = _policy.MTILE_SHAPES[D], _policy.m_tiles
    variants = [("shipped", None)] + [(f"{a} slots x {b} stages", (a, b)) for a, b in shapes]
    variants.append(("one M-tile per block", "one"))
    variants += [(label, ("dir", path)) for label, path in dirs]
    shipped_source = _kernels.program_source
    data = {p: make_sets(*p, H, Hkv, D, dtype) for p in points}
    print(f"{spec} ({H}/{Hkv}/{D}) {dtype}: cells = us (splits, merge, m_tiles x head_tiles)")
    for label, v in variants:
        _policy.MTILE_SHAPES[D], _policy.m_tiles = shipped, m_tiles
        _kernels.program_source, _kernels._compiled = shipped_source, {}
        if isinstance(v, tuple) and v[0] == "dir":  # the files PATH has, the shipped ones else
            _kernels.program_source = (
                lambda filename, defines, path=v[1]: shipped_source(filename, defines, path))
        elif v == "one":
            _policy.m_tiles = lambda *a: 1
        elif v is not None:
            _policy.MTILE_SHAPES[D] = (v[0], shipped[1], v[1])
        _decode._blocks_per_sm.cache_clear()
        cells = []
        for (b, L), (_, sets) in data.items():
            for split in [None] + forced:
                us, p = time_plans(lambda: cd.DecodePlan(b, H, Hkv, D, L, dtype, num_splits=split),
                                   sets)
                cells.append(f"b{b}x{L // 1024}k{'' if split is None else ' S' + str(split)} "
                             f"{us:.2f}" + ("" if split else f" ({p.num_splits}, {p.merge}, "
                                                          f"{p.m_tiles}x{p.head_tiles})"))
        print(f"{label:22s} " + "  ".join(cells), flush=True)
    _policy.MTILE_SHAPES[D], _policy.m_tiles = shipped, m_tiles
    _kernels.program_source = shipped_source


if __name__ == "__main__":
    main()
