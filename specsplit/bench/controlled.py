"""`specsplit bench --controlled` and `--neighbour`: the controller at work. AUTO requests learn
for a few passes, then each prompt runs spec-off, forced on and AUTO; beside N busy processes (a
noisy neighbour on a shared machine) the bench runs every prompt again, and a spell of AUTO requests
shows what the controller decided while they ran and after."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.bench.workload import Prompt, request

BUSY = " +busy"  # the drafter label of records measured beside the neighbours


class Neighbours:
    """`n` busy processes (a Python spin loop each), the noisy neighbour of a shared machine: paused
    (SIGSTOP) except inside `running()`, so each prompt runs quiet and then busy, back to back."""

    def __init__(self, n: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        for proc in self.procs:
            proc.send_signal(sig)

    @contextlib.contextmanager
    def running(self):
        self._signal(signal.SIGCONT)
        try:
            yield
        finally:
            self._signal(signal.SIGSTOP)

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def print_neighbour(rows: list[dict], n: int) -> None:
    """Per drafter (ALL task types): throughput with the neighbours running over quiet, same run."""
    quiet = {r["drafter"]: r for r in rows if r["task_type"] == "ALL" and not r["drafter"].endswith(BUSY)}
    for r in rows:
        if r["task_type"] == "ALL" and r["drafter"].endswith(BUSY) and r["drafter"][:-len(BUSY)] in quiet:
            q = quiet[r["drafter"][:-len(BUSY)]]
            print(f"{r['drafter'][:-len(BUSY)]} with {n} busy neighbour{'s' * (n != 1)} "
                  f"({n} of {len(os.sched_getaffinity(0))} CPUs taken): spec-off {r['tok_s_off']:.1f} / "
                  f"{q['tok_s_off']:.1f} tok/s quiet = {r['tok_s_off'] / q['tok_s_off']:.2f}x, spec-on "
                  f"{r['tok_s_on']:.1f} / {q['tok_s_on']:.1f} = {r['tok_s_on'] / q['tok_s_on']:.2f}x; on/off "
                  f"busy {r['speedup']:.2f}x, quiet {q['speedup']:.2f}x")


def controlled(stub, prompts: list[Prompt], max_new_tokens: int, repeats: int, learn: int) -> int:
    """The controller at work: `learn` passes of AUTO requests over the workload (it measures and
    decides per task type), then per prompt spec-off, forced spec-on and AUTO back to back."""
    for n in range(learn):
        for i, p in enumerate(prompts, 1):
            out = stub.Generate(request(p, pb.SPECULATION_AUTO, max_new_tokens), timeout=600)
            print(f"learn {n + 1}/{learn} [{i}/{len(prompts)}] {p.task_type:<10} "
                  f"{out.stats.speculation_reason:<9} gamma {out.stats.gamma}", file=sys.stderr, flush=True)
    modes = {"off": pb.SPECULATION_OFF, "on": pb.SPECULATION_ON, "auto": pb.SPECULATION_AUTO}
    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: {m: [0.0, 0] for m in modes})
    reasons: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in range(repeats):
        for i, p in enumerate(prompts, 1):
            order = list(modes) if (i + r) % 2 else list(reversed(modes))
            for mode in order:
                start = time.perf_counter()
                out = stub.Generate(request(p, modes[mode], max_new_tokens), timeout=600)
                for key in (p.task_type, "ALL"):
                    totals[key][mode][0] += time.perf_counter() - start
                    totals[key][mode][1] += len(out.token_ids)
                if mode == "auto":
                    reasons[p.task_type][f"{out.stats.speculation_reason}/g{out.stats.gamma}"] += 1
            print(f"measure [{i}/{len(prompts)}] {p.task_type}", file=sys.stderr, flush=True)
    print(f"specsplit bench --controlled: {len(prompts)} prompts, max_new_tokens={max_new_tokens}, "
          f"learn passes={learn}, measured repeats={repeats}")
    print(f"{'task type':<12}{'tok/s off':>10}{'forced on':>10}{'auto':>8}{'on/off':>8}{'auto/off':>9}  auto decisions")
    for task, t in sorted(totals.items(), key=lambda kv: (kv[0] == "ALL", kv[0])):
        rate = {m: n / s for m, (s, n) in t.items()}
        print(f"{task:<12}{rate['off']:>10.1f}{rate['on']:>10.1f}{rate['auto']:>8.1f}{rate['on'] / rate['off']:>7.2f}x"
              f"{rate['auto'] / rate['off']:>8.2f}x  {dict(reasons.get(task, {})) or ''}")
    return 0


SPELL_S, AFTER = 30.0, 10


def busy_spell(stub, prompts: list[Prompt], max_new_tokens: int, n: int) -> None:
    """The controller under a neighbour: AUTO requests of one task type for SPELL_S seconds beside
    `n` busy processes, then AFTER more with the machine quiet; how many speculated in each."""
    task = next((p.task_type for p in prompts if p.task_type == "code"), prompts[0].task_type)
    mine = [p for p in prompts if p.task_type == task]
    neighbours = Neighbours(n)
    seen: dict[str, list] = {"busy": [], "after": []}
    try:
        with neighbours.running():
            end = time.monotonic() + SPELL_S
            while time.monotonic() < end:
                p = mine[len(seen["busy"]) % len(mine)]
                seen["busy"].append(stub.Generate(request(p, pb.SPECULATION_AUTO, max_new_tokens), timeout=600).stats)
    finally:
        neighbours.close()
    for i in range(AFTER):
        seen["after"].append(stub.Generate(request(mine[i % len(mine)], pb.SPECULATION_AUTO, max_new_tokens),
                                           timeout=600).stats)
    for phase, stats in seen.items():
        reasons = defaultdict(int)
        for st in stats:
            reasons[st.speculation_reason] += 1
        when = f"beside {n} busy for {SPELL_S:.0f} s" if phase == "busy" else "after it"
        print(f"{task} AUTO {when}: {sum(st.speculation_used for st in stats)}/{len(stats)} speculated ("
              + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + ")")


