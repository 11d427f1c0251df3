"""The bridge's CPU per stored point, stage by stage, before vs after, against influxd's.

Run: ``.venv/bin/python bench/bridge_cpu.py [--ranks 1024] [--windows 4] [--baseline-rev HEAD~1]``

Builds ``ranks x windows`` OTLP requests with the exporters' WindowBuilder (as
bench/storage_bytes.py does: one request per rank-window, 3 steps, 5 phases, ``--kernels``
kernel classes; 28 points per window with 20 classes), serialized and gzip-compressed as the
exporter sends them by default. Each bridge version runs in its own child process (the code of
``--baseline-rev`` is taken with ``git archive``, its C fast path built in place when it has
one; the working tree's is "after"), the children
interleaved ``--rounds`` times, each timing (``time.process_time``, after a warm-up pass that
fills every cache and the cardinality guard) on the same bodies:

* ``decode``: gunzip + protobuf parse (``decode_body``);
* ``convert``: ``convert_to_points`` (resource checks, fields, buckets text, tags);
* ``guard``: ``CardinalityGuard.filter`` (all series known: the steady state);
* ``encode``: ``Point.encode`` (line protocol);
* ``fast convert``: gunzip + the C fast path's conversion (``_fast.convert``: protobuf wire
  format straight to line protocol, series hashes for the guard); versions without it: ``-``;
* ``intake, python``: the whole Python path per request: ``decode_body`` then
  ``Intake.ingest`` of a ``Bridge(fast_path=False)`` with a memory spool (convert,
  duplicate-rank and cardinality guards, encode, spool append; the forwarder not started, so
  nothing is sent);
* ``intake``: the whole path per request as the receivers run it with the defaults a user
  gets: gunzip, then ``Intake.ingest_body`` (the C fast path, the same guards and spool), and
  the Python path for a request the fast path declines. Versions without a fast path: the
  same as ``intake, python``.

After each round, writes the lines into a fresh REAL influxd 1.x: the first window (which
creates every series) apart, then the later windows, lets it snapshot and fully compact the
shard, and reports influxd's CPU per point (``/proc``) for each, and the ratio of each bridge
version's intake CPU to influxd's steady state (later windows, write + compaction) of the same
round: a job's series are created once and then written every window for hours. Machine
noise: every figure is the median of the rounds, with min-max.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STAGES = ("decode", "convert", "guard", "encode", "fast convert", "intake, python", "intake")
WEEK_S = 7 * 86_400
SOURCES = ("core/src", "exporters/src", "otel_bridge/src")
# a baseline's C fast path is built from these (versions before it have none)
EXTENSION_SOURCES = ("otel_bridge/csrc", "otel_bridge/setup.py", "otel_bridge/pyproject.toml")


def build_bodies(ranks: int, windows: int, kernels: int, seed: int) -> list[bytes]:
    from bench.storage_bytes import window
    from stepwatch.exporters._window import window_stamp

    rng = random.Random(seed)
    now_s = time.time_ns() // 10**9
    base_ns = (now_s - windows * 10 - 60) * 10**9  # recent: inside the bridge's skew bounds
    bodies: list[bytes] = []
    for index in range(windows):  # rank after rank within a window, as they arrive
        for rank in range(ranks):
            start = base_ns + index * 10 * 10**9
            end = window_stamp(start + 10 * 10**9 + rng.randrange(5_000_000), after=start)
            request, _ = window(
                rng, rank=rank, ranks=ranks, kernels=kernels, start_ns=start, end_ns=end
            )
            bodies.append(gzip.compress(request.SerializeToString()))
    return bodies


class _Unsent:
    """The forwarder is not started: nothing is ever written."""

    def write_lines(self, lines: Any) -> None:  # pragma: no cover - never called
        raise RuntimeError("not sending")

    def close(self) -> None:
        pass


def child(bodies_path: str, lines_path: str, stages_text: str) -> None:
    """Time each stage (of ``stages_text``, comma-separated) on the bodies with the stepwatch
    found on sys.path; print JSON."""
    from stepwatch.otel_bridge import Bridge
    from stepwatch.otel_bridge._cardinality import CardinalityGuard
    from stepwatch.otel_bridge._convert import TAG_ALLOWLIST, convert_to_points
    from stepwatch.otel_bridge._decode import decode_body, gunzip

    bodies: list[bytes] = pickle.loads(Path(bodies_path).read_bytes())

    def decode(body: bytes) -> Any:
        return decode_body(
            body, content_type="application/x-protobuf", content_encoding="gzip",
            max_bytes=1 << 24,
        )  # fmt: skip

    wanted = set(stages_text.split(","))
    python_stages = wanted & {"decode", "convert", "guard", "encode"}
    requests = [decode(body) for body in bodies] if python_stages or lines_path else []
    batches = [convert_to_points(request) for request in requests]
    guard = CardinalityGuard(max_new_series_per_s=None)

    def bridge(**options: Any) -> Any:
        return Bridge(
            _Unsent(), grpc_port=None, http_port=0, spool_max_bytes=1 << 40,
            max_queue_lines=1 << 40, max_new_series_per_s=None, **options,
        )  # fmt: skip

    intake = bridge().intake  # the defaults
    fast = getattr(intake, "fast_path", False)
    if batches:
        points = sum(len(batch.points) for batch in batches)
    else:  # only the fast path's stages: count its lines
        from stepwatch.otel_bridge import _fast

        points = sum(
            len(_fast.convert(
                gunzip(body, max_bytes=1 << 24), tag_allowlist=TAG_ALLOWLIST,
                max_duration_s=86_400.0, time_bounds_unix_nano=None, resource_check=None,
            ).lines)  # type: ignore[union-attr]
            for body in bodies
        )  # fmt: skip
    python = bridge(fast_path=False).intake if fast else intake
    declined = [0]

    def check(outcome: Any) -> None:
        if not outcome.accepted or outcome.rejected_points:
            raise RuntimeError(f"not stored: {outcome}")

    def ingest_python() -> None:
        for body in bodies:
            check(python.ingest(decode(body)))

    def ingest() -> None:  # as the receivers do
        from stepwatch.otel_bridge._decode import parse_protobuf

        for body in bodies:
            raw = gunzip(body, max_bytes=1 << 24)
            outcome = intake.ingest_body(raw)
            if outcome is None:
                declined[0] += 1
                outcome = intake.ingest(parse_protobuf(raw))
            check(outcome)

    def fast_convert() -> None:
        from stepwatch.otel_bridge import _fast

        for body in bodies:
            converted = _fast.convert(
                gunzip(body, max_bytes=1 << 24), tag_allowlist=TAG_ALLOWLIST,
                max_duration_s=86_400.0, time_bounds_unix_nano=None, resource_check=None,
            )  # fmt: skip
            if converted is None:
                raise RuntimeError("the fast path declined an exporter window")

    stages: dict[str, Any] = {
        "decode": lambda: [decode(body) for body in bodies],
        "convert": lambda: [convert_to_points(request) for request in requests],
        "guard": lambda: [guard.filter(batch.points) for batch in batches],
        "encode": lambda: [[point.encode() for point in batch.points] for batch in batches],
        "fast convert": fast_convert if fast else None,
        "intake, python": ingest_python,
        "intake": ingest if fast else ingest_python,
    }
    result: dict[str, float | None] = {}
    for name, run in stages.items():
        if run is None or name not in wanted:
            result[name] = None
            continue
        run()  # warm-up: caches, known series, the interpreter's specialisation
        started = time.process_time()
        run()
        result[name] = (time.process_time() - started) / points * 1e6
    if lines_path:
        lines = [point.encode() for batch in batches for point in batch.points]
        Path(lines_path).write_text("\n".join(lines) + "\n")
    print(json.dumps({"points": points, "us_per_point": result, "declined": declined[0]}))


def source_tree(rev: str, directory: Path) -> Path:
    """The packages as of ``rev`` (``git archive``), or the working tree for ``""``."""
    if not rev:
        return REPO
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", rev, "otel_bridge/"],
        check=True, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    extension = [path for path in EXTENSION_SOURCES if path in listed]
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, *SOURCES, *extension],
        check=True, capture_output=True,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive, check=True)
    if "otel_bridge/setup.py" in extension:  # that version's C fast path, built as setup.sh does
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=directory / "otel_bridge", check=True, capture_output=True,
        )  # fmt: skip
    return directory


def run_child(tree: Path, bodies: Path, lines: Path | None, stages: str) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*(str(tree / s) for s in SOURCES), str(REPO)])
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(bodies), str(lines or ""), stages],
        env=env, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def influxd_cpu(lines_path: Path, first: int) -> dict[str, float | bool]:
    """influxd CPU seconds per point: creating the series (the first window's ``first``
    lines), then the steady state (the later windows: write, and write + full compaction)."""
    from bench.bridge_clients import cpu_seconds
    from bench.storage_bytes import settle
    from stepwatch.core import InfluxClient, ManagedInfluxDB

    lines = [line for line in lines_path.read_text().split("\n") if line]
    with tempfile.TemporaryDirectory(prefix="bridge-cpu-influxd-") as directory:
        os.environ["INFLUXDB_DATA_CACHE_SNAPSHOT_WRITE_COLD_DURATION"] = "2s"
        os.environ["INFLUXDB_DATA_COMPACT_FULL_WRITE_COLD_DURATION"] = "5s"
        data_dir = Path(directory) / "influxd"
        influxd = ManagedInfluxDB(data_dir, database="bridgecpu").start()
        try:
            pid = influxd._process.pid  # type: ignore[union-attr]
            client = InfluxClient(influxd.url, database="bridgecpu", timeout_s=300)
            client.create_database()

            def write(part: list[str]) -> float:
                before = cpu_seconds(pid)
                for index in range(0, len(part), 5000):
                    client.write_lines(part[index : index + 5000])
                return cpu_seconds(pid) - before

            created = write(lines[:first])
            before = cpu_seconds(pid)
            written = write(lines[first:])
            _, settled = settle(data_dir, "bridgecpu", timeout_s=300)
            total = cpu_seconds(pid) - before
        finally:
            influxd.stop()
    steady = len(lines) - first
    return {
        "create": created / first * 1e6,
        "write": written / steady * 1e6,
        "total": total / steady * 1e6,
        "settled": settled,
    }


def spread(values: list[float | None]) -> str:
    known = [value for value in values if value is not None]
    if not known:
        return "-"
    return f"{statistics.median(known):6.2f} ({min(known):.2f}-{max(known):.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=4, help="windows per rank")
    parser.add_argument("--kernels", type=int, default=20, help="kernel classes per window")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs per version")
    parser.add_argument("--baseline-rev", default="", help="git rev measured as 'before'")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument(
        "--stages",
        default=",".join(STAGES),
        help="comma-separated stages to time (default all; 'fast convert,intake' for big runs)",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0

    with tempfile.TemporaryDirectory(prefix="bridge-cpu-") as directory:
        work = Path(directory)
        bodies = build_bodies(args.ranks, args.windows, args.kernels, args.seed)
        (work / "bodies.pickle").write_bytes(pickle.dumps(bodies))
        versions = {"after": source_tree("", work)}
        if args.baseline_rev:
            (work / "before").mkdir()
            versions = {"before": source_tree(args.baseline_rev, work / "before"), **versions}
        figures: dict[str, dict[str, list[float | None]]] = {
            v: {s: [] for s in STAGES} for v in versions
        }
        declined = 0
        points = 0
        influxd_rounds: list[dict[str, float | bool]] = []
        for round_index in range(args.rounds):
            for version, tree in versions.items():
                first = round_index == 0 and version == "after"
                lines = work / "lines" if first else None
                result = run_child(tree, work / "bodies.pickle", lines, args.stages)
                points = result["points"]
                declined += result.get("declined", 0) if version == "after" else 0
                for stage in STAGES:
                    figures[version][stage].append(result["us_per_point"][stage])
            # influxd's own CPU varies from run to run (~12-18 us per point here): measured
            # in every round, between the bridge's, and the ratios taken per round
            influxd_rounds.append(influxd_cpu(work / "lines", points // args.windows))

    size = sum(len(body) for body in bodies) / len(bodies)
    print(
        f"{args.ranks} ranks x {args.windows} windows, {args.kernels} kernel classes: "
        f"{points} points ({points / len(bodies):.0f} per request, {size:.0f} B gzip bodies); "
        f"bridge CPU per point, median of {args.rounds} interleaved rounds (min-max)"
    )
    header = "".join(f"{version:>22}" for version in versions)
    print(f"{'stage (us/point)':28}{header}")
    for stage in STAGES:
        print(f"  {stage:26}" + "".join(f"{spread(figures[v][stage]):>22}" for v in versions))

    def influxd(key: str) -> list[float]:
        return [float(figures[key]) for figures in influxd_rounds]

    unsettled = sum(not figures["settled"] for figures in influxd_rounds)
    print(f"  influxd, first window (creates the series)  {spread(list(influxd('create')))}")
    print(f"  influxd, later windows: write               {spread(list(influxd('write')))}")
    print(
        f"  influxd, later windows: write + compaction  {spread(list(influxd('total')))}"
        f"{f' (compaction not finished in {unsettled} rounds)' if unsettled else ''}"
    )
    steady = influxd("total")
    for version in versions:
        for stage in ("intake", "intake, python") if version == "after" else ("intake",):
            ratios = [
                value / total
                for value, total in zip(figures[version][stage], steady, strict=True)
                if value is not None
            ]
            if not ratios:
                continue
            print(
                f"  {version}, {stage}: bridge CPU / influxd's (later windows, write + "
                f"compaction), per round = {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f})"
            )
    print(f"  requests the fast path declined (after, all rounds): {declined}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
