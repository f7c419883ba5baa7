"""Entry point of the verify service."""

from __future__ import annotations

import asyncio

from specsplit import runtime, telemetry
from specsplit.serving import ModelWorker, serve
from specsplit.sessions import SessionTable
from specsplit.settings import VerifySettings
from verify_service.server import SERVICE_NAME, VerifierServicer, register


async def run(settings: VerifySettings, stop_event: asyncio.Event | None = None, handle_signals: bool = True) -> None:
    runtime.configure_process(settings.server.threads)
    tel = telemetry.configure("specsplit-verify", settings.server.metrics_port)
    worker = ModelWorker("verify")
    lm = await worker.run(runtime.load, settings.model)
    sessions = SessionTable(settings.max_sessions, settings.idle_timeout_s)
    servicer = VerifierServicer(lm, sessions, worker, settings.server.shared_memory)
    await serve(settings.server, SERVICE_NAME, lambda server: register(server, servicer), servicer.warmup,
                sessions=sessions, worker=worker, stop_event=stop_event, handle_signals=handle_signals,
                interceptors=tel.server_interceptors())
