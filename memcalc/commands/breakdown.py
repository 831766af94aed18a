"""``memcalc breakdown``: what one forward and backward step allocates."""

from memcalc.cli import config_from, emit, format_options, shape_options

HELP = "what one forward+backward step allocates, by component"


def add_arguments(parser) -> None:
    shape_options(parser)
    format_options(parser)


def run(args) -> int:
    from memcalc.timeline import predict

    emit(predict(config_from(args)), args.format)
    return 0
