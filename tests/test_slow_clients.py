"""Slow and hostile clients against a real `gpulane api` process, on loopback: sockets
that trickle their headers or body are answered 408 and closed at the deadline, real
clients are answered meanwhile, and connections past the cap get 503 server_busy."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from testkit import CLI, REPO, free_port, http_ok, wait_for, worker_env

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0


def _start_api(redis_url: str, **settings: object) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = worker_env(
        redis_url,
        header_timeout_s=HEADER_TIMEOUT_S,
        body_timeout_s=BODY_TIMEOUT_S,
        catalog_on_start=False,
        **settings,
    )
    proc = subprocess.Popen(
        [*CLI, "api", "--port", str(port)],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, "gpulane api exited"
        return http_ok(f"{url}/health")

    wait_for(up, 30, what="gpulane api to answer")
    return proc, url


@pytest.fixture
def start_api(redis_url: str) -> Iterator[Callable[..., str]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(**settings: object) -> str:
        proc, url = _start_api(redis_url, **settings)
        procs.append(proc)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(15)


def _connect(port: int, first: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if first:
        sock.sendall(first)
    return sock


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    """One byte per socket every 0.2 s, until the server closes it or stop is set."""
    live = list(socks)
    while live and not stop.is_set():
        for sock in list(live):
            try:
                sock.send(b"a")
            except OSError:
                live.remove(sock)
        time.sleep(0.2)


def _answer(sock: socket.socket) -> bytes:
    """Everything the server wrote before it closed the connection; b"reset" when a
    trickled byte crossed the close (the kernel then resets, dropping the answer)."""
    data = b""
    with sock:
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            return b"reset"
    return data


def _timed_out(answers: list[bytes]) -> None:
    """Every connection was closed: answered 408 request_timeout, or reset."""
    assert all(a == b"reset" or a.startswith(b"HTTP/1.1 408") for a in answers), answers
    assert any(b"request_timeout" in a for a in answers), answers


def test_slow_headers_and_bodies_do_not_starve_real_clients(
    start_api: Callable[..., str],
) -> None:
    api_process = start_api()
    port = int(api_process.rsplit(":", 1)[1])
    slow_headers = [
        _connect(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ") for _ in range(100)
    ]
    body_head = (
        b"POST /tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n{"
    )
    slow_bodies = [_connect(port, body_head) for _ in range(20)]
    stop = threading.Event()
    trickler = threading.Thread(target=_trickle, args=(slow_headers + slow_bodies, stop))
    trickler.start()
    try:
        # A starved client would time out here (an error, not a timed assertion).
        with httpx.Client(base_url=api_process, timeout=2.0) as http:
            for _ in range(10):  # while every slow socket is open and trickling
                assert http.get("/health").status_code == 200
                assert http.get("/queues").status_code == 200
        # Each slow socket reads with a timeout: one the server never closed raises.
        header_answers = [_answer(s) for s in slow_headers]
        body_answers = [_answer(s) for s in slow_bodies]
    finally:
        stop.set()
        trickler.join(10)
    _timed_out(header_answers)
    _timed_out(body_answers)


def test_connections_past_the_cap_are_refused_until_slow_ones_are_closed(
    start_api: Callable[..., str],
) -> None:
    api_process = start_api(max_connections=30)
    port = int(api_process.rsplit(":", 1)[1])
    idle = [_connect(port, b"") for _ in range(30)]  # open, silent
    try:
        busy = httpx.get(f"{api_process}/health", timeout=5)
        assert busy.status_code == 503 and busy.json()["error"] == "server_busy"
        assert busy.headers["retry-after"] == "1"
        # The silent ones miss the header deadline and are closed: room again.
        wait_for(
            lambda: httpx.get(f"{api_process}/health", timeout=5).status_code == 200,
            HEADER_TIMEOUT_S + 5,
            what="the cap to free up",
        )
        assert all(_answer(s).startswith(b"HTTP/1.1 408") for s in idle)  # silent: no reset
    finally:
        for sock in idle:
            sock.close()
