"""Several verify replicas behind one gateway: each session stays on the replica holding its KV
cache, new sessions spread by load, and a replica going away leaves the others serving."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

import grpc
import pytest
from conftest import service_address, until
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.replicas import RESOLVE_EVERY_S, Replicas, resolve
from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.errors import Failure
from specsplit.serving.settings import DraftSettings, GatewaySettings, ModelSettings, ServerSettings, VerifySettings
from verify_service.server import VerifierServicer


def fake_dns(table: dict[str, list[str]]):
    def lookup(host, port, type=0):
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, type, 6, "", (ip, port)) for ip in table[host]]
    return lookup


def test_resolve_expands_dns_names_and_keeps_plain_addresses():
    lookup = fake_dns({"verify": ["10.0.0.2", "10.0.0.1", "10.0.0.2"], "v6": ["fd00::1"]})
    assert resolve("dns:///verify:50051", lookup) == ["10.0.0.1:50051", "10.0.0.2:50051"]
    assert resolve("unix:///a.sock, host:1,dns:///v6:7", lookup) == ["unix:///a.sock", "host:1", "[fd00::1]:7"]
    with pytest.raises(ValueError, match="dns:///NAME:PORT"):
        resolve("dns:///verify", lookup)


async def test_replicas_follow_dns_and_pick_the_least_loaded_serving_one():
    table = {"verify": ["10.0.0.1", "10.0.0.2"]}
    clock = [0.0]
    replicas = Replicas("verify", "dns:///verify:50051", None, lookup=fake_dns(table), clock=lambda: clock[0])
    assert not replicas.replicas  # resolved on the first refresh
    await replicas.refresh()
    a, b = replicas.replicas["10.0.0.1:50051"], replicas.replicas["10.0.0.2:50051"]
    with pytest.raises(Failure) as e:
        replicas.pick()  # neither has answered a health check yet
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "no replica" in e.value.message
    a.serving = b.serving = True
    a.sessions = 2
    assert replicas.pick() is b
    b.sessions = 3
    assert replicas.pick() is a
    table["verify"] = ["10.0.0.1"]  # b's pod went away: no new sessions, dropped once its sessions end
    await replicas.refresh()
    assert not b.gone  # DNS is asked at most every RESOLVE_EVERY_S, not on every health check
    clock[0] += RESOLVE_EVERY_S
    await replicas.refresh()
    assert b.gone and replicas.pick() is a and "10.0.0.2:50051" in replicas.replicas
    b.sessions = 0
    await replicas.refresh()
    assert list(replicas.replicas) == ["10.0.0.1:50051"]
    a.serving = False
    assert not replicas.serving
    await replicas.close()


async def test_connecting_waits_for_dns_to_list_a_replica_then_says_what_is_missing():
    table = {"draft": []}  # the gateway started before any draft pod is ready
    clock = [0.0]

    async def later():
        await asyncio.sleep(0.05)
        table["draft"] = ["10.0.0.7"]

    replicas = Replicas("draft", "dns:///draft:50052", None, lookup=fake_dns(table), clock=lambda: clock[0])
    task = asyncio.ensure_future(later())
    first = await replicas.first(timeout_s=5, every_s=0.01)
    await task
    assert first.address == "10.0.0.7:50052" and first.watch is not None  # a draft replica is watched
    empty = Replicas("verify", "dns:///verify:50051", None, lookup=fake_dns({"verify": []}), clock=lambda: clock[0])
    with pytest.raises(RuntimeError, match="verify service: dns:///verify:50051 resolved to no address"):
        clock[0] = 0.0
        waiting = asyncio.ensure_future(empty.first(timeout_s=1, every_s=0.01))
        await asyncio.sleep(0.05)
        clock[0] = 2.0  # past the timeout
        await waiting
    await replicas.close()
    await empty.close()


async def _stack(models, tmp_path, monkeypatch, verify: tuple[str, ...], draft: tuple[str, ...],
                 draft_kw: dict[str, dict] | None = None, verify_models: dict[str, str] | None = None):
    """Verify and draft services (one process each, by name; draft_kw: DraftSettings by name) and a
    gateway told about all of them; yields (gateway address, stop events by name, tasks by name,
    sessions started per replica of each service)."""
    from draft_service.main import run as run_draft
    from draft_service.server import DrafterServicer
    from gateway.main import run as run_gateway
    from verify_service.main import run as run_verify

    started = {"verify": Counter(), "draft": Counter()}  # sessions started, per replica (its session table)

    def counting(cls, method: str, counter: Counter) -> None:
        original = getattr(cls, method)

        async def counted(self, request, context):
            response = await original(self, request, context)
            counter[id(self._sessions)] += 1
            return response
        monkeypatch.setattr(cls, method, counted)

    counting(VerifierServicer, "Prefill", started["verify"])
    counting(DrafterServicer, "StartSession", started["draft"])
    pools: dict[str, Replicas] = {}  # the gateway's replica sets, by service
    made = Replicas.__init__

    def recorded(self, service, *args, **kw):
        made(self, service, *args, **kw)
        pools[service] = self
    monkeypatch.setattr(Replicas, "__init__", recorded)

    def server(name: str) -> ServerSettings:
        return ServerSettings(listen=f"unix://{tmp_path / f'{name}.sock'}", address_file=str(tmp_path / f"{name}.a"),
                              grace_s=0.5, drain_s=1.0)

    async def address(name: str, task: asyncio.Task) -> str:
        return await service_address(tmp_path / f"{name}.a", task, name)

    stops = {name: asyncio.Event() for name in (*verify, *draft, "gateway")}
    def model(name: str) -> ModelSettings:  # verify_models: another model for some replicas
        return ModelSettings(str(models[(verify_models or {}).get(name, "target")]), "float32")

    tasks = {name: asyncio.create_task(run_verify(VerifySettings(server(name), model(name)), stops[name],
                                                  handle_signals=False)) for name in verify}
    # A draft model: n-gram drafts are the verifier's own and take no draft session.
    drafting = ModelSettings(str(models["draft"]), "float32", exact=False)
    tasks |= {name: asyncio.create_task(run_draft(DraftSettings(server(name), drafting, default_drafter="model",
                                                                **(draft_kw or {}).get(name, {})),
                                                  stops[name], handle_signals=False)) for name in draft}
    try:
        verify_at = [await address(n, tasks[n]) for n in verify]
        draft_at = [await address(n, tasks[n]) for n in draft]
        settings = GatewaySettings(server("gateway"), ",".join(verify_at), ",".join(draft_at),
                                   tokenizer=str(models["target"]), connect_timeout_s=10, tree_budget=0)
        tasks["gateway"] = asyncio.create_task(run_gateway(settings, stops["gateway"], handle_signals=False))
        addresses = dict(zip((*verify, *draft), (*verify_at, *draft_at)))

        async def seen_down(name: str) -> None:
            """Until the gateway's health checks have marked replica `name` unavailable."""
            pool = pools["verify" if name in verify else "draft"]
            await until(lambda: not pool.replicas[addresses[name]].available,
                        f"the gateway's health checks marking {name} unavailable", 30)

        yield await address("gateway", tasks["gateway"]), stops, tasks, started, seen_down
    finally:
        for stop in stops.values():
            stop.set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


@pytest.fixture
async def two_replicas(models, tmp_path, monkeypatch):
    """Two verify services, one draft service."""
    async for stack in _stack(models, tmp_path, monkeypatch, ("v1", "v2"), ("d1",)):
        yield stack


@pytest.fixture
async def two_drafters(models, tmp_path, monkeypatch):
    """One verify service, two draft services."""
    async for stack in _stack(models, tmp_path, monkeypatch, ("v1",), ("d1", "d2")):
        yield stack


async def test_sessions_spread_stay_put_and_survive_a_replica_going_away(two_replicas):
    gateway, stops, tasks, started, seen_down = two_replicas
    prefills = started["verify"]
    request = pb.GenerateRequest(text="def add(a, b):", max_new_tokens=24, speculation=pb.SPECULATION_ON,
                                 drafter="ngram", stop=pb.StopConditions(ignore_eos=True))
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = pb_grpc.GatewayStub(channel)
        off = await stub.Generate(pb.GenerateRequest(text=request.text, max_new_tokens=24, stop=request.stop,
                                                     speculation=pb.SPECULATION_OFF), timeout=60)
        answers = await asyncio.gather(*(stub.Generate(request, timeout=120) for _ in range(8)))
        # Every round of a session went to the replica that prefilled it (a round sent elsewhere would
        # find no session and fail), and the answers are exact.
        assert all(list(a.token_ids) == list(off.token_ids) and a.stats.rounds > 1 for a in answers)
        assert len(prefills) == 2 and min(prefills.values()) >= 3, prefills  # spread by load over both
        # One replica goes away: the gateway keeps serving on the other.
        stops["v2"].set()
        await tasks["v2"]
        await seen_down("v2")
        health = health_pb2_grpc.HealthStub(channel)
        assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
            health_pb2.HealthCheckResponse.SERVING
        before = dict(prefills)
        again = await asyncio.gather(*(stub.Generate(request, timeout=120) for _ in range(4)))
        assert all(list(a.token_ids) == list(off.token_ids) for a in again)
        grown = {k: prefills[k] - before.get(k, 0) for k in prefills}
        assert sorted(grown.values()) == [0, 4]  # all on the replica that is left


async def test_draft_sessions_spread_stay_put_and_a_lost_drafter_costs_drafts_not_answers(two_drafters, monkeypatch):
    gateway, stops, tasks, started, seen_down = two_drafters
    # The controller's load is the requests in flight now, not their mean over the last seconds: the
    # last AUTO request's reason must not depend on how fast the machine got there after the four
    # concurrent ones (on a busy machine it read "concurrency")
    from gateway.load import InFlight
    monkeypatch.setattr(InFlight, "others", lambda self: self.now)
    request = pb.GenerateRequest(text="def add(a, b):\n    return a + b\n\ndef add(a, b):", max_new_tokens=24,
                                 speculation=pb.SPECULATION_ON, drafter="model",
                                 stop=pb.StopConditions(ignore_eos=True))
    async with grpc.aio.insecure_channel(gateway) as channel:
        stub = pb_grpc.GatewayStub(channel)
        off = await stub.Generate(pb.GenerateRequest(text=request.text, max_new_tokens=24, stop=request.stop,
                                                     speculation=pb.SPECULATION_OFF), timeout=60)
        assert started["draft"] == Counter()  # spec-off takes no draft session
        answers = await asyncio.gather(*(stub.Generate(request, timeout=120) for _ in range(8)))
        # Every Propose went to the replica that started the session: one sent elsewhere would find no
        # session there and cost the request its drafts (speculation_reason drafter-lost).
        assert all(list(a.token_ids) == list(off.token_ids) for a in answers)
        assert all(a.stats.speculation_used and a.stats.speculation_reason != "drafter-lost" and
                   a.stats.accepted_tokens > 0 for a in answers), [a.stats.speculation_reason for a in answers]
        draft = started["draft"]
        assert len(draft) == 2 and min(draft.values()) >= 3, draft  # spread by load over both
        # One draft replica goes away: speculation goes on with the other, and no answer changes.
        stops["d2"].set()
        await tasks["d2"]
        await seen_down("d2")
        before = dict(draft)
        again = await asyncio.gather(*(stub.Generate(request, timeout=120) for _ in range(4)))
        assert all(list(a.token_ids) == list(off.token_ids) and a.stats.speculation_used and
                   a.stats.accepted_tokens > 0 for a in again)
        grown = {k: draft[k] - before.get(k, 0) for k in draft}
        assert sorted(grown.values()) == [0, 4]  # all on the replica that is left
        # The last one goes too: ON is refused with the reason, AUTO runs without drafts, same answer.
        stops["d1"].set()
        await tasks["d1"]
        await seen_down("d1")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Generate(request, timeout=60)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "draft service" in refused.value.details()
        auto = pb.GenerateRequest()
        auto.CopyFrom(request)
        auto.speculation = pb.SPECULATION_AUTO
        alone = await stub.Generate(auto, timeout=60)
        assert list(alone.token_ids) == list(off.token_ids) and not alone.stats.speculation_used
        assert alone.stats.speculation_reason == "drafter-down"


async def test_a_draft_replica_that_refuses_a_start_leaves_the_session_to_another(models, tmp_path, monkeypatch):
    from specsplit.api.draft.v1 import draft_pb2 as dpb
    from specsplit.api.draft.v1 import draft_pb2_grpc as dpb_grpc

    async for gateway, _, _, started, _ in _stack(models, tmp_path, monkeypatch, ("v1",), ("d1", "d2"),
                                               {"d1": {"max_sessions": 2}}):
        # Forced on: every round asks the drafter (an AUTO request's gate may stop asking a random model's).
        request = pb.GenerateRequest(text="def add(a, b):\n    return a + b\n\ndef add(a, b):", max_new_tokens=24,
                                     drafter="model", stop=pb.StopConditions(ignore_eos=True),
                                     speculation=pb.SPECULATION_ON)
        async with grpc.aio.insecure_channel(gateway) as g, \
                grpc.aio.insecure_channel((tmp_path / "d1.a").read_text().strip()) as d:
            stub, d1 = pb_grpc.GatewayStub(g), dpb_grpc.DrafterStub(d)
            off = pb.GenerateRequest()
            off.CopyFrom(request)
            off.speculation = pb.SPECULATION_OFF
            reference = await stub.Generate(off, timeout=60)
            # d1's table is filled behind the gateway's back: to the gateway both replicas look idle,
            # so the first session goes to d1 (the first listed), which refuses it.
            for i in range(2):
                await d1.StartSession(dpb.StartSessionRequest(session_id=f"fill{i}", prompt_token_ids=[1, 2]))
            answers = await asyncio.gather(*(stub.Generate(request, timeout=60) for _ in range(4)))
            assert all(list(a.token_ids) == list(reference.token_ids) for a in answers)
            assert all(a.stats.speculation_used and a.stats.speculation_reason != "drafter-full" and
                       a.stats.accepted_tokens > 0 for a in answers), [a.stats.speculation_reason for a in answers]
            assert sorted(started["draft"].values()) == [2, 4]  # d1: only the fills; d2: every request
            for i in range(2):
                await d1.EndSession(dpb.EndSessionRequest(session_id=f"fill{i}"))
            again = await stub.Generate(request, timeout=60)  # room is back on d1, and it was never "down"
            assert again.stats.speculation_used and sorted(started["draft"].values()) == [3, 4]


async def test_a_verify_replica_serving_other_weights_gets_no_sessions(models, tmp_path, monkeypatch):
    """v2 serves the draft model's weights (same tokenizer, other fingerprint): the gateway keeps it out
    of rotation, every session goes to v1, and the answers are v1's."""
    async for gateway, _, _, started, _ in _stack(models, tmp_path, monkeypatch, ("v1", "v2"), ("d1",),
                                               verify_models={"v2": "draft"}):
        request = pb.GenerateRequest(text="def add(a, b):", max_new_tokens=12, speculation=pb.SPECULATION_OFF,
                                     stop=pb.StopConditions(ignore_eos=True))
        async with grpc.aio.insecure_channel(gateway) as channel:
            stub = pb_grpc.GatewayStub(channel)
            answers = [await stub.Generate(request) for _ in range(6)]
        assert len({tuple(a.token_ids) for a in answers}) == 1
        assert sorted(started["verify"].values()) == [6]  # one replica's session table took them all
