"""Entry point of the draft service."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from opentelemetry.metrics import Observation

from draft_service.drafters.base import Drafter
from draft_service.drafters.hybrid import HybridDrafter
from draft_service.drafters.model import ModelDrafter, draft_vocabulary
from draft_service.drafters.ngram import NgramDrafter
from draft_service.drafters.selfdraft import SelfDrafter
from draft_service.server import SERVICE_NAME, DrafterServicer, register
from specsplit.model import catalog
from specsplit.model.headfile import resolve_head
from specsplit.serving import runtime, telemetry
from specsplit.serving.server import serve
from specsplit.serving.sessions import SessionTable
from specsplit.serving.settings import DraftSettings, ModelSettings
from specsplit.serving.worker import ModelWorker
from specsplit.speculation.lookup import OutputIndex

log = logging.getLogger("specsplit")


def draft_quantization(model: ModelSettings) -> str:
    """"auto": q4_0 where the native kernels run and the CPU has VNNI, else int8 weights where they
    run the draft model in bf16, else its own dtype. A drafter need not be exact, only cheap
    (speculation stays lossless): on the 1.5B + 0.5B pair from their files, the 0.5B as q4_0 drafts
    at 0.23-0.33 of a target step per token against 0.39-0.48 from its own GGUF blocks (which
    stream 8 bits for its Q5_0/Q6_K tensors), accepts 3.19-3.27 tokens a round against 3.40, and
    spec-on ran 38.7-39.7 tok/s against 34.3-34.5 (alternating runs, 2026-12-05)."""
    if model.quantize != "auto":
        return model.quantize
    import torch

    from specsplit.model import native
    from specsplit.model.modeling import parse_dtype

    dtype = parse_dtype(model.dtype)
    if native.unavailable(dtype, torch.device(model.device)):
        return ""
    if not native.lacks_vnni():
        return "q4_0"
    return "int8" if dtype == torch.bfloat16 else ""


def build_drafters(settings: DraftSettings) -> dict[str, Drafter]:
    store = OutputIndex(settings.store_tokens) if settings.store_tokens > 0 else None
    ngram = NgramDrafter("ngram", settings.ngram_min, settings.ngram_max, store=store)
    drafters: dict[str, Drafter] = {"ngram": ngram}
    if settings.model is not None:
        vocab = draft_vocabulary(catalog.resolve(settings.model.path), settings.draft_vocab)
        model = replace(settings.model, quantize=draft_quantization(settings.model))
        drafters["model"] = ModelDrafter(runtime.load(model, head_ids=vocab), "model", vocab)
    if settings.self_head is not None:
        drafters["self"] = SelfDrafter(resolve_head(settings.self_head, settings.target_model),
                                       catalog.resolve(settings.target_model), settings.device,
                                       min_confidence=settings.self_min_confidence, vocab=settings.head_vocab)
    # Retrieval where it matches, a neural drafter elsewhere: the self head when one is loaded
    # (trained for this target), else the draft model.
    neural = drafters.get("self") or drafters.get("model")
    if neural is not None:
        drafters["hybrid"] = HybridDrafter(ngram, neural, settings.hybrid_min_match)
    return drafters


async def run(settings: DraftSettings, stop_event: asyncio.Event | None = None, handle_signals: bool = True) -> None:
    threads = runtime.configure_process(settings.server.threads, "draft")
    tel = telemetry.configure("specsplit-draft", settings.server.metrics_port)
    worker = ModelWorker("draft", settings.batch_wait_ms / 1e3)
    drafters = await worker.run(build_drafters, settings)
    invariant = all(d.thread_invariant for d in drafters.values())
    log.info(threads + runtime.tune_threads(worker, "draft", invariant, settings.server.fixed_threads))
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
