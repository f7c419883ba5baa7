"""A causal LM drafting greedily, with its own KV cache that follows the committed tokens.

Most of a small draft model's cost per token can be its output head (Qwen2.5-0.5B: 136M of its 494M
weights read per token score 151,936 tokens), so it may score only a draft vocabulary: the ids a
distilled draft lists in `draft_vocab.json`, else the first N ids of its tokenizer (BPE ids are
numbered in merge order, roughly by frequency) and its added tokens. On the native kernels the head
is packed with those rows only. A target token outside the vocabulary can never be drafted (the
round then ends there); sampling stays lossless, since q is the distribution the token was drawn
from, zero outside the vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draft_service.drafters.base import DrafterDescription, DraftSession, Steps, drive
from specsplit.model.fastllama import Feed
from specsplit.model.modeling import KVSequence, LoadedModel, Sequence
from specsplit.speculation.drafting import Choice, Proposal, chain_tree, choose, sampled_from

DRAFT_VOCAB_FILE = "draft_vocab.json"  # written by `specsplit distill --kind model`


class ModelSession(DraftSession):
    def __init__(self, prompt: list[int], kv: Sequence):
        super().__init__(prompt)
        self.kv = kv
        self.fed: list[int] = []  # the tokens whose keys/values kv holds, in order


def draft_vocabulary(model_dir: str | Path, size: int = 0) -> torch.Tensor | None:
    """The ids the drafter scores, ascending: the model's `draft_vocab.json` when it has one, else
    with `size` > 0 the first `size` ids and every added (special) token; None: the whole vocabulary."""
    model_dir = Path(model_dir)
    vocab_file = model_dir / DRAFT_VOCAB_FILE
    if vocab_file.is_file():
        return torch.tensor(sorted(json.loads(vocab_file.read_text())), dtype=torch.long)
    if size <= 0:
        return None
    config = json.loads((model_dir / "config.json").read_text())
    vocab = int(config["vocab_size"])
    if size >= vocab:
        return None
    from transformers import AutoTokenizer

    added = AutoTokenizer.from_pretrained(model_dir, local_files_only=True).added_tokens_decoder
    return torch.tensor(sorted(set(range(size)) | {i for i in added if size <= i < vocab}), dtype=torch.long)


class ModelDrafter:

    def __init__(self, lm: LoadedModel, name: str = "model", vocab_ids: torch.Tensor | None = None):
        """vocab_ids: the draft vocabulary (draft_vocabulary); when lm runs natively, it must have
        been loaded with the same ids as head_ids."""
        self.lm = lm
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(lm.device)
        # Natively the packed head already scores the vocabulary; transformers' forward gives
        # features, scored here against the vocabulary's rows.
        self.rows = None
        if vocab_ids is not None and lm.native is None:
            self.rows = lm.model.get_output_embeddings().weight.detach()[self.vocab_ids].float()
        self.description = DrafterDescription(
            name=name, kind="model", model_id=lm.model_id, tokenizer_fingerprint=lm.fingerprint,
            param_bytes=lm.param_bytes, dtype=str(lm.dtype).removeprefix("torch."), device=str(lm.device))
        self.memory_bytes = lm.param_bytes
        self.thread_invariant = lm.native is not None
        self.runner = SequenceRunner(lm.native)

    def start(self, prompt: list[int]) -> ModelSession:
        # No forward here: the first propose feeds the prompt. StartSession runs while the verifier
        # prefills; co-located on few cores, two torch processes computing at once oversubscribe
        # the CPU (measured on 2 cores: 2.6 s for both prefills at once vs 0.33 s one after the other).
        return ModelSession(prompt, KVSequence(self.lm))

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
        if self.rows is not None:
            logits = (hidden[-1].float() @ self.rows.T)[None]
        return choose(session, logits[0], self.vocab_ids, self.lm.vocab_size)

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
