"""fp8 KV caches: ``quantize_kv`` writes fp8 codes (and per-row scales) from fp16/bf16/fp32 K or
V, on the GPU, by the rule of ``reference.quantize_kv`` (kernels/quantize_kv.cu, fp8.cuh);
``dequantize_kv`` their values back (kernels/dequantize_kv.cu, with fp8.cuh's decoding into
16-bit pairs, the one the attention kernels' tile math is to use)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import _kernels, _policy
from . import _validate as V
from .decode import _sm_count

if TYPE_CHECKING:
    import cupy

ArrayLike = Any

_QUANTIZE = ("quantize_kv.cu", "cd_quantize_kv")
_DEQUANTIZE = ("dequantize_kv.cu", "cd_dequantize_kv")


def quantize_kv(x: ArrayLike, kv_dtype: str = "e4m3", scale: float | ArrayLike | None = None,
                *, out: ArrayLike | None = None) -> tuple[cupy.ndarray, float | cupy.ndarray]:
    """fp8 codes of ``x`` (K or V rows: (tokens, num_kv_heads, head_dim) or (batch or
    num_pages, max_seqlen or page_size, num_kv_heads, head_dim); float16, bfloat16 or float32 on
    the GPU; leading strides free, head_dim contiguous): returns ``(codes, scale)``.

    ``kv_dtype``: "e4m3" (largest finite 448) or "e5m2" (57344). Each element becomes the code
    nearest to x / s (float32 division; ties to even), saturated to ± the largest finite code
    (infinities too); NaN stays NaN. ``scale`` s:

    - None: one per (token, KV head), s = max |x| of the row / the largest finite value (1 where
      that is 0 or not finite), returned as a float32 array of x's shape without head_dim;
    - a float > 0: one for the tensor (returned as given);
    - a (num_kv_heads,) float32 device array: one per KV head;
    - a float32 device array of x's shape without head_dim: one per token and KV head.

    ``out``: a uint8 device array of x's shape to write the codes into (e.g. a slice of a cache;
    leading strides free, head_dim contiguous); by default a new one. The scales a cache needs
    for attention are the ones returned (the same shape rules: ``k_scale``, ``v_scale``).

    Raises:
        TypeError, ValueError: an argument of the wrong type, dtype, shape, layout or device, a
            non-positive or non-finite host scale, or an unknown kv_dtype, before any launch.
    """
    cupy = _kernels.import_cupy()
    x = V.as_device_array(x, "x")
    fmt = V.check_kv_dtype(kv_dtype)
    dt = V.check_dtype(x, "x")
    _check_rows(x, "x")
    mode, scale_arr, scale_all = V.check_kv_scale(scale, "scale", tuple(x.shape[:-2]),
                                                  x.shape[-2], allow_none=True)
    out = _rows_out(cupy, out, x, "x", np.dtype(np.uint8))
    scale_out = cupy.empty(x.shape[:-1], cupy.float32) if mode == 0 else None
    _launch_rows(cupy, _QUANTIZE, {"FP8": V.KV_DTYPES.index(fmt), "IN_DTYPE": _policy.DTYPE_IDS[dt],
                                   "SCALE_MODE": mode},
                 x, out, (scale_arr, scale_out), scale_all)
    return out, (scale_out if mode == 0 else scale)


def dequantize_kv(codes: ArrayLike, kv_dtype: str = "e4m3", scale: float | ArrayLike = 1.0,
                  *, dtype: str = "float16", out: ArrayLike | None = None) -> cupy.ndarray:
    """Values of fp8 ``codes`` (uint8, or kv_dtype's ml_dtypes float8 type where CuPy holds one,
    of shape (tokens, num_kv_heads, head_dim) or (batch or num_pages, max_seqlen or page_size,
    num_kv_heads, head_dim) on the GPU; leading strides free, head_dim contiguous) in ``dtype``
    (float16, bfloat16 or float32: a name or NumPy dtype): value(code) · s in float32, rounded
    once to ``dtype``; NaN codes
    give NaN, e5m2's infinities ±inf. ``scale`` s as ``quantize_kv`` returns it: a float > 0
    (per tensor), a (num_kv_heads,) float32 device array (per KV head) or a float32 device array
    of the codes' shape without head_dim (per token and KV head). The inverse of
    ``quantize_kv`` up to its rounding; the rule of ``reference.dequantize_kv`` (float64 there).

    ``out``: a device array of the codes' shape and ``dtype`` to write into (leading strides
    free, head_dim contiguous); by default a new one.

    Raises:
        TypeError, ValueError: an argument of the wrong type, dtype, shape, layout or device, a
            non-positive or non-finite host scale, or an unknown kv_dtype, before any launch.
    """
    cupy = _kernels.import_cupy()
    codes = V.as_device_array(codes, "codes")
    fmt = V.check_kv_dtype(kv_dtype)
    V.check_fp8_cache(codes, "codes", fmt)
    if codes.dtype != np.uint8:
        codes = codes.view(cupy.uint8)
    dtype = V.check_dtype_arg(dtype, "dtype")
    _check_rows(codes, "codes")
    mode, scale_arr, scale_all = V.check_kv_scale(scale, "scale", tuple(codes.shape[:-2]),
                                                  codes.shape[-2])
    out = _rows_out(cupy, out, codes, "codes", _np_dtype(dtype))
    _launch_rows(cupy, _DEQUANTIZE, {"FP8": V.KV_DTYPES.index(fmt),
                                     "OUT_DTYPE": _policy.DTYPE_IDS[dtype], "SCALE_MODE": mode},
                 codes, out, (scale_arr,), scale_all)
    return out


def _np_dtype(name: str) -> np.dtype:
    """The NumPy dtype of an element type's name (bfloat16: ml_dtypes')."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _check_rows(x, name: str) -> None:
    """``x``: (tokens, num_kv_heads, head_dim) or (lead0, lead1, num_kv_heads, head_dim) rows of at
    most QUANTIZE_MAX_HEAD_DIM elements, head_dim contiguous."""
    if x.ndim not in (3, 4):
        V.fail(ValueError, name, "3 dimensions (tokens, num_kv_heads, head_dim) or 4 (batch or "
               "num_pages, tokens, num_kv_heads, head_dim)", f"shape {tuple(x.shape)}")
    head_dim = x.shape[-1]
    if not 1 <= head_dim <= _policy.QUANTIZE_MAX_HEAD_DIM:
        V.fail(ValueError, name, f"head_dim from 1 to {_policy.QUANTIZE_MAX_HEAD_DIM}", head_dim)
    if head_dim > 1 and x.size and x.strides[-1] != x.itemsize:  # (an empty array's strides: 0)
        V.fail(ValueError, name, "head_dim contiguous (stride 1 element)",
               f"stride {x.strides[-1] // x.itemsize}")


def _rows_out(cupy, out, x, x_name: str, dtype):
    """``out`` checked against ``x``'s shape and ``dtype`` (head_dim contiguous), or a new array."""
    if out is None:  # (bfloat16 as the view of 16-bit storage)
        return cupy.empty(x.shape, np.uint16 if dtype.itemsize == 2 else dtype).view(dtype)
    out = V.as_device_array(out, "out")
    if out.dtype != dtype:
        V.fail(TypeError, "out", f"dtype {V.dtype_name(dtype)}", V.dtype_name(out.dtype))
    if tuple(out.shape) != tuple(x.shape):
        V.fail(ValueError, "out", f"shape {tuple(x.shape)} ({x_name}'s)", f"shape {tuple(out.shape)}")
    if x.shape[-1] > 1 and out.size and out.strides[-1] != out.itemsize:
        V.fail(ValueError, "out", "head_dim contiguous", f"stride {out.strides[-1] // out.itemsize}")
    V.check_same_device({x_name: x, "out": out})
    return out


def _launch_rows(cupy, kernel: tuple[str, str], defines: dict, x, out, scales: tuple,
                 scale_all: float) -> None:
    """One launch of a row kernel (quantize_kv.cu, dequantize_kv.cu): a warp per (token, KV head)
    row of ``x`` into ``out``, the three leading axes by their element strides, the scale
    pointers ``scales`` (None: null) before them."""
    rows = int(np.prod(x.shape[:-1]))
    if rows == 0:
        return
    lead1 = x.shape[1] if x.ndim == 4 else 1
    xs = [s // x.itemsize for s in x.strides[:-1]]
    os_ = [s // out.itemsize for s in out.strides[:-1]]
    if x.ndim == 3:  # (tokens, H, D) as (tokens, 1, H, D)
        xs, os_ = [xs[0], 0, xs[1]], [os_[0], 0, os_[1]]
    fn = _kernels.get_function(*kernel, defines)
    blocks, threads = _policy.quantize_launch(rows, _sm_count(cupy.cuda.Device().id))
    _kernels.launch(fn, (blocks, 1, 1), (threads, 1, 1), (
        x, out, *(np.uint64(0) if a is None else a for a in scales),
        *(np.int64(v) for v in xs), *(np.int64(v) for v in os_),
        np.int64(rows), np.int32(lead1), np.int32(x.shape[-2]), np.int32(x.shape[-1]),
        np.float32(scale_all)))
