"""The fp8 encoding of kernels/fp8.cuh, step for step on the host, against ml_dtypes' rounding
(nearest, ties to even) with saturation: every float32 near every code boundary, subnormals,
specials and random values of every magnitude (no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from cupydecode import reference as R

ml_dtypes = pytest.importorskip("ml_dtypes")

# (ebits, mbits, bias, max_code, nan_code): kernels/fp8.cuh's cd_e4m3 and cd_e5m2
FORMATS = {"e4m3": (4, 3, 7, 0x7E, 0x7F), "e5m2": (5, 2, 15, 0x7B, 0x7E)}


def encode_like_the_kernel(f: np.ndarray, kv_dtype: str) -> np.ndarray:
    """cd_fp8_encode<F>(f) for a float32 array, the same integer and float32 steps."""
    ebits, mbits, bias, max_code, nan_code = FORMATS[kv_dtype]
    f = np.asarray(f, np.float32)
    b = f.view(np.uint32)
    sign = ((b >> 24) & 0x80).astype(np.uint32)
    a = np.abs(f)
    top = np.float32(R.FP8_FORMATS[kv_dtype][1])
    e = ((b >> 23) & 0xFF).astype(np.int64) - 127
    with np.errstate(invalid="ignore", over="ignore"):
        sub = np.rint(a * np.float32(2.0 ** (bias + mbits - 1))).astype(np.float64)
    sub = np.where(np.isfinite(sub) & (sub < 256), sub, 0).astype(np.uint32)  # (used below 2^-6)
    mant = b & 0x7FFFFF
    keep = mant >> (23 - mbits)
    rest = mant & ((1 << (23 - mbits)) - 1)
    half = 1 << (22 - mbits)
    keep = keep + ((rest > half) | ((rest == half) & ((keep & 1) == 1)))
    normal = ((np.maximum(e + bias, 0).astype(np.uint32) << mbits) + keep).astype(np.uint32)
    normal = np.minimum(normal, max_code)
    code = np.where(e < 1 - bias, sub, normal)
    code = np.where(a >= top, max_code, code)
    code = np.where(np.isnan(a), nan_code, code)
    return (sign | code).astype(np.uint8)


def values_near_every_code(kv_dtype: str) -> np.ndarray:
    """Each finite code's value, the midpoints between neighbours, and the float32 values one
    ulp either side of all of those, with both signs."""
    v = np.unique(np.abs(R.fp8_values(kv_dtype)[np.isfinite(R.fp8_values(kv_dtype))]))
    mids = (v[1:] + v[:-1]) / 2
    pts = np.concatenate([v, mids, [v[-1] * 1.03, v[-1] * 2, 1e30, 3e38]]).astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    return np.concatenate([pts, -pts])


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2"])
def test_kernel_encoding_rounds_like_ml_dtypes(rng, seed, kv_dtype):
    fp8 = getattr(ml_dtypes, R.FP8_FORMATS[kv_dtype][0])
    top = np.float32(R.FP8_FORMATS[kv_dtype][1])
    rand = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-30, 20, 200_000))).astype(np.float32)
    special = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40])
    x = np.concatenate([values_near_every_code(kv_dtype), rand, special])
    got = encode_like_the_kernel(x, kv_dtype)
    want = np.clip(x, -top, top).astype(fp8).view(np.uint8)  # (NaN stays NaN through clip)
    values = R.fp8_values(kv_dtype)
    nan = np.isnan(x)
    assert np.all(np.isnan(values[got[nan]])), seed
    bad = np.flatnonzero(got[~nan] != want[~nan])
    assert bad.size == 0, (seed, x[~nan][bad[:5]], got[~nan][bad[:5]], want[~nan][bad[:5]])


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2"])
def test_reference_quantiser_is_the_kernel_rule(rng, seed, kv_dtype):
    """reference.quantize_kv's codes are encode(x / s) with the float32 division the kernel
    does, for given and computed scales."""
    x = (rng.standard_normal((4, 3, 2, 40)) * rng.uniform(0.001, 100, (4, 3, 2, 1))).astype(np.float16)
    for scale in (0.37, np.float32([0.01, 2.0]), None):
        codes, s = R.quantize_kv(x, kv_dtype, scale)
        s32 = np.asarray(s if scale is None else scale, np.float32)
        y = x.astype(np.float32) / (s32[..., None] if s32.ndim else s32)
        assert np.array_equal(codes, encode_like_the_kernel(y, kv_dtype)), (seed, scale)
