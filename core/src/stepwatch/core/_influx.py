"""InfluxDB over its v1 HTTP API (``/write`` + InfluxQL ``/query``), and a managed influxd.

The v1 API is the common denominator (docs/architecture.md): 1.x speaks it natively; 2.x and 3.x
accept it through their compatibility endpoints with ``Authorization: Token ...``.
API reference: https://docs.influxdata.com/influxdb/v1/tools/api/
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from stepwatch.core._errors import (
    ConfigError,
    InfluxError,
    InfluxUnavailableError,
    ServerStartError,
)
from stepwatch.core._http import BrokenAnswerError, HttpClient, redact, retryable
from stepwatch.core._net import free_port, wait_http_ready
from stepwatch.core._schema import DEFAULT_DATABASE


@dataclasses.dataclass(frozen=True)
class QuerySeries:
    """One series of an InfluxQL result: a measurement, its group-by tags, and rows."""

    name: str
    tags: dict[str, str]
    columns: list[str]
    values: list[list[Any]]

    def records(self) -> list[dict[str, Any]]:
        """Rows as dicts keyed by column (convenient, not for hot paths)."""
        return [dict(zip(self.columns, row, strict=False)) for row in self.values]


def quote_ident(name: str) -> str:
    """An InfluxQL double-quoted identifier (measurement, tag or field key)."""
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def quote_literal(value: str) -> str:
    """An InfluxQL single-quoted string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class InfluxClient:
    """A small, dependency-free InfluxDB v1-API client on stepwatch's HTTP client.

    Kept-alive connections (a few, shared by the threads using the client), the proxy
    variables and the system CAs: :class:`stepwatch.core._http.HttpClient`.

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8086``.
        database: database (1.x) or DBRP-mapped bucket (2.x/3.x) to write and query.
        token: sent as ``Authorization: Token <token>`` (2.x/3.x compatibility API).
        username: v1 basic-auth user, with ``password``.
        timeout_s: per-request timeout.

    Raises:
        ConfigError: a bad URL, an empty database, a non-positive timeout, or an unusable proxy
            setting for the URL (the message names it).
    """

    def __init__(
        self,
        url: str,
        *,
        database: str = DEFAULT_DATABASE,
        token: str | None = None,
        username: str | None = None,
        password: str | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(f"url: {url!r} is not an http(s) URL")
        if not database:
            raise ConfigError("database: must not be empty")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s: must be positive, got {timeout_s}")
        self.url = url.rstrip("/")
        self.database = database
        self.timeout_s = timeout_s
        self._headers: dict[str, str] = {}
        if token:
            self._headers["Authorization"] = f"Token {token}"
        self._auth_params: dict[str, str] = {}
        if username:
            self._auth_params = {"u": username, "p": password or ""}
        self._http = HttpClient()
        try:
            self._http.check(self.url)
        except ConfigError as exc:
            raise ConfigError(f"url: {exc}") from exc

    def __repr__(self) -> str:  # never show credentials
        return f"InfluxClient(url={redact(self.url)!r}, database={self.database!r})"

    def close(self) -> None:
        """Close the kept-alive connections (a later request opens a new one)."""
        self._http.close()

    def _request(
        self, method: str, path: str, params: dict[str, str], body: bytes | None = None
    ) -> tuple[int, bytes]:
        query = urllib.parse.urlencode({**params, **self._auth_params})
        headers = dict(self._headers)
        if body is not None:
            headers["Content-Type"] = "text/plain; charset=utf-8"
        try:
            response = self._http.request(
                method,
                f"{self.url}{path}?{query}",
                headers=headers,
                body=body,
                timeout_s=self.timeout_s,
            )
        except BrokenAnswerError as exc:
            # Whether a write was stored is unknown: retried (rewriting is idempotent).
            raise InfluxUnavailableError(
                f"InfluxDB at {redact(self.url)} broke off its reply: {exc}"
            ) from exc
        except (OSError, ValueError) as exc:  # refused, timeouts, resets
            raise InfluxUnavailableError(
                f"InfluxDB at {redact(self.url)} unreachable: {exc}"
            ) from exc
        status = response.status
        if not 200 <= status < 300:
            detail = response.body.decode("utf-8", "replace").strip()
            message = f"InfluxDB {method} {path} answered {status}: {detail[:500]}"
            if retryable(status):
                raise InfluxUnavailableError(message, status=status)
            raise InfluxError(message, status=status)
        return status, response.body

    def ping(self) -> bool:
        """True when the server answers ``/ping``."""
        try:
            status, _ = self._request("GET", "/ping", {})
        except InfluxError:
            return False
        return status == 204

    def write_lines(self, lines: Iterable[str], *, database: str | None = None) -> int:
        """Write line protocol (nanosecond precision). Returns the bytes sent.

        Raises:
            InfluxError: the server rejected the batch (4xx, e.g. a malformed point).
            InfluxUnavailableError: unreachable, a broken-off reply, or an answer worth
                retrying (408, 429, 5xx); the caller should retry or spool.
        """
        body = "\n".join(lines).encode("utf-8")
        if not body:
            return 0
        self._request("POST", "/write", {"db": database or self.database, "precision": "ns"}, body)
        return len(body)

    def query(
        self, influxql: str, *, database: str | None = None, epoch: str = "ns"
    ) -> list[QuerySeries]:
        """Run InfluxQL statements; return every series of every statement in order."""
        status, body = self._request(
            "POST",
            "/query",
            {"db": database or self.database, "q": influxql, "epoch": epoch},
            b"",
        )
        del status
        payload = json.loads(body)
        series: list[QuerySeries] = []
        for result in payload.get("results", []):
            if "error" in result:
                raise InfluxError(f"InfluxQL error: {result['error']} in {influxql[:300]!r}")
            for item in result.get("series", []):
                series.append(
                    QuerySeries(
                        name=str(item.get("name", "")),
                        tags=dict(item.get("tags") or {}),
                        columns=list(item.get("columns", [])),
                        values=list(item.get("values", [])),
                    )
                )
        return series

    def create_database(self, name: str | None = None) -> None:
        """``CREATE DATABASE`` (idempotent in InfluxQL)."""
        self.query(f"CREATE DATABASE {quote_ident(name or self.database)}")


_INFLUXD_CONFIG = """\
# Written by stepwatch for a managed, loopback-only influxd (InfluxDB 1.x).
reporting-disabled = true
bind-address = "127.0.0.1:{rpc_port}"

[meta]
  dir = "{data_dir}/meta"
  logging-enabled = false

[data]
  dir = "{data_dir}/data"
  wal-dir = "{data_dir}/wal"
  query-log-enabled = false

[monitor]
  store-enabled = false

[http]
  enabled = true
  bind-address = "127.0.0.1:{http_port}"
  log-enabled = false
  max-body-size = 104857600

[continuous_queries]
  log-enabled = false
"""


class ManagedInfluxDB:
    """An influxd (1.x, from PATH) that stepwatch starts in its own data directory.

    Loopback-only, usage reporting off, free ports. ``stop()`` then ``start()`` restarts it on
    the same ports and data (used to test the bridge's spool).

    Args:
        data_dir: where config, data and log live; created if missing.
        http_port: HTTP port; a free one when ``None``.
        influxd: the binary; ``influxd`` from PATH (or ``/usr/bin/influxd``) when ``None``.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        http_port: int | None = None,
        influxd: str | None = None,
        database: str = DEFAULT_DATABASE,
        start_timeout_s: float = 30.0,
    ) -> None:
        binary = influxd or shutil.which("influxd") or "/usr/bin/influxd"
        if not Path(binary).exists():
            raise ConfigError(
                "influxd: not found on PATH; install Debian's influxdb package "
                "(scripts/setup.sh does) or pass --influx-url for an existing InfluxDB"
            )
        self.binary = binary
        self.data_dir = Path(data_dir).resolve()
        self.http_port = http_port or free_port()
        self.rpc_port = free_port()
        self.database = database
        self.start_timeout_s = start_timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "influxd.log"

    def client(self, *, database: str | None = None) -> InfluxClient:
        return InfluxClient(self.url, database=database or self.database)

    def start(self) -> ManagedInfluxDB:
        if self._process is not None and self._process.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.data_dir / "influxdb.conf"
        config_path.write_text(
            _INFLUXD_CONFIG.format(
                rpc_port=self.rpc_port, http_port=self.http_port, data_dir=self.data_dir
            )
        )
        log = self.log_path.open("ab")
        try:
            self._process = subprocess.Popen(
                [self.binary, "-config", str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, not influxd
            )
        finally:
            log.close()
        if not wait_http_ready(
            f"{self.url}/ping", timeout_s=self.start_timeout_s, expect_status=204
        ):
            tail = self.log_path.read_text(errors="replace")[-2000:]
            self.stop()
            raise ServerStartError(f"influxd did not answer /ping on {self.url}; log:\n{tail}")
        self.client().create_database()
        return self

    def stop(self, *, kill: bool = False) -> None:
        """Stop influxd: SIGTERM and wait (or SIGKILL at once with ``kill=True``)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)

    def __enter__(self) -> ManagedInfluxDB:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def wait_until(predicate: Any, *, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate()`` until truthy or the deadline passes (tests and CLIs)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def count_points(client: InfluxClient, measurement: str, where: str = "") -> int:
    """Number of points in ``measurement`` (0 when it does not exist yet)."""
    clause = f" WHERE {where}" if where else ""
    rows: Sequence[QuerySeries] = client.query(
        f"SELECT count(*) FROM {quote_ident(measurement)}{clause}"
    )
    if not rows or not rows[0].values:
        return 0
    counts = [value for value in rows[0].values[0][1:] if isinstance(value, int)]
    return max(counts, default=0)
