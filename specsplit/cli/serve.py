"""`specsplit serve verify|draft|gateway` (one service: what a split deploy runs) and `specsplit health`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

from specsplit.cli.flags import (
    ENV,
    auth_flag,
    draft_model_flags,
    server_flags,
    server_settings,
    setting,
    store_tokens_flag,
    target_flags,
)
from specsplit.errors import UsageError
from specsplit.serving.settings import (
    ClientTLS,
    ControllerSettings,
    DraftSettings,
    GatewaySettings,
    ModelSettings,
    VerifySettings,
)

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


def add(sub) -> None:
    serve = sub.add_parser("serve", help="run one service (what a split deploy runs)")
    serve.set_defaults(run=run_serve, before_imports=lambda: quiet_spin(os.environ))
    roles = serve.add_subparsers(dest="role", required=True)
    _verify_flags(roles.add_parser("verify", help="the target model"))
    _draft_flags(roles.add_parser("draft", help="the drafters"))
    _gateway_flags(roles.add_parser("gateway", help="the public Generate API"))

    hp = sub.add_parser("health", help="ask a service's grpc.health.v1: exit 0 if SERVING, 1 if not (container "
                                       "health checks)")
    hp.set_defaults(run=run_health)
    hp.add_argument("address", help="host:port or unix:///path.sock")
    hp.add_argument("--service", default="", help="a service name (default: the server as a whole)")
    hp.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    hp.add_argument("--tls-ca", help="the service serves TLS: trust this CA (PEM)")
    hp.add_argument("--tls-cert", help="mutual TLS: this client certificate (PEM)")
    hp.add_argument("--tls-key", help="and its key (PEM)")
    hp.add_argument("--tls-server-name", help="the name its certificate carries, when it is not the address's host")


def head_flags(p: argparse.ArgumentParser, settings) -> None:
    """How a feature head drafts, the same flags and variables in both services (`settings`: the
    service's settings class, whose defaults they take)."""
    p.add_argument("--self-min-confidence", type=float,
                   default=float(ENV("SPECSPLIT_SELF_MIN_CONFIDENCE", str(settings.self_min_confidence))),
                   help="the head stops drafting once its probability that the draft so far is right falls "
                        "below this (0: always draft gamma)")
    p.add_argument("--head-vocab", type=int, default=int(ENV("SPECSPLIT_HEAD_VOCAB", str(settings.head_vocab))),
                   help="the feature head's output rows: the first N of its frequency-ranked draft vocabulary "
                        "(0: all of it; fewer rows, fewer bytes a drafting step)")


def _verify_flags(v: argparse.ArgumentParser) -> None:
    server_flags(v, "127.0.0.1:50051")
    target_flags(v, "int8: weight-only int8 target GEMMs on the native kernels; q8_0: int8 weights per block of 32 "
                    "by int8 activations (AVX-512 VNNI); q4_0: 4-bit weights, the same activations; gguf: the "
                    "blocks of the model dir's model.gguf as shipped; spec on still equals off")
    s = VerifySettings
    setting(v, "--max-sessions", s, "max_sessions")
    setting(v, "--kv-cache-mib", s, "kv_cache_mib", "KV cache of all sessions together; 0: max sessions at the full "
                                                   "context, at most a quarter of memory")
    setting(v, "--idle-timeout", s, "idle_timeout_s", "evict sessions idle this long (s)")
    v.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=s.prefix_cache,
                   help="keep prompts' keys and values for later prompts that start the same way, in KV budget "
                        "the sessions leave free")
    store_tokens_flag(v, VerifySettings.store_tokens, "earlier outputs the verifier's own copies (prompt lookup "
                      "as it decodes ahead) also draw on, across requests (0: none)")
    v.add_argument("--head-width", type=int, default=int(ENV("SPECSPLIT_HEAD_WIDTH", str(s.head_width))),
                   help="the head drafting here grows EAGLE-2 token trees, this many nodes expanded a depth and "
                        "cut to what pays at the forward's cost by width (0: chains with the confidence stop)")
    v.add_argument("--self-head", default=ENV("SPECSPLIT_VERIFY_SELF_HEAD", "none"),
                   help="the target's feature head drafting in this service (greedy self and hybrid requests, "
                        "and where an AUTO request's decode-ahead finds no copy: no process crossing a head round); "
                        "'auto': the head shipped for --target-model if it has one; 'none': no head here")
    head_flags(v, s)
    setting(v, "--batch-rows", s, "batch_rows",
            "most rows of concurrent sessions' calls batched into one forward (1: no batching)")
    setting(v, "--batch-wait-ms", s, "batch_wait_ms", "how long a call may wait for other sessions' calls to join "
                                                     "its forward (a batch runs at once when every live session "
                                                     "has sent its call)")


def _draft_flags(d: argparse.ArgumentParser) -> None:
    server_flags(d, "127.0.0.1:50052")
    draft_model_flags(d)
    d.add_argument("--device", default=ENV("SPECSPLIT_DEVICE", DraftSettings.device))
    d.add_argument("--default-drafter", default=DraftSettings.default_drafter,
                   help="ngram | model | self | hybrid | auto (hybrid: n-gram + the self head if loaded, else the "
                        "draft model if given; else ngram)")
    d.add_argument("--ngram-min", type=int, default=DraftSettings.ngram_min)
    d.add_argument("--ngram-max", type=int, default=DraftSettings.ngram_max)
    store_tokens_flag(d)
    d.add_argument("--self-head", default=ENV("SPECSPLIT_SELF_HEAD", "auto"),
                   help="feature head from `specsplit distill` for the self and hybrid drafters; 'auto': the "
                        "head shipped for --target-model if it has one; 'none': no head")
    d.add_argument("--target-model", default=ENV("SPECSPLIT_TARGET_MODEL", DraftSettings.target_model),
                   help="the target the head drafts for (its embeddings are read from here)")
    d.add_argument("--hybrid-min-match", type=int, default=DraftSettings.hybrid_min_match,
                   help="the hybrid copies an n-gram match of at least this length, else uses the head")
    head_flags(d, DraftSettings)
    d.add_argument("--proposal-top-k", type=int,
                   default=int(ENV("SPECSPLIT_PROPOSAL_TOP_K", str(DraftSettings.proposal_top_k))),
                   help="rejection sampling: a model drafter samples from its most likely K tokens "
                        "(renormalised) and sends that distribution with each draft token")
    d.add_argument("--max-sessions", type=int, default=DraftSettings.max_sessions)
    d.add_argument("--idle-timeout", type=float, default=DraftSettings.idle_timeout_s)
    d.add_argument("--batch-wait-ms", type=float, default=DraftSettings.batch_wait_ms,
                   help="how long a Propose may wait for other sessions' to draft with it (at once when "
                        "every session has sent one)")


def _gateway_flags(g: argparse.ArgumentParser) -> None:
    c, s = ControllerSettings, GatewaySettings
    server_flags(g, "127.0.0.1:50050")
    g.add_argument("--verify", required=True,
                   help="the verify service: an address, several separated by commas (replicas), or dns:///NAME:PORT "
                        "(every address NAME resolves to, re-resolved: a Kubernetes headless Service); each session "
                        "stays on one replica")
    g.add_argument("--draft", required=True,
                   help="the draft service, as --verify: replicas too, each session stays on one; a lost replica "
                        "costs its sessions their drafts, not their answers")
    g.add_argument("--tokenizer", default=ENV("SPECSPLIT_TARGET_MODEL", "default"),
                   help="model dir holding the target's tokenizer ('default': the embedded model)")
    g.add_argument("--gamma", type=int, default=c.gamma_start, help="tokens drafted per round to start from (the "
                                                                    "controller adapts it for AUTO requests)")
    g.add_argument("--gamma-min", type=int, default=c.gamma_min)
    g.add_argument("--gamma-max", type=int, default=c.gamma_max)
    g.add_argument("--no-controller", dest="controller", action="store_false",
                   help="AUTO requests always speculate with --gamma (no adaptation, no auto-disable)")
    g.add_argument("--min-acceptance", type=float, default=c.min_acceptance,
                   help="switch speculation off below this mean acceptance length (0: the break-even length "
                        "from the measured costs; the seed's rule is 2)")
    g.add_argument("--control-share", type=float, default=c.control_share,
                   help="share of AUTO requests run without speculation to keep the baseline measured")
    g.add_argument("--max-inflight", type=int, default=c.max_inflight,
                   help="a fixed cap: above this many concurrent requests, AUTO requests run without "
                        "speculation; 0 (default): where it stops paying is predicted from the verifier's "
                        "measured cost per batch width and each task type's measured rounds")
    g.add_argument("--probe-every", type=int, default=c.probe_every,
                   help="under load, one AUTO decision in 4N runs the other mode so both stay measured; "
                        "pre-drafting's A/B runs the losing arm every N-th request")
    g.add_argument("--upstream-ca", default=ENV("SPECSPLIT_UPSTREAM_CA"),
                   help="reach the draft and verify services over TLS, trusting this CA (PEM)")
    g.add_argument("--upstream-cert", default=ENV("SPECSPLIT_UPSTREAM_CERT"),
                   help="the gateway's client certificate for mutual TLS (PEM)")
    g.add_argument("--upstream-key", default=ENV("SPECSPLIT_UPSTREAM_KEY"), help="its private key (PEM)")
    g.add_argument("--policy", default=ENV("SPECSPLIT_POLICY"),
                   help="policy file from `specsplit calibrate`: the controller's starting state")
    g.add_argument("--drafter", default=s.default_drafter, help="default drafter (empty: the draft service's default)")
    g.add_argument("--max-new-tokens-limit", type=int, default=s.max_new_tokens_limit)
    auth_flag(g, "callers must send metadata 'authorization: Bearer <the token in this file>' "
                 "(UNAUTHENTICATED otherwise; health and reflection stay open)")
    g.add_argument("--http-listen", default=ENV("SPECSPLIT_HTTP_LISTEN", s.http_listen),
                   help="host:port: also serve the OpenAI HTTP API there (/v1/completions, /v1/chat/completions "
                        "with SSE streaming, /v1/models; the same bearer token)")
    g.add_argument("--max-sessions-per-client", type=int, default=s.max_sessions_per_client,
                   help="Generate calls in flight per client address; more get RESOURCE_EXHAUSTED (0: no cap)")
    g.add_argument("--rpc-timeout", type=float, default=s.rpc_timeout_s, help="deadline of each internal call (s)")
    g.add_argument("--resume-wait", type=float, default=s.resume_wait_s,
                   help="how long a request whose verify replica died waits for a replica to take it back (s)")
    g.add_argument("--predraft", choices=["auto", "on", "off"], default=ENV("SPECSPLIT_PREDRAFT", s.predraft),
                   help="asynchronous drafting (draft the next block while Verify is in flight) for requests that "
                        "do not choose; auto: measured per task type, the faster arm wins (docs/controller.md)")
    g.add_argument("--tree-budget", type=int, default=int(ENV("SPECSPLIT_TREE_BUDGET", str(s.tree_budget))),
                   help="token trees: most draft tokens per round for requests that do not say (0 or 1: chains of "
                        "gamma); each tree is cut to the part whose expected gain pays for its verify rows")
    g.add_argument("--shm-segment-mib", type=float, default=s.shm_segment_bytes / 2**20,
                   help="size of each speculative session's shared-memory segment (feature ring + proposals)")


def _settings(a: argparse.Namespace):
    from specsplit.model.headfile import head_setting

    server = server_settings(a)
    if a.role == "verify":
        return VerifySettings(server=server, model=ModelSettings(a.target_model, a.dtype, a.device, a.exact,
                                                                 a.quantize),
                              max_sessions=a.max_sessions, idle_timeout_s=a.idle_timeout,
                              kv_cache_mib=a.kv_cache_mib, batch_rows=a.batch_rows,
                              batch_wait_ms=a.batch_wait_ms, prefix_cache=a.prefix_cache,
                              store_tokens=a.store_tokens, self_head=head_setting(a.self_head, a.target_model),
                              self_min_confidence=a.self_min_confidence, head_vocab=a.head_vocab,
                              head_width=a.head_width)
    if a.role == "draft":
        model = ModelSettings(a.draft_model, a.draft_dtype, a.device, exact=False,
                              quantize=a.draft_quantize) if a.draft_model else None
        return DraftSettings(server=server, model=model, draft_vocab=a.draft_vocab,
                             default_drafter=a.default_drafter,
                             ngram_min=a.ngram_min, ngram_max=a.ngram_max, max_sessions=a.max_sessions,
                             idle_timeout_s=a.idle_timeout, store_tokens=a.store_tokens,
                             self_head=head_setting(a.self_head, a.target_model), target_model=a.target_model,
                             device=a.device, hybrid_min_match=a.hybrid_min_match,
                             self_min_confidence=a.self_min_confidence, head_vocab=a.head_vocab,
                             proposal_top_k=a.proposal_top_k,
                             batch_wait_ms=a.batch_wait_ms)
    from gateway.access import read_token

    controller = ControllerSettings(
        enabled=a.controller, gamma_min=a.gamma_min, gamma_max=a.gamma_max, gamma_start=a.gamma,
        min_acceptance=a.min_acceptance, control_share=a.control_share, max_inflight=a.max_inflight,
        probe_every=a.probe_every)
    return GatewaySettings(server=server, verify_address=a.verify, draft_address=a.draft,
                           tokenizer=a.tokenizer, default_drafter=a.drafter,
                           max_new_tokens_limit=a.max_new_tokens_limit, rpc_timeout_s=a.rpc_timeout,
                           resume_wait_s=a.resume_wait,
                           controller=controller, policy_file=a.policy,
                           upstream_tls=ClientTLS(a.upstream_ca, a.upstream_cert, a.upstream_key)
                           if a.upstream_ca else None, predraft=a.predraft, tree_budget=a.tree_budget,
                           shm_segment_bytes=int(a.shm_segment_mib * 2**20),
                           auth_token=read_token(a.auth_token_file) if a.auth_token_file else "",
                           max_sessions_per_client=a.max_sessions_per_client, http_listen=a.http_listen)


def run_serve(a: argparse.Namespace) -> int:
    from specsplit.launcher import die_with_launcher
    from specsplit.serving import telemetry

    die_with_launcher()
    if a.cpus:  # before torch starts its threads: they follow the affinity
        os.sched_setaffinity(0, a.cpus)
    settings = _settings(a)
    if a.role == "verify":
        from verify_service.main import run
    elif a.role == "draft":
        from draft_service.main import run
    else:
        from gateway.main import run
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


def run_health(a: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specsplit.serving.server import channel_credentials

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
