"""Retrieval drafting: propose what followed the latest earlier occurrence of the current suffix,
in the session's own tokens (prompt lookup) and then in a bounded store of earlier outputs."""

from __future__ import annotations

from draft_service.drafters.base import DrafterDescription, DraftSession
from specsplit.speculation.drafting import Proposal, tree_proposal
from specsplit.speculation.store import OCCURRENCES, WIDTH, OutputStore, occurrences, pack
from specsplit.speculation.tokentree import Tree

# How often the target follows a copied continuation, per token, by the length of the match it
# came from (1, 2, 3+ tokens; a long match in the store of earlier outputs as 3+): a prior that
# scores tree nodes (the hybrid learns its own).
RELIABILITY = {1: 0.35, 2: 0.6, 3: 0.75}


def continuations(tokens: list[int], depth: int, min_n: int, max_n: int,
                  limit: int = OCCURRENCES) -> tuple[list[list[int]], int]:
    """What followed the latest `limit` earlier occurrences of the longest matching suffix (max_n
    down to min_n tokens) in `tokens` itself: (up to `depth` tokens each, n), or ([], 0)."""
    length = len(tokens)
    data = pack(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        hits = occurrences(data, data[(length - n) * WIDTH:], (length - 1) * WIDTH, limit)
        follows = [tokens[h + n:h + n + depth] for h in hits]
        follows = [f for f in follows if f]
        if follows:
            return follows, n
    return [], 0


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


def lookup(tokens: list[int], gamma: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """Longest n-gram first (max_n down to min_n): the most recent earlier occurrence of the last n
    tokens in `tokens` itself; returns (up to gamma tokens that followed it, n), or ([], 0)."""
    follows, n = continuations(tokens, gamma, min_n, max_n, 1)
    return (follows[0], n) if follows else ([], 0)


class NgramDrafter:

    def __init__(self, name: str = "ngram", min_n: int = 1, max_n: int = 3, store: OutputStore | None = None,
                 store_min_n: int = 2, store_max_n: int = 8):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.description = DrafterDescription(name=name, kind="ngram")
        self.thread_invariant = True  # no model
        self._min_n = min_n
        self._max_n = max_n
        self.store = store
        self._store_min_n = max(store_min_n, min_n)  # one matching token in a large store is a guess
        # A long exact match with an earlier output marks a templated repeat: it beats a short
        # match in the session.
        self._store_max_n = max(store_max_n, max_n)

    @property
    def memory_bytes(self) -> int:
        return self.store.memory_bytes if self.store is not None else 0

    def start(self, prompt: list[int]) -> DraftSession:
        return DraftSession(prompt)

    def match(self, tokens: list[int], gamma: int) -> tuple[list[int], int]:
        """(drafts, matched n-gram length): the session's own tokens first, then the store."""
        drafts, n = lookup(tokens, gamma, self._min_n, self._max_n)
        if self.store is not None:
            stored, m = self.store.lookup(tokens, gamma, max(self._store_min_n, n + 1), self._store_max_n)
            if m > n:
                return stored, m
        return drafts, n

    def tree(self, tokens: list[int], depth: int, tree: Tree | None = None,
             reliability: dict | None = None) -> tuple[Tree, int]:
        """A token tree of what followed earlier occurrences of the longest matching suffix: the
        session's own tokens, and the store when it matches longer. Returns (tree, n matched)."""
        reliability = reliability or RELIABILITY
        tree = tree if tree is not None else Tree()
        follows, n = continuations(tokens, depth, self._min_n, self._max_n)
        if self.store is not None:
            stored, m = self.store.continuations(tokens, depth, max(self._store_min_n, n + 1), self._store_max_n)
            if m > n:
                follows, n = stored, m
        if follows:
            add_continuations(tree, follows, reliability[min(n, 3)])
        return tree, n

    def propose(self, session: DraftSession, gamma: int, budget: int = 0) -> Proposal:
        if budget > 1:
            return tree_proposal(self.tree(session.tokens, gamma)[0], budget, gamma, "ngram")
        drafts, _ = self.match(session.tokens, gamma)
        return Proposal(drafts, "ngram" if drafts else "")

    def end(self, session: DraftSession) -> None:
        if self.store is not None:
            self.store.add(session.output)
