"""``memcalc impls``: the registered implementations."""

HELP = "list the implementations"


def add_arguments(parser) -> None:
    pass


def run(args) -> int:
    from memcalc.options import show
    from memcalc.impls import get_impl
    from memcalc.names import impl_choices
    from memcalc.output.render import Column, rich_table

    columns = [
        Column("implementation", lambda n: n),
        Column("what it is", lambda n: get_impl(n).summary, wrap=True),
        Column("model", lambda n: "traced" if get_impl(n).traced else "from CUDA sources",
               drop=1),
    ]
    show(rich_table("implementations (--impl NAME; lists: --impl a,b or 'all'); "
                               "naive is the custom softmax that keeps exp_x, naive-softmax is "
                               "torch.softmax attention", columns, impl_choices()))
    return 0
