import torch

from specsplit.speculation.acceptance import argmax_rows, greedy_accept


def logits_with_argmax(choices: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)  # [k+1, vocab]
    for row, token in enumerate(choices):
        logits[row, token] = 5.0
    return logits


def test_all_accepted_gives_bonus():
    assert greedy_accept(logits_with_argmax([3, 4, 5, 6]), [3, 4, 5]) == ([0, 1, 2], 6)


def test_early_mismatch_recovers_target_token():
    # The target wanted 7 where the draft said 4: accept one, recover 7, ignore the rest.
    assert greedy_accept(logits_with_argmax([3, 7, 5, 6]), [3, 4, 5]) == ([0], 7)


def test_first_token_rejected():
    assert greedy_accept(logits_with_argmax([9, 4, 5]), [3, 4]) == ([], 9)


def test_no_draft_is_plain_decoding():
    assert greedy_accept(logits_with_argmax([2]), []) == ([], 2)


def test_later_match_after_mismatch_is_not_accepted():
    assert greedy_accept(logits_with_argmax([1, 2, 3]), [0, 2]) == ([], 1)


def test_tree_follows_the_branch_the_target_chose():
    # Rows: 0 the last committed token; drafts 0:[7] and 1:[3] both children of it, 2:[4] after 3,
    # 3:[8] after 7. The target picks 3 after the root, 4 after 3, 6 after 4.
    draft, parents = [7, 3, 4, 8], [-1, -1, 1, 0]
    by_row = [3, 9, 4, 6, 1]  # the argmax after each row's path
    assert greedy_accept(logits_with_argmax(by_row), draft, parents) == ([1, 2], 6)


def test_tree_with_no_matching_child_recovers_at_the_root():
    assert greedy_accept(logits_with_argmax([5, 1, 1]), [7, 3], [-1, -1]) == ([], 5)


def test_tree_stops_where_the_chosen_token_has_no_child():
    # The target agrees with 3 but then wants 2, and 3's only child is 4.
    assert greedy_accept(logits_with_argmax([3, 0, 2, 0]), [7, 3, 4], [-1, -1, 1]) == ([1], 2)


def test_argmax_rows_takes_the_first_maximum_as_torch_does_in_every_dtype():
    torch.manual_seed(0)
    logits = torch.randn(6, 4099)
    logits[1, 17] = logits[1, 900] = logits[1, 4000] = 50.0  # a tie: the first one wins
    logits[2, :] = 0.0  # all equal: index 0
    logits[3, 5] = float("inf")
    for x in (logits, logits.bfloat16(), logits.half(), logits[1:4]):
        assert argmax_rows(x) == x.argmax(-1).tolist()
    assert argmax_rows(logits)[1:4] == [17, 0, 5]
