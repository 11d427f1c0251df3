"""Seed inputs for the fast path's fuzzer: valid OTLP bodies of what the bridge receives.

    .venv/bin/python -m tests.otel_bridge.fuzz.corpus DIRECTORY

Each seed is an option byte (``oracle.options``) and a body: exporter windows (phases and
kernels, one rank and several), gauges, sums and histograms of every kind (the ones the fast
path declines too, so the fuzzer starts on both sides of each of its decisions), with the
option bytes that reach every branch of the options.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.otel_bridge import otlp_requests as otlp


def bodies() -> Iterator[bytes]:
    """Valid request bodies."""
    from bench.storage_bytes import window
    from tests.otel_bridge.fuzz.oracle import NOW_NS

    rng = random.Random(46)
    start = NOW_NS - 30 * 10**9
    for rank, kernels in ((0, 0), (1, 3), (2, 20)):
        request, _ = window(
            rng, rank=rank, ranks=4, kernels=kernels, start_ns=start, end_ns=start + 10**10
        )
        yield bytes(request.SerializeToString())
    resource = otlp.rank_resource(rank=3)
    kinds = [
        otlp.gauge("stepwatch.step.last", 7.0),
        otlp.gauge("hw.power", 1.5, attrs={"hw.id": "GPU-0", "other": "dropped"}),
        otlp.counter("stepwatch.step.sampled", 3),
        otlp.exponential_histogram(
            "stepwatch.phase.duration",
            scale=3,
            offset=-60,
            counts=[1, 0, 2],
            total=0.07,
            minimum=0.01,
            maximum=0.04,
            attrs={"stepwatch.phase": "forward"},
        ),
        otlp.exponential_histogram(
            "stepwatch.step.duration",
            scale=0,
            offset=-7,
            counts=[1],
            total=0.01,
            zero_count=1,
            negative_counts=[1],
        ),
        otlp.explicit_histogram(
            "stepwatch.kernel.duration", bounds=[0.001, 0.002], counts=[1, 1, 0], total=0.003
        ),
    ]
    for metric in kinds:
        yield otlp.request([metric], resource=resource).SerializeToString()
    # tags whose values are all empty (not stored), on the resource and on a point
    empty = otlp.gauge("hw.power", 2.0, attrs={"hw.id": ""})
    yield otlp.request([empty], resource={"host.name": ""}).SerializeToString()
    yield otlp.request(kinds, resource=resource).SerializeToString()


def write(directory: Path) -> int:
    """The seeds into ``directory``; how many."""
    directory.mkdir(parents=True, exist_ok=True)
    count = 0
    for number, body in enumerate(bodies()):
        for mode in (0, 1, 2, 4, 6, 8, 16, 24, 32, 64):
            (directory / f"seed-{number:02d}-{mode:03d}").write_bytes(bytes([mode]) + body)
            count += 1
    return count


if __name__ == "__main__":
    print(write(Path(sys.argv[1])), "seeds")
