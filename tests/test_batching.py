"""Batching across sessions: one forward over several sessions' rows gives each row the logits its
session gets alone (bf16 and fp32), the worker gathers what arrives together without reordering
it around plain jobs, and concurrent requests through the real services share forwards and still
answer exactly what they answer one at a time."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
import torch
from conftest import running_stack

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.model.fastllama import Feed
from specsplit.model.modeling import KVSequence, load_model
from specsplit.serving.worker import ModelWorker
from verify_service.engine import Target


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 10, (length,), generator=g).tolist() for length in (5, 17, 40, 9)[:n]]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_batched_forward_gives_each_session_its_own_logits(models, dtype):
    lm = load_model(models["target"], dtype)
    if lm.native is None:
        pytest.skip(lm.kernels)
    prompts = _prompts(4, lm.vocab_size)
    alone = []
    for p in prompts:  # prefill, then a 3-token chain, then a 4-node tree, each session by itself
        s = KVSequence(lm)
        alone.append((s.forward(p[:-3], last_only=True), s.forward(p[-3:]), s.forward(p[:4], parents=[-1, 0, 0, 1])))
    seqs = [KVSequence(lm) for _ in prompts]
    for s, p in zip(seqs, prompts):
        s.reserve(len(p) + 4)
    prefill = lm.native.run([Feed(s, p[:-3], last_only=True) for s, p in zip(seqs, prompts)])
    chain = lm.native.run([Feed(s, p[-3:]) for s, p in zip(seqs, prompts)])
    tree = lm.native.run([Feed(s, p[:4], parents=[-1, 0, 0, 1]) for s, p in zip(seqs, prompts)])
    for i in range(len(prompts)):
        assert torch.equal(prefill[i][0], alone[i][0]), i
        assert torch.equal(chain[i][0], alone[i][1]), i
        assert torch.equal(tree[i][0], alone[i][2]), i
        assert seqs[i].length == len(prompts[i]) + 4
    # A batch whose sessions sit at different lengths, with one prefill and one tree among chains.
    late = KVSequence(lm)
    late.reserve(6)
    mixed = lm.native.run([Feed(seqs[0], [3]), Feed(late, prompts[3][:6], last_only=True),
                           Feed(seqs[2], [4, 5], parents=[-1, -1])])
    ref0, ref_late, ref2 = KVSequence(lm), KVSequence(lm), KVSequence(lm)
    for ref, p in ((ref0, prompts[0]), (ref2, prompts[2])):
        ref.forward(p[:-3], last_only=True)
        ref.forward(p[-3:])
        ref.forward(p[:4], parents=[-1, 0, 0, 1])
    assert torch.equal(mixed[0][0], ref0.forward([3]))
    assert torch.equal(mixed[1][0], ref_late.forward(prompts[3][:6], last_only=True))
    assert torch.equal(mixed[2][0], ref2.forward([4, 5], parents=[-1, -1]))


def test_target_runs_calls_of_several_sessions_in_one_forward(models, monkeypatch):
    lm = load_model(models["target"], "bfloat16")
    target = Target(lm)
    if not target.batches:
        pytest.skip(lm.kernels)
    prompts = _prompts(3, lm.vocab_size, seed=1)
    # Alone: prefill, then greedy decoding by verifies of the target's own continuation.
    alone = []
    for p in prompts:
        session, first = target.prefill(p)
        drafts = [first.next_token] * 3
        result = target.verify(session, len(session.tokens), drafts)
        alone.append((first.next_token, result.num_accepted, result.next_token, list(session.tokens)))
    steps = [target.plan_prefill(target.start_prefill(p)) for p in prompts]
    firsts = target.run(steps)
    assert [r.batch_calls for r in firsts] == [3, 3, 3]
    assert firsts[0].batch_rows == sum(len(p) for p in prompts)
    sessions = [s.session for s in steps]
    plans = [target.plan_verify(s, len(s.tokens), [f.next_token] * 3) for s, f in zip(sessions, firsts)]
    results = target.run(plans)
    for i, (first, result) in enumerate(zip(firsts, results)):
        assert (first.next_token, result.num_accepted, result.next_token, sessions[i].tokens) == alone[i]
        assert result.batch_calls == 3 and result.batch_rows == 12
    # A call that fails in a batch fails alone, and leaves its session as it was: its committed
    # tokens, and its cache rolled back from the rows the shared forward wrote.
    before = list(sessions[1].tokens)
    bad = target.plan_verify(sessions[1], len(sessions[1].tokens), [5])
    good = target.plan_verify(sessions[0], len(sessions[0].tokens), [])
    decide = target._decide

    def refuse_one(session, *args):
        if session is sessions[1]:
            raise ValueError("refused")
        return decide(session, *args)

    monkeypatch.setattr(target, "_decide", refuse_one)
    outcomes = target.run([bad, good])
    assert isinstance(outcomes[0], ValueError) and sessions[1].tokens == before
    assert sessions[1].kv.length == len(before) - 1  # the cache holds the committed tokens but the last
    assert outcomes[1].length == len(sessions[0].tokens)


def _recording_runner(batches: list[list]):
    def run(items):
        batches.append(list(items))
        return [x * 10 if x >= 0 else ValueError(f"bad {x}") for x in items]
    return run


async def test_worker_gathers_calls_that_arrive_together_and_keeps_order_around_plain_jobs():
    worker = ModelWorker("test", wait_s=0.0)
    batches: list[list] = []
    order: list = []
    runner = _recording_runner(batches)
    try:
        # Queued while the worker is busy: g1, g2, a plain job, g3 -> [g1, g2], the job, [g3].
        release = threading.Event()
        busy = worker.run(release.wait, 30)  # busy until everything below is queued
        futures = [busy, worker.run_gathered(runner, 1), worker.run_gathered(runner, 2),
                   worker.run(lambda: order.append(("job", [list(b) for b in batches]))),
                   worker.run_gathered(runner, 3), worker.run_gathered(runner, -1)]
        release.set()
        results = (await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 30))[1:]
        assert results[:2] == [10, 20] and results[3] == 30
        assert isinstance(results[4], ValueError)  # an item's failure is its own
        assert batches == [[1, 2], [3, -1]]
        assert order == [("job", [[1, 2]])]  # the job ran after the batch queued before it
    finally:
        worker.shutdown()


async def test_worker_waits_for_every_live_session_within_its_budget():
    live = [3]
    # A budget of 60 s, which no batch here may wait out: the steps that must not wait are bounded
    # by a 30 s guard (a hang fails the test), not by a timing.
    for wait_s, expected in ((60.0, [[1, 2, 3], [4, 5, 6]]), (0.0, [[1, 2, 3], [4], [5, 6]])):
        worker = ModelWorker("test", wait_s=wait_s, expected=lambda: live[0])
        batches: list[list] = []
        runner = _recording_runner(batches)
        try:
            release = threading.Event()
            busy = worker.run(release.wait, 30)  # so that 1, 2, 3 are queued together
            queued = [worker.run_gathered(runner, i) for i in (1, 2, 3)]
            release.set()
            await asyncio.wait_for(asyncio.gather(busy, *queued), 30)
            first = worker.run_gathered(runner, 4)
            if not wait_s:  # no budget: 4 runs alone, then 5 and 6 (queued behind a busy worker) together
                await asyncio.wait_for(first, 30)
                release = threading.Event()
                later = [worker.run(release.wait, 30), worker.run_gathered(runner, 5), worker.run_gathered(runner, 6)]
                release.set()
            else:  # 4 waits for the other live sessions: a full batch runs without waiting out the budget
                later = [first, worker.run_gathered(runner, 5), worker.run_gathered(runner, 6)]
            await asyncio.wait_for(asyncio.gather(*later), 30)
            assert batches == expected, wait_s
            # A session that is gone is not waited for.
            live[0], batches[:] = 1, []
            await asyncio.wait_for(worker.run_gathered(runner, 7), 30)
            assert batches == [[7]]
            live[0] = 3
        finally:
            worker.shutdown()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_concurrent_requests_share_forwards_and_answer_as_alone(models, tmp_path, transport):
    prompts = ["def add(a, b):", "The quick brown fox", '{"name": "cat",', "Once upon a time"]

    def req(prompt, speculation, drafter="ngram"):
        return pb.GenerateRequest(text=prompt, speculation=speculation, max_new_tokens=32, drafter=drafter,
                                  stop=pb.StopConditions(ignore_eos=True))

    async with running_stack(tmp_path, transport, models["target"], models["draft"],
                             shared_memory=transport == "unix", verify_kw={"batch_wait_ms": 50.0}) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            alone = {p: list((await gw.Generate(req(p, pb.SPECULATION_OFF))).token_ids) for p in prompts}
            # n-gram: the verifier's own lookups in its decode-ahead steps; model: the draft service's drafts
            for speculation, drafter in ((pb.SPECULATION_OFF, "ngram"), (pb.SPECULATION_ON, "ngram"),
                                         (pb.SPECULATION_ON, "model")):
                answers = await asyncio.gather(*(gw.Generate(req(p, speculation, drafter)) for p in prompts * 2))
                for p, a in zip(prompts * 2, answers):
                    assert list(a.token_ids) == alone[p], (p, speculation, drafter)
                calls = [r.batch_calls for a in answers for r in a.stats.round_records]
                assert max(calls) >= 4, calls  # rounds of different sessions shared forwards
                # A round's figures are its last forward's: a round that verified a draft, alone, had its rows.
                rows = [(r.batch_rows, r.drafted) for a in answers for r in a.stats.round_records
                        if r.batch_calls == 1 and not r.decoded]
                assert all(n == 1 + drafted for n, drafted in rows), rows


def test_the_self_head_drafts_several_sessions_in_one_call_as_it_drafts_each_alone(models, self_head):
    """drive_all runs every session's head steps in lock-step, one kernel call per turn: each
    session proposes exactly what it proposes alone (chains and EAGLE trees), and its caches end
    where they would."""
    from draft_service.drafters.base import drive_all
    from draft_service.drafters.selfdraft import SelfDrafter
    from specsplit.model.headserving import NativeHead

    drafter = SelfDrafter(self_head, models["target"])
    if not isinstance(drafter.runner, NativeHead):
        pytest.skip("the head runs on torch here")
    lm = load_model(models["target"], "float32")
    prompts = [p[:n] for p, n in zip(_prompts(4, lm.vocab_size, seed=3), (5, 12, 30, 9))]

    def started(prompt):
        session = drafter.start(prompt)
        seq = KVSequence(lm)
        session.add_features(0, seq.hidden(prompt[:-1]).float())
        return session

    calls = []
    real = drafter.runner.run
    drafter.runner.run = lambda steps: calls.append(len(steps)) or real(steps)
    for gamma, budget in ((4, 0), (3, 8)):
        singles = [started(p) for p in prompts]
        alone = [drafter.propose(s, gamma, budget) for s in singles]
        calls.clear()
        sessions = [started(p) for p in prompts]
        together = drive_all([(drafter.steps(s, gamma, budget), drafter.runner) for s in sessions])
        assert [tuple(p.tokens) for p in together] == [tuple(p.tokens) for p in alone], (gamma, budget)
        assert [p.parents for p in together] == [p.parents for p in alone]
        for a, b in zip(together, alone):
            assert a.scores == pytest.approx(b.scores, abs=1e-5) if a.scores else not b.scores
        assert max(calls) == len(prompts)  # a turn's steps of all four sessions in one call
        assert [s.cache.length for s in sessions] == [s.cache.length for s in singles]


async def test_the_concurrency_sweep_measures_every_level_and_mode_and_checks_answers(models, tmp_path):
    """bench --concurrency against the real services: every level runs off, on and AUTO, reports the
    batches formed, and exits 0 only when every answer equals its one-client spec-off answer."""
    import io

    from specsplit.bench import concurrency
    from specsplit.bench.workload import Prompt, Variant

    prompts = [Prompt("code", "def add(a, b):"), Prompt("chat", "Once upon a time")]
    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        with grpc.insecure_channel(stack.gateway) as channel:
            stub = pb_grpc.GatewayStub(channel)
            out = io.StringIO()
            status = await asyncio.to_thread(concurrency.run, stub, prompts, [1, 3], 12, Variant("ngram"), 6, out)
    report = out.getvalue()
    assert status == 0, report
    rows = [r for r in (line.split() for line in report.splitlines())
            if len(r) > 1 and r[0] in ("1", "3") and r[1] in ("off", "on", "auto")]
    assert [(r[0], r[1]) for r in rows] == [(c, m) for c in ("1", "3") for m in ("off", "on", "auto")], report
    batch = {(r[0], r[1]): float(r[8]) for r in rows}
    assert batch[("1", "off")] == 1.0 and batch[("3", "off")] > 1.0, report  # 3 clients share forwards
    assert all(r[11].split("/")[0] == r[11].split("/")[1] for r in rows), report  # all identical
    assert "auto/best" in report


async def test_two_rounds_of_one_session_at_once_commit_one_and_refuse_the_other(models, tmp_path):
    from specsplit.api.verify.v1 import verify_pb2 as vpb
    from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc

    # Two live sessions and a long batch wait: the first call waits for a second before its forward
    # runs, so both calls of "s" are gathered into one (alone, the first would run at once and the
    # second fail on its length instead of the guard).
    async with running_stack(tmp_path, "tcp", models["target"], None, shared_memory=False,
                             verify_kw={"batch_wait_ms": 2000.0}) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            v = vpb_grpc.VerifierStub(ch)
            first = await v.Prefill(vpb.PrefillRequest(session_id="s", prompt_token_ids=[5, 6, 7, 8]))
            await v.Prefill(vpb.PrefillRequest(session_id="idle", prompt_token_ids=[5, 6]))
            same = vpb.VerifyRequest(session_id="s", length=first.length, draft_token_ids=[first.next_token_id])
            outcomes = await asyncio.gather(v.Verify(same), v.Verify(same), return_exceptions=True)
            ok = [o for o in outcomes if not isinstance(o, BaseException)]
            refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
            assert len(ok) == 1 and len(refused) == 1, outcomes
            assert refused[0].code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "already has a call in this forward" in refused[0].details()  # the guard's refusal
            after = await v.Verify(vpb.VerifyRequest(session_id="s", length=ok[0].length))
            assert after.length == ok[0].length + 1  # the session went on from the committed round


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_forward_takes_each_rows_argmax_as_torch_does(models, dtype, tmp_path):
    """run_choosing's choices are torch.argmax of the logits it returns, for prefills, chains,
    trees and batches, on any team size; with a head whose second half of the vocabulary is
    twice its first (every logit tied with another, across the threads' shares), the first of the
    maxima, as torch takes it."""
    from conftest import native_model

    lm = native_model(models, dtype)
    prompts = _prompts(4, lm.vocab_size, seed=3)
    threads = torch.get_num_threads()
    try:
        for team in sorted({1, threads}):
            torch.set_num_threads(team)
            seqs = [KVSequence(lm) for _ in prompts]
            for s, p in zip(seqs, prompts):
                s.reserve(len(p) + 4)
            for feeds in ([Feed(s, p[:-3], last_only=True) for s, p in zip(seqs, prompts)],
                          [Feed(s, p[-3:]) for s, p in zip(seqs, prompts)],
                          [Feed(s, [4, 5, 6, 7], parents=[-1, 0, 0, 1]) for s in seqs]):
                for logits, _, chosen in lm.native.run_choosing(feeds):
                    assert chosen == logits.argmax(-1).tolist()
    finally:
        torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(models["target"])
    with torch.no_grad():
        head = model.lm_head.weight
        half = head.shape[0] // 2
        head[:half] = head[0]
        head[half:] = 2 * head[0]
    model.save_pretrained(tmp_path / "tied")
    AutoTokenizer.from_pretrained(models["target"]).save_pretrained(tmp_path / "tied")
    tied = native_model({"tied": tmp_path / "tied"}, dtype, "tied")
    seq = KVSequence(tied)
    seq.reserve(40)
    logits, _, chosen = tied.native.run_choosing([Feed(seq, prompts[2])])[0]
    assert bool(((logits == logits.max(-1, keepdim=True).values).sum(-1) > 1).all())  # every row's maximum is tied
    assert chosen == logits.argmax(-1).tolist() and set(chosen) <= {0, half}
