"""cupydecode: FlashDecoding (split-KV decode attention) for CuPy.

    out = cupydecode.flash_decode(q, k_cache, v_cache, cache_seqlens)
    o, lse = cupydecode.merge_states(o_parts, lse_parts)
    plan = cupydecode.DecodePlan(batch, num_heads, num_kv_heads, head_dim, max_seqlen, "float16")
    ref_out, ref_lse = cupydecode.reference.decode_attention(q, k_cache, v_cache)

CuPy is imported lazily, so ``import cupydecode`` (and the NumPy reference) work without a GPU.
"""

from . import reference
from ._policy import Tuning
from .decode import DecodePlan, flash_decode, merge_states
from .quantize import dequantize_kv, quantize_kv

__version__ = "0.2.0"
__all__ = ["flash_decode", "merge_states", "DecodePlan", "Tuning", "quantize_kv", "dequantize_kv", "reference", "__version__"]

# Modules the docs name as cupydecode.NAME, imported on first use (they are larger, and
# distributed's communicators are optional): cupydecode.workloads.alibi_slopes,
# cupydecode.distributed.ShardedDecodePlan work after a plain ``import cupydecode``.
_LAZY_MODULES = ("workloads", "distributed")


def __getattr__(name):
    if name in _LAZY_MODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
