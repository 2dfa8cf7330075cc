"""Float64 NumPy reference for decode attention and for the split/merge algorithm.

No CuPy import: this runs anywhere, and is what the tests and ``cupydecode check`` trust.
CuPy arrays passed in are copied to the host (through their ``.get()``).

Memory traffic of ``decode_attention``: the float64 copies of K and V are 4× (fp16) the cache,
so keep reference problems to a few hundred MB of cache.
"""

from __future__ import annotations

import numpy as np


def to_float64(x) -> np.ndarray:
    """Host float64 copy of a NumPy/ml_dtypes array or anything with ``.get()`` (CuPy)."""
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()
    return np.asarray(x).astype(np.float64)


def seqlens_array(cache_seqlens, batch: int, max_seqlen: int) -> np.ndarray:
    """cache_seqlens (None, int, sequence or array, host or device) as host int64 (batch,)."""
    if cache_seqlens is None:
        return np.full(batch, max_seqlen, np.int64)
    if isinstance(cache_seqlens, (int, np.integer)):
        return np.full(batch, int(cache_seqlens), np.int64)
    if not isinstance(cache_seqlens, np.ndarray) and hasattr(cache_seqlens, "get"):
        cache_seqlens = cache_seqlens.get()
    return np.clip(np.asarray(cache_seqlens, np.int64).reshape(batch), 0, max_seqlen)


def decode_attention(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None):
    """Direct softmax attention in float64: returns ``(out, lse)``.

    q (batch, num_heads, head_dim); k_cache, v_cache (batch, max_seqlen, num_kv_heads, head_dim).
    out (batch, num_heads, head_dim) float64; lse (batch, num_heads) float64, natural log.
    An empty sequence gives out = 0, lse = −inf.
    """
    q, k, v = to_float64(q), to_float64(k_cache), to_float64(v_cache)
    batch, num_heads, head_dim = q.shape
    _, max_seqlen, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    lens = seqlens_array(cache_seqlens, batch, max_seqlen)
    out = np.zeros((batch, num_heads, head_dim))
    lse = np.full((batch, num_heads), -np.inf)
    for b in range(batch):
        n = int(lens[b])
        if n == 0:
            continue
        qb = q[b].reshape(num_kv_heads, group, head_dim)
        s = np.einsum("kgd,nkd->kgn", qb, k[b, :n]) * scale      # s_j = c · q·k_j
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        o = np.einsum("kgn,nkd->kgd", p, v[b, :n]) / l
        out[b] = o.reshape(num_heads, head_dim)
        lse[b] = (m + np.log(l)).reshape(num_heads)
    return out, lse


def split_states(scores: np.ndarray, values: np.ndarray, boundaries) -> tuple[np.ndarray, np.ndarray]:
    """Kernel 1 of DESIGN.md for one query row, in float64.

    scores (n,) are the s_j (already scaled), values (n, head_dim) the v_j; ``boundaries`` the
    chunk edges [0, b1, ..., n]. Returns (Õ, LSE) of shapes (S, head_dim) and (S,); an empty
    chunk gives (0, −inf).
    """
    scores = np.asarray(scores, np.float64)
    values = np.asarray(values, np.float64)
    edges = list(boundaries)
    o = np.zeros((len(edges) - 1, values.shape[1]))
    lse = np.full(len(edges) - 1, -np.inf)
    for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        if b <= a:
            continue
        m = scores[a:b].max()                    # m_i
        w = np.exp(scores[a:b] - m)
        l = w.sum()                              # l_i ≥ 1
        o[i] = (w[:, None] * values[a:b]).sum(0) / l   # Õ_i = V_i / l_i
        lse[i] = m + np.log(l)                   # LSE_i
    return o, lse


def merge_states(o_parts, lse_parts) -> tuple[np.ndarray, np.ndarray]:
    """Kernel 2 of DESIGN.md in float64: o_parts (S, *rows, D), lse_parts (S, *rows).

    Empty states (LSE_i = −inf) are skipped; all empty gives (0, −inf) without NaN.
    """
    o = to_float64(o_parts)
    lse = to_float64(lse_parts)
    mx = lse.max(axis=0)
    live = np.isfinite(mx)
    ref = np.where(live, mx, 0.0)
    w = np.where(np.isneginf(lse), 0.0, np.exp(lse - ref))      # every exponent ≤ 0
    total = w.sum(axis=0)
    safe = np.where(live, total, 1.0)
    merged = np.einsum("s...,s...d->...d", w, np.where(np.isneginf(lse)[..., None], 0.0, o))
    merged = merged / safe[..., None]
    out_lse = np.where(live, ref + np.log(safe), -np.inf)
    return np.where(live[..., None], merged, 0.0), out_lse


def relative_error(x, ref) -> float:
    """‖x − ref‖₂ / ‖ref‖₂ (absolute ‖x‖ when ref is all zeros); NaN anywhere gives inf."""
    x = to_float64(x)
    ref = to_float64(ref)
    if not np.all(np.isfinite(x)):
        return float("inf")
    num = np.linalg.norm(x - ref)
    den = np.linalg.norm(ref)
    return float(num / den) if den > 0 else float(num)


def lse_error(lse, ref_lse) -> float:
    """Max |LSE − ref| over live rows; −inf must match −inf exactly (else inf)."""
    lse = to_float64(lse)
    ref_lse = to_float64(ref_lse)
    dead = np.isneginf(ref_lse)
    if np.any(np.isneginf(lse) != dead) or np.any(np.isnan(lse)):
        return float("inf")
    if np.all(dead):
        return 0.0
    return float(np.max(np.abs(lse[~dead] - ref_lse[~dead])))
