"""Retrieval or a neural drafter (the self head, or a draft model: "the head" below), chosen per
round by expected gain. Each source's accepted drafts
per round are learnt within the session (the next Propose's sync shows how many of the last
drafts the target kept): an n-gram match by its length (1, 2, 3+ tokens), the head as one source.
A round's value is (expected accepted + 1) / (the cost of verifying its drafts + the source's own
cost, in target steps), and drafting nothing is worth 1; the verify cost by width comes from the
verifier's measurement (StartSession), the head's cost is its measured drafting time over the
rest of a round (the time between Proposes less the head's own). Priors give the old
fixed order before anything is learnt: a match of `min_match` tokens or more, then the head,
then a shorter match; the head drafting nothing (unsure) lets a match fill in. A session of a task
type the service has seen starts instead from the means earlier sessions of that type learnt."""

from __future__ import annotations

import time
from collections import OrderedDict

from draft_service.drafters.base import DrafterDescription, DraftSession, Steps, drive, is_stepped, steps_of
from draft_service.drafters.ngram import NgramDrafter
from specsplit.speculation.drafting import Proposal
from specsplit.speculation.ewma import Ewma
from specsplit.speculation.tokentree import chain, follow

DECAY = 0.8  # per round: recent rounds weigh most (a session's text changes character)
PRIOR_WEIGHT = 2.0  # the priors count as this many rounds
HEAD_COST = 0.1  # the head's cost per drafted token in target steps until measured
HEAD = "head"  # the neural source's key among the learnt means (the n-gram's are its match lengths)
TASK_DECAY = 0.98  # per round, for the means a task type keeps across sessions
TASK_TYPES = 64  # task types remembered (labels come from clients)
EXPLORE = 8  # every n-th session of a task type starts from the default priors


def _prior(value: float) -> Ewma:
    """A decayed mean of accepted drafts per round that starts from `value`, worth PRIOR_WEIGHT rounds."""
    mean = Ewma(DECAY)
    mean.add(value, PRIOR_WEIGHT)
    return mean


class _Choice:
    """What the hybrid learns within one session."""

    def __init__(self, min_match: int, task: dict | None = None, explore: bool = False):
        # Priors: what earlier sessions of the task type learnt (`task`, which this session's
        # rounds teach in turn), else (or exploring) the old order: long match (1.5) > head (1.0)
        # > short match (0.4).
        defaults = {1: 0.4, 2: 0.4, 3: 0.4, HEAD: 1.0}
        defaults.update({n: 1.5 for n in (1, 2, 3) if n >= min_match})
        self.task = task if task is not None else {}
        learnt = {} if explore else self.task
        self.means = {k: _prior(learnt[k].value if isinstance(learnt.get(k), Ewma) else v)
                      for k, v in defaults.items()}
        # Last round's drafts: (position, tokens, parents or None for a chain, each token's source).
        self.pending: tuple[int, list[int], list[int] | None, list[object]] | None = None
        self.head_ms = Ewma(DECAY)  # the head's time per run, empty ones too (not its first: that feeds the prompt)
        self.rest_ms = Ewma(DECAY)  # the time between Proposes less the head's drafting: verify and overheads
        self.last_head_ms = 0.0  # the head's drafting time in the round that ended at the next Propose
        self.head_runs = 0
        self.last_call = 0.0


class HybridDrafter:

    def __init__(self, ngram: NgramDrafter, head, min_match: int = 2, name: str = "hybrid"):
        """head: a drafter with steps() (SelfDrafter or ModelDrafter); its kind names its drafts."""
        self.ngram, self.head, self.min_match = ngram, head, min_match
        self.source = head.description.kind
        self.thread_invariant = head.thread_invariant
        self._tasks: OrderedDict[str, dict] = OrderedDict()  # task type -> source -> Ewma, across sessions
        d = head.description
        self.description = DrafterDescription(
            name=name, kind="hybrid", model_id=d.model_id, tokenizer_fingerprint=d.tokenizer_fingerprint,
            param_bytes=d.param_bytes, dtype=d.dtype, device=d.device, needs_features=d.needs_features,
            target_model_fingerprint=d.target_model_fingerprint)

    @property
    def memory_bytes(self) -> int:
        return self.head.memory_bytes  # the store is shared with the ngram drafter, counted there

    def start(self, prompt: list[int]) -> DraftSession:
        session = self.head.start(prompt)
        session.choice = None  # made at the first propose, once the task type is known
        return session

    def _task(self, task_type: str) -> dict:
        """The service-wide means of a task type (the most recent TASK_TYPES types are kept)."""
        means = self._tasks.pop(task_type, None) or {}
        self._tasks[task_type] = means
        while len(self._tasks) > TASK_TYPES:
            self._tasks.popitem(last=False)
        return means

    @property
    def runner(self):
        return self.head.runner if is_stepped(self.head) else None

    def propose(self, session: DraftSession, gamma: int, budget: int = 0) -> Proposal:
        return drive(self.steps(session, gamma, budget), self.runner)

    def steps(self, session: DraftSession, gamma: int, budget: int = 0) -> Steps:
        """propose() as the head's steps (base.Steps); the head's time includes the other sessions'
        steps it was batched with: what the round waited for."""
        if session.choice is None:
            task = self._task(session.task_type)
            task["sessions"] = task.get("sessions", 0) + 1
            # Every EXPLORE-th session of a type starts from the default priors, so that a source
            # the type stopped using is measured again.
            session.choice = _Choice(self.min_match, task, explore=task["sessions"] % EXPLORE == 0)
        choice = _learn(session)
        drafts, n = self.ngram.match(session, gamma)
        key = min(n, 3)
        # Tokens per round over the round's cost in target steps: verifying k drafts costs
        # width_cost(k) (measured by the verifier), the head its own drafting time on top.
        head_value = (choice.means[HEAD].value + 1) / (session.width_cost(gamma) + self._head_cost(choice, gamma))
        # Drafting nothing is worth 1 (the target's own token, at no extra cost): the head must beat
        # that as well as the match.
        match_value = (min(choice.means[key].value, len(drafts)) + 1) / session.width_cost(len(drafts)) \
            if drafts else 1.0
        proposal = None
        if head_value > match_value:
            started = time.perf_counter()
            proposal = yield from steps_of(self.head, session, gamma, budget)
            choice.last_head_ms = (time.perf_counter() - started) * 1e3
            choice.head_runs += 1
            if choice.head_runs > 1:
                choice.head_ms.add(choice.last_head_ms)
            if not proposal.tokens:  # unsure, it drafted nothing: that is what running it earned
                choice.means[HEAD].add(0.0)
                choice.task.setdefault(HEAD, Ewma(TASK_DECAY)).add(0.0)
        if budget > 1 and not session.rejects:
            return self._tree(session, choice, proposal, gamma, budget)
        if proposal is None or not proposal.tokens:
            # Under rejection sampling the sources are not merged (a merged node has no one q).
            proposal = self.ngram.propose(session, gamma, budget) if budget > 1 else \
                Proposal(drafts, "ngram" if drafts else "")
        source = HEAD if proposal.source == self.source else key
        choice.pending = (len(session.tokens), list(proposal.tokens), proposal.parents,
                          [source] * len(proposal.tokens))
        return proposal

    def _tree(self, session: DraftSession, choice: _Choice, head: Proposal | None, gamma: int,
              budget: int) -> Proposal:
        """The union of the retrieval tree (scored with this session's learnt reliability per match
        length) and the head's tree when it ran, cut to the best `budget` nodes."""
        # A source's mean accepted per round m as a per-token chance r (a geometric run: m = r / (1 - r)).
        reliability = {k: m.value / (1 + m.value) for k, m in choice.means.items() if k != HEAD}
        tree, n = self.ngram.tree(session, gamma, reliability=reliability)
        if head is not None and head.tokens:
            nodes: list[int] = []
            for token, parent, score in zip(head.tokens, head.parents or chain(len(head.tokens)),
                                            head.scores or [1.0] * len(head.tokens)):
                nodes.append(tree.add(nodes[parent] if parent >= 0 else -1, token, score, HEAD))
        key = min(n, 3)
        tokens, parents, scores, sources = tree.select(budget, gamma)
        sources = [HEAD if s == HEAD else key for s in sources]
        choice.pending = (len(session.tokens), tokens, parents, sources) if tokens else None
        names = {self.source if s == HEAD else "ngram" for s in sources}
        source = "+".join(sorted(names)) if names else ""
        return Proposal(tokens, source, None, parents, scores)

    def _head_cost(self, choice: _Choice, gamma: int) -> float:
        """The head's drafting time per round in target steps: over the rest of a round (its verify),
        measured on every round, so rounds that did not draft with the head do not bias it."""
        head, rest = choice.head_ms.value, choice.rest_ms.value
        if head is None or not rest:
            return HEAD_COST * gamma
        return head / rest

    def end(self, session: DraftSession) -> None:
        self.ngram.end(session)


def _learn(session: DraftSession) -> _Choice:
    """Counts how many of the last round's drafts the target kept, now that the sync told us, and
    times the round; the task type's means (across sessions) learn it too."""
    choice: _Choice = session.choice
    now = time.perf_counter()
    if choice.last_call:
        choice.rest_ms.add(max(0.0, (now - choice.last_call) * 1e3 - choice.last_head_ms))
    choice.last_head_ms = 0.0
    choice.last_call = now
    if choice.pending is not None:
        at, drafts, parents, sources = choice.pending
        kept = session.tokens[at:]
        if len(kept) <= len(drafts) + 1:  # exactly one round committed (not a pre-draft's assumption)
            # Each source that drafted a first token learns how far the accepted path ran on its nodes.
            path = _accepted_path(drafts, parents, kept)
            for source in {s for s, p in zip(sources, parents or chain(len(drafts))) if p == -1}:
                run = 0
                while run < len(path) and sources[path[run]] == source:
                    run += 1
                choice.means[source].add(run)
                choice.task.setdefault(source, Ewma(TASK_DECAY)).add(run)
        choice.pending = None
    return choice


def _accepted_path(drafts: list[int], parents: list[int] | None, kept: list[int]) -> list[int]:
    """The draft indices the committed tokens `kept` followed (a chain when parents is None)."""
    return follow(lambda row, depth: kept[depth] if depth < len(kept) else -1, drafts, parents)[0]
