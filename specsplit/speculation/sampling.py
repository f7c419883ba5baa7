"""Sampling maths shared by the draft and verify services: the per-request warp (temperature,
top-k, top-p) and noise that both services derive from (seed, absolute position) alone, so
that a sampled token is reproducible and, in coupled mode, the same whoever drafted.

Noise comes from a CPU torch.Generator seeded with sha256(seed, position, stream): no state is
carried between calls or processes, retries and restarts reproduce the same draws, and each use
(Gumbel noise, acceptance uniform, residual sample) has its own stream."""

from __future__ import annotations

import hashlib

import torch

from specsplit.speculation.params import SamplingParams, TokenLogprob

GUMBEL, ACCEPT, RESAMPLE, DRAFT = 0, 1, 2, 3  # noise streams (DRAFT: the drafter's own samples)
# Token trees under rejection sampling: the j-th sibling's acceptance uniform (j >= 1) and the
# drafter's j-th extra sample at a position come from streams SIBLING_ACCEPT + j, SIBLING_DRAFT + j.
SIBLING_ACCEPT, SIBLING_DRAFT = 16, 48


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [n, V] from logits [n, V]: temperature, then top-k, then top-p (the smallest
    set of most likely tokens whose mass reaches top_p). Greedy (temperature 0) is one-hot."""
    logits = logits.float()
    if params.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    x = logits / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1:
        x = x.masked_fill(~_nucleus(x.softmax(-1), params.top_p), float("-inf"))
    return x.softmax(-1)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask of the smallest set of most likely tokens whose mass reaches top_p, per row. Sorting a
    whole vocabulary costs ~4 ms a row on CPU, so only the top k are sorted, k growing until they
    hold top_p of the mass (every token past them is dropped anyway)."""
    vocab = probs.shape[-1]
    k = min(vocab, 256)
    while True:
        top = probs.topk(k, dim=-1)  # sorted, most likely first
        if k == vocab or bool((top.values.sum(-1) >= top_p).all()):
            break
        k = min(vocab, k * 8)
    before = top.values.cumsum(-1) - top.values  # mass of the more likely tokens
    keep = before < top_p  # the first token is always kept
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, top.indices, keep)


def generator(seed: int, position: int, stream: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{position}:{stream}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def uniform(seed: int, position: int, stream: int) -> float:
    return float(torch.rand(1, generator=generator(seed, position, stream)))


def gumbel(seed: int, position: int, vocab: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [vocab] for one position (CPU, float32)."""
    u = torch.rand(vocab, generator=generator(seed, position, GUMBEL)).clamp_(1e-10, 1 - 1e-7)
    return -torch.log(-torch.log(u))


def coupled_choice(probs: torch.Tensor, seed: int, position: int) -> int:
    """Gumbel-max: argmax(log p + g) is an exact sample from p, and a function of (seed, position,
    p) alone, so every party that knows p makes the same choice."""
    noise = gumbel(seed, position, probs.shape[-1]).to(probs.device)
    return int((probs.log() + noise).argmax())


def sample(probs: torch.Tensor, seed: int, position: int, stream: int = RESAMPLE) -> int:
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator(seed, position, stream)))


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Row i's log-softmax (float32, before temperature, top-k or top-p) at tokens[i], and its `top`
    most likely tokens, most likely first."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    chosen = lp[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long)].tolist()
    if not top:
        return [(t, c, [], []) for t, c in zip(tokens, chosen)]
    values, ids = lp.topk(top, dim=-1)
    return list(zip(tokens, chosen, ids.tolist(), values.tolist()))
