"""Kernel experiments: time variants (compile-time XP_* switches, block shapes, splits) side by side."""
import sys

import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
import cupydecode as cd  # noqa: E402
from cupydecode import _policy  # noqa: E402
from tune import ceiling, graph_time, make_sets  # noqa: E402

BASE = _policy.SplitKernelConfig


class XP(BASE):
    pass


def variant(extra, nw=None, st=None):
    def cfg(dt, hd):
        base = _policy._orig_cfg(dt, hd)
        c = XP(dt, hd, nw or base.num_warps, st or base.stages)
        object.__setattr__(c, "_extra", dict(extra))
        return c
    return cfg


def _defines(self):
    d = BASE.defines(self)
    d.update(getattr(self, "_extra", {}))
    return d


XP.defines = _defines
XP.__hash__ = lambda self: hash((self.dtype, self.head_dim, self.num_warps, self.stages,
                                 tuple(sorted(getattr(self, "_extra", {}).items()))))
XP.__eq__ = lambda a, b: hash(a) == hash(b)
_policy._orig_cfg = _policy.split_kernel_config

VARIANTS = {
    "base": variant({}),
    "pf": variant({"XP_PREFETCH": 1}),
    "kvf": variant({"XP_KVFAST": 1}),
    "kvf+pf": variant({"XP_KVFAST": 1, "XP_PREFETCH": 1}),
    "stream": variant({"XP_STREAM_ONLY": 1}),
    "kvf+stream": variant({"XP_KVFAST": 1, "XP_STREAM_ONLY": 1}),
    "w8s2": variant({}, 8, 2),
}

ceil = ceiling()
print(f"ceiling {ceil:.0f} GB/s", flush=True)
H, Hkv, D = 32, 8, 128
for b, L, splits in [(1, 4096, None), (1, 16384, None), (1, 16384, 8), (1, 16384, 32), (4, 8192, None),
                     (4, 8192, 8), (1, 65536, None), (16, 8192, None), (64, 8192, None)]:
    nbytes, sets = make_sets(b, L, H, Hkv, D, "float16")
    floor = nbytes / ceil / 1e3
    row = [f"b{b} L{L} S={splits or 'auto'} floor {floor:.1f}"]
    for name, cfg in VARIANTS.items():
        _policy.split_kernel_config = cfg
        plans = [cd.DecodePlan(b, H, Hkv, D, L, "float16", num_splits=splits) for _ in sets]
        us = graph_time([lambda p=p, s=s: p.run(*s) for p, s in zip(plans, sets)], trials=20)
        o = plans[0].run(*sets[0])[0].astype(np.float32)
        if name == "base":
            ref = o.copy()
        bad = "" if "stream" in name or float(abs(o - ref).max()) < 1e-2 else "(WRONG)"
        row.append(f"{name}:{us:.1f}{bad}")
    _policy.split_kernel_config = _policy._orig_cfg
    row.append(f"(S={plans[0].num_splits})")
    print("  ".join(row), flush=True)
    del sets
