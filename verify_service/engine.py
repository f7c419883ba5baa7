"""The target side of speculation: prefill, verify k drafted tokens in one forward, roll back."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import TYPE_CHECKING

import torch

from specsplit.model.modeling import KVSequence, LoadedModel
from specsplit.serving import hops
from specsplit.serving.grammar import Language
from specsplit.speculation import tokentree
from specsplit.speculation.params import Logprobs, Method, SamplingParams
from specsplit.speculation.rollback import TreeRollback
from specsplit.speculation.sampling import token_logprobs
from verify_service.choice import decide
from verify_service.steps import ContextFull, LengthMismatch, Prefilling, Step, TargetSession, VerifyPlan, VerifyResult

if TYPE_CHECKING:
    from specsplit.model.prefixcache import PrefixCache


def certain(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Draft distributions for tokens drafted without sampling (a lookup's copy, a forced token):
    q is 1 on each, which rejection sampling takes as any q (accepted with probability p(x), else
    the residual is p without x, renormalized: exactly p)."""
    return [(torch.tensor([t]), torch.tensor([1.0])) for t in tokens]


class Target:
    """Runs the target model. Blocking: call from one worker thread at a time."""

    def __init__(self, lm: LoadedModel, new_sequence=None, prefix_cache: PrefixCache | None = None):
        """prefix_cache: prompts' keys and values kept for later sessions (native kernels only)."""
        self.lm = lm
        self.prefix_cache = prefix_cache
        self._new_sequence = new_sequence or (lambda: KVSequence(lm))  # a session's cache
        # Token trees need a forward that takes a tree mask and a cache that keeps one path (the
        # native kernels); transformers' forward here verifies chains.
        self.verifies_trees = isinstance(self._new_sequence(), TreeRollback)
        # Several sessions' rows in one forward: the native kernels (rows are independent there).
        # transformers' forward runs a batch's calls one after the other.
        self.batches = lm.native is not None and self.verifies_trees

    def prefill(self, prompt: list[int], with_features: bool = False, sampling: SamplingParams = SamplingParams(),
                chunk: int | None = None, language: Language | None = None) -> tuple[TargetSession, VerifyResult]:
        """Returns the new session and its first generated token (as a result with no drafts;
        features, if asked, cover the prompt); the prompt fed in chunks of `chunk` tokens (None:
        one call)."""
        prefilling = self.start_prefill(prompt, with_features, sampling, language=language)
        while True:
            result = self.run_one(self.plan_prefill(prefilling, chunk))
            if prefilling.finished:
                return prefilling.session, result

    def verify(self, session: TargetSession, length: int, draft: list[int],
               proposals: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               parents: list[int] | None = None) -> VerifyResult:
        return self.run_one(self.plan_verify(session, length, draft, proposals, parents))

    def run_one(self, step: Step) -> VerifyResult:
        outcome = self.run([step])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def start_prefill(self, prompt: list[int], with_features: bool = False,
                      sampling: SamplingParams = SamplingParams(), use_cache: bool = True,
                      logprobs: Logprobs = Logprobs(), resume: bool = False, language: Language | None = None,
                      output_tokens: int = 0, head=None) -> Prefilling:
        """A new session whose prompt is still to be fed (by plan_prefill's steps); a prefix of it
        already in the prefix cache is loaded into its cache at once (unless not use_cache, or the
        prompt's own log-probabilities are asked for: they need every prompt row's logits). With
        `resume`, the prompt's last token is the session's last committed one (PrefillRequest.resume):
        the rest is fed, and it is appended as the answer. `language`: structured output, every
        token chosen in it (a resumed session's last `output_tokens` prompt tokens are its output).
        `head`: the feature head's state for the session, where it drafts in this service."""
        sampling.check()
        logprobs.check()
        self._check_room(len(prompt) + 1)
        resumed = prompt[-1] if resume else None
        if resume:
            if len(prompt) < 2:
                raise ValueError("a resumed session holds its prompt and at least one committed token")
            prompt = prompt[:-1]
        session = TargetSession(kv=self._new_sequence(), tokens=list(prompt), with_features=with_features,
                                sampling=sampling, logprobs=logprobs,
                                output_start=len(prompt) + (1 if resume else 0) - output_tokens, head=head)
        if language is not None:
            session.matcher = language.matcher()
            if resume:
                session.matcher.consume([*prompt, resumed][-output_tokens:] if output_tokens else [])
        prefilling = Prefilling(session, list(prompt), resumed=resumed)
        # The whole prompt's room at once: grown chunk by chunk, the cache would be copied at every
        # doubling (tens of ms at thousands of tokens: a stall for every session sharing that forward).
        self._reserve(session, len(prompt))
        if self.prefix_cache is not None and use_cache and not logprobs.prompt:
            features = self.prefix_cache.load(prompt, session.kv)
            if features is not None:
                prefilling.done = prefilling.cached = prefilling.stored = len(features)
                if session.needs_features:
                    prefilling.features.append(features)
        return prefilling

    def plan_prefill(self, prefilling: Prefilling, chunk: int | None = None) -> Step:
        """The next `chunk` tokens of the prompt (None: all that are left) as a step; the last
        chunk's result is the first generated token (with the prompt's features, if asked), an
        earlier one's says only how far the prompt is (next_token -1). Any chunking gives the same
        cache and logits (the kernels are exact by construction)."""
        session, prompt, start = prefilling.session, prefilling.prompt, prefilling.done
        end = len(prompt) if chunk is None else min(len(prompt), start + max(1, chunk))
        last = end == len(prompt)  # the room: reserved for the whole prompt by start_prefill
        asked = session.logprobs

        def finish(logits: torch.Tensor | None, features, chosen: list[int] | None = None) -> VerifyResult:
            # logits [1, vocab] of the chunk's last row; [rows, vocab] when the prompt's logprobs are asked
            if asked.prompt:  # row j predicts prompt[start + j + 1]
                prefilling.prompt_logprobs += token_logprobs(logits, prompt[start + 1:end + 1], asked.top)
                logits, chosen = logits[-1:], chosen[-1:] if chosen else None
            prefilling.done = end
            if session.needs_features:
                prefilling.features.append(features)
            if self.prefix_cache is not None:
                self._keep_blocks(prefilling, features)
            if not last:
                return VerifyResult(0, -1, end, 0)
            if prefilling.resumed is not None:
                session.tokens.append(prefilling.resumed)
                return VerifyResult(0, prefilling.resumed, len(session.tokens), 0, cached=prefilling.cached)
            _, first = self._decide(session, logits, [], [], len(prompt), None, chosen)
            session.tokens.append(first)
            if session.matcher is not None:
                session.matcher.consume([first])
            features = torch.cat(prefilling.features) if session.needs_features else None
            return VerifyResult(0, first, len(session.tokens), 0, features, cached=prefilling.cached,
                                logprobs=tuple(token_logprobs(logits, [first], asked.top) if asked.generated else ()),
                                prompt_logprobs=tuple(prefilling.prompt_logprobs))

        # The prefix cache keeps every prompt row's features, so a later session that asks for them
        # can load them with the keys and values.
        chooses = last and prefilling.resumed is None
        return Step(session, prompt[start:end], finish, last_only=not asked.prompt, logits=chooses or asked.prompt,
                    features=session.needs_features or self.prefix_cache is not None)

    def plan_verify(self, session: TargetSession, length: int, draft: list[int],
                    proposals: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                    parents: list[int] | None = None, fill: int = 0, copied: bool = False) -> Step:
        """proposals: for rejection sampling, the sparse distribution (ids, probs) each draft token
        was sampled from; `copied`: the draft was copied, not sampled (the verifier's own lookup),
        and each token's q is 1 on it. parents: the draft is a token tree (draft[i]'s parent is
        draft[parents[i]], -1: the last committed token); None or a chain's parents: a chain. Under
        a constraint, a draft is cut where the language no longer allows it, and one left empty is
        filled with up to `fill` tokens the language forces. The step's finish decides what the
        target accepts and commits it (_commit_verified)."""
        plan = self._checked_draft(session, length, draft, proposals, parents, fill, copied)
        depth = max(tokentree.depths(plan.parents), default=0) if plan.parents is not None else len(plan.draft)
        self._check_room(length + depth + 1)
        self._reserve(session, len(plan.draft) + 1)
        # Feed the last committed token and the draft: row i of the logits follows the path to
        # draft[i - 1] (a chain: predicts draft[i]).
        rows = None if plan.parents is None else [-1, *(p + 1 for p in plan.parents)]
        return Step(session, [session.tokens[-1], *plan.draft], functools.partial(self._commit_verified, plan), rows,
                    features=session.needs_features)

    def _checked_draft(self, session: TargetSession, length: int, draft: list[int], proposals, parents,
                       fill: int, copied: bool) -> VerifyPlan:
        """The Verify's draft checked against the session (length, vocabulary, tree shape, proposals)
        and, under a constraint, fitted to the language."""
        if length != len(session.tokens):
            raise LengthMismatch(f"session has {len(session.tokens)} committed tokens, request says {length}")
        vocab = self.lm.vocab_size
        bad = [t for t in draft if t >= vocab]
        if bad:
            raise ValueError(f"draft token ids {bad[:4]} out of range for vocab size {vocab}")
        if parents is not None:
            tokentree.check(parents, len(draft))
            if tokentree.is_chain(parents):
                parents = None
        proposals = certain(draft) if copied and self._rejects(session) else proposals or []
        if self._rejects(session):
            self._check_proposals(draft, proposals)
        forced: tuple[bool, ...] = ()  # which draft tokens the language forced
        # A chain is cut to the language and carried on with what it forces; a tree is verified as
        # sent (its rows are masked along each path read, so a token outside the language is never
        # chosen). A forced token's q is 1 on it (exact: rejection sampling takes any q).
        if session.matcher is not None and parents is None:
            draft, keep, forced = session.matcher.fit(draft, fill)
            proposals = [*proposals[:keep], *(certain(draft[keep:]) if self._rejects(session) else ())]
        if parents is not None and not self.verifies_trees:
            raise ValueError("this target runs on transformers' forward, which verifies chains only "
                             "(Info.tree_verify is false): send no draft_parents")
        return VerifyPlan(session, length, draft, proposals, parents, forced)

    def _commit_verified(self, plan: VerifyPlan, logits: torch.Tensor, features,
                         chosen: list[int] | None = None) -> VerifyResult:
        """After the forward (logits [k+1, vocab]): the accepted path and the target's next token,
        the cache rolled back to them, the tokens committed, their features and logprobs."""
        session, length, draft, parents, forced = plan.session, plan.length, plan.draft, plan.parents, plan.forced
        try:
            path, next_token = self._decide(session, logits, draft, plan.proposals, length, parents, chosen)
        except BaseException:
            session.kv.truncate(length - 1)  # a refused call leaves the session as it was
            raise
        # Roll back by position: keep the cache for the committed prefix plus the accepted path.
        if parents is None:
            session.kv.truncate(length + len(path))
        else:
            session.kv.keep(length - 1, [0, *(i + 1 for i in path)])
        committed = [*(draft[i] for i in path), next_token]
        session.tokens += committed
        if session.matcher is not None:
            session.matcher.consume(committed)
        kept = [0, *(i + 1 for i in path)]  # the rows that chose the committed tokens, in order
        if features is not None:
            features = features[kept]
        asked = session.logprobs
        logprobs = token_logprobs(logits[kept], committed, asked.top) if asked.generated else ()
        return VerifyResult(len(path), next_token, len(session.tokens), 0, features, tuple(path),
                            logprobs=tuple(logprobs), constrained=session.matcher is not None,
                            draft=tuple(draft) if session.matcher is not None else (), forced=sum(forced),
                            forced_accepted=sum(forced[:len(path)]),
                            complete=session.matcher is not None and session.matcher.complete)

    def run(self, steps: list[Step]) -> list[VerifyResult | BaseException]:
        """The steps' rows in one forward where the kernels batch (each row's logits are those of
        its session alone), else one forward each; then each step's result, or its exception."""
        if not steps:
            return []
        hops.mark("verify.forward")
        start = time.perf_counter_ns()
        if self.batches:  # the native kernels also give each logits row's argmax (greedy's choice)
            from specsplit.model.fastllama import Feed

            outs = self.lm.native.run_choosing([Feed(s.session.kv, s.ids, s.last_only, s.parents, s.logits)
                                                for s in steps])
            outs = [(logits, hidden if s.features else None, chosen)
                    for s, (logits, hidden, chosen) in zip(steps, outs)]
        else:
            outs = [(*self._forward(s), None) for s in steps]
        forward_ns = time.perf_counter_ns() - start
        hops.mark("verify.forwarded")
        rows = sum(len(s.ids) for s in steps)
        results: list[VerifyResult | BaseException] = []
        for step, (logits, features, chosen) in zip(steps, outs):
            t = time.perf_counter_ns()
            try:
                result = step.finish(logits, features, chosen)
                results.append(dataclasses.replace(result, forward_ns=forward_ns + time.perf_counter_ns() - t,
                                                   batch_rows=rows, batch_calls=len(steps)))
            except BaseException as e:  # noqa: BLE001 -- this step's outcome, not the batch's
                results.append(e)
        return results

    def _keep_blocks(self, prefilling: Prefilling, features: torch.Tensor) -> None:
        """The prefix cache takes the whole blocks the prompt has now (each chunk's as it is done,
        so no one forward pays for copying a whole long prompt)."""
        prefilling.pending.append(features)
        upto = prefilling.done - prefilling.done % self.prefix_cache.block
        if upto <= prefilling.stored:
            return
        pending = torch.cat(prefilling.pending) if len(prefilling.pending) > 1 else prefilling.pending[0]
        self.prefix_cache.store(prefilling.prompt[:upto], prefilling.session.kv, pending, first=prefilling.stored)
        prefilling.pending = [pending[upto - prefilling.stored:]]
        prefilling.stored = upto

    def _reserve(self, session: TargetSession, rows: int) -> None:
        """Room in the session's cache before a batch runs (CacheFull fails this call alone).
        (verifies_trees, not an isinstance on the protocol: that costs ~50 us a round.)"""
        if self.verifies_trees:
            session.kv.reserve(rows)

    @staticmethod
    def _rejects(session: TargetSession) -> bool:
        return session.sampling.verification is Method.REJECTION

    @staticmethod
    def _decide(session: TargetSession, logits: torch.Tensor, draft: list[int], proposals: list, start: int,
                parents: list[int] | None, chosen: list[int] | None = None) -> tuple[list[int], int]:
        """logits [k+1, vocab]; row 0 is at absolute position `start` -> (accepted path, next token),
        under a constraint along the matcher's walk (verify_service.choice); `chosen`: each row's
        argmax where the forward took it."""
        walk = session.matcher.walk(draft, parents) if session.matcher is not None else None
        try:
            return decide(session.sampling, logits, draft, proposals, start, parents, walk, chosen)
        finally:
            if walk is not None:
                walk.close()

    def _check_proposals(self, draft: list[int], proposals: list) -> None:
        if len(proposals) != len(draft):
            raise ValueError(f"rejection sampling needs one proposal distribution per draft token: "
                             f"{len(proposals)} for {len(draft)} tokens")
        for token, (ids, q) in zip(draft, proposals):
            if len(ids) and int(ids.max()) >= self.lm.vocab_size:
                raise ValueError(f"proposal token id {int(ids.max())} out of range for vocab size {self.lm.vocab_size}")
            if not bool(((ids == token) & (q > 0)).any()):
                raise ValueError(f"draft token {token} has probability 0 in its proposal")

    @staticmethod
    def _forward(step: Step):
        tree = {} if step.parents is None else {"parents": step.parents}
        kv = step.session.kv
        if not step.logits:
            return None, kv.hidden(step.ids)
        if step.features:
            return kv.forward_with_features(step.ids, last_only=step.last_only, **tree)
        return kv.forward(step.ids, last_only=step.last_only, **tree), None

    def _check_room(self, needed: int) -> None:
        if needed > self.lm.max_context:
            raise ContextFull(f"{needed} tokens exceed the target's context of {self.lm.max_context}")
