"""The Drafter protocol and the committed-token bookkeeping every drafter session shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from specsplit.sampling import SamplingParams, gumbel, warp


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


class Proposal(NamedTuple):
    tokens: list[int]
    source: str  # which method drafted ("" when nothing was)


class DraftSession:
    """The committed sequence as the drafter knows it. Subclasses add their own caches and keep
    them consistent with `tokens` in `propose`."""

    feature_dim = 0  # width of the target features the session reads; 0: it reads none
    coupled: SamplingParams | None = None  # set for coupled sampling: draft with the verifier's noise

    def __init__(self, prompt: list[int]):
        self.tokens = list(prompt)
        self.prompt_len = len(prompt)
        self.drafting = 0  # index of the draft token being chosen (its position: len(tokens) + drafting)

    def sync(self, base_length: int, new_tokens: list[int]) -> None:
        """Roll back to `base_length` (dropping rejected guesses) and append what was committed."""
        if base_length > len(self.tokens):
            raise ValueError(f"base_length {base_length} is past the {len(self.tokens)} tokens the drafter has")
        if base_length < self.prompt_len:
            raise ValueError(f"base_length {base_length} is inside the {self.prompt_len}-token prompt")
        del self.tokens[base_length:]
        self.tokens += new_tokens

    def add_features(self, start: int, features: torch.Tensor) -> None:
        raise ValueError("this drafter does not read target features")

    @property
    def output(self) -> list[int]:
        """The committed tokens after the prompt."""
        return self.tokens[self.prompt_len:]


def choose(session: DraftSession, logits: torch.Tensor, ids: torch.Tensor | None, vocab: int) -> tuple[int, float]:
    """A model drafter's next token and its probability under the drafter: greedy, or for coupled
    sampling argmax(log q + g) with the verifier's Gumbel noise g for this absolute position.
    logits [n] cover target ids `ids` (a draft vocabulary) or the whole vocabulary (ids None)."""
    params = session.coupled
    if params is None:
        probs = logits.float().softmax(-1)
    else:
        probs = warp(logits[None], params)[0]
    if params is None or params.temperature == 0:
        k = int(probs.argmax())
    else:
        noise = gumbel(params.seed, len(session.tokens) + session.drafting, vocab)
        noise = noise if ids is None else noise[ids.cpu()]
        k = int((probs.log() + noise.to(probs.device)).argmax())
    return (k if ids is None else int(ids[k])), float(probs[k])


class Drafter(Protocol):
    description: DrafterDescription
    runs_model: bool  # False: cheap enough to run on the event loop
    memory_bytes: int  # what it holds in memory (parameters, borrowed target tensors, stores)

    def start(self, prompt: list[int]) -> DraftSession:
        """A new session holding the prompt. Cheap: model work waits for the first propose."""

    def propose(self, session: DraftSession, gamma: int) -> Proposal:
        """Up to `gamma` tokens continuing session.tokens; fewer or none when it has no guess."""

    def end(self, session: DraftSession) -> None:
        """The session is over (its output may be remembered, e.g. by a retrieval store)."""
