"""Compiled training steps, for validation (``--cases compiled``, live only): the code
``memcalc trace --compile`` follows, run on the GPU as torch compiles it.

Each case is model code (``modelcode.ModelCode``), the compile mode its ``torch.compile``
calls run in (``"default"``: the whole module compiled, as ``--compile`` does; None: the
code's own calls) and the partitioner's activation memory budget (``--compile-budget``;
None: torch's, 1.0). Its model is the tracer (``memcalc trace --compile``), which compiles
the code for the preset GPU without one (``memcalc.compiling``); the live run compiles it
with inductor on the GPU in hand, at the same budget (``memcalc.compiling.live``). A budget
changes what the partitioner saves: 0.5 against 1 checks that memcalc follows the choice.
"""

from __future__ import annotations

import torch

from memcalc.tracing.optimizers import loop_of
from memcalc.tracing.target import Calling
from memcalc.validation.modelcode import HIDDEN, FusedQKV, ModelCode
from memcalc.validation.training import IDS, Block, TinyLM, _hf_llama_lm

BUDGETS = (1.0, 0.5)


class GptBlock(Block):
    """nanoGPT's block (``training.Block``: layer norms, SDPA attention, an MLP of 4x)."""

    def __init__(self):
        super().__init__(FusedQKV)


class BlockCompiledLM(TinyLM):
    """``training.TinyLM`` with each block compiled in its constructor, as torchtitan's
    ``apply_compile`` does (``torch.compile(block, fullgraph=True)`` put back in place of
    the block): the step between the blocks, the embedding, head, loss and AdamW, eager."""

    def __init__(self):
        super().__init__()
        for index, block in enumerate(self.blocks):
            self.blocks.register_module(str(index), torch.compile(block, fullgraph=True))


def compiled_code() -> dict[str, tuple[ModelCode, str | None, float | None]]:
    """Every compiled case by name: ``(code, mode, budget)``; the Hugging Face Llama where
    transformers is installed."""
    adamw = Calling(IDS, loop=loop_of("adamw"))
    cases = {f"gpt-block-budget-{b}": (ModelCode(GptBlock, Calling(HIDDEN)), "default", b)
             for b in BUDGETS}
    cases["lm-blocks-compiled-adamw"] = (ModelCode(BlockCompiledLM, adamw), None, None)
    try:
        import transformers  # noqa: F401
    except ImportError:
        return cases
    llama = _hf_llama_lm()
    cases.update({f"hf-llama-lm-adamw-budget-{b}": (ModelCode(llama, adamw), "default", b)
                  for b in BUDGETS})
    return cases


def register() -> dict[str, str]:
    """Register each case's module as ``trace:compiled:<name>``, compiled as the case says
    (its implementation name by case name)."""
    from memcalc.compiling.session import calls
    from memcalc.tracing import prepared, register_function

    names = {}
    for key, (code, mode, budget) in compiled_code().items():
        with calls(mode, activation_budget=budget):
            names[key] = register_function(prepared(code.module, key), f"compiled:{key}",
                                           code.calling)
    return names
