"""CPU and wall time of one window's export, SDK OTLP/HTTP exporter vs OtlpHttpExporter.

The export thread of every rank builds one window per export interval and sends it; its CPU
holds the GIL and, on busy cores, comes out of the training step. This bench measures, per
window and per stage, the CPU time of the exporting thread (``time.thread_time``: the receiver
runs in this process, so ``process_time`` would charge its work to the exporter) and the wall
time, against the real stepwatch bridge (``stepwatch.otel_bridge.Bridge`` with a counting
writer, as ``bench/overhead.py`` runs it), for two realistic windows at the monitor's defaults:

- ``phases``: ``--steps-per-window`` steps x 5 phases (what a CPU rank without op histograms
  sends each interval). By default the steps one ``--interval-s`` (10 s, the default export
  interval) holds at ``--step-ms`` (26 ms, the bench's step, drawn +-10 %): 385;
- ``kernels``: the same plus 20 kernel classes x ``--kernel-executions`` each (by default 30
  per second of the interval: 300).

At the end, per window type: the CPU of build + export per window, per second of training at
the interval (per window / interval), and that as a share of a busy rank (one core: every
millisecond of export-thread CPU per second is 0.1 % of the rank's time), SDK against lean.

Stages: ``build`` (WindowBuilder fill + build of the SDK ``MetricsData``, the steps added in
one ``add_steps`` as the monitor does; the same code in both columns), ``build-1by1`` (the
SDK column: the steps added one ``add_step`` each, as before issue 15; the lean column:
``build`` again, interleaved), ``encode`` (SDK: ``encode_metrics`` + ``SerializeToString``;
lean: its direct protobuf writer, byte-identical), ``compress`` (SDK: ``GzipFile`` level 9;
lean: zlib level 6) and ``post``, then the whole ``export`` call (encode + compress + POST).
Also prints the bytes on the wire per compression level.

Then the histogram recording itself (``ExponentialHistogram.record_many``/``record_weighted``,
most of ``add_steps``' and ``add_kernels``' CPU), C loops (``_fasthist``) vs the Python loops,
side by side in the same run on the same values: 55 step durations (~20 ms), 6 phases (one
weighted, as auto mode's sampled phases), 20 kernel classes x 200 durations (1 us - 1 ms);
and the pass over a window's finished steps (``window_values``), C (``_fastrecord``) vs Python.

Usage: ``.venv/bin/python bench/export_cost.py [--windows 300] [--compression gzip]
[--interval-s 10] [--step-ms 26] [--steps-per-window N] [--kernel-executions N]
[--recording-only]``
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import io
import random
import statistics
import time
import zlib
from collections.abc import Callable
from typing import Any

# bench/ is sys.path[0] when this runs as a script: the same counting writer as overhead.py.
from overhead import CountingWriter

PHASES = ("data", "forward", "backward", "optimizer", "communication")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What one window holds: the export interval, its steps, its kernel executions."""

    interval_s: float = 10.0
    step_s: float = 0.026
    steps: int = 385
    kernel_executions: int = 300


def _window_values(rng: random.Random, kernel_classes: int, shape: Shape) -> tuple[list[Any], Any]:
    """One window's measurements, drawn once (the bench times aggregation, not the RNG)."""
    from stepwatch.exporters import KernelWindow

    steps = [
        (
            shape.step_s * rng.uniform(0.9, 1.1),
            {phase: rng.uniform(0.0005, 0.01) for phase in PHASES},
        )
        for _ in range(shape.steps)
    ]
    kernels = KernelWindow(
        {
            (f"aten::op{k}", "compute"): [
                rng.uniform(1e-6, 1e-4) for _ in range(shape.kernel_executions)
            ]
            for k in range(kernel_classes)
        }
    )
    return steps, kernels if kernel_classes else None


def _fill(builder: Any, steps: list[Any], kernels: Any, *, batched: bool = True) -> None:
    """What the monitor does with a window's steps: one ``add_steps`` (``batched=False``: one
    ``add_step`` per step, as it did before issue 15)."""
    if batched:
        phases: dict[str, list[float]] = {}
        for _, phases_s in steps:
            for name, seconds in phases_s.items():
                phases.setdefault(name, []).append(seconds)
        durations = [duration_s for duration_s, _ in steps]
        builder.add_steps(last_step_index=len(steps) - 1, durations_s=durations, phases_s=phases)
    else:
        for index, (duration_s, phases_s) in enumerate(steps):
            builder.add_step(step_index=index, duration_s=duration_s, phases_s=phases_s)
    if kernels is not None:
        builder.add_kernels(kernels)


def _measure(function: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Mean thread CPU and median wall per call, in microseconds."""
    walls: list[float] = []
    cpu_start = time.thread_time()
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        walls.append(time.perf_counter() - start)
    cpu = (time.thread_time() - cpu_start) / repeat
    return cpu * 1e6, statistics.median(walls) * 1e6


def _compare(
    sdk_call: Callable[[], Any], lean_call: Callable[[], Any], repeat: int, rounds: int = 5
) -> tuple[float, float, float, float]:
    """Both arms in alternating blocks (the machine is shared); medians over the blocks."""
    sdk: list[tuple[float, float]] = []
    lean: list[tuple[float, float]] = []
    block = max(repeat // rounds, 1)
    for _ in range(rounds):
        sdk.append(_measure(sdk_call, block))
        lean.append(_measure(lean_call, block))
    return (
        statistics.median(c for c, _ in sdk),
        statistics.median(w for _, w in sdk),
        statistics.median(c for c, _ in lean),
        statistics.median(w for _, w in lean),
    )


def _recording_values(rng: random.Random) -> tuple[list[list[float]], Any, list[list[float]]]:
    """A realistic window for the recording comparison: steps and phases, one weighted phase
    (values, weights), kernel classes."""
    steps = [0.020 * rng.uniform(0.9, 1.1) for _ in range(55)]
    phases = [[rng.uniform(0.0005, 0.008) for _ in range(55)] for _ in range(5)]
    sampled = [rng.uniform(0.0005, 0.008) for _ in range(14)]
    weighted = (sampled, [rng.choice((3, 4, 5)) for _ in sampled])
    kernels = [[10 ** rng.uniform(-6.0, -3.0) for _ in range(200)] for _ in range(20)]
    return [steps, *phases], weighted, kernels


def _recording_paths(rng: random.Random, repeat: int, shape: Shape) -> None:
    """C vs Python recording loops on the same window, alternating blocks; prints both."""
    from stepwatch.exporters import _histogram
    from stepwatch.exporters._histogram import ExponentialHistogram

    many, (values, weights), kernels = _recording_values(rng)

    def steps_phases() -> None:  # add_steps: 7 histograms (fresh per window, as the builder's)
        for durations in many:
            ExponentialHistogram().record_many(durations)
        ExponentialHistogram().record_weighted(values, weights)

    def kernel_classes() -> None:  # add_kernels: 20 histograms
        for durations in kernels:
            ExponentialHistogram().record_many(durations)

    fast = _histogram._fasthist
    if fast is None:
        print("histogram recording: the C extension (_fasthist) is not built; nothing to compare")
        return

    def python_path(call: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            _histogram._fasthist = None
            try:
                call()
            finally:
                _histogram._fasthist = fast

        return run

    print()
    print("histogram recording per window, C loops vs Python loops (thread CPU, us; medians of")
    print("5 alternating blocks)")
    header = f"{'part':14} {'calls':>5} {'values':>6} {'C us':>8} {'Python us':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    parts = (
        ("steps+phases", steps_phases, len(many) + 1, sum(map(len, many)) + len(values)),
        ("kernels", kernel_classes, len(kernels), sum(map(len, kernels))),
    )
    for name, call, calls, count in parts:
        python_cpu, _, c_cpu, _ = _compare(python_path(call), call, repeat)
        print(
            f"{name:14} {calls:5} {count:6} {c_cpu:8.1f} {python_cpu:9.1f} "
            f"{python_cpu / c_cpu:5.1f}x"
        )
    print("(per call: divide by calls; identical results: tests/exporters/test_histogram_fast.py)")
    _step_pass(rng, repeat)
    _point_encoding(rng, repeat, python_path, shape)


def _point_encoding(
    rng: random.Random,
    repeat: int,
    python_path: Callable[[Callable[[], None]], Callable[[], None]],
    shape: Shape,
) -> None:
    """The lean encoder on the kernels window: its exponential points written in C
    (``_fasthist.exponential_point``) vs in Python, side by side (the same bytes)."""
    from stepwatch.exporters._otlp_protobuf import RequestEncoder
    from stepwatch.exporters._window import WindowBuilder, build_resource

    steps, kernels = _window_values(rng, 20, shape)
    builder = WindowBuilder(build_resource(job_id="bench", rank=0, world_size=2))
    _fill(builder, steps, kernels)
    window = builder.build(start_unix_nano=1_000, end_unix_nano=2_000)
    encoder = RequestEncoder()
    points = sum(
        len(metric.data.data_points)
        for metric in window.resource_metrics[0].scope_metrics[0].metrics
    )

    def encode() -> None:
        encoder.encode(window)

    assert python_path(lambda: None) is not None
    c_bytes = encoder.encode(window)
    slow: list[bytes | None] = []
    python_path(lambda: slow.append(encoder.encode(window)))()
    assert slow == [c_bytes], "the C and Python point writers disagree"
    python_cpu, _, c_cpu, _ = _compare(python_path(encode), encode, repeat)
    print(
        f"{'encode':14} {1:5} {points:6} {c_cpu:8.1f} {python_cpu:9.1f} "
        f"{python_cpu / c_cpu:5.1f}x   (the kernels window's {points} points, one request)"
    )


def _step_pass(rng: random.Random, repeat: int) -> None:
    """``window_values`` over 55 finished steps (explicit steps with two phases, auto mode at
    stride 8): the C pass (``_fastrecord.host_values``) vs the Python loop, side by side."""
    from stepwatch.exporters import _recorder

    fast = _recorder.FAST_RECORDER
    if fast is None:
        print("step pass: the C extension (_fastrecord) is not built; nothing to compare")
        return
    records: list[Any] = []
    now = 10**12
    for index in range(55):
        step = int(0.020e9 * rng.uniform(0.9, 1.1))
        phases = {"data": step // 10, "compute": step // 2}
        auto = {"forward": step // 3, "backward": step // 2} if index % 8 == 0 else None
        records.append((index, now, now + step, phases, None, auto or _recorder.UNSAMPLED))
        now += step

    def c_pass() -> None:
        _recorder.window_values(records, None, 16, 0)

    def python_pass() -> None:
        _recorder.FAST_RECORDER = None
        try:
            _recorder.window_values(records, None, 16, 0)
        finally:
            _recorder.FAST_RECORDER = fast

    python_cpu, _, c_cpu, _ = _compare(python_pass, c_pass, repeat)
    print(
        f"{'step pass':14} {1:5} {len(records):6} {c_cpu:8.1f} {python_cpu:9.1f} "
        f"{python_cpu / c_cpu:5.1f}x   (window_values: 55 steps, 2 phases, auto at stride 8)"
    )


def _sdk_gzip(body: bytes) -> bytes:
    """What the SDK HTTP exporter does for gzip (GzipFile, level 9)."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="w") as stream:
        stream.write(body)
    return buffer.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=300, help="repetitions per figure")
    parser.add_argument("--compression", default="gzip", choices=("none", "gzip", "deflate"))
    parser.add_argument(
        "--interval-s",
        type=float,
        default=10.0,
        help="export interval the window stands for (default 10: the monitor's default)",
    )
    parser.add_argument(
        "--step-ms", type=float, default=26.0, help="mean step time (default 26, drawn +-10 %%)"
    )
    parser.add_argument(
        "--steps-per-window",
        type=int,
        default=None,
        help="steps in a window (default: what --interval-s holds at --step-ms: 385)",
    )
    parser.add_argument(
        "--kernel-executions",
        type=int,
        default=None,
        help="executions per kernel class per window (default: 30 per second of the interval)",
    )
    parser.add_argument(
        "--recording-only", action="store_true", help="only the C vs Python recording figures"
    )
    args = parser.parse_args()
    shape = _shape(parser, args)
    if args.recording_only:
        _recording_paths(random.Random(20261122), args.windows, shape)
        return

    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    from stepwatch.exporters import OtlpHttpExporter, WindowBuilder, build_resource
    from stepwatch.otel_bridge import Bridge

    writer = CountingWriter()
    bridge = Bridge(writer, grpc_port=None, http_port=0).start()
    endpoint = f"http://127.0.0.1:{bridge.http_port}/v1/metrics"
    sdk = OTLPMetricExporter(
        endpoint=endpoint, timeout=10.0, compression=Compression(args.compression)
    )
    lean = OtlpHttpExporter(endpoint, compression=args.compression, environ={})
    repeat = args.windows
    rng = random.Random(20261122)
    resource = build_resource(job_id="bench", rank=0, world_size=2, host_name="bench")
    rows: list[tuple[str, str, float, float, float, float]] = []
    sizes: list[tuple[str, dict[str, int]]] = []
    span_ns = int(shape.interval_s * 1e9)  # a window's time span
    try:
        for label, kernel_classes in (("phases", 0), ("kernels", 20)):
            builder = WindowBuilder(resource)

            steps, kernels = _window_values(rng, kernel_classes, shape)

            def build(builder: Any = builder, steps: Any = steps, kernels: Any = kernels) -> Any:
                _fill(builder, steps, kernels)
                now = time.time_ns()
                return builder.build(start_unix_nano=now - span_ns, end_unix_nano=now)

            for _ in range(20):
                build()
            window = build()
            request = encode_metrics(window)
            raw = request.SerializeToString()
            sdk_body = sdk._client._compress(raw)  # the SDK's own compression path
            lean_body = lean.compress(raw)
            for _ in range(20):  # warm both connections
                sdk.export(window)
                lean.export(window)

            def stage(
                name: str,
                sdk_call: Callable[[], Any],
                lean_call: Callable[[], Any],
                label: str = label,
            ) -> None:
                sdk_cpu, sdk_wall, lean_cpu, lean_wall = _compare(sdk_call, lean_call, repeat)
                rows.append((label, name, sdk_cpu, sdk_wall, lean_cpu, lean_wall))

            stage("build", build, build)

            def build_per_step(
                builder: Any = builder, steps: Any = steps, kernels: Any = kernels
            ) -> Any:
                _fill(builder, steps, kernels, batched=False)
                now = time.time_ns()
                return builder.build(start_unix_nano=now - span_ns, end_unix_nano=now)

            # Before/after of the batched fill, interleaved (both columns: the same builder).
            stage("build-1by1", build_per_step, build)
            stage(
                "encode",
                lambda w=window: encode_metrics(w).SerializeToString(),
                lambda w=window: lean.serialize(w),
            )
            stage(
                "compress",
                lambda r=raw: sdk._client._compress(r),
                lambda r=raw: lean.compress(r),
            )
            stage(
                "post",
                lambda b=sdk_body: sdk._client._submit(b, 10.0),
                lambda b=lean_body: lean.export_body(b),
            )
            stage("export", lambda w=window: sdk.export(w), lambda w=window: lean.export(w))

            by_level = {"none": len(raw)}
            for level in (1, 6, 9):
                compressor = zlib.compressobj(level, zlib.DEFLATED, 31)
                by_level[f"gzip-{level}"] = len(compressor.compress(raw) + compressor.flush())
                by_level[f"gzip-{level}-us"] = round(
                    _measure(lambda lv=level, r=raw: zlib.compress(r, lv, wbits=31), repeat)[0]
                )
            by_level["sdk-gzip(9)"] = len(_sdk_gzip(raw))
            by_level["deflate-6"] = len(zlib.compress(raw, 6))
            sizes.append((label, by_level))
    finally:
        sdk.shutdown()
        lean.shutdown()
        bridge.stop()

    print(
        f"compression={args.compression}, {repeat} windows per figure, receiver: stepwatch "
        f"bridge ({writer.lines} line-protocol points converted)"
    )
    print(
        f"window: {shape.steps} steps of {shape.step_s * 1e3:.0f} ms (+-10 %) x "
        f"{len(PHASES)} phases, one per {shape.interval_s:g} s; kernels: 20 classes x "
        f"{shape.kernel_executions} executions"
    )
    print(
        "CPU = time.thread_time of the exporting thread per call, wall = median per call (medians\n"
        "of 5 alternating blocks per arm); microseconds"
    )
    header = (
        f"{'window':8} {'stage':10} {'SDK cpu':>9} {'SDK wall':>9} {'lean cpu':>9} {'lean wall':>9}"
    )
    print(header)
    print("-" * len(header))
    for label, name, sdk_cpu, sdk_wall, lean_cpu, lean_wall in rows:
        print(
            f"{label:8} {name:10} {sdk_cpu:9.0f} {sdk_wall:9.0f} {lean_cpu:9.0f} {lean_wall:9.0f}"
        )
    _per_second(rows, shape)
    print()
    print("bytes on the wire per window (gzip-N-us: zlib CPU time for that level)")
    for label, by_level in sizes:
        print(f"{label:8} " + ", ".join(f"{key}={value}" for key, value in by_level.items()))
    _recording_paths(random.Random(20261122), repeat, shape)


def _per_second(rows: list[tuple[str, str, float, float, float, float]], shape: Shape) -> None:
    """Build + export CPU per window, per second of training, and as a share of a busy rank."""
    print()
    print(
        f"build+export CPU at one window per {shape.interval_s:g} s (per second = per window / "
        "interval; share = of one busy rank's core)"
    )
    for label in dict.fromkeys(r[0] for r in rows):
        total = {r[1]: r for r in rows if r[0] == label}
        sdk_total = total["build"][2] + total["export"][2]
        lean_total = total["build"][4] + total["export"][4]
        sdk_s, lean_s = sdk_total / shape.interval_s, lean_total / shape.interval_s
        print(
            f"{label:8} per window: SDK {sdk_total:6.0f} us, lean {lean_total:6.0f} us "
            f"({sdk_total / lean_total:.1f}x); per second: SDK {sdk_s:5.0f} us "
            f"({sdk_s / 1e4:.3f} %), lean {lean_s:5.0f} us ({lean_s / 1e4:.3f} %); "
            f"saved {sdk_s - lean_s:4.0f} us/s ({(sdk_s - lean_s) / 1e4:.3f} % of the rank)"
        )
        sdk_send = total["export"][2] - total["encode"][2] - total["compress"][2]
        lean_send = total["export"][4] - total["encode"][4] - total["compress"][4]
        print(
            f"{'':8} of which sending (export - encode - compress): SDK {sdk_send:5.0f} us, "
            f"lean {lean_send:5.0f} us per window"
        )


def _shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Shape:
    """The window the options describe; a bad value is a usage error naming the option."""
    if not args.interval_s > 0:
        parser.error(f"--interval-s must be positive, got {args.interval_s}")
    if not args.step_ms > 0:
        parser.error(f"--step-ms must be positive, got {args.step_ms}")
    step_s = args.step_ms / 1e3
    steps = args.steps_per_window
    if steps is None:
        steps = max(round(args.interval_s / step_s), 1)
    elif steps < 1:
        parser.error(f"--steps-per-window must be at least 1, got {steps}")
    executions = args.kernel_executions
    if executions is None:
        executions = max(round(30 * args.interval_s), 1)
    elif executions < 1:
        parser.error(f"--kernel-executions must be at least 1, got {executions}")
    if args.windows < 1:
        parser.error(f"--windows must be at least 1, got {args.windows}")
    return Shape(args.interval_s, step_s, steps, executions)


if __name__ == "__main__":
    main()
