"""The round protocol's bookkeeping (specsplit.speculation.cursor): whatever the verdicts, a drafter that
does what a Propose says (roll back to base, append the new tokens) holds exactly the committed
tokens plus at most the block it was told ahead; and no round drafts past the budget or the context."""

import random

from specsplit.speculation.cursor import Cursor


class Drafter:
    """Rolls back by position, as every drafter does (docs/architecture.md#one-round)."""

    def __init__(self, prompt):
        self.tokens = list(prompt)

    def hear(self, base, new):
        assert base <= len(self.tokens), "told a base beyond what it holds"
        self.tokens = self.tokens[:base] + list(new)


def test_drafter_view_matches_the_committed_tokens_under_any_verdicts():
    rng = random.Random(0)
    for trial in range(200):
        prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]
        budget, context = rng.randrange(1, 40), len(prompt) + rng.randrange(2, 60)
        cursor, drafter = Cursor(budget, context), Drafter(prompt)
        first = rng.randrange(1000)
        committed = [*prompt, first]
        cursor.start(len(prompt), first, len(committed))
        predrafted = False
        for _ in range(budget):  # every round commits at least one token
            if cursor.finish():
                break
            gamma = cursor.draft_room(rng.randrange(1, 8))
            assert gamma <= budget - cursor.generated - 1 and gamma <= context - cursor.length - 1
            drafts = []
            if gamma >= 1 and not predrafted:
                drafter.hear(*cursor.next_propose())
                assert drafter.tokens == committed
                drafts = [rng.randrange(1000) for _ in range(gamma)]
            elif predrafted:
                drafts = [rng.randrange(1000) for _ in range(max(gamma, 0))]
            accepted = rng.randrange(len(drafts) + 1)
            nxt = rng.randrange(1000)
            # a pre-draft: the drafter is told the block and its guess while the verify runs
            guess = rng.randrange(1000) if drafts and rng.random() < 0.4 else None
            if guess is not None:
                drafter.hear(*cursor.next_propose([*drafts, guess]))
                if rng.random() < 0.5:  # the assumption holds: all accepted, the guess is the target's
                    accepted, nxt = len(drafts), guess
            tokens = [*drafts[:accepted], nxt]
            hit = guess is not None and accepted == len(drafts) and nxt == guess
            committed += tokens
            cursor.commit(tokens, len(committed), drafter_holds_them=hit)
            predrafted = hit
            assert cursor.length == len(committed) and cursor.last == tokens
            assert cursor.generated == len(committed) - len(prompt)
            if hit:
                assert drafter.tokens == committed
        # the release tells the drafter the rest
        drafter.hear(cursor.base, cursor.unheard)
        assert drafter.tokens == committed
        assert cursor.generated <= budget and cursor.length <= context
        assert cursor.finish() == ("length" if cursor.generated >= budget else "context")


def test_a_round_without_a_propose_keeps_the_unheard_tokens():
    cursor = Cursor(max_new_tokens=10, max_context=100)
    cursor.start(3, 7, 4)
    cursor.commit([8], 5, drafter_holds_them=False)  # a round with no room to draft: no Propose
    assert cursor.next_propose() == (3, [7, 8])
    assert cursor.next_propose() == (5, [])
