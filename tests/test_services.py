"""The three real services on temp UNIX sockets and loopback TCP, with tiny random models."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from conftest import PROMPTS, active_sessions, request, running_stack, until, wait_released

from gateway.rounds import DECODE_AHEAD
from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.draft.v1 import draft_pb2_grpc as dpb_grpc
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc


@pytest.mark.parametrize("transport", ["unix", "tcp"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
async def test_speculation_on_equals_off_token_for_token(models, tmp_path, transport, dtype):
    # unix: co-located, rounds on the fast path; tcp: as on separate hosts, rounds on gRPC streams.
    fast = transport == "unix"
    async with running_stack(tmp_path, transport, models["target"], models["draft"], dtype,
                             shared_memory=fast) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            accepted = 0
            for prompt in PROMPTS:
                off = await gw.Generate(request(prompt, pb.SPECULATION_OFF))
                for drafter in ("ngram", "model"):
                    on = await gw.Generate(request(prompt, drafter=drafter, gamma=3))
                    assert list(on.token_ids) == list(off.token_ids), (prompt, drafter)
                    assert on.text == off.text
                    assert on.stats.speculation_used and on.stats.drafter == drafter
                    assert on.stats.fast_path is fast and off.stats.fast_path is fast
                    accepted += on.stats.accepted_tokens
                # Spec-off: the verifier decodes ahead on its own, DECODE_AHEAD tokens after each round's.
                records = off.stats.round_records
                assert sum(1 + r.decoded for r in records) == off.stats.generated_tokens - 1
                assert len(records) == -(-(off.stats.generated_tokens - 1) // (1 + DECODE_AHEAD))
                assert off.stats.mean_acceptance_length == 1.0
            assert accepted > 0, "the perturbed draft model should get some tokens accepted"
        assert await wait_released(stack) == (0, 0)


async def test_concurrent_requests_keep_their_sessions_apart(models, tmp_path):
    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            alone = [await gw.Generate(request(p, drafter="model")) for p in PROMPTS]
            together = await asyncio.gather(*(gw.Generate(request(p, drafter=d))
                                              for p in PROMPTS for d in ("model", "ngram")))
        for i, response in enumerate(together):
            assert list(response.token_ids) == list(alone[i // 2].token_ids)
        assert await wait_released(stack) == (0, 0)


async def test_generation_stops_at_the_context_end_with_drafts_clamped(models, tmp_path):
    async with running_stack(tmp_path, "tcp", models["target"], models["draft"]) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            prompt = "def add(a, b):\n    return a + b\n" * 200
            tokens = len(stack_tokenizer(models["target"]).encode(prompt))
            cut = prompt[:len(prompt) * 250 // tokens]  # about 250 of the model's 256 positions
            for speculation in (pb.SPECULATION_OFF, pb.SPECULATION_ON):
                response = await gw.Generate(request(cut, speculation, drafter="model", gamma=8, max_new_tokens=50))
                prompt_tokens = response.stats.prompt_tokens
                assert 240 < prompt_tokens < 256
                assert response.finish_reason == pb.FINISH_REASON_CONTEXT
                assert prompt_tokens + response.stats.generated_tokens == 256


def stack_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def test_stats_add_up_and_stream_matches_unary(models, tmp_path):
    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            req = request(PROMPTS[0], drafter="model", gamma=4, max_new_tokens=30)
            whole = await gw.Generate(req)
            chunks = [c async for c in gw.GenerateStream(req)]
        s = whole.stats
        assert s.generated_tokens == len(whole.token_ids) == 30
        assert whole.finish_reason == pb.FINISH_REASON_LENGTH
        assert s.rounds == len(s.round_records)
        assert s.drafted_tokens == sum(r.drafted for r in s.round_records)
        assert s.accepted_tokens == sum(r.accepted for r in s.round_records) <= s.drafted_tokens
        # Prefill gives one token, every round its accepted drafts plus one.
        assert 1 + s.accepted_tokens + s.rounds == s.generated_tokens
        assert s.mean_acceptance_length == pytest.approx((s.accepted_tokens + s.rounds) / s.rounds)
        assert all(r.network_ms >= 0 and r.verify_ms > 0 for r in s.round_records)
        assert s.exact
        assert "".join(c.text for c in chunks) == whole.text
        assert [t for c in chunks for t in c.token_ids] == list(whole.token_ids)
        assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and chunks[-1].stats.rounds == s.rounds


async def test_chat_prompt_and_stop_string(models, tmp_path):
    async with running_stack(tmp_path, "unix", models["target"], None) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hello there")])
            full = await gw.Generate(pb.GenerateRequest(chat=chat, max_new_tokens=40,
                                                        stop=pb.StopConditions(ignore_eos=True)))
            assert full.stats.prompt_tokens > 3
            stop = full.text[len(full.text) // 2:][:2]
            assert stop, "need some text to cut"
            cut = await gw.Generate(pb.GenerateRequest(chat=chat, max_new_tokens=40,
                                                       stop=pb.StopConditions(ignore_eos=True, stop_strings=[stop])))
        assert cut.finish_reason == pb.FINISH_REASON_STOP_STRING
        assert cut.text == full.text[:full.text.index(stop)]


BAD_REQUESTS = [
    (pb.GenerateRequest(max_new_tokens=5), grpc.StatusCode.INVALID_ARGUMENT, "no prompt"),
    (pb.GenerateRequest(text="   ", max_new_tokens=5), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (pb.GenerateRequest(text="hi"), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
    (pb.GenerateRequest(text="hi", max_new_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT, "limit"),
    (pb.GenerateRequest(text="hi " * 400, max_new_tokens=5), grpc.StatusCode.INVALID_ARGUMENT, "context"),
    (pb.GenerateRequest(text="hi", max_new_tokens=5, gamma=99), grpc.StatusCode.INVALID_ARGUMENT, "gamma"),
    (pb.GenerateRequest(text="hi", max_new_tokens=5, drafter="nope"), grpc.StatusCode.INVALID_ARGUMENT,
     "unknown drafter"),
    (pb.GenerateRequest(text="hi", max_new_tokens=5, sampling=pb.SamplingParams(temperature=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (pb.GenerateRequest(text="hi", max_new_tokens=5, sampling=pb.SamplingParams(temperature=0.7, method=7)),
     grpc.StatusCode.INVALID_ARGUMENT, "verify method"),
    (pb.GenerateRequest(text="hi", max_new_tokens=5, sampling=pb.SamplingParams(top_p=1.5)),
     grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (pb.GenerateRequest(text="hi", max_new_tokens=5, stop=pb.StopConditions(stop_strings=[""])),
     grpc.StatusCode.INVALID_ARGUMENT, "stop strings"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot", content="x")]),
                        max_new_tokens=5), grpc.StatusCode.INVALID_ARGUMENT, "role"),
]


def _bytes_field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field as raw bytes (payloads under 128 bytes)."""
    return bytes([number << 3 | 2, len(payload)]) + payload


# Bytes no protobuf library would send: each must get INVALID_ARGUMENT, not UNKNOWN.
UNDECODABLE = [
    _bytes_field(1, b"\xff\xfe not UTF-8") + b"\x18\x05",  # text, then max_new_tokens=5
    _bytes_field(1, b"\xed\xb2\x80 a surrogate, encoded"),
    _bytes_field(1, b"hello")[:-2],  # truncated
    b"\xff" * 12,  # not protobuf at all
    b"\x18" + b"\xff" * 11,  # a varint that never ends
]


async def test_bad_requests_get_specific_status_and_leave_nothing(models, tmp_path):
    async with running_stack(tmp_path, "tcp", models["target"], models["draft"]) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            for req, code, words in BAD_REQUESTS:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await gw.Generate(req)
                assert err.value.code() == code, req
                assert words in err.value.details(), err.value.details()
        # Raw bytes to every unary method a client reaches, on each of the three services.
        for address, methods in ((stack.gateway, ["/specsplit.gateway.v1.Gateway/Generate",
                                                  "/specsplit.gateway.v1.Gateway/GenerateStream"]),
                                 (stack.verify, ["/specsplit.verify.v1.Verifier/Prefill",
                                                 "/specsplit.verify.v1.Verifier/Verify"]),
                                 (stack.draft, ["/specsplit.draft.v1.Drafter/StartSession",
                                                "/specsplit.draft.v1.Drafter/Propose"])):
            async with grpc.aio.insecure_channel(address) as ch:
                for method in methods:
                    call = (ch.unary_stream if method.endswith("Stream") else ch.unary_unary)(method)
                    for raw in UNDECODABLE:
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            answer = call(raw, timeout=30)
                            if method.endswith("Stream"):
                                [_ async for _ in answer]
                            else:
                                await answer
                        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw, err.value)
                        assert "does not parse" in err.value.details() and method in err.value.details()
        async with grpc.aio.insecure_channel(stack.gateway) as ch:  # and the services still serve
            assert (await pb_grpc.GatewayStub(ch).Generate(request(PROMPTS[0]))).token_ids
        assert await wait_released(stack) == (0, 0)


async def test_internal_calls_refuse_bad_input(models, tmp_path):
    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as v, grpc.aio.insecure_channel(stack.draft) as d:
            verifier, drafter = vpb_grpc.VerifierStub(v), dpb_grpc.DrafterStub(d)

            async def code_of(call) -> grpc.StatusCode:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                return err.value.code()

            assert await code_of(verifier.Verify(vpb.VerifyRequest(session_id="ghost", length=3))) \
                == grpc.StatusCode.NOT_FOUND
            assert await code_of(drafter.Propose(dpb.ProposeRequest(session_id="ghost", gamma=2))) \
                == grpc.StatusCode.NOT_FOUND
            assert await code_of(verifier.Prefill(vpb.PrefillRequest(session_id="s"))) \
                == grpc.StatusCode.INVALID_ARGUMENT
            assert await code_of(verifier.Prefill(vpb.PrefillRequest(session_id="s", prompt_token_ids=[10**6]))) \
                == grpc.StatusCode.INVALID_ARGUMENT
            first = await verifier.Prefill(vpb.PrefillRequest(session_id="s", prompt_token_ids=[5, 6, 7]))
            assert first.length == 4
            assert await code_of(verifier.Prefill(vpb.PrefillRequest(session_id="s", prompt_token_ids=[5]))) \
                == grpc.StatusCode.ALREADY_EXISTS
            assert await code_of(verifier.Verify(vpb.VerifyRequest(session_id="s", length=9, draft_token_ids=[1]))) \
                == grpc.StatusCode.FAILED_PRECONDITION
            huge = vpb.VerifyRequest(session_id="s", length=4, draft_token_ids=[10**6])
            assert await code_of(verifier.Verify(huge)) == grpc.StatusCode.INVALID_ARGUMENT
            ok = await verifier.Verify(vpb.VerifyRequest(session_id="s", length=4, draft_token_ids=[1, 2]))
            assert ok.length == 4 + ok.num_accepted + 1
            assert (await verifier.Release(vpb.ReleaseRequest(session_id="s"))).released
            assert not (await verifier.Release(vpb.ReleaseRequest(session_id="s"))).released
            assert await code_of(drafter.StartSession(dpb.StartSessionRequest(
                session_id="t", drafter="model", prompt_token_ids=[1], target_tokenizer_fingerprint="f00"))) \
                == grpc.StatusCode.FAILED_PRECONDITION
            await drafter.StartSession(dpb.StartSessionRequest(session_id="t", prompt_token_ids=[1, 2, 1]))
            assert await code_of(drafter.Propose(dpb.ProposeRequest(session_id="t", gamma=0))) \
                == grpc.StatusCode.INVALID_ARGUMENT
            assert await code_of(drafter.Propose(dpb.ProposeRequest(session_id="t", gamma=2, base_length=7))) \
                == grpc.StatusCode.FAILED_PRECONDITION
            assert (await drafter.EndSession(dpb.EndSessionRequest(session_id="t"))).ended
        assert await wait_released(stack) == (0, 0)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["fast path", "streams"])
async def test_sessions_released_after_cancel_and_deadline(models, tmp_path, slow_forwards, shared_memory):
    # 200 tokens take at least 40 forwards of at least 20 ms: far past the 0.3 s deadline on any machine.
    slow_forwards(0.02)
    async with running_stack(tmp_path, "unix", models["target"], models["draft"],
                             shared_memory=shared_memory) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            req = request(PROMPTS[1], drafter="model", max_new_tokens=200)
            stream = gw.GenerateStream(req)
            async for _ in stream:
                assert await active_sessions(stack) == (1, 1)
                break
            stream.cancel()
            assert await wait_released(stack) == (0, 0)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gw.Generate(req, timeout=0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await wait_released(stack) == (0, 0)


async def test_n_gram_requests_draft_in_the_verifier_and_take_no_draft_session(models, tmp_path):
    """A request whose drafter is n-gram: no draft session at any point; the verifier's own lookups
    are accepted and counted (tokens per forward); greedy equals spec-off, and a sampled request
    under rejection sampling drafts too (q = 1 on each copy) and is reproduced by its seed."""
    from specsplit.api.common.v1 import common_pb2 as cpb

    text = "one two three one two three one two three one two"
    # No store of earlier outputs: under rejection sampling the output depends on the drafts (only
    # coupled sampling is drafter-invariant), and a store makes a repeated request's drafts differ.
    async with running_stack(tmp_path, "unix", models["target"], models["draft"],
                             verify_kw={"store_tokens": 0}) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            off = await gw.Generate(request(text, pb.SPECULATION_OFF, max_new_tokens=120))
            stream = gw.GenerateStream(request(text, drafter="ngram", max_new_tokens=120))
            chunks = []
            async for chunk in stream:
                if not chunks:
                    assert await active_sessions(stack) == (1, 0)  # the verifier's session alone
                chunks.append(chunk)
            on = chunks[-1].stats
            assert [t for c in chunks for t in c.token_ids] == list(off.token_ids)
            assert on.speculation_used and on.drafter == "ngram" and not on.shared_memory
            looked = sum(r.lookup_accepted for r in on.round_records)
            assert looked > 0 and on.accepted_tokens == looked
            assert on.drafted_tokens == sum(r.lookup_drafted for r in on.round_records)
            assert on.forwards == sum(1 + r.decoded - r.lookup_accepted for r in on.round_records) < 119
            assert on.mean_acceptance_length == pytest.approx((on.accepted_tokens + on.forwards) / on.forwards)
            sampling = pb.SamplingParams(temperature=0.3, seed=5, method=cpb.VERIFY_METHOD_REJECTION)
            sampled = [await gw.Generate(request(text, drafter="ngram", max_new_tokens=120, sampling=sampling))
                       for _ in range(2)]
            assert list(sampled[0].token_ids) == list(sampled[1].token_ids)
            assert sampled[0].stats.verify_method == "rejection" and sampled[0].stats.drafted_tokens > 0
        assert await wait_released(stack) == (0, 0)


async def test_without_the_draft_service_copies_still_speculate_and_model_drafts_fall_back_or_fail(models, tmp_path):
    """The draft service dies: n-gram requests go on speculating (the verifier drafts copies
    itself), an AUTO request for the draft model runs without drafts, an ON one is refused; every
    answer equals spec-off's and no session is left."""
    async with running_stack(tmp_path, "unix", models["target"], models["draft"], rpc_timeout_s=5) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            baseline = await gw.Generate(request(PROMPTS[2], pb.SPECULATION_OFF))
            stack.tasks[1].cancel()  # the draft service dies
            await asyncio.gather(stack.tasks[1], return_exceptions=True)
            auto = await gw.Generate(request(PROMPTS[2], pb.SPECULATION_AUTO, drafter="model"))
            assert not auto.stats.speculation_used
            assert list(auto.token_ids) == list(baseline.token_ids)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await gw.Generate(request(PROMPTS[2], pb.SPECULATION_ON, drafter="model"))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draft service" in err.value.details()
            for mode in (pb.SPECULATION_AUTO, pb.SPECULATION_ON):
                copied = await gw.Generate(request(PROMPTS[2], mode, drafter="ngram"))
                assert copied.stats.speculation_used and copied.stats.drafter == "ngram", copied.stats
                assert list(copied.token_ids) == list(baseline.token_ids)
        async with grpc.aio.insecure_channel(stack.verify) as v:
            async def released() -> bool:  # in the background once the answer is out
                return not (await vpb_grpc.VerifierStub(v).Info(vpb.InfoRequest())).active_sessions

            await until(released, "the verifier releasing every session", 60)


async def test_auto_requests_naming_no_drafter_try_n_gram_beside_the_default_and_forced_ones_do_not(models, tmp_path):
    """The default drafter (a draft model here) and n-gram alone take turns for AUTO requests that name
    none, until the controller has timed both; ON requests and requests that name one get what they
    asked; every answer equals spec-off's."""
    async with running_stack(tmp_path, "unix", models["target"], models["draft"], "float32",
                             default_drafter="model") as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            baseline = await gw.Generate(request(PROMPTS[1], pb.SPECULATION_OFF))
            used = []
            for _ in range(4):
                auto = await gw.Generate(request(PROMPTS[1], pb.SPECULATION_AUTO))
                assert list(auto.token_ids) == list(baseline.token_ids)
                used.append(auto.stats.drafter)
            assert set(used) == {"model", "ngram"}, used
            for _ in range(2):
                assert (await gw.Generate(request(PROMPTS[1], pb.SPECULATION_ON))).stats.drafter == "model"
            named = request(PROMPTS[1], pb.SPECULATION_AUTO)
            named.drafter = "model"
            assert (await gw.Generate(named)).stats.drafter == "model"


async def test_every_server_has_health_and_reflection(models, tmp_path):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    async with running_stack(tmp_path, "unix", models["target"], None) as stack:
        expected = {stack.gateway: "specsplit.gateway.v1.Gateway", stack.verify: "specsplit.verify.v1.Verifier",
                    stack.draft: "specsplit.draft.v1.Drafter"}

        def services(address: str) -> set[str]:
            with grpc.insecure_channel(address) as ch:
                return set(ProtoReflectionDescriptorDatabase(ch).get_services())

        for address, service in expected.items():
            listed = await asyncio.to_thread(services, address)
            assert {service, "grpc.health.v1.Health"} <= listed
            async with grpc.aio.insecure_channel(address) as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_drafter_with_another_tokenizer_is_refused(models, tmp_path):
    # As the default drafter the gateway refuses to start at all.
    with pytest.raises(RuntimeError, match="token ids do not match"):
        async with running_stack(tmp_path / "a", "unix", models["target"], models["foreign"], default_drafter="model"):
            pass
    # As an optional drafter, requests that name it are refused.
    async with running_stack(tmp_path / "b", "unix", models["target"], models["foreign"]) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.GatewayStub(ch).Generate(request(PROMPTS[0], drafter="model"))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "token ids do not match" in err.value.details()


async def test_gateway_refuses_requests_until_its_backends_answer(models, tmp_path):
    from gateway.main import run as run_gateway
    from specsplit.serving.settings import GatewaySettings, ServerSettings

    nowhere = f"unix://{tmp_path / 'nobody.sock'}"
    settings = GatewaySettings(ServerSettings(f"unix://{tmp_path / 'gw.sock'}", grace_s=0.5), nowhere, nowhere,
                               tokenizer=str(models["target"]), connect_timeout_s=30)
    stop = asyncio.Event()
    task = asyncio.create_task(run_gateway(settings, stop, handle_signals=False))
    try:
        await until((tmp_path / "gw.sock").exists, "the gateway listening on gw.sock", task=task)
        async with grpc.aio.insecure_channel(f"unix://{tmp_path / 'gw.sock'}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.GatewayStub(ch).Generate(request("hi"))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "still connecting" in err.value.details()
    finally:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)


async def test_verifier_refuses_bad_sampling_and_bad_proposals(models, tmp_path):
    from specsplit.api.common.v1 import common_pb2 as cpb

    async with running_stack(tmp_path, "unix", models["target"], None) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            stub = vpb_grpc.VerifierStub(ch)
            for sampling, words in ((cpb.Sampling(temperature=-1), "temperature"),
                                    (cpb.Sampling(temperature=1, top_p=1.5), "top_p")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Prefill(vpb.PrefillRequest(session_id="a", prompt_token_ids=[1, 2], sampling=sampling))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
            rejection = cpb.Sampling(temperature=1, seed=1, method=cpb.VERIFY_METHOD_REJECTION)
            first = await stub.Prefill(vpb.PrefillRequest(session_id="s", prompt_token_ids=[1, 2], sampling=rejection))
            for probs, words in (([], "one proposal distribution per draft token"),
                                 ([cpb.SparseProbs(token_ids=[5], probs=[0.5])], "sum to 1"),
                                 ([cpb.SparseProbs(token_ids=[6], probs=[1.0])], "probability 0")):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Verify(vpb.VerifyRequest(session_id="s", length=first.length, draft_token_ids=[5],
                                                        draft_probs=probs))
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
            ok = await stub.Verify(vpb.VerifyRequest(session_id="s", length=first.length, draft_token_ids=[5],
                                                     draft_probs=[cpb.SparseProbs(token_ids=[5], probs=[1.0])]))
            assert ok.length == first.length + ok.num_accepted + 1
            # The refused calls left the session untouched: a fresh session gives the same answer.
            await stub.Prefill(vpb.PrefillRequest(session_id="t", prompt_token_ids=[1, 2], sampling=rejection))
            fresh = await stub.Verify(vpb.VerifyRequest(session_id="t", length=first.length, draft_token_ids=[5],
                                                        draft_probs=[cpb.SparseProbs(token_ids=[5], probs=[1.0])]))
            assert (fresh.num_accepted, fresh.next_token_id) == (ok.num_accepted, ok.next_token_id)
            await stub.Release(vpb.ReleaseRequest(session_id="t"))
            await stub.Release(vpb.ReleaseRequest(session_id="s"))


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_coupled_sampling_gives_the_same_text_with_speculation_on_or_off(models, tmp_path, transport):
    from specsplit.api.common.v1 import common_pb2 as cpb

    async with running_stack(tmp_path, transport, models["target"], models["draft"]) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            seeds_differ = 0
            for prompt in PROMPTS:
                sampling = pb.SamplingParams(temperature=0.8, top_p=0.95, seed=11)
                off = await gw.Generate(request(prompt, pb.SPECULATION_OFF, sampling=sampling))
                assert off.stats.seed == 11 and off.stats.verify_method == "coupled"
                for drafter in ("ngram", "model"):
                    on = await gw.Generate(request(prompt, drafter=drafter, gamma=3, sampling=sampling))
                    assert list(on.token_ids) == list(off.token_ids), (prompt, drafter)
                    s = on.stats
                    assert s.recovered_tokens + s.bonus_tokens == sum(1 for r in s.round_records if r.drafted)
                other = await gw.Generate(request(prompt, pb.SPECULATION_OFF,
                                                  sampling=pb.SamplingParams(temperature=0.8, top_p=0.95, seed=12)))
                seeds_differ += list(other.token_ids) != list(off.token_ids)
            assert seeds_differ >= len(PROMPTS) - 1  # another seed, another text
            drawn = await gw.Generate(request(PROMPTS[0], sampling=pb.SamplingParams(temperature=0.8)))
            again = await gw.Generate(request(PROMPTS[0], pb.SPECULATION_OFF,
                                              sampling=pb.SamplingParams(temperature=0.8, seed=drawn.stats.seed)))
            assert list(again.token_ids) == list(drawn.token_ids)  # the reported seed reproduces the text
            rejection = pb.SamplingParams(temperature=0.8, seed=5, method=cpb.VERIFY_METHOD_REJECTION)
            first = await gw.Generate(request(PROMPTS[1], drafter="model", sampling=rejection))
            second = await gw.Generate(request(PROMPTS[1], drafter="model", sampling=rejection))
            assert list(first.token_ids) == list(second.token_ids) and first.stats.verify_method == "rejection"
            sent = [r.proposal_bytes for r in first.stats.round_records if r.drafted]
            assert sent and all(b > 0 for b in sent)  # the drafter's sampled q went to the verifier
        assert await wait_released(stack) == (0, 0)


async def test_model_drafter_drafts_with_the_verifiers_noise_in_coupled_mode(models, tmp_path):
    """The target drafting for itself at temperature 1: with the shared (seed, position) noise its
    drafts are the target's own sampled choices, so every draft is accepted (drafting greedily
    instead would match a sampled token far less often)."""
    async with running_stack(tmp_path, "unix", models["target"], models["target"], "float32") as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            sampling = pb.SamplingParams(temperature=1.0, seed=21)
            for prompt in PROMPTS:
                off = await gw.Generate(request(prompt, pb.SPECULATION_OFF, sampling=sampling))
                on = await gw.Generate(request(prompt, drafter="model", gamma=4, sampling=sampling))
                assert list(on.token_ids) == list(off.token_ids)
                rounds = [(r.drafted, r.accepted) for r in on.stats.round_records if r.drafted]
                assert rounds and all(a == d for d, a in rounds), (prompt, rounds)


async def test_draft_service_returns_what_each_draft_was_sampled_from(models, tmp_path):
    from specsplit.api.common.v1 import common_pb2 as cpb

    async with running_stack(tmp_path, "unix", models["target"], models["draft"],
                             draft_kw={"proposal_top_k": 5}) as stack:
        async with grpc.aio.insecure_channel(stack.draft) as ch:
            stub = dpb_grpc.DrafterStub(ch)
            prompt = [5, 6, 7, 8, 5, 6, 7]
            for drafter, method, expect in (("model", cpb.VERIFY_METHOD_REJECTION, "sampled"),
                                            ("ngram", cpb.VERIFY_METHOD_REJECTION, "point"),
                                            ("model", cpb.VERIFY_METHOD_COUPLED, "none")):
                sid = f"{drafter}-{method}"
                await stub.StartSession(dpb.StartSessionRequest(
                    session_id=sid, drafter=drafter, prompt_token_ids=prompt,
                    sampling=cpb.Sampling(temperature=0.9, seed=3, method=method)))
                got = await stub.Propose(dpb.ProposeRequest(session_id=sid, base_length=len(prompt), gamma=3))
                await stub.EndSession(dpb.EndSessionRequest(session_id=sid))
                assert got.draft_token_ids, drafter
                if expect == "none":
                    assert not got.draft_probs
                    continue
                assert len(got.draft_probs) == len(got.draft_token_ids)
                for token, q in zip(got.draft_token_ids, got.draft_probs):
                    assert token in q.token_ids and sum(q.probs) == pytest.approx(1.0, abs=1e-5)
                    if expect == "point":
                        assert (list(q.token_ids), list(q.probs)) == ([token], [1.0])
                    else:
                        assert 1 <= len(q.token_ids) <= 5
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.StartSession(dpb.StartSessionRequest(session_id="bad", prompt_token_ids=prompt,
                                                                sampling=cpb.Sampling(temperature=-2)))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in e.value.details()


async def test_controller_reasons_policy_and_concurrency(models, tmp_path, caplog):
    """AUTO requests go through the controller: reasons in stats, a calibrated policy that turns a
    task type off (applied only for the models it was made with), and the concurrency cut-off."""
    import json

    from specsplit.serving.settings import ControllerSettings

    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as v, grpc.aio.insecure_channel(stack.draft) as d:
            target = await vpb_grpc.VerifierStub(v).Info(vpb.InfoRequest())
            drafters = {x.name: x for x in (await dpb_grpc.DrafterStub(d).Info(dpb.InfoRequest())).drafters}
    from gateway import policy

    good, stale = tmp_path / "policy.json", tmp_path / "stale.json"
    policy.write(good, target, drafters, {"chat": {"model": {"speculate": False, "gamma": 2}},
                                          "code": {"model": {"speculate": True, "gamma": 3}}})
    document = json.loads(good.read_text())
    document["target"]["model_fingerprint"] = "0" * 16
    stale.write_text(json.dumps(document))
    for path, applied in ((good, True), (stale, False)):
        settings = ControllerSettings(max_inflight=1, control_share=0.0)
        async with running_stack(tmp_path / path.stem, "unix", models["target"], models["draft"],
                                 controller=settings, policy_file=str(path)) as stack:
            async with grpc.aio.insecure_channel(stack.gateway) as ch:
                gw = pb_grpc.GatewayStub(ch)
                chat = await gw.Generate(request(PROMPTS[0], pb.SPECULATION_AUTO, drafter="model", task_type="chat"))
                code = await gw.Generate(request(PROMPTS[1], pb.SPECULATION_AUTO, drafter="model", task_type="code"))
                forced = await gw.Generate(request(PROMPTS[0], pb.SPECULATION_ON, drafter="model", task_type="chat"))
                assert forced.stats.speculation_used and forced.stats.speculation_reason == "forced"
                if applied:
                    # The policy's verdict is the type's; the request is judged on its own rounds.
                    assert chat.stats.speculation_reason == "disabled" and chat.stats.speculation_used
                    assert (code.stats.gamma, code.stats.speculation_reason) == (3, "on")
                else:  # models changed since calibration: warn and adapt live from the defaults
                    assert chat.stats.speculation_used and chat.stats.gamma == 4
                    assert "recalibrate" in caplog.text
                many = await asyncio.gather(*(gw.Generate(request(p, pb.SPECULATION_AUTO, drafter="model",
                                                                  task_type="code")) for p in PROMPTS))
                reasons = {r.stats.speculation_reason for r in many}
                assert "concurrency" in reasons and all(
                    r.stats.speculation_used == (r.stats.speculation_reason != "concurrency") for r in many)


async def test_verifier_refuses_sessions_past_its_kv_budget_and_frees_them_on_release(models, tmp_path):
    from specsplit.model.modeling import load_model

    native = load_model(models["target"], "bfloat16").native
    if native is None:
        pytest.skip("the KV budget bounds the native forward's caches")
    fits = (1 << 20) // (256 * native.token_bytes)  # a session's cache starts at 256 positions
    async with running_stack(tmp_path, "unix", models["target"], None, verify_kw={"kv_cache_mib": 1}) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            stub = vpb_grpc.VerifierStub(ch)
            for i in range(fits):
                await stub.Prefill(vpb.PrefillRequest(session_id=f"s{i}", prompt_token_ids=[1, 2, 3]))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Prefill(vpb.PrefillRequest(session_id="over", prompt_token_ids=[1, 2, 3]))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "MiB" in e.value.details()
            await stub.Release(vpb.ReleaseRequest(session_id="s0"))
            await stub.Prefill(vpb.PrefillRequest(session_id="again", prompt_token_ids=[1, 2, 3]))  # room is back
            for sid in ["again", *(f"s{i}" for i in range(1, fits))]:
                await stub.Release(vpb.ReleaseRequest(session_id=sid))
            assert (await stub.Info(vpb.InfoRequest())).active_sessions == 0


async def test_sessions_evicted_idle_give_their_kv_budget_back(models, tmp_path):
    """A gateway that dies leaves its sessions open: the verifier evicts them once idle and their
    caches' budget comes back (ended as a Release ends them), so new sessions fit again."""
    from specsplit.model.modeling import load_model

    native = load_model(models["target"], "bfloat16").native
    if native is None:
        pytest.skip("the KV budget bounds the native forward's caches")
    fits = (1 << 20) // (256 * native.token_bytes)
    async with running_stack(tmp_path, "unix", models["target"], None,
                             verify_kw={"kv_cache_mib": 1, "idle_timeout_s": 0.5}) as stack:
        async with grpc.aio.insecure_channel(stack.verify) as ch:
            stub = vpb_grpc.VerifierStub(ch)
            for i in range(fits):
                await stub.Prefill(vpb.PrefillRequest(session_id=f"s{i}", prompt_token_ids=[1, 2, 3]))

            async def evicted() -> bool:
                return (await stub.Info(vpb.InfoRequest())).active_sessions == 0

            await until(evicted, "the idle sessions evicted", 30, every_s=0.05)
            for i in range(fits):  # the whole budget is back
                await stub.Prefill(vpb.PrefillRequest(session_id=f"new{i}", prompt_token_ids=[1, 2, 3]))
            assert not (await stub.Release(vpb.ReleaseRequest(session_id="s0"))).released  # already ended


async def test_concurrent_requests_past_the_kv_budget_are_refused_clearly_and_the_rest_answer(
        models, tmp_path, slow_forwards):
    from specsplit.model.modeling import load_model

    native = load_model(models["target"], "bfloat16").native
    if native is None:
        pytest.skip("the KV budget bounds the native forward's caches")
    fits = (1 << 20) // (256 * native.token_bytes)  # a session's cache starts at 256 positions
    slow_forwards(0.01)  # every request is still decoding when the last one arrives
    async with running_stack(tmp_path, "unix", models["target"], models["draft"],
                             verify_kw={"kv_cache_mib": 1, "prefix_cache": False}) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            gw = pb_grpc.GatewayStub(ch)
            reference = (await gw.Generate(request(PROMPTS[1], pb.SPECULATION_OFF))).token_ids
            outcomes = await asyncio.gather(*(gw.Generate(request(PROMPTS[1], pb.SPECULATION_AUTO, max_new_tokens=40))
                                              for _ in range(fits + 3)), return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, BaseException)]
            answered = [o for o in outcomes if not isinstance(o, BaseException)]
            assert refused and answered, (fits, len(refused))
            assert all(isinstance(o, grpc.aio.AioRpcError) and o.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                       and "MiB" in o.details() for o in refused), refused[0]
            assert all(o.token_ids == reference for o in answered)
            assert await wait_released(stack) == (0, 0)
            assert (await gw.Generate(request(PROMPTS[1], pb.SPECULATION_OFF))).token_ids == reference


async def test_full_session_tables_cost_drafts_or_refuse_clearly_and_leak_nothing(models, tmp_path):
    # Tables of two sessions each, filled by direct calls the gateway knows nothing of. (A draft model:
    # n-gram drafts are the verifier's own and take no draft session.)
    async with running_stack(tmp_path, "unix", models["target"], models["draft"], verify_kw={"max_sessions": 2},
                             draft_kw={"max_sessions": 2}) as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as g, grpc.aio.insecure_channel(stack.verify) as v, \
                grpc.aio.insecure_channel(stack.draft) as d:
            gw, verifier, drafter = pb_grpc.GatewayStub(g), vpb_grpc.VerifierStub(v), dpb_grpc.DrafterStub(d)
            reference = await gw.Generate(request(PROMPTS[0], pb.SPECULATION_OFF))
            for i in range(2):
                await drafter.StartSession(dpb.StartSessionRequest(session_id=f"d{i}", prompt_token_ids=[1, 2]))
            # A full draft table costs an AUTO request its drafts, not its answer; ON is refused.
            auto = await gw.Generate(request(PROMPTS[0], pb.SPECULATION_AUTO, drafter="model"))
            assert auto.token_ids == reference.token_ids
            assert (auto.stats.speculation_used, auto.stats.speculation_reason) == (False, "drafter-full")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await gw.Generate(request(PROMPTS[0], drafter="model"))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "draft service" in e.value.details()
            # A full verify table refuses the request, naming the service and the limit.
            for i in range(2):
                await verifier.Prefill(vpb.PrefillRequest(session_id=f"v{i}", prompt_token_ids=[1, 2, 3]))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await gw.Generate(request(PROMPTS[0], pb.SPECULATION_AUTO))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "verify service" in e.value.details()
            assert await active_sessions(stack) == (2, 2)  # the refused requests left nothing behind
            for i in range(2):
                await verifier.Release(vpb.ReleaseRequest(session_id=f"v{i}"))
                await drafter.EndSession(dpb.EndSessionRequest(session_id=f"d{i}"))
            # Room is back, and the drafter was never "down".
            again = await gw.Generate(request(PROMPTS[0], drafter="model"))
            assert again.token_ids == reference.token_ids and again.stats.speculation_used
        assert await wait_released(stack) == (0, 0)


async def test_bearer_token_and_per_client_cap(models, tmp_path):
    import os
    import stat

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with running_stack(tmp_path, "unix", models["target"], None, auth_token="s3cret",
                             max_sessions_per_client=1) as stack:
        assert stat.S_IMODE(os.stat(stack.gateway.removeprefix("unix://")).st_mode) == 0o600
        async with grpc.aio.insecure_channel(stack.gateway) as g:
            gw = pb_grpc.GatewayStub(g)
            for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await gw.Generate(request(PROMPTS[0]), metadata=metadata)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in gw.GenerateStream(request(PROMPTS[0])):
                    pass
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = await health_pb2_grpc.HealthStub(g).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
            token = [("authorization", "Bearer s3cret")]
            assert (await gw.Generate(request(PROMPTS[0]), metadata=token)).stats.generated_tokens == 40
            # One session per client: concurrent calls beyond it are refused, and the slot comes back.
            outcomes = await asyncio.gather(*(gw.Generate(request(p, max_new_tokens=120), metadata=token)
                                              for p in PROMPTS), return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
            assert refused and len(refused) < len(PROMPTS)
            assert all(o.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per client" in o.details()
                       for o in refused)
            assert (await gw.Generate(request(PROMPTS[0]), metadata=token)).stats.generated_tokens == 40
        # The tools' clients (bench, calibrate, generate) send the token from --auth-token-file.
        from specsplit.launcher import gateway_stub

        (tmp_path / "token").write_text("s3cret\n")
        for token_file, code in ((None, grpc.StatusCode.UNAUTHENTICATED), (str(tmp_path / "token"), None)):
            with gateway_stub(stack.gateway, None, token_file) as (stub, _):
                try:
                    out = await asyncio.to_thread(stub.Generate, request(PROMPTS[0]), timeout=60)
                    chunks = await asyncio.to_thread(lambda: list(stub.GenerateStream(request(PROMPTS[0]),
                                                                                      timeout=60)))
                    assert code is None and out.stats.generated_tokens == 40 and chunks[-1].finish_reason
                except grpc.RpcError as e:
                    assert e.code() == code, e
        assert await wait_released(stack) == (0, 0)


def test_a_freed_sequence_gives_its_kv_budget_back_while_still_referred_to(models):
    """FastSequence.free (what a Release calls): the bytes go back to the pool at once, not when
    the last reference goes (one kept by a decode winding down held a budget of 1 MiB beside a busy
    neighbour, and the next request was refused); the sequence is empty and usable after."""
    from specsplit.model.modeling import load_model

    native = load_model(models["target"], "bfloat16").native
    if native is None:
        pytest.skip("the KV budget bounds the native forward's caches")
    before = native.pool.used_bytes
    kept = native.sequence()
    kept.reserve(100)
    assert native.pool.used_bytes > before
    kept.free()
    assert native.pool.used_bytes == before and kept.length == 0 and kept.capacity == 0
    kept.reserve(10)  # usable again, and accounted again
    assert native.pool.used_bytes > before
    del kept
    import gc

    gc.collect()
    assert native.pool.used_bytes == before  # given back once, not twice
