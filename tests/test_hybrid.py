"""The hybrid's order: a long n-gram match, then the head, then a short match."""

from draft_service.drafters.base import DrafterDescription, DraftSession, Proposal
from draft_service.drafters.hybrid import HybridDrafter
from draft_service.drafters.ngram import NgramDrafter


class Head:
    """A self-drafter stand-in that proposes a fixed answer (empty: unsure)."""

    description = DrafterDescription(name="self", kind="self", needs_features=True)
    memory_bytes = 0

    def __init__(self, answer):
        self.answer = answer

    def start(self, prompt):
        return DraftSession(prompt)

    def propose(self, session, gamma):
        return Proposal(self.answer[:gamma], "self" if self.answer else "")


def test_long_match_beats_the_head():
    hybrid = HybridDrafter(NgramDrafter(), Head([42]), min_match=2)
    session = hybrid.start([5, 6, 7, 8, 5, 6])
    assert hybrid.propose(session, 2) == Proposal([7, 8], "ngram")


def test_head_beats_a_short_match_and_the_short_match_fills_in_when_it_is_unsure():
    session_tokens = [5, 6, 7, 9, 7]  # only a 1-token match: (7) -> 9
    def propose(head: list[int], tokens: list[int]) -> Proposal:
        return HybridDrafter(NgramDrafter(), Head(head), 2).propose(DraftSession(tokens), 3)

    assert propose([42, 43], session_tokens) == Proposal([42, 43], "self")
    assert propose([], session_tokens) == Proposal([9, 7], "ngram")
    assert propose([], [1, 2, 3]) == Proposal([], "")
