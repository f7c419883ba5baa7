"""End to end on the real default model (SmolLM2-135M-Instruct), each service its own process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from conftest import spawn_up
from transformers import AutoTokenizer

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.bench.workload import load_prompts
from specsplit.launcher import Stack, StackConfig
from specsplit.model import catalog

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def default_model() -> Path:
    return catalog.resolve(catalog.DEFAULT)


def one_prompt_per_task() -> list:
    return load_prompts(None, limit=1)


def generate(stub, prompt: str, speculation: int, **kw) -> pb.GenerateResponse:
    req = pb.GenerateRequest(max_new_tokens=kw.pop("max_new_tokens", 48), speculation=speculation, **kw)
    req.chat.messages.add(role="user", content=prompt)
    return stub.Generate(req, timeout=300)


# transports and dtypes are independent here: each is met once (a stack of the default model is ~30 s)
@pytest.mark.parametrize("transport,dtype", [("unix", "bfloat16"), ("tcp", "float32")])
def test_greedy_speculation_is_token_identical_on_the_default_model(default_model, tmp_path, transport, dtype):
    # The draft is the target itself, in bf16 with every id: it should agree almost always.
    config = StackConfig(transport=transport, dtype=dtype, draft_model="default", draft_dtype="bfloat16",
                         draft_quantize="", draft_vocab=0, run_dir=str(tmp_path))
    with Stack(config) as stack:
        address = stack.start()
        assert address.startswith("unix://") == (transport == "unix")
        # The gateway computes nothing and never loads torch (gateway.main.load_tokenizer).
        maps = Path(f"/proc/{stack.procs['gateway'].pid}/maps").read_text()
        assert "libtorch" not in maps and "libtorch" in Path(f"/proc/{stack.procs['verify'].pid}/maps").read_text()
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.GatewayStub(channel)
            for p in one_prompt_per_task():
                off = generate(stub, p.prompt, pb.SPECULATION_OFF)
                on = generate(stub, p.prompt, pb.SPECULATION_ON, drafter="ngram")
                assert list(on.token_ids) == list(off.token_ids), p.task_type
                assert on.stats.exact
            # The target drafting for itself (bf16, SDPA) agrees almost always.
            p = one_prompt_per_task()[0]
            self_drafted = generate(stub, p.prompt, pb.SPECULATION_ON, drafter="model", gamma=4)
            assert list(self_drafted.token_ids) == list(generate(stub, p.prompt, pb.SPECULATION_OFF).token_ids)
            rounds = [(r.drafted, r.accepted, r.depth, round(r.draft_ms, 1)) for r in self_drafted.stats.round_records]
            # Judged on the rounds that drafted (a slow Propose overruns its budget and the round
            # goes on without drafts: how often depends on the machine's speed, not on agreement).
            # A tree's round drafts branches beside its path: agreement is accepted tokens over its depth.
            drafted = [(r.depth, r.accepted) for r in self_drafted.stats.round_records if r.drafted]
            assert drafted and sum(a for _, a in drafted) >= 0.75 * sum(d for d, _ in drafted), rounds


def test_shipped_self_draft_is_exact_and_accepted_on_the_default_model(default_model, tmp_path):
    """The committed head for the default target: loaded by `auto` in both services, its fingerprint
    matches the converted model, outputs equal spec-off, and its drafts are accepted on code: greedy
    in the verifier (no draft service in the round), sampled in the draft service."""
    with Stack(StackConfig(transport="unix", drafter="hybrid", run_dir=str(tmp_path))) as stack:
        with grpc.insecure_channel(stack.start()) as channel:
            stub = pb_grpc.GatewayStub(channel)
            # Code (the head's drafts accepted) and open questions (the hardest to draft): the
            # greedy test above meets every task type.
            for p in [p for p in one_prompt_per_task() if p.task_type in ("code", "open")]:
                off = generate(stub, p.prompt, pb.SPECULATION_OFF)
                for drafter in ("self", "hybrid"):
                    on = generate(stub, p.prompt, pb.SPECULATION_ON, drafter=drafter)
                    assert list(on.token_ids) == list(off.token_ids), (p.task_type, drafter)
                    if p.task_type == "code" and drafter == "self":  # greedy: the verifier's own head drafts
                        rounds = on.stats.round_records
                        seen = [(r.head_drafted, r.head_accepted, r.head_steps) for r in rounds]  # for a failure
                        assert sum(r.head_accepted for r in rounds) > 0 and not any(r.drafted for r in rounds), seen
                # Sampling at temperature 0.8: coupled verification keeps the seed's text whatever
                # the drafter; rejection verification reproduces itself for a seed when the drafts
                # do (the self drafter; the hybrid's store of earlier outputs changes its drafts).
                sampling = pb.SamplingParams(temperature=0.8, seed=7)
                off = generate(stub, p.prompt, pb.SPECULATION_OFF, sampling=sampling)
                on = generate(stub, p.prompt, pb.SPECULATION_ON, drafter="hybrid", sampling=sampling)
                assert list(on.token_ids) == list(off.token_ids), (p.task_type, "coupled")
                rejection = pb.SamplingParams(temperature=0.8, seed=7, method=2)
                runs = [generate(stub, p.prompt, pb.SPECULATION_ON, drafter="self", sampling=rejection)
                        for _ in range(2)]
                assert list(runs[0].token_ids) == list(runs[1].token_ids)
                assert runs[0].stats.accepted_tokens > 0 and runs[0].stats.verify_method == "rejection"


def _spawn_up(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "SPECSPLIT_CACHE": os.environ.get("SPECSPLIT_CACHE", str(Path.home() / ".cache/specsplit"))}
    return spawn_up(tmp_path, list(flags), start_new_session=True, env=env)


def test_up_generate_and_stop_as_a_process_group(default_model, tmp_path):  # TCP: the greedy test above
    proc, address = _spawn_up(tmp_path, "--transport", "unix")
    try:
        out = subprocess.run([sys.executable, "-m", "specsplit.cli", "generate", "--gateway", address, "--json",
                              "--max-new-tokens", "12", "--task-type", "open", "Say hello."],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        response = json.loads(out.stdout)
        assert 0 < len(response["tokenIds"]) == response["stats"]["generatedTokens"] <= 12
        tokenizer = AutoTokenizer.from_pretrained(default_model, local_files_only=True)
        assert response["text"] == tokenizer.decode(response["tokenIds"], skip_special_tokens=True)
        assert response["stats"]["taskType"] == "open"
        sampled = [json.loads(subprocess.run(
            [sys.executable, "-m", "specsplit.cli", "generate", "--gateway", address, "--json",
             "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "3", *flags, "Say hello."],
            capture_output=True, text=True, timeout=120, check=True).stdout) for flags in ([], ["--no-spec"])]
        assert sampled[0]["tokenIds"] == sampled[1]["tokenIds"] and sampled[0]["stats"]["seed"] == "3"
        bad = subprocess.run([sys.executable, "-m", "specsplit.cli", "generate", "--gateway", address,
                              "--gamma", "99", "hi"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # what a terminal's Ctrl-C or a supervisor does
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # nothing outlives the test, and the failure says why
            proc.wait(timeout=30)
            raise AssertionError("`specsplit up` did not stop within 30 s of SIGTERM") from None
    assert proc.returncode == 0, proc.stderr.read()
    assert not list(tmp_path.glob("*.sock")), "sockets left behind"
    children = subprocess.run(["pgrep", "-f", "--", f"--address-file {tmp_path}"], capture_output=True, text=True)
    assert children.stdout == "", "service processes left behind"
