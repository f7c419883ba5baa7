"""The measuring commands: `bench`, `soak`, `calibrate`, `trace-report` (their work is in specsplit/bench/)."""

from __future__ import annotations

import argparse

from specsplit.cli.flags import ENV, list_of, stack_config, stack_flags

# The bench's other measurements, each instead of the on/off table (--controlled and --concurrency
# take values, below).
MODES = (
    ("--topology", "instead: co-located (UNIX, TCP) and split with an emulated RTT between gateway+verifier and "
                   "drafter (a userspace delaying proxy); speedup, overhead per round, break-even RTT"),
    ("--long-context", "instead: documents of 2k-6k tokens with questions (time to first token cold and with the "
                       "prefix cache, against transformers' forward), a long prefill beside a decoding stream, "
                       "and a multi-turn chat"),
    ("--round-overhead", "per-round overhead (median, P95) through the real services around a drafter and a verifier "
                         "that cost nothing, for shared memory, UNIX socket and TCP; then a round hop by hop with "
                         "the real model (the stack's target, forced n-gram, one prompt per category of --prompts, "
                         "default: the general workload)"),
    ("--traffic", "instead: the default request as users send it: the prompts (default: the general workload, six "
                  "categories) shuffled and unlabelled, AUTO beside spec-off and forced spec-on with each drafter; "
                  "per category the ratios, and spec-off's decode rate through the services vs the bare forward's"),
    ("--structured", "instead: structured output: prompts each with a JSON schema (default: the built-in workload), "
                     "constrained spec-off, AUTO and forced on beside the same prompts unconstrained; validity, "
                     "the share of tokens the schema forced, and the mask's cost against a step"),
    ("--ceiling", "instead: what the drafters could win with no round plumbing: the verifier's own code decoding in "
                  "this process (no services), spec-off, its prompt lookup, the stack's neural drafter (the feature "
                  "head, or the draft model) and both, per category of --prompts (default: the general workload); "
                  "decode-only ratios, tokens a forward (with --structured: each prompt with and without its schema)"),
    ("--tracing-overhead", "instead: spec-on requests alternated between a stack with tracing off and one with "
                           "tracing on (OTLP-JSON file), and the median cost of tracing per token"),
)


def add(sub) -> None:
    for add_command in (_add_bench, _add_soak, _add_calibrate, _add_validate, _add_trace_report):
        add_command(sub)


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="speculation on vs off per task type, through the real services")
    bench.set_defaults(run=run_bench)
    stack_flags(bench)
    bench.add_argument("--gateway", help="use this running gateway instead of starting a stack")
    bench.add_argument("--auth-token-file", default=ENV("SPECSPLIT_AUTH_TOKEN_FILE"),
                       help="with --gateway: send the bearer token in this file")
    bench.add_argument("--prompts", help="JSONL with task_type, prompt and optionally temperature (default: the "
                                         "starter prompts; 'mixed': the controller's mixed workload; 'general': six "
                                         "categories users send (math, chat, qa, rag, summarize, translate); 'copy': "
                                         "verbatim repetition, where drafts are almost always right; 'long': "
                                         "~1,300-token prompts, whose features make a large first round)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--anchor", action="store_true",
                       help="also run transformers in-process (generate plain and with prompt lookup) on the same "
                            "prompts, interleaved, and print the ratios against it")
    bench.add_argument("--anchor-llama-cpp", metavar="DIR",
                       help="also run llama.cpp from a build in DIR on the target's GGUF file (model.gguf in its "
                            "directory): llama-bench's decode rate; where built, llama-lookup per prompt, and "
                            "llama-server end to end over its OpenAI API, plain and with its speculation (-md the "
                            "draft model's GGUF, else --spec-type ngram-mod); each beside ours")
    bench.add_argument("--repeats", type=int, default=1, help="runs per prompt and mode; medians are reported")
    bench.add_argument("--limit", type=int, default=0, help="use only the first N prompts of each task type")
    bench.add_argument("--neighbour", type=int, default=0, metavar="N",
                       help="also run every prompt beside N busy processes (a noisy neighbour on a shared machine), "
                            "right after its quiet runs; rows marked +busy, and busy over quiet per drafter (with "
                            "--controlled: then 30 s of AUTO code requests beside them, and 10 after)")
    bench.add_argument("--json-out", help="also write every record and the summary here")
    bench.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 samples (seeded)")
    bench.add_argument("--seed", type=int, default=0, help="sampler seed at temperature > 0")
    bench.add_argument("--predraft", choices=["off", "on", "auto"], default="off",
                       help="pre-drafting in spec-on requests (auto: the gateway decides); --topology runs both")
    bench.add_argument("--tree-budgets", default="", type=list_of(int, "integers"),
                       help="comma-separated token-tree sizes to compare for every drafter, e.g. 1,8 (1: chains; "
                            "default: the gateway's --tree-budget)")
    bench.add_argument("--methods", default="coupled,rejection", type=list_of(str, "method names"),
                       help="verify methods compared at temperature > 0")
    bench.add_argument("--store-tokens", type=int, default=0,
                       help="the retrieval store remembers outputs across requests; the bench runs every prompt "
                            "several times, which the store would simply copy, so it is off unless set")
    bench.add_argument("--controlled", type=int, default=0, metavar="PASSES",
                       help="instead: the controller at work; PASSES passes of AUTO requests to learn, then per "
                            "prompt spec-off, forced spec-on and AUTO (try --prompts mixed)")
    bench.add_argument("--rtts", default="", type=list_of(float, "numbers"),
                       help="with --topology: comma-separated RTTs in ms (default 0,0.5,1,2,5,10,20,40)")
    bench.add_argument("--plot", default="specsplit-topology.png", help="with --topology: PNG of the curve")
    bench.add_argument("--concurrency", default="", type=list_of(int, "integers"),
                       help="instead: this many clients at once (e.g. 1,2,4,8,16), speculation off, on and AUTO "
                            "at each level; aggregate tok/s, P50/P95 latency and TTFT, the batches formed")
    bench.add_argument("--requests", type=int, default=16,
                       help="with --concurrency: requests per level and mode (spread over the clients)")
    for flag, what in MODES:
        bench.add_argument(flag, action="store_true", help=what)
    bench.add_argument("--drafters", default="", type=list_of(str, "drafter names"),
                       help="comma-separated drafters to compare side by side, e.g. ngram,self; 'default': the "
                            "default request (AUTO, no drafter named) as users send it (default: every drafter "
                            "of the started stack and the default request; with --gateway, its default drafter)")


def _add_soak(sub) -> None:
    soak = sub.add_parser("soak", help="N clients for M minutes against a stack started here (optionally with "
                                       "chaos); errors, latency, memory drift and what was left behind")
    soak.set_defaults(run=run_soak)
    stack_flags(soak)
    soak.add_argument("--clients", type=int, default=8)
    soak.add_argument("--minutes", type=float, default=10.0)
    soak.add_argument("--prompts", help="JSONL with task_type and prompt (default: the starter prompts)")
    soak.add_argument("--max-new-tokens", type=int, default=64)
    soak.add_argument("--store-tokens", type=int, default=0,
                      help="the retrieval store across requests (off: every answer is checked against spec-off, "
                           "and the store would only make repeated prompts easier)")
    soak.add_argument("--chaos", choices=["", "kill", "stop", "kill-verify", "term-verify"], default="",
                      help="kill: SIGKILL the draft service now and then (it is restarted); stop: SIGSTOP it for "
                           "2 s; kill-verify: SIGKILL a verify replica (its requests resume on another, or on it once "
                           "restarted); term-verify: SIGTERM one (it drains; a rolling restart); "
                           "requests must complete and match spec-off all the same")
    soak.add_argument("--chaos-every", type=float, default=10.0, help="seconds between chaos events, on average")
    soak.add_argument("--faults", type=int, default=0,
                      help="with --chaos: end after this many chaos events, once the services serve again and "
                           "every client has been answered after that (0: run --minutes, which bounds it anyway)")
    soak.add_argument("--request-drafter", default="",
                      help="the drafter the (AUTO) requests name (default: none, the default request's choice; "
                           "n-gram drafts are the verifier's own, so the draft service's faults touch only others)")


def _add_calibrate(sub) -> None:
    cal = sub.add_parser("calibrate", help="measure per task type whether speculation pays; write a policy file")
    cal.set_defaults(run=run_calibrate)
    stack_flags(cal)
    cal.add_argument("--prompts", help="JSONL with task_type and prompt (default: the starter prompts)")
    cal.add_argument("--limit", type=int, default=0, help="use only the first N prompts of each task type")
    cal.add_argument("--max-new-tokens", type=int, default=64)
    cal.add_argument("--repeats", type=int, default=1)
    _measured_gateway_flags(cal, "calibrate a running gateway (its default drafter) instead of a new stack")
    cal.add_argument("--policy-out", default="specsplit-policy.json", help="where to write the policy")


def _add_validate(sub) -> None:
    val = sub.add_parser("validate", help="before turning speculation on: measure your prompts per task type "
                                          "(acceptance, P50/P95 on vs off, consistency, drift, quantization) and "
                                          "write report.md and policy.json")
    val.set_defaults(run=run_validate)
    stack_flags(val)
    val.add_argument("--prompts", help="JSONL with task_type and prompt per line (other keys are ignored; default: "
                                       "the starter prompts)")
    val.add_argument("--out", required=True, help="directory for report.md, its plots and policy.json")
    val.add_argument("--max-new-tokens", type=int, default=64)
    val.add_argument("--limit", type=int, default=0, help="use only the first N prompts of each task type")
    val.add_argument("--gate", type=float, default=2.0,
                     help="speculation is off below this acceptance length (the design note's 2.0)")
    val.add_argument("--bucket", type=int, default=16, help="output positions per acceptance bucket")
    val.add_argument("--no-quantization", dest="quantization", action="store_false",
                     help="skip the matrix of 8- and 4-bit weights x speculation off / on (two more stacks)")
    _measured_gateway_flags(val, "validate a running gateway (no quantization matrix) instead of a new stack")


def _add_trace_report(sub) -> None:
    rep = sub.add_parser("trace-report", help="time shares, speedup and break-even RTT from Generate traces")
    rep.set_defaults(run=run_trace_report)
    rep.add_argument("--file", action="append", help="OTLP-JSON lines (e.g. from --trace-file); repeatable")
    rep.add_argument("--jaeger", help="Jaeger query URL, e.g. http://localhost:16686")
    rep.add_argument("--service", default="specsplit-gateway", help="service whose traces to fetch from Jaeger")
    rep.add_argument("--limit", type=int, default=200, help="most traces to fetch from Jaeger")
    rep.add_argument("--lookback", default="1h", help="how far back to fetch from Jaeger")
    rep.add_argument("--no-per-request", action="store_true", help="only the per-task-type table")
    rep.add_argument("--json-out", help="also write the report here")
    rep.add_argument("--plot", help="PNG: one request's rounds as a timeline and the time shares per task type")
    rep.add_argument("--plot-trace", help="the trace id (or its start) to draw (default: the spec-on request "
                                          "with the most rounds)")


def _measured_gateway_flags(p: argparse.ArgumentParser, gateway_help: str) -> None:
    """What a command that writes a policy needs to measure a running gateway instead of its own stack."""
    p.add_argument("--store-tokens", type=int, default=0, help="as for bench")
    p.add_argument("--gateway", help=gateway_help)
    p.add_argument("--auth-token-file", default=ENV("SPECSPLIT_AUTH_TOKEN_FILE"),
                   help="with --gateway: send the bearer token in this file")
    p.add_argument("--verify", help="with --gateway: the verify service, whose model the policy records")
    p.add_argument("--draft", help="with --gateway: the draft service, whose drafters the policy records")


def run_bench(a: argparse.Namespace) -> int:
    from specsplit.bench.bench import main as bench_main

    return bench_main(a, stack_config(a))


def run_soak(a: argparse.Namespace) -> int:
    from specsplit.bench.soak import main as soak_main
    from specsplit.bench.workload import load_prompts

    return soak_main(a, stack_config(a), load_prompts(a.prompts))


def run_calibrate(a: argparse.Namespace) -> int:
    from specsplit.bench.calibrate import main as calibrate_main

    return calibrate_main(a, stack_config(a))


def run_validate(a: argparse.Namespace) -> int:
    from specsplit.bench.validate import main as validate_main

    return validate_main(a, stack_config(a))


def run_trace_report(a: argparse.Namespace) -> int:
    from specsplit.bench.traceplot import plot
    from specsplit.bench.tracereport import main as report_main

    return report_main(a, plot)
