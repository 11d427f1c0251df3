"""``stepwatch ingest``: replay recorded PyTorch profiler traces as live ranks would report.

Imports only the standard library at module level; the exporter stack is imported by the
handler.
"""

from __future__ import annotations

import argparse
import datetime
import sys

from stepwatch.core._errors import ConfigError

_TIME_ORIGIN_HELP = (
    "Unix time (seconds) or ISO-8601 instant where the earliest step starts, for traces "
    "without Kineto's baseTimeNanoseconds (default: place the traces so they end now)"
)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``ingest`` subcommand."""
    parser = subparsers.add_parser(
        "ingest",
        help="replay PyTorch profiler (Kineto) traces, one file per rank, over OTLP",
        description=(
            "Read Kineto / Chrome trace-event JSON files (.json or .json.gz), one per rank, "
            "split them into steps at ProfilerStep#N and export one window per step over OTLP, "
            "exactly as a live rank would. Rank from distributedInfo.rank or the file name; "
            "world size from distributedInfo.world_size or the file count."
        ),
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE", help="trace files, one per rank")
    parser.add_argument("--job", required=True, help="stepwatch.job.id for every rank")
    parser.add_argument(
        "--endpoint",
        default=None,
        help="OTLP endpoint (default: OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT or localhost)",
    )
    parser.add_argument(
        "--protocol",
        choices=("http/protobuf", "grpc"),
        default=None,
        help="OTLP protocol (default: OTEL_EXPORTER_OTLP_[METRICS_]PROTOCOL or http/protobuf)",
    )
    parser.add_argument("--time-origin", default=None, help=_TIME_ORIGIN_HELP)
    parser.add_argument(
        "--host-name",
        default=None,
        help="host.name for every rank (default: the trace's host_name, else 'unknown')",
    )
    parser.add_argument(
        "--top-k", type=int, default=48, help="kernel classes kept by name per rank"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=None, help="bound on one export call, seconds"
    )
    parser.add_argument(
        "--max-events",
        type=int,
        default=None,
        help=(
            "most kernel, runtime, flow and step events one trace may keep (bounds memory, "
            "~160 bytes each; default 10,000,000)"
        ),
    )
    parser.set_defaults(handler=_ingest)


def parse_time_origin(text: str) -> int:
    """``--time-origin`` → Unix nanoseconds (Unix seconds, or ISO-8601 with a zone or ``Z``).

    Raises:
        ConfigError: The text is neither.
    """
    try:
        return round(float(text) * 1e9)
    except ValueError:
        pass
    try:
        instant = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ConfigError(
            f"--time-origin: expected Unix seconds or an ISO-8601 instant, got {text!r}"
        ) from exc
    if instant.tzinfo is None:
        raise ConfigError(f"--time-origin: {text!r} has no time zone (add Z or +00:00)")
    return round(instant.timestamp() * 1e9)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _ingest(args: argparse.Namespace) -> int:
    from stepwatch.exporters import create_exporter, resolve_exporter_config
    from stepwatch.exporters.kernels import ingest_traces

    origin = parse_time_origin(args.time_origin) if args.time_origin is not None else None
    config = resolve_exporter_config(
        endpoint=args.endpoint, protocol=args.protocol, timeout_s=args.timeout_s
    )
    exporter = create_exporter(config)
    # Only a given --max-events overrides ingest_traces' own default.
    limits = {} if args.max_events is None else {"max_events": args.max_events}
    try:
        result = ingest_traces(
            args.traces,
            job_id=args.job,
            exporter=exporter,
            time_origin_unix_nano=origin,
            host_name=args.host_name,
            top_k=args.top_k,
            progress=_progress,
            **limits,
        )
    finally:
        exporter.shutdown()
    windows = sum(trace.exported for trace in result.traces)
    print(
        f"ingested {len(result.traces)} of {len(args.traces)} traces, exported {windows} "
        f"windows to {config.endpoint} ({config.protocol})",
        file=sys.stderr,
    )
    for trace in result.traces:
        if trace.skipped_events:
            print(
                f"warning: {trace.path}: skipped {trace.skipped_events} malformed trace "
                f"event(s) (first: {trace.first_skipped})",
                file=sys.stderr,
            )
    for failure in result.failures:
        print(f"failed: {failure.message}", file=sys.stderr)
    if result.failures:
        print(f"{len(result.failures)} trace(s) failed", file=sys.stderr)
        return 1
    return 0
