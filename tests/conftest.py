"""Fixtures: tiny randomly initialised HF models (saved and loaded through the real code paths) and
real gRPC servers on temp UNIX sockets or loopback TCP."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from specsplit.model.native import PATHS
from specsplit.serving.settings import DraftSettings, GatewaySettings, ModelSettings, ServerSettings, VerifySettings

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    '{"name": "cat", "legs": 4, "sound": "meow"}',
    "| col | value |\n|-----|-------|\n| a | 1 |\n",
    "Once upon a time there was a small dragon who loved to read books.",
    "Repeat after me: speculation must never change the output.",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


SERVICE_START_S = 120.0  # a service loading a tiny model starts in seconds; this is for a loaded machine


async def until(check, what: str, timeout_s: float = SERVICE_START_S, task: asyncio.Task | None = None,
                every_s: float = 0.02):
    """Polls `check()` on the event loop until it is true (a coroutine's result is awaited: an RPC);
    fails saying `what` never happened after `timeout_s`. A `task` (the service being waited for)
    that ended raises its own error instead."""
    import inspect

    async def checked():
        result = check()
        return await result if inspect.isawaitable(result) else result

    deadline = time.monotonic() + timeout_s
    while not (result := await checked()):
        if task is not None and task.done():
            task.result()  # its start-up error
            raise AssertionError(f"{what}: the service stopped without an error first")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        await asyncio.sleep(every_s)
    return result


def wait_for(check, what: str, timeout_s: float = SERVICE_START_S, every_s: float = 0.05,
             not_yet: tuple[type[BaseException], ...] = (), process=None, log: Path | None = None):
    """The blocking twin of `until`: polls `check()` until it returns something true and returns it;
    fails saying `what` never happened after `timeout_s`. Exceptions of the `not_yet` types count as
    not yet (an RPC to a service still restarting); a `process` (Popen) that exits first fails at
    once, with the tail of its `log`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = check()
        except not_yet:
            result = None
        if result:
            return result
        if process is not None and process.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise AssertionError(f"{what}: the process exited ({process.returncode}) first\n{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)


def start_serve(name: str, run_dir: Path, args: list[str], env: dict | None = None):
    """`specsplit serve <args>` as its own process on a UNIX socket in `run_dir`, logging to
    run_dir/<name>.log: (the Popen, its address once it reports SERVING). The caller owns the
    process (stop it in a `finally`); a process that fails to start is killed here."""
    import subprocess
    import sys

    from specsplit.launcher import wait_serving

    address_file, log_path = run_dir / f"{name}.address", run_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "serve", *args, "--listen",
                                 f"unix://{run_dir / name}.sock", "--address-file", str(address_file)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(address_file.exists, f"the {name} service writing its address", process=proc, log=log_path)
        address = address_file.read_text().strip()
        wait_serving(address, 60)
    except BaseException:
        stop_process(proc)
        raise
    return proc, address


def spawn_up(run_dir: Path, flags: list[str], timeout_s: float = SERVICE_START_S, **popen_kw):
    """`specsplit up --run-dir run_dir <flags>` as a process: (the Popen, the gateway's address) once
    it prints "gateway: <address>" (within `timeout_s`, read on a thread so a silent launcher cannot
    hang the test). stdout is piped; stderr goes where `popen_kw` says (else piped). A launcher that
    fails to come up is killed here (its group with start_new_session); the caller stops the rest."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    popen_kw.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen([sys.executable, "-m", "specsplit.cli", "up", "--run-dir", str(run_dir), *flags],
                            stdout=subprocess.PIPE, text=True, **popen_kw)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if line and line[0].startswith("gateway: "):
        return proc, line[0].split(" ", 1)[1].strip()
    if popen_kw.get("start_new_session"):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.wait(30)
    err = proc.stderr.read() if proc.stderr else ""
    raise AssertionError(f"`specsplit up` did not report its gateway within {timeout_s:g} s: {line} {err[-2000:]}")


def stop_process(proc, grace_s: float = 10.0) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `grace_s`."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)


async def service_address(path: Path, task: asyncio.Task, name: str, serving: bool = True,
                          timeout_s: float = SERVICE_START_S) -> str:
    """The address a service started by `task` writes to `path` once it reports SERVING (bounded:
    a service that neither starts nor dies fails the test, naming it); with `serving`, also
    waits for its health check to say so."""
    from specsplit.launcher import wait_serving

    await until(path.exists, f"the {name} service writing its address to {path.name}", timeout_s, task)
    addr = path.read_text().strip()
    if serving:
        await asyncio.to_thread(wait_serving, addr, 30)
    return addr


@pytest.fixture
def slow_forwards(monkeypatch):
    """slow_forwards(seconds): every forward of a verify service in this process takes `seconds`
    longer, so that a test about a deadline or a cancel mid-work holds on a machine of any speed
    (the work is slow by construction, not because this machine happens to be). Returns a list
    that grows by one per forward begun, for a test to wait on."""
    from verify_service.engine import Target

    run = Target.run

    def slow(seconds: float) -> list:
        begun: list = []

        def slowed(self, steps):
            if steps:
                begun.append(len(steps))
                time.sleep(seconds)  # on the verify worker's thread, as a forward would be
            return run(self, steps)

        monkeypatch.setattr(Target, "run", slowed)
        return begun

    return slow


def make_tokenizer(vocab_size: int, extra_text: str = ""):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|end|>", "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS + [extra_text], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model_dir(path: Path, tokenizer, seed: int, layers: int = 2, noise_from: Path | None = None,
                   noise: float = 0.0, hidden: int = 64, heads: int = 4, kv_heads: int = 2, context: int = 256) -> Path:
    """A tiny Llama saved as a HF directory. With noise_from, a perturbed copy of that model (a
    'draft' that mostly agrees with it)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if noise_from is not None:
        model = AutoModelForCausalLM.from_pretrained(noise_from, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise * p.std())
    else:
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             max_position_embeddings=context, eos_token_id=tokenizer.eos_token_id,
                             bos_token_id=None, pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
        model = LlamaForCausalLM(config)
        with torch.no_grad():  # sharper logits than the default init, so greedy text has structure
            model.lm_head.weight.mul_(8)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    tok = make_tokenizer(300)
    target = make_model_dir(root / "target", tok, seed=1)
    return {
        "target": target,
        "draft": make_model_dir(root / "draft", tok, seed=2, noise_from=target, noise=0.3),
        "foreign": make_model_dir(root / "foreign", make_tokenizer(280, "other words entirely"), seed=3),
        # head_dim 32 and 3 query heads per KV head: whole 32-dim key chunks straight from the cache
        # and runs of 5 rows in one AMX attention task (the target's head_dim 16 takes padded copies)
        "wide": make_model_dir(root / "wide", tok, seed=4, hidden=192, heads=6, kv_heads=2),
        # long prompts: a context of 8192, with a prefill of thousands of tokens in chunks
        "long": make_model_dir(root / "long", tok, seed=5, context=8192),
    }


DISTILL_PROMPTS = ["def add(a, b):", "The quick brown fox", '{"name": "cat",', "Once upon a time",
                   "Repeat after me:", "| col | value |", "def sub(a, b):", "There was a small dragon"]


def write_prompts(path: Path) -> Path:
    import json

    path.write_text("".join(json.dumps({"prompt": p, "task_type": "test"}) + "\n" for p in DISTILL_PROMPTS))
    return path


@pytest.fixture(scope="session")
def self_head(models, tmp_path_factory) -> Path:
    """A feature head for the tiny target, made by the real `specsplit distill` pipeline, its MLP
    narrower than the target's (as a big target's head is made)."""
    from specsplit.distill.pipeline import DistillSettings, distill

    work = tmp_path_factory.mktemp("distill")
    return distill(DistillSettings(target_model=str(models["target"]), out=str(work), dtype="float32",
                                   prompts=str(write_prompts(work / "prompts.jsonl")), gen_minutes=1.0,
                                   train_minutes=0.1, max_new_tokens=24, batch=4, draft_vocab=128,
                                   data_fractions=(0.5, 1.0), head_intermediate=96),
                   log=lambda *_: None)


@dataclass
class Running:
    gateway: str
    verify: str
    draft: str
    stop: asyncio.Event
    tasks: list[asyncio.Task]


@contextlib.asynccontextmanager
async def running_stack(tmp_path: Path, transport: str, target: Path, draft: Path | None, dtype: str = "bfloat16",
                        default_drafter: str = "ngram", draft_kw: dict | None = None, tls: dict | None = None,
                        gateway_tls: dict | None = None,
                        verify_kw: dict | None = None, shared_memory: bool = True, draft_via=None, **gateway_kw):
    """The three real services in this process, on temp UNIX sockets or loopback TCP ports; with
    shared_memory False (as on separate hosts) the rounds go over gRPC streams, not the fast path.
    draft_via(address): the address the gateway dials for the draft service (a proxy in between)."""
    from draft_service.main import run as run_draft
    from gateway.main import run as run_gateway
    from verify_service.main import run as run_verify

    def server(name: str) -> ServerSettings:
        listen = f"unix://{tmp_path / f'{name}.sock'}" if transport == "unix" else "127.0.0.1:0"
        own_tls = (tls if name != "gateway" else gateway_tls) or {}  # tls: the draft and verify services'
        return ServerSettings(listen=listen, address_file=str(tmp_path / f"{name}.address"), grace_s=1.0,
                              drain_s=1.0, shared_memory=shared_memory, **own_tls)

    async def address(name: str, task: asyncio.Task) -> str:
        served_tls = gateway_tls if name == "gateway" else tls  # (the health wait below speaks plaintext)
        return await service_address(tmp_path / f"{name}.address", task, name, serving=not served_tls)

    stop = asyncio.Event()
    model = ModelSettings(str(target), dtype)
    draft_model = ModelSettings(str(draft), dtype, exact=False) if draft else None
    tasks = [
        asyncio.create_task(run_verify(VerifySettings(server("verify"), model, **(verify_kw or {})), stop,
                                       handle_signals=False)),
        asyncio.create_task(run_draft(DraftSettings(server("draft"), draft_model, default_drafter=default_drafter,
                                                    **(draft_kw or {})), stop, handle_signals=False)),
    ]
    try:
        verify_addr = await address("verify", tasks[0])
        draft_addr = await address("draft", tasks[1])
        # chains unless a test asks for trees: most tests pin the verify width they check
        dialed = draft_via(draft_addr) if draft_via else draft_addr
        settings = GatewaySettings(server("gateway"), verify_addr, dialed, tokenizer=str(target),
                                   connect_timeout_s=10, **{"tree_budget": 0, **gateway_kw})
        tasks.append(asyncio.create_task(run_gateway(settings, stop, handle_signals=False)))
        gateway_addr = await address("gateway", tasks[2])
        yield Running(gateway_addr, verify_addr, draft_addr, stop, tasks)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


# --- helpers shared by the test files (one place: no test file imports another) ---

PROMPTS = ["def add(a, b):", "The quick brown fox", '{"name": "cat",', "Once upon a time"]


def request(prompt: str, speculation=None, **kw):
    """A GenerateRequest for raw text: speculation ON unless given, 40 tokens ignoring EOS unless given."""
    from specsplit.api.gateway.v1 import gateway_pb2 as pb

    kw.setdefault("max_new_tokens", 40)
    kw.setdefault("stop", pb.StopConditions(ignore_eos=True))
    return pb.GenerateRequest(text=prompt, speculation=pb.SPECULATION_ON if speculation is None else speculation,
                              **kw)


async def active_sessions(stack) -> tuple[int, int]:
    """(the verify service's, the draft service's) open sessions."""
    import grpc

    from specsplit.api.draft.v1 import draft_pb2 as dpb
    from specsplit.api.draft.v1 import draft_pb2_grpc as dpb_grpc
    from specsplit.api.verify.v1 import verify_pb2 as vpb
    from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc

    async with grpc.aio.insecure_channel(stack.verify) as v, grpc.aio.insecure_channel(stack.draft) as d:
        vi = await vpb_grpc.VerifierStub(v).Info(vpb.InfoRequest())
        di = await dpb_grpc.DrafterStub(d).Info(dpb.InfoRequest())
    return vi.active_sessions, di.active_sessions


async def wait_released(stack, timeout_s: float = 60.0) -> tuple[int, int]:
    """The open sessions once both services report none, or as they stand after `timeout_s` (a
    hang guard, not a timing: the caller asserts (0, 0))."""
    with contextlib.suppress(AssertionError):
        await until(lambda: _none_open(stack), "both services releasing every session", timeout_s, every_s=0.05)
    return await active_sessions(stack)


async def _none_open(stack) -> bool:
    return await active_sessions(stack) == (0, 0)


def prefill_all(target, state, chunk: int | None = None):
    """Runs a started prefill (`Target.start_prefill`) to its end, one planned step at a time, and
    returns the last step's result; a prefill still unfinished after one step per prompt token (it
    stopped making progress) fails the test instead of looping."""
    result = None
    for _ in range(len(state.prompt) + 1):
        if state.finished:
            return result
        result = target.run_one(target.plan_prefill(state, chunk))
    assert state.finished, f"a prefill of {len(state.prompt)} tokens unfinished after as many steps ({state.done} fed)"
    return result


class Clock:
    """A clock that moves only when a test moves it (`clock.now += s`)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def free_ports(n: int = 1) -> int:
    """The first of n consecutive free loopback ports."""
    import random
    import socket

    for _ in range(100):
        base = random.randrange(20000, 60000)
        try:
            for port in range(base, base + n):
                socket.create_server(("127.0.0.1", port)).close()
        except OSError:
            continue
        return base
    raise RuntimeError("no free ports")


@pytest.fixture(params=PATHS)
def kernel_path(request, monkeypatch):
    """Runs the test once on each native kernel path this CPU has (SPECSPLIT_ISA); the others are
    skipped saying what the CPU lacks, so `pytest -rs` shows only what it truly lacks."""
    from specsplit.model import native

    why = native.lacks(request.param)
    if why:
        pytest.skip(f"kernel path {request.param} not tested on this CPU: {why}")
    monkeypatch.setenv("SPECSPLIT_ISA", request.param)
    monkeypatch.delenv("SPECSPLIT_AMX", raising=False)
    return request.param


def native_model(models, dtype: str = "bfloat16", model: str = "target"):
    """A fixture model loaded on the native kernels; the test is skipped (saying why) where they
    cannot run."""
    from specsplit.model import native
    from specsplit.model.modeling import load_model

    lm = load_model(models[model], dtype)
    if lm.native is None:
        pytest.skip(native.unavailable(lm.dtype, lm.device) or lm.kernels or "no native forward")
    return lm


def root_paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from the root, itself last (parents come before their children, as
    tokentree.check requires; built like tokentree.depths)."""
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        paths.append([*(paths[parent] if parent >= 0 else []), i])
    return paths


def random_head(seed: int = 0, head_dim: int = 8):
    """A tiny feature head with random weights (not the identity start: every path must matter),
    reading a 50-token embedding, drafting over 16 of its tokens. The native kernels need
    head_dim % 16 == 0."""
    from specsplit.model.featurehead import FeatureHead, HeadConfig

    torch.manual_seed(seed)
    cfg = HeadConfig(hidden=32, intermediate=64, heads=4, kv_heads=2, head_dim=head_dim, rope_theta=10000.0,
                     eps=1e-5, draft_vocab=16)
    head = FeatureHead(cfg)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    head.attach(torch.randn(50, 32), torch.randn(50, 32), torch.arange(16) * 3)
    return head.eval()


@pytest.fixture
def shm_dir(monkeypatch) -> Path:
    """SPECSPLIT_SHM_DIR in a fresh directory, removed after. Short: the services' fast-path sockets
    live here too, and a socket path has at most 107 bytes."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="shm-", dir="/tmp"))
    monkeypatch.setenv("SPECSPLIT_SHM_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# --- the run leaves no process behind ---

def _descendants(root: int) -> list[tuple[int, str]]:
    """Live (not zombie) processes below `root`, from /proc: (pid, command name)."""
    parents: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if rest[0] != "Z":
            parents[int(entry.name)] = (int(rest[1]), name)
    found, frontier = [], {root}
    while frontier:
        frontier = {pid for pid, (ppid, _) in parents.items() if ppid in frontier}
        found += [(pid, parents[pid][1]) for pid in sorted(frontier)]
    return found


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Every process a test started must be gone when the run ends (a leaked service holds ports,
    shared memory and CPU): waits up to 10 s for stragglers, then kills them and fails the run
    naming them."""
    import os
    import signal

    deadline = time.monotonic() + 10
    left = _descendants(os.getpid())
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _descendants(os.getpid())
    if not left:
        return
    for pid, _ in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    session.config.get_terminal_writer().line(f"processes left by the run (killed): {left}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
