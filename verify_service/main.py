"""Entry point of the verify service."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import torch
from opentelemetry.metrics import Observation

from specsplit.model import catalog, native
from specsplit.model.headfile import head_runner, load_head, max_context, resolve_head
from specsplit.model.headserving import NativeHead
from specsplit.model.prefixcache import PrefixCache
from specsplit.serving import runtime, telemetry
from specsplit.serving.server import serve
from specsplit.serving.sessions import SessionTable
from specsplit.serving.settings import VerifySettings
from specsplit.serving.worker import ModelWorker
from specsplit.speculation.lookup import OutputIndex
from verify_service.engine import Target
from verify_service.headdraft import VerifierHead
from verify_service.server import SERVICE_NAME, VerifierServicer, register

log = logging.getLogger("specsplit")


def kv_budget(settings: VerifySettings, lm) -> int:
    """Bytes for all sessions' KV caches: the setting, or max_sessions at the full context capped at a
    quarter of physical memory."""
    if settings.kv_cache_mib > 0:
        return settings.kv_cache_mib << 20
    per_token = lm.native.token_bytes if lm.native is not None else 0
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(settings.max_sessions * lm.max_context * per_token, physical // 4)


def _gauges(lm, sessions: SessionTable, cache: PrefixCache | None) -> None:
    m = telemetry.meter()
    m.create_observable_gauge("specsplit.verify.sessions", unit="{session}", description="sessions held",
                              callbacks=[lambda _: [Observation(len(sessions))]])
    m.create_observable_gauge("specsplit.verify.sessions.limit", unit="{session}", description="--max-sessions",
                              callbacks=[lambda _: [Observation(sessions.max_sessions)]])
    if lm.native is not None:  # transformers' own cache is not accounted
        pool = lm.native.pool
        m.create_observable_gauge("specsplit.verify.kv_cache.usage", unit="By",
                                  description="bytes the sessions' KV caches and the prefix cache hold",
                                  callbacks=[lambda _: [Observation(pool.used_bytes)]])
        m.create_observable_gauge("specsplit.verify.kv_cache.limit", unit="By", description="the KV cache budget",
                                  callbacks=[lambda _: [Observation(pool.budget_bytes)]])
    if cache is not None:
        m.create_observable_gauge("specsplit.verify.prefix_cache.usage", unit="By",
                                  description="bytes the prefix cache holds (given back whenever sessions need them)",
                                  callbacks=[lambda _: [Observation(cache.used_bytes)]])


def _head(settings: VerifySettings) -> VerifierHead | None:
    """The target's feature head for this service's own drafting (VerifySettings.self_head): only on
    the native kernels, where a round is one call."""
    if settings.self_head is None:
        return None
    head_dir = resolve_head(settings.self_head, settings.model.path)
    target_dir = catalog.resolve(settings.model.path)
    head, _ = load_head(head_dir, target_dir, settings.model.device, settings.head_vocab)
    runner = head_runner(head, torch.device(settings.model.device), max_context(target_dir))
    if not isinstance(runner, NativeHead):
        log.info("feature head %s: not drafting here (no native kernels: a round would be a call a step)",
                 head_dir.name)
        return None
    log.info("feature head %s drafts here (decode-ahead, where the lookup finds nothing)", head_dir.name)
    return VerifierHead(runner, head_dir.name, settings.head_gamma, settings.self_min_confidence, settings.head_width)


async def run(settings: VerifySettings, stop_event: asyncio.Event | None = None, handle_signals: bool = True) -> None:
    threads = runtime.configure_process(settings.server.threads, "verify")
    tel = telemetry.configure("specsplit-verify", settings.server.metrics_port)
    worker = ModelWorker("verify", settings.batch_wait_ms / 1e3, settings.batch_rows)
    started = time.perf_counter()
    lm = await worker.run(runtime.load, settings.model)
    log.info("target %s loaded in %.1f s; forward: %s%s", lm.model_id, time.perf_counter() - started, lm.kernels,
             f" ({lm.native.kernel}; kernel path {native.describe()})" if lm.native is not None else "")
    log.info(threads + runtime.tune_threads(worker, "verify", lm.native is not None, settings.server.fixed_threads))
    freed = lm.release_transformers_weights()
    if freed:
        log.info("freed transformers' copy of the packed weights: %.0f MiB", freed / 2**20)
    log.info(lm.set_kv_budget(kv_budget(settings, lm)))
    sessions = SessionTable(settings.max_sessions, settings.idle_timeout_s)
    cache = PrefixCache(lm.native.pool) if settings.prefix_cache and lm.native is not None else None
    head = await worker.run(_head, settings)
    servicer = VerifierServicer(lm, sessions, worker, settings.server.shared_memory, Target(lm, prefix_cache=cache),
                                OutputIndex(settings.store_tokens) if settings.store_tokens > 0 else None, head)
    worker.expected = servicer.expected  # every live session sends a round per forward, every prefill a chunk
    _gauges(lm, sessions, cache)
    fast = servicer.rounds.open_fast_path("verify", settings.server.shared_memory)
    await serve(settings.server, SERVICE_NAME, lambda server: register(server, servicer), servicer.warmup,
                sessions=sessions, worker=worker, stop_event=stop_event, handle_signals=handle_signals,
                interceptors=tel.server_interceptors(), fast_path=fast)
