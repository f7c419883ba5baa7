import torch

from verify_service.acceptance import greedy_accept


def logits_with_argmax(choices: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(choices), vocab)  # [k+1, vocab]
    for row, token in enumerate(choices):
        logits[row, token] = 5.0
    return logits


def test_all_accepted_gives_bonus():
    assert greedy_accept(logits_with_argmax([3, 4, 5, 6]), [3, 4, 5]) == (3, 6)


def test_early_mismatch_recovers_target_token():
    # The target wanted 7 where the draft said 4: accept one, recover 7, ignore the rest.
    assert greedy_accept(logits_with_argmax([3, 7, 5, 6]), [3, 4, 5]) == (1, 7)


def test_first_token_rejected():
    assert greedy_accept(logits_with_argmax([9, 4, 5]), [3, 4]) == (0, 9)


def test_no_draft_is_plain_decoding():
    assert greedy_accept(logits_with_argmax([2]), []) == (0, 2)


def test_later_match_after_mismatch_is_not_accepted():
    assert greedy_accept(logits_with_argmax([1, 2, 3]), [0, 2]) == (0, 1)
