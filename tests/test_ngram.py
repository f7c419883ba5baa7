from draft_service.drafters.base import DraftSession
from draft_service.drafters.ngram import NgramDrafter, lookup
from specsplit.speculation.drafting import Proposal
from specsplit.speculation.store import OutputStore


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


def test_packed_search_equals_a_plain_scan_including_misaligned_byte_matches():
    import random

    def scan(tokens, gamma, min_n, max_n):
        length = len(tokens)
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            for start in range(length - n - 1, -1, -1):
                if tokens[start:start + n] == tokens[length - n:]:
                    return tokens[start + n:start + n + gamma]
        return []

    rng = random.Random(0)
    # Ids whose uint32 bytes overlap when shifted (0, 1, 256, 65536...) provoke unaligned hits.
    alphabet = [0, 1, 2, 256, 257, 65536, 65537, 16777216]
    for _ in range(2000):
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(1, 30))]
        assert lookup(tokens, 3, 1, 3)[0] == scan(tokens, 3, 1, 3), tokens


def test_store_drafts_from_earlier_outputs_but_not_across_them():
    store = OutputStore(max_tokens=100)
    drafter = NgramDrafter(store=store)
    first = drafter.start([50, 51])
    first.sync(2, [10, 11, 12, 13])
    drafter.end(first)  # remembers the output [10, 11, 12, 13], not the prompt
    assert len(store) == 4
    second = drafter.start([60, 61, 10, 11])  # a new request whose tail repeats that output
    assert drafter.propose(second, 8) == Proposal([12, 13], "ngram")  # stops at the end of the stored output
    assert drafter.propose(drafter.start([50, 51]), 4) == Proposal([], "")  # prompts are not stored


def test_store_needs_two_matching_tokens_and_prefers_the_longer_match():
    store = OutputStore(max_tokens=100)
    store.add([1, 2, 3, 7, 8, 9])
    drafter = NgramDrafter(store=store)
    assert drafter.match([5, 3], 2) == ([], 0)  # one matching token in the store is a guess
    assert drafter.match([3, 7], 2) == ([8, 9], 2)
    assert drafter.match([9, 2, 3, 5, 1, 2, 3], 2) == ([7, 8], 3)  # the store's 3-gram beats the session's 2-gram


def test_store_evicts_oldest_outputs_beyond_its_bound():
    store = OutputStore(max_tokens=10)
    store.add([1, 2, 3, 4, 5, 6])
    store.add([7, 8, 9, 10, 11, 12])
    assert len(store) == 6
    assert store.lookup([1, 2], 2, 2, 3) == ([], 0)
    assert store.lookup([8, 9], 2, 2, 3) == ([10, 11], 2)
    store.add(list(range(100, 130)))  # longer than the bound: only its tail is kept
    assert len(store) == 10 and store.lookup([120, 121], 1, 2, 2) == ([122], 2)
