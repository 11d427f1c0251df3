"""``stepwatch detect``, ``stepwatch simulate`` and ``stepwatch evaluate``.

Only the standard library is imported here; numpy, statsmodels and the OTel SDK are imported
by the handlers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from stepwatch.app._influx_options import add_influx_arguments, influx_client
from stepwatch.app._times import parse_moment
from stepwatch.core import settings
from stepwatch.core._diagnosis import format_time
from stepwatch.core._durations import parse_duration_s

if TYPE_CHECKING:
    from stepwatch.core._influx import InfluxClient
    from stepwatch.core.settings import Setting
    from stepwatch.detectors import TruthFault


def fault_summary(fault: TruthFault) -> str:
    """One line describing an injected fault (``stepwatch simulate`` output)."""
    where = ",".join(str(r) for r in fault.ranks[:8]) or "all ranks"
    if len(fault.ranks) > 8:
        where += ",..."
    return (
        f"{fault.kind} x{fault.severity:.2f} on {where} from {format_time(fault.start_unix_nano)}"
        f" (costs the job {fault.slowdown:.2f}x step time)"
    )


def _extra_sinks(args: argparse.Namespace, client: InfluxClient) -> list[Any]:
    """Alertmanager and Grafana sinks from the arguments, else the environment."""
    from stepwatch.detectors.sinks import sinks_from_environment

    return list(
        sinks_from_environment(
            os.environ,
            state_client=client,
            alertmanager_url=args.alertmanager_url,
            grafana_url=args.grafana_url,
            dashboard_url=args.dashboard_url,
        )
    )


def _variables(*settings_used: Setting[str]) -> str:
    """``env A or B, C`` for a help text."""
    return "env " + ", ".join(" or ".join(setting.variables) for setting in settings_used)


def _detect(args: argparse.Namespace) -> int:
    from stepwatch.core._errors import ConfigError
    from stepwatch.detectors import IncrementalDetector, JsonLinesSink, detect_job
    from stepwatch.detectors.frame import job_time_range
    from stepwatch.detectors.sinks import format_table

    client = influx_client(args, os.environ)
    window_s = None if args.window is None else parse_duration_s(args.window, argument="--window")
    if args.every is not None:
        interval_s = parse_duration_s(args.every, argument="--every")
        lookback_s = parse_duration_s(args.lookback, argument="--lookback")
        detector = IncrementalDetector(
            client,
            args.job,
            sinks=_extra_sinks(args, client),
            window_s=window_s,
            lookback_s=lookback_s,
        )
        # Only changes are printed (opened, then closed), so a restarted runner, which finds
        # its open findings in InfluxDB, never prints one twice.
        printer = JsonLinesSink(sys.stdout, json_lines=args.json)
        passes = 0
        while True:
            result = detector.run_pass()
            printer.publish([*result.opened, *result.closed])
            passes += 1
            if args.passes is not None and passes >= args.passes:
                return 0
            time.sleep(interval_s)  # the pass cadence itself, not waiting for a server
    now = time.time_ns()
    if args.since is not None and (args.start is not None or args.end is not None):
        raise ConfigError("--since: use either --since or --from/--to")
    if args.start is not None:
        start = parse_moment(args.start, argument="--from", now_unix_nano=now)
        end = (
            now if args.end is None else parse_moment(args.end, argument="--to", now_unix_nano=now)
        )
    else:
        since_s = parse_duration_s(args.since or "15m", argument="--since")
        start, end = now - round(since_s * 1e9), now
    if end <= start:
        raise ConfigError("--to: must be after --from")
    # The frame spans the job's data, not the request; a job without data in the range
    # is said so (a typo in --job must not read as "healthy").
    span = job_time_range(client, args.job)
    if span is None:
        print(f"no data stored for job {args.job!r}", file=sys.stderr)
        return 1
    if span[1] < start or span[0] > end:
        print(
            f"no data for job {args.job!r} between {format_time(start)} and {format_time(end)} "
            f"(its data spans {format_time(span[0])} to {format_time(span[1])})",
            file=sys.stderr,
        )
        return 1
    diagnoses = detect_job(
        client, args.job, start_unix_nano=start, end_unix_nano=end, window_s=window_s
    )
    if args.json:
        for diagnosis in diagnoses:
            print(diagnosis.to_json())
    elif diagnoses:
        print(format_table(diagnoses))
    else:
        print(f"no findings for job {args.job!r}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from stepwatch.app._replay import send_otlp, write_direct
    from stepwatch.core._errors import ConfigError
    from stepwatch.detectors import Fault, Topology, simulate

    topology = Topology.parse(args.topology) if args.topology else Topology(args.ranks)
    if topology.world_size != args.ranks:
        raise ConfigError(
            f"--topology: {args.topology} has {topology.world_size} ranks, not {args.ranks}"
        )
    faults = [Fault.parse(text) for text in args.fault or ()]
    step_s = args.step_time
    window_ns = round(args.steps_per_window * step_s * 1e9)
    if args.start == "now":
        n_windows = -(-args.steps // args.steps_per_window)
        start = (time.time_ns() // window_ns - n_windows) * window_ns
    else:
        start = parse_moment(args.start, argument="--start", now_unix_nano=time.time_ns())
    stage_work = None
    if args.stage_work:
        try:
            stage_work = [float(value) for value in args.stage_work.split(",")]
        except ValueError as exc:
            raise ConfigError(f"--stage-work: {args.stage_work!r} is not numbers") from exc
    job = simulate(
        args.ranks,
        steps=args.steps,
        topology=topology,
        faults=faults,
        seed=args.seed,
        job=args.job,
        steps_per_window=args.steps_per_window,
        step_s=step_s,
        start_unix_nano=start,
        kernel_classes=args.kernel_classes,
        sequence_noise=args.sequence_noise,
        microbatches=args.microbatches,
        stage_work=stage_work,
        gc_rate=args.gc_rate,
        checkpoint_every=args.checkpoint_every,
        communication_phase=args.producer == "stepwatch",
        device_metrics=args.producer != "phase-timer",
    )
    if args.truth:
        job.truth.write(args.truth)
    if args.endpoint:
        sent = send_otlp(job, args.endpoint)
        print(f"sent {sent} OTLP exports of job {args.job!r} to {args.endpoint}")
    elif args.write_direct:
        client = influx_client(args, os.environ)
        client.create_database()
        points = write_direct(job, client)
        print(f"wrote {points} points of job {args.job!r} to {client.url} db {client.database}")
    else:
        print("nothing sent (use --write-direct or --endpoint URL)")
    for fault in job.truth.faults:
        print(f"  injected {fault_summary(fault)}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from stepwatch.core._diagnosis import Diagnosis
    from stepwatch.core._errors import ConfigError
    from stepwatch.detectors import Truth, detect_job_findings, score

    truth = Truth.read(args.truth)
    detected: dict[str, int] | None = None
    if args.diagnoses:
        try:
            with open(args.diagnoses, encoding="utf-8") as handle:
                diagnoses = [
                    Diagnosis.from_json_dict(json.loads(line)) for line in handle if line.strip()
                ]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"--diagnoses: cannot read {args.diagnoses}: {exc}") from exc
    else:
        findings = detect_job_findings(
            influx_client(args, os.environ),
            args.job or truth.job,
            start_unix_nano=truth.start_unix_nano,
            end_unix_nano=truth.end_unix_nano,
        )
        diagnoses = [finding.diagnosis for finding in findings]
        detected = {f.diagnosis.finding_id: f.detected_unix_nano for f in findings}
    result = score(truth, diagnoses, detected_unix_nano=detected)
    if args.json:
        print(json.dumps(result.to_json_dict()))
    else:
        for item in result.faults:
            latency = "n/a" if item.latency_windows is None else f"{item.latency_windows:.0f}"
            error = "n/a" if item.cost_error is None else f"{item.cost_error:+.1%}"
            print(
                f"{item.fault.kind:<18} detected={item.detected!s:<5} kind={item.right_kind!s:<5} "
                f"localised={item.localised!s:<5} latency_windows={latency} "
                f"cost={item.fault.slowdown:.2f}x cost_error={error}"
            )
        print(f"false alarms: {len(result.false_alarms)}")
        for alarm in result.false_alarms:
            print(f"  {alarm.kind}: {alarm.summary}")
    ok = all(item.localised for item in result.faults) and not result.false_alarms
    return 0 if ok else 3


def register(subparsers: Any) -> None:
    """Add ``detect``, ``simulate`` and ``evaluate`` to the ``stepwatch`` command."""
    detect = subparsers.add_parser(
        "detect", help="diagnose a job (one shot, or incrementally with --every)"
    )
    detect.add_argument("--job", required=True, help="stepwatch.job.id to analyse")
    detect.add_argument("--from", dest="start", help="range start (RFC 3339, now-1h, -1h)")
    detect.add_argument("--to", dest="end", help="range end (default now)")
    detect.add_argument("--since", help="range = the last DURATION (default 15m)")
    detect.add_argument("--json", action="store_true", help="JSON (docs/schema.md), one per line")
    detect.add_argument("--window", help="analysis window (default: the export window)")
    detect.add_argument("--every", help="run incrementally every DURATION (e.g. 30s)")
    detect.add_argument("--lookback", default="30m", help="range re-read each pass (--every)")
    detect.add_argument("--passes", type=int, help="stop after N passes (--every)")
    detect.add_argument(
        "--alertmanager-url", help=f"post alerts ({_variables(settings.ALERTMANAGER_URL)})"
    )
    detect.add_argument(
        "--grafana-url",
        help=f"post annotations ({_variables(settings.GRAFANA_URL, settings.GRAFANA_TOKEN)})",
    )
    detect.add_argument(
        "--dashboard-url", help=f"link put in alerts ({_variables(settings.DASHBOARD_URL)})"
    )
    add_influx_arguments(detect)
    detect.set_defaults(handler=_detect)

    sim = subparsers.add_parser("simulate", help="simulate a job with injected faults")
    sim.add_argument("--ranks", type=int, required=True)
    sim.add_argument("--steps", type=int, default=400)
    sim.add_argument("--topology", help="DPxTPxPP (default RANKSx1x1)")
    sim.add_argument(
        "--fault",
        action="append",
        help="KIND@STEP:RANKS[:SEVERITY][:PHASE], e.g. compute_straggler@200:17:1.3, "
        "jit_stall@100:3:2:outside (a stall between phases) (repeatable)",
    )
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--job", default="sim")
    sim.add_argument("--steps-per-window", type=int, default=5)
    sim.add_argument("--step-time", type=float, default=1.0, help="nominal step seconds")
    sim.add_argument("--kernel-classes", type=int, default=8)
    sim.add_argument(
        "--sequence-noise", type=float, default=0.05, help="log-sd of each replica's step work"
    )
    sim.add_argument("--microbatches", type=int, default=8, help="1F1B micro-batches per step")
    sim.add_argument(
        "--stage-work", help="relative work of each pipeline stage, e.g. 1.05,1,1,1.07"
    )
    sim.add_argument(
        "--gc-rate", type=float, default=0.0, help="chance per rank and step of a GC pause"
    )
    sim.add_argument(
        "--checkpoint-every", type=int, default=0, help="steps between checkpoint pauses"
    )
    sim.add_argument(
        "--producer",
        choices=("stepwatch", "backward-timer", "phase-timer"),
        default="stepwatch",
        help="what records the job: stepwatch's exporter (a communication phase, device "
        "metrics), a timer around loss.backward() (the all-reduce inside backward), or phase "
        "times only (no kernels, idle or clock)",
    )
    sim.add_argument("--start", default="now", help="first window start (default: ends now)")
    target = sim.add_mutually_exclusive_group()
    target.add_argument("--write-direct", action="store_true", help="write to InfluxDB directly")
    target.add_argument("--endpoint", help="send OTLP/HTTP to this bridge or collector URL")
    sim.add_argument("--truth", help="write the ground truth JSON here")
    add_influx_arguments(sim)
    sim.set_defaults(handler=_simulate)

    evaluate = subparsers.add_parser("evaluate", help="score diagnoses against a truth file")
    evaluate.add_argument("--truth", required=True)
    evaluate.add_argument("--diagnoses", help="JSON lines from `stepwatch detect --json`")
    evaluate.add_argument("--job", help="detect over the truth's range instead (default: its job)")
    evaluate.add_argument("--json", action="store_true")
    add_influx_arguments(evaluate)
    evaluate.set_defaults(handler=_evaluate)
