"""Acceptance rules. Plain torch, no grpc: the verifier's maths in one place."""

from __future__ import annotations

import torch

from specsplit.sampling import ACCEPT, coupled_choice, sample, uniform


def greedy_accept(logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
    """logits: [k+1, vocab] target logits at the k+1 positions after the committed prefix
    (row i predicts the token after draft[:i]); draft: k proposed tokens.

    Returns (num_accepted, next_token): the longest prefix of the draft that equals the target's
    own argmax choices, and the target's choice right after it — the recovered token at the first
    mismatch, or the bonus token when every draft token was accepted.
    """
    return _match(logits.argmax(dim=-1).tolist(), draft)


def _match(choices: list[int], draft: list[int]) -> tuple[int, int]:
    """The target's own choices at the k+1 positions -> (drafts accepted, the choice after them)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == choices[accepted]:
        accepted += 1
    return accepted, choices[accepted]


def coupled_accept(probs: torch.Tensor, draft: list[int], seed: int, start: int) -> tuple[int, int]:
    """Drafter-invariant verification: probs [k+1, V] are the target's warped distributions at
    absolute positions start..start+k. The target's token at each position is its Gumbel-max
    choice under the (seed, position) noise; drafts are accepted while they equal those choices.
    The text is a function of the seed and the target alone: the same as without speculation."""
    return _match([coupled_choice(probs[i], seed, start + i) for i in range(len(draft) + 1)], draft)


def rejection_accept(probs: torch.Tensor, draft: list[int], proposals: list[tuple[torch.Tensor, torch.Tensor]],
                     seed: int, start: int) -> tuple[int, int, str]:
    """Speculative sampling (Leviathan et al., Chen et al.): probs [k+1, V] target distributions;
    draft[i] was sampled from proposals[i] = (ids, q): the drafter's (possibly truncated and
    renormalised) distribution, sparse. Accept draft[i] with probability min(1, p/q); at the first
    rejection sample from norm(max(0, p - q)); after k acceptances sample a bonus token from
    probs[k]. Returns (num_accepted, next_token, "recovered" | "bonus"). The output is
    distributed exactly as sampling from the target."""
    for i, token in enumerate(draft):
        ids, q = proposals[i]
        dense_q = torch.zeros_like(probs[i]).index_put_((ids.to(probs.device),), q.to(probs.device).float())
        p_tok, q_tok = float(probs[i, token]), float(dense_q[token])
        if q_tok <= 0:
            raise ValueError(f"draft token {token} at position {start + i} has probability 0 in its proposal")
        if uniform(seed, start + i, ACCEPT) < min(1.0, p_tok / q_tok):
            continue
        residual = (probs[i] - dense_q).clamp_(min=0)
        total = float(residual.sum())
        # p <= q everywhere only when p == q up to rounding, where rejection has probability 0.
        return i, sample(residual / total if total > 0 else probs[i], seed, start + i), "recovered"
    k = len(draft)
    return k, sample(probs[k], seed, start + k), "bonus"
