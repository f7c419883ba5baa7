"""`specsplit calibrate` against real services (tiny models): a policy per task type that the
gateway's policy loader accepts for these models."""

from __future__ import annotations

import asyncio
import json

from conftest import running_stack

from specsplit.cli import parser as _parser
from specsplit.launcher import StackConfig


async def test_calibrate_writes_a_policy_for_every_task_type(models, tmp_path, capsys):
    from specsplit.bench.calibrate import main

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


def _outcome(rounds, tokens: int, decode_ms: float, used: bool):
    from gateway.controller import Outcome, RoundFacts

    return Outcome([RoundFacts(d, a, draft_ms=0.5 * d, verify_ms=10.0, network_ms=0.2) for d, a in rounds],
                   tokens, decode_ms, used)


def test_recommend_reads_the_measured_walls_and_the_controllers_statistics_exactly():
    """Every figure of a recommendation, from hand-made requests: the speedup is tokens/s on over
    off from the walls, the acceptance length the rounds' mean accepted + 1, the cost the draft ms
    per drafted token over the spec-off step, the seed's estimate 1 / (gamma / acc + cost); and
    speculation is recommended exactly when the measured speedup passes 1.02."""
    from gateway.controller import Controller
    from specsplit.bench.calibrate import FORCED, recommend
    from specsplit.serving.settings import ControllerSettings

    controller = Controller(ControllerSettings(gamma_start=3))
    for task, accepted in (("code", 3), ("chat", 0)):
        for _ in range(4):
            controller.observe(task, "model", FORCED, _outcome([(0, 0)] * 9, 10, 90.0, False))  # 10 ms a token
            controller.observe(task, "model", FORCED, _outcome([(3, accepted)] * 3, 3 * (accepted + 1) + 1,
                                                               30.0, True))
    walls = {"code": {"off_s": 2.0, "on_s": 1.0, "off_tokens": 100, "on_tokens": 100},
             "chat": {"off_s": 1.0, "on_s": 1.0, "off_tokens": 100, "on_tokens": 99}}
    table = recommend(controller, walls, "model", 3)
    code, chat = table["code"], table["chat"]
    assert code["measured_speedup"] == 2.0 and chat["measured_speedup"] == 0.99
    assert code["speculate"] and not chat["speculate"]
    assert code["acceptance_length"] == 4.0 and chat["acceptance_length"] == 1.0
    step = controller.state("code", "model").off_time_per_token()
    assert step == 10.0 + 0.2  # a one-row forward and its network time
    assert code["draft_cost_ratio"] == round(0.5 / step, 4)  # 0.5 ms per drafted token
    assert code["seed_estimate"] == round(1 / (3 / 4.0 + 0.5 / step), 3)
    assert code["gamma"] == controller.state("code", "model").best_gamma() and code["calibrated_gamma"] == 3
    assert code["alpha"] == 1.0 and chat["alpha"] == 0.0
