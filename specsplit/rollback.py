"""The one rollback contract. Every per-sequence cache (the target's KV cache, the model drafter's,
the self-draft head's one-layer cache) holds positions [0, length) and rolls back by position:

    truncate(length): keep positions [0, length). 0 <= length <= self.length, else ValueError and
    the cache is unchanged. Afterwards self.length == length, and the next tokens fed are written
    from position `length`, exactly as if the dropped ones had never been fed.

tests/test_rollback.py holds every implementation to it."""

from __future__ import annotations

from typing import Protocol


class Rollback(Protocol):
    @property
    def length(self) -> int: ...

    def truncate(self, length: int) -> None: ...


def check(held: int, length: int) -> None:
    """Raises unless `length` is a valid truncate() argument for a cache holding `held` positions."""
    if not 0 <= length <= held:
        raise ValueError(f"cannot truncate a cache of {held} positions to {length}")
