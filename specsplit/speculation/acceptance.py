"""Acceptance rules. Plain torch, no grpc: the verifier's maths in one place."""

from __future__ import annotations

import torch

from specsplit.speculation.sampling import ACCEPT, SIBLING_ACCEPT, coupled_choice, sample, uniform
from specsplit.speculation.tokentree import children_of, follow


def greedy_accept(logits: torch.Tensor, draft: list[int], parents: list[int] | None = None,
                  chosen: list[int] | None = None) -> tuple[list[int], int]:
    """logits: [k+1, vocab] target logits of the call's rows (row 0: the last committed token,
    row i + 1: draft[i]); draft: k proposed tokens, a chain or a tree (see specsplit.speculation.tokentree.follow).

    Returns (accepted draft indices, next_token): the longest path of the draft that equals the
    target's own argmax choices, and the target's choice right after it — the recovered token at
    the first mismatch, or the bonus token when the path ends in a leaf. `chosen`: each row's argmax
    where the forward already took it.
    """
    choices = chosen if chosen is not None else argmax_rows(logits)
    return follow(lambda row, depth: choices[row], draft, parents)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first maximum, as torch's). A CPU float32 row goes through numpy,
    whose argmax is 6-8x faster than torch's over a vocabulary (4 vs 30-40 us a row here): a
    greedy round reads one to nine rows, a decoded token one."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def coupled_accept(probs, draft: list[int], seed: int, start: int,
                   parents: list[int] | None = None) -> tuple[list[int], int]:
    """Drafter-invariant verification: probs[row] is the target's warped distribution after that
    row's path, row 0 at absolute position `start`, a row at depth d at start + d. The target's
    token at each position is its Gumbel-max choice under the (seed, position) noise; drafts are
    accepted while they equal those choices. The text is a function of the seed and the target
    alone: the same as without speculation, whatever was drafted (a chain or a tree)."""
    return follow(lambda row, depth: coupled_choice(probs[row], seed, start + depth), draft, parents)


def rejection_accept(probs, draft: list[int], proposals: list[tuple[torch.Tensor, torch.Tensor]],
                     seed: int, start: int, parents: list[int] | None = None) -> tuple[list[int], int, str]:
    """Speculative sampling (Leviathan et al., Chen et al.), over a chain or a token tree
    (SpecInfer's multi-step speculative sampling): probs[row] is the target's distribution after
    the row's path (row 0 at absolute position `start`); draft[i] was drawn from proposals[i] =
    (ids, q), sparse, independently of its siblings given its path (a deterministic draft: a
    point mass). At each node the children are tried in order: child s is accepted with
    probability min(1, r(x_s) / q_s(x_s)) with r = p at first; a rejection sets
    r = norm(max(0, r - q_s)) before the next child. If every child is rejected the next token is
    drawn from r ("recovered"); at a leaf from p ("bonus"). Returns (accepted path, next token,
    kind). The output is distributed exactly as sampling from the target; a chain gives the
    classic rule (each child's uniform from the (seed, position) ACCEPT stream, the first sibling's
    too; later siblings' from their own streams)."""
    children = children_of(len(draft), parents)
    path: list[int] = []
    row = 0
    while True:
        position = start + len(path)
        kids = children.get(row, [])
        if not kids:
            return path, sample(probs[row], seed, position), "bonus"
        residual = probs[row]
        for j, child in enumerate(kids):
            ids, q = proposals[child]
            dense_q = torch.zeros_like(residual).index_put_((ids.to(residual.device),), q.to(residual.device).float())
            token = draft[child]
            r_tok, q_tok = float(residual[token]), float(dense_q[token])
            if q_tok <= 0:
                raise ValueError(f"draft token {token} at position {position} has probability 0 in its proposal")
            if uniform(seed, position, ACCEPT if j == 0 else SIBLING_ACCEPT + j) < min(1.0, r_tok / q_tok):
                path.append(child)
                row = child + 1
                break
            rest = (residual - dense_q).clamp_(min=0)
            total = float(rest.sum())
            # r <= q everywhere only when r == q up to rounding, where rejection has probability 0.
            residual = rest / total if total > 0 else residual
        else:
            return path, sample(residual, seed, position), "recovered"
