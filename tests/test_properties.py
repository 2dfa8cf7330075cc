"""Properties of the split/merge algorithm on the float64 reference (CPU, hypothesis).

The GPU kernels are checked against this reference elsewhere; here the reference's own
algebra is checked on random inputs: splitting and merging gives the direct softmax whatever
the chunk edges (empty chunks included), the merge does not depend on the order of the states,
merging merged states equals merging them all at once, and a batch permutation permutes the
outputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from cupydecode import reference as R

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None)


def _direct(scores, values):
    m = scores.max()
    p = np.exp(scores - m)
    return (p[:, None] * values).sum(0) / p.sum(), m + np.log(p.sum())


@st.composite
def rows(draw, max_tokens=200, head_dim=8):
    """(scores, values, chunk edges): scores around a random centre up to ±1e4 (past float32's
    exp range), random chunk edges from 0 to n, repeated edges giving empty chunks."""
    n = draw(st.integers(1, max_tokens))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    centre = draw(st.sampled_from([0.0, 120.0, -300.0, 1e4]))
    spread = draw(st.sampled_from([0.1, 3.0, 30.0]))
    scores = centre + spread * rng.standard_normal(n)
    values = rng.standard_normal((n, head_dim))
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=12)))
    return scores, values, [0, *cuts, n]


@SETTINGS
@given(rows())
def test_split_then_merge_is_the_direct_softmax(row):
    scores, values, edges = row
    o_parts, lse_parts = R.split_states(scores, values, edges)
    o, lse = R.merge_states(o_parts, lse_parts)
    want_o, want_lse = _direct(scores, values)
    assert np.allclose(o, want_o, rtol=1e-10, atol=1e-12)
    assert np.isclose(lse, want_lse, rtol=1e-12, atol=1e-9)


@SETTINGS
@given(rows(), st.randoms(use_true_random=False))
def test_merge_does_not_depend_on_the_order_of_states(row, shuffle):
    scores, values, edges = row
    o_parts, lse_parts = R.split_states(scores, values, edges)
    order = list(range(len(lse_parts)))
    shuffle.shuffle(order)
    o, lse = R.merge_states(o_parts, lse_parts)
    o2, lse2 = R.merge_states(o_parts[order], lse_parts[order])
    assert np.allclose(o, o2, rtol=1e-12, atol=1e-13) and np.isclose(lse, lse2, rtol=1e-14)


@SETTINGS
@given(rows(), st.data())
def test_merging_merged_states_equals_merging_all(row, data):
    scores, values, edges = row
    o_parts, lse_parts = R.split_states(scores, values, edges)
    s = len(lse_parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, s), max_size=4)))
    groups = [(a, b) for a, b in zip([0, *cuts], [*cuts, s])]
    merged = [R.merge_states(o_parts[a:b], lse_parts[a:b]) if b > a
              else (np.zeros(values.shape[1]), -np.inf) for a, b in groups]
    o2, lse2 = R.merge_states(np.stack([m[0] for m in merged]),
                              np.asarray([m[1] for m in merged]))
    o, lse = R.merge_states(o_parts, lse_parts)
    assert np.allclose(o, o2, rtol=1e-10, atol=1e-12) and np.isclose(lse, lse2, rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.sampled_from([(4, 4), (8, 2), (6, 1)]), st.integers(1, 70),
       st.integers(0, 2**32 - 1))
def test_batch_permutation_permutes_the_outputs(batch, heads, max_seqlen, seed):
    num_heads, num_kv_heads = heads
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, num_heads, 8))
    k = rng.standard_normal((batch, max_seqlen, num_kv_heads, 8))
    v = rng.standard_normal((batch, max_seqlen, num_kv_heads, 8))
    lens = rng.integers(0, max_seqlen + 1, batch)
    perm = rng.permutation(batch)
    out, lse = R.decode_attention(q, k, v, lens)
    out_p, lse_p = R.decode_attention(q[perm], k[perm], v[perm], lens[perm])
    assert np.array_equal(out_p, out[perm]) and np.array_equal(lse_p, lse[perm])
