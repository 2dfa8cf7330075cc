"""merge_states on the GPU against the float64 reference merge."""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import (DTYPES, OUT_TOL, assert_lse_close, assert_out_close, context, decode_inputs,
                     randn, to_device)

pytestmark = pytest.mark.gpu

# float32 LSE of magnitude up to ~60 here: a few float32 spacings.
LSE_ATOL = 1e-5


def _states(rng, shape, dtype, lse_range=20.0, empty_fraction=0.0):
    """Random (o_parts, lse_parts) on the host; empty states get lse = -inf and o = NaN."""
    o = randn(rng, shape, dtype)
    lse = rng.uniform(-lse_range, lse_range, shape[:-1]).astype(np.float32)
    if empty_fraction:
        empty = rng.random(shape[:-1]) < empty_fraction
        lse[empty] = -np.inf
        o[empty] = np.nan
    return o, lse


SHAPES = [(1, 4, 128), (2, 7, 64), (3, 5, 256), (7, 3, 5, 128), (33, 6, 64), (100, 2, 128),
          (4, 9, 5), (5, 3, 200), (2, 1, 1), (40, 3, 256), (300, 2, 128), (130, 3, 5),
          (33, 5, 64), (20, 3, 128),  # these two leave warps of the last merge block idle
          (16, 3, 128), (32, 2, 256)]  # whole groups of 16 states (CD_MERGE_GROUP) only


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_matches_reference(cupy, rng, seed, dtype, shape):
    ctx = context(seed, dtype=dtype, shape=shape)
    o, lse = _states(rng, shape, dtype)
    ref_o, ref_lse = R.merge_states(o, lse)
    do = to_device(o)
    got_o, got_lse = cupydecode.merge_states(do, to_device(lse))
    assert got_o.dtype == do.dtype and got_o.shape == shape[1:], ctx
    assert got_lse.dtype == np.float32 and got_lse.shape == shape[1:-1], ctx
    assert_out_close(got_o, ref_o, OUT_TOL[dtype], ctx)
    assert_lse_close(got_lse, ref_lse, LSE_ATOL, ctx, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 4, 8, 128), (70, 4, 8, 256)], ids=lambda s: "x".join(map(str, s)))
def test_empty_states_never_leak(cupy, rng, seed, dtype, shape):
    """States with lse = -inf carry NaN outputs; rows with every state empty give 0 and -inf
    (70 states: five groups on eight warps per row, some warps with no state at all)."""
    ctx = context(seed, dtype=dtype, shape=shape)
    o, lse = _states(rng, shape, dtype, empty_fraction=0.5)
    lse[:, 0, 0] = -np.inf  # a row with every state empty
    o[:, 0, 0] = np.nan
    lse[1:, 1, 1] = -np.inf  # a row with one live state
    o[1:, 1, 1] = np.nan
    ref_o, ref_lse = R.merge_states(o, lse)
    got_o, got_lse = cupydecode.merge_states(to_device(o), to_device(lse))
    assert not bool(cupy.any(cupy.isnan(got_o.astype(cupy.float32)))), f"NaN leaked {ctx}"
    assert not cupy.any(got_o[0, 0]) and float(got_lse[0, 0]) == -np.inf, ctx
    assert_out_close(got_o, ref_o, OUT_TOL[dtype], ctx)
    assert_lse_close(got_lse, ref_lse, LSE_ATOL, ctx, rtol=1e-6)


@pytest.mark.parametrize("num_states", [1, 2, 40])
def test_all_empty(cupy, num_states):
    o = cupy.full((num_states, 3, 5, 64), np.nan, cupy.float32)
    lse = cupy.full((num_states, 3, 5), -np.inf, cupy.float32)
    got_o, got_lse = cupydecode.merge_states(o, lse)
    assert not cupy.any(got_o) and not bool(cupy.any(cupy.isnan(got_o)))
    assert bool(cupy.all(cupy.isneginf(got_lse)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_lse_spread(cupy, rng, seed, dtype):
    """LSE values of ±1e4 in one row: exp of them overflows; the max-shifted merge must not."""
    shape = (8, 16, 128)
    ctx = context(seed, dtype=dtype)
    o, lse = _states(rng, shape, dtype, lse_range=1e4)
    lse[3, :4] = 1e4                   # near-ties at the top of the range
    lse[5, :4] = 1e4 - 0.5
    lse[:, 4] = -1e4 + rng.uniform(0, 3, shape[0]).astype(np.float32)  # all very negative
    ref_o, ref_lse = R.merge_states(o, lse)
    got_o, got_lse = cupydecode.merge_states(to_device(o), to_device(lse))
    assert bool(cupy.all(cupy.isfinite(got_o.astype(cupy.float32)))), ctx
    assert_out_close(got_o, ref_o, OUT_TOL[dtype], ctx)
    # |LSE| ≈ 1e4 is resolved by float32 only to ~1e-3.
    assert_lse_close(got_lse, ref_lse, 1e-3, ctx, rtol=1e-6)


@pytest.mark.parametrize("centre", [1e4, -3e3, 0.0])
@pytest.mark.parametrize("num_states", [5, 40])  # one group of states; several warps' groups
def test_large_lse_keeps_float32_accuracy(cupy, rng, seed, centre, num_states):
    """LSEs near ±1e4 within a few units of each other: every weight as exact as at 0 (each
    exponent is formed from the difference of two LSEs, never from a scaled LSE alone)."""
    ctx = context(seed, centre=centre, num_states=num_states)
    o = randn(rng, (num_states, 6, 128), "float32")
    lse = (centre + rng.uniform(-4, 4, (num_states, 6))).astype(np.float32)
    ref_o, ref_lse = R.merge_states(o.astype(np.float64), lse.astype(np.float64))
    got_o, got_lse = cupydecode.merge_states(to_device(o), to_device(lse))
    # element-wise: a weight off by 3e-4 (the error of a scaled 1e4) fails this bound
    assert np.allclose(got_o.get(), ref_o, rtol=1e-5, atol=1e-5), ctx
    assert_lse_close(got_lse, ref_lse, 1e-5, ctx, rtol=1e-6)


def test_non_contiguous_inputs(cupy, rng, seed):
    ctx = context(seed)
    o, lse = _states(rng, (4, 6, 64), "float32")
    ref_o, ref_lse = R.merge_states(o, lse)
    # The same states stored (rows, S, D) and viewed as (S, rows, D).
    do = to_device(np.ascontiguousarray(o.transpose(1, 0, 2))).transpose(1, 0, 2)
    dl = to_device(np.ascontiguousarray(lse.T)).T
    assert not do.flags.c_contiguous and not dl.flags.c_contiguous
    got_o, got_lse = cupydecode.merge_states(do, dl)
    assert_out_close(got_o, ref_o, OUT_TOL["float32"], ctx)
    assert_lse_close(got_lse, ref_lse, LSE_ATOL, ctx, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_contiguous_views_at_any_alignment(cupy, rng, seed, dtype, offset):
    """A contiguous o_parts may start at any element (no alignment is assumed)."""
    shape = (5, 3, 64)
    ctx = context(seed, dtype=dtype, offset=offset)
    o, lse = _states(rng, shape, dtype)
    ref_o, ref_lse = R.merge_states(o, lse)
    do = to_device(o)
    flat = cupy.full(o.size + offset, np.nan, do.dtype)
    flat[offset:] = do.ravel()
    view = flat[offset:].reshape(shape)
    assert view.flags.c_contiguous and (view.data.ptr % 16 == 0) == (offset == 0)
    got_o, got_lse = cupydecode.merge_states(view, to_device(lse))
    assert_out_close(got_o, ref_o, OUT_TOL[dtype], ctx)
    assert_lse_close(got_lse, ref_lse, LSE_ATOL, ctx, rtol=1e-6)


def test_merge_of_decode_halves_equals_whole(cupy, rng, seed):
    """Cascade use: attention over two halves of a cache, merged, equals attention over all."""
    batch, num_heads, num_kv_heads, head_dim, length = 2, 16, 4, 128, 1500
    ctx = context(seed)
    q, k, v = (to_device(x) for x in decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim,
                                                    length, "float32"))
    whole, whole_lse = cupydecode.flash_decode(q, k, v, return_lse=True)
    parts = [cupydecode.flash_decode(q, cupy.ascontiguousarray(k[:, a:b]),
                                     cupy.ascontiguousarray(v[:, a:b]), return_lse=True)
             for a, b in ((0, 600), (600, length))]
    o, lse = cupydecode.merge_states(cupy.stack([p[0] for p in parts]),
                                     cupy.stack([p[1] for p in parts]))
    assert_out_close(o, whole, 1e-5, ctx)
    assert_lse_close(lse, whole_lse, 1e-5, ctx)


def test_empty_rows_shape(cupy):
    o, lse = cupydecode.merge_states(cupy.zeros((3, 0, 64), cupy.float16),
                                     cupy.zeros((3, 0), cupy.float32))
    assert o.shape == (0, 64) and lse.shape == (0,)


@pytest.mark.parametrize("num_states", [3, 40])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_pos_inf_is_empty_and_nan_stays_in_its_row(cupy, rng, seed, dtype, num_states):
    """+inf LSE (some libraries' empty row) is an empty state; a NaN LSE or a NaN output of a
    live state makes only its own row NaN (out and lse); every other row matches the reference."""
    ctx = context(seed, dtype=dtype, num_states=num_states)
    o, lse = _states(rng, (num_states, 6, 128), dtype)
    lse[1, 0], o[1, 0] = np.inf, np.nan           # row 0: state 1 empty (+inf)
    lse[:, 1] = np.inf                            # row 1: every state empty
    lse[num_states - 1, 2] = np.nan               # row 2: a NaN LSE
    o[0, 3, 17] = np.nan                          # row 3: a NaN in a live state's output
    ref_o, ref_lse = R.merge_states(o, lse)
    got_o, got_lse = cupydecode.merge_states(to_device(o), to_device(lse))
    got_o, got_lse = R.to_float64(got_o), R.to_float64(got_lse)
    assert np.all(np.isnan(got_o[2])) and np.isnan(got_lse[2]), ctx
    assert np.isnan(got_o[3]).any() and np.isnan(ref_o[3]).any(), ctx
    assert np.all(got_o[1] == 0) and np.isneginf(got_lse[1]), ctx
    rows = [0, 4, 5]
    assert_out_close(got_o[rows], ref_o[rows], OUT_TOL[dtype], ctx)
    assert_lse_close(got_lse[rows], ref_lse[rows], LSE_ATOL, ctx, rtol=1e-6)


@pytest.mark.parametrize("shape", [(5, 3, 8, 128), (40, 2, 6, 64), (1, 4, 8, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_merge_applies_sinks_once(cupy, rng, seed, shape):
    """sinks (one per head, broadcast over the batch) join each merged row once: against the
    reference's merge with sinks, empty rows included (out 0, lse σ); host and device sinks."""
    ctx = context(seed, shape=shape)
    o, lse = _states(rng, shape, "float32", empty_fraction=0.3)
    lse[:, 0, 0] = -np.inf  # an empty row: its result is the sink alone
    o[:, 0, 0] = np.nan
    sinks = rng.uniform(-3, 5, shape[2]).astype(np.float32)
    ref_o, ref_lse = R.merge_states(o, lse, sinks)
    for given in (sinks, to_device(sinks)):
        got_o, got_lse = cupydecode.merge_states(to_device(o), to_device(lse), sinks=given)
        assert_out_close(got_o, ref_o, OUT_TOL["float32"], ctx)
        assert_lse_close(got_lse, ref_lse, LSE_ATOL, ctx, rtol=1e-6)
    assert float(got_lse[0, 0].get()) == pytest.approx(float(sinks[0]), abs=1e-5), ctx
    with pytest.raises(ValueError, match="sinks: expected a shape that ends"):
        cupydecode.merge_states(to_device(o), to_device(lse), sinks=np.zeros(shape[2] + 1))
    with pytest.raises(ValueError, match="sinks: expected a shape that ends"):  # on the device
        cupydecode.merge_states(to_device(o), to_device(lse),
                                sinks=to_device(np.zeros(shape[2] + 1, np.float32)))
    with pytest.raises(TypeError, match="sinks: expected dtype float32"):
        cupydecode.merge_states(to_device(o), to_device(lse), sinks=to_device(sinks.astype(np.float16)))
