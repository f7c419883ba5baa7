"""The one thread of a service that touches its model and per-session state.

Work arrives two ways and runs in arrival order on this thread: jobs from the gRPC event loop
(`run`) and framed requests on the co-located fast path (`specsplit.fastpath`), which this thread
serves itself so that a round on the fast path costs no thread hop. One thread also means one
OpenMP team for the native kernels."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import selectors
import socket
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("specsplit")


class ModelWorker:
    def __init__(self, name: str):
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._run_jobs)
        self._jobs: collections.deque = collections.deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Runs fn(*args) on the worker thread; callable from any thread."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:
            future.cancel()
            return future
        self._jobs.append((future, fn, args))
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:  # the wake-up buffer is full: the thread is awake anyway
            pass
        return future

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.submit(fn, *args))

    def watch(self, sock: socket.socket, on_readable: Callable[[socket.socket], None]) -> None:
        """Calls on_readable(sock) on the worker thread whenever sock is readable (from any thread)."""
        if threading.current_thread() is self._thread:
            self._selector.register(sock, selectors.EVENT_READ, on_readable)
        else:
            self.submit(self._selector.register, sock, selectors.EVENT_READ, on_readable).result()

    def unwatch(self, sock: socket.socket) -> None:
        """From the worker thread (a callback): stop watching sock."""
        self._selector.unregister(sock)

    def _loop(self) -> None:
        while not self._stopping:
            for key, _ in self._selector.select():
                try:
                    key.data(key.fileobj)
                except Exception:  # a callback's bug must not kill the thread that serves everyone
                    log.exception("worker callback failed")
        for future, _, _ in self._jobs:
            future.cancel()
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()
        self._wake_w.close()

    def _run_jobs(self, sock: socket.socket) -> None:
        try:
            sock.recv(4096)
        except BlockingIOError:
            pass
        while self._jobs and not self._stopping:
            future, fn, args = self._jobs.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                future.set_exception(e)

    def shutdown(self) -> None:
        """Finishes the job running now, cancels the queued ones, closes watched sockets."""
        if self._thread.is_alive():
            self.submit(self._stop)
            self._thread.join()

    def _stop(self) -> None:
        self._stopping = True
