"""Prompt lookup: propose what followed the latest earlier occurrence of the current suffix."""

from __future__ import annotations

from array import array

from draft_service.drafters.base import DrafterDescription, DraftSession

_WIDTH = 4  # bytes per token id in the search buffer


def lookup(tokens: list[int], gamma: int, min_n: int, max_n: int) -> list[int]:
    """Longest n-gram first (max_n down to min_n): find the most recent earlier occurrence of the
    last n tokens and return up to gamma tokens that followed it. [] when nothing matches.

    The search is bytes.rfind over the ids packed as uint32 (C speed: ~0.05 ms at 8k tokens where
    a Python scan took 3 ms); a hit that is not token-aligned is skipped."""
    length = len(tokens)
    data = array("I", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = data[(length - n) * _WIDTH:]
        end = (length - 1) * _WIDTH  # an earlier occurrence ends before the last token
        while (hit := data.rfind(suffix, 0, end)) >= 0:
            if hit % _WIDTH == 0:  # latest aligned occurrence: recent context predicts best
                follow = hit // _WIDTH + n
                return tokens[follow:follow + gamma]
            end = hit + len(suffix) - 1
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
