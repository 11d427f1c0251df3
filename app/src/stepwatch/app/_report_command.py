"""``stepwatch report``: write the self-contained HTML report of one job.

Imports only the standard library and stepwatch.core at module level (``stepwatch --help``
stays fast); configuration precedence: command-line argument > environment variable >
default (:mod:`stepwatch.core.settings`).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from stepwatch.app._influx_options import add_influx_arguments, influx_client
from stepwatch.app._times import parse_moment
from stepwatch.core._errors import ConfigError


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
    add_influx_arguments(parser)
    parser.add_argument(
        "--detect",
        action="store_true",
        help="run the detectors now instead of reading stored findings (stepwatch.diagnosis)",
    )
    parser.add_argument("--out", required=True, help="the HTML file to write")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from stepwatch.detectors import detect_job, write_report
    from stepwatch.detectors.frame import job_time_range

    client = influx_client(args, os.environ)
    now = time.time_ns()
    first = last = now
    if args.start is None or args.end is None:
        span = job_time_range(client, args.job)
        if span is None:
            raise ConfigError(
                f"--job: no data for {args.job!r} in database {client.database!r} at {client.url}"
            )
        first, last = span
    start = (
        first
        if args.start is None
        else parse_moment(args.start, argument="--from", now_unix_nano=now)
    )
    end = last if args.end is None else parse_moment(args.end, argument="--to", now_unix_nano=now)
    findings = None
    if args.detect:
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
