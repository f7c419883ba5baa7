"""The OpenAI-compatible HTTP door, exercised with the official `openai` client against the three
real services (in this process, on UNIX sockets; the door on a loopback port)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
import torch
from conftest import free_ports, running_stack, wait_released

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc

TOKEN = "s3cret-token"
GREEDY = {"temperature": 0, "max_tokens": 20}


@pytest.fixture(scope="module")
async def shared_door(models, tmp_path_factory):
    """One stack for the module's tests: they only send requests (none stops or kills a service)."""
    port = free_ports()
    async with running_stack(tmp_path_factory.mktemp("openai"), "unix", models["target"], models["draft"],
                             "float32", http_listen=f"127.0.0.1:{port}", auth_token=TOKEN) as stack:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0)
        model = (await client.models.list()).data[0].id
        channel = grpc.aio.insecure_channel(stack.gateway)
        yield stack, (client, model, pb_grpc.GatewayStub(channel), port)
        await channel.close()
        await client.close()


@pytest.fixture
async def door(shared_door):
    """The shared stack, from a state each test can rely on: no session left open by the one before."""
    stack, handles = shared_door
    assert await wait_released(stack) == (0, 0)
    return handles


async def grpc_generate(stub, **kw) -> pb.GenerateResponse:
    return await stub.Generate(pb.GenerateRequest(**kw), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=60)


async def test_completions_equal_grpc_generate_with_speculation_on_and_off(door):
    client, model, stub, _ = door
    texts = {}
    for mode in ("off", "on"):
        reply = await client.completions.create(model=model, prompt="def add(a, b):", **GREEDY,
                                                extra_body={"specsplit": {"speculation": mode, "drafter": "ngram",
                                                                          "ignore_eos": True, "task_type": "code"}})
        assert reply.object == "text_completion" and len(reply.choices) == 1
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 20
        stats = reply.model_extra["specsplit"]
        assert stats["speculation_used"] is (mode == "on") and stats["task_type"] == "code"
        texts[mode] = reply.choices[0].text
    assert texts["on"] == texts["off"]  # greedy: speculation changes nothing
    reference = await grpc_generate(stub, text="def add(a, b):", max_new_tokens=20,
                                    speculation=pb.SPECULATION_OFF, stop=pb.StopConditions(ignore_eos=True))
    assert reference.text == texts["off"]
    assert reply.usage.prompt_tokens == reference.stats.prompt_tokens


async def test_chat_streams_what_it_answers_whole(door):
    client, model, stub, _ = door
    messages = [{"role": "user", "content": "Say something about cats."}]
    whole = await client.chat.completions.create(model=model, messages=messages, **GREEDY)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    stream = await client.chat.completions.create(model=model, messages=messages, stream=True,
                                                  stream_options={"include_usage": True}, **GREEDY)
    chunks = [chunk async for chunk in stream]
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in text_chunks if c.choices[0].finish_reason] == \
        [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    reference = await grpc_generate(stub, chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in messages]),
                                    max_new_tokens=20)
    assert reference.text == whole.choices[0].message.content


async def test_sampling_with_a_seed_repeats(door):
    client, model, _, _ = door
    kw = {"model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 7}
    first, second = [await client.completions.create(**kw) for _ in range(2)]
    assert first.choices[0].text == second.choices[0].text
    # ... and the seed is the one given: other seeds give other texts (a dropped seed would not).
    others = [await client.completions.create(**{**kw, "seed": seed}) for seed in (8, 9, 10)]
    assert any(o.choices[0].text != first.choices[0].text for o in others)
    assert {o.model_extra["specsplit"]["seed"] for o in others} == {"8", "9", "10"}
    assert first.model_extra["specsplit"]["verify_method"] == "coupled"


@pytest.mark.parametrize("kw, status, param", [
    ({"temperature": -1}, 400, None),
    ({"n": 17}, 400, "n"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"frequency_penalty": -1}, 400, "frequency_penalty"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"max_tokens": 0}, 400, "max_tokens"),  # without echo there is nothing to answer
    ({"extra_body": {"specsplit": {"gama": 3}}}, 400, "specsplit"),
    ({"extra_body": {"specsplit": {"speculation": "sometimes"}}}, 400, "specsplit.speculation"),
    ({"model": "gpt-4"}, 404, None),
])
async def test_bad_requests_get_openai_errors(door, kw, status, param):
    client, model, _, _ = door
    args = {"model": model, "prompt": "hi", "max_tokens": 4, **kw}
    with pytest.raises(openai.APIStatusError) as caught:
        await client.completions.create(**args)
    error = caught.value
    assert error.status_code == status
    body = error.body  # the client unwraps {"error": {...}}
    assert body["type"] in ("invalid_request_error", "not_found_error") and body["message"]
    assert body["code"] in ("INVALID_ARGUMENT", "NOT_FOUND") and body["param"] == param


def _post_chat(port: int, body: bytes) -> tuple[int, dict]:
    """Raw bytes to the chat endpoint, as a careless client sends them: (status, JSON answer)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


async def test_auth_and_malformed_bodies(door):
    _, model, _, port = door
    anonymous = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        await anonymous.completions.create(model=model, prompt="hi", max_tokens=2)
    assert caught.value.body["code"] == "UNAUTHENTICATED"
    await anonymous.close()

    status, body = await asyncio.to_thread(_post_chat, port, b"{not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, body = await asyncio.to_thread(_post_chat, port, json.dumps({"model": model, "messages": []}).encode())
    assert status == 400 and body["error"]["param"] == "messages"


def _hostile(model: str) -> list[tuple[bytes, str]]:
    """Bodies a careless or hostile client sends, each with a word its 400 must say."""
    def chat(**kw) -> bytes:
        return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **kw}).encode()

    deep = b'{"model": "m", "messages": [{"role": "user", "content": ' + b"[" * 5000 + b"]" * 5000 + b"}]}"
    return [
        (b'{"model": "m", "messages": [{"role": "user", "content": "\\udcff bad"}]}', "surrogate"),
        (chat(max_tokens=10**12), "max_tokens"),
        (chat(seed=-1), "seed"),
        (chat(seed=1 << 64), "seed"),
        (chat(n=10**30), "n"),
        (deep, "nested"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "JSON"),  # not UTF-8
        ('{"messages": [{"role": "user", "content": "caf\u00e9"}]}'.encode("latin-1"), "JSON"),  # nor this
        (b"", "JSON"),
        (b"[]", "object"),
        (chat(temperature="hot"), "temperature"),
        (chat(temperature=float("nan")), "temperature"),
        (chat(max_tokens=True), "max_tokens"),
        (chat(stop=[1, 2]), "stop"),
        (json.dumps({"model": model, "messages": [{"role": "user", "content": {"text": "hi"}}]}).encode(), "content"),
        (json.dumps({"model": model, "messages": "hi"}).encode(), "messages"),
    ]


async def test_hostile_bodies_get_a_400_that_says_what_is_wrong_and_the_door_stays_up(door):
    client, model, _, port = door

    for body, word in _hostile(model):
        status, answer = await asyncio.to_thread(_post_chat, port, body)
        assert status == 400, (body[:80], status, answer)
        assert word.lower() in answer["error"]["message"].lower() or word == (answer["error"].get("param") or ""), \
            (body[:80], answer)
    good = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], **GREEDY)
    assert good.choices[0].message.content is not None and good.usage.completion_tokens > 0


async def test_a_stream_waiting_for_its_first_token_keeps_the_connection_alive_and_reports_cached_tokens(
        door, monkeypatch):
    from gateway.openai import OpenAIFront

    client, model, _, port = door
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several prefix-cache blocks
    kw = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    whole = await client.completions.create(**kw)
    again = await client.completions.create(**kw)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32  # the same prompt: found in the prefix cache
    assert again.choices[0].text == whole.choices[0].text
    monkeypatch.setattr(OpenAIFront, "keepalive_s", 1e-4)  # every prefill is "long"

    def stream() -> list[bytes]:
        body = json.dumps({**kw, "stream": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers={
            "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            return [line for line in r.read().split(b"\n") if line]

    lines = await asyncio.to_thread(stream)
    first_data = next(i for i, line in enumerate(lines) if line.startswith(b"data:"))
    assert first_data > 0 and all(line == b": prefilling" for line in lines[:first_data])
    events = [json.loads(line[5:]) for line in lines[first_data:] if line != b"data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole.choices[0].text
    streamed = await client.completions.create(**kw, stream=True)  # the official client skips the comments
    assert "".join([c.choices[0].text async for c in streamed if c.choices]) == whole.choices[0].text


LOGPROB_PROMPT = "def add(a, b):"


def reference_logprobs(models, ids: list[int]) -> torch.Tensor:
    """transformers' float32 log-softmax of every row for these token ids."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


async def test_logprobs_are_the_targets_and_agree_with_transformers(door, models):
    from transformers import AutoTokenizer

    from specsplit.api.common.v1 import common_pb2 as cpb

    client, model, stub, _ = door
    prompt_ids = AutoTokenizer.from_pretrained(models["target"]).encode(LOGPROB_PROMPT)
    answers = {}
    for mode in (pb.SPECULATION_OFF, pb.SPECULATION_ON):
        answers[mode] = await grpc_generate(stub, text=LOGPROB_PROMPT, max_new_tokens=12, speculation=mode,
                                            drafter="ngram", stop=pb.StopConditions(ignore_eos=True),
                                            logprobs=cpb.LogprobsRequest(generated=True, top=5, prompt=True))
    off, on = answers[pb.SPECULATION_OFF], answers[pb.SPECULATION_ON]
    assert on.stats.speculation_used and list(on.token_ids) == list(off.token_ids)
    # A row's logits do not depend on how many rows share its forward: on equals off, bit for bit.
    assert [(lp.token_id, lp.logprob, list(lp.top_ids)) for lp in on.logprobs] == \
        [(lp.token_id, lp.logprob, list(lp.top_ids)) for lp in off.logprobs]
    assert [lp.token_id for lp in off.logprobs] == list(off.token_ids)
    for lp in off.logprobs:  # greedy: the chosen token is the arg-max, and the top list is sorted
        assert lp.logprob <= 0 and lp.top_ids[0] == lp.token_id and lp.top_logprobs[0] == lp.logprob
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True) and len(lp.top_ids) == 5
    assert [lp.token_id for lp in off.prompt_logprobs] == prompt_ids[1:]
    ids = [*prompt_ids, *off.token_ids]
    reference = reference_logprobs(models, ids)
    ours = [*off.prompt_logprobs, *off.logprobs]
    for position, lp in enumerate(ours, start=1):  # token at `position` is predicted by row position - 1
        assert lp.token_id == ids[position]
        assert abs(lp.logprob - float(reference[position - 1, ids[position]])) < 1e-4, position
    # The OpenAI shapes carry the same numbers.
    chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    assert all(e.logprob == e.top_logprobs[0].logprob and bytes(e.bytes) == e.token.encode() for e in content)
    completion = await client.completions.create(model=model, prompt=LOGPROB_PROMPT, temperature=0, max_tokens=12,
                                                 logprobs=5, extra_body={"specsplit": {"ignore_eos": True}})
    got = completion.choices[0].logprobs
    assert got.token_logprobs == pytest.approx([lp.logprob for lp in off.logprobs], abs=1e-6)
    assert "".join(got.tokens) == completion.choices[0].text == off.text
    assert got.text_offset == [sum(len(t) for t in got.tokens[:i]) for i in range(len(got.tokens))]


async def test_echo_with_no_new_tokens_gives_the_prompts_logprobs_as_lm_eval_asks(door, models):
    from transformers import AutoTokenizer

    client, model, _, port = door
    prompt_ids = AutoTokenizer.from_pretrained(models["target"]).encode(LOGPROB_PROMPT)
    reference = reference_logprobs(models, prompt_ids)
    # lm-eval's loglikelihood request: echo, max_tokens 0, logprobs, temperature 0.
    body = {"model": model, "prompt": LOGPROB_PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1,
            "temperature": 0}
    status, answer = await asyncio.to_thread(post_json, port, "/v1/completions", body)
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["text"] == LOGPROB_PROMPT and answer["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == LOGPROB_PROMPT and len(lp["tokens"]) == len(prompt_ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(prompt_ids)):
        assert abs(lp["token_logprobs"][i] - float(reference[i - 1, prompt_ids[i]])) < 1e-4
        assert len(lp["top_logprobs"][i]) == 1
    # The official client, the same request.
    same = await client.completions.create(model=model, prompt=LOGPROB_PROMPT, max_tokens=0, echo=True, logprobs=1,
                                           temperature=0)
    assert same.choices[0].logprobs.token_logprobs == lp["token_logprobs"]
    # echo with generated tokens: the prompt, then the completion, in one list.
    more = await client.completions.create(model=model, prompt=LOGPROB_PROMPT, max_tokens=4, echo=True, logprobs=0,
                                           temperature=0, extra_body={"specsplit": {"ignore_eos": True}})
    tokens = more.choices[0].logprobs.tokens
    assert more.choices[0].text.startswith(LOGPROB_PROMPT) and len(tokens) == len(prompt_ids) + 4
    assert more.choices[0].logprobs.token_logprobs[:len(prompt_ids)] == lp["token_logprobs"]
    # Both budgets given: max_completion_tokens wins, for the tokens generated and the answer's shape
    # alike (read in two orders, such a body was generated with 4 tokens and answered as prompt-only).
    both = {**body, "max_completion_tokens": 4, "specsplit": {"ignore_eos": True}}
    status, answer = await asyncio.to_thread(post_json, port, "/v1/completions", both)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4, answer
    assert answer["choices"][0]["text"].startswith(LOGPROB_PROMPT) and answer["choices"][0]["text"] != LOGPROB_PROMPT


async def test_n_choices_are_the_seeded_requests_one_by_one(door):
    client, model, _, _ = door
    kw = {"model": model, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 12,
          "temperature": 0.9, "extra_body": {"specsplit": {"ignore_eos": True}}}
    three = await client.chat.completions.create(n=3, seed=7, **kw)
    assert [c.index for c in three.choices] == [0, 1, 2]
    singles = [await client.chat.completions.create(seed=7 + i, **kw) for i in range(3)]
    assert [c.message.content for c in three.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in three.choices}) > 1  # different seeds, different samples
    assert three.usage.completion_tokens == 36
    stream = await client.chat.completions.create(n=2, seed=7, stream=True, **kw)
    texts, finished = {0: "", 1: ""}, set()
    async for event in stream:
        for choice in event.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and [texts[0], texts[1]] == [c.message.content for c in three.choices[:2]]


def post_json(port: int, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def test_a_gbnf_grammar_holds_the_output_as_llama_server_takes_it(door):
    """llama-server's `grammar` field (GBNF) on the chat endpoint: the answer is in its language, the
    same with speculation on and off; a grammar that does not parse, or one beside a JSON
    response_format, is a 400 that says so."""
    import re

    client, model, _, _ = door
    grammar = 'root ::= item (", " item)*\nitem ::= "cat" | "dog" | [0-9]{1,3}\n'
    texts = {}
    for mode in ("off", "on"):
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name some pets"}], max_tokens=24, temperature=0,
            extra_body={"grammar": grammar, "specsplit": {"speculation": mode, "drafter": "model"}})
        texts[mode] = reply.choices[0].message.content
        whole = re.fullmatch(r"(cat|dog|[0-9]{1,3})(, (cat|dog|[0-9]{1,3}))*", texts[mode])
        # a budget that ends inside the structure leaves a prefix of a sentence, and says so
        assert whole or reply.choices[0].finish_reason == "length" and re.fullmatch(
            r"(cat|dog|[0-9]{1,3})(, (cat|dog|[0-9]{1,3}))*(, ?(c|ca|d|do)?)?", texts[mode]), texts[mode]
    assert texts["on"] == texts["off"]
    for extra, says in (({"grammar": 'root ::= "open'}, "gbnf: Unexpected end of input"),
                        ({"grammar": grammar, "response_format": {"type": "json_object"}}, "grammar")):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, extra_body=extra)
        assert says in caught.value.body["message"]
