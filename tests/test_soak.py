"""`specsplit soak` with chaos: many clients while the draft service (or a verify replica) is
SIGKILLed now and then; every answer must still come, equal to its spec-off reference, and nothing
may be left behind."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import write_prompts


# The draft service killed once (each kill costs the run a service start, ~17 s here: counts, not
# minutes); a verify replica twice, so that a request may resume on the one killed first.
@pytest.mark.parametrize("chaos, replicas, faults", [("kill", 1, 1), ("kill-verify", 2, 2)])
def test_soak_with_a_service_killed_now_and_then_loses_nothing(models, tmp_path, shm_dir, chaos, replicas,
                                                               faults):
    """The draft service SIGKILLed now and then (requests lose drafts, never answers), or one of two
    verify replicas (requests resume on the other, or on the killed one once restarted). Its own
    shared-memory directory: the segments it counts at the end are its stack's, whatever runs beside."""
    done = subprocess.run(
        # A draft model: n-gram drafts are the verifier's own, and a draft service's death would not touch them.
        [sys.executable, "-m", "specsplit.cli", "soak", "--target-model", str(models["long"]), "--self-head", "none",
         "--drafter", "model", "--draft-model", str(models["draft"]), "--draft-dtype", "float32", "--dtype", "float32",
         "--tree-budget", "0", "--prompts",
         str(write_prompts(tmp_path / "p.jsonl")), "--clients", "4", "--minutes", "2", "--max-new-tokens", "200",
         "--chaos", chaos, "--chaos-every", "4", "--faults", str(faults), "--verify-replicas", str(replicas),
         "--request-drafter", "model", "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    requests = int(re.search(r"requests (\d+), errors \(requests lost\) 0 ", out).group(1))
    kills = int(re.search(rf"chaos: {chaos} x(\d+)", out).group(1))
    assert requests >= 4 and kills == faults  # every client answered; the service killed, then the run ended
    assert "answers differing from spec-off 0" in out
    assert "sessions verify 0, draft 0; shared-memory segments 0" in out
    if chaos == "kill":
        assert re.search(r"speculation_reason: .*drafter-(lost|down)", out)  # the kills hit requests
        assert "draft service restarted" in done.stderr
    else:
        assert re.search(r"verify(-2)? service restarted", done.stderr), done.stderr[-2000:]
        assert re.search(r"resumed \d+ request", out), out  # the kills hit requests, which went on
