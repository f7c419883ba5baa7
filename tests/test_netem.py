"""The delaying proxy: adds the configured round trip, keeps order, paces to a bandwidth cap."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from specsplit.bench.netem import DelayProxy


@pytest.fixture
def echo():
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        for _ in range(64):  # connections: no test opens more
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(65536), b"")],
                             daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


def _round_trip(sock: socket.socket, payload: bytes) -> tuple[float, bytes]:
    start = time.perf_counter()
    sock.sendall(payload)
    sock.settimeout(30)  # a lost byte fails here, named, instead of waiting on the per-test timeout
    got = b""
    for _ in payload:  # each read brings at least a byte
        if len(got) == len(payload):
            break
        chunk = sock.recv(65536)
        assert chunk, f"the proxy closed the connection after {len(got)} of {len(payload)} bytes"
        got += chunk
    return (time.perf_counter() - start) * 1e3, got


def test_round_trips_pay_the_rtt_in_order_and_the_rtt_can_change(echo):
    with DelayProxy(echo, rtt_ms=40) as proxy:
        host, port = proxy.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            slow = [_round_trip(sock, f"ping {i};".encode()) for i in range(3)]
            assert all(ms >= 40 for ms, _ in slow) and [g for _, g in slow] == [b"ping 0;", b"ping 1;", b"ping 2;"]
            proxy.set_rtt(150)  # applies to the open connection (only lower bounds: a loaded host is slower)
            assert _round_trip(sock, b"x")[0] >= 150
            burst = b"".join(f"{i:05d}".encode() for i in range(2000))  # many chunks: order preserved
            assert _round_trip(sock, burst)[1] == burst


def test_bandwidth_cap_paces_bulk_data(echo):
    with DelayProxy(echo, rtt_ms=0) as proxy:
        host, port = proxy.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            assert _round_trip(sock, b"z" * 100_000)[1] == b"z" * 100_000
            proxy.bandwidth = 1_000_000  # applies to the open connection
            ms, got = _round_trip(sock, b"z" * 100_000)  # 100 kB at 1 MB/s: >= 100 ms (directions overlap)
            assert ms >= 95 and got == b"z" * 100_000


def test_only_loopback():
    with pytest.raises(ValueError, match="loopback"):
        DelayProxy("10.0.0.1:50051")
