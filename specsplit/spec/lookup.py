"""Prompt lookup's index: where each bigram of a growing token sequence (prompt, then committed
output) last stood, so that "did the last two tokens occur before, and what followed them there" is
one dictionary read. The gateway's gate asks the first (a copy in sight); the verifier's decode-ahead
asks the second (its own draft)."""

from __future__ import annotations


class BigramIndex:
    """Indexes a sequence that only grows (committed tokens never roll back); pass the same list each
    time, and each call indexes what was appended since the last."""

    def __init__(self):
        self._at: dict[tuple[int, int], int] = {}  # bigram -> where its second token last stood
        self._upto = 0  # tokens[:_upto] are indexed, but for the bigram ending at _upto - 1

    def follows(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the last two of `tokens`;
        none where they did not occur before (or k < 1)."""
        end = len(tokens) - 1
        for i in range(max(1, self._upto), end):  # every bigram but the last one
            self._at[tokens[i - 1], tokens[i]] = i
        self._upto = max(self._upto, end)
        at = self._at.get((tokens[-2], tokens[-1])) if k > 0 and end >= 1 else None
        return [] if at is None else tokens[at + 1:at + 1 + k]
