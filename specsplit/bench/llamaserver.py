"""llama-server end to end: the anchor users actually run. With `bench --anchor-llama-cpp DIR` and a
build holding bin/llama-server, the server is started on the target's GGUF file (plain, then with
its own speculation: the draft model's GGUF as `-md`, or draft-free `--spec-type ngram-mod` when
there is no draft model), and the bench's chat prompts go over its OpenAI API one at a time, as a
client sends them: greedy, the same token budget, no prompt cache (`cache_prompt: false`), wall time
per request with prompt processing. Our rows are set beside these, per task type."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.errors import UsageError


@dataclass
class Served:
    """One mode's totals over a task type's prompts: tokens generated, wall seconds, drafts, and
    each prompt's processing time as the server reports it (its timings.prompt_ms)."""

    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    prompt_ms: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def modes(target_gguf: Path, draft_gguf: Path | None) -> dict[str, list[str]]:
    """What llama-server runs: plain, and with the speculation a user of it would turn on."""
    if draft_gguf is not None:
        return {"plain": [], "draft": ["-md", str(draft_gguf), "--spec-draft-n-max", "8"]}
    return {"plain": [], "ngram-mod": ["--spec-type", "ngram-mod"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process on a free local port, stopped on exit."""

    def __init__(self, build: str, gguf: Path, extra: list[str], threads: int = 2, context: int = 8192,
                 start_timeout_s: float = 600.0):
        tool = Path(build) / "bin" / "llama-server"
        if not tool.is_file():
            raise UsageError(f"--anchor-llama-cpp {build}: no bin/llama-server there "
                             "(build it: docs/benchmarks.md, 'llama.cpp as an anchor')")
        if not gguf.is_file():
            raise UsageError(f"--anchor-llama-cpp: the target has no GGUF file at {gguf}")
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._cmd = [str(tool), "-m", str(gguf), "-t", str(threads), "-c", str(context), "--host", "127.0.0.1",
                     "--port", str(self.port), *extra]
        self._timeout_s = start_timeout_s
        self._proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self._proc = subprocess.Popen(self._cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self._proc.returncode}): "
                                   f"{self._proc.stderr.read()[-400:].strip()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.__exit__()
        raise TimeoutError(f"llama-server did not answer /health within {self._timeout_s:.0f} s")

    def __exit__(self, *exc) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def chat(self, prompt: str, max_tokens: int, timeout_s: float = 900.0) -> tuple[int, float, int, int, float]:
        """One chat request: (tokens generated, wall seconds, drafted, accepted, prompt processing ms)."""
        body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                           "temperature": 0, "seed": 0, "cache_prompt": False}).encode()
        request = urllib.request.Request(f"{self.url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            answer = json.loads(r.read())
        seconds = time.perf_counter() - start
        timings = answer.get("timings") or {}
        return (int(answer["usage"]["completion_tokens"]), seconds, int(timings.get("draft_n", 0)),
                int(timings.get("draft_n_accepted", 0)), float(timings.get("prompt_ms", 0.0)))


def run(build: str, target_gguf: Path, draft_gguf: Path | None, prompts, max_tokens: int,
        threads: int = 2) -> dict[str, dict[str, Served]]:
    """mode -> task type (and "ALL") -> totals, each mode's server warmed by one request first."""
    out: dict[str, dict[str, Served]] = {}
    for mode, extra in modes(target_gguf, draft_gguf).items():
        totals = out[mode] = {}
        with LlamaServer(build, target_gguf, extra, threads) as server:
            server.chat(prompts[0].prompt, 8)
            for p in prompts:
                tokens, seconds, drafted, accepted, prompt_ms = server.chat(p.prompt, max_tokens)
                for key in (p.task_type, "ALL"):
                    t = totals.setdefault(key, Served())
                    t.tokens, t.seconds = t.tokens + tokens, t.seconds + seconds
                    t.drafted, t.accepted = t.drafted + drafted, t.accepted + accepted
                    t.prompt_ms.append(prompt_ms)
    return out


def print_table(served: dict[str, dict[str, Served]], rows: list[dict]) -> None:
    """llama-server per task type beside our spec-off and each drafter's rate (from the bench's rows)."""
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    on = {(r["drafter"], r["task_type"]): r["tok_s_on"] for r in rows}
    off = {r["task_type"]: r["tok_s_off"] for r in rows}
    names = list(served)
    print("llama-server end to end (the same GGUF file(s), chat prompts over its OpenAI API, greedy, the same "
          "token budget, no prompt cache; tok/s = tokens / wall time incl. prompt processing; run before the stack)")
    print(f"{'task type':<12}" + "".join(f" {'server ' + n:>18}" for n in names) + f" {'ours off':>9} {'/plain':>7}"
          + "".join(f" {d + ' on':>16} {'/plain':>7} {'/' + names[-1]:>10}" for d in drafters))
    for task in sorted(served[names[0]], key=lambda k: k == "ALL"):
        rates = [served[n].get(task, Served()).tok_s for n in names]
        plain, spec = rates[0], rates[-1]
        line = f"{task:<12}" + "".join(f" {r:>18.1f}" for r in rates)
        ours_off = off.get(task)
        line += f" {ours_off:>9.1f} {ours_off / plain:>6.2f}x" if ours_off and plain else f" {'-':>9} {'-':>7}"
        for d in drafters:
            rate = on.get((d, task))
            line += (f" {rate:>16.1f} {rate / plain:>6.2f}x {rate / spec:>9.2f}x" if rate and plain and spec
                     else f" {'-':>16} {'-':>7} {'-':>10}")
        print(line)
    plain = served[names[0]].get("ALL", Served()).prompt_ms
    # The bench's rows carry our spec-off prompt processing (every drafter's: the same runs); --traffic's do not.
    ours = next((r["prefill_ms_off"] for r in rows if r["task_type"] == "ALL" and "prefill_ms_off" in r), None)
    if plain and ours is not None and all(plain):
        print(f"prompt processing, median per prompt (cold; the server's timings.prompt_ms, our stats.prefill_ms "
              f"spec-off): llama-server {statistics.median(plain):.1f} ms, ours {ours:.1f} ms "
              f"({ours / statistics.median(plain):.2f}x its time)")
    for n in names[1:]:
        t = served[n].get("ALL", Served())
        if t.drafted:
            print(f"llama-server {n}: {t.accepted}/{t.drafted} drafted tokens accepted")
