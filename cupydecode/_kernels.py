"""Kernel sources, compilation and the one launch function.

Every CUDA kernel of the package lives in a ``.cu`` file under ``kernels/``. This module
reads a file, resolves its local ``#include "x.cuh"`` lines textually, prepends the
compile-time constants of one specialisation, and builds a ``cupy.RawModule`` from it once per
process. Because the headers are inlined, the source CuPy hashes for its on-disk cache is the
complete program: an edited header can never be served from a stale cubin.

``launch`` is the single place where kernels are started: it owns grid, block and dynamic shared
memory, and refuses Python ints as kernel arguments (CuPy passes those as 64-bit values, which
silently corrupts an ``int`` parameter).
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

import numpy as np

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)

# Compile options common to every kernel. No fast-math: the kernels pick their approximate
# instructions (ex2.approx) explicitly and keep IEEE division and log2 elsewhere.
COMPILE_OPTIONS = ("-std=c++17",)


def kernel_dir() -> Path:
    """Where the .cu files are: inside the installed package, or ``kernels/`` of a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / "decode_split.cu").is_file():
            return candidate
    raise FileNotFoundError(
        f"cupydecode kernel sources not found (looked in {here / 'kernels'} and {here.parent / 'kernels'})"
    )


def _inline(path: Path, seen: set[Path]) -> str:
    text = path.read_text()

    def repl(match: re.Match) -> str:
        inc = (path.parent / match.group(1)).resolve()
        if inc in seen:
            return ""  # #pragma once semantics
        seen.add(inc)
        return f"// ---- begin {match.group(1)}\n{_inline(inc, seen)}\n// ---- end {match.group(1)}"

    return _INCLUDE.sub(repl, text)


def program_source(filename: str, defines: dict[str, int]) -> str:
    """The complete source of one specialisation: defines, then the file with headers inlined."""
    path = kernel_dir() / filename
    head = "".join(f"#define {k} {int(v)}\n" for k, v in sorted(defines.items()))
    return head + _inline(path, {path.resolve()})


def source_digest(filename: str, defines: dict[str, int]) -> str:
    return hashlib.sha256(program_source(filename, defines).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _module(source: str, options: tuple[str, ...]):
    import cupy

    return cupy.RawModule(code=source, options=options)


_compiled: dict[tuple, object] = {}


def get_function(filename: str, name: str, defines: dict[str, int]):
    """The compiled kernel ``name`` of one specialisation (compiled lazily, cached).

    The cache key holds the source text itself (through ``_module``'s argument), so a file
    edited while the process runs is recompiled rather than served stale.
    """
    key = (filename, name, tuple(sorted(defines.items())))
    fn = _compiled.get(key)
    if fn is None:
        fn = _module(program_source(filename, defines), COMPILE_OPTIONS).get_function(name)
        _compiled[key] = fn
    return fn


def compiled_specialisations() -> list[str]:
    """Human-readable list of the specialisations compiled in this process."""
    return [f"{f}:{n} " + " ".join(f"{k}={v}" for k, v in d) for (f, n, d) in _compiled]


def compile_for_arch(filename: str, defines: dict[str, int], arch: str) -> bytes:
    """Compile one specialisation with NVRTC for ``arch`` (e.g. "sm_90") without any GPU.

    Used by the tests to prove every kernel builds on a machine that has only NVRTC.
    Raises RuntimeError with the compiler log on failure.
    """
    from cupy_backends.cuda.libs import nvrtc

    src = program_source(filename, defines)
    prog = nvrtc.createProgram(src, filename, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", *COMPILE_OPTIONS])
        except Exception as exc:  # nvrtc.NVRTCError carries no log
            raise RuntimeError(f"NVRTC failed for {filename} {defines} ({arch}):\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)


_SCALAR_TYPES = (np.int32, np.int64, np.uint32, np.uint64, np.float32, np.float64)
_ARG_TYPES: frozenset = frozenset()


def launch(fn, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple,
           shared_mem: int = 0) -> None:
    """Start ``fn`` on the current CuPy stream.

    Scalars must already be explicit NumPy scalars matching the kernel's parameter types;
    pointers are CuPy arrays or ``np.uint64(0)`` for a null pointer; a struct passed by value is
    a one-element structured NumPy array (the split kernel takes all its parameters so).
    """
    global _ARG_TYPES
    if not _ARG_TYPES:
        import cupy

        _ARG_TYPES = frozenset((cupy.ndarray, *_SCALAR_TYPES))
    for i, a in enumerate(args):
        if type(a) not in _ARG_TYPES and not _is_param_struct(a):
            # exact types: bool and Python int are refused
            raise TypeError(f"kernel argument {i} must be a cupy.ndarray, an explicit NumPy "
                            f"scalar or a one-element structured NumPy array (a struct passed by "
                            f"value), got {type(a).__name__}")
    allow_shared_memory(fn, shared_mem)
    fn(grid, block, args, shared_mem=shared_mem)


def _is_param_struct(a) -> bool:
    return type(a) is np.ndarray and a.shape == (1,) and a.dtype.names is not None


_smem_opted_in: set[tuple[int, int, int]] = set()


def allow_shared_memory(fn, shared_mem: int) -> None:
    """Opt ``fn`` in to ``shared_mem`` bytes of dynamic shared memory (needed above 48 KB)."""
    if shared_mem <= 48 * 1024:
        return
    import cupy

    # per device: CuPy keeps one function per device and sets the attribute on the current one
    key = (id(fn), shared_mem, cupy.cuda.runtime.getDevice())
    if key not in _smem_opted_in:
        fn.max_dynamic_shared_size_bytes = shared_mem
        _smem_opted_in.add(key)
