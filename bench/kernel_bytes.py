"""Bytes per rank per step: raw Kineto trace vs what stepwatch puts on the wire and in InfluxDB.

Run: ``.venv/bin/python bench/kernel_bytes.py [TRACE_DIR_OR_TAR]`` (default: the public 8-rank
DLRM trace in tests/data/kineto). One window per step, built exactly as ``stepwatch ingest``
builds it. Prints, per configuration (histogram scale, top-K): OTLP protobuf bytes (the
``ExportMetricsServiceRequest`` body), the same gzip-compressed (what the OTLP exporters send with
``compression=gzip``), InfluxDB line-protocol bytes (via ``stepwatch.otel_bridge.convert_request``
when it exists), and the ratios against the raw trace and ARGUS's 2.7 KB.
"""

from __future__ import annotations

import gzip
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from stepwatch.exporters.kernels import classify_kernel, ingest_traces, read_trace, trace_windows

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TAR = REPO / "tests" / "data" / "kineto" / "param_dlrm_8rank" / "dlrm_kineto.tar.gz"
ARGUS_BYTES = 2.7e3


def _trace_files(source: Path, scratch: Path) -> list[Path]:
    if source.is_dir():
        return sorted(p for p in source.rglob("*.json*") if p.is_file())
    with tarfile.open(source) as archive:
        archive.extractall(scratch, filter="data")
    return sorted(p for p in scratch.rglob("*.json*") if p.is_file())


def _windows(trace, world_size: int, **options):  # type: ignore[no-untyped-def]
    """The trace's windows as rank ``trace.rank`` of a bench job (``options``: trace_windows')."""
    return trace_windows(
        trace,
        job_id="bench",
        rank=trace.rank or 0,
        world_size=trace.world_size or world_size,
        time_offset_ns=0,
        host_name="node-0",
        **options,
    )


def _encoder():  # type: ignore[no-untyped-def]
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import encode_metrics

    return encode_metrics


def _converter():  # type: ignore[no-untyped-def]
    try:
        from stepwatch.otel_bridge import convert_request
    except ImportError:
        return None
    return convert_request


class _EncodingExporter:
    """Encodes each window to OTLP protobuf, as the HTTP exporter would, and counts bytes."""

    def __init__(self) -> None:
        self.bytes = 0
        self.windows = 0

    def export(self, metrics_data, /):  # type: ignore[no-untyped-def]
        self.bytes += len(_encoder()(metrics_data).SerializeToString())
        self.windows += 1


def _max_quantile_error(traces, windows_per_trace) -> float:  # type: ignore[no-untyped-def]
    """Worst relative error of the bridge's p50/p90/p99 estimate vs the exact nearest rank."""
    import math

    from stepwatch.otel_bridge._buckets import exponential_buckets, nearest_rank_quantile

    worst = 0.0
    for trace, windows in zip(traces, windows_per_trace, strict=True):
        for step, window in zip(trace.steps, windows, strict=True):
            exact: dict[str, list[float]] = {}
            for event in step.kernels:
                exact.setdefault(classify_kernel(event.name).name, []).append(
                    event.duration_ns / 1e9
                )
            for metric in window.metrics.resource_metrics[0].scope_metrics[0].metrics:
                if metric.name != "stepwatch.kernel.duration":
                    continue
                for point in metric.data.data_points:
                    if point.attributes["stepwatch.kernel.class"] == "other":
                        continue  # folded classes have no single exact counterpart
                    values = sorted(exact[point.attributes["stepwatch.kernel.class"]])
                    buckets = exponential_buckets(
                        point.scale,
                        positive_offset=point.positive.offset,
                        positive_counts=point.positive.bucket_counts,
                        zero_count=point.zero_count,
                    )
                    for q in (0.5, 0.9, 0.99):
                        want = values[max(1, math.ceil(q * len(values))) - 1]
                        got = nearest_rank_quantile(
                            buckets, q, minimum=point.min, maximum=point.max
                        )
                        worst = max(worst, abs(got - want) / want)
    return worst


def _one_window(trace):  # type: ignore[no-untyped-def]
    from stepwatch.exporters import WindowBuilder, build_resource
    from stepwatch.exporters.kernels import KernelSummariser
    from stepwatch.exporters.kernels._ingest import (
        DEFAULT_KERNEL_MAX_SCALE,
        DEFAULT_KERNEL_MAX_SIZE,
    )

    resource = build_resource(job_id="bench", rank=0, world_size=1, host_name="node-0")
    builder = WindowBuilder(
        resource, max_scale=DEFAULT_KERNEL_MAX_SCALE, max_size=DEFAULT_KERNEL_MAX_SIZE
    )
    summariser = KernelSummariser()
    for step in trace.steps:
        builder.add_step(step_index=step.index, duration_s=step.duration_s, phases_s=step.phases_s)
        summariser.add_step(step.kernels, start_ns=step.start_ns, end_ns=step.end_ns)
    builder.add_kernels(summariser.drain())
    return builder.build(
        start_unix_nano=trace.steps[0].start_ns, end_unix_nano=trace.steps[-1].end_ns
    )


def _only_kernels(request):  # type: ignore[no-untyped-def]
    copy = type(request)()
    copy.CopyFrom(request)
    for resource_metrics in copy.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            kept = [m for m in scope_metrics.metrics if m.name == "stepwatch.kernel.duration"]
            del scope_metrics.metrics[:]
            scope_metrics.metrics.extend(kept)
    return copy


def _without_descriptions(request):  # type: ignore[no-untyped-def]
    copy = type(request)()
    copy.CopyFrom(request)
    for resource_metrics in copy.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                metric.description = ""
    return copy


def _copy(request):  # type: ignore[no-untyped-def]
    copy = type(request)()
    copy.CopyFrom(request)
    return copy


def _histogram_points(request, *, kernel_only: bool = False):  # type: ignore[no-untyped-def]
    for resource_metrics in request.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if kernel_only and metric.name != "stepwatch.kernel.duration":
                    continue
                if metric.HasField("exponential_histogram"):
                    yield from metric.exponential_histogram.data_points


def _drop_attribute(container, key: str) -> None:  # type: ignore[no-untyped-def]
    kept = [_copy(item) for item in container.attributes if item.key != key]
    del container.attributes[:]
    container.attributes.extend(kept)


def _no_category(request) -> None:  # type: ignore[no-untyped-def]
    for point in _histogram_points(request, kernel_only=True):
        _drop_attribute(point, "stepwatch.kernel.category")


def _no_service_name(request) -> None:  # type: ignore[no-untyped-def]
    for resource_metrics in request.resource_metrics:
        _drop_attribute(resource_metrics.resource, "service.name")


def _single_values_at_scale_0(request) -> None:  # type: ignore[no-untyped-def]
    from stepwatch.exporters._histogram import map_to_index

    for point in _histogram_points(request):
        if point.count == 1 and point.positive.bucket_counts:
            point.scale = 0
            point.positive.offset = map_to_index(point.max, 0)


def _clear(field: str, *, kernel_only: bool = True):  # type: ignore[no-untyped-def]
    def apply(request) -> None:  # type: ignore[no-untyped-def]
        for point in _histogram_points(request, kernel_only=kernel_only):
            if field == "attributes":
                del point.attributes[:]
            elif field == "bucket_counts":
                del point.positive.bucket_counts[:]
            elif field == "timestamps":
                point.ClearField("start_time_unix_nano")
                point.ClearField("time_unix_nano")
            else:
                point.ClearField(field)

    return apply


def _no_resource(request) -> None:  # type: ignore[no-untyped-def]
    for resource_metrics in request.resource_metrics:
        del resource_metrics.resource.attributes[:]


def _variants_table(traces) -> None:  # type: ignore[no-untyped-def]
    """Savings not taken (they break a contract or cost too much) and what each field costs."""
    import zlib

    encode_metrics = _encoder()
    requests: list = []  # type: ignore[type-arg]
    exact_requests: list = []  # type: ignore[type-arg]
    min_max_requests: list = []  # type: ignore[type-arg]
    for trace in traces:
        for options, target in (
            ({}, requests),
            ({"kernel_significant_bits": 53}, exact_requests),
            ({"kernel_min_max": True}, min_max_requests),
        ):
            for window in _windows(trace, len(traces), **options):
                target.append(encode_metrics(window.metrics))

    def mean_gzip(items, *mutations) -> float:  # type: ignore[no-untyped-def]
        sizes = []
        for request in items:
            copy = _copy(request)
            for mutate in mutations:
                mutate(copy)
            sizes.append(len(gzip.compress(copy.SerializeToString(), 6)))
        return statistics.mean(sizes)

    base = mean_gzip(requests)
    print(f"\ndefault window (scale 4, size 320, top_k 48): {base:.0f} gzip B; variants:")
    rows = [
        ("kernel min/max sent (kernel_min_max=True, 12 bits)", mean_gzip(min_max_requests)),
        ("kernel sum exact (kernel_significant_bits=53)", mean_gzip(exact_requests)),
        ("NOT TAKEN: no stepwatch.kernel.category on the wire", mean_gzip(requests, _no_category)),
        ("NOT TAKEN: no service.name resource attribute", mean_gzip(requests, _no_service_name)),
        (
            "NOT TAKEN: one-observation histograms at scale 0",
            mean_gzip(requests, _single_values_at_scale_0),
        ),
        (
            "NOT TAKEN: all three above",
            mean_gzip(requests, _no_category, _no_service_name, _single_values_at_scale_0),
        ),
        (
            "NOT TAKEN: Content-Encoding deflate (zlib) instead of gzip",
            statistics.mean(len(zlib.compress(r.SerializeToString(), 6)) for r in requests),
        ),
    ]
    for label, size in rows:
        print(f"  {label:<62} {size:>7.0f} B ({size - base:+.0f})")
    print("cost of each field family (gzip B saved by removing it; kernel points unless 'all'):")
    for label, mutation in (
        ("point attributes", _clear("attributes")),
        ("bucket_counts", _clear("bucket_counts")),
        ("sum", _clear("sum")),
        ("count", _clear("count")),
        ("start/end timestamps", _clear("timestamps")),
        ("all histograms: sum+min+max", _clear("sum", kernel_only=False)),
        ("resource attributes", _no_resource),
    ):
        if label.startswith("all histograms"):
            size = mean_gzip(
                requests,
                _clear("sum", kernel_only=False),
                _clear("min", kernel_only=False),
                _clear("max", kernel_only=False),
            )
        else:
            size = mean_gzip(requests, mutation)
        print(f"  {label:<62} {base - size:>7.0f} B")


def _as_explicit(metrics_data):  # type: ignore[no-untyped-def]
    """The window with every exponential histogram sent as explicit buckets on the fixed grid
    (``WindowBuilder(histogram_buckets="explicit")`` builds the same points from the same
    snapshots)."""
    import dataclasses

    from opentelemetry.sdk.metrics.export import ExponentialHistogram

    from stepwatch.exporters._histogram import HistogramSnapshot
    from stepwatch.exporters._window import _histogram_metric

    resource_metrics = []
    for resource in metrics_data.resource_metrics:
        scopes = []
        for scope in resource.scope_metrics:
            metrics = []
            for metric in scope.metrics:
                if not isinstance(metric.data, ExponentialHistogram):
                    metrics.append(metric)
                    continue
                points = metric.data.data_points
                series = [
                    (
                        dict(point.attributes),
                        HistogramSnapshot(
                            count=point.count,
                            sum=point.sum,
                            min=point.min,
                            max=point.max,
                            scale=point.scale,
                            zero_count=point.zero_count,
                            offset=point.positive.offset,
                            bucket_counts=tuple(point.positive.bucket_counts),
                        ),
                    )
                    for point in points
                ]
                bounds = (points[0].start_time_unix_nano, points[0].time_unix_nano)
                has_min_max = points[0].min is not None
                metrics.append(
                    _histogram_metric(
                        metric.name, series, bounds, min_max=has_min_max, explicit=True
                    )
                )
            scopes.append(dataclasses.replace(scope, metrics=metrics))
        resource_metrics.append(dataclasses.replace(resource, scope_metrics=scopes))
    return dataclasses.replace(metrics_data, resource_metrics=resource_metrics)


def _explicit_table(traces) -> None:  # type: ignore[no-untyped-def]
    """Explicit buckets (the Collector-compatible option): bytes, columns, quantile error."""
    import math

    encode_metrics = _encoder()
    convert_request = _converter()
    exponential, explicit, steps = [], [], 0
    columns: dict[str, set[str]] = {}
    worst = 0.0
    for trace in traces:
        for step, window in zip(trace.steps, _windows(trace, len(traces)), strict=True):
            steps += 1
            exponential.append(
                len(gzip.compress(encode_metrics(window.metrics).SerializeToString(), 6))
            )
            request = encode_metrics(_as_explicit(window.metrics))
            explicit.append(len(gzip.compress(request.SerializeToString(), 6)))
            if convert_request is None:
                continue
            for line in convert_request(request).lines:
                measurement = line.split(",", 1)[0]
                keys = {item.split("=", 1)[0] for item in line.split(" ")[1].split(",")}
                columns.setdefault(measurement, set()).update(keys)
                if not measurement.startswith("stepwatch.kernel.duration"):
                    continue
                kernel_class = line.split("stepwatch.kernel.class=", 1)[1].split(",", 1)[0]
                if kernel_class == "other":
                    continue
                fields = dict(item.split("=", 1) for item in line.split(" ")[1].split(","))
                values = sorted(
                    event.duration_ns / 1e9
                    for event in step.kernels
                    if classify_kernel(event.name).name.replace(" ", "\\ ") == kernel_class
                )
                if not values:
                    continue
                for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
                    want = values[max(1, math.ceil(q * len(values))) - 1]
                    worst = max(worst, abs(float(fields[name]) - want) / want)
    print(
        f"explicit buckets (histogram_buckets='explicit', for a Collector's influxdb exporter): "
        f"{statistics.mean(explicit):.0f} gzip B per rank per step vs "
        f"{statistics.mean(exponential):.0f} B exponential "
        f"({statistics.mean(explicit) / statistics.mean(exponential):.2f}x); "
        f"kernel quantile error at most {100 * worst:.2f}%"
    )
    if columns:
        print(
            "  InfluxDB columns per measurement (bridge layout, all ranks and steps): "
            + ", ".join(f"{name} {len(keys)}" for name, keys in sorted(columns.items()))
        )


def _wire_bytes(traces) -> None:  # type: ignore[no-untyped-def]
    """Bytes the real exporter sends per rank per step with default settings, and with none.

    Every window goes through ``OtlpHttpExporter`` (what ``StepMonitor`` uses for
    http/protobuf, compression from ``OTEL_EXPORTER_OTLP_COMPRESSION``'s default) to a local
    receiver that answers 200; the exporter counts the request bodies it sent.
    """
    import http.server
    import threading

    from stepwatch.core import settings
    from stepwatch.exporters import OtlpHttpExporter

    class Sink(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", "0")))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}/v1/metrics"
    default = str(settings.OTLP_COMPRESSION.default)
    sizes: dict[str, float] = {}
    try:
        for compression in dict.fromkeys((default, "none", "gzip")):
            exporter = OtlpHttpExporter(endpoint, compression=compression)
            steps = 0
            for trace in traces:
                for window in _windows(trace, len(traces)):
                    exporter.export(window.metrics)
                steps += len(trace.steps)
            sizes[compression] = exporter.stats.body_bytes / steps
            exporter.shutdown()
    finally:
        server.shutdown()
    print(
        f"on the wire, default settings (compression={default}): {sizes[default]:.0f} B per rank "
        f"per step; compression=none: {sizes['none']:.0f} B "
        f"({sizes['none'] / sizes[default]:.2f}x); gzip: {sizes['gzip']:.0f} B"
    )


def main(argv: list[str]) -> int:
    source = Path(argv[1]) if len(argv) > 1 else DEFAULT_TAR
    encode_metrics = _encoder()
    convert_request = _converter()
    with tempfile.TemporaryDirectory() as scratch:
        files = _trace_files(source, Path(scratch))
        started = time.perf_counter()
        traces = [read_trace(path) for path in files]
        parse_s = time.perf_counter() - started
    raw_per_step = [t.raw_size_bytes / len(t.steps) for t in traces]
    steps = sum(len(t.steps) for t in traces)
    kernels = sum(len(s.kernels) for t in traces for s in t.steps)
    print(f"source: {source}")
    print(
        f"{len(traces)} ranks, {steps} steps, {kernels} device events; parsed in {parse_s:.2f} s "
        f"({sum(t.raw_size_bytes for t in traces) / 1e6 / parse_s:.0f} MB/s)"
    )
    print(f"raw trace per rank per step: {statistics.mean(raw_per_step) / 1e3:.0f} KB (mean)")
    if convert_request is None:
        print("line protocol: stepwatch.otel_bridge.convert_request not available")
    header = (
        f"{'scale':>5} {'size':>4} {'top_k':>5} {'series':>6} {'otlp B':>7} {'gzip B':>7} "
        f"{'lp B':>7} "
        f"{'gzip/ARGUS':>10} {'raw/gzip':>9} {'kernel gz':>9} {'nodesc gz':>9} {'max q err':>9}"
    )
    print(header)
    for scale, top_k, max_size in (
        (5, 48, 160),
        (5, 48, 320),
        (4, 48, 160),
        (4, 48, 320),
        (3, 48, 160),
        (4, 8, 160),
        (2, 48, 160),
    ):
        otlp, zipped, line, series, kernel_only, no_desc = [], [], [], [], [], []
        all_windows = []
        for trace in traces:
            windows = _windows(trace, len(traces), top_k=top_k, max_scale=scale, max_size=max_size)
            all_windows.append(windows)
            for window in windows:
                request = encode_metrics(window.metrics)
                body = request.SerializeToString()
                otlp.append(len(body))
                zipped.append(len(gzip.compress(body, 6)))
                kernel_only.append(len(gzip.compress(_only_kernels(request).SerializeToString())))
                no_desc.append(
                    len(gzip.compress(_without_descriptions(request).SerializeToString()))
                )
                kernel_metrics = [
                    m
                    for rm in window.metrics.resource_metrics
                    for sm in rm.scope_metrics
                    for m in sm.metrics
                    if m.name == "stepwatch.kernel.duration"
                ]
                series.append(sum(len(m.data.data_points) for m in kernel_metrics))
                if convert_request is not None:
                    conversion = convert_request(request)
                    line.append(sum(len(text) + 1 for text in conversion.lines))
        mean_zip = statistics.mean(zipped)
        print(
            f"{scale:>5} {max_size:>4} {top_k:>5} {statistics.mean(series):>6.1f} "
            f"{statistics.mean(otlp):>7.0f} "
            f"{mean_zip:>7.0f} {statistics.mean(line) if line else float('nan'):>7.0f} "
            f"{mean_zip / ARGUS_BYTES:>10.2f} {statistics.mean(raw_per_step) / mean_zip:>9.0f} "
            f"{statistics.mean(kernel_only):>9.0f} {statistics.mean(no_desc):>9.0f} "
            f"{100 * _max_quantile_error(traces, all_windows):>8.2f}%"
        )
    _variants_table(traces)
    multi = [trace for trace in traces if len(trace.steps) > 1]
    if multi:
        per_step = []
        for trace in multi:
            body = _encoder()(_one_window(trace)).SerializeToString()
            per_step.append(len(gzip.compress(body)) / len(trace.steps))
        print(
            f"all steps of a rank in one window (live exporters batch steps per export): "
            f"{statistics.mean(per_step):.0f} gzip B per rank per step "
            f"({len(multi[0].steps)} steps per window)"
        )
    _wire_bytes(traces)
    _explicit_table(traces)
    exporter = _EncodingExporter()
    with tempfile.TemporaryDirectory() as scratch:
        files = _trace_files(source, Path(scratch))
        started = time.perf_counter()
        ingest_traces(files, job_id="bench", exporter=exporter, time_origin_unix_nano=0)
        elapsed = time.perf_counter() - started
    print(
        f"ingest of all {len(files)} files (read, split, summarise, build, encode): "
        f"{elapsed:.2f} s, {exporter.windows} windows, {exporter.bytes} OTLP bytes"
    )
    print(
        "(ingest default: scale 4, size 320, top_k 48; byte figures are per rank per step, mean; "
        "'kernel gz': the request with only stepwatch.kernel.duration; 'nodesc gz': the whole "
        "request without metric descriptions)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
