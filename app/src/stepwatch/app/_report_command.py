"""``stepwatch report``: write the self-contained HTML report of one job.

Imports only the standard library at module level (``stepwatch --help`` stays fast);
configuration precedence: command-line argument > environment variable > default.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from stepwatch.core._errors import ConfigError

# option -> (environment variable, default); the same variables as `stepwatch bridge`.
ENVIRONMENT: dict[str, tuple[str, str | None]] = {
    "influx_url": ("STEPWATCH_INFLUX_URL", "http://127.0.0.1:8086"),
    "database": ("STEPWATCH_INFLUX_DATABASE", "stepwatch"),
    "token": ("STEPWATCH_INFLUX_TOKEN", None),
}
_RELATIVE = re.compile(r"^(now)?-(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "report",
        help="write a self-contained HTML report of one job",
        description="Write one HTML page (inline SVG, no external resources) with the job's "
        "findings, step time with change points, rank × time heatmaps, phase breakdown and "
        "the kernels that moved. Options fall back to their environment variable, then to "
        "the default.",
    )
    parser.add_argument("--job", required=True, help="the stepwatch.job.id to report on")
    parser.add_argument(
        "--from",
        dest="start",
        help="start: RFC 3339 time or relative like -6h (default: the job's first window)",
    )
    parser.add_argument(
        "--to", dest="end", help="end: RFC 3339, relative, or now (default: its last window)"
    )
    for option, (variable, default) in ENVIRONMENT.items():
        parser.add_argument(
            "--" + option.replace("_", "-"),
            default=None,
            help=f"[${variable}] (default: {default})",
        )
    parser.add_argument(
        "--detect",
        action="store_true",
        help="run the detectors now instead of reading stored findings (stepwatch.diagnosis)",
    )
    parser.add_argument("--out", required=True, help="the HTML file to write")
    parser.set_defaults(handler=run)


def resolve(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str | None]:
    """Argument > environment variable > default, for every option in ENVIRONMENT."""
    options: dict[str, str | None] = {}
    for option, (variable, default) in ENVIRONMENT.items():
        value = getattr(args, option, None)
        options[option] = value if value is not None else (environ.get(variable) or default)
    return options


def parse_moment(text: str, *, argument: str, now_unix_nano: int) -> int:
    """RFC 3339, ``now``, or ``-6h``/``now-30m`` relative to now, as Unix nanoseconds."""
    value = text.strip()
    if value == "now":
        return now_unix_nano
    relative = _RELATIVE.match(value)
    if relative:
        seconds = float(relative.group(2)) * _UNIT_S[relative.group(3)]
        return now_unix_nano - int(seconds * 1e9)
    from stepwatch.core._diagnosis import parse_time

    try:
        return parse_time(value)
    except ValueError as exc:
        raise ConfigError(
            f"{argument}: {text!r} is neither RFC 3339, 'now', nor relative like -6h"
        ) from exc


def run(args: argparse.Namespace) -> int:
    from stepwatch.core._influx import InfluxClient
    from stepwatch.detectors.report._report import job_extent, write_report

    options = resolve(args, os.environ)
    client = InfluxClient(
        str(options["influx_url"]),
        database=str(options["database"]),
        token=options["token"],
    )
    now = time.time_ns()
    first = last = now
    if args.start is None or args.end is None:
        extent = job_extent(client, args.job)
        if extent is None:
            raise ConfigError(
                f"--job: no data for {args.job!r} in database {client.database!r} at {client.url}"
            )
        first, last = extent
    start = (
        first - 1
        if args.start is None
        else parse_moment(args.start, argument="--from", now_unix_nano=now)
    )
    end = last if args.end is None else parse_moment(args.end, argument="--to", now_unix_nano=now)
    findings = None
    if args.detect:
        detect_job = getattr(importlib.import_module("stepwatch.detectors"), "detect_job", None)
        if detect_job is None:
            raise ConfigError("--detect: stepwatch.detectors.detect_job is not available")
        findings = list(detect_job(client, args.job, start_unix_nano=start, end_unix_nano=end))
    path = write_report(
        client,
        args.job,
        start_unix_nano=start,
        end_unix_nano=end,
        out_path=args.out,
        findings=findings,
    )
    print(path)
    return 0
