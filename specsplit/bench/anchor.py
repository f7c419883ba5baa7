"""`specsplit bench --anchor`: what a user would otherwise run, measured in the same run.

Hugging Face transformers in-process on the same model, dtype, chat template and token budget:
`model.generate` plain, with prompt lookup (`prompt_lookup_num_tokens=3`) and, when the stack has a
draft model, with assisted generation (`assistant_model=` the same draft model), greedy, timed like
the bench's own requests (wall time per request, prefill included, after a warm-up), interleaved
with them prompt by prompt so that machine noise hits both alike.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from specsplit.model import native

LOOKUP_TOKENS = 3


@dataclass
class AnchorRecord:
    task_type: str
    seconds: dict[str, list[float]] = field(default_factory=dict)  # mode ("plain", "lookup", "assisted") -> runs
    tokens: dict[str, int] = field(default_factory=dict)  # mode -> tokens of the last run
    identical: dict[str, bool] = field(default_factory=dict)  # mode -> its output equals plain generate's
    plain_ids: list[int] = field(default_factory=list)  # the last plain output, without its end-of-sequence token

    def tok_s(self, mode: str) -> float:
        return self.tokens[mode] / statistics.median(self.seconds[mode])


class Anchor:
    """transformers' own model (its default attention and kernels), loaded as a user would; with
    `draft_dir`, the same draft model our model drafter serves, as transformers' assistant."""

    def __init__(self, model_dir: str, dtype: str, draft_dir: str | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from specsplit.model.modeling import parse_dtype

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=parse_dtype(dtype), local_files_only=True)
        self.model.eval()
        self.assistant = None
        if draft_dir is not None:
            self.assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=parse_dtype(dtype),
                                                                  local_files_only=True).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.version = __import__("transformers").__version__

    @property
    def modes(self) -> list[str]:
        return ["plain", "lookup"] + (["assisted"] if self.assistant is not None else [])

    def _generate(self, ids: list[int], max_new_tokens: int, mode: str) -> tuple[list[int], float]:
        inputs = torch.tensor([ids])
        extra = {"lookup": {"prompt_lookup_num_tokens": LOOKUP_TOKENS},
                 "assisted": {"assistant_model": self.assistant}}.get(mode, {})
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=self.tokenizer.eos_token_id, **extra)
        return out[0, len(ids):].tolist(), time.perf_counter() - start

    def warmup(self, prompt: str) -> None:
        for mode in self.modes:
            self._generate(self._ids(prompt), 8, mode)

    def _ids(self, prompt: str) -> list[int]:
        from specsplit.model.chat import chat_prompt_ids

        return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": prompt}])

    def run(self, record: AnchorRecord, prompt: str, max_new_tokens: int) -> None:
        """One request per mode for `prompt`, added to `record`."""
        ids = self._ids(prompt)
        outputs = {}
        for mode in self.modes:
            out, t = self._generate(ids, max_new_tokens, mode)
            record.seconds.setdefault(mode, []).append(t)
            record.tokens[mode] = len(out)
            outputs[mode] = out
        record.identical = {mode: out == outputs["plain"] for mode, out in outputs.items()}
        plain = outputs["plain"]
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        while plain and plain[-1] in eos:  # the gateway's token ids stop before the end-of-sequence token
            plain = plain[:-1]
        record.plain_ids = plain


def step_profile(model_dir: str, dtype: str, quantize: str = "", context: int = 128,
                 repeats: int = 30) -> dict[str, float]:
    """Our target forward in this process (the verify service's code): median ms of a 1-row step
    and of a 5-row verify at a `context`-token prefix, interleaved."""
    from specsplit.model.modeling import KVSequence, load_model

    lm = load_model(model_dir, dtype, quantize=quantize)
    seq = KVSequence(lm)
    seq.forward([(i * 7 + 3) % lm.vocab_size for i in range(context)])
    times: dict[int, list[float]] = {1: [], 5: []}
    for i in range(repeats + 3):
        for rows in times:
            start = time.perf_counter()
            seq.forward(list(range(10, 10 + rows)))
            if i >= 3:
                times[rows].append(time.perf_counter() - start)
            seq.truncate(context)
    kernels = lm.kernels + (f": {lm.native.kernel}; path {native.describe()}" if lm.native is not None else "")
    return {"kernels": kernels, **{f"rows{r}_ms": 1e3 * statistics.median(t) for r, t in times.items()}}


class BareTarget:
    """Our target decoding alone in this process (the verify service's code, no services), to time
    beside requests through the services: the chat prompt prefilled, then a given output fed back one
    token a step with each step's greedy choice taken, as a spec-off decode does."""

    def __init__(self, model_dir: str, dtype: str, quantize: str):
        from transformers import AutoTokenizer

        from specsplit.model.modeling import load_model

        self.lm = load_model(model_dir, dtype, quantize=quantize)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def decode_ms(self, prompt: str, output: list[int]) -> float | None:
        """ms per token after the first (None for an output of fewer than 2 tokens)."""
        from specsplit.model.chat import chat_prompt_ids
        from specsplit.model.modeling import KVSequence

        if len(output) < 2:
            return None
        seq = KVSequence(self.lm)
        seq.forward(chat_prompt_ids(self.tokenizer, [{"role": "user", "content": prompt}]), last_only=True)
        start = time.perf_counter()
        for token in output[:-1]:
            int(seq.forward([token], last_only=True)[-1].argmax())
        return 1e3 * (time.perf_counter() - start) / (len(output) - 1)

def print_table(anchor: Anchor, records: list[AnchorRecord], ours: list[dict], our_records: list,
                out=sys.stdout) -> None:
    """Per task type: transformers' tok/s per mode next to ours, our speculation against its best
    speculating mode (assisted generation when there is a draft model, else prompt lookup), how
    often its speculation equalled its own plain output, and how many of our spec-off outputs
    equal transformers' plain greedy ones (`off=HF`: numerics, or the quality cost of quantized
    weights)."""
    groups: dict[str, list[AnchorRecord]] = defaultdict(list)
    for r in records:
        groups[r.task_type].append(r)
    groups["ALL"] = list(records)
    first = our_records[0].drafter if our_records else None
    ours_off = [r.off_ids for r in our_records if r.drafter == first]  # one per prompt, in prompt order
    same = {id(a): a.plain_ids == ids for a, ids in zip(records, ours_off)}
    drafters = list(dict.fromkeys(row["drafter"] for row in ours))
    modes = anchor.modes
    best = modes[-1]
    print(f"anchor: transformers {anchor.version} in-process, {anchor.model.dtype}, same prompts, chat template and "
          f"token budget, greedy, interleaved with the requests above (tok/s = tokens / wall time incl. prefill; "
          f"{'assisted = assistant_model, the same draft model; ' if anchor.assistant is not None else ''}"
          f"X=plain: that mode's output equals HF plain's)", file=out)
    head = f"{'task type':<11}" + "".join(f"{'HF ' + m:>{len(m) + 5}}" for m in modes)
    head += "".join(f"{m + '=plain':>{len(m) + 8}}" for m in modes[1:])
    head += f"{'ours off':>9}{'off/HF':>8}{'off=HF':>8}"
    head += "".join(f"{d + ' on':>{max(10, len(d) + 4)}}{'/HF ' + best:>{len(best) + 6}}" for d in drafters)
    print(head, file=out)
    by_key = {(row["drafter"], row["task_type"]): row for row in ours}
    for task, rs in groups.items():
        speed = {m: sum(r.tokens[m] for r in rs) / sum(statistics.median(r.seconds[m]) for r in rs) for m in modes}
        off = by_key[(drafters[0], task)]["tok_s_off"]
        line = f"{task:<11}" + "".join(f"{speed[m]:>{len(m) + 5}.1f}" for m in modes)
        line += "".join(f"{sum(r.identical[m] for r in rs):>{len(m) + 4}}/{len(rs):<3}" for m in modes[1:])
        line += f"{off:>9.1f}{off / speed['plain']:>7.2f}x{sum(same.get(id(r), False) for r in rs):>4}/{len(rs):<3}"
        for d in drafters:
            on = by_key[(d, task)]["tok_s_on"]
            line += f"{on:>{max(10, len(d) + 4)}.1f}{on / speed[best]:>{len(best) + 5}.2f}x"
        print(line, file=out)
