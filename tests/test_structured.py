"""Structured output (docs/protocol.md#constraints): every token the target chooses is masked to the
constraint's language, greedy or sampled, with speculation on or off and whatever was drafted; a
draft the language does not allow is cut, and tokens the language forces are drafted by the
verifier itself. Real services on real sockets; the tiny models for grammars, the real default model
for JSON schemas (its JSON must also validate), the official `openai` client for response_format."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pydantic
import pytest
from conftest import free_ports, prefill_all, running_stack, wait_released

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc
from specsplit.model import catalog
from verify_service.widths import WARMUP_ROWS

ON, OFF, AUTO = pb.SPECULATION_ON, pb.SPECULATION_OFF, pb.SPECULATION_AUTO
REGEX = r"(yes|no|maybe)-[0-9]{2}( and (yes|no))*"
LARK = 'start: item (", " item)*\nitem: "cat" | "dog" | NUMBER\nNUMBER: /[0-9]{1,3}/\n'
GBNF = 'root ::= item (", " item)*\nitem ::= "cat" | "dog" | [0-9]{1,3}\n'  # the same language, as llama.cpp writes it
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"type": "string", "enum": ["engineer", "teacher", "doctor"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}


async def generate(stub, speculation: int, constraint: cpb.Constraint, prompt: str, **kw) -> pb.GenerateResponse:
    request = pb.GenerateRequest(max_new_tokens=kw.pop("max_new_tokens", 40), speculation=speculation,
                                 constraint=constraint, **kw)
    request.chat.messages.add(role="user", content=prompt)
    return await stub.Generate(request, timeout=300)


@pytest.fixture(scope="module")
async def shared_tiny(models, tmp_path_factory):
    """One stack for the module's tests: they only send requests (none stops or kills a service).
    Its verifier's cost by width is pinned flat: the gateway cuts a tree to what pays at the widths
    the warm-up measured, and on a loaded machine (a parallel suite) a steep curve cut every tree to a
    chain, so the tree test ran no tree. Flat, every scored node pays and trees reach the verifier."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("verify_service.server.measure_rows", lambda target, token: [5.0] * WARMUP_ROWS)
        async with running_stack(tmp_path_factory.mktemp("structured"), "unix", models["target"], models["draft"],
                                 "float32") as stack:
            channel = grpc.aio.insecure_channel(stack.gateway)
            yield stack, pb_grpc.GatewayStub(channel)
            await channel.close()


@pytest.fixture
async def tiny(shared_tiny):
    """The shared stack, from a state each test can rely on: no session left open by the one before."""
    assert await wait_released(shared_tiny[0]) == (0, 0)
    return shared_tiny


@pytest.mark.parametrize("constraint, check", [
    (cpb.Constraint(regex=REGEX), lambda text: re.fullmatch(REGEX, text)),
    (cpb.Constraint(lark=LARK), lambda text: re.fullmatch(r"(cat|dog|[0-9]{1,3})(, (cat|dog|[0-9]{1,3}))*", text)),
    (cpb.Constraint(gbnf=GBNF), lambda text: re.fullmatch(r"(cat|dog|[0-9]{1,3})(, (cat|dog|[0-9]{1,3}))*", text)),
], ids=["regex", "lark", "gbnf"])
async def test_every_choice_stays_in_the_language_with_speculation_on_and_off(tiny, constraint, check):
    _, stub = tiny
    texts, trees = {}, 0
    for mode, speculation, drafter, tree in (("off", OFF, "", 0), ("ngram", ON, "ngram", 1), ("model", ON, "model", 1),
                                             ("tree", ON, "model", 8), ("auto", AUTO, "", 0)):
        for prompt in ("Answer:", "Say cat or dog"):
            out = await generate(stub, speculation, constraint, prompt, drafter=drafter, max_new_tokens=24,
                                 tree_budget=tree)
            texts[mode, prompt] = out.text
            if mode == "tree":  # token trees under a constraint: rows masked along each path read
                assert out.stats.tree_budget == 8
                trees += sum(r.drafted > r.depth for r in out.stats.round_records)
            if out.stats.constraint_complete:  # a whole sentence: it ended there (EOS), not at the budget
                assert check(out.text), out.text
                assert out.finish_reason == pb.FINISH_REASON_EOS
            else:  # the budget cut it: a prefix of a sentence
                assert out.finish_reason == pb.FINISH_REASON_LENGTH and out.stats.generated_tokens == 24
    assert trees  # some rounds branched
    for mode in ("ngram", "model", "tree", "auto"):  # greedy: the constraint and the drafts change nothing
        assert [texts[mode, p] for p in ("Answer:", "Say cat or dog")] == \
               [texts["off", p] for p in ("Answer:", "Say cat or dog")]


async def test_sampling_under_a_constraint_is_the_same_text_on_and_off_for_a_seed(tiny):
    _, stub = tiny
    coupled = pb.SamplingParams(temperature=0.9, seed=11)
    off = await generate(stub, OFF, cpb.Constraint(regex=REGEX), "Answer:", sampling=coupled)
    on = await generate(stub, ON, cpb.Constraint(regex=REGEX), "Answer:", sampling=coupled, drafter="model")
    assert on.text == off.text
    rejection = pb.SamplingParams(temperature=0.9, seed=11, method=cpb.VERIFY_METHOD_REJECTION)
    for seed in range(3):
        rejection.seed = seed
        out = await generate(stub, ON, cpb.Constraint(regex=REGEX), "Answer:", sampling=rejection, drafter="model")
        assert out.stats.constraint_complete is False or re.fullmatch(REGEX, out.text), out.text
        assert re.match(r"(yes|no|maybe)", out.text) or len(out.text) < 5  # its start is the language's


async def test_forced_tokens_are_drafted_by_the_verifier(tiny):
    _, stub = tiny
    forced = cpb.Constraint(regex=r"The answer is (yes|no), and that is final\.")
    off = await generate(stub, OFF, forced, "Answer:")
    auto = await generate(stub, AUTO, forced, "Answer:")
    assert auto.text == off.text and re.fullmatch(forced.regex, off.text)
    for out in (off, auto):
        assert out.stats.constraint_complete and out.finish_reason == pb.FINISH_REASON_EOS
    assert off.stats.forced_tokens == 0  # spec-off drafts nothing, forced text included
    # The fixed words are forced; llguidance forces a token only where the text's tokenization is
    # certain (the last token of a forced span may merge with what follows).
    assert auto.stats.forced_tokens >= auto.stats.generated_tokens // 3, auto.stats
    assert sum(r.forced_accepted for r in auto.stats.round_records) == auto.stats.forced_tokens
    assert all(r.forced_accepted <= r.forced for r in auto.stats.round_records)


def test_a_draft_is_cut_to_the_language_and_carried_on_with_what_it_forces_after_it(models):
    """The verifier's draft under a constraint: the caller's tokens the language allows, then the
    tokens the language forces after them (a value's last word, then the fixed text that follows
    it), each flagged as forced or not; a draft that leaves the language is cut where it does."""
    from transformers import AutoTokenizer

    from specsplit.serving.grammar import Language

    tokenizer = AutoTokenizer.from_pretrained(models["target"])
    language = Language(cpb.Constraint(regex=r"The answer is (yes|no), and that is final\."), tokenizer,
                        len(tokenizer))
    matcher = language.matcher()
    ids = tokenizer("The answer is yes", add_special_tokens=False).input_ids
    tokens, keep, forced = matcher.fit(ids, 32)
    assert keep == len(ids) and tokens[:keep] == ids and len(forced) == len(tokens)
    tail = tokens[keep:]
    assert tail and all(forced[keep:]) and not forced[keep - 1]  # "yes" was a choice, what follows is not
    assert ", and that is final.".startswith(tokenizer.decode(tail)), tokenizer.decode(tail)
    assert matcher.fit(ids, keep + 1)[0] == ids + tail[:1]  # no further than asked
    wrong = tokenizer("The answer is maybe", add_special_tokens=False).input_ids
    cut, kept, flags = matcher.fit(wrong, 0)
    assert kept < len(wrong) and cut == wrong[:kept] and len(flags) == kept
    assert matcher.fit([], 32)[0] == matcher.forced(32)  # nothing drafted: what the language forces from here


async def test_a_budget_inside_the_structure_says_so(tiny):
    _, stub = tiny
    out = await generate(stub, ON, cpb.Constraint(regex="[a-z]{60}"), "Answer:", max_new_tokens=3)
    assert out.finish_reason == pb.FINISH_REASON_LENGTH and not out.stats.constraint_complete
    assert re.fullmatch("[a-z]*", out.text)


@pytest.mark.parametrize("constraint, message", [
    (cpb.Constraint(json_schema="{not json"), "json_schema is not JSON"),
    (cpb.Constraint(json_schema="[1, 2]"), "must be a JSON object"),
    (cpb.Constraint(regex="(unclosed"), "regex"),
    (cpb.Constraint(lark="start: undefined_rule"), "lark"),
    (cpb.Constraint(gbnf='root ::= "unclosed'), "gbnf: Unexpected end of input"),
    (cpb.Constraint(gbnf="root ::= undefined"), "gbnf: Rule 'undefined' not found"),
    (cpb.Constraint(), "needs one of json_schema, json_object, regex, lark or gbnf"),
])
async def test_a_bad_constraint_is_invalid_argument_before_anything_runs(tiny, constraint, message):
    stack, stub = tiny
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        await generate(stub, ON, constraint, "Answer:")
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in failed.value.details()
    assert await wait_released(stack) == (0, 0)  # the drafter's session, started beside the Prefill, ended
    async with grpc.aio.insecure_channel(stack.verify) as channel:  # the verifier is where it is checked
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await vpb_grpc.VerifierStub(channel).Prefill(
                vpb.PrefillRequest(session_id="bad-constraint", prompt_token_ids=[5, 6, 7], constraint=constraint))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await vpb_grpc.VerifierStub(channel).Info(vpb.InfoRequest())).active_sessions == 0


@pytest.mark.e2e
async def test_json_schema_outputs_validate_and_speculation_changes_nothing_on_the_default_model(tmp_path):
    """The real model through the gRPC API and the OpenAI door (response_format json_schema, the
    official client's parse helper with a Pydantic model)."""
    port = free_ports()
    target = catalog.resolve(catalog.DEFAULT)
    async with running_stack(tmp_path, "unix", target, None, http_listen=f"127.0.0.1:{port}") as stack:
        async with grpc.aio.insecure_channel(stack.gateway) as channel:
            stub = pb_grpc.GatewayStub(channel)
            schema = cpb.Constraint(json_schema=json.dumps(PERSON))
            prompt = "Describe a made-up person as JSON: name, age, role, skills and address."
            texts = set()
            for speculation in (OFF, ON, AUTO):
                out = await generate(stub, speculation, schema, prompt, max_new_tokens=160)
                assert out.stats.constraint_complete and out.finish_reason == pb.FINISH_REASON_EOS, out.text
                jsonschema.validate(json.loads(out.text), PERSON)
                assert (out.stats.forced_tokens > 0) == (speculation != OFF)  # forced drafts are speculation
                texts.add(out.text)
            assert len(texts) == 1  # greedy: identical with speculation off, on and AUTO
            sampled = pb.SamplingParams(temperature=0.8, seed=3)
            on = await generate(stub, ON, schema, prompt, max_new_tokens=160, sampling=sampled)
            off = await generate(stub, OFF, schema, prompt, max_new_tokens=160, sampling=sampled)
            assert on.text == off.text
            jsonschema.validate(json.loads(on.text), PERSON)
            anything = await generate(stub, AUTO, cpb.Constraint(json_object=True), prompt, max_new_tokens=160)
            assert isinstance(json.loads(anything.text), dict)

        class Pet(pydantic.BaseModel):
            name: str = pydantic.Field(max_length=16)
            species: str = pydantic.Field(max_length=16)
            age: int = pydantic.Field(ge=0, le=40)

        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        try:
            parsed = await client.chat.completions.parse(
                model="SmolLM2-135M-Instruct", response_format=Pet, max_tokens=120, temperature=0,
                messages=[{"role": "user", "content": "Invent a pet and describe it as JSON."}])
            pet = parsed.choices[0].message.parsed
            assert isinstance(pet, Pet) and pet.name
            with pytest.raises(openai.BadRequestError, match="response_format"):
                await client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8,
                                                     messages=[{"role": "user", "content": "hi"}],
                                                     response_format={"type": "xml"})
        finally:
            await client.close()


def test_a_resumed_session_goes_on_in_its_language_exactly(models):
    """A constrained session re-opened elsewhere (PrefillRequest.resume with output_tokens): its new
    matcher has seen the output so far, and the rest is what the first session would have chosen."""
    from specsplit.model.modeling import load_model
    from specsplit.serving.grammar import Language
    from verify_service.engine import Target

    lm = load_model(models["target"], "float32")
    target, language = Target(lm), Language(cpb.Constraint(regex=REGEX), lm.tokenizer, lm.vocab_size)
    prompt = lm.tokenizer("Answer:").input_ids

    def decode(session, steps):
        for _ in range(steps):
            target.verify(session, len(session.tokens), [])
        return session.tokens[len(prompt):]

    whole = decode(_prefilled(target, prompt, language), 8)
    first = decode(_prefilled(target, prompt, language), 3)
    resumed = target.start_prefill([*prompt, *first], language=language, resume=True, output_tokens=len(first))
    prefill_all(target, resumed)
    assert decode(resumed.session, 5) == whole
    assert re.fullmatch(r"(yes|no|maybe).*", lm.tokenizer.decode(whole))


def _prefilled(target, prompt, language):
    prefilling = target.start_prefill(prompt, language=language)
    prefill_all(target, prefilling)
    return prefilling.session
