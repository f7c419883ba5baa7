"""The lossless test's controls: the verify service with a deliberately broken acceptance rule for
each method, run as its own process (`python -m brokenverify` + the `serve verify` flags), so the
statistical test shows it catches the mistakes it is there to catch, through the real services."""

from __future__ import annotations

import os
import sys


def broken_rejection_accept(probs, draft, proposals, seed, start, parents=None):
    """Rejection sampling with the classic mistake: every draft tested against p, and resampling
    from p instead of the residual norm(max(0, p - q)) (over a chain or a tree's siblings)."""
    from specsplit.speculation.sampling import ACCEPT, RESAMPLE, SIBLING_ACCEPT, sample, uniform

    parents = list(range(-1, len(draft) - 1)) if parents is None else parents
    path, row = [], 0
    for _ in range(len(draft) + 1):  # a node accepted each time but the last
        position = start + len(path)
        kids = [i for i, parent in enumerate(parents) if parent + 1 == row]
        for j, child in enumerate(kids):
            ids, q = proposals[child]
            q_tok = float(q[ids == draft[child]].sum())
            if uniform(seed, position, ACCEPT if j == 0 else SIBLING_ACCEPT + j) < min(
                    1.0, float(probs[row][draft[child]]) / q_tok):
                path.append(child)
                row = child + 1
                break
        else:
            return path, sample(probs[row], seed, position, RESAMPLE), "recovered" if kids else "bonus"
    raise AssertionError("a path longer than the draft")


def broken_coupled_accept(probs, draft, seed, start, parents=None):
    """Coupled verification with a plausible mistake: a draft token the target could have chosen
    (p > 0) is accepted, instead of only the one its (seed, position) noise chooses."""
    from specsplit.speculation.sampling import coupled_choice

    parents = list(range(-1, len(draft) - 1)) if parents is None else parents
    path, row = [], 0
    for _ in range(len(draft) + 1):
        nxt = next((i for i, parent in enumerate(parents) if parent + 1 == row and float(probs[row][draft[i]]) > 0),
                   None)
        if nxt is None:
            return path, coupled_choice(probs[row], seed, start + len(path))
        path.append(nxt)
        row = nxt + 1
    raise AssertionError("a path longer than the draft")


if __name__ == "__main__":
    from specsplit.cli.serve import quiet_spin

    quiet_spin(os.environ)  # as `specsplit serve` does, before torch is imported
    from specsplit.cli import main
    from verify_service import choice

    choice.rejection_accept, choice.coupled_accept = broken_rejection_accept, broken_coupled_accept
    sys.argv = ["specsplit", "serve", "verify", *sys.argv[1:]]
    sys.exit(main())
