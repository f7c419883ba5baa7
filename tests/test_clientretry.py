"""The retry policy shipped for the gateway's clients (specsplit/data/gateway-service-config.json):
a Generate that meets UNAVAILABLE (a gateway restarting, no verify replica serving for a moment) is
retried with backoff and answered; other failures are not retried."""

from __future__ import annotations

import grpc
import pytest

from specsplit.api.gateway.v1 import gateway_pb2 as pb
from specsplit.api.gateway.v1 import gateway_pb2_grpc as pb_grpc
from specsplit.serving.server import gateway_client_options


class Flaky(pb_grpc.GatewayServicer):
    """UNAVAILABLE for the first `fail` calls, then an answer; INVALID_ARGUMENT for an empty text."""

    def __init__(self, fail: int):
        self.fail, self.calls = fail, 0

    async def Generate(self, request, context):
        self.calls += 1
        if not request.text:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no prompt")
        if self.calls <= self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "restarting")
        return pb.GenerateResponse(text="answered")


@pytest.mark.parametrize("fail, answered", [(2, True), (9, False)])
async def test_unavailable_is_retried_with_backoff_and_other_failures_are_not(fail, answered):
    flaky = Flaky(fail)
    server = grpc.aio.server()
    pb_grpc.add_GatewayServicer_to_server(flaky, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=gateway_client_options()) as channel:
            stub = pb_grpc.GatewayStub(channel)
            if answered:
                assert (await stub.Generate(pb.GenerateRequest(text="hi"), timeout=60)).text == "answered"
                assert flaky.calls == fail + 1
            else:  # at most 5 attempts, then the status itself
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Generate(pb.GenerateRequest(text="hi"), timeout=60)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE and flaky.calls == 5
            flaky.calls = 0
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Generate(pb.GenerateRequest(), timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and flaky.calls == 1
    finally:
        await server.stop(0)
