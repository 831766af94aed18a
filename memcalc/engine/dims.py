"""The sizes a program is built from, read once from a configuration.

``Config.dims`` is the one way to get them (``Dims.of`` is what it calls); programs,
the replay, the grid recorder and the tracer all read sizes from here, so a new option
reaches every path at once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Dims:
    """``B`` batch, ``H`` query heads, ``Hk`` key/value heads, ``N`` query rows, ``M`` key
    rows, ``D`` head dim (one rank's: ``H`` and ``Hk`` over ``--tp`` ranks, ``N`` and ``M``
    over ``--cp``), the dtype's torch name, ``chunk`` (chunked implementations), the
    protocol's loss and forward-only flag, and the device facts fused kernels read.

    The sizes may be integers or any number-like objects with the same arithmetic (the
    grid path builds programs over symbolic sizes)."""

    B: int
    H: int
    N: int
    M: int
    D: int
    dtype: str
    causal: bool
    loss: str
    Hk: int
    chunk: int
    forward_only: bool = False
    sm_count: int | None = None  # the device's, for fused kernels' split heuristics
    compute_capability: tuple[int, int] = (9, 0)
    deterministic: bool = False  # the kernels' deterministic backward, where one has it
    mask: str = "none"  # a BlockMask's kind (flex): none, causal, sliding:W, document:L
    block_mask: str = "given"  # flex: the BlockMask built before the step, or "dense": in it
    varlen: int = 0  # flash-attn's varlen functions: the sequences packed into the N (and M)
    # rows of one batch (B = 1); 0: a batch of B sequences of N rows each
    cp: int = 1  # context-parallel ranks; N and M are then one rank's rows (memcalc.impls.ring)
    cp_method: str = "allgather"  # how the ranks exchange K/V: allgather or alltoall
    cp_rank: int = 0  # the rank whose step the program is
    layout: str = "BHND"  # q, k, v's memory: (B, H, N, D) as given, or "BNHD": (B, N, H, D)
    # tensors seen through .transpose(1, 2) (DeepSpeed-Ulysses' local attention; the math
    # path's matmuls copy by it: memcalc.impls.sdpa_math.folds)

    @classmethod
    def of(cls, config) -> "Dims":
        """The sizes of a ``memcalc.config.Config`` (what ``Config.dims`` returns; this module
        imports nothing of memcalc's, so every layer can use it)."""
        s, p, gpu, cp, tp = (config.shape, config.protocol, config.device.spec, config.cp,
                             config.tp)
        return cls(s.batch, s.heads // tp, s.seq_len // cp, s.keys // cp, s.head_dim,
                   config.dtype.torch_name, config.causal, p.loss, s.key_heads // tp,
                   config.chunk, p.forward_only, gpu.sm_count, gpu.compute_capability,
                   p.deterministic, config.mask, config.block_mask, cp=cp,
                   cp_method=config.cp_method)

    def replace(self, **sizes) -> "Dims":
        """These sizes with some changed (``N``, ``M``, ...), for programs built at other
        lengths from one configuration's options."""
        return Dims(**{**self.__dict__, **sizes})
