"""Float64 NumPy reference for decode attention and for the split/merge algorithm.

No CuPy import: this runs anywhere, and is what the tests and ``cupydecode check`` trust.
CuPy arrays passed in are copied to the host (through their ``.get()``); the same computation
runs on the GPU with ``xp=cupy`` (:func:`attention_rows`) where the host would be too slow.

Memory traffic of ``decode_attention``: the float64 copies of K and V are 4× (fp16) the cache,
so keep reference problems to a few hundred MB of cache.
"""

from __future__ import annotations

import numpy as np


def _host(x) -> np.ndarray:
    """A host array of ``x`` in its own dtype (CuPy arrays through ``.get()``)."""
    if not isinstance(x, np.ndarray) and hasattr(x, "get"):
        x = x.get()
    return np.asarray(x)


def to_float64(x) -> np.ndarray:
    """Host float64 copy of a NumPy/ml_dtypes array or anything with ``.get()`` (CuPy)."""
    return _host(x).astype(np.float64)


def seqlens_array(cache_seqlens, batch: int, max_seqlen: int) -> np.ndarray:
    """cache_seqlens (None, int, sequence or array, host or device) as host int64 (batch,)."""
    if cache_seqlens is None:
        return np.full(batch, max_seqlen, np.int64)
    if isinstance(cache_seqlens, (int, np.integer)):  # (clamped as the arrays are)
        return np.full(batch, min(max(int(cache_seqlens), 0), max_seqlen), np.int64)
    return np.clip(_host(cache_seqlens).astype(np.int64).reshape(batch), 0, max_seqlen)


# Low-precision KV formats: kv_dtype → (ml_dtypes type, the largest finite value). A cache in one
# of them holds uint8 codes (or that ml_dtypes type); a key is code · k_scale, a value code · v_scale.
FP8_FORMATS = {"e4m3": ("float8_e4m3fn", 448.0), "e5m2": ("float8_e5m2", 57344.0)}


def _fp8_format(kv_dtype: str):
    """(the ml_dtypes type, the largest finite value) of ``kv_dtype`` (:data:`FP8_FORMATS`)."""
    import ml_dtypes

    if kv_dtype not in FP8_FORMATS:
        raise ValueError(f"kv_dtype: expected one of {', '.join(map(repr, FP8_FORMATS))}, "
                         f"got {kv_dtype!r}")
    name, top = FP8_FORMATS[kv_dtype]
    return getattr(ml_dtypes, name), top


def fp8_values(kv_dtype: str) -> np.ndarray:
    """(256,) float64: the value of every code of ``kv_dtype`` ("e4m3" or "e5m2"; NaN codes are
    NaN, e5m2's infinities ±inf)."""
    return np.arange(256, dtype=np.uint8).view(_fp8_format(kv_dtype)[0]).astype(np.float64)


def _codes(cache):
    """A cache's uint8 codes (an ml_dtypes float8 array viewed as its bytes)."""
    if cache.dtype.itemsize != 1:
        raise TypeError(f"an fp8 cache: expected uint8 codes (or an ml_dtypes float8 array), "
                        f"got dtype {cache.dtype}")
    return cache if cache.dtype == np.uint8 else cache.view(np.uint8)


def _scale_of(scale, name: str, lead: tuple, num_kv_heads: int, xp=np):
    """``scale`` as an xp float64 copy of a shape that broadcasts against (lead...,
    num_kv_heads): a float (per tensor), (num_kv_heads,) (per KV head) or lead +
    (num_kv_heads,) (per token and head). A GPU scale comes to the host for ``xp=numpy``."""
    if scale is None:
        raise ValueError(f"{name}: expected a scale with kv_dtype (a float, ({num_kv_heads},) or "
                         f"{(*lead, num_kv_heads)}), got None")
    a = _host(scale) if xp is np else xp.asarray(scale)
    shape = tuple(a.shape)
    if shape not in ((), (num_kv_heads,), (*lead, num_kv_heads)):
        raise ValueError(f"{name}: expected a float, shape ({num_kv_heads},) or "
                         f"{(*lead, num_kv_heads)}, got shape {shape}")
    return a.astype(np.float64)  # (a copy)


def dequantize_kv(cache, kv_dtype: str, scale, xp=np):
    """float64 values code · scale of fp8 codes (…, num_kv_heads, head_dim): a cache (batch,
    max_seqlen, Hkv, D) or paged (num_pages, page_size, Hkv, D), or rows (tokens, Hkv, D);
    ``scale`` per tensor, per KV head or per (token, KV head) (:data:`FP8_FORMATS`).
    ``xp=cupy``: on the GPU (a CuPy cache and scale)."""
    lut = xp.asarray(fp8_values(kv_dtype))
    codes = _codes(cache if xp is not np else _host(cache))
    s = _scale_of(scale, "scale", tuple(codes.shape[:-2]), codes.shape[-2], xp)
    return lut[codes] * s[..., None]


def quantize_kv(x, kv_dtype: str, scale=None, xp=np):
    """``(codes, scale)``: fp8 codes (uint8) of ``x`` (…, num_kv_heads, head_dim; float16,
    bfloat16 or float32) for ``scale`` (per tensor, per KV head, or per (token, KV head) of x's
    leading shape), as the kernels quantise: x / scale in float32 (x in float32, the scale
    rounded to float32, IEEE division), rounded to the nearest code (ties to even), saturated to
    ±the largest finite value (infinities too); NaN stays NaN.
    ``scale=None``: per (token, KV head), computed as the kernels' quantising append computes
    it: amax_d |x| / the largest finite value in float32 (1 where the row is all zero or not
    finite), returned as float32 of x's shape without head_dim."""
    fp8, top = _fp8_format(kv_dtype)
    xh = x if xp is not np else _host(x)
    x32 = xh.astype(np.float32) if xp is np else xh.astype(xp.float32)
    if scale is None:
        amax = xp.abs(x32).max(axis=-1)
        scale = amax / np.float32(top)
        scale = xp.where(xp.isfinite(scale) & (scale > 0), scale, np.float32(1.0)).astype(np.float32)
        s32 = scale
    else:
        s32 = _scale_of(scale, "scale", tuple(x32.shape[:-2]), x32.shape[-2], xp
                        ).astype(np.float32)
    y = xp.clip(x32 / s32[..., None], -np.float32(top), np.float32(top))
    if xp is np:
        codes = y.astype(fp8).view(np.uint8)
    else:  # the float32 → fp8 rounding on the host (ml_dtypes), the codes back on the GPU
        codes = xp.asarray(y.get().astype(fp8).view(np.uint8))
    return codes, scale


def attention_rows(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None,
                   batch_ids=None, kv_heads=None, xp=np, logits_soft_cap=None,
                   block_table=None, window_left=None, alibi_slopes=None, sinks=None,
                   kv_dtype=None, k_scale=None, v_scale=None, tokens_after=None):
    """Direct softmax attention in float64 for some sequences and KV heads: the one reference
    computation, with NumPy (``xp=numpy``: GPU inputs are copied to the host) or with CuPy
    (``xp=cupy``: on the GPU, for caches too large for the host reference).

    q is (batch, num_heads, head_dim), one token per sequence, or (batch, q_len, num_heads,
    head_dim): query token t of a sequence of L cached tokens sits at position L − q_len + t and
    attends the keys j ≤ its position (causal, aligned to the end). Scores, in this order:
    s_j = c · q·k_j (c = 1/sqrt(head_dim) unless ``softmax_scale``); ``logits_soft_cap`` t > 0:
    s_j ← t · tanh(s_j / t) (Gemma-2); ``alibi_slopes`` (num_heads,): s_j ← s_j − slope_h ·
    (position − j); ``window_left`` W ≥ 0: only keys position − W ≤ j ≤ position count (None or
    −1: no window). ``sinks`` (num_heads,), a logit σ_h per query head: the denominator gains
    e^σ_h with no value, O = Σ_j e^{s_j} v_j / (e^σ_h + Σ_j e^{s_j}), LSE = ln(e^σ_h + Σ_j e^{s_j}).
    With ``block_table`` (batch, max_pages_per_seq) the cache is paged, (num_pages, page_size,
    num_kv_heads, head_dim): token t of sequence b is row t % page_size of page
    block_table[b, t // page_size]; a token whose page index is outside [0, num_pages)
    contributes nothing. ``tokens_after`` (batch,): the cache holds one shard of each sequence,
    followed by tokens_after[b] more of its tokens elsewhere (sequence parallelism): the query
    tokens sit at L + tokens_after[b] − q_len + t, which their causal limit, the window and
    ALiBi's distances count; only the cache's keys are attended. ``batch_ids`` / ``kv_heads``
    select what to compute (None: all).

    Returns ``(out, lse)`` of xp float64 arrays of shapes (nb, nk, G, D) and (nb, nk, G) — with
    a q_len axis after nb for 4-dimensional q — with G = num_heads // num_kv_heads (the query
    heads of each selected KV head, in order). A row that attends nothing gives out = 0 and
    lse = −inf (σ_h with a sink). Memory: float64 copies of one sequence's K and V for the
    selected heads at a time.

    ``kv_dtype`` "e4m3" or "e5m2" (:data:`FP8_FORMATS`): the caches hold fp8 codes (uint8, or
    ml_dtypes float8 arrays) and a key is code · k_scale, a value code · v_scale, each scale a
    float (per tensor), (num_kv_heads,) (per KV head) or the cache's leading shape +
    (num_kv_heads,) (per token and KV head: (batch, max_seqlen, Hkv), or (num_pages, page_size,
    Hkv) paged).
    """
    if xp is np:
        q, k_cache, v_cache = (_host(x) for x in (q, k_cache, v_cache))
    table = None if block_table is None else _host(block_table).astype(np.int64)
    lut = None if kv_dtype is None else xp.asarray(fp8_values(kv_dtype))
    if lut is not None:  # fp8 codes, and their scales as xp float64 arrays that broadcast
        k_cache, v_cache = _codes(k_cache), _codes(v_cache)
        lead, hkv = tuple(k_cache.shape[:2]), k_cache.shape[2]
        k_scale, v_scale = (_scale_of(sc, name, lead, hkv, xp)
                            for sc, name in ((k_scale, "k_scale"), (v_scale, "v_scale")))
    single = q.ndim == 3
    q4 = q[:, None] if single else q                      # (batch, q_len, num_heads, head_dim)
    batch, q_len, num_heads, head_dim = q4.shape
    num_kv_heads = k_cache.shape[2]
    max_seqlen = k_cache.shape[1] * (1 if table is None else table.shape[1])  # capacity
    group = num_heads // num_kv_heads
    scale = 1.0 / np.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    # (0 is "no cap", as flash_decode and FlashAttention take it)
    cap = None if logits_soft_cap is None or logits_soft_cap == 0 else float(logits_soft_cap)
    if cap is not None and not (cap > 0 and np.isfinite(cap)):
        raise ValueError(f"logits_soft_cap: expected a finite number > 0, or None (or 0) for no "
                         f"cap, got {cap}")
    window = _window(window_left)
    slopes = _per_head(alibi_slopes, num_heads, "alibi_slopes")
    sink = _per_head(sinks, num_heads, "sinks")
    lens = seqlens_array(cache_seqlens, batch, max_seqlen)
    after = (np.zeros(batch, np.int64) if tokens_after is None
             else np.clip(_host(tokens_after).astype(np.int64).reshape(batch), 0, 2**30))
    batch_ids = list(range(batch)) if batch_ids is None else list(batch_ids)
    kv_heads = list(range(num_kv_heads)) if kv_heads is None else list(kv_heads)
    heads = np.asarray(kv_heads)[:, None] * group + np.arange(group)[None, :]  # (nk, G) ids
    shape = (len(batch_ids), q_len, len(kv_heads), group)
    out = xp.zeros((*shape, head_dim), xp.float64)
    lse = xp.full(shape, -np.inf, xp.float64)
    sink_h = None if sink is None else xp.asarray(sink[heads])                 # (nk, G)
    for i, b in enumerate(batch_ids):
        n = int(lens[b])
        if n == 0:
            if sink_h is not None:
                lse[i] = sink_h[None]
            continue
        pos = n + after[b] - q_len + np.arange(q_len)       # the query tokens' positions
        j = np.arange(n)
        attend = j[None, :] <= pos[:, None]                 # (q_len, n): causal
        if window is not None:
            attend &= j[None, :] >= pos[:, None] - window
        rows = _token_rows(k_cache, b, n, table, xp)
        if rows is not None:
            attend &= rows[2][None, :]                      # tokens on out-of-range pages
        qb = q4[b].reshape(q_len, num_kv_heads, group, head_dim)[:, kv_heads].astype(xp.float64)
        kb = _load(k_cache, k_scale, lut, b, n, rows, kv_heads, xp)        # (n, nk, D)
        s = xp.einsum("tkgd,nkd->tkgn", qb, kb) * scale     # s_j = c · q·k_j
        del kb
        if cap is not None:
            s = cap * xp.tanh(s / cap)                      # s_j ← t · tanh(s_j / t)
        if slopes is not None:                              # s_j ← s_j − slope_h · (pos − j)
            dist = (pos[:, None] - j[None, :]).astype(np.float64)
            s = s - xp.asarray(slopes[heads])[None, :, :, None] * xp.asarray(dist)[:, None, None, :]
        vb = _load(v_cache, v_scale, lut, b, n, rows, kv_heads, xp)
        for t in range(q_len):  # each query token over exactly the keys it attends
            keys = np.flatnonzero(attend[t])
            if keys.size == 0:
                if sink_h is not None:
                    lse[i, t] = sink_h
                continue
            idx = xp.asarray(keys)
            st = s[t][..., idx]                             # (nk, G, keys)
            ref = st.max(axis=-1)
            if sink_h is not None:
                ref = xp.maximum(ref, sink_h)
            # a non-finite maximum (a NaN or inf input) must reach the row, not be subtracted
            ref = xp.where(xp.isfinite(ref), ref, 0.0)
            p = xp.exp(st - ref[..., None])
            l = p.sum(axis=-1)
            if sink_h is not None:
                l = l + xp.exp(sink_h - ref)
            out[i, t] = xp.einsum("kgn,nkd->kgd", p, vb[idx]) / l[..., None]
            lse[i, t] = ref + xp.log(l)
    return (out[:, 0], lse[:, 0]) if single else (out, lse)


def _window(window_left):
    """None (no window) or the number of keys W ≥ 0 left of each query's position."""
    if window_left is None or (isinstance(window_left, (int, np.integer)) and window_left == -1):
        return None
    if isinstance(window_left, bool) or not isinstance(window_left, (int, np.integer)):
        raise TypeError(f"window_left: expected None or an int >= -1, got "
                        f"{type(window_left).__name__} {window_left!r}")
    if window_left < -1:
        raise ValueError(f"window_left: expected None or an int >= -1, got {window_left!r}")
    return int(window_left)


def _per_head(values, num_heads: int, name: str):
    """A (num_heads,) host float64 array of ``values`` (host or GPU), or None."""
    if values is None:
        return None
    a = _host(values).astype(np.float64)
    if a.shape != (num_heads,):
        raise ValueError(f"{name}: expected shape ({num_heads},) (one per query head), "
                         f"got {a.shape}")
    return a


def _token_rows(cache, b: int, n: int, table, xp):
    """Where the first ``n`` tokens of sequence ``b`` live in a paged cache: (pages, rows) index
    arrays of xp and a host mask of the tokens whose page index is in range (the others point at
    page 0 and must not count); None for a contiguous cache."""
    if table is None:
        return None
    num_pages, page_size = cache.shape[0], cache.shape[1]
    t = np.arange(n)
    pages = table[b, t // page_size]
    valid = (pages >= 0) & (pages < num_pages)
    return xp.asarray(np.where(valid, pages, 0)), xp.asarray(t % page_size), valid


def _rows(cache, b: int, n: int, rows):
    """The K or V rows (tokens, num_kv_heads, head_dim) of sequence ``b`` (``_token_rows``)."""
    return cache[b, :n] if rows is None else cache[rows[0], rows[1]]


def _load(cache, scale, lut, b: int, n: int, rows, kv_heads, xp):
    """Sequence ``b``'s first ``n`` K or V rows of the KV heads ``kv_heads`` in float64
    (n, nk, head_dim): the cache's values, or with ``lut`` (an fp8 cache) its codes' values
    times ``scale`` (per tensor, per KV head, or per token and head, as the cache is indexed)."""
    x = _rows(cache, b, n, rows)[:, kv_heads]
    if lut is None:
        return x.astype(xp.float64)
    if scale.ndim == 0:
        s = scale
    elif scale.ndim == 1:
        s = scale[xp.asarray(kv_heads)][None, :, None]
    else:
        s = _rows(scale, b, n, rows)[:, kv_heads][..., None]
    return lut[x] * s


def append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table=None, xp=np,
              max_seqlen=None, kv_dtype=None, k_scale=None, v_scale=None):
    """The caches after appending ``k_new``/``v_new`` (batch, q_len, num_kv_heads, head_dim) at
    positions cache_seqlens[b] … cache_seqlens[b] + q_len − 1 of each sequence, through
    ``block_table`` for a paged cache: ``(k, v, lengths)`` as new host arrays (the inputs are not
    changed), lengths = cache_seqlens + q_len clamped to the capacity. Positions past the
    capacity, and rows of pages whose index is outside [0, num_pages), are not written. The
    capacity is the cache's (pages per sequence × page_size when paged), or ``max_seqlen`` where
    given (a plan's, which may end inside a sequence's last page).
    ``kv_dtype`` (an fp8 cache of codes): the new tokens are written as codes of ``k_scale`` /
    ``v_scale`` (:func:`quantize_kv`); per-(token, head) scales are computed for the new tokens
    and written into copies of the scale arrays at their slots, and the result is then
    ``(k, v, lengths, k_scale, v_scale)``.
    ``xp=cupy``: the copies are made on the GPU instead (CuPy inputs; caches too large for the
    host), lengths and the table still on the host."""
    if xp is np:
        k, v = _host(k_cache).copy(), _host(v_cache).copy()
        k_new, v_new = _host(k_new), _host(v_new)
    else:
        k, v = k_cache.copy(), v_cache.copy()
    scales = None
    if kv_dtype is not None:
        k, v = _codes(k), _codes(v)
        lead, hkv = tuple(k.shape[:2]), k.shape[2]
        scales = [_scale_of(sc, name, lead, hkv, xp)
                  for sc, name in ((k_scale, "k_scale"), (v_scale, "v_scale"))]
        per_token = [sc.ndim == 3 for sc in scales]
        new_codes = []  # (codes, scales) of k_new and v_new, quantised once
        for x, sc, tok in zip((k_new, v_new), scales, per_token):
            codes, got = quantize_kv(x, kv_dtype, None if tok else sc, xp)
            new_codes.append((codes, got if tok else None))
        (k_new, k_tok), (v_new, v_tok) = new_codes
    table = None if block_table is None else _host(block_table).astype(np.int64)
    batch, q_len = k_new.shape[0], k_new.shape[1]
    capacity = k.shape[1] * (1 if table is None else table.shape[1])
    if max_seqlen is not None:
        capacity = min(capacity, int(max_seqlen))
    lens = seqlens_array(cache_seqlens, batch, capacity)
    for b in range(batch):
        for i in range(q_len):
            t = int(lens[b]) + i
            if t >= capacity:
                break
            if table is None:
                slot = (b, t)
            else:
                page = table[b, t // k.shape[1]]
                if not 0 <= page < k.shape[0]:
                    continue
                slot = (page, t % k.shape[1])
            k[slot], v[slot] = k_new[b, i], v_new[b, i]
            if scales is not None:
                for sc, tok in ((scales[0], k_tok), (scales[1], v_tok)):
                    if tok is not None:
                        sc[slot] = tok[b, i]
    lens = np.minimum(lens + q_len, capacity)
    return (k, v, lens) if scales is None else (k, v, lens, *scales)


def decode_attention(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None,
                     logits_soft_cap=None, block_table=None, k_new=None, v_new=None,
                     window_left=None, alibi_slopes=None, sinks=None, kv_dtype=None,
                     k_scale=None, v_scale=None, tokens_after=None):
    """Direct softmax attention in float64 (NumPy): returns ``(out, lse)``.

    q (batch, num_heads, head_dim), or (batch, q_len, num_heads, head_dim) for several query
    tokens per sequence; k_cache, v_cache (batch, max_seqlen, num_kv_heads, head_dim), or paged
    with ``block_table``. out has q's shape (float64); lse q's shape without head_dim, natural
    log. ``k_new``/``v_new`` (batch, q_len, num_kv_heads, head_dim; 3 dims for one token): the
    new tokens are appended first (:func:`append_kv`, on copies) and attended too. The score
    options and their order: :func:`attention_rows`. A row that attends nothing gives out = 0,
    lse = −inf. ``kv_dtype`` "e4m3" or "e5m2": the caches hold fp8 codes and attention runs on
    their values code · k_scale, code · v_scale (new tokens quantised first, as
    :func:`append_kv` does).
    """
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new: expected both or neither")
    if k_new is not None and tokens_after is not None:
        raise ValueError("tokens_after: expected None with k_new/v_new (new tokens belong at the "
                         "sequence's end)")
    if k_new is not None:
        k_new, v_new = (x[:, None] if np.ndim(x) == 3 else x for x in (k_new, v_new))
        q_len = 1 if np.ndim(q) == 3 else q.shape[1]
        if k_new.shape[1] != q_len:
            raise ValueError(f"k_new: expected {q_len} new token(s) per sequence (q's q_len), "
                             f"got {k_new.shape[1]}")
        grown = append_kv(k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                          kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale)
        k_cache, v_cache, cache_seqlens = grown[:3]
        if kv_dtype is not None:
            k_scale, v_scale = grown[3:]
    out, lse = attention_rows(q, k_cache, v_cache, cache_seqlens, softmax_scale,
                              logits_soft_cap=logits_soft_cap, block_table=block_table,
                              window_left=window_left, alibi_slopes=alibi_slopes, sinks=sinks,
                              kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale,
                              tokens_after=tokens_after)
    lead = out.shape[:-3]                                   # (batch,) or (batch, q_len)
    return (out.reshape(*lead, -1, out.shape[-1]), lse.reshape(*lead, -1))


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


def merge_states(o_parts, lse_parts, sinks=None) -> tuple[np.ndarray, np.ndarray]:
    """Kernel 2 of docs/DESIGN.md in float64: o_parts (S, *rows, D), lse_parts (S, *rows).

    Empty states (LSE_i = −inf, or +inf: the value some libraries give an empty row) are
    skipped; all empty gives (0, −inf) without NaN. A NaN LSE or a NaN in a live state's output
    makes its row NaN (and only its row). ``sinks``
    (broadcast against *rows, e.g. (num_heads,) for rows (batch, num_heads)): a sink logit σ
    applied once to the merged state, LSE ← ln(e^LSE + e^σ), O ← O · e^(LSE_old − LSE_new).
    """
    o = to_float64(o_parts)
    lse = to_float64(lse_parts)
    lse = np.where(np.isposinf(lse), -np.inf, lse)              # +inf: empty, as −inf
    bad = np.isnan(lse).any(axis=0)                             # a NaN LSE: its row is NaN
    lse = np.where(np.isnan(lse), -np.inf, lse)
    mx = lse.max(axis=0)
    live = np.isfinite(mx)
    ref = np.where(live, mx, 0.0)
    w = np.where(np.isneginf(lse), 0.0, np.exp(lse - ref))      # every exponent ≤ 0
    total = w.sum(axis=0)
    safe = np.where(live, total, 1.0)
    merged = np.einsum("s...,s...d->...d", w, np.where(np.isneginf(lse)[..., None], 0.0, o))
    merged = merged / safe[..., None]
    out_lse = np.where(live, ref + np.log(safe), -np.inf)
    merged = np.where(live[..., None], merged, 0.0)
    merged = np.where(bad[..., None], np.nan, merged)
    out_lse = np.where(bad, np.nan, out_lse)
    if sinks is not None:
        with_sink = np.logaddexp(out_lse, to_float64(sinks))
        merged = merged * np.where(live, np.exp(out_lse - with_sink), 0.0)[..., None]
        out_lse = with_sink
    return merged, out_lse


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
