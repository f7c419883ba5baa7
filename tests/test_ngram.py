from draft_service.drafters.base import DraftSession
from draft_service.drafters.ngram import NgramDrafter
from specsplit.speculation.drafting import Proposal
from specsplit.speculation.lookup import CANDIDATES, OutputIndex


def lookup(tokens: list[int], gamma: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """The n-gram drafter's own-token lookup on a fresh session of `tokens`."""
    return NgramDrafter(min_n=min_n, max_n=max_n).match(DraftSession(tokens), gamma)


def test_longest_suffix_wins():
    # suffix (5, 6) occurred before followed by 7, 8; suffix (6,) alone also matched after 9.
    tokens = [5, 6, 7, 8, 6, 9, 1, 5, 6]
    assert lookup(tokens, 2, 1, 3) == ([7, 8], 2)


def test_latest_occurrence_is_used():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    assert lookup(tokens, 1, 2, 2) == ([4], 2)


def test_no_match_proposes_nothing():
    assert lookup([1, 2, 3, 4], 3, 1, 3) == ([], 0)


def test_proposal_is_capped_by_gamma_and_available_tokens():
    tokens = [7, 1, 2, 3, 7]
    assert lookup(tokens, 2, 1, 1) == ([1, 2], 1)
    assert lookup([7, 1, 7], 5, 1, 1) == ([1, 7], 1)


def test_session_sync_rolls_back_rejected_guesses():
    drafter = NgramDrafter()
    session = drafter.start([1, 2, 3, 1, 2])
    assert drafter.propose(session, 2) == Proposal([3, 1], "ngram")
    session.sync(5, [3, 9])  # target accepted 3, then chose 9
    assert session.tokens == [1, 2, 3, 1, 2, 3, 9]
    session.sync(6, [4])  # a later round rewrites from position 6
    assert session.tokens == [1, 2, 3, 1, 2, 3, 4]


def test_sync_refuses_a_gap():
    import pytest

    session = DraftSession([1, 2])
    with pytest.raises(ValueError, match="past the 2 tokens"):
        session.sync(3, [5])


def test_the_index_finds_what_a_plain_scan_finds_as_the_sequence_grows_and_rolls_back():
    """The rule, by brute force: the longest agreeing suffix (max_n down to min_n tokens) among the
    latest CANDIDATES occurrences of the last two tokens (of the last one where the pair never
    occurred), latest first; on one session that grows and is rolled back, as the drafter's is."""
    import random

    def scan(tokens, gamma, min_n, max_n):
        end = len(tokens) - 1

        def agree(p):  # the longest n <= max_n whose n tokens ending at p are the context's last n
            return max(n for n in range(1, max_n + 1) if n == 1 or (p - n + 1 >= 0 and
                                                                    tokens[p - n + 1:p + 1] == tokens[end - n + 1:]))

        earlier = [p for p in range(end) if tokens[p] == tokens[end]]
        pairs = [p for p in earlier if max_n >= 2 and agree(p) >= 2][-CANDIDATES:]
        candidates = pairs or (earlier[-CANDIDATES:] if min_n <= 1 else [])
        if not candidates:
            return []
        best = max(agree(p) for p in candidates)
        return tokens[max(p for p in candidates if agree(p) == best) + 1:][:gamma] if best >= min_n else []

    rng = random.Random(0)
    drafter = NgramDrafter(min_n=1, max_n=3)
    for _ in range(100):
        session = drafter.start([rng.randrange(4) for _ in range(rng.randrange(1, 6))])
        for _ in range(40):
            if rng.random() < 0.3 and len(session.tokens) > session.prompt_len:  # a rollback
                base = rng.randrange(session.prompt_len, len(session.tokens) + 1)
            else:
                base = len(session.tokens)
            session.sync(base, [rng.randrange(4) for _ in range(rng.randrange(1, 4))])
            tokens = session.tokens
            assert drafter.match(session, 3)[0] == scan(tokens, 3, 1, 3), tokens


def test_store_drafts_from_earlier_outputs_but_not_across_them():
    store = OutputIndex(max_tokens=100)
    drafter = NgramDrafter(store=store)
    first = drafter.start([50, 51])
    first.sync(2, [10, 11, 12, 13])
    drafter.end(first)  # remembers the output [10, 11, 12, 13], not the prompt
    assert len(store) == 4
    second = drafter.start([60, 61, 10, 11])  # a new request whose tail repeats that output
    assert drafter.propose(second, 8) == Proposal([12, 13], "ngram")  # stops at the end of the stored output
    assert drafter.propose(drafter.start([50, 51]), 4) == Proposal([], "")  # prompts are not stored


def test_store_needs_two_matching_tokens_and_prefers_the_longer_match():
    store = OutputIndex(max_tokens=100)
    store.add([1, 2, 3, 7, 8, 9])
    drafter = NgramDrafter(store=store)
    assert drafter.match(DraftSession([5, 3]), 2) == ([], 0)  # one matching token in the store is a guess
    assert drafter.match(DraftSession([3, 7]), 2) == ([8, 9], 2)
    # the store's 3-gram beats the session's 2-gram
    assert drafter.match(DraftSession([9, 2, 3, 5, 1, 2, 3]), 2) == ([7, 8], 3)
