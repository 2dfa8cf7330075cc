"""Kernel sources, compilation and the one launch function.

Every CUDA kernel of the package lives in a ``.cu`` file under ``kernels/``. This module
reads a file, resolves its local ``#include "x.cuh"`` lines textually, prepends the
compile-time constants of one specialisation, and builds a ``cupy.RawModule`` from it once per
process. Because the headers are inlined, the source CuPy hashes for its on-disk cache is the
complete program: an edited header can never be served from a stale cubin.

Kernels are started in one of two places: ``launch`` (CuPy's generic path; refuses Python ints
as kernel arguments, which CuPy passes as 64-bit values and which would silently corrupt an
``int`` parameter) and ``StructLaunch`` (a plan's hot path: the parameters are packed into a
prepared buffer and handed to ``cuLaunchKernel`` directly).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import re
import threading
from pathlib import Path

import numpy as np

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)

# Compile options common to every kernel. No fast-math: the kernels pick their approximate
# instructions (ex2.approx) explicitly and keep IEEE division and log2 elsewhere.
COMPILE_OPTIONS = ("-std=c++17",)


# What a user without CuPy or without a GPU is told (the CLI's checks and DecodePlan use these).
INSTALL_HINT = ('install cupydecode with the CUDA extra that matches the driver: '
                'pip install "cupydecode[cuda12]" (CUDA 12 driver) or "cupydecode[cuda13]" '
                '(from a checkout: pip install ".[cuda12]")')


def import_cupy():
    """``import cupy`` for the public entry points, with the install command if it fails."""
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(f"cupydecode needs CuPy to run on the GPU: {INSTALL_HINT}") from exc
    return cupy


@functools.lru_cache(maxsize=None)
def _driver_library():
    """The CUDA driver library (ctypes), or None where it cannot be loaded (no NVIDIA driver)."""
    import sys

    try:
        return ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
    except OSError:
        return None


def _driver_loadable() -> bool:
    return _driver_library() is not None


def gpu_problem() -> str | None:
    """None where CuPy can run kernels on a GPU, else what is missing, in plain words, with the
    fix: CuPy not installed, no NVIDIA driver, a driver older than CuPy's CUDA, no device."""
    try:
        import cupy
    except Exception as exc:
        return f"CuPy is not importable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        if not _driver_loadable():
            return ("no NVIDIA driver found (the CUDA driver library libcuda cannot be loaded): "
                    "cupydecode needs an NVIDIA GPU and its driver")
        text = f"{type(exc).__name__}: {exc}"
        if "InsufficientDriver" in text or "insufficient" in text.lower():
            return (f"the NVIDIA driver is older than the CUDA runtime CuPy was built for ({text});"
                    f" update the driver, or {INSTALL_HINT.replace('install', 'reinstall', 1)}"
                    " for the driver's CUDA version")
        if "NoDevice" in text:
            return "the NVIDIA driver reports no CUDA GPU"
        return f"CUDA found no usable GPU ({text})"
    if n < 1:
        return "the NVIDIA driver reports no CUDA GPU"
    return None


def kernel_dir() -> Path:
    """Where the .cu files are: inside the installed package, or ``kernels/`` of a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "kernels", here.parent / "kernels"):
        if (candidate / "decode_split.cu").is_file():
            return candidate
    raise FileNotFoundError(
        f"cupydecode kernel sources not found (looked in {here / 'kernels'} and {here.parent / 'kernels'})"
    )


def _find(name: str, directories: tuple[Path, ...]) -> Path:
    """The first of ``directories`` that holds the file ``name`` (the last one if none does)."""
    return next((d / name for d in directories if (d / name).is_file()), directories[-1] / name)


def _inline(path: Path, seen: set[Path], directories: tuple[Path, ...]) -> str:
    text = path.read_text()

    def repl(match: re.Match) -> str:
        inc = _find(match.group(1), directories).resolve()
        if inc in seen:
            return ""  # #pragma once semantics
        seen.add(inc)
        return (f"// ---- begin {match.group(1)}\n{_inline(inc, seen, directories)}\n"
                f"// ---- end {match.group(1)}")

    return _INCLUDE.sub(repl, text)


# Folders whose files replace the shipped ones while :func:`kernel_sources` is active.
_SOURCE_DIRS: tuple[Path, ...] = ()


@contextlib.contextmanager
def kernel_sources(folder: Path | str):
    """A/B of kernel variants: inside the ``with`` block, every kernel is built from the files
    ``folder`` holds (the others stay the shipped ones). Plans built inside keep the kernels they
    were built with after the block ends."""
    with source_dirs((Path(folder).resolve(), *_SOURCE_DIRS)):
        yield


@contextlib.contextmanager
def source_dirs(dirs: tuple[Path, ...]):
    """Inside the ``with`` block, kernels are built from ``dirs`` (a value of ``_SOURCE_DIRS``,
    e.g. the one a plan was built under) before the shipped folder."""
    global _SOURCE_DIRS
    previous = _SOURCE_DIRS
    _SOURCE_DIRS = tuple(dirs)
    try:
        yield
    finally:
        _SOURCE_DIRS = previous


def program_source(filename: str, defines: dict[str, int], folder: Path | str | None = None) -> str:
    """The complete source of one specialisation: defines, then the file with headers inlined.

    With ``folder`` (for A/B of kernel variants), each file of the program that ``folder`` holds
    is read from there, the others from :func:`kernel_dir` (and :func:`kernel_sources`' folders).
    """
    directories = (*([Path(folder)] if folder is not None else []), *_SOURCE_DIRS, kernel_dir())
    path = _find(filename, directories)
    head = "".join(f"#define {k} {int(v)}\n" for k, v in sorted(defines.items()))
    return head + _inline(path, {path.resolve()}, directories)


_PARAM_ENTRY = re.compile(r"\bX\(\s*(PTR|I64|I32|F32)\s*,\s*[^,()]+?\s*,\s*(\w+)\s*\)")


def param_list(filename: str, macro: str) -> tuple[tuple[str, str], ...]:
    """The (kind, name) entries of the parameter list ``macro`` in kernels/``filename`` (an
    X-macro of ``X(kind, C type, name)`` entries; kernels/decode_params.cuh), in order; from a
    :func:`kernel_sources` folder where one holds the file."""
    text = _find(filename, (*_SOURCE_DIRS, kernel_dir())).read_text()
    start = text.index(f"#define {macro}(X)")
    lines = []
    for line in text[start:].splitlines():
        lines.append(re.sub(r"/\*.*?\*/", "", line))
        if not line.rstrip().endswith("\\"):
            break
    entries = tuple(_PARAM_ENTRY.findall(" ".join(lines)))
    if not entries:
        raise ValueError(f"no parameters found in {macro} of kernels/{filename}")
    return entries


def source_digest(filename: str, defines: dict[str, int]) -> str:
    return hashlib.sha256(program_source(filename, defines).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _module(source: str, options: tuple[str, ...]):
    import cupy

    return cupy.RawModule(code=source, options=options)


_compiled: dict[tuple, object] = {}


def get_function(filename: str, name: str, defines: dict[str, int]):
    """The compiled kernel ``name`` of one specialisation (compiled lazily, once per process for
    each file, kernel, defines and :func:`kernel_sources` folders: a file edited while the
    process runs is not rebuilt; CuPy's on-disk cache is keyed by the whole source text, so a
    new process never loads a stale cubin)."""
    key = (filename, name, tuple(sorted(defines.items())), _SOURCE_DIRS)
    fn = _compiled.get(key)
    if fn is None:
        fn = _module(program_source(filename, defines), COMPILE_OPTIONS).get_function(name)
        _compiled[key] = fn
    return fn


def compiled_specialisations() -> list[str]:
    """Human-readable list of the specialisations compiled in this process, with the registers
    per thread and local (spill) bytes the compiler gave each kernel on the current GPU."""
    rows = []
    for (f, n, d, _), fn in _compiled.items():
        try:
            res = f"  [{fn.num_regs} registers, {fn.local_size_bytes} B local]"
        except Exception:  # attributes need a loaded module (a GPU)
            res = ""
        rows.append(f"{f}:{n} " + " ".join(f"{k}={v}" for k, v in d) + res)
    return rows


def compile_for_arch(filename: str, defines: dict[str, int], arch: str,
                     ptxas_info: bool = False) -> tuple[bytes, str]:
    """Compile one specialisation with NVRTC for ``arch`` (e.g. "sm_90") without any GPU.

    Returns ``(cubin, log)``: the compiler's log holds its warnings and, with ``ptxas_info``,
    ptxas's resource use of each kernel (registers, spill bytes). Used by the tests to prove
    every kernel builds, without warnings or register spills, on a machine that has only NVRTC.
    Raises RuntimeError with the compiler log on failure.
    """
    from cupy_backends.cuda.libs import nvrtc

    src = program_source(filename, defines)
    prog = nvrtc.createProgram(src, filename, [], [])
    options = [f"-arch={arch}", *COMPILE_OPTIONS, *(("-Xptxas", "-v") if ptxas_info else ())]
    if ptxas_info and tuple(nvrtc.getVersion()) >= (12, 9):
        # NVRTC 12.9+ caches compilations across processes, and a result from its cache comes
        # without ptxas's report: the resource use is asked for, so compile for real
        options.append("--no-cache")
    try:
        try:
            nvrtc.compileProgram(prog, options)
        except Exception as exc:  # nvrtc.NVRTCError carries no log
            raise RuntimeError(f"NVRTC failed for {filename} {defines} ({arch}):\n"
                               f"{nvrtc.getProgramLog(prog)}") from exc
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


_SCALAR_TYPES = (np.int32, np.int64, np.uint32, np.uint64, np.float32, np.float64)
_ARG_TYPES: frozenset = frozenset()


def launch(fn, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple,
           shared_mem: int = 0) -> None:
    """Start ``fn`` on the current CuPy stream.

    Scalars must already be explicit NumPy scalars matching the kernel's parameter types;
    pointers are CuPy arrays or ``np.uint64(0)`` for a null pointer.
    """
    global _ARG_TYPES
    if not _ARG_TYPES:
        import cupy

        _ARG_TYPES = frozenset((cupy.ndarray, *_SCALAR_TYPES))
    for i, a in enumerate(args):
        if type(a) not in _ARG_TYPES:  # exact types: bool and Python int are refused
            raise TypeError(f"kernel argument {i} must be a cupy.ndarray or an explicit NumPy "
                            f"scalar, got {type(a).__name__}")
    allow_shared_memory(fn, shared_mem)
    fn(grid, block, args, shared_mem=shared_mem)


# Programmatic dependent launch: a kernel launched with the driver's programmatic-stream-
# serialization attribute may start before the kernel ahead of it in the stream has ended, once
# every block of that kernel has run griddepcontrol.launch_dependents, and waits in
# griddepcontrol.wait before it reads what that kernel wrote (kernels/common.cuh). Needs compute
# capability 9.0 and a driver of CUDA 12.3 or later (stream capture then keeps the dependency as
# a programmatic graph edge). The launch goes through cuLaunchKernelEx, which CuPy does not bind.
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
PROGRAMMATIC_MIN_CC = 9
PROGRAMMATIC_MIN_DRIVER = 12030


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, 4 bytes of padding, a 64-byte value union (an int here)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("num_attrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=None)
def _launch_kernel_ex():
    """The driver's cuLaunchKernelEx, or None where the driver library or the entry is missing."""
    fn = getattr(_driver_library(), "cuLaunchKernelEx", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = (ctypes.c_void_p,) * 4
    return fn


@functools.lru_cache(maxsize=None)
def programmatic_launch_supported(device_id: int) -> bool:
    """Whether kernels on GPU ``device_id`` can be launched as programmatic dependents."""
    import cupy

    major = cupy.cuda.runtime.getDeviceProperties(device_id)["major"]
    return (major >= PROGRAMMATIC_MIN_CC
            and cupy.cuda.runtime.driverGetVersion() >= PROGRAMMATIC_MIN_DRIVER
            and _launch_kernel_ex() is not None)


class StructLaunch:
    """A prepared launch: every kernel parameter packed into one buffer, then ``cuLaunchKernel``.

    CuPy's generic launch inspects and converts every argument on each call (~16 µs for one
    structured NumPy scalar, ~0.5 µs per plain argument); here the caller packs the values
    straight into a buffer that lives as long as this object, and the launch is one
    ``cuLaunchKernel`` through CuPy's driver binding. ``layout`` (a ``struct.Struct``) packs all
    parameters; kernel parameter ``i`` starts at byte ``offsets[i]`` of it (default: the split
    kernel's single by-value struct at 0). Grid, block and dynamic shared memory are fixed at
    construction.

    Each thread packs into its own buffer, so concurrent launches from several threads cannot
    mix their parameters (the driver copies the parameters before ``cuLaunchKernel`` returns).

    ``tail`` (a ``struct.Struct``): the parameters continue after ``layout`` with ``tail``'s,
    which :meth:`launch_with_tail` packs only when their key is another object than the one
    packed last (a plan's strides and scalars stay the same from call to call, its pointers do
    not).

    With ``programmatic`` (where :func:`programmatic_launch_supported`), the launch is a
    programmatic dependent of the kernel before it in the stream, through ``cuLaunchKernelEx``
    (if the driver refuses it, that launch and the later ones are plain ``cuLaunchKernel``s);
    the kernel must then wait (``cd_wait_prerequisites``) before it reads that kernel's output.
    """

    def __init__(self, fn, grid: tuple[int, int, int], block: tuple[int, int, int],
                 shared_mem: int, layout, offsets: tuple[int, ...] = (0,),
                 programmatic: bool = False, tail=None):
        from cupy_backends.cuda.api import driver

        if any(o < 0 or o >= layout.size for o in offsets):
            raise ValueError(f"offsets {offsets} outside the {layout.size}-byte layout")
        self._tail = tail
        self._size = layout.size + (0 if tail is None else tail.size)
        allow_shared_memory(fn, shared_mem)
        self._driver = driver       # imported once, not on every launch
        self._kernel = fn           # keeps the module (and so the CUfunction) alive
        self._func = fn.kernel.ptr  # the CUfunction on the current device
        self._dims = (*grid, *block, shared_mem)
        self._layout = layout       # a struct.Struct matching the kernel's parameters
        self._offsets = tuple(offsets)
        self._local = threading.local()
        self._launch_ex = _launch_kernel_ex() if programmatic else None

    @property
    def programmatic(self) -> bool:
        """Whether this launch is a programmatic dependent of the kernel before it."""
        return self._launch_ex is not None

    def _slot(self):
        slot = getattr(self._local, "slot", None)
        if slot is None:
            bind_context()  # cuLaunchKernel needs a context current in the launching thread
            buf = (ctypes.c_uint64 * (-(-self._size // 8)))()   # 8-byte aligned
            base = ctypes.addressof(buf)
            argv = (ctypes.c_void_p * len(self._offsets))(*(base + o for o in self._offsets))
            config = None
            if self._launch_ex is not None:  # the launch's configuration, per thread as well
                attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
                config = _LaunchConfig(self._dims[:3], self._dims[3:6], self._dims[6], None,
                                       ctypes.addressof(attr), 1)
                config._attr = attr  # kept alive with the configuration that points at it
            slot = self._local.slot = (buf, argv, ctypes.addressof(argv), config,
                                       0 if config is None else ctypes.addressof(config))
            self._local.tail_key = None
        return slot

    def __call__(self, stream_ptr: int, *values) -> None:
        """Pack ``values`` with the layout and launch on the stream ``stream_ptr``."""
        slot = self._slot()
        self._layout.pack_into(slot[0], 0, *values)
        self._launch(stream_ptr, slot)

    def launch_with_tail(self, stream_ptr: int, values: tuple, tail_key, tail_values: tuple) -> None:
        """Launch with ``values`` packed with the layout and ``tail_values`` with the tail after
        them, the tail packed only where ``tail_key`` is not the object this thread packed last
        (one key object must always come with the same tail values; holding the last one keeps
        its identity from being reused)."""
        local = self._local
        slot = getattr(local, "slot", None) or self._slot()
        if local.tail_key is not tail_key:
            local.tail_key = None  # (a packing that raises leaves no key behind)
            self._tail.pack_into(slot[0], self._layout.size, *tail_values)
            local.tail_key = tail_key
        self._layout.pack_into(slot[0], 0, *values)
        if self._launch_ex is None:  # (the plain launch of _launch, one call less)
            self._driver.launchKernel(self._func, *self._dims, stream_ptr, slot[2], 0)
        else:
            self._launch(stream_ptr, slot)

    def _launch(self, stream_ptr: int, slot) -> None:
        _, _, argv, config, config_ptr = slot
        launch_ex = self._launch_ex  # (a slot has a configuration whenever this is set)
        if launch_ex is not None:
            config.stream = stream_ptr
            if not launch_ex(config_ptr, self._func, argv, None):
                return
            # Refused (e.g. by a driver that does not take the attribute here): the kernel's wait
            # does nothing in a plain launch, so launch it plainly, now and from now on; an error
            # that is not about the attribute raises from the plain launch.
            self._launch_ex = None
        self._driver.launchKernel(self._func, *self._dims, stream_ptr, argv, 0)


def bind_context() -> None:
    """Make the current device's context current in the calling thread.

    A thread that has made no CUDA runtime call that needs a context has none current, and the
    driver calls made here directly (cuLaunchKernel, the occupancy query, function attributes)
    would fail there with CUDA_ERROR_INVALID_CONTEXT; cudaFree(0) binds the device's context.
    Only where none is current: cudaFree is refused while a stream of the thread or process is
    being captured in global or thread-local mode (a launch first needed inside such a capture
    would invalidate it), and a thread that captures has its context current already.
    """
    import cupy
    from cupy_backends.cuda.api import driver

    if driver.ctxGetCurrent() == 0:
        cupy.cuda.runtime.free(0)


# (id(fn), bytes, device) → fn: holding fn keeps its id from being reused by another function
# object while its entry exists (a stale entry would skip a needed opt-in).
_smem_opted_in: dict[tuple[int, int, int], object] = {}


def allow_shared_memory(fn, shared_mem: int) -> None:
    """Opt ``fn`` in to ``shared_mem`` bytes of dynamic shared memory (needed above 48 KB)."""
    if shared_mem <= 48 * 1024:
        return
    import cupy

    # per device: CuPy keeps one function per device and sets the attribute on the current one
    key = (id(fn), shared_mem, cupy.cuda.runtime.getDevice())
    if key not in _smem_opted_in:
        fn.max_dynamic_shared_size_bytes = shared_mem
        _smem_opted_in[key] = fn
