"""Window times go out in whole milliseconds, strictly increasing per monitor."""

from __future__ import annotations

from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters._window import STAMP_NS, window_stamp


def test_stamps_round_to_the_millisecond_and_never_repeat() -> None:
    assert window_stamp(1_795_000_000_123_499_999) == 1_795_000_000_123_000_000
    assert window_stamp(1_795_000_000_123_500_000) == 1_795_000_000_124_000_000
    previous = 1_795_000_000_124_000_000
    # a window ending within the same millisecond as the previous one gets the next one
    assert window_stamp(1_795_000_000_124_000_100, after=previous) == previous + STAMP_NS
    assert window_stamp(previous + 7 * STAMP_NS, after=previous) == previous + 7 * STAMP_NS


def test_every_exported_point_is_stamped_on_whole_milliseconds() -> None:
    exporter = InMemoryExporter()
    monitor = StepMonitor(
        job_id="j", rank=0, world_size=1, exporter=exporter, start=False, health=False
    )
    stamps: list[int] = []
    for _ in range(3):
        for _ in range(5):
            with monitor.step(), monitor.phase("forward"):
                pass
        assert monitor.export_now()
        # a window with no finished step (where the rank is) right after the previous one
        assert monitor.export_now()
    monitor.close()
    for data in exporter.exported:
        times: set[int] = set()
        for metric in data.resource_metrics[0].scope_metrics[0].metrics:
            for point in metric.data.data_points:
                assert point.time_unix_nano % STAMP_NS == 0, metric.name
                times.add(point.time_unix_nano)
        assert len(times) == 1
        stamps.extend(times)
    assert stamps == sorted(set(stamps)), "two windows share a time"
