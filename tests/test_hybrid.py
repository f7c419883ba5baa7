"""The hybrid's choice: before it has learnt anything, a long n-gram match, then the head, then a
short match; then by the accepted drafts each source earned in the session."""

from types import SimpleNamespace

from conftest import Clock

from draft_service.drafters import hybrid as hybrid_module
from draft_service.drafters.base import DrafterDescription, DraftSession
from draft_service.drafters.hybrid import HybridDrafter
from draft_service.drafters.ngram import NgramDrafter
from specsplit.speculation.drafting import Proposal


class Head:
    """A self-drafter stand-in that proposes a fixed answer (empty: unsure)."""

    description = DrafterDescription(name="self", kind="self", needs_features=True)
    memory_bytes = 0
    thread_invariant = True

    def __init__(self, answer):
        self.answer = answer

    def start(self, prompt):
        return DraftSession(prompt)

    def propose(self, session, gamma, budget=0):
        return Proposal(self.answer[:gamma], "self" if self.answer else "")


HEAD_S, VERIFY_S = 0.001, 0.004  # a head costing about a quarter of the rest of a round, as a real one may


class SlowHead(Head):
    """A head whose drafting takes HEAD_S on `clock` (the hybrid's clock in the test), so that its
    measured cost is a real share of a round (an instant stand-in would make drafting look free, and
    any acceptance worth it) and this machine's load cannot change the verdict."""

    def __init__(self, answer, clock):
        super().__init__(answer)
        self.clock = clock

    def propose(self, session, gamma, budget=0):
        self.clock.now += HEAD_S
        return super().propose(session, gamma, budget)


def test_long_match_beats_the_head():
    hybrid = HybridDrafter(NgramDrafter(), Head([42]), min_match=2)
    session = hybrid.start([5, 6, 7, 8, 5, 6])
    assert hybrid.propose(session, 2) == Proposal([7, 8], "ngram")


def test_head_beats_a_short_match_and_the_short_match_fills_in_when_it_is_unsure():
    session_tokens = [5, 6, 7, 9, 7]  # only a 1-token match: (7) -> 9

    def propose(head: list[int], tokens: list[int]) -> Proposal:
        hybrid = HybridDrafter(NgramDrafter(), Head(head), 2)
        return hybrid.propose(hybrid.start(tokens), 3)

    assert propose([42, 43], session_tokens) == Proposal([42, 43], "self")
    assert propose([], session_tokens) == Proposal([9, 7], "ngram")
    assert propose([], [1, 2, 3]) == Proposal([], "")


def test_the_source_that_keeps_getting_accepted_wins():
    # The text repeats "1 2 3 4" with one-token matches everywhere (1 -> 2 -> 3 -> 4 -> 1...), and the
    # head is always wrong: after a few rounds the hybrid trusts the short match it started by doubting.
    hybrid = HybridDrafter(NgramDrafter(max_n=1), Head([42, 43]), min_match=2)
    session = hybrid.start([1, 2, 3, 4, 1])
    sources = []
    for _ in range(8):
        last = session.tokens[-1]
        following = [(last + i) % 4 + 1 for i in range(4)]  # the cycle continues
        proposal = hybrid.propose(session, 3)
        accepted = next((i for i, t in enumerate(proposal.tokens) if t != following[i]), len(proposal.tokens))
        session.sync(len(session.tokens), following[:accepted + 1])
        sources.append(proposal.source)
    assert sources[0] == "self" and sources[-1] == "ngram", sources
    assert sources[-3:] == ["ngram"] * 3


def test_wide_verifies_that_cost_more_keep_a_doubtful_head_idle():
    """The head's prior (1 accepted per round) pays where verifying 3 drafts costs what one token
    does, not where it costs 2.5 target steps (the verifier's measured curve, sent at StartSession)."""
    tokens = [1, 2, 3]  # no n-gram match: the head or nothing
    for curve, expected in (([10.0] * 5, [42, 43, 44]), ([10.0, 15.0, 20.0, 25.0, 30.0], [])):
        hybrid = HybridDrafter(NgramDrafter(), Head([42, 43, 44]), 2)
        session = hybrid.start(tokens)
        session.verify_ms_by_rows = curve
        assert session.width_cost(3) == curve[3] / curve[0]
        assert hybrid.propose(session, 3).tokens == expected


def test_with_a_budget_the_hybrid_proposes_the_union_of_match_and_head():
    hybrid = HybridDrafter(NgramDrafter(), Head([7, 9]), min_match=3)
    session = hybrid.start([5, 6, 7, 8, 5, 6])  # a 2-token match: (5 6) -> 7 8; the head says 7 9
    proposal = hybrid.propose(session, 2, budget=4)
    assert proposal.parents is not None and proposal.source == "ngram+self"
    paths = {tuple(proposal.tokens[j] for j in (i, p)) for i, p in enumerate(proposal.parents) if p >= 0}
    assert proposal.tokens[0] == 7 and {(8, 7), (9, 7)} <= paths


def test_a_task_type_starts_from_what_its_earlier_sessions_learnt(monkeypatch):
    """The head is always wrong on "rewrite": a later rewrite session starts without it (nothing
    matched, nothing drafted), a session of another type still starts with it, and every 8th
    rewrite session starts from the default priors again (re-measuring the head)."""
    clock = Clock()
    monkeypatch.setattr(hybrid_module, "time", SimpleNamespace(perf_counter=clock))
    hybrid = HybridDrafter(NgramDrafter(), SlowHead([42, 43], clock), min_match=2)

    def session(task: str):
        s = hybrid.start([1, 2, 3])
        s.task_type = task
        return s

    first = session("rewrite")
    sources = []
    for i in range(12):  # the head drafts, the target never agrees (and nothing repeats)
        sources.append(hybrid.propose(first, 2).source)
        clock.now += VERIFY_S  # the rest of a round: the head's cost is measured against it
        first.sync(len(first.tokens), [100 + i])
    assert sources[0] == "self" and sources[-1] == ""  # it learnt within the session
    assert hybrid.propose(session("rewrite"), 2) == Proposal([], "")
    assert hybrid.propose(session("code"), 2).source == "self"
    sources = [hybrid.propose(session("rewrite"), 2).source for _ in range(6)]  # sessions 3..8
    assert sources == [""] * 5 + ["self"]


class CountingHead(Head):
    """An unsure head (drafts nothing) that counts how often it is run; each run takes HEAD_S on
    `clock` (the hybrid's clock in the test: this machine's load cannot change the verdict)."""

    def __init__(self, clock):
        super().__init__([])
        self.runs, self.clock = 0, clock

    def propose(self, session, gamma, budget=0):
        self.runs += 1
        self.clock.now += HEAD_S
        return super().propose(session, gamma, budget)


def test_a_head_that_drafts_nothing_is_soon_left_idle(monkeypatch):
    """Running an unsure head costs its time and earns nothing: the hybrid learns that as it learns a
    rejected draft (such runs were once not counted, and the head ran every round for nothing)."""
    clock = Clock()
    monkeypatch.setattr(hybrid_module, "time", SimpleNamespace(perf_counter=clock))
    head = CountingHead(clock)
    hybrid = HybridDrafter(NgramDrafter(), head, min_match=2)
    session = hybrid.start([1, 2, 3])  # nothing to match
    runs = []
    for i in range(40):
        assert hybrid.propose(session, 3) == Proposal([], "")
        clock.now += VERIFY_S  # the rest of the round: its verify
        session.sync(len(session.tokens), [10 + i])
        runs.append(head.runs)
    assert runs[9] <= 4 and runs[-1] == runs[9], runs  # a few tries, then idle
