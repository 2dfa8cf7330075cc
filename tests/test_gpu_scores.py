"""Score options through the kernel's score hook, against the float64 reference on the GPU:
``logits_soft_cap`` (s ← c·tanh(s/c)) on every math path, merge mode and kind of call.

Each case has logits well past the cap, so a kernel that ignored the cap (or applied it twice)
fails: checked by comparing the reference with and without the cap.
"""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import DTYPES, OUT_TOL, DecodeCase, to_device

pytestmark = pytest.mark.gpu

# (num_heads, num_kv_heads, head_dim): heads as N (G 2, Gemma-2's head_dim 256; G 4), the
# 16-row path (G 16), several M-tiles (MQA 48), MHA at head_dim 64
LAYOUTS = [(16, 8, 256), (32, 8, 128), (32, 2, 128), (48, 1, 128), (12, 12, 64)]
MODES = [{"num_splits": 1}, {"num_splits": 3, "merge": "fused"},
         {"num_splits": 3, "merge": "kernel"}, {}]


def _assert_cap_matters(case: DecodeCase) -> None:
    """The capped reference is far (≫ tolerance) from the uncapped one on these inputs."""
    plain, _ = R.decode_attention(*case.host, case.lengths)
    diff = R.relative_error(plain, case.ref_out)
    assert diff > 20 * OUT_TOL[case.dtype], f"the cap changes the output by only {diff:.2e} {case.ctx}"


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "{}-{}-{}".format(*x))
@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_cap_matches_reference(cupy, rng, seed, dtype, layout):
    """Cap 4 on logits of about ±25 (q_scale 6): each merge mode and the automatic plan through
    DecodePlan, and flash_decode; ragged lengths with a 1-token and an empty sequence."""
    num_heads, num_kv_heads, head_dim = layout
    case = DecodeCase(rng, seed, 4, num_heads, num_kv_heads, head_dim, 1200, dtype,
                      [1200, 1, 0, 777], q_scale=6.0, logits_soft_cap=4.0)
    _assert_cap_matters(case)
    for mode in MODES:
        plan = case.plan(**mode)
        assert plan.config.soft_cap and plan.logits_soft_cap == 4.0, plan
        case.check(*case.run(plan), f"{mode} merge={plan.merge}")
    case.check(*case.flash_decode(), "flash_decode")
    case.check(*case.flash_decode(num_splits=2), "flash_decode splits=2")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_soft_cap_gemma2(cupy, rng, seed, dtype):
    """Gemma-2's cap of 50 at its shapes (9B: 16/8/256), logits of about ±250 (q_scale 60)."""
    case = DecodeCase(rng, seed, 3, 16, 8, 256, 4097, dtype, [4097, 2000, 3], q_scale=60.0,
                      logits_soft_cap=50.0)
    _assert_cap_matters(case)
    case.check(*case.flash_decode())
    case.check(*case.flash_decode(num_splits=1), "splits=1")


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_soft_cap_large_logits(cupy, rng, seed, dtype):
    """Logits of ±1e4 are capped to ±50: finite, and equal to the reference."""
    case = DecodeCase(rng, seed, 2, 32, 8, 128, 1024, dtype, q_scale=2400.0, logits_soft_cap=50.0)
    for mode in MODES[:3]:
        out, lse = case.run(case.plan(**mode))
        assert bool(cupy.all(cupy.isfinite(lse))) and bool(cupy.all(lse <= 50.0 + np.log(1024))), (
            mode, case.ctx)
        case.check(out, lse, str(mode))


def test_soft_cap_with_softmax_scale_and_kv_groups(cupy, rng, seed, monkeypatch):
    """A per-call softmax_scale rescales before the cap (plan.run and flash_decode), and blocks
    of several KV heads (forced) cap alike."""
    from cupydecode import _policy

    case = DecodeCase(rng, seed, 3, 32, 8, 128, 1024, "float16", [1024, 500, 0], q_scale=3.0,
                      logits_soft_cap=3.0)
    scale = 0.5
    ref_out, ref_lse = R.decode_attention(*case.host, case.lengths, softmax_scale=scale,
                                          logits_soft_cap=3.0)
    case.ref_out, case.ref_lse = ref_out, ref_lse
    plan = case.plan(num_splits=3)
    out, lse = case.poisoned()
    case.check(*plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse,
                         softmax_scale=scale), "plan softmax_scale")
    case.check(*case.flash_decode(softmax_scale=scale), "flash_decode softmax_scale")
    case.ref_out, case.ref_lse = R.decode_attention(*case.host, case.lengths, logits_soft_cap=3.0)
    monkeypatch.setattr(_policy, "kv_per_block", lambda *a, **k: _policy.KV_GROUP)
    for mode in MODES[:3]:
        plan = case.plan(**mode)
        assert plan.kv_per_block == _policy.KV_GROUP and plan.config.soft_cap, plan
        case.check(*case.run(plan), f"kv groups {mode}")


def test_soft_cap_in_a_graph(cupy, rng, seed):
    """A capped plan captured once and replayed after q changes in place."""
    case = DecodeCase(rng, seed, 2, 32, 8, 128, 2048, "bfloat16", q_scale=5.0, logits_soft_cap=5.0)
    plan = case.plan()
    out, lse = case.poisoned()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse)  # compile, then capture
        stream.begin_capture()
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse)
        graph = stream.end_capture()
        out.fill(np.nan)
        lse.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    case.check(out, lse, "graph")
    q2 = R.to_float64(case.host[0])[:, ::-1].astype(case.host[0].dtype)  # heads reversed
    case.ref_out, case.ref_lse = R.decode_attention(q2, *case.host[1:], case.lengths,
                                                    logits_soft_cap=5.0)
    with stream:  # every update in stream order with the replay (a non-blocking stream)
        case.q[...] = to_device(q2)
        out.fill(np.nan)
        lse.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    case.check(out, lse, "graph after q changed")


def test_no_cap_is_the_plain_kernel(cupy):
    """None and 0 mean no cap: the plan's kernel is the one without SOFT_CAP."""
    for cap in (None, 0, 0.0):
        plan = cupydecode.DecodePlan(2, 32, 8, 128, 256, "float16", logits_soft_cap=cap)
        assert plan.logits_soft_cap is None and not plan.config.soft_cap
        assert plan.config.defines()["SOFT_CAP"] == 0


def _alibi_case(rng, seed, layout, dtype, lengths, max_seqlen, **options):
    """A DecodeCase whose reference has ALiBi with random positive slopes (as large as 0.5, so
    the bias is far from negligible over hundreds of tokens); returns (case, host and device
    slopes)."""
    num_heads = layout[0]
    slopes = rng.uniform(0.001, 0.5, num_heads).astype(np.float32)
    case = DecodeCase(rng, seed, len(lengths), *layout, max_seqlen, dtype, lengths,
                      alibi_slopes=slopes, **options)
    case.plan_options = options  # what a DecodePlan takes (the slopes go to each run)
    return case, slopes, to_device(slopes)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "{}-{}-{}".format(*x))
@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_matches_reference(cupy, rng, seed, dtype, layout):
    """ALiBi through each merge mode of a plan and through flash_decode (device and host
    slopes); ragged lengths with a 1-token and an empty sequence. The bias matters: the
    reference without it is far off."""
    case, slopes, d_slopes = _alibi_case(rng, seed, layout, dtype, [1200, 1, 0, 777], 1200)
    plain, _ = R.decode_attention(*case.host, case.lengths)
    assert R.relative_error(plain, case.ref_out) > 20 * OUT_TOL[dtype], case.ctx
    for mode in MODES:
        plan = cupydecode.DecodePlan(*case.shape, dtype, alibi=True, **mode)
        assert plan.config.alibi and plan.alibi, plan
        out, lse = case.poisoned()
        case.check(*plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse,
                             alibi_slopes=d_slopes), f"{mode} merge={plan.merge}")
    case.check(*case.flash_decode(), "flash_decode, host slopes")
    case.options = dict(case.options, alibi_slopes=d_slopes)
    case.check(*case.flash_decode(num_splits=2), "flash_decode, device slopes, splits=2")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_alibi_with_the_soft_cap_a_window_and_pages(cupy, rng, seed, dtype):
    """ALiBi after the soft-cap (the reference's order), with a window, on a paged cache."""
    from helpers import to_paged

    lens = [3000, 800, 17, 0]
    case, slopes, d_slopes = _alibi_case(rng, seed, (32, 8, 128), dtype, lens, 3000, q_scale=4.0,
                                         logits_soft_cap=30.0, window_left=700)
    kp, vp, table = to_paged(rng, case.host[1], case.host[2], 16)
    plan = cupydecode.DecodePlan(4, 32, 8, 128, 3000, dtype, page_size=16, alibi=True,
                                 logits_soft_cap=30.0, window_left=700)
    out, lse = case.poisoned()
    case.check(*plan.run(case.q, to_device(kp), to_device(vp), case.seqlens, out=out, lse=lse,
                         block_table=cupy.asarray(table), alibi_slopes=d_slopes))


def test_alibi_slopes_change_in_place_between_replays(cupy, rng, seed):
    """A captured ALiBi plan reads the slopes' current values on every replay."""
    case, slopes, d_slopes = _alibi_case(rng, seed, (32, 8, 128), "float16", [2000, 999], 2000)
    plan = cupydecode.DecodePlan(*case.shape, "float16", alibi=True)
    out, lse = case.poisoned()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse, alibi_slopes=d_slopes)
        stream.synchronize()
        stream.begin_capture()
        plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse, alibi_slopes=d_slopes)
        graph = stream.end_capture()
        for scale in (1.0, 0.1):
            d_slopes[...] = cupy.asarray(slopes * np.float32(scale))
            out[...] = np.nan
            graph.launch(stream)
            stream.synchronize()
            case.ref_out, case.ref_lse = R.decode_attention(
                *case.host, case.lengths, alibi_slopes=slopes * np.float32(scale))
            case.check(out, lse, f"slopes x{scale}")


def test_alibi_validation(cupy, rng):
    q = to_device(rng.standard_normal((2, 8, 128)).astype(np.float16))
    k = to_device(rng.standard_normal((2, 64, 8, 128)).astype(np.float16))
    f = cupydecode.flash_decode
    with pytest.raises(ValueError, match="alibi_slopes: expected shape \\(8,\\)"):
        f(q, k, k, alibi_slopes=cupy.ones(4, cupy.float32))
    with pytest.raises(TypeError, match="alibi_slopes: expected dtype float32"):
        f(q, k, k, alibi_slopes=cupy.ones(8, cupy.float16))
    with pytest.raises(ValueError, match="alibi_slopes: expected a contiguous"):
        f(q, k, k, alibi_slopes=cupy.ones(16, cupy.float32)[::2])
    plan = cupydecode.DecodePlan(2, 8, 8, 128, 64, "float16", alibi=True)
    with pytest.raises(ValueError, match="alibi_slopes: expected a \\(num_heads=8,\\)"):
        plan.run(q, k, k)
    with pytest.raises(TypeError, match="alibi_slopes"):
        plan.run(q, k, k, alibi_slopes=np.ones(8, np.float32))  # a plan never copies
    with pytest.raises(TypeError, match="alibi: expected True or False"):
        cupydecode.DecodePlan(2, 8, 8, 128, 64, "float16", alibi=1)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "{}-{}-{}".format(*x))
@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_match_reference(cupy, rng, seed, dtype, layout):
    """Sinks (gpt-oss: a logit per query head in the denominator) join once, whatever the merge:
    one split (the split kernel's epilogue), the fused merge and the merge kernel; an empty
    sequence gives out 0 and lse σ; through flash_decode (host and device sinks) and plans."""
    num_heads = layout[0]
    sinks = rng.uniform(-2.0, 6.0, num_heads).astype(np.float32)
    case = DecodeCase(rng, seed, 4, *layout, 1200, dtype, [1200, 1, 0, 777], sinks=sinks)
    plain, _ = R.decode_attention(*case.host, case.lengths)
    assert R.relative_error(plain, case.ref_out) > 20 * OUT_TOL[dtype], case.ctx
    d_sinks = to_device(sinks)
    for mode in MODES:
        plan = cupydecode.DecodePlan(*case.shape, dtype, **mode)
        out, lse = case.poisoned()
        case.check(*plan.run(case.q, case.k, case.v, case.seqlens, out=out, lse=lse,
                             sinks=d_sinks), f"{mode} merge={plan.merge}")
    case.check(*case.flash_decode(), "flash_decode, host sinks")
    case.options = dict(case.options, sinks=d_sinks)
    case.check(*case.flash_decode(num_splits=3), "flash_decode, device sinks, splits=3")
    _, lse = case.flash_decode(num_splits=1)
    assert np.allclose(lse[2].get(), sinks, atol=1e-5), case.ctx  # the empty sequence


def test_host_values_outlive_their_launch(cupy, rng, seed):
    """flash_decode copies host lengths, sinks and ALiBi slopes to the device; those copies stay
    alive until the kernel that reads them is launched, so the outputs it allocates after them
    (out, lse: the same sizes, the pool's next blocks) never take their memory. One split (the
    split kernel's epilogue reads the sinks and writes lse), 3 and the policy's splits; every
    call a miss (host values are checked each time)."""
    heads = 12
    sinks = rng.uniform(-2.0, 6.0, heads).astype(np.float32)
    slopes = rng.uniform(0.01, 0.2, heads).astype(np.float32)
    lengths = [900, 1, 0, 333]
    case = DecodeCase(rng, seed, 4, heads, heads, 64, 900, "float16", lengths, sinks=sinks,
                      alibi_slopes=slopes)
    for splits in (1, 3, None):
        for rnd in range(3):
            out, lse = cupydecode.flash_decode(
                case.q, case.k, case.v, lengths, sinks=list(sinks), alibi_slopes=list(slopes),
                num_splits=splits, return_lse=True)
            case.check(out, lse, f"splits={splits} round {rnd}")
