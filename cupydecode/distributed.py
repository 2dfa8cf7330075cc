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
sequence's end). The kernel places the query tokens there (DecodePlan.run's ``tokens_after``),
so their causal limits (several query tokens), the window and ALiBi's distances are the
sequence's own. Sinks join once, in the merge. Every option of :class:`DecodePlan` works but
appending (k_new, v_new: append on the rank that holds the sequence's end, before the step).

Failure: a rank whose step fails before the collective (a refused input, or any other error)
still takes part in it, its header saying so, and then every rank raises (the failing one its
own error, the others a RuntimeError naming it) — no rank merges a partial result. Headers
carry the step's number too, so ranks that fell out of step fail alike. A rank that never
arrives (dead or hung) makes the others raise after ``timeout`` seconds (NCCL: the
communicator is aborted).

Communicators: :class:`ThreadGroup` (ranks as threads of one process on one GPU: tests, and
use without NCCL), :class:`NcclCommunicator` (one process per GPU, NCCL through CuPy, e.g.
started by :func:`spawn` or mpirun). Anything with ``rank``, ``size`` and
``all_gather(send) -> (size, n)`` works; one whose all-gather is only queued on the stream has a
``wait()`` too, called once the step's merge is queued behind it (NcclCommunicator: the host
launches the merge while the attention and the collective run). NCCL is optional: nothing here
is imported by ``import cupydecode``.
"""

from __future__ import annotations

import threading
import time
from typing import NoReturn

import numpy as np

from . import _kernels
from . import _validate as V
from ._policy import DTYPE_IDS

# Each rank's piece of a step's collective: a header of 4 int32 (status: 0 ok, 1 this rank
# failed; the rank; the step; 0), the LSEs (float32, padded to 16 bytes), the outputs
HEADER_BYTES = 16
OK, FAILED = 0, 1


def piece_layout(rows: int, head_dim: int, itemsize: int) -> tuple[int, int, int]:
    """(LSE offset, output offset, bytes) of one rank's piece for ``rows`` query rows."""
    out_at = HEADER_BYTES + -(-4 * rows // 16) * 16
    return HEADER_BYTES, out_at, out_at + rows * head_dim * itemsize


def piece_views(send, rows_shape: tuple, head_dim: int, dtype):
    """Views (no copies) of the parts of one rank's piece ``send`` (1-D uint8 of piece_layout's
    bytes; NumPy or CuPy): (header (4,) int32, LSEs rows_shape float32, outputs (*rows_shape,
    head_dim) of ``dtype``), each 16-byte aligned in the piece."""
    xp = _array_module(send)
    rows = int(np.prod(rows_shape))
    lse_at, out_at, nbytes = piece_layout(rows, head_dim, np.dtype(dtype).itemsize)
    if send.shape != (nbytes,):
        raise ValueError(f"send: expected a piece of {nbytes} bytes, got shape {send.shape}")
    return (send[:HEADER_BYTES].view(xp.int32),
            send[lse_at:lse_at + 4 * rows].view(xp.float32).reshape(rows_shape),
            send[out_at:].view(dtype).reshape(*rows_shape, head_dim))


def pack_piece(send, status: int, rank: int, step: int, lse=None, out=None) -> None:
    """Write one rank's piece into ``send`` (uint8, piece_layout's bytes; NumPy or CuPy):
    the header, and where ``status`` is OK its LSEs and outputs (rows in order)."""
    xp = _array_module(send)
    rows_shape, head_dim = (lse.shape, out.shape[-1]) if status == OK else ((0,), 0)
    if status == OK:
        header, lse_to, out_to = piece_views(send, rows_shape, head_dim, out.dtype)
        lse_to[...] = lse
        out_to[...] = out
    else:
        header = send[:HEADER_BYTES].view(xp.int32)
    header[:] = xp.asarray([status, rank, step, 0], xp.int32)


def unpack_pieces(recv, rows_shape: tuple, head_dim: int, dtype):
    """Every rank's (headers (size, 4) int32 on the host, LSEs (size, *rows_shape) float32,
    outputs (size, *rows_shape, head_dim)) from the gathered pieces ``recv`` (size, bytes)."""
    xp = _array_module(recv)
    lse, out = unpack_states(recv, rows_shape, head_dim, dtype)
    return _host(xp.ascontiguousarray(recv[:, :HEADER_BYTES]).view(xp.int32)), lse, out


def unpack_states(recv, rows_shape: tuple, head_dim: int, dtype):
    """Every rank's (LSEs (size, *rows_shape) float32, outputs (size, *rows_shape, head_dim)),
    contiguous, from the gathered pieces ``recv`` (size, bytes), on recv's device."""
    xp = _array_module(recv)
    rows = int(np.prod(rows_shape))
    lse_at, out_at, nbytes = piece_layout(rows, head_dim, np.dtype(dtype).itemsize)
    if recv.shape[1:] != (nbytes,):
        raise ValueError(f"recv: expected pieces of {nbytes} bytes, got shape {recv.shape}")
    n = recv.shape[0]
    lse = xp.ascontiguousarray(recv[:, lse_at:lse_at + 4 * rows]).view(xp.float32)
    out = xp.ascontiguousarray(recv[:, out_at:]).view(dtype)
    return lse.reshape(n, *rows_shape), out.reshape(n, *rows_shape, head_dim)


def check_headers(headers: np.ndarray, rank: int, step: int) -> None:
    """Every rank reported OK for the same step, or RuntimeError naming the ranks that did not."""
    failed = [int(r) for r in np.flatnonzero(headers[:, 0] != OK)]
    if failed:
        raise RuntimeError(f"rank {rank}: ranks {failed} failed this step (their own errors say "
                           "why); nothing was merged")
    astray = [int(r) for r in np.flatnonzero(headers[:, 2] != step)]
    if astray:
        raise RuntimeError(f"rank {rank}: ranks {astray} sent steps {headers[astray, 2].tolist()} "
                           f"to step {step} (a rank retried or skipped a step); nothing was merged")


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
        if self.group._barrier.broken:
            raise RuntimeError(f"rank {self.rank}: this ThreadGroup was broken by an earlier "
                               "failure or abort; make a new one")
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
    current CuPy stream; one that has not finished after ``timeout`` seconds, or that NCCL
    reports failed, aborts the communicator and raises. (Making the communicator waits for every
    rank without a timeout of its own: NCCL's.)"""

    def __init__(self, size: int, unique_id, rank: int, timeout: float = 60.0):
        nccl = _nccl()
        self.size = V.check_int(size, "size", 1)
        self.rank = V.check_int(rank, "rank", 0, self.size - 1)
        self.timeout = float(timeout)
        self._uint8 = nccl.NCCL_UINT8
        self._comm = nccl.NcclCommunicator(self.size, unique_id, self.rank)
        self._done = None  # one event, recorded after each collective

    def all_gather(self, send):
        """(size, n) uint8: every rank's ``send`` (1-D uint8, the same n everywhere), queued on
        the current stream (the host does not wait: work queued after it overlaps it);
        :meth:`wait` waits for it, with the timeout."""
        cupy = _kernels.import_cupy()
        if send.dtype != cupy.uint8 or send.ndim != 1:
            V.fail(TypeError, "send", "a 1-D uint8 array", f"{send.ndim}-D {send.dtype}")
        recv = cupy.empty((self.size, send.size), cupy.uint8)
        stream = cupy.cuda.get_current_stream()
        if self._done is None:
            self._done = cupy.cuda.Event(disable_timing=True)
        try:
            self._comm.allGather(send.data.ptr, recv.data.ptr, send.size, self._uint8, stream.ptr)
            self._done.record(stream)
        except Exception as exc:
            self._failed(exc)
        return recv

    def wait(self) -> None:
        """Until the last all-gather has finished: raises (and aborts the communicator) where
        NCCL reports it failed or it has not finished after ``timeout`` seconds (a rank failed
        or hangs)."""
        if self._done is None:
            return
        try:
            deadline = time.monotonic() + self.timeout
            while not self._done.done:
                self._comm.check_async_error()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the collective did not finish within {self.timeout} s "
                                       "(a rank failed or hangs)")
                time.sleep(0)
            self._comm.check_async_error()
        except Exception as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> NoReturn:
        """Abort the communicator and raise, naming the rank and NCCL's error."""
        self._comm.abort()
        raise RuntimeError(f"rank {self.rank}: NCCL all-gather failed, communicator aborted "
                           f"({type(exc).__name__}: {exc})") from exc

    def abort(self) -> None:
        self._comm.abort()


def _nccl():
    """CuPy's NCCL module, or ImportError naming the extra that brings NCCL."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ImportError("cupydecode.distributed: CuPy has no NCCL here: install the extra "
                          "'cupydecode[nccl12]' or 'cupydecode[nccl13]' (beside cuda12/cuda13)") from exc
    if not getattr(nccl, "available", True):
        raise ImportError("cupydecode.distributed: CuPy found no NCCL library: install the extra "
                          "'cupydecode[nccl12]' or 'cupydecode[nccl13]' (beside cuda12/cuda13)")
    return nccl


def nccl_unique_id():
    """A new NCCL unique id: make it on one process, give it to every rank's NcclCommunicator."""
    return _nccl().get_unique_id()


def _spawned(fn, size, uid, rank, timeout, args, results):
    import pickle
    import traceback

    try:
        import cupy

        cupy.cuda.Device(rank).use()
        comm = NcclCommunicator(size, uid, rank, timeout)
        results.put((rank, True, pickle.dumps(fn(comm, *args))))  # (pickled here: errors caught)
    except BaseException:  # reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))


def spawn(fn, size: int, *args, timeout: float = 600.0, collective_timeout: float = 60.0) -> list:
    """Run ``fn(comm, *args)`` in ``size`` new processes, rank r on GPU r, each with its
    NcclCommunicator (collectives time out after ``collective_timeout`` s); returns their
    results in rank order. Raises RuntimeError naming every rank that failed (with its
    traceback), died, or had not finished after ``timeout`` s; once one rank fails, the others
    get ``collective_timeout`` s to finish before they are stopped. ``fn``, ``args`` and the
    results must be picklable (e.g. a module-level function, host arrays)."""
    import multiprocessing as mp
    import pickle
    import queue

    size = V.check_int(size, "size", 1)
    cupy = _kernels.import_cupy()
    gpus = cupy.cuda.runtime.getDeviceCount()
    if size > gpus:
        V.fail(ValueError, "size", f"at most the {gpus} GPUs here (one rank per GPU)", size)
    ctx = mp.get_context("spawn")
    uid = nccl_unique_id()
    results = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(fn, size, uid, r, collective_timeout, args, results))
             for r in range(size)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout
    try:
        while len(got) < size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.2)
                got[rank] = (ok, value)
                if not ok:  # the others may wait on it in a collective: a grace period
                    deadline = min(deadline, time.monotonic() + collective_timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in got]
                for r in dead:
                    got[r] = (False, f"died with exit code {procs[r].exitcode}")
    finally:
        for p in procs:
            p.join(timeout=1.0)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
                if p.is_alive():
                    p.kill()
                    p.join()
    failed = {r: v for r, (ok, v) in got.items() if not ok}
    missing = [r for r in range(size) if r not in got]
    if failed or missing:
        raise RuntimeError("spawn: " + "; ".join(
            [f"rank {r} failed: {v}" for r, v in sorted(failed.items())]
            + [f"rank {r} had not finished (stopped)" for r in missing]))
    return [pickle.loads(got[r][1]) for r in range(size)]


def _array_module(x):
    return np if isinstance(x, np.ndarray) else _kernels.import_cupy()


class ShardedDecodePlan:
    """A :class:`DecodePlan` for this rank's shard (its capacity ``max_seqlen``: the most
    tokens of one sequence this rank holds) and the step's merge across ranks: ``run`` returns
    the attention over every rank's keys, on every rank (``root`` None) or on ``root`` only
    (the others get None; every rank still receives every piece). Every rank builds the plan
    with the same arguments but ``max_seqlen`` and ``page_size`` (checked once, collectively: a
    mismatch, or a rank whose plan fails, raises on every rank). ``num_splits``, ``split_size``,
    ``merge``, ``page_size``, ``logits_soft_cap``, ``window_left``, ``alibi``, ``q_len``,
    ``kv_dtype``, ``tuning`` go to the rank's DecodePlan. The host reads each step's headers, so a step cannot be captured in
    a CUDA graph."""

    def __init__(self, comm, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 max_seqlen: int, dtype="float16", *, root: int | None = None, **plan_options):
        from .decode import DecodePlan

        cupy = _kernels.import_cupy()
        self.comm, self.root, self.step = comm, root, 0
        error, sig = None, np.zeros(8, np.float64)
        try:
            if root is not None:
                V.check_int(root, "root", 0, comm.size - 1)
            self.plan = plan = DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen,
                                          dtype, **plan_options)
            kv = 0 if plan.kv_dtype is None else 1 + ("e4m3", "e5m2").index(plan.kv_dtype)
            window = -1 if plan.window_left is None else plan.window_left
            sig[:] = [OK, batch, num_heads, num_kv_heads, head_dim,
                      DTYPE_IDS[plan.dtype] + 8 * kv + 32 * int(plan.alibi) + 64 * plan.q_len,
                      (-1 if root is None else root) + 1024 * (window + 1),
                      np.nan if plan.logits_soft_cap is None else plan.logits_soft_cap]
        except Exception as exc:  # the others learn of it in the collective below
            error, sig[0] = exc, FAILED
        # every rank's plan alike: one collective now
        recv = comm.all_gather(cupy.asarray(sig.view(np.uint8)))
        _wait(comm)
        got = _host(recv).view(np.float64)
        sigs = got.reshape(comm.size, -1)
        if error is not None:
            raise error
        failed = [r for r in range(comm.size) if sigs[r, 0] != OK]
        if failed:
            raise RuntimeError(f"ShardedDecodePlan: rank {comm.rank}: ranks {failed} failed to "
                               "build their plans (their own errors say why)")
        same = lambda a, b: np.array_equal(a, b, equal_nan=True)  # noqa: E731
        differ = [r for r in range(comm.size) if not same(sigs[r], sig)]
        if differ:
            raise ValueError(f"ShardedDecodePlan: rank {comm.rank}'s plan (status, batch, "
                             f"num_heads, num_kv_heads, head_dim, dtype/kv_dtype/alibi/q_len, "
                             f"root/window, soft-cap) "
                             f"{sig.tolist()} differs from ranks {differ}: "
                             f"{[sigs[r].tolist() for r in differ]}")
        self.rows_shape = tuple(self.plan.lse.shape)  # (batch, [q_len,] num_heads)
        self.dtype = self.plan.out.dtype
        self.nbytes = piece_layout(int(np.prod(self.rows_shape)), self.plan.head_dim,
                                   self.dtype.itemsize)[2]
        self._send = cupy.zeros(self.nbytes, cupy.uint8)
        # the plan writes its output and LSEs straight into this rank's piece (no copy), and
        # the header goes there from pinned host memory (an asynchronous copy, no stream sync);
        # the gathered headers come back into pinned memory in one copy
        _, self._send_lse, self._send_out = piece_views(self._send, self.rows_shape,
                                                        self.plan.head_dim, self.dtype)
        # (the pinned pool rounds a request up to 512 bytes and the buffer exposes them all:
        # the count is explicit)
        words = HEADER_BYTES // 4
        self._header = np.frombuffer(cupy.cuda.alloc_pinned_memory(HEADER_BYTES), np.int32,
                                     words)
        self._headers = np.frombuffer(cupy.cuda.alloc_pinned_memory(HEADER_BYTES * comm.size),
                                      np.int32, words * comm.size).reshape(comm.size, words)
        self._header_sent = cupy.cuda.Event(disable_timing=True)  # the pinned header is free
        self._header_sent.record()

    def run(self, q, k_cache, v_cache, cache_seqlens, tokens_after=None, *,
            softmax_scale: float | None = None, alibi_slopes=None, sinks=None,
            block_table=None, k_scale=None, v_scale=None):
        """This step's attention over every rank's shard: ``(out, lse)`` (out like q, lse
        q's shape without head_dim, float32), or None on a rank other than ``root``.
        ``cache_seqlens``: this rank's tokens of each sequence (int, or an int32 device array);
        ``tokens_after``: (batch,) int32 device array, each sequence's tokens after this rank's
        shard (None: 0; required with ALiBi, a window or several query tokens). ``sinks``
        (num_heads,) join once, after the merge. Any error on a rank fails the step on every rank
        (that rank raises its own, the others RuntimeError)."""
        cupy = _kernels.import_cupy()
        plan, step = self.plan, self.step
        self.step += 1
        error = None
        try:
            if (tokens_after is None and self.comm.size > 1
                    and (plan.alibi or plan.window_left is not None or plan.q_len > 1)):
                V.fail(ValueError, "tokens_after", "each sequence's tokens after this rank's "
                       "shard (zeros on the rank holding the sequences' ends): with ALiBi, a "
                       "window or several query tokens the positions count them", None)
            V.check_merge_sinks(sinks, self.rows_shape)  # here, where it fails this rank alone
            plan.run(q, k_cache, v_cache, cache_seqlens, self._send_out, self._send_lse,
                     softmax_scale=softmax_scale, alibi_slopes=alibi_slopes,
                     block_table=block_table, k_scale=k_scale, v_scale=v_scale,
                     tokens_after=tokens_after)
        except Exception as exc:  # the others learn of it in the collective below
            error = exc
        stream = cupy.cuda.get_current_stream()
        self._header_sent.synchronize()  # (the last step's copy has read the pinned header)
        self._header[:] = (OK if error is None else FAILED, self.comm.rank, step, 0)
        cupy.cuda.runtime.memcpyAsync(self._send.data.ptr, self._header.ctypes.data,
                                      HEADER_BYTES, cupy.cuda.runtime.memcpyHostToDevice,
                                      stream.ptr)
        self._header_sent.record(stream)
        recv = self.comm.all_gather(self._send)
        merged = None
        if error is None and (self.root is None or self.comm.rank == self.root):
            # merged before the headers are read (a failed rank's piece merges to garbage that
            # is never returned): the merge's launch overlaps the headers' copy
            from .decode import merge_states

            lse_parts, o_parts = unpack_states(recv, self.rows_shape, plan.head_dim, self.dtype)
            merged = merge_states(o_parts, lse_parts, sinks=sinks)
        cupy.cuda.runtime.memcpy2DAsync(self._headers.ctypes.data, HEADER_BYTES,
                                        recv.data.ptr, recv.strides[0], HEADER_BYTES,
                                        recv.shape[0], cupy.cuda.runtime.memcpyDeviceToHost,
                                        stream.ptr)
        _wait(self.comm)
        stream.synchronize()
        if error is not None:
            raise error
        check_headers(self._headers, self.comm.rank, step)
        return merged


def _wait(comm) -> None:
    """Until ``comm``'s last collective has finished, where it queues them (its ``wait``: a
    timeout or NCCL's error raises); others have finished theirs on return."""
    wait = getattr(comm, "wait", None)
    if wait is not None:
        wait()


def _host(x) -> np.ndarray:
    return x if isinstance(x, np.ndarray) else x.get()
