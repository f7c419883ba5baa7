"""Retrieval drafting's one engine: where each token and each pair of tokens stood, in a session's
own growing sequence (SequenceIndex: the prompt, then committed output) and in a bounded store of
earlier sessions' outputs (OutputIndex), so that "what followed earlier occurrences of the
context's end" is a dictionary read and a short comparison. One matching rule everywhere: of the
latest CANDIDATES occurrences of the last two tokens (of the last one, where a caller allows a
one-token match and the pair never occurred), those that agree longest with the context going
back (up to max_n tokens), latest first. The gateway's gate asks whether a copy is in sight; the
verifier's decode-ahead and the draft service's n-gram drafter draft from it (the latter a token
tree from several occurrences). Only drafting speed depends on it: drafts are verified."""

from __future__ import annotations

import threading
from array import array
from collections import deque

CANDIDATES = 8  # latest occurrences of the context's last two tokens compared by how far back they agree
MATCH = 8  # tokens compared back from them: the longest agreement wins


def _best(at: list[int], agreement, depth: int, limit: int, min_n: int, follow) -> tuple[list[list[int]], int]:
    """The continuations (follow(position, depth), non-empty) of the latest `limit` positions among
    the latest CANDIDATES of `at` that agree longest (agreement(position)), and that length;
    ([], 0) below min_n."""
    ranked = sorted(((agreement(p), p) for p in at[-CANDIDATES:]), reverse=True)
    n = ranked[0][0] if ranked else 0
    if n < min_n:
        return [], 0
    follows = [f for agree, p in ranked if agree == n and (f := follow(p, depth))][:limit]
    return (follows, n) if follows else ([], 0)


def first(found: tuple[list[list[int]], int]) -> tuple[list[int], int]:
    """The first continuation of a continuations() answer and its agreement; ([], 0) where none."""
    follows, n = found
    return (follows[0], n) if follows else ([], 0)


class SequenceIndex:
    """Indexes a growing sequence (pass the same list each time: each call indexes what was
    appended since the last); a drafter whose sequence is rolled back calls truncate first."""

    def __init__(self):
        self._pairs: dict[int, list[int]] = {}  # (a << 32 | b) -> where b stood after a, in order
        self._ones: dict[int, list[int]] = {}  # token -> where it stood, in order
        self._upto = 0  # positions < _upto are indexed (never the last token: it is the query's)

    def truncate(self, tokens: list[int], length: int) -> None:
        """Forgets what `tokens` held from `length` on: call before the sequence is cut there."""
        keep = max(length - 1, 0)
        for i in range(self._upto - 1, keep - 1, -1):
            self._ones[tokens[i]].pop()
            if i >= 1:
                self._pairs[tokens[i - 1] << 32 | tokens[i]].pop()
        self._upto = min(self._upto, keep)

    def _grow(self, tokens: list[int]) -> None:
        for i in range(self._upto, len(tokens) - 1):
            self._ones.setdefault(tokens[i], []).append(i)
            if i >= 1:
                self._pairs.setdefault(tokens[i - 1] << 32 | tokens[i], []).append(i)
        self._upto = max(self._upto, len(tokens) - 1)

    def continuations(self, tokens: list[int], depth: int, limit: int = 1, min_n: int = 2,
                      max_n: int = MATCH) -> tuple[list[list[int]], int]:
        """Up to `limit` continuations (up to `depth` tokens each) of the earlier occurrences of the
        end of `tokens` that agree longest with it (at least min_n tokens, counted up to max_n),
        latest first, and how many tokens they agree on; ([], 0) where none."""
        self._grow(tokens)
        end = len(tokens) - 1
        if depth < 1 or end < 1:
            return [], 0
        at, first = (self._pairs.get(tokens[-2] << 32 | tokens[-1]), 2) if max_n >= 2 else (None, 1)
        if not at and min_n <= 1:
            at, first = self._ones.get(tokens[-1]), 1
        if not at:
            return [], 0

        def agreement(p: int) -> int:
            n = first
            while n < max_n and p - n >= 0 and tokens[p - n] == tokens[end - n]:
                n += 1
            return min(n, max_n)

        return _best(at, agreement, depth, limit, min_n, lambda p, k: tokens[p + 1:p + 1 + k])

    def match(self, tokens: list[int], k: int, min_n: int = 2, max_n: int = MATCH) -> tuple[list[int], int]:
        """The first of continuations(): up to k tokens, and how many tokens agree; ([], 0) where none."""
        return first(self.continuations(tokens, k, 1, min_n, max_n))

    def follows(self, tokens: list[int], k: int) -> list[int]:
        return self.match(tokens, k)[0]


class OutputIndex:
    """Earlier sessions' outputs, shared by every session of a service (templated answers repeat
    across requests), matched as SequenceIndex matches (two tokens at least) and never across two
    outputs. Bounded: once `max_tokens` is passed the oldest outputs go (they stay searchable until
    the index is rebuilt, at twice the bound). Thread-safe: sessions end on the event loop while
    lookups may run on a worker."""

    _END = -1  # between outputs: matches no token id, and a continuation stops at it

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._outputs: deque[array] = deque()
        self._tokens = 0  # in _outputs
        self._seq = array("l", [self._END])  # the outputs in order, each followed by _END
        self._pairs: dict[int, list[int]] = {}  # (a << 32 | b) -> where b stood after a in _seq, in order
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._tokens

    @property
    def memory_bytes(self) -> int:
        return len(self._seq) * self._seq.itemsize

    def add(self, output: list[int]) -> None:
        output = output[-self.max_tokens:] if self.max_tokens > 0 else []
        if not output:
            return
        with self._lock:
            self._outputs.append(array("l", output))
            self._tokens += len(output)
            while self._tokens > self.max_tokens:
                self._tokens -= len(self._outputs.popleft())
            if len(self._seq) + len(output) > 2 * self.max_tokens:  # rebuilt from what is kept
                self._seq, self._pairs = array("l", [self._END]), {}
                for kept in self._outputs:
                    self._append(kept)
            else:
                self._append(output)

    def _append(self, output) -> None:
        start = len(self._seq)
        self._seq.extend(output)
        self._seq.append(self._END)
        seq = self._seq
        for i in range(start + 1, start + len(output)):
            self._pairs.setdefault(seq[i - 1] << 32 | seq[i], []).append(i)

    def continuations(self, tokens: list[int], depth: int, limit: int = 1, min_n: int = 2,
                      max_n: int = MATCH) -> tuple[list[list[int]], int]:
        """As SequenceIndex.continuations, over the stored outputs; a continuation stops at the end
        of its output, and an agreement at its start."""
        if depth < 1 or len(tokens) < 2:
            return [], 0
        with self._lock:
            seq = self._seq
            at = self._pairs.get(tokens[-2] << 32 | tokens[-1])
            if not at:
                return [], 0

            def agreement(p: int) -> int:  # seq[0] is _END: p - n never goes below 0
                n = 2
                while n < min(max_n, len(tokens)) and seq[p - n] == tokens[-1 - n]:
                    n += 1
                return min(n, max_n)

            def follow(p: int, k: int) -> list[int]:
                out = seq[p + 1:p + 1 + k].tolist()
                return out[:out.index(self._END)] if self._END in out else out

            return _best(at, agreement, depth, limit, min_n, follow)

    def match(self, tokens: list[int], k: int, min_n: int = 2, max_n: int = MATCH) -> tuple[list[int], int]:
        return first(self.continuations(tokens, k, 1, min_n, max_n))


class Agreement:
    """How often the target follows one sequence's lookup drafts, per token: accepted tokens over
    accepted tokens plus rejections (a geometric run's estimate), decayed so that a copied span
    shows quickly; and how many tokens a draft is worth at that rate and a forward's cost by width.
    A rate too low to draft at is tried again with one token every PROBE steps: it is only learnt
    from drafts, and what the target follows changes along a text (prose, then code)."""

    DECAY = 0.9  # per lookup
    PRIOR, WEIGHT = 0.5, 2.0  # before any lookup: an even chance, worth two lookups
    PROBE = 16  # steps that drafted nothing before one token is drafted anyway (~1 % of a step each)

    def __init__(self):
        self.accepted, self.stops = self.PRIOR * self.WEIGHT, (1 - self.PRIOR) * self.WEIGHT
        self.idle = 0  # steps since the last draft that had room

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.stops)

    def add(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * self.DECAY + accepted
        self.stops = self.stops * self.DECAY + (accepted < drafted)

    def depth(self, room: int, step_ms: list[float], round_ms: float = 0.0, token_ms: float = 0.0) -> int:
        """Draft tokens worth verifying, at most `room`: the k whose expected gain is the largest,
        each token's chance of being accepted (rate ** i) times a one-row step, less what its rows
        add to the forward (`step_ms[r - 1]`: a forward of r rows) and what drafting them costs (a
        copy nothing; a head `round_ms` a round plus `token_ms` a token, as measured where it runs);
        free tokens always go in."""
        def cost(rows: int) -> float:
            return step_ms[min(rows, len(step_ms)) - 1]

        k, best, gain, chance = 0, 0.0, -round_ms, 1.0
        for i in range(1, room + 1):
            chance *= self.rate
            gain += chance * cost(1) - (cost(i + 1) - cost(i)) - token_ms
            if gain >= best:
                k, best = i, gain
        if k or room < 1:
            self.idle = 0
            return k
        self.idle += 1
        if self.idle < self.PROBE:
            return 0
        self.idle = 0
        return 1  # the probe
