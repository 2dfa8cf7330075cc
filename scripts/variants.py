"""Time source and block-shape variants of the split kernel side by side (development tool).

Each variant is a text substitution on a copy of kernels/decode_split.cu, a block shape
(warps, stages), or a whole other version of kernels/ (any .prev*/ folder holding
decode_split.cu, e.g. filled with `git show REV:kernels/FILE`; a file it lacks is the shipped
one); the shipped source is untouched.
GPU µs per call by graph replay over buffer sets larger than 4× L2, fp16 32/8/128, automatic
splits; then (unless --kernels-only) partials without the merge and fixed split counts.

Usage: python scripts/variants.py [BxL,BxL,...] [--shapes WxS,...] [--head-dim D] [--kernels-only]
  --shapes 8x3,4x6   also time those block shapes (warps x stages) in place of the policy's
  --sub 'LABEL|OLD|NEW'   also time the shipped source with OLD replaced by NEW (repeatable)
  --dir LABEL=PATH   also time the kernels of folder PATH (as a .prev*/ folder; repeatable)
  --cross            also time every --sub variant with every --shapes shape
"""

import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode import _kernels  # noqa: E402
from cupydecode import decode as _decode  # noqa: E402
from tune import forced_shape, make_sets, time_plans  # noqa: E402

VARIANTS = {"base": ({}, None)}
# Previous versions of the kernels put in .prev*/ (e.g. from git), for A/B in the same process.
for PREV in sorted(Path(".").glob(".prev*")):
    if (PREV / "decode_split.cu").is_file():
        VARIANTS[f"kernels in {PREV}/"] = ({"@dir": str(PREV.resolve())}, None)


@contextlib.contextmanager
def use(subs, shape):
    """Plans built inside use the variant: a folder of kernel files (``@dir``), text
    substitutions on the shipped decode_split.cu, and/or a forced block shape."""
    with contextlib.ExitStack() as stack:
        if "@dir" in subs:
            stack.enter_context(_kernels.kernel_sources(subs["@dir"]))
        elif subs:
            src = (_kernels.kernel_dir() / "decode_split.cu").read_text()
            for old, new in subs.items():
                assert old in src, old
                src = src.replace(old, new)
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory()))
            (folder / "decode_split.cu").write_text(src)
            stack.enter_context(_kernels.kernel_sources(folder))
        if shape is not None:
            stack.enter_context(forced_shape(*shape))
        _decode._blocks_per_sm.cache_clear()
        yield


POINTS = [(1, 1024), (1, 4096), (1, 16384), (1, 65536), (4, 8192), (16, 8192)]
if len(sys.argv) > 1 and not sys.argv[1].startswith("--"):  # e.g. 16x1024,16x4096
    POINTS = [tuple(int(x) for x in p.split("x")) for p in sys.argv[1].split(",")]
if "--shapes" in sys.argv:  # e.g. 8x3,4x6
    for ws in sys.argv[sys.argv.index("--shapes") + 1].split(","):
        w, st = (int(x) for x in ws.split("x"))
        VARIANTS[f"{w} warps x {st} stages"] = ({}, (w, st))
for k, arg in enumerate(sys.argv):
    if arg == "--dir":  # e.g. 'k then v=variant_kv' (a plain folder travels where .prev* may not)
        label, path = sys.argv[k + 1].split("=", 1)
        VARIANTS[label] = ({"@dir": str(Path(path).resolve())}, None)
    if arg == "--sub":  # e.g. 'evict normal|L2::evict_first.b64|L2::evict_normal.b64'
        label, old, new = sys.argv[k + 1].split("|")
        VARIANTS[label] = ({old: new}, None)
if "--cross" in sys.argv:  # each substitution in each forced shape too
    for label, (subs, shape) in list(VARIANTS.items()):
        if shape is None and subs and "@dir" not in subs:
            for other, (osubs, oshape) in list(VARIANTS.items()):
                if oshape is not None and not osubs:
                    VARIANTS[f"{label}, {oshape[0]}x{oshape[1]}"] = (subs, oshape)


def main():
    H, Hkv, D = 32, 8, 128
    if "--head-dim" in sys.argv:  # e.g. 64
        D = int(sys.argv[sys.argv.index("--head-dim") + 1])
    data = {p: make_sets(*p, H, Hkv, D, "float16") for p in POINTS}

    def row(label, make_plan, skip=lambda L: False):
        """One line: GPU µs per call at every point, plans from make_plan(b, L)."""
        cells = []
        for (b, L), (_, sets) in data.items():
            if skip(L):
                cells.append(float("nan"))
                continue
            cells.append(time_plans(lambda: make_plan(b, L), sets)[0])
        print(f"{label:24s}" + "".join(f"  {c:7.2f}" for c in cells), flush=True)

    def partials_only(b, L):  # the split kernel writing partials, no merge at all
        splits = cd.DecodePlan(b, H, Hkv, D, L, "float16").num_splits  # as the base row
        p = cd.DecodePlan(b, H, Hkv, D, L, "float16", num_splits=splits, merge="kernel")
        p._merge_call = None
        return p

    print(f"{'variant':24s}" + "".join(f"  b{b}x{L // 1024}k" for b, L in POINTS), flush=True)
    for name, (subs, shape) in VARIANTS.items():
        with use(subs, shape):
            row(name, lambda b, L: cd.DecodePlan(b, H, Hkv, D, L, "float16"))
    if "--kernels-only" in sys.argv:
        return
    row("partials only", partials_only)
    for splits in (4, 16):
        row(f"splits {splits}", lambda b, L, s=splits: cd.DecodePlan(b, H, Hkv, D, L, "float16", num_splits=s),
            skip=lambda L, s=splits: L // s < 64)


if __name__ == "__main__":
    main()
