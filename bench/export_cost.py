"""CPU and wall time of one window's export, SDK OTLP/HTTP exporter vs OtlpHttpExporter.

The export thread of every rank builds one window per second and sends it; its CPU holds the
GIL and, on busy cores, comes out of the training step. This bench measures, per window and
per stage, the CPU time of the exporting thread (``time.thread_time``: the receiver runs in
this process, so ``process_time`` would charge its work to the exporter) and the wall time,
against the real stepwatch bridge (``stepwatch.otel_bridge.Bridge`` with a counting writer, as
``bench/overhead.py`` runs it), for two realistic windows:

- ``phases``: 46 steps x 5 phases (what a CPU rank without op histograms sends each second);
- ``kernels``: the same plus 20 kernel classes x 30 executions.

Stages: ``build`` (WindowBuilder fill + build of the SDK ``MetricsData``, the steps added in
one ``add_steps`` as the monitor does; the same code in both columns), ``build-1by1`` (the
SDK column: the steps added one ``add_step`` each, as before issue 15; the lean column:
``build`` again, interleaved), ``encode`` (SDK: ``encode_metrics`` + ``SerializeToString``;
lean: its direct protobuf writer, byte-identical), ``compress`` (SDK: ``GzipFile`` level 9;
lean: zlib level 6) and ``post``, then the whole ``export`` call (encode + compress + POST).
Also prints the bytes on the wire per compression level.

Usage: ``.venv/bin/python bench/export_cost.py [--windows 300] [--compression gzip]``
"""

from __future__ import annotations

import argparse
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


def _window_values(rng: random.Random, kernel_classes: int) -> tuple[list[Any], Any]:
    """One window's measurements, drawn once (the bench times aggregation, not the RNG)."""
    from stepwatch.exporters import KernelWindow

    steps = [
        (0.026 * rng.uniform(0.9, 1.1), {phase: rng.uniform(0.0005, 0.01) for phase in PHASES})
        for _ in range(46)
    ]
    kernels = KernelWindow(
        {
            (f"aten::op{k}", "compute"): [rng.uniform(1e-6, 1e-4) for _ in range(30)]
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
    args = parser.parse_args()

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
    try:
        for label, kernel_classes in (("phases", 0), ("kernels", 20)):
            builder = WindowBuilder(resource)

            steps, kernels = _window_values(rng, kernel_classes)

            def build(builder: Any = builder, steps: Any = steps, kernels: Any = kernels) -> Any:
                _fill(builder, steps, kernels)
                now = time.time_ns()
                return builder.build(start_unix_nano=now - 1_000_000_000, end_unix_nano=now)

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
                return builder.build(start_unix_nano=now - 1_000_000_000, end_unix_nano=now)

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
    for label, _, _, _, _, _ in rows[:: len(rows) // 2][:2]:
        total = {r[1]: r for r in rows if r[0] == label}
        sdk_total = total["build"][2] + total["export"][2]
        lean_total = total["build"][4] + total["export"][4]
        print(
            f"{label}: build+export CPU per window: SDK {sdk_total:.0f} us, lean "
            f"{lean_total:.0f} us ({sdk_total / lean_total:.1f}x)"
        )
    print()
    print("bytes on the wire per window (gzip-N-us: zlib CPU time for that level)")
    for label, by_level in sizes:
        print(f"{label:8} " + ", ".join(f"{key}={value}" for key, value in by_level.items()))


if __name__ == "__main__":
    main()
