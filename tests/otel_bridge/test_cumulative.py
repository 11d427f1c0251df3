"""CUMULATIVE sums and histograms → per-window deltas (``_cumulative.py``, docs/storage.md)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.metrics.v1 import metrics_pb2

from stepwatch.otel_bridge import Bridge, convert_request
from stepwatch.otel_bridge._cumulative import CumulativeState
from tests.otel_bridge.otlp_requests import (
    T0,
    RecordingWriter,
    bucket_fields,
    counter,
    explicit_histogram,
    exponential_histogram,
    line_fields,
    request,
)

SECOND = 1_000_000_000
BOUNDS = [0.1, 0.2, 0.4]
CUMULATIVE = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE


def step(
    counts: Sequence[int], total: float, at_s: int, *, start: int = T0, rank: int = 0
) -> metrics_pb2.Metric:
    metric = explicit_histogram(
        "stepwatch.step.duration",
        bounds=BOUNDS,
        counts=counts,
        total=total,
        minimum=0.05,
        maximum=0.5,
        time_unix_nano=T0 + at_s * SECOND,
        attrs={"stepwatch.phase": f"p{rank}"},
    )
    metric.histogram.aggregation_temporality = CUMULATIVE
    metric.histogram.data_points[0].start_time_unix_nano = start
    return metric


def fields(line: str) -> dict[str, str]:
    return line_fields(line)


def test_first_point_is_a_baseline_then_windows_are_differences() -> None:
    state = CumulativeState()
    first = convert_request(request([step([1, 2, 1, 0], 0.9, 10)]), cumulative=state)
    assert first.lines == [] and first.rejected == {"cumulative_baseline": 1}
    second = convert_request(request([step([2, 5, 3, 1], 2.4, 20)]), cumulative=state)
    (line,) = second.lines
    stored = fields(line)
    assert stored["count"] == "7.0" and float(stored["sum"]) == 1.5
    buckets = bucket_fields(stored)
    assert (buckets["0.1"], buckets["0.2"], buckets["0.4"], buckets["+Inf"]) == (
        "1.0",
        "4.0",
        "6.0",
        "7.0",
    )
    assert "min" not in stored and "max" not in stored  # the run's, not the window's
    assert stored["start_time_unix_nano"] == f"{T0 + 10 * SECOND}i"  # the previous point
    assert line.endswith(f" {T0 + 20 * SECOND}")
    assert ",stepwatch.phase=p0," in line  # the point's attributes are kept
    assert len(state) == 1


def test_resets_out_of_order_and_resends() -> None:
    state = CumulativeState()
    for metric in (step([1, 0, 0, 0], 0.05, 10), step([2, 0, 0, 0], 0.1, 20)):
        convert_request(request([metric]), cumulative=state)
    resend = convert_request(request([step([2, 0, 0, 0], 0.1, 20)]), cumulative=state)
    assert len(resend.lines) == 1 and fields(resend.lines[0])["count"] == "1.0"  # same delta
    older = convert_request(request([step([3, 0, 0, 0], 0.1, 15)]), cumulative=state)
    assert older.rejected == {"cumulative_out_of_order": 1}
    restarted = convert_request(
        request([step([1, 0, 0, 0], 0.05, 30, start=T0 + 25 * SECOND)]), cumulative=state
    )
    assert restarted.rejected == {"cumulative_reset": 1}
    went_down = convert_request(
        request([step([0, 0, 0, 0], 0.0, 40, start=T0 + 25 * SECOND)]), cumulative=state
    )
    assert went_down.rejected == {"cumulative_reset": 1}
    other_bounds = step([1, 0, 0, 0], 0.05, 50, start=T0 + 25 * SECOND)
    other_bounds.histogram.data_points[0].explicit_bounds[0] = 0.05
    assert convert_request(request([other_bounds]), cumulative=state).rejected == {
        "cumulative_reset": 1
    }
    after = convert_request(
        request([step([3, 0, 0, 0], 0.15, 60, start=T0 + 25 * SECOND)]), cumulative=state
    )
    assert after.rejected == {"cumulative_reset": 1}  # bounds changed back: a reset again
    resumed = convert_request(
        request([step([4, 0, 0, 0], 0.2, 70, start=T0 + 25 * SECOND)]), cumulative=state
    )
    assert fields(resumed.lines[0])["count"] == "1.0"


def test_monotonic_counters_differentiate_levels_do_not() -> None:
    state = CumulativeState()

    def sums(value: int, at_s: int) -> list[metrics_pb2.Metric]:
        total = counter("train.tokens", value, time_unix_nano=T0 + at_s * SECOND)
        level = counter("queue.size", value, monotonic=False, time_unix_nano=T0 + at_s * SECOND)
        for metric in (total, level):
            metric.sum.aggregation_temporality = CUMULATIVE
        return [total, level]

    first = convert_request(request(sums(100, 10)), cumulative=state)
    assert first.rejected == {"cumulative_baseline": 1} and len(first.lines) == 1
    second = convert_request(request(sums(130, 20)), cumulative=state)
    stored = {line.split(",")[0]: fields(line) for line in second.lines}
    assert stored["train.tokens"]["counter"] == "30.0"
    assert stored["queue.size"]["gauge"] == "130.0"  # a non-monotonic sum is a level


def test_series_are_separate_per_resource_and_attributes() -> None:
    state = CumulativeState()
    for at_s, counts in ((10, [1, 0, 0, 0]), (20, [3, 0, 0, 0])):
        for rank in range(3):
            message = request([step(counts, 0.1 * sum(counts), at_s, rank=rank)])
            message.resource_metrics[0].resource.attributes[1].value.int_value = rank
            conversion = convert_request(message, cumulative=state)
    assert len(state) == 3 and fields(conversion.lines[0])["count"] == "2.0"


def test_exponential_histograms_are_differentiated_across_a_downscale() -> None:
    state = CumulativeState()

    def kernel(scale: int, offset: int, counts: list[int], at_s: int) -> metrics_pb2.Metric:
        metric = exponential_histogram(
            "stepwatch.kernel.duration",
            scale=scale,
            offset=offset,
            counts=counts,
            total=0.01 * sum(counts),
            time_unix_nano=T0 + at_s * SECOND,
        )
        metric.exponential_histogram.aggregation_temporality = CUMULATIVE
        return metric

    convert_request(request([kernel(2, -20, [1, 1, 0, 1], 10)]), cumulative=state)
    # scale 2 → 1: indexes -20..-17 become -10, -10, -9, -9; then two more observations
    (line,) = convert_request(request([kernel(1, -10, [3, 2], 20)]), cumulative=state).lines
    assert fields(line)["count"] == "2.0"
    vanished = kernel(1, -10, [0, 2], 30)  # an observation lost: a reset
    assert convert_request(request([vanished]), cumulative=state).rejected == {
        "cumulative_reset": 1
    }


def test_state_is_bounded_and_expires() -> None:
    now = [0.0]
    evicted: list[tuple[str, int]] = []
    state = CumulativeState(
        max_series=2, ttl_s=60.0, clock=lambda: now[0], on_evict=lambda *e: evicted.append(e)
    )
    for rank in range(3):
        convert_request(request([step([1, 0, 0, 0], 0.05, 10, rank=rank)]), cumulative=state)
    assert len(state) == 2 and evicted == [("capacity", 1)]
    # rank 0 was forgotten: its next point is a baseline again
    again = convert_request(request([step([2, 0, 0, 0], 0.1, 20, rank=0)]), cumulative=state)
    assert again.rejected == {"cumulative_baseline": 1}
    now[0] = 61.0
    late = convert_request(request([step([2, 0, 0, 0], 0.1, 20, rank=2)]), cumulative=state)
    assert late.rejected == {"cumulative_baseline": 1}  # silent past the TTL: forgotten
    assert ("expired", 1) in evicted


def test_a_refused_request_does_not_advance_the_state() -> None:
    writer = RecordingWriter()
    bridge = Bridge(writer, grpc_port=None, max_queue_lines=1, flush_interval_s=60.0)
    bridge.start()
    try:
        assert bridge.ingest(request([step([1, 0, 0, 0], 0.05, 10)])).accepted
        first = bridge.ingest(request([step([3, 0, 0, 0], 0.15, 20)]))
        assert first.accepted and first.rejected_points == 0
        refused = bridge.ingest(request([step([6, 0, 0, 0], 0.3, 30)]))  # queue full: 429
        assert not refused.accepted
    finally:
        bridge.stop(timeout_s=5)
    assert len(bridge.intake.cumulative) == 1
    state = bridge.intake.cumulative
    # the retry of the refused request is differentiated against the point of second 20
    (line,) = convert_request(request([step([6, 0, 0, 0], 0.3, 30)]), cumulative=state).lines
    assert fields(line)["count"] == "3.0"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=4, max_size=4), min_size=2, max_size=12))
def test_stored_windows_add_up_to_the_cumulative_growth(increments: list[list[int]]) -> None:
    state = CumulativeState()
    running = [0, 0, 0, 0]
    stored = 0.0
    for index, increment in enumerate(increments):
        running = [a + b for a, b in zip(running, increment, strict=True)]
        message = request([step(running, 0.1 * sum(running), 10 * (index + 1))])
        conversion = convert_request(message, cumulative=state)
        stored += sum(float(fields(line)["count"]) for line in conversion.lines)
    assert stored == sum(running) - sum(increments[0])
