"""Keys and values of prompt prefixes kept across requests and sessions (vLLM's automatic prefix
caching, on per-session caches): a system prompt, a few-shot template or an earlier chat turn that
a new prompt starts with is copied into the new session's cache instead of being computed again.

A prompt is cut into blocks of BLOCK tokens; a block is found by its tokens and the block before
it (a chain: a block is only reused after the very same prefix), and holds that span's keys,
values and features (final-norm hidden states, which self-drafting heads read). The kernels are
exact by construction, so a session that loads a cached prefix and computes the rest holds the
same cache, and answers the same, as one that computed it all. Blocks take their bytes from the
sessions' KV budget (KVPool) and give them back, least recently used first, whenever a session
needs the room: the cache only ever holds room nobody else wants."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from specsplit.model.fastllama import CacheFull, FastSequence, KVPool

BLOCK = 32


@dataclass(eq=False)
class _Block:
    parent: int | None  # the key of the block before it (None: the prompt's first)
    tokens: tuple[int, ...]
    kv: torch.Tensor  # [layers, 2, BLOCK, kv_heads, head_dim]
    features: torch.Tensor  # [BLOCK, hidden]
    nbytes: int


class PrefixCache:
    """Not thread-safe apart from reclaim (called under the pool's lock): used from one worker."""

    def __init__(self, pool: KVPool, block: int = BLOCK):
        self.block = block
        self._pool = pool
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._pinned: set[int] = set()  # blocks of the prompt being stored: not reclaimed meanwhile
        self.used_bytes = 0
        self.lookups = self.hits = 0
        self.queried_tokens = self.hit_tokens = 0
        pool.reclaim = self._reclaim

    def __len__(self) -> int:
        return len(self._blocks)

    def load(self, prompt: list[int], sequence: FastSequence) -> torch.Tensor | None:
        """Appends the keys and values of the longest cached prefix of `prompt` to the (empty)
        sequence, leaving at least the prompt's last token to compute (its logits give the first
        token); returns that prefix's features, or None on a miss."""
        keys = self._chain(prompt, len(prompt) - 1)
        self.lookups += 1
        self.queried_tokens += len(prompt)
        if not keys:
            return None
        self.hits += 1
        self.hit_tokens += len(keys) * self.block
        self._touch(keys)
        blocks = [self._blocks[k] for k in keys]
        sequence.append(torch.cat([b.kv for b in blocks], dim=2))
        return torch.cat([b.features for b in blocks])

    def store(self, prompt: list[int], sequence: FastSequence, features: torch.Tensor, first: int = 0) -> None:
        """Keeps the prompt's full blocks that are not kept yet, as far as free room allows: the
        sequence holds the prompt's keys and values, `features` one row per token of prompt[first:]
        (a prefill in chunks stores each chunk's blocks as they are done; the blocks before
        `first` were stored before)."""
        keys = self._chain(prompt, len(prompt))  # kept already
        self._pinned.update(keys)
        parent = keys[-1] if keys else None
        try:
            for start in range(len(keys) * self.block, len(prompt) - self.block + 1, self.block):
                tokens = tuple(prompt[start:start + self.block])
                key = hash((parent, tokens))
                if start < first or key in self._blocks:
                    break  # evicted since (its features are gone with it), or a hash collision
                kv = sequence.read(start, start + self.block)
                feats = features[start - first:start - first + self.block].clone()
                nbytes = kv.numel() * kv.element_size() + feats.numel() * feats.element_size()
                self._pool.take(nbytes, "the prefix cache")
                self._blocks[key] = _Block(parent, tokens, kv, feats, nbytes)
                self.used_bytes += nbytes
                keys.append(key)
                self._pinned.add(key)
                parent = key
        except CacheFull:
            pass  # the sessions use the rest of the budget
        finally:
            self._pinned.clear()
        self._touch(keys)

    def cached_tokens(self, prompt: list[int]) -> int:
        """How many tokens at the start of `prompt` a load would find (without loading them)."""
        return len(self._chain(prompt, len(prompt))) * self.block

    def stats(self) -> dict[str, int]:
        return {"blocks": len(self._blocks), "bytes": self.used_bytes, "lookups": self.lookups,
                "hits": self.hits, "queried_tokens": self.queried_tokens, "hit_tokens": self.hit_tokens}

    def _chain(self, prompt: list[int], limit: int) -> list[int]:
        """Keys of the cached blocks that `prompt[:limit]` starts with, in order."""
        parent, keys = None, []
        for start in range(0, limit - self.block + 1, self.block):
            tokens = tuple(prompt[start:start + self.block])
            key = hash((parent, tokens))
            block = self._blocks.get(key)
            if block is None or block.parent != parent or block.tokens != tokens:
                break
            keys.append(key)
            parent = key
        return keys

    def _touch(self, keys: list[int]) -> None:
        """Most recently used: a chain's first block last, so its later blocks go first (a block
        is only reachable through the ones before it)."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _reclaim(self, nbytes: int) -> None:
        """Gives back at least `nbytes` (or all it can), least recently used blocks first."""
        for key in [k for k in self._blocks if k not in self._pinned]:
            if nbytes <= 0:
                break
            block = self._blocks.pop(key)
            self.used_bytes -= block.nbytes
            self._pool.give(block.nbytes)
            nbytes -= block.nbytes
