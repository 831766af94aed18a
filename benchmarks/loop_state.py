"""Does the chunked loop's allocator state repeat? The measurement behind the engine's limits.

A replay could skip ahead exactly over a loop whose allocator state repeats up to an
address shift: the cost of a period instead of N. This replays ``linear-causal-chunked``
(the protocol's warm-up step, where every small-pool decision is made) and reports:

* forward: the first chunk whose small pool repeats an earlier chunk's: its free blocks
  within 4 MiB of the newest small segment and the one temporary a chunk leaves to the
  next, relative to that segment, and the sizes of the free blocks farther back (a 512 B
  hole near the start is reused by every chunk: the state repeats in the order of its
  addresses, not by one shift); the period in chunks and in 2 MiB segments;
* backward, per slice of chunks: the small segments left wholly free, the free blocks,
  and where the chunk's allocations land: within 4 MiB of the chunk's own saved scores
  (``near``), below them or above them. A loop that repeated would show the same shares in
  every slice.

Run from the repository root: ``python benchmarks/loop_state.py --seq 1000000`` (10 s).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

from memcalc.engine.allocator import MiB
from memcalc.config import make_config
from memcalc.impls import get_impl
from memcalc.engine.replay import Ledger, replay

NEAR = 4 * MiB  # an allocation this close to the chunk's scores is the chunk's own front
SLICES = 8


class Observer(Ledger):
    """The protocol's ledger, watching the warm-up's chunks (by their tensors' names)."""

    def __init__(self, workspace_bytes: int, chunks: int):
        super().__init__(workspace_bytes)
        self.label, self.chunks = "", chunks
        self.seen: dict[tuple, int] = {}
        self.period: tuple[int, int, int] | None = None  # first chunk, chunks, segments
        self.scores_at: int | None = None  # address of the backward chunk's scores
        self.slices: list[Counter] = [Counter() for _ in range(SLICES)]
        self.chunk = 0

    def phase(self, label: str) -> None:
        self.label = label
        super().phase(label)

    def alloc(self, key, item, stream: int = 0) -> None:
        if self.label == "warm-up" and isinstance(key, str):
            self._observe(key)
        super().alloc(key, item, stream)
        if self.scores_at is not None and isinstance(key, str):
            self._place(self.live[key].block)

    def _observe(self, name: str) -> None:
        """At a chunk's first forward tensor, the forward's state; at its first backward
        tensor of the output's node, the backward's counts."""
        if (m := re.fullmatch(r"qk(\d+)", name)) and self.period is None:
            self._forward_state(int(m.group(1)))
        elif m := re.fullmatch(r"a/b(\d+)", name):
            self.chunk = int(m.group(1))
            self.scores_at = self.live[f"S{self.chunk}"].block.addr
            self._backward_counts()

    def _small_segments(self) -> list:
        return [s for s in self.allocator.segments if s.small]

    def _forward_state(self, i: int) -> None:
        segments = self._small_segments()
        if not segments:
            return
        top = segments[-1].addr
        free = sorted((b.addr - top, b.size) for b in self.allocator.pool(True))
        temporary = self.live.get(f"n{i - 1}")
        state = (tuple(f for f in free if f[0] > -NEAR),
                 tuple(sorted(Counter(size for at, size in free if at <= -NEAR).items())),
                 temporary.block.addr - top if temporary else None)
        if state in self.seen:
            first, count = self.seen[state]
            self.period = (first, i - first, len(segments) - count)
        self.seen[state] = (i, len(segments))

    def _slice(self) -> Counter:
        return self.slices[min(SLICES - 1, (self.chunks - 1 - self.chunk) * SLICES // self.chunks)]

    def _backward_counts(self) -> None:
        counts = self._slice()
        if "chunks" not in counts:
            segments = self._small_segments()
            counts["wholly free at start"] = sum(s.is_free() for s in segments)
            counts["free blocks at start"] = len(self.allocator.pool(True))
        counts["chunks"] += 1

    def _place(self, block) -> None:
        if block is None or not block.segment.small or block.segment.addr < 0:
            return
        gap = block.addr - self.scores_at
        self._slice()["near" if abs(gap) < NEAR else "below" if gap < 0 else "above"] += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    config = make_config(impl="linear-causal-chunked", seq_len=args.seq)
    d = config.dims
    observer = Observer(config.workspace_bytes, -(-d.N // d.chunk))
    replay(observer, d, get_impl(config.impl).program(d))
    print(f"linear-causal-chunked, {config.label()}, {observer.chunks:,} chunks of {d.chunk}")
    if observer.period:
        first, chunks, segments = observer.period
        print(f"forward: the small pool at chunk {first + chunks:,} repeats chunk {first:,}'s: "
              f"a period of {chunks:,} chunks, {segments:,} segments of 2 MiB")
    else:
        print("forward: no chunk's small pool repeats an earlier one's")
    print("backward (warm-up), by slices of chunks, last chunk first:")
    print(f"{'chunks':>8} {'wholly free':>12} {'free blocks':>12} {'near':>7} {'below':>7} "
          f"{'above':>7}")
    for c in observer.slices:
        placed = max(1, c["near"] + c["below"] + c["above"])
        print(f"{c['chunks']:>8,} {c['wholly free at start']:>12,} {c['free blocks at start']:>12,}"
              + "".join(f" {c[k] / placed:>6.1%}" for k in ("near", "below", "above")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
