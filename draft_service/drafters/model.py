"""A causal LM drafting greedily, with its own KV cache that follows the committed tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draft_service.drafters.base import (
    Choice,
    DrafterDescription,
    DraftSession,
    Proposal,
    Steps,
    chain_tree,
    choose,
    drive,
    sampled_from,
)
from specsplit.fastllama import Feed
from specsplit.modeling import KVSequence, LoadedModel, Sequence

DRAFT_VOCAB_FILE = "draft_vocab.json"  # written by `specsplit distill --kind model`


class ModelSession(DraftSession):
    def __init__(self, prompt: list[int], kv: Sequence):
        super().__init__(prompt)
        self.kv = kv
        self.fed: list[int] = []  # the tokens whose keys/values kv holds, in order


class ModelDrafter:

    def __init__(self, lm: LoadedModel, name: str = "model", model_dir: str | Path | None = None):
        self.lm = lm
        # A distilled draft scores only its draft vocabulary (most of a small model's cost is the head).
        vocab_file = Path(model_dir) / DRAFT_VOCAB_FILE if model_dir else None
        self.vocab_ids = self.rows = None
        if vocab_file is not None and vocab_file.is_file():
            self.vocab_ids = torch.tensor(json.loads(vocab_file.read_text()), dtype=torch.long, device=lm.device)
            self.rows = lm.model.get_output_embeddings().weight.detach()[self.vocab_ids]
        self.description = DrafterDescription(
            name=name, kind="model", model_id=lm.model_id, tokenizer_fingerprint=lm.fingerprint,
            param_bytes=lm.param_bytes, dtype=str(lm.dtype).removeprefix("torch."), device=str(lm.device))
        self.memory_bytes = lm.param_bytes
        self.runner = SequenceRunner(lm.native)

    def start(self, prompt: list[int]) -> ModelSession:
        # No forward here: the first propose feeds the prompt. StartSession runs while the verifier
        # prefills; co-located on few cores, two torch processes computing at once oversubscribe
        # the CPU (measured on 2 cores: 2.6 s for both prefills at once vs 0.33 s one after the other).
        return ModelSession(prompt, KVSequence(self.lm.model))

    def propose(self, session: ModelSession, gamma: int, budget: int = 0) -> Proposal:
        return drive(self.steps(session, gamma, budget), self.runner)

    def steps(self, session: ModelSession, gamma: int, budget: int = 0) -> Steps:
        """propose() as forward steps (base.Steps: fastllama.Feed, answered with (logits, features)),
        so that the draft service runs several sessions' steps in one forward."""
        tokens = session.tokens
        if len(tokens) + gamma > self.lm.max_context:
            gamma = self.lm.max_context - len(tokens)
        if gamma <= 0:
            return Proposal([], "")
        # Roll the cache back to the longest prefix it shares with the committed tokens (it also
        # holds our own earlier guesses, some of which the target accepted), keeping >= 1 token to feed.
        keep = _common_prefix(session.fed, tokens[:-1])
        session.kv.truncate(keep)
        pending = tokens[keep:]
        choices = []
        while len(choices) < gamma:
            session.drafting = len(choices)
            logits, hidden = yield Feed(session.kv, pending, last_only=True, logits=self.rows is None)
            choices.append(self._choose(session, logits, hidden))
            pending = [choices[-1].token]
        drafts = [c.token for c in choices]
        session.fed = tokens + drafts[:-1]
        if budget > 1:
            return chain_tree(choices, budget, "model")
        return Proposal(drafts, "model", sampled_from(choices))

    def _choose(self, session: ModelSession, logits, hidden) -> Choice:
        if self.rows is None:
            return choose(session, logits[0], None, self.lm.vocab_size)
        return choose(session, hidden[-1].float() @ self.rows.float().T, self.vocab_ids, self.lm.vocab_size)

    def end(self, session: ModelSession) -> None:
        pass


class SequenceRunner:
    """Runs Feeds: several sequences in one native forward, else one by one on their own forward."""

    def __init__(self, native):
        self.native = native  # fastllama.FastLlama, or None (transformers' forward)

    def run(self, feeds: list[Feed]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        if self.native is not None:
            for f in feeds:
                f.sequence.reserve(len(f.token_ids))
            return self.native.run(feeds)
        out = []
        for f in feeds:
            if f.logits:
                out.append((f.sequence.forward(f.token_ids, last_only=f.last_only), None))
            else:
                out.append((None, f.sequence.hidden(f.token_ids)))
        return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
