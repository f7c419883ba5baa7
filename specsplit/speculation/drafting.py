"""The draft side of a round: what a drafter proposes (a chain or a token tree, with the
distributions its tokens were drawn from) and how a model drafter draws its tokens so that the
verifier's acceptance (specsplit.speculation.acceptance) stays lossless:

- greedy: argmax of the drafter's distribution q;
- coupled: argmax(log q + g) with the verifier's own Gumbel noise g for the absolute position, so
  the draft equals the target's sampled token as often as q resembles p;
- rejection: a sample from q cut to its top k and renormalised, sent with the draft; a token tree
  under rejection sampling has a layout fixed before the draws (`sampled_tree`).

The draws read a session through `Drafting` (its sampling, and where in the sequence it drafts)."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from specsplit.speculation.params import Method, SamplingParams
from specsplit.speculation.sampling import DRAFT, SIBLING_DRAFT, gumbel, sample, warp
from specsplit.speculation.tokentree import Tree


class Drafting(Protocol):
    """What the draws read of a drafter's session."""

    sampling: SamplingParams  # the session's sampling, as the verifier applies it
    proposal_top_k: int  # rejection: sample from (and send) the drafter's top-k, renormalised
    tokens: list[int]  # the committed sequence as the drafter knows it
    drafting: int  # index of the draft token being chosen (its position: len(tokens) + drafting)


class Proposal(NamedTuple):
    tokens: list[int]
    source: str  # which method drafted ("" when nothing was)
    # Rejection sampling: the sparse distribution (ids, probs) each token was sampled from.
    # None: the tokens are a deterministic function of the context (a point mass each).
    probs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # A token tree (specsplit.speculation.tokentree): each token's parent index (-1: the committed tokens) and
    # the drafter's estimate that the target follows the path to it, best first. None: a chain.
    parents: list[int] | None = None
    scores: list[float] | None = None


def tree_proposal(tree: Tree, budget: int, depth: int, source: str) -> Proposal:
    """The best `budget` nodes of `tree`, at most `depth` deep."""
    tokens, parents, scores, _ = tree.select(budget, depth)
    return Proposal(tokens, source if tokens else "", None, parents, scores)


class Choice(NamedTuple):
    token: int
    top_prob: float  # the drafter's highest probability at this step, known before choosing
    q: tuple[torch.Tensor, torch.Tensor] | None  # rejection sampling: (ids, probs) the token was drawn from
    prob: float = 1.0  # the drafter's probability of `token`
    # The drafter's next-best token and its probability (greedy: second-largest q; coupled: the
    # second-largest log q + noise): a token tree's sibling of `token`.
    runner_up: tuple[int, float] | None = None


def chain_tree(choices: list[Choice], budget: int, source: str) -> Proposal:
    """A drafted chain with each step's runner-up as a sibling leaf, scored by the drafter's own
    probabilities along the path; the best `budget` nodes. Under rejection sampling the runner-up is
    an independent second draw and the layout is fixed before any draw (`sampled_tree`)."""
    if choices and choices[0].q is not None:
        return sampled_tree(choices, budget, source)
    tree, parent, score = Tree(), -1, 1.0
    for choice in choices:
        if choice.runner_up is not None:
            tree.add(parent, choice.runner_up[0], score * choice.runner_up[1])
        score *= choice.prob
        parent = tree.add(parent, choice.token, score)
    return tree_proposal(tree, budget, len(choices), source)


def choose(session: Drafting, logits: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> Choice:
    """A model drafter's next token. logits [n] cover target ids `ids` (a draft vocabulary) or
    the whole vocabulary (ids None); q is their distribution warped as the verifier warps p.
    - greedy: argmax q;
    - coupled: argmax(log q + g) with the verifier's Gumbel noise g for this absolute position, so
      the draft equals the target's own sampled token as often as q resembles p;
    - rejection: a sample from q cut to its top `proposal_top_k` and renormalised, returned with
      the draft so that the verifier tests against exactly the distribution that was sampled.
    top_prob is max q, fixed before the token is drawn: a drafter that stops on it keeps every
    drafted token distributed as its q (stopping on the drawn token's own probability would not)."""
    params = session.sampling
    probs, ranked = _ranking(session, logits, ids, vocab)
    top_prob = probs.max(-1).values
    position = len(session.tokens) + session.drafting
    q = None
    two = ranked.topk(min(2, ranked.shape[-1]))
    k = two.indices[0]
    runner_up = None
    if len(two.indices) > 1 and float(probs[two.indices[1]]) > 0:
        second = int(two.indices[1])
        runner_up = (second if ids is None else int(ids[second]), float(probs[second]))
    if params.verification is Method.REJECTION:
        cut = probs.topk(min(session.proposal_top_k, probs.shape[-1]))
        keep = cut.values > 0
        local, values = cut.indices[keep], cut.values[keep]
        values = (values / values.sum()).cpu()
        j = sample(values, params.seed, position, DRAFT)
        k = local[j]
        q = ((local if ids is None else ids[local]).cpu(), values)
        # A second, independent draw from the same q (a token tree's sibling under rejection
        # sampling); the same token again is dropped, as the verifier would surely reject it.
        second = sample(values, params.seed, position, SIBLING_DRAFT + 1)
        runner_up = None if second == j else (int(local[second] if ids is None else ids[local[second]]),
                                              float(values[second]))
    k = int(k)
    return Choice(k if ids is None else int(ids[k]), float(top_prob), q, float(probs[k]), runner_up)


def sampled_tree(choices: list[Choice], budget: int, source: str) -> Proposal:
    """Rejection sampling's token tree: the sampled chain, and at its first `budget - len(chain)`
    depths a sibling drawn independently from the same q, depth by depth (chain token first). The
    verifier tries siblings in order (SpecInfer's multi-step speculative sampling), which is
    lossless only if which drafts are sent, and in which order, does not depend on the values
    drawn: so no scores (the gateway cuts such a tree by depth only) and no reordering."""
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[tuple[torch.Tensor, torch.Tensor]] = []
    siblings, parent = max(0, budget - len(choices)), -1
    for depth, choice in enumerate(choices):
        node = len(tokens)
        tokens.append(choice.token)
        parents.append(parent)
        probs.append(choice.q)
        if depth < siblings and choice.runner_up is not None:
            tokens.append(choice.runner_up[0])
            parents.append(parent)
            probs.append(choice.q)
        parent = node
    return Proposal(tokens, source if tokens else "", probs, parents, None)


def candidates(session: Drafting, logits: torch.Tensor, ids: torch.Tensor | None, vocab: int,
               k: int) -> list[tuple[int, float]]:
    """A model drafter's `k` best next tokens with their probabilities q, best first, ranked as
    `choose` ranks them (greedy: by q; coupled: by log q plus the verifier's noise for this
    position): the children of a node in a token tree."""
    probs, ranked = _ranking(session, logits, ids, vocab)
    top = ranked.topk(min(k, ranked.shape[-1])).indices.tolist()
    return [(i if ids is None else int(ids[i]), float(probs[i])) for i in top if float(probs[i]) > 0]


def _ranking(session: Drafting, logits: torch.Tensor, ids: torch.Tensor | None,
             vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, the key its candidates are ranked by): q is the drafter's distribution warped as the
    verifier warps p (softmax when greedy); the key is q itself, or under coupled sampling
    log q + the verifier's Gumbel noise for the position being drafted."""
    params = session.sampling
    probs = warp(logits[None], params)[0] if params.temperature > 0 else logits.float().softmax(-1)
    if params.verification is Method.COUPLED:
        noise = gumbel(params.seed, len(session.tokens) + session.drafting, vocab)
        return probs, probs.log() + (noise if ids is None else noise[ids.cpu()]).to(probs.device)
    return probs, probs


def sampled_from(choices: list[Choice]) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """The proposal distributions of sampled choices (rejection sampling); None when chosen deterministically."""
    return [c.q for c in choices] if choices and choices[0].q is not None else None
