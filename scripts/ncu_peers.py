"""Run one decode shape through cupydecode and torch's cuDNN SDPA a few times each, for ncu.

Usage: ncu ... python scripts/ncu_peers.py MODEL BATCH SEQLEN [DTYPE]
"""
import sys

import cupy as cp

sys.path.insert(0, ".")
import cupydecode as cd  # noqa: E402
from cupydecode.bench import _torch_views  # noqa: E402
from cupydecode.workloads import make_inputs, workload_for_model  # noqa: E402

model, b, L = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dtype = sys.argv[4] if len(sys.argv) > 4 else "float16"
w = workload_for_model(model, b, L, dtype)
q, k, v, _ = make_inputs(w)
plan = cd.DecodePlan(b, w.num_heads, w.num_kv_heads, w.head_dim, L, dtype)
print(plan, plan.merge, flush=True)
for _ in range(2):
    plan.run(q, k, v)
cp.cuda.Device().synchronize()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

tq, tk, tv = _torch_views(torch, [(q, k, v, None)])[0]
with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
    for _ in range(2):
        F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=w.group > 1)
torch.cuda.synchronize()
