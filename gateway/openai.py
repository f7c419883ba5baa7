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
from typing import NamedTuple

import grpc
from aiohttp import web
from google.protobuf.json_format import MessageToDict

from gateway.openaiwire import FINISH, STATUS, Tokens, asked_tokens, choices, generate_request, invalid, per_choice
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.errors import Failure

log = logging.getLogger("specsplit.gateway")

MAX_BODY = 8 << 20


def error_response(failure: Failure) -> web.Response:
    status, kind = STATUS.get(failure.code, (500, "server_error"))
    return web.json_response({"error": {"message": failure.message, "type": kind,
                                        "param": getattr(failure, "param", None), "code": failure.code.name}},
                             status=status)


class OpenAIFront:
    """The HTTP routes around `servicer.stream` (gateway.server.GatewayServicer)."""

    keepalive_s = 2.0  # a stream waiting this long for its first token sends a comment line

    def __init__(self, servicer, model_id: str, tokenizer, auth_token: str = "", max_new_tokens_default: int = 16):
        self._servicer, self._model = servicer, model_id
        self._tokens = Tokens(tokenizer)  # token ids as text, for log-probabilities
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
        body = _json(await http.read())
        request = generate_request(body, chat, self._default_tokens)
        n = choices(body)
        model = body.get("model") or self._model
        if model != self._model:
            raise Failure(grpc.StatusCode.NOT_FOUND, f"model {model!r} is not served here; this gateway serves "
                                                     f"{self._model!r} (GET /v1/models)")
        client = f"http:{http.remote or 'unknown'}"
        shape = _Shape(chat, body, request, self._tokens)
        streams = [self._servicer.stream(one, client, lambda: None) for one in per_choice(request, n)]
        merged = _merged(streams)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        created = int(time.time())
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._sse(http, merged, shape, ident, created, include_usage)
        parts: list[list[pb.GenerateChunk]] = [[] for _ in range(n)]
        async with contextlib.aclosing(merged) as chunks:
            async for index, chunk in chunks:
                parts[index].append(chunk)
        answers = [shape.whole(i, chunks) for i, chunks in enumerate(parts)]
        lasts = [chunks[-1] for chunks in parts]
        return web.json_response({"id": ident, "object": "chat.completion" if chat else "text_completion",
                                  "created": created, "model": self._model, "choices": answers,
                                  "usage": shape.usage(lasts), "specsplit": _stats(lasts[0].stats)})

    async def _first(self, http: web.Request, chunks, iterator) -> _Start:
        """Waits for the stream's first chunk; while a long prompt is prefilled, comment lines keep
        the connection alive (opening the response). A failure before any byte went out raises (an
        ordinary error response), after one it is returned to be sent as an error event."""
        pending = asyncio.ensure_future(anext(iterator, None))
        response = None
        try:
            while not (await asyncio.wait({pending}, timeout=self.keepalive_s))[0]:
                if response is None:
                    response = await _open_stream(http)
                await response.write(b": prefilling\n\n")
            return _Start(response, pending.result())  # a refusal or an early failure raises here
        except BaseException as e:
            pending.cancel()
            if response is None or not isinstance(e, Failure):
                await chunks.__aexit__(None, None, None)
                if isinstance(e, ConnectionResetError):
                    return _Start(response, None, gone=True)
                raise
            return _Start(response, None, e)  # headers are out: it becomes an error event

    async def _sse(self, http: web.Request, merged, shape: _Shape, ident: str, created: int,
                   include_usage: bool) -> web.StreamResponse:
        """Server-sent events: one `data:` line per chunk of any choice, then `data: [DONE]`. A failure
        before the first token is an ordinary error response; after it, an error event ends the
        stream. While a long prompt is prefilled, a comment line every keepalive_s keeps the
        connection alive (a failure after one is an error event too)."""
        chunks = contextlib.aclosing(merged)
        iterator = await chunks.__aenter__()
        start = await self._first(http, chunks, iterator)
        if start.gone:
            return start.response
        first, early = start.first, start.early
        response = start.response or await _open_stream(http)
        kind = "chat.completion.chunk" if shape.chat else "text_completion"

        async def send(payload: dict) -> None:
            await response.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

        def event(index: int, chunk: pb.GenerateChunk) -> dict:
            payload = {"id": ident, "object": kind, "created": created, "model": self._model,
                       "choices": [shape.part(index, chunk)]}
            if chunk.HasField("stats"):
                payload["specsplit"] = _stats(chunk.stats)
            return payload

        lasts: dict[int, pb.GenerateChunk] = {}
        try:
            if early is not None:
                raise early
            if first is not None:
                await send(event(*first))
                lasts[first[0]] = first[1]
                async for index, chunk in iterator:
                    await send(event(index, chunk))
                    lasts[index] = chunk
            if include_usage and lasts:
                await send({"id": ident, "object": kind, "created": created, "model": self._model, "choices": [],
                            "usage": shape.usage(list(lasts.values()))})
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


class _Start(NamedTuple):
    """How a stream began: its response if keep-alive comments opened it, the first (index, chunk)
    (None: it ended or failed), a failure after the headers went out, or the client gone."""

    response: web.StreamResponse | None
    first: tuple | None
    early: Failure | None = None
    gone: bool = False


def _json(raw: bytes):
    """The request body's JSON, which must be text the model can read: UTF-8 whose strings hold no
    lone surrogate (JSON's \\udcff escapes decode to one, and no tokenizer encodes it), nested no
    deeper than the parser's recursion allows."""
    try:
        body = json.loads(raw)
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise invalid(f"the request body is not JSON: {e}") from None
    except UnicodeEncodeError as e:
        raise invalid(f"the request body holds a lone surrogate ({e.object[e.start:e.end]!a}) in a string: "
                      "not Unicode text") from None
    except RecursionError:
        raise invalid("the request body is nested too deeply") from None
    return body


async def _merged(streams: list):
    """(choice index, chunk) from n Generate streams as they come; a failure of any ends them all
    (each stream is closed, so its session is released)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as chunks:
            async for chunk in chunks:
                yield 0, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async with contextlib.aclosing(stream) as chunks:
                async for chunk in chunks:
                    await queue.put((index, chunk, None))
            await queue.put((index, None, None))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer
            await queue.put((index, None, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                left -= 1
            else:
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Shape:
    """One request's choices in OpenAI's shapes: text or delta, echo, log-probabilities, usage."""

    def __init__(self, chat: bool, body: dict, request: pb.GenerateRequest, tokens: Tokens):
        self.chat, self._tokens = chat, tokens
        self._logprobs = request.logprobs.generated
        self._echo = not chat and bool(body.get("echo"))
        self._prompt_only = asked_tokens(body) == 0
        self._prompt = request.text
        self._first_id = None
        if self._echo and self._logprobs:  # the first prompt token has no logprob, but is listed
            self._first_id = tokens.first_id(request.text)
        self._offsets: dict[int, int] = {}
        self._roles: set[int] = set()

    def part(self, index: int, chunk: pb.GenerateChunk) -> dict:
        """A choice's part of a stream event (the whole answer when it is the only chunk)."""
        finish = FINISH.get(chunk.finish_reason) if chunk.finish_reason else None
        generated = not self._prompt_only
        if self.chat:
            delta = {"content": chunk.text}
            if index not in self._roles:
                self._roles.add(index)
                delta = {"role": "assistant", **delta}
            out = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            if self._logprobs:
                out["logprobs"] = self._tokens.chat_logprobs(chunk.logprobs)
            return out
        first = index not in self._offsets
        text = (self._prompt if self._echo and first else "") + (chunk.text if generated else "")
        out = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
        if self._logprobs:
            entries = []
            if first and self._echo:
                entries = [(self._first_id, None), *((lp.token_id, lp) for lp in chunk.prompt_logprobs)]
            if generated:
                entries += [(lp.token_id, lp) for lp in chunk.logprobs]
            out["logprobs"] = self._tokens.completion_logprobs(entries, self._offsets.get(index, 0))
            self._offsets[index] = self._offsets.get(index, 0) + sum(len(t) for t in out["logprobs"]["tokens"])
        else:
            self._offsets.setdefault(index, 0)
        return out

    def whole(self, index: int, chunks: list[pb.GenerateChunk]) -> dict:
        """A choice's whole answer from its chunks."""
        joined = pb.GenerateChunk(text="".join(c.text for c in chunks), finish_reason=chunks[-1].finish_reason)
        for c in chunks:
            joined.logprobs.extend(c.logprobs)
            joined.prompt_logprobs.extend(c.prompt_logprobs)
        out = self.part(index, joined)
        if self.chat:
            delta = out.pop("delta")
            out["message"] = {"role": "assistant", "content": delta["content"]}
        return out

    def usage(self, lasts: list[pb.GenerateChunk]) -> dict:
        stats = lasts[0].stats
        completion = 0 if self._prompt_only else sum(c.stats.generated_tokens for c in lasts)
        return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": completion,
                "total_tokens": stats.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": stats.prefix_cached_tokens}}


async def _open_stream(http: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(http)
    return response


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
