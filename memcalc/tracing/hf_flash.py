"""Hugging Face transformers' ``attn_implementation="flash_attention_2"`` (and ``_3``) in a
trace: the model calls the flash-attn stand-ins (``memcalc.tracing.flash_attn``).

transformers decides whether flash-attn can run from the installed distribution and the
device (``modeling_flash_attention_utils.FLASH_ATTENTION_COMPATIBILITY_MATRIX``,
``is_flash_attn_2_available``: importlib.metadata and ``torch.cuda``), neither of which a
trace has, and it caches the functions it imported (``lazy_import_flash_attention``'s
module globals). While a trace runs (``stand_in``), once ``transformers.
modeling_flash_attention_utils`` is imported, its checks of FlashAttention 2 and 3 say
available, its cache starts empty (so the functions it imports are the stand-ins), and
both are put back after, so a real run later in the same process imports the package.
"""

from __future__ import annotations

from contextlib import contextmanager

from memcalc.tracing.imports import on_import

MODULE = "transformers.modeling_flash_attention_utils"
VERSIONS = (2, 3)  # the flash-attn packages memcalc models: flash_attn, flash_attn_interface
# lazy_import_flash_attention's cache (transformers 5.x)
CACHE = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn",
         "_pad_fn", "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn")


def _available(*args, **kwargs) -> bool:
    return True


@contextmanager
def stand_in():
    """Inside, transformers (when imported) takes flash-attn 2 and 3 as installed on a GPU
    and imports their functions anew (the stand-ins); as it was after."""
    undo = []
    try:
        with on_import(MODULE, lambda module: undo.append(_patched(module))):
            yield
    finally:
        for restore in undo:
            restore()


def _patched(module):
    """Patch ``module`` (transformers' flash-attention utilities); return what undoes it."""
    matrix = getattr(module, "FLASH_ATTENTION_COMPATIBILITY_MATRIX", {})
    checks = {v: matrix[v]["general_availability_check"] for v in VERSIONS if v in matrix}
    functions = {name: getattr(module, name) for name in
                 ("is_flash_attn_2_available", "is_flash_attn_3_available")
                 if hasattr(module, name)}
    cache = {name: getattr(module, name) for name in CACHE if hasattr(module, name)}
    for v in checks:
        matrix[v]["general_availability_check"] = _available
    for name in functions:
        setattr(module, name, _available)
    for name in cache:
        setattr(module, name, None)

    def restore():
        for v, check in checks.items():
            matrix[v]["general_availability_check"] = check
        for name, value in {**functions, **cache}.items():
            setattr(module, name, value)
    return restore
