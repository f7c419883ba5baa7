"""An EAGLE-style draft head: one decoder layer that reads the target's own features.

Input at position i: [f_i, emb(t_{i+1})], where f_i is the target's final-norm hidden state at
token t_i and emb is the target's input embedding. The layer outputs a prediction of f_{i+1}; the
target's output head, restricted to a frequency-ranked draft vocabulary (FR-Spec), turns it into
a guess for t_{i+2}. Drafting step k feeds the head's own predicted feature back in.

The head's own weights are small (fc + one layer); the embedding and the output-head rows come from
the target at load time and are never saved with the head. Training and serving share this module.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specsplit.speculation import rollback


@dataclass(frozen=True)
class HeadConfig:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    draft_vocab: int

    @classmethod
    def from_target(cls, config, draft_vocab: int, intermediate: int = 0) -> HeadConfig:
        """The head's shape for a target: its hidden size, attention and RoPE; the MLP the target's
        width unless `intermediate` (> 0) asks for a narrower one (a big target's head: cheaper to
        run and to ship, and no more than its data can train)."""
        rope = getattr(config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        heads = config.num_attention_heads
        return cls(hidden=config.hidden_size, intermediate=intermediate or config.intermediate_size, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", heads) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   rope_theta=float(theta), eps=float(config.rms_norm_eps), draft_vocab=draft_vocab)

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class FeatureHead(nn.Module):
    """Parameters: fc, one Llama decoder layer. Buffers set by `attach`: the target's embedding,
    the output-head rows of the draft vocabulary and the draft-to-target id map."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        d, h, kv, hd = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.input_norm = RMSNorm(d, cfg.eps)
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        self.post_norm = RMSNorm(d, cfg.eps)
        self.gate_proj = nn.Linear(d, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(d, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, d, bias=False)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Draft vocabulary: index k of the draft head is target token id vocab_ids[k].
        self.register_buffer("vocab_ids", torch.zeros(cfg.draft_vocab, dtype=torch.long))
        self.embed: torch.Tensor | None = None  # [target_vocab, hidden], the target's input embedding
        self.vocab_weight: torch.Tensor | None = None  # [draft_vocab, hidden], target lm_head rows

    # -- wiring -------------------------------------------------------------------------------
    def init_from_target_layer(self, layer: dict[str, torch.Tensor]) -> None:
        """Start as an identity: fc passes f_i through and the layer's residual branches output
        zero (o_proj, down_proj zeroed), so the untrained head predicts f_{i+1} = f_i. The other
        weights are copied from a target layer (`layer`: its weights by name, headfile.target_layer;
        a narrower MLP: its first rows; no biases). (Measured: copying a layer as-is starts far off
        scale and learns nothing.)"""
        d = self.cfg.hidden
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, :d].copy_(torch.eye(d))
            for mine, theirs in ((self.q_proj, "self_attn.q_proj"), (self.k_proj, "self_attn.k_proj"),
                                 (self.v_proj, "self_attn.v_proj"), (self.gate_proj, "mlp.gate_proj"),
                                 (self.up_proj, "mlp.up_proj"), (self.input_norm, "input_layernorm"),
                                 (self.post_norm, "post_attention_layernorm")):
                mine.weight.copy_(layer[f"{theirs}.weight"][:mine.weight.shape[0]].float())
            self.o_proj.weight.zero_()
            self.down_proj.weight.zero_()

    def attach(self, embed: torch.Tensor, lm_head: torch.Tensor, vocab_ids: torch.Tensor | None = None) -> None:
        """Give the head the target's embedding [V, d] and output head [V, d] (frozen, not saved)."""
        if vocab_ids is not None:
            self.vocab_ids.copy_(vocab_ids)
        self.embed = embed.detach()  # kept in its own dtype (bf16 when serving: half the memory)
        self.vocab_weight = lm_head.detach()[self.vocab_ids].to(self.fc.weight.dtype)

    def head_state(self) -> dict[str, torch.Tensor]:
        """What a saved head holds: its own weights and the vocab map (no target tensors)."""
        return {k: v for k, v in self.state_dict().items()}

    # -- maths --------------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[..., None] * self.inv_freq  # [..., T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return x * emb.cos().to(x.dtype) + _rotate_half(x) * emb.sin().to(x.dtype)

    def project(self, features: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor):
        """fc + input norm + q/k/v with RoPE for inputs [B, T, d] / [B, T] at positions [T].
        Returns (residual [B,T,d], q [B,H,T,hd], k [B,KV,T,hd], v [B,KV,T,hd])."""
        cfg = self.cfg
        x = self.fc(torch.cat([features, self.embed[next_tokens].to(features.dtype)], dim=-1))
        b, t, _ = x.shape
        hn = self.input_norm(x)
        q = self.q_proj(hn).view(b, t, cfg.heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(hn).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(hn).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        return x, self._rope(q, positions), self._rope(k, positions), v

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """o_proj + MLP on attention output [B, H, T, hd]; returns the predicted features [B, T, d]."""
        b, _, t, _ = attn.shape
        x = residual + self.o_proj(attn.transpose(1, 2).reshape(b, t, -1))
        hn = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(hn)) * self.up_proj(hn))

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., draft_vocab]."""
        return features @ self.vocab_weight.T

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.cfg.heads // self.cfg.kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=1)

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.cfg.head_dim)


class HeadCache:
    """Keys/values of one sequence for the head's single layer, truncated by position."""

    def __init__(self):
        self.k: torch.Tensor | None = None  # [1, KV, n, hd]
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def truncate(self, length: int) -> None:
        """specsplit.speculation.rollback's contract."""
        rollback.check(self.length, length)
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


@torch.inference_mode()
def head_step(head: FeatureHead, cache: HeadCache, features: torch.Tensor, next_tokens: list[int]) -> torch.Tensor:
    """Serving: append n inputs (features [n, d], the tokens after them) at positions
    [cache.length, +n) and return the predicted next features [n, d]."""
    start = cache.length
    positions = torch.arange(start, start + len(next_tokens), device=features.device)
    tokens = torch.tensor([next_tokens], dtype=torch.long, device=features.device)
    residual, q, k, v = head.project(features[None].to(head.fc.weight.dtype), tokens, positions)
    keys, values = cache.append(k, v)
    scores = (q @ head.expand_kv(keys).transpose(2, 3)) * head.scale  # [1, H, n, start+n]
    n = len(next_tokens)
    if n > 1:
        future = torch.ones(n, start + n, dtype=torch.bool, device=features.device).triu(start + 1)
        scores = scores.masked_fill(future, float("-inf"))
    attn = scores.softmax(-1) @ head.expand_kv(values)
    return head.finish(residual, attn)[0]


def unrolled_forward(head: FeatureHead, features: torch.Tensor, tokens: torch.Tensor,
                     levels: int) -> list[torch.Tensor]:
    """Training: predictions of f_{i+1} at every position for drafting steps 1..levels, as drafting
    sees them. Step s at position i reads the head's own step-(s-1) prediction for f_i, and attends
    to true-feature keys up to position i-s+1 and to the step-r keys of positions i-s+1+r-1
    (r = 2..s): exactly the context a step-s draft has at serving time (no teacher forcing of the
    features beyond the committed prefix).

    features [B, T, d] (f_0..f_{T-1}), tokens [B, T] (t_1..t_T: the token after each feature).
    Returns `levels` tensors [B, T, d]; step s is meaningful from position s-1 on."""
    b, t, _ = features.shape
    positions = torch.arange(t, device=features.device)
    outs, keys, values = [], [], []
    feats = features
    for s in range(1, levels + 1):
        residual, q, k, v = head.project(feats, tokens, positions)
        keys.append(head.expand_kv(k))
        values.append(head.expand_kv(v))
        true_scores = (q @ keys[0].transpose(2, 3)) * head.scale  # [B, H, T, T]
        hidden = torch.ones(t, t, dtype=torch.bool, device=features.device).triu(1 - (s - 1))
        true_scores = true_scores.masked_fill(hidden, float("-inf"))
        extra_scores, extra_values = [], []
        for r in range(2, s + 1):  # the step-r key sits s-r positions before the query
            shift = s - r
            k_r = torch.roll(keys[r - 1], shifts=shift, dims=2)
            extra_scores.append((q * k_r).sum(-1, keepdim=True) * head.scale)  # [B, H, T, 1]
            extra_values.append(torch.roll(values[r - 1], shifts=shift, dims=2))
        probs = torch.cat([true_scores, *extra_scores], dim=-1).softmax(-1)
        attn = probs[..., :t] @ values[0]
        for j, v_r in enumerate(extra_values):
            attn = attn + probs[..., t + j:t + j + 1] * v_r
        out = head.finish(residual, attn)
        outs.append(out)
        # Next step at position i reads this step's prediction made at position i-1.
        feats = torch.cat([out[:, :1], out[:, :-1]], dim=1)
    return outs
