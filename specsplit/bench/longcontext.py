"""`specsplit bench --long-context`: documents of 2k-6k tokens with questions, a multi-turn chat and
a long prefill beside a decoding stream, through the real services; transformers' own forward over
the same prompts in the same run.

- Cold: time to first token (client side, GenerateStream) with the prefix cache skipped
  (GenerateRequest.skip_prefix_cache), against transformers' forward of the same token ids
  (logits of the last position, as its generate's prefill computes them).
- Warm: another question over the same document (the document is the system prompt, so the prompt
  starts the same way): time to first token with the prefix cache, and whether the answer equals a
  cold run's of the same prompt. Speculation on vs off on the warm prompts (retrieval from a long
  input is where drafting should pay).
- Stall: a stream decoding beside a cold 6k-token prefill: its longest gap between chunks while the
  prefill runs, against its median gap.
- Chat: turns that resend the conversation, with the cached share of each prompt.

The documents are Python standard library sources (code as context), cut at a token count."""

from __future__ import annotations

import inspect
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

from gateway.controller import p95
from specsplit.api.gateway.v1 import gateway_pb2 as pb

SIZES = (2000, 4000, 6000)
SOURCES = ("argparse", "dataclasses", "typing", "tarfile")
QUESTIONS = ("In one sentence, what is this file for?", "Name three functions or classes defined in it.",
             "Which modules does it import?", "What does the first class in the file do?")
CHAT_TURNS = ("What does this module do?", "Which class is the most important one?",
              "Show how to call it in two lines.", "What could go wrong when using it?")
COLD_REPEATS = 3


def documents(tokenizer, sizes=SIZES) -> list[tuple[str, str]]:
    """(name, text): the source of one stdlib module per size, cut to that many tokens."""
    import importlib

    out = []
    for size, name in zip(sizes, SOURCES):
        ids = tokenizer(inspect.getsource(importlib.import_module(name)), add_special_tokens=False).input_ids
        if len(ids) < size:
            raise ValueError(f"{name}.py has {len(ids)} tokens, fewer than {size}")
        out.append((f"{name}.py[:{size}]", tokenizer.decode(ids[:size])))
    return out


def _messages(doc: str, question: str) -> list[dict]:
    return [{"role": "system", "content": "Answer questions about this file.\n\n" + doc},
            {"role": "user", "content": question}]


def _request(messages: list[dict], max_new_tokens: int, skip: bool, speculation=pb.SPECULATION_OFF):
    req = pb.GenerateRequest(max_new_tokens=max_new_tokens, speculation=speculation, skip_prefix_cache=skip,
                             task_type="long", stop=pb.StopConditions(ignore_eos=True))
    for m in messages:
        req.chat.messages.add(role=m["role"], content=m["content"])
    return req


@dataclass
class Timed:
    ttft: float  # seconds from the call to the first chunk with tokens (client side)
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stats: pb.GenerationStats | None = None


def timed(stub, req) -> Timed:
    """A streamed request, timed."""
    start = time.perf_counter()
    out = Timed(0.0)
    for chunk in stub.GenerateStream(req, timeout=900):
        if chunk.token_ids and not out.tokens:
            out.ttft = time.perf_counter() - start
        out.tokens += chunk.token_ids
        out.text += chunk.text
        if chunk.HasField("stats"):
            out.stats = chunk.stats
    return out


class HFForward:
    """transformers' own bf16 model: the forward time of a prompt's prefill."""

    def __init__(self, model_dir: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

    def seconds(self, ids: list[int], repeats: int = 3) -> float:
        torch = self._torch
        x = torch.tensor([ids])
        times = []
        with torch.inference_mode():
            for _ in range(repeats):
                t = time.perf_counter()
                self.model(x, logits_to_keep=1)
                times.append(time.perf_counter() - t)
        return statistics.median(times)


def run(stub, model_dir: str, dtype: str, max_new_tokens: int, kernels: str, out=sys.stdout,
        sizes: tuple[int, ...] = SIZES) -> int:
    from transformers import AutoTokenizer

    from specsplit.model.chat import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    docs = documents(tokenizer, sizes)
    print("loading transformers' own model ...", file=sys.stderr, flush=True)
    hf = HFForward(model_dir, dtype)
    hf.seconds(chat_prompt_ids(tokenizer, _messages(docs[0][1][:sizes[0]], QUESTIONS[0])), 1)  # warm-up
    timed(stub, _request(_messages("warm-up", QUESTIONS[0]), 4, True))
    rows = []
    for name, doc in docs:
        print(f"{name}: cold, warm, transformers ...", file=sys.stderr, flush=True)
        rows.append(_document(stub, tokenizer, hf, name, doc, max_new_tokens))
    print(f"stall: a stream decoding beside a cold prefill of {sizes[-1]} tokens ...", file=sys.stderr, flush=True)
    stall = _stall(stub, docs[-1][1], max_new_tokens)
    print("chat: turns that resend the conversation ...", file=sys.stderr, flush=True)
    chat = _chat(stub, docs[0][1], max_new_tokens)
    print(f"\nspecsplit bench --long-context: documents = Python standard library sources, greedy, "
          f"max_new_tokens={max_new_tokens}; target forward: {kernels}; transformers {dtype} forward in this "
          f"process (logits of the last position), same token ids", file=out)
    _print_documents(rows, out)
    gaps, beside, tokens, ttft, chunks = stall
    med, during = statistics.median(gaps), max(beside, default=0.0)
    print(f"\nstall: a spec-off stream's median gap between chunks {med * 1e3:.1f} ms alone; while a {tokens}-token "
          f"cold prefill ran beside it, median {statistics.median(beside or [0]) * 1e3:.1f} ms and longest "
          f"{during * 1e3:.1f} ms ({during / med:.1f}x the median alone); that prefill's TTFT {ttft:.2f} s in "
          f"{chunks} chunks", file=out)
    print(f"\nchat over {docs[0][0]} (each turn resends the conversation):", file=out)
    print(f"{'turn':>5}{'prompt tokens':>15}{'cached':>8}{'TTFT s':>9}", file=out)
    for i, (tokens, cached, ttft) in enumerate(chat, 1):
        print(f"{i:>5}{tokens:>15}{cached:>8}{ttft:>9.3f}", file=out)
    differ = sum(row[8] - row[7] for row in rows)
    if differ:
        print(f"\n{differ} warm answers differ from their cold or spec-on runs", file=out)
    return 1 if differ else 0


def _document(stub, tokenizer, hf, name: str, doc: str, max_new_tokens: int) -> tuple:
    """One document: cold (its first question, several times), transformers' forward of it, then
    each later question warm (the prefix cache), cold and spec-on; a table row."""
    from specsplit.model.chat import chat_prompt_ids

    first = _messages(doc, QUESTIONS[0])
    cold = [timed(stub, _request(first, max_new_tokens, True)) for _ in range(COLD_REPEATS)]
    forward = hf.seconds(chat_prompt_ids(tokenizer, first))
    warm, same, spec = [], 0, []
    for q in QUESTIONS[1:]:
        messages = _messages(doc, q)
        w = timed(stub, _request(messages, max_new_tokens, False))
        c = timed(stub, _request(messages, max_new_tokens, True))
        on = timed(stub, _request(messages, max_new_tokens, False, pb.SPECULATION_ON))
        warm.append(w)
        cold.append(c)
        same += w.tokens == c.tokens == on.tokens
        spec.append((w.stats, on.stats))
    cold_s = [c.ttft for c in cold]
    off_rate = sum(s.generated_tokens for s, _ in spec) / sum(s.decode_ms for s, _ in spec) * 1e3
    on_rate = sum(s.generated_tokens for _, s in spec) / sum(s.decode_ms for _, s in spec) * 1e3
    return (name, cold[0].stats.prompt_tokens, statistics.median(cold_s), p95(cold_s), forward,
            statistics.median(w.ttft for w in warm), statistics.median(w.stats.prefix_cached_tokens for w in warm),
            same, len(warm), off_rate, on_rate, statistics.mean(s.mean_acceptance_length for _, s in spec),
            statistics.median(c.stats.prefill_chunks for c in cold))


def _print_documents(rows: list[tuple], out) -> None:
    print(f"{'document':<20}{'tokens':>7}{'cold TTFT P50/P95 s':>21}{'chunks':>7}{'HF fwd s':>9}{'cold/HF':>8}"
          f"{'warm TTFT s':>12}{'warm/cold':>10}{'cached':>7}{'identical':>10}{'off tok/s':>10}{'on tok/s':>9}"
          f"{'acc.len':>8}", file=out)
    for (name, tokens, c50, c95, fwd, w50, cached, same, n, off, on, acc, chunks) in rows:
        print(f"{name:<20}{tokens:>7}{c50:>12.3f} /{c95:>6.3f}{chunks:>7.0f}{fwd:>9.3f}{c50 / fwd:>7.2f}x"
              f"{w50:>12.3f}{w50 / c50:>9.2f}x{cached:>7.0f}{f'{same}/{n}':>10}{off:>10.1f}{on:>9.1f}{acc:>8.2f}",
              file=out)


def _stall(stub, doc: str, max_new_tokens: int):
    """(the stream's gaps between chunks before the prefill began, its longest gap while the prefill
    ran, the prefill's prompt tokens, TTFT and chunks)."""
    stream = pb.GenerateRequest(text="Count from one to one thousand in words:", speculation=pb.SPECULATION_OFF,
                                max_new_tokens=max(256, max_new_tokens), stop=pb.StopConditions(ignore_eos=True))
    arrivals: list[float] = []
    started = threading.Event()

    def decode():
        tokens = 0
        for chunk in stub.GenerateStream(stream, timeout=900):
            if chunk.token_ids:
                arrivals.append(time.perf_counter())
                tokens += len(chunk.token_ids)
                if tokens >= 32:  # by tokens, not chunks: a spec-off chunk decoded ahead holds up to 16
                    started.set()
        started.set()

    thread = threading.Thread(target=decode)
    thread.start()
    started.wait()
    begin = time.perf_counter()
    long = timed(stub, _request(_messages(doc, QUESTIONS[0]), 1, True))
    end = begin + long.ttft
    thread.join()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b <= begin]
    beside = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > begin and a < end]
    return gaps, beside, long.stats.prompt_tokens, long.ttft, long.stats.prefill_chunks


def _chat(stub, doc: str, max_new_tokens: int) -> list[tuple[int, int, float]]:
    messages = [{"role": "system", "content": "Answer questions about this file.\n\n" + doc}]
    out = []
    for question in CHAT_TURNS:
        messages.append({"role": "user", "content": question})
        answer = timed(stub, _request(messages, max_new_tokens, False))
        out.append((answer.stats.prompt_tokens, answer.stats.prefix_cached_tokens, answer.ttft))
        messages.append({"role": "assistant", "content": answer.text})
    return out
