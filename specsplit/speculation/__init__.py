"""The speculation core: plain maths, no gRPC, no services. A newcomer reads this folder to know
the round protocol, the rollback contract and the acceptance maths.

A session's round (the gateway drives it; docs/protocol.md has the messages):

1. The verifier holds the committed tokens; its cache holds all but the last (`rollback`). The
   gateway's `cursor` says where both sides stand: the verifier's length, what the drafter has not
   heard yet, the room left.
2. The drafter, told what was committed since its last proposal (`Cursor.next_propose`), proposes
   k tokens: a chain, or a token tree (`tokentree`: each token's parent, scored by the drafter's
   estimate that the target follows the path to it), drawn as `drafting` says (greedy, coupled
   with the verifier's noise, or sampled from q with q sent along for rejection sampling).
3. The verifier feeds the last committed token and the drafts in one forward (a tree's rows see
   only their own path) and walks them (`acceptance`): the longest path the target agrees with,
   then its own token at the first disagreement (recovered) or after the last draft (bonus). At
   temperature > 0 the walk is lossless: coupled choice with the shared (seed, position) noise
   (`sampling`), or rejection sampling with the residual distribution, sibling by sibling.
4. Both sides roll back by position to the committed length (`rollback.truncate`; a tree's cache
   keeps one path with `TreeRollback.keep`), the gateway commits the verdict (`Cursor.commit`), and
   the next round starts from there.

Modules: `sampling` (warp, the seeded noise streams, coupled choice), `tokentree` (trees, best-first
selection, the verify cost curve and the gain-based cut), `drafting` (what a drafter proposes and
the draws losslessness depends on), `acceptance` (greedy, coupled and rejection walks over chains
and trees), `rollback` (the cache contracts), `cursor` (a request's place in the protocol),
`ewma` (the decayed mean the controller and the hybrid drafter learn with), `lookup` (prompt
lookup's bigram index: a copy in sight, and what followed it)."""
