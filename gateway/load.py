"""What the other sessions on a verify replica put into its forwards: their rows and committed
tokens per round, as their last rounds reported. With a batching verifier a session's rounds share
forwards with theirs, so the gateway cuts a token tree by what it adds to the whole batch
(tokentree.worth_verifying with others' rows and gain), not by what it costs alone."""

from __future__ import annotations

import math
import time


class InFlight:
    """Generate calls in flight, now and as a decayed mean over the last `tau_s` seconds: a request
    lives for seconds, and the load it will share forwards with is the recent one, not the instant
    it arrived at (a lull between two requests of a busy client would otherwise judge it alone)."""

    def __init__(self, tau_s: float = 2.0, clock=time.monotonic):
        self.now, self._mean, self._tau, self._clock = 0, 0.0, tau_s, clock
        self._at = clock()

    def _settle(self) -> None:
        t = self._clock()
        keep = math.exp(-(t - self._at) / self._tau)
        self._mean = self._mean * keep + self.now * (1 - keep)
        self._at = t

    def enter(self) -> None:
        self._settle()
        self.now += 1

    def leave(self) -> None:
        self._settle()
        self.now -= 1

    def others(self) -> int:
        """Other requests a new one (not yet entered) should expect to share forwards with: the
        larger of those in flight now and the recent mean less one (N clients back to back keep
        about N in flight, each request among N - 1 others)."""
        self._settle()
        return max(self.now, round(self._mean) - 1)


class Load:
    def __init__(self):
        self._rounds: dict[str, tuple[int, float]] = {}  # session id -> (rows, tokens committed) of its last round
        self.rows, self.gain = 0, 0.0  # sums over the sessions

    def enter(self, session_id: str) -> None:
        self.report(session_id, 1, 1.0)  # until its first round: what a spec-off round puts in

    def report(self, session_id: str, rows: int, gain: float) -> None:
        old_rows, old_gain = self._rounds.get(session_id, (0, 0.0))
        self._rounds[session_id] = (rows, gain)
        self.rows += rows - old_rows
        self.gain += gain - old_gain

    def leave(self, session_id: str) -> None:
        rows, gain = self._rounds.pop(session_id, (0, 0.0))
        self.rows -= rows
        self.gain -= gain

    def others(self, session_id: str) -> tuple[int, float]:
        """(rows, tokens committed) of the other sessions' last rounds."""
        rows, gain = self._rounds.get(session_id, (0, 0.0))
        return self.rows - rows, self.gain - gain
