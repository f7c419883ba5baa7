"""`specsplit bench --round-overhead`: what a round costs beyond the models. The real gateway and the
real draft and verify servers (gRPC, worker thread, fast path, shared memory) run with a verifier
and a drafter that cost nothing: the drafter proposes gamma copies of one token and the verifier
accepts them all. Every figure is a round's overhead as specsplit.serving.roundtime defines it (round wall
time minus compute), for each way the gateway reaches the services."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import torch

from gateway.controller import p95
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.launcher import Stack, StackConfig, die_with_launcher

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

        self.description = DrafterDescription(name="stub", kind="stub")  # not "ngram": those stay in the verifier
        self.memory_bytes = 0
        self.thread_invariant = True

    def start(self, prompt: list[int]):
        from draft_service.drafters.base import DraftSession

        return DraftSession(prompt)

    def propose(self, session, gamma: int, budget: int = 0):
        from specsplit.speculation.drafting import Proposal

        return Proposal([TOKEN] * gamma, "stub")

    def end(self, session) -> None:
        pass


async def _serve_stub(kind: str, listen: str, address_file: str, shared_memory: bool) -> None:
    """The real servicer and server of `kind` around a stub model."""
    from transformers import AutoTokenizer

    from specsplit.model import catalog
    from specsplit.model.identity import tokenizer_fingerprint
    from specsplit.serving.server import serve
    from specsplit.serving.sessions import SessionTable
    from specsplit.serving.settings import ServerSettings
    from specsplit.serving.worker import ModelWorker

    settings = ServerSettings(listen=listen, address_file=address_file, shared_memory=shared_memory)
    worker, sessions = ModelWorker(kind), SessionTable(64, 600.0)
    if kind == "verify":
        from verify_service.engine import Target
        from verify_service.server import SERVICE_NAME, VerifierServicer, register

        tokenizer = AutoTokenizer.from_pretrained(catalog.resolve("default"), local_files_only=True)
        vocab = len(tokenizer)
        lm = SimpleNamespace(model_id="stub", vocab_size=vocab, fingerprint=tokenizer_fingerprint(tokenizer),
                             max_context=1 << 16, dtype=torch.bfloat16, device=torch.device("cpu"), exact=True,
                             eos_token_ids=[], param_bytes=0, model_fingerprint="", hidden_size=576,
                             tokenizer=tokenizer, native=None)
        servicer = VerifierServicer(lm, sessions, worker, shared_memory,
                                    Target(lm, new_sequence=lambda: _StubSequence(vocab)))
    else:
        from draft_service.server import SERVICE_NAME, DrafterServicer, register

        servicer = DrafterServicer({"stub": _StubDrafter()}, "stub", sessions, worker, shared_memory=shared_memory)
    fast = servicer.rounds.open_fast_path(kind, shared_memory)
    await serve(settings, SERVICE_NAME, lambda server: register(server, servicer), sessions=sessions, worker=worker,
                fast_path=fast)


class _StubStack(Stack):
    """The stub verify and draft services and the real gateway, as the launcher runs a stack."""

    def start(self, timeout_s: float = 120.0, draft_via=None) -> str:
        try:
            for name in ("verify", "draft"):
                self._spawn(name, [], entry=("specsplit.bench.roundoverhead", "serve", name))
            self._await(["verify", "draft"], timeout_s)
            self._spawn("gateway", ["--verify", self.addresses["verify"], "--draft", self.addresses["draft"],
                                    "--tokenizer", "default", "--predraft", "off"])
            self._await(["gateway"], timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.addresses["gateway"]


def measure(transport: str, shared_memory: bool, requests: int, tokens: int, gamma: int) -> dict:
    """Per-round overhead, network and gateway shares (ms) of spec-on requests through one stack."""
    with _StubStack(StackConfig(transport=transport, shared_memory=shared_memory)) as stack, \
            grpc.insecure_channel(stack.start()) as channel:
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
    return {"rounds": len(overhead), "median": statistics.median(overhead),
            "p95": p95(overhead), "network": statistics.median(network),
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


def hop_by_hop(config: StackConfig, prompts: list, tokens: int = 128, drafter: str = "hybrid") -> list:
    """A round's hops with the real model: `prompts` forced on with `drafter` (one the draft service
    drafts for: n-gram alone is the verifier's own, with no hop to take) through a stack of
    `config` whose processes mark each hop (specsplit.serving.hops); prints per transition between
    consecutive marks its median over the rounds that asked the drafter, and returns the rows."""
    from specsplit.bench.workload import Variant, request
    from specsplit.serving import hops

    with tempfile.TemporaryDirectory(prefix="specsplit-hops-") as tmp:
        prefix = str(Path(tmp) / "hops")
        os.environ[hops.ENV] = prefix  # the stack's processes inherit it
        try:
            with Stack(config) as stack, grpc.insecure_channel(stack.start()) as channel:
                stub = pb_grpc.GatewayStub(channel)
                stub.Generate(request(prompts[0], pb.SPECULATION_ON, 16, Variant(drafter)), timeout=600)  # warm-up
                since = time.perf_counter_ns()
                for p in prompts:
                    stub.Generate(request(p, pb.SPECULATION_ON, tokens, Variant(drafter)), timeout=600)
                until = time.perf_counter_ns()
                copies = [stub.Generate(request(p, pb.SPECULATION_ON, tokens, Variant("ngram")), timeout=600).stats
                          for p in prompts]
        finally:
            del os.environ[hops.ENV]
        rounds, rows = hops.table([m for m in hops.read(prefix, since) if m[0] < until])
    compute = {"verify.forward -> verify.forwarded": "model compute", "draft.work -> draft.worked": "drafting"}
    print(f"\nA round's hops with the real model ({config.target_model}, {config.quantize or config.dtype}, "
          f"forced {drafter}, co-located on the fast path): medians over {rounds} rounds that asked the drafter")
    print(f"{'hop':<48}{'median us':>10}")
    for hop, us, _ in rows:
        print(f"{hop:<48}{us:>10.1f}{f'   ({compute[hop]})' if hop in compute else ''}")
    total = sum(us for _, us, _ in rows)
    beyond = total - sum(us for hop, us, _ in rows if hop in compute)
    print(f"{'sum of medians':<48}{total:>10.1f}\n{'of which neither forward nor drafting':<48}{beyond:>10.1f}")
    print("drafting: the draft service's whole batch (session sync, the drafter, its answer built); "
          "verify.forwarded -> verify.worked: acceptance, commit and the answer built; a -> b across processes: "
          "the crossing, the receiver's wake-up included")
    per_forward = [(s.decode_ms - s.verify_ms) / s.forwards * 1e3 for s in copies if s.forwards]
    if per_forward:
        print(f"n-gram alone, drafted in the verifier (no draft service; a round is a chunk of up to 16 forwards): "
              f"{statistics.median(per_forward):.0f} us a forward beyond the forward itself (decode wall time - "
              f"verify compute, over {sum(s.forwards for s in copies)} forwards, median of {len(per_forward)} "
              f"requests), {statistics.median(s.mean_acceptance_length for s in copies):.2f} tokens a forward")
    return rows


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m specsplit.bench.roundoverhead")
    parser.add_argument("cmd", choices=["serve"])
    parser.add_argument("kind", choices=["verify", "draft"])
    parser.add_argument("--listen", required=True)
    parser.add_argument("--address-file", required=True)
    parser.add_argument("--threads", type=int, default=0)  # accepted as the launcher passes it; unused
    parser.add_argument("--no-shm", action="store_true")
    args = parser.parse_args(argv)
    die_with_launcher()
    asyncio.run(_serve_stub(args.kind, args.listen, args.address_file, not args.no_shm))


if __name__ == "__main__":
    main(sys.argv[1:])
