"""Synthetic decode workloads: model presets, the built-in check matrix and fresh random inputs.

Shared by ``cupydecode check``, ``cupydecode bench`` and the tests. A :class:`Workload` is a
plain description (shapes, dtype, lengths, split count, seed); :func:`make_inputs` turns it into
GPU arrays. Data is always fresh random data: the seed is drawn from ``os.urandom`` unless
given, and written back into the workload so that a failure can be replayed exactly.

KV cache bytes of one workload, the number everything else is measured against:
    2 (K and V) × Σ_b cache_seqlens[b] × num_kv_heads × head_dim × itemsize
(an fp8 cache: itemsize 1, plus 4 bytes per token and KV head with per-token scales).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ._policy import DTYPE_IDS, ITEMSIZE, KV_DTYPES

DTYPES = tuple(DTYPE_IDS)
KV_SCALES = ("tensor", "head", "token")  # an fp8 cache's scale modes (Workload.kv_scale)
# The code an fp8 cache holds past each length and in padding pages: NaN in e4m3 and e5m2.
FP8_NAN_CODE = 0x7F


@dataclass(frozen=True)
class ModelPreset:
    """Attention of a model's decoder layers: query heads, KV heads, head dim, and the options
    the model runs with: ``logits_soft_cap`` (Gemma-2's cap on the scores), ``window_left`` W
    (sliding-window layers attend their last W + 1 tokens; ``alternate``: those layers alternate
    with layers that attend everything, as in Gemma-2 and gpt-oss), ``alibi`` (ALiBi's bias),
    ``sinks`` (a sink logit per query head, gpt-oss)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    note: str = ""
    logits_soft_cap: float | None = None
    window_left: int | None = None
    alternate: bool = False
    alibi: bool = False
    sinks: bool = False

    @property
    def group(self) -> int:
        """G = query heads per KV head (1: MHA, num_heads: MQA)."""
        return self.num_heads // self.num_kv_heads

    def layers(self) -> dict[str, dict]:
        """The model's layer types and the Workload options of each: {"": options} where every
        layer attends alike, {"sliding": ..., "full": ...} where windowed layers alternate with
        full ones."""
        opts = {"logits_soft_cap": self.logits_soft_cap, "alibi": self.alibi,
                "sinks": self.sinks}
        if self.window_left is None:
            return {"": opts}
        windowed = dict(opts, window_left=self.window_left)
        return {"sliding": windowed, "full": opts} if self.alternate else {"": windowed}


MODELS: dict[str, ModelPreset] = {
    "llama-3-8b": ModelPreset(32, 8, 128, "GQA 4"),
    "llama-3-70b": ModelPreset(64, 8, 128, "GQA 8"),
    "llama-3-405b": ModelPreset(128, 8, 128, "GQA 16"),
    "llama-2-7b": ModelPreset(32, 32, 128, "MHA"),
    "qwen2.5-7b": ModelPreset(28, 4, 128, "GQA 7"),
    "mistral-7b": ModelPreset(32, 8, 128, "GQA 4, window 4096", window_left=4095),
    "gemma-2-2b": ModelPreset(8, 4, 256, "GQA 2, head_dim 256, soft-cap 50, window 4096 on "
                              "alternate layers", 50.0, window_left=4095, alternate=True),
    "gemma-2-9b": ModelPreset(16, 8, 256, "GQA 2, head_dim 256, soft-cap 50, window 4096 on "
                              "alternate layers", 50.0, window_left=4095, alternate=True),
    "gemma-2b": ModelPreset(8, 1, 256, "MQA, head_dim 256"),
    "gpt-2": ModelPreset(12, 12, 64, "MHA"),
    "falcon-7b": ModelPreset(71, 1, 64, "MQA"),
    "phi-2": ModelPreset(32, 32, 80, "MHA, head_dim 80"),
    "phi-3-mini": ModelPreset(32, 32, 96, "MHA, head_dim 96"),
    "gpt-oss-20b": ModelPreset(64, 8, 64, "GQA 8, sinks, window 128 on alternate layers",
                               window_left=127, alternate=True, sinks=True),
    "bloom-7b1": ModelPreset(32, 32, 128, "MHA, ALiBi", alibi=True),
    "mpt-7b": ModelPreset(32, 32, 128, "MHA, ALiBi", alibi=True),
}


def fresh_seed() -> int:
    """A new 32-bit seed from the OS (never a fixed default: every run sees new data)."""
    return int.from_bytes(os.urandom(4), "little")


@dataclass
class Workload:
    """One decode-attention problem.

    ``seqlen`` is max_seqlen (the cache's second axis). ``lengths`` gives per-sequence live
    lengths (varlen; None: every sequence is ``seqlen`` long). ``num_splits`` None lets the
    library choose. ``q_scale`` multiplies q, which scales every logit (the overflow case).
    ``seed`` None means "draw a fresh one": :func:`make_inputs` records it here.
    ``logits_soft_cap``: the score cap c (s ← c·tanh(s/c)), None for none. ``page_size``: run
    on a paged copy of the cache (:func:`page_inputs`), None for the contiguous cache.
    ``append``: the call appends one new token per sequence (:func:`new_tokens`) at position
    lengths[b] and attends it too, min(lengths[b] + 1, seqlen) tokens (lengths go to the
    device, so a sequence already at seqlen gets nothing written; lengths are required: None,
    every sequence full, leaves no room and is refused). ``window_left`` W: only the last W + 1 tokens of
    each sequence are attended (None: no window). ``alibi``: ALiBi's bias with the standard
    slopes of ``num_heads`` heads (:func:`alibi_slopes`). ``sinks``: a sink logit per query
    head (:func:`sink_logits`, from the seed). ``layer``: the layer type of a model preset it
    stands for (a label). ``q_len``: query tokens per sequence, the last q_len of each (q is
    then (batch, q_len, num_heads, head_dim)). ``kv_dtype``: "e4m3" or "e5m2" for an fp8 cache
    (:func:`quantize_inputs`; q and out stay ``dtype``), None for a cache in ``dtype``;
    ``kv_scale``: its scales per "tensor", per KV "head" or per "token" (and KV head).
    """

    batch: int
    seqlen: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    num_splits: int | None = None
    lengths: tuple[int, ...] | None = None
    q_scale: float = 1.0
    seed: int | None = None
    name: str = ""
    logits_soft_cap: float | None = None
    page_size: int | None = None
    append: bool = False
    window_left: int | None = None
    alibi: bool = False
    sinks: bool = False
    layer: str = ""  # a model preset's layer type ("sliding", "full"), "" where all are alike
    q_len: int = 1  # query tokens per sequence (draft tokens verified together)
    kv_dtype: str | None = None  # "e4m3", "e5m2": an fp8 cache; None: the cache in dtype
    kv_scale: str = "tensor"  # an fp8 cache's scales: per "tensor", KV "head" or "token"

    def __post_init__(self) -> None:
        if self.lengths is not None:
            self.lengths = tuple(int(n) for n in self.lengths)
            if len(self.lengths) != self.batch:
                raise ValueError(f"lengths: expected {self.batch} values (one per sequence), "
                                 f"got {len(self.lengths)}")
            if any(n < 0 or n > self.seqlen for n in self.lengths):
                raise ValueError(f"lengths: expected values in [0, seqlen={self.seqlen}], "
                                 f"got {list(self.lengths)}")
        if self.append and self.lengths is None:
            raise ValueError("lengths: expected per-sequence lengths with append (None: every "
                             "sequence full, no room for the new token)")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype: expected one of {', '.join(KV_DTYPES)} or None, got "
                             f"{self.kv_dtype!r}")
        if self.kv_scale not in KV_SCALES:
            raise ValueError(f"kv_scale: expected one of {', '.join(KV_SCALES)}, got "
                             f"{self.kv_scale!r}")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def splits_label(self) -> str:
        return "auto" if self.num_splits is None else str(self.num_splits)

    def live_tokens(self) -> int:
        """Σ_b live length: the tokens whose K and V must be read (with ``append``, the new one
        of each sequence with room for it included)."""
        lens = ((self.seqlen,) * self.batch if self.lengths is None else
                tuple(min(n + 1, self.seqlen) if self.append else n for n in self.lengths))
        if self.window_left is not None:
            lens = tuple(min(n, self.window_left + self.q_len) for n in lens)
        return sum(lens)

    @property
    def kv_itemsize(self) -> int:
        """Bytes per cached element: 1 for an fp8 cache, else the dtype's."""
        return 1 if self.kv_dtype else ITEMSIZE[self.dtype]

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one token's row of one KV head, of K or of V: head_dim elements (an fp8
        cache's codes, and its per-token scale, 4 bytes)."""
        return self.head_dim * self.kv_itemsize + (4 if self.kv_per_token_scales else 0)

    def kv_bytes(self) -> int:
        """Bytes of K and V that one call must read (live tokens only)."""
        return 2 * self.live_tokens() * self.num_kv_heads * self.kv_row_bytes

    @property
    def kv_per_token_scales(self) -> bool:
        return self.kv_dtype is not None and self.kv_scale == "token"

    @property
    def q_shape(self) -> tuple[int, ...]:
        """q's shape: (batch, num_heads, head_dim), or (batch, q_len, num_heads, head_dim)."""
        tokens = (self.q_len,) if self.q_len > 1 else ()
        return (self.batch, *tokens, self.num_heads, self.head_dim)

    def cache_bytes(self) -> int:
        """Bytes of the allocated q, K and V (max_seqlen for every sequence; an fp8 cache's
        codes and per-token scales)."""
        return (ITEMSIZE[self.dtype] * self.batch * self.q_len * self.num_heads * self.head_dim
                + 2 * self.batch * self.seqlen * self.num_kv_heads * self.kv_row_bytes)

    def draw_bytes(self) -> int:
        """Bytes :func:`make_inputs` allocates (an fp8 cache is drawn in dtype first, then
        quantised by :func:`quantize_inputs`)."""
        return (ITEMSIZE[self.dtype] * self.batch * (self.q_len * self.num_heads
                                                     + 2 * self.seqlen * self.num_kv_heads)
                * self.head_dim)

    def shape_label(self) -> str:
        cap = "" if self.logits_soft_cap is None else f" cap={self.logits_soft_cap:g}"
        cap += "" if self.page_size is None else f" page={self.page_size}"
        cap += " append" if self.append else ""
        cap += "" if self.window_left is None else f" window={self.window_left}"
        cap += " alibi" if self.alibi else ""
        cap += " sinks" if self.sinks else ""
        cap += "" if self.q_len == 1 else f" q_len={self.q_len}"
        cap += "" if self.kv_dtype is None else f" {self.kv_dtype}/{self.kv_scale}"
        return (f"B={self.batch} L={self.seqlen} H={self.num_heads}/{self.num_kv_heads} "
                f"D={self.head_dim}{cap}")


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's slopes for ``num_heads`` heads (Press et al.; BLOOM's code): 2^(−8(i+1)/n) for
    the n = largest power of two ≤ num_heads, then every other slope of 2n for the rest."""
    n = 1 << (num_heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    extra = [2.0 ** (-4.0 * (2 * i + 1) / n) for i in range(num_heads - n)]
    return np.asarray(slopes + extra, np.float32)


def sink_logits(num_heads: int, seed: int) -> np.ndarray:
    """A sink logit per query head for a check (gpt-oss learns them; values in [−2, 6] make the
    sink weigh from almost nothing to most of a short row's denominator)."""
    return np.random.default_rng([seed, 7]).uniform(-2.0, 6.0, num_heads).astype(np.float32)


def workload_for_model(model: str, batch: int, seqlen: int, dtype: str = "float16",
                       head_dim: int | None = None, layer: str | None = None, **kw) -> Workload:
    """A workload with a preset's head shape and options, e.g.
    ``workload_for_model("llama-3-8b", 4, 8192)``: ``layer`` one of the preset's layer types
    (:meth:`ModelPreset.layers`; None: the first), ``head_dim`` the preset's heads with this
    head_dim instead; ``kw`` (Workload fields) override the preset's options."""
    try:
        p = MODELS[model]
    except KeyError:
        raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {model!r}") from None
    layers = p.layers()
    if layer is None:
        layer = next(iter(layers))
    if layer not in layers:
        raise ValueError(f"layer: expected one of {', '.join(map(repr, layers))} for {model}, "
                         f"got {layer!r}")
    kw.setdefault("name", f"{model} {layer}".strip())
    kw.setdefault("layer", layer)
    for key, value in layers[layer].items():
        kw.setdefault(key, value)
    return Workload(batch, seqlen, p.num_heads, p.num_kv_heads, head_dim or p.head_dim, dtype,
                    **kw)


def random_lengths(batch: int, seqlen: int, seed: int) -> tuple[int, ...]:
    """Per-sequence lengths in [0, seqlen] drawn from ``seed``.

    The first sequence is always full length (so the cache's whole extent is exercised) and,
    with three or more sequences, the last is empty (the −inf / zero-output edge case).
    """
    rng = np.random.default_rng([seed, 0x1E45])
    lens = rng.integers(0, seqlen + 1, size=batch)
    if batch:
        lens[0] = seqlen
    if batch >= 3:
        lens[-1] = 0
    return tuple(int(n) for n in lens)


def _fill_normal(rs, out, scale: float = 1.0) -> None:
    """Fill ``out`` with N(0, scale²) rounded to its dtype, one leading slice at a time (the
    float32 draw is the big temporary, so keep it to one sequence's worth)."""
    import cupy

    for b in range(out.shape[0]):
        x = rs.standard_normal(out.shape[1:], dtype=cupy.float32)
        if scale != 1.0:
            x *= cupy.float32(scale)
        out[b] = x.astype(out.dtype)


def make_inputs(workload: Workload):
    """Fresh random GPU inputs for ``workload``: ``(q, k_cache, v_cache, cache_seqlens)``.

    q ~ N(0, q_scale²), K and V ~ N(0, 1), in the workload's dtype and the public layout
    (q (B, H, D); K, V (B, L, Hkv, D)). ``cache_seqlens`` is an int32 device array for varlen
    workloads, else None. With varlen, the cache past each sequence's length is filled with NaN:
    a correct kernel never reads it, so any leak shows up as NaN in the output.

    Draws a fresh seed when ``workload.seed`` is None and records it in the workload.
    """
    import cupy

    if workload.seed is None:
        workload.seed = fresh_seed()
    w = workload
    rs = cupy.random.RandomState(w.seed)
    q = cupy.empty(w.q_shape, w.dtype)
    k = cupy.empty((w.batch, w.seqlen, w.num_kv_heads, w.head_dim), w.dtype)
    v = cupy.empty_like(k)
    _fill_normal(rs, q, w.q_scale)
    _fill_normal(rs, k)
    _fill_normal(rs, v)
    seqlens = None
    if w.lengths is not None:
        seqlens = cupy.asarray(np.asarray(w.lengths, np.int32))
        for b, n in enumerate(w.lengths):
            k[b, n:] = math.nan
            v[b, n:] = math.nan
    return q, k, v, seqlens


def new_tokens(workload: Workload):
    """Fresh random ``(k_new, v_new)`` GPU arrays (batch, 1, num_kv_heads, head_dim) ~ N(0, 1)
    in the workload's dtype: the token each sequence appends (``workload.append``), drawn from
    the workload's seed (which :func:`make_inputs` records first)."""
    import cupy

    w = workload
    rs = cupy.random.RandomState((w.seed ^ 0x5EED1E5) % 2**32)
    out = []
    for _ in range(2):
        x = cupy.empty((w.batch, 1, w.num_kv_heads, w.head_dim), w.dtype)
        _fill_normal(rs, x)
        out.append(x)
    return out[0], out[1]


def page_inputs(inputs, page_size: int, seed: int):
    """``make_inputs``' (q, k, v, cache_seqlens) with the cache moved into pages:
    (q, k_pages, v_pages, cache_seqlens, block_table). Pages of ``page_size`` tokens, each
    sequence's ceil(max_seqlen / page_size) pages in random order over the pool (``seed``);
    rows past max_seqlen in a sequence's last page are NaN (NaN codes in an fp8 cache). The
    contiguous K and V are not kept. :func:`page_like` pages per-token scales the same way."""
    q, k, v, seqlens = inputs
    table = page_order(k.shape[0], k.shape[1], page_size, seed)
    return (q, page_like(k, page_size, seed), page_like(v, page_size, seed), seqlens,
            table)


def page_order(batch: int, max_seqlen: int, page_size: int, seed: int):
    """The block table of :func:`page_inputs`: (batch, ceil(max_seqlen / page_size)) int32 on
    the GPU, a random permutation of the pool's pages (``seed``)."""
    import cupy

    per_seq = -(-max_seqlen // page_size)
    order = cupy.random.RandomState(seed).permutation(batch * per_seq)
    return order.reshape(batch, per_seq).astype(cupy.int32)


def page_like(x, page_size: int, seed: int):
    """A (batch, max_seqlen, ...) array (K, V, or an fp8 cache's per-token scales) moved into the
    pages of :func:`page_inputs` with the same ``seed``: (num_pages, page_size, ...); rows past
    max_seqlen NaN (NaN codes for uint8 codes)."""
    import cupy

    batch, max_seqlen = x.shape[:2]
    table = page_order(batch, max_seqlen, page_size, seed)
    per_seq = table.shape[1]
    fill = FP8_NAN_CODE if x.dtype == cupy.uint8 else math.nan
    if per_seq * page_size != max_seqlen:
        padded = cupy.full((batch, per_seq * page_size) + x.shape[2:], fill, x.dtype)
        padded[:, :max_seqlen] = x
        x = padded
    pages = cupy.empty((batch * per_seq, page_size) + x.shape[2:], x.dtype)
    pages[table.reshape(-1)] = x.reshape(batch * per_seq, page_size, *x.shape[2:])
    return pages


def quantize_inputs(workload: Workload, k, v):
    """An fp8 workload's cache from :func:`make_inputs`' K and V: ``(k_codes, v_codes, k_scale,
    v_scale)``, codes uint8 of K's shape, each scale of the workload's ``kv_scale`` mode.

    Each (token, KV head) row of K and V is first multiplied by its own factor e^u, u ~ U(−2, 2)
    (from the seed), so rows differ in magnitude and every scale differs from 1 and from its
    neighbours: per "tensor" max |x| / the format's largest finite value (a float); per KV
    "head" 1.5 × the head's max |x| / that value ((num_kv_heads,) float32); per "token" the
    row's own (``quantize_kv``'s rule; (batch, max_seqlen, num_kv_heads) float32), NaN past each
    length. Rows past each length (NaN in make_inputs) are NaN codes. Quantised on the GPU by
    ``cupydecode.quantize_kv``, the rule of ``reference.quantize_kv``; the reference then reads
    the codes and scales, so it holds the exact values the kernel attends."""
    import cupy

    from .quantize import quantize_kv
    from .reference import FP8_FORMATS

    w = workload
    top = FP8_FORMATS[w.kv_dtype][1]
    rs = cupy.random.RandomState((w.seed ^ 0xF8F8F8) % 2**32)
    result = []
    for x in (k, v):
        mag = cupy.exp(rs.uniform(-2.0, 2.0, x.shape[:-1] + (1,)).astype(cupy.float32))

        def rows(b, x=x, mag=mag):
            return x[b].astype(cupy.float32) * mag[b]
        scale = None
        if w.kv_scale != "token":
            amax = cupy.stack([cupy.nan_to_num(cupy.abs(rows(b)), nan=0.0).max(axis=(0, 2))
                               for b in range(x.shape[0])]).max(axis=0)
            amax = cupy.where(amax > 0, amax, cupy.float32(top))
            scale = (float(np.float32(float(amax.max()) / top)) if w.kv_scale == "tensor"
                     else (amax * cupy.float32(1.5 / top)).astype(cupy.float32))
        codes = cupy.empty(x.shape, cupy.uint8)
        token_scales = cupy.empty(x.shape[:-1], cupy.float32) if scale is None else None
        for b in range(x.shape[0]):
            _, s = quantize_kv(rows(b), w.kv_dtype, scale, out=codes[b])
            if token_scales is not None:
                token_scales[b] = s
        if token_scales is not None and w.lengths is not None:
            for b, n in enumerate(w.lengths):
                token_scales[b, n:] = math.nan
        result.append((codes, scale if token_scales is None else token_scales))
    (kc, ks), (vc, vs) = result
    return kc, vc, ks, vs


# q_scale for the overflow workload: with q ~ N(0, s²) and K ~ N(0, 1) the logits
# c·q·k are N(0, s²), so over ~10⁵ (row, token) pairs they reach about ±4.3 s ≈ ±1e4.
OVERFLOW_Q_SCALE = 2400.0


def default_check_matrix() -> list[Workload]:
    """The built-in list run by ``cupydecode check``.

    Covers fp16 / bf16 / fp32; head_dim 64, 128, 256 and between (32 to 192), and 512; 1 to 16 query
    tokens per sequence; GQA groups 1 (MHA), 2, 4, 7, 8 and MQA
    (71 or 48 query heads on one KV head, also with blocks of several M-tiles); lengths 1, 17, 255, 257, 4097 and 65536; variable lengths
    with an empty sequence; forced 1 and 3 splits and automatic splits; logits of ±1e4; the
    soft-cap on every math path; paged caches of 1 to 256 tokens per page; a new token appended
    in the call (contiguous and paged, every math path, a sequence at full capacity and an
    empty one); sliding windows, ALiBi, sinks; fp8 caches (e4m3, e5m2) with scales per tensor,
    per KV head and per token, paged, appended, with several query tokens and score options.
    Sizes are kept small enough that the float64 reference stays cheap (the whole list runs
    in seconds on an H200, most of it compilation on the first run).
    """
    W = Workload
    m = []
    # fp16: every length class, MHA to MQA, all head dims
    m += [
        W(1, 1, 32, 8, 128, "float16", None, name="len 1"),
        W(3, 17, 32, 8, 128, "float16", 1, name="len 17, odd batch"),
        W(2, 255, 32, 8, 128, "float16", 3, name="len 255"),
        W(2, 257, 32, 8, 128, "float16", None, name="len 257"),
        W(2, 4097, 28, 4, 128, "float16", None, name="GQA 7"),
        W(2, 4097, 28, 4, 128, "float16", 3, name="GQA 7"),
        W(1, 4097, 71, 1, 64, "float16", None, name="MQA 71"),
        W(2, 4097, 71, 1, 64, "float16", 3, name="MQA 71, M-tiles"),
        W(3, 257, 12, 12, 64, "float16", 3, name="MHA"),
        W(2, 4097, 16, 8, 256, "float16", None, name="head_dim 256"),
        W(1, 65536, 32, 8, 128, "float16", None, name="len 65536"),
        W(4, 300, 32, 8, 128, "float16", None, (300, 1, 17, 0), name="varlen + empty"),
    ]
    # bf16
    m += [
        W(2, 4097, 32, 8, 128, "bfloat16", None, name="len 4097"),
        W(3, 257, 28, 4, 128, "bfloat16", 1, name="GQA 7"),
        W(2, 17, 16, 8, 256, "bfloat16", 3, name="head_dim 256"),
        W(2, 255, 71, 1, 64, "bfloat16", None, name="MQA 71"),
        W(2, 2000, 48, 1, 128, "bfloat16", 1, name="MQA 48, M-tiles"),
        W(3, 4097, 28, 4, 128, "bfloat16", 3, (4097, 0, 257), name="varlen + empty"),
        W(1, 65536, 8, 1, 128, "bfloat16", 3, name="len 65536"),
    ]
    # fp32 (CUDA-core path)
    m += [
        W(2, 257, 32, 8, 128, "float32", None, name="len 257"),
        W(2, 4097, 28, 4, 64, "float32", 3, name="GQA 7"),
        W(2, 255, 16, 8, 256, "float32", None, name="head_dim 256"),
        W(3, 17, 8, 1, 128, "float32", 1, name="MQA 8"),
        W(3, 257, 32, 8, 128, "float32", 1, (0, 255, 257), name="varlen + empty"),
    ]
    # logits of ±1e4: exp() of them overflows any float type; the LSE path must not
    m += [
        W(2, 1024, 32, 8, 128, "float16", None, q_scale=OVERFLOW_Q_SCALE, name="logits ±1e4"),
        W(2, 1024, 32, 8, 128, "float32", 3, q_scale=OVERFLOW_Q_SCALE, name="logits ±1e4"),
    ]
    # the soft-cap (Gemma-2's 50) on every math path, on logits mostly past the cap (q_scale 60:
    # logits of about ±60, capped to ±36) and on ordinary ones: heads as N (G 2), Q·Kᵀ (G 16),
    # M-tiles (MQA 48), CUDA cores (fp32); one split, several, and the fused merge
    cap = {"logits_soft_cap": 50.0}
    m += [
        W(2, 4097, 16, 8, 256, "float16", None, q_scale=60.0, name="soft-cap 50", **cap),
        W(3, 257, 32, 2, 128, "float16", 3, (257, 100, 0), name="soft-cap 50, varlen", **cap),
        W(2, 2000, 48, 1, 128, "bfloat16", 1, q_scale=60.0, name="soft-cap 50, M-tiles", **cap),
        W(2, 4097, 8, 4, 256, "bfloat16", None, name="soft-cap 50", **cap),
        W(2, 1024, 32, 8, 128, "float32", 3, q_scale=60.0, name="soft-cap 50", **cap),
        W(2, 1024, 32, 8, 128, "float16", None, q_scale=OVERFLOW_Q_SCALE,
          name="soft-cap 50, logits ±1e4", **cap),
    ]
    # paged caches (pages in random order): a page per token, 3 (tiles across pages), one tile
    # per page, several, a page size that is no power of two (100); lengths that end mid-page
    # and an empty one; each math path; with the soft-cap
    m += [
        W(4, 300, 32, 8, 128, "float16", None, (300, 1, 17, 0), name="paged 16, varlen",
          page_size=16),
        W(2, 4097, 28, 4, 128, "bfloat16", 3, name="paged 1", page_size=1),
        W(2, 2000, 48, 1, 128, "float16", 1, name="paged 64, M-tiles", page_size=64),
        W(3, 257, 16, 8, 256, "float32", None, (257, 100, 0), name="paged 3, varlen",
          page_size=3),
        W(3, 5000, 32, 8, 128, "bfloat16", None, (5000, 4099, 250), name="paged 100, varlen",
          page_size=100),
        W(1, 65536, 32, 8, 128, "bfloat16", None, name="paged 256", page_size=256),
        W(2, 4097, 16, 8, 256, "float16", None, q_scale=60.0, name="paged 64, soft-cap 50",
          page_size=64, **cap),
    ]
    # a new token appended in the call (k_new, v_new): written at each length, then attended;
    # an empty sequence (written at 0), a full one (nothing written, the length stays), page
    # boundaries (the new token in a page's last row, in a new page's first); each math path
    new = {"append": True}
    m += [
        W(4, 300, 32, 8, 128, "float16", None, (299, 0, 17, 300), name="append, varlen", **new),
        W(2, 4097, 28, 4, 128, "bfloat16", 3, (4096, 1000), name="append, GQA 7", **new),
        W(2, 2000, 48, 1, 128, "float16", 1, (1999, 2000), name="append, M-tiles", **new),
        W(2, 2000, 71, 1, 64, "float16", 1, (1999, 700), name="append, paged 16, M-tiles",
          page_size=16, **new),
        W(3, 257, 16, 8, 256, "float32", None, (256, 0, 100), name="append, varlen", **new),
        W(4, 300, 32, 8, 128, "bfloat16", None, (299, 15, 16, 0), name="append, paged 16",
          page_size=16, **new),
        W(3, 5000, 32, 8, 128, "float16", 3, (4999, 99, 5000), name="append, paged 100",
          page_size=100, **new),
        W(2, 257, 8, 1, 64, "float32", None, (256, 0), name="append, paged 1", page_size=1,
          **new),
        W(3, 257, 32, 2, 128, "float16", 3, (256, 100, 0), name="append, soft-cap 50",
          **new, **cap),
    ]
    # sliding windows (window_left W: the last W + 1 tokens): a window shorter than a tile, one
    # ending mid-tile, one longer than some sequences, a window of 0 (the last token only);
    # varlen with an empty sequence; each math path; paged, appended, with the soft-cap
    m += [
        W(3, 20000, 32, 8, 128, "float16", None, (20000, 4000, 0), name="window 4095",
          window_left=4095),
        W(2, 4097, 28, 4, 128, "bfloat16", 3, name="window 100, GQA 7", window_left=100),
        W(2, 2000, 48, 1, 128, "float16", None, (2000, 7), name="window 9, M-tiles",
          window_left=9),
        W(3, 257, 16, 8, 256, "float32", None, (257, 100, 1), name="window 0", window_left=0),
        W(4, 3000, 32, 8, 128, "bfloat16", None, (3000, 1500, 17, 0), name="window 1000, paged 16",
          page_size=16, window_left=1000),
        W(3, 5000, 32, 8, 128, "float16", 3, (4999, 99, 5000), name="window 127, append, paged 100",
          page_size=100, append=True, window_left=127),
        W(2, 4097, 16, 8, 256, "float16", None, q_scale=60.0, name="window 511, soft-cap 50",
          window_left=511, **cap),
    ]
    # ALiBi (the standard slopes): heads as N, 16 rows, M-tiles, CUDA cores; varlen with an empty
    # sequence; with the soft-cap, a window and a paged cache
    ali = {"alibi": True}
    m += [
        W(3, 4097, 32, 8, 128, "float16", None, (4097, 1000, 0), name="alibi, varlen", **ali),
        W(2, 2000, 32, 2, 128, "bfloat16", 3, name="alibi, G 16", **ali),
        W(2, 2000, 48, 1, 128, "float16", 1, name="alibi, M-tiles", **ali),
        W(2, 1024, 12, 12, 64, "float32", None, name="alibi", **ali),
        W(3, 3000, 32, 8, 128, "float16", None, (3000, 17, 0), name="alibi, soft-cap, window, paged",
          page_size=16, window_left=700, **ali, **cap),
    ]
    # attention sinks (a logit per query head in the denominator): one split, the fused merge,
    # the merge kernel's plans (forced split counts), an empty sequence (out 0, lse σ); with a
    # window and pages (gpt-oss's sliding layers: a window of 127)
    snk = {"sinks": True}
    m += [
        W(3, 4097, 64, 8, 64, "bfloat16", 1, (4097, 100, 0), name="sinks, 1 split", **snk),
        W(3, 4097, 64, 8, 64, "float16", None, (4097, 100, 0), name="sinks", **snk),
        W(2, 20000, 64, 8, 64, "float16", 40, name="sinks, 40 splits", **snk),
        W(2, 2000, 48, 1, 128, "float32", 3, name="sinks, MQA", **snk),
        W(3, 5000, 64, 8, 64, "bfloat16", None, (5000, 60, 0), name="sinks, window 127, paged",
          page_size=16, window_left=127, **snk),
    ]
    # head_dims between the kernel widths (64, 128, 256: their rows zero-filled in shared
    # memory, only the real dims read and written): each math path, one split, several and the
    # fused merge, varlen with an empty sequence, paged and appended
    m += [
        W(2, 4097, 32, 32, 80, "float16", None, name="head_dim 80 (MHA)"),
        W(3, 4097, 32, 8, 96, "bfloat16", 3, (4097, 0, 300), name="head_dim 96, varlen"),
        W(2, 2000, 48, 1, 112, "float16", 1, name="head_dim 112, M-tiles"),
        W(2, 1024, 32, 2, 192, "float16", None, name="head_dim 192, G 16"),
        W(2, 300, 8, 2, 40, "float32", 3, name="head_dim 40"),
        W(2, 257, 16, 4, 32, "float16", None, name="head_dim 32"),
        W(4, 300, 32, 8, 96, "float16", None, (299, 15, 16, 0), name="head_dim 96, append, paged 16",
          page_size=16, append=True),
        W(2, 3000, 32, 32, 80, "bfloat16", None, (3000, 17), name="head_dim 80, window, alibi, sinks",
          window_left=500, alibi=True, sinks=True),
    ]
    # head_dim 512 (its own width: blocks of 8 query rows): G 4, G 16 (two head tiles), the
    # merge kernel's plans, varlen with an empty sequence, paged and appended, the score options,
    # several query tokens
    m += [
        W(3, 4097, 32, 8, 512, "float16", None, (4097, 0, 300), name="head_dim 512, varlen"),
        W(2, 2000, 32, 2, 512, "bfloat16", 3, name="head_dim 512, G 16"),
        W(4, 300, 16, 4, 512, "float16", None, (299, 15, 16, 0),
          name="head_dim 512, append, paged 16", page_size=16, append=True),
        W(2, 3000, 16, 2, 512, "bfloat16", None, (3000, 17), q_scale=8.0,
          name="head_dim 512, soft-cap, window, alibi, sinks", logits_soft_cap=50.0,
          window_left=700, alibi=True, sinks=True),
        W(2, 2000, 8, 2, 512, "float16", None, (2000, 3), name="head_dim 512, q_len 4", q_len=4),
    ]
    # several query tokens per sequence (draft tokens, each causal to its own position): heads
    # as N (G 4 × 2 tokens fill its 8 columns), the 16-row path, M-tiles, CUDA cores; sequences
    # shorter than q_len (their first rows attend nothing) and empty ones; with a window,
    # ALiBi, sinks and pages
    m += [
        W(3, 4097, 32, 8, 128, "float16", None, (4097, 1, 0), name="q_len 2", q_len=2),
        W(2, 2000, 32, 8, 128, "bfloat16", 3, (2000, 1000), name="q_len 4", q_len=4),
        W(2, 2000, 48, 1, 128, "float16", None, (2000, 5), name="q_len 7, M-tiles", q_len=7),
        W(2, 1024, 16, 16, 64, "float32", None, (1024, 16), name="q_len 16 (MHA)", q_len=16),
        W(3, 3000, 32, 8, 128, "float16", None, (3000, 17, 0),
          name="q_len 4, window, alibi, sinks, paged 16", page_size=16, window_left=500,
          alibi=True, sinks=True, q_len=4),
    ]
    # fp8 caches (q and out fp16/bf16): e4m3 and e5m2, scales per tensor, per KV head and per
    # token, each differing from 1 and from its neighbours (quantize_inputs); varlen with an
    # empty sequence, one split, several and the fused merge; paged, appended (the new tokens
    # quantised in the call, codes and per-token scales checked bit for bit), several query
    # tokens, the score options; MQA, G 16, MHA at head_dim 256, head_dims between the widths
    f8 = {"kv_dtype": "e4m3"}
    f5 = {"kv_dtype": "e5m2"}
    tok, head = {"kv_scale": "token"}, {"kv_scale": "head"}
    m += [
        W(2, 4097, 32, 8, 128, "float16", None, name="e4m3 per tensor", **f8),
        W(3, 4097, 32, 8, 128, "bfloat16", 3, (4097, 0, 300), name="e4m3 per head, varlen",
          **f8, **head),
        W(3, 4097, 32, 8, 128, "float16", 1, (4097, 1, 0), name="e4m3 per token, varlen",
          **f8, **tok),
        W(2, 2000, 8, 1, 64, "float16", None, name="e5m2 per token, MQA 8", **f5, **tok),
        W(2, 1024, 32, 2, 128, "bfloat16", 3, name="e5m2 per head, G 16", **f5, **head),
        W(2, 1024, 4, 4, 256, "float16", None, name="e4m3 per tensor, MHA", **f8),
        W(2, 3000, 24, 8, 96, "float16", None, (3000, 17), name="e4m3 per token, head_dim 96",
          **f8, **tok),
        W(1, 65536, 32, 8, 128, "float16", None, name="e4m3 per token, len 65536", **f8, **tok),
        W(4, 300, 32, 8, 128, "float16", None, (299, 15, 16, 0),
          name="e4m3 per token, append, paged 16", page_size=16, append=True, **f8, **tok),
        W(3, 5000, 32, 8, 128, "bfloat16", 3, (4999, 99, 5000),
          name="e5m2 per tensor, append, paged 100", page_size=100, append=True, **f5),
        W(3, 4097, 32, 8, 128, "float16", None, (4096, 1000, 0), name="e4m3 per head, append",
          append=True, **f8, **head),
        W(3, 3000, 32, 8, 128, "float16", None, (3000, 17, 0),
          name="e4m3 per token, q_len 4, paged 16", page_size=16, q_len=4, **f8, **tok),
        W(3, 3000, 32, 8, 128, "bfloat16", None, (3000, 500, 0),
          name="e4m3 per token, soft-cap, window, alibi, sinks", logits_soft_cap=50.0,
          window_left=700, alibi=True, sinks=True, q_scale=8.0, **f8, **tok),
    ]
    return m
