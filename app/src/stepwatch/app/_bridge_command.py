"""``stepwatch bridge``: run the OTLP → InfluxDB bridge until SIGINT/SIGTERM.

Standard library and ``stepwatch.core`` only at import time (``stepwatch --help`` must work
without the extra). Every option is a :mod:`stepwatch.core.settings` setting: command-line
argument > its environment variable (then its aliases) > its default.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from stepwatch.core import ConfigError, settings
from stepwatch.core.settings import Setting

#: The command's options, in ``--help`` order, each with what the command adds to its help.
OPTIONS: tuple[tuple[Setting[Any], str], ...] = (
    (settings.INFLUX_URL, ""),
    (settings.INFLUX_DATABASE, ""),
    (settings.INFLUX_TOKEN, "; with --org/--bucket uses the v2 API"),
    (settings.INFLUX_ORG, ""),
    (settings.INFLUX_BUCKET, ""),
    (settings.BRIDGE_HOST, ""),
    (settings.BRIDGE_GRPC_PORT, ""),
    (settings.BRIDGE_HTTP_PORT, ""),
    (settings.BRIDGE_SPOOL_DIR, " (memory when unset)"),
    (settings.BRIDGE_SPOOL_MAX_BYTES, ""),
    (settings.BRIDGE_SPOOL_OVERFLOW, ""),
    (settings.BRIDGE_TOKEN_FILE, f" (or ${settings.BRIDGE_TOKEN.variable})"),
    (settings.BRIDGE_TLS_CERT, " on both receivers"),
    (settings.BRIDGE_TLS_KEY, ""),
    (settings.BRIDGE_MAX_SERIES, ""),
    (settings.BRIDGE_MAX_SERIES_TOTAL, ""),
    (settings.BRIDGE_MAX_NEW_SERIES_PER_S, ""),
    (settings.BRIDGE_MAX_QUEUE_LINES, ""),
    (settings.BRIDGE_REQUEST_TIMEOUT_S, ""),
    (settings.BRIDGE_MAX_CONNECTIONS, ""),
    (settings.BRIDGE_IDLE_TIMEOUT_S, ""),
    (settings.BRIDGE_HANDSHAKE_TIMEOUT_S, ""),
    (settings.BRIDGE_MAX_CONNECTION_AGE_S, ""),
    (settings.BRIDGE_MAX_HEADER_BYTES, ""),
    (settings.BRIDGE_GRPC_MAX_CONCURRENT_STREAMS, ""),
    (settings.BRIDGE_MAX_FUTURE_SKEW_S, ""),
    (settings.BRIDGE_MAX_PAST_SKEW_S, "; e.g. 604800"),
    (settings.BRIDGE_MAX_DURATION_S, ""),
    (settings.BRIDGE_DUPLICATE_RANK_TAKEOVER_S, ""),
    (settings.BRIDGE_HISTOGRAM_LAYOUT, ""),
)


def _flag(setting: Setting[Any]) -> str:
    return "--" + setting.name.replace("_", "-")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bridge",
        help="receive OTLP metrics (gRPC, HTTP) and write them to InfluxDB",
        description="Run the OTLP → InfluxDB bridge until SIGINT/SIGTERM. Every option "
        "falls back to its environment variables (shown in brackets, in order), then to the "
        "default.",
    )
    for setting, note in OPTIONS:
        variables = " or ".join(setting.variables)
        default = "unset" if setting.default is None else setting.default
        parser.add_argument(
            _flag(setting),
            dest=setting.name,
            default=None,
            help=f"{setting.help}{note} [{variables}; {default}]",
        )
    parser.add_argument(
        "--reuse-port",
        action="store_true",
        help="set SO_REUSEPORT so several bridge processes share the ports",
    )
    parser.set_defaults(handler=run_bridge)


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    """Every option's value: argument > environment variable (then aliases) > default.

    Raises:
        ConfigError: an argument or a variable does not parse (names the option or variable).
    """
    resolved: dict[str, Any] = {}
    for setting, _ in OPTIONS:
        text = getattr(args, setting.name, None)
        argument = None
        if text is not None:
            try:
                argument = setting.parse(text)
            except ValueError as exc:
                raise ConfigError(f"{_flag(setting)}: {text!r} is not valid ({exc})") from exc
        resolved[setting.name] = setting.resolve(argument, environ)
    return resolved


def _limit(options: Mapping[str, Any], setting: Setting[float]) -> float | None:
    """A positive bound in seconds, or None for 0 (no limit)."""
    value = options[setting.name]
    if not value >= 0:  # also NaN
        raise ConfigError(f"{_flag(setting)}: must be >= 0, got {value!r}")
    return float(value) or None


def _overflow(value: str) -> Literal["drop_oldest", "drop_newest"]:
    if value not in ("drop_oldest", "drop_newest"):
        raise ConfigError(f"--spool-overflow: {value!r} is not drop_oldest or drop_newest")
    return "drop_oldest" if value == "drop_oldest" else "drop_newest"


def _layout(value: str) -> str:
    if value not in ("compact", "per_bound"):
        raise ConfigError(f"--histogram-layout: {value!r} is not compact or per_bound")
    return value


def auth_token(options: Mapping[str, Any], environ: Mapping[str, str]) -> str | None:
    """The bearer token: from the token file when one is set, else its variable, else none."""
    path = options[settings.BRIDGE_TOKEN_FILE.name]
    if path:
        try:
            token = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"--auth-token-file: cannot read {path}: {exc}") from exc
        if not token:
            raise ConfigError(f"--auth-token-file: {path} is empty")
        return token
    variable = settings.BRIDGE_TOKEN.resolve(None, environ)
    return variable.strip() if variable else None


def run_bridge(args: argparse.Namespace) -> int:
    from stepwatch.core import InfluxClient
    from stepwatch.otel_bridge import Bridge, InfluxV1Writer, InfluxV2Writer, LineWriter

    environ = dict(os.environ)
    options = resolve(args, environ)
    writer: LineWriter
    url = options[settings.INFLUX_URL.name]
    token = options[settings.INFLUX_TOKEN.name]
    org = options[settings.INFLUX_ORG.name]
    bucket = options[settings.INFLUX_BUCKET.name]
    if token and org and bucket:
        writer = InfluxV2Writer(url, token=token, org=org, bucket=bucket)
        target = f"{url} bucket {bucket} (v2 API)"
    else:
        database = options[settings.INFLUX_DATABASE.name]
        writer = InfluxV1Writer(InfluxClient(url, database=database, token=token))
        target = f"{url} database {database} (v1 API)"
    bridge = Bridge(
        writer,
        host=options[settings.BRIDGE_HOST.name],
        grpc_port=options[settings.BRIDGE_GRPC_PORT.name],
        http_port=options[settings.BRIDGE_HTTP_PORT.name],
        spool_dir=options[settings.BRIDGE_SPOOL_DIR.name],
        spool_max_bytes=options[settings.BRIDGE_SPOOL_MAX_BYTES.name],
        spool_overflow=_overflow(options[settings.BRIDGE_SPOOL_OVERFLOW.name]),
        max_series_per_measurement=options[settings.BRIDGE_MAX_SERIES.name] or None,
        max_series_total=options[settings.BRIDGE_MAX_SERIES_TOTAL.name] or None,
        max_new_series_per_s=_limit(options, settings.BRIDGE_MAX_NEW_SERIES_PER_S),
        request_timeout_s=options[settings.BRIDGE_REQUEST_TIMEOUT_S.name],
        max_connections=options[settings.BRIDGE_MAX_CONNECTIONS.name],
        idle_timeout_s=options[settings.BRIDGE_IDLE_TIMEOUT_S.name],
        handshake_timeout_s=options[settings.BRIDGE_HANDSHAKE_TIMEOUT_S.name],
        max_connection_age_s=options[settings.BRIDGE_MAX_CONNECTION_AGE_S.name],
        max_header_bytes=options[settings.BRIDGE_MAX_HEADER_BYTES.name],
        grpc_max_concurrent_streams=options[settings.BRIDGE_GRPC_MAX_CONCURRENT_STREAMS.name],
        max_queue_lines=options[settings.BRIDGE_MAX_QUEUE_LINES.name],
        auth_token=auth_token(options, environ),
        tls_cert_file=options[settings.BRIDGE_TLS_CERT.name],
        tls_key_file=options[settings.BRIDGE_TLS_KEY.name],
        reuse_port=bool(args.reuse_port),
        max_future_skew_s=_limit(options, settings.BRIDGE_MAX_FUTURE_SKEW_S),
        max_past_skew_s=_limit(options, settings.BRIDGE_MAX_PAST_SKEW_S),
        max_duration_s=_limit(options, settings.BRIDGE_MAX_DURATION_S),
        duplicate_rank_takeover_s=_limit(options, settings.BRIDGE_DUPLICATE_RANK_TAKEOVER_S),
        histogram_layout=_layout(options[settings.BRIDGE_HISTOGRAM_LAYOUT.name]),
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
