"""A request's place in the round protocol (docs/architecture.md#one-round), as the gateway keeps it
between rounds: plain values, no gRPC.

* The verifier holds `length` committed tokens (its cache: all but the last one, which the next
  Verify feeds first).
* The drafter has heard every committed token before position `base`; `unheard` are the committed
  tokens from `base` on that it has not. A Propose (or the EndSession) carries them, with `base`,
  and the drafter rolls its own state back to `base` before appending them: `next_propose()`.
* A verdict commits the accepted drafts and the target's next token: `commit()`. When a pre-draft
  assumed exactly that outcome, the drafter already holds them.
* `output` is every token committed after the prompt: with the prompt, what a session re-opened on
  another verifier is prefilled with (the last of them still to be fed).
* A round drafts at most `draft_room(gamma)` tokens, so that accepted + 1 fits the output budget and the
  context; `finish()` says when neither has room left."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Cursor:
    max_new_tokens: int
    max_context: int
    length: int = 0  # committed tokens on the verifier
    base: int = 0  # position of unheard[0]
    unheard: list[int] = field(default_factory=list)  # committed tokens the drafter has not heard of
    output: list[int] = field(default_factory=list)  # the tokens committed after the prompt
    last: list[int] = field(default_factory=list)  # the tokens the last step committed

    @property
    def generated(self) -> int:
        return len(self.output)

    def start(self, prompt_length: int, first_token: int, length: int) -> None:
        """After the prefill: the prompt is on both sides, and the target's first token committed."""
        self.base, self.unheard, self.last = prompt_length, [first_token], [first_token]
        self.length, self.output = length, [first_token]

    def draft_room(self, gamma: int) -> int:
        """Largest gamma whose accepted + 1 tokens fit max_new_tokens and the context."""
        return min(gamma, self.max_new_tokens - self.generated - 1, self.max_context - self.length - 1)

    def finish(self) -> str:
        """'length' or 'context' once no token fits, else ''."""
        if self.generated >= self.max_new_tokens:
            return "length"
        if self.length >= self.max_context:
            return "context"
        return ""

    def next_propose(self, ahead: list[int] = ()) -> tuple[int, list[int]]:
        """What the next Propose tells the drafter: `base` and the unheard tokens (a pre-draft adds
        the block under verification and the guess after it, `ahead`). They count as heard from now
        on: a Propose that fails fails the request or its drafter, never half of it."""
        told = self.base, [*self.unheard, *ahead]
        self.base, self.unheard = self.length, []
        return told

    def commit(self, tokens: list[int], length: int, drafter_holds_them: bool) -> None:
        """A verdict: `tokens` committed, the verifier now at `length`. Rounds without a Propose (no
        room left to draft) keep adding to what the drafter has not heard."""
        self.last = tokens
        if drafter_holds_them:
            self.base, self.unheard = length, []
        else:
            self.unheard = [*self.unheard, *tokens]
        self.length = length
        self.output += tokens
