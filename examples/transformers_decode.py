"""Decode steps of a Hugging Face transformers model with cupydecode as its attention, through
transformers' attention-function registry (AttentionInterface), against the model's own SDPA
attention.

A small Llama-shaped model with random weights (no download): 4 layers, 8 query heads, 2 KV
heads, head_dim 64, float16. The prompt runs through SDPA (prefill is not decode); every decode
step (one new token) runs through cupydecode.flash_decode on the model's own KV cache, viewed
through DLPack with no copy, on torch's current stream. The logits of each step are compared
with those of the same model using SDPA on the same tokens.

    python examples/transformers_decode.py          (needs torch and transformers)
"""

from __future__ import annotations

import cupy as cp
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import cupydecode


CALLS = {"cupydecode": 0}  # decode-step calls that ran on cupydecode (the example checks > 0)


def _no_padding(mask) -> bool:
    """transformers' mask for this call attends every cached token: None, an all-True bool mask
    or an all-zero additive one."""
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def cupydecode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                         **kwargs):
    """transformers' attention-function signature: query (batch, heads, q_len, dim), key and value
    (batch, kv_heads, kv_len, dim) with the cache already updated; returns ((batch, q_len, heads,
    dim), None). One-token steps without padding go to cupydecode; anything else to SDPA."""
    if query.shape[2] != 1 or not _no_padding(attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    CALLS["cupydecode"] += 1
    with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        q = cp.from_dlpack(query[:, :, 0])                    # (batch, heads, dim)
        k = cp.from_dlpack(key.transpose(1, 2))               # (batch, kv_len, kv_heads, dim) view
        v = cp.from_dlpack(value.transpose(1, 2))
        out = cupydecode.flash_decode(q, k, v, softmax_scale=scaling)
    return torch.from_dlpack(out).unsqueeze(1), None          # (batch, 1, heads, dim)


AttentionInterface.register("cupydecode", cupydecode_attention)


def _use(model, impl: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:
        model.config._attn_implementation = impl


def run(steps: int = 16, prompt_len: int = 200, batch: int = 2, seed: int = 0) -> float:
    """Greedy decoding with SDPA, then the same tokens through cupydecode's decode steps;
    returns the largest relative error of a step's logits (cupydecode against SDPA)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=1000, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to("cuda", torch.float16).eval()
    prompt = torch.randint(0, config.vocab_size, (batch, prompt_len), device="cuda")
    with torch.no_grad():
        runs, tokens = {}, None
        for impl in ("sdpa", "cupydecode"):
            _use(model, impl)
            out = model(prompt, use_cache=True)
            cache, logits = out.past_key_values, []
            feed = [out.logits[:, -1:].argmax(-1)] if tokens is None else tokens
            for i in range(steps):
                out = model(feed[i], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                logits.append(out.logits[:, -1].float())
                if tokens is None and i + 1 < steps:  # SDPA's greedy tokens, fed to both
                    feed.append(logits[-1].argmax(-1, keepdim=True))
            tokens, runs[impl] = feed, logits
    assert CALLS["cupydecode"] >= steps * config.num_hidden_layers, CALLS
    return max(float((a - b).norm() / a.norm()) for a, b in zip(runs["sdpa"], runs["cupydecode"]))


if __name__ == "__main__":
    err = run()
    print(f"16 decode steps of a Llama-shaped model through cupydecode: logits within {err:.2e} "
          "of SDPA's (relative)")
    assert err < 1e-2, err
