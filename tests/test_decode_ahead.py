"""A round without a draft decodes ahead in the verifier (VerifyRequest.decode_ahead), through the
real verify server: the same tokens, logprobs and features as one call per token, a stop after a stop
token, sessions beside it served in the same forwards with their answers matched on the shared fast
path, and a session released while it decodes is answered NOT_FOUND and leaves nothing behind."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from conftest import request, running_stack, until, wait_released

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc

PROMPT = [5, 9, 14, 3, 8, 21, 7]


async def _one_at_a_time(v, sid: str, n: int, **prefill) -> tuple[list[int], list, vpb.PrefillResponse]:
    first = await v.Prefill(vpb.PrefillRequest(session_id=sid, prompt_token_ids=PROMPT, **prefill))
    tokens, length, logprobs = [first.next_token_id], first.length, []
    for _ in range(n):
        step = await v.Verify(vpb.VerifyRequest(session_id=sid, length=length))
        tokens.append(step.next_token_id)
        logprobs += step.logprobs
        length = step.length
    return tokens, logprobs, first


async def test_decoding_ahead_equals_one_call_per_token_and_stops_after_a_stop_token(models, tmp_path):
    """Seeded sampling (coupled: the noise follows seed and position), so that the random model's
    output varies, and decoding ahead must draw exactly as one call per token does."""
    asked = cpb.LogprobsRequest(generated=True, top=2)
    sampling = cpb.Sampling(temperature=1.0, seed=7)
    async with running_stack(tmp_path, "tcp", models["long"], None, shared_memory=False) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            v = vpb_grpc.VerifierStub(ch)
            steps, step_logprobs, _ = await _one_at_a_time(v, "steps", 12, logprobs=asked, sampling=sampling)
            assert len(set(steps)) > 2, steps  # a model whose output varies (else equality says little)
            first = await v.Prefill(vpb.PrefillRequest(session_id="ahead", prompt_token_ids=PROMPT, logprobs=asked,
                                                       return_features=True, sampling=sampling))
            ahead = await v.Verify(vpb.VerifyRequest(session_id="ahead", length=first.length, decode_ahead=11))
            assert [first.next_token_id, ahead.next_token_id, *ahead.decoded_token_ids] == steps
            assert ahead.length == first.length + 12 and ahead.num_accepted == 0
            assert [(x.token_id, x.logprob) for x in ahead.logprobs] == [(x.token_id, x.logprob) for x in step_logprobs]
            # one feature row per committed token, from the last committed position on
            assert (ahead.features.start, ahead.features.rows) == (first.length - 1, 12)
            # the next round goes on from where it stopped
            more = await v.Verify(vpb.VerifyRequest(session_id="ahead", length=ahead.length))
            assert more.length == ahead.length + 1

            # A stop token ends it early: the answer's last token is the stop token (one not seen before it).
            at = next(i for i in range(1, len(steps)) if steps[i] not in steps[:i])
            stop = steps[at]
            first = await v.Prefill(vpb.PrefillRequest(session_id="stop", prompt_token_ids=PROMPT,
                                                       stop_token_ids=[stop], sampling=sampling))
            stopped = await v.Verify(vpb.VerifyRequest(session_id="stop", length=first.length, decode_ahead=11))
            got = [first.next_token_id, stopped.next_token_id, *stopped.decoded_token_ids]
            assert got == steps[:at + 1]


async def test_sessions_decoding_ahead_share_forwards_and_answers_match_on_the_fast_path(models, tmp_path):
    """Through the gateway on the shared fast-path connection: spec-off requests decode ahead while
    others run short rounds; answers come back out of request order and each reaches its call."""
    from specsplit.api.gateway.v1 import gateway_pb2 as pb
    from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc

    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)

            def req(text: str, mode: int) -> pb.GenerateRequest:
                return pb.GenerateRequest(text=text, max_new_tokens=40, speculation=mode, drafter="ngram",
                                          stop=pb.StopConditions(ignore_eos=True))

            texts = ["def add(a, b):", "The quick brown fox", "1, 2, 3, 4,", "import os\nimport sys\n"]
            alone = [await gw.Generate(req(t, pb.SPECULATION_OFF)) for t in texts]
            together = await asyncio.gather(*(gw.Generate(req(t, mode)) for t in texts
                                              for mode in (pb.SPECULATION_OFF, pb.SPECULATION_ON)))
            for i, t in enumerate(texts):
                for answer in together[2 * i:2 * i + 2]:
                    assert list(answer.token_ids) == list(alone[i].token_ids), t
                    assert answer.stats.fast_path
            assert any(r.decoded for a in together for r in a.stats.round_records)
            assert max(r.batch_calls for a in together for r in a.stats.round_records) > 1  # shared forwards


async def test_a_session_released_while_it_decodes_ahead_is_answered_not_found(models, tmp_path, slow_forwards):
    begun = slow_forwards(0.02)  # 400 forwards take 8 s at least: the Release always lands mid-decode
    async with running_stack(tmp_path, "tcp", models["long"], None, shared_memory=False) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            v = vpb_grpc.VerifierStub(ch)
            first = await v.Prefill(vpb.PrefillRequest(session_id="s", prompt_token_ids=PROMPT * 20))
            before = len(begun)
            decoding = asyncio.ensure_future(v.Verify(vpb.VerifyRequest(session_id="s", length=first.length,
                                                                        decode_ahead=400)))
            # a few forwards of the decode in (a Release runs between a decode's forwards)
            await until(lambda: len(begun) >= before + 3, "the decode's first forwards", 60)
            await v.Release(vpb.ReleaseRequest(session_id="s"))
            with pytest.raises(grpc.aio.AioRpcError) as released:
                await decoding
            assert released.value.code() == grpc.StatusCode.NOT_FOUND, released.value
            assert len(begun) < before + 400  # it stopped at the Release, not after the 400 forwards
            info = await v.Info(vpb.InfoRequest())
            assert info.active_sessions == 0
            again = await v.Prefill(vpb.PrefillRequest(session_id="s", prompt_token_ids=PROMPT))
            assert again.length == len(PROMPT) + 1  # the id is free, and nothing of the old decode remains
            with pytest.raises(grpc.aio.AioRpcError) as stale:
                await v.Verify(vpb.VerifyRequest(session_id="s", length=first.length + 5))
            assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_the_verifier_drafts_from_the_context_itself_and_stays_exact(models, tmp_path):
    """lookup_gamma: where the last two tokens occurred before, the verifier drafts what followed
    them and verifies it in the same forward: the tokens equal one call per token's, greedy and
    under seeded (coupled) sampling, and a text that repeats itself gets drafts accepted."""
    async with running_stack(tmp_path, "tcp", models["target"], None, shared_memory=False) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            v = vpb_grpc.VerifierStub(ch)
            for name, sampling in (("greedy", cpb.Sampling()), ("coupled", cpb.Sampling(temperature=1.0, seed=3))):
                steps, _, _ = await _one_at_a_time(v, f"steps-{name}", 30, sampling=sampling)
                first = await v.Prefill(vpb.PrefillRequest(session_id=f"look-{name}", prompt_token_ids=PROMPT,
                                                           sampling=sampling, return_features=True))
                ahead = await v.Verify(vpb.VerifyRequest(session_id=f"look-{name}", length=first.length,
                                                         decode_ahead=29, lookup_gamma=4))
                assert [first.next_token_id, ahead.next_token_id, *ahead.decoded_token_ids] == steps, name
                assert ahead.length == first.length + 30 and ahead.features.rows == 30
                assert ahead.lookup_accepted <= ahead.lookup_drafted
                if name == "greedy":  # the random model repeats one token: the lookup copies it
                    assert ahead.lookup_accepted > 0 and ahead.lookup_drafted > 0, ahead


@pytest.mark.e2e
@pytest.mark.parametrize("width", [0, 3], ids=["chains", "trees"])
async def test_the_verifiers_own_head_drafts_where_lookup_finds_nothing_and_changes_no_token(tmp_path, width):
    """A verify service that runs the target's feature head (VerifySettings.self_head) drafts with it
    in its decode-ahead where the prompt lookup has nothing (chains, or token trees: `width`), and
    the tree verify commits one path of them: its steps and tokens are counted apart
    from the lookup's, and the text is the one-token-per-call text (greedy: drafts change no token).
    Through the gateway, a greedy self or hybrid request is drafted there (no draft session, no
    features crossing), n-gram gets the lookup alone, and a sampled self request the draft service."""
    from transformers import AutoTokenizer

    from specsplit.model import catalog, native
    from specsplit.model.chat import chat_prompt_ids

    why = native.unavailable(torch.bfloat16, torch.device("cpu"))
    if why:
        pytest.skip(f"the verifier's head needs the native kernels: {why}")
    target = catalog.resolve(catalog.DEFAULT)
    prompt = chat_prompt_ids(AutoTokenizer.from_pretrained(target),
                             [{"role": "user", "content": "Write a Python function that checks if a number is prime."}])
    draft_kw = {"self_head": "default", "target_model": str(target)}
    # No store of earlier outputs: each request drafts from its own context (a store would copy the
    # first request's answer into the next ones whole, and the head would have nothing to draft).
    async with running_stack(tmp_path, "unix", target, None, verify_kw={"self_head": "default", "store_tokens": 0,
                                                                         "head_width": width},
                             draft_kw=draft_kw, default_drafter="hybrid") as stack:
        async with grpc.aio.insecure_channel(f"unix://{tmp_path / 'verify.sock'}") as ch:
            v = vpb_grpc.VerifierStub(ch)
            first = await v.Prefill(vpb.PrefillRequest(session_id="one", prompt_token_ids=prompt))
            steps, length = [first.next_token_id], first.length
            for _ in range(47):
                step = await v.Verify(vpb.VerifyRequest(session_id="one", length=length))
                steps.append(step.next_token_id)
                length = step.length
            first = await v.Prefill(vpb.PrefillRequest(session_id="ahead", prompt_token_ids=prompt))
            ahead = await v.Verify(vpb.VerifyRequest(session_id="ahead", length=first.length, decode_ahead=46,
                                                     lookup_gamma=8, head_gamma=8))
            got = [first.next_token_id, ahead.next_token_id, *ahead.decoded_token_ids]
            assert got == steps[:len(got)] and len(got) == 48
            assert ahead.head_steps > 0 and 0 < ahead.head_accepted <= ahead.head_drafted
            assert not ahead.HasField("features")  # the head read them here; none were asked for
            # Each source only where asked: the head alone (self), the lookup alone (n-gram), neither.
            for name, ask, lookup, head in (("head", dict(head_gamma=8), False, True),
                                            ("lookup", dict(lookup_gamma=8), True, False),
                                            ("off", {}, False, False)):
                start = await v.Prefill(vpb.PrefillRequest(session_id=name, prompt_token_ids=prompt))
                only = await v.Verify(vpb.VerifyRequest(session_id=name, length=start.length, decode_ahead=46, **ask))
                assert [start.next_token_id, only.next_token_id, *only.decoded_token_ids] == steps[:48], name
                assert (only.head_steps > 0, only.lookup_steps > 0) == (head, lookup), (name, only)
                assert (only.head_ns > 0) == head  # the head's drafting time, apart from the forwards
            for sid in ("one", "ahead", "head", "lookup", "off"):
                await v.Release(vpb.ReleaseRequest(session_id=sid))
            info = await v.Info(vpb.InfoRequest())
            assert info.head_model_id == "smollm2-135m-instruct-self"
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            text = "Write a Python function that checks if a number is prime."
            off = await gw.Generate(request(text, pb.SPECULATION_OFF, max_new_tokens=48))
            for drafter, lookup in (("self", False), ("hybrid", True), ("ngram", True)):
                on = await gw.Generate(request(text, drafter=drafter, max_new_tokens=48))
                rounds = on.stats.round_records
                assert list(on.token_ids) == list(off.token_ids), drafter
                assert not any(r.drafted or r.feature_bytes or r.draft_source for r in rounds), drafter
                assert (sum(r.head_steps for r in rounds) > 0) == (drafter != "ngram"), drafter
                # The head's time is drafting (draft_ms), on the critical path: not network, not the forwards.
                assert all((r.draft_ms > 0) == (r.head_steps > 0) for r in rounds), drafter
                assert (sum(r.lookup_drafted for r in rounds) > 0) <= lookup, drafter
            sampled = await gw.Generate(request(text, drafter="self", max_new_tokens=24,
                                                sampling=pb.SamplingParams(temperature=0.8, seed=3)))
            rounds = sampled.stats.round_records
            assert all(r.draft_source == "self" and r.feature_bytes > 0 for r in rounds if r.drafted)
            assert any(r.drafted for r in rounds) and not any(r.head_steps for r in rounds)
            # AUTO requests that name no drafter: the default (hybrid) is drafted here, n-gram's lookup
            # and the head, so n-gram alone is not tried beside it (Arms would alternate them)
            for _ in range(3):
                auto = await gw.Generate(request(text, pb.SPECULATION_AUTO, max_new_tokens=24))
                assert auto.stats.drafter == "hybrid" and list(auto.token_ids) == list(off.token_ids)[:24]
        assert await wait_released(stack) == (0, 0)
