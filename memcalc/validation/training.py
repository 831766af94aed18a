"""Whole training steps, for validation: language models from token ids to their loss,
trained as a loop trains them (``memcalc trace --optimizer``): AdamW on torch's foreach
path and fused, SGD with momentum, accumulated micro-steps, autocast over float32
weights and pure bf16.

Live (``--cases training``), each runs on the GPU under the protocol of a training loop;
its model is the program ``memcalc oom --trace`` solves (fitted over lengths) and its
emulated column a direct trace at the length run. Emulated, those whose sizes are
polynomials in N (attention written out) check the fitted program against direct traces
at lengths it was not fitted on, as model code does (``modelcode.fitted_checks``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from memcalc.engine.inputs import inputs_of
from memcalc.tracing.optimizers import loop_of
from memcalc.tracing.target import Calling
from memcalc.validation.modelcode import WIDTH, FusedQKV, ManualCausal, ModelCode

VOCAB, LAYERS = 1024, 2
IDS = inputs_of(["ids=B,N:int64", "labels=B,N:int64"])


class Block(nn.Module):
    """A pre-norm block: layer norm, attention (``attention``), layer norm, an MLP of 4x."""

    def __init__(self, attention: type):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = attention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(),
                                 nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyLM(nn.Module):
    """Token ids to a cross-entropy loss: an embedding of ``VOCAB`` tokens, ``LAYERS``
    blocks of SDPA attention (``FusedQKV``), a final norm and a head."""

    attention: type = FusedQKV

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(self.attention) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


class EagerTinyLM(TinyLM):
    """The same with nanoGPT's attention written out (``ManualCausal``): no fused kernel,
    every size a polynomial in N."""

    attention = ManualCausal


def _hf_llama_lm():
    """A Hugging Face LlamaForCausalLM of two layers (4 heads of 64 over 2 key/value heads,
    SDPA), its loss computed inside from ``labels``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    class LlamaStep(nn.Module):
        def __init__(self):
            super().__init__()
            config = LlamaConfig(hidden_size=WIDTH, intermediate_size=688, num_attention_heads=4,
                                 num_key_value_heads=2, num_hidden_layers=LAYERS,
                                 vocab_size=VOCAB, max_position_embeddings=8192)
            config._attn_implementation = "sdpa"
            self.model = LlamaForCausalLM(config)

        def forward(self, ids, labels):
            return self.model(input_ids=ids, labels=labels)

    return LlamaStep


def _calling(optimizer: str, accumulate: int = 1, autocast: str | None = None,
             param_dtype: str | None = None) -> Calling:
    return Calling(IDS, autocast, param_dtype, loop_of(optimizer, accumulate))


def training_code() -> dict[str, ModelCode]:
    """Every training case by name; the Hugging Face ones where transformers is installed."""
    cases = {
        "lm-adamw": ModelCode(TinyLM, _calling("adamw")),
        "lm-adamw-fused-autocast": ModelCode(TinyLM, _calling("adamw:fused", 1, "bfloat16")),
        "lm-adamw-bf16": ModelCode(TinyLM, _calling("adamw", param_dtype="bfloat16")),
        "lm-adamw-accum2-autocast": ModelCode(TinyLM, _calling("adamw", 2, "bfloat16")),
        "lm-sgd": ModelCode(TinyLM, _calling("sgd")),
        "eager-lm-adamw": ModelCode(EagerTinyLM, _calling("adamw"), polynomial=True),
    }
    try:
        import transformers  # noqa: F401
    except ImportError:
        return cases
    llama = _hf_llama_lm()
    cases.update({
        "hf-llama-lm-adamw-autocast": ModelCode(llama, _calling("adamw", 1, "bfloat16")),
        "hf-llama-lm-adamw-fused-bf16": ModelCode(llama, _calling("adamw:fused",
                                                                  param_dtype="bfloat16")),
        "hf-llama-lm-adamw-accum2": ModelCode(llama, _calling("adamw", 2, "bfloat16")),
    })
    return cases


def register() -> dict[str, str]:
    """Register each case's module (built on the meta device) as ``trace:training:<name>``;
    its implementation name by case name."""
    from memcalc.tracing import prepared, register_function

    return {key: register_function(prepared(code.module, key), f"training:{key}", code.calling)
            for key, code in training_code().items()}
