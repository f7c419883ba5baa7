"""Prompt lookup's bigram index (specsplit/speculation/lookup.py): the verifier copies what followed the
occurrence of the last two tokens that agrees longest with the context, and indexes a growing list."""

from specsplit.speculation.lookup import OutputIndex, SequenceIndex


def test_no_copy_where_the_last_two_tokens_are_new():
    index = SequenceIndex()
    assert index.follows([1, 2, 3, 4], 4) == []
    assert index.follows([1, 2, 3, 1, 2], 0) == []  # k < 1
    assert index.follows([7], 3) == []


def test_copies_the_occurrence_that_agrees_longest_not_merely_the_latest():
    # "9 5 1 2" -> 30 early; "8 1 2" -> 40 later; the context ends "9 5 1 2": the early one agrees over 4 tokens
    tokens = [9, 5, 1, 2, 30, 31, 0, 8, 1, 2, 40, 41, 0, 9, 5, 1, 2]
    assert SequenceIndex().follows(tokens, 2) == [30, 31]
    # ends "8 1 2": the later one agrees longer
    assert SequenceIndex().follows([*tokens[:-4], 8, 1, 2], 2) == [40, 41]
    # agreeing equally (only the bigram): the latest
    assert SequenceIndex().follows([*tokens[:-4], 6, 1, 2], 3) == [40, 41, 0]


def test_indexes_a_growing_sequence_as_it_grows():
    index, tokens = SequenceIndex(), [1, 2, 3]
    assert index.follows(tokens, 2) == []
    tokens += [4, 1, 2]
    assert index.follows(tokens, 2) == [3, 4]
    tokens += [3, 4, 5, 6, 3, 4]  # "3 4" was followed by 1, then by 5; neither agrees past "6": the latest
    assert index.follows(tokens, 1) == [5]


def test_lookups_draft_what_pays_at_their_rate_and_the_forwards_cost_by_width():
    from specsplit.speculation.lookup import Agreement

    flat_then_dear = [3.0, 3.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # up to 3 rows cost one; then 1 ms a row
    odds = Agreement()
    assert odds.rate == 0.5
    # rows that cost nothing go in whatever the rate; a 4th row (+1 ms) needs its token's chance * 3 ms >= 1
    assert odds.depth(8, flat_then_dear) == 2  # 0.5 ** 3 * 3 = 0.375 < 1
    for _ in range(20):
        odds.add(6, 6)  # a span being copied: every lookup accepted whole
    assert odds.rate > 0.9 and odds.depth(8, flat_then_dear) == 8
    assert odds.depth(3, flat_then_dear) == 3  # never past the room it is given
    # A drafter whose tokens cost time (a head: its price a round and a token, measured) drafts as
    # deep as pays in all: at an even rate the tokens earn 1.5, 0.75, 0.375 ... ms
    even = Agreement()
    assert even.depth(8, flat_then_dear, token_ms=0.5) == 2  # 1.0 + 0.25; a third: -0.125
    assert even.depth(8, flat_then_dear, token_ms=1.0) == 1
    assert even.depth(8, flat_then_dear, round_ms=1.6) == 2  # one token does not pay for the round, two do
    assert even.depth(8, flat_then_dear, round_ms=2.3) == 0  # more than any depth earns (2.25 at two)
    for _ in range(40):  # (120 tokens accepted fade at 0.9 a lookup)
        odds.add(2, 0)  # the copy ended: rejected at once
    assert odds.rate < 0.1 and odds.depth(8, flat_then_dear) == 2
    # Where every row costs, a poor rate drafts nothing, but one token every PROBE steps (the rate
    # is only learnt from drafts); a probe accepted raises it.
    assert [odds.depth(8, [3.0, 4.0, 5.0]) for _ in range(2 * Agreement.PROBE)] == \
        ([0] * (Agreement.PROBE - 1) + [1]) * 2
    assert odds.depth(0, flat_then_dear) == 0
    before = odds.rate
    odds.add(1, 1)
    assert odds.rate > before


def test_stored_outputs_are_found_by_their_last_two_tokens_with_how_far_they_agree_and_never_across_outputs():
    store = OutputIndex(max_tokens=100)
    store.add([1, 2, 3, 7, 8, 9])
    store.add([5, 1, 2, 3, 4, 6])
    assert len(store) == 12
    assert store.match([3, 7], 2) == ([8, 9], 2)
    assert store.match([9, 1, 2, 3], 3) == ([4, 6], 3)  # the latest occurrence; agrees on 3 tokens (9 != 5)
    assert store.match([5, 1, 2, 3], 1) == ([4], 4)
    assert store.match([8, 9], 4) == ([], 0)  # the end of its output: nothing follows
    assert store.match([9, 5], 2) == ([], 0)  # the two outputs' seam is no bigram
    assert store.match([2, 3], 0) == ([], 0)


def test_the_store_keeps_the_latest_outputs_within_its_bound():
    store = OutputIndex(max_tokens=10)
    store.add(list(range(6)))
    store.add(list(range(10, 16)))
    assert len(store) == 6  # the first went over the bound
    store.add(list(range(20, 40)))  # longer than the bound: only its tail, and the index is rebuilt
    assert len(store) == 10
    assert store.match([10, 11], 2) == ([], 0) and store.match([0, 1], 2) == ([], 0)
    assert store.match([30, 31], 2) == ([32, 33], 2)
    assert OutputIndex(0).match([1, 2], 2) == ([], 0)
