"""The split kernel's direct launch path, without a GPU: the driver call is intercepted and the
parameter block it would receive is read back through kernelParams[0]."""

import ctypes
import threading

import numpy as np
import pytest

pytest.importorskip("cupy")

from cupydecode import _kernels, _policy  # noqa: E402
from cupydecode.decode import _PARAMS  # noqa: E402


class _FakeKernel:
    class kernel:  # noqa: N801 - mirrors RawKernel.kernel.ptr
        ptr = 0xABC0


def _intercept(monkeypatch, on_launch, on_free=lambda ptr: None, context=0):
    """The driver's cuLaunchKernel replaced by ``on_launch(dims, kernel_params, extra)`` (dims:
    function, grid, block, shared memory, stream), the thread's current context (cuCtxGetCurrent)
    by ``context`` (0: none) and the context binding of a thread's first launch (cudaFree(0)) by
    ``on_free(ptr)``: nothing reaches a GPU."""
    import cupy
    from cupy_backends.cuda.api import driver

    def fake_launch(func, gx, gy, gz, bx, by, bz, smem, stream, kernel_params, extra):
        on_launch((func, gx, gy, gz, bx, by, bz, smem, stream), kernel_params, extra)

    monkeypatch.setattr(driver, "launchKernel", fake_launch)
    monkeypatch.setattr(driver, "ctxGetCurrent", lambda: context)
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
_MERGE_CTYPES = [ctypes.c_uint64] * 4 + [ctypes.c_int32, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32,
                                         ctypes.c_uint64, ctypes.c_int32]


def _merge_params(kernel_params) -> tuple:
    """The merge kernel's parameters as a launch hands them to the driver: parameter i read
    through kernelParams[i] with its C type."""
    argv = ctypes.cast(kernel_params, ctypes.POINTER(ctypes.c_void_p))
    return tuple(t.from_address(argv[i]).value for i, t in enumerate(_MERGE_CTYPES))


def _values(seed: int) -> tuple:
    """A value of every field of the split kernel's parameter block, by its format code:
    pointers, negative and positive int64 strides, int32 and float32 (exact in float32)."""
    values = []
    for i, code in enumerate(_PARAMS.format.lstrip("<")):
        values.append({"Q": 0x7F0000000000 + 256 * (seed + i),
                       "q": -(seed + i) if i % 3 else seed + 1000 * i,
                       "i": (7 * seed + i) * (-1) ** i, "f": 0.125 * (seed + i)}[code])
    return tuple(values)


def test_struct_launch_passes_the_packed_block(captured):
    launch = _kernels.StructLaunch(_FakeKernel(), (8, 16, 2), (128, 1, 1), 4096, _PARAMS)
    for seed in (1, 2):
        launch(0x5151, *_values(seed))
    assert captured[0] == ("free", 0)  # the context is bound once, before the first launch
    launches = captured[1:]
    assert [c[0] for c in launches] == [(0xABC0, 8, 16, 2, 128, 1, 1, 4096, 0x5151, 0)] * 2
    assert [_PARAMS.unpack(c[1]) for c in launches] == [_values(1), _values(2)]


def test_struct_launch_binds_no_context_where_one_is_current(monkeypatch):
    """A thread with a context current (every thread that captures a graph) launches without
    cudaFree(0), which a global or thread-local capture would refuse (and be invalidated by)."""
    calls = []
    _intercept(monkeypatch, lambda dims, params, extra: calls.append(dims[-1]),
               lambda ptr: calls.append(("free", ptr)), context=0x1234)
    _kernels.StructLaunch(_FakeKernel(), (1, 1, 1), (32, 1, 1), 0, _PARAMS)(0x77, *_values(3))
    assert calls == [0x77]


def test_launch_with_tail_packs_the_tail_only_when_its_key_changes(captured):
    """The split kernel's pointers (decode._PARAMS_HEAD) every call, the rest
    (decode._PARAMS_TAIL) only when the tail's key is another object (an equal one included):
    the bytes the driver gets are those of the whole list packed at once (decode._PARAMS)."""
    from cupydecode.decode import _NUM_PTRS, _PARAMS_HEAD, _PARAMS_TAIL

    assert _NUM_PTRS == 17 and _PARAMS_HEAD.size + _PARAMS_TAIL.size == _PARAMS.size
    launch = _kernels.StructLaunch(_FakeKernel(), (8, 16, 2), (128, 1, 1), 4096, _PARAMS_HEAD,
                                   tail=_PARAMS_TAIL)
    v1, v2, v3 = _values(1), _values(2), _values(3)
    a, b = ["a"], ["a"]  # equal, not the same
    launch.launch_with_tail(0x5151, v1[:_NUM_PTRS], a, v1[_NUM_PTRS:])
    launch.launch_with_tail(0x5151, v2[:_NUM_PTRS], a, v2[_NUM_PTRS:])  # same key: tail kept
    launch.launch_with_tail(0x5151, v2[:_NUM_PTRS], b, v2[_NUM_PTRS:])
    launch.launch_with_tail(0x5151, v3[:_NUM_PTRS], a, v3[_NUM_PTRS:])
    blocks = [_PARAMS.unpack(c[1]) for c in captured[1:]]
    assert blocks == [v1, v2[:_NUM_PTRS] + v1[_NUM_PTRS:], v2, v3]


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
    values = (0x7F0000001000, 0x7F0000002000, 0x7F0000003000, 0, 37, (1 << 33) + 5, 128, 4,
              0x7F0000004000, 32)
    launch(0x99, *values)
    launch(0x99, *values[:4], 5, 7, 64, 1, 0, 8)
    assert seen == [values, values[:4] + (5, 7, 64, 1, 0, 8)]
    assert len(_MERGE_OFFSETS) == len(_MERGE_CTYPES)
    with pytest.raises(ValueError, match="offsets"):
        _kernels.StructLaunch(_FakeKernel(), (1, 1, 1), (32, 1, 1), 0, _MERGE_PARAMS, (0, 72))


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
    values = (1, 2, 3, 0, 37, (1 << 33) + 5, 128, 4, 0, 32)
    launch(0x5151, *values)
    launch(0x6262, *values[:4], 5, 7, 64, 1, 0, 32)
    assert seen == [([3, 2, 1, 256, 1, 1, 1024], 0x5151, 1, [6, 1], 0xABC0, (37, (1 << 33) + 5), None),
                    ([3, 2, 1, 256, 1, 1, 1024], 0x6262, 1, [6, 1], 0xABC0, (5, 7), None)]
    assert plain_calls == []
    launch(0xBAD, *values)  # refused: launched plainly
    launch(0x7373, *values[:4], 9, 7, 64, 1, 0, 32)  # and plainly from then on
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


class _Arr:
    """What DecodePlan._prepare and the tests' launches read of an array: its pointer and item
    size."""

    def __init__(self, ptr, itemsize=2):
        self.data = type("Mem", (), {"ptr": ptr})()
        self.itemsize = itemsize


class _Stream:
    ptr = 0x77


class _Recorder:
    """A plan's split-kernel launch that hands ``record(stream, values)`` every value it would
    pack, the pointers and the tail together, in the list's order."""

    def __init__(self, record):
        self.record = record

    def launch_with_tail(self, stream, values, tail_key, tail_values):
        self.record(stream, tuple(values) + tuple(tail_values))


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr


def _launch(plan, q, k, v, seqlens, seqlen_all, scale, out, lse, strides, table=None, new=None):
    """What DecodePlan.run does after its checks: the call prepared for these inputs
    (DecodePlan._prepare), then launched with their pointers (DecodePlan._launch)."""
    call = plan._prepare(strides, seqlens, seqlen_all, scale, table, new)
    arrays = (q, k, v, seqlens, table, *(new[:2] if new else (None, None)))
    plan._launch(call, _Stream(), [_ptr(a) for a in arrays], _ptr(out), _ptr(lse), 0, 0, 0, 0)


def _fake_plan(paged: bool):
    """A DecodePlan's launch state without a GPU: batch 3, 8 KV heads, head_dim 128 (float16),
    max_seqlen 640; the prepared launches record the values they would pack."""
    from cupydecode.decode import DecodePlan

    plan = object.__new__(DecodePlan)
    calls = []
    plan.batch, plan.max_seqlen, plan.page_size, plan.q_len = 3, 640, (16 if paged else None), 1
    plan._counters_wait, plan._counters_refill, plan._merge_call = None, False, None
    plan._part_ptrs, plan._counter_ptr = (0xA0, 0xB0), 0xC0
    plan._static = (640, 32, 4, 1, 64, plan.page_size or 0)
    plan._window_arg = 4095 if paged else -1
    plan._scale, plan._score_default = 0.5, (0.72, 1, 0.0, 0.0)
    plan.config, plan.token_config = _policy.split_kernel_config("float16", 128), None
    plan.window_left = 4095 if paged else None
    plan._plain_launches = set()
    launches = {}

    def split_launch(config):  # one launch per build, as DecodePlan._split_launch keeps them
        if config not in launches:
            launches[config] = _Recorder(
                lambda stream, values: calls.append(("split", stream, values, config)))
            if not config.runtime_options:
                plan._plain_launches.add(launches[config])
        return launches[config]

    plan._split_launch = split_launch
    return plan, calls


def test_launch_refuses_options_on_the_plain_build():
    """A call prepared for the split kernel's build without runtime options (no sinks, no
    tokens_after) launched with a sinks or tokens_after pointer is a host bug: refused before
    anything is launched; prepared with them, the same pointers launch the options build."""
    plan, calls = _fake_plan(False)
    q, k, v, out = (_Arr(p) for p in (0x100, 0x200, 0x300, 0x400))
    strides = (4096, 128, 8 * 81920, 8 * 1024, 8 * 128, 8 * 81920, 8 * 1024, 8 * 128, 4096, 128,
               0, 0, 0, 0)
    ptrs = [0x100, 0x200, 0x300, 0, 0, 0, 0]
    plain = plan._prepare(strides, None, 17, 0.5)
    for sinks, tokens_after in ((0x900, 0), (0, 0xA00), (0x900, 0xA00)):
        with pytest.raises(RuntimeError, match="without runtime options"):
            plan._launch(plain, _Stream(), ptrs, 0x400, 0, 0, sinks, 0, 0, tokens_after)
    assert calls == []
    plan._launch(plain, _Stream(), ptrs, 0x400, 0, 0, 0, 0, 0)  # none: the plain build
    with_opts = plan._prepare(strides, None, 17, 0.5, sinks=True, tokens_after=True)
    plan._launch(with_opts, _Stream(), ptrs, 0x400, 0, 0, 0x900, 0, 0, 0xA00)
    assert [c[3].runtime_options for c in calls] == [False, True]


@pytest.mark.parametrize("paged", [False, True])
def test_launch_packs_the_new_tokens_into_the_split_values(paged):
    """With new tokens, the one split-kernel launch carries k_new's and v_new's pointers and
    element strides and n_new = 1; without, null pointers, zero strides and n_new = 0. Each value
    is at its parameter's place in the kernel's list (decode._LAUNCH_ORDER)."""
    from cupydecode.decode import _LAUNCH_ORDER, _PARAMS

    plan, calls = _fake_plan(paged)
    q, k, v, out, lse = (_Arr(p) for p in (0x100, 0x200, 0x300, 0x400, 0x500))
    seqlens, table = _Arr(0x600, 4), (_Arr(0x700, 4) if paged else None)
    k_new, v_new = _Arr(0x800), _Arr(0x900)
    # element strides: q (2), K (3), V (3), out (2), the table's row, q's and out's token
    # strides (one token: 0), the page count
    strides = (4096, 128, 8 * 81920, 8 * 1024, 8 * 128, 8 * 81920, 8 * 1024, 8 * 128, 4096, 128,
               40 if paged else 0, 0, 0, 123 if paged else 0)
    new = (k_new, v_new, (1024, 0, 128, 2048, 1024, 256))
    _launch(plan, q, k, v, seqlens, 640, 0.5, out, lse, strides, table, new)
    _launch(plan, q, k, v, None, 17, 0.5, out, lse, strides, table)
    assert [c[0] for c in calls] == ["split", "split"] and {c[1] for c in calls} == {0x77}
    for call, seqlens_ptr, seqlen_all, with_new in ((calls[0], 0x600, 640, True),
                                                    (calls[1], 0, 17, False)):
        split = dict(zip(_LAUNCH_ORDER, call[2]))
        assert len(call[2]) == len(_LAUNCH_ORDER) == len(_PARAMS.format) - 1
        assert (split["seqlens"], split["seqlen_all"], split["seqlens_64"]) == (
            seqlens_ptr, seqlen_all, 0)
        assert (split["k"], split["block_table"], split["k_sb"], split["bt_sb"],
                split["num_pages"]) == (0x200, 0x700 if paged else 0, 8 * 81920,
                                        40 if paged else 0, 123 if paged else 0)
        assert (split["max_seqlen"], split["page_size"], split["scale_log2"],
                split["window_left"]) == (640, 16 if paged else 0, 0.72, 4095 if paged else -1)
        assert (split["q_st"], split["out_st"], split["q_len"]) == (0, 0, 1)
        got = tuple(split[n] for n in ("k_new", "v_new", "kn_sb", "kn_ss", "kn_sh", "vn_sb",
                                       "vn_ss", "vn_sh", "n_new"))
        assert got == ((0x800, 0x900, 1024, 0, 128, 2048, 1024, 256, 1) if with_new
                       else (0,) * 9)


def _append_model(values, batch: int, num_kv_heads: int, itemsize: int, row_bytes: int,
                  bounds) -> None:
    """The split kernel's writes of the appended token (kernels/decode_split.cu: the clamp of
    the length, the page lookup, app_kr/app_vr and the stores) on host memory, line for line:
    ``values`` in the kernel's parameter order (pointers are host addresses here, strides in
    elements). Every access is first checked to lie inside the memory of the array it belongs
    to (``bounds``: parameter name → numpy.lib.array_utils.byte_bounds of that array)."""
    from cupydecode.decode import _LAUNCH_ORDER

    p = dict(zip(_LAUNCH_ORDER, values))

    def inside(name, addr, nbytes):
        low, high = bounds[name]
        assert low <= addr and addr + nbytes <= high, f"{name}: [{addr}, +{nbytes}) outside"
        return addr

    def i32(name, addr):
        return ctypes.c_int32.from_address(inside(name, addr, 4)).value
    for b in range(batch):
        seqlen = i32("seqlens", p["seqlens"] + 4 * b) if p["seqlens"] else p["seqlen_all"]
        new_lo = max(0, min(seqlen, p["max_seqlen"]))
        if min(p["n_new"], p["max_seqlen"] - new_lo) < 1:
            continue
        if p["block_table"]:
            pj = new_lo // p["page_size"]
            page = i32("block_table", p["block_table"] + 4 * (b * p["bt_sb"] + pj))
            if not 0 <= page < p["num_pages"]:
                continue
            row = new_lo - pj * p["page_size"]
            kr, vr = page * p["k_sb"] + row * p["k_ss"], page * p["v_sb"] + row * p["v_ss"]
        else:
            kr, vr = b * p["k_sb"] + new_lo * p["k_ss"], b * p["v_sb"] + new_lo * p["v_ss"]
        for h in range(num_kv_heads):
            for dst, d_off, src, s_off in (
                    ("k", kr + h * p["k_sh"], "k_new", b * p["kn_sb"] + h * p["kn_sh"]),
                    ("v", vr + h * p["v_sh"], "v_new", b * p["vn_sb"] + h * p["vn_sh"])):
                ctypes.memmove(inside(dst, p[dst] + itemsize * d_off, row_bytes),
                               inside(src, p[src] + itemsize * s_off, row_bytes), row_bytes)


def _host_arr(x):
    return _Arr(x.ctypes.data if x is not None else 0, x.itemsize if x is not None else 2)


@pytest.mark.parametrize("layout", ["contiguous", "paged", "paged-hnd"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_append_values_write_the_reference_rows(layout, dtype):
    """The values _launch packs for the split kernel (the cache's and k_new's element strides,
    the lengths, the capacity, the table and its row stride), applied by a host model of the
    kernel's append index math to host arrays, write exactly the rows
    reference.append_kv writes: out-of-range lengths clamped, out-of-range pages not written,
    a strided k_new, the HND page order as a transposed view."""
    from cupydecode import _validate as V
    from cupydecode import reference as R
    from cupydecode.decode import DecodePlan

    rng = np.random.default_rng(5)
    batch, hkv, heads, dim, page = 6, 2, 8, 64, 16
    cap = 96  # 6 pages of 16 per sequence
    lens = np.array([-3, 0, 15, 16, 95, 96], np.int32)
    q = rng.standard_normal((batch, heads, dim)).astype(dtype)
    if layout == "contiguous":
        k = rng.standard_normal((batch, cap, hkv, dim)).astype(dtype)
        v = rng.standard_normal((batch, cap, hkv, dim)).astype(dtype)
        table = None
    else:
        num_pages = batch * cap // page + 2
        table = rng.permutation(num_pages)[:batch * cap // page].reshape(batch, -1)
        table = np.ascontiguousarray(table, np.int32)
        table[3, 1] = -1          # sequence 3's new token (position 16) opens page 1: invalid
        table[2, 0] = num_pages   # sequence 2's (position 15) is in page 0: out of range
        if layout == "paged-hnd":
            k, v = (np.ascontiguousarray(rng.standard_normal((num_pages, hkv, page, dim)).astype(
                dtype)).transpose(0, 2, 1, 3) for _ in range(2))
        else:
            k, v = (rng.standard_normal((num_pages, page, hkv, dim)).astype(dtype)
                    for _ in range(2))
    wide = rng.standard_normal((batch, 1, 2 * hkv, dim)).astype(dtype)
    k_new = wide[:, :, ::2]  # a strided view: head stride of two rows
    v_new = rng.standard_normal((batch, hkv, dim)).astype(dtype)  # 3 dims
    want_k, want_v, _ = R.append_kv(k, v, lens, k_new, v_new[:, None], table)
    k_before = k.copy()

    plan = object.__new__(DecodePlan)
    plan.batch, plan.num_heads, plan.head_dim, plan.q_len = batch, heads, dim, 1
    plan.max_seqlen, plan.page_size = cap, (None if table is None else page)
    plan._counters_wait, plan._counters_refill, plan._merge_call = None, False, None
    plan._part_ptrs, plan._counter_ptr = (0, 0), 0
    plan._static = (cap, heads, heads // hkv, 1, cap, plan.page_size or 0)
    plan._window_arg = -1
    plan._scale, plan._score_default = 0.125, (0.125 * _policy.LOG2E, 0, 0.0, 0.0)
    split = []
    plan.config = _policy.split_kernel_config(np.dtype(dtype).name, dim)
    plan.token_config = None
    plan.window_left = None
    plan._split_launch = lambda config: _Recorder(lambda stream, values: split.append(values))
    from numpy.lib.array_utils import byte_bounds

    bt_sb = 0 if table is None else table.strides[0] // 4
    strides = plan._element_strides(q, k, v, bt_sb, 0 if table is None else k.shape[0])
    new = (_host_arr(k_new), _host_arr(v_new),
           (*V.new_token_strides(k_new), *V.new_token_strides(v_new)))
    _launch(plan, _host_arr(q), _host_arr(k), _host_arr(v), _host_arr(lens), cap, 0.125,
            _host_arr(q), None, strides, None if table is None else _host_arr(table), new)
    (values,) = split
    bounds = {"k": byte_bounds(k), "v": byte_bounds(v), "k_new": byte_bounds(k_new),
              "v_new": byte_bounds(v_new), "seqlens": byte_bounds(lens),
              "block_table": None if table is None else byte_bounds(table)}
    _append_model(values, batch, hkv, k.itemsize, dim * k.itemsize, bounds)
    assert np.array_equal(k, want_k) and np.array_equal(v, want_v)
    # not vacuous: one row per sequence with room (and, paged, a page in range) was written
    changed = (k != k_before).reshape(k.shape[0], k.shape[1], -1).any(axis=-1).sum()
    assert changed == (5 if table is None else 3)


def test_launch_flags_int64_lengths():
    """int64 device lengths and block tables (torch's default integer type) reach the kernel as
    they are, with seqlens_64 / table_64 = 1 (the kernel reads them in 64 bits)."""
    from cupydecode.decode import _LAUNCH_ORDER, _SEQLEN_ALL

    plan, calls = _fake_plan(False)
    q, k, v, out, lse = (_Arr(p) for p in (0x100, 0x200, 0x300, 0x400, 0x500))
    strides = (4096, 128, 8 * 81920, 8 * 1024, 8 * 128, 8 * 81920, 8 * 1024, 8 * 128, 4096, 128,
               0, 0, 0, 0)
    _launch(plan, q, k, v, _Arr(0x600, 8), 640, 0.5, out, lse, strides)
    split = dict(zip(_LAUNCH_ORDER, calls[0][2]))
    assert (split["seqlens"], split["seqlens_64"], split["table_64"]) == (0x600, 1, 0)
    plan, calls = _fake_plan(True)  # an int64 block table likewise
    _launch(plan, q, k, v, _Arr(0x600, 4), 640, 0.5, out, lse, strides, _Arr(0x700, 8))
    split = dict(zip(_LAUNCH_ORDER, calls[0][2]))
    assert (split["block_table"], split["seqlens_64"], split["table_64"]) == (0x700, 0, 1)


def test_calls_without_runtime_options_take_the_build_without_them():
    """A call with no appended tokens, window, sinks, tokens_after or int64 lengths launches the
    split kernel built without the runtime options (RUNTIME_OPTIONS 0: each a constant there);
    a call with any of them, the build that reads them — never the other way round, which would
    drop the option."""
    plan, calls = _fake_plan(False)
    q, k, v, out, lse = (_Arr(p) for p in (0x100, 0x200, 0x300, 0x400, 0x500))
    strides = (4096, 128, 8 * 81920, 8 * 1024, 8 * 128, 8 * 81920, 8 * 1024, 8 * 128, 4096, 128,
               0, 0, 0, 0)
    new = (_Arr(0x800), _Arr(0x900), (1024, 0, 128, 2048, 1024, 256))

    def build(seqlens=None, new=None, **rare):
        calls.clear()
        launch, tail = plan._prepare(strides, seqlens, 640, 0.5, None, new, None, **rare)
        launch.launch_with_tail(0x77, (), None, tail)
        return calls[0][3].runtime_options

    assert build() is False and build(_Arr(0x600, 4)) is False
    assert plan.config.runtime_options and not _policy.runtime_options(False, False, False,
                                                                       False, False)
    assert build(_Arr(0x600, 8)) is True  # int64 lengths
    assert build(_Arr(0x600, 4), new) is True
    assert build(sinks=True) is True and build(tokens_after=True) is True
    plan, calls = _fake_plan(True)  # a plan with a window
    assert build() is True


def test_an_int_length_reaches_the_kernel_whatever_was_remembered():
    """An int cache_seqlens is not in a call's key (it changes every step of a loop): a
    remembered call takes each call's value as seqlen_all (the prepared call itself where it is
    the same), and a value out of range is refused as the full checks refuse it, appending
    too (its token must fit in the cache)."""
    from cupydecode.decode import _LAUNCH_ORDER, _SEQLEN_ALL

    plan, calls = _fake_plan(False)
    q, k, v, out, lse = (_Arr(p) for p in (0x100, 0x200, 0x300, 0x400, 0x500))
    strides = (4096, 128, 8 * 81920, 8 * 1024, 8 * 128, 8 * 81920, 8 * 1024, 8 * 128, 4096, 128,
               0, 0, 0, 0)
    call = plan._prepare(strides, None, 640, 0.5)
    assert plan._with_length(call, 640, False, True) is call
    for n in (17, 0, 640):
        launch, tail = plan._with_length(call, n, False, True)
        plan._launch((launch, tail), _Stream(), [_ptr(a) for a in (q, k, v)] + [0] * 4,
                     _ptr(out), _ptr(lse), 0, 0, 0, 0)
    got = [dict(zip(_LAUNCH_ORDER, c[2])) for c in calls]
    assert [(g["seqlen_all"], g["seqlens"]) for g in got] == [(17, 0), (0, 0), (640, 0)]
    assert got[0]["max_seqlen"] == 640 and got[0]["k_sb"] == 8 * 81920
    for bad in (641, -1):
        with pytest.raises(ValueError, match="^cache_seqlens:"):
            plan._with_length(call, bad, False, True)
    assert plan._with_length(call, 639, True, False)[1][_SEQLEN_ALL] == 639
    for bad in (640, 641, -1):
        with pytest.raises(ValueError, match="^cache_seqlens:"):
            plan._with_length(call, bad, True, False)


def test_a_plans_own_outputs_are_read_only():
    """run launches into the pointers of plan.out and plan.lse it remembered at construction,
    so the attributes cannot be rebound to other arrays."""
    from cupydecode.decode import DecodePlan

    for name in ("out", "lse"):
        attr = getattr(DecodePlan, name)
        assert isinstance(attr, property) and attr.fset is None, name
