"""The co-located round path on its own: the model worker thread, frames, errors, and answers that
stay matched to their calls when a caller gives up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import grpc
import pytest
from conftest import until

from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.errors import Failure
from specsplit.serving import fastpath
from specsplit.serving.worker import ModelWorker


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


SLOW_RUNNING = threading.Event()  # set when a "slow" call starts on the worker


def _handler(body: bytes) -> bytes:
    request = vpb.VerifyRequest.FromString(body)
    if request.session_id == "slow":
        SLOW_RUNNING.set()
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
        SLOW_RUNNING.clear()
        pending = asyncio.ensure_future(link.call(vpb.VerifyRequest(session_id="slow", length=1),
                                                  vpb.VerifyResponse, 5.0))
        await until(SLOW_RUNNING.is_set, "the slow call running on the worker", 30, every_s=0.005)
        await asyncio.to_thread(worker.shutdown)
        assert (await pending).length == 2
        await until(lambda: link.closed, "the link closing after its server stopped", 30, every_s=0.01)
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


async def test_the_link_survives_malformed_frames_with_clear_failures(tmp_path):
    """A service that answers out of step: an empty error frame fails its call with a clear status
    and the link goes on; an oversize frame fails the call as a bad frame and closes the link; an
    answer nobody asked for closes it too, and later calls fail UNAVAILABLE."""
    path = tmp_path / "bad.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    script: list[bytes] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            for answer in script:
                conn.recv(1 << 16)  # one request, then its scripted answer
                conn.sendall(answer)

    async def link_for(answers: list[bytes]) -> tuple[fastpath.FastLink, threading.Thread]:
        script[:] = answers
        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        return await fastpath.FastLink.open(path, "verify"), thread

    request = vpb.VerifyRequest(session_id="s")
    # An error frame with no status byte: UNKNOWN, said so; the next answer still reaches its call.
    link, thread = await link_for([fastpath.frame(fastpath.ERROR, b"", 0), fastpath.frame(fastpath.OK, b"", 1)])
    with pytest.raises(Failure) as empty:
        await link.call(request, vpb.VerifyResponse, 5.0)
    assert empty.value.code == grpc.StatusCode.UNKNOWN and "no status or message" in empty.value.message
    assert not link.closed and await link.call(request, vpb.VerifyResponse, 5.0) == vpb.VerifyResponse()
    link.close()
    thread.join(5)
    # A frame longer than any message: the call fails as a bad frame, the link is closed.
    link, thread = await link_for([fastpath.HEAD.pack(fastpath.MAX_FRAME + 1, fastpath.OK, 0)])
    with pytest.raises(Failure) as oversize:
        await link.call(request, vpb.VerifyResponse, 5.0)
    assert oversize.value.code == grpc.StatusCode.UNAVAILABLE and "bad frame" in oversize.value.message
    assert link.closed
    thread.join(5)
    # The peer closes mid-frame (half an answer, then gone): the call fails UNAVAILABLE, the link is closed.
    whole = fastpath.frame(fastpath.OK, vpb.VerifyResponse(length=9).SerializeToString(), 0)
    link, thread = await link_for([whole[:len(whole) // 2]])
    with pytest.raises(Failure) as cut:
        await link.call(request, vpb.VerifyResponse, 5.0)
    assert cut.value.code == grpc.StatusCode.UNAVAILABLE, cut.value
    assert link.closed
    thread.join(5)
    # Two answers to one call: the second was asked by nobody, and the stream cannot be trusted.
    link, thread = await link_for([fastpath.frame(fastpath.OK, b"", 0) * 2])
    await link.call(request, vpb.VerifyResponse, 5.0)
    await until(lambda: link.closed, "the link closing after an answer nobody asked for", 30, every_s=0.01)
    with pytest.raises(Failure) as after:
        await link.call(request, vpb.VerifyResponse, 5.0)
    assert after.value.code == grpc.StatusCode.UNAVAILABLE and link.closed
    thread.join(5)
    listener.close()


def _ends(path: Path) -> int:
    """Sockets open on this host at the UNIX address `path`: its listener and the ends it accepted."""
    rows = Path("/proc/net/unix").read_text().splitlines()[1:]
    return sum(1 for row in rows if row.split()[-1] == str(path))


async def test_a_service_answers_bad_frames_clearly_and_keeps_serving(models, tmp_path, shm_dir):
    """The service side of the fast path, on the real verify and draft services: an undecodable
    request is answered INVALID_ARGUMENT, naming the message, on a link that goes on; a frame
    longer than any message closes that connection only; the services keep serving."""
    from conftest import running_stack, until

    from specsplit.api.gateway.v1 import gateway_pb2 as pb
    from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc

    async with running_stack(tmp_path, "unix", models["target"], models["draft"]) as stack:
        sockets = sorted(shm_dir.glob("specsplit-fast-*.sock"))
        assert len(sockets) == 2  # the verify service's and the draft service's
        idle = {path: _ends(path) for path in sockets}  # its listener (no request has come yet)

        def exchange(path: Path, data: bytes) -> bytes:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30)
                conn.connect(str(path))
                conn.sendall(data)
                answer = b""
                for _ in range(1 << 10):  # a frame's reads (each brings a byte at least)
                    chunk = conn.recv(1 << 16)
                    if not chunk:
                        return answer
                    answer += chunk
                    head = fastpath.HEAD.size
                    if len(answer) >= head and len(answer) >= head + struct.unpack_from("<I", answer)[0]:
                        conn.sendall(fastpath.frame(fastpath.OK, b"\xff\xff"))  # the link goes on
                        second = conn.recv(1 << 16)
                        return answer + b"|" + second
                raise AssertionError(f"no whole frame in {len(answer)} bytes over 1,024 reads")

        for path in sockets:
            answer = await asyncio.to_thread(exchange, path, fastpath.frame(fastpath.OK, b"\xff\xff", 7))
            first, second = answer.split(b"|", 1)
            for reply, call in ((first, 7), (second, 0)):
                length, kind, answered = fastpath.HEAD.unpack_from(reply)
                head = fastpath.HEAD.size
                assert kind == fastpath.ERROR and reply[head] == grpc.StatusCode.INVALID_ARGUMENT.value[0], reply
                assert b"undecodable" in reply[head + 1:head + length], reply
                assert answered == call  # each answer names its call
            oversize = fastpath.HEAD.pack(fastpath.MAX_FRAME + 1, fastpath.OK, 0)
            assert await asyncio.to_thread(exchange, path, oversize) == b""  # closed, nothing answered
            # A client that dies mid-frame: the service closes its end (as for every connection above:
            # none is left open), nothing is answered, the service stays.
            half = fastpath.frame(fastpath.OK, vpb.VerifyRequest(session_id="x").SerializeToString(), 3)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(30)
                conn.connect(str(path))
                conn.sendall(half[:len(half) - 3])
                await until(lambda: _ends(path) == idle[path] + 1, "the service's end of the half-frame connection")
            await until(lambda: _ends(path) == idle[path], f"every connection to {path.name} closed by the service")
        async with grpc.aio.insecure_channel(stack.gateway) as ch:
            done = await pb_grpc.GatewayStub(ch).Generate(pb.GenerateRequest(
                text="def add(a, b):", max_new_tokens=8, speculation=pb.SPECULATION_ON,
                stop=pb.StopConditions(ignore_eos=True)))
        assert done.stats.generated_tokens == 8 and done.stats.fast_path
