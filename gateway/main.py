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


async def run(settings: GatewaySettings, stop_event: asyncio.Event | None = None, handle_signals: bool = True) -> None:
    from transformers import AutoTokenizer

    threads = runtime.configure_process(settings.server.threads, "gateway", most=1)  # no model compute here
    tel = telemetry.configure("specsplit-gateway", settings.server.metrics_port)
    tokenizer_dir = catalog.resolve(settings.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
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
