"""`specsplit bench --round-overhead`: what a round costs beyond the models. The real gateway and the
real draft and verify servers (gRPC, worker thread, fast path, shared memory) run with a verifier
and a drafter that cost nothing: the drafter proposes gamma copies of one token and the verifier
accepts them all. Every figure is a round's overhead as specsplit.roundtime defines it (round wall
time minus compute), for each way the gateway reaches the services."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch

from specsplit.gateway.v1 import gateway_pb2 as pb
from specsplit.gateway.v1 import gateway_pb2_grpc as pb_grpc

TOKEN = 100  # what the stub drafter proposes and the stub verifier chooses
TRANSPORTS = (("shared memory", "unix", True), ("unix socket", "unix", False), ("tcp loopback", "tcp", False))


class _StubSequence:
    """A target 'forward' that predicts the fed tokens themselves, then TOKEN: every draft of TOKEN
    is accepted."""

    def __init__(self, vocab: int):
        self._vocab = vocab

    def forward(self, ids: list[int], last_only: bool = False) -> torch.Tensor:
        rows = 1 if last_only else len(ids)
        logits = torch.zeros(rows, self._vocab)
        logits[:, TOKEN] = 1.0  # [rows, vocab]
        return logits

    def truncate(self, length: int) -> None:
        pass


class _StubDrafter:
    def __init__(self):
        from draft_service.drafters.base import DrafterDescription

        self.description = DrafterDescription(name="stub", kind="ngram")
        self.memory_bytes = 0

    def start(self, prompt: list[int]):
        from draft_service.drafters.base import DraftSession

        return DraftSession(prompt)

    def propose(self, session, gamma: int):
        from draft_service.drafters.base import Proposal

        return Proposal([TOKEN] * gamma, "stub")

    def end(self, session) -> None:
        pass


async def _serve_stub(kind: str, listen: str, address_file: str, shared_memory: bool) -> None:
    """The real servicer and server of `kind` around a stub model."""
    from transformers import AutoTokenizer

    from specsplit import default_model, fastpath
    from specsplit.modeling import tokenizer_fingerprint
    from specsplit.serving import serve
    from specsplit.sessions import SessionTable
    from specsplit.settings import ServerSettings
    from specsplit.worker import ModelWorker

    settings = ServerSettings(listen=listen, address_file=address_file, shared_memory=shared_memory)
    worker, sessions = ModelWorker(kind), SessionTable(64, 600.0)
    if kind == "verify":
        from verify_service.engine import Target
        from verify_service.server import SERVICE_NAME, VerifierServicer, register

        tokenizer = AutoTokenizer.from_pretrained(default_model.resolve("default"), local_files_only=True)
        vocab = len(tokenizer)
        lm = SimpleNamespace(model_id="stub", vocab_size=vocab, fingerprint=tokenizer_fingerprint(tokenizer),
                             max_context=1 << 16, dtype=torch.bfloat16, device=torch.device("cpu"), exact=True,
                             eos_token_ids=[], param_bytes=0, model_fingerprint="", hidden_size=576,
                             tokenizer=tokenizer)
        servicer = VerifierServicer(lm, sessions, worker, shared_memory,
                                    Target(lm, new_sequence=lambda: _StubSequence(vocab)))
        handler = servicer.rounds.frame
    else:
        from draft_service.server import SERVICE_NAME, DrafterServicer, register

        servicer = DrafterServicer({"stub": _StubDrafter()}, "stub", sessions, worker, shared_memory=shared_memory)
        handler = servicer.rounds.frame
    fast = fastpath.offer(worker, handler, kind, shared_memory)
    servicer.fast_path = str(fast.path) if fast else ""
    await serve(settings, SERVICE_NAME, lambda server: register(server, servicer), sessions=sessions, worker=worker,
                fast_path=fast)


class _Stack:
    """Stub verify and draft services and the real gateway, as child processes."""

    def __init__(self, transport: str, shared_memory: bool):
        self.dir = Path(tempfile.mkdtemp(prefix="specsplit-rounds-"))
        self.transport, self.shared_memory = transport, shared_memory
        self.procs: list[subprocess.Popen] = []

    def _listen(self, name: str) -> str:
        return f"unix://{self.dir / f'{name}.sock'}" if self.transport == "unix" else "127.0.0.1:0"

    def _spawn(self, name: str, cmd: list[str]) -> str:
        from specsplit.tools.launcher import PARENT_ENV, wait_serving

        address = self.dir / f"{name}.address"
        flags = ["--listen", self._listen(name), "--address-file", str(address)]
        flags += [] if self.shared_memory else ["--no-shm"]
        log = open(self.dir / f"{name}.log", "ab")
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        self.procs.append(subprocess.Popen([sys.executable, "-m", *cmd, *flags], stdout=log,
                                           stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + 120
        while not address.exists():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start: {(self.dir / f'{name}.log').read_text()[-2000:]}")
            time.sleep(0.05)
        wait_serving(address.read_text().strip(), 60)
        return address.read_text().strip()

    def start(self) -> str:
        verify = self._spawn("verify", ["specsplit.tools.roundoverhead", "serve", "verify"])
        draft = self._spawn("draft", ["specsplit.tools.roundoverhead", "serve", "draft"])
        return self._spawn("gateway", ["specsplit.cli", "serve", "gateway", "--verify", verify, "--draft", draft,
                                       "--tokenizer", "default", "--predraft", "off"])

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def measure(transport: str, shared_memory: bool, requests: int, tokens: int, gamma: int) -> dict:
    """Per-round overhead, network and gateway shares (ms) of spec-on requests through one stack."""
    stack = _Stack(transport, shared_memory)
    try:
        with grpc.insecure_channel(stack.start()) as channel:
            stub = pb_grpc.GatewayStub(channel)
            request = pb.GenerateRequest(text="Count: one two three", max_new_tokens=tokens, gamma=gamma,
                                         speculation=pb.SPECULATION_ON, predraft=pb.PREDRAFT_OFF)
            stub.Generate(request, timeout=60)  # warm-up
            overhead, network, gateway, fast = [], [], [], 0
            for _ in range(requests):
                stats = stub.Generate(request, timeout=60).stats
                fast += stats.fast_path
                for r in stats.round_records:
                    overhead.append(r.network_ms + r.gateway_ms)
                    network.append(r.network_ms)
                    gateway.append(r.gateway_ms)
    finally:
        stack.stop()
    ordered = sorted(overhead)
    return {"rounds": len(overhead), "median": statistics.median(overhead),
            "p95": ordered[max(0, int(0.95 * len(ordered)) - 1)], "network": statistics.median(network),
            "gateway": statistics.median(gateway), "fast_path": f"{fast}/{requests}"}


def run(requests: int = 20, tokens: int = 256, gamma: int = 4) -> list[dict]:
    rows = []
    print(f"{'path':<15}{'rounds':>7}{'median ms':>10}{'p95 ms':>8}{'network':>9}{'gateway':>9}{'fast path':>10}")
    for label, transport, shared in TRANSPORTS:
        row = {"path": label, **measure(transport, shared, requests, tokens, gamma)}
        rows.append(row)
        print(f"{label:<15}{row['rounds']:>7}{row['median']:>10.3f}{row['p95']:>8.3f}{row['network']:>9.3f}"
              f"{row['gateway']:>9.3f}{row['fast_path']:>10}", flush=True)
    print("Per round, spec on, gamma {}: overhead = round wall time - compute = network + gateway "
          "(docs/metrics.md#time), through the real gateway and servers around a verifier and a drafter that "
          "cost nothing. fast path: requests whose rounds used it.".format(gamma))
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m specsplit.tools.roundoverhead")
    parser.add_argument("cmd", choices=["serve"])
    parser.add_argument("kind", choices=["verify", "draft"])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--address-file", required=True)
    parser.add_argument("--no-shm", action="store_true")
    args = parser.parse_args(argv)
    from specsplit.tools.launcher import die_with_launcher

    die_with_launcher()
    asyncio.run(_serve_stub(args.kind, args.listen, args.address_file, not args.no_shm))


if __name__ == "__main__":
    main(sys.argv[1:])
