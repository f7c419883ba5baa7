"""The `specsplit` command: fetch-model (and the native kernels), up, serve, generate, bench, distill."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
from pathlib import Path

from specsplit import telemetry
from specsplit.errors import UsageError
from specsplit.settings import (
    ClientTLS,
    ControllerSettings,
    DraftSettings,
    GatewaySettings,
    ModelSettings,
    ServerSettings,
    VerifySettings,
)

ENV = os.environ.get
# OpenMP threads spin after each parallel region before they sleep (libgomp: 300,000 spins by
# default). Co-located services share the cores: a verifier's threads still spinning after its
# forward take the cores from the drafter that runs next, and the reverse (measured, hybrid+tree8 on
# the starter prompts: drafting cost per drafted token 0.060 -> 0.046 of a target step, spec-off
# unchanged). 20,000 spins still bridge the barriers inside one forward; no spinning at all
# (OMP_WAIT_POLICY=PASSIVE) halves the verifier's speed. libgomp reads it once, when torch loads.
SERVICE_SPINCOUNT = "20000"


def quiet_spin(environ) -> None:
    """A service's spin count, unless the user chose one (GOMP_SPINCOUNT or OMP_WAIT_POLICY)."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = SERVICE_SPINCOUNT


def _server_flags(p: argparse.ArgumentParser, default_listen: str) -> None:
    p.add_argument("--listen", default=default_listen, help="unix:///path.sock or host:port (port 0: any free port)")
    p.add_argument("--address-file", help="write the bound address here once SERVING")
    p.add_argument("--threads", type=int, default=int(ENV("SPECSPLIT_THREADS", "0")),
                   help="torch intra-op threads (0: torch's default)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds in-flight calls get on shutdown")
    p.add_argument("--metrics-port", type=int, default=int(ENV("SPECSPLIT_METRICS_PORT", "0")),
                   help="serve Prometheus metrics on this port (0: none)")
    p.add_argument("--tls-cert", default=ENV("SPECSPLIT_TLS_CERT"), help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", default=ENV("SPECSPLIT_TLS_KEY"), help="the certificate's private key (PEM)")
    p.add_argument("--tls-client-ca", default=ENV("SPECSPLIT_TLS_CLIENT_CA"),
                   help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--no-shm", dest="shared_memory", action="store_false",
                   help="never offer or map shared memory: every payload goes over gRPC")


def _server_settings(a: argparse.Namespace) -> ServerSettings:
    return ServerSettings(listen=a.listen, address_file=a.address_file, threads=a.threads, grace_s=a.grace,
                          metrics_port=a.metrics_port, tls_cert=a.tls_cert, tls_key=a.tls_key,
                          tls_client_ca=a.tls_client_ca, shared_memory=a.shared_memory)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line (argparse prints the whole usage first), exit code 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _list_of(convert, what: str):
    """An argparse type: comma-separated values, each through `convert`."""
    def parse(text: str) -> tuple:
        try:
            return tuple(convert(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
    return parse


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specsplit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    fm = sub.add_parser("fetch-model", help="fetch a catalog model (pinned, digest checked) and convert it into the "
                                            "cache once; prints its directory")
    fm.add_argument("name", nargs="?", default="default", help="a name `specsplit models` lists (default: the "
                                                               "embedded SmolLM2-135M-Instruct)")
    sub.add_parser("models", help="list the catalog: names, source, size, digest, licence, whether fetched")
    hp = sub.add_parser("health", help="ask a service's grpc.health.v1: exit 0 if SERVING, 1 if not (container "
                                       "health checks)")
    hp.add_argument("address", help="host:port or unix:///path.sock")
    hp.add_argument("--service", default="", help="a service name (default: the server as a whole)")
    hp.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    hp.add_argument("--tls-ca", help="the service serves TLS: trust this CA (PEM)")
    hp.add_argument("--tls-cert", help="mutual TLS: this client certificate (PEM)")
    hp.add_argument("--tls-key", help="and its key (PEM)")
    hp.add_argument("--tls-server-name", help="the name its certificate carries, when it is not the address's host")

    serve = sub.add_parser("serve", help="run one service (what a split deploy runs)")
    roles = serve.add_subparsers(dest="role", required=True)
    v = roles.add_parser("verify", help="the target model")
    _server_flags(v, "127.0.0.1:50051")
    v.add_argument("--target-model", default=ENV("SPECSPLIT_TARGET_MODEL", "default"),
                   help="local HF model dir, or 'default' (embedded SmolLM2-135M-Instruct)")
    v.add_argument("--dtype", default=ENV("SPECSPLIT_DTYPE", "bfloat16"), help="bfloat16 | float32 | float16")
    v.add_argument("--device", default=ENV("SPECSPLIT_DEVICE", "cpu"), help="cpu | cuda | cuda:N")
    v.add_argument("--quantize", choices=["", "int8", "q8_0", "q4_0", "gguf"], default=ENV("SPECSPLIT_QUANTIZE", ""),
                   help="int8: weight-only int8 target GEMMs on the native kernels; q8_0: int8 weights per block of 32 "
                        "by int8 activations (AVX-512 VNNI); q4_0: 4-bit weights, the same activations; gguf: the "
                        "blocks of the model dir's model.gguf as shipped; spec on still equals off")
    v.add_argument("--no-exact", dest="exact", action="store_false",
                   help="SDPA attention and plain linears: faster, but spec-on may differ from spec-off")
    v.add_argument("--max-sessions", type=int, default=VerifySettings.max_sessions)
    v.add_argument("--kv-cache-mib", type=int, default=VerifySettings.kv_cache_mib,
                   help="KV cache of all sessions together; 0: max sessions at the full context, "
                        "at most a quarter of memory")
    v.add_argument("--idle-timeout", type=float, default=VerifySettings.idle_timeout_s,
                   help="evict sessions idle this long (s)")
    v.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=VerifySettings.prefix_cache,
                   help="keep prompts' keys and values for later prompts that start the same way, in KV budget "
                        "the sessions leave free")
    v.add_argument("--batch-rows", type=int, default=VerifySettings.batch_rows,
                   help="most rows of concurrent sessions' calls batched into one forward (1: no batching)")
    v.add_argument("--batch-wait-ms", type=float, default=VerifySettings.batch_wait_ms,
                   help="how long a call may wait for other sessions' calls to join its forward (a batch runs "
                        "at once when every live session has sent its call)")

    d = roles.add_parser("draft", help="the drafters")
    _server_flags(d, "127.0.0.1:50052")
    _draft_model_flags(d)
    d.add_argument("--device", default=ENV("SPECSPLIT_DEVICE", "cpu"))
    d.add_argument("--default-drafter", default="auto",
                   help="ngram | model | self | hybrid | auto (hybrid: n-gram + the self head if loaded, else the "
                        "draft model if given; else ngram)")
    d.add_argument("--ngram-min", type=int, default=1)
    d.add_argument("--ngram-max", type=int, default=3)
    d.add_argument("--store-tokens", type=int, default=262144,
                   help="earlier outputs the retrieval drafter remembers across requests (0: none)")
    d.add_argument("--self-head", default=ENV("SPECSPLIT_SELF_HEAD", "auto"),
                   help="feature head from `specsplit distill` for the self and hybrid drafters; 'auto': the "
                        "shipped head when --target-model is the default; 'none': no head")
    d.add_argument("--target-model", default=ENV("SPECSPLIT_TARGET_MODEL", "default"),
                   help="the target the head drafts for (its embeddings are read from here)")
    d.add_argument("--hybrid-min-match", type=int, default=2,
                   help="the hybrid copies an n-gram match of at least this length, else uses the head")
    d.add_argument("--self-min-confidence", type=float, default=float(ENV("SPECSPLIT_SELF_MIN_CONFIDENCE", "0.3")),
                   help="the head stops drafting once its probability that the draft so far is right falls "
                        "below this (0: always draft gamma)")
    d.add_argument("--proposal-top-k", type=int, default=int(ENV("SPECSPLIT_PROPOSAL_TOP_K", "16")),
                   help="rejection sampling: a model drafter samples from its most likely K tokens "
                        "(renormalised) and sends that distribution with each draft token")
    d.add_argument("--max-sessions", type=int, default=DraftSettings.max_sessions)
    d.add_argument("--idle-timeout", type=float, default=DraftSettings.idle_timeout_s)
    d.add_argument("--batch-wait-ms", type=float, default=DraftSettings.batch_wait_ms,
                   help="how long a Propose may wait for other sessions' to draft with it (at once when "
                        "every session has sent one)")

    g = roles.add_parser("gateway", help="the public Generate API")
    _server_flags(g, "127.0.0.1:50050")
    g.add_argument("--verify", required=True,
                   help="the verify service: an address, several separated by commas (replicas), or dns:///NAME:PORT "
                        "(every address NAME resolves to, re-resolved: a Kubernetes headless Service); each session "
                        "stays on one replica")
    g.add_argument("--draft", required=True,
                   help="the draft service, as --verify: replicas too, each session stays on one; a lost replica "
                        "costs its sessions their drafts, not their answers")
    g.add_argument("--tokenizer", default=ENV("SPECSPLIT_TARGET_MODEL", "default"),
                   help="model dir holding the target's tokenizer ('default': the embedded model)")
    g.add_argument("--gamma", type=int, default=4, help="tokens drafted per round to start from (the "
                                                        "controller adapts it for AUTO requests)")
    g.add_argument("--gamma-min", type=int, default=1)
    g.add_argument("--gamma-max", type=int, default=8)
    g.add_argument("--no-controller", dest="controller", action="store_false",
                   help="AUTO requests always speculate with --gamma (no adaptation, no auto-disable)")
    g.add_argument("--min-acceptance", type=float, default=0.0,
                   help="switch speculation off below this mean acceptance length (0: the break-even length "
                        "from the measured costs; the seed's rule is 2)")
    g.add_argument("--control-share", type=float, default=0.05,
                   help="share of AUTO requests run without speculation to keep the baseline measured")
    g.add_argument("--max-inflight", type=int, default=0,
                   help="a fixed cap: above this many concurrent requests, AUTO requests run without "
                        "speculation; 0 (default): where it stops paying is predicted from the verifier's "
                        "measured cost per batch width and each task type's measured rounds")
    g.add_argument("--probe-every", type=int, default=10,
                   help="while speculation is off for a task type, every N-th request re-measures it")
    g.add_argument("--upstream-ca", default=ENV("SPECSPLIT_UPSTREAM_CA"),
                   help="reach the draft and verify services over TLS, trusting this CA (PEM)")
    g.add_argument("--upstream-cert", default=ENV("SPECSPLIT_UPSTREAM_CERT"),
                   help="the gateway's client certificate for mutual TLS (PEM)")
    g.add_argument("--upstream-key", default=ENV("SPECSPLIT_UPSTREAM_KEY"), help="its private key (PEM)")
    g.add_argument("--policy", default=ENV("SPECSPLIT_POLICY"),
                   help="policy file from `specsplit calibrate`: the controller's starting state")
    g.add_argument("--drafter", default="", help="default drafter (empty: the draft service's default)")
    g.add_argument("--max-new-tokens-limit", type=int, default=4096)
    g.add_argument("--auth-token-file", default=ENV("SPECSPLIT_AUTH_TOKEN_FILE"),
                   help="callers must send metadata 'authorization: Bearer <the token in this file>' "
                        "(UNAUTHENTICATED otherwise; health and reflection stay open)")
    g.add_argument("--http-listen", default=ENV("SPECSPLIT_HTTP_LISTEN", ""),
                   help="host:port: also serve the OpenAI HTTP API there (/v1/completions, /v1/chat/completions "
                        "with SSE streaming, /v1/models; the same bearer token)")
    g.add_argument("--max-sessions-per-client", type=int, default=0,
                   help="Generate calls in flight per client address; more get RESOURCE_EXHAUSTED (0: no cap)")
    g.add_argument("--rpc-timeout", type=float, default=60.0, help="deadline of each internal call (s)")
    g.add_argument("--predraft", choices=["auto", "on", "off"], default=ENV("SPECSPLIT_PREDRAFT", "auto"),
                   help="asynchronous drafting (draft the next block while Verify is in flight) for requests that "
                        "do not choose; auto: measured per task type, the faster arm wins (docs/controller.md)")
    g.add_argument("--tree-budget", type=int, default=int(ENV("SPECSPLIT_TREE_BUDGET", "8")),
                   help="token trees: most draft tokens per round for requests that do not say (0 or 1: chains of "
                        "gamma); each tree is cut to the part whose expected gain pays for its verify rows")
    g.add_argument("--shm-segment-mib", type=float, default=4.0,
                   help="size of each speculative session's shared-memory segment (feature ring + proposals)")

    up = sub.add_parser("up", help="start verify, draft and gateway co-located; Ctrl-C stops all three")
    _stack_flags(up)
    up.add_argument("--store-tokens", type=int, default=262144,
                    help="earlier outputs the retrieval drafter remembers across requests (0: none)")
    up.add_argument("--metrics-port", type=int, default=int(ENV("SPECSPLIT_METRICS_PORT", "0")),
                    help="Prometheus endpoints: the gateway's on this port, the verify service's on the next, the "
                         "draft service's on the one after (0: none)")
    up.add_argument("--http-listen", default=ENV("SPECSPLIT_HTTP_LISTEN", ""),
                    help="host:port: the gateway also speaks the OpenAI HTTP API there (/v1/completions, "
                         "/v1/chat/completions, /v1/models)")

    gen = sub.add_parser("generate", help="call Generate on a gateway")
    gen.add_argument("prompt")
    gen.add_argument("--gateway", default=ENV("SPECSPLIT_GATEWAY"), help="gateway address (default: the last `up`)")
    gen.add_argument("--auth-token-file", default=ENV("SPECSPLIT_AUTH_TOKEN_FILE"),
                     help="send the bearer token in this file (a gateway started with --auth-token-file)")
    gen.add_argument("--no-spec", action="store_true", help="speculation off")
    gen.add_argument("--spec", action="store_true", help="speculation on (refuse to fall back)")
    gen.add_argument("--drafter", default="")
    gen.add_argument("--gamma", type=int, default=0)
    gen.add_argument("--tree-budget", type=int, default=0, help="token-tree size per round (0: the gateway's default)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--task-type", default="")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, help="sampler seed (default: drawn by the gateway, reported in stats)")
    gen.add_argument("--method", choices=["coupled", "rejection"], default="coupled",
                     help="verification at temperature > 0: coupled (same text on or off) or rejection")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    gen.add_argument("--stream", action="store_true", help="print text as it is accepted")
    gen.add_argument("--json", action="store_true", help="print the whole response as one JSON object")
    gen.add_argument("--timeout", type=float, default=600.0)

    dist = sub.add_parser("distill", help="make a self-draft head for a target from its own continuations")
    dist.add_argument("--target-model", default=ENV("SPECSPLIT_TARGET_MODEL", "default"))
    dist.add_argument("--out", required=True, help="work directory: data shards, checkpoint, head/ (resumable)")
    dist.add_argument("--prompts", help="JSONL of {prompt, task_type} (default: the built-in distillation set)")
    dist.add_argument("--prompt-seeds", default="0", type=_list_of(int, "integers"),
                      help="built-in set: comma-separated seeds, each adding ~1,000 new prompts (new template "
                           "combinations and rewrite passages) after those of the seeds before it, so that a "
                           "resumed run with more seeds keeps its shards and generates more")
    dist.add_argument("--data-fractions", default="1", type=_list_of(float, "numbers"),
                      help="comma-separated shares of the training data, e.g. 0.25,0.5,1: each trains its own "
                           "head with the same budget and the held-out accuracy of each is printed (a data-size "
                           "curve, kept in the card); the largest is exported")
    dist.add_argument("--init-head", help="--kind self: start from this exported head (its weights and draft "
                                          "vocabulary) instead of the target's last layer, to continue it on "
                                          "more data")
    dist.add_argument("--gen-minutes", type=float, default=30.0, help="budget for generating data")
    dist.add_argument("--train-minutes", type=float, default=30.0, help="total training budget (resume adds to it)")
    dist.add_argument("--train-steps", type=int, default=0,
                      help="also stop training at this many steps (0: the time budget alone); a machine's "
                           "load does not change what a step-bounded run learns")
    dist.add_argument("--max-new-tokens", type=int, default=192, help="continuation length per prompt")
    dist.add_argument("--batch", type=int, default=8, help="prompts generated together")
    dist.add_argument("--draft-vocab", type=int, default=8192, help="size of the frequency-ranked draft vocabulary")
    dist.add_argument("--levels", type=int, default=3, help="drafting steps unrolled in training")
    dist.add_argument("--lr", type=float, default=6e-4)
    dist.add_argument("--batch-tokens", type=int, default=1024, help="tokens per training step")
    dist.add_argument("--dtype", default=ENV("SPECSPLIT_DTYPE", "bfloat16"), help="target dtype while generating")
    dist.add_argument("--device", default=ENV("SPECSPLIT_DEVICE", "cpu"))
    dist.add_argument("--threads", type=int, default=int(ENV("SPECSPLIT_THREADS", "0")))
    dist.add_argument("--stages", default="generate,train,export", type=_list_of(str, "stage names"),
                      help="comma-separated subset to run")
    dist.add_argument("--kind", choices=["self", "model"], default="self",
                      help="self: a feature head (--drafter self/hybrid); model: a standalone draft model of "
                           "--layers target layers (--draft-model DIR/model)")
    dist.add_argument("--layers", type=int, default=2, help="target layers a standalone draft keeps (--kind model)")

    bench = sub.add_parser("bench", help="speculation on vs off per task type, through the real services")
    _stack_flags(bench)
    bench.add_argument("--gateway", help="use this running gateway instead of starting a stack")
    bench.add_argument("--auth-token-file", default=ENV("SPECSPLIT_AUTH_TOKEN_FILE"),
                       help="with --gateway: send the bearer token in this file")
    bench.add_argument("--prompts", help="JSONL with task_type, prompt and optionally temperature (default: the "
                                         "starter prompts; 'mixed': the controller's mixed workload; 'copy': "
                                         "verbatim repetition, where drafts are almost always right; 'long': "
                                         "~1,300-token prompts, whose features make a large first round)")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--anchor", action="store_true",
                       help="also run transformers in-process (generate plain and with prompt lookup) on the same "
                            "prompts, interleaved, and print the ratios against it")
    bench.add_argument("--anchor-llama-cpp", metavar="DIR",
                       help="also run llama.cpp's llama-bench (a build in DIR) on the target's GGUF file (model.gguf "
                            "in its directory) and print its decode rate next to ours")
    bench.add_argument("--repeats", type=int, default=1, help="runs per prompt and mode; medians are reported")
    bench.add_argument("--limit", type=int, default=0, help="use only the first N prompts of each task type")
    bench.add_argument("--json-out", help="also write every record and the summary here")
    bench.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 samples (seeded)")
    bench.add_argument("--seed", type=int, default=0, help="sampler seed at temperature > 0")
    bench.add_argument("--predraft", choices=["off", "on", "auto"], default="off",
                       help="pre-drafting in spec-on requests (auto: the gateway decides); --topology runs both")
    bench.add_argument("--tree-budgets", default="", type=_list_of(int, "integers"),
                       help="comma-separated token-tree sizes to compare for every drafter, e.g. 1,8 (1: chains; "
                            "default: the gateway's --tree-budget)")
    bench.add_argument("--methods", default="coupled,rejection", type=_list_of(str, "method names"),
                       help="verify methods compared at temperature > 0")
    bench.add_argument("--store-tokens", type=int, default=0,
                       help="the retrieval store remembers outputs across requests; the bench runs every prompt "
                            "several times, which the store would simply copy, so it is off unless set")
    bench.add_argument("--controlled", type=int, default=0, metavar="PASSES",
                       help="instead: the controller at work; PASSES passes of AUTO requests to learn, then per "
                            "prompt spec-off, forced spec-on and AUTO (try --prompts mixed)")
    bench.add_argument("--topology", action="store_true",
                       help="instead: co-located (UNIX, TCP) and split with an emulated RTT between gateway+verifier "
                            "and drafter (a userspace delaying proxy); speedup, overhead per round, break-even RTT")
    bench.add_argument("--rtts", default="", type=_list_of(float, "numbers"),
                       help="with --topology: comma-separated RTTs in ms (default 0,0.5,1,2,5,10,20,40)")
    bench.add_argument("--plot", default="specsplit-topology.png", help="with --topology: PNG of the curve")
    bench.add_argument("--concurrency", default="", type=_list_of(int, "integers"),
                       help="instead: this many clients at once (e.g. 1,2,4,8,16), speculation off, on and AUTO "
                            "at each level; aggregate tok/s, P50/P95 latency and TTFT, the batches formed")
    bench.add_argument("--requests", type=int, default=16,
                       help="with --concurrency: requests per level and mode (spread over the clients)")
    bench.add_argument("--long-context", action="store_true",
                       help="instead: documents of 2k-6k tokens with questions (time to first token cold and "
                            "with the prefix cache, against transformers' forward), a long prefill beside a "
                            "decoding stream, and a multi-turn chat")
    bench.add_argument("--round-overhead", action="store_true",
                       help="per-round overhead (median, P95) through the real services around a drafter and a "
                            "verifier that cost nothing, for shared memory, UNIX socket and TCP (no model loaded)")
    bench.add_argument("--tracing-overhead", action="store_true",
                       help="instead: spec-on requests alternated between a stack with tracing off and one "
                            "with tracing on (OTLP-JSON file), and the median cost of tracing per token")
    bench.add_argument("--drafters", default="", type=_list_of(str, "drafter names"),
                       help="comma-separated drafters to compare side by side, e.g. ngram,self "
                            "(default: every drafter of the started stack; with --gateway, its default)")

    soak = sub.add_parser("soak", help="N clients for M minutes against a stack started here (optionally with "
                                       "chaos); errors, latency, memory drift and what was left behind")
    _stack_flags(soak)
    soak.add_argument("--clients", type=int, default=8)
    soak.add_argument("--minutes", type=float, default=10.0)
    soak.add_argument("--prompts", help="JSONL with task_type and prompt (default: the starter prompts)")
    soak.add_argument("--max-new-tokens", type=int, default=64)
    soak.add_argument("--store-tokens", type=int, default=0,
                      help="the retrieval store across requests (off: every answer is checked against spec-off, "
                           "and the store would only make repeated prompts easier)")
    soak.add_argument("--chaos", choices=["", "kill", "stop"], default="",
                      help="kill: SIGKILL the draft service now and then (it is restarted); stop: SIGSTOP it for "
                           "2 s; requests must complete and match spec-off all the same")
    soak.add_argument("--chaos-every", type=float, default=10.0, help="seconds between chaos events, on average")

    cal = sub.add_parser("calibrate", help="measure per task type whether speculation pays; write a policy file")
    _stack_flags(cal)
    cal.add_argument("--prompts", help="JSONL with task_type and prompt (default: the starter prompts)")
    cal.add_argument("--limit", type=int, default=0, help="use only the first N prompts of each task type")
    cal.add_argument("--max-new-tokens", type=int, default=64)
    cal.add_argument("--repeats", type=int, default=1)
    cal.add_argument("--store-tokens", type=int, default=0, help="as for bench")
    cal.add_argument("--gateway", help="calibrate a running gateway (its default drafter) instead of a new stack")
    cal.add_argument("--auth-token-file", default=ENV("SPECSPLIT_AUTH_TOKEN_FILE"),
                     help="with --gateway: send the bearer token in this file")
    cal.add_argument("--verify", help="with --gateway: the verify service, whose model the policy records")
    cal.add_argument("--draft", help="with --gateway: the draft service, whose drafters the policy records")
    cal.add_argument("--policy-out", default="specsplit-policy.json", help="where to write the policy")

    rep = sub.add_parser("trace-report", help="time shares, speedup and break-even RTT from Generate traces")
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
    return parser


def _draft_model_flags(p: argparse.ArgumentParser) -> None:
    """The model drafter's flags, for `serve draft` and the stacks."""
    p.add_argument("--draft-model", default=ENV("SPECSPLIT_DRAFT_MODEL"),
                   help="a local HF causal LM dir or catalog name for the 'model' drafter ('default': the embedded "
                        "model)")
    p.add_argument("--draft-dtype", default=ENV("SPECSPLIT_DRAFT_DTYPE", "bfloat16"))
    p.add_argument("--draft-quantize", choices=["auto", "", "int8", "q8_0", "q4_0"],
                   default=ENV("SPECSPLIT_DRAFT_QUANTIZE", "auto"),
                   help="the draft model's GEMM weights: q8_0, q4_0, int8, '' (its dtype) or auto (q8_0 where the "
                        "native kernels run and the CPU has VNNI, else int8 for a bf16 draft, else its dtype)")
    p.add_argument("--draft-vocab", type=int, default=int(ENV("SPECSPLIT_DRAFT_VOCAB", "32768")),
                   help="the model drafter scores only this many token ids (its draft_vocab.json if it has one; "
                        "else the first N ids and the special tokens; 0: all)")


def _stack_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", choices=["unix", "tcp"], default="unix")
    p.add_argument("--target-model", default=ENV("SPECSPLIT_TARGET_MODEL", "default"))
    p.add_argument("--dtype", default=ENV("SPECSPLIT_DTYPE", "bfloat16"))
    _draft_model_flags(p)
    p.add_argument("--device", default=ENV("SPECSPLIT_DEVICE", "cpu"))
    p.add_argument("--no-exact", dest="exact", action="store_false")
    p.add_argument("--quantize", choices=["", "int8", "q8_0", "q4_0", "gguf"], default=ENV("SPECSPLIT_QUANTIZE", ""),
                   help="int8: the target's GEMM weights in int8; q8_0 / q4_0: 8- / 4-bit weights by int8 activations "
                        "per block of 32 (native kernels, VNNI); gguf: the blocks of the model's GGUF file as shipped")
    p.add_argument("--drafter", default="auto",
                   help="default drafter: ngram | self | hybrid | model (with --draft-model) | auto (hybrid: n-gram "
                        "+ the self head if there, else the draft model if given; else ngram)")
    p.add_argument("--self-head", default=ENV("SPECSPLIT_SELF_HEAD", "auto"),
                   help="feature head for the self/hybrid drafters ('auto': shipped head for the default target)")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--batch-wait-ms", type=float, default=VerifySettings.batch_wait_ms,
                   help="the verify service's wait for other sessions' calls to join a forward")
    p.add_argument("--tree-budget", type=int, default=8,
                   help="the gateway's token-tree size per round for requests that do not say (0: chains)")
    p.add_argument("--threads", type=int, default=int(ENV("SPECSPLIT_THREADS", "0")))
    p.add_argument("--trace-file", help="the three services append their traces here as OTLP-JSON lines "
                                        "(read them with `specsplit trace-report --file`)")
    p.add_argument("--run-dir", help="directory for sockets and logs (default: a fresh temp dir)")
    p.add_argument("--no-shm", dest="shared_memory", action="store_false",
                   help="no shared-memory fast path: every payload goes over the sockets")


def _stack_config(a: argparse.Namespace):
    from specsplit.tools.launcher import StackConfig

    return StackConfig(transport=a.transport, target_model=a.target_model, draft_model=a.draft_model, dtype=a.dtype,
                       draft_dtype=a.draft_dtype, draft_quantize=a.draft_quantize, draft_vocab=a.draft_vocab,
                       device=a.device, exact=a.exact,
                       quantize=a.quantize,
                       drafter=a.drafter, gamma=a.gamma, tree_budget=a.tree_budget,
                       self_head=a.self_head, store_tokens=a.store_tokens, batch_wait_ms=a.batch_wait_ms,
                       threads=a.threads, run_dir=a.run_dir, trace_file=a.trace_file,
                       shared_memory=a.shared_memory, metrics_port=getattr(a, "metrics_port", 0),
                       http_listen=getattr(a, "http_listen", ""))


def _last_gateway_file() -> Path:
    from specsplit.catalog import cache_root

    return cache_root() / "last-gateway"


def cmd_serve(a: argparse.Namespace) -> int:
    from specsplit.tools.launcher import die_with_launcher

    die_with_launcher()
    server = _server_settings(a)
    if a.role == "verify":
        from verify_service.main import run

        settings = VerifySettings(server=server, model=ModelSettings(a.target_model, a.dtype, a.device, a.exact,
                                                                     a.quantize),
                                  max_sessions=a.max_sessions, idle_timeout_s=a.idle_timeout,
                                  kv_cache_mib=a.kv_cache_mib, batch_rows=a.batch_rows,
                                  batch_wait_ms=a.batch_wait_ms, prefix_cache=a.prefix_cache)
    elif a.role == "draft":
        from draft_service.main import run

        model = ModelSettings(a.draft_model, a.draft_dtype, a.device, exact=False,
                              quantize=a.draft_quantize) if a.draft_model else None
        settings = DraftSettings(server=server, model=model, draft_vocab=a.draft_vocab,
                                 default_drafter=a.default_drafter,
                                 ngram_min=a.ngram_min, ngram_max=a.ngram_max, max_sessions=a.max_sessions,
                                 idle_timeout_s=a.idle_timeout, store_tokens=a.store_tokens,
                                 self_head=_self_head(a.self_head, a.target_model), target_model=a.target_model,
                                 device=a.device, hybrid_min_match=a.hybrid_min_match,
                                 self_min_confidence=a.self_min_confidence, proposal_top_k=a.proposal_top_k,
                                 batch_wait_ms=a.batch_wait_ms)
    else:
        from gateway.access import read_token
        from gateway.main import run

        controller = ControllerSettings(
            enabled=a.controller, gamma_min=a.gamma_min, gamma_max=a.gamma_max, gamma_start=a.gamma,
            min_acceptance=a.min_acceptance, control_share=a.control_share, max_inflight=a.max_inflight,
            probe_every=a.probe_every)
        settings = GatewaySettings(server=server, verify_address=a.verify, draft_address=a.draft,
                                   tokenizer=a.tokenizer, default_drafter=a.drafter,
                                   max_new_tokens_limit=a.max_new_tokens_limit, rpc_timeout_s=a.rpc_timeout,
                                   controller=controller, policy_file=a.policy,
                                   upstream_tls=ClientTLS(a.upstream_ca, a.upstream_cert, a.upstream_key)
                                   if a.upstream_ca else None, predraft=a.predraft, tree_budget=a.tree_budget,
                                   shm_segment_bytes=int(a.shm_segment_mib * 2**20),
                                   auth_token=read_token(a.auth_token_file) if a.auth_token_file else "",
                                   max_sessions_per_client=a.max_sessions_per_client, http_listen=a.http_listen)
    try:
        asyncio.run(run(settings))
    except (UsageError, FileNotFoundError, IsADirectoryError, PermissionError):
        raise  # a bad flag or file: main() says so in one line
    except Exception as e:  # a start-up failure: say what it was, not a traceback
        print(f"specsplit serve {a.role}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        telemetry.shutdown()  # spans still queued are exported
    return 0


def _self_head(flag: str, target_model: str) -> str | None:
    """'auto': the shipped head if the target is the embedded default and the head is there."""
    if flag == "none":
        return None
    if flag == "auto":
        from draft_service.drafters.selfdraft import resolve_head

        return "default" if target_model == "default" and (resolve_head("default") / "head.json").is_file() else None
    return flag


def cmd_up(a: argparse.Namespace) -> int:
    from specsplit import catalog
    from specsplit.tools.launcher import Stack

    for path in {a.target_model, a.draft_model} - {None}:
        catalog.resolve(path)  # convert the default model once, before three processes want it
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = Stack(_stack_config(a))
    try:
        address = stack.start()
        _last_gateway_file().write_text(address + "\n")
        print(f"gateway: {address}", flush=True)
        while not stop.is_set():  # only the user's signal stops the stack; a crashed service is restarted
            for event in stack.supervise():
                print(event, file=sys.stderr, flush=True)
            stop.wait(0.2)
        return 0
    finally:
        codes = stack.stop()
        print(f"stopped: {', '.join(f'{n}={c}' for n, c in codes.items())}", flush=True)


def cmd_generate(a: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from specsplit.common.v1 import common_pb2 as cpb
    from specsplit.gateway.v1 import gateway_pb2 as pb
    from specsplit.gateway.v1 import gateway_pb2_grpc as pb_grpc

    address = a.gateway
    if not address and _last_gateway_file().exists():
        address = _last_gateway_file().read_text().strip()
    if not address:
        print("no gateway: start one with `specsplit up` or pass --gateway", file=sys.stderr)
        return 2
    request = pb.GenerateRequest(
        max_new_tokens=a.max_new_tokens, gamma=a.gamma, tree_budget=a.tree_budget, drafter=a.drafter,
        task_type=a.task_type,
        speculation=pb.SPECULATION_OFF if a.no_spec else pb.SPECULATION_ON if a.spec else pb.SPECULATION_AUTO,
        stop=pb.StopConditions(stop_strings=a.stop),
        sampling=pb.SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                                   method=cpb.VERIFY_METHOD_REJECTION if a.method == "rejection"
                                   else cpb.VERIFY_METHOD_COUPLED))
    if a.raw:
        request.text = a.prompt
    else:
        request.chat.messages.add(role="user", content=a.prompt)
    from gateway.access import with_token

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GatewayStub(with_token(channel, a.auth_token_file))
        try:
            if a.stream and not a.json:
                for chunk in stub.GenerateStream(request, timeout=a.timeout):
                    print(chunk.text, end="", flush=True)
                    last = chunk
                print()
                print(_summary(last.stats, last.finish_reason), file=sys.stderr)
                return 0
            response = stub.Generate(request, timeout=a.timeout)
        except grpc.RpcError as e:
            print(f"{e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if a.json:
        print(json.dumps(json_format.MessageToDict(response, always_print_fields_with_no_presence=True)))
    else:
        print(response.text)
        print(_summary(response.stats, response.finish_reason), file=sys.stderr)
    return 0


def _summary(stats, finish_reason) -> str:
    from specsplit.gateway.v1 import gateway_pb2 as pb

    rate = stats.generated_tokens / (stats.total_ms / 1e3) if stats.total_ms else 0.0
    spec = f"drafter={stats.drafter} gamma={stats.gamma}" if stats.speculation_used else "speculation off"
    return (f"[{pb.FinishReason.Name(finish_reason)}] {stats.generated_tokens} tokens in {stats.total_ms:.0f} ms "
            f"({rate:.1f} tok/s), {stats.rounds} rounds, acceptance length {stats.mean_acceptance_length:.2f}, {spec}")


def cmd_bench(a: argparse.Namespace) -> int:
    from specsplit.tools.bench import main as bench_main

    return bench_main(a, _stack_config(a))


def cmd_soak(a: argparse.Namespace) -> int:
    from specsplit.tools.soak import main as soak_main
    from specsplit.tools.workload import load_prompts

    return soak_main(a, _stack_config(a), load_prompts(a.prompts))


def cmd_calibrate(a: argparse.Namespace) -> int:
    from specsplit.tools.calibrate import main as calibrate_main

    return calibrate_main(a, _stack_config(a))


def cmd_trace_report(a: argparse.Namespace) -> int:
    from specsplit.tools.traceplot import plot
    from specsplit.tools.tracereport import main as report_main

    return report_main(a, plot)


def cmd_distill(a: argparse.Namespace) -> int:
    from draft_service.drafters.selfdraft import resolve_head
    from specsplit import runtime
    from specsplit.tools.distill.pipeline import DistillSettings, distill

    runtime.configure_process(a.threads)
    stages = a.stages
    unknown = set(stages) - {"generate", "train", "export"}
    if unknown:
        raise UsageError(f"unknown stages {sorted(unknown)}; choose from generate, train, export")
    distill(DistillSettings(target_model=a.target_model, out=a.out, prompts=a.prompts, gen_minutes=a.gen_minutes,
                            train_minutes=a.train_minutes, train_steps=a.train_steps,
                            max_new_tokens=a.max_new_tokens, batch=a.batch,
                            draft_vocab=a.draft_vocab, levels=a.levels, lr=a.lr, dtype=a.dtype, device=a.device,
                            stages=stages, kind=a.kind, layers=a.layers, batch_tokens=a.batch_tokens,
                            prompt_seeds=a.prompt_seeds, data_fractions=a.data_fractions,
                            init_head=str(resolve_head(a.init_head)) if a.init_head else None))
    return 0


def cmd_fetch_model(a: argparse.Namespace) -> int:
    import logging

    from specsplit import catalog

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(catalog.fetch(a.name))
    _build_native()
    return 0


def cmd_models(a: argparse.Namespace) -> int:
    from specsplit import catalog

    print("\n".join(catalog.describe()))
    return 0


def _build_native() -> None:
    """Builds the native kernels once (cached), so services do not each wait for the compiler."""
    import time

    import torch

    from specsplit import native

    reason = native.unavailable(torch.float32, torch.device("cpu"))
    if reason:
        print(f"native kernels: not used here ({reason})", file=sys.stderr)
        return
    started = time.perf_counter()
    native.module()
    print(f"native kernels: ready in {time.perf_counter() - started:.1f} s ({native.cache_dir()})", file=sys.stderr)


def cmd_health(a: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specsplit.serving import channel_credentials

    if a.tls_ca:
        options = [("grpc.ssl_target_name_override", a.tls_server_name)] if a.tls_server_name else []
        credentials = channel_credentials(ClientTLS(a.tls_ca, a.tls_cert, a.tls_key))
        channel = grpc.secure_channel(a.address, credentials, options=options)
    else:
        channel = grpc.insecure_channel(a.address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=a.service),
                                                              timeout=a.timeout)
            status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as e:
            status = f"{e.code().name}: {e.details()}"
    print(f"{a.address}{' ' + a.service if a.service else ''}: {status}")
    return 0 if status == "SERVING" else 1


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    if a.command == "serve":  # before anything imports torch (and with it libgomp)
        quiet_spin(os.environ)
    command = {"serve": cmd_serve, "up": cmd_up, "generate": cmd_generate, "bench": cmd_bench,
               "distill": cmd_distill, "fetch-model": cmd_fetch_model, "models": cmd_models, "health": cmd_health,
               "trace-report": cmd_trace_report, "calibrate": cmd_calibrate, "soak": cmd_soak}[a.command]
    try:
        return command(a)
    except (UsageError, FileNotFoundError, IsADirectoryError, PermissionError) as e:  # a bad flag or file
        print(f"specsplit {a.command}: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, TimeoutError, OSError) as e:  # a service that died, a model that does not fit
        print(f"specsplit {a.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
