"""Hugging Face ``transformers`` BERT with a padding mask, traced as it is called
(``pip install ".[hf]"``): BERT-base's shapes (12 heads of 64, 768 wide), two layers,
training mode, from a config on the meta device. ``attention_mask=B,N:int64:padded`` pads
the end of the first sequence, so the mask builders take their padded path (a (B, 1, N, N)
mask into every attention call) as on a GPU.

    ATTN_IMPLEMENTATION=eager memcalc trace examples/huggingface/bert.py:encoder --input input_ids=B,N:int64 --input attention_mask=B,N:int64:padded --seq 512 --batch 8
    ATTN_IMPLEMENTATION=eager memcalc trace examples/huggingface/bert.py:self_attention --input x=B,N,768 --input attention_mask=B,N:int64:padded --seq 512 --batch 8
"""

import os

import torch
from transformers import BertConfig, BertModel
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bert.modeling_bert import BertSelfAttention

config = BertConfig(num_hidden_layers=2)
config._attn_implementation = os.environ.get("ATTN_IMPLEMENTATION", "sdpa")

with torch.device("meta"):
    attn = BertSelfAttention(config)
    model = BertModel(config, add_pooling_layer=False)


def self_attention(x, attention_mask):
    """BertSelfAttention on hidden states x (B, N, 768) with the (B, N) padding mask turned
    into the 4-D mask BertModel builds."""
    mask = create_bidirectional_mask(config=config, inputs_embeds=x,
                                     attention_mask=attention_mask)
    out, _ = attn(x, attention_mask=mask)
    return out


def encoder(input_ids, attention_mask):
    """The encoder's last hidden state (B, N, 768) from token ids and a padding mask."""
    return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
