"""Threads from the CPUs a process may use: affinity and the cgroup CPU quota (v2 and v1), unless
set; and a stack pinned to one CPU runs each service on one thread and serves."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specsplit.serving import cpus


def _cgroup(tmp_path: Path, lines: str) -> Path:
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(lines)
    return proc


def test_quota_from_cgroup_v2_is_the_tightest_of_the_process_and_its_ancestors(tmp_path):
    root = tmp_path / "cg"
    (root / "kubepods" / "pod1" / "c1").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "kubepods" / "cpu.max").write_text("400000 100000\n")
    (root / "kubepods" / "pod1" / "cpu.max").write_text("150000 100000\n")
    (root / "kubepods" / "pod1" / "c1" / "cpu.max").write_text("max 100000\n")
    proc = _cgroup(tmp_path, "0::/kubepods/pod1/c1\n")
    assert cpus.quota(root, proc) == 1.5
    (root / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")
    assert cpus.quota(root, proc) == 4.0
    (root / "kubepods" / "cpu.max").write_text("max 100000\n")
    assert cpus.quota(root, proc) is None


def test_quota_from_cgroup_v1(tmp_path):
    root = tmp_path / "cg"
    (root / "cpu" / "docker" / "abc").mkdir(parents=True)
    (root / "cpu" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("50000\n")
    (root / "cpu" / "docker" / "abc" / "cpu.cfs_period_us").write_text("100000\n")
    (root / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    proc = _cgroup(tmp_path, "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n")
    assert cpus.quota(root, proc) == 0.5


@pytest.mark.parametrize("affinity, quota, expect, why", [
    (64, 2.0, 2, "cgroup CPU limit 2 (affinity 64)"), (64, 1.5, 2, "cgroup CPU limit 1.5 (affinity 64)"),
    (64, 0.5, 1, "cgroup CPU limit 0.5 (affinity 64)"), (2, None, 2, "affinity 2 CPUs, no cgroup CPU limit"),
    (2, 8.0, 2, "affinity 2 CPUs, cgroup CPU limit 8")])
def test_threads_are_the_smaller_of_affinity_and_quota(monkeypatch, affinity, quota, expect, why):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "affinity", lambda: affinity)
    monkeypatch.setattr(cpus, "quota", lambda: quota)
    assert cpus.threads(0) == (expect, why)
    assert cpus.threads(3) == (3, "--threads")  # a user's choice wins
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert cpus.threads(0) == (5, "OMP_NUM_THREADS")


@pytest.fixture
def one_cpu_quota():
    """A real cgroup (v1's cpu controller, or v2) limited to 1 CPU (a quota, not an affinity: the
    process still sees every CPU; fractions are rounded up, tested above); its tasks file, for a process
    to join. Skipped, saying why, where this process may not make one (not root, a read-only
    /sys/fs/cgroup)."""
    import contextlib

    made = None
    for root, limit in ((Path("/sys/fs/cgroup/cpu"), {"cpu.cfs_quota_us": "100000", "cpu.cfs_period_us": "100000"}),
                        (Path("/sys/fs/cgroup"), {"cpu.max": "100000 100000"})):
        group = root / f"specsplit-test-{os.getpid()}"
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            for name, value in limit.items():
                (group / name).write_text(value)
            made = group
            break
        except OSError:
            group.rmdir()
    if made is None:
        pytest.skip("no cgroup this process may create (root and a writable /sys/fs/cgroup are needed)")
    try:
        yield made / ("tasks" if (made / "tasks").exists() else "cgroup.procs")
    finally:
        with contextlib.suppress(OSError):
            made.rmdir()


@pytest.mark.parametrize("confine", ["affinity", "cgroup", "pinned"])
def test_a_stack_confined_to_one_cpu_runs_one_thread_per_service_and_serves(models, tmp_path, request, confine):
    # affinity: as `taskset -c 0 specsplit up`; cgroup: a real CPU quota of 1, as a container's limit;
    # pinned: `up --pin verify=0 --pin draft=0 --pin gateway=0`, each service pinning itself (serve --cpus)
    join = {"affinity": "os.sched_setaffinity(0, {0})", "pinned": "",
            "cgroup": f"open({str(request.getfixturevalue('one_cpu_quota'))!r}, 'w').write(str(os.getpid()))"
            if confine == "cgroup" else ""}[confine]
    pins = {"verify": "0", "draft": "0", "gateway": "0"} if confine == "pinned" else {}
    script = textwrap.dedent(f"""
        import os, grpc
        {join}
        from specsplit.launcher import Stack, StackConfig
        from specsplit.api.gateway.v1 import gateway_pb2 as pb, gateway_pb2_grpc as pbg
        with Stack(StackConfig(target_model={str(models["target"])!r}, draft_model={str(models["draft"])!r},
                               dtype="float32", draft_dtype="float32", drafter="ngram", self_head="none",
                               run_dir={str(tmp_path / "up")!r}, pins={pins!r})) as stack:
            with grpc.insecure_channel(stack.start()) as ch:
                out = pbg.GatewayStub(ch).Generate(pb.GenerateRequest(text="def add(a, b):", max_new_tokens=8,
                                                                      speculation=pb.SPECULATION_ON), timeout=60)
            assert out.stats.generated_tokens == 8 and out.stats.speculation_used
            logs = {{n: open({str(tmp_path / "up")!r} + f"/{{n}}.log").read() for n in ("verify", "draft", "gateway")}}
        for name, log in logs.items():
            print(name, [line.split(name + ":", 1)[1] for line in log.splitlines()
                         if "torch thread" in line or "no model compute" in line])
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SPECSPLIT_THREADS")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("verify", "draft"):
        line = next(line for line in done.stdout.splitlines() if line.startswith(name))
        assert " 1 torch thread (" in line, line
    gateway = next(line for line in done.stdout.splitlines() if line.startswith("gateway"))
    assert "torch not loaded" in gateway, gateway  # it computes nothing: no torch, no threads of its own
    verify = next(line for line in done.stdout.splitlines() if line.startswith("verify"))
    assert ("cgroup CPU limit 1 " if confine == "cgroup" else "affinity 1 CPUs") in verify, verify


def test_idle_clock_sums_the_idle_and_iowait_ticks_of_the_cpus_this_process_may_run_on(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2})
    monkeypatch.setattr(cpus, "quota", lambda: None)
    stat = tmp_path / "stat"
    tick = os.sysconf("SC_CLK_TCK")

    def write(idle0: int, idle2: int) -> None:  # user nice system idle iowait ...
        stat.write_text(f"cpu  9 9 9 {idle0 + idle2 + 500} 9 0 0\ncpu0 1 0 1 {idle0} 3 0 0\n"
                        f"cpu1 1 0 1 500 0 0 0\ncpu2 1 0 1 {idle2} 0 0 0\nintr 1 2 3\n")

    write(100, 200)
    idle = cpus.idle_clock(stat)
    assert idle() == (100 + 3 + 200) / tick  # cpu1 is not this process's
    write(150, 260)
    assert idle() == (150 + 3 + 260) / tick
    monkeypatch.setattr(cpus, "quota", lambda: 1.0)  # a quota of one CPU of the two: idle ones may not be ours
    assert cpus.idle_clock(stat) is None
    assert cpus.idle_clock(tmp_path / "absent") is None
