"""One module per ``memcalc`` subcommand.

Each module defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``,
and imports anything heavy inside ``run`` so that the CLI starts fast. ``memcalc.cli``
finds the modules here; adding a command means adding a module.

May import: everything below ``memcalc.cli`` (the top of the flow: parse, call the
library, render); their shared options come from ``memcalc.options``.
"""
