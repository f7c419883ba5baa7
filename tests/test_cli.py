"""A user's mistake on the command line gets one line naming it and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "bad.jsonl").write_text('{"task_type": "code", "prompt": "a"}\n{"task_type": "code", "prompt": \n')
    (d / "noprompt.jsonl").write_text('{"task_type": "code"}\n')
    (d / "empty-token").write_text("\n")
    return d


CASES = [
    (["bench", "--gamma", "x"], "argument --gamma: invalid int value"),
    (["bench", "--tree-budgets", "1,eight"], "argument --tree-budgets: expected comma-separated integers"),
    (["bench", "--rtts", "0,fast", "--topology"], "argument --rtts: expected comma-separated numbers"),
    (["bench", "--prompts", "{d}/missing.jsonl", "--gateway", "127.0.0.1:1"], "No such file or directory"),
    (["bench", "--prompts", "{d}/bad.jsonl", "--gateway", "127.0.0.1:1"], "bad.jsonl:2: not JSON"),
    (["calibrate", "--prompts", "{d}/noprompt.jsonl", "--gateway", "127.0.0.1:1"],
     "noprompt.jsonl:1: need an object with string fields task_type and prompt"),
    (["distill", "--out", "{d}/out", "--prompts", "{d}/bad.jsonl"], "bad.jsonl:2: not JSON"),
    (["distill", "--out", "{d}/out", "--stages", "generate,polish"], "unknown stages ['polish']"),
    (["distill", "--out", "{d}/out", "--data-fractions", "half"], "expected comma-separated numbers"),
    (["up", "--target-model", "{d}/no-model"], "nor a local HF model directory"),
    (["serve", "verify", "--target-model", "{d}/no-model"], "nor a local HF model directory"),
    (["trace-report", "--file", "{d}/missing.jsonl"], "No such file or directory"),
    (["serve", "gateway", "--verify", "127.0.0.1:1", "--draft", "127.0.0.1:1", "--auth-token-file", "{d}/empty-token"],
     "the auth token file is empty"),
    (["generate", "hi", "--gateway", "127.0.0.1:1", "--auth-token-file", "{d}/missing"], "No such file"),
    (["generate"], "the following arguments are required: prompt"),
    (["serve"], "the following arguments are required: role"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(c[0][:2]) + f"#{i}" for i, c in enumerate(CASES)])
def test_a_bad_flag_or_file_gets_one_line_and_exit_code_2(files, args, message):
    done = subprocess.run([sys.executable, "-m", "specsplit.cli", *(a.format(d=files) for a in args)],
                          capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in done.stderr, done.stderr


async def test_generate_prints_the_text_then_a_summary_plain_streamed_or_as_json(models, tmp_path, capsys):
    """`specsplit generate` as a person reads it: the text on stdout, one summary line on stderr
    (finish reason, token count, rounds, acceptance, the drafter); streamed, the same text; the
    JSON form carries the same text and tokens; a refused request exits 1 naming the status."""
    import asyncio
    import json
    import re

    from conftest import running_stack

    from specsplit.cli import main

    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        def call(*flags: str) -> tuple[int, str, str]:
            code = main(["generate", "--gateway", stack.gateway, "--raw", "--max-new-tokens", "10", *flags,
                         "def add(a, b):"])
            out = capsys.readouterr()
            return code, out.out, out.err

        as_json = json.loads((await asyncio.to_thread(call, "--json", "--spec"))[1])
        plain = await asyncio.to_thread(call, "--spec")
        streamed = await asyncio.to_thread(call, "--spec", "--stream")
        off = await asyncio.to_thread(call, "--no-spec")
        refused = await asyncio.to_thread(call, "--gamma", "99")
    n = as_json["stats"]["generatedTokens"]
    assert 0 < n <= 10
    for code, out, err in (plain, streamed, off):
        assert code == 0 and out == as_json["text"] + "\n", (out, as_json["text"])
        summary = re.fullmatch(r"\[FINISH_REASON_(\w+)\] (\d+) tokens in \d+ ms \([\d.]+ tok/s\), (\d+) rounds, "
                               r"acceptance length ([\d.]+), (.*)\n", err)
        assert summary and int(summary[2]) == n, err
    assert plain[2].rstrip().endswith(f"drafter={as_json['stats']['drafter']} gamma={as_json['stats']['gamma']}")
    assert off[2].rstrip().endswith("speculation off")
    assert refused[0] == 1 and refused[2].startswith("INVALID_ARGUMENT: ")


def test_the_heads_stop_reads_one_variable_in_both_services(monkeypatch):
    """SPECSPLIT_SELF_MIN_CONFIDENCE sets the chain stop of the head wherever it drafts (the verify
    service's own head read only its flag, so an `up` that set the variable changed one of two)."""
    from specsplit.cli import parser

    monkeypatch.setenv("SPECSPLIT_SELF_MIN_CONFIDENCE", "0.2")
    assert [parser().parse_args(["serve", kind]).self_min_confidence for kind in ("verify", "draft")] == [0.2, 0.2]
