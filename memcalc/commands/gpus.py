"""``memcalc gpus``: the GPU presets and where their figures come from."""

HELP = "list the GPU presets"


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    from memcalc.options import show
    from memcalc.gpus import MEMORY_KINDS, gpu_presets
    from memcalc.output.render import Column, rich_table
    from memcalc.engine.units import human

    columns = [
        Column("name", lambda g: g.name),
        Column("device", lambda g: g.label, wrap=True, drop=3),
        Column("cc", lambda g: ".".join(map(str, g.compute_capability)), drop=4),
        Column("memory (B)", lambda g: g.memory_bytes, "right"),
        Column("size", lambda g: human(g.memory_bytes), "right", drop=1),
        Column("from", lambda g: g.memory_kind, drop=2),
        Column("nvidia-smi total (B)", lambda g: g.smi_memory_bytes or "-", "right", drop=5),
        Column("source", lambda g: g.source, wrap=True, drop=6),
    ]
    kinds = "; ".join(f"{kind}: {what}" for kind, what in MEMORY_KINDS.items() if kind != "given")
    show(rich_table("GPU presets: the budget is the memory PyTorch can use less --reserve "
                    "(default 512 MiB for the CUDA context)", columns, gpu_presets().values(),
                    [f"memory, from {kinds}"]))
    return 0
