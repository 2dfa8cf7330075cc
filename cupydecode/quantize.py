"""fp8 KV caches: ``quantize_kv`` writes fp8 codes (and per-row scales) from fp16/bf16/fp32 K or
V, on the GPU, by the rule of ``reference.quantize_kv`` (kernels/quantize_kv.cu, fp8.cuh)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import _kernels, _policy
from . import _validate as V

if TYPE_CHECKING:
    import cupy

ArrayLike = Any

_FILE, _KERNEL = "quantize_kv.cu", "cd_quantize_kv"


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
    if x.ndim not in (3, 4):
        V.fail(ValueError, "x", "3 dimensions (tokens, num_kv_heads, head_dim) or 4 (batch or "
               "num_pages, tokens, num_kv_heads, head_dim)", f"shape {tuple(x.shape)}")
    num_kv_heads, head_dim = x.shape[-2], x.shape[-1]
    if not 1 <= head_dim <= _policy.QUANTIZE_MAX_HEAD_DIM:
        V.fail(ValueError, "x", f"head_dim from 1 to {_policy.QUANTIZE_MAX_HEAD_DIM}", head_dim)
    if head_dim > 1 and x.size and x.strides[-1] != x.itemsize:  # (an empty array's strides: 0)
        V.fail(ValueError, "x", "head_dim contiguous (stride 1 element)",
               f"stride {x.strides[-1] // x.itemsize}")
    mode, scale_arr, scale_all = V.check_kv_scale(scale, "scale", tuple(x.shape[:-2]),
                                                  num_kv_heads, allow_none=True)
    if out is None:
        out = cupy.empty(x.shape, cupy.uint8)
    else:
        out = V.as_device_array(out, "out")
        if out.dtype != np.uint8:
            V.fail(TypeError, "out", "dtype uint8 (fp8 codes)", V.dtype_name(out.dtype))
        if tuple(out.shape) != tuple(x.shape):
            V.fail(ValueError, "out", f"shape {tuple(x.shape)} (x's)", f"shape {tuple(out.shape)}")
        if head_dim > 1 and out.size and out.strides[-1] != 1:
            V.fail(ValueError, "out", "head_dim contiguous", f"stride {out.strides[-1]}")
    V.check_same_device({"x": x, "out": out})
    scale_out = cupy.empty(x.shape[:-1], cupy.float32) if mode == 0 else None
    rows = int(np.prod(x.shape[:-1]))
    if rows == 0:
        return out, (scale_out if mode == 0 else scale)
    lead1 = x.shape[1] if x.ndim == 4 else 1
    xs = [s // x.itemsize for s in x.strides[:-2]]
    os_ = list(out.strides[:-2])
    if x.ndim == 3:  # (tokens, H, D) as (tokens, 1, H, D)
        xs, os_ = [xs[0], 0], [os_[0], 0]
    fn = _kernels.get_function(_FILE, _KERNEL, {"FP8": V.KV_DTYPES.index(fmt),
                                                "IN_DTYPE": _policy.DTYPE_IDS[dt],
                                                "SCALE_MODE": mode})
    from .decode import _sm_count

    blocks, threads = _policy.quantize_launch(rows, _sm_count(cupy.cuda.Device().id))
    _kernels.launch(fn, (blocks, 1, 1), (threads, 1, 1), (
        x, out, np.uint64(0) if scale_arr is None else scale_arr,
        np.uint64(0) if scale_out is None else scale_out,
        np.int64(xs[0]), np.int64(xs[1]), np.int64(x.strides[-2] // x.itemsize),
        np.int64(os_[0]), np.int64(os_[1]), np.int64(out.strides[-2]),
        np.int64(rows), np.int32(lead1), np.int32(num_kv_heads), np.int32(head_dim),
        np.float32(scale_all)))
    return out, (scale_out if mode == 0 else scale)
