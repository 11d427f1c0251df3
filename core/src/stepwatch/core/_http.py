"""stepwatch's one HTTP client: every request a stepwatch component sends goes through here.

Users: the InfluxDB client (:class:`~stepwatch.core.InfluxClient`: ``/write``, ``/query``,
``/ping``), the Alertmanager and Grafana sinks (:func:`send_json`), the exporters' OTLP/HTTP
exporter (``OtlpHttpExporter``) and the managed servers' readiness probes. Standard library only
(``http.client``): the exporters run inside training jobs and gain no dependency from it.

What it owns, so that no user re-decides it:

- **Connection reuse.** Per origin (scheme, host, port) a few kept-alive connections wait
  between requests; each request takes one of its own, so a client is safe across threads. A
  waiting connection the server has closed is found before use (its socket reads as closed)
  and replaced; when the close races the request (a broken pipe, a reset, or no status line on
  a reused connection), the request is resent once, at once, on a fresh connection. The server
  never answered the first one; the requests stepwatch sends are idempotent or keyed.
- **Proxies.** ``<scheme>_proxy`` then ``all_proxy`` (either case, lowercase first), unless the
  host matches ``no_proxy``: the rules of ``requests``, read once when the client is built.
  Only ``http://`` proxies: plain HTTP is sent to them with the absolute URI (RFC 9112 section
  3.2.2), https is tunnelled through them with ``CONNECT``.
- **TLS.** The system CAs or a CA bundle, and a client certificate for mutual TLS
  (:class:`TlsFiles`); certificates and host names are always verified.
- **Timeouts.** Each socket operation of a request is bounded by what is left of its timeout.
- **Credentials in errors.** :func:`redact` drops the userinfo and the query (InfluxDB's v1 API
  takes ``u``/``p`` there) from a URL before any message shows it.
- **Retryable.** :func:`retryable` (408, 429, 5xx) for InfluxDB; :data:`OTLP_RETRYABLE_STATUSES`
  (429, 502, 503, 504), the OTLP/HTTP specification's narrower list; :func:`retry_after_s`
  reads ``Retry-After``.

What an answer means (an alert refused, a batch to spool) stays with the caller: a request
returns an :class:`HttpResponse` for any status and raises ``OSError`` only when no whole answer
came. Redirects are answers like any other (3xx), never followed.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import email.utils
import http.client
import json
import math
import select
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, Final, NamedTuple, Protocol

from stepwatch.core._errors import ConfigError, DeliveryError

#: A kept-alive connection the server has since closed fails on first use with one of these
#: (``RemoteDisconnected`` is both a ``ConnectionResetError`` and a ``BadStatusLine``).
_STALE_ERRORS: Final = (
    BrokenPipeError,
    ConnectionResetError,
    ConnectionAbortedError,
    http.client.BadStatusLine,
)
#: The OTLP/HTTP specification's retryable answers
#: (https://opentelemetry.io/docs/specs/otlp/#retryable-response-codes): any other is final.
OTLP_RETRYABLE_STATUSES: Final = frozenset({429, 502, 503, 504})
DEFAULT_MAX_IDLE: Final = 2


def retryable(status: int) -> bool:
    """Whether the same request may succeed later: 408, 429 or a 5xx (RFC 9110, RFC 6585)."""
    return status in (408, 429) or 500 <= status <= 599


def retry_after_s(value: str | None, *, now_unix_s: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delay-seconds or HTTP-date), or None.

    RFC 9110 section 10.2.3. A date in the past gives ``0.0``; an unparsable value gives None.
    """
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return max(seconds, 0.0) if math.isfinite(seconds) else None
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    now = time.time() if now_unix_s is None else now_unix_s
    return max(when.timestamp() - now, 0.0)


def redact(url: str) -> str:
    """``url`` without what may carry credentials: the ``user:password@`` and the query."""
    parsed = urllib.parse.urlsplit(url)
    netloc = parsed.netloc.rpartition("@")[2]
    if netloc == parsed.netloc and not parsed.query:
        return url
    return urllib.parse.urlunsplit((parsed.scheme, netloc, parsed.path, "", parsed.fragment))


def check_base_url(url: str, argument: str) -> str:
    """``url`` without a trailing slash, or ``ConfigError`` naming ``argument``."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"{argument}: {url!r} is not an http(s) URL")
    return url.rstrip("/")


# ---------------------------------------------------------------------- answers


@dataclasses.dataclass(frozen=True)
class HttpResponse:
    """An answer, read to its end (errors are answers too, not exceptions).

    ``headers`` looks names up case-insensitively.
    """

    status: int
    body: bytes
    reason: str = ""
    headers: http.client.HTTPMessage = dataclasses.field(default_factory=http.client.HTTPMessage)

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


class HttpTransport(Protocol):
    """Sends one HTTP request. Raises ``OSError`` only when no whole answer came.

    :class:`HttpClient` is the implementation; tests pass in-process ones.
    """

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        body: bytes | None,
        timeout_s: float,
    ) -> HttpResponse: ...


class BrokenAnswerError(ConnectionError):
    """The server's answer broke off or was no HTTP (a short body, a garbled status line)."""


def send_json(
    transport: HttpTransport,
    method: str,
    url: str,
    payload: Any,
    *,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> HttpResponse:
    """Send ``payload`` as JSON; ``DeliveryError`` unless the answer is 2xx."""
    body = None if payload is None else json.dumps(payload).encode()
    all_headers = {"Accept": "application/json", **(headers or {})}
    if body is not None:
        all_headers["Content-Type"] = "application/json"
    try:
        response = transport.request(
            method, url, headers=all_headers, body=body, timeout_s=timeout_s
        )
    except OSError as exc:
        raise DeliveryError(f"{method} {redact(url)} failed: {exc}") from exc
    if not 200 <= response.status < 300:
        detail = response.body.decode("utf-8", "replace").strip()[:300]
        raise DeliveryError(
            f"{method} {redact(url)} answered {response.status}: {detail}",
            status=response.status,
        )
    return response


# ---------------------------------------------------------------------- proxies and TLS


class TlsFiles(NamedTuple):
    """PEM files for https endpoints (None: not configured)."""

    certificate_file: str | None = None  # CA bundle verifying the server (else system CAs)
    client_key_file: str | None = None  # private key for mutual TLS
    client_certificate_file: str | None = None  # certificate (chain) for mutual TLS


NO_TLS_FILES: Final = TlsFiles()  # the system CAs, no client certificate


def _proxies_from(environ: Mapping[str, str]) -> dict[str, str]:
    """``urllib.request.getproxies_environment`` for an explicit mapping (lowercase wins)."""
    proxies: dict[str, str] = {}
    for name, value in environ.items():
        if value and name.lower().endswith("_proxy") and name != name.lower():
            proxies[name[:-6].lower()] = value
    for name, value in environ.items():
        if name.lower().endswith("_proxy") and name == name.lower():
            if value:
                proxies[name[:-6]] = value
            else:
                proxies.pop(name[:-6], None)
    if "REQUEST_METHOD" in environ:  # CGI: HTTP_PROXY may come from a request header
        proxies.pop("http", None)
    return proxies


def _proxy_for(url: str, proxies: Mapping[str, str]) -> str | None:
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or ""
    target = f"{host}:{parsed.port}" if parsed.port else host
    if urllib.request.proxy_bypass_environment(target, proxies):  # type: ignore[attr-defined]
        return None
    return proxies.get(parsed.scheme) or proxies.get("all")


def resolve_proxy(url: str, *, environ: Mapping[str, str] | None = None) -> str | None:
    """The proxy URL ``requests`` would use for ``url``, or None for a direct connection.

    ``<scheme>_proxy`` then ``all_proxy`` (either case, lowercase first), unless the host
    matches ``no_proxy`` (``urllib.request.proxy_bypass_environment`` semantics).

    Args:
        url: The URL to reach.
        environ: The environment to read (``urllib.request.getproxies()`` when omitted).
    """
    proxies = urllib.request.getproxies() if environ is None else _proxies_from(environ)
    return _proxy_for(url, proxies)


@dataclasses.dataclass(frozen=True)
class _Proxy:
    host: str
    port: int
    authorization: str | None  # Proxy-Authorization from the proxy URL's userinfo


def _parse_proxy(url: str) -> _Proxy:
    source = url
    if "://" not in url:
        url = "http://" + url
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port or 80
    except ValueError:
        port = 0
    if parsed.scheme != "http" or not parsed.hostname or not port:
        raise ConfigError(
            f"proxy {redact(source)!r} (from *_proxy environment variables): only http:// "
            "proxies are supported; set no_proxy for the endpoint's host to bypass it"
        )
    authorization = None
    if parsed.username is not None:
        credentials = (
            f"{urllib.parse.unquote(parsed.username)}:{urllib.parse.unquote(parsed.password or '')}"
        )
        authorization = "Basic " + base64.b64encode(credentials.encode()).decode("ascii")
    return _Proxy(parsed.hostname, port, authorization)


def _ssl_context(tls: TlsFiles) -> ssl.SSLContext:
    """``ssl.create_default_context`` with the configured CA bundle and client certificate."""
    certificate_file, client_key_file, client_certificate_file = tls
    try:
        context = ssl.create_default_context(cafile=certificate_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"certificate_file {certificate_file!r} is unusable: {exc}") from exc
    if client_certificate_file is not None:
        try:
            context.load_cert_chain(client_certificate_file, keyfile=client_key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"client_certificate_file {client_certificate_file!r} / client_key_file "
                f"{client_key_file!r} are unusable: {exc}"
            ) from exc
    elif client_key_file is not None:
        raise ConfigError("client_key_file needs client_certificate_file")
    return context


# ---------------------------------------------------------------------- connections


class _Origin:
    """How to reach one (scheme, host, port): directly or through a proxy, in TLS or not."""

    def __init__(self, parsed: urllib.parse.SplitResult, proxy: _Proxy | None, context: Any):
        self.https = parsed.scheme == "https"
        self.host = parsed.hostname or ""
        self.port = parsed.port or (443 if self.https else 80)
        self.proxy = proxy
        self.context: ssl.SSLContext | None = context
        # Plain HTTP through a proxy: absolute URIs in the request line, credentials in a header.
        self.absolute = proxy is not None and not self.https
        self.headers: dict[str, str] = {}
        if self.absolute and proxy is not None and proxy.authorization:
            self.headers["Proxy-Authorization"] = proxy.authorization
        self.idle: list[http.client.HTTPConnection] = []

    def target(self, parsed: urllib.parse.SplitResult) -> str:
        """The request line's target: the path and query, or the absolute URI for a proxy."""
        path = parsed.path or "/"
        if self.absolute:
            netloc = parsed.netloc.rpartition("@")[2]  # never userinfo in a request line
            return urllib.parse.urlunsplit((parsed.scheme, netloc, path, parsed.query, ""))
        return path + (f"?{parsed.query}" if parsed.query else "")

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        """A new, unconnected connection."""
        proxy = self.proxy
        if not self.https:
            host, port = (self.host, self.port) if proxy is None else (proxy.host, proxy.port)
            return http.client.HTTPConnection(host, port, timeout=timeout_s)
        if proxy is None:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=timeout_s, context=self.context
            )
        # CONNECT through the proxy, then TLS to the endpoint inside the tunnel.
        connection = http.client.HTTPSConnection(
            proxy.host, proxy.port, timeout=timeout_s, context=self.context
        )
        tunnel = {"Proxy-Authorization": proxy.authorization} if proxy.authorization else None
        connection.set_tunnel(self.host, self.port, headers=tunnel)
        return connection


def _closed_by_peer(connection: http.client.HTTPConnection) -> bool:
    """Whether a waiting kept-alive connection is unusable: closed, or readable (the server
    closed it or sent something unasked). ``poll``, not ``select``: no descriptor limit."""
    sock = connection.sock
    if sock is None:
        return True
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


class HttpClient:
    """Sends HTTP requests on kept-alive connections; the :class:`HttpTransport` of stepwatch.

    Safe across threads: concurrent requests each take a connection of their own; at most
    ``max_idle`` per origin wait between requests. :meth:`interrupt` and :meth:`close` may come
    from another thread (a shutdown).

    Args:
        tls: PEM files for https URLs.
        environ: The environment for the proxy variables (``urllib.request.getproxies()`` when
            None); read once, here.
        stop: Set by the owner when it shuts down: no resend after that.
        max_idle: Kept-alive connections kept per origin between requests.

    Attributes:
        requests: Requests sent (resends included).
        body_bytes: Request body bytes sent.
        reconnects: Fresh connections opened because a kept-alive one had been closed by the
            server (found before use, or failed on use and the request was resent).

    Raises:
        ConfigError: ``max_idle`` is negative.
    """

    def __init__(
        self,
        *,
        tls: TlsFiles = NO_TLS_FILES,
        environ: Mapping[str, str] | None = None,
        stop: threading.Event | None = None,
        max_idle: int = DEFAULT_MAX_IDLE,
    ) -> None:
        if isinstance(max_idle, bool) or not isinstance(max_idle, int) or max_idle < 0:
            raise ConfigError(f"max_idle must be a non-negative integer, got {max_idle!r}")
        self._tls = tls
        self._proxies = urllib.request.getproxies() if environ is None else _proxies_from(environ)
        self._stop = stop or threading.Event()
        self._max_idle = max_idle
        self._lock = threading.Lock()
        self._origins: dict[tuple[str, str, int], _Origin] = {}
        self._context: ssl.SSLContext | None = None
        self._busy: set[http.client.HTTPConnection] = set()
        self._generation = 0  # close() moves it on: connections from before are not kept
        self.requests = 0
        self.body_bytes = 0
        self.reconnects = 0

    def __repr__(self) -> str:  # proxy URLs may carry credentials: never show them
        return f"HttpClient(origins={len(self._origins)})"

    def __del__(self) -> None:
        # Owners that never call close() (a client built for one command) leave no socket
        # open behind them: the waiting connections close with the client.
        with contextlib.suppress(Exception):
            for origin in self._origins.values():
                for connection in origin.idle:
                    connection.close()

    def check(self, url: str) -> None:
        """Resolve ``url``'s origin now: its proxy and TLS settings (cached for requests).

        Raises:
            ConfigError: Not an http(s) URL with a host and a valid port, an unusable proxy
                setting, or an unusable TLS file.
        """
        self._route(url)

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        body: bytes | None = None,
        timeout_s: float,
    ) -> HttpResponse:
        """Send one request and read its answer, whatever its status.

        Raises:
            OSError: No whole answer came: unreachable, timed out (``TimeoutError``, also when
                ``timeout_s`` is not positive), reset, or broken off (:class:`BrokenAnswerError`).
            ConfigError: ``url`` or the proxy for it is unusable (as :meth:`check`).
        """
        deadline = time.monotonic() + timeout_s
        origin, target = self._route(url)
        sent = {**origin.headers, **headers} if origin.headers else headers
        try:
            return self._exchange(origin, method, target, sent, body, deadline)
        except OSError:
            raise
        except http.client.HTTPException as exc:  # a short body, a status line that is no HTTP
            raise BrokenAnswerError(f"{type(exc).__name__}: {exc!r}") from exc

    def _exchange(
        self,
        origin: _Origin,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes | None,
        deadline: float,
    ) -> HttpResponse:
        """The request, resent once on a fresh connection when a reused one was stale."""
        connection, reused, generation = self._take(origin)
        try:
            answer, keep = self._send(connection, method, target, headers, body, deadline)
        except _STALE_ERRORS:
            self._drop(connection)
            if not reused or self._stop.is_set() or deadline <= time.monotonic():
                raise
            with self._lock:
                self.reconnects += 1
            connection = self._fresh(origin)
            try:
                answer, keep = self._send(connection, method, target, headers, body, deadline)
            except BaseException:
                self._drop(connection)
                raise
        except BaseException:
            self._drop(connection)
            raise
        self._give_back(origin, connection, keep=keep, generation=generation)
        return answer

    def interrupt(self) -> None:
        """Shut down the sockets of requests in flight on other threads (they fail at once)."""
        with self._lock:
            busy = list(self._busy)
        for connection in busy:
            sock = connection.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the waiting connections; those in flight close when their request ends.

        A later request opens a new connection.
        """
        with self._lock:
            self._generation += 1
            idle = [c for origin in self._origins.values() for c in origin.idle]
            for origin in self._origins.values():
                origin.idle.clear()
        for connection in idle:
            connection.close()

    # ------------------------------------------------------------------ internals

    def _route(self, url: str) -> tuple[_Origin, str]:
        parsed = urllib.parse.urlsplit(url)
        try:
            port = parsed.port
        except ValueError:
            raise ConfigError(
                f"{redact(url)!r}: the port is not a number from 0 to 65535"
            ) from None
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ConfigError(f"{redact(url)!r} is not an http:// or https:// URL with a host")
        https = parsed.scheme == "https"
        key = (parsed.scheme, parsed.hostname, port or (443 if https else 80))
        origin = self._origins.get(key)
        if origin is None:
            proxy_url = _proxy_for(url, self._proxies)
            proxy = _parse_proxy(proxy_url) if proxy_url else None
            context = self._ssl() if https else None
            with self._lock:
                origin = self._origins.setdefault(key, _Origin(parsed, proxy, context))
        return origin, origin.target(parsed)

    def _ssl(self) -> ssl.SSLContext:
        context = self._context
        if context is None:
            context = self._context = _ssl_context(self._tls)
        return context

    def _take(self, origin: _Origin) -> tuple[http.client.HTTPConnection, bool, int]:
        """A waiting connection still open (reused: True), else a new one."""
        closed: list[http.client.HTTPConnection] = []
        connection = None
        with self._lock:
            generation = self._generation
            while origin.idle:
                candidate = origin.idle.pop()
                if _closed_by_peer(candidate):
                    closed.append(candidate)
                    continue
                connection = candidate
                break
            if connection is None:
                connection = origin.connection(1.0)  # the timeout is set per request
                if closed:
                    self.reconnects += 1
            self._busy.add(connection)
        for stale in closed:
            stale.close()
        return connection, connection.sock is not None, generation

    def _fresh(self, origin: _Origin) -> http.client.HTTPConnection:
        connection = origin.connection(1.0)
        with self._lock:
            self._busy.add(connection)
        return connection

    def _send(
        self,
        connection: http.client.HTTPConnection,
        method: str,
        target: str,
        headers: Mapping[str, str],
        body: bytes | None,
        deadline: float,
    ) -> tuple[HttpResponse, bool]:
        """One request on ``connection``; the answer and whether the connection can be kept."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request's timeout passed before it was sent")
        connection.timeout = remaining
        if connection.sock is None:
            connection.connect()
            if connection.sock is not None:
                # http.client writes the headers and the body in two sends: without
                # TCP_NODELAY the body may wait for the delayed ACK of the headers (Nagle).
                connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            connection.sock.settimeout(remaining)
        with self._lock:
            self.requests += 1
            self.body_bytes += len(body) if body else 0
        connection.request(method, target, body=body, headers=headers)
        response = connection.getresponse()
        answer = HttpResponse(
            status=response.status,
            body=response.read(),  # read it all, or the connection cannot be reused
            reason=response.reason,
            headers=response.headers,
        )
        return answer, not response.will_close

    def _give_back(
        self,
        origin: _Origin,
        connection: http.client.HTTPConnection,
        *,
        keep: bool,
        generation: int,
    ) -> None:
        with self._lock:
            self._busy.discard(connection)
            keep = keep and generation == self._generation and len(origin.idle) < self._max_idle
            if keep:
                origin.idle.append(connection)
        if not keep:
            connection.close()

    def _drop(self, connection: http.client.HTTPConnection) -> None:
        with self._lock:
            self._busy.discard(connection)
        connection.close()
