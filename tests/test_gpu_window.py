"""Sliding windows (``window_left`` W: each sequence attends its last W + 1 tokens) on the GPU,
against the float64 reference with the same window.

The cache before each window is NaN as well as past each length: a kernel that reads a single
token outside the window turns its output NaN. Outputs are NaN-poisoned. Every case also checks
that the window matters (the reference without it is far off), so a kernel that ignored it fails.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import DTYPES, OUT_TOL, DecodeCase, to_device, to_paged

pytestmark = pytest.mark.gpu

# (num_heads, num_kv_heads, head_dim): heads as N (G 4), the 16-row path (G 16), M-tiles
# (MQA 48), head_dim 64 and 256
LAYOUTS = [(32, 8, 128), (32, 2, 128), (48, 1, 128), (12, 4, 64), (16, 8, 256)]
MODES = [{"num_splits": 1}, {"num_splits": 3, "merge": "fused"},
         {"num_splits": 3, "merge": "kernel"}, {}]
# windows: the last token only, shorter than a tile, ending mid-tile, several tiles, longer than
# some of the sequences (they attend everything), longer than the cache
WINDOWS = (0, 5, 16, 100, 700, 5000)
LENGTHS = [1500, 1, 0, 777, 16, 101]


def _nan_before_window(case: DecodeCase, window: int) -> None:
    """The device cache's tokens before each sequence's window set to NaN (the host copy, which
    the reference read, keeps its values)."""
    for b, n in enumerate(case.lengths):
        lo = max(0, n - 1 - window)
        case.k[b, :lo] = np.nan
        case.v[b, :lo] = np.nan


def _assert_window_matters(case: DecodeCase, window: int) -> None:
    if all(n <= window + 1 for n in case.lengths):
        return  # every sequence fits its window: the window changes nothing here
    plain, _ = R.decode_attention(*case.host, case.lengths)
    diff = R.relative_error(plain, case.ref_out)
    # a kernel that ignored the window would be off by about diff: far past the check's tolerance
    assert diff > 2 * OUT_TOL[case.dtype], f"the window changes the output by {diff:.2e} {case.ctx}"


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "{}-{}-{}".format(*x))
@pytest.mark.parametrize("dtype", DTYPES)
def test_window_matches_reference(cupy, rng, seed, dtype, layout, window):
    """Each merge mode and the automatic plan through DecodePlan, and flash_decode; ragged
    lengths with a 1-token and an empty sequence; the plan's splits sized from the window."""
    case = DecodeCase(rng, seed, len(LENGTHS), *layout, 1500, dtype, LENGTHS, window_left=window)
    _nan_before_window(case, window)
    _assert_window_matters(case, window)
    for mode in MODES:
        plan = case.plan(**mode)
        assert plan.window_left == window and plan.span == min(1500, window + 1), plan
        if "num_splits" not in mode:
            assert plan.chunk_tokens * plan.num_splits >= plan.span, plan
        case.check(*case.run(plan), f"{mode} merge={plan.merge}")
    case.check(*case.flash_decode(), "flash_decode")
    case.check(*case.flash_decode(num_splits=2), "flash_decode splits=2")


def test_window_minus_one_is_no_window(cupy, rng, seed):
    """window_left=-1 (FlashAttention's "no window") runs the plain plan."""
    case = DecodeCase(rng, seed, 3, 32, 8, 128, 1000, "float16", [1000, 0, 17], window_left=-1)
    plan = case.plan()
    assert plan.window_left is None and plan.span == 1000
    case.check(*case.run(plan))
    case.check(*case.flash_decode())


@pytest.mark.parametrize("page_size", (1, 16, 100))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_window_on_paged_caches(cupy, rng, seed, dtype, page_size):
    """A window over paged caches (pages in random order, NaN before each window too), with
    the soft-cap, through DecodePlan and flash_decode."""
    lens = [3000, 1200, 17, 0]
    case = DecodeCase(rng, seed, 4, 32, 8, 128, 3000, dtype, lens, q_scale=4.0, window_left=1000,
                      logits_soft_cap=30.0)
    q, k, v = case.host
    k, v = k.copy(), v.copy()
    for b, n in enumerate(lens):
        lo = max(0, n - 1 - 1000)
        k[b, :lo] = np.nan
        v[b, :lo] = np.nan
    kp, vp, table = to_paged(rng, k, v, page_size)
    kp, vp, table = to_device(kp), to_device(vp), cupy.asarray(table)
    plan = cupydecode.DecodePlan(4, 32, 8, 128, 3000, dtype, page_size=page_size,
                                 window_left=1000, logits_soft_cap=30.0)
    out, lse = case.poisoned()
    case.check(*plan.run(case.q, kp, vp, case.seqlens, out=out, lse=lse, block_table=table),
               "plan")
    out, _ = case.poisoned()
    case.check(*cupydecode.flash_decode(case.q, kp, vp, case.seqlens, out=out, return_lse=True,
                                        block_table=table, window_left=1000,
                                        logits_soft_cap=30.0), "flash_decode")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_window_with_appended_tokens(cupy, rng, seed, dtype):
    """The new token (k_new, v_new) is inside its own window: attention over the last W + 1
    tokens of the grown sequence, and the token written into the cache."""
    lens = [2000, 999, 0, 2047]
    w = 300
    case = DecodeCase(rng, seed, 4, 32, 8, 128, 2048, dtype, lens)
    k_new = rng.standard_normal((4, 1, 8, 128)).astype(case.host[1].dtype)
    v_new = rng.standard_normal((4, 1, 8, 128)).astype(case.host[1].dtype)
    ref_out, ref_lse = R.decode_attention(*case.host, lens, k_new=k_new, v_new=v_new,
                                          window_left=w)
    exp_k, exp_v, grown = R.append_kv(case.host[1], case.host[2], np.asarray(lens), k_new, v_new)
    case.ref_out, case.ref_lse = ref_out, ref_lse
    case.lengths = [int(n) for n in grown]  # rows are empty only where the grown length is 0
    for b, n in enumerate(grown):
        case.k[b, :max(0, n - 1 - w)] = np.nan
        case.v[b, :max(0, n - 1 - w)] = np.nan
    plan = cupydecode.DecodePlan(4, 32, 8, 128, 2048, dtype, window_left=w)
    out, lse = case.poisoned()
    case.check(*plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse,
                         k_new=to_device(k_new), v_new=to_device(v_new)), "plan")
    for b, n in enumerate(lens):
        if n < 2048:
            row = case.k[b, n].get().astype(np.float32)
            assert np.array_equal(row, exp_k[b, n].astype(np.float32)), (b, case.ctx)


def test_window_plan_in_a_graph_with_lengths_changed_in_place(cupy, rng, seed):
    """A windowed plan captured once: lengths changed in place between replays move each
    window along the cache."""
    case = DecodeCase(rng, seed, 3, 32, 8, 128, 4096, "float16", [4096, 3000, 10],
                      window_left=511)
    plan = case.plan()
    out, lse = case.poisoned()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse)  # compile, outside
        stream.synchronize()
        stream.begin_capture()
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse)
        graph = stream.end_capture()
        # (within the first lengths: the cache past them is NaN)
        for lens in ([4096, 3000, 10], [2000, 2999, 5], [0, 1, 10], [4095, 600, 1]):
            case.seqlens[...] = cupy.asarray(np.asarray(lens, np.int32))
            out[...] = np.nan
            lse[...] = np.nan
            graph.launch(stream)
            stream.synchronize()
            ref_out, ref_lse = R.decode_attention(*case.host, lens, window_left=511)
            case.ref_out, case.ref_lse, case.lengths = ref_out, ref_lse, lens
            case.check(out, lse, f"lengths {lens}")


def test_window_reads_only_the_window(cupy, rng, seed):
    """A window of 4095 over a cache of 65536 tokens: the plan's splits cover 4096 tokens, as a
    plan of a 4096-token cache does (its cost is that cache's, not the long one's)."""
    windowed = cupydecode.DecodePlan(1, 32, 8, 128, 65536, "float16", window_left=4095)
    short = cupydecode.DecodePlan(1, 32, 8, 128, 4096, "float16")
    assert (windowed.num_splits, windowed.chunk_tokens) == (short.num_splits, short.chunk_tokens)
    assert windowed.span == 4096 and "window_left=4095" in repr(windowed)


@pytest.mark.parametrize("bad,exc", [(-2, ValueError), (2.0, TypeError), (True, TypeError)])
def test_window_validation(cupy, rng, bad, exc):
    q = cupy.zeros((1, 8, 128), cupy.float16)
    k = cupy.zeros((1, 64, 8, 128), cupy.float16)
    with pytest.raises(exc, match="window_left"):
        cupydecode.flash_decode(q, k, k, window_left=bad)
    with pytest.raises(exc, match="window_left"):
        cupydecode.DecodePlan(1, 8, 8, 128, 64, "float16", window_left=bad)
