"""A round's hops, timed across the three processes for `bench --round-overhead`
(docs/benchmarks.md#what-a-round-costs). When SPECSPLIT_HOPS names a file prefix, every process
appends `<CLOCK_MONOTONIC ns> <mark>` lines to `<prefix>.<pid>` where a round passes a hop (one
write a mark, a few microseconds); unset, a mark costs one test. The clock is the machine's, so
marks of co-located processes line up."""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

ENV = "SPECSPLIT_HOPS"
_prefix = os.environ.get(ENV, "")
_fd: int | None = None


def mark(name: str) -> None:
    global _fd
    if not _prefix:
        return
    if _fd is None:
        _fd = os.open(f"{_prefix}.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.write(_fd, b"%d %s\n" % (time.perf_counter_ns(), name.encode()))


def read(prefix: str, since_ns: int = 0) -> list[tuple[int, str]]:
    """Every process's marks under `prefix` from `since_ns` on, in time order."""
    marks = []
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*"):
        for line in path.read_text().splitlines():
            ns, name = line.split(" ", 1)
            if int(ns) >= since_ns:
                marks.append((int(ns), name))
    return sorted(marks)


def table(marks: list[tuple[int, str]], start: str = "gateway.round", only: str = "gateway.to-draft",
          skip: int = 5) -> tuple[int, list[tuple[str, float, int]]]:
    """Rounds split at each `start` mark; of those that passed `only` (rounds that asked the drafter),
    past the first `skip`: per transition between consecutive marks ("a -> b"), its median in
    microseconds and how many rounds had it, in the order rounds pass them. Returns (rounds, rows)."""
    rounds: list[list[tuple[int, str]]] = []
    for ns, name in marks:
        if name == start:
            rounds.append([])
        if rounds:
            rounds[-1].append((ns, name))
    kept = [r for r in rounds[:-1] if any(name == only for _, name in r)][skip:]  # the last may be cut off
    gaps: dict[str, list[float]] = defaultdict(list)
    order: dict[str, float] = {}
    for r in kept:
        for i, ((a_ns, a), (b_ns, b)) in enumerate(zip(r, r[1:])):
            key = f"{a} -> {b}"
            gaps[key].append((b_ns - a_ns) / 1e3)
            order[key] = min(order.get(key, i), i)
    common = [k for k in gaps if len(gaps[k]) >= len(kept) / 2]  # a transition most rounds take
    return len(kept), [(k, statistics.median(gaps[k]), len(gaps[k])) for k in sorted(common, key=order.get)]
