"""Asynchronous drafting through the real services: the next block is drafted while Verify is in
flight, used when its assumption held and rolled back otherwise, and the output never changes."""

from __future__ import annotations

import grpc
from conftest import PROMPTS, request, running_stack, wait_released

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc


async def test_a_perfect_drafter_hits_and_skips_propose_calls(models, tmp_path):
    # The target drafting for itself: every block is accepted and its guess is the target's bonus.
    async with running_stack(tmp_path, "unix", models["target"], models["target"], "float32") as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            for prompt in PROMPTS:
                off = await gw.Generate(request(prompt, pb.SPECULATION_OFF))
                sync = await gw.Generate(request(prompt, drafter="model", gamma=3, predraft=pb.PREDRAFT_OFF))
                ahead = await gw.Generate(request(prompt, drafter="model", gamma=3, predraft=pb.PREDRAFT_ON))
                assert list(ahead.token_ids) == list(sync.token_ids) == list(off.token_ids), prompt
                assert sync.stats.predraft_attempts == 0
                s = ahead.stats
                # every block accepted whole, so every guess is right but a last one the budget cut off
                assert s.predraft_attempts >= 5 and s.predraft_hits >= s.predraft_attempts - 1, (prompt, s)
                predrafted = [r for r in s.round_records if r.predrafted]
                assert len(predrafted) == s.predraft_hits  # each hit served the next round without a Propose
                assert all(r.accepted == r.drafted for r in predrafted[:-1])
        assert await wait_released(stack) == (0, 0)


async def test_misses_roll_back_and_output_is_unchanged(models, self_head, tmp_path):
    """An imperfect model drafter, the self head (its pre-drafts continue from its own predicted
    features) and the hybrid, greedy and coupled sampling: pre-drafting changes no token."""
    draft_kw = {"self_head": str(self_head), "target_model": str(models["target"]), "self_min_confidence": 0.0}
    async with running_stack(tmp_path, "unix", models["target"], models["draft"], "float32",
                             draft_kw=draft_kw) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            coupled = pb.SamplingParams(temperature=0.9, seed=11, method=cpb.VERIFY_METHOD_COUPLED)
            misses = hits = 0
            for prompt in PROMPTS:
                for sampling in (None, coupled):
                    kw = {"sampling": sampling} if sampling else {}
                    off = await gw.Generate(request(prompt, pb.SPECULATION_OFF, **kw))
                    for drafter in ("model", "self", "hybrid"):
                        on = await gw.Generate(request(prompt, drafter=drafter, gamma=3, predraft=pb.PREDRAFT_ON, **kw))
                        assert list(on.token_ids) == list(off.token_ids), (prompt, drafter, sampling)
                        hits += on.stats.predraft_hits
                        misses += on.stats.predraft_attempts - on.stats.predraft_hits
            assert misses > 0 and hits > 0  # both paths ran
        assert await wait_released(stack) == (0, 0)


async def test_rejection_sampling_with_predrafts_is_reproducible(models, tmp_path):
    async with running_stack(tmp_path, "unix", models["target"], models["draft"], "float32") as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            rejection = pb.SamplingParams(temperature=0.9, seed=4, method=cpb.VERIFY_METHOD_REJECTION)
            first = await gw.Generate(request(PROMPTS[0], drafter="model", gamma=3, predraft=pb.PREDRAFT_ON,
                                              sampling=rejection))
            again = await gw.Generate(request(PROMPTS[0], drafter="model", gamma=3, predraft=pb.PREDRAFT_ON,
                                              sampling=rejection))
            assert list(first.token_ids) == list(again.token_ids)
            assert first.stats.predraft_attempts > 0
            assert sum(r.proposal_bytes for r in first.stats.round_records) > 0
        assert await wait_released(stack) == (0, 0)
