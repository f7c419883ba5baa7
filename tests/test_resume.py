"""A session re-opened on another verifier (PrefillRequest.resume) goes on exactly where the lost one
was: the same next tokens, greedy and seeded, chunked or not; a resume that cannot be is refused."""

from __future__ import annotations

import grpc
import pytest
from conftest import prefill_all, running_stack

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc
from specsplit.model.modeling import load_model
from specsplit.speculation.params import SamplingParams
from verify_service.engine import Target

PROMPT = [5, 17, 3, 22, 9, 41, 8]


def _open(target: Target, tokens: list[int], sampling: SamplingParams, resume: bool, chunk: int | None = None):
    prefilling = target.start_prefill(tokens, sampling=sampling, resume=resume)
    return prefilling.session, prefill_all(target, prefilling, chunk)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, seed=11)],
                         ids=["greedy", "seeded"])
@pytest.mark.parametrize("chunk", [None, 3])
def test_a_resumed_session_continues_as_the_lost_one_would_have(models, sampling, chunk):
    target = Target(load_model(models["target"], "float32"))
    lost, first = _open(target, PROMPT, sampling, resume=False)
    for _ in range(6):  # some rounds of one token, one of a draft
        target.verify(lost, len(lost.tokens), [])
    target.verify(lost, len(lost.tokens), [lost.tokens[-1], 7])
    committed = list(lost.tokens)
    resumed, answer = _open(target, committed, sampling, resume=True, chunk=chunk)
    assert (answer.next_token, answer.length) == (committed[-1], len(committed))  # nothing chosen
    assert resumed.tokens == committed and resumed.kv.length == len(committed) - 1
    for _ in range(8):
        a = target.verify(lost, len(lost.tokens), [])
        b = target.verify(resumed, len(resumed.tokens), [])
        assert (a.next_token, a.length) == (b.next_token, b.length)
    assert resumed.tokens == lost.tokens


async def test_a_resume_prefill_is_checked_and_answered_with_the_last_token(models, tmp_path):
    async with running_stack(tmp_path, "unix", models["target"], None) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            v = vpb_grpc.VerifierStub(ch)
            for bad, says in ((vpb.PrefillRequest(session_id="a", prompt_token_ids=[5], resume=True), "at least one"),
                              (vpb.PrefillRequest(session_id="a", prompt_token_ids=PROMPT, resume=True,
                                                  logprobs=cpb.LogprobsRequest(prompt=True)), "no prompt logprobs")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await v.Prefill(bad)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in e.value.details()
            plain = await v.Prefill(vpb.PrefillRequest(session_id="plain", prompt_token_ids=PROMPT))
            resumed = await v.Prefill(vpb.PrefillRequest(session_id="resumed", prompt_token_ids=[*PROMPT,
                                                         plain.next_token_id], resume=True, return_features=True))
            assert (resumed.next_token_id, resumed.length) == (plain.next_token_id, plain.length)
            assert not resumed.HasField("features")  # the drafter has them from the lost session
            after = [await v.Verify(vpb.VerifyRequest(session_id=s, length=plain.length)) for s in ("plain", "resumed")]
            assert after[0].next_token_id == after[1].next_token_id
            for s in ("plain", "resumed"):
                await v.Release(vpb.ReleaseRequest(session_id=s))
