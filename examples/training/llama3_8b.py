"""Llama-3-8B as Hugging Face ``transformers`` builds it (``pip install ".[hf]"``): 32 decoder
layers of 4,096 (32 query heads of 128, 8 key/value heads), an MLP of 14,336, a vocabulary
of 128,256, the loss computed inside the model from ``labels``. Built from its config on
the meta device: no weights are read, nothing is downloaded.

    memcalc trace examples/training/llama3_8b.py:model --input input_ids=B,N:int64 --input labels=B,N:int64 --seq 4096 --batch 1 --param-dtype bf16 --optimizer adamw --gpu h100-80gb
    memcalc trace examples/training/llama3_8b.py:model --input input_ids=B,N:int64 --input labels=B,N:int64 --seq 4096 --batch 1 --autocast bf16 --optimizer adamw --gpu h100-80gb
    memcalc trace examples/training/llama3_8b.py:checkpointed --input input_ids=B,N:int64 --input labels=B,N:int64 --seq 4096 --batch 1 --param-dtype bf16 --optimizer adamw --gpu h100-80gb

``model`` trains as ``model(input_ids=..., labels=...)`` is called in a loop;
``checkpointed`` is the same model with ``activation_checkpointing_enable()`` (transformers'
non-reentrant activation checkpointing of each decoder layer). ``LAYERS`` in the
environment sets the depth (default 32).
"""

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, num_hidden_layers=int(os.environ.get("LAYERS", 32)),
                     vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                     tie_word_embeddings=False, use_cache=False)  # training: no KV cache
config._attn_implementation = os.environ.get("ATTN_IMPLEMENTATION", "sdpa")

with torch.device("meta"):
    model = LlamaForCausalLM(config)
    checkpointed = LlamaForCausalLM(config)
if hasattr(checkpointed, "activation_checkpointing_enable"):  # its name from transformers 5.x
    checkpointed.activation_checkpointing_enable({"use_reentrant": False})
else:
    checkpointed.gradient_checkpointing_enable({"use_reentrant": False})
checkpointed.train()
model.train()
