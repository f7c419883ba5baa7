"""How the verifier chooses its tokens: from a call's logits, the accepted path and the token after
it, greedy, coupled or by rejection sampling (specsplit.speculation.acceptance); under a constraint each
row read keeps only the tokens its language allows (specsplit.serving.grammar.Walk, row by row:
greedy checks the row's own argmax and computes the whole mask only where it is not allowed)."""

from __future__ import annotations

import torch

from specsplit.speculation.acceptance import argmax_rows, coupled_accept, greedy_accept, rejection_accept
from specsplit.speculation.params import Method, SamplingParams
from specsplit.speculation.sampling import warp
from specsplit.speculation.tokentree import follow


class Warped:
    """The warped distribution of a row of logits, computed when a verification reads it (a
    tree's walk reads only the rows on its path); with `mask(row)`, of the allowed tokens only."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams, mask=None):
        self._logits, self._params, self._rows, self._mask = logits, params, {}, mask

    def __getitem__(self, row: int) -> torch.Tensor:
        if row not in self._rows:
            logits = self._logits[row:row + 1]
            if self._mask is not None:
                logits = logits.masked_fill(~self._mask(row), float("-inf"))
            self._rows[row] = warp(logits, self._params)[0]
        return self._rows[row]


def decide(params: SamplingParams, logits: torch.Tensor, draft: list[int], proposals: list, start: int,
           parents: list[int] | None, walk=None, chosen: list[int] | None = None) -> tuple[list[int], int]:
    """logits [k+1, vocab], row 0 at absolute position `start` -> (accepted path, next token).
    `chosen`: each row's argmax, where the forward took it (greedy then reads no row itself)."""
    how = params.verification
    if how is Method.GREEDY:
        if walk is None:
            return greedy_accept(logits, draft, parents, chosen)
        choices = chosen if chosen is not None else argmax_rows(logits)

        def choose(row: int, depth: int) -> int:
            token = choices[row]
            if walk.allows(row, token):
                return token
            return int(logits[row].masked_fill(~walk.mask(row), float("-inf")).argmax())
        return follow(choose, draft, parents)
    rows = Warped(logits, params, walk.mask if walk is not None else None)
    if how is Method.COUPLED:
        return coupled_accept(rows, draft, params.seed, start, parents)
    path, token, _ = rejection_accept(rows, draft, proposals, params.seed, start, parents)
    return path, token
