import grpc
import pytest

from gateway.upstream import Deadline, Upstream
from specsplit.errors import Failure


def failing(code: grpc.StatusCode):
    async def method(request, timeout):
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="boom")
    return method


@pytest.mark.parametrize("backend_code,client_code", [
    (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED),  # the backend lost the session
    (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
    (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.FAILED_PRECONDITION),
])
async def test_backend_errors_keep_an_actionable_code_and_name_the_service(backend_code, client_code):
    with pytest.raises(Failure) as err:
        await Upstream().call(failing(backend_code), object(), "verify", Deadline(lambda: None, 1.0))
    assert err.value.code == client_code
    assert str(err.value) == "verify service: boom"


async def test_internal_deadline_is_bounded_by_the_clients():
    seen = []

    async def method(request, timeout):
        seen.append(timeout)

    up = Upstream()
    for remaining in (0.5, None, 120.0):
        await up.call(method, object(), "draft", Deadline(lambda r=remaining: r, 60.0))
    assert seen == [0.5, 60.0, 60.0]
