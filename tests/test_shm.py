"""The co-located fast path: shared-memory segments, the same-host proof, fallback to plain gRPC,
and cleanup (normal exit, session end, cancelled request, SIGKILL and restart)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from conftest import start_serve, stop_process, wait_for

from specsplit.api.common.v1 import common_pb2 as cpb
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.serving import shm


def _segments(d: Path) -> list[str]:
    return sorted(n for n in os.listdir(d) if not n.endswith((".lock", ".sock")))


def test_segment_is_private_bounded_and_round_trips(shm_dir):
    creator = shm.Creator()
    seg = creator.create("ab" * 16, row_bytes=96, budget=200_000, max_rows=1000)
    path = shm_dir / seg.name
    assert path.stat().st_mode & 0o777 == 0o600
    assert seg.ring_rows == (200_000 - shm.HEADER_BYTES - shm.SLOTS * shm.SLOT_BYTES) // 96
    mapped = shm.Segment.attach(seg.name)
    assert mapped.nonce == seg.nonce and len(seg.nonce) == 16
    # Feature rows by position, across the ring's end.
    data = os.urandom(96 * 5)
    start = seg.ring_rows - 2
    msg = shm.stash_features(seg, cpb.Features(start=start, rows=5, dim=24, dtype="float32", data=data))
    assert msg.in_shm and not msg.data
    assert shm.fetch_features(mapped, msg).data == data
    rows = seg.ring_rows + 1
    too_many = cpb.Features(start=0, rows=rows, dim=24, dtype="float32", data=b"\0" * 96 * rows)
    assert not shm.stash_features(seg, too_many).in_shm  # does not fit: stays inline
    # Proposals alternate between two slots, so one can be verified while the next is drafted.
    dists = [([1, 2, 3], [0.5, 0.25, 0.25]), ([7], [1.0])]
    first, second = mapped.write_proposal(dists), mapped.write_proposal(dists[:1])
    assert first[0] != second[0]
    assert seg.read_proposal(*first) == dists and seg.read_proposal(*second) == dists[:1]
    assert seg.proposal_prefix(*first, 1) == second[1]
    with pytest.raises(shm.ShmError):
        seg.read_proposal(first[0] - 8, 16)  # not inside a slot
    mapped.close()
    creator.close()
    assert os.listdir(shm_dir) == []


def test_attach_refuses_what_is_not_a_private_segment(shm_dir):
    for name in ("../etc/passwd", "specsplit-zz-00", "other"):
        with pytest.raises(shm.ShmError):
            shm.Segment.attach(name)
    assert shm.try_attach("specsplit-0123456789abcdef-00000000") is None  # not on this "host"
    creator = shm.Creator()
    seg = creator.create("cd" * 16, 0, 1 << 20, 0)
    os.chmod(shm_dir / seg.name, 0o644)
    with pytest.raises(PermissionError):
        shm.Segment.attach(seg.name)
    os.chmod(shm_dir / seg.name, 0o600)
    with pytest.raises(shm.ShmError):
        shm.Segment.attach(seg.name, max_bytes=1024)
    assert shm.try_attach(seg.name, enabled=False) is None
    creator.close()


def test_segments_of_a_killed_creator_are_reclaimed_and_a_live_ones_are_not(shm_dir):
    live = shm.Creator()
    kept = live.create("11" * 16, 0, 1 << 20, 0)
    child = subprocess.run([sys.executable, "-c", (
        "import os, signal\nfrom specsplit.serving import shm\nc = shm.Creator()\nc.create('22' * 16, 0, 1 << 20, 0)\n"
        "os.kill(os.getpid(), signal.SIGKILL)")], env=os.environ)
    assert child.returncode == -signal.SIGKILL
    assert len(_segments(shm_dir)) == 2
    reclaimed = shm.reclaim_stale()
    assert len(reclaimed) == 1 and reclaimed[0].endswith("22" * 16)
    assert _segments(shm_dir) == [kept.name]
    live.close()


# Three real service processes. The draft service may get its own SPECSPLIT_SHM_DIR: it then cannot
# see the gateway's segments, exactly like a service on another host.


class Services:
    def __init__(self, models, self_head, run_dir: Path, shm_dir: Path, draft_shm_dir: Path | None = None):
        self.run_dir, self.shm_dir = run_dir, shm_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}
        target = str(models["target"])
        self.args = {
            "verify": ["--target-model", target, "--dtype", "float32"],
            "draft": ["--target-model", target, "--draft-model", str(models["draft"]), "--draft-dtype", "float32",
                      "--self-head", str(self_head), "--default-drafter", "ngram"],
        }
        self.env = {"verify": shm_dir, "draft": draft_shm_dir or shm_dir, "gateway": shm_dir}
        try:
            self.start("verify")
            self.start("draft")
            self.args["gateway"] = ["--verify", self.addresses["verify"], "--draft", self.addresses["draft"],
                                    "--tokenizer", target]
            self.start("gateway")
        except BaseException:
            self.stop()  # the ones that started
            raise

    def start(self, name: str) -> None:
        (self.run_dir / f"{name}.address").unlink(missing_ok=True)
        env = {**os.environ, "SPECSPLIT_SHM_DIR": str(self.env[name])}
        self.procs[name], self.addresses[name] = start_serve(name, self.run_dir, [name, *self.args[name]], env)

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait(10)

    def mapped(self, name: str) -> list[str]:
        """Segments the service still maps (an unlinked segment keeps its memory while mapped)."""
        maps = Path(f"/proc/{self.procs[name].pid}/maps").read_text()
        return [line for line in maps.splitlines() if shm.PREFIX in line]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            stop_process(proc, 20)


def _request(prompt: str, drafter: str, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, max_new_tokens=kw.pop("max_new_tokens", 24), drafter=drafter, gamma=3,
                              speculation=kw.pop("speculation", pb.SPECULATION_ON),
                              stop=pb.StopConditions(ignore_eos=True), **kw)


REJECTION = pb.SamplingParams(temperature=0.9, seed=5, method=cpb.VERIFY_METHOD_REJECTION)


def _succeeds(gw) -> bool:
    try:
        return gw.Generate(_request("def add(a, b):", "self", max_new_tokens=4)).stats.shared_memory
    except grpc.RpcError:
        return False


def _poll(predicate, what: str):  # a hang guard, not a timing
    wait_for(predicate, what, 60)


def _released(services: Services, shm_dir: Path) -> None:
    """Every segment removed from the shm dir and unmapped by the verify and draft services."""
    _poll(lambda: _segments(shm_dir) == [], "no segment left in the shm dir")
    _poll(lambda: services.mapped("verify") == [] and services.mapped("draft") == [],
          "no segment still mapped by the verify or draft service")


@pytest.mark.parametrize("colocated", [True, False])
def test_shared_memory_is_used_only_when_both_ends_prove_the_same_host(models, self_head, tmp_path, shm_dir,
                                                                       colocated):
    other = None if colocated else tmp_path / "other-host-shm"
    if other is not None:
        other.mkdir()
    services = Services(models, self_head, tmp_path, shm_dir, other)
    try:
        with grpc.insecure_channel(services.addresses["gateway"]) as ch:
            gw = pb_grpc.GatewayStub(ch)
            for drafter, sampling in (("self", None), ("model", REJECTION), ("hybrid", REJECTION)):
                kw = {"sampling": sampling} if sampling else {}
                off = gw.Generate(_request("def add(a, b):", drafter, speculation=pb.SPECULATION_OFF, **kw))
                on = gw.Generate(_request("def add(a, b):", drafter, **kw))
                assert not off.stats.shared_memory
                assert on.stats.shared_memory is colocated, drafter
                if sampling is None or drafter == "self":
                    assert list(on.token_ids) == list(off.token_ids), drafter  # greedy: identical either way
                records = on.stats.round_records
                if drafter in ("self", "hybrid"):
                    assert all(r.feature_bytes > 0 for r in records)
                if sampling is not None:  # a model's or the head's drafts carry their q (a copy's is 1: none)
                    sampled = [r for r in records if r.drafted and r.draft_source in ("model", "self")]
                    assert all(r.proposal_bytes > 0 for r in sampled), drafter
                    assert sampled or drafter == "hybrid", drafter  # the hybrid may have chosen copies only
                assert on.stats.accepted_tokens <= on.stats.drafted_tokens
            # Rejection sampling is reproducible for a seed whichever path the payloads took.
            again = gw.Generate(_request("The quick brown fox", "model", sampling=REJECTION))
            assert again.stats.shared_memory is colocated
        _released(services, shm_dir)  # each removed when its session ended
    finally:
        services.stop()
    assert os.listdir(shm_dir) == []  # the gateway's lock file goes at exit too


def test_no_segment_outlives_a_cancel_or_a_sigkill(models, self_head, tmp_path, shm_dir):
    services = Services(models, self_head, tmp_path, shm_dir)
    try:
        ch = grpc.insecure_channel(services.addresses["gateway"])
        gw = pb_grpc.GatewayStub(ch)
        # A streaming request cancelled after its first chunk.
        stream = gw.GenerateStream(_request("Once upon a time", "self", max_new_tokens=200))
        next(stream)
        assert len(_segments(shm_dir)) == 1
        stream.cancel()
        _released(services, shm_dir)

        # The verify service killed mid-request and started again (same socket path): the request
        # resumes there, mapping the same segment, which goes in a background release after its answer.
        future = gw.Generate.future(_request("Once upon a time", "self", max_new_tokens=400))
        _poll(lambda: len(_segments(shm_dir)) == 1, "the request's one segment")
        services.kill("verify")
        services.start("verify")
        assert future.result(120).stats.resumes == 1
        _poll(lambda: _segments(shm_dir) == [], "no segment left in the shm dir")
        _poll(lambda: _succeeds(gw), "a request over shared memory succeeding again")
        # the probe's own segment goes in its background release
        _poll(lambda: _segments(shm_dir) == [], "no segment left in the shm dir")

        # The gateway killed mid-request: its segment and lock are left behind until something starts.
        future = gw.Generate.future(_request("Once upon a time", "self", max_new_tokens=400))
        _poll(lambda: len(_segments(shm_dir)) == 1, "the request's one segment")
        services.kill("gateway")
        with pytest.raises(grpc.RpcError) as killed:
            future.result(60)
        assert killed.value.code() == grpc.StatusCode.UNAVAILABLE  # the gateway's death, not a refusal
        ch.close()
        assert len(_segments(shm_dir)) == 1
        services.start("gateway")
        assert _segments(shm_dir) == []  # reclaimed on start
        with grpc.insecure_channel(services.addresses["gateway"]) as ch2:
            ok = pb_grpc.GatewayStub(ch2).Generate(_request("def add(a, b):", "self"))
            assert ok.stats.shared_memory
        _poll(lambda: _segments(shm_dir) == [], "no segment left in the shm dir")
    finally:
        services.stop()
    assert os.listdir(shm_dir) == []


@pytest.fixture
def full_shm_dir(monkeypatch):
    """A tmpfs of 1 MiB, filled: a full /dev/shm (mounting one needs root, as CI runs)."""
    d = Path(tempfile.mkdtemp(prefix="full-", dir="/tmp"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True)
    if mounted.returncode != 0:
        d.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        fd = os.open(d / "ballast", os.O_WRONLY | os.O_CREAT)
        try:
            for _ in range(257):  # 1 MiB in pages, and one more: it cannot all fit
                os.write(fd, b"\0" * 4096)
            raise AssertionError("1 MiB and a page written to a 1 MiB tmpfs")
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        monkeypatch.setenv("SPECSPLIT_SHM_DIR", str(d))
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
        shutil.rmtree(d, ignore_errors=True)


def test_a_full_dev_shm_falls_back_to_grpc(models, self_head, tmp_path, full_shm_dir):
    # ftruncate accepts a segment on a full tmpfs; its first write then faults with SIGBUS. The
    # segment's pages are reserved at creation instead, so the gateway sees the failure there and
    # runs the session over gRPC: same answer, no shared memory, nothing left behind.
    services = Services(models, self_head, tmp_path, full_shm_dir)
    try:
        with grpc.insecure_channel(services.addresses["gateway"]) as ch:
            gw = pb_grpc.GatewayStub(ch)
            for drafter in ("self", "model"):
                off = gw.Generate(_request("def add(a, b):", drafter, speculation=pb.SPECULATION_OFF), timeout=120)
                on = gw.Generate(_request("def add(a, b):", drafter), timeout=120)
                assert list(on.token_ids) == list(off.token_ids), drafter
                assert on.stats.speculation_used and not on.stats.shared_memory
            assert all(p.poll() is None for p in services.procs.values())  # nobody died of SIGBUS
        assert _segments(full_shm_dir) == ["ballast"]
        assert "no shared memory for session" in (tmp_path / "gateway.log").read_text()
    finally:
        services.stop()


def test_a_stopped_stack_leaves_nothing_in_dev_shm_after_its_services_were_killed(models, tmp_path, shm_dir):
    """`up`'s stop sweeps what SIGKILLed services left (segments, locks, fast-path sockets); files of
    live processes stay."""
    import socket as sockets

    from specsplit.launcher import Stack, StackConfig

    live = shm.Creator()  # a live gateway's segment and lock (this process holds the lock)
    kept = live.create("33" * 16, 0, 1 << 20, 0)
    listening = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)  # a live service's fast path
    listening.bind(str(shm_dir / f"specsplit-fast-{os.getpid()}-live.sock"))
    listening.listen()
    ours = set(os.listdir(shm_dir))
    stack = Stack(StackConfig(target_model=str(models["target"]), draft_model=str(models["draft"]), dtype="float32",
                              draft_dtype="float32", drafter="ngram", self_head="none", run_dir=str(tmp_path / "up")))
    try:
        with grpc.insecure_channel(stack.start()) as ch:
            stream = pb_grpc.GatewayStub(ch).GenerateStream(_request("def add(a, b):", "ngram", max_new_tokens=200))
            next(stream)
            left = set(os.listdir(shm_dir)) - ours
            assert any(n.startswith("specsplit-fast-") for n in left) and _segments(shm_dir) != sorted(ours)
            for name in ("gateway", "draft", "verify"):
                stack.procs[name].kill()
                stack.procs[name].wait(10)
            assert set(os.listdir(shm_dir)) - ours  # the dead left their files behind
    finally:
        stack.stop()
    assert set(os.listdir(shm_dir)) == ours  # theirs swept, the live ones kept
    listening.close()
    live.remove(kept)
    live.close()
