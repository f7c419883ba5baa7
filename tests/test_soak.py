"""`specsplit soak` with chaos: many clients while the draft service is SIGKILLed now and then; every
answer must still come, equal to its spec-off reference, and nothing may be left behind."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import write_prompts


def test_soak_with_the_drafter_killed_now_and_then_loses_nothing(models, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "soak", "--target-model", str(models["target"]), "--self-head", "none",
         "--drafter", "ngram", "--dtype", "float32", "--tree-budget", "0", "--prompts",
         str(write_prompts(tmp_path / "p.jsonl")), "--clients", "4", "--minutes", "0.35", "--max-new-tokens", "48",
         "--chaos", "kill", "--chaos-every", "6", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    requests = int(re.search(r"requests (\d+), errors 0 ", out).group(1))
    kills = int(re.search(r"chaos: kill x(\d+)", out).group(1))
    assert requests >= 4 and kills >= 1  # every client answered, the drafter killed (how many: the machine's speed)
    assert "answers differing from spec-off 0" in out
    assert re.search(r"speculation_reason: .*drafter-(lost|down)", out)  # the kills hit requests
    assert "sessions verify 0, draft 0; shared-memory segments 0" in out
    assert "draft service restarted" in done.stderr
