"""The self and hybrid drafters through the three real services: target features travel verify ->
gateway -> draft service, output equals speculation off, and a head for other weights is refused."""

from __future__ import annotations

import grpc
import pytest
from conftest import PROMPTS, request, running_stack, wait_released

from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.draft.v1 import draft_pb2_grpc as dpb_grpc
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_self_and_hybrid_drafts_keep_greedy_output_identical(models, self_head, tmp_path, transport):
    # No confidence stop: the head drafts gamma tokens every round.
    draft_kw = {"self_head": str(self_head), "target_model": str(models["target"]), "self_min_confidence": 0.0}
    async with running_stack(tmp_path, transport, models["target"], None, draft_kw=draft_kw) as stack:
        async with grpc.aio.insecure_channel(stack.draft) as ch:
            info = {d.name: d for d in (await dpb_grpc.DrafterStub(ch).Info(dpb.InfoRequest())).drafters}
        assert info["self"].needs_features and info["hybrid"].needs_features and not info["ngram"].needs_features
        assert info["self"].target_model_fingerprint and info["self"].memory_bytes > info["self"].param_bytes > 0
        assert all(d.draft_ns_per_token > 0 for d in info.values())
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            accepted = {"self": 0, "hybrid": 0}
            for prompt in PROMPTS:
                off = await gw.Generate(request(prompt, pb.SPECULATION_OFF))
                for drafter in accepted:
                    on = await gw.Generate(request(prompt, drafter=drafter, gamma=3))
                    assert list(on.token_ids) == list(off.token_ids), (prompt, drafter)
                    records = on.stats.round_records
                    assert records[0].feature_bytes > 0  # the prompt's features, then each round's
                    assert all(r.feature_bytes > 0 for r in records)
                    assert {r.draft_source for r in records if r.drafted} <= {"self", "ngram"}
                    if drafter == "self":
                        # (the last rounds are clamped by max_new_tokens)
                        assert all(r.draft_source == "self" and r.drafted == 3 for r in records[:-3])
                    accepted[drafter] += on.stats.accepted_tokens
            assert accepted["self"] > 0, "a trained head should get drafts accepted"
        assert await wait_released(stack) == (0, 0)


async def test_a_head_for_other_target_weights_is_refused_per_request(models, self_head, tmp_path):
    """The verifier serves 'draft' (same tokenizer, other weights); the draft service's head was made
    for 'target'. The gateway refuses self drafting with a message that says why."""
    draft_kw = {"self_head": str(self_head), "target_model": str(models["target"])}
    async with running_stack(tmp_path, "unix", models["draft"], None, draft_kw=draft_kw) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await gw.Generate(request(PROMPTS[0], drafter="self"))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "trained for target weights" in e.value.details()
            ok = await gw.Generate(request(PROMPTS[0], drafter="ngram"))  # other drafters still serve
            assert ok.stats.speculation_used
        # And the draft service refuses such a session on its own, whoever calls it.
        async with grpc.aio.insecure_channel(stack.draft) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await dpb_grpc.DrafterStub(ch).StartSession(dpb.StartSessionRequest(
                    session_id="x", drafter="self", prompt_token_ids=[1, 2], target_model_fingerprint="0" * 16))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_retrieval_store_drafts_a_repeated_answer_from_an_earlier_request(models, tmp_path, monkeypatch):
    from verify_service.widths import Widths

    # Wider forwards priced flat: the lookup depth then follows the matches alone, not this
    # machine's momentary cost of a row (which can price every lookup out on a loaded machine).
    monkeypatch.setattr(Widths, "curve", lambda self, step_ms, start, sampling=None: [1.0] * len(start))
    async with running_stack(tmp_path, "unix", models["target"], None) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            firsts = {p: await gw.Generate(request(p, drafter="ngram", gamma=4)) for p in PROMPTS}
            # The least repetitive answer: prompt lookup alone does worst on it.
            prompt = min(PROMPTS, key=lambda p: firsts[p].stats.mean_acceptance_length)
            first = firsts[prompt]
            # Outputs join the store when their session is released, in the background after the answer.
            assert await wait_released(stack) == (0, 0)
            second = await gw.Generate(request(prompt, drafter="ngram", gamma=4))
        assert list(first.token_ids) == list(second.token_ids)
        # The second request copies the first one's output from the store.
        assert second.stats.mean_acceptance_length > first.stats.mean_acceptance_length + 1


async def test_features_sent_to_a_drafter_that_reads_none_are_refused(models, tmp_path):
    from specsplit.api.common.v1 import common_pb2 as cpb

    async with running_stack(tmp_path, "unix", models["target"], None) as stack:
        async with grpc.aio.insecure_channel(stack.draft) as ch:
            stub = dpb_grpc.DrafterStub(ch)
            await stub.StartSession(dpb.StartSessionRequest(session_id="s", drafter="ngram", prompt_token_ids=[1, 2]))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Propose(dpb.ProposeRequest(
                    session_id="s", base_length=2, new_token_ids=[3], gamma=2,
                    features=cpb.Features(start=0, rows=1, dim=4, dtype="float32", data=bytes(16))))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "reads none" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Propose(dpb.ProposeRequest(
                    session_id="s", base_length=3, new_token_ids=[4], gamma=2,
                    features=cpb.Features(start=0, rows=2, dim=4, dtype="float32", data=bytes(5))))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "bytes" in e.value.details()
            await stub.EndSession(dpb.EndSessionRequest(session_id="s"))
