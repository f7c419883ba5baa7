"""`specsplit bench --ceiling`: what the drafters could win with no round plumbing at all. The
verifier's own code decodes in this process, no services: spec-off; its prompt lookup (the
decode-ahead's `Decoding.draft`, priced at the width curve measured here and kept current from the
lone forwards, as the service does); the feature head (the draft service's SelfDrafter with its
confidence stop, as deep as its accepted rate pays at that curve); and both (the lookup where it
finds a copy, else the head). Decode time only, after the prefill; greedy. A ratio here bounds what
any transport, gate or drafter choice can give the same drafters on this target and machine
(docs/benchmarks.md#the-ceiling)."""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.spec.lookup import Agreement
from specsplit.tools.workload import Prompt

MODES = ("off", "lookup", "head", "both")
LOOKUP_GAMMA = 8  # as the gateway asks: max(gamma, tree budget)


@dataclass
class Run:
    tokens: list[int]
    ms: float  # decode wall time after the prefill
    forwards: int
    head_drafted: int = 0
    head_accepted: int = 0
    head_ms: float = 0.0


def decode(target, ids: list[int], n: int, mode: str, start: list[float], head, gamma: int, widths=None) -> Run:
    """One greedy decode of up to n tokens by `mode`, as the verifier's decode-ahead runs it: drafts
    priced at the width curve measured at `start`, then (`widths`, verify_service.widths.Widths) at
    what its lone forwards cost now."""
    from verify_service.decoding import Decoding

    heading = mode in ("head", "both") and head is not None
    session, first = target.prefill(ids, with_features=heading)
    # The decode-ahead commits decode_ahead + 1 tokens after the prefill's: n in all.
    lookup = LOOKUP_GAMMA if mode in ("lookup", "both") else 0
    request = vpb.VerifyRequest(decode_ahead=max(0, n - 2), lookup_gamma=lookup)
    own, trust = None, Agreement()
    if heading:
        own = head.start(ids)
        own.sync(len(ids), [first.next_token])
        own.add_features(0, first.features)
    decoding, run = Decoding(), Run([], 0.0, 0)
    eos = set(target.lm.eos_token_ids)
    session.stop_tokens = frozenset(eos)
    started = time.perf_counter()
    while first.next_token not in eos and n > 1:
        curve = widths.curve(session.step_ms, start) if widths is not None else start
        draft = decoding.draft(request, session, curve) if request.lookup_gamma else []
        from_head = heading and not draft
        if from_head:
            room = min(gamma, request.decode_ahead - decoding.committed)
            depth = trust.depth(room, curve) if room > 0 else 0
            if depth:
                t = time.perf_counter()
                draft = head.propose(own, depth).tokens
                run.head_ms += 1e3 * (time.perf_counter() - t)
        length = len(session.tokens)
        result = target.run_one(target.plan_verify(session, length, draft, copied=True))
        run.forwards += 1
        decoding.add(result, session)
        if widths is not None:
            widths.add(session.step_ms, 1 + len(draft), result.forward_ns / 1e6)
        if from_head and draft:
            trust.add(len(draft), result.num_accepted)
            run.head_drafted += len(draft)
            run.head_accepted += result.num_accepted
        if own is not None:
            own.sync(length, session.tokens[length:])
            own.add_features(length - 1, result.features)
        if decoding.finished(request, session, target.lm.max_context):
            break
    run.ms = 1e3 * (time.perf_counter() - started)
    out = session.tokens[len(ids):]
    end = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
    run.tokens = out[:min(end, n)]
    return run


def main(args, config) -> int:
    from transformers import AutoTokenizer

    from draft_service.drafters.selfdraft import SelfDrafter, resolve_head
    from specsplit.cli.serve import self_head_path
    from specsplit.model import catalog
    from specsplit.model.modeling import chat_prompt_ids, load_model
    from specsplit.serving.settings import ControllerSettings, DraftSettings
    from specsplit.tools.workload import load_prompts
    from verify_service.engine import Target
    from verify_service.server import first_id, measure_rows
    from verify_service.widths import Widths

    prompts = load_prompts(args.prompts or "general", args.limit)
    config = config.resolved()
    model_dir = catalog.resolve(config.target_model)
    lm = load_model(model_dir, config.dtype, config.device, config.exact, quantize=config.quantize)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = Target(lm)
    curve = measure_rows(target, first_id(lm))
    widths = Widths()
    flag = self_head_path(config.self_head, config.target_model)
    head = None if flag is None else SelfDrafter(resolve_head(flag), model_dir, config.device,
                                                  min_confidence=DraftSettings.self_min_confidence)
    modes = MODES if head is not None else MODES[:2]
    print(f"ceiling: {lm.model_id} ({lm.kernels}), {len(prompts)} prompts, {args.max_new_tokens} tokens, greedy, "
          f"{args.repeats} repeat(s); decode only, in this process; a forward by rows 1..{len(curve)}: "
          + " ".join(f"{ms:.2f}" for ms in curve) + " ms" + ("" if head else "; no feature head for this target"),
          file=sys.stderr, flush=True)
    runs: dict[tuple[int, str], list[Run]] = defaultdict(list)
    for repeat in range(args.repeats):
        for i, p in enumerate(prompts):
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}])
            order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]
            for mode in order:
                runs[(i, mode)].append(decode(target, ids, args.max_new_tokens, mode, curve, head,
                                              ControllerSettings.gamma_start, widths))
    print_table(prompts, runs, modes)
    return 0


def print_table(prompts: list[Prompt], runs: dict, modes: tuple[str, ...], out=sys.stdout) -> None:
    """Per category: spec-off ms a token, each mode's decode-only ratio against it, tokens a forward,
    the head's accepted share, and outputs identical to spec-off."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        groups[p.task_type].append(i)
    groups["ALL"] = list(range(len(prompts)))

    def ms(i: int, mode: str) -> float:  # median over repeats
        return statistics.median(r.ms for r in runs[(i, mode)])

    head = f"{'category':<10}{'off ms/tok':>11}" + "".join(f"{m + ' /off':>11}{'tok/fwd':>8}" for m in modes[1:])
    head += f"{'head acc':>10}{'identical':>10}"
    print(head, file=out)
    for name, members in groups.items():
        tokens = sum(max(1, len(runs[(i, "off")][0].tokens) - 1) for i in members)  # after the prefill's
        off = sum(ms(i, "off") for i in members) / tokens
        line = f"{name:<10}{off:>11.3f}"
        for mode in modes[1:]:
            mode_ms = sum(ms(i, mode) for i in members) / tokens
            forwards = sum(runs[(i, mode)][0].forwards for i in members)
            line += f"{off / mode_ms:>10.2f}x{tokens / max(1, forwards):>8.2f}"
        if "head" in modes:
            drafted = sum(runs[(i, "head")][0].head_drafted for i in members)
            accepted = sum(runs[(i, "head")][0].head_accepted for i in members)
            line += f"{accepted:>5}/{drafted:<4}"
        same = sum(all(r.tokens == runs[(i, 'off')][0].tokens for m in modes for r in runs[(i, m)]) for i in members)
        line += f"{same:>6}/{len(members):<3}"
        print(line, file=out)
    if "head" in modes:
        drafting = sum(r.head_ms for (i, m), rs in runs.items() if m == "head" for r in rs)
        total = sum(r.ms for (i, m), rs in runs.items() if m == "head" for r in rs)
        print(f"the head's drafting: {100 * drafting / max(total, 1e-9):.0f} % of the head mode's decode time",
              file=out)
