"""Host arrays are refused before any GPU work, so these checks run on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import cupydecode
from cupydecode import _validate as V


@pytest.fixture
def cupy_importable():
    try:
        import cupy  # noqa: F401  (importing CuPy needs no GPU)
    except Exception as exc:
        pytest.skip(f"cupy cannot be imported ({type(exc).__name__}: {exc})")


def _decode_args(dtype=np.float16):
    q = np.zeros((2, 8, 128), dtype)
    k = np.zeros((2, 16, 2, 128), dtype)
    return q, k, k.copy()


@pytest.mark.parametrize("form", ["ndarray", "list", "scalar"])
def test_flash_decode_refuses_host_q(cupy_importable, form):
    q, k, v = _decode_args()
    q = {"ndarray": q, "list": q.tolist(), "scalar": 1.0}[form]
    with pytest.raises(TypeError) as info:
        cupydecode.flash_decode(q, k, v)
    msg = str(info.value)
    assert msg.startswith("q:") and "move it to the GPU" in msg, msg


def test_flash_decode_refuses_host_arrays_with_every_option(cupy_importable):
    q, k, v = _decode_args(np.float32)
    with pytest.raises(TypeError, match=r"^q: .*move it to the GPU"):
        cupydecode.flash_decode(q, k, v, [3, 4], softmax_scale=0.1, num_splits=3,
                                return_lse=True, out=np.zeros_like(q))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_merge_states_refuses_host_arrays(cupy_importable, dtype):
    o = np.zeros((3, 4, 64), dtype)
    lse = np.zeros((3, 4), np.float32)
    with pytest.raises(TypeError) as info:
        cupydecode.merge_states(o, lse)
    msg = str(info.value)
    assert msg.startswith("o_parts:") and "move it to the GPU" in msg, msg


def test_error_message_suggests_the_fix(cupy_importable):
    q, k, v = _decode_args()
    with pytest.raises(TypeError, match=r"cupy\.asarray\(q\)"):
        cupydecode.flash_decode(q, k, v)


def test_import_does_not_import_cupy():
    """``import cupydecode`` and the NumPy reference work where CuPy cannot even load."""
    code = ("import sys, cupydecode, cupydecode.reference, cupydecode._policy; "
            "assert 'cupy' not in sys.modules, 'cupy imported at import time'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_documented_submodules_after_a_plain_import():
    """The names the README uses (cupydecode.workloads.alibi_slopes,
    cupydecode.distributed.ShardedDecodePlan) resolve after ``import cupydecode`` alone, still
    without CuPy; an unknown name is an AttributeError."""
    code = ("import sys, cupydecode; cupydecode.workloads.alibi_slopes(8); "
            "cupydecode.distributed.ShardedDecodePlan; "
            "assert not hasattr(cupydecode, 'nonexistent'); "
            "assert 'cupy' not in sys.modules, 'cupy imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("kwargs, name", [
    (dict(max_seqlen=2**31), "max_seqlen"),
    (dict(max_seqlen=-1), "max_seqlen"),
    (dict(split_size=2**31), "split_size"),
    (dict(num_splits=0), "num_splits"),
    (dict(batch=True), "batch"),
    (dict(batch=65536), "batch"),
    (dict(enable_pdl=1), "enable_pdl"),
    (dict(logits_soft_cap=-1.0), "logits_soft_cap"),
    (dict(logits_soft_cap=float("nan")), "logits_soft_cap"),
    (dict(logits_soft_cap="50"), "logits_soft_cap"),
    (dict(num_heads=0), "num_heads"),
    (dict(num_heads=8.0), "num_heads"),
    (dict(num_kv_heads=0), "num_kv_heads"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(head_dim=128.0), "head_dim"),
    (dict(head_dim=0), "head_dim"),
    (dict(head_dim=100), "head_dim"),
    (dict(head_dim=384), "head_dim"),
    (dict(head_dim=520), "head_dim"),
    (dict(head_dim=512, dtype="float32"), "head_dim"),
    (dict(head_dim=512, kv_dtype="e4m3"), "head_dim"),
    (dict(max_seqlen=64.0), "max_seqlen"),
    (dict(dtype="int8"), "dtype"),
    (dict(dtype=object()), "dtype"),
    (dict(num_splits=2, split_size=256), "num_splits and split_size"),
    (dict(merge="fast"), "merge"),
    (dict(alibi=1), "alibi"),
    (dict(window_left=-2), "window_left"),
    (dict(page_size=0), "page_size"),
    (dict(page_size=16.0), "page_size"),
    (dict(page_size=2**31), "page_size"),
    (dict(q_len=0), "q_len"),
    (dict(q_len=65), "q_len"),
    (dict(q_len=2.0), "q_len"),
    (dict(kv_dtype="fp8"), "kv_dtype"),
    (dict(kv_dtype=1), "kv_dtype"),
    (dict(kv_dtype="e4m3", dtype="float32"), "dtype"),
    (dict(kv_dtype="e4m3", head_dim=40), "head_dim"),
    (dict(tuning=5), "tuning"),
    (dict(tuning=cupydecode.Tuning(kv_groups=1)), "tuning.kv_groups"),
])
def test_plan_arguments_checked_before_any_gpu_use(cupy_importable, kwargs, name):
    """Token counts are int32 in the kernels: out-of-range plan arguments fail by name, early."""
    args = dict(batch=1, num_heads=8, num_kv_heads=2, head_dim=128, max_seqlen=1024,
                dtype="float16")
    args.update(kwargs)
    with pytest.raises((TypeError, ValueError), match=rf"^{name}: expected"):
        cupydecode.DecodePlan(**args)


@pytest.mark.parametrize("value", ["no", 1, None, np.array(True)])
def test_return_lse_is_true_or_false(cupy_importable, value):
    """A truthy non-bool would silently change what flash_decode returns: refused by name,
    before any other check."""
    q, k, v = _decode_args()
    with pytest.raises(TypeError, match=r"^return_lse: expected True or False, got "):
        cupydecode.flash_decode(q, k, v, return_lse=value)


def test_numpy_bools_are_flags(cupy_importable):
    assert V.check_flag(np.True_, "return_lse") is True and V.check_flag(False, "alibi") is False
    q, k, v = _decode_args()  # (past the flag, host q is refused as usual)
    with pytest.raises(TypeError, match=r"^q: "):
        cupydecode.flash_decode(q, k, v, return_lse=np.True_)


class _Fake:
    """A GPU-array look-alike whose DLPack and array-interface exports can be made to fail."""

    def __init__(self, dtype="float16", dlpack_error=None, cai=None, cai_error=None):
        self.dtype = dtype
        self._dlpack_error, self._cai, self._cai_error = dlpack_error, cai, cai_error

    def __dlpack__(self, *args, **kwargs):
        raise self._dlpack_error or BufferError("no DLPack here")

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA

    @property
    def __cuda_array_interface__(self):
        if self._cai_error is not None:
            raise self._cai_error
        if self._cai is None:
            raise AttributeError("__cuda_array_interface__")
        return self._cai


def test_bfloat16_without_dlpack_is_refused_not_misread(cupy_importable):
    """The array interface has no typestr for bfloat16 (torch 2.5 says '<f2', i.e. float16):
    a bfloat16 tensor that DLPack cannot bring in is refused by name."""
    fake = _Fake("torch.bfloat16", cai={"shape": (2, 8, 128), "typestr": "<f2", "data": (0, False),
                                         "version": 3})
    with pytest.raises(TypeError, match=r"^q: expected a bfloat16 GPU array .*DLPack"):
        cupydecode.flash_decode(fake, fake, fake)


def test_array_interface_that_raises_names_the_argument(cupy_importable):
    """torch < 2.5 raises KeyError from __cuda_array_interface__ for bfloat16."""
    fake = _Fake("torch.bfloat16", cai_error=KeyError("torch.bfloat16"))
    with pytest.raises(TypeError, match=r"^q: expected a GPU array, got _Fake whose "
                                        r"__cuda_array_interface__ failed \(KeyError"):
        cupydecode.flash_decode(fake, fake, fake)


def test_dlpack_only_object_that_fails_names_the_argument(cupy_importable):
    fake = _Fake(dlpack_error=BufferError("a CPU tensor"))
    with pytest.raises(TypeError, match=r"^q: expected a GPU array, got _Fake that CuPy cannot "
                                        r"view on the GPU"):
        cupydecode.flash_decode(fake, fake, fake)


@pytest.mark.parametrize("scale", [1e39, -1e39, 3e38])
def test_softmax_scale_beyond_float32_is_refused(scale):
    with pytest.raises(ValueError, match=r"^softmax_scale: expected \|softmax_scale\| <= "):
        V.check_scale(scale, 128)
    assert V.check_scale(1e30, 128) == 1e30


def test_is_capturing_treats_a_refused_query_as_capturing():
    from cupydecode import decode

    class S:
        def __init__(self, result):
            self.result = result

        def is_capturing(self):
            if isinstance(self.result, Exception):
                raise self.result
            return self.result

    assert decode._is_capturing(S(False)) is False
    assert decode._is_capturing(S(True)) is True
    assert decode._is_capturing(S(RuntimeError("cudaErrorStreamCaptureImplicit"))) is True


def test_plan_without_a_gpu_says_so_plainly(cupy_importable):
    """No driver or no GPU: DecodePlan says what is missing (not a raw CUDA error code)."""
    from cupydecode import _kernels

    why = _kernels.gpu_problem()
    if why is None:
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match=r"^DecodePlan: ") as info:
        cupydecode.DecodePlan(1, 8, 2, 128, 1024, "float16")
    assert str(info.value) == f"DecodePlan: {why}"


@pytest.mark.parametrize("cap, exc", [(-1.0, ValueError), (float("inf"), ValueError),
                                      (float("nan"), ValueError), (1e-40, ValueError),
                                      (1e39, ValueError), (1001.0, ValueError), ("50", TypeError),
                                      (True, TypeError), ([50.0], TypeError)])
def test_soft_cap_errors_name_the_argument(cap, exc):
    with pytest.raises(exc, match=r"^logits_soft_cap: expected a"):
        V.check_soft_cap(cap)


def test_soft_cap_values():
    """None and 0 (FlashAttention's "no cap") mean none; a cap gives the kernel's two factors;
    a softmax_scale / cap ratio beyond float32 is refused naming both."""
    import math

    from cupydecode._policy import LOG2E

    assert V.check_soft_cap(None) is None and V.check_soft_cap(0) is None
    assert V.check_soft_cap(0.0) is None and V.check_soft_cap(50) == 50.0
    assert V.check_soft_cap(V.MAX_SOFT_CAP) == V.MAX_SOFT_CAP
    assert V.soft_cap_args(0.125, None) == (0.0, 0.0)
    cap_in, cap_out = V.soft_cap_args(0.125, 50.0)
    assert math.isclose(cap_in, 2 * LOG2E * 0.125 / 50) and math.isclose(cap_out, 50 * LOG2E)
    # tanh as the kernel computes it: cap_out − 2·cap_out / (2^(qk·cap_in) + 1), in log2 units
    qk = np.linspace(-3000, 3000, 101)
    kernel = (cap_out - 2 * cap_out / (np.exp2(qk * cap_in) + 1)) / LOG2E
    assert np.allclose(kernel, 50 * np.tanh(0.125 * qk / 50), atol=1e-9)
    with pytest.raises(ValueError, match=r"^softmax_scale/logits_soft_cap: expected"):
        V.soft_cap_args(1e38, 1e-30)


@pytest.mark.parametrize("cap", [30.0, 50.0, 1000.0])
def test_soft_cap_in_float32_is_accurate_up_to_the_largest_cap(cap):
    """The kernel's formula evaluated in float32 (exact exp2; the GPU's ex2 adds ~2 ulp):
    softmax outputs within 1e-4 relative of float64 c·tanh(s/c) for scores up to ±100, at
    every accepted cap (float32's tolerance)."""
    from cupydecode._policy import LOG2E

    rng = np.random.default_rng(7)
    v = rng.standard_normal((2048, 64))
    cap_in, cap_out = (np.float32(x) for x in V.soft_cap_args(1.0, cap))
    for spread in (1.0, 10.0, 100.0):
        s = rng.standard_normal((16, 2048)) * spread
        e = np.exp2(s.astype(np.float32) * cap_in)
        got = (cap_out - np.float32(2) * cap_out / (e + np.float32(1))).astype(np.float64)
        want = cap * np.tanh(s / cap) * LOG2E

        def attend(x):
            w = np.exp2(x - x.max(axis=1, keepdims=True))
            return (w / w.sum(axis=1, keepdims=True)) @ v
        o, ref = attend(got), attend(want)
        assert np.linalg.norm(o - ref) / np.linalg.norm(ref) < 1e-4, (cap, spread)


def test_new_tokens_both_or_neither(cupy_importable):
    """k_new without v_new (or the reverse) is refused by name, before anything else."""
    k_new = np.zeros((2, 1, 2, 128), np.float16)
    with pytest.raises(ValueError, match=r"^v_new: expected a GPU array like k_new \(appending "
                                         r"takes both k_new and v_new, or neither\), got None$"):
        V.check_new_tokens(k_new, None, 2, 2, 128, "float16")
    with pytest.raises(ValueError, match=r"^k_new: expected a GPU array like v_new .*got None$"):
        V.check_new_tokens(None, k_new, 2, 2, 128, "float16")


@pytest.mark.parametrize("form", ["ndarray", "list"])
def test_new_tokens_on_the_host_are_refused(cupy_importable, form):
    """Host k_new/v_new are refused (a plan never copies): the first one named."""
    k_new = np.zeros((2, 1, 2, 128), np.float16)
    k_new = k_new if form == "ndarray" else k_new.tolist()
    with pytest.raises(TypeError, match=r"^k_new: expected a GPU array .*move it to the GPU"):
        V.check_new_tokens(k_new, k_new, 2, 2, 128, "float16")


def test_flash_decode_with_new_tokens_refuses_host_arrays(cupy_importable):
    q, k, v = _decode_args()
    k_new = np.zeros((2, 1, 2, 128), np.float16)
    with pytest.raises(TypeError, match=r"^q: .*move it to the GPU"):
        cupydecode.flash_decode(q, k, v, [3, 4], k_new=k_new, v_new=k_new)


def test_new_token_strides_are_in_elements():
    """(batch, token, head) strides in elements; 3 dims hold one token (stride 0)."""
    x = np.zeros((3, 1, 4, 64), np.float16)
    assert V.new_token_strides(x) == (4 * 64, 4 * 64, 64)
    assert V.new_token_strides(x[:, 0]) == (4 * 64, 0, 64)
    assert V.new_token_strides(np.zeros((3, 8, 2, 64), np.float32)[:, 0, ::2]) == (
        8 * 2 * 64, 0, 2 * 64)


@pytest.mark.parametrize("window,exc", [(-2, ValueError), (1.5, TypeError), (True, TypeError),
                                        ("16", TypeError), (2**31, ValueError)])
def test_window_errors_name_the_argument(window, exc):
    with pytest.raises(exc, match=r"^window_left: expected an int"):
        V.check_window(window)


def test_window_values():
    """None and −1 (FlashAttention's "no window") mean none; W ≥ 0 (NumPy ints too) is kept."""
    assert V.check_window(None) is None and V.check_window(-1) is None
    assert V.check_window(0) == 0 and V.check_window(np.int64(4095)) == 4095
    assert V.check_window(V.MAX_TOKENS) == V.MAX_TOKENS


def test_alibi_slopes_must_match_the_plan():
    """An ALiBi plan needs its slopes; a plan without ALiBi refuses them (both before any
    launch, naming alibi_slopes)."""
    with pytest.raises(ValueError, match=r"^alibi_slopes: expected a \(num_heads=8,\) float32"):
        V.check_alibi_slopes(None, True, 8)
    with pytest.raises(ValueError, match=r"^alibi_slopes: expected None for a plan built without"):
        V.check_alibi_slopes(np.ones(8, np.float32), False, 8)
    assert V.check_alibi_slopes(None, False, 8) is None


def test_merge_sinks_shape_must_end_the_rows_shape():
    with pytest.raises(ValueError, match=r"^sinks: expected a shape that ends the rows' shape"):
        V.check_merge_sinks(np.zeros(5, np.float32), (2, 8))
    with pytest.raises(ValueError, match=r"^sinks: expected finite values"):
        V.check_merge_sinks([0.0, np.inf], (2, 2))
    with pytest.raises(TypeError, match=r"^sinks: expected real numbers"):
        V.check_merge_sinks(np.array([True, False]), (2, 2))
    assert V.check_merge_sinks(None, (2, 8)) is None


def _policy_config(**kw):
    from cupydecode import _policy

    return _policy.split_kernel_config("float16", 128, **kw)


@pytest.mark.parametrize("tuning, exc, match", [
    ("4x2", TypeError, r"tuning: expected a cupydecode.Tuning or None, got str"),
    (cupydecode.Tuning(num_warps=8.0), TypeError, r"tuning.num_warps: expected an int"),
    (cupydecode.Tuning(stages=True), TypeError, r"tuning.stages: expected an int"),
    (cupydecode.Tuning(l2_evict_first=1), TypeError, r"tuning.l2_evict_first: expected True"),
    (cupydecode.Tuning(kv_groups="no"), TypeError, r"tuning.kv_groups: expected True"),
    (cupydecode.Tuning(num_warps=0), ValueError, r"tuning.num_warps: expected a multiple of 1.*got 0"),
    (cupydecode.Tuning(num_warps=64), ValueError, r"tuning.num_warps: .*got 64"),
    (cupydecode.Tuning(stages=1), ValueError, r"tuning.stages: expected 2 to 16, got 1"),
    (cupydecode.Tuning(stages=12), ValueError, r"tuning: expected a block shape within the GPU's "
                                               r"232448 bytes.*4 warps x 12 stages"),
])
def test_tuning_errors_name_the_field(tuning, exc, match):
    with pytest.raises(exc, match=match):
        V.check_tuning(tuning, _policy_config(), 232448)


def test_tuning_overrides_only_what_it_names():
    base = _policy_config()
    assert V.check_tuning(None, base, 232448) is base
    assert V.check_tuning(cupydecode.Tuning(), base, 232448) == base
    got = V.check_tuning(cupydecode.Tuning(num_warps=8, stages=2, l2_evict_first=False), base, 0)
    assert (got.num_warps, got.stages, got.l2_evict_first) == (8, 2, False)
    assert (got.m_tiles, got.heads_as_n, got.dtype) == (base.m_tiles, base.heads_as_n, base.dtype)
    m2 = _policy_config(m_tiles=2)
    with pytest.raises(ValueError, match=r"tuning.num_warps: expected a multiple of 2 from 2"):
        V.check_tuning(cupydecode.Tuning(num_warps=3), m2, 0)
    with pytest.raises(ValueError, match=r"tuning.warps_in_step"):
        V.check_tuning(cupydecode.Tuning(warps_in_step=True), m2, 0)


def test_tuning_accepts_every_policy_shape_and_refuses_what_cannot_build():
    """Tuning() leaves every shape the policy makes (M-tile blocks of 15 warps included, every
    switch on) as it is; one warp cannot copy a float32 256-dim row's 64 chunks; a paged
    multi-token plan's shared memory counts its mask words and new rows."""
    import dataclasses

    from cupydecode import _policy

    for cfg in _policy.compile_check_configs():
        for paged in (False, True):
            cc = dataclasses.replace(cfg, paged=paged)
            cc = _policy.multi_q_config(cc) if cfg.kv_per_block == 1 else cc  # (its own shape)
            assert V.check_tuning(cupydecode.Tuning(), cc, 232448) == cc
    f32 = _policy.split_kernel_config("float32", 256)
    with pytest.raises(ValueError, match=r"tuning.num_warps: expected at least 2 for float32"):
        V.check_tuning(cupydecode.Tuning(num_warps=1), f32, 0)
    big = dataclasses.replace(_policy.split_kernel_config("float16", 256), paged=True,
                              multi_q=True, num_warps=1, stages=13)
    assert big.smem_bytes + _policy.SPLIT_STATIC_SMEM_BYTES > 232448 > dataclasses.replace(
        big, paged=False, multi_q=False).smem_bytes
    with pytest.raises(ValueError, match=r"tuning: expected a block shape within"):
        V.check_tuning(cupydecode.Tuning(num_warps=1, stages=13), dataclasses.replace(
            big, num_warps=4, stages=2), 232448)


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2"])
def test_kv_dtype_names(kv_dtype):
    assert V.check_kv_dtype(kv_dtype) == kv_dtype


@pytest.mark.parametrize("bad, kind", [("fp8", ValueError), ("E4M3", ValueError),
                                       (None, TypeError), (8, TypeError)])
def test_kv_dtype_errors_name_the_argument(bad, kind):
    with pytest.raises(kind, match=r"kv_dtype: expected 'e4m3' or 'e5m2', got"):
        V.check_kv_dtype(bad)


@pytest.mark.parametrize("scale, exc, match", [
    (None, ValueError, r"k_scale: expected a float > 0, a \(8,\) float32 device array .* "
                       r"\(2, 5, 8\) float32 device array .*got None"),
    (0.0, ValueError, r"k_scale: expected a finite float > 0 .*got 0.0"),
    (-2, ValueError, r"k_scale: expected a finite float > 0 .*got -2.0"),
    (float("inf"), ValueError, r"k_scale: expected a finite float > 0 .*got inf"),
    (1e39, ValueError, r"k_scale: expected a finite float > 0"),
    (1e-50, ValueError, r"k_scale: expected a finite float > 0 \(in float32"),
    (True, TypeError, r"k_scale: expected a float > 0"),
    ([1.0] * 8, TypeError, r"k_scale: .*host arrays are not copied"),
    (np.ones(8, np.float32), TypeError, r"k_scale: .*host arrays are not copied"),
])
def test_kv_scale_host_values_are_checked(scale, exc, match):
    with pytest.raises(exc, match=match):
        V.check_kv_scale(scale, "k_scale", (2, 5), 8)


def test_kv_scale_modes_for_host_values():
    assert V.check_kv_scale(None, "scale", (2, 5), 8, allow_none=True) == (0, None, 1.0)
    assert V.check_kv_scale(0.25, "scale", (2, 5), 8) == (1, None, 0.25)
    assert V.check_kv_scale(np.float32(2), "scale", (2, 5), 8) == (1, None, 2.0)


def test_head_dim_messages():
    """What head_dims exist is said in the message: the range, 512, and 512's dtypes."""
    with pytest.raises(ValueError, match=r"^head_dim: expected head_dim a multiple of 8 from 32 "
                                         r"to 256, or 512, got 520$"):
        V.check_head_dim(520, "float16", "head_dim")
    with pytest.raises(ValueError, match=r"^q: expected .* for float32 \(512 takes float16 or "
                                         r"bfloat16\), got 512$"):
        V.check_head_dim(512, "float32", "q")
    for d in (32, 80, 256, 512):
        V.check_head_dim(d, "bfloat16", "q")
    with pytest.raises(ValueError, match=r"^head_dim: expected head_dim at most 256 with "
                                         r"kv_dtype='e4m3' \(512 takes 16-bit caches only\)"):
        V.check_fp8_query("float16", 512, "e4m3", "dtype", "head_dim")


@pytest.mark.parametrize("lengths, q_len, appending, in_cache, match", [
    # appending: the new tokens are written at cache_seqlens[b] … + q_len − 1, inside the cache
    (None, 1, True, False, r"lengths <= max_seqlen - 1 = 255 .*got None \(every sequence full\)"),
    (256, 1, True, False, r"lengths <= max_seqlen - 1 = 255 .*k_new/v_new's token .*got a length of 256"),
    ([255, 256, 0], 1, True, False, r".*got a length of 256"),
    (np.array([253, 7]), 4, True, False, r"lengths <= max_seqlen - 4 = 252 .*4 tokens.*got a length of 253"),
    # several query tokens already in the cache: each sequence holds them (0: an empty slot)
    ([64, 3], 4, False, True, r"lengths >= q_len=4 .*got a length of 3"),
    (2, 4, False, True, r"lengths >= q_len=4 .*got a length of 2"),
])
def test_host_lengths_must_hold_the_query_tokens(lengths, q_len, appending, in_cache, match):
    with pytest.raises(ValueError, match=rf"^cache_seqlens: expected {match}"):
        V.check_lengths_fit(lengths, q_len, 256, appending, in_cache)


@pytest.mark.parametrize("lengths, q_len, appending, in_cache", [
    ([255, 0, 17], 1, True, False), (252, 4, True, False), ([0, 252], 4, True, False),
    ([64, 0], 4, False, True), (None, 4, False, True),
    ([256, 256], 4, False, False),          # a shard's query tokens after its cache: no rule
    ([256], 1, False, True),                # one query token: any length
    (np.array(5), 1, True, False),          # 0-d, wrong type or range: check_seqlens' refusals
    (300, 1, False, True), (True, 1, True, False), (2.5, 4, False, True),
])
def test_host_lengths_that_hold_the_query_tokens_pass(lengths, q_len, appending, in_cache):
    V.check_lengths_fit(lengths, q_len, 256, appending, in_cache)
    if lengths is None and not appending:  # every sequence full, even a cache shorter than q_len
        V.check_lengths_fit(None, q_len, 2, False, in_cache)


def test_ragged_host_sequences_name_their_argument(cupy_importable):
    ragged = [[1, 2], [3]]
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected a rectangular sequence"):
        V.check_seqlens(ragged, 2, 16)
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected a rectangular sequence"):
        V.check_lengths_fit(ragged, 4, 16, True, False)
    with pytest.raises(ValueError, match=r"^block_table: expected a rectangular sequence"):
        V.check_block_table(ragged, 2, 16, 4)
    with pytest.raises(ValueError, match=r"^sinks: expected a rectangular sequence"):
        V.check_head_values([[0.5], [0.5, 1.0]], "sinks", 2)
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected shape \(2,\)"):
        V.check_seqlens(np.array(5), 2, 16)  # a 0-d host array


def test_dtype_arguments_are_named_and_checked(cupy_importable):
    assert V.check_dtype_arg("float16", "dtype") == "float16"
    assert V.check_dtype_arg(np.float32, "dtype") == "float32"
    assert V.check_dtype_arg(np.dtype(np.float16), "dtype") == "float16"
    for bad, match in (("int8", r"one of \(float16, bfloat16, float32\), got int8"),
                       ([1], r"a NumPy dtype or dtype name, got \[1\]"),
                       ("float17", r"a NumPy dtype or dtype name, got 'float17'")):
        with pytest.raises(TypeError, match=rf"^dtype: expected {match}"):
            V.check_dtype_arg(bad, "dtype")


def test_fp8_codes_must_be_uint8_or_their_formats_float8():
    import ml_dtypes

    V.check_fp8_cache(np.zeros(4, np.uint8), "codes", "e5m2")
    V.check_fp8_cache(np.zeros(4, ml_dtypes.float8_e4m3fn), "codes", "e4m3")
    V.check_fp8_cache(np.zeros(4, ml_dtypes.float8_e5m2), "codes", "e5m2")
    for arr, fmt in ((np.zeros(4, ml_dtypes.float8_e4m3fn), "e5m2"),
                     (np.zeros(4, ml_dtypes.float8_e5m2), "e4m3"), (np.zeros(4, np.int8), "e4m3")):
        with pytest.raises(TypeError, match=rf"^codes: expected uint8 codes or .* kv_dtype='{fmt}'"):
            V.check_fp8_cache(arr, "codes", fmt)


@pytest.mark.parametrize("bad", [5.0, True, "8", 1j])
def test_lengths_of_another_kind_are_named(cupy_importable, bad):
    with pytest.raises(TypeError, match=r"^cache_seqlens: expected None, an int, a host sequence "
                                        r"of 2 ints, or a \(2,\) int32/int64 device array, got "):
        V.check_seqlens(bad, 2, 16)
    with pytest.raises(TypeError, match=r"^cache_seqlens: expected None, an int, or a \(2,\) "
                                        r"int32/int64 device array, got "):
        V.check_seqlens(bad, 2, 16, allow_host_array=False)  # (a plan's run)


def test_a_non_finite_host_value_is_shown_with_its_index():
    with pytest.raises(ValueError, match=r"^alibi_slopes: expected finite values, got nan at "
                                        r"index 2"):
        V.check_head_values([0.5, 0.25, float("nan")], "alibi_slopes", 3)
