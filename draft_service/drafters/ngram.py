"""Retrieval drafting: propose what followed earlier occurrences of the context's end, in the
session's own tokens (prompt lookup) and then in a bounded store of earlier outputs, by the one
engine of specsplit.speculation.lookup (the rule the verifier's own lookups follow)."""

from __future__ import annotations

from draft_service.drafters.base import DrafterDescription, DraftSession
from specsplit.speculation.drafting import Proposal, tree_proposal
from specsplit.speculation.lookup import CANDIDATES, OutputIndex, first
from specsplit.speculation.tokentree import Tree

# How often the target follows a copied continuation, per token, by the length of the match it
# came from (1, 2, 3+ tokens; a long match in the store of earlier outputs as 3+): a prior that
# scores tree nodes (the hybrid learns its own).
RELIABILITY = {1: 0.35, 2: 0.6, 3: 0.75}


def add_continuations(tree: Tree, follows: list[list[int]], reliability: float, source: str = "ngram") -> None:
    """Adds copied continuations as a tree: a node's score is the share of continuations that pass
    through it times `reliability` per token of depth (SuffixDecoding's frequency estimate)."""
    counts: dict[tuple[int, ...], int] = {}
    for follow in follows:
        for d in range(1, len(follow) + 1):
            counts[tuple(follow[:d])] = counts.get(tuple(follow[:d]), 0) + 1
    nodes: dict[tuple[int, ...], int] = {}
    for path in sorted(counts, key=len):  # parents before children
        score = counts[path] / len(follows) * reliability ** len(path)
        nodes[path] = tree.add(nodes.get(path[:-1], -1), path[-1], score, source)


class NgramDrafter:

    def __init__(self, name: str = "ngram", min_n: int = 1, max_n: int = 3, store: OutputIndex | None = None,
                 store_min_n: int = 2, store_max_n: int = 8):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.description = DrafterDescription(name=name, kind="ngram")
        self.thread_invariant = True  # no model
        self._min_n = min_n
        self._max_n = max_n
        self.store = store
        self._store_min_n = max(store_min_n, min_n, 2)  # one matching token in a large store is a guess
        # A long exact match with an earlier output marks a templated repeat: it beats a short
        # match in the session.
        self._store_max_n = max(store_max_n, max_n)

    @property
    def memory_bytes(self) -> int:
        return self.store.memory_bytes if self.store is not None else 0

    def start(self, prompt: list[int]) -> DraftSession:
        return DraftSession(prompt)

    def continuations(self, session: DraftSession, depth: int, limit: int = CANDIDATES) -> tuple[list[list[int]], int]:
        """What followed the earlier occurrences of the session's end that agree longest with it:
        in its own tokens, or in the store where that agrees longer. (continuations, n agreed)."""
        follows, n = session.index.continuations(session.tokens, depth, limit, self._min_n, self._max_n)
        if self.store is not None:
            stored, m = self.store.continuations(session.tokens, depth, limit, max(self._store_min_n, n + 1),
                                                 self._store_max_n)
            if m > n:
                return stored, m
        return follows, n

    def match(self, session: DraftSession, gamma: int) -> tuple[list[int], int]:
        """(drafts, n agreed): the first of continuations()."""
        return first(self.continuations(session, gamma, 1))

    def tree(self, session: DraftSession, depth: int, tree: Tree | None = None,
             reliability: dict | None = None) -> tuple[Tree, int]:
        """A token tree of continuations(). Returns (tree, n agreed)."""
        reliability = reliability or RELIABILITY
        tree = tree if tree is not None else Tree()
        follows, n = self.continuations(session, depth)
        if follows:
            add_continuations(tree, follows, reliability[min(n, 3)])
        return tree, n

    def propose(self, session: DraftSession, gamma: int, budget: int = 0) -> Proposal:
        if budget > 1:
            return tree_proposal(self.tree(session, gamma)[0], budget, gamma, "ngram")
        drafts, _ = self.match(session, gamma)
        return Proposal(drafts, "ngram" if drafts else "")

    def end(self, session: DraftSession) -> None:
        if self.store is not None:
            self.store.add(session.output)
