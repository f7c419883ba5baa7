"""Stage 1 of distillation: the target's own greedy continuations of the prompts, written in
resumable shards of token ids.

The draft must imitate *this* target, so the data is what the target says, not reference text, and
it is said by the weights the verifier serves (the native kernels, continuously batched: a finished
sequence's slot takes the next prompt in the same forward). The shards keep token ids only (a few
bytes a token), so a data set can be kept and grown over many runs. The target's features of every
position (~1 KiB a token) are what its forwards computed on the way, kept beside the shards in a
cache a fresh machine rebuilds (`features_path`; train.load_examples recomputes what is missing
by one prefill per sequence: 560-720 tok/s on 2 AVX2 cores, so an hour for a million tokens).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from specsplit.model.chat import chat_prompt_ids
from specsplit.model.modeling import LoadedModel
from specsplit.speculation.params import SamplingParams
from specsplit.speculation.sampling import sample, warp

SLOTS = 16  # sequences decoded together: the most tokens/s on 2 cores (16: 337, 32: 314, 64: 280 tok/s)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the gateway tokenizes a one-message chat request (plain text without a template)."""
    if getattr(tokenizer, "chat_template", None):
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt)["input_ids"]


class Sampler:
    """The next token from a logits row: greedy (temperature 0), else drawn at `temperature` among the
    `top_k` most likely as a served request with that seed draws (speculation.sampling's warp, then
    the seed's stream at the draw's position): the same seed, the same draws."""

    def __init__(self, temperature: float = 0.0, top_k: int = 50, seed: int = 0):
        self.params = SamplingParams(temperature=temperature, top_k=top_k, seed=seed)
        self.draws = 0

    def __call__(self, logits: torch.Tensor, greedy: int) -> int:
        if self.params.temperature <= 0:
            return greedy
        self.draws += 1
        return sample(warp(logits[None], self.params)[0], self.params.seed, self.draws)


@torch.inference_mode()
def decode_native(lm: LoadedModel, prompts: list[list[int]], max_new_tokens: int, sampler: Sampler | None = None,
                  slots: int = SLOTS, features: bool = False):
    """Continuations of every prompt on the native forward, `slots` sequences per forward; yields
    (index, continuation) as each finishes (at EOS, included, or the budget), or with `features`
    (index, continuation, the features of prompt + continuation but its last token, bfloat16: the
    rows the forwards read). Greedy unless a sampler says otherwise."""
    from specsplit.model.fastllama import Feed

    fast, eos = lm.native, set(lm.eos_token_ids)
    sampler = sampler or Sampler()
    queue = list(range(len(prompts)))[::-1]
    active: dict[int, tuple] = {}  # index -> (sequence, rows to feed, continuation so far, features so far)
    while queue or active:
        while queue and len(active) < slots:
            i = queue.pop()
            active[i] = (fast.sequence(), list(prompts[i]), [], [])
        feeds = [Feed(seq, rows, last_only=True) for seq, rows, _, _ in active.values()]
        for feed in feeds:
            feed.sequence.reserve(len(feed.token_ids))
        for i, (logits, hidden, choice) in zip(list(active), fast.run_choosing(feeds)):
            seq, _, cont, feats = active[i]
            if features:
                feats.append(hidden.to(torch.bfloat16))
            token = sampler(logits[0], choice[0])
            cont.append(token)
            if token in eos or len(cont) >= max_new_tokens:
                del active[i]
                yield (i, cont, torch.cat(feats)) if features else (i, cont)
            else:
                active[i] = (seq, [token], cont, feats)


@torch.inference_mode()
def decode_transformers(lm: LoadedModel, prompts: list[list[int]], max_new_tokens: int):
    """Greedy continuations of a left-padded batch on transformers' forward (models or devices the
    native kernels do not serve): (index, continuation) per prompt, EOS included."""
    from transformers import DynamicCache

    model, device = lm.model, lm.device
    eos = set(lm.eos_token_ids)
    width = max(len(p) for p in prompts)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [B, width]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    cache = DynamicCache(config=model.config)
    out_tokens: list[torch.Tensor] = []  # per step: [B]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    step_ids = ids
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        hidden = model.model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                             cache=cache, use_cache=True).last_hidden_state  # [B, n, hidden]
        nxt = model.lm_head(hidden[:, -1]).argmax(-1)  # [B]
        out_tokens.append(nxt)
        done |= torch.tensor([int(t) in eos for t in nxt.tolist()], device=device)
        if bool(done.all()):
            break
        step_ids = nxt[:, None]
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=1)
    generated = torch.stack(out_tokens, dim=1).tolist()  # [B, steps]
    for row, cont in enumerate(generated):
        end = next((i + 1 for i, t in enumerate(cont) if t in eos), len(cont))
        yield row, cont[:end]


def shard_paths(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("shard-*.pt"))


def features_path(shard: Path) -> Path:
    """Where a shard's features are cached: DIR/features/ beside DIR/data/ (not kept in the repository)."""
    return shard.parent.parent / "features" / shard.name


def save_whole(obj, path: Path) -> None:
    """torch.save that leaves either the old file or the new one, never a part (a run stopped
    mid-write resumes from what exists)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    tmp.rename(path)


def save_features(shard: Path, features: list[torch.Tensor]) -> None:
    save_whole(features, features_path(shard))


def check_shards(tokenizer, prompts: list[dict], data_dir: Path, batch: int) -> None:
    """Every shard written holds the continuations of the prompts its index names (a prompt list
    that changed under existing shards would pair prompts with other prompts' answers)."""
    for path in shard_paths(data_dir):
        k = int(path.stem.split("-")[1])
        for j, ex in enumerate(torch.load(path, weights_only=True)):
            at = k * batch + j
            prompt_ids = ex["ids"][:ex["prompt_len"]].tolist()
            if at >= len(prompts) or prompt_ids != chat_ids(tokenizer, prompts[at]["prompt"]):
                raise ValueError(f"{path} does not continue prompt {at} of {data_dir / 'prompts.jsonl'} (or the "
                                 f"built-in seeds given): start a new --out, or give the prompts it was made from")


def run(lm: LoadedModel, prompts: list[dict], data_dir: Path, budget_s: float, batch: int,
        max_new_tokens: int) -> None:
    """Shard k holds the continuations of prompts [k*batch, (k+1)*batch); shards that exist are
    skipped (resume). Generates until the prompts or the time budget run out; a shard is written
    whole, once all its sequences are done."""
    data_dir.mkdir(parents=True, exist_ok=True)
    n_shards = (len(prompts) + batch - 1) // batch
    todo = [k for k in range(n_shards) if not (data_dir / f"shard-{k:05d}.pt").exists()]
    check_shards(lm.tokenizer, prompts, data_dir, batch)
    deadline = time.monotonic() + budget_s
    started, tokens = time.monotonic(), 0
    bar = tqdm(total=n_shards, initial=n_shards - len(todo), desc="generate", unit="shard")
    # In pieces of a few shards, so that the budget is checked often and a stop loses little.
    piece = max(1, 2 * SLOTS // batch) if lm.native is not None else 1
    for at in range(0, len(todo), piece):
        if time.monotonic() >= deadline:
            bar.write(f"generate: time budget reached after {tokens} new tokens; rerun to resume")
            break
        shards = todo[at:at + piece]
        rows = [(k, r) for k in shards for r in prompts[k * batch:(k + 1) * batch]]
        ids = [chat_ids(lm.tokenizer, r["prompt"]) for _, r in rows]
        decode = decode_native(lm, ids, max_new_tokens, features=True) if lm.native is not None else \
            decode_transformers(lm, ids, max_new_tokens)
        examples: dict[int, dict] = {}
        features: dict[int, torch.Tensor] = {}
        for i, cont, *feats in decode:
            examples[i] = {"ids": torch.tensor(ids[i] + cont, dtype=torch.int32), "prompt_len": len(ids[i]),
                           "task_type": rows[i][1]["task_type"]}
            features.update({i: feats[0]} if feats else {})
            tokens += len(cont)
        for k in shards:
            mine = [i for i, (owner, _) in enumerate(rows) if owner == k]
            path = data_dir / f"shard-{k:05d}.pt"
            if features:
                save_features(path, [features[i] for i in mine])  # before the shard: never a shard without
            save_whole([examples[i] for i in mine], path)  # a shard exists only once complete
            bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / (time.monotonic() - started):.0f}", tokens=tokens)
    bar.close()
