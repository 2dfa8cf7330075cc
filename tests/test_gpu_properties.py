"""GPU twins of the reference's properties (tests/test_properties.py), on random shapes drawn by
hypothesis: the kernels' split and merge give the float64 softmax for any split count or size;
merge_states does not depend on the order of the states, and merging merged states equals
merging them all; a batch permutation permutes the outputs bit for bit; a fixed split_size gives
a sequence bitwise the same result whatever the rest of the batch. Each example draws fresh
data from its own seed, shown when it fails."""

from __future__ import annotations

import numpy as np
import pytest

import cupydecode
from cupydecode import reference as R
from helpers import LSE_TOL, OUT_TOL, assert_lse_close, assert_out_close, decode_inputs, to_device

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.gpu

# (the cupy fixture is function-scoped and the same object for every example)
SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
LAYOUTS = [(8, 2, 128), (4, 4, 64), (16, 1, 128), (8, 8, 80), (8, 4, 256), (48, 1, 128)]


@st.composite
def problems(draw):
    """(seed, batch, layout, dtype, max_seqlen, lengths): lengths from 0 to max_seqlen."""
    seed = draw(st.integers(0, 2**32 - 1))
    batch = draw(st.integers(1, 4))
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from(["float16", "bfloat16"]))
    max_seqlen = draw(st.integers(1, 3000))
    lengths = draw(st.lists(st.integers(0, max_seqlen), min_size=batch, max_size=batch))
    return seed, batch, layout, dtype, max_seqlen, lengths


def _inputs(problem):
    seed, batch, (heads, kv_heads, dim), dtype, max_seqlen, lengths = problem
    rng = np.random.default_rng(seed)
    return decode_inputs(rng, batch, heads, kv_heads, dim, max_seqlen, dtype), rng


@SETTINGS
@given(problems(), st.one_of(st.none(), st.integers(1, 9).map(lambda n: {"num_splits": n}),
                             st.integers(1, 40).map(lambda n: {"split_size": 64 * n})))
def test_any_split_gives_the_softmax(cupy, problem, splits):
    (q, k, v), _ = _inputs(problem)
    lens = problem[-1]
    ref_out, ref_lse = R.decode_attention(q, k, v, lens)
    out, lse = cupydecode.flash_decode(to_device(q), to_device(k), to_device(v),
                                       cupy.asarray(np.asarray(lens, np.int32)), return_lse=True,
                                       **(splits or {}))
    ctx = f"[{problem} {splits}]"
    assert_out_close(out, ref_out, OUT_TOL[problem[3]], ctx)
    assert_lse_close(lse, ref_lse, LSE_TOL[problem[3]], ctx)


@st.composite
def states(draw):
    """(o_parts, lse_parts) of 1–12 states of 1–40 rows, head_dim 8–256: LSEs around a random
    centre up to ±1e4, with empty states (−inf, and +inf as some libraries write them)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n, rows = draw(st.integers(1, 12)), draw(st.integers(1, 40))
    dim = draw(st.sampled_from([8, 64, 80, 128, 256]))
    centre = draw(st.sampled_from([0.0, 120.0, -300.0, 1e4]))
    lse = (centre + 5.0 * rng.standard_normal((n, rows))).astype(np.float32)
    empty = rng.random((n, rows)) < draw(st.sampled_from([0.0, 0.2, 0.6]))
    lse[empty] = np.where(rng.random(int(empty.sum())) < 0.5, -np.inf, np.inf)
    o = rng.standard_normal((n, rows, dim)).astype(np.float32)
    return seed, o, lse


def _merged_ref(o, lse):
    """The reference's merge with +inf read as empty (the API's convention)."""
    lse64 = np.where(np.isposinf(lse), -np.inf, lse).astype(np.float64)
    outs, lses = zip(*(R.merge_states(o[:, r].astype(np.float64), lse64[:, r])
                       for r in range(o.shape[1])))
    return np.stack(outs), np.asarray(lses)


@SETTINGS
@given(states(), st.randoms(use_true_random=False))
def test_merge_states_is_the_reference_in_any_order(cupy, state, shuffle):
    seed, o, lse = state
    order = list(range(o.shape[0]))
    shuffle.shuffle(order)
    got, got_lse = cupydecode.merge_states(cupy.asarray(o), cupy.asarray(lse))
    got2, got2_lse = cupydecode.merge_states(cupy.asarray(o[order]), cupy.asarray(lse[order]))
    want, want_lse = _merged_ref(o, lse)
    ctx = f"[seed={seed} order={order}]"
    for out, out_lse in ((got, got_lse), (got2, got2_lse)):
        assert np.allclose(out.get(), want, rtol=1e-5, atol=1e-6), ctx
        assert_lse_close(out_lse, want_lse, 1e-5, ctx, rtol=1e-6)
    assert np.allclose(got.get(), got2.get(), rtol=1e-5, atol=1e-6), ctx


@SETTINGS
@given(states(), st.data())
def test_merging_merged_states_equals_merging_all(cupy, state, data):
    seed, o, lse = state
    n = o.shape[0]
    cuts = sorted(data.draw(st.lists(st.integers(1, n), max_size=4, unique=True)))
    groups = [(a, b) for a, b in zip([0, *cuts], [*cuts, n]) if b > a]
    parts = [cupydecode.merge_states(cupy.asarray(o[a:b]), cupy.asarray(lse[a:b]))
             for a, b in groups]
    again, again_lse = cupydecode.merge_states(cupy.stack([p[0] for p in parts]),
                                               cupy.stack([p[1] for p in parts]))
    whole, whole_lse = cupydecode.merge_states(cupy.asarray(o), cupy.asarray(lse))
    ctx = f"[seed={seed} groups={groups}]"
    # each group's merged LSE is a float32: rounded by up to |LSE| · 2^-24, which scales that
    # group's weight by as much (inherent in the representation, whatever merges it)
    live = np.abs(lse[np.isfinite(lse)])
    tol = 1e-5 + 4 * 2.0**-24 * (float(live.max()) if live.size else 0.0)
    assert np.allclose(again.get(), whole.get(), rtol=tol, atol=tol), ctx
    assert_lse_close(again_lse, whole_lse.get(), 1e-5, ctx, rtol=1e-6)


@SETTINGS
@given(problems())
def test_a_batch_permutation_permutes_the_outputs(cupy, problem):
    """The same plan (same batch size) over permuted sequences: each sequence's result is
    computed the same way wherever it sits, so the outputs permute bit for bit."""
    (q, k, v), rng = _inputs(problem)
    lens = np.asarray(problem[-1], np.int32)
    perm = rng.permutation(len(lens))
    out, lse = cupydecode.flash_decode(to_device(q), to_device(k), to_device(v),
                                       cupy.asarray(lens), return_lse=True)
    out_p, lse_p = cupydecode.flash_decode(to_device(q[perm]), to_device(k[perm]),
                                           to_device(v[perm]), cupy.asarray(lens[perm]),
                                           return_lse=True)
    ctx = f"[{problem} perm={perm}]"
    assert bool(cupy.all(out_p.view(cupy.uint16) == out[cupy.asarray(perm)].view(cupy.uint16))), ctx
    assert bool(cupy.all((lse_p == lse[cupy.asarray(perm)]) | (cupy.isnan(lse_p) & cupy.isnan(lse[cupy.asarray(perm)])))), ctx


@SETTINGS
@given(problems(), st.integers(1, 40))
def test_a_fixed_split_size_makes_a_sequence_independent_of_its_batch(cupy, problem, n):
    """split_size: sequence b alone gives bit for bit what it gives inside the batch."""
    (q, k, v), _ = _inputs(problem)
    lens = np.asarray(problem[-1], np.int32)
    split = 64 * n
    dq, dk, dv = to_device(q), to_device(k), to_device(v)
    out, lse = cupydecode.flash_decode(dq, dk, dv, cupy.asarray(lens), split_size=split,
                                       return_lse=True)
    for b in range(len(lens)):
        one, one_lse = cupydecode.flash_decode(
            cupy.ascontiguousarray(dq[b:b + 1]), cupy.ascontiguousarray(dk[b:b + 1]),
            cupy.ascontiguousarray(dv[b:b + 1]), cupy.asarray(lens[b:b + 1]), split_size=split,
            return_lse=True)
        ctx = f"[{problem} split_size={split} b={b}]"
        assert bool(cupy.all(one[0].view(cupy.uint16) == out[b].view(cupy.uint16))), ctx
        assert bool(cupy.all(one_lse[0] == lse[b])), ctx
