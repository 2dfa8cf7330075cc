"""Shared test helpers: GPU detection, fresh random data, tolerances and checks.

Every test draws fresh random data. The seed comes from os.urandom (or from the environment
variable CUPYDECODE_TEST_SEED, to replay a failure) and is written into every assertion message
and into the report of a failing test.
"""

from __future__ import annotations

import functools
import os

import ml_dtypes
import numpy as np

from cupydecode import reference as R
from cupydecode.cli import detect_gpu
from cupydecode.workloads import fresh_seed

SEED_ENV = "CUPYDECODE_TEST_SEED"

# Relative L2 error of the output against the float64 reference.
OUT_TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-4}
# Max abs error of the natural-log LSE on live rows (empty rows must be exactly -inf).
LSE_TOL = {"float16": 1e-3, "bfloat16": 1e-3, "float32": 1e-5}
DTYPES = ("float16", "bfloat16", "float32")


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """None when CuPy sees at least one CUDA device, else why not (for skip messages): the
    CLI's own check, so the tests skip exactly where `cupydecode check` would refuse."""
    ok, why = detect_gpu()
    return None if ok else why


def new_seed() -> int:
    """CUPYDECODE_TEST_SEED if set (to replay a failure), else a fresh seed from the OS."""
    env = os.environ.get(SEED_ENV)
    return int(env) if env else fresh_seed()


def np_dtype(name: str) -> np.dtype:
    """NumPy dtype for a dtype name; bfloat16 comes from ml_dtypes."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def randn(rng: np.random.Generator, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    """Host array of standard normal values times ``scale``, rounded to ``dtype``."""
    x = rng.standard_normal(shape, dtype=np.float32)
    if scale != 1.0:
        x *= np.float32(scale)
    return x.astype(np_dtype(dtype))


def decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype,
                  q_scale: float = 1.0):
    """Host (q, k_cache, v_cache) in the public layout."""
    q = randn(rng, (batch, num_heads, head_dim), dtype, q_scale)
    k = randn(rng, (batch, max_seqlen, num_kv_heads, head_dim), dtype)
    v = randn(rng, (batch, max_seqlen, num_kv_heads, head_dim), dtype)
    return q, k, v


def context(seed: int, **case) -> str:
    items = " ".join(f"{k}={v}" for k, v in case.items())
    return f"[seed={seed} (replay: {SEED_ENV}={seed}) {items}]"


def assert_out_close(got, ref, tol: float, ctx: str, what: str = "out") -> float:
    err = R.relative_error(got, ref)
    assert err <= tol, f"{what}: relative L2 error {err:.3e} > {tol:.1e} {ctx}"
    return err


def assert_lse_close(got, ref, atol: float, ctx: str, rtol: float = 0.0) -> float:
    """Live rows within ``atol + rtol·|ref|``; rows with ref = -inf must be exactly -inf."""
    got = R.to_float64(got)
    ref = R.to_float64(ref)
    assert not np.any(np.isnan(got)), f"lse: NaN in result {ctx}"
    dead = np.isneginf(ref)
    mismatch = np.isneginf(got) != dead
    assert not np.any(mismatch), (
        f"lse: -inf pattern differs at {np.argwhere(mismatch)[:5].tolist()} {ctx}")
    if np.all(dead):
        return 0.0
    diff = np.abs(got[~dead] - ref[~dead])
    bound = atol + rtol * np.abs(ref[~dead])
    worst = int(np.argmax(diff - bound))
    assert np.all(diff <= bound), (
        f"lse: error {diff[worst]:.3e} > {bound[worst]:.1e} (value {ref[~dead][worst]:.4g}) {ctx}")
    return float(diff.max())


def to_device(x: np.ndarray):
    """Host array → CuPy array of the same dtype (bfloat16 travels as its 16-bit pattern)."""
    import cupy

    x = np.ascontiguousarray(x)
    if x.dtype == np_dtype("bfloat16"):
        return cupy.asarray(x.view(np.uint16)).view(x.dtype)
    return cupy.asarray(x)


def poison_pool(cupy, nbytes: int) -> None:
    """Leave NaN-filled blocks in CuPy's memory pool, so that a following ``cupy.empty`` of a
    similar size gets NaN memory: an output element the kernels forget to write then shows."""
    n = max(1, -(-nbytes // 4))
    blocks = [cupy.full(n, np.nan, cupy.float32) for _ in range(4)]
    del blocks


def nan_tail(k: np.ndarray, lens) -> np.ndarray:
    """K or V with every token past each sequence's length set to NaN: a kernel that reads
    past the length turns the output NaN (the reference never reads there)."""
    k = k.copy()
    for b, n in enumerate(lens):
        k[b, n:] = np.nan
    return k


class DecodeCase:
    """One decode problem for a test, in a few lines: fresh inputs (the cache past each length
    NaN), the float64 reference with the same options, the library's calls into NaN-poisoned
    outputs, and the check against the reference (empty sequences: out = 0, lse = −inf).

    ``options`` are the API's score options (e.g. ``logits_soft_cap=50.0``), given alike to the
    reference, to ``flash_decode`` and to ``DecodePlan``::

        case = DecodeCase(rng, seed, 3, 32, 8, 128, 1000, "float16", [1000, 0, 17],
                          logits_soft_cap=5.0)
        case.check(*case.flash_decode(num_splits=3))
    """

    def __init__(self, rng, seed, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype,
                 lengths=None, q_scale: float = 1.0, **options):
        import cupy

        self.dtype, self.options = dtype, options
        self.shape = (batch, num_heads, num_kv_heads, head_dim, max_seqlen)
        self.lengths = [max_seqlen] * batch if lengths is None else list(lengths)
        q, k, v = decode_inputs(rng, batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype,
                                q_scale)
        k, v = nan_tail(k, self.lengths), nan_tail(v, self.lengths)
        self.host = q, k, v
        self.ref_out, self.ref_lse = R.decode_attention(q, k, v, self.lengths, **options)
        self.q, self.k, self.v = to_device(q), to_device(k), to_device(v)
        self.seqlens = cupy.asarray(np.asarray(self.lengths, np.int32))
        self.ctx = context(seed, dtype=dtype, shape=self.shape, lens=self.lengths[:8],
                           q_scale=q_scale, **options)

    def poisoned(self):
        """NaN-filled (out, lse) of the problem's shapes."""
        import cupy

        return (cupy.full(self.q.shape, np.nan, self.q.dtype),
                cupy.full(self.q.shape[:2], np.nan, cupy.float32))

    def flash_decode(self, **kw):
        """``flash_decode`` with the case's options (and ``kw``) into poisoned outputs."""
        import cupydecode

        import cupy

        out, _ = self.poisoned()
        poison_pool(cupy, self.q.shape[0] * self.q.shape[1] * 4)  # flash_decode's own lse
        return cupydecode.flash_decode(self.q, self.k, self.v, self.seqlens, out=out,
                                       return_lse=True, **self.options, **kw)

    def plan(self, **kw):
        """A ``DecodePlan`` of the case's shape and options (``kw``: splits, merge, ...)."""
        import cupydecode

        return cupydecode.DecodePlan(*self.shape, self.dtype, **self.options, **kw)

    def run(self, plan):
        """``plan.run`` on the case's inputs into poisoned outputs."""
        out, lse = self.poisoned()
        return plan.run(self.q, self.k, self.v, self.seqlens, out=out, lse=lse)

    def check(self, out, lse, what: str = "", lse_rtol: float = 0.0) -> float:
        """Out and lse against the reference; returns the output's relative error."""
        import cupy

        ctx = f"{what} {self.ctx}".strip()
        err = assert_out_close(out, self.ref_out, OUT_TOL[self.dtype], ctx)
        assert_lse_close(lse, self.ref_lse, LSE_TOL[self.dtype], ctx, rtol=lse_rtol)
        for b, n in enumerate(self.lengths):
            if n == 0:  # (a sink's empty row: out 0, lse σ, which the reference holds)
                assert not cupy.any(out[b]), ctx
                if self.options.get("sinks") is None:
                    assert bool(cupy.all(cupy.isneginf(lse[b]))), ctx
        return err


def to_paged(rng, k: np.ndarray, v: np.ndarray, page_size: int, extra_pages: int = 3):
    """A contiguous (batch, max_seqlen, kv_heads, dim) cache as a paged one: (k_pages, v_pages,
    block_table) with ceil(max_seqlen / page_size) pages per sequence, pages in random order
    among ``extra_pages`` unused ones. Unused pages and rows past max_seqlen are NaN, so a
    kernel that reads a wrong page or row turns its output NaN."""
    batch, max_seqlen = k.shape[:2]
    per_seq = -(-max_seqlen // page_size)
    num_pages = batch * per_seq + extra_pages
    order = rng.permutation(num_pages)
    table = order[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    pages = []
    for x in (k, v):
        p = np.full((num_pages, page_size) + x.shape[2:], np.nan, np.float32).astype(x.dtype)
        for b in range(batch):
            for j in range(per_seq):
                rows = x[b, j * page_size:(j + 1) * page_size]
                p[table[b, j], :len(rows)] = rows
        pages.append(p)
    return pages[0], pages[1], table


def shard(k, v, lens, cuts):
    """Per rank r, each sequence's tokens [cuts[b][r], cuts[b][r + 1]) at the front of a cache of
    its own: (k_r, v_r, lens_r, tokens_after_r) for every rank."""
    ranks = len(cuts[0]) - 1
    out = []
    for r in range(ranks):
        lo = np.asarray([c[r] for c in cuts])
        hi = np.asarray([c[r + 1] for c in cuts])
        n = hi - lo
        kr = np.full((k.shape[0], max(1, int(n.max())), *k.shape[2:]), np.nan, k.dtype)
        vr = kr.copy()
        for b in range(k.shape[0]):
            kr[b, :n[b]] = k[b, lo[b]:hi[b]]
            vr[b, :n[b]] = v[b, lo[b]:hi[b]]
        out.append((kr, vr, n, np.asarray(lens) - hi))
    return out


# Deliberately broken kernels, for tests that a check catches them: each mutant is a list of
# (line as it stands in kernels/decode_split.cu, its broken replacement). A CPU test
# (tests/test_compile.py) checks that every line still stands in the source exactly
# once, so that a change to the kernel that moves one fails without a GPU, not only on one.
KERNEL_MUTANTS = {
    # the new token's K and V rows never stored into the cache
    "append_not_stored": [("if (head_tile == 0 && app_kr >= 0) {", "if (false) {")],
    # every K scale taken as 1: the per-tensor/per-head factor and the per-token scales
    "k_scales_ignored": [
        ("const float k_mul = (p.k_scale ? p.k_scale[rw.kv_head] : 1.f) * p.k_scale_all;",
         "const float k_mul = 1.f;"),
        ("const float kmul[2] = {tsc[g], tsc[g + 8]};", "const float kmul[2] = {1.f, 1.f};")],
    # every V scale taken as 1 (per token: the weights' factor 2^(mv − m2), which carries
    # log2 v_scale, dropped)
    "v_scales_ignored": [
        ("const float v_mul = (p.v_scale ? p.v_scale[rw.kv_head] : 1.f) * p.v_scale_all;",
         "const float v_mul = 1.f;"),
        ("vfac[h] = st.m2[h] == CD_NEG_INF ? 0.f : cd_exp2(st.mv[h] - st.m2[h]);",
         "vfac[h] = st.m2[h] == CD_NEG_INF ? 0.f : 1.f;")],
}


def mutant_source(name: str) -> str:
    """kernels/decode_split.cu with the mutant ``name``'s lines replaced (each must stand in the
    source exactly once)."""
    from cupydecode._kernels import kernel_dir

    text = (kernel_dir() / "decode_split.cu").read_text()
    for old, new in KERNEL_MUTANTS[name]:
        assert text.count(old) == 1, f"mutant {name}: {old!r} stands {text.count(old)} times"
        text = text.replace(old, new)
    return text
