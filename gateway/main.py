"""Entry point of the gateway."""

from __future__ import annotations

import asyncio
import logging

from gateway.access import BearerAuth
from gateway.backends import Backends
from gateway.server import SERVICE_NAME, GatewayServicer, register
from specsplit.model import catalog
from specsplit.serving import runtime, telemetry
from specsplit.serving.server import serve
from specsplit.serving.settings import GatewaySettings

log = logging.getLogger("specsplit")


def load_tokenizer(path):
    """The model's tokenizer. Where the directory has a tokenizer.json, transformers' generic fast
    tokenizer reads it, which needs no torch (AutoTokenizer gives that class, or a subclass of it
    built from the same file, for the models here: same ids, vocabulary and special tokens, and the
    services' tokenizer fingerprints are checked against it at connect); else AutoTokenizer, which
    loads torch. The gateway computes nothing: without torch it starts in ~2 s instead of ~6 and
    holds ~130 MB instead of ~380."""
    if (path / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


async def run(settings: GatewaySettings, stop_event: asyncio.Event | None = None, handle_signals: bool = True) -> None:
    threads = runtime.configure_process(settings.server.threads, "gateway", compute=False)
    tel = telemetry.configure("specsplit-gateway", settings.server.metrics_port)
    tokenizer_dir = catalog.resolve(settings.tokenizer)
    tokenizer = load_tokenizer(tokenizer_dir)
    backends = Backends(settings, tokenizer, tel.client_interceptors())
    servicer = GatewayServicer(backends)
    http = []

    async def ready() -> None:
        await backends.connect()
        log.info(threads)
        if settings.http_listen:  # after connect: the HTTP door serves once the backends fit together
            from gateway.openai import OpenAIFront, start

            front = OpenAIFront(servicer, backends.target.model_id, backends.tokenizer, settings.auth_token)
            http.append((await start(settings.http_listen, front))[0])

    try:
        await serve(settings.server, SERVICE_NAME, lambda server: register(server, servicer),
                    ready, stop_event=stop_event, handle_signals=handle_signals,
                    interceptors=[*tel.server_interceptors(), *([BearerAuth(settings.auth_token)]
                                                                 if settings.auth_token else [])],
                    health_monitor=backends.watch_health)
    finally:
        for runner in http:
            await runner.cleanup()
        await backends.close()
