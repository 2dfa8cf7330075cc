"""JAX arrays in and out of cupydecode through DLPack, without copies: the cache and q stay JAX
arrays on the GPU, cupydecode reads them zero-copy, and the output comes back to JAX.

    python examples/jax_interop.py
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy too

import cupy as cp  # noqa: E402
import jax  # noqa: E402
import jax.dlpack  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cupydecode  # noqa: E402


def run(batch=2, num_heads=32, num_kv_heads=8, head_dim=128, max_seqlen=2048, seed=0):
    """Returns the relative error of the output (as a JAX array) against the reference."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(keys[0], (batch, num_heads, head_dim), jnp.float16)
    k = jax.random.normal(keys[1], (batch, max_seqlen, num_kv_heads, head_dim), jnp.float16)
    v = jax.random.normal(keys[2], (batch, max_seqlen, num_kv_heads, head_dim), jnp.float16)
    out = cupydecode.flash_decode(cp.from_dlpack(q), cp.from_dlpack(k), cp.from_dlpack(v))
    out_jax = jax.dlpack.from_dlpack(out)       # back to JAX, zero-copy
    ref, _ = cupydecode.reference.decode_attention(np.asarray(q), np.asarray(k), np.asarray(v))
    return cupydecode.reference.relative_error(np.asarray(out_jax), ref)


if __name__ == "__main__":
    err = run()
    print(f"flash_decode on JAX arrays: relative error {err:.2e}")
    assert err < 2e-3, err
