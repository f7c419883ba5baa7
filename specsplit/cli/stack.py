"""`specsplit up` (verify, draft and gateway co-located, supervised) and `specsplit generate` (a client)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from specsplit.cli.flags import ENV, auth_flag, last_gateway_file, stack_config, stack_flags, store_tokens_flag


def add(sub) -> None:
    up = sub.add_parser("up", help="start verify, draft and gateway co-located; Ctrl-C stops all three")
    up.set_defaults(run=run_up)
    stack_flags(up)
    store_tokens_flag(up)
    up.add_argument("--metrics-port", type=int, default=int(ENV("SPECSPLIT_METRICS_PORT", "0")),
                    help="Prometheus endpoints: the gateway's on this port, the verify service's on the next, the "
                         "draft service's on the one after (0: none)")
    up.add_argument("--policy", default=ENV("SPECSPLIT_POLICY"),
                    help="policy file from `specsplit validate` or `calibrate`: the controller's starting state")
    up.add_argument("--http-listen", default=ENV("SPECSPLIT_HTTP_LISTEN", ""),
                    help="host:port: the gateway also speaks the OpenAI HTTP API there (/v1/completions, "
                         "/v1/chat/completions, /v1/models)")

    gen = sub.add_parser("generate", help="call Generate on a gateway")
    gen.set_defaults(run=run_generate)
    gen.add_argument("prompt")
    gen.add_argument("--gateway", default=ENV("SPECSPLIT_GATEWAY"), help="gateway address (default: the last `up`)")
    auth_flag(gen, "send the bearer token in this file (a gateway started with --auth-token-file)")
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


def run_up(a: argparse.Namespace) -> int:
    from specsplit.launcher import Stack
    from specsplit.model import catalog

    for path in {a.target_model, a.draft_model} - {None}:
        catalog.resolve(path)  # convert the default model once, before three processes want it
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = Stack(stack_config(a))
    try:
        address = stack.start()
        last_gateway_file().write_text(address + "\n")
        print(f"gateway: {address}", flush=True)
        while not stop.is_set():  # only the user's signal stops the stack; a crashed service is restarted
            for event in stack.supervise():
                print(event, file=sys.stderr, flush=True)
            stop.wait(0.2)
        return 0
    finally:
        codes = stack.stop()
        print(f"stopped: {', '.join(f'{n}={c}' for n, c in codes.items())}", flush=True)


def run_generate(a: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from specsplit.api.common.v1 import common_pb2 as cpb
    from specsplit.api.gateway.v1 import gateway_pb2 as pb
    from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc

    address = a.gateway
    if not address and last_gateway_file().exists():
        address = last_gateway_file().read_text().strip()
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
    from specsplit.serving.server import gateway_client_options

    with grpc.insecure_channel(address, options=gateway_client_options()) as channel:
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
    from specsplit.api.gateway.v1 import gateway_pb2 as pb

    rate = stats.generated_tokens / (stats.total_ms / 1e3) if stats.total_ms else 0.0
    spec = f"drafter={stats.drafter} gamma={stats.gamma}" if stats.speculation_used else "speculation off"
    return (f"[{pb.FinishReason.Name(finish_reason)}] {stats.generated_tokens} tokens in {stats.total_ms:.0f} ms "
            f"({rate:.1f} tok/s), {stats.rounds} rounds, acceptance length {stats.mean_acceptance_length:.2f}, {spec}")

