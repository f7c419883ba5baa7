"""How many CPUs this process may use, and so how many threads its model runs on: the scheduler
affinity (taskset, a cpuset) and the cgroup's CPU quota (a container's CPU limit: cgroup v2
`cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), whichever is smaller. torch's default is
every core of the machine, which in a pod pinned to 2 of 64 cores means 64 threads fighting for 2."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def quota(root: Path = CGROUP, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs the cgroup may use (1.5: 150 ms per 100 ms), the tightest of the process's cgroup and
    its ancestors; None: no limit."""
    limits = []
    for directory in _cgroup_dirs(root, proc_cgroup):
        v2 = directory / "cpu.max"
        v1 = (directory / "cpu.cfs_quota_us", directory / "cpu.cfs_period_us")
        try:
            if v2.is_file():
                value, period = v2.read_text().split()[:2]
                if value != "max":
                    limits.append(int(value) / int(period))
            elif v1[0].is_file():
                value, period = int(v1[0].read_text()), int(v1[1].read_text())
                if value > 0:
                    limits.append(value / period)
        except (OSError, ValueError):
            continue
    return min(limits) if limits else None


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[Path]:
    """The process's cgroup directory and its ancestors up to the root (v2 unified, or v1's cpu
    controller); in a container's cgroup namespace the root is the container's own."""
    paths = []
    try:
        for line in proc_cgroup.read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2
                paths.append((root, path))
            elif "cpu" in controllers.split(","):  # v1
                mount = root / "cpu" if (root / "cpu").is_dir() else root / controllers
                paths.append((mount, path))
    except (OSError, ValueError):
        pass
    out = []
    for mount, path in paths or [(root, "/")]:
        here = mount / path.lstrip("/")
        while True:
            out.append(here)
            if here == mount or here.parent == here:
                break
            here = here.parent
    return out


def idle_clock(stat: Path = Path("/proc/stat")):
    """A function giving the seconds the CPUs this process may run on have spent idle so far (the
    kernel's idle and iowait ticks, 10 ms apart), or None: no /proc/stat, or a cgroup quota below
    the affinity (idle CPUs the quota does not give this process would look free)."""
    try:
        mine = os.sched_getaffinity(0)
        limit = quota()
        if limit is not None and math.ceil(limit) < len(mine):
            return None
        tick = os.sysconf("SC_CLK_TCK")
        names = {f"cpu{c}".encode() for c in mine}
        stat.read_bytes()
    except (AttributeError, OSError, ValueError):
        return None

    def idle_s() -> float:
        ticks = 0
        for line in stat.read_bytes().splitlines()[1:]:
            fields = line.split()
            if fields and fields[0] in names:
                ticks += int(fields[4]) + int(fields[5])
        return ticks / tick

    return idle_s


def available() -> tuple[int, str]:
    """(CPUs this process may use, why)."""
    cpus = affinity()
    why = f"affinity {cpus} CPUs"
    limit = quota()
    if limit is None:
        return cpus, why + ", no cgroup CPU limit"
    if math.ceil(limit) < cpus:
        return max(1, math.ceil(limit)), f"cgroup CPU limit {limit:g} (affinity {cpus})"
    return cpus, why + f", cgroup CPU limit {limit:g}"


def threads(requested: int) -> tuple[int, str]:
    """The torch threads to use: `requested` if > 0, else OMP_NUM_THREADS if set, else the
    available CPUs; and why."""
    if requested > 0:
        return requested, "--threads"
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"]), "OMP_NUM_THREADS"
    return available()
