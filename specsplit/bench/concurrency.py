"""`specsplit bench --concurrency 1,2,4,8,16`: N clients at once, speculation off, on and AUTO, at
each level: aggregate tokens/s, per-request P50/P95 latency and time to first token, per task type,
with the verify batches actually formed; every greedy answer is checked against its spec-off
answer with one client. The three modes run interleaved in short turns (two requests per client
each), so that the machine's drift over a level hits all of them alike."""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from gateway.controller import p95
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.bench.workload import Prompt, Variant, request

MODES = {"off": pb.SPECULATION_OFF, "on": pb.SPECULATION_ON, "auto": pb.SPECULATION_AUTO}


@dataclass
class Answer:
    prompt: int  # index into the prompt list
    task_type: str
    tokens: list[int]
    latency_s: float
    ttft_s: float
    rounds: int
    batch_calls: int  # summed over the rounds (sessions in each round's verify forward)
    batch_rows: int
    reason: str
    accepted: int
    forwards: int  # the verifier's forwards after the prefill (a decode-ahead round has several)


@dataclass
class Level:
    clients: int
    mode: str
    wall_s: float
    answers: list[Answer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(a.tokens) for a in self.answers)

    def rate(self, task_type: str = "ALL") -> float:
        """Aggregate tokens/s; per task type, its share of the level's tokens over the same wall time
        would hide nothing new, so a type's rate is its tokens over its requests' summed latency
        times the clients (what the type would get with the whole level to itself)."""
        if task_type == "ALL":
            return self.tokens / self.wall_s
        mine = [a for a in self.answers if a.task_type == task_type]
        busy = sum(a.latency_s for a in mine)
        return self.clients * sum(len(a.tokens) for a in mine) / busy if busy else 0.0


def one(stub, p: Prompt, index: int, mode: str, max_new_tokens: int, variant: Variant) -> Answer:
    start = time.perf_counter()
    first, tokens, stats = None, [], None
    for chunk in stub.GenerateStream(request(p, MODES[mode], max_new_tokens, variant), timeout=600):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
        tokens += chunk.token_ids
        if chunk.HasField("stats"):
            stats = chunk.stats
    latency = time.perf_counter() - start
    rounds = stats.round_records
    return Answer(index, p.task_type, tokens, latency, first if first is not None else latency, len(rounds),
                  sum(r.batch_calls for r in rounds), sum(r.batch_rows for r in rounds),
                  stats.speculation_reason, stats.accepted_tokens, stats.forwards or len(rounds))


TURN = 2  # requests per client in one turn of a mode


def turn(stub, prompts: list[Prompt], out: Level, max_new_tokens: int, variant: Variant, first: int) -> None:
    """`out.clients` threads, each sending TURN requests back to back (client i starts at prompt
    first + i, so every prompt is met at every level); adds to out's answers and wall time."""
    clients, mode = out.clients, out.mode
    lock = threading.Lock()

    def client(i: int) -> None:
        for n in range(TURN):
            index = (first + i + n * clients) % len(prompts)
            try:
                answer = one(stub, prompts[index], index, mode, max_new_tokens, variant)
            except Exception as e:  # noqa: BLE001 -- counted and printed
                with lock:
                    out.errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                out.answers.append(answer)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.wall_s += time.perf_counter() - start


def run(stub, prompts: list[Prompt], levels: list[int], max_new_tokens: int, variant: Variant,
        requests_per_level: int, out=sys.stdout) -> int:
    """Every level in off, on, auto order; returns 1 if any request failed or any greedy answer
    differed from its one-client spec-off answer, else 0."""
    reference: dict[int, list[int]] = {}
    results: list[Level] = []
    for clients in levels:
        turns = max(1, -(-requests_per_level // (clients * TURN)))
        modes = {mode: Level(clients, mode, 0.0) for mode in MODES}
        for t in range(turns):
            for mode in (list(MODES) if t % 2 == 0 else list(reversed(MODES))):
                turn(stub, prompts, modes[mode], max_new_tokens, variant, t * clients * TURN)
        if clients == levels[0]:
            reference = {a.prompt: a.tokens for a in modes["off"].answers}
        for lv in modes.values():
            results.append(lv)
            print(f"concurrency {clients:>2} {lv.mode:<4} {lv.rate():7.1f} tok/s  {len(lv.answers)} requests"
                  f"{f'  {len(lv.errors)} errors' if lv.errors else ''}", file=sys.stderr, flush=True)
    return report(results, reference, prompts, out)


def report(results: list[Level], reference: dict[int, list[int]], prompts: list[Prompt], out) -> int:
    types = sorted({p.task_type for p in prompts})
    base = {lv.mode: lv.rate() for lv in results if lv.clients == results[0].clients}
    print(f"concurrency sweep: {len(prompts)} prompts; aggregate tok/s, per-request latency (s), TTFT (s), "
          f"sessions per verify forward (mean over rounds); identical: greedy answers equal to the one-client "
          f"spec-off answer", file=out)
    print(f"{'clients':>7} {'mode':<5}{'tok/s':>8}{'x 1 client':>11}{'p50 s':>7}{'p95 s':>7}{'ttft p50':>9}"
          f"{'ttft p95':>9}{'batch':>7}{'rows':>6}{'acc.len':>8}{'identical':>10}  "
          + "  ".join(f"{t[:10]:>10}" for t in types) + "  auto reasons", file=out)
    bad = 0
    by_clients: dict[int, dict[str, Level]] = defaultdict(dict)
    for lv in results:
        by_clients[lv.clients][lv.mode] = lv
        a = lv.answers
        lat, ttft = [x.latency_s for x in a], [x.ttft_s for x in a]
        rounds = sum(x.rounds for x in a) or 1
        same = sum(1 for x in a if reference.get(x.prompt) == x.tokens)
        bad += len(lv.errors) + (len(a) - same if reference else 0)
        reasons = Counter(x.reason for x in a) if lv.mode == "auto" else {}
        forwards = sum(x.forwards for x in a) or 1
        acc = (sum(x.accepted for x in a) + forwards) / forwards  # tokens per target forward
        print(f"{lv.clients:>7} {lv.mode:<5}{lv.rate():>8.1f}{lv.rate() / base[lv.mode]:>10.2f}x"
              f"{statistics.median(lat):>7.2f}{p95(lat):>7.2f}{statistics.median(ttft):>9.3f}{p95(ttft):>9.3f}"
              f"{sum(x.batch_calls for x in a) / rounds:>7.2f}{sum(x.batch_rows for x in a) / rounds:>6.1f}"
              f"{acc:>8.2f}{f'{same}/{len(a)}':>10}  "
              + "  ".join(f"{lv.rate(t):>10.1f}" for t in types)
              + f"  {dict(reasons) if reasons else ''}"
              + (f"  ERRORS {len(lv.errors)}: {lv.errors[0]}" if lv.errors else ""),
              file=out)
    print("on/off and auto against the better of on and off, per level:", file=out)
    for clients, modes in by_clients.items():
        off, on, auto = (modes[m].rate() for m in ("off", "on", "auto"))
        print(f"  {clients:>2} clients: on/off {on / off:.2f}x, auto/best {auto / max(on, off):.2f}x "
              f"(best: {'on' if on > off else 'off'})", file=out)
    return 1 if bad else 0
