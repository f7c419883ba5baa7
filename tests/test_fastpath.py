"""The co-located round path on its own: the model worker thread, frames, errors, and answers that
stay matched to their calls when a caller gives up."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from specsplit import fastpath
from specsplit.errors import Failure
from specsplit.verify.v1 import verify_pb2 as vpb
from specsplit.worker import ModelWorker


@pytest.fixture
def shm_dir(monkeypatch):
    d = Path(tempfile.mkdtemp(prefix="fp-", dir="/tmp"))  # short: socket paths have at most 107 bytes
    monkeypatch.setenv("SPECSPLIT_SHM_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def test_worker_runs_every_job_on_its_one_thread_in_order():
    worker = ModelWorker("test")
    try:
        seen = []
        results = await asyncio.gather(*(worker.run(lambda i=i: seen.append((i, threading.get_ident())) or i * i)
                                         for i in range(20)))
        assert results == [i * i for i in range(20)]
        assert [i for i, _ in seen] == list(range(20)) and len({t for _, t in seen}) == 1
        assert seen[0][1] != threading.get_ident()
        with pytest.raises(ZeroDivisionError):
            await worker.run(lambda: 1 / 0)
    finally:
        worker.shutdown()
    assert worker.submit(int).cancelled()  # after shutdown nothing runs


def _handler(body: bytes) -> bytes:
    request = vpb.VerifyRequest.FromString(body)
    if request.session_id == "slow":
        time.sleep(0.3)
    if request.session_id == "refused":
        raise Failure(grpc.StatusCode.FAILED_PRECONDITION, "length mismatch")
    if request.session_id == "bug":
        raise KeyError("oops")
    return vpb.VerifyResponse(num_accepted=len(request.draft_token_ids), length=request.length + 1).SerializeToString()


def _serve(body: bytes, reply) -> None:
    """The fast path's handler form: reply(answer bytes or the exception)."""
    try:
        reply(_handler(body))
    except Exception as e:  # noqa: BLE001 -- the answer
        reply(e)


async def test_calls_errors_and_late_answers(shm_dir):
    worker = ModelWorker("test")
    server = fastpath.offer(worker, _serve, "verify", enabled=True)
    try:
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600  # only this user may connect
        link = await fastpath.FastLink.open(server.path, "verify")
        answers = await asyncio.gather(*(link.call(vpb.VerifyRequest(session_id="s", length=n, draft_token_ids=[1] * n),
                                                   vpb.VerifyResponse, 5.0) for n in range(1, 30)))
        assert [(a.num_accepted, a.length) for a in answers] == [(n, n + 1) for n in range(1, 30)]
        with pytest.raises(Failure) as refused:
            await link.call(vpb.VerifyRequest(session_id="refused"), vpb.VerifyResponse, 5.0)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.message == "verify service: length mismatch"
        with pytest.raises(Failure) as bug:
            await link.call(vpb.VerifyRequest(session_id="bug"), vpb.VerifyResponse, 5.0)
        assert bug.value.code == grpc.StatusCode.INTERNAL and "KeyError" in bug.value.message
        # A caller that gives up leaves its answer to be dropped: the next call gets its own.
        with pytest.raises(Failure) as late:
            await link.call(vpb.VerifyRequest(session_id="slow", length=100), vpb.VerifyResponse, 0.05)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        after = await link.call(vpb.VerifyRequest(session_id="s", length=7), vpb.VerifyResponse, 5.0)
        assert after.length == 8
        # A stopping service finishes the request it is running, then its connections close: the
        # link knows, and a call fails as UNAVAILABLE at once.
        pending = asyncio.ensure_future(link.call(vpb.VerifyRequest(session_id="slow", length=1),
                                                  vpb.VerifyResponse, 5.0))
        await asyncio.sleep(0.05)
        await asyncio.to_thread(worker.shutdown)
        assert (await pending).length == 2
        for _ in range(100):
            if link.closed:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(Failure) as gone:
            await link.call(vpb.VerifyRequest(session_id="s"), vpb.VerifyResponse, 5.0)
        assert gone.value.code == grpc.StatusCode.UNAVAILABLE and link.closed
    finally:
        worker.shutdown()
        server.close()
    assert not server.path.exists()


def test_stale_sockets_are_reclaimed_and_live_ones_kept(shm_dir):
    worker = ModelWorker("test")
    live = fastpath.offer(worker, _serve, "draft", enabled=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead_path = shm_dir / "specsplit-fast-1-deadbeef.sock"
    dead.bind(str(dead_path))
    dead.close()  # bound, nobody listening: what a SIGKILLed service leaves
    try:
        assert fastpath.reclaim_stale() == [dead_path.name]
        assert live.path.exists() and not dead_path.exists()
    finally:
        worker.shutdown()
        live.close()


def test_no_fast_path_where_a_socket_cannot_be_made(monkeypatch, tmp_path):
    deep = tmp_path / ("x" * 120)
    deep.mkdir()
    monkeypatch.setenv("SPECSPLIT_SHM_DIR", str(deep))
    worker = ModelWorker("test")
    try:
        assert fastpath.offer(worker, _serve, "verify", enabled=True) is None  # rounds use gRPC then
        assert fastpath.offer(worker, _serve, "verify", enabled=False) is None
    finally:
        worker.shutdown()
