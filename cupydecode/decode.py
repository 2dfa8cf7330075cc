"""Public API: flash_decode, merge_states and DecodePlan.

Thin by design: validate (``_validate``) → plan (``_policy``) → launch (``_kernels``).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import struct
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _kernels, _policy
from . import _validate as V

if TYPE_CHECKING:
    import cupy

# GPU arrays: cupy.ndarray, or anything DLPack / __cuda_array_interface__ brings in (torch, JAX)
ArrayLike = Any

_SPLIT_FILE, _SPLIT_KERNEL = "decode_split.cu", "cd_decode_split"
_MERGE_FILE, _MERGE_KERNEL = "merge_states.cu", "cd_merge_states"


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


@functools.lru_cache(maxsize=None)
def _smem_per_block(device_id: int) -> int:
    import cupy

    # 0 when the CUDA properties do not report it: then the launch itself is the check.
    return int(cupy.cuda.runtime.getDeviceProperties(device_id).get("sharedMemPerBlockOptin", 0))


_SUPPORTED_GPUS = "supported are GPUs with >= 160 KB per block (A100, H100, H200, B200"


def _smem_need(dtype: str, head_dim: int, kv_dtype: str | None = None) -> int:
    """Shared memory per block (bytes) that every block shape a plan of ``dtype`` and
    ``head_dim`` (an fp8 cache: ``kv_dtype``) may pick fits in."""
    return max(c.smem_bytes for c in (
        _policy.split_kernel_configs(dtype, head_dim) if kv_dtype is None else
        _policy.fp8_kernel_configs(dtype, head_dim, kv_dtype)))


def smem_shortfall(device_id: int, smem_optin: int, dtype: str, head_dim: int,
                   kv_dtype: str | None = None) -> str | None:
    """Why GPU ``device_id``, which allows ``smem_optin`` bytes of shared memory per block (0:
    not reported), cannot run every block shape a plan of ``dtype`` and ``head_dim`` may pick;
    None where it can."""
    need = _smem_need(dtype, head_dim, kv_dtype)
    if 0 < smem_optin < need:
        return (f"cupydecode needs {need} bytes of shared memory per block for {dtype} head_dim "
                f"{head_dim}, but GPU {device_id} allows {smem_optin}: {_SUPPORTED_GPUS}; "
                f"head_dim {_policy.WIDE_HEAD_DIM}: >= 204 KB, H100, H200, B200)")
    return None


def device_shortfall() -> str | None:
    """Why the current GPU cannot run any plan (too little shared memory per block even for
    the least demanding dtype and kernel width), or None."""
    import cupy

    device_id = cupy.cuda.Device().id
    smem_optin = _smem_per_block(device_id)
    least = min(_smem_need(dtype, width) for dtype in _policy.DTYPE_IDS
                for width in _policy.KERNEL_HEAD_DIMS[:3])
    if 0 < smem_optin < least:
        return (f"GPU {device_id} allows {smem_optin} bytes of shared memory per block; "
                f"cupydecode's kernels need at least {least}: {_SUPPORTED_GPUS})")
    return None


def _split_function(cfg: _policy.SplitKernelConfig):
    if _kernels._SOURCE_DIRS and _kernels.param_list(_PARAM_FILE, _PARAM_MACRO) != _PARAM_LIST:
        raise RuntimeError("a kernel variant (kernel_sources) with another parameter list than "
                           "the shipped kernels/decode_params.cuh: the host packs the shipped one")
    return _kernels.get_function(_SPLIT_FILE, _SPLIT_KERNEL, cfg.defines())


@functools.lru_cache(maxsize=None)
def _blocks_per_sm(cfg: _policy.SplitKernelConfig, device_id: int) -> int:
    """Resident blocks per SM of the split kernel, from the driver's occupancy calculator."""
    from cupy_backends.cuda.api import driver

    fn = _split_function(cfg)
    _kernels.allow_shared_memory(fn, cfg.smem_bytes)
    return max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(
        fn.kernel.ptr, cfg.threads, cfg.smem_bytes))


def _merge_function(in_dtype: str, out_dtype: str, head_dim: int):
    return _kernels.get_function(_MERGE_FILE, _MERGE_KERNEL, {
        "IN_DTYPE": _policy.DTYPE_IDS[in_dtype],
        "OUT_DTYPE": _policy.DTYPE_IDS[out_dtype],
        "VEC": _policy.merge_vec(head_dim),
    })


def _is_capturing(stream) -> bool:
    try:
        return bool(stream.is_capturing())
    except Exception:  # the query itself is illegal during some captures
        return True


class DecodePlan:
    """Fixed launch plan for one decode shape: workspace allocated once, grid fixed.

    ``run`` allocates nothing and never synchronises, so it can be captured in a
    ``cupy.cuda.Graph`` and replayed after the inputs are changed in place::

        plan = DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
        out, lse = plan.run(q, k_cache, v_cache, cache_seqlens)

    Without ``out=``/``lse=``, ``run`` writes into buffers owned by the plan (``plan.out``,
    ``plan.lse``), overwritten by the next run. ``num_splits`` forces the split count;
    ``split_size`` fixes the tokens per split instead, so that a sequence's result does not
    depend on the rest of the batch; by default both are chosen from the shape and SM count.

    ``merge`` says how split partials are combined: ``"fused"`` lets the last split block of
    each KV head (or block of KV heads) merge them inside the one launch; ``"kernel"`` runs
    merge_states.cu as a second kernel (same math, one more launch, spread over many warps);
    ``"auto"`` (default) takes the fused merge where it costs each of the block's warps one trip
    to L2 — and, where the merge kernel is launched as a programmatic dependent (Hopper on),
    folds at most 64 partial states per block — and the kernel elsewhere (``plan.merge`` tells
    which: ``"fused"``, ``"kernel"``, or ``"none"`` for one split; ``_policy.merge_mode``).

    ``enable_pdl=True`` launches the split kernel as a programmatic dependent of the kernel
    before it on the stream (Hopper and later; elsewhere a plain launch): its blocks may become
    resident while that kernel ends, and wait in the kernel before they read anything — q, the
    lengths and the cache may all be that kernel's output. It pays where the kernel before lets
    its dependents start early (``griddepcontrol.launch_dependents``, as kernels written for
    programmatic launch do): measured on the H200 in the decode-step protocol, 0.6–1.3 µs less
    per call from 4 MB to 268 MB of KV and 6 µs (1.2%) at 2 GB; after a kernel that does not,
    0.06–0.46 µs more, hence off by default (docs/PERFORMANCE.md).

    ``logits_soft_cap`` c > 0 caps every score s (after the softmax scale) as c·tanh(s/c)
    before the softmax, as Gemma-2 does (c = 50); the plan's kernel is then built with the cap
    (``SOFT_CAP``), and a plan without one runs exactly the kernel it ran before.

    ``page_size`` P makes the plan one for paged caches: ``run`` then takes k_cache, v_cache
    of shape (num_pages, P, num_kv_heads, head_dim) (other strides honoured, e.g. the HND order
    as a transposed view) and ``block_table=``, an int32 device array (batch, ≥
    ceil(max_seqlen / P)) whose row b lists sequence b's pages in order; ``max_seqlen`` is then
    the most tokens a sequence may hold. Any P ≥ 1 works; a page index outside [0, num_pages)
    reads nothing and its tokens count for nothing.

    ``run(..., k_new=, v_new=)`` appends each sequence's new token in the same launch: attention
    runs over cache_seqlens[b] + 1 tokens (clamped to max_seqlen), the new one read from k_new,
    v_new, and the block whose chunk holds it writes its K and V rows into the cache at position
    cache_seqlens[b] (through the block table when paged; a device length at or past
    max_seqlen, or a page index outside [0, num_pages), writes nothing; an int length or None
    that leaves no room is refused). The caller advances cache_seqlens.

    ``window_left`` W ≥ 0 makes every run attend only the last W + 1 tokens of each sequence
    (the new one included; with N query tokens, each token's own last W + 1); the split count and
    size come from min(max_seqlen, W + N) (``span``: the first token's W + 1 keys and the N − 1
    after them).

    ``q_len`` N > 1 makes a plan for N query tokens per sequence (verifying draft tokens): ``run``
    takes q of shape (batch, N, num_heads, head_dim), and writes out (batch, N, num_heads,
    head_dim) and lse (batch, N, num_heads); token t of a sequence of L tokens attends the keys
    up to position L − N + t (and, with a window, only the last W + 1 of those). The N tokens'
    K and V are in the cache already, or ``run(..., k_new=, v_new=)`` of shape (batch, N,
    num_kv_heads, head_dim) appends them in the same launch (N ≤ 16). Blocks tile
    a KV head's N × G (token, head) rows as they tile G heads, reading each K/V tile once for
    all of them; the kernel is built with ``MULTI_Q``.

    ``kv_dtype`` ("e4m3" or "e5m2") makes a plan for caches of fp8 codes: ``run`` then takes
    uint8 (or the format's ml_dtypes float8) caches and ``k_scale=``, ``v_scale=`` (per tensor,
    per KV head or per token: :func:`flash_decode`), q and out float16 or bfloat16, head_dim a
    multiple of 16. Its blocks decode the codes in registers (one KV head and at most 8 query
    rows a block: ``_policy.FP8_SHAPES``); appended tokens are quantised into the cache.

    ``tuning``: a :class:`cupydecode.Tuning` overrides the policy's block shape (warps, ring
    stages, the L2 hint, warps in step) for A/B measurements of kernel shapes; the default
    (None) is the policy's shape, the one the measurements in docs/PERFORMANCE.md chose.

    A plan's workspace (partials and the fused merge's arrival counters) is shared by its runs:
    run one plan on one stream at a time, and make one plan per stream for concurrent decoding
    (``flash_decode`` keeps its cached plans per stream for this reason, and per thread on the
    per-thread default stream, whose one handle names a different stream in each thread).
    """

    def __init__(self, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_seqlen: int, dtype, num_splits: int | None = None,
                 split_size: int | None = None, merge: str = "auto", enable_pdl: bool = False,
                 *, logits_soft_cap: float | None = None, page_size: int | None = None,
                 window_left: int | None = None, alibi: bool = False, q_len: int = 1,
                 kv_dtype: str | None = None, tuning: _policy.Tuning | None = None):
        cupy = _kernels.import_cupy()

        self.batch = V.check_int(batch, "batch", 0, _policy.MAX_BATCH)
        self.num_heads = V.check_int(num_heads, "num_heads", 1)
        self.num_kv_heads = V.check_int(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = V.check_int(head_dim, "head_dim", 1)
        self.max_seqlen = V.check_int(max_seqlen, "max_seqlen", 0, _policy.MAX_TOKENS)
        self.dtype = V.check_dtype_arg(dtype, "dtype")
        V.check_head_dim(self.head_dim, self.dtype, "head_dim")
        self.kv_dtype = None if kv_dtype is None else V.check_kv_dtype(kv_dtype)
        if self.kv_dtype is not None:
            V.check_fp8_query(self.dtype, self.head_dim, self.kv_dtype, "dtype", "head_dim")
        if self.num_heads % self.num_kv_heads:
            V.fail(ValueError, "num_kv_heads", f"a divisor of num_heads={self.num_heads}",
                   self.num_kv_heads)
        num_splits, split_size = V.check_splits(num_splits, split_size)
        if merge not in _policy.MERGE_MODES:
            V.fail(ValueError, "merge", " or ".join(map(repr, _policy.MERGE_MODES)), repr(merge))
        self.enable_pdl = V.check_flag(enable_pdl, "enable_pdl")
        self.logits_soft_cap = V.check_soft_cap(logits_soft_cap)
        self.window_left = V.check_window(window_left)
        self.alibi = V.check_flag(alibi, "alibi")
        self.q_len = V.check_int(q_len, "q_len", 1, _policy.MAX_Q_LEN)
        # the tokens a sequence's attention reads at most: the splits are sized from these (a
        # window: the first query token's W + 1 and the q_len − 1 after it)
        self.span = (self.max_seqlen if self.window_left is None
                     else min(self.max_seqlen, self.window_left + self.q_len))
        self.page_size = (None if page_size is None
                          else V.check_int(page_size, "page_size", 1, _policy.MAX_TOKENS))
        V.check_tuning_types(tuning)  # (its fields are read below, before check_tuning)
        self.group = self.num_heads // self.num_kv_heads
        # a KV head's query rows: its G heads of each of the q_len tokens (blocks tile these)
        rows_g = self.q_len * self.group
        try:
            self.device_id = cupy.cuda.Device().id
        except cupy.cuda.runtime.CUDARuntimeError as exc:  # no driver, no GPU: say so plainly
            raise RuntimeError(f"DecodePlan: {_kernels.gpu_problem() or exc}") from exc
        _kernels.bind_context()  # the driver calls below (occupancy, attributes) need it
        smem_optin = _smem_per_block(self.device_id)
        why = smem_shortfall(self.device_id, smem_optin, self.dtype, self.head_dim, self.kv_dtype)
        if why:
            raise RuntimeError(why)
        if (split_size is not None
                and _policy.fixed_split_size(self.span, split_size)[0] > _policy.MAX_SPLITS):
            what = ("max_seqlen" if self.window_left is None
                    else "min(max_seqlen, window_left + q_len)")
            V.fail(ValueError, "split_size", f"at least {what} / {_policy.MAX_SPLITS} = "
                   f"{-(-self.span // _policy.MAX_SPLITS)}", split_size)

        # where the GPU allows, the merge kernel is launched as a programmatic dependent of the
        # split kernel: its blocks are then resident and waiting when the split kernel ends
        programmatic = _kernels.programmatic_launch_supported(self.device_id)
        eight_rows = _policy.eight_row_blocks(self.head_dim, self.kv_dtype)
        if not eight_rows:
            self.m_tiles, self.num_splits, self.chunk_tokens, self.kv_per_block = _policy.plan_shape(
                self.dtype, self.head_dim, rows_g, self.batch, self.num_kv_heads, self.span,
                _sm_count(self.device_id), lambda cfg: _blocks_per_sm(cfg, self.device_id),
                num_splits, split_size, merge, programmatic,
                kv_groups=self.q_len == 1 and (tuning is None or tuning.kv_groups is not False))
        else:  # an fp8 cache, head_dim 512: one M-tile and one KV head a block of 8 rows
            self.m_tiles, self.kv_per_block = 1, 1
            self.num_splits, self.chunk_tokens = _policy.narrow_plan_shape(
                self.dtype, self.kv_dtype, self.head_dim, rows_g, self.batch, self.num_kv_heads,
                self.span, _sm_count(self.device_id),
                lambda cfg: _blocks_per_sm(cfg, self.device_id), num_splits, split_size, merge,
                programmatic)
        self.head_tiles = _policy.head_tiles(rows_g, self.m_tiles, eight_rows)
        kpb = self.kv_per_block  # KV heads per block (1, KV_GROUP, or a BURST_KV_GROUPS size)
        # a block of several KV heads takes all of their query heads (one head tile), and the
        # grid below has one block per kpb KV heads: anything else would leave heads unwritten
        assert kpb == 1 or (self.num_kv_heads % kpb == 0 and self.head_tiles == 1), (
            kpb, self.num_kv_heads, self.head_tiles)
        rows_per_block = _policy.block_rows(rows_g, self.m_tiles, kpb, eight_rows)
        # The block shape depends on how long each block streams.
        self.config = _policy.split_kernel_config(self.dtype, self.head_dim, self.chunk_tokens,
                                                  self.m_tiles, rows_g, kpb, self.kv_dtype)
        kv_bytes = (2 * self.batch * self.span * self.num_kv_heads * self.head_dim
                    * (1 if self.kv_dtype else _policy.ITEMSIZE[self.dtype]))  # read at most
        if not _policy.l2_evict_first(self.dtype, kv_bytes):
            self.config = dataclasses.replace(self.config, l2_evict_first=False)
        if self.logits_soft_cap is not None:
            self.config = dataclasses.replace(self.config, soft_cap=True)
        if self.alibi:
            self.config = dataclasses.replace(self.config, alibi=True)
        if self.page_size is not None:
            self.config = dataclasses.replace(self.config, paged=True)
        if self.q_len > 1:
            self.config = _policy.multi_q_config(self.config)
        # per-token fp8 scales: the same kernel with KV_SCALE_TOKEN in its own shape, built at
        # the first run that passes such scales
        token = None if self.kv_dtype is None else _policy.fp8_token_config(self.config,
                                                                             self.chunk_tokens)
        self.config = V.check_tuning(tuning, self.config, smem_optin)  # (tuning's overrides)
        self.token_config = None if token is None else V.check_tuning(tuning, token, smem_optin)
        self.merge = _policy.merge_mode(self.num_splits, rows_per_block, self.head_dim,
                                        self.config.num_warps, merge, programmatic)
        rows = self.batch * self.q_len * self.num_heads
        self._merge_call = None        # prepared launch of merge_states.cu (merge == "kernel")
        self.o_part = self.lse_part = self._counters = None
        self._counters_wait = None      # event of the counters' zero fill, until the first run
        self._counters_refill = False   # built during a capture: fill again before the first run
        if self.num_splits > 1:
            self.o_part = cupy.empty((self.num_splits, rows, self.head_dim), cupy.float32)
            self.lse_part = cupy.empty((self.num_splits, rows), cupy.float32)
            if self.merge == "kernel":
                blocks, threads, warps_per_item = _policy.merge_launch(rows, self.head_dim,
                                                                       self.num_splits)
                self._merge_call = _kernels.StructLaunch(
                    _merge_function("float32", self.dtype, self.head_dim), (blocks, 1, 1),
                    (threads, 1, 1), 0, _MERGE_PARAMS, _MERGE_OFFSETS, programmatic=programmatic)
                self._merge_static = (self.num_splits, rows, self.head_dim, warps_per_item)
            else:
                # Arrival counters of the fused merge; the last arrival wraps its own back to 0,
                # so they must start at 0, and one that starts non-zero stays wrong for every
                # later launch. cupy.zeros fills on this stream: the first eager run (on any
                # stream) waits for that fill through an event — no host synchronisation. While
                # this stream is captured, the fill is a graph node instead (ahead of the plan's
                # kernel in the graph), so the first eager run fills again (_launch).
                self._counters = cupy.zeros(
                    self.batch * (self.num_kv_heads // kpb) * self.head_tiles, cupy.int32)
                stream = cupy.cuda.get_current_stream()
                if _is_capturing(stream):
                    self._counters_refill = True
                else:
                    self._counters_wait = cupy.cuda.Event(disable_timing=True)
                    self._counters_wait.record(stream)
        tokens = (self.q_len,) if self.q_len > 1 else ()  # one token: (batch, num_heads, …)
        self._out = cupy.empty((self.batch, *tokens, self.num_heads, self.head_dim), self.dtype)
        self._lse = cupy.empty((self.batch, *tokens, self.num_heads), cupy.float32)
        self._grid = ((self.num_kv_heads // kpb) * self.head_tiles, self.num_splits, self.batch)
        # Kernel scalars that never change for this plan, packed once.
        self._static = (self.max_seqlen, self.num_heads, self.group, self.head_tiles,
                        self.chunk_tokens, self.page_size or 0)
        self._window_arg = -1 if self.window_left is None else self.window_left
        # pages per sequence a block table must have for this plan's max_seqlen
        self._min_pages = 0 if self.page_size is None else -(-self.max_seqlen // self.page_size)
        self._in_step = int(_policy.warps_in_step(self.config, self.chunk_tokens, tuning))
        self._part_ptrs = ((0, 0) if self.o_part is None
                           else (self.o_part.data.ptr, self.lse_part.data.ptr))
        self._out_ptr, self._lse_ptr = self.out.data.ptr, self.lse.data.ptr
        # _launch's pointers after the inputs' when run is given none of its rare arguments
        self._own_outputs = (self._out_ptr, self._lse_ptr, 0, 0, 0, 0, 0)
        self._counter_ptr = 0 if self._counters is None else self._counters.data.ptr
        self._calls: dict = {}  # call_key of inputs that passed run's checks -> _prepare(...)
        self._get_stream = cupy.cuda.get_current_stream
        self._scale = V.check_scale(None, self.head_dim)
        self._score_default = self._score_values(self._scale)
        self._programmatic = programmatic
        # The split kernel's builds this plan has launched, by config (_split_launch): the one
        # for calls without runtime options now (with a window: the one with them); the other,
        # and an fp8 cache's per-token-scale build (KV_SCALE_TOKEN), at the first call to need it
        self._launches: dict = {}
        self._plain_launches: set = set()  # those of builds without the runtime options
        self._sources = _kernels._SOURCE_DIRS  # a later build from the sources of this one
        if self.batch:
            self._split_launch(self.config if self.window_left is not None else
                               dataclasses.replace(self.config, runtime_options=False))
        self._shape = dict(batch=self.batch, q_len=self.q_len, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           max_seqlen=self.max_seqlen)

    def _split_launch(self, config: _policy.SplitKernelConfig) -> _kernels.StructLaunch:
        """The prepared launch of the split kernel of ``config`` on this plan's grid (built at
        its first use, then kept)."""
        launch = self._launches.get(config)
        if launch is None:
            with _kernels.source_dirs(self._sources):
                fn = _split_function(config)
            launch = self._launches[config] = _kernels.StructLaunch(
                fn, self._grid, (config.threads, 1, 1), config.smem_bytes,
                _PARAMS_HEAD, programmatic=self._programmatic and self.enable_pdl,
                tail=_PARAMS_TAIL)
            if not config.runtime_options:
                self._plain_launches.add(launch)
        return launch

    def __repr__(self) -> str:
        cap = "" if self.logits_soft_cap is None else f", logits_soft_cap={self.logits_soft_cap:g}"
        cap += "" if self.kv_dtype is None else f", kv_dtype={self.kv_dtype!r}"
        cap += "" if self.page_size is None else f", page_size={self.page_size}"
        cap += "" if self.window_left is None else f", window_left={self.window_left}"
        cap += ", alibi=True" if self.alibi else ""
        cap += "" if self.q_len == 1 else f", q_len={self.q_len}"
        return (f"DecodePlan(batch={self.batch}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"max_seqlen={self.max_seqlen}, dtype={self.dtype}{cap}, "
                f"num_splits={self.num_splits}, chunk_tokens={self.chunk_tokens}, "
                f"m_tiles={self.m_tiles}, kv_per_block={self.kv_per_block})")

    def _score_values(self, scale: float) -> tuple:
        """The kernel's last parameters for softmax scale ``scale``, in the list's order:
        (scale_log2, warps_in_step, soft_cap_in, soft_cap_out)."""
        return (scale * _policy.LOG2E, self._in_step,
                *V.soft_cap_args(scale, self.logits_soft_cap))

    def _score_args(self, scale: float) -> tuple:
        """``_score_values(scale)``, the default scale's computed once."""
        return self._score_default if scale == self._scale else self._score_values(scale)

    @property
    def out(self) -> cupy.ndarray:
        """The plan's own output, (batch, [q_len,] num_heads, head_dim): where :meth:`run`
        writes when it is given no ``out`` (read-only: its pointer is remembered)."""
        return self._out

    @property
    def lse(self) -> cupy.ndarray:
        """The plan's own log-sum-exp, (batch, [q_len,] num_heads) float32: where :meth:`run`
        writes when it is given no ``lse`` (read-only, as ``out``)."""
        return self._lse

    @property
    def workspace_bytes(self) -> int:
        parts = (self.o_part, self.lse_part, self._counters)
        return sum(p.nbytes for p in parts if p is not None)

    def run(self, q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike,
            cache_seqlens: int | ArrayLike | None = None, out: ArrayLike | None = None,
            lse: ArrayLike | None = None, *, softmax_scale: float | None = None,
            block_table: ArrayLike | None = None, k_new: ArrayLike | None = None,
            v_new: ArrayLike | None = None, alibi_slopes: ArrayLike | None = None,
            sinks: ArrayLike | None = None, k_scale: float | ArrayLike | None = None,
            v_scale: float | ArrayLike | None = None,
            tokens_after: ArrayLike | None = None) -> tuple[cupy.ndarray, cupy.ndarray]:
        """Decode attention for this plan's shape; returns ``(out, lse)`` (the plan's own
        buffers unless ``out``/``lse`` are given). ``cache_seqlens``: None, an int or an int32 or
        int64 device array (a plan never copies from the host). A plan built with ``page_size`` takes
        paged caches (num_pages, page_size, num_kv_heads, head_dim) and their ``block_table``,
        an int32 device array (batch, ≥ ceil(max_seqlen / page_size)), whose values may change
        between graph replays. ``k_new``, ``v_new`` (batch, 1, num_kv_heads, head_dim) or
        (batch, num_kv_heads, head_dim) device arrays of the cache's dtype: each sequence's new
        token, written into the cache at position cache_seqlens[b] and attended with the rest
        (a device length leaves nothing written past max_seqlen; an int or None length without
        room for them is refused; the class docstring); their values, too, may change
        between replays. A plan built with ``alibi=True`` takes ``alibi_slopes``, a (num_heads,)
        float32 device array (values may change between replays). ``sinks``: a (num_heads,)
        float32 device array of sink logits (gpt-oss), any plan. A plan built with ``kv_dtype``
        takes caches of fp8 codes and their ``k_scale``, ``v_scale`` (each a float, a
        (num_kv_heads,) float32 device array, or one of the cache's leading shape +
        (num_kv_heads,): per token, the two together; :func:`flash_decode`). ``tokens_after``:
        a (batch,) int32 device array where the cache holds one shard of each sequence
        (sequence parallelism, :mod:`cupydecode.distributed`): sequence b has tokens_after[b]
        more tokens after this cache's last one, which the query tokens' positions count (the
        causal limit of several query tokens, the window, ALiBi's distances); the keys attended
        are this cache's. Not with ``k_new``/``v_new``.

        Raises:
            TypeError, ValueError: inputs that do not match the plan (shape, dtype, device) or
                are invalid, named in the message, before any launch.
        """
        args = (cache_seqlens, block_table, k_new, v_new)
        rare = (out, lse, softmax_scale, alibi_slopes, sinks, k_scale, v_scale, tokens_after)
        key, ptrs = V.call_key(q, k_cache, v_cache, args, rare)
        call = self._calls.get(key)  # (never stored under None: uncacheable inputs)
        checked = None  # (the checked arrays, held until launched: as in flash_decode)
        if call is None:  # inputs of a kind this plan has not seen pass: the full checks
            call, ptrs, extra, out, lse, checked = self._check_run(
                q, k_cache, v_cache, args, rare, None if key is None else key[:V.LAYOUT_PARTS])
            if key is not None:
                if len(self._calls) >= _CALLS_SIZE:
                    self._calls.clear()
                self._calls[key] = call
        else:
            if type(cache_seqlens) is int:  # (its value is not in the key)
                call = self._with_length(call, cache_seqlens,
                                         k_new is not None and v_new is not None,
                                         k_new is None and v_new is None and tokens_after is None)
            if len(ptrs) == _INPUT_PTRS:  # none of rare given (call_key leaves their pointers out)
                extra = self._own_outputs
            else:  # rare's pointers: out, lse, (the scale: none), slopes, sinks, k and v scales,
                # tokens_after
                extra = (self._out_ptr if out is None else ptrs[_INPUT_PTRS],
                         self._lse_ptr if lse is None else ptrs[_INPUT_PTRS + 1],
                         *ptrs[_INPUT_PTRS + 3:])
        self._launch(call, None, ptrs, *extra)
        del checked
        return (self.out if out is None else out), (self.lse if lse is None else lse)

    def _check_run(self, q, k_cache, v_cache, args: tuple, rare: tuple, layout) -> tuple:
        """run's checks of its inputs (every one, in order): ``(call, pointers, extra, out,
        lse, checked)``, the call :meth:`_prepare`'s and :meth:`_launch`'s pointers of the
        arrays as the kernel takes them (q, k, v, the device lengths, the block table, k_new,
        v_new; then ``extra``: out, lse, alibi slopes, sinks, k and v scales, tokens_after; 0
        for none), the
        checked out and lse (None: the plan's), and ``checked``, those arrays, for the caller to
        hold until they are launched; ``layout``: the inputs' ``_validate.layout_key`` where
        known."""
        cache_seqlens, block_table, k_new, v_new = args
        out, lse, softmax_scale, alibi_slopes, sinks, k_scale, v_scale, tokens_after = rare
        q, k_cache, v_cache, block_table, strides = self._check_layout(
            q, k_cache, v_cache, block_table, layout)
        # (a shard's query tokens are after it: tokens_after)
        V.check_lengths_fit(cache_seqlens, self.q_len, self.max_seqlen,
                            k_new is not None and v_new is not None,
                            k_new is None and v_new is None and tokens_after is None)
        # (inputs that passed are on the current device, which is then the plan's)
        seqlens, seqlen_all = V.check_seqlens(cache_seqlens, self.batch, self.max_seqlen,
                                              allow_host_array=False, device=self.device_id)
        scale = self._scale if softmax_scale is None else V.check_scale(softmax_scale,
                                                                        self.head_dim)
        out = None if out is None else V.check_out(out, "out", self.out.shape, self.dtype)
        lse = None if lse is None else V.check_out(lse, "lse", self.lse.shape, "float32")
        new = (None if k_new is None and v_new is None else V.check_new_tokens(
            k_new, v_new, self.batch, self.num_kv_heads, self.head_dim, self.dtype, self.q_len))
        slopes = (None if alibi_slopes is None and not self.alibi else V.check_alibi_slopes(
            alibi_slopes, self.alibi, self.num_heads, allow_host_array=False))
        if sinks is not None:
            sinks = V.check_head_values(sinks, "sinks", self.num_heads, allow_host_array=False)
        scales = V.check_attention_scales(self.kv_dtype, k_scale, v_scale, k_cache,
                                          self.num_kv_heads)
        if tokens_after is not None:
            tokens_after = V.check_tokens_after(tokens_after, self.batch, new is not None)
        call = self._prepare(strides, seqlens, seqlen_all, scale, block_table, new, scales,
                             sinks is not None, tokens_after is not None)
        (k_new, v_new), (k_sc, v_sc) = new[:2] if new else (None, None), _scale_arrays(scales)
        arrays = (q, k_cache, v_cache, seqlens, block_table, k_new, v_new, slopes, sinks, k_sc,
                  v_sc, tokens_after)
        return (call, _pointers(*arrays[:7]),
                (self._out_ptr if out is None else out.data.ptr,
                 self._lse_ptr if lse is None else lse.data.ptr, *_pointers(*arrays[7:])),
                out, lse, arrays)

    def _check_layout(self, q, k_cache, v_cache, block_table, layout=None):
        """The checks of q, k_cache, v_cache and block_table: (q, k, v, block_table, kernel
        strides); ``layout``: their ``_validate.layout_key`` where known."""
        paged = self.page_size is not None
        if (block_table is not None) != paged:
            expected = (f"a (batch, max_pages_per_seq) int32 device array (the plan has "
                        f"page_size={self.page_size})" if paged else
                        "None (the plan is for contiguous caches; DecodePlan(..., page_size=P) "
                        "takes paged ones)")
            V.fail(ValueError, "block_table", expected,
                   "None" if block_table is None else type(block_table).__name__)
        if layout is None:
            layout = V.layout_key(q, k_cache, v_cache)
        q, k, v, dt, shape = V.check_decode_inputs(q, k_cache, v_cache, layout, paged,
                                                   self.kv_dtype)
        if self.q_len == 1 and q.ndim == 4:  # (its out and lse are the 3-dimensional ones)
            V.fail(ValueError, "q", "(batch, num_heads, head_dim) for a plan of one query token "
                   "(DecodePlan(..., q_len=N) takes (batch, N, num_heads, head_dim))",
                   f"shape {tuple(q.shape)}")
        if q.data.device_id != self.device_id:
            V.fail(ValueError, "q/k_cache/v_cache", f"arrays on the plan's GPU {self.device_id}",
                   f"GPU {q.data.device_id}")
        bt_sb = num_pages = 0
        if paged:
            if shape["page_size"] != self.page_size:
                V.fail(ValueError, "k_cache", f"pages of the plan's page_size {self.page_size}",
                       f"shape {tuple(k.shape)}")
            shape, block_table, bt_sb, num_pages = V.check_paged_cache(
                shape, block_table, self._min_pages, allow_host_array=False)
            del shape["page_size"]
            shape["max_seqlen"] = self.max_seqlen  # (the table may hold more)
        if shape != self._shape or dt != self.dtype:
            V.fail(ValueError, "q/k_cache/v_cache",
                   f"the plan's shape {self._shape} and dtype {self.dtype}",
                   f"{shape} and dtype {dt}")
        return q, k, v, block_table, self._element_strides(q, k, v, bt_sb, num_pages)

    def _element_strides(self, q, k, v, bt_sb: int = 0, num_pages: int = 0) -> tuple:
        """The kernel's layout values: strides in elements (q's batch and head, K's and V's
        batch — the page, paged — token and head, out's batch and head, the block table's row,
        q's and out's token (0 for one token)) and the number of pages (0 unpaged), computed
        once per kind of inputs by the callers' caches: run's ``_calls``, flash_decode's ``_EAGER``.
        ``out`` is always C-contiguous (``check_out``), so its strides follow from the shape (a
        size-1 axis's stride, whatever the array reports, only ever multiplies index 0)."""
        es = q.itemsize
        q_sb, q_st, q_sh = ((q.strides[0], 0, q.strides[1]) if q.ndim == 3 else q.strides[:3])
        row = self.num_heads * self.head_dim
        return (q_sb // es, q_sh // es, *(x // k.itemsize for x in k.strides[:3]),
                *(x // v.itemsize for x in v.strides[:3]),
                self.q_len * row, self.head_dim, bt_sb, q_st // es,
                row if self.q_len > 1 else 0, num_pages)

    def _prepare(self, strides, seqlens, seqlen_all, scale, table=None, new=None,
                 scales=None, sinks: bool = False, tokens_after: bool = False) -> tuple:
        """A call of this plan with checked inputs of one kind, less its pointers: ``(launch,
        tail)``, the prepared split kernel and the values of its parameters after the pointers.
        ``strides``: :meth:`_element_strides`; ``seqlens``: the device lengths or None, with
        ``seqlen_all`` (``_validate.check_seqlens``); ``scale``: the softmax scale; ``table``:
        a paged plan's block table; ``new``: ``_validate.check_new_tokens(...)`` (k_new, v_new,
        their strides in elements); ``scales``: an fp8 plan's
        ``_validate.check_attention_scales(...)``; ``sinks``, ``tokens_after``: whether the
        call passes them (their pointers come at the launch)."""
        if self.batch == 0:  # (nothing is launched)
            return None, ()
        new_strides, n_new = _NO_NEW if new is None else new[2], 0 if new is None else self.q_len
        config = self.config
        k_all = v_all = 1.0
        if scales is not None:
            per_token, (_, k_all), (_, v_all) = scales
            if per_token:
                config = self.token_config
        lengths_64 = seqlens is not None and seqlens.itemsize == 8
        if not _policy.runtime_options(new is not None, self.window_left is not None, sinks,
                                       tokens_after, lengths_64):
            config = dataclasses.replace(config, runtime_options=False)
        launch = self._split_launch(config)
        tail = (*strides[:11], *new_strides, *strides[11:], seqlen_all, *self._static,
                *self._score_args(scale), n_new, self._window_arg,
                int(lengths_64),
                0 if table is None else table.itemsize >> 3, self.q_len, k_all, v_all)
        return launch, tail

    def _with_length(self, call, length: int, appending: bool, in_cache: bool) -> tuple:
        """``call`` (:meth:`_prepare`'s) for an int ``cache_seqlens`` of ``length``, checked
        as the full checks do (``appending``: k_new and v_new given, whose tokens must fit in the
        cache; ``in_cache``: neither nor tokens_after, so several query tokens must be in the
        cache already): itself where the length is the one it was prepared with, else a copy
        with that length."""
        room = self.max_seqlen - (self.q_len if appending else 0)
        if self.q_len > 1 or not 0 <= length <= room:  # (the checks' refusals)
            V.check_lengths_fit(length, self.q_len, self.max_seqlen, appending, in_cache)
            length = V.check_seqlens(length, self.batch, self.max_seqlen)[1]
        launch, tail = call
        if not tail or tail[_SEQLEN_ALL] == length:
            return call
        return launch, (*tail[:_SEQLEN_ALL], length, *tail[_SEQLEN_ALL + 1:])

    def _launch(self, call, stream, ptrs, out: int, lse: int, slopes: int, sinks: int,
                k_scale: int, v_scale: int, tokens_after: int = 0) -> None:
        """Everything after the checks: the split kernel (which appends k_new/v_new's tokens),
        then (if split) the merge kernel, on ``stream`` (None: the current stream). ``call``:
        :meth:`_prepare`'s for inputs of this kind; ``ptrs``: the device pointers of q, k, v,
        the lengths, the block table, k_new and v_new (its first 7 items, as
        ``_validate.call_key`` gives them); the rest: the pointers of out, lse, the ALiBi slopes,
        the sinks, the k and v scales and tokens_after. A pointer of 0: none (``lse``: not
        written)."""
        if self.batch == 0:
            return
        if stream is None:
            stream = self._get_stream()
        if (self._counters_wait is not None or self._counters_refill) and not _is_capturing(stream):
            if self._counters_refill:
                self._counters.fill(0)
            else:
                stream.wait_event(self._counters_wait)
            self._counters_wait, self._counters_refill = None, False
        # Raw pointers in the struct are as safe as array arguments: the arrays are alive during
        # this call, and CuPy's pool hands freed memory out again only in stream order.
        part_o, part_lse = self._part_ptrs
        launch, tail = call
        if (sinks or tokens_after) and launch in self._plain_launches:
            # the build without runtime options would ignore them (n_new, the window and int64
            # lengths are in the tail that _prepare chose the build with)
            raise RuntimeError("DecodePlan: sinks or tokens_after passed to the split kernel's "
                               "build without runtime options (a cupydecode bug)")
        launch.launch_with_tail(
            stream.ptr, (ptrs[0], ptrs[1], ptrs[2], ptrs[3], part_o, part_lse, out, lse,
                         self._counter_ptr, ptrs[4], ptrs[5], ptrs[6], slopes, sinks, k_scale,
                         v_scale, tokens_after), call, tail)
        if self._merge_call is not None:
            self._merge_call(stream.ptr, part_o, part_lse, out, lse, *self._merge_static, sinks,
                             self.num_heads)


def _pointers(*arrays) -> list:
    """The device pointer of each of ``arrays`` (CuPy arrays or None: 0)."""
    return [0 if a is None else a.data.ptr for a in arrays]


def _scale_arrays(scales) -> tuple:
    """The device arrays (or None) of ``_validate.check_attention_scales(...)``'s k and v scales
    (None without an fp8 cache)."""
    return (None, None) if scales is None else (scales[1][0], scales[2][0])


_CALLS_SIZE = 64  # kinds of inputs a plan remembers (DecodePlan._calls)
_INPUT_PTRS = 7  # call_key's pointers of q, k_cache, v_cache and the four args, always there


# struct cd_decode_params of the split kernel, packed from its declaration in
# kernels/decode_params.cuh (one list for both sides), and the order in which DecodePlan._launch
# passes the values, checked against that list here.
_PARAM_CODES = {"PTR": "Q", "I64": "q", "I32": "i", "F32": "f"}
_PARAM_FILE, _PARAM_MACRO = "decode_params.cuh", "CD_DECODE_PARAMS"
try:
    _PARAM_LIST = _kernels.param_list(_PARAM_FILE, _PARAM_MACRO)
except FileNotFoundError:  # kernel sources missing (a broken install): building a plan says so
    _PARAM_LIST = ()
_PARAMS = struct.Struct("<" + "".join(_PARAM_CODES[kind] for kind, _ in _PARAM_LIST))
# The same list in two parts for StructLaunch.launch_with_tail: the pointers (every call's), then
# the strides and scalars (packed again only when they change)
_NUM_PTRS = next((i for i, (kind, _) in enumerate(_PARAM_LIST) if kind != "PTR"), len(_PARAM_LIST))
_PARAMS_HEAD = struct.Struct("<" + "Q" * _NUM_PTRS)
_PARAMS_TAIL = struct.Struct("<" + _PARAMS.format.lstrip("<")[_NUM_PTRS:])
_LAUNCH_ORDER = ("q", "k", "v", "seqlens", "o_part", "lse_part", "out", "lse_out", "counters",
                 "block_table", "k_new", "v_new", "alibi_slopes", "sinks", "k_scale", "v_scale",
                 "tokens_after", "q_sb", "q_sh", "k_sb", "k_ss", "k_sh", "v_sb",
                 "v_ss", "v_sh", "out_sb", "out_sh", "bt_sb", "kn_sb", "kn_ss", "kn_sh", "vn_sb",
                 "vn_ss", "vn_sh", "q_st", "out_st", "num_pages", "seqlen_all", "max_seqlen",
                 "num_heads", "group", "head_tiles", "chunk_tokens", "page_size", "scale_log2",
                 "warps_in_step", "soft_cap_in", "soft_cap_out", "n_new",
                 "window_left", "seqlens_64", "table_64", "q_len", "k_scale_all", "v_scale_all")
if _PARAM_LIST and tuple(name for _, name in _PARAM_LIST) != _LAUNCH_ORDER:
    raise ImportError("kernels/decode_params.cuh and DecodePlan._launch disagree on the split "
                      f"kernel's parameters: {[n for _, n in _PARAM_LIST]} vs {list(_LAUNCH_ORDER)}")

_NO_NEW = (0,) * 6  # k_new's and v_new's strides without new tokens
_SEQLEN_ALL = _LAUNCH_ORDER.index("seqlen_all") - _NUM_PTRS  # its place in a prepared tail

# Parameters of cd_merge_states in kernels/merge_states.cu, packed for a plan's prepared launch:
# o_parts, lse_parts, out, lse_out (pointers), num_states (int32), rows (int64), head_dim and
# warps_per_item (int32), sinks (pointer), num_sinks (int32); kernel parameter i starts at byte
# _MERGE_OFFSETS[i].
_MERGE_PARAMS = struct.Struct("<4Qi4xqiiQi")
_MERGE_OFFSETS = (0, 8, 16, 24, 32, 40, 48, 52, 56, 64)


_FLOAT32 = np.dtype(np.float32)
_PLAN_CACHE: OrderedDict = OrderedDict()
_PLAN_CACHE_SIZE = 16
_PLAN_LOCK = threading.Lock()
_PER_THREAD_STREAM = 2  # cudaStreamPerThread
_THREAD = threading.local()


def _thread_token() -> object:
    """An object unique to the calling thread; a cache key holding it keeps it alive, so unlike
    a thread ident it is never handed to a later thread."""
    token = getattr(_THREAD, "token", None)
    if token is None:
        token = _THREAD.token = object()
    return token


def _cached_plan(shape: dict, dtype: str, num_splits, split_size, soft_cap, window,
                 alibi: bool, device: int, stream: int, kv_dtype=None) -> DecodePlan:
    """Plans (and their workspaces) reused across eager calls of the same shape on one stream
    (``device``: the current device, ``stream``: the current stream's handle)."""
    # The per-thread default stream has the same handle in every thread but is a different
    # stream in each: those plans (workspaces) must not be shared across threads.
    owner = _thread_token() if stream == _PER_THREAD_STREAM else None
    key = (tuple(shape.values()), dtype, num_splits, split_size, soft_cap, window, alibi, device,
           stream, owner, kv_dtype)
    with _PLAN_LOCK:  # threads may share the cache (not a plan: see the key)
        plan = _PLAN_CACHE.get(key)
        if plan is None:
            plan = DecodePlan(shape["batch"], shape["num_heads"], shape["num_kv_heads"],
                              shape["head_dim"], shape["max_seqlen"], dtype,
                              num_splits=num_splits, split_size=split_size,
                              logits_soft_cap=soft_cap, page_size=shape.get("page_size"),
                              window_left=window, alibi=alibi, q_len=shape["q_len"],
                              kv_dtype=kv_dtype)
            _PLAN_CACHE[key] = plan
            if len(_PLAN_CACHE) > _PLAN_CACHE_SIZE:
                _PLAN_CACHE.popitem(last=False)
        else:
            _PLAN_CACHE.move_to_end(key)
    return plan


# flash_decode's lookups folded into one per call: (the inputs' _validate.call_key, stream,
# return_lse, per-thread owner) → _check_flash_decode's entry (plan, prepared call, out's shape
# and dtype). An entry exists only for inputs that passed every check.
_EAGER: dict = {}
_EAGER_SIZE = 16


def flash_decode(q: ArrayLike, k_cache: ArrayLike, v_cache: ArrayLike,
                 cache_seqlens: int | Sequence[int] | ArrayLike | None = None, *,
                 softmax_scale: float | None = None, logits_soft_cap: float | None = None,
                 num_splits: int | None = None, return_lse: bool = False,
                 out: ArrayLike | None = None, split_size: int | None = None,
                 block_table: ArrayLike | None = None, k_new: ArrayLike | None = None,
                 v_new: ArrayLike | None = None, window_left: int | None = None,
                 alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
                 kv_dtype: str | None = None, k_scale: float | ArrayLike | None = None,
                 v_scale: float | ArrayLike | None = None
                 ) -> cupy.ndarray | tuple[cupy.ndarray, cupy.ndarray]:
    """Decode attention of one query token per sequence (or several: draft tokens to verify)
    against its KV cache.

    Args:
        q: (batch, num_heads, head_dim) float16, bfloat16 or float32 GPU array, or
            (batch, q_len, num_heads, head_dim) for q_len query tokens per sequence (up to 64;
            speculative decoding, MTP): token t of a sequence of L tokens sits at position
            L − q_len + t and attends the keys up to it (causal, aligned to the end); those q_len
            tokens' K and V are in the cache already (cache_seqlens counts them), or k_new/v_new
            of q_len tokens (q_len ≤ 16) append them in the call. out and
            lse then have the q_len axis too.
        k_cache, v_cache: (batch, max_seqlen, num_kv_heads, head_dim), same dtype; last dim
            contiguous, other strides honoured. num_heads must be a multiple of num_kv_heads.
            With ``block_table``: paged, (num_pages, page_size, num_kv_heads, head_dim).
        cache_seqlens: None (all max_seqlen), an int, a host sequence of ``batch`` ints, or a
            (batch,) int32 or int64 device array (never read on the host; clamped to
            [0, max_seqlen]).
        softmax_scale: default 1/sqrt(head_dim).
        logits_soft_cap: c > 0 caps every score s = softmax_scale · q·k as c·tanh(s/c) before
            the softmax (Gemma-2: 50.0); None or 0: no cap.
        num_splits: force the number of KV splits (≥ 1); default chosen from shape and SM count.
        return_lse: also return the log-sum-exp (batch, [q_len,] num_heads) float32, natural log.
        out: optional preallocated output of q's shape and dtype.
        split_size: fix the tokens per split instead of num_splits (batch-independent results).
        block_table: (batch, max_pages_per_seq) int32 page indices of a paged cache: token t of
            sequence b is row t % page_size of page block_table[b, t // page_size]; any
            page_size ≥ 1, pages in any order. A device table is never read on the host (an
            index outside [0, num_pages) reads nothing, its tokens count for nothing); a host
            table is range-checked and copied. max_seqlen is max_pages_per_seq × page_size.
        k_new, v_new: (batch, 1, num_kv_heads, head_dim) or (batch, num_kv_heads, head_dim) GPU
            arrays of the cache's dtype (last dim contiguous, 16-byte aligned), both or neither:
            each sequence's new token, written into the cache at position cache_seqlens[b]
            (through block_table when paged) before the attention, which then runs over
            cache_seqlens[b] + 1 tokens. Host-given lengths must leave room for the new tokens
            (ValueError; cache_seqlens=None, every sequence full, leaves none); device lengths
            are never read: a position at or past max_seqlen is then not written and the length
            stays max_seqlen. A page index outside [0, num_pages) is not written. The caller
            advances cache_seqlens. With q of q_len tokens: (batch, q_len, num_kv_heads, head_dim), the
            q_len tokens written at cache_seqlens[b] … + q_len − 1 (q_len ≤ 16).
        window_left: W ≥ 0 attends only the keys at positions ≥ p − W, where p is the query's
            position (L − 1 for one query token of a sequence of L tokens; L − q_len + t for
            token t of q_len): W + 1 keys, a sliding window (e.g. Mistral's 4096); the splits
            cover only those, so a window over a long cache costs about what a cache of W + 1
            tokens does. None or −1: no window.
        alibi_slopes: (num_heads,) float32, one slope per query head (a device array, or host
            values copied per call): each score gains −slope_h · (p − j) for key j and the
            query's position p (above), after the soft-cap (ALiBi: BLOOM, MPT).
        sinks: (num_heads,) float32 sink logits σ_h (gpt-oss; a device array, or host values
            copied per call): the softmax denominator gains e^σ_h with no value, out =
            Σ e^s v / (e^σ + Σ e^s) and lse = ln(e^σ + Σ e^s); an empty sequence gives out = 0,
            lse = σ_h.
        kv_dtype: "e4m3" or "e5m2": the caches hold fp8 codes (uint8, or that format's
            ml_dtypes float8 type), key j = code · k_scale, value = code · v_scale; q and out
            float16 or bfloat16, head_dim a multiple of 16. Every option above works with it;
            k_new/v_new (q's dtype) are quantised into the cache with the scales (per-token
            scales: computed for the new tokens, amax / the format's largest value, and written
            into k_scale/v_scale at their positions).
        k_scale, v_scale: with kv_dtype, each a float > 0 (per tensor), a (num_kv_heads,)
            float32 device array (per KV head), or a float32 device array of the cache's first
            two axes + (num_kv_heads,) — (batch, max_seqlen, num_kv_heads), paged (num_pages,
            page_size, num_kv_heads) — per token and KV head (both per token, or neither).
            :func:`cupydecode.quantize_kv` makes a cache and its scales.

    Returns:
        out, or (out, lse) with ``return_lse=True``. A sequence of length 0 gives out = 0 and
        lse = −inf.

    Raises:
        TypeError: an argument of the wrong type or dtype (host arrays included: inputs must be
            on the GPU), named in the message with what was expected.
        ValueError: shapes, strides, lengths or options out of range, named likewise. Every
            check runs before any launch.
        ImportError: CuPy is not installed (the message gives the install command).
    """
    cupy = _kernels.import_cupy()
    if return_lse is not False and return_lse is not True:  # (two identity tests a call)
        return_lse = V.check_flag(return_lse, "return_lse")

    args = (cache_seqlens, block_table, k_new, v_new)
    rare = (out, softmax_scale, logits_soft_cap, num_splits, split_size, window_left,
            alibi_slopes, sinks, kv_dtype, k_scale, v_scale)
    # (no CUDA call before a host array is refused)
    key, ptrs = V.call_key(q, k_cache, v_cache, args, rare)
    hit = stream = None
    if key is not None:
        stream = cupy.cuda.get_current_stream()
        ptr = stream.ptr
        key = (key, ptr, bool(return_lse), _thread_token() if ptr == _PER_THREAD_STREAM else None)
        hit = _EAGER.get(key)
    # the checked arrays, held until their pointers are launched: among them the device copies
    # of host values, whose memory must not go back to the pool before
    checked = None
    if hit is None:  # inputs of a kind not seen to pass: the full checks
        hit, stream, ptrs, extra, out, checked = _check_flash_decode(
            q, k_cache, v_cache, args, rare, None if key is None else key[0][:V.LAYOUT_PARTS],
            stream)
        if key is not None:
            if len(_EAGER) >= _EAGER_SIZE:
                _EAGER.clear()
            _EAGER[key] = hit
    else:  # rare's pointers (call_key: all 0 where none of rare is given): slopes, sinks, scales
        extra = _NO_EXTRA if len(ptrs) == _INPUT_PTRS else _FLASH_EXTRA(ptrs)
    plan, call, out_shape, out_dtype = hit
    if checked is None and type(cache_seqlens) is int:  # remembered: its value is not in the key
        call = plan._with_length(call, cache_seqlens, k_new is not None and v_new is not None,
                                 k_new is None and v_new is None)
    # out and lse follow q: (batch, [q_len,] num_heads, head_dim), (batch, [q_len,] num_heads)
    out = cupy.empty(out_shape, out_dtype) if out is None else out
    lse = cupy.empty(out_shape[:-1], _FLOAT32) if return_lse else None
    plan._launch(call, stream, ptrs, out.data.ptr, 0 if lse is None else lse.data.ptr, *extra)
    del checked  # (launched: CuPy's pool reuses its memory only in stream order)
    return (out, lse) if return_lse else out


_NO_EXTRA = (0, 0, 0, 0)  # flash_decode's slopes, sinks and scales when none is given
# their places among call_key's pointers: after the inputs', in flash_decode's rare order (out,
# softmax_scale, logits_soft_cap, num_splits, split_size, window_left, alibi_slopes, sinks,
# kv_dtype, k_scale, v_scale)
_FLASH_EXTRA = operator.itemgetter(*(_INPUT_PTRS + i for i in (6, 7, 9, 10)))


def _check_flash_decode(q, k_cache, v_cache, args: tuple, rare: tuple, layout, stream) -> tuple:
    """flash_decode's checks of its inputs (every one, in order, before any CUDA call) and its
    plan: ``(entry, stream, pointers, extra, out, checked)``, the entry ``(plan, call, out's
    shape, out's dtype)`` (``call``: the plan's :meth:`DecodePlan._prepare`), the current stream
    (``stream`` where given), the pointers of the arrays as the kernel takes them (q, k, v, the
    device lengths, the block table, k_new, v_new; ``extra``: the ALiBi slopes, the sinks, the
    k and v scales; 0 for none: :meth:`DecodePlan._launch`), the checked ``out`` (or None) and
    ``checked``, those arrays, which the caller holds until it has launched their pointers (the
    device copies of host lengths, tables, slopes and sinks live only there); ``layout``: the
    inputs' ``_validate.layout_key`` where known."""
    cache_seqlens, block_table, k_new, v_new = args
    (out, softmax_scale, logits_soft_cap, num_splits, split_size, window_left, alibi_slopes,
     sinks, kv_dtype, k_scale, v_scale) = rare
    kv = None if kv_dtype is None else V.check_kv_dtype(kv_dtype)
    soft_cap = V.check_soft_cap(logits_soft_cap)
    window = V.check_window(window_left)
    alibi = alibi_slopes is not None
    if layout is None:
        layout = V.layout_key(q, k_cache, v_cache)
    q, k, v, dt, shape = V.check_decode_inputs(q, k_cache, v_cache, layout,
                                               block_table is not None, kv)
    table, bt_sb, num_pages = block_table, 0, 0
    if block_table is not None:
        shape, table, bt_sb, num_pages = V.check_paged_cache(shape, block_table)
    q_len = shape["q_len"]
    V.check_lengths_fit(cache_seqlens, q_len, shape["max_seqlen"],
                        k_new is not None and v_new is not None, k_new is None and v_new is None)
    seqlens, seqlen_all = V.check_seqlens(cache_seqlens, shape["batch"], shape["max_seqlen"],
                                          device=q.data.device_id)
    scale = V.check_scale(softmax_scale, shape["head_dim"])
    num_splits, split_size = V.check_splits(num_splits, split_size)
    new = (None if k_new is None and v_new is None else V.check_new_tokens(
        k_new, v_new, shape["batch"], shape["num_kv_heads"], shape["head_dim"], dt, q_len))
    slopes = None if not alibi else V.check_alibi_slopes(alibi_slopes, alibi, shape["num_heads"])
    if sinks is not None:
        sinks = V.check_head_values(sinks, "sinks", shape["num_heads"])
    scales = V.check_attention_scales(kv, k_scale, v_scale, k, shape["num_kv_heads"])
    out_shape = tuple(q.shape)
    out = None if out is None else V.check_out(out, "out", out_shape, dt)
    if stream is None:
        import cupy

        stream = cupy.cuda.get_current_stream()
    # validation put q on the current device: its id, without asking the runtime again
    plan = _cached_plan(shape, dt, num_splits, split_size, soft_cap, window, alibi,
                        q.data.device_id, stream.ptr, kv)
    call = plan._prepare(plan._element_strides(q, k, v, bt_sb, num_pages), seqlens, seqlen_all,
                         scale, table, new, scales, sinks is not None)
    (k_new, v_new), (k_sc, v_sc) = new[:2] if new else (None, None), _scale_arrays(scales)
    # (dtype objects, not names, for the outputs: CuPy parses a name on every call)
    entry = (plan, call, out_shape, q.dtype)
    arrays = (q, k, v, seqlens, table, k_new, v_new, slopes, sinks, k_sc, v_sc)
    return (entry, stream, _pointers(*arrays[:7]), _pointers(*arrays[7:]), out, arrays)


def merge_states(o_parts: ArrayLike, lse_parts: ArrayLike, *,
                 sinks: ArrayLike | None = None) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Merge partial attention states through their log-sum-exp.

    Args:
        o_parts: (num_states, *rows, head_dim) float16/bfloat16/float32: locally normalised outputs.
        lse_parts: (num_states, *rows) float32: their log-sum-exp (natural log; −inf = empty,
            and +inf too: the value some libraries give an empty row).
        sinks: optional float32 sink logits σ (gpt-oss), broadcast against the rows from the
            right (e.g. (num_heads,) for rows (batch, num_heads); a device array, or host values
            copied): applied once to each merged row, LSE ← ln(e^LSE + e^σ), O ← O·e^(LSE_old −
            LSE_new); an empty row gives O = 0, LSE = σ. Pass the sinks here, not to the calls
            that made the partial states.

    Returns:
        (o, lse): o of shape (*rows, head_dim) in o_parts' dtype, lse (*rows) float32.
        Rows whose states are all empty give o = 0, lse = −inf (never NaN). A NaN LSE, or a NaN
        in a live state's output, makes that row NaN and no other.

    Raises:
        TypeError, ValueError: inputs of the wrong type, dtype or shape, named in the message,
            before any launch.
        ImportError: CuPy is not installed (the message gives the install command).
    """
    cupy = _kernels.import_cupy()

    o, lse_in, dt = V.check_merge_inputs(o_parts, lse_parts)
    rows_shape = tuple(o.shape[1:-1])
    sink_arr = V.check_merge_sinks(sinks, rows_shape)  # (every check before the copies below)
    o = cupy.ascontiguousarray(o)
    if o.data.ptr % 16:  # each lane reads its elements of a state as one vector (≤ 16 bytes)
        o = o.copy()
    lse_in = cupy.ascontiguousarray(lse_in)
    num_states, head_dim = o.shape[0], o.shape[-1]
    rows = int(np.prod(rows_shape, dtype=np.int64))
    out = cupy.empty(rows_shape + (head_dim,), dt)
    lse = cupy.empty(rows_shape, cupy.float32)
    if rows:
        blocks, threads, warps_per_item = _policy.merge_launch(rows, head_dim, num_states)
        _kernels.launch(_merge_function(dt, dt, head_dim), (blocks, 1, 1), (threads, 1, 1),
                        (o, lse_in, out, lse, np.int32(num_states), np.int64(rows),
                         np.int32(head_dim), np.int32(warps_per_item),
                         np.uint64(0) if sink_arr is None else sink_arr,
                         np.int32(1 if sink_arr is None else sink_arr.size)))
    return out, lse
