"""Programs made for tests: the shapes of real ones, small enough to reason about."""

from memcalc.engine.program import Program, Role, free, new


def one_event_pair_per_64_rows(d) -> Program:
    """A program whose events grow with N (a loop over chunks of 64 rows), then ``out``."""
    events = []
    for i in range(d.N // 64):
        events += [new(f"c{i}", (d.B, 64, d.D), d.dtype, Role.temporary, "mm"), free(f"c{i}")]
    return Program(tuple(events + [new("out", (d.B, d.N, d.D), d.dtype, Role.output, "mm")]), ())
