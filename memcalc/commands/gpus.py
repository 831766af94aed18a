"""``memcalc gpus``: the GPU presets and where their figures come from."""

HELP = "list the GPU presets"


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from memcalc.gpus import gpu_presets
    from memcalc.units import human

    table = Table("name", "device", "cc", "memory (bytes)", "", "source")
    for g in gpu_presets().values():
        cc = ".".join(map(str, g.compute_capability))
        table.add_row(g.name, g.label, cc, str(g.memory_bytes), human(g.memory_bytes), g.source)
    Console().print(table)
    return 0
