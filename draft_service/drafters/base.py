"""The Drafter protocol and the committed-token bookkeeping every drafter session shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DrafterDescription:
    name: str
    kind: str
    model_id: str = ""
    tokenizer_fingerprint: str = ""  # empty: works on ids alone, fits any tokenizer
    param_bytes: int = 0
    dtype: str = ""
    device: str = ""


class DraftSession:
    """The committed sequence as the drafter knows it. Subclasses add their own caches and keep
    them consistent with `tokens` in `propose`."""

    def __init__(self, prompt: list[int]):
        self.tokens = list(prompt)

    def sync(self, base_length: int, new_tokens: list[int]) -> None:
        """Roll back to `base_length` (dropping rejected guesses) and append what was committed."""
        if base_length > len(self.tokens):
            raise ValueError(f"base_length {base_length} is past the {len(self.tokens)} tokens the drafter has")
        del self.tokens[base_length:]
        self.tokens += new_tokens


class Drafter(Protocol):
    description: DrafterDescription
    runs_model: bool  # False: cheap enough to run on the event loop

    def start(self, prompt: list[int]) -> DraftSession:
        """A new session holding the prompt. Cheap: model work waits for the first propose."""

    def propose(self, session: DraftSession, gamma: int) -> list[int]:
        """Up to `gamma` tokens continuing session.tokens; fewer or none when it has no guess."""
