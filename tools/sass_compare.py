"""Compare the machine code of every split-kernel specialisation with another version of the
kernels, without a GPU (development tool): the instruction count per opcode of each sm_90
specialisation here against the same specialisation built from FOLDER's files (e.g. filled with
`git show REV:kernels/decode_split.cu > FOLDER/decode_split.cu`). A refactor that leaves every
count unchanged changed register names and predicate senses at most.

--exact compares the instructions themselves, in order, registers included: a specialisation
whose machine code is identical runs as before, so a refactor that leaves the plans' builds
identical needs no new timing (one that only keeps the counts may still schedule differently).
--match K=V (repeatable) keeps the specialisations whose defines include every K=V given, e.g.
`--match HEADS_AS_N=1 --match RUNTIME_OPTIONS=0` (a quick look at some builds; the default is
all of them).

Needs NVRTC and nvdisasm (pip install nvidia-cuda-nvrtc nvidia-cuda-nvdisasm); found in the
site-packages' nvidia/*/ folders unless --nvrtc / --nvdisasm say where.

Usage: python tools/sass_compare.py FOLDER [--exact] [--match K=V]... [--arch sm_90]
                                          [--nvrtc LIB] [--nvdisasm BIN]
"""

import argparse
import collections
import ctypes
import glob
import pathlib
import re
import site
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, ".")
from cupydecode import _kernels, _policy  # noqa: E402


def _find(pattern: str) -> str | None:
    hits = sorted(h for d in site.getsitepackages() for h in glob.glob(f"{d}/nvidia/*/{pattern}"))
    return hits[-1] if hits else None


def cubin(lib: str, src: str, arch: str) -> bytes:
    nvrtc = ctypes.CDLL(lib)
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
    opts = [f"-arch={arch}".encode(), *(o.encode() for o in _kernels.COMPILE_OPTIONS)]
    if nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) != 0:
        raise RuntimeError("NVRTC failed")
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, buf)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw


def instructions(nvdisasm: str, data: bytes) -> list[str]:
    """The instructions of a cubin in order, as nvdisasm writes them, without their addresses."""
    path = pathlib.Path(tempfile.mkdtemp()) / "k.cubin"
    path.write_bytes(data)
    text = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True,
                          check=True).stdout
    lines = (re.sub(r"/\*[0-9a-f]+\*/", "", line).strip() for line in text.splitlines())
    return [line for line in lines if line.endswith(";")]


def opcodes(listing: list[str]) -> collections.Counter:
    counts = collections.Counter()
    for line in listing:
        m = re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            counts[m.group(1).split(".")[0]] += 1
    return counts


def compare(job):
    """(label, old count, new count, per-opcode delta, identical) of one specialisation; old
    count None where FOLDER's kernels do not build it (a specialisation this version added)."""
    defines, folder, lib, nvdisasm, arch = job
    label = " ".join(f"{k}={v}" for k, v in sorted(defines.items()))
    new = instructions(nvdisasm, cubin(lib, _kernels.program_source("decode_split.cu", defines),
                                       arch))
    try:
        with _kernels.kernel_sources(folder):
            old = instructions(nvdisasm, cubin(
                lib, _kernels.program_source("decode_split.cu", defines), arch))
    except RuntimeError:  # NVRTC failed: FOLDER's kernels have no such build
        return label, None, len(new), {}, False
    old_ops, new_ops = opcodes(old), opcodes(new)
    delta = {k: new_ops[k] - old_ops[k] for k in set(old_ops) | set(new_ops)
             if new_ops[k] != old_ops[k]}
    return label, len(old), len(new), delta, old == new


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--exact", action="store_true",
                    help="compare the instructions in order, registers included")
    ap.add_argument("--match", action="append", default=[], metavar="K=V",
                    help="only specialisations whose defines include K=V (repeatable)")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--nvrtc", default=_find("lib/libnvrtc.so.*[0-9]"))
    ap.add_argument("--nvdisasm", default=_find("bin/nvdisasm"))
    a = ap.parse_args()
    if not a.nvrtc or not a.nvdisasm:
        sys.exit("NVRTC or nvdisasm not found: pip install nvidia-cuda-nvrtc nvidia-cuda-nvdisasm")
    if any("=" not in m for m in a.match):
        ap.error(f"--match takes K=V, got {a.match}")
    wanted = dict(m.split("=", 1) for m in a.match)
    builds = [c.defines() for c in _policy.compile_check_configs()]
    jobs = [(d, a.folder, a.nvrtc, a.nvdisasm, a.arch) for d in builds
            if all(str(d.get(k, "")) == v for k, v in wanted.items())]
    if not jobs:
        sys.exit(f"no specialisation matches {a.match}")
    with ProcessPoolExecutor() as ex:
        rows = list(ex.map(compare, jobs))
    added = [r for r in rows if r[1] is None]
    if a.exact:
        changed = [r for r in rows if r[1] is not None and not r[4]]
        kind = "identical machine code"
    else:
        changed = [r for r in rows if r[3]]
        kind = "the same instruction count per opcode"
    print(f"{len(rows)} specialisations ({a.arch}): {len(rows) - len(changed) - len(added)} with "
          f"{kind}" + (f", {len(added)} that {a.folder}'s kernels do not build" if added else ""))
    for label, before, after, delta, _ in changed:
        print(f"  {label}: {before} -> {after} instructions, {delta}")
    for label, _, after, _, _ in added:
        print(f"  {label}: new ({after} instructions)")


if __name__ == "__main__":
    main()
