"""The one thread of a service that touches its model and per-session state.

Work arrives two ways and runs in arrival order on this thread: jobs from the gRPC event loop
(`run`, `run_gathered`) and framed requests on the co-located fast path (`specsplit.serving.fastpath`),
which this thread serves itself so that a round on the fast path costs no thread hop. One thread
also means one OpenMP team for the native kernels.

Gathered work (`gather`, `run_gathered`) is batched: items that arrive close together are handed
to their runner in one call (the verify service runs them in one forward). A batch is run once it
holds a call from every live session (`expected()`, the service's session count: in steady state
each session sends one round per forward, so they all come back), holds `max_rows` rows, or its
first item has waited `wait_s`; a plain job runs only after the batch before it, so arrival order
holds across both kinds. A runner may leave an item unfinished (`Again`: a long prefill runs in
chunks): the item joins the next batch, beside whatever arrived meanwhile, and plain jobs (a
Release) run between its turns. An item may bring its own wait (`run_gathered(wait_s=)`,
`Again.wait_s`), and a batch waits the shortest of its items' waits: a prefill's chunk waits longer
for the live sessions' rounds, since one run alone makes a round that arrives meanwhile wait out the
whole chunk, then its own forward. Waiting for every session keeps them in step: one that misses a forward
would otherwise run its own, beside (and on a shared CPU, against) the others' drafting.

With a `tuner` (specsplit.serving.threadtune), each batch runs on the team size it picks, and its
wall and CPU time go back to it."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from specsplit.serving import hops

log = logging.getLogger("specsplit")

# runner(items) -> one outcome per item: its result, or the exception it raised
Runner = Callable[[list], list]
Reply = Callable[[Any], None]


@dataclass(frozen=True)
class Again:
    """A runner's outcome for an item it has not finished (a prefill in chunks): the item joins the
    next batch with `rows` rows, and its reply waits; that turn may wait up to `wait_s` for other
    items (None: the worker's wait)."""

    rows: int
    wait_s: float | None = None


class ModelWorker:
    def __init__(self, name: str, wait_s: float = 0.0, max_rows: int = 256,
                 expected: Callable[[], int] = lambda: 1):
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, self._run_jobs)
        self._jobs: collections.deque = collections.deque()
        self._stopping = False
        self.wait_s, self.max_rows = wait_s, max_rows
        # (runner, item, rows, reply, its wait or None: wait_s, True: an unfinished item's next turn)
        self._batch: list[tuple[Runner, Any, int, Reply, float | None, bool]] = []
        self._batch_since = 0.0  # when the batch's first item arrived (perf_counter)
        self.expected = expected  # how many calls a batch can expect (set by the service)
        self.tuner = None  # a ThreadTuner, set by a service whose forwards' bits do not depend on it
        self._work, self._worked = f"{name}.work", f"{name}.worked"  # hop marks: a batch run
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Runs fn(*args) on the worker thread; callable from any thread."""
        return self._enqueue(None, fn, args)

    def run(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """From an event loop: fn(*args) on the worker thread, queued now, awaitable."""
        return asyncio.wrap_future(self.submit(fn, *args))

    def run_gathered(self, runner: Runner, item: Any, rows: int = 1, wait_s: float | None = None,
                     joined: Callable[[], None] | None = None) -> asyncio.Future:
        """From an event loop: runner's outcome for `item`, queued now and run in a batch with
        whatever else is gathered (waiting up to wait_s for it, None: the worker's); awaiting it
        raises the item's exception. joined(), on the worker thread, when the item joins a batch
        (once; never for an item cancelled while still queued)."""
        return asyncio.wrap_future(self._enqueue(runner, item, (rows, wait_s, joined)))

    def gather(self, runner: Runner, item: Any, rows: int, reply: Reply, wait_s: float | None = None,
               again: bool = False) -> None:
        """From the worker thread (a callback): adds `item` to the batch; reply(outcome) later."""
        if not self._batch:
            self._batch_since = time.perf_counter()
        self._batch.append((runner, item, rows, reply, wait_s, again))

    def _enqueue(self, runner: Runner | None, fn_or_item: Any, args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:
            future.cancel()
            return future
        self._jobs.append((future, runner, fn_or_item, args))
        try:
            self._wake_w.send(b"\0")
        except BlockingIOError:  # the wake-up buffer is full: the thread is awake anyway
            pass
        return future

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
            for key, _ in self._selector.select(self._timeout()):
                try:
                    key.data(key.fileobj)
                except Exception:  # a callback's bug must not kill the thread that serves everyone
                    log.exception("worker callback failed")
            if self._batch and self._timeout() == 0:
                self._flush()
        for entry in self._batch:
            entry[3](concurrent.futures.CancelledError("the service is stopping"))
        for future, *_ in self._jobs:
            future.cancel()
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()
        self._selector.close()
        self._wake_w.close()

    def _timeout(self) -> float | None:
        """How long the batch may still wait for more items (None: there is none)."""
        if not self._batch:
            return None
        if len(self._batch) >= self.expected() or sum(b[2] for b in self._batch) >= self.max_rows:
            return 0
        wait = min(self.wait_s if entry[4] is None else entry[4] for entry in self._batch)
        return max(0.0, wait - (time.perf_counter() - self._batch_since))

    def _flush(self) -> None:
        """Runs the batch: items of one runner together, in arrival order, up to max_rows (at least
        one item); what does not fit waits for the next."""
        runner, rows, taken, rest = self._batch[0][0], 0, [], []
        for entry in self._batch:
            if entry[0] == runner and (not taken or rows + entry[2] <= self.max_rows) and not rest:
                taken.append(entry)
                rows += entry[2]
            else:
                rest.append(entry)
        self._batch = rest
        self._batch_since = time.perf_counter()
        tuner = self.tuner
        size = tuner.size() if tuner else 0
        started, cpu = time.perf_counter(), time.thread_time()
        hops.mark(self._work)
        try:
            outcomes = runner([entry[1] for entry in taken])
        except BaseException as e:  # noqa: BLE001 -- a runner's bug fails its items, not the thread
            log.exception("batch runner failed")
            outcomes = [e] * len(taken)
        else:
            if tuner:
                tuner.record(size, time.perf_counter() - started, time.thread_time() - cpu)
        hops.mark(self._worked)
        for entry, outcome in zip(taken, outcomes):
            if isinstance(outcome, Again):
                self.gather(entry[0], entry[1], outcome.rows, entry[3], outcome.wait_s, again=True)
                continue
            try:
                entry[3](outcome)
            except Exception:
                log.exception("batch reply failed")

    def _run_jobs(self, sock: socket.socket) -> None:
        try:
            sock.recv(4096)
        except BlockingIOError:
            pass
        while self._jobs and not self._stopping:
            future, runner, fn, args = self._jobs.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            if runner is not None:
                rows, wait_s, joined = args
                if joined is not None:
                    joined()
                self.gather(runner, fn, rows, lambda outcome, f=future: _settle(f, outcome), wait_s)
                continue
            while any(not entry[5] for entry in self._batch):  # what arrived before this job runs
                self._flush()  # before it (an unfinished item's next turn may come after it)
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


def _settle(future: concurrent.futures.Future, outcome: Any) -> None:
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
