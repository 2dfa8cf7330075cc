"""How many thread-block clusters of the split kernel fit on the GPU at once (development tool).

A merge through distributed shared memory needs all splits of one (sequence, KV heads) in one
cluster, and a one-wave plan needs every cluster resident together. This asks the driver
(cuOccupancyMaxActiveClusters) for the split kernel's long-chunk shapes at head_dim 128, fp16:
one KV head per block and blocks of KV_GROUP KV heads, for cluster sizes 1–8, and prints how
many blocks that is beside the SM count and the blocks that batch-16 plans of 8 KV heads need.

Usage: python scripts/cluster_fit.py
"""

import ctypes
import sys

sys.path.insert(0, ".")
import cupy  # noqa: E402

from cupydecode import _kernels, _policy, decode  # noqa: E402

_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION


class _ClusterAttribute(ctypes.Structure):
    """CUlaunchAttribute holding a cluster dimension (x, y, z) in its 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("dims", ctypes.c_uint * 3),
                ("rest", ctypes.c_char * 52)]


def max_active_clusters(fn, threads: int, smem: int, cluster: int) -> int:
    query = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    query.restype = ctypes.c_int
    query.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_void_p)
    _kernels.bind_context()
    _kernels.allow_shared_memory(fn, smem)
    attr = _ClusterAttribute(id=_CLUSTER_DIMENSION, dims=(cluster, 1, 1))
    config = _kernels._LaunchConfig((cluster * 32, 1, 1), (threads, 1, 1), smem, None,
                                    ctypes.addressof(attr), 1)
    n = ctypes.c_int(0)
    err = query(ctypes.byref(n), fn.kernel.ptr, ctypes.addressof(config))
    if err:
        raise RuntimeError(f"cuOccupancyMaxActiveClusters: CUresult {err}")
    return n.value


def main():
    dev = cupy.cuda.runtime.getDevice()
    sms = decode._sm_count(dev)
    print(f"{cupy.cuda.runtime.getDeviceProperties(dev)['name'].decode()}: {sms} SMs")
    shapes = [("one KV head per block", _policy.split_kernel_config("float16", 128, 1 << 15, group=4)),
              (f"{_policy.KV_GROUP} KV heads per block",
               _policy.split_kernel_config("float16", 128, 1 << 15, group=4,
                                           kv_per_block=_policy.KV_GROUP))]
    for name, cfg in shapes:
        fn = decode._split_function(cfg)
        per_sm = decode._blocks_per_sm(cfg, dev)
        print(f"{name}: {cfg.num_warps} warps, {cfg.smem_bytes} B shared, {per_sm} block(s)/SM")
        for c in (1, 2, 3, 4, 8):
            n = max_active_clusters(fn, cfg.threads, cfg.smem_bytes, c)
            print(f"  clusters of {c}: {n:3d} at once = {n * c:3d} blocks")
    print(f"batch 16, 8 KV heads in blocks of {_policy.KV_GROUP}, 4 splits per cluster: "
          f"{16 * 8 // _policy.KV_GROUP} clusters of 4 needed")


if __name__ == "__main__":
    main()
