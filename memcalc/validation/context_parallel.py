"""``memcalc validate --cases cp``: context parallelism checked without a GPU.

For each configuration of the grid below and each of its ranks, the model's figures
(``memcalc.impls.ring``, ``memcalc.analysis.predict.rank_breakdown``) against a trace of
PyTorch's own ring attention for that rank (``_templated_ring_attention`` and its backward
on a fake process group: ``memcalc.tracing.context_parallel``), through the same tracer and
allocator model as every emulated check; tolerance 0. The flash kernel inside each step is
memcalc's model of it in both (it cannot run on the meta device): what is checked is what
the ring adds, its exchange, merge and accumulators. DeepSpeed-Ulysses
(``memcalc.impls.ulysses``) against DeepSpeed's own ``DistributedAttention`` traced the same
way, where DeepSpeed is installed (the ``deepspeed`` extra).
"""

from __future__ import annotations

from itertools import product

from memcalc.config import Config, make_config
from memcalc.impls.ring import METHODS
from memcalc.impls.ulysses import WRITTEN_OUT
from memcalc.validation.compare import Check, figures_of

# kernels and their rows per rank (in each a dtype), ranks, methods: small sizes (every rank
# is traced); the reference code of each kernel pins its backend (sdpa_kernel), as the model
# has it. The memory-efficient kernel takes multiples of 64 rows under the ring (its padded
# logsumexp: memcalc.impls.accepted.context_parallel), and float32, which the others do not.
KERNELS = {"sdpa-flash": {256: "bf16", 1000: "fp16"}, "sdpa-cudnn": {256: "bf16", 1000: "fp16"},
           "sdpa-efficient": {256: "bf16", 512: "fp32"}}
RANKS = (2, 3, 4, 8)


def grid() -> list[Config]:
    """The configurations: every (kernel and its rows per rank, P, method), causal, B=1, H=4,
    d=64."""
    return [make_config(impl=kernel, batch=1, heads=4, head_dim=64, dtype=dtype, causal=True,
                        seq_len=P * rows, cp=P, cp_method=method)
            for kernel, rows_dtypes in KERNELS.items() for rows, dtype in rows_dtypes.items()
            for P, method in product(RANKS, METHODS)]


# DeepSpeed-Ulysses: (B, H, Hk, rows per rank, dtype, causal) at each P dividing the heads,
# over each local attention it models. B = 1 and B = 2 take different copies
# (memcalc.impls.ulysses), and the math path's matmuls copy with B = 2 but not with B = 1
# nor one head a rank (P = 8). flash-attn's kernel is its trace stand-in, the model's events.
ULYSSES = ((1, 8, 8, 256, "bf16", True), (2, 8, 8, 1000, "fp16", True),
           (1, 8, 4, 256, "fp16", True), (2, 8, 8, 256, "bf16", False))
# float32, for the local attentions that take it (in float32 the math path saves v itself)
ULYSSES_FP32 = ((1, 8, 8, 256, "fp32", True), (2, 8, 4, 256, "fp32", False))
SDPA_KERNELS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
FP32 = ("sdpa-efficient",) + WRITTEN_OUT


def ulysses_grid(kernels: tuple[str, ...] = SDPA_KERNELS + ("flash-attn",) + WRITTEN_OUT
                 ) -> list[Config]:
    """The DeepSpeed-Ulysses configurations (d = 64), P = 2, 4, 8 where P divides Hk (and
    grouped heads only where the kernel takes them)."""
    from memcalc.impls import get_impl

    return [make_config(impl=kernel, batch=B, heads=H, kv_heads=Hk, head_dim=64, dtype=dtype,
                        causal=causal, seq_len=P * rows, cp=P, cp_method="ulysses")
            for kernel in kernels for P in (2, 4, 8)
            for B, H, Hk, rows, dtype, causal in ULYSSES + (ULYSSES_FP32 * (kernel in FP32))
            if Hk % P == 0 and (Hk == H or get_impl(kernel).gqa)]


def ulysses_checked() -> bool:
    """Whether DeepSpeed is installed, whose own code the Ulysses checks trace."""
    from memcalc.tracing.context_parallel import deepspeed_installed

    return deepspeed_installed()


def rank_call(config: Config) -> tuple:
    """What a rank runs, and its inputs: the implementation's reference code on (B, H,
    N / P, D) shards (torch's ring takes over its SDPA call); under DeepSpeed-Ulysses, inside
    DeepSpeed's ``DistributedAttention`` on (B, N / P, H, D) rows."""
    from memcalc.engine.inputs import QKV
    from memcalc.impls import get_impl
    from memcalc.impls.flash_attn import BNHD
    from memcalc.validation.reference import reference_fn
    from memcalc.validation.reference.ulysses import distributed

    fn = reference_fn(config)
    if get_impl(config.impl).inputs == BNHD:  # flash_attn_func: the trace's stand-in
        fn = _stand_ins(fn)
    if config.cp_method == "ulysses":
        return distributed(fn, heads_first=get_impl(config.impl).inputs != BNHD), BNHD
    return fn, QKV


def _stand_ins(fn):
    """``fn``, importing the flash-attn packages' trace stand-ins
    (``memcalc.tracing.flash_attn``) where it imports them."""
    def call(*args):
        from memcalc.tracing.flash_attn import stand_ins

        with stand_ins():
            return fn(*args)
    return call


def traced_rank(config: Config, rank: int, options=None):
    """The trace of ``rank``'s step (``rank_call``)."""
    from memcalc.tracing import TraceOptions, traced
    from memcalc.tracing.target import Calling

    fn, inputs = rank_call(config)
    return traced(fn, config, options or TraceOptions(), calling=Calling(inputs=inputs),
                  rank=rank).breakdown


def columns(config: Config, rank: int) -> dict[str, dict[str, int]]:
    """The figures of ``rank``'s step beside a live run on one GPU (``validation/cp_one_gpu.py``,
    each rank in turn on a fake process group): ``model``, ``trace`` (the tracer, the
    collectives as NCCL runs them) and ``trace_fake`` (as the fake group does, keeping
    nothing: what the live run must equal)."""
    from memcalc.analysis.predict import rank_breakdown
    from memcalc.tracing import TraceOptions

    return {"trace_fake": figures_of(traced_rank(config, rank, TraceOptions(group="fake"))),
            "trace": figures_of(traced_rank(config, rank)),
            "model": figures_of(rank_breakdown(config, rank))}


def checks(progress=None) -> tuple[Check, ...]:
    """One check per (configuration, rank); the Ulysses ones where DeepSpeed is installed."""
    from memcalc.analysis.predict import rank_breakdown

    configs = grid() + (ulysses_grid() if ulysses_checked() else [])
    pairs = [(c, rank) for c in configs for rank in range(c.cp)]
    if progress is not None:
        pairs = progress(pairs, len(pairs), "validate (context parallel)")
    return tuple(Check(config=c, predicted=figures_of(rank_breakdown(c, rank)),
                       measured=figures_of(traced_rank(c, rank)),
                       case=f"cp rank {rank}", detail=f"rank {rank} of {c.cp}")
                 for c, rank in pairs)



def recorded_config(row: dict, environment: dict[str, str]) -> Config:
    """The configuration of one row of a ``validation/cp_one_gpu.py`` report, on its GPU."""
    from memcalc.validation.cuda import live_config

    config = make_config(impl=row["impl"], batch=row.get("batch", 1), heads=row["heads"],
                         kv_heads=row.get("kv_heads"), head_dim=row["head_dim"],
                         dtype=row["dtype"], causal=row.get("causal", True), seq_len=row["N"],
                         cp=row["P"], cp_method=row["method"])
    return live_config(config, environment)


def recheck(report: dict, every: int = 1) -> list[str]:
    """A recorded one-GPU run of the ring (``validation/cp_one_gpu.py``) against memcalc now:
    of every ``every``-th rank step, the model as the recording's torch ran the ring against
    the trace recorded with it and, as a fake group runs the ring, against the live figures;
    and the fake-group trace now against the live figures where the installed torch's ring
    is the recording's (``memcalc.impls.ring.same_ring``). One line per difference; [] when
    none."""
    from memcalc.impls.ring import same_ring
    from memcalc.impls.sdpa_select import Release
    from memcalc.tracing import TraceOptions

    recorded = Release.of(report["environment"]["torch"]).torch[:2]
    traced = same_ring(recorded)
    differences = []
    for row in report["rows"][::every]:
        config, rank = recorded_config(row, report["environment"]), row["rank"]
        now = {"model": figures_of(recorded_model(config, rank, recorded)),
               "model_fake": figures_of(recorded_model(config, rank, recorded, stash=False))}
        if traced:
            now["trace_fake"] = figures_of(traced_rank(config, rank, TraceOptions(group="fake")))
        pairs = [("model", "trace"), ("model_fake", "live")] + [("trace_fake", "live")] * traced
        differences += [f"{row['impl']} {row['dtype']} P={row['P']} N={row['N']} "
                        f"{row['method']} rank {rank}: {ours} {now[ours]} != recorded "
                        f"{theirs} {row.get(theirs)}"
                        for ours, theirs in pairs if now[ours] != row.get(theirs)]
    return differences


def recorded_model(config: Config, rank: int, torch: tuple[int, int], stash: bool = True):
    """``rank``'s step as the model has it under torch release ``torch``'s ring code, the
    collectives as NCCL runs them or (``stash=False``) as a fake group does; DeepSpeed's
    Ulysses (synchronous all-to-alls, no stash) as ``rank_breakdown`` has it."""
    from memcalc.analysis.predict import rank_breakdown
    from memcalc.impls import ring

    if config.cp_method == "ulysses":
        return rank_breakdown(config, rank)
    d = config.dims.replace(cp_rank=rank)
    return rank_breakdown(config, rank, program=ring.program(d, config.impl, torch, stash))


def main(argv: list[str]) -> int:
    """``python -m memcalc.validation.context_parallel REPORT.json``: exit 0 when memcalc
    gives back every recorded rank step. A report of DeepSpeed-Ulysses' steps is checked
    against DeepSpeed's own code: without DeepSpeed, one line naming the extra, not a trace
    failing on its import."""
    import json

    from memcalc.errors import install

    if len(argv) != 1:
        raise ValueError("give one report: python -m memcalc.validation.context_parallel "
                         "REPORT.json")
    report = json.loads(open(argv[0]).read())
    if any(row.get("method") == "ulysses" for row in report["rows"]) and not ulysses_checked():
        raise ValueError(f"{argv[0]}: DeepSpeed-Ulysses' steps are checked against "
                         f"DeepSpeed's own code, which is not installed: {install('deepspeed')}")
    differences = recheck(report)
    for line in differences:
        print(line)
    print(f"{len(report['rows'])} rank steps recorded on {report['environment']['device']} "
          f"(torch {report['environment']['torch']}), {len(differences)} not given back")
    return 1 if differences else 0


if __name__ == "__main__":
    import sys

    from memcalc.errors import run_main

    run_main(main, sys.argv[1:])
