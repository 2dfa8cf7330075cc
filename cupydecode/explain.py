"""``cupydecode explain``: docs/DESIGN.md's algorithm, number by number, on a tiny example.

One query row q against ``tokens`` keys and values, split into ``splits`` chunks exactly as the
kernels split a cache (chunks of ceil(tokens / splits) tokens; trailing chunks may be empty).
Kernel 1 gives, per chunk i:
    m_i = max s_j,  l_i = Σ exp(s_j − m_i),  V_i = Σ exp(s_j − m_i) v_j,
    Õ_i = V_i / l_i,  LSE_i = m_i + log l_i
and kernel 2 merges them:
    LSE = max_i LSE_i + log Σ_i exp(LSE_i − max_i LSE_i),  w_i = exp(LSE_i − LSE),  O = Σ w_i Õ_i.
Everything here is NumPy (no CuPy import); :func:`gpu_partials` reads the same quantities
back from the real kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _policy
from . import reference as R


@dataclass
class Walk:
    """Inputs (float32 values, held in float64) and every intermediate of the algorithm."""

    q: np.ndarray          # (D,)
    k: np.ndarray          # (n, D)
    v: np.ndarray          # (n, D)
    scale: float           # c
    edges: list[int]       # chunk boundaries [0, ..., n], len S + 1
    s: np.ndarray          # (n,)   s_j
    m: np.ndarray          # (S,)   m_i (−inf for an empty chunk)
    l: np.ndarray          # (S,)   l_i (0 for an empty chunk)
    V: np.ndarray          # (S, D) V_i
    O_part: np.ndarray     # (S, D) Õ_i
    lse_part: np.ndarray   # (S,)   LSE_i
    lse: float             # merged LSE
    w: np.ndarray          # (S,)   w_i
    O: np.ndarray          # (D,)   merged output
    O_direct: np.ndarray   # (D,)   direct float64 softmax
    lse_direct: float

    @property
    def tokens(self) -> int:
        return self.k.shape[0]

    @property
    def splits(self) -> int:
        return len(self.edges) - 1

    @property
    def head_dim(self) -> int:
        return self.q.shape[0]


def chunk_edges(tokens: int, splits: int) -> list[int]:
    """Chunk boundaries as the kernels cut them: chunk = ceil(tokens / splits) tokens."""
    chunk = _policy.chunk_for_splits(tokens, splits)
    return [min(i * chunk, tokens) for i in range(splits + 1)]


def make_example(tokens: int, head_dim: int, seed: int, center: float = 120.0,
                 spread: float = 1.5):
    """q, K, V (float32 values) whose logits c·q·k_j are ``center`` ± about ``spread``.

    q = a·u and k_j = a·u + noise_j for a unit vector u, with a² = center·√D, so that
    c·q·k_j = c·a² + c·a·(u·noise_j) = center + N(0, spread²).
    """
    rng = np.random.default_rng(seed)
    u = rng.standard_normal(head_dim)
    u /= np.linalg.norm(u)
    a = math.sqrt(center * math.sqrt(head_dim))
    sigma = spread * math.sqrt(head_dim) / a
    q = a * u
    k = a * u + sigma * rng.standard_normal((tokens, head_dim))
    v = rng.standard_normal((tokens, head_dim))
    as32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731  what a GPU would hold
    return as32(q), as32(k), as32(v)


def split_merge(s: np.ndarray, v: np.ndarray, edges, dtype=np.float64):
    """Kernel 1 then kernel 2 in ``dtype`` arithmetic; returns a dict of every quantity."""
    with np.errstate(over="ignore"):  # (logits past the dtype's range: inf, as a kernel's)
        s = s.astype(dtype)
    v = v.astype(dtype)
    S, D = len(edges) - 1, v.shape[1]
    m = np.full(S, -np.inf, dtype)
    l = np.zeros(S, dtype)
    V = np.zeros((S, D), dtype)
    O_part = np.zeros((S, D), dtype)
    lse_part = np.full(S, -np.inf, dtype)
    for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        if b <= a:
            continue  # empty chunk: (Õ, LSE) = (0, −inf), never exp(−inf − (−inf)) = NaN
        m[i] = s[a:b].max()
        p = np.exp(s[a:b] - m[i])                 # every exponent ≤ 0
        l[i] = p.sum()
        V[i] = (p[:, None] * v[a:b]).sum(axis=0)
        O_part[i] = V[i] / l[i]
        lse_part[i] = m[i] + np.log(l[i])
    mx = lse_part.max()
    if not np.isfinite(mx):
        return dict(m=m, l=l, V=V, O_part=O_part, lse_part=lse_part, lse=dtype(-np.inf),
                    w=np.zeros(S, dtype), O=np.zeros(D, dtype))
    e = np.where(np.isneginf(lse_part), dtype(0), np.exp(lse_part - mx))
    lse = mx + np.log(e.sum())
    w = np.where(np.isneginf(lse_part), dtype(0), np.exp(lse_part - lse))
    O = (w[:, None] * O_part).sum(axis=0)
    return dict(m=m, l=l, V=V, O_part=O_part, lse_part=lse_part, lse=lse, w=w, O=O)


def walk(tokens: int = 12, splits: int = 3, head_dim: int = 4, seed: int = 0,
         center: float = 120.0) -> Walk:
    """The full float64 walk of docs/DESIGN.md on one generated example."""
    if tokens < 1 or splits < 1 or head_dim < 1:
        raise ValueError(f"tokens, splits, head_dim: expected ≥ 1, got {tokens}, {splits}, {head_dim}")
    q, k, v = make_example(tokens, head_dim, seed, center)
    scale = 1.0 / math.sqrt(head_dim)
    s = scale * (k @ q)
    edges = chunk_edges(tokens, splits)
    r = split_merge(s, v, edges)
    o_dir, lse_dir = R.decode_attention(q[None, None], k[None, :, None], v[None, :, None],
                                        softmax_scale=scale)
    return Walk(q=q, k=k, v=v, scale=scale, edges=edges, s=s, O_direct=o_dir[0, 0],
                lse_direct=float(lse_dir[0, 0]), **r)


def direct_softmax(s: np.ndarray, v: np.ndarray, dtype):
    """O = Σ exp(s_j) v_j / Σ exp(s_j) computed naively in ``dtype`` (no max subtraction).

    Returns (denominator, output); with logits past log(max of dtype) both overflow.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        s = s.astype(dtype)
        v = v.astype(dtype)
        e = np.exp(s)
        num = (e[:, None] * v).sum(axis=0)
        den = e.sum()
        return den, num / den


# ---------------------------------------------------------------------------- formatting

def _vec(x, prec: int = 6) -> str:
    return np.array2string(np.asarray(x, np.float64), precision=prec, floatmode="fixed",
                           max_line_width=200, sign=" ")


def _num(x, prec: int = 6) -> str:
    x = float(x)
    return f"{x:.{prec}f}" if math.isfinite(x) else str(x)


def format_walk(wk: Walk) -> list[str]:
    n, S, D = wk.tokens, wk.splits, wk.head_dim
    chunk = wk.edges[1] - wk.edges[0]  # walk() takes S >= 1
    lines = [
        f"One query row against {n} token{'s' * (n != 1)}, head_dim {D}, c = 1/sqrt({D}) = "
        f"{wk.scale:g}; {S} split(s) of up to {chunk} token{'s' * (chunk != 1)}.",
        "(q, k_j, v_j are float32 values; everything below is float64.)",
        "",
        "Scores  s_j = c · q·k_j",
    ]
    for j in range(n):
        lines.append(f"  j={j:<3d} s_j = {_num(wk.s[j], 4)}")
    lines += ["", "Kernel 1, per split i (tokens a..b-1):",
              "  i  tokens      m_i = max s_j    l_i = Σ exp(s_j − m_i)   LSE_i = m_i + log l_i"]
    for i in range(S):
        a, b = wk.edges[i], wk.edges[i + 1]
        toks = f"{a}..{b - 1}" if b > a else "(empty)"
        lines.append(f"  {i:<2d} {toks:<11s} {_num(wk.m[i]):>14s}   {_num(wk.l[i]):>20s}   "
                     f"{_num(wk.lse_part[i]):>20s}")
    lines.append("  V_i = Σ exp(s_j − m_i) v_j        Õ_i = V_i / l_i")
    for i in range(S):
        lines.append(f"  {i:<2d} V_i = {_vec(wk.V[i])}   Õ_i = {_vec(wk.O_part[i])}")
    lines += [
        "",
        "Kernel 2, the merge:",
        f"  LSE = max_i LSE_i + log Σ_i exp(LSE_i − max_i LSE_i) = {_num(wk.lse)}",
        f"  w_i = exp(LSE_i − LSE) = {_vec(wk.w)}   (Σ w_i = {_num(wk.w.sum(), 12)})",
        f"  O   = Σ_i w_i Õ_i = {_vec(wk.O, 9)}",
        "",
        "Direct float64 softmax over all tokens (reference.decode_attention):",
        f"  O_direct   = {_vec(wk.O_direct, 9)}",
        f"  LSE_direct = log Σ_j exp(s_j) = {_num(wk.lse_direct)}",
        f"  max |O − O_direct| = {np.max(np.abs(wk.O - wk.O_direct)):.3e}",
        f"  |LSE − LSE_direct| = {abs(wk.lse - wk.lse_direct):.3e}",
    ]
    return lines


def format_overflow(wk: Walk) -> list[str]:
    """The direct exp-sum overflows in fp16 and fp32; the LSE path in fp32 stays exact."""
    smax = float(wk.s.max())
    lines = [
        "",
        f"Why the log domain: the largest logit here is {smax:.2f}; exp overflows float16 past "
        f"{math.log(float(np.finfo(np.float16).max)):.2f} and float32 past {math.log(float(np.finfo(np.float32).max)):.2f}.",
    ]
    for dt in (np.float16, np.float32):
        den, out = direct_softmax(wk.s, wk.v, dt)
        lines.append(f"  direct in {np.dtype(dt).name:<8s} Σ_j exp(s_j) = {float(den)}   "
                     f"O = {_vec(out, 4)}")
    r32 = split_merge(wk.s, wk.v, wk.edges, np.float32)
    err = float(np.max(np.abs(r32["O"].astype(np.float64) - wk.O_direct)))
    lines += [
        f"  LSE path in float32 (what the kernels do): LSE = {_num(r32['lse'], 4)}   "
        f"O = {_vec(r32['O'], 6)}",
        f"  LSE path float32 vs float64 direct: max |ΔO| = {err:.2e}, "
        f"|ΔLSE| = {abs(float(r32['lse']) - wk.lse_direct):.2e}  (every exponent ≤ 0: nothing overflows)",
    ]
    return lines


# ---------------------------------------------------------------------------- GPU

def gpu_partials(wk: Walk) -> dict:
    """The same quantities from the real kernels: Õ_i, LSE_i (kernel 1) and O, LSE (kernel 2).

    Runs a float32 ``DecodePlan`` with ``num_splits`` = the walk's split count on one sequence
    of one head, and reads ``plan.o_part`` / ``plan.lse_part`` after the run. head_dim is padded
    with zeros to the next supported one (a multiple of 8 from 32): zeros in q and k leave every
    score unchanged, zeros in v only add output columns, which are dropped.
    """
    import cupy

    from .decode import DecodePlan

    D = wk.head_dim
    padded = next((d for d in _policy.SUPPORTED_HEAD_DIMS if D <= d <= _policy.MAX_HEAD_DIM),
                  None)  # (float32: up to 256)
    if padded is None:
        raise ValueError(f"head_dim: expected at most {_policy.MAX_HEAD_DIM} for --gpu, got {D}")
    n = wk.tokens

    def dev(x, shape):
        buf = np.zeros(shape, np.float32)
        buf[..., :D] = x.reshape(shape[:-1] + (D,))
        return cupy.asarray(buf)

    q = dev(wk.q, (1, 1, padded))
    k = dev(wk.k, (1, n, 1, padded))
    v = dev(wk.v, (1, n, 1, padded))
    plan = DecodePlan(1, 1, 1, padded, n, "float32", num_splits=wk.splits)
    out, lse = plan.run(q, k, v, softmax_scale=wk.scale)
    cupy.cuda.get_current_stream().synchronize()
    if plan.o_part is None:  # one split: the split kernel wrote the final result directly
        o_part, lse_part = out.reshape(1, 1, padded), lse.reshape(1, 1)
    else:
        o_part, lse_part = plan.o_part, plan.lse_part
    return {
        "num_splits": plan.num_splits, "chunk_tokens": plan.chunk_tokens,
        "O_part": cupy.asnumpy(o_part[:, 0, :D]).astype(np.float64),
        "lse_part": cupy.asnumpy(lse_part[:, 0]).astype(np.float64),
        "O": cupy.asnumpy(out[0, 0, :D]).astype(np.float64),
        "lse": float(lse[0, 0]),
    }


def gpu_differences(wk: Walk, g: dict) -> dict:
    """Max abs differences GPU − CPU for Õ_i, LSE_i (live splits; empty must be −inf), O, LSE."""
    return {
        "O_part": float(np.max(np.abs(g["O_part"] - wk.O_part))),
        "lse_part": R.lse_error(g["lse_part"], wk.lse_part),
        "O": float(np.max(np.abs(g["O"] - wk.O))),
        "lse": abs(g["lse"] - wk.lse),
    }


def format_gpu(wk: Walk, g: dict) -> list[str]:
    d = gpu_differences(wk, g)
    lines = ["", f"The same example on the GPU (float32 kernels, num_splits={g['num_splits']}, "
                 f"chunk_tokens={g['chunk_tokens']}):"]
    for i in range(len(g["lse_part"])):
        lines.append(f"  {i:<2d} Õ_i = {_vec(g['O_part'][i])}   LSE_i = {_num(g['lse_part'][i])}")
    lines += [
        f"  O   = {_vec(g['O'], 9)}   LSE = {_num(g['lse'])}",
        f"  max |GPU − CPU|: Õ_i {d['O_part']:.2e}, LSE_i {d['lse_part']:.2e}, "
        f"O {d['O']:.2e}, LSE {d['lse']:.2e}",
    ]
    return lines
