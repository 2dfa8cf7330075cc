"""GPU tensors of other frameworks (torch here, when installed) are taken zero-copy, in every
dtype, bfloat16 included: the same bits as the same data in CuPy arrays."""

from __future__ import annotations

import pytest

import cupydecode
from cupydecode import reference as R
from helpers import (DTYPES, LSE_TOL, OUT_TOL, assert_lse_close, assert_out_close, context,
                     decode_inputs, to_device)

pytestmark = pytest.mark.gpu


@pytest.fixture
def torch(cupy):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    return torch


@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_tensors_in_and_out(cupy, torch, rng, seed, dtype, splits):
    ctx = context(seed, dtype=dtype, splits=splits)
    host = decode_inputs(rng, 2, 16, 4, 128, 1500, dtype)
    ref_out, ref_lse = R.decode_attention(*host)
    q, k, v = (to_device(x) for x in host)
    want, want_lse = cupydecode.flash_decode(q, k, v, num_splits=splits, return_lse=True)
    assert_out_close(want, ref_out, OUT_TOL[dtype], ctx)   # also fails on any NaN
    assert_lse_close(want_lse, ref_lse, LSE_TOL[dtype], ctx)
    tq, tk, tv = (torch.from_dlpack(x) for x in (q, k, v))
    tout = torch.full(tuple(q.shape), float("nan"), dtype=tq.dtype, device=tq.device)
    got, lse = cupydecode.flash_decode(tq, tk, tv, num_splits=splits, out=tout, return_lse=True)
    torch.cuda.synchronize()
    assert got.data.ptr == tout.data_ptr(), f"out= not written in place {ctx}"
    assert cupy.array_equal(got.view(cupy.uint8), want.view(cupy.uint8)), ctx
    assert cupy.array_equal(lse, want_lse), ctx
    # a strided torch view of the cache (heads-major), as a (batch, heads, seq, dim) cache holds it
    tk2 = tk.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    tv2 = tv.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    got2 = cupydecode.flash_decode(tq, tk2, tv2, num_splits=splits)
    assert_out_close(got2, want, OUT_TOL[dtype], f"strided {ctx}")
