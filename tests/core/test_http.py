"""stepwatch's one HTTP client (core/_http.py): reuse, stale connections, errors, retryable.

The exporter's use of it (proxies, TLS, deadlines, interrupting a shutdown) is tested in
tests/exporters/test_otlp_http.py; the sinks' in tests/detectors/test_*sink*.py.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import http.server
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from stepwatch.core import ConfigError, DeliveryError, InfluxClient, InfluxError
from stepwatch.core._errors import InfluxUnavailableError
from stepwatch.core._http import (
    OTLP_RETRYABLE_STATUSES,
    BrokenAnswerError,
    HttpClient,
    redact,
    retryable,
    send_json,
)
from stepwatch.core._net import free_port


class Server:
    """An HTTP/1.1 keep-alive server answering from a script (then 200 ``ok``).

    Script entries: an int (that status, empty body, plus ``headers`` for 429), ``"drop"``
    (read the request, close without an answer), ``"short"`` (promise 50 bytes, send 2, close).
    """

    def __init__(self) -> None:
        self.script: collections.deque[Any] = collections.deque()
        self.received: list[tuple[int, str, bytes]] = []  # (client port, request line, body)
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return None

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with server.lock:
                    server.received.append((self.client_address[1], self.requestline, body))
                    step = server.script.popleft() if server.script else 200
                if step == "drop":
                    self.close_connection = True
                    return
                if step == "short":
                    self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nxx")
                    self.close_connection = True
                    return
                payload = b"ok" if step == 200 else f"status {step}".encode()
                self.send_response(step)
                self.send_header("Content-Length", str(len(payload)))
                if step == 429:
                    self.send_header("Retry-After", "3")
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _handle

        class Threaded(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def process_request(self, request: Any, client_address: Any) -> None:
                server.sockets.append(request)
                super().process_request(request, client_address)

        self.httpd = Threaded(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close_connections(self) -> None:
        """Close every kept-alive connection from the server's side (an idle timeout)."""
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def ports(self) -> list[int]:
        return [port for port, _, _ in self.received]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.close_connections()


@pytest.fixture
def server() -> Iterator[Server]:
    running = Server()
    yield running
    running.stop()


def _get(client: HttpClient, url: str, **options: Any) -> Any:
    return client.request("GET", url, headers={}, timeout_s=options.get("timeout_s", 5.0))


def test_requests_reuse_one_kept_alive_connection(server: Server) -> None:
    client = HttpClient(environ={})
    for _ in range(3):
        answer = _get(client, f"{server.url}/x?y=1")
        assert (answer.status, answer.body) == (200, b"ok")
    post = client.request("POST", f"{server.url}/w", headers={"X-A": "b"}, body=b"abc", timeout_s=5)
    assert post.status == 200
    assert len(set(server.ports())) == 1
    assert server.received[0][1] == "GET /x?y=1 HTTP/1.1"
    assert server.received[-1][2] == b"abc"
    assert (client.requests, client.body_bytes, client.reconnects) == (4, 3, 0)
    client.close()
    assert _get(client, server.url).status == 200  # a closed client opens a new connection
    assert len(set(server.ports())) == 2


def test_threads_each_take_a_connection_and_at_most_max_idle_wait(server: Server) -> None:
    client = HttpClient(environ={}, max_idle=2)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(20):
                assert _get(client, server.url).status == 200
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert len(server.received) == 120
    assert len(set(server.ports())) < 120  # connections were reused
    (origin,) = client._origins.values()
    assert 1 <= len(origin.idle) <= 2


def test_a_connection_the_server_closed_while_waiting_is_replaced_before_use(
    server: Server,
) -> None:
    client = HttpClient(environ={})
    assert _get(client, server.url).status == 200
    server.close_connections()  # the server's idle timeout
    assert _get(client, server.url).status == 200
    assert len(server.received) == 2  # nothing was resent
    assert client.reconnects == 1
    assert len(set(server.ports())) == 2


def test_a_reused_connection_that_fails_on_use_is_resent_once_on_a_fresh_one(
    server: Server,
) -> None:
    client = HttpClient(environ={})
    assert _get(client, server.url).status == 200
    server.script.append("drop")  # the close races the request: no answer on the old one
    assert _get(client, server.url).status == 200
    assert len(server.received) == 3
    assert server.ports()[0] == server.ports()[1] != server.ports()[2]
    assert client.reconnects == 1
    # On a fresh connection nothing is resent: the failure is the caller's.
    client.close()
    server.script.append("drop")
    with pytest.raises(ConnectionError):
        _get(client, server.url)
    assert len(server.received) == 4


def test_a_broken_off_answer_is_an_os_error_naming_it(server: Server) -> None:
    client = HttpClient(environ={})
    server.script.append("short")
    with pytest.raises(BrokenAnswerError, match="IncompleteRead"):
        _get(client, server.url)
    assert _get(client, server.url).status == 200  # the broken connection was not kept


def test_statuses_are_answers_and_unreachable_timeouts_are_os_errors(server: Server) -> None:
    client = HttpClient(environ={})
    server.script.extend([404, 503, 301])
    assert [_get(client, server.url).status for _ in range(3)] == [404, 503, 301]
    with pytest.raises(ConnectionRefusedError):
        _get(client, f"http://127.0.0.1:{free_port()}/")
    with pytest.raises(TimeoutError):
        _get(client, server.url, timeout_s=0.0)


@pytest.mark.parametrize(
    "url", ["ftp://h/x", "http:///x", "h:80", "http://h:99999/", "http://h:port/"]
)
def test_bad_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        HttpClient(environ={}).check(url)


def test_proxy_settings_are_checked_and_never_shown() -> None:
    environ = {"http_proxy": "socks5://user:secret@p:1080"}
    with pytest.raises(ConfigError, match="only http:// proxies") as info:
        HttpClient(environ=environ).check("http://bridge:4318/")
    assert "secret" not in str(info.value)
    bypassed = HttpClient(environ={**environ, "no_proxy": "bridge"})
    bypassed.check("http://bridge:4318/")
    assert "secret" not in repr(bypassed)
    with pytest.raises(ConfigError, match="max_idle"):
        HttpClient(max_idle=-1)


def test_redact_drops_userinfo_and_query() -> None:
    assert redact("http://u:pw@h:8086/query?u=a&p=pw") == "http://h:8086/query"
    assert redact("https://h/api/alerts") == "https://h/api/alerts"
    url = f"http://127.0.0.1:{free_port()}/api?token=pw"
    with pytest.raises(DeliveryError) as info:
        send_json(HttpClient(environ={}), "POST", url, {"a": 1}, timeout_s=2)
    assert "pw" not in str(info.value)


def test_what_is_retryable() -> None:
    assert [s for s in (200, 301, 400, 404, 408, 429, 500, 501, 503, 599) if retryable(s)] == [
        408,
        429,
        500,
        501,
        503,
        599,
    ]
    assert sorted(OTLP_RETRYABLE_STATUSES) == [429, 502, 503, 504]


def test_influx_client_maps_answers_to_its_errors(server: Server) -> None:
    client = InfluxClient(server.url, username="u", password="pw", timeout_s=2)
    server.script.extend([429, 400, 503])
    with pytest.raises(InfluxUnavailableError) as later:
        client.write_lines(["m v=1 1"])
    assert later.value.status == 429
    with pytest.raises(InfluxError) as refused:
        client.write_lines(["m v=1 1"])
    assert refused.value.status == 400 and not isinstance(refused.value, InfluxUnavailableError)
    with pytest.raises(InfluxUnavailableError):
        client.write_lines(["m v=1 1"])
    server.script.append("short")
    with pytest.raises(InfluxUnavailableError, match="broke off"):
        client.write_lines(["m v=1 1"])
    assert client.write_lines(["m v=1 1"]) == len("m v=1 1")
    assert len(set(server.ports())) <= 3  # kept alive across answers; not across broken ones
    unreachable = InfluxClient(f"http://127.0.0.1:{free_port()}", username="u", password="pw")
    assert not unreachable.ping()
    with pytest.raises(InfluxUnavailableError, match="unreachable") as info:
        unreachable.write_lines(["m v=1 1"])
    assert "pw" not in str(info.value)
    client.close()


def test_influx_client_refuses_an_unusable_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("http_proxy", "socks5://p:1080")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with pytest.raises(ConfigError, match=r"url: .*only http:// proxies"):
        InfluxClient("http://influx.example:8086")


def test_a_dropped_client_leaves_no_socket_open(server: Server) -> None:
    client = HttpClient(environ={})
    assert _get(client, server.url).status == 200
    del client
    gc.collect()  # an unclosed socket would be a ResourceWarning (an error in this suite)
