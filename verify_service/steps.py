"""The target's sessions and the steps of its (batched) forwards, as plain records: a session's
committed tokens and cache (TargetSession), a prompt being fed in chunks (Prefilling), one call's
rows and what to make of their logits (Step, with a Verify's checked draft: VerifyPlan), and what
a call answers (VerifyResult). verify_service.engine's Target makes and runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specsplit.model.modeling import Sequence
from specsplit.serving.grammar import Matcher
from specsplit.speculation.ewma import Ewma
from specsplit.speculation.lookup import Agreement, SequenceIndex
from specsplit.speculation.params import Logprobs, SamplingParams


class ContextFull(ValueError):
    pass


class LengthMismatch(ValueError):
    pass


@dataclass
class TargetSession:
    """Committed tokens of one sequence. The KV cache always holds tokens[:-1]: the last committed
    token (the target's own latest choice) is fed at the head of the next verify call."""

    kv: Sequence
    tokens: list[int] = field(default_factory=list)
    with_features: bool = False  # return the features of newly committed positions
    sampling: SamplingParams = SamplingParams()  # temperature 0: greedy; its method above that
    segment: object = None  # the gateway's shared-memory segment, when mapped (specsplit.serving.shm)
    logprobs: Logprobs = Logprobs()  # which log-probabilities its answers carry
    stop_tokens: frozenset[int] = frozenset()  # a decode-ahead stops after one (PrefillRequest.stop_token_ids)
    index: SequenceIndex = field(default_factory=SequenceIndex)  # prompt lookup over its tokens (decode-ahead)
    agreement: Agreement = field(default_factory=Agreement)  # how often the target follows its lookups
    matcher: Matcher | None = None  # structured output: the output's place in its language (serving.grammar)
    output_start: int = 0  # tokens[output_start:] are its output (a resumed session's prompt holds some)
    step_ms: Ewma = field(default_factory=lambda: Ewma(0.9))  # its lone one-row forwards now (verify_service.widths)
    head: object = None  # the target's feature head drafting for it here (verify_service.headdraft.HeadState)

    @property
    def needs_features(self) -> bool:
        """Its forwards keep their rows' features: its caller asked for them, or its head reads them."""
        return self.with_features or self.head is not None


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    next_token: int
    length: int
    forward_ns: int
    # With features: [num_accepted + 1, hidden] for positions [length_before - 1, length - 1).
    features: torch.Tensor | None = None
    # The accepted draft indices in order (a tree's path; 0..num_accepted-1 for a chain).
    path: tuple[int, ...] = ()
    batch_rows: int = 0  # rows of the forward that served this call (all calls in its batch)
    batch_calls: int = 0  # calls (sessions) in that forward
    cached: int = 0  # a prefill: prompt tokens whose keys and values came from the prefix cache
    logprobs: tuple = ()  # the committed tokens' (token, logprob, top ids, top logprobs), if asked
    prompt_logprobs: tuple = ()  # a prefill's prompt tokens 1.. likewise
    # Under a constraint: the draft as verified (cut to what the language allows, carried on with
    # what it forces), how many of its tokens were forced and of those accepted, and whether the
    # output is a whole sentence of the language.
    constrained: bool = False
    draft: tuple[int, ...] = ()
    forced: int = 0
    forced_accepted: int = 0
    complete: bool = False


@dataclass
class Prefilling:
    """A session's prompt being fed in chunks: its cache holds prompt[:done]; features of those
    rows so far when the session asked for them (the prefix cache's, then each chunk's)."""

    session: TargetSession
    prompt: list[int]
    done: int = 0
    cached: int = 0  # of which loaded from the prefix cache
    features: list[torch.Tensor] = field(default_factory=list)  # kept only when the session asked for them
    stored: int = 0  # prompt[:stored] is in the prefix cache (whole blocks)
    pending: list[torch.Tensor] = field(default_factory=list)  # features of prompt[stored:done]
    prompt_logprobs: list = field(default_factory=list)  # of prompt[1:done + 1], when asked
    resumed: int | None = None  # a resumed session's last committed token: appended, not chosen

    @property
    def finished(self) -> bool:
        return self.done == len(self.prompt) and len(self.session.tokens) > len(self.prompt)


@dataclass(frozen=True)
class VerifyPlan:
    """A Verify's draft as checked and fitted (Target._checked_draft), for its step's finish."""

    session: TargetSession
    length: int  # committed tokens before the call
    draft: list[int]
    proposals: list  # rejection sampling's (ids, probs) per draft token; else empty
    parents: list[int] | None  # a token tree's; None: a chain
    forced: tuple[bool, ...]  # which draft tokens the language forced


@dataclass
class Step:
    """One call's part of a (batched) forward: rows fed to its session's cache, and what to make of
    their logits (`finish(logits, features, chosen)`; the result's forward_ns is filled in by Target.run)."""

    session: TargetSession
    ids: list[int]
    # finish(logits, features, each logits row's argmax or None) -> the step's result
    finish: Callable[[torch.Tensor, torch.Tensor | None, list[int] | None], VerifyResult]
    parents: list[int] | None = None  # a token tree's rows (row -> earlier row, -1: the prefix)
    last_only: bool = False
    logits: bool = True  # False: no logits (a prefill's chunk before the last)
    features: bool = False  # the rows' features (final-norm hidden states) too
