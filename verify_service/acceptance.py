"""Acceptance rules. Plain torch, no grpc: the verifier's maths in one place."""

from __future__ import annotations

import torch


def greedy_accept(logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
    """logits: [k+1, vocab] target logits at the k+1 positions after the committed prefix
    (row i predicts the token after draft[:i]); draft: k proposed tokens.

    Returns (num_accepted, next_token): the longest prefix of the draft that equals the target's
    own argmax choices, and the target's choice right after it — the recovered token at the first
    mismatch, or the bonus token when every draft token was accepted.
    """
    choices = logits.argmax(dim=-1).tolist()  # [k+1]
    accepted = 0
    while accepted < len(draft) and draft[accepted] == choices[accepted]:
        accepted += 1
    return accepted, choices[accepted]
