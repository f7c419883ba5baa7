import pytest

from specsplit.bench.records import Record, first_divergence, summarise
from specsplit.bench.workload import load_prompts


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) == -1
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_starter_prompts_cover_four_task_types():
    prompts = load_prompts(None)
    counts = {t: sum(p.task_type == t for p in prompts) for t in {p.task_type for p in prompts}}
    assert set(counts) == {"code", "structured", "rewrite", "open"}
    assert min(counts.values()) >= 5
    assert [p.task_type for p in load_prompts(None, limit=1)] == ["code", "structured", "rewrite", "open"]


def record(task, off_s, on_s, tokens, rounds, accepted, identical=True, drafter="ngram", ran="ngram"):
    return Record(task, "p", drafter, off_s, on_s, tokens, tokens, rounds, rounds * 4, accepted, 1.0, 2.0, 0.5,
                  identical, -1 if identical else 3, [off_s, off_s + 1], [on_s], target_step_ms=40.0,
                  parts={"total": on_s * 1e3, "draft": 1.0, "verify": 2.0, "network": 0.5,
                         "gateway": on_s * 1e3 - 3.5}, ran=ran)


def test_the_summary_says_which_drafter_each_default_request_ran():
    import io

    from specsplit.bench.records import print_table

    rows = summarise([record("code", 2.0, 1.0, 20, 8, 11, drafter="default", ran="hybrid"),
                      record("code", 2.0, 1.5, 20, 8, 11, drafter="default", ran="ngram"),
                      record("open", 1.0, 1.0, 10, 9, 0, drafter="default", ran=""),
                      record("open", 1.0, 0.9, 10, 9, 0)])
    out = io.StringIO()
    print_table(rows, "header", out=out)
    assert "default request ran: code hybrid 1, ngram 1; open none 1" in out.getvalue().splitlines()


def test_summary_ratios_and_counts():
    all_rows = summarise([
        record("code", off_s=2.0, on_s=1.0, tokens=20, rounds=8, accepted=11),
        record("code", off_s=2.0, on_s=2.0, tokens=20, rounds=19, accepted=0, identical=False),
        record("open", off_s=1.0, on_s=1.0, tokens=10, rounds=9, accepted=0),
        record("code", off_s=2.0, on_s=0.5, tokens=20, rounds=4, accepted=15, drafter="self"),
    ])
    rows = {r["task_type"]: r for r in all_rows if r["drafter"] == "ngram"}
    self_rows = {r["task_type"]: r for r in all_rows if r["drafter"] == "self"}
    assert set(self_rows) == {"code", "ALL"} and self_rows["code"]["speedup"] == 4.0
    code = rows["code"]
    assert code["tok_s_off"] == 10.0 and code["tok_s_on"] == 40 / 3
    assert code["speedup"] == (40 / 3) / 10.0
    assert code["acceptance_length"] == (11 + 27) / 27
    assert code["identical"] == 1 and code["first_divergence"] == [3]
    assert rows["ALL"]["prompts"] == 3 and rows["open"]["acceptance_length"] == 1.0
    assert (code["p95_off_s"], code["p95_on_s"]) == (3.0, 2.0)
    # 2 x 1.0 ms of drafting over 8 * 4 + 19 * 4 drafted tokens, against a 40 ms target step.
    assert code["draft_cost_ratio"] == (2.0 / 108) / 40.0
    # Shares of the gateway's request time, by specsplit.serving.roundtime's parts: they add up to 1.
    assert code["network_share"] == (0.5 + 0.5) / 3000
    assert sum(code[f"{k}_share"] for k in ("draft", "verify", "network", "gateway")) == pytest.approx(1.0)


def test_p95_is_nearest_rank():
    from gateway.controller import p95

    assert p95([5.0]) == 5.0
    assert p95([float(i) for i in range(1, 21)]) == 19.0
    assert p95([float(i) for i in range(1, 101)]) == 95.0


def test_prompt_files_ignore_extra_keys_and_name_a_bad_line(tmp_path):
    from specsplit.errors import UsageError

    good = tmp_path / "good.jsonl"
    good.write_text('{"id": 7, "task_type": "code", "prompt": "def f():", "temperature": 0.5}\n\n')
    (p,) = load_prompts(str(good))
    assert (p.task_type, p.prompt, p.temperature) == ("code", "def f():", 0.5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task_type": "code", "prompt": "a"}\n{"task_type": "code", "prompt": \n')
    with pytest.raises(UsageError, match=r"bad.jsonl:2: not JSON"):
        load_prompts(str(bad))
    bad.write_text('{"task_type": "code"}\n')
    with pytest.raises(UsageError, match=r"bad.jsonl:1: need an object with string fields task_type and prompt"):
        load_prompts(str(bad))


def test_acceptance_by_draft_position_counts_chains_and_trees():
    from specsplit.api.gateway.v1 import gateway_pb2 as gpb
    from specsplit.bench.records import depth_counts

    rounds = [gpb.RoundRecord(drafted=4, accepted=2),  # a chain: depth 4
              gpb.RoundRecord(drafted=6, accepted=1, depth=3),  # a tree 3 deep
              gpb.RoundRecord(drafted=0, accepted=0)]  # nothing drafted
    assert depth_counts(rounds) == [[2, 2], [2, 1], [2, 0], [1, 0]]
    a = record("code", 2.0, 1.0, 20, 2, 3)
    b = record("code", 2.0, 1.0, 20, 2, 3)
    a.by_depth, b.by_depth = [[2, 2], [2, 1]], [[1, 1]]
    assert summarise([a, b])[0]["by_depth"] == [[3, 3], [2, 1]]


@pytest.mark.parametrize("transport, shared_memory", [("unix", True), ("tcp", False)])
def test_round_overhead_runs_the_real_gateway_around_stub_services(transport, shared_memory):
    """`bench --round-overhead` (a documented command): stub verify and draft services that cost nothing,
    the real gateway, every drafted token accepted; the fast path where shared memory is on."""
    from specsplit.bench import roundoverhead

    row = roundoverhead.measure(transport, shared_memory, requests=2, tokens=24, gamma=4)
    assert row["rounds"] == 2 * 5  # 23 tokens after the first, 4 drafts + 1 per round (the last round shorter)
    assert row["fast_path"] == ("2/2" if shared_memory else "0/2")
    assert row["median"] > 0 and row["network"] > 0  # measured, not judged: benches print figures


async def test_bench_measures_the_target_step_per_forward_and_the_default_request_beside_drafters(models, tmp_path):
    """The drafter's cost column divides by one target step: the spec-off request's verify time per
    forward. Spec-off rounds decode ahead (many forwards a round), so per round it would be many
    steps, and all of them together could not fit in the request's wall time. The "default" variant
    is the request users send (AUTO), set beside the forced drafters and checked against spec-off."""
    import asyncio

    import grpc
    from conftest import running_stack

    from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
    from specsplit.bench.bench import run_prompt
    from specsplit.bench.workload import Prompt, Variant

    prompt = Prompt("code", "Write a Python function that adds two numbers.")
    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        def run():
            with grpc.insecure_channel(stack.gateway) as channel:
                return run_prompt(pb_grpc.GatewayStub(channel), prompt, 32, 1, [Variant("ngram"), Variant("default")])

        record, default = await asyncio.to_thread(run)
    assert (record.drafter, default.drafter) == ("ngram", "default")
    assert record.ran == "ngram" and default.ran in ("ngram", "hybrid", "")  # AUTO's choice, or none
    assert default.identical and default.on_tokens == 32
    assert record.off_tokens == 32 and record.target_step_ms > 0
    assert record.target_step_ms * (record.off_tokens - 1) <= record.off_s * 1e3  # the decode's forwards fit in it


async def test_traffic_sends_the_default_request_unlabelled_beside_forced_modes(models, tmp_path):
    """`bench --traffic` against the real services: every prompt runs spec-off, AUTO without a task
    type and forced on per drafter; the table has a row per category and ALL, counts each mode's
    outputs equal to spec-off (greedy: all of them), and the service tax compares like with like."""
    import asyncio
    import io

    import grpc
    from conftest import running_stack

    from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
    from specsplit.bench import anchor, traffic
    from specsplit.bench.workload import Prompt, Variant

    prompts = [Prompt("rag", "Document: the cat sat on the mat. Question: where did the cat sit?"),
               Prompt("chat", "Hello! How are you today?"), Prompt("rag", "Copy this: 1 2 3 4 5 6 7 8")]
    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        def run():
            with grpc.insecure_channel(stack.gateway) as channel:
                out = io.StringIO()
                rows = traffic.run(pb_grpc.GatewayStub(channel), prompts, 16, 1, [Variant("ngram")], out=out,
                                   bare=anchor.BareTarget(str(models["target"]), "bfloat16", ""))
                return rows, out.getvalue()

        rows, printed = await asyncio.to_thread(run)
    assert set(rows) == {"rag", "chat", "ALL", "service_tax"}
    assert rows["ALL"]["n"] == 3 and rows["rag"]["n"] == 2
    assert rows["ALL"]["identical"] == {"off": 3, "default": 3, "ngram": 3}  # greedy: every mode equals spec-off
    assert sum(rows["ALL"]["reasons"].values()) == 3 and "forced" not in rows["ALL"]["reasons"]  # AUTO, not forced
    assert sum(rows["ALL"]["drafters"].values()) == 3  # which drafter each default request ran with
    tax = rows["service_tax"]
    assert 0 < tax["forward_ms"] <= tax["through_ms"]  # its forwards are part of the decode time
    assert 0 < rows["ALL"]["off_prefill_share"] < 1 and rows["ALL"]["default_vs_off_decode"] > 0
    assert "default" in printed and "service tax" in printed
    assert tax["bare_vs_through"] > 0 and "bare target" in printed  # timed beside each spec-off request
    assert tax["bare_ms"] > 0
    # The price columns: this verifier runs no head (the tiny target has none), so it drafted nothing.
    assert rows["ALL"]["head_drafted"] == rows["ALL"]["head_accepted"] == 0 and rows["ALL"]["draft_cost"] >= 0
    assert "lookup        head   cost identical" in printed.splitlines()[1]


async def test_structured_runs_each_schema_constrained_and_free_and_checks_every_output(models, tmp_path):
    """`bench --structured` against the real services: each prompt with its schema spec-off, AUTO and
    forced on, and without it; every constrained output that is complete validates (the schema holds
    it), greedy outputs equal spec-off's, and the forced share is what the requests reported."""
    import asyncio
    import io

    import grpc
    from conftest import running_stack

    from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
    from specsplit.bench import structured

    rows = [{"task_type": "flag", "prompt": "Answer as JSON.",
             "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                        "additionalProperties": False}},
            {"task_type": "pick", "prompt": "Pick one.", "schema": {"type": "string", "enum": ["alpha", "beta"]}}]
    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        def run():
            with grpc.insecure_channel(stack.gateway) as channel:
                out = io.StringIO()
                return structured.run(pb_grpc.GatewayStub(channel), rows, 24, 1, None, None, out=out), out.getvalue()
        summary, text = await asyncio.to_thread(run)
    assert summary["n"] == 3 * len(rows) and summary["identical"] == summary["n"]
    assert summary["complete"] == summary["n"] == summary["valid"]  # both schemas end within 24 tokens
    assert 0 < summary["forced_share"] <= 1  # `{"ok":` is forced
    assert summary["decode_default_vs_off"] > 0 and summary["decode_free_default_vs_off"] > 0
    assert set(summary["per_prompt"]) == {"flag", "pick"}
    assert "valid against their schema 6/6" in text


def test_hops_table_splits_rounds_and_takes_medians_per_transition():
    from specsplit.serving.hops import table

    marks = []
    for r in range(8):  # rounds of 100 ns, every other asks the drafter
        t = 1000 * r
        marks.append((t, "gateway.round"))
        if r % 2:
            marks += [(t + 10, "gateway.to-draft"), (t + 30 + r, "draft.received")]
        marks += [(t + 50, "gateway.to-verify"), (t + 90, "verify.received")]
    rounds, rows = table(sorted(marks), skip=1)
    # asked rounds 1, 3, 5, 7 less the first kept, and the last cut off as possibly incomplete
    assert rounds == 2
    assert [hop for hop, _, _ in rows] == ["gateway.round -> gateway.to-draft", "gateway.to-draft -> draft.received",
                                           "draft.received -> gateway.to-verify",
                                           "gateway.to-verify -> verify.received"]
    assert rows[1][1] == (20 + 4) / 1e3 and rows[1][2] == 2  # the median of 23 and 25 ns, in us


def test_round_hops_are_marked_in_every_process_of_a_real_stack(models, capsys):
    """`bench --round-overhead`'s second table: a real stack whose three processes mark a round's
    hops; the rounds that asked the drafter pass through each service's fast path and the forward."""
    from specsplit.bench import roundoverhead
    from specsplit.bench.workload import Prompt
    from specsplit.launcher import StackConfig

    prompts = [Prompt("t", "one two three one two three one two three one two"), Prompt("t", "a b a b a b a b")]
    rows = roundoverhead.hop_by_hop(StackConfig(target_model=str(models["target"]), draft_model=str(models["draft"]),
                                                dtype="float32"), prompts, 24, "model")
    hops = [hop for hop, _, _ in rows]
    for hop in ("gateway.to-draft -> draft.received", "draft.work -> draft.worked",
                "gateway.from-draft -> gateway.to-verify", "verify.forward -> verify.forwarded",
                "verify.answers -> gateway.from-verify"):
        assert hop in hops, hops
    assert hops.index("gateway.to-draft -> draft.received") < hops.index("verify.forward -> verify.forwarded")
    assert all(us > 0 for _, us, _ in rows)
    out = capsys.readouterr().out
    assert "of which neither forward nor drafting" in out and "n-gram alone, drafted in the verifier" in out


async def test_controlled_learns_then_reports_each_task_type_and_every_auto_decision(models, tmp_path, capsys):
    """`bench --controlled` on real services: a row per task type and ALL with the three modes'
    rates, and AUTO's decisions counted once per measured AUTO request of that type."""
    import ast
    import asyncio
    import re

    import grpc
    from conftest import running_stack

    from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
    from specsplit.bench.controlled import controlled
    from specsplit.bench.workload import Prompt

    prompts = [Prompt("code", "def add(a, b):"), Prompt("code", "def sub(a, b):"), Prompt("story", "Once upon a time")]
    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        def run():
            with grpc.insecure_channel(stack.gateway) as channel:
                return controlled(pb_grpc.GatewayStub(channel), prompts, 8, 2, 1)

        assert await asyncio.to_thread(run) == 0
    rows = {m[0]: m for m in re.findall(r"^(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)x\s*(.*)$",
                                        capsys.readouterr().out, re.M)}
    assert set(rows) == {"code", "story", "ALL"}
    for task, n in (("code", 4), ("story", 2)):  # prompts of the type x repeats
        decisions = ast.literal_eval(rows[task][6])  # the printed dict of reason/gamma -> count
        assert sum(decisions.values()) == n and all(re.fullmatch(r"[\w-]+/g\d+", k) for k in decisions)
        assert all(float(x) > 0 for x in rows[task][1:4])
    assert rows["ALL"][6] == ""


def test_busy_spell_counts_what_auto_decided_beside_the_neighbours_and_after_and_leaves_none(monkeypatch, capsys):
    """`bench --neighbour N`'s spell: AUTO requests of one type while N busy processes run, then a few
    with the machine quiet; each phase's count of requests that speculated and their reasons. The
    neighbours are real processes, running only during the spell and gone after it."""
    from types import SimpleNamespace

    from specsplit.bench import controlled as bench
    from specsplit.bench.workload import Prompt

    made = []
    real = bench.Neighbours

    class Watched(real):
        def __init__(self, n):
            super().__init__(n)
            made.append(self)

    def state(proc) -> str:  # R running, T stopped (SIGSTOP), ... from /proc; "" once reaped
        return "" if proc.poll() is not None else open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0]

    class Stub:  # the gateway's answers: "load" while the neighbours run, "learnt" after
        def __init__(self):
            self.phases = []

        def Generate(self, request, timeout):
            busy = all(state(p) not in ("T", "") for p in made[0].procs)
            self.phases.append(busy)
            return SimpleNamespace(stats=SimpleNamespace(speculation_used=not busy,
                                                         speculation_reason="load" if busy else "learnt"))

    monkeypatch.setattr(bench, "Neighbours", Watched)
    monkeypatch.setattr(bench, "SPELL_S", 0.3)
    monkeypatch.setattr(bench, "AFTER", 3)
    stub = Stub()
    prompts = [Prompt("open", "hi"), Prompt("code", "def f():"), Prompt("code", "class A:")]
    bench.busy_spell(stub, prompts, 8, 2)
    busy = sum(stub.phases[:-3])
    assert busy == len(stub.phases) - 3 > 0 and not any(stub.phases[-3:])
    assert all(p.poll() is not None for p in made[0].procs) and len(made[0].procs) == 2
    out = capsys.readouterr().out.splitlines()
    assert out == [f"code AUTO beside 2 busy for 0 s: 0/{busy} speculated (load {busy})",
                   "code AUTO after it: 3/3 speculated (learnt 3)"]


def test_a_rounds_time_counts_the_verifiers_own_drafting_as_compute_not_network():
    """roundtime.split: a Verify call of 10 ms whose forwards took 6 and whose head drafted for 3
    (VerifyResponse.head_ns) spent 1 ms in transit; its 3 ms are drafting on the critical path."""
    from specsplit.serving import roundtime

    ms = 1_000_000
    own = roundtime.split(round_ns=12 * ms, draft_ns=0, draft_call_ns=0, verify_ns=6 * ms, verify_call_ns=10 * ms,
                          verify_draft_ns=3 * ms)
    assert own == roundtime.RoundTime(9.0, 1.0, 2.0)
    # A Propose the gateway waited for: its compute counts, its transit is network.
    asked = roundtime.split(round_ns=20 * ms, draft_ns=2 * ms, draft_call_ns=5 * ms, verify_ns=6 * ms,
                            verify_call_ns=10 * ms)
    assert asked == roundtime.RoundTime(8.0, 7.0, 5.0)


def test_tracing_overhead_runs_two_stacks_request_by_request_and_exports_from_the_traced_one(models, capsys):
    """`bench --tracing-overhead`: the same spec-on requests against a stack with tracing off and one
    exporting OTLP-JSON to a file, alternating; every pair timed, and the traced stack wrote spans."""
    import re

    from specsplit.bench.bench import tracing_overhead
    from specsplit.bench.workload import Prompt
    from specsplit.launcher import StackConfig

    prompts = [Prompt("t", "one two three one two three one two"), Prompt("t", "a b a b a b a b")]
    config = StackConfig(target_model=str(models["target"]), draft_model=str(models["draft"]), dtype="float32")
    assert tracing_overhead(prompts, config, max_new_tokens=8, repeats=2) == 0
    out = capsys.readouterr().out
    found = re.search(r"tracing overhead: (\d+) request pairs, (\d+) tokens; median ms/token tracing off ([\d.]+), "
                      r"on ([\d.]+); median per-request ratio on/off ([\d.]+) .*; (\d+) export batches written", out)
    assert found, out
    pairs, tokens, off, on, ratio, batches = found.groups()
    assert int(pairs) == len(prompts) * 2 and int(tokens) == 2 * int(pairs) * 8  # every request, both stacks
    assert float(off) > 0 and float(on) > 0 and float(ratio) > 0  # measured, not judged: the bench prints figures
    assert int(batches) > 0  # the traced stack exported; a stack that traced nothing writes none


def test_the_bench_command_runs_every_prompt_off_and_on_and_writes_its_table_and_json(models, tmp_path):
    """`specsplit bench` as users run it (the README's `run.sh bench`: --anchor), on the tiny model:
    each prompt spec-off and spec-on for each drafter and the default request, checked identical,
    transformers' own generate beside it, the summary and every record in --json-out."""
    import json
    import subprocess
    import sys

    from conftest import write_prompts

    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "specsplit.cli", "bench", "--target-model", str(models["target"]), "--draft-model",
         str(models["draft"]), "--dtype", "float32", "--draft-dtype", "float32", "--prompts",
         str(write_prompts(tmp_path / "p.jsonl")), "--limit", "1", "--drafters", "ngram,default",
         "--max-new-tokens", "8", "--anchor", "--json-out", str(out), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    kinds = {r["task_type"] for r in result["records"]}
    assert {(r["task_type"], r["drafter"]) for r in result["records"]} == {(k, d) for k in kinds
                                                                          for d in ("ngram", "default")}
    assert all(r["identical"] and r["off_tokens"] == r["on_tokens"] == 8 for r in result["records"])
    assert "exact numerics" in result["header"] and "specsplit bench:" in done.stdout
    assert {row["drafter"] for row in result["summary"]} >= {"ngram", "default"}
    assert "transformers" in done.stdout  # the anchor's table: what users would otherwise run
