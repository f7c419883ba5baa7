"""Flags more than one command takes, and the settings they make. Every default is read from the
settings classes (specsplit/serving/settings.py), the one source the services use too."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from specsplit.serving.settings import (
    ControllerSettings,
    DraftSettings,
    GatewaySettings,
    ServerSettings,
    VerifySettings,
)

ENV = os.environ.get
QUANTIZE = ["", "int8", "q8_0", "q4_0", "gguf"]


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line (argparse prints the whole usage first), exit code 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def list_of(convert, what: str):
    """An argparse type: comma-separated values, each through `convert`."""
    def parse(text: str) -> tuple:
        try:
            return tuple(convert(x.strip()) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}") from None
    return parse


def setting(p: argparse.ArgumentParser, flag: str, cls, field: str, help: str | None = None) -> None:
    """A flag whose default and type are a settings class's field (the one source of both)."""
    default = getattr(cls, field)
    p.add_argument(flag, type=type(default), default=default, help=help)


def threads_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=int(ENV("SPECSPLIT_THREADS", str(ServerSettings.threads))),
                   help="torch intra-op threads (0: the CPUs this process may use: affinity, cgroup CPU limit)")


def server_flags(p: argparse.ArgumentParser, default_listen: str) -> None:
    p.add_argument("--listen", default=default_listen, help="unix:///path.sock or host:port (port 0: any free port)")
    p.add_argument("--cpus", type=cpu_list, default=(), metavar="CPUS",
                   help="run on these CPUs only (0,2-3: as taskset takes them), set before anything starts; "
                        "the thread count follows (--threads 0)")
    p.add_argument("--address-file", help="write the bound address here once SERVING")
    threads_flag(p)
    p.add_argument("--fixed-threads", action="store_true",
                   help="every forward on --threads threads; by default the native kernels' team size per forward "
                        "is measured (halving down to 1), so a busy neighbour's core is not waited for")
    p.add_argument("--drain", type=float, default=ServerSettings.drain_s,
                   help="on SIGTERM, seconds the sessions held get to finish (no new ones are taken; a gateway "
                        "resumes those left on another replica)")
    p.add_argument("--grace", type=float, default=ServerSettings.grace_s,
                   help="seconds in-flight calls get on shutdown, after the drain")
    p.add_argument("--metrics-port", type=int, default=int(ENV("SPECSPLIT_METRICS_PORT", "0")),
                   help="serve Prometheus metrics on this port (0: none)")
    p.add_argument("--tls-cert", default=ENV("SPECSPLIT_TLS_CERT"), help="serve TLS with this certificate (PEM)")
    p.add_argument("--tls-key", default=ENV("SPECSPLIT_TLS_KEY"), help="the certificate's private key (PEM)")
    p.add_argument("--tls-client-ca", default=ENV("SPECSPLIT_TLS_CLIENT_CA"),
                   help="require client certificates signed by this CA (mutual TLS)")
    p.add_argument("--no-shm", dest="shared_memory", action="store_false",
                   help="never offer or map shared memory: every payload goes over gRPC")


def server_settings(a: argparse.Namespace) -> ServerSettings:
    return ServerSettings(listen=a.listen, address_file=a.address_file, threads=a.threads, grace_s=a.grace,
                          drain_s=a.drain,
                          fixed_threads=a.fixed_threads,
                          metrics_port=a.metrics_port, tls_cert=a.tls_cert, tls_key=a.tls_key,
                          tls_client_ca=a.tls_client_ca, shared_memory=a.shared_memory)


def target_flags(p: argparse.ArgumentParser, quantize_help: str) -> None:
    """The target model's flags, for `serve verify` and the stacks."""
    p.add_argument("--target-model", default=ENV("SPECSPLIT_TARGET_MODEL", "default"),
                   help="local HF model dir, or 'default' (embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=ENV("SPECSPLIT_DTYPE", "bfloat16"), help="bfloat16 | float32 | float16")
    p.add_argument("--device", default=ENV("SPECSPLIT_DEVICE", "cpu"), help="cpu | cuda | cuda:N")
    p.add_argument("--quantize", choices=["auto", *QUANTIZE], default=ENV("SPECSPLIT_QUANTIZE", "auto"),
                   help=quantize_help + "; '' its --dtype; auto: a GGUF-sourced model (every catalog model) from its "
                        "file's blocks unless their perplexity on a fixed text is more than 1 %% worse, measured "
                        "once (docs/usage.md), else its --dtype")
    p.add_argument("--no-exact", dest="exact", action="store_false",
                   help="SDPA attention and plain linears: faster, but spec-on may differ from spec-off")


def draft_model_flags(p: argparse.ArgumentParser) -> None:
    """The model drafter's flags, for `serve draft` and the stacks."""
    p.add_argument("--draft-model", default=ENV("SPECSPLIT_DRAFT_MODEL"),
                   help="a local HF causal LM dir or catalog name for the 'model' drafter ('default': the embedded "
                        "model)")
    p.add_argument("--draft-dtype", default=ENV("SPECSPLIT_DRAFT_DTYPE", "bfloat16"))
    p.add_argument("--draft-quantize", choices=["auto", *QUANTIZE],
                   default=ENV("SPECSPLIT_DRAFT_QUANTIZE", "auto"),
                   help="the draft model's GEMM weights: q8_0, q4_0, int8, gguf (its model.gguf's blocks), '' (its "
                        "dtype) or auto (q4_0 where the native kernels run and the CPU has VNNI, else int8 for a bf16 "
                        "draft, else its dtype)")
    p.add_argument("--draft-vocab", type=int, default=int(ENV("SPECSPLIT_DRAFT_VOCAB", str(DraftSettings.draft_vocab))),
                   help="the model drafter scores only this many token ids (its draft_vocab.json if it has one; "
                        "else the first N ids and the special tokens; 0: all)")


def store_tokens_flag(p: argparse.ArgumentParser, default: int = DraftSettings.store_tokens, why: str = "") -> None:
    p.add_argument("--store-tokens", type=int, default=default,
                   help=why or "earlier outputs the retrieval drafter remembers across requests (0: none)")


def stack_flags(p: argparse.ArgumentParser) -> None:
    """A co-located stack's flags (`up`, `bench`, `soak`, `calibrate`)."""
    p.add_argument("--transport", choices=["unix", "tcp"], default="unix")
    target_flags(p, "int8: the target's GEMM weights in int8; q8_0 / q4_0: 8- / 4-bit weights by int8 activations "
                    "per block of 32 (native kernels, VNNI); gguf: the blocks of the model's GGUF file as shipped")
    draft_model_flags(p)
    p.add_argument("--drafter", default=DraftSettings.default_drafter,
                   help="default drafter: ngram | self | hybrid | model (with --draft-model) | auto (hybrid: n-gram "
                        "+ the self head if there, else the draft model if given; else ngram)")
    p.add_argument("--self-head", default=ENV("SPECSPLIT_SELF_HEAD", "auto"),
                   help="feature head for the self/hybrid drafters ('auto': shipped head for the default target)")
    p.add_argument("--verify-head", default=ENV("SPECSPLIT_VERIFY_HEAD", "auto"),
                   help="the same head drafting in the verify service, where the features are (its decode-ahead, "
                        "where the lookup finds nothing: no process crossed); 'none': only in the draft service")
    p.add_argument("--gamma", type=int, default=ControllerSettings.gamma_start)
    p.add_argument("--batch-wait-ms", type=float, default=VerifySettings.batch_wait_ms,
                   help="the verify service's wait for other sessions' calls to join a forward")
    p.add_argument("--tree-budget", type=int, default=GatewaySettings.tree_budget,
                   help="the gateway's token-tree size per round for requests that do not say (0: chains)")
    threads_flag(p)
    p.add_argument("--trace-file", help="the three services append their traces here as OTLP-JSON lines "
                                        "(read them with `specsplit trace-report --file`)")
    p.add_argument("--run-dir", help="directory for sockets and logs (default: a fresh temp dir)")
    p.add_argument("--no-shm", dest="shared_memory", action="store_false",
                   help="no shared-memory fast path: every payload goes over the sockets")
    p.add_argument("--verify-replicas", type=int, default=1,
                   help="verify processes behind the gateway (each restarted when it exits; a request whose "
                        "replica dies resumes on another)")
    p.add_argument("--pin", action="append", default=[], metavar="SERVICE=CPUS", type=pin_flag,
                   help="run a service on these CPUs only (e.g. --pin verify=1 --pin draft=0 on 2 cores; CPUS: "
                        "a list and ranges as taskset takes them, 0,2-3); each then takes that many threads")


def stack_config(a: argparse.Namespace):
    from specsplit.launcher import StackConfig

    return StackConfig(transport=a.transport, target_model=a.target_model, draft_model=a.draft_model, dtype=a.dtype,
                       draft_dtype=a.draft_dtype, draft_quantize=a.draft_quantize, draft_vocab=a.draft_vocab,
                       device=a.device, exact=a.exact, quantize=a.quantize,
                       drafter=a.drafter, gamma=a.gamma, tree_budget=a.tree_budget,
                       self_head=a.self_head, verify_head=a.verify_head, store_tokens=a.store_tokens,
                       batch_wait_ms=a.batch_wait_ms,
                       threads=a.threads, run_dir=a.run_dir, trace_file=a.trace_file,
                       shared_memory=a.shared_memory, metrics_port=getattr(a, "metrics_port", 0),
                       http_listen=getattr(a, "http_listen", ""), policy=getattr(a, "policy", None),
                       verify_replicas=a.verify_replicas, pins=dict(a.pin))


def cpu_list(spec: str) -> tuple[int, ...]:
    """0,2-3 as (0, 2, 3); argparse reports the error as a bad value."""
    cpus = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise argparse.ArgumentTypeError(f"{spec!r}: a list of CPU numbers and ranges, as 0,2-3")
        cpus.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(cpus))


def pin_flag(value: str) -> tuple[str, str]:
    """SERVICE=CPUS as (service, CPUS) for that service's --cpus."""
    service, _, spec = value.partition("=")
    if service not in ("verify", "draft", "gateway"):
        raise argparse.ArgumentTypeError(f"{value!r}: use SERVICE=CPUS with SERVICE verify, draft or gateway")
    cpu_list(spec)
    return service, spec


def auth_flag(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--auth-token-file", default=ENV("SPECSPLIT_AUTH_TOKEN_FILE"), help=help)


def last_gateway_file() -> Path:
    from specsplit.model.catalog import cache_root

    return cache_root() / "last-gateway"
