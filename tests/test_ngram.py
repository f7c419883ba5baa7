from draft_service.drafters.base import DraftSession
from draft_service.drafters.ngram import NgramDrafter, lookup


def test_longest_suffix_wins():
    # suffix (5, 6) occurred before followed by 7, 8; suffix (6,) alone also matched after 9.
    tokens = [5, 6, 7, 8, 6, 9, 1, 5, 6]
    assert lookup(tokens, 2, 1, 3) == [7, 8]


def test_latest_occurrence_is_used():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2]
    assert lookup(tokens, 1, 2, 2) == [4]


def test_no_match_proposes_nothing():
    assert lookup([1, 2, 3, 4], 3, 1, 3) == []


def test_proposal_is_capped_by_gamma_and_available_tokens():
    tokens = [7, 1, 2, 3, 7]
    assert lookup(tokens, 2, 1, 1) == [1, 2]
    assert lookup([7, 1, 7], 5, 1, 1) == [1, 7]


def test_session_sync_rolls_back_rejected_guesses():
    drafter = NgramDrafter()
    session = drafter.start([1, 2, 3, 1, 2])
    assert drafter.propose(session, 2) == [3, 1]
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
        assert lookup(tokens, 3, 1, 3) == scan(tokens, 3, 1, 3), tokens
