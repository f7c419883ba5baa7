"""The Drafter protocol and the committed-token bookkeeping every drafter session shares."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specsplit.speculation.drafting import Proposal
from specsplit.speculation.lookup import SequenceIndex
from specsplit.speculation.params import Method, SamplingParams
from specsplit.speculation.tokentree import verify_ms

GREEDY = SamplingParams()


@dataclass(frozen=True)
class DrafterDescription:
    name: str
    kind: str
    model_id: str = ""
    tokenizer_fingerprint: str = ""  # empty: works on ids alone, fits any tokenizer
    param_bytes: int = 0
    dtype: str = ""
    device: str = ""
    needs_features: bool = False
    target_model_fingerprint: str = ""  # empty: not tied to one target's weights


class DraftSession:
    """The committed sequence as the drafter knows it. Subclasses add their own caches and keep
    them consistent with `tokens` in `propose`."""

    feature_dim = 0  # width of the target features the session reads; 0: it reads none
    sampling: SamplingParams = GREEDY  # the session's sampling, as the verifier applies it
    proposal_top_k = 16  # rejection: sample from (and send) the drafter's top-k, renormalised
    verify_ms_by_rows: list[float] = []  # the target's verify time by rows (StartSession); empty: unknown
    task_type = ""  # the request's label (StartSession)

    def __init__(self, prompt: list[int]):
        self.tokens = list(prompt)
        self.index = SequenceIndex()  # retrieval over `tokens` (the n-gram drafter's, the hybrid's)
        self.prompt_len = len(prompt)
        self.drafting = 0  # index of the draft token being chosen (its position: len(tokens) + drafting)

    def sync(self, base_length: int, new_tokens: list[int]) -> None:
        """Roll back to `base_length` (dropping rejected guesses) and append what was committed."""
        if base_length > len(self.tokens):
            raise ValueError(f"base_length {base_length} is past the {len(self.tokens)} tokens the drafter has")
        if base_length < self.prompt_len:
            raise ValueError(f"base_length {base_length} is inside the {self.prompt_len}-token prompt")
        self.index.truncate(self.tokens, base_length)
        del self.tokens[base_length:]
        self.tokens += new_tokens

    def add_features(self, start: int, features: torch.Tensor) -> None:
        raise ValueError("this drafter does not read target features")

    def width_cost(self, drafts: int) -> float:
        """Verifying `drafts` tokens against none, in target steps (1.0 when unknown)."""
        curve = self.verify_ms_by_rows
        if not curve or drafts <= 0:
            return 1.0
        return verify_ms(curve, drafts + 1) / curve[0]

    @property
    def rejects(self) -> bool:
        """Rejection sampling: drafts are drawn from q, and token trees keep a layout fixed before the draws."""
        return self.sampling.verification is Method.REJECTION

    @property
    def output(self) -> list[int]:
        """The committed tokens after the prompt."""
        return self.tokens[self.prompt_len:]


class Drafter(Protocol):
    description: DrafterDescription
    memory_bytes: int  # what it holds in memory (parameters, borrowed target tensors, stores)
    # its drafts' bits do not depend on the thread count (no model, or the native kernels): the
    # service may then tune the team size per forward (specsplit.serving.threadtune)
    thread_invariant: bool

    def start(self, prompt: list[int]) -> DraftSession:
        """A new session holding the prompt. Cheap: model work waits for the first propose."""

    def propose(self, session: DraftSession, gamma: int, budget: int = 0) -> Proposal:
        """Up to `gamma` tokens continuing session.tokens; fewer or none when it has no guess. With
        budget > 1, a token tree of up to `budget` tokens, `gamma` deep (or still a chain)."""

    def end(self, session: DraftSession) -> None:
        """The session is over (its output may be remembered, e.g. by a retrieval store)."""


# A drafter's propose as a generator of model steps: it yields what it needs computed (a step
# object its runner takes), is sent the runner's result for it, and returns the Proposal. Drafters
# whose work batches across sessions offer `steps(session, gamma, budget) -> Steps` beside
# propose, and `runner` (whose `run(steps) -> results` takes several sessions' steps at once).
Steps = Generator[object, object, Proposal]


@runtime_checkable
class Stepped(Protocol):
    """A drafter whose work can share a runner with other sessions' (model drafters)."""

    runner: object  # run(steps) -> results: several sessions' steps in one call

    def steps(self, session: DraftSession, gamma: int, budget: int) -> Steps: ...


_STEPPED: dict[type, bool] = {}


def is_stepped(drafter) -> bool:
    """isinstance(drafter, Stepped), read once per class: a runtime protocol check costs 10-30 us,
    and a round asked it twice (our drafters' classes say it for all their instances)."""
    kind = type(drafter)
    if kind not in _STEPPED:
        _STEPPED[kind] = isinstance(drafter, Stepped)
    return _STEPPED[kind]


def steps_of(drafter, session: DraftSession, gamma: int, budget: int = 0) -> Steps:
    """A drafter's steps; for one without them, its propose as steps that need no runner."""
    if is_stepped(drafter):
        return (yield from drafter.steps(session, gamma, budget))
    return drafter.propose(session, gamma, budget)


def drive(steps: Steps, runner) -> Proposal:
    """Runs one session's steps alone."""
    try:
        step = next(steps)
        while True:
            step = steps.send(runner.run([step])[0])
    except StopIteration as done:
        return done.value


def drive_all(work: list[tuple[Steps, object]]) -> list[Proposal | BaseException]:
    """Several sessions' (steps, runner) in lock-step: at each turn every unfinished session's next
    step, one runner.run per runner over all of them; per session its Proposal or exception."""
    outcomes: list[Proposal | BaseException | None] = [None] * len(work)
    pending: dict[int, object] = {}

    def advance(i: int, value=None, first: bool = False) -> None:
        try:
            pending[i] = next(work[i][0]) if first else work[i][0].send(value)
        except StopIteration as done:
            outcomes[i] = done.value
        except Exception as e:  # noqa: BLE001 -- this session's outcome
            outcomes[i] = e

    for i in range(len(work)):
        advance(i, first=True)
    while pending:
        turn, pending = pending, {}
        by_runner: dict[int, list[int]] = {}
        for i in turn:
            by_runner.setdefault(id(work[i][1]), []).append(i)
        for members in by_runner.values():
            try:
                results = work[members[0]][1].run([turn[i] for i in members])
            except Exception as e:  # noqa: BLE001 -- the batch's sessions fail, not the service
                for i in members:
                    outcomes[i] = e
                continue
            for i, result in zip(members, results):
                advance(i, result)
    return outcomes
