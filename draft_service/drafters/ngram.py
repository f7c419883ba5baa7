"""Prompt lookup: propose what followed the latest earlier occurrence of the current suffix."""

from __future__ import annotations

from draft_service.drafters.base import DrafterDescription, DraftSession


def lookup(tokens: list[int], gamma: int, min_n: int, max_n: int) -> list[int]:
    """Longest n-gram first (max_n down to min_n): find the most recent earlier occurrence of the
    last n tokens and return up to gamma tokens that followed it. [] when nothing matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Latest start first: recent context predicts the continuation best.
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = start + n
                return tokens[follow:follow + gamma]
    return []


class NgramDrafter:
    runs_model = False

    def __init__(self, name: str = "ngram", min_n: int = 1, max_n: int = 3):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.description = DrafterDescription(name=name, kind="ngram")
        self._min_n = min_n
        self._max_n = max_n

    def start(self, prompt: list[int]) -> DraftSession:
        return DraftSession(prompt)

    def propose(self, session: DraftSession, gamma: int) -> list[int]:
        return lookup(session.tokens, gamma, self._min_n, self._max_n)
