"""Retrieval first, the self-drafter otherwise: copying pays when the text repeats (rewrites,
templated output), the head everywhere else. Most reliable first: an n-gram match of at least
`min_match` tokens, then the head (which drafts nothing when it is unsure), then a shorter match."""

from __future__ import annotations

from draft_service.drafters.base import DrafterDescription, Proposal
from draft_service.drafters.ngram import NgramDrafter
from draft_service.drafters.selfdraft import SelfDrafter, SelfSession


class HybridDrafter:

    def __init__(self, ngram: NgramDrafter, head: SelfDrafter, min_match: int = 2, name: str = "hybrid"):
        self.ngram, self.head, self.min_match = ngram, head, min_match
        d = head.description
        self.description = DrafterDescription(
            name=name, kind="hybrid", model_id=d.model_id, tokenizer_fingerprint=d.tokenizer_fingerprint,
            param_bytes=d.param_bytes, dtype=d.dtype, device=d.device, needs_features=True,
            target_model_fingerprint=d.target_model_fingerprint)

    @property
    def memory_bytes(self) -> int:
        return self.head.memory_bytes  # the store is shared with the ngram drafter, counted there

    def start(self, prompt: list[int]) -> SelfSession:
        return self.head.start(prompt)

    def propose(self, session: SelfSession, gamma: int) -> Proposal:
        drafts, n = self.ngram.match(session.tokens, gamma)
        if n >= self.min_match:
            return Proposal(drafts, "ngram")
        proposal = self.head.propose(session, gamma)
        if proposal.tokens or not drafts:
            return proposal
        return Proposal(drafts, "ngram")

    def end(self, session: SelfSession) -> None:
        self.ngram.end(session)
