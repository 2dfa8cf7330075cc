"""Every refused input: exception type, and a message that names the argument."""

from __future__ import annotations

import math

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import OUT_TOL, assert_out_close, decode_inputs, to_device

pytestmark = pytest.mark.gpu

B, H, HKV, D, L = 2, 8, 2, 128, 64


@pytest.fixture
def good(cupy, rng):
    """Valid device (q, k_cache, v_cache) and their host copies."""
    host = decode_inputs(rng, B, H, HKV, D, L, "float16")
    return tuple(to_device(x) for x in host), host


def raises(exc, *fragments):
    """pytest.raises whose message must contain every fragment (literally)."""
    import re

    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def misaligned(cupy, shape, dtype, offset_elems=1):
    """A C-contiguous array whose data pointer is not 16-byte aligned."""
    n = int(np.prod(shape))
    base = cupy.zeros(n + 16, dtype)
    view = base[offset_elems:offset_elems + n].reshape(shape)
    assert view.data.ptr % 16
    return view


def test_shape_errors(cupy, good):
    (q, k, v), _ = good
    f = cupydecode.flash_decode
    with raises(ValueError, "q:", "3-D"):
        f(q[0], k, v)
    with raises(ValueError, "k_cache:", "4-D"):
        f(q, k[0], v)
    with raises(ValueError, "v_cache:", "4-D"):
        f(q, k, v[0])
    with raises(ValueError, "k_cache:", "batch=2"):                       # batch mismatch
        f(q, k[:1], v[:1])
    with raises(ValueError, "k_cache:", "head_dim=128"):                  # head_dim mismatch
        f(q, cupy.ascontiguousarray(k[..., :64]), cupy.ascontiguousarray(v[..., :64]))
    with raises(ValueError, "v_cache:", "shape of k_cache"):              # k/v shapes differ
        f(q, k, v[:, :L // 2])
    with raises(ValueError, "v_cache:", "shape of k_cache"):              # num_kv_heads differ
        f(q, k, cupy.ascontiguousarray(v[:, :, :1]))
    with raises(ValueError, "k_cache:", "num_kv_heads", "dividing", "num_heads=8"):
        f(q, cupy.zeros((B, L, 3, D), cupy.float16), cupy.zeros((B, L, 3, D), cupy.float16))
    big = 65536  # one grid row per sequence: CUDA allows 65535
    with raises(ValueError, "q:", "65535"):
        f(cupy.zeros((big, 1, 64), cupy.float16), cupy.zeros((big, 1, 1, 64), cupy.float16),
          cupy.zeros((big, 1, 1, 64), cupy.float16))


def test_unsupported_head_dim_and_dtypes(cupy, good):
    (q, k, v), _ = good
    f = cupydecode.flash_decode
    for d in (100, 24, 264):  # not a multiple of 8; below 32; above 256
        with raises(ValueError, "q:", "head_dim a multiple of 8 from 32 to 256", str(d)):
            f(cupy.zeros((B, H, d), cupy.float16), cupy.zeros((B, L, HKV, d), cupy.float16),
              cupy.zeros((B, L, HKV, d), cupy.float16))
    for dtype in (cupy.float64, cupy.int32):
        with raises(TypeError, "q:", "dtype", np.dtype(dtype).name):
            f(q.astype(dtype), k.astype(dtype), v.astype(dtype))
    with raises(TypeError, "k_cache:", "dtype of q", "float32"):          # mixed dtypes
        f(q, k.astype(cupy.float32), v)
    with raises(TypeError, "v_cache:", "dtype of q", "float32"):
        f(q, k, v.astype(cupy.float32))


def test_layout_errors(cupy, good):
    (q, k, v), _ = good
    f = cupydecode.flash_decode
    wide = cupy.zeros((B, L, HKV, 2 * D), cupy.float16)
    with raises(ValueError, "k_cache:", "last dimension contiguous"):
        f(q, wide[..., ::2], v)
    with raises(ValueError, "v_cache:", "last dimension contiguous"):
        f(q, k, wide[..., ::2])
    with raises(ValueError, "q:", "last dimension contiguous"):
        f(cupy.zeros((B, H, 2 * D), cupy.float16)[..., ::2], k, v)
    with raises(ValueError, "k_cache:", "16-byte aligned"):
        f(q, misaligned(cupy, k.shape, cupy.float16), v)
    with raises(ValueError, "v_cache:", "16-byte aligned"):
        f(q, k, misaligned(cupy, v.shape, cupy.float16))
    with raises(ValueError, "q:", "16-byte aligned"):
        f(misaligned(cupy, q.shape, cupy.float16), k, v)


def test_host_arrays(cupy, good):
    (q, k, v), (hq, hk, hv) = good
    f = cupydecode.flash_decode
    with raises(TypeError, "q:", "move it to the GPU"):
        f(hq, k, v)
    with raises(TypeError, "k_cache:", "move it to the GPU"):
        f(q, hk, v)
    with raises(TypeError, "v_cache:", "move it to the GPU"):
        f(q, k, hv)
    with raises(TypeError, "out:", "move it to the GPU"):
        f(q, k, v, out=np.zeros(q.shape, np.float16))


def test_cache_seqlens_errors(cupy, good):
    (q, k, v), _ = good
    f = cupydecode.flash_decode
    with raises(ValueError, "cache_seqlens:", "shape (2,)"):
        f(q, k, v, cupy.zeros(3, cupy.int32))
    with raises(ValueError, "cache_seqlens:", "shape (2,)"):
        f(q, k, v, [1, 2, 3])
    with raises(TypeError, "cache_seqlens:", "int32 or int64", "uint32"):
        f(q, k, v, cupy.zeros(2, cupy.uint32))
    with raises(TypeError, "cache_seqlens:", "int32 or int64", "float32"):
        f(q, k, v, cupy.zeros(2, cupy.float32))
    with raises(ValueError, "cache_seqlens:", "contiguous"):
        f(q, k, v, cupy.zeros(4, cupy.int64)[::2])
    with raises(TypeError, "cache_seqlens:", "int32"):
        f(q, k, v, cupy.zeros(2, cupy.bool_))
    with raises(ValueError, "cache_seqlens:", f"max_seqlen={L}"):         # host out of range
        f(q, k, v, [L + 1, 0])
    with raises(ValueError, "cache_seqlens:", f"max_seqlen={L}"):
        f(q, k, v, np.array([-1, 3]))
    with raises(ValueError, "cache_seqlens:", f"[0, {L}]"):
        f(q, k, v, L + 1)
    with raises(ValueError, "cache_seqlens:", f"[0, {L}]"):
        f(q, k, v, -1)
    with raises(TypeError, "cache_seqlens:"):
        f(q, k, v, True)
    with raises(TypeError, "cache_seqlens:", "integers"):
        f(q, k, v, [True, False])
    with raises(TypeError, "cache_seqlens:", "integers"):
        f(q, k, v, [1.5, 2.0])
    with raises(ValueError, "cache_seqlens:", "contiguous"):
        f(q, k, v, cupy.zeros(4, cupy.int32)[::2])


@pytest.mark.parametrize("value,exc", [(0, ValueError), (-1, ValueError), (1.5, TypeError),
                                       (True, TypeError), ("2", TypeError), (10**6, ValueError)])
def test_num_splits_errors(cupy, good, value, exc):
    (q, k, v), _ = good
    with raises(exc, "num_splits:"):
        cupydecode.flash_decode(q, k, v, num_splits=value)


@pytest.mark.parametrize("value,exc", [(0, ValueError), (-64, ValueError), (64.0, TypeError)])
def test_split_size_errors(cupy, good, value, exc):
    (q, k, v), _ = good
    with raises(exc, "split_size:"):
        cupydecode.flash_decode(q, k, v, split_size=value)


def test_num_splits_with_split_size(cupy, good):
    (q, k, v), _ = good
    with raises(ValueError, "num_splits", "split_size"):
        cupydecode.flash_decode(q, k, v, num_splits=2, split_size=64)


def test_out_errors(cupy, good):
    (q, k, v), _ = good
    f = cupydecode.flash_decode
    with raises(ValueError, "out:", "shape", str((B, H, D))):
        f(q, k, v, out=cupy.empty((B, H, D + 64), cupy.float16))
    with raises(TypeError, "out:", "dtype float16", "float32"):
        f(q, k, v, out=cupy.empty((B, H, D), cupy.float32))
    with raises(ValueError, "out:", "C-contiguous"):
        f(q, k, v, out=cupy.empty((B, D, H), cupy.float16).transpose(0, 2, 1))


@pytest.mark.parametrize("value,exc", [(math.nan, ValueError), (math.inf, ValueError),
                                       (-math.inf, ValueError), ("x", TypeError),
                                       (True, TypeError), (None, None)])
def test_softmax_scale_errors(cupy, good, value, exc):
    (q, k, v), _ = good
    if exc is None:
        cupydecode.flash_decode(q, k, v, softmax_scale=value)
        return
    with raises(exc, "softmax_scale:"):
        cupydecode.flash_decode(q, k, v, softmax_scale=value)


@pytest.mark.parametrize("value,exc", [(-1.0, ValueError), (math.inf, ValueError),
                                       (math.nan, ValueError), ("50", TypeError),
                                       (False, TypeError)])
def test_soft_cap_errors(cupy, good, value, exc):
    (q, k, v), _ = good
    with raises(exc, "logits_soft_cap:"):
        cupydecode.flash_decode(q, k, v, logits_soft_cap=value)
    with raises(exc, "logits_soft_cap:"):
        cupydecode.DecodePlan(*q.shape[:2], k.shape[2], q.shape[2], k.shape[1], q.dtype,
                              logits_soft_cap=value)


def test_merge_states_errors(cupy, rng):
    o = cupy.zeros((3, 4, 64), cupy.float32)
    lse = cupy.zeros((3, 4), cupy.float32)
    m = cupydecode.merge_states
    with raises(TypeError, "o_parts:", "move it to the GPU"):
        m(o.get(), lse)
    with raises(TypeError, "lse_parts:", "move it to the GPU"):
        m(o, lse.get())
    with raises(TypeError, "o_parts:", "float64"):
        m(o.astype(cupy.float64), lse)
    with raises(TypeError, "lse_parts:", "float32", "float16"):
        m(o, lse.astype(cupy.float16))
    with raises(ValueError, "lse_parts:", "shape (3, 4)"):
        m(o, lse[:, :3])
    with raises(ValueError, "o_parts:"):
        m(o[0, 0], lse[0])
    with raises(ValueError, "o_parts:", "at least one state"):
        m(o[:0], lse[:0])


def test_plan_constructor_errors(cupy):
    P = cupydecode.DecodePlan
    with raises(TypeError, "dtype:", "float64"):
        P(1, 8, 2, 128, 64, "float64")
    with raises(TypeError, "dtype:"):
        P(1, 8, 2, 128, 64, "not-a-dtype")
    for d in (100, 24, 264):
        with raises(ValueError, "head_dim:", "a multiple of 8 from 32 to 256", str(d)):
            P(1, 8, 2, d, 64, "float16")
    with raises(ValueError, "num_kv_heads:", "num_heads=8"):
        P(1, 8, 3, 128, 64, "float16")
    with raises(ValueError, "batch:"):
        P(-1, 8, 2, 128, 64, "float16")
    with raises(ValueError, "max_seqlen:"):
        P(1, 8, 2, 128, -5, "float16")
    with raises(ValueError, "num_splits:"):
        P(1, 8, 2, 128, 64, "float16", num_splits=0)
    with raises(ValueError, "split_size:"):
        P(1, 8, 2, 128, 64, "float16", split_size=0)
    with raises(ValueError, "merge:"):
        P(1, 8, 2, 128, 64, "float16", num_splits=2, merge="twice")


def test_valid_call_after_errors(cupy, good):
    """An error leaves nothing behind: the next valid call is still correct."""
    (q, k, v), (hq, hk, hv) = good
    f = cupydecode.flash_decode
    bad_calls = [
        lambda: f(q, k, v, num_splits=0),
        lambda: f(q, k, v[:, :3]),
        lambda: f(q, k, v, cupy.zeros(3, cupy.int32)),
        lambda: f(q, k, v, out=cupy.empty((1,), cupy.float16)),
        lambda: f(q, k, v, softmax_scale=math.nan),
        lambda: cupydecode.merge_states(cupy.zeros((2, 3, 8), cupy.float32), cupy.zeros((2, 4), cupy.float32)),
    ]
    ref_out, _ = R.decode_attention(hq, hk, hv, [L, 5])
    for bad in bad_calls:
        with pytest.raises((TypeError, ValueError)):
            bad()
        for splits in (None, 3):
            got = f(q, k, v, cupy.asarray(np.array([L, 5], np.int32)), num_splits=splits)
            assert_out_close(got, ref_out, OUT_TOL["float16"], f"after {bad}")


def test_errors_after_the_same_layout_passed(cupy, good):
    """flash_decode remembers the layouts that passed its checks (per stream and split option);
    every argument is still checked on every call: after a valid call, the same layout with a
    split count that equals a valid one as a key (True == 1), an unhashable one, a misaligned
    pointer, a bad output or bad lengths is refused."""
    (q, k, v), _ = good
    f = cupydecode.flash_decode
    for splits in (None, 1, 2):
        f(q, k, v, num_splits=splits)
        with raises(TypeError, "num_splits:"):
            f(q, k, v, num_splits=True)
        with raises(TypeError, "num_splits:"):
            f(q, k, v, num_splits=[2])
        with raises(ValueError, "q:", "16-byte aligned"):
            f(misaligned(cupy, q.shape, cupy.float16), k, v, num_splits=splits)
        with raises(ValueError, "out:", "C-contiguous"):
            f(q, k, v, num_splits=splits,
              out=cupy.empty((B, D, H), cupy.float16).transpose(0, 2, 1))
        with raises(ValueError, "cache_seqlens:", "shape (2,)"):
            f(q, k, v, cupy.zeros(3, cupy.int32), num_splits=splits)
    f(q, k, v, split_size=32)
    with raises(TypeError, "split_size:"):
        f(q, k, v, split_size=32.0)


def test_layouts_in_turn_on_one_stream(cupy, good):
    """Calls of one shape that alternate layouts on one stream (contiguous; K/V inside a wider
    cache; q inside a wider array) each run with their own strides: every result matches the
    float64 reference, in both rounds."""
    (q, k, v), (hq, hk, hv) = good
    wide_q = cupy.full((B, H + 3, D), np.nan, cupy.float16)
    wide_q[:, :H] = q
    wide_k = cupy.full((B, L, HKV + 1, D), np.nan, cupy.float16)
    wide_v = cupy.full((B, L, HKV + 1, D), np.nan, cupy.float16)
    wide_k[:, :, :HKV] = k
    wide_v[:, :, :HKV] = v
    qs, ks, vs = wide_q[:, :H], wide_k[:, :, :HKV], wide_v[:, :, :HKV]
    ref, _ = R.decode_attention(hq, hk, hv)
    for rnd in range(2):
        for name, args in (("contiguous", (q, k, v)), ("strided", (qs, ks, vs)),
                           ("strided K/V", (q, ks, vs)), ("strided q", (qs, k, v))):
            got = cupydecode.flash_decode(*args)
            assert_out_close(got, ref, OUT_TOL["float16"], f"{name}, round {rnd}")


def test_first_call_checks_once_and_takes_the_key_it_computed(cupy, good, monkeypatch):
    """A layout's first flash_decode call runs the full checks once, on the layout part of the
    call key it computed (no second derivation of the layout key); the next call is a hit that
    runs no check; both are correct."""
    from cupydecode import _validate as V
    from cupydecode import decode as D

    (q, k, v), (hq, hk, hv) = good
    layouts, checks = [], []
    real_layout, real_checks = V.layout_key, V._check_decode_inputs
    monkeypatch.setattr(V, "layout_key", lambda *a: layouts.append(1) or real_layout(*a))
    monkeypatch.setattr(V, "_check_decode_inputs",
                        lambda *a: checks.append(1) or real_checks(*a))
    monkeypatch.setattr(D, "_EAGER", {})
    monkeypatch.setattr(V, "_VALIDATED", {})
    ref, _ = R.decode_attention(hq, hk, hv)
    for n in (1, 2):
        assert_out_close(cupydecode.flash_decode(q, k, v), ref, OUT_TOL["float16"], f"call {n}")
        assert (len(layouts), len(checks)) == (0, 1), f"call {n}: {len(layouts)} layout keys, " \
            f"{len(checks)} full checks in all"
    assert V.call_key(q, k, v, (None,) * 4, (None,) * 7)[0][:V.LAYOUT_PARTS] == real_layout(q, k, v)


def test_new_token_errors(cupy, good):
    """k_new/v_new: both or neither, on the GPU, the cache's dtype, one token per sequence, the
    last dim contiguous, 16-byte aligned; refused by name before anything is launched (the
    cache is unchanged), by flash_decode and by a plan, which never copies them."""
    (q, k, v), _ = good
    f = cupydecode.flash_decode
    kn = cupy.ones((B, 1, HKV, D), cupy.float16)
    vn = cupy.ones((B, HKV, D), cupy.float16)  # 3 dims are fine too
    k0, v0 = k.copy(), v.copy()
    lens = cupy.asarray(np.array([3, 0], np.int32))
    expected = f"(batch={B}, 1, num_kv_heads={HKV}, head_dim={D}) or ({B}, {HKV}, {D})"
    wide = cupy.zeros((B, 1, HKV, 2 * D), cupy.float16)
    padded = cupy.zeros((B, 1, HKV, D + 4), cupy.float16)[..., :D]  # head stride 264 bytes
    plan = cupydecode.DecodePlan(B, H, HKV, D, L, "float16")
    for call in (lambda **kw: f(q, k, v, lens, **kw),
                 lambda **kw: plan.run(q, k, v, lens, **kw)):
        with raises(ValueError, "v_new:", "a GPU array like k_new", "got None"):
            call(k_new=kn)
        with raises(ValueError, "k_new:", "a GPU array like v_new", "got None"):
            call(v_new=vn)
        with raises(TypeError, "k_new:", "move it to the GPU"):
            call(k_new=kn.get(), v_new=vn)
        with raises(TypeError, "v_new:", "move it to the GPU"):
            call(k_new=kn, v_new=vn.get().tolist())
        with raises(TypeError, "k_new:", "dtype float16 (q's)", "float32"):
            call(k_new=kn.astype(cupy.float32), v_new=vn)
        with raises(TypeError, "v_new:", "dtype float16 (q's)", "float32"):
            call(k_new=kn, v_new=vn.astype(cupy.float32))
        with raises(ValueError, "k_new:", expected, f"({B}, 2, {HKV}, {D})"):  # 2 tokens
            call(k_new=cupy.ones((B, 2, HKV, D), cupy.float16), v_new=vn)
        with raises(ValueError, "v_new:", expected, f"(1, {HKV}, {D})"):       # batch
            call(k_new=kn, v_new=vn[:1])
        with raises(ValueError, "k_new:", expected, f"({B}, 1, 1, {D})"):      # KV heads
            call(k_new=kn[:, :, :1], v_new=vn)
        with raises(ValueError, "k_new:", "last dimension contiguous"):
            call(k_new=wide[..., ::2], v_new=vn)
        with raises(ValueError, "k_new:", "16-byte aligned"):
            call(k_new=misaligned(cupy, kn.shape, cupy.float16), v_new=vn)
        with raises(ValueError, "v_new:", "16-byte aligned"):
            call(k_new=kn, v_new=padded)
    cupy.cuda.Device().synchronize()
    assert bool(cupy.all(k.view(cupy.uint16) == k0.view(cupy.uint16)))  # nothing launched
    assert bool(cupy.all(v.view(cupy.uint16) == v0.view(cupy.uint16)))
    # after a valid call of the same layout, the same checks still run
    f(q, k, v, lens, k_new=kn, v_new=vn)
    with raises(ValueError, "k_new:", "16-byte aligned"):
        f(q, k, v, lens, k_new=misaligned(cupy, kn.shape, cupy.float16), v_new=vn)
    with raises(ValueError, "v_new:", "a GPU array like k_new"):
        f(q, k, v, lens, k_new=kn)


def test_rare_arguments_refused_by_name_then_a_valid_call(cupy, good):
    """sinks, out, lse, alibi_slopes, k_scale and block_table, through flash_decode and
    DecodePlan.run: each bad value is refused by name before any launch, and afterwards the
    context is healthy (a valid call of each entry point matches the reference)."""
    (q, k, v), (hq, hk, hv) = good
    f = cupydecode.flash_decode
    plan = cupydecode.DecodePlan(B, H, HKV, D, L, "float16")
    run = plan.run
    lengths = cupy.full((B,), L, cupy.int32)
    page = 16
    kp, vp = (x.reshape(B * L // page, page, HKV, D) for x in (k, v))
    table = cupy.arange(B * L // page, dtype=cupy.int32).reshape(B, -1)
    cases = [
        (lambda: f(q, k, v, sinks=cupy.zeros(4, cupy.float32)), ValueError, "sinks:", "(8,)"),
        (lambda: f(q, k, v, sinks=cupy.zeros(H, cupy.float16)), TypeError, "sinks:", "float32"),
        (lambda: f(q, k, v, sinks=cupy.zeros(2 * H, cupy.float32)[::2]), ValueError, "sinks:",
         "contiguous"),
        (lambda: f(q, k, v, sinks=[0.0] * (H - 1) + [math.nan]), ValueError, "sinks:", "finite"),
        (lambda: f(q, k, v, sinks=np.ones(H, bool)), TypeError, "sinks:", "real numbers"),
        (lambda: run(q, k, v, lengths, sinks=np.zeros(H, np.float32)), TypeError, "sinks:"),
        (lambda: run(q, k, v, lengths, sinks=cupy.zeros(4, cupy.float32)), ValueError, "sinks:",
         "(8,)"),
        (lambda: run(q, k, v, lengths, out=cupy.empty((B, H, D), cupy.float32)), TypeError,
         "out:", "float16"),
        (lambda: run(q, k, v, lengths, out=np.empty((B, H, D), np.float16)), TypeError, "out:"),
        (lambda: run(q, k, v, lengths, lse=cupy.empty((B, H), cupy.float16)), TypeError, "lse:",
         "float32"),
        (lambda: run(q, k, v, lengths, lse=cupy.empty((B, 2 * H), cupy.float32)[:, ::2]),
         ValueError, "lse:", "C-contiguous"),
        (lambda: run(q, k, v, lengths, lse=np.empty((B, H), np.float32)), TypeError, "lse:"),
        (lambda: run(q, k, v, lengths, k_scale=1.0), ValueError, "k_scale:", "without kv_dtype"),
        (lambda: f(q, k, v, alibi_slopes=[math.nan] * H), ValueError, "alibi_slopes:", "finite"),
        (lambda: run(q, k, v, lengths, alibi_slopes=cupy.ones(H, cupy.float32)), ValueError,
         "alibi_slopes:", "alibi=True"),
        (lambda: f(q, kp, vp, block_table=table[::-1]), ValueError, "block_table:",
         "non-negative row stride"),
        (lambda: f(q, kp, vp, block_table=np.zeros(table.shape)), TypeError, "block_table:",
         "integers"),
        (lambda: f(q, kp, vp, block_table=table.ravel()), ValueError, "block_table:", "shape"),
        (lambda: f(q, kp, vp, block_table=table.astype(cupy.float32)), TypeError,
         "block_table:", "int32 or int64"),
    ]
    for bad, exc, *fragments in cases:
        with raises(exc, *fragments):
            bad()
    cupy.cuda.Device().synchronize()
    ref_out, ref_lse = R.decode_attention(hq, hk, hv, [L, L])
    out, lse = f(q, k, v, lengths, return_lse=True)
    assert_out_close(out, ref_out, OUT_TOL["float16"], "flash_decode after the refusals")
    got, _ = run(q, k, v, lengths)
    assert_out_close(got, ref_out, OUT_TOL["float16"], "DecodePlan.run after the refusals")
    assert_out_close(f(q, kp, vp, block_table=table), ref_out, OUT_TOL["float16"],
                     "paged flash_decode after the refusals")
    assert np.allclose(cupy.asnumpy(lse), ref_lse, atol=1e-3)


def test_arrays_on_another_gpu_refused_by_name(cupy, good):
    """Each array argument on a GPU other than the current one is refused by name before any
    launch (a kernel would fault on, or silently read through peer access, another device's
    memory). Needs two GPUs."""
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    (q, k, v), _ = good  # on GPU 0, the current one
    with cupy.cuda.Device(1):
        q1, k1, v1 = (cupy.asarray(x.get()) for x in (q, k, v))
        lengths1 = cupy.full((B,), L, cupy.int32)
        heads1 = cupy.zeros(H, cupy.float32)
        out1 = cupy.empty_like(q1)
        new1 = cupy.zeros((B, 1, HKV, D), cupy.float16)
    f = cupydecode.flash_decode
    kv_len = cupy.full((B,), L - 1, cupy.int32)
    cases = [
        (lambda: f(q1, k, v), "q:"),
        (lambda: f(q, k1, v), "k_cache:"),
        (lambda: f(q, k, v1), "v_cache:"),
        (lambda: f(q, k, v, lengths1), "cache_seqlens:"),
        (lambda: f(q, k, v, sinks=heads1), "sinks:"),
        (lambda: f(q, k, v, alibi_slopes=heads1), "alibi_slopes:"),
        (lambda: f(q, k, v, out=out1), "out:"),
        (lambda: f(q, k, v, kv_len, k_new=new1, v_new=new1), "k_new:"),
        (lambda: cupydecode.DecodePlan(B, H, HKV, D, L, "float16").run(q, k, v, lengths1),
         "cache_seqlens:"),
    ]
    for bad, name in cases:
        with raises(ValueError, name, "GPU 1"):
            bad()
    cupy.cuda.Device().synchronize()
