"""Where a round's bulk payloads travel: target features to the drafter and draft distributions to
the verifier go by reference into the session's shared-memory segment when the receiving service
mapped it, inline otherwise (specsplit.serving.shm)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.errors import Failure
from specsplit.serving import shm

ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass
class Links:
    """The session's ways to its two services: its shared memory and round links (gateway.upstream)."""

    segment: shm.Segment | None = None  # the session's shared memory (co-located fast path)
    shm_verify: bool = False  # the verify service mapped it
    shm_draft: bool = False  # the draft service mapped it
    verifier: object = None  # the session's round link to each service (gateway.upstream)
    drafter: object = None
    fast_path: bool = False  # rounds went over the fast path (both services)



def join(pending: cpb.Features | None, new: cpb.Features | None, segment: shm.Segment | None) -> cpb.Features | None:
    """Features not delivered yet followed by the new rows (rare: a round without a Propose).
    Rows in shared memory are read back first, so the result is always valid."""
    if pending is None or not pending.rows:
        return new
    if new is None or not new.rows:
        return pending
    pending, new = shm.fetch_features(segment, pending), shm.fetch_features(segment, new)
    return cpb.Features(start=pending.start, rows=pending.rows + new.rows, dim=new.dim, dtype=new.dtype,
                        data=pending.data + new.data)


def feature_bytes(features: cpb.Features | None) -> int:
    """Bytes of feature rows carried, inline or in shared memory."""
    return 0 if features is None else features.rows * features.dim * ELEMENT_BYTES.get(features.dtype, 4)


def proposal_bytes(inline: list[cpb.SparseProbs], ref: cpb.ShmRef | None) -> int:
    return ref.length if ref is not None else sum(d.ByteSize() for d in inline)


def for_drafter(links: Links, features: cpb.Features | None) -> cpb.Features | None:
    """Features as the draft service can read them: a ring reference only if it mapped the segment."""
    if features is None or links.shm_draft:
        return features
    return shm.fetch_features(links.segment, features)


def for_verifier(links: Links, proposal: dpb.ProposeResponse,
                 keep: list[int]) -> tuple[list[cpb.SparseProbs], cpb.ShmRef | None]:
    """The draft distributions of the drafts kept (indices into the proposal), inline or, when they
    are a prefix, as a segment reference the verifier can read."""
    if not proposal.HasField("draft_probs_shm"):
        return [proposal.draft_probs[i] for i in keep] if proposal.draft_probs else [], None
    ref = proposal.draft_probs_shm
    if links.shm_verify and keep == list(range(len(keep))):
        length = links.segment.proposal_prefix(ref.offset, ref.length, len(keep))
        return [], cpb.ShmRef(offset=ref.offset, length=length)
    dists = links.segment.read_proposal(ref.offset, ref.length)
    return [cpb.SparseProbs(token_ids=dists[i][0], probs=dists[i][1]) for i in keep], None


def proves(nonce: bytes, segment: shm.Segment, service: str) -> bool:
    """A service shares our host if it read the segment's nonce; anything else but none is a fault."""
    if not nonce:
        return False
    if nonce != segment.nonce:
        raise Failure(grpc.StatusCode.INTERNAL, f"{service} service mapped a different segment named {segment.name}")
    return True
