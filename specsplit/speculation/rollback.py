"""The one rollback contract. Every per-sequence cache (the target's KV cache, the model drafter's,
the self-draft head's one-layer cache) holds positions [0, length) and rolls back by position:

    truncate(length): keep positions [0, length). 0 <= length <= self.length, else ValueError and
    the cache is unchanged. Afterwards self.length == length, and the next tokens fed are written
    from position `length`, exactly as if the dropped ones had never been fed.

tests/test_rollback.py holds every implementation to it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Rollback(Protocol):
    @property
    def length(self) -> int: ...

    def truncate(self, length: int) -> None: ...


@runtime_checkable
class TreeRollback(Rollback, Protocol):
    """A cache that also verifies token trees (the native kernels' KV cache):

    reserve(rows): room for `rows` more positions before a (batched) forward writes them, or the
    caller's error (CacheFull) with nothing written.
    keep(start, rows): after a tree call wrote slots [start, length), keep the slots `rows` (one
    path, ascending) at positions start, start + 1, ... and drop the rest: the cache again holds
    one sequence by position, and truncate works as before."""

    def reserve(self, rows: int) -> None: ...

    def keep(self, start: int, rows: list[int]) -> None: ...


def check(held: int, length: int) -> None:
    """Raises unless `length` is a valid truncate() argument for a cache holding `held` positions."""
    if not 0 <= length <= held:
        raise ValueError(f"cannot truncate a cache of {held} positions to {length}")
