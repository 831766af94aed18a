"""Hugging Face ``transformers`` GPT-2, traced as it is called: its attention module (the
``_attn`` of the eager implementation, or sdpa) and the language model with its loss
(``pip install ".[hf]"``). GPT-2 small's shapes (12 heads of 64, 768 wide, 50,257 tokens),
in training mode (attention and residual dropout 0.1), from a config on the meta device.

    memcalc trace examples/huggingface/gpt2.py:attention --input x=B,N,768 --seq 1024 --batch 8
    ATTN_IMPLEMENTATION=eager memcalc trace examples/huggingface/gpt2.py:attention --input x=B,N,768 --seq 1024 --batch 8
    memcalc trace examples/huggingface/gpt2.py:language_model --input input_ids=B,N:int64 --input labels=B,N:int64 --seq 1024 --batch 8 --autocast bf16 --gpu a100-80gb
"""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import create_causal_mask
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention

config = GPT2Config(n_layer=2)
config._attn_implementation = os.environ.get("ATTN_IMPLEMENTATION", "sdpa")

with torch.device("meta"):
    attn = GPT2Attention(config, layer_idx=0)
    model = GPT2LMHeadModel(config)


def attention(x):
    """GPT2Attention on hidden states x (B, N, 768) with the causal mask GPT2Model builds
    (None for sdpa, which then runs is_causal; an additive float mask for eager)."""
    position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    mask = create_causal_mask(config=config, inputs_embeds=x, attention_mask=None, cache=None,
                              position_ids=position_ids)
    out, _ = attn(x, attention_mask=mask)
    return out


def language_model(input_ids, labels):
    """A training step of the two-layer GPT-2 language model; the loss starts the backward."""
    return model(input_ids=input_ids, labels=labels)
