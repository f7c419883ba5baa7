"""`specsplit calibrate` against real services (tiny models): a policy per task type that the
gateway's policy loader accepts for these models."""

from __future__ import annotations

import asyncio
import json

from conftest import running_stack

from specsplit.cli import parser as _parser
from specsplit.tools.launcher import StackConfig


async def test_calibrate_writes_a_policy_for_every_task_type(models, tmp_path, capsys):
    from specsplit.tools.calibrate import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"task_type": t, "prompt": p}) + "\n" for t, p in (
        ("code", "def add(a, b):"), ("code", "def sub(a, b):"), ("story", "Once upon a time"),
        ("story", "There was a small dragon"))))
    out = tmp_path / "policy.json"
    async with running_stack(tmp_path, "unix", models["target"], models["draft"], default_drafter="model") as stack:
        args = _parser().parse_args(["calibrate", "--gateway", stack.gateway, "--verify", stack.verify, "--draft",
                                     stack.draft, "--prompts", str(prompts), "--max-new-tokens", "24",
                                     "--gamma", "3", "--policy-out", str(out)])
        assert await asyncio.to_thread(main, args, StackConfig()) == 0
    printed = capsys.readouterr().out
    assert "seed est." in printed and "code" in printed and "story" in printed
    policy = json.loads(out.read_text())
    assert policy["target"]["model_fingerprint"] and set(policy["drafters"]) == {"model"}
    for task in ("code", "story"):
        entry = policy["task_types"][task]["model"]
        assert 1 <= entry["gamma"] <= 8 and entry["acceptance_length"] >= 1.0
        assert isinstance(entry["speculate"], bool) and entry["measured_speedup"] > 0
