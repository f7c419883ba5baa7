"""Self-drafting: a small head (specsplit.model.featurehead) on the target's own features, trained by
`specsplit distill` for one target. Features arrive with every Propose; the head keeps a one-layer
KV cache over the committed positions and drafts greedily in its reduced vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draft_service.drafters.base import DrafterDescription, DraftSession, Steps, drive
from specsplit.model.featurehead import FeatureHead, HeadCache, HeadCall, HeadConfig, HeadRound, NativeHead, TorchHead
from specsplit.model.identity import weights_fingerprint
from specsplit.spec.drafting import Choice, Proposal, candidates, chain_tree, choose, sampled_from
from specsplit.spec.tokentree import Tree

HEAD_FORMAT = "specsplit-feature-head/1"
WIDTH = 3  # token trees: nodes expanded per depth, and children per node
MIN_EXPAND = 0.05  # token trees: a node whose path probability is below this is not expanded
PACKAGED = Path(__file__).resolve().parents[2] / "specsplit" / "model" / "drafts"


class SelfSession(DraftSession):
    def __init__(self, prompt: list[int], dim: int, cache=None):
        super().__init__(prompt)
        self.feature_dim = dim
        # Features of committed positions [0, len(tokens) - 1), written by position into a buffer
        # that grows by doubling (a concatenation per round made every round cost the whole history).
        self._rows = torch.zeros(max(64, len(prompt)), dim, dtype=torch.float32)
        self._count = 0
        self.cache = cache if cache is not None else HeadCache()  # the head's one-layer KV cache (or a KVBuffer)
        self.cached = 0  # leading positions whose head cache entries came from true features
        self.last = None  # (the head's predicted feature at position cached - 1, its draft logits)

    @property
    def features(self) -> torch.Tensor:
        return self._rows[:self._count]  # [positions, dim], a view

    def sync(self, base_length: int, new_tokens: list[int]) -> None:
        super().sync(base_length, new_tokens)
        # Head cache position i used feature i and token i+1: keep those still committed.
        self.cached = min(self.cached, base_length - 1)
        self._count = min(self._count, base_length)

    def add_features(self, start: int, features: torch.Tensor) -> None:
        if start > self._count:
            raise ValueError(f"features start at position {start}; the drafter has {self._count}")
        end = start + len(features)
        if end > len(self.tokens) - 1:
            raise ValueError(f"features up to position {end} for {len(self.tokens)} tokens: "
                             "the last committed token has no feature yet")
        if end > len(self._rows):
            rows = torch.zeros(max(end, 2 * len(self._rows)), self.feature_dim, dtype=torch.float32)
            rows[:self._count] = self._rows[:self._count]
            self._rows = rows
        self._rows[start:end] = features
        self._count = end
        self.cached = min(self.cached, start)


def resolve_head(path: str) -> Path:
    """A head directory, or `default` for the one shipped for the embedded default target."""
    if path == "default":
        return PACKAGED / "smollm2-135m-instruct-self"
    return Path(path).expanduser()


def head_setting(flag: str, target_model: str) -> str | None:
    """The --self-head flag as DraftSettings.self_head takes it: 'none' none; 'auto' the shipped head
    if the target is the embedded default and the head is there; else the flag (a directory)."""
    if flag == "none":
        return None
    if flag == "auto":
        return "default" if target_model == "default" and (resolve_head("default") / "head.json").is_file() else None
    return flag


def read_head_card(head_dir: Path) -> dict:
    card_path = head_dir / "head.json"
    if not card_path.is_file():
        raise FileNotFoundError(f"{head_dir} is not a feature head (no head.json); make one with `specsplit distill`")
    card = json.loads(card_path.read_text())
    if card.get("format") != HEAD_FORMAT:
        raise ValueError(f"{card_path}: format {card.get('format')!r}, expected {HEAD_FORMAT!r}")
    return card


def target_tensors(target_dir: Path, tied: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and output head, read alone from its safetensors files."""
    from safetensors import safe_open

    embed = head = None
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.endswith("embed_tokens.weight"):
                    embed = st.get_tensor(name)
                elif name == "lm_head.weight":
                    head = st.get_tensor(name)
    if embed is None:
        raise ValueError(f"{target_dir}: no '*embed_tokens.weight' tensor in its safetensors files")
    if head is None:
        if not tied:
            raise ValueError(f"{target_dir}: no 'lm_head.weight' tensor and the embeddings are not tied")
        head = embed
    return embed, head


class SelfDrafter:

    def __init__(self, head_dir: Path, target_dir: Path, device: str = "cpu", name: str = "self",
                 min_confidence: float = 0.0):
        card = read_head_card(head_dir)
        theirs = card["target"]["model_fingerprint"]
        ours = weights_fingerprint(target_dir)
        if theirs != ours:
            raise ValueError(f"feature head {head_dir} was trained for target {card['target']['model_id']} "
                             f"(weights {theirs}); {target_dir} has weights {ours or '(no safetensors)'}: "
                             "retrain it with `specsplit distill` for this target")
        from safetensors.torch import load_file

        # float32 explicitly: the default dtype is process-wide, and a model loading in another
        # thread (transformers switches it while it builds) must not decide this head's dtype.
        self.head = FeatureHead(HeadConfig(**card["config"])).float()
        self.head.load_state_dict({k: v.float() for k, v in load_file(str(head_dir / "head.safetensors")).items()})
        embed, lm_head = target_tensors(target_dir, card.get("tied_embeddings", True))
        self.head.attach(embed.to(torch.bfloat16), lm_head.float())
        self.head.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        context = json.loads((target_dir / "config.json").read_text()).get("max_position_embeddings") or 8192
        self.runner = _runner(self.head, self.device, int(context))
        self.card = card
        # Drafting stops once the head's own probability that the whole draft so far is right
        # (the product of its top probabilities) falls below this: a doubtful draft costs draft
        # and verify time and is rarely accepted. 0 drafts gamma tokens every round.
        self.min_confidence = min_confidence
        own = sum(t.numel() * t.element_size() for t in self.head.state_dict().values())
        self.memory_bytes = own + sum(t.numel() * t.element_size() for t in (self.head.embed, self.head.vocab_weight))
        self.memory_bytes += self.runner.packed_bytes
        self.thread_invariant = isinstance(self.runner, NativeHead)
        self.description = DrafterDescription(
            name=name, kind="self", model_id=head_dir.name,
            tokenizer_fingerprint=card["target"]["tokenizer_fingerprint"],
            param_bytes=own, dtype="float32", device=str(self.device), needs_features=True,
            target_model_fingerprint=theirs)

    def start(self, prompt: list[int]) -> SelfSession:
        return SelfSession(prompt, self.head.cfg.hidden, self.runner.new_cache())

    def propose(self, session: SelfSession, gamma: int, budget: int = 0) -> Proposal:
        return drive(self.steps(session, gamma, budget), self.runner)

    @torch.inference_mode()
    def steps(self, session: SelfSession, gamma: int, budget: int = 0) -> Steps:
        """propose() as a generator of head steps (HeadCall, answered with the runner's result), so
        that the draft service can run several sessions' steps in one call (drive_all)."""
        n, have = len(session.tokens), len(session.features)
        if not have:
            return Proposal([], "")  # no features yet: nothing to draft from
        head, cache, runner = self.head, session.cache, self.runner
        cache.truncate(session.cached)  # drop last round's drafted steps
        tree = budget > 1 and not session.rejects and runner.trees
        if isinstance(runner, NativeHead) and session.sampling.temperature == 0:  # the whole round in one call
            return (yield from self._round(session, gamma, budget, tree))
        if session.cached < have:
            feats = session.features[session.cached:have].to(self.device)
            out, logits = yield HeadCall(cache, feats, session.tokens[session.cached + 1:have + 1])
            session.cached, session.last = have, (out[-1], logits)
        pred, logits = session.last  # the head's prediction of the feature at position `have`
        # Positions [have, n - 1) have no target features yet: tokens a pre-drafting gateway assumed
        # while their Verify is in flight. Go on from the head's own predictions, as drafting does.
        for token in session.tokens[have + 1:n]:
            out, logits = yield HeadCall(cache, pred[None], [token])
            pred = out[-1]
        if tree:
            return (yield from self._expand(session, cache, pred, logits, gamma, budget))
        choices = []
        confidence = 1.0
        for k in range(gamma):
            session.drafting = k
            choice = choose(session, logits, head.vocab_ids, head.embed.shape[0])
            confidence *= choice.top_prob
            if confidence < self.min_confidence:
                break
            choices.append(choice)
            if k + 1 < gamma:
                out, logits = yield HeadCall(cache, pred[None], [choice.token])
                pred = out[-1]
        if budget > 1 and choices:
            return chain_tree(choices, budget, "self")
        return Proposal([c.token for c in choices], "self" if choices else "", sampled_from(choices))

    def _round(self, session: SelfSession, gamma: int, budget: int, tree: bool) -> Steps:
        """A greedy round as one HeadRound: the new target features, the tokens a pre-drafting
        gateway assumed, and the chain (or EAGLE-2 tree, as _expand grows it) in one native call."""
        n, have = len(session.tokens), len(session.features)
        new = session.features[session.cached:have].to(self.device)
        drafted = yield HeadRound(session.cache, new, session.tokens[session.cached + 1:have + 1],
                                  session.tokens[have + 1:n], session.last if session.cached >= have else None,
                                  gamma, self.min_confidence, WIDTH if tree else 0, MIN_EXPAND)
        session.cached, session.last = have, drafted.last
        if tree:
            nodes = Tree()
            for parent, token, score in zip(*drafted.tree):
                nodes.add(parent, token, score, "self")
            tokens, parents, scores, _ = nodes.select(budget, gamma)
            return Proposal(tokens, "self" if tokens else "", None, parents, scores)
        c = drafted.chain
        choices = [Choice(token, top, None, top, (second, p2) if second >= 0 else None)
                   for token, top, second, p2 in zip(c.tokens, c.top_probs, c.runner_ups, c.runner_up_probs)]
        if budget > 1 and choices:
            return chain_tree(choices, budget, "self")
        return Proposal([ch.token for ch in choices], "self" if choices else "", None)

    def _expand(self, session: SelfSession, cache, pred: torch.Tensor, logits: torch.Tensor, gamma: int,
                budget: int) -> Steps:
        """EAGLE-2's dynamic tree: at each depth the WIDTH best nodes so far (by the product of the
        head's probabilities along their path) are expanded in one head call (a tree step over
        their rows), each giving its WIDTH best next tokens; the best `budget` nodes are proposed,
        best first."""
        head = self.head
        vocab = head.embed.shape[0]
        tree, base, slot_parents = Tree(), cache.length, []
        frontier = [(-1, -1, pred, logits, 1.0)]  # (tree node, cache slot, predicted feature, logits, score)
        for depth in range(gamma):
            session.drafting = depth
            grown = []
            for node, slot, feature, row_logits, score in frontier:
                for token, prob in candidates(session, row_logits, head.vocab_ids, vocab, WIDTH):
                    child = tree.add(node, token, score * prob, "self")
                    grown.append((score * prob, child, slot, feature, token))
            grown.sort(key=lambda g: -g[0])
            grown = [g for g in grown[:WIDTH] if g[0] >= MIN_EXPAND]
            if depth + 1 == gamma or not grown:
                break
            rows = [g[2] for g in grown]
            start = cache.length
            out, row_logits = yield HeadCall(cache, torch.stack([g[3] for g in grown]), [g[4] for g in grown],
                                             [-1 if s < 0 else -2 - s for s in rows], base, tuple(slot_parents))
            slot_parents += rows
            frontier = [(g[1], start + i, out[i], row_logits[i], g[0]) for i, g in enumerate(grown)]
        tokens, parents, scores, _ = tree.select(budget, gamma)
        return Proposal(tokens, "self" if tokens else "", None, parents, scores)

    def end(self, session: SelfSession) -> None:
        pass


def _runner(head: FeatureHead, device: torch.device, max_positions: int):
    """The native kernels when they run here, else torch. Weights q8_0 where the CPU has VNNI (a
    drafting step of the default's head 0.27 -> 0.19 ms: every step of a round's tree pays it; drafts
    need not match any other path, only be the same for a session however it is batched), else
    bfloat16 where it has bf16 dot products (half the bytes of float32)."""
    from specsplit.model import native

    if native.unavailable(torch.float32, device) is None and head.cfg.head_dim % 16 == 0:
        dtype = torch.bfloat16 if native.unavailable(torch.bfloat16, device) is None else torch.float32
        quantize = "q8_0" if native.lacks_vnni() is None else ""
        try:
            return NativeHead(head, max_positions, dtype, quantize)
        except (RuntimeError, OSError):  # no compiler, a failed build: torch still drafts
            pass
    return TorchHead(head)
