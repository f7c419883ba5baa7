"""The verify service's own refusals, through its real gRPC server: a draft id out of the vocabulary,
a round past the context, and a round the KV budget cannot hold while other sessions hold the rest.
Each answers a clear status and leaves the session as it was (it goes on afterwards)."""

from __future__ import annotations

import grpc
import pytest
from conftest import running_stack

from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_out_of_range_drafts_and_a_full_context_are_refused_and_the_session_goes_on(models, tmp_path):
    async with running_stack(tmp_path, "tcp", models["target"], None, shared_memory=False) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            v = vpb_grpc.VerifierStub(ch)
            info = await v.Info(vpb.InfoRequest())
            first = await v.Prefill(vpb.PrefillRequest(session_id="s", prompt_token_ids=[5] * 240))
            bad = await _refused(v.Verify(vpb.VerifyRequest(session_id="s", length=first.length,
                                                            draft_token_ids=[7, info.vocab_size + 3])))
            assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and str(info.vocab_size) in bad.details()
            room = info.max_context - first.length  # a round needs room for its drafts and the next token
            full = await _refused(v.Verify(vpb.VerifyRequest(session_id="s", length=first.length,
                                                             draft_token_ids=[7] * (room + 1))))
            assert full.code() == grpc.StatusCode.OUT_OF_RANGE and str(info.max_context) in full.details()
            after = await v.Verify(vpb.VerifyRequest(session_id="s", length=first.length,
                                                     draft_token_ids=[first.next_token_id]))
            assert after.length >= first.length + 1  # the refusals left the session as it was


async def test_a_round_the_kv_budget_cannot_hold_is_refused_while_other_sessions_hold_the_rest(models, tmp_path):
    from specsplit.model.modeling import load_model

    lm = load_model(models["long"], "bfloat16")
    if lm.native is None:
        pytest.skip(lm.kernels)
    per_buffer = 256 * lm.native.token_bytes  # a session's cache starts at 256 positions
    sessions = (1 << 20) // per_buffer  # a 1 MiB budget: this many sessions of 256 positions
    async with running_stack(tmp_path, "tcp", models["long"], None, shared_memory=False,
                             verify_kw={"kv_cache_mib": 1, "prefix_cache": False}) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            v = vpb_grpc.VerifierStub(ch)
            firsts = [await v.Prefill(vpb.PrefillRequest(session_id=f"s{i}", prompt_token_ids=[5 + i] * 250))
                      for i in range(sessions)]
            # s0 grows past its 256 positions: its cache would double, and the others hold the rest.
            grow = vpb.VerifyRequest(session_id="s0", length=firsts[0].length, draft_token_ids=[9] * 10)
            refused = await _refused(v.Verify(grow))
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "MiB" in refused.details()
            await v.Release(vpb.ReleaseRequest(session_id="s1"))  # room again
            grown = await v.Verify(grow)
            assert grown.length > firsts[0].length  # the same round, now held
