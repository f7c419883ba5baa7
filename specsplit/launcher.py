"""Starts the three services as child processes on one host (what `specsplit up` and the bench run)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.serving.settings import ControllerSettings, DraftSettings, GatewaySettings, VerifySettings

_PR_SET_PDEATHSIG = 1


PARENT_ENV = "SPECSPLIT_LAUNCHER_PID"
RESTART_FIRST_S, RESTART_MAX_S = 0.5, 30.0  # a crashed service's restart delay, doubling up to the cap
STABLE_S = 60.0  # a service up this long has its restart delay reset
# --metrics-port P: each service's port is P + this (verify replicas after the first: 3, 4, ...)
METRICS_OFFSET = {"gateway": 0, "verify": 1, "draft": 2}


def service_of(name: str) -> str:
    """The service a process of the stack runs: "verify-2" (a second verify replica) runs "verify"."""
    return name.split("-")[0]


def die_with_launcher() -> None:
    """Called by `specsplit serve` at start: when started by a Stack, get SIGTERM once the launcher
    dies, even by SIGKILL. The child sets this itself rather than in a preexec_fn: a preexec_fn
    forces fork() instead of vfork(), and fork() in a process using gRPC runs gRPC's fork handlers,
    which can crash the child with an epoll EBADF before exec (grpc/grpc#43055; seen here once)."""
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent:
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != int(parent):  # the launcher died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass(frozen=True)
class StackConfig:
    transport: str = "unix"  # unix | tcp
    target_model: str = "default"
    draft_model: str | None = None
    dtype: str = "bfloat16"
    draft_dtype: str = "bfloat16"
    draft_quantize: str = "auto"  # the draft model's weights: as serve draft's --draft-quantize
    draft_vocab: int = DraftSettings.draft_vocab  # the model drafter's draft vocabulary (0: all)
    device: str = "cpu"
    exact: bool = True
    quantize: str = ""  # the target's weights: as serve verify's --quantize ("" its dtype, auto: weightchoice)
    batch_wait_ms: float = VerifySettings.batch_wait_ms  # the verify service's --batch-wait-ms
    drafter: str = DraftSettings.default_drafter  # the draft service's default drafter
    self_head: str = "auto"  # feature head for the self/hybrid drafters (see `serve draft --self-head`)
    # the same head drafting in the verify service's decode-ahead (see `serve verify --self-head`): "none" there
    verify_head: str = "auto"
    # The draft service's store of earlier outputs (0: none), and the verifier's up to its own default.
    store_tokens: int = DraftSettings.store_tokens
    gamma: int = ControllerSettings.gamma_start
    tree_budget: int = GatewaySettings.tree_budget  # the gateway's --tree-budget
    threads: int = 0
    run_dir: str | None = None  # sockets, address files and logs; a fresh temp dir when None
    trace_file: str | None = None  # the services export traces here as OTLP-JSON lines (else OTEL_* decides)
    shared_memory: bool = True  # False: --no-shm for all three
    metrics_port: int = 0  # Prometheus: the gateway's port; verify +1, draft +2 (0: none)
    http_listen: str = ""  # host:port: the gateway's OpenAI-compatible HTTP door ("" none)
    verify_replicas: int = 1  # verify processes behind the gateway: verify, verify-2, ...
    policy: str | None = None  # the gateway's --policy (from `specsplit calibrate` or `validate`)
    pins: dict = field(default_factory=dict)  # service -> its --cpus (0,2-3; verify: every replica)

    def resolved(self) -> StackConfig:
        """The config with the target's weights chosen (`--quantize auto`, cached), for a tool that
        measures the model a stack started here serves (its step, its kernels' name)."""
        from specsplit.model import weightchoice

        return replace(self, quantize=weightchoice.resolve(self.quantize, self.target_model, self.dtype, self.device))


def sweep_shared_memory() -> list[str]:
    """Removes what dead processes of this project left in the shared-memory directory: segments and
    lock files of creators that no longer hold their lock, fast-path sockets nobody listens on. A
    live process's files are kept (its lock is held, its socket answers)."""
    from specsplit.serving import fastpath, shm

    return shm.reclaim_stale() + fastpath.reclaim_stale()


class Stack:
    """verify + draft (in parallel), then the gateway; each a `specsplit serve` process."""

    def __init__(self, config: StackConfig):
        self.config = config
        self._own_dir = config.run_dir is None
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="specsplit-"))
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # sockets and logs: this user's only
        self.procs: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}
        self._commands: dict[str, tuple[list[str], tuple[str, ...]]] = {}  # how each was started
        self._started: dict[str, float] = {}
        self._restarts: dict[str, int] = {}  # consecutive restarts (reset once it stays up STABLE_S)
        self._due: dict[str, float] = {}  # a crashed service's restart time

    @property
    def verify_names(self) -> list[str]:
        """The verify processes' names: verify, verify-2, ..."""
        return ["verify", *(f"verify-{k}" for k in range(2, self.config.verify_replicas + 1))]

    def _listen(self, name: str) -> str:
        if self.config.transport == "unix":
            return f"unix://{self.run_dir / f'{name}.sock'}"
        if self.config.transport == "tcp":
            return "127.0.0.1:0"
        raise ValueError(f"unknown transport {self.config.transport!r}; use unix or tcp")

    def _spawn(self, name: str, args: list[str], entry: tuple[str, ...] = ()) -> None:
        """Starts service `name` (`specsplit serve NAME`, or `python -m *entry` taking the same
        --listen, --address-file, --threads and --no-shm flags). A restart listens where the first
        run was bound, so the others reach it at the same address."""
        address_file = self.run_dir / f"{name}.address"
        address_file.unlink(missing_ok=True)
        self._commands[name] = (args, entry)
        listen = self.addresses.get(name) or self._listen(name)
        cmd = [sys.executable, "-m", *(entry or ("specsplit.cli", "serve", service_of(name))), "--listen", listen,
               "--address-file", str(address_file), *args]
        if self.config.threads:
            cmd += ["--threads", str(self.config.threads)]
        if not self.config.shared_memory:
            cmd.append("--no-shm")
        if service_of(name) in self.config.pins:
            cmd += ["--cpus", self.config.pins[service_of(name)]]
        if self.config.metrics_port:
            offset = (METRICS_OFFSET[name] if name in METRICS_OFFSET
                      else len(METRICS_OFFSET) + self.verify_names.index(name) - 1)
            cmd += ["--metrics-port", str(self.config.metrics_port + offset)]
        log = open(self.run_dir / f"{name}.log", "ab")
        env = dict(os.environ)
        env.pop("SPECSPLIT_METRICS_PORT", None)  # one port each, from the config: three cannot share one
        if self.config.trace_file:
            env["SPECSPLIT_OTLP_FILE"] = str(Path(self.config.trace_file).resolve())
        env[PARENT_ENV] = str(os.getpid())
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._started[name] = time.monotonic()
        log.close()

    def supervise(self) -> list[str]:
        """Restarts the services that exited, each after a delay that doubles with its consecutive
        crashes (RESTART_FIRST_S .. RESTART_MAX_S); returns what happened, for the log. The others
        keep serving meanwhile: the gateway runs without drafts while the draft service is down and
        answers UNAVAILABLE (health NOT_SERVING) while the verify service is."""
        events, now = [], time.monotonic()
        for name, proc in list(self.procs.items()):
            if proc.poll() is None:
                if now - self._started[name] > STABLE_S:
                    self._restarts[name] = 0
                continue
            if name not in self._due:
                delay = min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** self._restarts.get(name, 0))
                self._due[name] = now + delay
                events.append(f"{name} service exited with {proc.returncode}; restarting it in {delay:.1f} s; "
                              f"last lines of its log:\n{self.tail(name, 5)}")
            elif now >= self._due[name]:
                del self._due[name]
                self._restarts[name] = self._restarts.get(name, 0) + 1
                self._spawn(name, *self._commands[name])
                events.append(f"{name} service restarted (pid {self.procs[name].pid}, restart "
                              f"{self._restarts[name]} in a row), listening on {self.addresses[name]}")
        return events

    def _await(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(names)
        while pending:
            for name in sorted(pending):
                proc = self.procs[name]
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} service exited with {proc.returncode}; "
                                       f"last lines of {self.run_dir / f'{name}.log'}:\n{self.tail(name)}")
                path = self.run_dir / f"{name}.address"
                if path.exists():
                    self.addresses[name] = path.read_text().strip()
                    wait_serving(self.addresses[name], max(1.0, deadline - time.monotonic()))
                    pending.discard(name)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sorted(pending)} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.1)

    def tail(self, name: str, lines: int = 20) -> str:
        path = self.run_dir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def rss_mib(self, name: str) -> float:
        """A service's resident memory now (MiB; 0 where the process is gone)."""
        try:
            with open(f"/proc/{self.procs[name].pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def start(self, timeout_s: float = 600.0, draft_via=None) -> str:
        """Returns the gateway address once all three report SERVING. draft_via(address) -> address
        lets the gateway reach the draft service through something (the bench's delaying proxy)."""
        c = self.config
        try:
            model_flags = ["--dtype", c.dtype, "--device", c.device] + ([] if c.exact else ["--no-exact"])
            for name in self.verify_names:
                self._spawn(name, ["--target-model", c.target_model, *model_flags, "--quantize", c.quantize,
                                   "--batch-wait-ms", str(c.batch_wait_ms), "--self-head", c.verify_head,
                                   "--store-tokens", str(min(c.store_tokens, VerifySettings.store_tokens))])
            draft_flags = ["--default-drafter", c.drafter, "--device", c.device, "--self-head", c.self_head,
                           "--target-model", c.target_model, "--store-tokens", str(c.store_tokens)]
            if c.draft_model:
                draft_flags += ["--draft-model", c.draft_model, "--draft-dtype", c.draft_dtype]
                draft_flags += ["--draft-quantize", c.draft_quantize, "--draft-vocab", str(c.draft_vocab)]
            self._spawn("draft", draft_flags)
            self._await([*self.verify_names, "draft"], timeout_s)
            draft = draft_via(self.addresses["draft"]) if draft_via else self.addresses["draft"]
            verify = ",".join(self.addresses[name] for name in self.verify_names)
            self._spawn("gateway", ["--verify", verify, "--draft", draft,
                                    "--tokenizer", c.target_model, "--gamma", str(c.gamma),
                                    "--tree-budget", str(c.tree_budget),
                                    *(["--http-listen", c.http_listen] if c.http_listen else []),
                                    *(["--policy", str(Path(c.policy).resolve())] if c.policy else [])])
            self._await(["gateway"], timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.addresses["gateway"]

    def stop(self, grace_s: float = 10.0) -> dict[str, int]:
        """SIGTERM all (gateway first), SIGKILL what is left after grace_s; returns exit codes."""
        for name in ["gateway", "draft", *self.verify_names]:
            proc = self.procs.get(name)
            if proc and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        for path in [*self.run_dir.glob("*.sock"), *self.run_dir.glob("*.address")]:
            path.unlink(missing_ok=True)  # a SIGKILLed server leaves its socket behind
        sweep_shared_memory()  # and its shared-memory segments, locks and fast-path socket
        if self._own_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return codes

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextlib.contextmanager
def gateway_stub(address: str | None, config: StackConfig, token_file: str | None = None):
    """(stub, stack): a stub for the gateway at `address` (sending the bearer token in `token_file`,
    if any), or for a stack started here from `config` (stack None otherwise); the stack is
    stopped on exit."""
    from gateway.access import with_token

    stack = None
    try:
        if not address:
            stack = Stack(config)
            print(f"starting verify, draft and gateway over {config.transport} ...", file=sys.stderr, flush=True)
            address = stack.start()
        with grpc.insecure_channel(address) as channel:
            yield pb_grpc.GatewayStub(with_token(channel, token_file if not stack else None)), stack
    finally:
        if stack is not None:
            stack.stop()


def wait_serving(address: str, timeout_s: float) -> None:
    """Blocks until the server at `address` answers SERVING on the standard health service."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2, wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} is not SERVING after {timeout_s:.0f} s")
            time.sleep(0.1)
