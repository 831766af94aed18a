"""Hugging Face ``transformers`` Llama, traced as it is called: its attention module, a
decoder layer, and a small causal LM with its loss (``pip install ".[hf]"``).

Built from a config on the meta device (no weights are read); the attention
implementation is ``sdpa`` unless ``ATTN_IMPLEMENTATION`` says ``eager`` (or
``flex_attention``). The shapes are Llama-3-8B's (4,096 wide, 32 query heads of 128, 8
key/value heads: grouped-query attention), with two layers for the causal LM.

    memcalc trace examples/huggingface/llama.py:attention --input x=B,N,4096 --seq 4096 --batch 1 --autocast bf16 --gpu a100-80gb
    memcalc trace examples/huggingface/llama.py:decoder_layer --input x=B,N,4096 --seq 4096 --batch 1 --autocast bf16 --gpu a100-80gb
    memcalc trace examples/huggingface/llama.py:causal_lm --input input_ids=B,N:int64 --input attention_mask=B,N:int64 --input labels=B,N:int64 --seq 2048 --batch 1 --autocast bf16 --gpu a100-80gb
    memcalc oom --trace examples/huggingface/llama.py:attention --input x=B,N,4096 --batch 1 --autocast bf16 --gpu a100-80gb
"""

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import (LlamaAttention, LlamaDecoderLayer,
                                                      LlamaRotaryEmbedding)

config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, num_hidden_layers=2, vocab_size=128256,
                     max_position_embeddings=131072, rope_theta=500000.0)
config._attn_implementation = os.environ.get("ATTN_IMPLEMENTATION", "sdpa")

with torch.device("meta"):
    rotary = LlamaRotaryEmbedding(config)
    attn = LlamaAttention(config, layer_idx=0)
    layer = LlamaDecoderLayer(config, layer_idx=0)
    model = LlamaForCausalLM(config)


def _rope_and_mask(x):
    """What LlamaModel.forward makes before its layers: position ids, the rotary
    embeddings (cos, sin) and the causal mask (None for sdpa, which then runs is_causal)."""
    position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None,
                              position_ids=position_ids)
    return position_ids, rotary(x, position_ids), mask


def attention(x):
    """LlamaAttention on hidden states x (B, N, 4096), as the decoder layer calls it."""
    _, position_embeddings, mask = _rope_and_mask(x)
    out, _ = attn(x, position_embeddings=position_embeddings, attention_mask=mask)
    return out


def decoder_layer(x):
    """One LlamaDecoderLayer: norms, attention, MLP, residuals."""
    position_ids, position_embeddings, mask = _rope_and_mask(x)
    return layer(x, attention_mask=mask, position_ids=position_ids,
                 position_embeddings=position_embeddings)


def causal_lm(input_ids, attention_mask, labels):
    """A training step of the two-layer causal LM: logits (B, N, vocab), upcast to float32
    and cross-entropy inside the model's loss; the loss is what the backward starts from."""
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
