"""Model code as people train it, for validation: modules called with hidden states, in
mixed precision, and Hugging Face attention, each with how it is called (``Calling``).

Live (``--backend cuda``), each runs on the GPU beside its model, the tracer (``memcalc
trace``): a GPU's first run checks autocast, module state and the Hugging Face paths too.
Emulated, those whose sizes are polynomials in N (no fused kernel: eager attention) check
the program fitted for ``memcalc oom --trace`` against direct traces at lengths it was not
fitted on. Modules are classes built with no arguments, on the device that runs them.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from memcalc.engine.inputs import inputs_of
from memcalc.tracing.target import Calling

WIDTH, HEADS = 256, 4


class FusedQKV(nn.Module):
    """nanoGPT's attention block: one projection to q, k, v from hidden states (B, N, C),
    SDPA with ``is_causal``, the output projection."""

    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class FusedQKVAutocast(FusedQKV):
    """The same with autocast written in its forward (bf16)."""

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return super().forward(x)


class ManualCausal(FusedQKV):
    """The same with nanoGPT's manual attention: a causal ``bias`` buffer, ``masked_fill``,
    softmax, training dropout 0.1."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(4096, 4096)).view(1, 1, 4096, 4096))
        self.attn_dropout = nn.Dropout(0.1)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = self.attn_dropout(F.softmax(att, dim=-1)) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def _hf_llama(implementation: str):
    """A Hugging Face LlamaAttention (GQA, 4 heads of 64 over 2 key/value heads) with its
    rotary embedding and the causal mask its model builds, from hidden states."""
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    # the cache argument is ``past_key_values`` through transformers 5.17, ``cache`` later;
    # 5.25 keeps ``past_key_values`` as a deprecated keyword and warns when both are given
    parameters = inspect.signature(create_causal_mask).parameters
    no_cache = {next(name for name in ("cache", "past_key_values") if name in parameters): None}

    class LlamaAttentionStep(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = LlamaConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                      num_attention_heads=HEADS, num_key_value_heads=2,
                                      num_hidden_layers=1, vocab_size=1000)
            self.config._attn_implementation = implementation
            self.rotary = LlamaRotaryEmbedding(self.config)
            self.attn = LlamaAttention(self.config, layer_idx=0)

        def forward(self, x):
            position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=None,
                                      position_ids=position_ids, **no_cache)
            return self.attn(x, position_embeddings=self.rotary(x, position_ids),
                             attention_mask=mask)[0]

    return LlamaAttentionStep


def _hf_bert():
    """A Hugging Face BertModel (eager, two layers of 4 heads) from token ids and a padding
    mask."""
    from transformers import BertConfig, BertModel

    class BertStep(nn.Module):
        def __init__(self):
            super().__init__()
            config = BertConfig(hidden_size=WIDTH, num_attention_heads=HEADS,
                                intermediate_size=2 * WIDTH, num_hidden_layers=2,
                                vocab_size=1000, max_position_embeddings=4096,
                                attn_implementation="eager")
            self.model = BertModel(config, add_pooling_layer=False)

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    return BertStep


@dataclass(frozen=True)
class ModelCode:
    """A module class, how it is called, and whether its sizes are polynomials in N (no
    fused kernel), so that the emulated backend checks its fitted program."""

    module: type
    calling: Calling
    polynomial: bool = False


HIDDEN = inputs_of([f"x=B,N,{WIDTH}"])


def model_code() -> dict[str, ModelCode]:
    """Every case by name; the Hugging Face ones where transformers is installed."""
    cases = {
        "fused-qkv": ModelCode(FusedQKV, Calling(HIDDEN)),
        "fused-qkv-autocast": ModelCode(FusedQKV, Calling(HIDDEN, "bfloat16")),
        "autocast-inside": ModelCode(FusedQKVAutocast, Calling(HIDDEN)),
        "manual-causal": ModelCode(ManualCausal, Calling(HIDDEN), polynomial=True),
        "manual-causal-bf16": ModelCode(ManualCausal, Calling(HIDDEN, "bfloat16"),
                                        polynomial=True),
    }
    try:
        import transformers  # noqa: F401
    except ImportError:
        return cases
    ids = inputs_of(["input_ids=B,N:int64", "attention_mask=B,N:int64:padded"])
    cases.update({
        "hf-llama-sdpa": ModelCode(_hf_llama("sdpa"), Calling(HIDDEN, "bfloat16")),
        "hf-llama-eager": ModelCode(_hf_llama("eager"), Calling(HIDDEN, "bfloat16"),
                                    polynomial=True),
        "hf-bert-padded": ModelCode(_hf_bert(), Calling(ids), polynomial=True),
    })
    return cases


def register() -> dict[str, str]:
    """Register each case's module (built on the meta device) as ``trace:model:<name>``;
    its implementation name by case name."""
    from memcalc.tracing import prepared, register_function

    return {key: register_function(prepared(code.module, key), f"model:{key}", code.calling)
            for key, code in model_code().items()}


FITTED_LENGTHS = (300, 1000)  # beyond the lengths the programs are fitted on (61 to 257)


def fitted_checks(codes: dict[str, ModelCode] | None = None,
                  names: dict[str, str] | None = None, case: str = "modelcode") -> tuple:
    """The emulated checks of model code (or of other ``codes`` registered as ``names``,
    ``case``: the training steps'): for each module whose sizes are polynomials in N, the
    program fitted from its traces (what ``memcalc oom --trace`` solves) against a direct
    trace, on the GPU's code paths, at lengths it was not fitted on."""
    from memcalc.config import Config, Shape
    from memcalc.analysis.predict import predict
    from memcalc.tracing import prepared, trace
    from memcalc.validation.compare import Check, figures_of

    codes, names = codes or model_code(), names or register()
    checks = []
    for key, code in codes.items():
        if not code.polynomial:
            continue
        fn = prepared(code.module, key)
        for n in FITTED_LENGTHS:
            config = Config(impl=names[key], shape=Shape(batch=2, seq_len=n))
            checks.append(Check(config=config, predicted=figures_of(predict(config)),
                                measured=figures_of(trace(fn, config, calling=code.calling)),
                                case=case))
    return tuple(checks)
