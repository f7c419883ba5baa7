"""What the benchmarks send: prompt files and the Generate requests made from them."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.errors import UsageError


@dataclass(frozen=True)
class Prompt:
    task_type: str
    prompt: str
    temperature: float | None = None  # None: the run's --temperature


def load_prompts(path: str | None, limit: int = 0) -> list[Prompt]:
    """JSONL rows {task_type, prompt[, temperature]}; path None: the starter prompts; "mixed": the
    controller's mixed workload (code and structured greedy, open prompts sampled at T=1.2 as
    "creative"); "copy": four prompts to repeat text verbatim (drafts almost always right); "long": two
    summaries of ~1,300-token notes (large first-round payloads for feature-reading drafters); "general":
    36 questions in six categories users send (math, chat, qa, rag and summarize over ~600-word
    documents, translate), written for this project."""
    name = {None: "starter_prompts.jsonl", "mixed": "mixed_prompts.jsonl", "copy": "copy_prompts.jsonl",
            "long": "long_prompts.jsonl", "general": "general_prompts.jsonl"}.get(path)
    text = resources.files("specsplit.data").joinpath(name).read_text() if name else Path(path).read_text()
    prompts = [_prompt(line, n, path) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if limit:
        seen: dict[str, int] = defaultdict(int)
        kept = []
        for p in prompts:
            seen[p.task_type] += 1
            if seen[p.task_type] <= limit:
                kept.append(p)
        prompts = kept
    return prompts


@dataclass(frozen=True)
class Variant:
    """One spec-on configuration: a drafter, and at temperature > 0 a verify method."""

    drafter: str
    method: str = ""  # "" greedy, else coupled | rejection
    tree_budget: int = 0  # token trees of this many tokens; 0: the gateway's default

    @property
    def label(self) -> str:
        label = f"{self.drafter}/{self.method}" if self.method else self.drafter
        return f"{label}+tree{self.tree_budget}" if self.tree_budget > 1 else label


# What every bench request says, set by main from --temperature / --seed / --predraft. Pre-drafting
# is pinned (off by default) so that a run measures one protocol, not the controller's A/B.
REQUEST = {"temperature": 0.0, "seed": 0, "predraft": pb.PREDRAFT_OFF}


DEFAULT_REQUEST = "default"  # as a Variant's drafter: the request users send (AUTO, no drafter named)


def request(p: Prompt, speculation: int, max_new_tokens: int, variant: Variant = Variant("")) -> pb.GenerateRequest:
    if variant.drafter == DEFAULT_REQUEST and speculation == pb.SPECULATION_ON:
        speculation, variant = pb.SPECULATION_AUTO, Variant("", variant.method, variant.tree_budget)
    method = cpb.VERIFY_METHOD_REJECTION if variant.method == "rejection" else cpb.VERIFY_METHOD_COUPLED
    req = pb.GenerateRequest(max_new_tokens=max_new_tokens, speculation=speculation, task_type=p.task_type,
                             drafter=variant.drafter, predraft=REQUEST["predraft"], tree_budget=variant.tree_budget,
                             sampling=pb.SamplingParams(temperature=REQUEST["temperature"] if p.temperature is None
                                                        else p.temperature, seed=REQUEST["seed"], method=method))
    req.chat.messages.add(role="user", content=p.prompt)
    return req


def warmup(prompts: list[Prompt]) -> Prompt:
    """The first prompt, labelled so that warm-up requests stay out of per-task figures (traces)."""
    return Prompt("warmup", prompts[0].prompt)


def _prompt(line: str, number: int, path: str | None) -> Prompt:
    """One JSONL row; keys other than Prompt's fields (an "id", say) are ignored."""
    where = f"{path or 'built-in prompts'}:{number}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("task_type"), str):
        raise UsageError(f"{where}: need an object with string fields task_type and prompt")
    known = {f.name for f in fields(Prompt)}
    return Prompt(**{k: v for k, v in row.items() if k in known})
