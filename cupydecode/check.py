"""Correctness check of one workload against a float64 reference (``cupydecode check``).

For each workload: fresh random inputs, outputs poisoned with NaN, one ``DecodePlan.run`` (the
launch that ``flash_decode`` makes, with the plan exposing the split count it chose), then
errors against float64. The reference is ``cupydecode.reference.decode_attention`` (NumPy) for
small caches and the same math in float64 on the GPU (:func:`reference_gpu`) where NumPy would
be slow.

With ``Workload.append`` the call also appends a new token per sequence (k_new, v_new): the
reference appends it first (``reference.decode_attention(..., k_new=, v_new=)``, or
``reference.append_kv`` on the GPU for large caches), and the cache after the call must equal
the cache with exactly the addressed rows replaced, bit for bit.

With ``Workload.kv_dtype`` the cache is fp8 (``workloads.quantize_inputs``: rows of differing
magnitude, scales per tensor, per KV head or per token that differ from 1 and from each other)
and the reference attends the exact values code · scale; an append must write the codes (and
per-token scales) that ``reference.append_kv`` computes, bit for bit.

Tolerances: relative L2 error of the output ≤ 2e-3 (fp16), 1e-2 (bf16), 1e-4 (fp32); max abs
LSE error ≤ 1e-3, widened for huge logits by the rounding an fp32 LSE cannot avoid (see
:func:`lse_tolerance`). Rows of empty sequences must give LSE = −inf exactly and out = 0.
"""

from __future__ import annotations

import math

import numpy as np

from . import reference as R
from .workloads import (Workload, alibi_slopes, make_inputs, new_tokens, page_inputs, page_like,
                        quantize_inputs, sink_logits)

REL_TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-4}
LSE_ATOL = 1e-3
# Above this many cache elements (per K), the float64 reference runs on the GPU: NumPy would
# copy K and V to float64 on the host (4× an fp16 cache) and take seconds.
NUMPY_REFERENCE_MAX_ELEMENTS = 1 << 22


def lse_tolerance(ref_lse, head_dim: int) -> float:
    """Max abs LSE error accepted: 1e-3 + 2⁻²³ · √head_dim · max|LSE|.

    The second term is the rounding of an fp32 dot product of head_dim terms at the logits'
    magnitude (about √D ulps). It is < 1e-5 for ordinary logits and matters only for the
    overflow workload: at |LSE| = 1e4 one fp32 ulp is already 1e-3, and with D = 128 the bound
    is 1.45e-2.
    """
    ref = R.to_float64(ref_lse)
    live = ref[np.isfinite(ref)]
    mag = float(np.abs(live).max()) if live.size else 0.0
    return LSE_ATOL + 2.0**-23 * math.sqrt(head_dim) * mag


def reference_gpu(q, k, v, lengths=None, softmax_scale=None, batch_ids=None, kv_heads=None,
                  **options):
    """Float64 decode attention on the GPU for some sequences and KV heads: the reference's own
    computation (``reference.attention_rows``) with CuPy. Returns CuPy float64 ``(out, lse)`` of
    shapes (nb, nk, G, D) and (nb, nk, G); ``lengths`` a host sequence (None: all max_seqlen);
    ``options``: the score options of ``attention_rows`` (e.g. ``logits_soft_cap``)."""
    import cupy

    return R.attention_rows(q, k, v, lengths, softmax_scale, batch_ids, kv_heads, xp=cupy,
                            **options)


def select_rows(x, num_kv_heads: int, batch_ids=None, kv_heads=None, tokens: bool = False):
    """The rows of a (B, H, ...) result that :func:`reference_gpu` computed: (nb, nk, G, ...);
    ``tokens``: x is (B, q_len, H, ...), the rows (nb, q_len, nk, G, ...)."""
    lead = x.shape[:2] if tokens else x.shape[:1]
    heads = x.shape[len(lead)]
    y = x.reshape(*lead, num_kv_heads, heads // num_kv_heads, *x.shape[len(lead) + 1:])
    if batch_ids is not None:
        y = y[list(batch_ids)]
    if kv_heads is not None:
        y = y[(slice(None),) * len(lead) + (list(kv_heads),)]
    return y


def fp8_options(w: Workload, k_scale, v_scale) -> dict:
    """The reference's options for the workload's cache: ``kv_dtype``, ``k_scale``, ``v_scale``
    for an fp8 cache (k and v its codes), none for a cache in dtype."""
    return ({} if w.kv_dtype is None else
            {"kv_dtype": w.kv_dtype, "k_scale": k_scale, "v_scale": v_scale})


def append_on_gpu(k, v, lens, new, fp8: dict):
    """``reference.append_kv`` on the GPU (copies): ``(k, v, lengths, fp8)`` with ``fp8`` (the
    options of :func:`fp8_options`) holding the scales after the append."""
    import cupy

    k, v, lens, *grown = R.append_kv(k, v, lens, *new, xp=cupy, **fp8)
    return k, v, lens, (dict(fp8, k_scale=grown[0], v_scale=grown[1]) if fp8 else fp8)


def reference_for(w: Workload, q, k, v, new=None, scales=(None, None)):
    """Float64 ``(out, lse, kind)`` for the whole workload; out (B, H, D), lse (B, H); ``new``:
    the appended tokens (k_new, v_new) of an append workload, None otherwise; ``scales``: an
    fp8 workload's (k_scale, v_scale) (k and v its codes)."""
    options = {"logits_soft_cap": w.logits_soft_cap, "window_left": w.window_left,
               "alibi_slopes": alibi_slopes(w.num_heads) if w.alibi else None,
               "sinks": sink_logits(w.num_heads, w.seed) if w.sinks else None}
    fp8 = fp8_options(w, *scales)
    lens = None if w.lengths is None else np.asarray(w.lengths)
    if k[0].size * w.batch <= NUMPY_REFERENCE_MAX_ELEMENTS:
        if new is not None:
            options.update(k_new=new[0], v_new=new[1])
        out, lse = R.decode_attention(q, k, v, lens, **options, **fp8)
        return out, lse, "numpy f64"
    if new is not None:
        k, v, lens, fp8 = append_on_gpu(k, v, lens, new, fp8)
    out, lse = reference_gpu(q, k, v, lens, **options, **fp8)
    return out.reshape(w.q_shape).get(), lse.reshape(w.q_shape[:-1]).get(), "gpu f64"


def max_abs_error(x, ref) -> float:
    x = R.to_float64(x)
    ref = R.to_float64(ref)
    if not np.all(np.isfinite(x)):
        return math.inf
    return float(np.max(np.abs(x - ref))) if x.size else 0.0


def _row_skeleton(w: Workload) -> dict:
    return {
        "name": w.name, "dtype": w.dtype, "batch": w.batch, "seqlen": w.seqlen,
        "num_heads": w.num_heads, "num_kv_heads": w.num_kv_heads, "head_dim": w.head_dim,
        "lengths": None if w.lengths is None else list(w.lengths), "q_scale": w.q_scale,
        "logits_soft_cap": w.logits_soft_cap, "page_size": w.page_size, "append": w.append,
        "window_left": w.window_left, "alibi": w.alibi, "sinks": w.sinks, "q_len": w.q_len,
        "kv_dtype": w.kv_dtype, "kv_scale": w.kv_scale if w.kv_dtype else None,
        "cache_rows_wrong": None, "splits_requested": w.splits_label, "splits": None,
        "chunk_tokens": None,
        "seed": w.seed, "reference": None, "max_abs_err": None, "rel_err": None,
        "lse_err": None, "rel_tol": REL_TOL[w.dtype], "lse_tol": None, "max_abs_lse": None,
        "passed": False, "error": "",
    }


def run_check(w: Workload) -> dict:
    """Check one workload; returns a result row (``passed`` True/False, never raises)."""
    import cupy

    from .decode import DecodePlan

    row = _row_skeleton(w)
    try:
        q, k, v, seqlens = make_inputs(w)
        row["seed"] = w.seed
        scales = (None, None)
        if w.kv_dtype:  # the fp8 cache: k and v become its codes
            k, v, *scales = quantize_inputs(w, k, v)
        plan = DecodePlan(w.batch, w.num_heads, w.num_kv_heads, w.head_dim, w.seqlen, w.dtype,
                          num_splits=w.num_splits, logits_soft_cap=w.logits_soft_cap,
                          page_size=w.page_size, window_left=w.window_left, alibi=w.alibi,
                          q_len=w.q_len, kv_dtype=w.kv_dtype)
        row["splits"], row["chunk_tokens"] = plan.num_splits, plan.chunk_tokens
        # Poisoned outputs: a row the kernels forget to write stays NaN and fails the check.
        out = cupy.full(w.q_shape, math.nan, w.dtype)
        lse = cupy.full(w.q_shape[:-1], math.nan, cupy.float32)
        new = new_tokens(w) if w.append else None
        appended = {} if new is None else {"k_new": new[0], "v_new": new[1]}
        if w.alibi:
            appended["alibi_slopes"] = cupy.asarray(alibi_slopes(w.num_heads))
        if w.sinks:
            appended["sinks"] = cupy.asarray(sink_logits(w.num_heads, w.seed))
        # per-token scales: the call's own (an append writes into them; paged: in pages)
        run_scales = [s if isinstance(s, float) or s is None or s.ndim == 1 else
                      page_like(s, w.page_size, w.seed) if w.page_size else s.copy()
                      for s in scales]
        if w.kv_dtype:
            appended.update(k_scale=run_scales[0], v_scale=run_scales[1])
        if w.page_size:  # the same tokens in pages (random order); the reference reads k, v
            _, kc, vc, _, table = page_inputs((q, k, v, seqlens), w.page_size, w.seed)
            plan.run(q, kc, vc, seqlens, out=out, lse=lse, block_table=table, **appended)
        else:  # an append writes into the cache: into a copy, k and v stay for the reference
            kc, vc = (k.copy(), v.copy()) if new is not None else (k, v)
            plan.run(q, kc, vc, seqlens, out=out, lse=lse, **appended)
        cupy.cuda.get_current_stream().synchronize()
        if new is not None:
            row["cache_rows_wrong"] = wrong_cache_rows(w, q, k, v, seqlens, new, kc, vc,
                                                       scales, run_scales)
        del kc, vc, run_scales
        ref_out, ref_lse, kind = reference_for(w, q, k, v, new, scales)
        row["reference"] = kind
        row["max_abs_err"] = max_abs_error(out, ref_out)
        row["rel_err"] = R.relative_error(out, ref_out)
        row["lse_err"] = R.lse_error(lse, ref_lse)
        row["lse_tol"] = lse_tolerance(ref_lse, w.head_dim)
        live = ref_lse[np.isfinite(ref_lse)]
        row["max_abs_lse"] = float(np.abs(live).max()) if live.size else 0.0
        row["passed"] = bool(row["rel_err"] <= row["rel_tol"] and row["lse_err"] <= row["lse_tol"]
                             and not row["cache_rows_wrong"])
        if row["cache_rows_wrong"]:
            row["error"] = (f"the cache after the append differs from reference.append_kv's in "
                            f"{row['cache_rows_wrong']} token row(s) of K and V"
                            + (" (codes or per-token scales)" if w.kv_dtype else ""))
    except Exception as exc:  # a crash is a failed row, not a crashed run
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["passed"] = False
    finally:
        cupy.get_default_memory_pool().free_all_blocks()
    return row


def wrong_cache_rows(w: Workload, q, k, v, seqlens, new, k_after, v_after,
                     scales=(None, None), scales_after=(None, None)) -> int:
    """Token rows (of K and of V) in which the cache after an append call (``k_after``,
    ``v_after``: contiguous, or the pages of :func:`page_inputs` with the workload's seed)
    differs in any bit from the cache before it (``k``, ``v``) with exactly the addressed rows
    replaced (``reference.append_kv``, on the GPU). An fp8 workload: ``k``, ``v`` its codes,
    ``scales`` its (k_scale, v_scale) before the call, ``scales_after`` the call's after it
    (a row whose per-token scale differs counts as wrong too)."""
    import cupy

    lens = None if w.lengths is None else np.asarray(w.lengths)
    k_exp, v_exp, _, fp8 = append_on_gpu(k, v, lens, new, fp8_options(w, *scales))
    s_exp = [fp8.get("k_scale"), fp8.get("v_scale")]
    if w.page_size:
        _, k_exp, v_exp, _, _ = page_inputs((q, k_exp, v_exp, seqlens), w.page_size, w.seed)
    got_exp = [(k_after, k_exp), (v_after, v_exp)]
    if w.kv_per_token_scales:  # float32 scales, bit for bit where not NaN (past the lengths)
        s_exp = [page_like(s, w.page_size, w.seed) if w.page_size else s for s in s_exp]
        got_exp = [(g, e, sa, se.astype(cupy.float32))
                   for (g, e), sa, se in zip(got_exp, scales_after, s_exp)]
    wrong = 0
    for got, exp, *sc in got_exp:
        diff = got.view(cupy.uint8) != exp.view(cupy.uint8)
        diff = diff.reshape(diff.shape[0] * diff.shape[1], -1).any(axis=1)
        if sc:  # (a NaN's bits may change in a float64 round trip; any NaN equals any NaN)
            got_s, exp_s = sc
            sd = ((got_s.view(cupy.uint32) != exp_s.view(cupy.uint32))
                  & ~(cupy.isnan(got_s) & cupy.isnan(exp_s)))
            diff |= sd.reshape(diff.shape[0], -1).any(axis=1)
        wrong += int(diff.sum())
    return wrong


def repro_command(row: dict) -> str:
    """The ``cupydecode check`` command line that replays one row (same seed, same data)."""
    parts = ["cupydecode check", f"--batch {row['batch']}", f"--seqlen {row['seqlen']}",
             f"--heads {row['num_heads']}", f"--kv-heads {row['num_kv_heads']}",
             f"--head-dim {row['head_dim']}", f"--dtype {row['dtype']}",
             f"--splits {row['splits_requested']}", f"--seed {row['seed']}"]
    if row["lengths"] is not None:
        parts.append("--lengths " + ",".join(str(n) for n in row["lengths"]))
    if row["q_scale"] != 1.0:
        parts.append(f"--q-scale {row['q_scale']:g}")
    if row["logits_soft_cap"] is not None:
        parts.append(f"--soft-cap {row['logits_soft_cap']!r}")
    if row["page_size"] is not None:
        parts.append(f"--page-size {row['page_size']}")
    if row["append"]:
        parts.append("--append")
    if row.get("window_left") is not None:
        parts.append(f"--window {row['window_left']}")
    if row.get("alibi"):
        parts.append("--alibi")
    if row.get("sinks"):
        parts.append("--sinks")
    if row.get("q_len", 1) > 1:
        parts.append(f"--q-len {row['q_len']}")
    if row.get("kv_dtype"):
        parts.append(f"--kv-dtype {row['kv_dtype']} --kv-scale {row['kv_scale']}")
    return " ".join(parts)
