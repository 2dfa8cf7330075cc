"""The split kernel's direct launch path, without a GPU: the driver call is intercepted and the
parameter block it would receive is read back through kernelParams[0]."""

import ctypes
import threading

import pytest

pytest.importorskip("cupy")

from cupydecode import _kernels  # noqa: E402
from cupydecode.decode import _PARAMS  # noqa: E402


class _FakeKernel:
    class kernel:  # noqa: N801 - mirrors RawKernel.kernel.ptr
        ptr = 0xABC0


def _intercept(monkeypatch, on_launch, on_free=lambda ptr: None):
    """The driver's cuLaunchKernel replaced by ``on_launch(dims, kernel_params, extra)`` (dims:
    function, grid, block, shared memory, stream), and the context binding of a thread's first
    launch (cudaFree(0)) by ``on_free(ptr)``: nothing reaches a GPU."""
    import cupy
    from cupy_backends.cuda.api import driver

    def fake_launch(func, gx, gy, gz, bx, by, bz, smem, stream, kernel_params, extra):
        on_launch((func, gx, gy, gz, bx, by, bz, smem, stream), kernel_params, extra)

    monkeypatch.setattr(driver, "launchKernel", fake_launch)
    monkeypatch.setattr(cupy.cuda.runtime, "free", on_free)


@pytest.fixture
def captured(monkeypatch):
    """Launches as (dims + (extra,), the parameter block the driver would copy), and context
    bindings as ("free", ptr), in order."""
    calls = []

    def launch(dims, kernel_params, extra):
        argv = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))
        calls.append((dims + (extra,), ctypes.string_at(argv[0], _PARAMS.size)))

    _intercept(monkeypatch, launch, lambda ptr: calls.append(("free", ptr)))
    return calls


# C types of cd_merge_states' parameters (kernels/merge_states.cu), in order
_MERGE_CTYPES = [ctypes.c_uint64] * 4 + [ctypes.c_int32, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32]


def _merge_params(kernel_params) -> tuple:
    """The merge kernel's parameters as a launch hands them to the driver: parameter i read
    through kernelParams[i] with its C type."""
    argv = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))
    return tuple(t.from_address(argv[i]).value for i, t in enumerate(_MERGE_CTYPES))


def _values(seed: int) -> tuple:
    ptrs = tuple(0x7F0000000000 + 256 * (seed + i) for i in range(10))
    strides = tuple(-(seed + i) if i % 3 else seed + 1000 * i for i in range(11))
    return ptrs + strides + (7 * seed, seed, 1 << 20, 32, 4, 1, 256 + seed, 16, 0.125, seed % 2,
                             0.5 * seed, 72.0)


def test_struct_launch_passes_the_packed_block(captured):
    launch = _kernels.StructLaunch(_FakeKernel(), (8, 16, 2), (128, 1, 1), 4096, _PARAMS)
    for seed in (1, 2):
        launch(0x5151, *_values(seed))
    assert captured[0] == ("free", 0)  # the context is bound once, before the first launch
    launches = captured[1:]
    assert [c[0] for c in launches] == [(0xABC0, 8, 16, 2, 128, 1, 1, 4096, 0x5151, 0)] * 2
    assert [_PARAMS.unpack(c[1]) for c in launches] == [_values(1), _values(2)]


def test_struct_launch_buffers_are_per_thread(captured):
    launch = _kernels.StructLaunch(_FakeKernel(), (1, 1, 1), (32, 1, 1), 0, _PARAMS)
    slots = []

    def worker():
        slots.append(launch._slot())  # kept alive, so addresses cannot be reused
        assert launch._slot() is slots[-1]  # one buffer per thread, reused by its launches

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    worker()
    assert len({ctypes.addressof(s[0]) for s in slots}) == 4
    assert captured == [("free", 0)] * 4  # each thread binds the context once


def test_struct_launch_refuses_wrong_values(captured):
    launch = _kernels.StructLaunch(_FakeKernel(), (1, 1, 1), (32, 1, 1), 0, _PARAMS)
    import struct

    with pytest.raises(struct.error):
        launch(0, *_values(1)[:-1])  # one value short
    assert all(c == ("free", 0) for c in captured)  # nothing launched


def test_struct_launch_points_each_parameter_at_its_offset(monkeypatch):
    """The merge kernel's prepared launch: kernelParams[i] must point at parameter i's bytes,
    each read with the C type of cd_merge_states' parameter i."""
    from cupydecode.decode import _MERGE_OFFSETS, _MERGE_PARAMS

    seen = []
    _intercept(monkeypatch, lambda dims, kernel_params, extra: seen.append(_merge_params(kernel_params)))
    launch = _kernels.StructLaunch(_FakeKernel(), (3, 1, 1), (256, 1, 1), 0, _MERGE_PARAMS,
                                   _MERGE_OFFSETS)
    values = (0x7F0000001000, 0x7F0000002000, 0x7F0000003000, 0, 37, (1 << 33) + 5, 128, 4)
    launch(0x99, *values)
    launch(0x99, *values[:4], 5, 7, 64, 1)
    assert seen == [values, values[:4] + (5, 7, 64, 1)]
    assert len(_MERGE_OFFSETS) == len(_MERGE_CTYPES)
    with pytest.raises(ValueError, match="offsets"):
        _kernels.StructLaunch(_FakeKernel(), (1, 1, 1), (32, 1, 1), 0, _MERGE_PARAMS, (0, 56))


def test_programmatic_launch_passes_config_attribute_and_parameters(monkeypatch):
    """A programmatic launch (a plan's merge kernel on Hopper) goes through cuLaunchKernelEx: the
    CUlaunchConfig it receives holds the grid, block, shared memory and stream, and one
    attribute, programmatic stream serialization (id 6) set to 1, laid out as cuda.h has them;
    kernelParams points at the packed parameters. A refused launch is made plainly instead
    (cuLaunchKernel), with the same parameters, and so are the later ones."""
    from cupydecode.decode import _MERGE_OFFSETS, _MERGE_PARAMS

    seen, plain_calls = [], []
    _intercept(monkeypatch, lambda dims, kernel_params, extra:
               plain_calls.append((dims, _merge_params(kernel_params)[4])))

    def fake_launch_ex(config_ptr, func, kernel_params, extra):
        u32 = [ctypes.c_uint32.from_address(config_ptr + 4 * i).value for i in range(7)]
        stream, attrs = (ctypes.c_uint64.from_address(config_ptr + o).value for o in (32, 40))
        num_attrs = ctypes.c_uint32.from_address(config_ptr + 48).value
        attr = [ctypes.c_int32.from_address(attrs + o).value for o in (0, 8)]
        nums = _merge_params(kernel_params)[4:6]
        seen.append((u32, stream, num_attrs, attr, func, nums, extra))
        return 1 if stream == 0xBAD else 0

    monkeypatch.setattr(_kernels, "_launch_kernel_ex", lambda: fake_launch_ex)
    launch = _kernels.StructLaunch(_FakeKernel(), (3, 2, 1), (256, 1, 1), 1024, _MERGE_PARAMS,
                                   _MERGE_OFFSETS, programmatic=True)
    assert launch.programmatic
    values = (1, 2, 3, 0, 37, (1 << 33) + 5, 128, 4)
    launch(0x5151, *values)
    launch(0x6262, *values[:4], 5, 7, 64, 1)
    assert seen == [([3, 2, 1, 256, 1, 1, 1024], 0x5151, 1, [6, 1], 0xABC0, (37, (1 << 33) + 5), None),
                    ([3, 2, 1, 256, 1, 1, 1024], 0x6262, 1, [6, 1], 0xABC0, (5, 7), None)]
    assert plain_calls == []
    launch(0xBAD, *values)  # refused: launched plainly
    launch(0x7373, *values[:4], 9, 7, 64, 1)  # and plainly from then on
    assert not launch.programmatic and len(seen) == 3
    assert plain_calls == [((0xABC0, 3, 2, 1, 256, 1, 1, 1024, 0xBAD), 37),
                           ((0xABC0, 3, 2, 1, 256, 1, 1, 1024, 0x7373), 9)]
    plain = _kernels.StructLaunch(_FakeKernel(), (1, 1, 1), (32, 1, 1), 0, _MERGE_PARAMS,
                                  _MERGE_OFFSETS)
    assert not plain.programmatic


def test_launch_structures_match_cuda_h():
    """CUlaunchAttribute is 72 bytes (value union at 8); CUlaunchConfig is 56 (stream at 32)."""
    assert ctypes.sizeof(_kernels._LaunchAttribute) == 72
    assert _kernels._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_kernels._LaunchConfig) == 56
    assert (_kernels._LaunchConfig.stream.offset, _kernels._LaunchConfig.attrs.offset,
            _kernels._LaunchConfig.num_attrs.offset) == (32, 40, 48)
