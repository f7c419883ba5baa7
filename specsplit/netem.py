"""A userspace delaying TCP proxy: network emulation where `tc netem` is not available (these
machines have no sch_netem module). Every chunk read from one side is written to the other side
`one_way_ms` after it was read, in order, optionally paced to a bandwidth cap. The delay can change
while connections are open, so one stack serves a whole RTT sweep. Loopback only."""

from __future__ import annotations

import asyncio
import threading
import time


class DelayProxy:
    def __init__(self, upstream: str, rtt_ms: float = 0.0, bandwidth_bytes_s: float = 0.0):
        host, _, port = upstream.rpartition(":")
        if host not in ("127.0.0.1", "localhost", "[::1]"):
            raise ValueError(f"the delay proxy only forwards to loopback, not {upstream!r}")
        self.upstream = (host, int(port))
        self.rtt_ms = rtt_ms
        self.bandwidth = bandwidth_bytes_s  # 0: unlimited
        self.address = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="delay-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> str:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", 0), self._loop).result(10)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.address

    def set_rtt(self, rtt_ms: float) -> None:
        self.rtt_ms = rtt_ms  # read per chunk: applies to data read from now on

    def stop(self) -> None:
        async def close():
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        if self._server is not None:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> DelayProxy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _accept(self, client_reader, client_writer) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_writer.close()
            return
        for reader, writer in ((client_reader, upstream_writer), (upstream_reader, client_writer)):
            task = asyncio.create_task(self._pipe(reader, writer))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction: read, hold each chunk until its due time, write in order."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while (item := await queue.get()) is not None:
                due, data = item
                delay = due - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(data)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(deliver())
        free_at = 0.0  # when the emulated link finishes sending the previous chunk (bandwidth cap)
        try:
            while data := await reader.read(65536):
                now = time.monotonic()
                free_at = max(free_at, now) + len(data) / self.bandwidth if self.bandwidth else now
                queue.put_nowait((free_at + self.rtt_ms / 2000, data))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            queue.put_nowait(None)
            await asyncio.gather(sender, return_exceptions=True)
