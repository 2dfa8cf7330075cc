"""Float64 NumPy reference for decode attention and for the split/merge algorithm.

No CuPy import: this runs anywhere, and is what the tests and ``cupydecode check`` trust.
CuPy arrays passed in are copied to the host (through their ``.get()``); the same computation
runs on the GPU with ``xp=cupy`` (:func:`attention_rows`) where the host would be too slow.

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


def attention_rows(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None,
                   batch_ids=None, kv_heads=None, xp=np, logits_soft_cap=None,
                   block_table=None):
    """Direct softmax attention in float64 for some sequences and KV heads: the one reference
    computation, with NumPy (``xp=numpy``: GPU inputs are copied to the host) or with CuPy
    (``xp=cupy``: on the GPU, for caches too large for the host reference).

    s_j = c · q·k_j (c = 1/sqrt(head_dim) unless ``softmax_scale``), then with
    ``logits_soft_cap`` t > 0 s_j ← t · tanh(s_j / t) (Gemma-2); O = Σ_j softmax(s)_j v_j,
    LSE = ln Σ_j e^{s_j}. ``batch_ids`` / ``kv_heads`` select what to compute (None: all).
    With ``block_table`` (batch, max_pages_per_seq) the cache is paged, (num_pages, page_size,
    num_kv_heads, head_dim): token t of sequence b is row t % page_size of page
    block_table[b, t // page_size]; a token whose page index is outside [0, num_pages)
    contributes nothing.
    Returns ``(out, lse)`` of xp float64 arrays of shapes (nb, nk, G, D) and (nb, nk, G), with
    G = num_heads // num_kv_heads (the query heads of each selected KV head, in order). An empty
    sequence gives out = 0, lse = −inf. Memory: float64 copies of one sequence's K and V for the
    selected heads at a time.
    """
    if xp is np:
        q, k_cache, v_cache = (_host(x) for x in (q, k_cache, v_cache))
    table = None if block_table is None else _host(block_table).astype(np.int64)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    max_seqlen = k_cache.shape[1] * (1 if table is None else table.shape[1])  # capacity
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    if cap is not None and not (cap > 0 and np.isfinite(cap)):
        raise ValueError(f"logits_soft_cap: expected a finite number > 0 or None, got {cap}")
    lens = seqlens_array(cache_seqlens, batch, max_seqlen)
    batch_ids = list(range(batch)) if batch_ids is None else list(batch_ids)
    kv_heads = list(range(num_kv_heads)) if kv_heads is None else list(kv_heads)
    out = xp.zeros((len(batch_ids), len(kv_heads), group, head_dim), xp.float64)
    lse = xp.full((len(batch_ids), len(kv_heads), group), -np.inf, xp.float64)
    for i, b in enumerate(batch_ids):
        n = int(lens[b])
        if n == 0:
            continue
        rows = _token_rows(k_cache, b, n, table, xp)
        if rows is not None and len(rows[0]) == 0:
            continue  # every page of the sequence out of range: nothing to attend
        qb = q[b].reshape(num_kv_heads, group, head_dim)[kv_heads].astype(xp.float64)
        kb = _rows(k_cache, b, n, rows)[:, kv_heads].astype(xp.float64)   # (n, nk, D)
        s = xp.einsum("kgd,nkd->kgn", qb, kb) * scale              # s_j = c · q·k_j
        if cap is not None:
            s = cap * xp.tanh(s / cap)                              # s_j ← t · tanh(s_j / t)
        del kb
        m = s.max(axis=-1, keepdims=True)
        p = xp.exp(s - m)
        del s
        l = p.sum(axis=-1, keepdims=True)
        vb = _rows(v_cache, b, n, rows)[:, kv_heads].astype(xp.float64)
        out[i] = xp.einsum("kgn,nkd->kgd", p, vb) / l
        lse[i] = (m + xp.log(l))[..., 0]
    return out, lse


def _token_rows(cache, b: int, n: int, table, xp):
    """Where the first ``n`` tokens of sequence ``b`` live in a paged cache: (pages, rows) index
    arrays of xp, tokens on out-of-range pages left out; None for a contiguous cache."""
    if table is None:
        return None
    num_pages, page_size = cache.shape[0], cache.shape[1]
    t = np.arange(n)
    pages = table[b, t // page_size]
    keep = (pages >= 0) & (pages < num_pages)
    return xp.asarray(pages[keep]), xp.asarray((t % page_size)[keep])


def _rows(cache, b: int, n: int, rows):
    """The K or V rows (tokens, num_kv_heads, head_dim) of sequence ``b`` (``_token_rows``)."""
    return cache[b, :n] if rows is None else cache[rows[0], rows[1]]


def append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None):
    """The caches after appending ``k_new``/``v_new`` (batch, q_len, num_kv_heads, head_dim) at
    positions cache_seqlens[b] … cache_seqlens[b] + q_len − 1 of each sequence, through
    ``block_table`` for a paged cache: ``(k, v, lengths)`` as new host arrays (the inputs are not
    changed), lengths = cache_seqlens + q_len clamped to the capacity. Positions past the
    capacity, and rows of pages whose index is outside [0, num_pages), are not written."""
    k, v = _host(k_cache).copy(), _host(v_cache).copy()
    k_new, v_new = _host(k_new), _host(v_new)
    table = None if block_table is None else _host(block_table).astype(np.int64)
    batch, q_len = k_new.shape[0], k_new.shape[1]
    capacity = k.shape[1] * (1 if table is None else table.shape[1])
    lens = seqlens_array(cache_seqlens, batch, capacity)
    for b in range(batch):
        for i in range(q_len):
            t = int(lens[b]) + i
            if t >= capacity:
                break
            if table is None:
                k[b, t], v[b, t] = k_new[b, i], v_new[b, i]
                continue
            page = table[b, t // k.shape[1]]
            if 0 <= page < k.shape[0]:
                k[page, t % k.shape[1]] = k_new[b, i]
                v[page, t % k.shape[1]] = v_new[b, i]
    return k, v, np.minimum(lens + q_len, capacity)


def _host(x) -> np.ndarray:
    """A host array of ``x`` in its own dtype (CuPy arrays through ``.get()``)."""
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()
    return np.asarray(x)


def decode_attention(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None,
                     logits_soft_cap=None, block_table=None, k_new=None, v_new=None):
    """Direct softmax attention in float64 (NumPy): returns ``(out, lse)``.

    ``block_table``: a paged cache (:func:`attention_rows`). ``k_new``/``v_new``: the new tokens
    are appended first (:func:`append_kv`, on copies) and attended too.

    q (batch, num_heads, head_dim); k_cache, v_cache (batch, max_seqlen, num_kv_heads, head_dim).
    out (batch, num_heads, head_dim) float64; lse (batch, num_heads) float64, natural log.
    An empty sequence gives out = 0, lse = −inf. (:func:`attention_rows` for every row.)
    """
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new: expected both or neither")
    if k_new is not None:
        k_cache, v_cache, cache_seqlens = append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new,
                                                    block_table)
    out, lse = attention_rows(q, k_cache, v_cache, cache_seqlens, softmax_scale,
                              logits_soft_cap=logits_soft_cap, block_table=block_table)
    batch, num_heads, head_dim = out.shape[0], out.shape[1] * out.shape[2], out.shape[3]
    return out.reshape(batch, num_heads, head_dim), lse.reshape(batch, num_heads)


def split_states(scores: np.ndarray, values: np.ndarray, boundaries) -> tuple[np.ndarray, np.ndarray]:
    """Kernel 1 of docs/DESIGN.md for one query row, in float64.

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
    """Kernel 2 of docs/DESIGN.md in float64: o_parts (S, *rows, D), lse_parts (S, *rows).

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
