"""``stepwatch up`` and ``stepwatch demo`` (standard library only at import)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from stepwatch.app._demo_job import (
    DEMO_FAULT,
    DEMO_FAULT_STEP,
    DEMO_KERNEL_PERIOD_STEPS,
    DEMO_STEPS,
    FAULT_KINDS,
    HANG_FAULTS,
    INSTRUMENTATIONS,
    NO_KERNELS_BY_DEFAULT,
)
from stepwatch.core import settings
from stepwatch.core._durations import parse_duration_s

#: The full detector pass period of `stepwatch up` (hangs are probed more often, see
#: ``settings.HANG_PROBE_INTERVAL_S``).
UP_DETECT_EVERY_S = 30.0


def register(subparsers: Any) -> None:
    up = subparsers.add_parser(
        "up",
        help="run the local stack: managed InfluxDB, OTLP bridge, detectors",
        description="Start a managed influxd (or use --influx-url), the OTLP bridge and the "
        "detector service; print the endpoints; Ctrl-C stops everything.",
    )
    _add_stack_arguments(up)
    up.add_argument(
        "--detect-every",
        default=f"{UP_DETECT_EVERY_S:.0f}s",
        help="detector period, e.g. 30s or 2m; 'off' disables (default 30s; hangs are "
        f"probed every ${settings.HANG_PROBE_INTERVAL_S.variable} seconds, 5 by default)",
    )
    up.set_defaults(handler=_run_up)

    demo = subparsers.add_parser(
        "demo",
        help="run a real 4-rank DDP job that develops a straggler, and diagnose it",
        description="A real PyTorch DDP job (CPU, gloo) instrumented by stepwatch, streamed "
        "through the bridge into a managed InfluxDB, then diagnosed: by default it runs "
        f"healthy for {DEMO_FAULT_STEP} steps, then rank 2 becomes a compute straggler "
        "(its peers only wait for it in the all-reduce). Ends with the finding, its cost and "
        "an HTML report. Another fault with --fault; a healthy run with --fault none.",
    )
    _add_stack_arguments(demo)
    demo.add_argument("--ranks", type=int, default=4, help="number of DDP ranks (default 4)")
    demo.add_argument(
        "--steps", type=int, default=DEMO_STEPS, help=f"training steps (default {DEMO_STEPS})"
    )
    demo.add_argument(
        "--fault",
        default=DEMO_FAULT,
        choices=FAULT_KINDS,
        help=f"inject a real fault into the job (default {DEMO_FAULT}; none: a healthy run)",
    )
    demo.add_argument("--fault-rank", type=int, default=2, help="the faulty rank (default 2)")
    demo.add_argument(
        "--fault-step",
        type=int,
        default=DEMO_FAULT_STEP,
        help=f"the step the fault starts (default {DEMO_FAULT_STEP})",
    )
    demo.add_argument(
        "--fault-factor",
        type=float,
        default=2.0,
        help="fault strength: slowdown factor of the affected work (default 2.0)",
    )
    demo.add_argument(
        "--export-interval",
        type=float,
        default=0.25,
        help="seconds per exported window (default 0.25: a short demo still has many windows)",
    )
    demo.add_argument(
        "--kernels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="collect op histograms with torch.profiler, 5 steps in every "
        f"{DEMO_KERNEL_PERIOD_STEPS} (default on, off for --fault "
        f"{'/'.join(NO_KERNELS_BY_DEFAULT)}; --no-kernels: phases only)",
    )
    demo.add_argument(
        "--phase-sampling",
        type=_phase_sampling,
        default="auto",
        help="auto mode times phases on steps >= 50 ms apart ('auto', the default), 1 step in "
        "N (an integer) or every step (1); the collective wait is timed on every step, and the "
        "detectors know what sampled phases rest on",
    )
    demo.add_argument(
        "--instrumentation",
        choices=INSTRUMENTATIONS,
        default="auto",
        help="how the job's loop is timed: 'auto' (monitor.instrument: the collective wait as "
        "communication) or 'hand' (the README's loop: data, forward, backward, optimizer "
        "phases, the all-reduce inside backward)",
    )
    demo.add_argument(
        "--keep-running",
        action="store_true",
        help="keep the stack up after the demo until Ctrl-C",
    )
    demo.add_argument("--json", action="store_true", help="print diagnoses as JSON lines")
    demo.set_defaults(handler=_run_demo)


def _phase_sampling(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        stride = int(text)
    except ValueError:
        stride = 0
    if stride < 1:
        raise argparse.ArgumentTypeError(f"'auto' or a positive integer, got {text!r}")
    return stride


def _add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="where the managed InfluxDB and the spool live "
        "(default $STEPWATCH_DATA_DIR or ~/.local/share/stepwatch)",
    )
    parser.add_argument(
        "--influx-url",
        default=None,
        help="use this InfluxDB (v1 API) instead of starting one "
        f"(${settings.INFLUX_URL.variable})",
    )
    parser.add_argument(
        "--database",
        default=None,
        help=f"database to write and read (${settings.INFLUX_DATABASE.variable}; "
        f"default {settings.INFLUX_DATABASE.default})",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bridge listen address")
    parser.add_argument("--grpc-port", type=int, default=0, help="OTLP/gRPC port (0: free)")
    parser.add_argument("--http-port", type=int, default=0, help="OTLP/HTTP port (0: free)")


def _stack(args: argparse.Namespace, *, detect_every_s: float | None) -> Any:
    from stepwatch.app._stack import LocalStack, default_data_dir

    environ = os.environ
    # Only an explicitly given InfluxDB replaces the managed one (the default URL would not).
    influx_url, _ = settings.INFLUX_URL.lookup(environ)
    return LocalStack(
        args.data_dir or default_data_dir(),
        influx_url=args.influx_url or influx_url,
        database=settings.INFLUX_DATABASE.resolve(args.database, environ) or "stepwatch",
        influx_token=settings.INFLUX_TOKEN.resolve(None, environ),
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        detect_every_s=detect_every_s,
    )


def _wait_for_signal() -> None:
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def _print_endpoints(stack: Any) -> None:
    influx = stack.influx_url or (stack.influxd.url if stack.influxd else "?")
    print(f"InfluxDB:     {influx}  (database {stack.database})")
    print(f"OTLP/HTTP:    {stack.otlp_http_endpoint}/v1/metrics")
    print(f"OTLP/gRPC:    {stack.otlp_grpc_endpoint}")
    print(f"bridge stats: {stack.otlp_http_endpoint}/metrics")
    print(
        f"point ranks at it: OTEL_EXPORTER_OTLP_ENDPOINT={stack.otlp_http_endpoint}",
        flush=True,
    )


def _run_up(args: argparse.Namespace) -> int:
    every = (
        None
        if args.detect_every == "off"
        else parse_duration_s(args.detect_every, argument="--detect-every")
    )
    with _stack(args, detect_every_s=every) as stack:
        _print_endpoints(stack)
        print("stepwatch up: running; Ctrl-C stops everything", flush=True)
        _wait_for_signal()
    print("stepwatch up: stopped", flush=True)
    return 0


def _hang_demo(stack: Any, config: Any, *, json_lines: bool) -> int:
    """Run a job that hangs until the hang is found, print the finding, kill the job."""
    from stepwatch.app._demo import run_hang_demo

    seen = run_hang_demo(stack.client, config)
    if seen.finding is None:
        print("diagnosis: no hang found within the time allowed")
        return 1
    after = "" if seen.found_after_s is None else f" {seen.found_after_s:.1f} s after it began"
    print(f"diagnosis: the hang was found{after}:")
    finding = seen.finding
    print(finding.to_json() if json_lines else f"  [{finding.severity}] hang: {finding.summary}")
    if seen.closed is not None:
        print("  the job was killed and the finding closed (the job ended)")
    print(
        f'  InfluxQL: SELECT * FROM "stepwatch.diagnosis" '
        f"WHERE \"stepwatch.job.id\" = '{config.job_id}'  (database {stack.database})"
    )
    sys.stdout.flush()
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from stepwatch.app._demo import (
        by_cost,
        closing_lines,
        format_summary,
        intro,
        median_step_s,
        run_demo_job,
        write_outputs,
    )
    from stepwatch.app._demo_job import DemoJobConfig, kernels_by_default
    from stepwatch.detectors.frame import job_time_range

    job = f"demo-{args.fault}-{time.strftime('%Y%m%d-%H%M%S')}"
    hangs = args.fault in HANG_FAULTS
    # A job that hangs never finishes: the detector service finds it live, as under `up`.
    with _stack(args, detect_every_s=UP_DETECT_EVERY_S if hangs else None) as stack:
        _print_endpoints(stack)
        config = DemoJobConfig(
            job_id=job,
            world_size=args.ranks,
            steps=args.steps,
            fault=args.fault,
            fault_rank=args.fault_rank,
            fault_step=args.fault_step,
            fault_factor=args.fault_factor,
            endpoint=stack.otlp_http_endpoint,
            export_interval_s=args.export_interval,
            collect_kernels=kernels_by_default(args.fault)
            if args.kernels is None
            else args.kernels,
            phase_sampling=args.phase_sampling,
            instrumentation=args.instrumentation,
        )
        if hangs:
            return _hang_demo(stack, config, json_lines=args.json)
        told = intro(config)
        if told:
            print(told)
        summary = run_demo_job(stack.client, config)
        print(format_summary(summary, steps=args.steps))
        out_dir = stack.data_dir / "reports"
        out_dir.mkdir(parents=True, exist_ok=True)
        start_unix_nano, end_unix_nano = job_time_range(stack.client, job) or (
            time.time_ns() - 600_000_000_000,
            time.time_ns(),
        )
        diagnoses, report = write_outputs(
            stack.client,
            job,
            out_dir=out_dir,
            start_unix_nano=start_unix_nano - 1_000_000_000,
            end_unix_nano=end_unix_nano + 1_000_000_000,
        )
        diagnoses = by_cost(list(diagnoses))
        print(
            f"diagnosis ({len(diagnoses)} finding{'s' if len(diagnoses) != 1 else ''}"
            + (", most costly first):" if len(diagnoses) > 1 else "):")
        )
        for diagnosis in diagnoses:
            print(
                diagnosis.to_json()
                if args.json
                else f"  [{diagnosis.severity}] {diagnosis.kind}: {diagnosis.summary}"
            )
        print(
            f'InfluxQL: SELECT * FROM "stepwatch.phase.duration" '
            f"WHERE \"stepwatch.job.id\" = '{job}'  (database {stack.database})"
        )
        print()
        for line in closing_lines(
            config, diagnoses, report=report, median_step=median_step_s(stack.client, job)
        ):
            print(line)
        if args.keep_running:
            print("stack still running; Ctrl-C stops it", flush=True)
            _wait_for_signal()
    sys.stdout.flush()
    return 0
