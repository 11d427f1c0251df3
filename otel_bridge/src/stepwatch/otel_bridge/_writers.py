"""Line-protocol writers: InfluxDB v1 ``/write`` and the v2 ``/api/v2/write`` API.

A writer sends one batch synchronously. It raises :class:`~stepwatch.InfluxUnavailableError`
when the batch may succeed later (unreachable, 5xx, 429, a reply broken off: retry) and
:class:`~stepwatch.InfluxError` when InfluxDB refused it for good (4xx: malformed points,
field-type conflicts); the bridge's forwarder decides what to do.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from stepwatch.core._errors import ConfigError, InfluxError, InfluxUnavailableError
from stepwatch.core._influx import InfluxClient


class LineWriter(Protocol):
    """Writes one batch of line protocol (nanosecond timestamps) or raises."""

    def write_lines(self, lines: Sequence[str]) -> None:
        """Send ``lines``; raise InfluxUnavailableError (retry) or InfluxError (refused)."""

    def close(self) -> None:
        """Release connections."""


class InfluxV1Writer:
    """Writes through the InfluxDB v1 ``/write`` API (1.x, and 2.x/3.x compatibility API).

    Args:
        client: the :class:`~stepwatch.InfluxClient` naming URL, database and credentials.
        create_database: run ``CREATE DATABASE`` before the first write (1.x only; harmless
            when it exists). Failures are ignored: the write itself reports problems.
        spool_dir: where a :class:`Bridge` using this writer spools batches while InfluxDB is
            down, unless the bridge is given its own ``spool_dir``.
    """

    def __init__(
        self,
        client: InfluxClient,
        *,
        create_database: bool = True,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.client = client
        self._create_database = create_database
        self.spool_dir = None if spool_dir is None else Path(spool_dir)

    def __repr__(self) -> str:
        return f"InfluxV1Writer({self.client!r})"

    def write_lines(self, lines: Sequence[str]) -> None:
        if self._create_database:
            try:
                self.client.create_database()
            except InfluxUnavailableError:
                raise
            except InfluxError:
                pass  # 2.x/3.x have no CREATE DATABASE; the write decides
            self._create_database = False
        # A reply broken off mid-way (InfluxDB or a proxy closed the connection, or sent
        # garbage) is the client's InfluxUnavailableError: whether the batch was stored is
        # unknown, so it is retried (rewriting is idempotent).
        self.client.write_lines(lines)

    def close(self) -> None:
        """Close the client's kept-alive connections."""
        self.client.close()


class InfluxV2Writer:
    """Writes through the InfluxDB v2 API (``POST /api/v2/write``) with ``influxdb-client``.

    API: https://docs.influxdata.com/influxdb/v2/api/#operation/PostWrite

    Args:
        url: base URL, e.g. ``http://127.0.0.1:8086``.
        token: API token (sent as ``Authorization: Token ...``; never logged).
        org: organisation name or ID.
        bucket: destination bucket.
        timeout_s: per-request timeout.
        spool_dir: as for :class:`InfluxV1Writer`.
    """

    def __init__(
        self,
        url: str,
        *,
        token: str,
        org: str,
        bucket: str,
        timeout_s: float = 10.0,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(f"url: {url!r} is not an http(s) URL")
        for name, value in (("token", token), ("org", org), ("bucket", bucket)):
            if not value:
                raise ConfigError(f"{name}: must not be empty for the v2 writer")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s: must be positive, got {timeout_s}")
        # heavy: only when the v2 API is used
        from influxdb_client.client.influxdb_client import InfluxDBClient
        from influxdb_client.client.write_api import SYNCHRONOUS

        self.url = url.rstrip("/")
        self.spool_dir = None if spool_dir is None else Path(spool_dir)
        self.org = org
        self.bucket = bucket
        # influxdb-client's own retries are off: the forwarder retries and spools.
        self._client: Any = InfluxDBClient(
            url=self.url, token=token, org=org, timeout=int(timeout_s * 1000), retries=False
        )
        self._write_api: Any = self._client.write_api(write_options=SYNCHRONOUS)

    def __repr__(self) -> str:  # never show the token
        return f"InfluxV2Writer(url={self.url!r}, org={self.org!r}, bucket={self.bucket!r})"

    def write_lines(self, lines: Sequence[str]) -> None:
        from influxdb_client.client.exceptions import InfluxDBError
        from influxdb_client.rest import ApiException

        body = "\n".join(lines)
        if not body:
            return
        try:
            self._write_api.write(
                bucket=self.bucket, org=self.org, record=body, write_precision="ns"
            )
        except (ApiException, InfluxDBError) as exc:
            status = getattr(exc, "status", None)
            if status is None and getattr(exc, "response", None) is not None:
                status = getattr(exc.response, "status", None)
            message = f"InfluxDB v2 write to {self.url} answered {status}: {str(exc)[:300]}"
            if status is None or int(status) >= 500 or int(status) == 429:
                raise InfluxUnavailableError(message, status=status) from exc
            raise InfluxError(message, status=int(status)) from exc
        except OSError as exc:  # urllib3 connection errors derive from OSError or not:
            raise InfluxUnavailableError(f"InfluxDB at {self.url} unreachable: {exc}") from exc
        except Exception as exc:  # urllib3 MaxRetryError/ProtocolError are not OSError
            if type(exc).__module__.startswith("urllib3"):
                raise InfluxUnavailableError(f"InfluxDB at {self.url} unreachable: {exc}") from exc
            raise

    def close(self) -> None:
        self._write_api.close()
        self._client.close()
