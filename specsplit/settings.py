"""One frozen settings object per service, built at the entry point from flags and environment."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSettings:
    path: str  # a local HF model directory, or "default" for the embedded SmolLM2-135M-Instruct
    dtype: str = "bfloat16"
    device: str = "cpu"
    exact: bool = True


@dataclass(frozen=True)
class ServerSettings:
    listen: str  # unix:///path.sock or host:port (port 0 picks a free one)
    address_file: str | None = None  # where the bound address is written once SERVING
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    grace_s: float = 5.0  # in-flight calls get this long on shutdown
    metrics_port: int = 0  # Prometheus scrape endpoint (0: none; see specsplit.telemetry)


@dataclass(frozen=True)
class VerifySettings:
    server: ServerSettings
    model: ModelSettings
    max_sessions: int = 64
    idle_timeout_s: float = 600.0


@dataclass(frozen=True)
class DraftSettings:
    server: ServerSettings
    model: ModelSettings | None  # None: no standalone draft model
    default_drafter: str = "auto"  # auto: hybrid when a self head is loaded, else ngram
    ngram_min: int = 1
    ngram_max: int = 3
    store_tokens: int = 262144  # earlier outputs the retrieval drafter remembers (0: none)
    # A feature head from `specsplit distill` ("default": the one shipped for the embedded target);
    # None: no self/hybrid drafters. It reads the embedding of target_model, whose weights must
    # be the ones it was trained on.
    self_head: str | None = None
    target_model: str = "default"
    device: str = "cpu"
    hybrid_min_match: int = 2  # n-gram length from which the hybrid copies instead of using the head
    self_min_confidence: float = 0.3  # the head stops drafting below this chain probability
    proposal_top_k: int = 16  # rejection sampling: tokens kept (and sent) per draft distribution
    max_sessions: int = 64
    idle_timeout_s: float = 600.0


@dataclass(frozen=True)
class GatewaySettings:
    server: ServerSettings
    verify_address: str
    draft_address: str
    tokenizer: str  # model directory holding the target's tokenizer, or "default"
    default_gamma: int = 4
    default_drafter: str = ""  # empty: the draft service's default
    max_new_tokens_limit: int = 4096
    rpc_timeout_s: float = 60.0  # per internal call, also bounded by the client's deadline
    connect_timeout_s: float = 300.0  # how long to wait for the draft and verify services at start
