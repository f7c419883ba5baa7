"""Services dying under a real `specsplit up` (three processes, supervised) and behind a gateway of
two verify replicas: a drafter killed or stalled mid-request costs the request its drafts, never its
answer; a killed verifier costs its requests a restart (or a move to the other replica), never their
answers; the gateway's health says what is down meanwhile."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from conftest import free_ports, spawn_up, start_serve, stop_process, wait_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specsplit.api.draft.v1 import draft_pb2 as dpb
from specsplit.api.draft.v1 import draft_pb2_grpc as dpb_grpc
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc

PROMPT = "Repeat after me: speculation must never change the output."


@dataclass
class Up:
    proc: subprocess.Popen
    run_dir: Path
    gateway: str
    metrics_port: int  # the gateway's; the verify service's is the next, the draft service's the one after

    def pid(self, name: str) -> int:
        found = subprocess.run(["pgrep", "-f", "--", f"--address-file {self.run_dir / name}.address"],
                               capture_output=True, text=True).stdout.split()
        assert len(found) == 1, (name, found)
        return int(found[0])

    def address(self, name: str) -> str:
        return (self.run_dir / f"{name}.address").read_text().strip()

    def log(self) -> str:
        return (self.run_dir / "up.err").read_text()


@pytest.fixture
def up(models, tmp_path):
    """A stack of its own for each test: the tests kill and stop its processes."""
    err = open(tmp_path / "up.err", "w")
    metrics = free_ports(3)
    proc, gateway = spawn_up(tmp_path, [
        # a context of 8,192: streams long enough to be cut mid-way; a draft model (n-gram drafts are
        # the verifier's own: its faults are the verifier's)
        "--target-model", str(models["long"]), "--self-head", "none", "--drafter", "model",
        "--draft-model", str(models["draft"]), "--draft-dtype", "float32",
        "--dtype", "float32", "--tree-budget", "0", "--metrics-port", str(metrics)], stderr=err)
    try:
        yield Up(proc, tmp_path, gateway, metrics)
    finally:
        proc.send_signal(signal.SIGINT)
        stop_process(proc, 30)
        err.close()


def _request(speculation=pb.SPECULATION_ON, tokens: int = 200) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, max_new_tokens=tokens, speculation=speculation, gamma=4,
                              stop=pb.StopConditions(ignore_eos=True))


def _stream(stub, request, after_chunks: int = 0, act=lambda: None, timeout: float = 30.0):
    """(token ids, the final stats) of a streamed request; `act` runs after `after_chunks` chunks."""
    ids, stats = [], None
    for i, chunk in enumerate(stub.GenerateStream(request, timeout=timeout)):
        ids += chunk.token_ids
        if chunk.HasField("stats"):
            stats = chunk.stats
        if i + 1 == after_chunks:
            act()
    return ids, stats


def _until(check, what: str, timeout_s: float = 90.0, every_s: float = 0.2):
    """`check()` true (an RPC error counts as not yet), else the test fails naming `what`."""
    return wait_for(check, what, timeout_s, every_s, not_yet=(grpc.RpcError,))


def _speculates(stub) -> bool:
    """A forced spec-on request runs with drafts again (UNAVAILABLE while the drafter is down)."""
    stats = stub.Generate(_request(tokens=24), timeout=30).stats
    return stats.speculation_used and stats.speculation_reason != "drafter-lost"


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=5).status


def test_a_drafter_killed_or_stalled_mid_request_costs_drafts_not_the_answer(up):
    with grpc.insecure_channel(up.gateway) as channel:
        stub = pb_grpc.GatewayStub(channel)
        reference, off = _stream(stub, _request(pb.SPECULATION_OFF))
        assert not off.speculation_used
        _stream(stub, _request())  # a warm drafter: its Propose budget now follows measured times

        first_pid = up.pid("draft")
        ids, stats = _stream(stub, _request(), 3, lambda: os.kill(first_pid, signal.SIGKILL))
        assert ids == reference  # greedy: target-only rounds are spec-off decoding
        assert stats.speculation_reason == "drafter-lost" and stats.speculation_used
        assert not stats.round_records[-1].drafted
        # AUTO requests meanwhile run without it; the supervisor restarts it and speculation resumes.
        auto = stub.Generate(_request(pb.SPECULATION_AUTO, 24), timeout=30)
        assert auto.token_ids == reference[:24]
        _until(lambda: _speculates(stub), "speculation back with a restarted drafter")
        assert up.pid("draft") != first_pid
        assert "draft service exited with -9; restarting it" in up.log()

        _stream(stub, _request())  # warm again (a new process)
        stalled = up.pid("draft")
        try:
            ids, stats = _stream(stub, _request(), 3, lambda: os.kill(stalled, signal.SIGSTOP))
            assert ids == reference and stats.speculation_reason == "drafter-lost"
            assert _health(up.gateway) == health_pb2.HealthCheckResponse.SERVING
            _until(lambda: _health(up.gateway, "specsplit.draft.v1.Drafter")
                   == health_pb2.HealthCheckResponse.NOT_SERVING, "the gateway's health: drafter NOT_SERVING")
        finally:
            os.kill(stalled, signal.SIGCONT)
        _until(lambda: _speculates(stub), "speculation back with a restarted drafter")
        # The stalled drafter ended the sessions it was given; nothing is left open there.
        with grpc.insecure_channel(up.address("draft")) as draft:
            _until(lambda: dpb_grpc.DrafterStub(draft).Info(dpb.InfoRequest(), timeout=5).active_sessions == 0,
                   "the draft service ending every session")


def test_a_verifier_killed_mid_stream_costs_its_streams_a_restart_not_their_answers(up):
    """The one verify process under `up` SIGKILLed while three streams decode (spec-on, AUTO and
    spec-off): each waits for the supervisor's restart, is re-opened there with what it committed,
    and ends with the spec-off answer, no token sent twice or skipped. Health says NOT_SERVING while
    it is down; the draft service lost no session; requests after it are served by the new process."""
    import threading

    with grpc.insecure_channel(up.gateway) as channel:
        stub = pb_grpc.GatewayStub(channel)
        reference = stub.Generate(_request(pb.SPECULATION_OFF, 1200), timeout=120).token_ids
        verify_pid = up.pid("verify")
        started, results = threading.Barrier(3, action=lambda: os.kill(verify_pid, signal.SIGKILL)), {}

        def run(speculation) -> None:  # the kill comes once every stream has sent its first chunk
            results[speculation] = _stream(stub, _request(speculation, 1200), 1, started.wait, timeout=180)

        streams = [threading.Thread(target=run, args=(s,)) for s in
                   (pb.SPECULATION_ON, pb.SPECULATION_AUTO, pb.SPECULATION_OFF)]
        for t in streams:
            t.start()
        _until(lambda: _health(up.gateway) == health_pb2.HealthCheckResponse.NOT_SERVING,
               "the gateway's health: NOT_SERVING while the verifier is down", 30, every_s=0.05)
        for t in streams:
            t.join(180)
        assert len(results) == 3
        for speculation, (ids, stats) in results.items():
            assert ids == list(reference), speculation
        resumed = [stats for _, stats in results.values() if stats.resumes]
        assert resumed and all(s.resume_ms > 0 for s in resumed)
        print("resumed after the kill:", [(s.resumes, round(s.resume_ms)) for s in resumed])
        with grpc.insecure_channel(up.address("draft")) as draft:
            _until(lambda: dpb_grpc.DrafterStub(draft).Info(dpb.InfoRequest(), timeout=5).active_sessions == 0,
                   "the draft service ending every session", 10)
        _until(lambda: _health(up.gateway) == health_pb2.HealthCheckResponse.SERVING, "the gateway's health: SERVING")
        assert _health(up.gateway, "specsplit.verify.v1.Verifier") == health_pb2.HealthCheckResponse.SERVING
        again = stub.Generate(_request(pb.SPECULATION_ON, 64), timeout=30)
        assert again.token_ids == reference[:64] and up.pid("verify") != verify_pid
        assert "verify service exited with -9; restarting it" in up.log()


def test_up_serves_each_services_metrics_on_its_own_port(up, capsys):
    with grpc.insecure_channel(up.gateway) as channel:
        pb_grpc.GatewayStub(channel).Generate(_request(tokens=16), timeout=30)
    from specsplit.cli import main

    assert main(["health", up.gateway]) == 0 and capsys.readouterr().out.strip().endswith(": SERVING")

    def scrape(offset: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{up.metrics_port + offset}/metrics", timeout=10) as r:
            return r.read().decode()

    gateway, verify = scrape(0), scrape(1)
    assert 'specsplit_request_duration' in gateway and 'speculation="on"' in gateway
    assert "specsplit_spec_decode_accepted_tokens" in gateway and "specsplit_request_time_to_first_token" in gateway
    assert "specsplit_verify_forward_seconds_count" in verify and 'call="prefill"' in verify
    assert re.search(r"specsplit_verify_threads\{[^}]*\} [1-9]\d*\.0", verify)  # the team size now
    # Each backend replica the gateway pins sessions to is gauged: here one of each, both available.
    for service in ("verify", "draft"):
        assert re.search(r'specsplit_replica_available\{[^}]*service="%s"[^}]*\} 1\.0' % service, gateway), service
        assert re.search(r'specsplit_replica_sessions\{[^}]*service="%s"' % service, gateway), service
    draft = scrape(2)
    assert "specsplit_draft_memory" in draft and re.search(r"specsplit_draft_sessions_limit\{[^}]*\} 64\.0", draft)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_verify_replica_killed_or_drained_mid_round_loses_no_request(models, tmp_path, how):
    """Two verify replicas behind one gateway, each serving some of eight streams; one is SIGKILLed
    (or SIGTERMed: it drains) while they decode. Every stream finishes with the exact answer, no
    token sent twice or skipped: a killed replica's sessions resume on the survivor (once each),
    a draining one's finish where they are or resume; the survivor ends with no session left; new
    requests go there at once, whether or not the gateway's health checks saw the replica go."""
    from specsplit.api.verify.v1 import verify_pb2 as vpb
    from specsplit.api.verify.v1 import verify_pb2_grpc as vpb_grpc
    target = str(models["long"])  # a context of 8,192: streams long enough to be cut mid-way
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, *args: str) -> str:
        procs[name], address = start_serve(name, tmp_path, list(args))
        return address

    try:
        v1 = start("v1", "verify", "--target-model", target, "--dtype", "float32")
        v2 = start("v2", "verify", "--target-model", target, "--dtype", "float32")
        draft = start("draft", "draft", "--self-head", "none", "--default-drafter", "ngram")
        gateway = start("gateway", "gateway", "--verify", f"{v1},{v2}", "--draft", draft, "--tokenizer", target)
        request = pb.GenerateRequest(text="def add(a, b):", max_new_tokens=1200, speculation=pb.SPECULATION_ON,
                                     stop=pb.StopConditions(ignore_eos=True))
        with grpc.insecure_channel(gateway) as channel:
            stub = pb_grpc.GatewayStub(channel)
            off = stub.Generate(pb.GenerateRequest(text=request.text, max_new_tokens=1200, stop=request.stop,
                                                   speculation=pb.SPECULATION_OFF), timeout=300)
            streams = [stub.GenerateStream(request, timeout=300) for _ in range(8)]
            firsts = [next(s) for s in streams]  # every session is decoding
            with grpc.insecure_channel(v2) as ch:
                on_v2 = vpb_grpc.VerifierStub(ch).Info(vpb.InfoRequest(), timeout=10).active_sessions
            assert 0 < on_v2 < 8, on_v2  # spread over both replicas
            procs["v2"].send_signal(getattr(signal, how))
            outputs, resumes = [], 0
            for first, stream in zip(firsts, streams):
                ids = list(first.token_ids)
                for chunk in stream:
                    ids += chunk.token_ids
                    resumes += chunk.stats.resumes if chunk.HasField("stats") else 0
                outputs.append(ids)
            assert all(ids == list(off.token_ids) for ids in outputs)
            if how == "SIGKILL":
                assert resumes == on_v2, (resumes, on_v2)  # each of its sessions, once
            else:
                assert procs["v2"].wait(60) == 0 and "draining" in (tmp_path / "v2.log").read_text()
            with grpc.insecure_channel(v1) as ch:
                info = vpb_grpc.VerifierStub(ch).Info
                _until(lambda: info(vpb.InfoRequest(), timeout=10).active_sessions == 0,
                       "the survivor releasing every session")  # nothing leaked
            short = pb.GenerateRequest(text=request.text, max_new_tokens=16, speculation=pb.SPECULATION_ON,
                                       stop=request.stop)
            again = [stub.Generate(short, timeout=60) for _ in range(3)]  # v2 is gone: they start on v1
            assert all(list(a.token_ids) == list(off.token_ids)[:16] for a in again)
    finally:
        for proc in procs.values():
            stop_process(proc, 20)
