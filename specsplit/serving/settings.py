"""One frozen settings object per service, built at the entry point from flags and environment;
the CLI's defaults and the tools' are read from here, and so are the limits every side checks."""

from __future__ import annotations

from dataclasses import dataclass

# Draft tokens one verify call takes (a token tree's budget too: the gateway, the draft service
# and the metrics' per-position counters use the same bound), and the longest chain a round drafts.
MAX_DRAFT = 64
MAX_GAMMA = 32


@dataclass(frozen=True)
class ModelSettings:
    path: str  # a local HF model directory, or "default" for the embedded SmolLM2-135M-Instruct
    dtype: str = "bfloat16"
    device: str = "cpu"
    exact: bool = True
    quantize: str = ""  # the GEMM weights: "" (the dtype), int8, q8_0, q4_0, gguf, or auto (weightchoice)


@dataclass(frozen=True)
class ServerSettings:
    listen: str  # unix:///path.sock or host:port (port 0 picks a free one)
    address_file: str | None = None  # where the bound address is written once SERVING
    threads: int = 0  # torch intra-op threads, the most a forward uses; 0: the CPUs this process may use
    # True: every forward on `threads`; False: the team size per forward is measured (serving.threadtune)
    fixed_threads: bool = False
    # On shutdown (SIGTERM): new sessions are refused at once (health NOT_SERVING), the sessions held
    # get up to drain_s to finish (the gateway resumes any left elsewhere), then in-flight calls grace_s.
    drain_s: float = 20.0
    grace_s: float = 5.0
    metrics_port: int = 0  # Prometheus scrape endpoint (0: none; see specsplit.serving.telemetry)
    # TLS: PEM files. With tls_client_ca the server also requires a client certificate signed by it (mTLS).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # Co-located fast path (specsplit.serving.shm): the gateway offers a segment per speculative session,
    # the services map it when it is on their host. False: plain gRPC only.
    shared_memory: bool = True


@dataclass(frozen=True)
class ClientTLS:
    """How the gateway reaches TLS backends: the CA that signed their certificates and, for mTLS,
    the gateway's own certificate and key (PEM files)."""

    ca: str
    cert: str | None = None
    key: str | None = None


@dataclass(frozen=True)
class VerifySettings:
    server: ServerSettings
    model: ModelSettings
    max_sessions: int = 64
    idle_timeout_s: float = 600.0
    # KV cache of all sessions together (native forward); 0: max_sessions at the full context,
    # capped at a quarter of physical memory.
    kv_cache_mib: int = 0
    # Batching across sessions: the most rows one forward takes, and how long the first call of a
    # batch may wait for the others (a batch also runs once every live session has sent its call).
    batch_rows: int = 256
    batch_wait_ms: float = 5.0
    # Keep prompts' keys and values for later prompts that start the same way (native forward),
    # in KV budget that sessions leave free.
    prefix_cache: bool = True
    # Earlier outputs the verifier's own copies (decode-ahead lookups) also draw on (0: none): a
    # bigram index, at most ≈ 10 MiB at 64k tokens (every bigram distinct; text repeats many).
    store_tokens: int = 65536
    # The target's feature head, drafting here where the decode-ahead's lookup finds nothing (no
    # process crossing a head round); None: none. Greedy sessions only; see DraftSettings for the stop.
    self_head: str | None = None
    # The chain stops below this probability of being right. Here a round costs no crossing: with
    # the head's state in the kernels, 0.2 measured above 0.3 and 0.4 (forced self 1.29-1.46x against
    # 1.28-1.36x and 1.28-1.33x spec-off, the default request 1.47-1.62x against 1.40-1.53x and 1.50x,
    # runs alternating, EPYC Zen 5, 2026-12-07 evening) and 0.1 no better (1.27-1.32x, 1.43x).
    self_min_confidence: float = 0.2
    # The head's output rows: the first N of its frequency-ranked draft vocabulary (0: all of it).
    # Measured on the default model (EPYC Zen 5, 2026-12-07): 4,096 of 8,192 rows keep 92 % of the
    # target's tokens, the same acceptance, and a drafted token 15 % cheaper (the default request
    # 1.50-1.55x against 1.41-1.47x spec-off, back to back).
    head_vocab: int = 4096
    head_gamma: int = 8  # most tokens of one head draft (a tree: its depth)
    # > 0: the head drafts EAGLE-2 trees here, this many nodes expanded a depth, cut to the nodes
    # whose expected tokens pay for their rows; 0: chains with the confidence stop.
    head_width: int = 0


@dataclass(frozen=True)
class DraftSettings:
    server: ServerSettings
    model: ModelSettings | None  # None: no standalone draft model
    # The model drafter scores this many ids (its draft_vocab.json if it has one; 0: all).
    draft_vocab: int = 32768
    default_drafter: str = "auto"  # auto: hybrid when a draft model or self head is loaded, else ngram
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
    head_vocab: int = 4096  # the head's output rows (VerifySettings.head_vocab)
    proposal_top_k: int = 16  # rejection sampling: tokens kept (and sent) per draft distribution
    max_sessions: int = 64
    idle_timeout_s: float = 600.0
    batch_wait_ms: float = 2.0  # how long a Propose may wait for other sessions' to draft with it


@dataclass(frozen=True)
class ControllerSettings:
    enabled: bool = True
    gamma_min: int = 1
    gamma_max: int = 8
    gamma_start: int = 4
    # Speculation is switched off below this mean acceptance length. 0: the break-even acceptance
    # length computed from the measured costs (the length at which spec-on time per token equals
    # spec-off), times `margin`. The seed's fixed rule is 2.0.
    min_acceptance: float = 0.0
    margin: float = 1.05
    control_share: float = 0.05  # AUTO requests that run spec-off to keep the baseline measured (every n-th)
    # A fixed cap: above this many requests in flight, no speculation; 0: none (the cut-off is
    # predicted from the verifier's cost curve and the task type's measured rounds, controller.md).
    max_inflight: int = 0
    window: int = 48  # requests per task type and mode kept for latency percentiles
    min_requests: int = 6  # spec-on (and spec-off) requests needed before judging
    probe_every: int = 10  # under load, one decision in 4x this runs the other mode; pre-drafting's A/B likewise
    hysteresis: float = 0.05  # turning back on needs P95 this much better than off and acceptance above threshold
    decay: float = 0.98  # per round, for the running acceptance and cost estimates
    gamma_gain: float = 0.02  # gamma changes only when the model expects at least this gain per token

    def check(self) -> None:
        if not 1 <= self.gamma_min <= self.gamma_start <= self.gamma_max:
            raise ValueError(f"need 1 <= gamma_min ({self.gamma_min}) <= gamma_start ({self.gamma_start}) "
                             f"<= gamma_max ({self.gamma_max})")
        if not 0 <= self.control_share < 1:
            raise ValueError(f"control_share {self.control_share} is not in [0, 1)")


@dataclass(frozen=True)
class GatewaySettings:
    server: ServerSettings
    verify_address: str
    draft_address: str
    tokenizer: str  # model directory holding the target's tokenizer, or "default"
    default_drafter: str = ""  # empty: the draft service's default
    max_new_tokens_limit: int = 4096
    rpc_timeout_s: float = 60.0  # per internal call, also bounded by the client's deadline
    # A request whose verify replica died (or restarted) waits this long for a replica to take its
    # session back (re-prefilled with everything it committed) before it fails UNAVAILABLE: a little
    # more than a restart of the default model's verify service under `up`.
    resume_wait_s: float = 30.0
    connect_timeout_s: float = 300.0  # how long to wait for the draft and verify services at start
    controller: ControllerSettings = ControllerSettings()  # decides AUTO requests
    policy_file: str | None = None  # from `specsplit calibrate`: the controller's starting state
    upstream_tls: ClientTLS | None = None  # None: plaintext to the draft and verify services
    shm_segment_bytes: int = 4 * 1024 * 1024  # per speculative session, when shared memory is on
    # Asynchronous drafting for requests that do not say: on | off | auto (the controller measures
    # both per task type and keeps the faster; docs/controller.md).
    predraft: str = "auto"
    # Token trees: most draft tokens per round for requests that do not say (0 or 1: chains). The
    # gateway keeps the part of each proposed tree whose expected gain pays for its verify rows.
    tree_budget: int = 8
    auth_token: str = ""  # non-empty: calls must carry `authorization: Bearer <token>` (health stays open)
    max_sessions_per_client: int = 0  # Generate calls in flight per client address (0: no cap)
    http_listen: str = ""  # host:port: also serve the OpenAI-compatible HTTP API (gateway/openai.py)
