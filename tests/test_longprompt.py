"""Long prompts: prefill in chunks (exact, interleaved with other sessions' rounds, stopped by a
Release), the prefix cache across sessions (hits exact, eviction under the KV budget), and a
client deadline shorter than a prefill."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import grpc
import pytest
import torch
from conftest import native_model, prefill_all, until

from specsplit.model.fastllama import CacheFull
from specsplit.model.modeling import load_model
from specsplit.model.prefixcache import BLOCK, PrefixCache
from specsplit.speculation.params import SamplingParams
from verify_service.engine import Target


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _cache(seq) -> torch.Tensor:
    return seq.read(0, seq.length)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_prefix_cache_hit_gives_the_cache_features_and_token_of_a_cold_prefill(models, dtype):
    lm = native_model(models, dtype)
    cache = PrefixCache(lm.native.pool)
    target, cold = Target(lm, prefix_cache=cache), Target(lm)
    shared = _prompt(3 * BLOCK + 5, lm.vocab_size, 1)
    first = shared + _prompt(20, lm.vocab_size, 2)
    second = shared + _prompt(11, lm.vocab_size, 3)
    sampling = SamplingParams(temperature=0.9, seed=4)
    target.prefill(first, with_features=True)
    assert cache.stats()["blocks"] == len(first) // BLOCK and cache.hits == 0
    warm, got = target.prefill(second, with_features=True, sampling=sampling, chunk=7)
    assert got.cached == 3 * BLOCK and cache.hits == 1 and cache.hit_tokens == 3 * BLOCK
    ref, want = cold.prefill(second, with_features=True, sampling=sampling)
    assert want.cached == 0
    assert torch.equal(_cache(warm.kv), _cache(ref.kv))
    assert torch.equal(got.features, want.features) and got.features.shape[0] == len(second)
    assert (got.next_token, warm.tokens) == (want.next_token, ref.tokens)
    # Decoding on from the loaded prefix stays exact too.
    drafts = [want.next_token] * 4
    a, b = target.verify(warm, len(warm.tokens), drafts), cold.verify(ref, len(ref.tokens), drafts)
    assert (a.num_accepted, a.next_token, warm.tokens) == (b.num_accepted, b.next_token, ref.tokens)
    assert torch.equal(a.features, b.features)
    # A prompt that is all cached blocks still computes its last token; another start misses.
    again, whole = target.prefill(first[:2 * BLOCK])
    assert whole.cached == BLOCK and again.tokens[-1] == cold.prefill(first[:2 * BLOCK])[1].next_token
    assert target.prefill(_prompt(2 * BLOCK, lm.vocab_size, 9))[1].cached == 0
    # skip: computed in full, though cached.
    prefilling = target.start_prefill(second, use_cache=False)
    assert prefilling.done == 0


def test_prefix_cache_only_uses_room_the_sessions_leave_and_evicts_least_recently_used(models):
    lm = native_model(models)
    pool, positions = lm.native.pool, lm.max_context  # a buffer grows to at least 256 positions
    held = pool.used_bytes
    try:
        cache = PrefixCache(pool)
        target = Target(lm, prefix_cache=cache)
        prompts = [_prompt(2 * BLOCK + 1, lm.vocab_size, s) for s in range(3)]
        for p in prompts:
            target.prefill(p)
        target.prefill(prompts[2])  # used last
        assert len(cache) == 6 and [cache.cached_tokens(p) for p in prompts] == [2 * BLOCK] * 3
        assert pool.used_bytes == held + cache.used_bytes  # the sessions' buffers went back
        pool.budget_bytes = held + 4 * positions * lm.native.token_bytes + cache.used_bytes // 2  # 3 blocks
        # Sessions that need the whole budget take it back from the cache, least recently used first.
        alive = [lm.native.sequence() for _ in range(4)]
        for seq in alive:
            seq.reserve(positions)
        assert pool.used_bytes <= pool.budget_bytes and len(cache) == 3
        assert [cache.cached_tokens(p) for p in prompts] == [0, BLOCK, 2 * BLOCK]
        with pytest.raises(CacheFull):  # sessions never lose room to the cache
            lm.native.sequence().reserve(positions)
        assert [cache.cached_tokens(p) for p in prompts] == [0, 0, 0]
        del alive, seq
        assert pool.used_bytes == held  # nothing leaked
    finally:
        pool.budget_bytes = 1 << 62


def test_a_prefill_takes_its_whole_prompts_room_before_its_first_chunk(models):
    """Cold or from the prefix cache, a prefill reserves the whole prompt at its start: grown chunk
    by chunk, its cache would be copied at every doubling, inside the forwards that decoding
    sessions share."""
    lm = load_model(models["long"], "bfloat16")
    if lm.native is None:
        pytest.skip(lm.kernels)
    for target in (Target(lm), Target(lm, prefix_cache=PrefixCache(lm.native.pool))):
        prompt = _prompt(1500, lm.vocab_size, 9)
        state = target.start_prefill(prompt, use_cache=False)
        capacity = state.session.kv.capacity
        assert capacity >= len(prompt)
        prefill_all(target, state, 64)
        assert state.session.kv.capacity == capacity  # never grown (copied) on the way


def _turning(turns: dict, batches: list | None = None, wait: float | None = None):
    """A worker runner that gives each item its turns: Again(1, wait) until its count in `turns`
    (1 where absent) runs out, then the item upper-cased; each batch recorded in `batches`."""
    from specsplit.serving.worker import Again

    def run(items):
        if batches is not None:
            batches.append(list(items))
        out = []
        for item in items:
            turns[item] = turns.get(item, 1) - 1
            out.append(Again(1, wait) if turns[item] > 0 else item.upper())
        return out
    return run


async def test_worker_runs_an_unfinished_item_again_beside_later_arrivals_and_plain_jobs_between():
    from specsplit.serving.worker import ModelWorker

    worker = ModelWorker("test", wait_s=0.0)
    batches: list[list] = []
    runner = _turning({"long": 3}, batches)

    try:
        busy = worker.run(time.sleep, 0.1)  # so that the first turn and the rest queue together
        long = worker.run_gathered(runner, "long")
        seen = []
        job = worker.run(lambda: seen.append([list(b) for b in batches]))
        short = worker.run_gathered(runner, "short")
        await busy
        assert await asyncio.gather(long, short, job) == ["LONG", "SHORT", None]
        # the job ran after the first turn (queued before it) but did not wait for the item to finish
        assert seen == [[["long"]]]
        assert batches == [["long"], ["long", "short"], ["long"]]
    finally:
        worker.shutdown()


async def test_an_unfinished_item_alone_waits_its_own_time_for_a_round_to_share_its_turn():
    """A chunk's next turn, alone in the batch, waits up to its Again.wait_s for a session's round
    (it then runs beside it, not ahead of it); without a wait of its own it runs at once."""
    from conftest import until

    from specsplit.serving.worker import ModelWorker

    # Waiting (a budget no test run outlasts): the round, sent once the first turn ran, shares the
    # second. Not waiting: the turns run back to back; the round, sent once all three ran, comes after.
    for wait, sent_after, expected in ((60.0, 1, [["long"], ["long", "round"], ["long"]]),
                                       (None, 3, [["long"], ["long"], ["long"], ["round"]])):
        turns = {"long": 3}
        # Two live sessions until the round has had its turn: the long item's last turn then waits for no one.
        worker = ModelWorker("test", wait_s=0.0, expected=lambda: 2 if turns.get("round", 1) > 0 else 1)
        batches: list[list] = []
        runner = _turning(turns, batches, wait)

        try:
            long = worker.run_gathered(runner, "long")
            await until(lambda: len(batches) >= sent_after, f"{sent_after} turn(s) of the long item", 30)
            answers = asyncio.gather(long, worker.run_gathered(runner, "round"))
            assert await asyncio.wait_for(answers, 30) == ["LONG", "ROUND"]
            assert batches == expected, wait
        finally:
            worker.shutdown()


async def test_an_item_counts_as_joined_once_and_never_if_cancelled_while_queued():
    """What a prefill's count rests on (the verify service counts a prefill in when it joins a
    batch, out when it finishes): an item cancelled while queued behind a busy worker never joins,
    so nothing is counted that nothing would count out; one that runs joins once, whatever its turns."""
    from specsplit.serving.worker import ModelWorker

    worker = ModelWorker("test", wait_s=0.0)
    joined: list[str] = []
    turns = {"kept": 3}
    runner = _turning(turns)

    gate = threading.Event()  # the worker is busy until the test says so, however slow the machine
    try:
        busy = worker.run(gate.wait, 60)
        dropped = worker.run_gathered(runner, "dropped", joined=lambda: joined.append("dropped"))
        kept = worker.run_gathered(runner, "kept", joined=lambda: joined.append("kept"))
        dropped.cancel()  # its caller gave up while the worker was busy (both were queued at the call)
        # asyncio hands a cancel on to the wrapped future from a loop callback: let it run before
        # the worker is freed, or the worker may take the item first (as a service would, rightly)
        await asyncio.sleep(0)
        gate.set()
        assert await busy
        assert await kept == "KEPT"
        assert joined == ["kept"] and turns["kept"] == 0
    finally:
        worker.shutdown()


def _long_text(sentences: int) -> str:
    return " ".join(["The quick brown fox jumps over the lazy dog."] * sentences)


async def test_a_long_prefill_runs_in_chunks_beside_a_decoding_session_and_changes_nothing(models, tmp_path):
    from conftest import running_stack

    from specsplit.api.verify.v1 import verify_pb2 as vpb
    from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc

    long = _prompt(3000, 290, 7)
    lm = load_model(models["long"], "bfloat16")
    if lm.native is None:
        pytest.skip(lm.kernels)
    one_call = Target(lm).prefill(long)[1].next_token
    async with running_stack(tmp_path, "tcp", models["long"], None, shared_memory=False) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            v = vpb_grpc.VerifierStub(ch)
            a = await v.Prefill(vpb.PrefillRequest(session_id="a", prompt_token_ids=[5, 6, 7]))
            rounds, done = [], asyncio.Event()

            async def decode():
                length = a.length
                for _ in range(4096):  # steps: fewer than the context holds
                    if done.is_set():
                        return
                    r = await v.Verify(vpb.VerifyRequest(session_id="a", length=length))
                    rounds.append(r)
                    length = r.length

            decoding = asyncio.create_task(decode())
            await until(lambda: rounds, "session a decoding before b's prefill starts", 60, every_s=0.01)
            b = await v.Prefill(vpb.PrefillRequest(session_id="b", prompt_token_ids=long))
            done.set()
            await decoding
            assert b.chunks > 1 and b.next_token_id == one_call
            shared = [r for r in rounds if r.batch_calls == 2]
            assert shared and all(r.batch_rows > 1 for r in shared)  # a's rounds ran beside b's chunks
            assert (await v.Info(vpb.InfoRequest())).active_prefills == 0
            # The prefix cache: a cold prefill (skipping it) and a warm one answer as b did.
            cold = await v.Prefill(vpb.PrefillRequest(session_id="c", prompt_token_ids=long, skip_prefix_cache=True))
            for held in ("a", "b", "c"):  # alone, a prefill runs in chunks of 512: the new part in one
                await v.Release(vpb.ReleaseRequest(session_id=held))
            warm = await v.Prefill(vpb.PrefillRequest(session_id="d", prompt_token_ids=long))
            assert (cold.cached_tokens, warm.cached_tokens) == (0, len(long) // BLOCK * BLOCK)
            assert cold.next_token_id == warm.next_token_id == one_call
            assert warm.chunks == 1


async def test_a_client_deadline_shorter_than_a_prefill_stops_it_and_leaves_nothing(models, tmp_path, slow_forwards):
    from conftest import running_stack

    from specsplit.api.gateway.v1 import gateway_pb2 as pb
    from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
    from specsplit.api.verify.v1 import verify_pb2 as vpb
    from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc

    request = pb.GenerateRequest(text=_long_text(500), speculation=pb.SPECULATION_OFF, max_new_tokens=4,
                                 stop=pb.StopConditions(ignore_eos=True))
    async with running_stack(tmp_path, "unix", models["long"], None) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as gch, grpc.aio.insecure_channel(stack.verify) as vch:
            gw, v = pb_grpc.GatewayStub(gch), vpb_grpc.VerifierStub(vch)
            slow_forwards(0.2)  # a chunk outlasts the deadline on any machine
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await gw.Generate(request, timeout=0.1)
            assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            async def stopped() -> bool:  # the gateway's Release stops the prefill at its next chunk
                info = await v.Info(vpb.InfoRequest())
                return info.active_prefills == info.active_sessions == 0

            await until(stopped, "the released prefill stopping", 30, every_s=0.05)
            # It stopped before its end: the prefix cache holds the blocks of its chunks before the
            # stop, not all of them; the same prompt then computes the rest.
            first = await gw.Generate(request)
            whole = first.stats.prompt_tokens // BLOCK * BLOCK
            assert first.stats.prefix_cached_tokens < whole and first.stats.prefill_chunks >= 1
            second = await gw.Generate(request)
            assert second.stats.prefix_cached_tokens > 0.9 * second.stats.prompt_tokens
            assert list(second.token_ids) == list(first.token_ids)


async def test_bench_long_context_runs_and_reports_cache_hits_and_identical_answers(models, tmp_path):
    """`bench --long-context` end to end on the tiny model with short documents: every warm answer
    equals its cold and spec-on runs (exit 0), every warm question finds the document in the prefix
    cache, and each chat turn after the first finds the conversation before it."""
    import io
    import re

    from conftest import running_stack

    from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
    from specsplit.bench import longcontext

    sizes = (200, 300, 400)
    async with running_stack(tmp_path, "unix", models["long"], None) as stack:
        with grpc.insecure_channel(stack.gateway) as channel:
            out = io.StringIO()
            status = await asyncio.to_thread(longcontext.run, pb_grpc.GatewayStub(channel), str(models["long"]),
                                             "float32", 6, "test kernels", out, sizes)
    report = out.getvalue()
    assert status == 0, report
    rows = re.findall(r"^(\w+)\.py\[:(\d+)\]\s+(\d+)\s.*?(\d+)\s+(\d+)/(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+$", report, re.M)
    assert [int(r[1]) for r in rows] == list(sizes), report
    for _, size, tokens, cached, same, n in rows:
        assert int(tokens) > int(size)  # the document and the chat around it
        assert int(cached) > 0 and same == n == str(len(longcontext.QUESTIONS) - 1), report
    turns = re.findall(r"^\s+(\d)\s+(\d+)\s+(\d+)\s+[\d.]+$", report, re.M)
    assert [int(t[0]) for t in turns] == [1, 2, 3, 4], report
    assert all(int(cached) > 0 for _, _, cached in turns[1:]), report
    assert "stall:" in report and "transformers float32 forward" in report
