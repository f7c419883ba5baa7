"""Serving a feature head (specsplit.model.featurehead): on the native kernels (NativeHead: a head
step, a tree step, or a whole greedy drafting round in one call) or on torch (TorchHead), and the
bookkeeping of one sequence's target features (HeadTrack) that the draft service's self drafter and
the verify service's own head drafting share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specsplit.model.featurehead import FeatureHead, HeadCache, head_step


class NativeHead:
    """Serving on the native kernels (specsplit.model.native): the head's layer and its draft-vocabulary
    logits in one call per drafting step instead of ~50 torch ops (measured on the shipped head:
    1.95 ms a step plus 1.6 ms of logits with torch). The same maths as head_step +
    FeatureHead.logits, with the weights (and cache) in `dtype`, or the weights quantized as
    `quantize` says (fastllama.QUANTIZE: "q8_0" reads about half of bfloat16's bytes a step); its
    caches are fastllama.KVBuffer (one layer)."""

    trees = True  # tree_step: a draft tree's level in one call

    def __init__(self, head: FeatureHead, max_positions: int, dtype: torch.dtype = torch.float32,
                 quantize: str = ""):
        from specsplit.model import native
        from specsplit.model.fastllama import QUANTIZE, interleave
        from specsplit.model.fastllama import dense as dense_float

        def dense(weight):  # the head's GEMM weights: `dtype`, or quantized as fastllama's QUANTIZE says
            return dense_float(weight, QUANTIZE[quantize])

        cfg = head.cfg
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * head.inv_freq.float()
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        self.head = head
        self.max_positions = max_positions
        self.dtype = dtype
        self.decoder = native.module().Decoder(cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.eps,
                                               torch.empty(0, cfg.hidden, dtype=dtype), emb.cos(), emb.sin(),
                                               torch.empty(0), dense(head.vocab_weight.to(dtype)), native.amx())
        matrices = (head.q_proj, head.k_proj, head.v_proj, head.o_proj, head.gate_proj, head.up_proj, head.down_proj)
        # bytes a weight: the dtype's, or int8 values (4-bit for q4_0) with a float16 scale per block of 32
        size = {"q8_0": 34 / 32, "q4_0": 18 / 32}.get(quantize, torch.empty(0, dtype=dtype).element_size())
        self.packed_bytes = int(size * (sum(m.weight.numel() for m in matrices) + head.vocab_weight.numel()))
        self.decoder.add_layer(dense(torch.cat([head.q_proj.weight, head.k_proj.weight, head.v_proj.weight]).to(dtype)),
                               torch.empty(0), dense(head.o_proj.weight.to(dtype)),
                               dense(interleave(head.gate_proj.weight, head.up_proj.weight).to(dtype)),
                               dense(head.down_proj.weight.to(dtype)),
                               head.input_norm.weight.float(), head.post_norm.weight.float())
        if quantize:  # the few best logits of each row again from bf16 rows: block rounding moves picks
            self.decoder.set_exact_head(head.vocab_weight.to(torch.bfloat16))
            self.packed_bytes += 2 * head.vocab_weight.numel()  # held, though a step reads 8 rows of them
        # fc in the kernels too: draft() runs a whole round (fc, the layer, the output rows and the
        # choices of every step) in one call
        self.drafting = native.module().DraftHead(self.decoder, dense(head.fc.weight.to(dtype)), head.embed,
                                                  head.vocab_ids.cpu())
        self.packed_bytes += int(size * head.fc.weight.numel())

    def new_cache(self):
        from specsplit.model.fastllama import KVBuffer

        cfg = self.head.cfg
        return KVBuffer(1, cfg.kv_heads, cfg.head_dim, self.dtype, self.max_positions)

    def sequence(self):
        """A sequence's head state held in the kernels (native HeadSequence: begin, follow, draft),
        for a drafter that follows one sequence's committed tokens, chain by chain."""
        from specsplit.model import native

        return native.module().HeadSequence(self.drafting, self.max_positions, self.new_cache().kv)

    @torch.inference_mode()
    def step(self, cache, features: torch.Tensor, next_tokens: list[int]):
        """As head_step, plus the draft logits of the last row: (predicted features [n, d], logits [draft_vocab])."""
        return self.run([HeadCall(cache, features, next_tokens)])[0]

    @torch.inference_mode()
    def tree_step(self, cache, features: torch.Tensor, next_tokens: list[int], parents: list[int], base: int,
                  slot_parents: list[int]):
        """One step over several rows of a draft tree that grows over calls: the cache holds the
        committed positions [0, base) and the tree's nodes from earlier steps in slots [base, length),
        slot_parents[s - base] being slot s's parent slot (-1: a root). A row's parent is a row of
        this call, -1 (a root), or -2 - s (a child of slot s). Returns (predicted features [n, d],
        draft logits [n, draft_vocab]), each row as if its path alone had been fed."""
        return self.run([HeadCall(cache, features, next_tokens, parents, base, slot_parents)])[0]

    @torch.inference_mode()
    def run(self, calls: list) -> list:
        """Several sessions' work in one call of the kernels each (every session on its own cache):
        whole drafting rounds (HeadRound: a DraftRound each) and single steps (HeadCall: what step or
        tree_step returns), in the order asked."""
        out: list = [None] * len(calls)
        groups: dict[tuple, list[int]] = {}
        for i, c in enumerate(calls):
            key = (c.gamma, c.min_confidence, c.width, c.min_expand) if isinstance(c, HeadRound) else ()
            groups.setdefault(key, []).append(i)
        for key, members in groups.items():
            results = self.draft([calls[i] for i in members]) if key else self._steps([calls[i] for i in members])
            for i, r in zip(members, results):
                out[i] = r
        return out

    def draft(self, rounds: list[HeadRound]) -> list[DraftRound]:
        """Greedy drafting rounds of several sessions (the same gamma, stop and tree shape) in one
        call of the kernels: no Python between the head's steps (decoder.cpp, Decoder::draft)."""
        first = rounds[0]
        for r in rounds:  # room for every row the round may feed
            r.cache.reserve(r.cache.length + len(r.next_tokens) + len(r.forced) + r.gamma * max(1, r.width))
        empty = torch.empty(0)
        results = self.drafting.draft(
            torch.cat([r.features.float() for r in rounds]) if any(len(r.next_tokens) for r in rounds)
            else torch.empty(0, self.head.cfg.hidden), torch.tensor([t for r in rounds for t in r.next_tokens],
                                                                    dtype=torch.long),
            [len(r.next_tokens) for r in rounds], [torch.tensor(r.forced, dtype=torch.long) for r in rounds],
            [r.cache.kv for r in rounds], [r.cache.length for r in rounds],
            [r.prev[0] if r.prev is not None else empty for r in rounds],
            [r.prev[1] if r.prev is not None else empty for r in rounds],
            first.gamma, first.min_confidence, first.width, first.min_expand)
        out = []
        for r, res in zip(rounds, results):
            r.cache.length += int(res[2])
            lists = [t.tolist() for t in res[3:]]
            out.append(DraftRound((res[0], res[1]), tree=TreeDraft(*lists)) if r.width
                       else DraftRound((res[0], res[1]), chain=ChainDraft(*lists)))
        return out

    def _steps(self, calls: list[HeadCall]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Single head steps of several sessions in one forward: per call what step (a chain step)
        or tree_step (parents given) returns."""
        head = self.head
        # fc call by call: torch's GEMM gives a row other bits among other rows, and a session's
        # drafts should not depend on what it was batched with.
        x = torch.cat([head.fc(torch.cat([c.features.float(),
                                          head.embed[torch.tensor(c.next_tokens, dtype=torch.long)].float()], dim=-1))
                       for c in calls])  # [rows, d]
        starts, trees, bases, slots = [], [], [], []
        for c in calls:
            start = c.cache.length
            c.cache.reserve(start + len(c.next_tokens))
            starts.append(start)
            trees.append(torch.tensor(c.parents if c.parents is not None else [], dtype=torch.long))
            bases.append(start if c.base is None else c.base)
            slots.append(torch.tensor(list(c.slot_parents), dtype=torch.long))
        logits, hidden, _ = self.decoder.forward_batch(torch.empty(0, dtype=torch.long), x, [c.cache.kv for c in calls],
                                                       starts, [len(c.next_tokens) for c in calls],
                                                       [1 if c.parents is None else 2 for c in calls], trees, bases,
                                                       slots)
        out, row, at = [], 0, 0
        for c in calls:
            n = len(c.next_tokens)
            c.cache.length += n
            if c.parents is None:  # a chain step: the last row's logits
                out.append((hidden[row:row + n], logits[at]))
                at += 1
            else:
                out.append((hidden[row:row + n], logits[at:at + n]))
                at += n
            row += n
        return out


@dataclass(frozen=True)
class HeadCall:
    """One session's drafting step as a drafter asks for it (NativeHead.run batches them): its
    cache, the features and next tokens of the rows it feeds and, for a tree step, their parents
    (see NativeHead.tree_step)."""

    cache: object
    features: torch.Tensor  # [n, d]
    next_tokens: list[int]
    parents: list[int] | None = None
    base: int | None = None
    slot_parents: tuple[int, ...] | list[int] = ()


@dataclass(frozen=True)
class HeadRound:
    """One session's whole greedy drafting round as NativeHead.draft runs it: the target features
    not yet fed (and the tokens after them), the tokens already assumed after those (fed on the
    head's own predictions), the session's last prediction (pred, logits) when no feature is new,
    and the draft's shape: gamma steps, a chain (width 0, stopping below min_confidence) or a
    dynamic tree (width nodes a depth, path probability at least min_expand)."""

    cache: object
    features: torch.Tensor  # [n, d]
    next_tokens: list[int]
    forced: list[int]
    prev: tuple[torch.Tensor, torch.Tensor] | None
    gamma: int
    min_confidence: float
    width: int
    min_expand: float


class ChainDraft(NamedTuple):
    tokens: list[int]
    top_probs: list[float]
    runner_ups: list[int]  # each step's second-best token, -1: none
    runner_up_probs: list[float]


class TreeDraft(NamedTuple):
    """A dynamic tree's nodes in the order made (children of one node: distinct tokens)."""

    parents: list[int]  # an earlier node, -1: a root
    tokens: list[int]
    scores: list[float]  # path probabilities


class DraftRound(NamedTuple):
    """What a HeadRound gives: the prediction after the target features (the next round's prev),
    and the chain or the tree drafted."""

    last: tuple[torch.Tensor, torch.Tensor]
    chain: ChainDraft | None = None
    tree: TreeDraft | None = None


class TorchHead:
    """Serving on torch (where the native kernels do not run): head_step and FeatureHead.logits."""

    packed_bytes = 0
    trees = False  # no tree_step: the self drafter drafts chains here

    def __init__(self, head: FeatureHead):
        self.head = head

    def new_cache(self) -> HeadCache:
        return HeadCache()

    @torch.inference_mode()
    def step(self, cache: HeadCache, features: torch.Tensor, next_tokens: list[int]):
        out = head_step(self.head, cache, features, next_tokens)
        return out, self.head.logits(out[-1])

    def run(self, calls: list[HeadCall]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Chain steps one after the other (torch has no tree steps here)."""
        return [self.step(c.cache, c.features, c.next_tokens) for c in calls]


class HeadTrack:
    """One sequence's target features as a head drafting for it reads them: the features of
    committed positions [0, committed - 1), written by position into a buffer that grows by doubling
    (a concatenation per round made every round cost the whole history); the head's KV cache; how
    many leading positions that cache holds from true features; and the head's latest prediction
    there (pred, draft logits)."""

    def __init__(self, dim: int, cache=None, rows: int = 64):
        self.feature_dim = dim
        self._rows = torch.zeros(max(64, rows), dim, dtype=torch.float32)
        self._count = 0
        self.cache = cache if cache is not None else HeadCache()  # the head's one-layer KV cache (or a KVBuffer)
        self.cached = 0  # leading positions whose head cache entries came from true features
        self.last = None  # (the head's predicted feature at position cached - 1, its draft logits)

    @property
    def features(self) -> torch.Tensor:
        return self._rows[:self._count]  # [positions, dim], a view

    def cut(self, base_length: int) -> None:
        """The sequence was cut back to base_length tokens: head cache position i used feature i and
        token i + 1, so keep those still committed."""
        self.cached = min(self.cached, base_length - 1)
        self._count = min(self._count, base_length)

    def put_features(self, start: int, features: torch.Tensor, committed: int) -> None:
        """Features of positions [start, start + n) of a sequence of `committed` tokens."""
        if start > self._count:
            raise ValueError(f"features start at position {start}; the drafter has {self._count}")
        end = start + len(features)
        if end > committed - 1:
            raise ValueError(f"features up to position {end} for {committed} tokens: "
                             "the last committed token has no feature yet")
        if end > len(self._rows):
            rows = torch.zeros(max(end, 2 * len(self._rows)), self.feature_dim, dtype=torch.float32)
            rows[:self._count] = self._rows[:self._count]
            self._rows = rows
        self._rows[start:end] = features
        self._count = end
        self.cached = min(self.cached, start)

    def round(self, tokens: list[int], gamma: int, min_confidence: float, width: int,
              min_expand: float) -> HeadRound:
        """A greedy round after `tokens` (the committed ones, then any assumed): the features not yet
        fed and the tokens after them, the assumed tokens, then the draft (see HeadRound). Drops
        the last round's drafted steps from the head's cache first."""
        have = self._count
        self.cache.truncate(self.cached)
        return HeadRound(self.cache, self.features[self.cached:have], tokens[self.cached + 1:have + 1],
                         tokens[have + 1:], self.last if self.cached >= have else None, gamma, min_confidence,
                         width, min_expand)

    def took(self, drafted: DraftRound) -> None:
        """The round ran: the head's cache holds every feature now."""
        self.cached, self.last = self._count, drafted.last
