"""Every kernel specialisation compiles with NVRTC for sm_80 and sm_90, without a GPU."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import pytest

from cupydecode import _kernels, _policy
from helpers import KERNEL_MUTANTS, mutant_source

ARCHS = ("sm_80", "sm_90")


@functools.lru_cache(maxsize=None)
def nvrtc_unavailable_reason() -> str | None:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()  # loads the NVRTC shared library
    except Exception as exc:
        return f"NVRTC cannot be loaded through cupy_backends ({type(exc).__name__}: {exc})"
    return None



@pytest.fixture
def nvrtc():
    reason = nvrtc_unavailable_reason()
    if reason:
        pytest.skip(reason)


SPLIT_CASES = _policy.compile_check_configs()
MERGE_CASES = list(itertools.product(range(3), range(3), (1, 4)))


# Register spills ptxas is known to make (bytes of spill stores) by (dtype, kernel width) of the split
# kernel: the float32 head_dim-256 shape, whose 16 rows × 8 accumulators per lane fill the 255
# registers, spills 0-20 bytes depending on the arch and on small changes elsewhere in the kernel
# (register allocation there is at its edge), hence one budget for it. float32 is the accuracy
# path, not a serving one. Any other spill is a regression: the decode kernels run at the
# memory's pace only while they keep up.
KNOWN_SPILLS = {("float32", 256): 48}  # (36 with every switch on, several query tokens included)


def _check_build(result, allowed_spill: int = 0):
    """A cubin, a log without compiler warnings, and no more spill bytes than allowed."""
    cubin, log = result
    assert isinstance(cubin, (bytes, bytearray)) and cubin[:4] == b"\x7fELF"
    assert "warning" not in log.lower(), log
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
    assert spills and max(spills) <= allowed_spill, log  # (ptxas reports every kernel)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cfg", SPLIT_CASES,
                         ids=lambda c: f"{c.dtype}-D{c.head_dim}-{c.num_warps}w{c.stages}s-m{c.m_tiles}"
                                         f"-kv{c.kv_per_block}{'' if c.l2_evict_first else '-plain'}"
                                         f"{'-softcap' if c.soft_cap else ''}{'-alibi' if c.alibi else ''}"
                                         f"{'-paged' if c.paged else ''}{'-multiq' if c.multi_q else ''}"
                                         f"{'-' + c.kv_dtype if c.kv_dtype else ''}"
                                         f"{'-tokscale' if c.kv_scale_token else ''}")
def test_split_kernel_compiles(nvrtc, cfg, arch):
    _check_build(_kernels.compile_for_arch("decode_split.cu", cfg.defines(), arch, ptxas_info=True),
                 KNOWN_SPILLS.get((cfg.dtype, cfg.width), 0))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("in_dtype,out_dtype,vec", MERGE_CASES)
def test_merge_kernel_compiles(nvrtc, in_dtype, out_dtype, vec, arch):
    defines = {"IN_DTYPE": in_dtype, "OUT_DTYPE": out_dtype, "VEC": vec}
    _check_build(_kernels.compile_for_arch("merge_states.cu", defines, arch, ptxas_info=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("filename", ["read_ceiling.cu", "hold.cu", "step_traffic.cu"])
def test_benchmark_kernels_compile(nvrtc, filename, arch):
    _check_build(_kernels.compile_for_arch(filename, {}, arch, ptxas_info=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fp8,in_dtype,mode", list(itertools.product(range(2), range(3), range(4))))
def test_quantize_kernel_compiles(nvrtc, fp8, in_dtype, mode, arch):
    defines = {"FP8": fp8, "IN_DTYPE": in_dtype, "SCALE_MODE": mode}
    _check_build(_kernels.compile_for_arch("quantize_kv.cu", defines, arch, ptxas_info=True))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fp8,out_dtype,mode", list(itertools.product(range(2), range(3), range(1, 4))))
def test_dequantize_kernel_compiles(nvrtc, fp8, out_dtype, mode, arch):
    defines = {"FP8": fp8, "OUT_DTYPE": out_dtype, "SCALE_MODE": mode}
    _check_build(_kernels.compile_for_arch("dequantize_kv.cu", defines, arch, ptxas_info=True))


def test_a_parameter_list_out_of_falling_alignment_does_not_compile(nvrtc, tmp_path):
    """The host packs the parameter structs field after field: a 4-byte field ahead of an 8-byte
    one (padding inside the struct) stops the build; an odd number of 4-byte fields at the end
    (tail padding only) does not."""
    cfg = _policy.split_kernel_config("float16", 128)
    filename, entry = "decode_params.cuh", "X(I32, int, n_new)"
    kernel, defines = "decode_split.cu", cfg.defines()
    text = (_kernels.kernel_dir() / filename).read_text()
    assert entry in text
    (tmp_path / filename).write_text(text.replace(entry, entry + " X(I64, long long, late)"))
    with _kernels.kernel_sources(tmp_path):
        with pytest.raises(RuntimeError, match="must keep falling alignment"):
            _kernels.compile_for_arch(kernel, defines, "sm_90")
    (tmp_path / filename).write_text(text.replace(entry, entry + " X(I32, int, a) X(I32, int, b)"))
    with _kernels.kernel_sources(tmp_path):
        _kernels.compile_for_arch(kernel, defines, "sm_90")


def test_split_kernel_refuses_another_shared_memory_size(nvrtc):
    """The host's dynamic shared memory (SMEM_BYTES_HOST, from SplitKernelConfig.smem_bytes) must
    be the kernel's own SMEM_BYTES: a host figure 16 bytes short or long, or none, fails the build
    (the launch never runs with too little shared memory)."""
    cfg = _policy.split_kernel_config("float16", 128)
    defines = cfg.defines()
    assert defines["SMEM_BYTES_HOST"] == cfg.smem_bytes
    for bytes_ in (cfg.smem_bytes - 16, cfg.smem_bytes + 16):
        with pytest.raises(RuntimeError, match="is not SMEM_BYTES"):
            _kernels.compile_for_arch("decode_split.cu", dict(defines, SMEM_BYTES_HOST=bytes_),
                                      "sm_90")
    without = {k: v for k, v in defines.items() if k != "SMEM_BYTES_HOST"}
    with pytest.raises(RuntimeError, match="SMEM_BYTES_HOST"):
        _kernels.compile_for_arch("decode_split.cu", without, "sm_90")


def test_split_kernel_and_host_agree_on_appended_rows(nvrtc, tmp_path):
    """The kernel's NEW_ROWS (shared memory for appended rows) and the host's MAX_APPEND_Q_LEN
    (the q_len it lets append) meet in the shared-memory size: a kernel holding fewer rows than
    the host lets in fails the build of a multi-token plan."""
    cfg = _policy.multi_q_config(_policy.split_kernel_config("float16", 128))
    text = (_kernels.kernel_dir() / "decode_split.cu").read_text()
    entry = f"#define NEW_ROWS (MULTI_Q ? {_policy.MAX_APPEND_Q_LEN} : 1)"
    assert entry in text
    (tmp_path / "decode_split.cu").write_text(text.replace(entry, "#define NEW_ROWS (MULTI_Q ? 8 : 1)"))
    with _kernels.kernel_sources(tmp_path):
        with pytest.raises(RuntimeError, match="is not SMEM_BYTES"):
            _kernels.compile_for_arch("decode_split.cu", cfg.defines(), "sm_90")


def test_compile_error_carries_the_log(nvrtc):
    cfg = _policy.split_kernel_config("float16", 128)
    bad = dict(cfg.defines(), ROWS=8)  # the kernel refuses ROWS != 16 with #error
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        _kernels.compile_for_arch("decode_split.cu", bad, "sm_90")


@pytest.mark.parametrize("filename", ["decode_split.cu", "merge_states.cu"])
def test_program_source_inlines_headers(filename):
    defines = (_policy.split_kernel_config("float16", 128).defines() if filename == "decode_split.cu"
               else {"IN_DTYPE": 2, "OUT_DTYPE": 0, "VEC": 4})
    src = _kernels.program_source(filename, defines)
    assert not re.search(r'#\s*include\s+"', src), "a local #include was left for NVRTC to resolve"
    assert "cd_merge_scales" in src  # defined in common.cuh
    for name, value in defines.items():
        assert f"#define {name} {value}\n" in src


def test_program_source_from_another_folder(tmp_path):
    """A/B variants: the files a folder holds replace the shipped ones, the rest stay shipped."""
    defines = _policy.split_kernel_config("float16", 128).defines()
    shipped = _kernels.program_source("decode_split.cu", defines)
    head = "".join(f"#define {k} {v}\n" for k, v in sorted(defines.items()))
    split = (_kernels.kernel_dir() / "decode_split.cu").read_text()
    (tmp_path / "decode_split.cu").write_text("// variant\n" + split)  # its header stays shipped
    assert (_kernels.program_source("decode_split.cu", defines, tmp_path)
            == head + "// variant\n" + shipped[len(head):])
    common = (_kernels.kernel_dir() / "common.cuh").read_text()
    (tmp_path / "common.cuh").write_text(common.replace("#pragma once", "#pragma once // variant"))
    src = _kernels.program_source("decode_split.cu", defines, tmp_path)
    assert "#pragma once // variant" in src and "#pragma once // variant" not in shipped
    assert _kernels.program_source("hold.cu", {}, tmp_path) == _kernels.program_source("hold.cu", {})


def test_source_digest_tracks_defines():
    cfg = _policy.split_kernel_config("float16", 128)
    base = _kernels.source_digest("decode_split.cu", cfg.defines())
    assert base == _kernels.source_digest("decode_split.cu", dict(cfg.defines()))
    assert base != _kernels.source_digest("decode_split.cu", dict(cfg.defines(), STAGES=cfg.stages + 1))
    other = _policy.split_kernel_config("bfloat16", 128)
    assert base != _kernels.source_digest("decode_split.cu", other.defines())
    merge = {"IN_DTYPE": 0, "OUT_DTYPE": 0, "VEC": 4}
    assert (_kernels.source_digest("merge_states.cu", merge)
            != _kernels.source_digest("merge_states.cu", dict(merge, VEC=1)))


def test_kernel_dir_holds_the_sources():
    d = _kernels.kernel_dir()
    for name in ("decode_split.cu", "merge_states.cu", "common.cuh",
                 "read_ceiling.cu", "hold.cu", "step_traffic.cu"):
        assert (d / name).is_file(), d


def test_kernel_sources_override_is_scoped(tmp_path):
    """A/B of kernel variants without touching the shipped files: inside kernel_sources(folder)
    the folder's files are used, outside the shipped ones again."""
    defines = _policy.split_kernel_config("float16", 128).defines()
    shipped = _kernels.program_source("decode_split.cu", defines)
    split = (_kernels.kernel_dir() / "decode_split.cu").read_text()
    (tmp_path / "decode_split.cu").write_text("// variant\n" + split)
    with _kernels.kernel_sources(tmp_path):
        assert "// variant\n" in _kernels.program_source("decode_split.cu", defines)
        assert _kernels.program_source("hold.cu", {}) == _kernels.program_source("hold.cu", {}, None)
    assert _kernels.program_source("decode_split.cu", defines) == shipped


def _mutant_configs(name: str) -> list:
    """The builds whose code a mutant changes, as the GPU tests run it: the append's store in
    the 16-bit one-token path (contiguous and paged caches; an fp8 cache stores through
    cd_quantize_new_rows), the scales in the fp8 shapes per tensor or head and per token."""
    if name == "append_not_stored":
        cfg = _policy.split_kernel_config("float16", 128)
        return [cfg, dataclasses.replace(cfg, paged=True)]
    configs = [c for c in _policy.fp8_kernel_configs("float16", 128, "e4m3")
               if c.l2_evict_first and c.num_warps == 8]
    assert {c.kv_scale_token for c in configs} == {False, True}
    return configs


@pytest.mark.parametrize("name", sorted(KERNEL_MUTANTS))
def test_kernel_mutants_still_apply_and_compile(nvrtc, tmp_path, name):
    """The broken kernels that GPU tests expect a check to catch (tests/helpers.py): each line a
    mutant replaces still stands in the source once, and the mutant builds into machine code
    that differs from the shipped kernel's in every build its GPU test runs (a mutant whose lines
    became dead code there would test nothing), so a kernel change that moves those lines fails
    here, on any machine."""
    (tmp_path / "decode_split.cu").write_text(mutant_source(name))
    for cfg in _mutant_configs(name):
        assert cfg.runtime_options, cfg  # (the append and the scales are runtime options)
        shipped, _ = _kernels.compile_for_arch("decode_split.cu", cfg.defines(), "sm_90")
        with _kernels.kernel_sources(tmp_path):
            cubin, _ = _kernels.compile_for_arch("decode_split.cu", cfg.defines(), "sm_90")
        assert cubin[:4] == b"\x7fELF"
        assert cubin != shipped, f"mutant {name} changes nothing in {cfg}"
