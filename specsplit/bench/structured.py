"""`specsplit bench --structured`: structured output as users ask for it. Each prompt of the workload
(`specsplit/data/structured_prompts.jsonl`: our own prompts, each with a JSON schema) runs with its
schema spec-off, as the default request (AUTO) and forced on, and without its schema spec-off and
AUTO (the same workload's unconstrained speculation gain), all greedy and cold (no prefix cache). It
prints per prompt and overall: tok/s and ratios, how much of each constrained output the schema
forced, that every constrained output parses and validates, that on equals off; and the mask's
cost per token against the target's 1-row step."""

from __future__ import annotations

import json
import statistics
import sys
import time
from importlib import resources
from pathlib import Path

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb

MODES = {  # label -> (speculation, constrained)
    "off": (pb.SPECULATION_OFF, True), "default": (pb.SPECULATION_AUTO, True), "on": (pb.SPECULATION_ON, True),
    "free off": (pb.SPECULATION_OFF, False), "free default": (pb.SPECULATION_AUTO, False)}


def load(path: str | None) -> list[dict]:
    text = Path(path).read_text() if path else resources.files("specsplit.data").joinpath(
        "structured_prompts.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def request(row: dict, speculation: int, constrained: bool, max_new_tokens: int) -> pb.GenerateRequest:
    req = pb.GenerateRequest(max_new_tokens=max_new_tokens, speculation=speculation, skip_prefix_cache=True,
                             task_type="" if speculation == pb.SPECULATION_AUTO else f"bench-{row['task_type']}")
    req.chat.messages.add(role="user", content=row["prompt"])
    if constrained:
        req.constraint.CopyFrom(cpb.Constraint(json_schema=json.dumps(row["schema"])))
    return req


def valid(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    try:
        import jsonschema
    except ImportError:  # a dev extra: without it, parsing is the check
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def mask_cost_us(model_dir: str, rows: list[dict], outputs: dict) -> float:
    """Median microseconds to compute one row's mask along the workload's constrained outputs."""
    from transformers import AutoTokenizer

    from specsplit.serving.grammar import Language

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    times = []
    for row in rows:
        matcher = Language(cpb.Constraint(json_schema=json.dumps(row["schema"])), tokenizer, len(tokenizer)).matcher()
        for token in outputs[row["task_type"]]:
            start = time.perf_counter()
            matcher.walk([]).mask(0)
            times.append(time.perf_counter() - start)
            matcher.consume([token])
    return 1e6 * statistics.median(times) if times else 0.0


def run(stub, rows: list[dict], max_new_tokens: int, repeats: int, model_dir: str | None, step_ms: float | None,
        out=None) -> dict:
    out = out or sys.stdout
    seconds = {m: 0.0 for m in MODES}
    tokens = {m: 0 for m in MODES}
    decoding = {m: [0.0, 0] for m in MODES}  # ms after the first token, tokens after the first
    per, outputs, checks = {}, {}, {"valid": 0, "complete": 0, "identical": 0, "n": 0, "forced": 0, "generated": 0}
    for row in rows:
        got = {mode: _median_reply(stub, row, speculation, constrained, max_new_tokens, repeats)
               for mode, (speculation, constrained) in MODES.items()}
        for mode, (reply, wall) in got.items():
            seconds[mode] += wall
            tokens[mode] += len(reply.token_ids)
            decoding[mode][0] += reply.stats.decode_ms
            decoding[mode][1] += max(0, len(reply.token_ids) - 1)
        _check(row, got, checks)
        outputs[row["task_type"]] = list(got["off"][0].token_ids)
        rate = {m: len(r.token_ids) / s for m, (r, s) in got.items()}
        per[row["task_type"]] = rate
        print(f"[{len(per)}/{len(rows)}] {row['task_type']:<9} off {rate['off']:6.1f} default {rate['default']:6.1f} "
              f"({rate['default'] / rate['off']:.2f}x) tok/s, forced {got['default'][0].stats.forced_tokens}/"
              f"{len(got['default'][0].token_ids)}", file=sys.stderr, flush=True)
    total = {m: tokens[m] / seconds[m] for m in MODES}
    rate_after = {m: n / ms if ms else 0.0 for m, (ms, n) in decoding.items()}
    print(f"specsplit bench --structured: {len(rows)} prompts with a JSON schema, greedy, max_new_tokens="
          f"{max_new_tokens}, repeats={repeats}; tok/s = tokens / wall time incl. a cold prefill", file=out)
    _table(per, total, out)
    summary = _summary(per, total, rate_after, checks, out)
    if model_dir:
        us = mask_cost_us(model_dir, rows, outputs)
        summary["mask_us"] = us
        line = (f"mask per token: {us:.0f} us median (llguidance, along the spec-off outputs; greedy rows whose "
                "own choice is allowed skip it)")
        if step_ms:
            line += f" = {us / 1e3 / step_ms:.1%} of the 1-row step ({step_ms:.2f} ms)"
            summary["mask_share_of_step"] = us / 1e3 / step_ms
        print(line, file=out)
    return summary


def _median_reply(stub, row: dict, speculation, constrained: bool, max_new_tokens: int, repeats: int):
    """(the last reply, the median wall time of `repeats` runs)."""
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        reply = stub.Generate(request(row, speculation, constrained, max_new_tokens), timeout=600)
        walls.append(time.perf_counter() - start)
    return reply, statistics.median(walls)


def _check(row: dict, got: dict, checks: dict) -> None:
    """The constrained modes' outputs: valid against the schema, complete, identical to spec-off;
    the tokens the schema forced in the default request's."""
    for mode in ("off", "default", "on"):
        reply = got[mode][0]
        checks["n"] += 1
        checks["valid"] += valid(reply.text, row["schema"])
        checks["complete"] += reply.stats.constraint_complete
        checks["identical"] += reply.text == got["off"][0].text
    checks["forced"] += got["default"][0].stats.forced_tokens
    checks["generated"] += len(got["default"][0].token_ids)


def _table(per: dict, total: dict, out) -> None:
    print(f"{'prompt':<10}{'off':>8}{'default':>9}{'def/off':>8}{'on':>8}{'on/off':>7}{'free off':>9}"
          f"{'free def':>9}{'free gain':>10}", file=out)
    for name, rate in [*per.items(), ("ALL", total)]:
        print(f"{name:<10}{rate['off']:>8.1f}{rate['default']:>9.1f}{rate['default'] / rate['off']:>7.2f}x"
              f"{rate['on']:>8.1f}{rate['on'] / rate['off']:>6.2f}x{rate['free off']:>9.1f}{rate['free default']:>9.1f}"
              f"{rate['free default'] / rate['free off']:>9.2f}x", file=out)


def _summary(per: dict, total: dict, rate_after: dict, checks: dict, out) -> dict:
    gain = total["default"] / total["off"]
    free_gain = total["free default"] / total["free off"]
    decode_gain = rate_after["default"] / rate_after["off"] if rate_after["off"] else 0.0
    free_decode_gain = rate_after["free default"] / rate_after["free off"] if rate_after["free off"] else 0.0
    forced, generated = checks.pop("forced"), checks.pop("generated")
    summary = {"per_prompt": per, "all": total, "default_vs_off": gain, "free_default_vs_off": free_gain,
               "gain_vs_free_gain": gain / free_gain, "forced_share": forced / max(1, generated),
               "decode_default_vs_off": decode_gain, "decode_free_default_vs_off": free_decode_gain, **checks}
    print(f"constrained outputs valid against their schema {checks['valid']}/{checks['n']}, complete "
          f"{checks['complete']}/{checks['n']}, identical to spec-off {checks['identical']}/{checks['n']}; "
          f"forced by the schema: {forced}/{generated} tokens of the default request's outputs "
          f"({forced / max(1, generated):.0%}); default/off {gain:.2f}x against the unconstrained {free_gain:.2f}x "
          f"({gain / free_gain:.2f}x)", file=out)
    print(f"decode only (tokens after the first / time after prefill): default/off {decode_gain:.2f}x constrained, "
          f"{free_decode_gain:.2f}x unconstrained", file=out)
    return summary


def main(args, config) -> int:
    from specsplit.bench import anchor as anchoring
    from specsplit.launcher import gateway_stub
    from specsplit.model import catalog

    rows = load(args.prompts if args.prompts not in (None, "structured") else None)
    if args.limit:
        rows = rows[:args.limit]
    if args.temperature:
        print("--structured measures greedy decoding (--temperature is not applied)", file=sys.stderr)
    model_dir = step_ms = None
    if not args.gateway:
        model_dir = str(catalog.resolve(config.target_model))
        print("measuring the target step ...", file=sys.stderr, flush=True)
        step_ms = anchoring.step_profile(model_dir, config.dtype, config.quantize)["rows1_ms"]
    with gateway_stub(args.gateway, config, args.auth_token_file) as (stub, _):
        stub.Generate(request(rows[0], pb.SPECULATION_ON, True, 16), timeout=600)
        summary = run(stub, rows, args.max_new_tokens, args.repeats, model_dir, step_ms)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=1))
    return 0 if summary["valid"] == summary["n"] and summary["identical"] == summary["n"] else 1
