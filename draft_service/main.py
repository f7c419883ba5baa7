"""Entry point of the draft service."""

from __future__ import annotations

import asyncio

from opentelemetry.metrics import Observation

from draft_service.drafters.base import Drafter
from draft_service.drafters.hybrid import HybridDrafter
from draft_service.drafters.model import ModelDrafter
from draft_service.drafters.ngram import NgramDrafter, OutputStore
from draft_service.drafters.selfdraft import SelfDrafter, resolve_head
from draft_service.server import SERVICE_NAME, DrafterServicer, register
from specsplit import default_model, runtime, telemetry
from specsplit.serving import serve
from specsplit.sessions import SessionTable
from specsplit.settings import DraftSettings
from specsplit.worker import ModelWorker


def build_drafters(settings: DraftSettings) -> dict[str, Drafter]:
    store = OutputStore(settings.store_tokens) if settings.store_tokens > 0 else None
    ngram = NgramDrafter("ngram", settings.ngram_min, settings.ngram_max, store=store)
    drafters: dict[str, Drafter] = {"ngram": ngram}
    if settings.model is not None:
        drafters["model"] = ModelDrafter(runtime.load(settings.model), "model",
                                         default_model.resolve(settings.model.path))
    if settings.self_head is not None:
        head = SelfDrafter(resolve_head(settings.self_head), default_model.resolve(settings.target_model),
                           settings.device, min_confidence=settings.self_min_confidence)
        drafters["self"] = head
        drafters["hybrid"] = HybridDrafter(ngram, head, settings.hybrid_min_match)
    return drafters


async def run(settings: DraftSettings, stop_event: asyncio.Event | None = None, handle_signals: bool = True) -> None:
    runtime.configure_process(settings.server.threads)
    tel = telemetry.configure("specsplit-draft", settings.server.metrics_port)
    worker = ModelWorker("draft", settings.batch_wait_ms / 1e3)
    drafters = await worker.run(build_drafters, settings)
    sessions = SessionTable(settings.max_sessions, settings.idle_timeout_s)
    worker.expected = lambda: len(sessions)  # every drafting session sends a Propose per round
    default = settings.default_drafter
    if default == "auto":
        default = "hybrid" if "hybrid" in drafters else "ngram"
    servicer = DrafterServicer(drafters, default, sessions, worker, settings.proposal_top_k,
                               settings.server.shared_memory)
    m = telemetry.meter()
    m.create_observable_gauge(
        "specsplit.draft.memory", unit="By", description="bytes each drafter holds (DrafterInfo.memory_bytes)",
        callbacks=[lambda _: [Observation(d.memory_bytes, {"drafter": name}) for name, d in drafters.items()]])
    m.create_observable_gauge("specsplit.draft.sessions", unit="{session}", description="sessions held",
                              callbacks=[lambda _: [Observation(len(sessions))]])
    m.create_observable_gauge("specsplit.draft.sessions.limit", unit="{session}", description="--max-sessions",
                              callbacks=[lambda _: [Observation(sessions.max_sessions)]])
    fast = servicer.rounds.open_fast_path("draft", settings.server.shared_memory)
    await serve(settings.server, SERVICE_NAME, lambda server: register(server, servicer), servicer.warmup,
                sessions=sessions, worker=worker, stop_event=stop_event, handle_signals=handle_signals,
                interceptors=tel.server_interceptors(), fast_path=fast)
