"""Prompt lookup's bigram index (specsplit/spec/lookup.py): the verifier copies what followed the
occurrence of the last two tokens that agrees longest with the context, and indexes a growing list."""

from specsplit.spec.lookup import BigramIndex


def test_no_copy_where_the_last_two_tokens_are_new():
    index = BigramIndex()
    assert index.follows([1, 2, 3, 4], 4) == []
    assert index.follows([1, 2, 3, 1, 2], 0) == []  # k < 1
    assert index.follows([7], 3) == []


def test_copies_the_occurrence_that_agrees_longest_not_merely_the_latest():
    # "9 5 1 2" -> 30 early; "8 1 2" -> 40 later; the context ends "9 5 1 2": the early one agrees over 4 tokens
    tokens = [9, 5, 1, 2, 30, 31, 0, 8, 1, 2, 40, 41, 0, 9, 5, 1, 2]
    assert BigramIndex().follows(tokens, 2) == [30, 31]
    # ends "8 1 2": the later one agrees longer
    assert BigramIndex().follows([*tokens[:-4], 8, 1, 2], 2) == [40, 41]
    # agreeing equally (only the bigram): the latest
    assert BigramIndex().follows([*tokens[:-4], 6, 1, 2], 3) == [40, 41, 0]


def test_indexes_a_growing_sequence_as_it_grows():
    index, tokens = BigramIndex(), [1, 2, 3]
    assert index.follows(tokens, 2) == []
    tokens += [4, 1, 2]
    assert index.follows(tokens, 2) == [3, 4]
    tokens += [3, 4, 5, 6, 3, 4]  # "3 4" was followed by 1, then by 5; neither agrees past "6": the latest
    assert index.follows(tokens, 1) == [5]
