"""cupydecode.quantize_kv on the GPU against reference.quantize_kv, code for code and scale for
scale: both fp8 formats, every input dtype and scale granularity, strided outputs, non-finite
inputs; and its bad inputs refused before any launch."""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import DTYPES, context, np_dtype, randn, to_device

pytestmark = pytest.mark.gpu

POISON = 0x7F  # an e4m3 NaN code (and an e5m2 NaN): a byte the kernel did not write stays NaN


def _inputs(rng, shape, dtype):
    """K-like rows of every magnitude (2^-12 … 2^12 per row), and rows with planted values: a NaN
    alone (a row maximum that ignored NaN would give another scale), ±inf alone, all zeros, a
    value past the e4m3 range."""
    x = randn(rng, shape, "float32")
    x *= np.exp2(rng.uniform(-12, 12, shape[:-1] + (1,))).astype(np.float32)
    rows = x.reshape(-1, shape[-1])
    rows[0, 3] = np.nan
    rows[1, :2] = [np.inf, -np.inf]
    rows[2] = 0.0
    rows[3, 5] = 1e6
    return x.astype(np_dtype(dtype))


def _check(codes, scale, want_codes, want_scale, kv_dtype, ctx):
    got = codes.get()
    values = R.fp8_values(kv_dtype)
    nan = np.isnan(values[want_codes])
    assert np.array_equal(np.isnan(values[got]), nan), ctx
    assert np.array_equal(got[~nan], want_codes[~nan]), ctx
    if want_scale is not None:
        assert np.array_equal(scale.get(), np.asarray(want_scale, np.float32)), ctx


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("granularity", ["computed", "tensor", "head", "token"])
@pytest.mark.parametrize("shape", [(3, 37, 4, 128), (50, 2, 40), (2, 5, 8, 256)])
def test_quantize_matches_the_reference(cupy, rng, seed, kv_dtype, dtype, granularity, shape):
    x = _inputs(rng, shape, dtype)
    lead, heads = shape[:-1], shape[-2]
    scale = {"computed": None, "tensor": 0.0371,
             "head": rng.uniform(0.001, 1.0, heads).astype(np.float32),
             "token": rng.uniform(0.001, 1.0, lead).astype(np.float32)}[granularity]
    want_codes, want_scale = R.quantize_kv(x, kv_dtype, scale)
    dev_scale = scale if scale is None or np.isscalar(scale) else cupy.asarray(scale)
    ctx = context(seed, kv_dtype=kv_dtype, dtype=dtype, granularity=granularity, shape=shape)
    for poison in (POISON, 0x3C):  # (a NaN code, then a finite one: no byte left unwritten)
        out = cupy.full(shape, poison, cupy.uint8)
        codes, got_scale = cupydecode.quantize_kv(to_device(x), kv_dtype, dev_scale, out=out)
        assert codes is out
        _check(codes, got_scale, want_codes, want_scale if scale is None else None, kv_dtype, ctx)
        if scale is not None and not np.isscalar(scale):
            assert got_scale is dev_scale, ctx


def test_quantize_into_a_cache_slice_writes_only_the_slice(cupy, rng, seed):
    """out= a strided slice of a larger cache (the new tokens of each sequence): those bytes are
    the codes, every other byte of the cache is untouched."""
    cache = cupy.asarray(rng.integers(0, 256, (4, 64, 8, 128)).astype(np.uint8))
    before = cache.get()
    x = randn(rng, (4, 3, 8, 128), "float16")
    view = cache[:, 10:13]
    codes, scale = cupydecode.quantize_kv(to_device(x), "e4m3", out=view)
    want_codes, want_scale = R.quantize_kv(x, "e4m3")
    after = cache.get()
    ctx = context(seed)
    assert np.array_equal(after[:, 10:13], want_codes), ctx
    after[:, 10:13] = before[:, 10:13]
    assert np.array_equal(after, before), ctx
    assert np.array_equal(scale.get(), want_scale), ctx


@pytest.mark.parametrize("view", ["tokens", "heads", "both"])
def test_quantize_of_a_strided_input(cupy, rng, seed, view):
    """x as a view with free leading strides: every second token, every second KV head, both."""
    big = randn(rng, (2, 40, 8, 64), "bfloat16")
    pick = {"tokens": np.s_[:, ::2], "heads": np.s_[:, :, ::2], "both": np.s_[:, ::2, 1::2]}[view]
    codes, scale = cupydecode.quantize_kv(to_device(big)[pick], "e5m2")
    want_codes, want_scale = R.quantize_kv(big[pick], "e5m2")
    _check(codes, scale, want_codes, want_scale, "e5m2", context(seed, view=view))


def test_quantize_one_token_per_sequence_into_the_cache(cupy, rng, seed):
    """The decode step's use: x (batch, H, D), the new tokens, written to out = cache[:, t] (3
    dimensions, strided), and into every second KV head of another cache (a head stride)."""
    cache = cupy.asarray(rng.integers(0, 256, (6, 32, 8, 128)).astype(np.uint8))
    before = cache.get()
    x = randn(rng, (6, 8, 128), "float16")
    codes, scale = cupydecode.quantize_kv(to_device(x), "e4m3", 0.02, out=cache[:, 7])
    want_codes, _ = R.quantize_kv(x, "e4m3", 0.02)
    after = cache.get()
    ctx = context(seed)
    assert np.array_equal(after[:, 7], want_codes) and scale == 0.02, ctx
    after[:, 7] = before[:, 7]
    assert np.array_equal(after, before), ctx
    half = randn(rng, (6, 4, 128), "float16")
    cupydecode.quantize_kv(to_device(half), "e4m3", out=cache[:, 9, ::2])
    want_half, _ = R.quantize_kv(half, "e4m3")
    got = cache.get()
    assert np.array_equal(got[:, 9, ::2], want_half), ctx
    assert np.array_equal(got[:, 9, 1::2], before[:, 9, 1::2]), ctx


def test_quantize_of_more_rows_than_one_pass_of_the_grid(cupy, rng, seed):
    """Enough rows (4 × 4096 × 8) that every warp of the grid takes several in turn."""
    x = randn(rng, (4, 4096, 8, 64), "float16")
    codes, scale = cupydecode.quantize_kv(to_device(x), "e4m3")
    want_codes, want_scale = R.quantize_kv(x, "e4m3")
    _check(codes, scale, want_codes, want_scale, "e4m3", context(seed))


def test_empty_input_returns_empty_codes(cupy):
    codes, scale = cupydecode.quantize_kv(cupy.zeros((0, 4, 64), cupy.float16))
    assert codes.shape == (0, 4, 64) and scale.shape == (0, 4)


def test_quantize_bad_inputs_are_refused(cupy):
    x = cupy.zeros((2, 3, 4, 64), cupy.float16)
    cases = [
        (dict(x=x, kv_dtype="fp8"), ValueError, r"kv_dtype: expected 'e4m3' or 'e5m2'"),
        (dict(x=x, scale=-1.0), ValueError, r"scale: expected a finite float > 0 .*got -1.0"),
        (dict(x=x, scale=float("nan")), ValueError, r"scale: expected a finite float > 0"),
        (dict(x=x, scale=True), TypeError, r"scale: expected a float > 0"),
        (dict(x=x, scale=np.ones(4, np.float32)), TypeError, r"scale: .*host arrays"),
        (dict(x=x, scale=cupy.ones(4, cupy.float16)), TypeError, r"scale: .*dtype float16"),
        (dict(x=x, scale=cupy.ones(5, cupy.float32)), ValueError, r"scale: .*shape \(5,\)"),
        (dict(x=x, scale=cupy.ones((2, 3, 4, 1), cupy.float32)), ValueError, r"scale: .*shape"),
        (dict(x=x[..., ::2]), ValueError, r"x: expected head_dim contiguous"),
        (dict(x=x[0, 0]), ValueError, r"x: expected 3 dimensions"),
        (dict(x=cupy.zeros((2, 4, 264), cupy.float16)), ValueError, r"x: expected head_dim from 1 to 256"),
        (dict(x=cupy.zeros((2, 4, 64), cupy.int32)), TypeError, r"x: "),
        (dict(x=x, out=cupy.zeros((2, 3, 4, 64), cupy.float16)), TypeError, r"out: expected dtype uint8"),
        (dict(x=x, out=cupy.zeros((2, 3, 4, 32), cupy.uint8)), ValueError, r"out: expected shape"),
        (dict(x=np.zeros((2, 4, 64), np.float16)), TypeError, r"x: "),
    ]
    for kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            cupydecode.quantize_kv(**kwargs)
    cupydecode.quantize_kv(x)  # the context is healthy afterwards
    cupy.cuda.Device().synchronize()


# dequantize_kv: the attention kernels' decoding of codes (fp8.cuh), checked against the values
# of every code; the result is value · s in float32 rounded once to the output type


def _dequantized(codes: np.ndarray, kv_dtype: str, scale, dtype: str) -> np.ndarray:
    """What dequantize_kv returns: value(code) (exact in float32) · s in float32, one rounding."""
    values = R.fp8_values(kv_dtype).astype(np.float32)[codes]
    s = np.asarray(scale, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        return (values * (s[..., None] if s.ndim else s)).astype(np_dtype(dtype))


def _same(got, want) -> bool:
    """Equal bit for bit where finite and infinite, NaN where NaN (any NaN payload)."""
    g, w = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    return bool(np.array_equal(np.isnan(g), np.isnan(w)) and np.array_equal(g[~np.isnan(w)], w[~np.isnan(w)])
                and np.array_equal(np.signbit(g[~np.isnan(w)]), np.signbit(w[~np.isnan(w)])))


def _host(x, dtype: str) -> np.ndarray:
    """A device array on the host (bfloat16 through its 16-bit pattern)."""
    import cupy

    return x.view(cupy.uint16).get().view(np_dtype(dtype)) if dtype == "bfloat16" else x.get()


def _poisoned(cupy, shape, dtype: str):
    """A NaN-filled device array of ``dtype``."""
    if dtype == "bfloat16":
        return cupy.full(shape, 0x7FC0, cupy.uint16).view(np_dtype("bfloat16"))
    return cupy.full(shape, np.nan, np_dtype(dtype))


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["gpu", "by_bits"])
def test_dequantize_gives_every_code_its_value(cupy, monkeypatch, kv_dtype, dtype, path):
    """All 256 codes, in every position of a group of four (rows of 256 codes shifted by 0–3),
    with a unit scale: the exact value, ±0, ±inf and NaN as they are; with the GPU's conversion
    instruction (sm_89+) and with the decoding by bits of older GPUs (FP8_BY_BITS)."""
    from cupydecode import _kernels

    if path == "by_bits":
        build = _kernels.get_function
        monkeypatch.setattr(_kernels, "get_function",
                            lambda f, n, d: build(f, n, {**d, "FP8_BY_BITS": 1}))
    codes = np.stack([np.roll(np.arange(256, dtype=np.uint8), k) for k in range(4)])
    codes = codes.reshape(4, 1, 256)
    out = _poisoned(cupy, codes.shape, dtype)
    got = cupydecode.dequantize_kv(cupy.asarray(codes), kv_dtype, 1.0, dtype=dtype, out=out)
    assert got is out
    assert _same(_host(got, dtype), R.fp8_values(kv_dtype)[codes]), (kv_dtype, dtype, path)


@pytest.mark.parametrize("kv_dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("granularity", ["tensor", "head", "token"])
@pytest.mark.parametrize("shape", [(3, 37, 4, 128), (50, 2, 40), (2, 5, 8, 256), (4, 3, 2, 13)])
def test_dequantize_matches_its_rule_and_inverts_quantize(cupy, rng, seed, kv_dtype, dtype,
                                                          granularity, shape):
    """Random codes with scales per tensor, KV head or (token, KV head): value · s in float32,
    rounded once (bit for bit), into a NaN-poisoned out; and dequantize(quantize(x)) against
    the float64 reference's dequantised values."""
    lead, heads = shape[:-1], shape[-2]
    scale = {"tensor": 0.0371, "head": rng.uniform(0.001, 1.0, heads).astype(np.float32),
             "token": rng.uniform(0.001, 1.0, lead).astype(np.float32)}[granularity]
    dev_scale = scale if np.isscalar(scale) else cupy.asarray(scale)
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    out = _poisoned(cupy, shape, dtype)
    ctx = context(seed, kv_dtype=kv_dtype, dtype=dtype, granularity=granularity, shape=shape)
    got = cupydecode.dequantize_kv(cupy.asarray(codes), kv_dtype, dev_scale, dtype=dtype, out=out)
    assert got is out, ctx
    assert _same(_host(got, dtype), _dequantized(codes, kv_dtype, scale, dtype)), ctx
    # the round trip: x → codes → values, against the reference's float64 code · scale
    x = _inputs(rng, shape, "float16")
    qcodes, qscale = cupydecode.quantize_kv(to_device(x), kv_dtype)
    back = cupydecode.dequantize_kv(qcodes, kv_dtype, qscale, dtype="float32").get()
    want = R.dequantize_kv(qcodes.get(), kv_dtype, qscale.get())
    finite = np.isfinite(want)
    assert np.array_equal(np.isnan(back), np.isnan(want)), ctx
    assert np.allclose(back[finite], want[finite], rtol=2**-23, atol=0), ctx


def test_dequantize_of_a_strided_cache_slice(cupy, rng, seed):
    """codes and out as views with free leading strides (every second token of a paged cache,
    every second KV head): only out's slice is written."""
    cache = cupy.asarray(rng.integers(0, 256, (5, 16, 8, 64)).astype(np.uint8))
    view = cache[:, ::2, 1::2]
    big = cupy.full((5, 8, 8, 64), np.nan, cupy.float16)
    out = big[:, :, ::2]
    got = cupydecode.dequantize_kv(view, "e5m2", 2.0, out=out)
    ctx = context(seed)
    assert got is out, ctx
    assert _same(got.get(), _dequantized(view.get(), "e5m2", 2.0, "float16")), ctx
    assert bool(cupy.all(cupy.isnan(big[:, :, 1::2]))), ctx


def test_dequantize_of_float8_arrays(cupy, rng, seed):
    """Codes held as an ml_dtypes float8 array (where CuPy holds one) are read as their bytes."""
    import ml_dtypes

    codes = cupy.asarray(rng.integers(0, 256, (3, 4, 32)).astype(np.uint8))
    try:
        f8 = codes.view(ml_dtypes.float8_e4m3fn)
    except Exception as exc:  # noqa: BLE001 (CuPy's refusal of the dtype, whatever its type)
        pytest.skip(f"this CuPy holds no float8 arrays ({type(exc).__name__}: {exc})")
    got = cupydecode.dequantize_kv(f8, "e4m3", 0.5)
    assert _same(got.get(), _dequantized(codes.get(), "e4m3", 0.5, "float16")), context(seed)


def test_dequantize_bad_inputs_are_refused(cupy):
    c = cupy.zeros((2, 3, 4, 64), cupy.uint8)
    cases = [
        (dict(codes=c, kv_dtype="fp8"), ValueError, r"kv_dtype: expected 'e4m3' or 'e5m2'"),
        (dict(codes=c, scale=None), ValueError, r"scale: expected a float > 0"),
        (dict(codes=c, scale=0.0), ValueError, r"scale: expected a finite float > 0"),
        (dict(codes=c, scale=cupy.ones(5, cupy.float32)), ValueError, r"scale: .*shape \(5,\)"),
        (dict(codes=c, scale=cupy.ones(4, cupy.float64)), TypeError, r"scale: .*dtype float64"),
        (dict(codes=c, dtype="int8"), TypeError, r"dtype: expected one of \(float16, bfloat16, float32\), got int8"),
        (dict(codes=c, dtype=[1]), TypeError, r"dtype: expected a NumPy dtype or dtype name, got \[1\]"),
        (dict(codes=cupy.zeros((2, 3, 4, 64), cupy.float16)), TypeError,
         r"codes: expected uint8 codes or float8_e4m3fn with kv_dtype='e4m3', got float16"),
        (dict(codes=c[..., ::2]), ValueError, r"codes: expected head_dim contiguous"),
        (dict(codes=c[0, 0]), ValueError, r"codes: expected 3 dimensions"),
        (dict(codes=c, out=cupy.zeros((2, 3, 4, 64), cupy.float32)), TypeError, r"out: expected dtype float16"),
        (dict(codes=c, out=cupy.zeros((2, 3, 4, 32), cupy.float16)), ValueError, r"out: expected shape"),
        (dict(codes=np.zeros((2, 4, 64), np.uint8)), TypeError, r"codes: "),
    ]
    for kwargs, exc, match in cases:
        with pytest.raises(exc, match=match):
            cupydecode.dequantize_kv(**kwargs)
    assert cupydecode.dequantize_kv(cupy.zeros((0, 4, 64), cupy.uint8)).shape == (0, 4, 64)
