"""``stepwatch bridge``: run the OTLP → InfluxDB bridge until SIGINT/SIGTERM.

Standard library only at import time (``stepwatch --help`` must work without the extra).
Configuration precedence: command-line argument > environment variable > default.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stepwatch.core._errors import ConfigError

# option -> (environment variable, default)
ENVIRONMENT: dict[str, tuple[str, str | None]] = {
    "influx_url": ("STEPWATCH_INFLUX_URL", "http://127.0.0.1:8086"),
    "database": ("STEPWATCH_INFLUX_DATABASE", "stepwatch"),
    "token": ("STEPWATCH_INFLUX_TOKEN", None),
    "org": ("STEPWATCH_INFLUX_ORG", None),
    "bucket": ("STEPWATCH_INFLUX_BUCKET", None),
    "host": ("STEPWATCH_BRIDGE_HOST", "127.0.0.1"),
    "grpc_port": ("STEPWATCH_BRIDGE_GRPC_PORT", "4317"),
    "http_port": ("STEPWATCH_BRIDGE_HTTP_PORT", "4318"),
    "spool_dir": ("STEPWATCH_BRIDGE_SPOOL_DIR", None),
    "spool_max_bytes": ("STEPWATCH_BRIDGE_SPOOL_MAX_BYTES", str(256 * 1024 * 1024)),
    "auth_token_file": ("STEPWATCH_BRIDGE_TOKEN_FILE", None),
    "tls_cert": ("STEPWATCH_BRIDGE_TLS_CERT", None),
    "tls_key": ("STEPWATCH_BRIDGE_TLS_KEY", None),
    "max_series": ("STEPWATCH_BRIDGE_MAX_SERIES", "2000000"),
    "max_queue_lines": ("STEPWATCH_BRIDGE_MAX_QUEUE_LINES", "200000"),
    "max_future_skew_s": ("STEPWATCH_BRIDGE_MAX_FUTURE_SKEW_S", "600"),
    "max_past_skew_s": ("STEPWATCH_BRIDGE_MAX_PAST_SKEW_S", "0"),
    "max_duration_s": ("STEPWATCH_BRIDGE_MAX_DURATION_S", "86400"),
    "duplicate_rank_takeover_s": ("STEPWATCH_BRIDGE_DUPLICATE_RANK_TAKEOVER_S", "30"),
}
TOKEN_VARIABLE = "STEPWATCH_BRIDGE_TOKEN"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bridge",
        help="receive OTLP metrics (gRPC, HTTP) and write them to InfluxDB",
        description="Run the OTLP → InfluxDB bridge until SIGINT/SIGTERM. Every option "
        "falls back to its environment variable (shown in brackets), then to the default.",
    )

    def option(flag: str, dest: str, help_text: str, **kwargs: Any) -> None:
        variable, default = ENVIRONMENT[dest]
        parser.add_argument(
            flag, dest=dest, default=None, help=f"{help_text} [{variable}; {default}]", **kwargs
        )

    option("--influx-url", "influx_url", "InfluxDB base URL")
    option("--database", "database", "database (v1 API) to write")
    option("--token", "token", "InfluxDB token (2.x/3.x); with --org/--bucket uses the v2 API")
    option("--org", "org", "InfluxDB v2 organisation")
    option("--bucket", "bucket", "InfluxDB v2 bucket")
    option("--host", "host", "listen address (loopback by default)")
    option("--grpc-port", "grpc_port", "OTLP/gRPC port (0: any free port)")
    option("--http-port", "http_port", "OTLP/HTTP port, also /metrics and /healthz")
    option("--spool-dir", "spool_dir", "disk spool directory (memory when unset)")
    option("--spool-max-bytes", "spool_max_bytes", "spool bound in bytes")
    option(
        "--auth-token-file",
        "auth_token_file",
        f"file holding the bearer token clients must send (or ${TOKEN_VARIABLE})",
    )
    option("--tls-cert", "tls_cert", "PEM certificate for TLS on both receivers")
    option("--tls-key", "tls_key", "PEM private key for TLS")
    option("--max-series", "max_series", "series per measurement per job (0: no guard)")
    option("--max-queue-lines", "max_queue_lines", "points queued in memory before 429s")
    option(
        "--max-future-skew-s",
        "max_future_skew_s",
        "reject points stamped this far ahead of receive time (0: no limit)",
    )
    option(
        "--max-past-skew-s",
        "max_past_skew_s",
        "reject points stamped this far behind receive time (0: no limit; e.g. 604800)",
    )
    option(
        "--max-duration-s",
        "max_duration_s",
        "reject duration histograms whose max or mean exceed this (0: no limit)",
    )
    option(
        "--duplicate-rank-takeover-s",
        "duplicate_rank_takeover_s",
        "reject a second producer of a live (job, rank) until the first is silent this "
        "long (0: no duplicate-rank guard)",
    )
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="set SO_REUSEPORT so several bridge processes share the ports",
    )
    parser.set_defaults(handler=run_bridge)


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str | None]:
    """Argument > environment variable > default, for every option in ENVIRONMENT."""
    resolved: dict[str, str | None] = {}
    for dest, (variable, default) in ENVIRONMENT.items():
        value = getattr(args, dest, None)
        if value is None:
            value = environ.get(variable) or default
        resolved[dest] = value
    return resolved


def _int(options: Mapping[str, str | None], dest: str) -> int:
    text = options[dest]
    try:
        return int(text or "")
    except ValueError as exc:
        raise ConfigError(f"--{dest.replace('_', '-')}: {text!r} is not an integer") from exc


def _seconds(options: Mapping[str, str | None], dest: str) -> float | None:
    """A positive number of seconds, or None for 0 (no limit)."""
    text = options[dest]
    try:
        value = float(text or "")
    except ValueError as exc:
        raise ConfigError(f"--{dest.replace('_', '-')}: {text!r} is not a number") from exc
    if value < 0 or value != value:
        raise ConfigError(f"--{dest.replace('_', '-')}: must be >= 0, got {text!r}")
    return value or None


def auth_token(options: Mapping[str, str | None], environ: Mapping[str, str]) -> str | None:
    """The bearer token: from --auth-token-file, else $STEPWATCH_BRIDGE_TOKEN, else none."""
    path = options["auth_token_file"]
    if path:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"--auth-token-file: cannot read {path}: {exc}") from exc
        if not token:
            raise ConfigError(f"--auth-token-file: {path} is empty")
        return token
    return environ.get(TOKEN_VARIABLE, "").strip() or None


def run_bridge(args: argparse.Namespace) -> int:
    from stepwatch.core._influx import InfluxClient
    from stepwatch.otel_bridge import Bridge, InfluxV1Writer, InfluxV2Writer, LineWriter

    environ = dict(os.environ)
    options = resolve(args, environ)
    writer: LineWriter
    url = str(options["influx_url"])
    if options["token"] and options["org"] and options["bucket"]:
        writer = InfluxV2Writer(
            url, token=options["token"], org=options["org"], bucket=options["bucket"]
        )
        target = f"{url} bucket {options['bucket']} (v2 API)"
    else:
        client = InfluxClient(url, database=str(options["database"]), token=options["token"])
        writer = InfluxV1Writer(client)
        target = f"{url} database {options['database']} (v1 API)"
    max_series = _int(options, "max_series")
    bridge = Bridge(
        writer,
        host=str(options["host"]),
        grpc_port=_int(options, "grpc_port"),
        http_port=_int(options, "http_port"),
        spool_dir=options["spool_dir"],
        spool_max_bytes=_int(options, "spool_max_bytes"),
        max_series_per_measurement=max_series or None,
        max_queue_lines=_int(options, "max_queue_lines"),
        auth_token=auth_token(options, environ),
        tls_cert_file=options["tls_cert"],
        tls_key_file=options["tls_key"],
        reuse_port=bool(args.reuse_port),
        max_future_skew_s=_seconds(options, "max_future_skew_s"),
        max_past_skew_s=_seconds(options, "max_past_skew_s"),
        max_duration_s=_seconds(options, "max_duration_s"),
        duplicate_rank_takeover_s=_seconds(options, "duplicate_rank_takeover_s"),
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        del signum, frame
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        bridge.start()
        print(f"stepwatch bridge: OTLP/gRPC {bridge.grpc_endpoint}", flush=True)
        print(f"stepwatch bridge: OTLP/HTTP {bridge.http_url}", flush=True)
        print(f"stepwatch bridge: metrics {bridge.metrics_url}", flush=True)
        print(f"stepwatch bridge: writing to {target}", flush=True)
        while not stop.wait(0.5):
            pass
        print("stepwatch bridge: stopping", flush=True)
    finally:
        bridge.stop()
        writer.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
