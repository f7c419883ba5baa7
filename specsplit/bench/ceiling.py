"""`specsplit bench --ceiling`: what the drafters could win with no round plumbing at all. The
verifier's own code decodes in this process, no services: spec-off; its prompt lookup (the
decode-ahead's `Decoding.draft`, priced at the width curve measured here and kept current from the
lone forwards, as the service does); the stack's neural drafter, built as the draft service builds
it (the feature head with its confidence stop, or the draft model: the hybrid's), as deep as its
accepted rate pays at that curve; and both (the lookup where it finds a copy, else the neural
drafter). Decode time only, after the prefill; greedy. A ratio here bounds what any transport, gate
or drafter choice can give the same drafters on this target and machine
(docs/benchmarks.md#the-ceiling)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

from specsplit.api.verify.v1 import verify_pb2 as vpb
from specsplit.bench.workload import Prompt
from specsplit.speculation.lookup import Agreement
from verify_service.decoding import Decoding

MODES = ("off", "lookup", "neural", "both")
LOOKUP_GAMMA = 8  # as the gateway asks: max(gamma, tree budget)


@dataclass
class Run:
    tokens: list[int]
    ms: float  # decode wall time after the prefill
    forwards: int
    forced: int = 0  # tokens the language forced (drafted by the verifier)
    drafted: int = 0  # by the neural drafter
    accepted: int = 0
    draft_ms: float = 0.0


def decode(target, ids: list[int], n: int, mode: str, start: list[float], drafter, gamma: int, widths=None,
           language=None) -> Run:
    """One greedy decode of up to n tokens by `mode`, as the verifier's decode-ahead runs it: drafts
    priced at the width curve measured at `start`, then (`widths`, verify_service.widths.Widths) at
    what its lone forwards cost now. With a `language` (structured output) every token is chosen in
    it, and a mode that drafts also drafts what the language forces (spec-off does not: as served)."""
    neural = mode in ("neural", "both") and drafter is not None
    reads = neural and drafter.description.needs_features
    session, first = target.prefill(ids, with_features=reads, language=language)
    # The decode-ahead commits decode_ahead + 1 tokens after the prefill's: n in all.
    lookup = LOOKUP_GAMMA if mode in ("lookup", "both") else 0
    request = vpb.VerifyRequest(decode_ahead=max(0, n - 2), lookup_gamma=lookup)
    own, trust = None, Agreement()
    if neural:
        own = drafter.start(ids)
        own.sync(len(ids), [first.next_token])
        if reads:
            own.add_features(0, first.features)
    decoding, run = Decoding(), Run([], 0.0, 0)
    eos = set(target.lm.eos_token_ids)
    session.stop_tokens = frozenset(eos)
    started = time.perf_counter()
    while first.next_token not in eos and n > 1:
        curve = widths.curve(session.step_ms, start) if widths is not None else start
        draft = decoding.draft(request, session, curve)[0] if request.lookup_gamma else []
        asked = neural and not draft
        if asked:
            room = min(gamma, request.decode_ahead - decoding.committed)
            depth = trust.depth(room, curve) if room > 0 else 0
            if depth:
                t = time.perf_counter()
                draft = drafter.propose(own, depth).tokens
                run.draft_ms += 1e3 * (time.perf_counter() - t)
        length = len(session.tokens)
        fill = request.decode_ahead - decoding.committed if mode != "off" else 0
        # Greedy: how a draft was made does not enter its verification (`copied` only speaks to q).
        result = target.run_one(target.plan_verify(session, length, draft, copied=True, fill=fill))
        run.forwards += 1
        run.forced += result.forced_accepted
        decoding.add(result, session)
        if widths is not None:
            widths.add(session.step_ms, 1 + len(draft), result.forward_ns / 1e6)
        if asked and draft:
            trust.add(len(draft), result.num_accepted)
            run.drafted += len(draft)
            run.accepted += result.num_accepted
        if own is not None:
            own.sync(length, session.tokens[length:])
            if reads:
                own.add_features(length - 1, result.features)
        if decoding.finished(request, session, target.lm.max_context):
            break
    run.ms = 1e3 * (time.perf_counter() - started)
    if own is not None:
        drafter.end(own)
    out = session.tokens[len(ids):]
    end = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
    run.tokens = out[:min(end, n)]
    return run


def main(args, config) -> int:
    from transformers import AutoTokenizer

    from specsplit.model import catalog
    from specsplit.model.chat import chat_prompt_ids
    from specsplit.model.modeling import load_model
    from specsplit.serving.settings import ControllerSettings
    from verify_service.engine import Target
    from verify_service.widths import Widths, first_id, measure_rows

    config = config.resolved()
    model_dir = catalog.resolve(config.target_model)
    lm = load_model(model_dir, config.dtype, config.device, config.exact, quantize=config.quantize)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    target = Target(lm)
    curve = measure_rows(target, first_id(lm))
    widths = Widths()
    if args.structured:  # each prompt with its schema, then without: the verifier's own drafting only
        prompts, languages, drafter = *_structured(args.prompts, tokenizer, lm.vocab_size), None
    else:
        prompts, languages, drafter = _general(args, config), None, _neural_drafter(config)
    modes = MODES if drafter is not None else MODES[:2]
    print(f"ceiling: {lm.model_id} ({lm.kernels}), {len(prompts)} prompts, {args.max_new_tokens} tokens, greedy, "
          f"{args.repeats} repeat(s); decode only, in this process; a forward by rows 1..{min(9, len(curve))}: "
          + " ".join(f"{ms:.2f}" for ms in curve[:9]) + " ms; neural: "
          + (f"{drafter.description.kind} {drafter.description.model_id}" if drafter else "none"),
          file=sys.stderr, flush=True)
    constrained: dict[tuple[int, str], list[Run]] = defaultdict(list)
    free: dict[tuple[int, str], list[Run]] = defaultdict(list)
    for repeat in range(args.repeats):
        for i, p in enumerate(prompts):
            ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}])
            order = modes[repeat % len(modes):] + modes[:repeat % len(modes)]
            for mode in order:
                for runs, language in ((free, None), (constrained, languages[i] if languages else None)):
                    if runs is constrained and languages is None:
                        continue
                    runs[(i, mode)].append(decode(target, ids, args.max_new_tokens, mode, curve, drafter,
                                                  ControllerSettings.gamma_max, widths, language))
    if languages is None:
        print_table(prompts, free, modes)
    else:
        _print_structured(prompts, constrained, free, modes)
    return 0


def _structured(path: str | None, tokenizer, vocab_size: int) -> tuple[list[Prompt], list]:
    """The structured workload's prompts and each one's schema as a language."""
    from specsplit.api.common.v1 import common_pb2 as cpb
    from specsplit.bench import structured
    from specsplit.serving.grammar import Language

    rows = structured.load(path)
    return ([Prompt(r["task_type"], r["prompt"]) for r in rows],
            [Language(cpb.Constraint(json_schema=json.dumps(r["schema"])), tokenizer, vocab_size) for r in rows])


def _general(args, config) -> list[Prompt]:
    from specsplit.bench.workload import load_prompts

    return load_prompts(args.prompts or "general", args.limit)


def _neural_drafter(config):
    """The hybrid's neural drafter as the draft service would build it (the head, else the draft
    model), or None."""
    from draft_service.main import build_drafters
    from specsplit.model.headfile import head_setting
    from specsplit.serving.settings import DraftSettings, ModelSettings, ServerSettings

    draft_model = ModelSettings(config.draft_model, config.draft_dtype, config.device, exact=False,
                                quantize=config.draft_quantize) if config.draft_model else None
    drafters = build_drafters(DraftSettings(ServerSettings(""), draft_model, draft_vocab=config.draft_vocab,
                                            self_head=head_setting(config.self_head, config.target_model),
                                            target_model=config.target_model, device=config.device))
    return drafters.get("self") or drafters.get("model")


def _print_structured(prompts: list[Prompt], constrained: dict, free: dict, modes: tuple[str, ...]) -> None:
    print("with each prompt's schema (the lookup's steps also draft what the schema forces):")
    print_table(prompts, constrained, modes)
    print("the same prompts without it:")
    print_table(prompts, free, modes)
    gains = [sum(statistics.median(r.ms for r in runs[(i, "off")]) for i in range(len(prompts)))
             / sum(statistics.median(r.ms for r in runs[(i, "lookup")]) for i in range(len(prompts)))
             for runs in (constrained, free)]
    forced = sum(runs[0].forced for (i, m), runs in constrained.items() if m == "lookup")
    tokens = sum(len(runs[0].tokens) for (i, m), runs in constrained.items() if m == "lookup")
    print(f"constrained gain {gains[0]:.2f}x against the unconstrained {gains[1]:.2f}x ({gains[0] / gains[1]:.2f} "
          f"of it); the schema forced {forced} of {tokens} tokens")


def print_table(prompts: list[Prompt], runs: dict, modes: tuple[str, ...], out=sys.stdout) -> None:
    """Per category: spec-off ms a token, each mode's decode-only ratio against it, tokens a forward,
    the neural drafter's accepted share (alone), and outputs identical to spec-off."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        groups[p.task_type].append(i)
    groups["ALL"] = list(range(len(prompts)))

    def ms(i: int, mode: str) -> float:  # median over repeats
        return statistics.median(r.ms for r in runs[(i, mode)])

    head = f"{'category':<10}{'off ms/tok':>11}" + "".join(f"{m + ' /off':>11}{'tok/fwd':>8}" for m in modes[1:])
    head += (f"{'accepted':>10}" if "neural" in modes else "") + f"{'identical':>10}"
    print(head, file=out)
    for name, members in groups.items():
        tokens = sum(max(1, len(runs[(i, "off")][0].tokens) - 1) for i in members)  # after the prefill's
        off = sum(ms(i, "off") for i in members) / tokens
        line = f"{name:<10}{off:>11.3f}"
        for mode in modes[1:]:
            mode_ms = sum(ms(i, mode) for i in members) / tokens
            forwards = sum(runs[(i, mode)][0].forwards for i in members)
            line += f"{off / mode_ms:>10.2f}x{tokens / max(1, forwards):>8.2f}"
        if "neural" in modes:
            drafted = sum(runs[(i, "neural")][0].drafted for i in members)
            accepted = sum(runs[(i, "neural")][0].accepted for i in members)
            line += f"{accepted:>5}/{drafted:<4}"
        same = sum(all(r.tokens == runs[(i, 'off')][0].tokens for m in modes for r in runs[(i, m)]) for i in members)
        line += f"{same:>6}/{len(members):<3}"
        print(line, file=out)
    if "neural" in modes:
        drafting = sum(r.draft_ms for (i, m), rs in runs.items() if m == "neural" for r in rs)
        total = sum(r.ms for (i, m), rs in runs.items() if m == "neural" for r in rs)
        print(f"drafting: {100 * drafting / max(total, 1e-9):.0f} % of the neural mode's decode time", file=out)
