"""One kept-alive ``http.client`` connection POSTing to one URL, directly or through a proxy.

The transport under :class:`~stepwatch.exporters.OtlpHttpExporter`: the proxy (the rules
``requests`` and ``urllib`` use) and the TLS context are resolved once, when it is built, and
the connection is reused across requests. When a reused connection turns out to be stale (the
receiver restarted or closed it while idle), the request is resent once at once on a fresh
one. What an answer means (retries, backoff, OTLP status messages) is the exporter's business.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import email.utils
import http.client
import logging
import math
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Final, NamedTuple

from stepwatch.core._errors import ConfigError

logger = logging.getLogger("stepwatch.exporters")

# A kept-alive connection the server has since closed fails on first use with one of these;
# the request never reached a live server, so it is resent at once on a fresh connection.
_STALE_ERRORS: Final = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class TlsFiles(NamedTuple):
    """PEM files for an https endpoint (None: not configured)."""

    certificate_file: str | None = None  # CA bundle verifying the server (else system CAs)
    client_key_file: str | None = None  # private key for mutual TLS
    client_certificate_file: str | None = None  # certificate (chain) for mutual TLS


@dataclasses.dataclass(frozen=True)
class _Proxy:
    host: str
    port: int
    authorization: str | None
    source: str


@dataclasses.dataclass(frozen=True)
class Answer:
    """An HTTP answer, read to the end (so the connection can be reused)."""

    status: int
    reason: str
    headers: http.client.HTTPMessage
    body: bytes


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


def resolve_proxy(endpoint: str, *, environ: Mapping[str, str] | None = None) -> str | None:
    """The proxy URL ``requests`` would have used for ``endpoint``, or None for a direct link.

    ``<scheme>_proxy`` then ``all_proxy`` (either case, lowercase first), unless the host
    matches ``no_proxy`` (``urllib.request.proxy_bypass_environment`` semantics).

    Args:
        endpoint: The OTLP endpoint URL.
        environ: The environment to read (``urllib.request.getproxies()`` when omitted).
    """
    proxies = urllib.request.getproxies() if environ is None else _proxies_from(environ)
    parsed = urllib.parse.urlsplit(endpoint)
    host = parsed.hostname or ""
    target = f"{host}:{parsed.port}" if parsed.port else host
    if urllib.request.proxy_bypass_environment(target, proxies):  # type: ignore[attr-defined]
        return None
    return proxies.get(parsed.scheme) or proxies.get("all")


def _parse_proxy(url: str) -> _Proxy:
    source = url
    if "://" not in url:
        url = "http://" + url
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "http" or not parsed.hostname:
        raise ConfigError(
            f"proxy {source!r} (from *_proxy environment variables): only http:// proxies "
            "are supported; set no_proxy for the OTLP endpoint's host to bypass it"
        )
    authorization = None
    if parsed.username is not None:
        credentials = (
            f"{urllib.parse.unquote(parsed.username)}:{urllib.parse.unquote(parsed.password or '')}"
        )
        authorization = "Basic " + base64.b64encode(credentials.encode()).decode("ascii")
    return _Proxy(parsed.hostname, parsed.port or 80, authorization, source)


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


class PostConnection:
    """POSTs to one http(s) URL on one kept-alive connection, directly or through a proxy.

    The owner serialises :meth:`attempt`; :meth:`interrupt` and :meth:`close` may come from
    another thread (a shutdown). Each socket operation is bounded by the time left until the
    caller's deadline.

    Args:
        endpoint: Full http:// or https:// URL (checked by the caller).
        headers: Headers of every request (``Proxy-Authorization`` is added when a plain-HTTP
            proxy has credentials).
        stop: Set by the owner when it shuts down: no resend after that.
        tls: PEM files for an https endpoint.
        environ: Environment for the proxy variables (``urllib.request.getproxies()`` when
            None); read once, here.

    Attributes:
        requests: Requests sent (resends included).
        body_bytes: Request body bytes sent.
        reconnects: Resends on a fresh connection after a stale kept-alive one failed.

    Raises:
        ConfigError: The proxy is not an http:// URL, or a TLS file is unusable.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        headers: Mapping[str, str],
        stop: threading.Event,
        tls: TlsFiles,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(endpoint)
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname or ""
        self._port = parsed.port or (443 if self._https else 80)
        self._path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
        self._headers = dict(headers)
        self._stop = stop
        proxy_url = resolve_proxy(endpoint, environ=environ)
        self._proxy = _parse_proxy(proxy_url) if proxy_url else None
        self._ssl_context = _ssl_context(tls) if self._https else None
        if self._proxy is not None and not self._https:
            # Plain HTTP through a proxy: the request line carries the absolute URI (RFC 9112
            # section 3.2.2) and the proxy forwards it.
            self._path = urllib.parse.urlunsplit(
                (parsed.scheme, parsed.netloc, parsed.path or "/", parsed.query, "")
            )
            if self._proxy.authorization:
                self._headers["Proxy-Authorization"] = self._proxy.authorization
        self._http: http.client.HTTPConnection | None = None
        self.requests = 0
        self.body_bytes = 0
        self.reconnects = 0

    def attempt(self, body: bytes, deadline: float) -> tuple[Answer | None, Exception | None]:
        """One POST, plus one immediate resend when a kept-alive connection was stale."""
        reused = self._http is not None and self._http.sock is not None
        try:
            return self._post(body, deadline), None
        except (*_STALE_ERRORS, http.client.BadStatusLine) as exc:
            self.close()
            if not reused or self._stop.is_set() or deadline <= time.monotonic():
                return None, exc
            self.reconnects += 1
            logger.debug("kept-alive OTLP connection was stale (%r); resending", exc)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return None, exc
        try:
            return self._post(body, deadline), None
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            return None, exc

    def _post(self, body: bytes, deadline: float) -> Answer:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the export deadline passed")
        connection = self._http
        if connection is None:
            connection = self._http = self._new_connection(remaining)
        connection.timeout = remaining
        if connection.sock is None:
            connection.connect()
            if connection.sock is not None:
                # http.client writes the headers and the body in two sends: without
                # TCP_NODELAY the body may wait for the delayed ACK of the headers (Nagle).
                connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:
            connection.sock.settimeout(remaining)
        self.requests += 1
        self.body_bytes += len(body)
        connection.request("POST", self._path, body=body, headers=self._headers)
        response = connection.getresponse()
        answer = Answer(
            status=response.status,
            reason=response.reason,
            headers=response.headers,
            body=response.read(),  # read it all, or the connection cannot be reused
        )
        if response.will_close:
            self.close()
        return answer

    def _new_connection(self, timeout_s: float) -> http.client.HTTPConnection:
        proxy = self._proxy
        connection: http.client.HTTPConnection
        if self._https:
            if proxy is None:
                connection = http.client.HTTPSConnection(
                    self._host, self._port, timeout=timeout_s, context=self._ssl_context
                )
            else:  # CONNECT through the proxy, then TLS to the endpoint inside the tunnel
                connection = http.client.HTTPSConnection(
                    proxy.host, proxy.port, timeout=timeout_s, context=self._ssl_context
                )
                tunnel_headers = (
                    {"Proxy-Authorization": proxy.authorization} if proxy.authorization else None
                )
                connection.set_tunnel(self._host, self._port, headers=tunnel_headers)
        elif proxy is None:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        else:
            connection = http.client.HTTPConnection(proxy.host, proxy.port, timeout=timeout_s)
        return connection

    def interrupt(self) -> None:
        """Shut down the socket of a request in flight on another thread (it fails at once)."""
        connection = self._http
        sock = connection.sock if connection is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection; the next request opens a new one."""
        connection, self._http = self._http, None
        if connection is not None:
            connection.close()
