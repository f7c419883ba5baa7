"""Stage 1 of distillation: the target's own greedy continuations of the prompts, written in
resumable shards of token ids.

The draft must imitate *this* target, so the data is what the target says, not reference text.
The shards keep token ids only (a few bytes a token; the features would be ~1 KiB a token), so a
data set can be kept and grown over many runs; training computes the target's features of every
position by one prefill per sequence (train.load_examples), with the forward the verifier serves.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm import tqdm

from specsplit.model.modeling import LoadedModel, chat_prompt_ids


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the gateway tokenizes a one-message chat request (plain text without a template)."""
    if getattr(tokenizer, "chat_template", None):
        return chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt)["input_ids"]


@torch.inference_mode()
def generate_batch(lm: LoadedModel, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Greedy continuations of a left-padded batch. Each example holds `ids` (prompt + continuation,
    ending at EOS or the budget) and `prompt_len`."""
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
    examples = []
    for row, prompt in enumerate(prompts):
        cont = generated[row]
        end = next((i + 1 for i, t in enumerate(cont) if t in eos), len(cont))
        seq = prompt + cont[:end]
        examples.append({"ids": torch.tensor(seq, dtype=torch.int32), "prompt_len": len(prompt)})
    return examples


def shard_paths(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("shard-*.pt"))


def run(lm: LoadedModel, prompts: list[dict], data_dir: Path, budget_s: float, batch: int,
        max_new_tokens: int) -> None:
    """Generates shard k from prompts [k*batch, (k+1)*batch), skipping shards that exist (resume),
    until the prompts or the time budget run out."""
    data_dir.mkdir(parents=True, exist_ok=True)
    n_shards = (len(prompts) + batch - 1) // batch
    todo = [k for k in range(n_shards) if not (data_dir / f"shard-{k:05d}.pt").exists()]
    deadline = time.monotonic() + budget_s
    tokens = 0
    started = time.monotonic()
    bar = tqdm(todo, desc="generate", unit="batch", total=n_shards, initial=n_shards - len(todo))
    for k in bar:
        if time.monotonic() >= deadline:
            bar.write(f"generate: time budget reached after {tokens} new tokens; rerun to resume")
            break
        rows = prompts[k * batch:(k + 1) * batch]
        examples = generate_batch(lm, [chat_ids(lm.tokenizer, r["prompt"]) for r in rows], max_new_tokens)
        for ex, r in zip(examples, rows):
            ex["task_type"] = r["task_type"]
        tokens += sum(len(ex["ids"]) - ex["prompt_len"] for ex in examples)
        tmp = data_dir / f".shard-{k:05d}.pt.tmp"
        torch.save(examples, tmp)
        tmp.rename(data_dir / f"shard-{k:05d}.pt")  # a shard exists only once complete
        bar.set_postfix(tok_s=f"{tokens / (time.monotonic() - started):.0f}")
    bar.close()
