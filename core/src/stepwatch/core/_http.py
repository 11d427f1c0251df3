"""A small HTTP transport for the sinks that talk to other servers (Alertmanager, Grafana).

Collaborators inject any :class:`HttpTransport` (tests pass real in-process implementations);
:class:`UrllibTransport` is the standard-library default.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, Protocol

from stepwatch.core._errors import ConfigError, DeliveryError


@dataclasses.dataclass(frozen=True)
class HttpResponse:
    """What a transport returns for any HTTP status (errors are not exceptions here)."""

    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


class HttpTransport(Protocol):
    """Sends one HTTP request. Raises ``OSError`` only when the server cannot be reached."""

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        body: bytes | None,
        timeout_s: float,
    ) -> HttpResponse: ...


class UrllibTransport:
    """The default transport: the standard library's ``urllib``."""

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        body: bytes | None,
        timeout_s: float,
    ) -> HttpResponse:
        request = urllib.request.Request(url, data=body, method=method, headers=dict(headers))
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return HttpResponse(int(response.status), response.read())
        except urllib.error.HTTPError as exc:
            return HttpResponse(int(exc.code), exc.read())
        except urllib.error.URLError as exc:
            reason = exc.reason
            raise OSError(str(reason)) from exc


def check_base_url(url: str, argument: str) -> str:
    """``url`` without a trailing slash, or ``ConfigError`` naming ``argument``."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ConfigError(f"{argument}: {url!r} is not an http(s) URL")
    return url.rstrip("/")


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
        raise DeliveryError(f"{method} {_redact(url)} failed: {exc}") from exc
    if not 200 <= response.status < 300:
        detail = response.body.decode("utf-8", "replace").strip()[:300]
        raise DeliveryError(
            f"{method} {_redact(url)} answered {response.status}: {detail}",
            status=response.status,
        )
    return response


def _redact(url: str) -> str:
    parsed = urllib.parse.urlparse(url)
    return parsed._replace(query="").geturl() if parsed.query else url
