"""The co-located fast path: one shared-memory segment per speculative session, for the bulk
per-round payloads (target features, sparse draft distributions). gRPC still carries every call and
its small fields; a message then names a region of the segment instead of carrying the bytes.

The gateway creates the segment (0600, in SPECSPLIT_SHM_DIR, default /dev/shm), writes a random
nonce into it and sends only its name; a service proves it shares the host (and the user) by
reading the nonce back. A service that cannot open the name, or refuses shared memory, answers
without a nonce and the session falls back to plain gRPC. The gateway unlinks the segment when the
session ends and all of its segments when it exits. A creator holds an flock on its own lock file for
its whole life, so a segment whose creator's lock is free was left by a dead process (SIGKILL) and
any specsplit process reclaims it when it starts; unlike a pid, the lock cannot be confused by pid
reuse or by containers with their own pid namespaces.
Layout and sizing: docs/protocol.md#shared-memory."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
from pathlib import Path

import numpy as np

from specsplit.api.common.v1 import common_pb2 as cpb

log = logging.getLogger("specsplit")

PREFIX = "specsplit-"
_NAME = re.compile(r"^specsplit-([0-9a-f]{16})-[0-9a-f]{8,64}$")
_LOCK = re.compile(r"^specsplit-([0-9a-f]{16})\.lock$")
_MAGIC = b"SPSHM\x01\x00\x00"
# magic, nonce, ring offset, ring rows, row bytes, slot offset, slot bytes, slot count
_HEADER = struct.Struct("<8s16sQIIQII")
HEADER_BYTES = 64
SLOTS = 2  # proposal slots: one being verified while the next is drafted (pre-drafting)
SLOT_BYTES = 64 * 1024
MAX_SEGMENT_BYTES = 256 * 1024 * 1024  # the most a service maps for one session


class ShmError(ValueError):
    """A name, size or region that does not belong to a well-formed segment."""


def is_segment_name(name: str) -> bool:
    """A session segment's file name (not a lock file, not a fast-path socket)."""
    return bool(_NAME.match(name))


def _reserve(fd: int, size: int, path: Path) -> None:
    """Takes the segment's pages now. ftruncate alone makes a sparse file that a full tmpfs still
    accepts; the first write past the free space then kills the writer with SIGBUS (the gateway,
    or a service writing features). Reserved up front, a full /dev/shm is an OSError here, and the
    gateway runs that session over gRPC."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem that cannot reserve: as before
            return
        raise OSError(e.errno, f"cannot reserve {size} bytes of shared memory in {path.parent}: "
                               f"{os.strerror(e.errno)}") from None


def shm_dir() -> Path:
    return Path(os.environ.get("SPECSPLIT_SHM_DIR", "/dev/shm"))


def available() -> bool:
    return shm_dir().is_dir() and os.access(shm_dir(), os.W_OK)


class Segment:
    """A mapped segment. The gateway `create`s (and later `unlink`s) it; services `attach`."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self._mm = mm
        self.owner = owner
        magic, self.nonce, self.ring_offset, self.ring_rows, self.row_bytes, self.slot_offset, \
            self.slot_bytes, slots = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC:
            raise ShmError(f"segment {name} is not a specsplit segment")
        if slots != SLOTS or self.slot_offset + SLOTS * self.slot_bytes > len(mm) \
                or self.ring_offset + self.ring_rows * self.row_bytes > self.slot_offset:
            raise ShmError(f"segment {name} has an inconsistent layout")
        self._slot = 0

    @classmethod
    def create(cls, creator: str, session_id: str, row_bytes: int, budget: int, max_rows: int) -> Segment:
        """A new segment for a session: a ring of up to `max_rows` feature rows of `row_bytes`
        (0: no features) within `budget` bytes, plus the proposal slots."""
        name = f"{PREFIX}{creator}-{session_id}"
        if not _NAME.match(name):
            raise ShmError(f"session id {session_id!r} cannot name a segment")
        rows = 0
        if row_bytes:
            rows = max(0, min(max_rows, (budget - HEADER_BYTES - SLOTS * SLOT_BYTES) // row_bytes))
        ring_offset = HEADER_BYTES
        slot_offset = ring_offset + rows * row_bytes
        size = slot_offset + SLOTS * SLOT_BYTES
        path = shm_dir() / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, size)
            _reserve(fd, size, path)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        _HEADER.pack_into(mm, 0, _MAGIC, secrets.token_bytes(16), ring_offset, rows, row_bytes, slot_offset,
                          SLOT_BYTES, SLOTS)
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str, max_bytes: int = MAX_SEGMENT_BYTES) -> Segment:
        """Maps a segment the gateway created. FileNotFoundError: not on this host (or not in this
        IPC namespace); PermissionError: another user's; ShmError: not a valid segment."""
        if not _NAME.match(name):
            raise ShmError(f"{name!r} is not a specsplit segment name")
        fd = os.open(shm_dir() / name, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PermissionError(f"segment {name} is not private to this user")
            if not HEADER_BYTES <= st.st_size <= max_bytes:
                raise ShmError(f"segment {name} is {st.st_size} bytes; this service maps at most {max_bytes}")
            mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        try:
            return cls(name, mm, owner=False)
        except BaseException:
            mm.close()
            raise

    @property
    def size(self) -> int:
        return len(self._mm)

    # Features: row i of the ring holds position p with p % ring_rows == i.

    def fits_rows(self, rows: int, row_bytes: int) -> bool:
        return 0 < rows <= self.ring_rows and row_bytes == self.row_bytes

    def write_rows(self, start: int, data: bytes) -> None:
        rows = len(data) // self.row_bytes
        for offset, lo, hi in self._ring_spans(start, rows):
            self._mm[offset:offset + (hi - lo) * self.row_bytes] = data[lo * self.row_bytes:hi * self.row_bytes]

    def read_rows(self, start: int, rows: int) -> bytes:
        if not 0 < rows <= self.ring_rows:
            raise ShmError(f"{rows} feature rows; the segment's ring holds {self.ring_rows}")
        return b"".join(self._mm[offset:offset + (hi - lo) * self.row_bytes]
                        for offset, lo, hi in self._ring_spans(start, rows))

    def _ring_spans(self, start: int, rows: int):
        done = 0
        while done < rows:
            slot = (start + done) % self.ring_rows
            n = min(rows - done, self.ring_rows - slot)
            yield self.ring_offset + slot * self.row_bytes, done, done + n
            done += n

    # Proposals: sparse distributions, alternating between the slots.

    def write_proposal(self, dists: list[tuple[list[int], list[float]]]) -> tuple[int, int] | None:
        """Writes the distributions to the next slot; (offset, length), or None when they do not fit."""
        raw = encode_proposal(dists)
        if len(raw) > self.slot_bytes:
            return None
        offset = self.slot_offset + self._slot * self.slot_bytes
        self._slot = (self._slot + 1) % SLOTS
        self._mm[offset:offset + len(raw)] = raw
        return offset, len(raw)

    def read_proposal(self, offset: int, length: int) -> list[tuple[list[int], list[float]]]:
        return decode_proposal(self._slot_bytes(offset, length))

    def proposal_prefix(self, offset: int, length: int, count: int) -> int:
        """Length of the region's first `count` distributions (a ref can be cut to them)."""
        raw, at = self._slot_bytes(offset, length), 0
        for _ in range(count):
            at += 4 + 8 * struct.unpack_from("<I", raw, at)[0]
        return at

    def _slot_bytes(self, offset: int, length: int) -> bytes:
        inside = any(self.slot_offset + i * self.slot_bytes <= offset
                     and offset + length <= self.slot_offset + (i + 1) * self.slot_bytes for i in range(SLOTS))
        if not inside:
            raise ShmError(f"proposal region [{offset}, {offset + length}) is not inside a slot")
        return self._mm[offset:offset + length]

    def close(self) -> None:
        self._mm.close()

    def unlink(self) -> None:
        """Owner only: removes the name (mappings in other processes stay valid until they close)."""
        self.close()
        try:
            os.unlink(shm_dir() / self.name)
        except FileNotFoundError:
            pass


def encode_proposal(dists: list[tuple[list[int], list[float]]]) -> bytes:
    """Per draft token, back to back: n (u32), n ids (u32), n probabilities (f32), little-endian."""
    parts = []
    for ids, probs in dists:
        parts += [struct.pack("<I", len(ids)), np.asarray(ids, "<u4").tobytes(), np.asarray(probs, "<f4").tobytes()]
    return b"".join(parts)


def decode_proposal(raw: bytes) -> list[tuple[list[int], list[float]]]:
    try:
        at, out = 0, []
        while at < len(raw):
            (n,) = struct.unpack_from("<I", raw, at)
            at += 4
            if at + 8 * n > len(raw):
                raise ShmError("proposal region is truncated")
            ids = np.frombuffer(raw, "<u4", n, at).tolist()
            probs = np.frombuffer(raw, "<f4", n, at + 4 * n).tolist()
            out.append((ids, probs))
            at += 8 * n
    except struct.error:
        raise ShmError("proposal region is truncated") from None
    return out


class Creator:
    """The segments one process creates, named after a token whose lock file it holds until it
    exits (the kernel drops the lock even on SIGKILL)."""

    def __init__(self):
        self.token = secrets.token_hex(8)
        self._lock_path = shm_dir() / f"{PREFIX}{self.token}.lock"
        # Locked before it gets its name, so no reclaimer ever sees it free.
        pending = shm_dir() / f".{PREFIX}{self.token}.lock"
        self._lock = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        os.rename(pending, self._lock_path)
        self.live: dict[str, Segment] = {}

    def create(self, session_id: str, row_bytes: int, budget: int, max_rows: int) -> Segment:
        segment = Segment.create(self.token, session_id, row_bytes, budget, max_rows)
        self.live[segment.name] = segment
        return segment

    def remove(self, segment: Segment) -> None:
        self.live.pop(segment.name, None)
        segment.unlink()

    def close(self) -> None:
        """Normal exit: unlinks every segment still live, then the lock file."""
        for segment in list(self.live.values()):
            self.remove(segment)
        try:
            os.unlink(self._lock_path)
        except FileNotFoundError:
            pass
        os.close(self._lock)


def reclaim_stale() -> list[str]:
    """Unlinks segments (and lock files) of creators that no longer hold their lock."""
    try:
        names = os.listdir(shm_dir())
    except OSError:
        return []
    tokens = {m.group(1) for m in map(_NAME.match, names) if m} | {m.group(1) for m in map(_LOCK.match, names) if m}
    reclaimed = []
    for token in tokens:
        if _held(shm_dir() / f"{PREFIX}{token}.lock"):
            continue
        for name in names:
            if name.startswith(f"{PREFIX}{token}"):
                try:
                    os.unlink(shm_dir() / name)
                    if _NAME.match(name):
                        reclaimed.append(name)
                except OSError:
                    pass
    if reclaimed:
        log.warning("reclaimed %d shared-memory segment(s) left by dead processes", len(reclaimed))
    return reclaimed


def _held(lock_path: Path) -> bool:
    """Whether a live process holds the lock (a missing lock file means nobody does)."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def try_attach(name: str, enabled: bool = True) -> Segment | None:
    """A service's side of the handshake: the segment, or None (plain gRPC) when it is not ours to map."""
    if not name or not enabled:
        return None
    try:
        return Segment.attach(name)
    except (OSError, ShmError) as e:  # another host or namespace, another user, not a segment
        log.info("not mapping shared-memory segment %s: %s", name, e)
        return None


def stash_features(segment: Segment | None, message: cpb.Features) -> cpb.Features:
    """Moves the rows into the segment's ring when they fit; the message unchanged otherwise."""
    if segment is None or message.in_shm or not message.rows:
        return message
    if not segment.fits_rows(message.rows, len(message.data) // message.rows):
        return message
    segment.write_rows(message.start, message.data)
    return cpb.Features(start=message.start, rows=message.rows, dim=message.dim, dtype=message.dtype, in_shm=True)


def fetch_features(segment: Segment | None, message: cpb.Features) -> cpb.Features:
    """The rows inline, read from the segment when the message points there."""
    if not message.in_shm:
        return message
    if segment is None:
        raise ShmError("features are in shared memory but this session has no mapped segment")
    return cpb.Features(start=message.start, rows=message.rows, dim=message.dim, dtype=message.dtype,
                        data=segment.read_rows(message.start, message.rows))
