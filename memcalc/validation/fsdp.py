"""FSDP2 training steps, for validation: the two-layer language model of ``training.py``
(attention written out, so that every size is a polynomial in N) sharded by PyTorch's own
``fully_shard`` over P ranks (``memcalc trace --fsdp``), each rank a case of its own.

Emulated, each rank's program fitted over lengths (what ``memcalc oom --trace --fsdp``
solves) is checked against a direct trace of torch's FSDP2 code as that rank, at lengths it
was not fitted on (``modelcode.fitted_checks``). The shards are uneven over 3 ranks (the
last rank holds fewer rows of each weight), so ranks differ there.
"""

from __future__ import annotations

from memcalc.tracing.fsdp import Sharding
from memcalc.tracing.optimizers import loop_of
from memcalc.tracing.target import Calling
from memcalc.validation.modelcode import ModelCode
from memcalc.validation.training import IDS, EagerTinyLM

# (name, sharding, optimizer): every rank of each is a case
SETUPS = (
    ("fsdp2-lm-adamw", Sharding(2), "adamw"),
    ("fsdp3-lm-adamw", Sharding(3), "adamw"),
    ("fsdp4-lm-adamw-mp", Sharding(4, param_dtype="bfloat16", reduce_dtype="float32"),
     "adamw"),
    ("fsdp2-lm-sgd-no-reshard", Sharding(2, "never"), "sgd"),
)


def fsdp_code() -> dict[str, ModelCode]:
    """Every rank of every setup, by name (``fsdp3-lm-adamw:r2``)."""
    return {f"{name}:r{rank}": ModelCode(EagerTinyLM, Calling(IDS, loop=loop_of(optimizer),
                                                              fsdp=sharding, rank=rank),
                                         polynomial=True)
            for name, sharding, optimizer in SETUPS for rank in range(sharding.world)}


def register() -> dict[str, str]:
    """Register each rank's step as ``trace:fsdp:<name>``; its implementation by name."""
    from memcalc.tracing import prepared, register_function

    return {key: register_function(prepared(code.module, key), f"fsdp:{key}", code.calling)
            for key, code in fsdp_code().items()}
