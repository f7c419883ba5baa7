"""A userspace delaying TCP proxy: network emulation where `tc netem` is not available (these
machines have no sch_netem module). Every chunk read from one side is written to the other side
`rtt_ms / 2` after it was read, in order, optionally paced to a bandwidth cap. The delay can change
while connections are open, so one stack serves a whole RTT sweep. Loopback only.

Threads with blocking sockets rather than asyncio: an event loop's timers have millisecond
granularity (epoll), which added ~2 ms to every emulated 0.5 ms round trip; time.sleep is good to
~0.1 ms here."""

from __future__ import annotations

import queue
import socket
import threading
import time


class DelayProxy:
    def __init__(self, upstream: str, rtt_ms: float = 0.0, bandwidth_bytes_s: float = 0.0):
        host, _, port = upstream.rpartition(":")
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"the delay proxy only forwards to loopback, not {upstream!r}")
        self.upstream = (host, int(port))
        self.rtt_ms = rtt_ms
        self.bandwidth = bandwidth_bytes_s  # 0: unlimited
        self.address = ""
        self._listener: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def start(self) -> str:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="delay-proxy", daemon=True).start()
        return self.address

    def set_rtt(self, rtt_ms: float) -> None:
        self.rtt_ms = rtt_ms  # read per chunk: applies to data read from now on

    def stop(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for s in self._sockets:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._sockets.clear()

    def __enter__(self) -> DelayProxy:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.upstream)
            except OSError:
                if self._closed.is_set():
                    return
                continue
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._sockets += [client, upstream]
            self._pipe(client, upstream)
            self._pipe(upstream, client)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        """One direction: a reader stamps each chunk with its due time, a writer delivers in order."""
        chunks: queue.Queue = queue.Queue()

        def read() -> None:
            free_at = 0.0  # when the emulated link has sent the previous chunk (bandwidth cap)
            try:
                while data := src.recv(65536):
                    now = time.monotonic()
                    free_at = max(free_at, now) + len(data) / self.bandwidth if self.bandwidth else now
                    chunks.put((free_at + self.rtt_ms / 2000, data))
            except OSError:
                pass
            chunks.put(None)

        def write() -> None:
            try:
                while (item := chunks.get()) is not None:
                    due, data = item
                    if (delay := due - time.monotonic()) > 0:
                        time.sleep(delay)
                    dst.sendall(data)
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()
