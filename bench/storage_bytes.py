"""Stored bytes per rank per window and columns per measurement: compact vs per-bound layout.

Run: ``.venv/bin/python bench/storage_bytes.py [--ranks 16] [--windows 360] [--interval-s 10]
[--steps 3] [--phase-stride 1]``

Builds ``ranks x windows`` windows with the exporters' WindowBuilder (the scale simulation's
window: 3 steps, 5 phases, ``--kernels`` kernel classes with 6 executions each, device idle;
fresh lognormal values every window), converts each with ``convert_request`` in both layouts
(bridge CPU per point: ``time.process_time``), writes each layout into its own database of one
REAL influxd 1.x, lets influxd snapshot its cache and fully compact the shard to one TSM file,
then prints side by side, in one run:

* TSM bytes on disk per rank per window, split into values, timestamps and TSM index by
  field key (parsed from the TSM files: header, blocks ``crc | type | uvarint len(ts) | ts |
  values``, index, footer), and the index amortised over a 7-day shard of windows;
* fields and columns (tags + fields + time, what InfluxDB 3 counts) per measurement from
  ``SHOW FIELD KEYS`` / ``SHOW TAG KEYS``;
* bridge CPU per point vs influxd CPU per point (``/proc``) for the same writes;
* the kernel quantiles read back from storage (``p50``/``p90``/``p99``, and recomputed from
  the stored ``buckets`` field, also merged over all windows of a series) vs the exact
  nearest-rank quantiles of the durations the windows were built from.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import struct
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bridge_clients import cpu_seconds  # noqa: E402

PHASES = ("data", "forward", "backward", "optimizer", "communication")
LAYOUTS = ("per_bound", "compact")
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
WEEK_S = 7 * 86_400
KERNEL = "stepwatch.kernel.duration"


def window(
    rng: random.Random,
    *,
    rank: int,
    ranks: int,
    kernels: int,
    start_ns: int,
    end_ns: int,
    steps: int = 3,
    phase_stride: int = 1,
) -> tuple[Any, dict[str, list[float]]]:
    """One rank's window as an OTLP request, and the exact kernel durations per class.

    ``phase_stride`` > 1: auto mode's phases timed on 1 step in that many (what a rank
    sends at ``phase_sampling="auto"`` with short steps: the sampled steps' points, and
    ``stepwatch.phase.every_step`` for the wait and ``data``, timed on every step)."""
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import (
        encode_metrics,
    )

    from stepwatch.exporters import KernelWindow, WindowBuilder, build_resource

    builder = WindowBuilder(
        build_resource(
            job_id="storage", rank=rank, world_size=ranks, host_name=f"node-{rank // 8:05d}",
            local_rank=rank % 8,
        )
    )  # fmt: skip
    if phase_stride == 1:
        for step in range(steps):
            builder.add_step(
                step_index=step,
                duration_s=0.5 * rng.lognormvariate(0, 0.05),
                phases_s={phase: 0.1 * rng.lognormvariate(0, 0.1) for phase in PHASES},
            )
    else:
        from stepwatch.exporters._sampling import share_out

        durations_s = [0.5 * rng.lognormvariate(0, 0.05) for _ in range(steps)]
        timed = list(range(0, steps, phase_stride))
        weights = share_out(steps, len(timed))
        every_step = ("data", "communication")
        builder.add_steps(
            last_step_index=steps - 1,
            durations_s=durations_s,
            phases_s={
                p: [0.1 * rng.lognormvariate(0, 0.1) for _ in durations_s] for p in every_step
            },
            weighted_phases_s={
                p: ([0.1 * rng.lognormvariate(0, 0.1) for _ in timed], weights)
                for p in PHASES
                if p not in every_step
            },
            sampled_steps_s=([durations_s[i] for i in timed], weights),
            sampling=True,
        )
    durations = {
        (f"k{index:02d}", "communication" if index >= kernels - 4 else "compute"): [
            0.0005 * (index + 1) * rng.lognormvariate(0, 0.2) for _ in range(2 * steps)
        ]
        for index in range(kernels)
    }
    builder.add_kernels(KernelWindow(durations, [0.01 * rng.random() for _ in range(steps)]))
    data = builder.build(start_unix_nano=start_ns, end_unix_nano=end_ns)
    return encode_metrics(data), {name: values for (name, _), values in durations.items()}


def nearest_rank(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(quantile * len(ordered))) - 1]


# -- TSM files -------------------------------------------------------------------------------------


def _uvarint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def tsm_breakdown(paths: list[Path]) -> dict[str, dict[str, int]]:
    """Bytes per field key: ``values``, ``timestamps``, ``block`` (CRC, type, length) and
    ``index`` (its index entry), plus ``{"": {"file": header + footer}}``."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for path in paths:
        data = path.read_bytes()
        (index_offset,) = struct.unpack(">Q", data[-8:])
        out[""]["file"] += 5 + 8
        position = index_offset
        while position < len(data) - 8:
            (key_length,) = struct.unpack(">H", data[position : position + 2])
            key = data[position + 2 : position + 2 + key_length].decode()
            field = key.rsplit("#!~#", 1)[1]
            at = position + 3 + key_length
            (count,) = struct.unpack(">H", data[at : at + 2])
            entry_bytes = 2 + key_length + 1 + 2 + 28 * count
            out[field]["index"] += entry_bytes
            for entry in range(count):
                start = position + 5 + key_length + 28 * entry
                offset, size = struct.unpack(">QI", data[start + 16 : start + 28])
                block = data[offset + 4 : offset + size]  # after the CRC
                ts_length, values_at = _uvarint(block, 1)
                out[field]["timestamps"] += ts_length
                out[field]["values"] += len(block) - values_at - ts_length
                out[field]["block"] += 4 + values_at
            position += entry_bytes
    return out


def settle(data_dir: Path, database: str, timeout_s: float) -> tuple[list[Path], bool]:
    """Wait until the WAL is snapshotted and each shard is one fully compacted TSM file."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted((data_dir / "data" / database).rglob("*.tsm"))
        temporary = list((data_dir / "data" / database).rglob("*.tmp"))
        wal = sum(p.stat().st_size for p in (data_dir / "wal" / database).rglob("*.wal"))
        shards = {path.parent for path in files}
        if files and not temporary and wal == 0 and len(files) == len(shards):
            return files, True
        if time.monotonic() > deadline:
            return files, False
        time.sleep(1)


# -- the run ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--windows", type=int, default=360, help="windows per rank")
    parser.add_argument("--interval-s", type=float, default=10.0, help="export interval")
    parser.add_argument("--jitter-ms", type=float, default=5.0, help="export timer jitter")
    parser.add_argument(
        "--ns-stamps", action="store_true",
        help="windows stamped in jittered nanoseconds, as the exporter did before it stamped "
        "whole milliseconds (stepwatch.exporters._window.window_stamp, the default)",
    )  # fmt: skip
    parser.add_argument("--kernels", type=int, default=20, help="kernel classes per window")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3, help="steps per window")
    parser.add_argument(
        "--phase-stride", type=int, default=1,
        help="auto mode's phases timed on 1 step in N (sampled windows carry 3 more points)",
    )  # fmt: skip
    args = parser.parse_args(argv)

    from stepwatch.core import InfluxClient, ManagedInfluxDB
    from stepwatch.exporters._window import window_stamp
    from stepwatch.otel_bridge import bucket_quantile, convert_request, merge_buckets

    rng = random.Random(args.seed)
    base_ns = (1_795_000_000 // WEEK_S * WEEK_S + 86_400) * 10**9  # one shard for the run
    interval_ns = int(args.interval_s * 1e9)
    requests: list[Any] = []
    exact: dict[tuple[str, str, int], list[float]] = {}  # (rank, class, time) -> durations
    every: dict[tuple[str, str], list[float]] = defaultdict(list)
    for rank in range(args.ranks):
        previous = base_ns
        for index in range(args.windows):
            end = base_ns + (index + 1) * interval_ns + rng.randrange(int(args.jitter_ms * 1e6) + 1)
            if not args.ns_stamps:
                end = window_stamp(end, after=previous)  # what StepMonitor sends
            request, durations = window(
                rng, rank=rank, ranks=args.ranks, kernels=args.kernels,
                start_ns=previous, end_ns=end, steps=args.steps, phase_stride=args.phase_stride,
            )  # fmt: skip
            previous = end
            requests.append(request)
            for name, values in durations.items():
                exact[(str(rank), name, end)] = values
                every[(str(rank), name)].extend(values)
    windows = args.ranks * args.windows

    lines: dict[str, list[str]] = {}
    cpu: dict[str, float] = {}
    for layout in LAYOUTS:  # warm every cache (escaped series keys, bucket bounds) first
        for request in requests:
            convert_request(request, histogram_layout=layout)
    for layout in LAYOUTS:
        started = time.process_time()
        converted = [convert_request(r, histogram_layout=layout) for r in requests]
        cpu[layout] = time.process_time() - started
        lines[layout] = [line for conversion in converted for line in conversion.lines]
    points = len(lines["compact"])
    assert points == len(lines["per_bound"])
    print(
        f"{args.ranks} ranks x {args.windows} windows ({args.interval_s:g} s apart, "
        f"{args.jitter_ms:g} ms jitter, stamped in {'ns' if args.ns_stamps else 'ms'}), "
        f"{points / windows:.0f} points per window, "
        f"{args.kernels} kernel classes; influxd 1.x, shard fully compacted"
    )

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="storage-bytes-") as directory:
        os.environ["INFLUXDB_DATA_CACHE_SNAPSHOT_WRITE_COLD_DURATION"] = "2s"
        os.environ["INFLUXDB_DATA_COMPACT_FULL_WRITE_COLD_DURATION"] = "5s"
        data_dir = Path(directory) / "influxd"
        influxd = ManagedInfluxDB(data_dir, database="per_bound").start()
        try:
            pid = influxd._process.pid  # type: ignore[union-attr]
            for layout in LAYOUTS:
                client = InfluxClient(influxd.url, database=layout, timeout_s=300)
                client.create_database()
                before = cpu_seconds(pid)
                for index in range(0, points, 5000):
                    client.write_lines(lines[layout][index : index + 5000])
                written = cpu_seconds(pid) - before
                files, settled = settle(data_dir, layout, timeout_s=300)
                total = cpu_seconds(pid) - before
                fields: dict[str, int] = {}
                columns: dict[str, int] = {}
                for series in client.query("SHOW FIELD KEYS"):
                    fields[series.name] = len(series.values)
                for series in client.query("SHOW TAG KEYS"):
                    columns[series.name] = len(series.values) + fields.get(series.name, 0) + 1
                results[layout] = {
                    "tsm": sum(path.stat().st_size for path in files),
                    "breakdown": tsm_breakdown(files),
                    "settled": settled,
                    "influx_write_cpu": written,
                    "influx_cpu": total,
                    "fields": fields,
                    "columns": columns,
                    "client": client,
                }
            errors = quantile_errors(results["compact"]["client"], results["per_bound"]["client"],
                                     exact, every, bucket_quantile, merge_buckets)  # fmt: skip
        finally:
            influxd.stop()

    report(args, results, cpu, points, windows, lines, errors)
    return 0


def quantile_errors(  # type: ignore[no-untyped-def]
    compact, per_bound, exact, every, bucket_quantile, merge_buckets
) -> dict[str, float]:
    """Worst relative error of the kernel quantiles read back from each database."""
    worst: dict[str, float] = defaultdict(float)
    for name, client in (("compact", compact), ("per_bound", per_bound)):
        extra = ', "buckets", "min", "max"' if name == "compact" else ""
        query = (
            f'SELECT "p50", "p90", "p99"{extra} FROM "{KERNEL}" '
            'GROUP BY "stepwatch.rank", "stepwatch.kernel.class"'
        )
        for series in client.query(query, epoch="ns"):
            rank, kernel = series.tags["stepwatch.rank"], series.tags["stepwatch.kernel.class"]
            texts = []
            for row in series.values:
                record = dict(zip(series.columns, row, strict=True))
                values = exact[(rank, kernel, int(record["time"]))]
                for field, quantile in QUANTILES:
                    truth = nearest_rank(values, quantile)
                    again = None
                    if name == "compact":
                        again = bucket_quantile(
                            record["buckets"], quantile, minimum=record["min"],
                            maximum=record["max"],
                        )  # fmt: skip
                    if record[field] is None:  # compact stores no p99: read from the buckets
                        label, value = f"{name} buckets {field}", again
                    else:
                        label, value = f"{name} stored {field}", record[field]
                        if again is not None:  # stored: rounded to 12 significant bits
                            assert abs(again - value) <= 2**-12 * again, (again, record)
                    error = abs(value - truth) / truth
                    worst[label] = max(worst[label], error)
                if name == "compact":
                    texts.append(record["buckets"])
            if texts:
                from stepwatch.otel_bridge._buckets import nearest_rank_quantile

                merged = merge_buckets(texts)
                for field, quantile in QUANTILES:
                    truth = nearest_rank(every[(rank, kernel)], quantile)
                    value = nearest_rank_quantile(merged, quantile, minimum=None, maximum=None)
                    error = abs(value - truth) / truth  # type: ignore[operator]
                    key = f"compact merged {field}"
                    worst[key] = max(worst[key], error)
    return dict(worst)


def report(  # type: ignore[no-untyped-def]
    args, results, cpu, points, windows, lines, errors
) -> None:
    print(f"\n{'':44} {'per_bound':>12} {'compact':>12} {'ratio':>7}")

    def row(label: str, old: float, new: float, unit: str = "") -> None:
        ratio = new / old if old else float("nan")
        print(f"{label:44} {old:>11,.1f}{unit:1} {new:>11,.1f}{unit:1} {ratio:>7.2f}")

    for layout in LAYOUTS:
        if not results[layout]["settled"]:
            print(f"WARNING: {layout}: the shard did not settle to one TSM file in time")
    row("line protocol B per point", *(sum(map(len, lines[x])) / points + 1 for x in LAYOUTS))
    row("fields per point", *(
        sum(line.count("=") - line.split(" ")[0].count("=") for line in lines[x]) / points
        for x in LAYOUTS
    ))  # fmt: skip
    row("TSM B per rank per window (this run)", *(results[x]["tsm"] / windows for x in LAYOUTS))
    parts: dict[str, dict[str, float]] = {}
    for layout in LAYOUTS:
        totals: dict[str, float] = defaultdict(float)
        for part in results[layout]["breakdown"].values():
            for kind, size in part.items():
                totals[kind] += size
        parts[layout] = totals
    for kind in ("values", "timestamps", "block", "index", "file"):
        row(f"  {kind} B per rank per window", *(parts[x][kind] / windows for x in LAYOUTS))
    keys = {x: sum(1 for f in results[x]["breakdown"] if f) for x in LAYOUTS}
    week = WEEK_S / args.interval_s
    steady = {
        x: (parts[x]["values"] + parts[x]["timestamps"] + parts[x]["block"]) / windows
        + parts[x]["index"] / args.ranks / week
        for x in LAYOUTS
    }
    row("  the same, index over a 7-day shard", *(steady[x] for x in LAYOUTS))
    row("TSM index B per rank (per shard)", *(parts[x]["index"] / args.ranks for x in LAYOUTS))
    label = "field keys with data (all measurements)"
    print(f"{label:44} {keys['per_bound']:>12} {keys['compact']:>12}")
    print("\nfields / columns (tags + fields + time) per measurement:")
    for name in sorted(results["per_bound"]["fields"]):
        old, new = results["per_bound"], results["compact"]
        print(
            f"  {name:40} fields {old['fields'][name]:>4} -> {new['fields'][name]:>3}   "
            f"columns {old['columns'][name]:>4} -> {new['columns'][name]:>3}"
        )
    print("\nwhere the compact layout's bytes go (B per rank per window: values + timestamps + "
          "block headers; index per rank per shard):")  # fmt: skip
    breakdown = results["compact"]["breakdown"]
    for field in sorted(breakdown, key=lambda f: -sum(breakdown[f].values())):
        if not field:
            continue
        part = breakdown[field]
        data = (part["values"] + part["timestamps"] + part["block"]) / windows
        print(
            f"  {field:22} values {part['values'] / windows:7.1f}  timestamps "
            f"{part['timestamps'] / windows:6.1f}  blocks {part['block'] / windows:5.1f}  "
            f"= {data:7.1f}   index {part['index'] / args.ranks:9,.0f}"
        )
    print("\nCPU per point (same requests, same writes):")
    row("  bridge convert_request us/point", *(cpu[x] / points * 1e6 for x in LAYOUTS))
    row("  influxd write us/point", *(
        results[x]["influx_write_cpu"] / points * 1e6 for x in LAYOUTS
    ))  # fmt: skip
    row("  influxd write+compaction us/point", *(
        results[x]["influx_cpu"] / points * 1e6 for x in LAYOUTS
    ))  # fmt: skip
    row("  bridge / influxd (write+compaction)", *(
        cpu[x] / max(results[x]["influx_cpu"], 1e-9) for x in LAYOUTS
    ))  # fmt: skip
    print(
        "\nkernel quantiles read back from InfluxDB vs exact nearest rank (worst relative error):"
    )
    for key in sorted(errors):
        print(f"  {key:28} {100 * errors[key]:6.2f} %")


if __name__ == "__main__":
    raise SystemExit(main())
