"""``memcalc impls``: the registered implementations."""

HELP = "list the implementations"


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from memcalc.impls import get_impl, impl_names

    table = Table("implementation", "what it is")
    for name in impl_names():
        table.add_row(name, get_impl(name).summary)
    Console().print(table)
    return 0
