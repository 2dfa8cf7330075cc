"""Sequence-parallel decode over several GPUs: each rank holds a shard of every sequence's cache.

A long context outgrows one GPU. Split each sequence's tokens across N ranks (contiguous ranges
or pages, any sizes, a rank may hold none of a sequence): each rank attends its own keys and
returns its partial state (Õ_r, LSE_r), and the merge through the LSEs is exact — the split
kernel's own algorithm one level up (docs/DESIGN.md). One collective per step moves
B · H · (D · itemsize + 4) bytes per rank, whatever the context length.

    group = ThreadGroup(2)                      # or NcclCommunicator per process (below)
    plan = ShardedDecodePlan(group.communicator(rank), batch, num_heads, num_kv_heads,
                             head_dim, shard_capacity, "float16", alibi=True)
    out, lse = plan.run(q, k_shard, v_shard, shard_lengths, tokens_after,
                        alibi_slopes=slopes, sinks=sinks)

Every rank passes the same q (the step's query tokens) and its own shard; ``tokens_after[b]``
is how many of sequence b's tokens come after this rank's last one (0 on the rank holding the
sequence's end). ALiBi counts distances from the sequence's last token: a shard's scores are
the local ones shifted by a constant per row, applied to its LSE (reference.shard_lse). Sinks
join once, in the merge. Supported: one query token per sequence; softmax_scale, the soft-cap,
ALiBi, sinks, paged shards, every dtype and head_dim of :class:`DecodePlan`. Sliding windows
and several query tokens would need each shard's global positions inside the kernel: refused
by name.

Failure: a rank whose inputs fail their checks still takes part in the step's collective, with
a status word saying so, and then every rank raises (the failing one its own error, the others
a RuntimeError naming it) — no rank merges a partial result. A rank that never arrives (dead or
hung) makes the others raise after ``timeout`` seconds (NCCL: the communicator is aborted).

Communicators: :class:`ThreadGroup` (ranks as threads of one process on one GPU: tests, and
use without NCCL), :class:`NcclCommunicator` (one process per GPU, NCCL
through CuPy, e.g. started by :func:`spawn` or mpirun). Anything with ``rank``, ``size`` and
``all_gather(send) -> (size, n)`` works. NCCL is optional: nothing here is imported by
``import cupydecode``.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from . import _kernels
from . import _validate as V
from . import reference as R
from ._policy import DTYPE_IDS

# Each rank's piece of the collective: a status word (int32: 0 ok, 1 its inputs failed; then the
# rank's id), padded to 16 bytes, the LSEs (float32, rows padded to 16 bytes), the outputs
STATUS_BYTES = 16
OK, FAILED = 0, 1


class ThreadGroup:
    """``size`` ranks as threads of one process, on the current GPU: ``communicator(rank)``
    gives each thread its communicator (tests, and shards of one GPU's memory). A collective
    waits at most ``timeout`` seconds for the other ranks."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.size = V.check_int(size, "size", 1)
        self.timeout = float(timeout)
        self._barrier = threading.Barrier(self.size)
        self._slots: list = [None] * self.size

    def communicator(self, rank: int) -> _ThreadCommunicator:
        return _ThreadCommunicator(self, V.check_int(rank, "rank", 0, self.size - 1))


class _ThreadCommunicator:
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def _meet(self, what: str) -> None:
        try:
            self.group._barrier.wait(self.group.timeout)
        except threading.BrokenBarrierError:
            raise RuntimeError(f"rank {self.rank}: a rank did not reach the {what} within "
                               f"{self.group.timeout} s (it failed or hangs); step abandoned") from None

    def all_gather(self, send):
        """(size, n): every rank's ``send`` (1-D, the same n everywhere), in rank order."""
        xp = _array_module(send)
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()  # this rank's piece is written
        self.group._slots[self.rank] = send
        self._meet("collective")
        recv = xp.stack([xp.asarray(x) for x in self.group._slots])
        if xp is not np:
            xp.cuda.get_current_stream().synchronize()
        self._meet("end of the collective")  # every rank has copied: the slots may be reused
        return recv

    def abort(self) -> None:
        self.group._barrier.abort()


class NcclCommunicator:
    """One rank of an NCCL communicator of ``size`` ranks (one process per GPU; ``unique_id``
    from :func:`nccl_unique_id` on one process, shared with the others). Collectives run on the
    current CuPy stream; a collective that has not finished after ``timeout`` seconds aborts
    the communicator and raises TimeoutError."""

    def __init__(self, size: int, unique_id, rank: int, timeout: float = 60.0):
        from cupy.cuda import nccl

        self.size = V.check_int(size, "size", 1)
        self.rank = V.check_int(rank, "rank", 0, self.size - 1)
        self.timeout = float(timeout)
        self._nccl = nccl
        self._comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)

    def all_gather(self, send):
        cupy = _kernels.import_cupy()
        recv = cupy.empty((self.size, send.size), cupy.uint8)
        stream = cupy.cuda.get_current_stream()
        self._comm.allGather(send.data.ptr, recv.data.ptr, send.size, self._nccl.NCCL_UINT8,
                             stream.ptr)
        done = stream.record()
        deadline = time.monotonic() + self.timeout
        while not done.done:
            self._comm.check_async_error()
            if time.monotonic() > deadline:
                self._comm.abort()
                raise TimeoutError(f"rank {self.rank}: the collective did not finish within "
                                   f"{self.timeout} s (a rank failed or hangs); communicator aborted")
            time.sleep(2e-5)
        return recv

    def abort(self) -> None:
        self._comm.abort()


def nccl_unique_id():
    """A new NCCL unique id: make it on one process, give it to every rank's NcclCommunicator."""
    from cupy.cuda import nccl

    return nccl.get_unique_id()


def _spawned(fn, size, uid, rank, timeout, args, results):
    import cupy

    try:
        cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        comm = NcclCommunicator(size, uid, rank, timeout)
        results.put((rank, True, fn(comm, *args)))
    except BaseException as exc:  # reported to the parent, which raises
        results.put((rank, False, f"{type(exc).__name__}: {exc}"))


def spawn(fn, size: int, *args, timeout: float = 300.0) -> list:
    """Run ``fn(comm, *args)`` in ``size`` new processes, one per GPU (rank r on GPU r), each
    with its NcclCommunicator; returns their results in rank order. Raises RuntimeError naming
    every rank that failed, or that did not finish within ``timeout`` seconds (those are
    terminated). ``fn`` and its results must be picklable (e.g. host arrays)."""
    import multiprocessing as mp

    size = V.check_int(size, "size", 1)
    ctx = mp.get_context("spawn")
    uid = nccl_unique_id()
    results = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(fn, size, uid, r, timeout, args, results))
             for r in range(size)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout
    while len(got) < size and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except Exception:  # queue.Empty: keep waiting until the deadline
            continue
        got[rank] = (ok, value)
    for p in procs:
        p.join(timeout=1.0)
        if p.is_alive():
            p.terminate()
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    missing = [r for r in range(size) if r not in got]
    if failed or missing:
        raise RuntimeError("spawn: " + "; ".join(
            [f"rank {r} failed: {v}" for r, v in sorted(failed.items())]
            + [f"rank {r} did not finish within {timeout} s" for r in missing]))
    return [got[r][1] for r in range(size)]


def _array_module(x):
    return np if isinstance(x, np.ndarray) else _kernels.import_cupy()


class ShardedDecodePlan:
    """A :class:`DecodePlan` for this rank's shard (its capacity ``max_seqlen``: the most
    tokens of one sequence this rank holds) and the step's merge across ranks: ``run`` returns
    the attention over every rank's keys, on every rank (``root`` None) or on ``root`` only
    (the others get None). Every rank must build the plan with the same arguments but
    ``max_seqlen`` (checked once, collectively: a mismatch raises on every rank). ``num_splits``,
    ``split_size``, ``merge``, ``page_size``, ``logits_soft_cap``, ``alibi``, ``tuning`` go to
    the rank's DecodePlan."""

    def __init__(self, comm, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_seqlen: int, dtype="float16", *, root: int | None = None,
                 window_left: int | None = None, q_len: int = 1, **plan_options):
        from .decode import DecodePlan

        cupy = _kernels.import_cupy()
        self.comm = comm
        if root is not None:
            V.check_int(root, "root", 0, comm.size - 1)
        if window_left is not None and window_left != -1:
            V.fail(ValueError, "window_left", "None across shards (a window needs each shard's "
                   "global positions in the kernel; not supported yet)", window_left)
        if q_len != 1:
            V.fail(ValueError, "q_len", "1 across shards (several query tokens need each shard's "
                   "global positions in the kernel; not supported yet)", q_len)
        self.root = root
        self.plan = DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, dtype,
                               **plan_options)
        self.rows = self.plan.batch * self.plan.num_heads
        self.dtype = self.plan.out.dtype
        self._lse_off = STATUS_BYTES
        self._out_off = STATUS_BYTES + -(-4 * self.rows // 16) * 16
        self.nbytes = self._out_off + self.rows * self.plan.head_dim * self.dtype.itemsize
        # every rank's plan alike (all but its capacity): one collective now, none per step
        sig = np.asarray([batch, num_heads, num_kv_heads, head_dim, DTYPE_IDS[self.plan.dtype],
                          -1 if root is None else root, int(bool(plan_options.get("alibi"))),
                          0 if plan_options.get("logits_soft_cap") is None else 1], np.int64)
        got = _host(comm.all_gather(cupy.asarray(sig.view(np.uint8))))
        sigs = got.view(np.int64).reshape(comm.size, -1)
        differ = [r for r in range(comm.size) if not np.array_equal(sigs[r], sig)]
        if differ:
            raise ValueError(f"ShardedDecodePlan: rank {comm.rank}'s plan (batch, num_heads, "
                             f"num_kv_heads, head_dim, dtype, root, alibi, soft-cap) = "
                             f"{sig.tolist()} differs from ranks {differ}': "
                             f"{[sigs[r].tolist() for r in differ]}")
        self._send = cupy.zeros(self.nbytes, cupy.uint8)

    def run(self, q, k_cache, v_cache, cache_seqlens, tokens_after=None, *,
            softmax_scale: float | None = None, alibi_slopes=None, sinks=None,
            block_table=None):
        """This step's attention over every rank's shard: ``(out, lse)`` (out like q, lse
        (batch, num_heads) float32), or None on a rank other than ``root``. ``cache_seqlens``:
        this rank's tokens of each sequence (int, or an int32 device array); ``tokens_after``:
        (batch,) int32 device array, each sequence's tokens after this rank's shard (needed with
        ALiBi; None: 0). ``sinks`` (num_heads,) join once, after the merge."""
        cupy = _kernels.import_cupy()
        plan, send = self.plan, self._send
        error = None
        try:
            if tokens_after is not None:
                tokens_after = V.as_device_array(tokens_after, "tokens_after")
                V.check_shape(tokens_after, "tokens_after", (plan.batch,), f"({plan.batch},)")
                if tokens_after.dtype != cupy.int32:
                    V.fail(TypeError, "tokens_after", "int32", V.dtype_name(tokens_after.dtype))
            elif alibi_slopes is not None:
                V.fail(ValueError, "tokens_after", "each sequence's tokens after this shard "
                       "(ALiBi counts distances from the sequence's last token)", None)
            # sinks checked here, where a bad one fails this rank's step before any launch
            sinks = V.check_merge_sinks(sinks, (plan.batch, plan.num_heads))
            out, lse = plan.run(q, k_cache, v_cache, cache_seqlens, softmax_scale=softmax_scale,
                                alibi_slopes=alibi_slopes, block_table=block_table)
            lse = R.shard_lse(lse, alibi_slopes, tokens_after, xp=cupy)
            send[:4].view(cupy.int32)[0] = OK
            send[self._lse_off:self._lse_off + 4 * self.rows].view(cupy.float32)[:] = lse.ravel()
            send[self._out_off:].view(self.dtype)[:] = out.ravel()
        except (TypeError, ValueError) as exc:
            error = exc
            send[:4].view(cupy.int32)[0] = FAILED
        recv = self.comm.all_gather(send)
        status = _host(recv[:, :4].copy().view(cupy.int32))[:, 0]
        if error is not None:
            raise error
        failed = [r for r in range(self.comm.size) if status[r] != OK]
        if failed:
            raise RuntimeError(f"rank {self.comm.rank}: ranks {failed} failed this step's "
                               "checks (their own errors say why); nothing was merged")
        if self.root is not None and self.comm.rank != self.root:
            return None
        n = self.comm.size
        lse_parts = recv[:, self._lse_off:self._lse_off + 4 * self.rows].copy().view(
            cupy.float32).reshape(n, plan.batch, plan.num_heads)
        o_parts = recv[:, self._out_off:].copy().view(self.dtype).reshape(
            n, plan.batch, plan.num_heads, plan.head_dim)
        from .decode import merge_states

        return merge_states(o_parts, lse_parts, sinks=sinks)


def _host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()
