"""Token trees as drafters build them and the wire carries them: tokens in topological order,
each with the index of its parent (-1: a child of the last committed token). A chain is the tree
whose parents are -1, 0, 1, ...

Drafters score candidate nodes (the estimated probability that the target follows the path to
the node) and `Tree.select` keeps the best `budget` of them, best first from the root, so every
kept node's parent is kept too. The verifier walks the tree (specsplit.speculation.acceptance)."""

from __future__ import annotations

import heapq
from itertools import count


def check(parents: list[int], size: int) -> None:
    """A token tree as the wire carries it: one parent per draft token, an earlier index or -1."""
    if len(parents) != size:
        raise ValueError(f"draft_parents has {len(parents)} entries for {size} draft tokens")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"draft_parents[{i}] = {parent}: a parent must be an earlier draft index or -1")


def depths(parents: list[int]) -> list[int]:
    """Depth of each node, 1 for a child of the committed tokens."""
    out: list[int] = []
    for parent in parents:
        out.append(out[parent] + 1 if parent >= 0 else 1)
    return out


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def chain(size: int) -> list[int]:
    """The parents of a chain of `size` drafts."""
    return list(range(-1, size - 1))


def follow(choice, draft: list[int], parents: list[int] | None) -> tuple[list[int], int]:
    """Walks a token tree from the root. Row 0 is the last committed token, row i + 1 is draft[i],
    whose parent is row parents[i] + 1 (parents None: a chain); choice(row, depth) is the token
    taken after that row's path. Follows the child equal to the choice while there is one. Returns
    (the followed draft indices, root to leaf; the choice after them)."""
    children = children_of(len(draft), parents)
    path: list[int] = []
    row = 0
    while True:
        token = choice(row, len(path))
        nxt = next((i for i in children.get(row, ()) if draft[i] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        row = nxt + 1


def children_of(size: int, parents: list[int] | None) -> dict[int, list[int]]:
    """Row -> the draft indices whose parent it is (row 0: the last committed token), in order."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(chain(size) if parents is None else parents):
        children.setdefault(parent + 1, []).append(i)
    return children


def verify_ms(forward_ms_by_rows: list[float], rows: int) -> float:
    """A verify of `rows` rows by the verifier's measured curve (InfoResponse.forward_ms_by_rows),
    extended past its end by its last slope (flat for a single point)."""
    curve = forward_ms_by_rows
    if rows <= len(curve):
        return curve[rows - 1]
    slope = curve[-1] - curve[-2] if len(curve) > 1 else 0.0
    return curve[-1] + slope * (rows - len(curve))


def prune(parents: list[int], max_depth: int, size: int | None = None) -> tuple[list[int], list[int]]:
    """The first `size` nodes (all: None) that are at most `max_depth` deep: (their indices, their
    parents renumbered). A node whose parent is not a kept earlier node is dropped with it, so the
    kept nodes are a tree even when the proposal was not."""
    keep: list[int] = []
    index: dict[int, int] = {}
    depth: dict[int, int] = {}
    for i, parent in enumerate(parents[:size]):
        if parent != -1 and parent not in index:
            continue
        d = 1 if parent == -1 else depth[parent] + 1
        if d <= max_depth:
            index[i], depth[i] = len(keep), d
            keep.append(i)
    return keep, [index[parents[i]] if parents[i] >= 0 else -1 for i in keep]


class Tree:
    """Candidate nodes with scores; children of a node have distinct tokens (adding a known child
    keeps the higher score)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.sources: list[str] = []
        self.children_of: dict[int, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float, source: str = "") -> int:
        """The node for `token` under `parent` (-1: the root), created if new; returns its index."""
        children = self.children_of.setdefault(parent, {})
        node = children.get(token)
        if node is None:
            node = children[token] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.scores.append(score)
            self.sources.append(source)
        elif score > self.scores[node]:
            self.scores[node], self.sources[node] = score, source
        return node

    def add_path(self, tokens: list[int], scores: list[float], source: str = "", parent: int = -1) -> list[int]:
        nodes = []
        for token, score in zip(tokens, scores):
            parent = self.add(parent, token, score, source)
            nodes.append(parent)
        return nodes

    def select(self, budget: int, max_depth: int,
               min_score: float = 0.0) -> tuple[list[int], list[int], list[float], list[str]]:
        """The best `budget` nodes (score >= min_score, at most max_depth deep), expanded best
        first from the root: (tokens, parents, scores, sources), parents before children, so that
        every prefix is a tree too."""
        tie = count()
        frontier = [(-self.scores[c], next(tie), c, 1) for c in self.children_of.get(-1, {}).values()]
        heapq.heapify(frontier)
        chosen: dict[int, int] = {}
        tokens, parents, scores, sources = [], [], [], []
        while frontier and len(tokens) < budget:
            neg, _, node, depth = heapq.heappop(frontier)
            if -neg < min_score:
                break
            chosen[node] = len(tokens)
            tokens.append(self.tokens[node])
            parent = self.parents[node]
            parents.append(chosen[parent] if parent >= 0 else -1)
            scores.append(self.scores[node])
            sources.append(self.sources[node])
            if depth < max_depth:
                for child in self.children_of.get(node, {}).values():
                    heapq.heappush(frontier, (-self.scores[child], next(tie), child, depth + 1))
        return tokens, parents, scores, sources


def score_scale(accepted: float | None, expected: float | None) -> float:
    """How far a drafter's tree scores have held up: the tokens its trees earned over the sum of
    their kept nodes' scores (the tokens they promised), within [0.25, 4]; 1.0 until measured. Applied
    to the scores before a tree is cut by worth_verifying."""
    if accepted is None or not expected:
        return 1.0
    return min(4.0, max(0.25, accepted / expected))


def worth_verifying(scores: list[float], forward_ms_by_rows: list[float], fixed_ms: float,
                    other_rows: int = 0, other_gain: float = 0.0) -> int:
    """How many leading nodes of a best-first tree to verify: the count m whose expected tokens per
    round (1 + the sum of their scores, each node's chance of being on the accepted path) per
    millisecond (the verify forward of m + 1 rows plus the round's other costs) is highest. Without a
    cost curve, all of them. With a batching verifier, other sessions' rounds share the forward:
    `other_rows` of theirs, expected to commit `other_gain` tokens; then the count is the one that
    maximises the whole batch's tokens per millisecond, so a node must pay for what its row costs
    everyone (alone, both are 0 and it is the session's own rate)."""
    if not forward_ms_by_rows:
        return len(scores)
    gain = other_gain + 1.0
    best, best_rate = 0, gain / (verify_ms(forward_ms_by_rows, other_rows + 1) + fixed_ms)
    for m, score in enumerate(scores, start=1):
        gain += score
        rate = gain / (verify_ms(forward_ms_by_rows, other_rows + m + 1) + fixed_ms)
        if rate > best_rate:
            best, best_rate = m, rate
    return best
