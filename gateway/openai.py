"""The OpenAI-compatible HTTP door of the gateway (`--http-listen`): /v1/completions and
/v1/chat/completions (JSON or SSE streaming) and /v1/models, mapped onto the same Generate path as
gRPC (GatewayServicer.stream: one admission, cap, controller and metrics). Speculation settings
travel in an extension object, `"specsplit": {...}` (the openai client's `extra_body`); the
response carries the request's GenerationStats there. Errors are OpenAI's JSON shape with the
gRPC status as `code`. docs/protocol.md#openai-compatible-http."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import secrets
import time

import grpc
from aiohttp import web
from google.protobuf.json_format import MessageToDict

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.errors import Failure

log = logging.getLogger("specsplit.gateway")

MAX_BODY = 8 << 20
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
UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "top_logprobs": None, "suffix": None,
               "tools": None, "functions": None, "response_format": None, "logit_bias": None}


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
            raise invalid(f"{key}={body[key]!r} is not supported (specsplit answers one choice, without logprobs)",
                          key)
    request = pb.GenerateRequest()
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid("messages must be a non-empty list", "messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise invalid(f"messages[{i}] must be an object", "messages")
            request.chat.messages.add(role=str(message.get("role", "")), content=_content(message.get("content"), i))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise invalid("prompt must be a string (or a list of one string)", "prompt")
        request.text = prompt
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    request.max_new_tokens = _int(tokens, "max_tokens", 1) if tokens is not None else max_new_tokens_default
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop must be a string or a list of strings", "stop")
    request.stop.stop_strings.extend(stops)
    # OpenAI's defaults: temperature 1, top_p 1.
    temperature = _number(body.get("temperature", 1.0), "temperature")
    request.sampling.temperature = temperature
    if body.get("top_p") is not None:
        request.sampling.top_p = _number(body["top_p"], "top_p")
    if body.get("seed") is not None:
        request.sampling.seed = _int(body["seed"], "seed", 0)
    extension = body.get("specsplit") or {}
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
    return request


def _content(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise invalid(f"messages[{i}].content must be a string or a list of text parts", "messages")


def _int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise invalid(f"{name} must be an integer >= {low}, not {value!r}", name)
    return value


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"{name} must be a number, not {value!r}", name)
    return float(value)


def _choice(value, choices: dict, name: str):
    if value not in choices:
        raise invalid(f"{name} {value!r}: use one of {sorted(choices)}", name)
    return choices[value]


def error_response(failure: Failure) -> web.Response:
    status, kind = STATUS.get(failure.code, (500, "server_error"))
    return web.json_response({"error": {"message": failure.message, "type": kind,
                                        "param": getattr(failure, "param", None), "code": failure.code.name}},
                             status=status)


class OpenAIFront:
    """The HTTP routes around `servicer.stream` (gateway.server.GatewayServicer)."""

    keepalive_s = 2.0  # a stream waiting this long for its first token sends a comment line

    def __init__(self, servicer, model_id: str, auth_token: str = "", max_new_tokens_default: int = 16):
        self._servicer, self._model = servicer, model_id
        self._expected = f"Bearer {auth_token}".encode() if auth_token else None
        self._default_tokens = max_new_tokens_default  # OpenAI's completions default is 16

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._errors])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        if self._expected is not None:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, self._expected):
                return error_response(Failure(grpc.StatusCode.UNAUTHENTICATED,
                                              "missing or wrong bearer token (header 'Authorization: Bearer <token>')"))
        try:
            return await handler(request)
        except Failure as e:
            return error_response(e)
        except web.HTTPException as e:  # aiohttp's own: unknown route, wrong method, body too large
            return web.json_response({"error": {"message": e.reason, "type": "invalid_request_error",
                                                "param": None, "code": None}}, status=e.status)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self._model, "object": "model", "created": 0, "owned_by": "specsplit"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, http: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await http.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid(f"the request body is not JSON: {e}") from None
        request = generate_request(body, chat, self._default_tokens)
        model = body.get("model") or self._model
        if model != self._model:
            raise Failure(grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served here; this gateway serves "
                                                     f"{self._model!r} (GET /v1/models)")
        peer = http.remote or "unknown"
        client = f"http:{peer}"
        stream = self._servicer.stream(request, client, lambda: None)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        created = int(time.time())
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._sse(http, stream, chat, ident, created, include_usage)
        text, last = [], None
        async with contextlib.aclosing(stream) as chunks:
            async for chunk in chunks:
                text.append(chunk.text)
                last = chunk
        finish = FINISH.get(last.finish_reason, "stop")
        choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(text)}, "finish_reason": finish}
                  if chat else {"index": 0, "text": "".join(text), "logprobs": None, "finish_reason": finish})
        return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": self._model, "choices": [choice],
                                  "usage": _usage(last.stats), "specsplit": _stats(last.stats)})

    async def _sse(self, http: web.Request, stream, chat: bool, ident: str, created: int,
                   include_usage: bool) -> web.StreamResponse:
        """Server-sent events: one `data:` line per chunk, then `data: [DONE]`. A failure before the
        first token is an ordinary error response; after it, an error event ends the stream. While a
        long prompt is prefilled, a comment line every keepalive_s keeps the connection alive (a
        failure after one is an error event too)."""
        chunks = contextlib.aclosing(stream)
        iterator = await chunks.__aenter__()
        pending = asyncio.ensure_future(anext(iterator, None))
        response = early = None
        try:  # a long prompt's prefill: comment lines keep the connection alive until the first token
            while not (await asyncio.wait({pending}, timeout=self.keepalive_s))[0]:
                if response is None:
                    response = await _open_stream(http)
                await response.write(b": prefilling\n\n")
            first = pending.result()  # a refusal or an early failure raises here
        except BaseException as e:
            pending.cancel()
            if response is None or not isinstance(e, Failure):
                await chunks.__aexit__(None, None, None)
                if isinstance(e, ConnectionResetError):
                    return response
                raise
            first, early = None, e  # headers are out: it becomes an error event
        if response is None:
            response = await _open_stream(http)
        kind = "chat.completion.chunk" if chat else "text_completion"

        async def send(payload: dict) -> None:
            await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

        def event(chunk: pb.GenerateChunk, role: bool = False) -> dict:
            finish = FINISH.get(chunk.finish_reason) if chunk.finish_reason else None
            text = chunk.text
            if chat:
                delta = {"role": "assistant", "content": text} if role else {"content": text}
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            payload = {"id": ident, "object": kind, "created": created, "model": self._model, "choices": [choice]}
            if chunk.HasField("stats"):
                payload["specsplit"] = _stats(chunk.stats)
            return payload

        last = first
        try:
            if early is not None:
                raise early
            if first is not None:
                await send(event(first, role=True))
                async for chunk in iterator:
                    await send(event(chunk))
                    last = chunk
            if include_usage and last is not None:
                await send({"id": ident, "object": kind, "created": created, "model": self._model, "choices": [],
                            "usage": _usage(last.stats)})
            await response.write(b"data: [DONE]\n\n")
        except Failure as e:
            status, kind_ = STATUS.get(e.code, (500, "server_error"))
            await send({"error": {"message": e.message, "type": kind_, "param": None, "code": e.code.name}})
        except ConnectionResetError:  # the client went away: the request ends here (closing it below)
            return response
        finally:
            await chunks.__aexit__(None, None, None)
        await response.write_eof()
        return response


async def _open_stream(http: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(http)
    return response


def _usage(stats: pb.GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.prefix_cached_tokens}}


def _stats(stats: pb.GenerationStats) -> dict:
    """The request's GenerationStats without the per-round records (they can be long)."""
    summary = pb.GenerationStats()
    summary.CopyFrom(stats)
    del summary.round_records[:]
    return MessageToDict(summary, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


async def start(listen: str, front: OpenAIFront) -> tuple[web.AppRunner, str]:
    """Serves the front on `host:port` (port 0: a free one); returns the runner and the bound address."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--http-listen {listen!r}: use host:port")
    runner = web.AppRunner(front.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host.strip("[]"), int(port))
    await site.start()
    bound = runner.addresses[0]
    address = f"{host}:{bound[1]}"
    log.info("OpenAI-compatible HTTP on http://%s/v1", address)
    return runner, address
