"""Constants that the launch policy (cupydecode/_policy.py) and the CUDA sources must agree on,
read from the kernel sources themselves (no GPU needed)."""

from __future__ import annotations

import re

from cupydecode import _policy as P
from cupydecode._kernels import kernel_dir

KERNELS = kernel_dir()


def _define(filename: str, name: str, pattern: str = r"^#define {name} (\d+)") -> int:
    """The integer a source line of kernels/``filename`` gives ``name`` (a #define by default)."""
    text = (KERNELS / filename).read_text()
    m = re.search(pattern.format(name=name), text, re.M)
    assert m, f"{name} not found in kernels/{filename}"
    return int(m.group(1))


def test_merge_group_matches_states_per_trip():
    assert _define("common.cuh", "CD_MERGE_GROUP") == P.MERGE_STATES_PER_TRIP


def test_merge_kernel_warps_match_launch_policy():
    assert _define("merge_states.cu", "CD_MERGE_MAX_WARPS") == P.MERGE_WARPS


def test_fused_merge_pass_matches_policy():
    nv = _define("decode_split.cu", "MERGE_NV", r"constexpr int {name} = (\d+);")
    assert 32 * nv == P.FUSED_PASS


def test_merge_kernel_parameters_match_prepared_launch():
    """A plan launches merge_states.cu from packed bytes (decode._MERGE_PARAMS): its parameter
    list, read from the source, must have the types and order the packing assumes."""
    import struct

    from cupydecode.decode import _MERGE_OFFSETS, _MERGE_PARAMS  # imports no CuPy

    text = (KERNELS / "merge_states.cu").read_text()
    params = re.search(r"cd_merge_states\(([^)]*)\)", text).group(1).split(",")
    codes = ["Q" if "*" in p else "q" if "long long" in p else "i" for p in params]
    assert codes == ["Q", "Q", "Q", "Q", "i", "q", "i", "i", "Q", "i"]
    offsets, at = [], 0
    for c in codes:  # natural alignment, as the CUDA ABI lays the parameters out
        size = struct.calcsize(c)
        at = -(-at // size) * size
        offsets.append(at)
        at += size
    assert tuple(offsets) == _MERGE_OFFSETS
    assert _MERGE_PARAMS.format.lstrip("<") == "4Qi4xqiiQi" and _MERGE_PARAMS.size == at


def test_split_kernel_parameters_are_declared_once():
    """struct cd_decode_params is built from the list in kernels/decode_params.cuh, and the host
    packs that same list (decode._PARAMS, in the order _launch passes the values): the packing
    of the fields: 17 pointers (ALiBi's slopes, the sinks, the fp8 scales and tokens_after
    last), 19 int64 strides (k_new's and v_new's, then q's and out's token strides last), 8
    int32, a float32, an int32, the soft-cap's two float32, n_new, window_left, seqlens_64,
    table_64, q_len and the fp8 per-tensor scales (last). 364 bytes, padded to 368 (a whole
    number of 8-byte words), all inside the buffer
    StructLaunch packs into (whole 8-byte words). The list keeps falling alignment, which the
    kernel asserts (cd_falling_alignment)."""
    from cupydecode.decode import _LAUNCH_ORDER, _PARAM_LIST, _PARAMS  # imports no CuPy

    assert (_PARAMS.format == "<" + "Q" * 17 + "q" * 19 + "i" * 8 + "fiffiiiiiff"
            and _PARAMS.size == 364)
    assert _LAUNCH_ORDER[-3:] == ("q_len", "k_scale_all", "v_scale_all")
    assert -(-_PARAMS.size // 8) * 8 == 368
    rank = {"PTR": 8, "I64": 8, "I32": 4, "F32": 4}
    sizes = [rank[kind] for kind, _ in _PARAM_LIST]
    assert sizes == sorted(sizes, reverse=True), _PARAM_LIST
    assert tuple(name for _, name in _PARAM_LIST) == _LAUNCH_ORDER
    split = (KERNELS / "decode_split.cu").read_text()
    assert '#include "decode_params.cuh"' in split
    body = re.search(r"struct cd_decode_params \{(.*?)\};", split, re.S).group(1)
    assert body.strip() == "CD_DECODE_PARAMS(CD_PARAM_FIELD)", body
    assert "cd_falling_alignment({CD_DECODE_PARAMS(CD_PARAM_ALIGN)})" in split


def test_a_variant_with_another_parameter_list_is_refused(tmp_path):
    """kernel_sources() may swap kernel files, but not the parameter list the host packs."""
    import pytest

    from cupydecode import _kernels
    from cupydecode.decode import _split_function

    text = (KERNELS / "decode_params.cuh").read_text()
    (tmp_path / "decode_params.cuh").write_text(
        text.replace("X(F32, float, v_scale_all)", "X(F32, float, v_scale_all) X(I32, int, extra)"))
    with _kernels.kernel_sources(tmp_path):
        assert _kernels.param_list("decode_params.cuh", "CD_DECODE_PARAMS")[-1] == ("I32", "extra")
        with pytest.raises(RuntimeError, match="parameter list"):
            _split_function(P.split_kernel_config("float16", 128))
