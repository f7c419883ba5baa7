"""`specsplit validate` through the real services: the report, the verdicts, the quantization matrix
and a policy the gateway then starts from; the verdict rule; bad prompt files in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.bench.validate import TaskVerdict, decide
from specsplit.launcher import Stack, StackConfig

PROMPTS = [{"task_type": "code", "prompt": "def add(a, b):", "id": 1, "source": "mine"},
           {"task_type": "code", "prompt": "def sub(a, b):", "id": 2},
           {"task_type": "chat", "prompt": "Once upon a time", "id": 3},
           {"task_type": "chat", "prompt": "The quick brown fox", "id": 4}]


def reference_perplexity(model_dir: Path) -> float:
    """The fixed text's perplexity under transformers' float32 forward (tokens after the first),
    cut to the model's context as validate cuts it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specsplit.bench.validate import perplexity_text

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = perplexity_text(tokenizer, model.config.max_position_embeddings)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return float(torch.exp(-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()))


def _validate(models, tmp_path: Path, prompts: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specsplit.cli", "validate", "--target-model", str(models["target"]),
                           "--draft-model", str(models["draft"]), "--dtype", "float32", "--draft-dtype", "float32",
                           "--self-head", "none", "--drafter", "ngram", "--prompts", str(prompts),
                           "--out", str(tmp_path / "out"), "--max-new-tokens", "12", "--run-dir", str(tmp_path / "run"),
                           *extra], capture_output=True, text=True, timeout=600)


def test_validate_writes_the_report_and_a_policy_the_gateway_starts_from(models, tmp_path):
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))  # extra keys: ignored
    # A gate no drafter reaches: every task type's verdict is off, so the policy must switch
    # speculation off for AUTO requests (a fresh controller starts with it on).
    done = _validate(models, tmp_path, prompts, "--gate", "1000")
    assert done.returncode == 0, done.stderr[-3000:]
    from specsplit.model import native

    assert f"kernel path: {native.describe()}" in done.stdout  # the stack ran here, on this path
    out = tmp_path / "out"
    report = (out / "report.md").read_text()
    for heading in ("## Verdicts", "## Per task type", "## Acceptance length by output position",
                    "## Quantization and speculation"):
        assert heading in report
    assert "| code | **off** | acceptance length" in report and "| chat | **off** |" in report
    for weights in ("| float32 |", "| q8_0 |", "| q4_0 |"):
        assert weights in report
    # Each format's perplexity on the fixed text; the float32 row's is transformers' own.
    ppl = {line.split("|")[1].strip(): float(line.split("|")[-2]) for line in report.splitlines()
           if line.startswith(("| float32 |", "| q8_0 |", "| q4_0 |"))}
    assert abs(ppl["float32"] - reference_perplexity(models["target"])) < 0.01 * ppl["float32"], ppl
    assert all(1 < p < 1e6 for p in ppl.values()) and ppl["q4_0"] != ppl["float32"], ppl
    assert "| code | 2 |" in report and "2/2 | 2/2 |" in report  # greedy and seeded: on equals off
    for plot in ("acceptance_by_position.png", "latency.png", "quantization.png"):
        assert (out / plot).read_bytes().startswith(b"\x89PNG")
    document = json.loads((out / "policy.json").read_text())
    assert set(document["task_types"]) == {"code", "chat"}
    assert all(entry["ngram"]["speculate"] is False for entry in document["task_types"].values())
    assert "validate" in done.stderr  # the progress bar
    with Stack(StackConfig(target_model=str(models["target"]), draft_model=str(models["draft"]), dtype="float32",
                           draft_dtype="float32", drafter="ngram", self_head="none", run_dir=str(tmp_path / "up"),
                           policy=str(out / "policy.json"))) as stack:
        with grpc.insecure_channel(stack.start()) as channel:
            stub = pb_grpc.GatewayStub(channel)
            for task in ("code", "chat", "unseen"):
                req = pb.GenerateRequest(text="def add(a, b):", max_new_tokens=8, task_type=task)
                stats = stub.Generate(req, timeout=60).stats
                # The policy's verdicts start the gateway's states: its two types are off (each request
                # is still judged by its own gate: controller.md#per-request); a new type is on.
                assert stats.speculation_reason == ("on" if task == "unseen" else "disabled"), task
        assert "ignoring it" not in (tmp_path / "up" / "gateway.log").read_text()


def test_a_bad_prompts_file_is_one_clear_line(models, tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"task_type": "code", "prompt": "def f():"}\n{"prompt": 3}\n')
    done = _validate(models, tmp_path, prompts)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == \
        f"specsplit validate: {prompts}:2: need an object with string fields task_type and prompt"
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # nothing started


def _verdict(**kw) -> TaskVerdict:
    base = {"task_type": "t", "n": 5, "acceptance": 2.5, "p50_off": 1.0, "p50_on": 0.7, "p95_off": 1.2,
            "p95_on": 0.9, "speedup": 1.4, "greedy_identical": 5, "sampled_identical": 5,
            "by_position": [(0, 2.6, 10), (16, 2.4, 10)], "prefill_ms": 10, "decode_ms": 500, "draft_share": 0.1,
            "gamma": 4}
    return TaskVerdict(**{**base, **kw})


@pytest.mark.parametrize("kw, verdict, why", [
    ({}, "on", "2.50 >= 2.0"),
    ({"acceptance": 1.6}, "off", "1.60 < gate 2.0"),
    ({"p95_on": 1.3}, "off", "P95 on 1.30 s > off 1.20 s"),
    ({"by_position": [(0, 3.0, 10), (16, 1.5, 10)]}, "adaptive", "1.50 in the last output positions"),
    ({"by_position": [(0, 3.0, 10), (16, 1.5, 2)]}, "on", "2.50 >= 2.0"),  # two rounds decide nothing
    ({"speedup": 1.02}, "adaptive", "only 1.02x"),
])
def test_the_verdict_rule(kw, verdict, why):
    got, reason = decide(_verdict(**kw), 2.0)
    assert got == verdict and why in reason, reason
