"""Prompt lookup's index: where each bigram of a growing token sequence (prompt, then committed
output) stood, so that "did the last two tokens occur before, and what followed them there" is a
dictionary read and a short comparison. The gateway's gate asks the first (a copy in sight); the
verifier's decode-ahead asks the second (its own draft)."""

from __future__ import annotations

from array import array
from collections import deque

CANDIDATES = 8  # latest occurrences of a bigram compared by how far back they match the context
MATCH = 8  # tokens compared back from a bigram: the longest agreeing occurrence is the one copied


class BigramIndex:
    """Indexes a sequence that only grows (committed tokens never roll back); pass the same list each
    time, and each call indexes what was appended since the last."""

    def __init__(self):
        self._at: dict[tuple[int, int], list[int]] = {}  # bigram -> where its second token stood, in order
        self._upto = 0  # tokens[:_upto] are indexed, but for the bigram ending at _upto - 1

    def follows(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed an earlier occurrence of the last two of `tokens` (match())."""
        return self.match(tokens, k)[0]

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed an earlier occurrence of the last two of `tokens`: of its
        latest CANDIDATES occurrences, the one whose preceding tokens agree longest with the context
        (up to MATCH; the latest among equals), as the drafters' n-gram source prefers its longest
        match; and how many tokens agree. ([], 0) where they did not occur before (or k < 1)."""
        end = len(tokens) - 1
        for i in range(max(1, self._upto), end):  # every bigram but the last one
            self._at.setdefault((tokens[i - 1], tokens[i]), []).append(i)
        self._upto = max(self._upto, end)
        seen = self._at.get((tokens[-2], tokens[-1])) if k > 0 and end >= 1 else None
        if not seen:
            return [], 0
        best, agree = seen[-1], -1
        for at in reversed(seen[-CANDIDATES:]):
            n = 2
            while n < MATCH and at - n >= 0 and tokens[at - n] == tokens[end - n]:
                n += 1
            if n > agree:
                best, agree = at, n
        return tokens[best + 1:best + 1 + k], agree


class OutputIndex:
    """Earlier sessions' outputs, shared by every session of a service (templated answers repeat
    across requests), indexed by bigram: the latest stored occurrence of a context's last two
    tokens is a dictionary read. Bounded: once `max_tokens` is passed the oldest outputs go (they
    stay searchable until the index is rebuilt, at twice the bound). Only drafting speed depends on
    it: drafts are verified. Not thread-safe: its owner adds and looks up from one thread."""

    _END = -1  # between outputs: matches no token id, and a continuation stops at it

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._outputs: deque[array] = deque()
        self._tokens = 0  # in _outputs
        self._seq = array("l", [self._END])  # the outputs in order, each followed by _END
        self._at: dict[int, int] = {}  # bigram (a << 32 | b) -> where its second token last stood in _seq

    def __len__(self) -> int:
        return self._tokens

    def add(self, output: list[int]) -> None:
        output = output[-self.max_tokens:] if self.max_tokens > 0 else []
        if not output:
            return
        self._outputs.append(array("l", output))
        self._tokens += len(output)
        while self._tokens > self.max_tokens:
            self._tokens -= len(self._outputs.popleft())
        if len(self._seq) + len(output) > 2 * self.max_tokens:  # rebuilt from what is kept
            self._seq, self._at = array("l", [self._END]), {}
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
            self._at[seq[i - 1] << 32 | seq[i]] = i

    def match(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the latest stored occurrence of the last two of `tokens`,
        and how many tokens of `tokens` it agrees with (up to MATCH); ([], 0) where none."""
        at = self._at.get(tokens[-2] << 32 | tokens[-1]) if k > 0 and len(tokens) >= 2 else None
        if at is None:
            return [], 0
        seq, n = self._seq, 2
        while n < min(MATCH, len(tokens)) and seq[at - n] == tokens[-1 - n]:  # _END stops it at the output's start
            n += 1
        follow = seq[at + 1:at + 1 + k].tolist()
        return (follow[:follow.index(self._END)] if self._END in follow else follow), n


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

    def depth(self, room: int, step_ms: list[float]) -> int:
        """Draft tokens worth verifying, at most `room`: the k-th goes in while its chance of being
        accepted (rate ** k) times a one-row step beats what its row adds to the forward
        (`step_ms[r - 1]`: a forward of r rows); rows that cost nothing extra always go in."""
        def cost(rows: int) -> float:
            return step_ms[min(rows, len(step_ms)) - 1]

        k, chance = 0, 1.0
        while k < room:
            chance *= self.rate
            if chance * cost(1) < cost(k + 2) - cost(k + 1):
                break
            k += 1
        if k or room < 1:
            self.idle = 0
            return k
        self.idle += 1
        if self.idle < self.PROBE:
            return 0
        self.idle = 0
        return 1  # the probe
