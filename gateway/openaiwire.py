"""The OpenAI wire shapes of the gateway's HTTP door (gateway.openai): a request body as Generate
requests (one per choice), and answers, chunks and log-probabilities in OpenAI's formats
(completions: tokens / token_logprobs / top_logprobs / text_offset; chat: content entries).
Log-probabilities are the target's own distribution (specsplit.common.v1.TokenLogprob: the
log-softmax before temperature and top-p, as vLLM's default)."""

from __future__ import annotations

import json

import grpc

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.errors import Failure
from specsplit.speculation.params import MAX_TOP_LOGPROBS

FINISH = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_CONTEXT: "length", pb.FINISH_REASON_EOS: "stop",
          pb.FINISH_REASON_STOP_STRING: "stop"}
STATUS = {  # gRPC status -> (HTTP status, OpenAI error type)
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
SPECULATION = {"auto": pb.SPECULATION_AUTO, "on": pb.SPECULATION_ON, "off": pb.SPECULATION_OFF}
METHODS = {"coupled": cpb.VERIFY_METHOD_COUPLED, "rejection": cpb.VERIFY_METHOD_REJECTION}
EXTENSION = {"speculation", "drafter", "gamma", "tree_budget", "task_type", "verify_method", "ignore_eos", "top_k"}
UNSUPPORTED = {"best_of": 1, "suffix": None, "tools": None, "functions": None, "logit_bias": None}
# Sampling parameters specsplit does not apply: refused when set, never ignored (verification would
# have to use the penalised distribution).
REFUSED = ("presence_penalty", "frequency_penalty")
MAX_CHOICES = 16


def asked_tokens(body: dict):
    """The token budget a body asks for: max_completion_tokens (the newer name) over max_tokens; None:
    neither. One reading for building the request and for shaping its answer."""
    return body.get("max_completion_tokens", body.get("max_tokens"))


def invalid(message: str, param: str | None = None) -> Failure:
    failure = Failure(grpc.StatusCode.INVALID_ARGUMENT, message)
    failure.param = param
    return failure


def generate_request(body: dict, chat: bool, max_new_tokens_default: int) -> pb.GenerateRequest:
    """An OpenAI request body as a GenerateRequest; raises Failure (INVALID_ARGUMENT) naming the field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    for key, neutral in UNSUPPORTED.items():
        if body.get(key) not in (None, False, neutral):
            raise invalid(f"{key}={body[key]!r} is not supported", key)
    for key in REFUSED:
        if body.get(key) not in (None, 0, 0.0):
            raise invalid(f"{key}={body[key]!r} is not supported: specsplit does not penalise (and never ignores "
                          "a sampling parameter); send 0 or leave it out", key)
    request = pb.GenerateRequest()
    _input(body, chat, request)
    request.logprobs.CopyFrom(_logprobs(body, chat))
    _length_and_stops(body, chat, max_new_tokens_default, request)
    # OpenAI's defaults: temperature 1, top_p 1.
    request.sampling.temperature = _number(body.get("temperature", 1.0), "temperature")
    if body.get("top_p") is not None:
        request.sampling.top_p = _number(body["top_p"], "top_p")
    if body.get("seed") is not None:
        request.sampling.seed = _int(body["seed"], "seed", 0, UINT64)
    _extension(body.get("specsplit") or {}, request)
    if body.get("response_format") is not None:
        _response_format(body["response_format"], request.constraint)
    if body.get("grammar") is not None:  # llama-server's field: a GBNF grammar
        if not isinstance(body["grammar"], str) or request.HasField("constraint"):
            raise invalid("grammar must be a GBNF string, and not beside a json response_format", "grammar")
        request.constraint.gbnf = body["grammar"]
    return request


def _input(body: dict, chat: bool, request: pb.GenerateRequest) -> None:
    """The chat's messages, or the completion's prompt (a string, or a list of one string)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid("messages must be a non-empty list", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise invalid(f"messages[{i}] must be an object", "messages")
            request.chat.messages.add(role=str(message.get("role", "")), content=_content(message.get("content"), i))
        return
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("prompt must be a string (or a list of one string)", "prompt")
    request.text = prompt


def _length_and_stops(body: dict, chat: bool, default: int, request: pb.GenerateRequest) -> None:
    tokens = asked_tokens(body)
    request.max_new_tokens = _int(tokens, "max_tokens", 0) if tokens is not None else default
    if request.max_new_tokens == 0:  # lm-eval's log-likelihood: the prompt's logprobs, nothing generated
        if chat or not body.get("echo"):
            raise invalid("max_tokens=0 needs echo=true on /v1/completions (the prompt's log-probabilities)",
                          "max_tokens")
        request.max_new_tokens = 1  # one token is generated and dropped (prompt_only)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop must be a string or a list of strings", "stop")
    request.stop.stop_strings.extend(stops)


def _extension(extension, request: pb.GenerateRequest) -> None:
    """The body's `specsplit` object: speculation, verify_method, gamma, tree_budget, top_k, drafter,
    task_type, ignore_eos."""
    if not isinstance(extension, dict):
        raise invalid("specsplit must be an object", "specsplit")
    unknown = set(extension) - EXTENSION
    if unknown:
        raise invalid(f"unknown specsplit field(s) {sorted(unknown)}; use {sorted(EXTENSION)}", "specsplit")
    if "speculation" in extension:
        request.speculation = _choice(extension["speculation"], SPECULATION, "specsplit.speculation")
    if "verify_method" in extension:
        request.sampling.method = _choice(extension["verify_method"], METHODS, "specsplit.verify_method")
    for key in ("gamma", "tree_budget", "top_k"):
        if key in extension:
            value = _int(extension[key], f"specsplit.{key}", 0)
            if key == "top_k":
                request.sampling.top_k = value
            else:
                setattr(request, key, value)
    for key in ("drafter", "task_type"):
        if key in extension:
            if not isinstance(extension[key], str):
                raise invalid(f"specsplit.{key} must be a string", f"specsplit.{key}")
            setattr(request, key, extension[key])
    if extension.get("ignore_eos"):
        request.stop.ignore_eos = True


def _response_format(value, constraint: cpb.Constraint) -> None:
    """OpenAI's response_format as a constraint: text (none), json_object, or json_schema (its
    `schema`; `strict` or not, the output is held to it)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        constraint.json_object = True
    elif kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid("response_format.json_schema must be an object with a `schema` object",
                          "response_format")
        constraint.json_schema = json.dumps(spec.get("schema", {}))
    elif kind != "text":
        raise invalid(f"response_format {value!r}: use type text, json_object or json_schema", "response_format")


def choices(body: dict) -> int:
    n = body.get("n")
    n = 1 if n is None else _int(n, "n", 1)
    if n > MAX_CHOICES:
        raise invalid(f"n={n}: at most {MAX_CHOICES} choices", "n")
    return n


def per_choice(request: pb.GenerateRequest, n: int) -> list[pb.GenerateRequest]:
    """n requests; sampled ones with a seed get seed, seed + 1, ... (without one, each draws its own)."""
    out = []
    for i in range(n):
        one = pb.GenerateRequest()
        one.CopyFrom(request)
        if i and one.sampling.HasField("seed"):
            one.sampling.seed += i
        out.append(one)
    return out


def _logprobs(body: dict, chat: bool) -> cpb.LogprobsRequest:
    """chat: logprobs (bool) and top_logprobs (int); completions: logprobs (int, the top count) and echo."""
    wanted = cpb.LogprobsRequest()
    if chat:
        top = body.get("top_logprobs")
        if top is not None and not body.get("logprobs"):
            raise invalid("top_logprobs needs logprobs=true", "top_logprobs")
        if body.get("logprobs"):
            wanted.generated, wanted.top = True, _top(top or 0, "top_logprobs")
        return wanted
    if body.get("logprobs") is not None:
        wanted.generated, wanted.top = True, _top(body["logprobs"], "logprobs")
        wanted.prompt = bool(body.get("echo"))
    return wanted


def _top(value, name: str) -> int:
    value = _int(value, name, 0)
    if value > MAX_TOP_LOGPROBS:
        raise invalid(f"{name}={value}: at most {MAX_TOP_LOGPROBS}", name)
    return value


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise invalid(f"messages[{i}].content must be a string or a list of text parts", "messages")


UINT32, UINT64 = (1 << 32) - 1, (1 << 64) - 1  # the widest the wire's fields hold


def _int(value, name: str, low: int, high: int = UINT32) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(f"{name} must be an integer in [{low}, {high}], not {value!r}", name)
    return value


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a number, not {value!r}", name)
    return float(value)


def _choice(value, choices: dict, name: str):
    if value not in choices:
        raise invalid(f"{name} {value!r}: use one of {sorted(choices)}", name)
    return choices[value]


class Tokens:
    """Token ids as OpenAI shows them: each decoded alone (its text and UTF-8 bytes)."""

    def __init__(self, tokenizer):
        self._tokenizer, self._text = tokenizer, {}

    def first_id(self, prompt: str) -> int:
        """The prompt's first token as the gateway tokenizes a text prompt (its logprob is undefined)."""
        return self._tokenizer.encode(prompt)[0]

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self._tokenizer.decode([token_id])
        return self._text[token_id]

    def completion_logprobs(self, entries: list[tuple[int, cpb.TokenLogprob | None]], offset: int = 0) -> dict:
        """completions' logprobs object for (token id, its logprob or None: an echoed first prompt
        token) entries; text offsets count from `offset` (characters)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in entries:
            text = self.text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.logprob)
            out["top_logprobs"].append(None if lp is None else
                                       {self.text(t): v for t, v in zip(lp.top_ids, lp.top_logprobs)})
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def chat_logprobs(self, logprobs) -> dict:
        def entry(token_id: int, value: float) -> dict:
            text = self.text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in zip(lp.top_ids, lp.top_logprobs)]}
                            for lp in logprobs], "refusal": None}
