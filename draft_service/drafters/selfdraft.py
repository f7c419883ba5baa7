"""Self-drafting: a small head (specsplit.model.featurehead) on the target's own features, trained by
`specsplit distill` for one target. Features arrive with every Propose; the head keeps a one-layer
KV cache over the committed positions and drafts greedily in its reduced vocabulary."""

from __future__ import annotations

from pathlib import Path

import torch

from draft_service.drafters.base import DrafterDescription, DraftSession, Steps, drive
from specsplit.model.headfile import head_runner, load_head, max_context
from specsplit.model.headserving import HeadCall, HeadTrack, NativeHead
from specsplit.speculation.drafting import Choice, Proposal, candidates, chain_tree, choose, sampled_from
from specsplit.speculation.tokentree import Tree

WIDTH = 3  # token trees: nodes expanded per depth, and children per node
MIN_EXPAND = 0.05  # token trees: a node whose path probability is below this is not expanded


class SelfSession(DraftSession, HeadTrack):
    """The committed tokens and the target's features as the head reads them (HeadTrack)."""

    def __init__(self, prompt: list[int], dim: int, cache=None):
        DraftSession.__init__(self, prompt)
        HeadTrack.__init__(self, dim, cache, len(prompt))

    def sync(self, base_length: int, new_tokens: list[int]) -> None:
        super().sync(base_length, new_tokens)
        self.cut(base_length)

    def add_features(self, start: int, features: torch.Tensor) -> None:
        self.put_features(start, features, len(self.tokens))


class SelfDrafter:

    def __init__(self, head_dir: Path, target_dir: Path, device: str = "cpu", name: str = "self",
                 min_confidence: float = 0.0, vocab: int = 0):
        self.head, card = load_head(head_dir, target_dir, device, vocab)
        self.device = torch.device(device)
        self.runner = head_runner(self.head, self.device, max_context(target_dir))
        self.card = card
        # Drafting stops once the head's own probability that the whole draft so far is right
        # (the product of its top probabilities) falls below this: a doubtful draft costs draft
        # and verify time and is rarely accepted. 0 drafts gamma tokens every round.
        self.min_confidence = min_confidence
        own = sum(t.numel() * t.element_size() for t in self.head.state_dict().values())
        self.memory_bytes = own + sum(t.numel() * t.element_size() for t in (self.head.embed, self.head.vocab_weight))
        self.memory_bytes += self.runner.packed_bytes
        self.thread_invariant = isinstance(self.runner, NativeHead)
        self.description = DrafterDescription(
            name=name, kind="self", model_id=head_dir.name,
            tokenizer_fingerprint=card["target"]["tokenizer_fingerprint"],
            param_bytes=own, dtype="float32", device=str(self.device), needs_features=True,
            target_model_fingerprint=card["target"]["model_fingerprint"])

    def start(self, prompt: list[int]) -> SelfSession:
        return SelfSession(prompt, self.head.cfg.hidden, self.runner.new_cache())

    def propose(self, session: SelfSession, gamma: int, budget: int = 0) -> Proposal:
        return drive(self.steps(session, gamma, budget), self.runner)

    @torch.inference_mode()
    def steps(self, session: SelfSession, gamma: int, budget: int = 0) -> Steps:
        """propose() as a generator of head steps (HeadCall, answered with the runner's result), so
        that the draft service can run several sessions' steps in one call (drive_all)."""
        n, have = len(session.tokens), len(session.features)
        if not have:
            return Proposal([], "")  # no features yet: nothing to draft from
        head, cache, runner = self.head, session.cache, self.runner
        cache.truncate(session.cached)  # drop last round's drafted steps
        tree = budget > 1 and not session.rejects and runner.trees
        if isinstance(runner, NativeHead) and session.sampling.temperature == 0:  # the whole round in one call
            return (yield from self._round(session, gamma, budget, tree))
        if session.cached < have:
            feats = session.features[session.cached:have].to(self.device)
            out, logits = yield HeadCall(cache, feats, session.tokens[session.cached + 1:have + 1])
            session.cached, session.last = have, (out[-1], logits)
        pred, logits = session.last  # the head's prediction of the feature at position `have`
        # Positions [have, n - 1) have no target features yet: tokens a pre-drafting gateway assumed
        # while their Verify is in flight. Go on from the head's own predictions, as drafting does.
        for token in session.tokens[have + 1:n]:
            out, logits = yield HeadCall(cache, pred[None], [token])
            pred = out[-1]
        if tree:
            return (yield from self._expand(session, cache, pred, logits, gamma, budget))
        choices = []
        confidence = 1.0
        for k in range(gamma):
            session.drafting = k
            choice = choose(session, logits, head.vocab_ids, head.embed.shape[0])
            confidence *= choice.top_prob
            if confidence < self.min_confidence:
                break
            choices.append(choice)
            if k + 1 < gamma:
                out, logits = yield HeadCall(cache, pred[None], [choice.token])
                pred = out[-1]
        if budget > 1 and choices:
            return chain_tree(choices, budget, "self")
        return Proposal([c.token for c in choices], "self" if choices else "", sampled_from(choices))

    def _round(self, session: SelfSession, gamma: int, budget: int, tree: bool) -> Steps:
        """A greedy round as one HeadRound: the new target features, the tokens a pre-drafting
        gateway assumed, and the chain (or EAGLE-2 tree, as _expand grows it) in one native call."""
        drafted = yield session.round(session.tokens, gamma, self.min_confidence, WIDTH if tree else 0, MIN_EXPAND)
        session.took(drafted)
        if tree:
            nodes = Tree()
            for parent, token, score in zip(*drafted.tree):
                nodes.add(parent, token, score, "self")
            tokens, parents, scores, _ = nodes.select(budget, gamma)
            return Proposal(tokens, "self" if tokens else "", None, parents, scores)
        c = drafted.chain
        choices = [Choice(token, top, None, top, (second, p2) if second >= 0 else None)
                   for token, top, second, p2 in zip(c.tokens, c.top_probs, c.runner_ups, c.runner_up_probs)]
        if budget > 1 and choices:
            return chain_tree(choices, budget, "self")
        return Proposal([ch.token for ch in choices], "self" if choices else "", None)

    def _expand(self, session: SelfSession, cache, pred: torch.Tensor, logits: torch.Tensor, gamma: int,
                budget: int) -> Steps:
        """EAGLE-2's dynamic tree: at each depth the WIDTH best nodes so far (by the product of the
        head's probabilities along their path) are expanded in one head call (a tree step over
        their rows), each giving its WIDTH best next tokens; the best `budget` nodes are proposed,
        best first."""
        head = self.head
        vocab = head.embed.shape[0]
        tree, base, slot_parents = Tree(), cache.length, []
        frontier = [(-1, -1, pred, logits, 1.0)]  # (tree node, cache slot, predicted feature, logits, score)
        for depth in range(gamma):
            session.drafting = depth
            grown = []
            for node, slot, feature, row_logits, score in frontier:
                for token, prob in candidates(session, row_logits, head.vocab_ids, vocab, WIDTH):
                    child = tree.add(node, token, score * prob, "self")
                    grown.append((score * prob, child, slot, feature, token))
            grown.sort(key=lambda g: -g[0])
            grown = [g for g in grown[:WIDTH] if g[0] >= MIN_EXPAND]
            if depth + 1 == gamma or not grown:
                break
            rows = [g[2] for g in grown]
            start = cache.length
            out, row_logits = yield HeadCall(cache, torch.stack([g[3] for g in grown]), [g[4] for g in grown],
                                             [-1 if s < 0 else -2 - s for s in rows], base, tuple(slot_parents))
            slot_parents += rows
            frontier = [(g[1], start + i, out[i], row_logits[i], g[0]) for i, g in enumerate(grown)]
        tokens, parents, scores, _ = tree.select(budget, gamma)
        return Proposal(tokens, "self" if tokens else "", None, parents, scores)

    def end(self, session: SelfSession) -> None:
        pass
