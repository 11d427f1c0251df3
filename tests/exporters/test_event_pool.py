"""The C event marker's pool: a CUDA timer's events recorded again once nobody holds them.

A mark is a ``torch.Event`` made and recorded per mark; with a pool the marker keeps the events
it made and records the oldest one again when its reference count says no step, interval or
boundary holds it any more. What must never happen is a mark handed out while a holder still
needs its earlier reading: the monitor's results with a pool are compared here, window by
window, with those of a device whose marks are plain numbers.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from stepwatch.exporters import InMemoryExporter
from stepwatch.exporters._recorder import FAST_RECORDER
from tests.exporters.test_auto import _summary
from tests.exporters.test_auto_device import VirtualDevice, device_job

_fastrecord = pytest.importorskip("stepwatch.exporters._fastrecord")
pytestmark = pytest.mark.skipif(FAST_RECORDER is None, reason="the C extension is off")


class _Event:
    """Shaped like ``torch.Event``: record() takes the device clock's reading."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self.at: int | None = None
        self.records = 0
        self.refuse = False

    def record(self) -> None:
        if self.refuse:
            raise RuntimeError("the device is gone")
        self.records += 1
        self.at = 0 if self.device is None else self.device.now_ns


def test_without_a_pool_every_mark_is_a_new_event() -> None:
    marker = _fastrecord.EventMarker(_Event)
    first = marker()
    gone = weakref.ref(first)
    del first
    assert gone() is None  # nothing kept it
    second = marker()
    assert (marker.pool, marker.held, marker.made, marker.reused) == (0, 0, 2, 0)
    assert second.records == 1


def test_a_kept_event_is_recorded_again_only_once_nobody_holds_it() -> None:
    marker = _fastrecord.EventMarker(_Event, pool=4)
    first = marker()
    second = marker()
    assert (marker.held, marker.made, marker.reused) == (2, 2, 0)
    third = marker()  # the oldest (first) is still held: a new one
    assert third is not first and third is not second
    del first
    fourth = marker()  # the ring is not full yet: its empty slots are filled first
    assert marker.made == 4 and marker.held == 4
    again = marker()  # the oldest kept event, now held by nobody else
    assert again.records == 2 and marker.reused == 1
    assert again is not second and again is not third and again is not fourth


def test_events_come_back_in_the_order_they_were_handed_out() -> None:
    marker = _fastrecord.EventMarker(_Event, pool=64)
    held = [marker() for _ in range(10)]
    ids = [id(event) for event in held]
    for _ in range(6):  # fill the rest of the first ring (16)
        held.append(marker())
    ids += [id(event) for event in held[10:]]
    held.clear()
    again = [marker() for _ in range(16)]
    assert [id(event) for event in again] == ids
    assert marker.made == 16 and marker.reused == 16


def test_a_held_oldest_event_grows_the_ring_and_keeps_the_order() -> None:
    marker = _fastrecord.EventMarker(_Event, pool=64)
    held = [marker() for _ in range(16)]  # the first ring, full
    ids = [id(event) for event in held]
    del held[10:]  # the oldest ten are still held: the eight looked at are
    grown = [marker() for _ in range(16)]  # the ring doubles: 16 new events after the old 16
    assert marker.made == 32 and marker.held == 32
    assert all(event.records == 1 for event in grown)
    del held[:]
    grown.clear()
    # The next 32 marks go oldest first: the first ring's 16 (held ones freed since), then
    # the grown part's.
    order = [id(marker()) for _ in range(32)]
    assert order[:16] == ids
    assert marker.reused == 32


def test_one_event_held_for_long_is_passed_over() -> None:
    marker = _fastrecord.EventMarker(_Event, pool=64)
    kept = [marker() for _ in range(16)]
    oldest = kept[0]
    kept.clear()
    for _ in range(100):  # each mark let go at once, the oldest held all along
        assert marker() is not oldest
    assert (marker.made, marker.held, marker.reused) == (16, 16, 100)
    assert oldest.records == 1


def test_at_its_limit_a_held_event_goes_to_its_holders_and_a_new_one_takes_its_slot() -> None:
    marker = _fastrecord.EventMarker(_Event, pool=2)
    first, second = marker(), marker()
    gone = weakref.ref(first)
    third = marker()  # both held: a new event replaces the oldest in the ring
    assert (marker.held, marker.made) == (2, 3)
    del first
    gc.collect()
    assert gone() is None  # the ring let it go: its holder's drop destroyed it
    del second, third
    fourth, fifth = marker(), marker()
    assert marker.made == 3 and marker.reused == 2
    assert fourth.records == 2 and fifth.records == 2


def test_a_kept_event_that_refuses_is_replaced_and_a_new_one_that_refuses_raises() -> None:
    marker = _fastrecord.EventMarker(_Event, pool=16)
    event = marker()
    event.refuse = True
    gone = weakref.ref(event)
    del event
    for _ in range(15):
        marker()  # fill the ring: the refusing event is the oldest again
    fresh = marker()  # a new event instead, in its slot
    assert fresh.records == 1 and gone() is None
    assert (marker.refused, marker.made, marker.held) == (1, 17, 16)

    class Refused(_Event):
        def record(self) -> None:
            raise RuntimeError("no CUDA")

    refusing = _fastrecord.EventMarker(Refused, pool=4)
    with pytest.raises(RuntimeError, match="no CUDA"):
        refusing()
    assert (refusing.held, refusing.made) == (0, 0)  # a new event that fails is not kept
    with pytest.raises(ValueError):
        _fastrecord.EventMarker(_Event, pool=-1)

    class Gone(_Event):
        gone = False

        def record(self) -> None:
            if Gone.gone:
                raise RuntimeError("the device is gone")
            super().record()

    marker = _fastrecord.EventMarker(Gone, pool=16)
    for _ in range(16):
        marker()
    Gone.gone = True  # kept and new events alike refuse: the new one's error, the ring kept
    with pytest.raises(RuntimeError, match="the device is gone"):
        marker()
    assert (marker.refused, marker.made, marker.held) == (1, 16, 16)
    Gone.gone = False
    assert marker().records == 2 and marker.reused == 1


class _DeviceEvent(_Event):
    """Like ``torch.Event``: the first record fixes its device; another refuses."""

    current = 0

    def __init__(self) -> None:
        super().__init__()
        self.index: int | None = None

    def record(self) -> None:
        if self.index is not None and self.index != _DeviceEvent.current:
            raise RuntimeError("Event device index does not match recording stream's")
        self.index = _DeviceEvent.current
        super().record()


def test_a_kept_event_of_another_device_is_replaced_and_no_mark_fails() -> None:
    _DeviceEvent.current = 0
    marker = _fastrecord.EventMarker(_DeviceEvent, pool=64)
    for _ in range(16):
        marker()  # the first ring: 16 events of device 0, each let go at once
    _DeviceEvent.current = 1
    moved = [marker() for _ in range(16)]
    assert all(event.index == 1 for event in moved)
    assert (marker.refused, marker.made, marker.held) == (16, 32, 16)
    del moved
    assert all(marker().index == 1 for _ in range(40))  # the replacements, reused
    assert (marker.refused, marker.made) == (16, 32)
    # A process whose marks keep moving between devices: the pool retires after 64 refusals.
    for _ in range(60):
        _DeviceEvent.current ^= 1
        for _ in range(16):
            assert marker().index == _DeviceEvent.current
    assert marker.refused == 64 and marker.pool == 0 and marker.held == 0
    made = marker.made
    marker()
    assert marker.made == made + 1 and marker.held == 0


def test_the_ring_is_released_with_the_marker_and_seen_by_the_collector() -> None:
    marker = _fastrecord.EventMarker(_Event, pool=8)
    events = [marker() for _ in range(3)]
    refs = [weakref.ref(event) for event in events]
    events[0].cycle = marker  # a cycle that only the ring closes
    del events
    del marker
    gc.collect()
    assert all(ref() is None for ref in refs)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_mark_never_hands_out_an_event_someone_still_holds(seed: int) -> None:
    """Random holds and drops, as steps waiting for export do: each event handed out is
    held by nobody else, and events are reused once the holders go."""
    generator = random.Random(seed)
    marker = _fastrecord.EventMarker(_Event, pool=48)
    held: list[Any] = []
    for _ in range(5_000):
        if held and generator.random() < 0.45:
            del held[: generator.randint(1, min(len(held), 40))]  # oldest first, in windows
        elif held and generator.random() < 0.05:
            held.pop(generator.randrange(len(held)))  # one out of order
        else:
            event = marker()
            assert all(event is not other for other in held)
            held.append(event)
    assert marker.held <= 48
    assert marker.reused > marker.made  # most marks took a kept event


def test_threads_marking_at_once_never_share_an_event() -> None:
    """The training thread and autograd's device thread both mark; record() may let another
    thread in (here it always does): each event handed out is in nobody else's hands."""

    class Yielding(_Event):
        def record(self) -> None:
            time.sleep(0)  # the GIL to another thread, mid-mark
            super().record()

    marker = _fastrecord.EventMarker(Yielding, pool=8)  # small: a look-ahead sees all of it
    errors: list[str] = []

    def work(seed: int) -> None:
        generator = random.Random(seed)
        held: list[Any] = []
        for _ in range(2_000):
            event = marker()
            if getattr(event, "owner", None) is not None:
                errors.append(f"handed out while held by {event.owner}")
            event.owner = seed
            held.append(event)
            if generator.random() < 0.3:
                for old in held:
                    old.owner = None
                held.clear()
        for old in held:
            old.owner = None

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert marker.reused > 1_000  # of 8,000 marks, the threads holding up to ~10 each


def test_an_event_being_recorded_again_is_not_taken_by_another_thread() -> None:
    """Thread A's mark takes the one kept event and its record() lets B in (A waits there):
    B's mark must make a new event, not take A's. The kept event's record is a closure that
    holds no reference to it, as a C++ binding's record() need not."""
    entered, release = threading.Event(), threading.Event()
    marker = _fastrecord.EventMarker(_Event, pool=1)
    kept = marker()
    a_thread: list[Any] = [None]

    def record() -> None:
        if threading.current_thread() is a_thread[0]:
            entered.set()
            release.wait(10)

    kept.record = record
    del kept  # let go: only the ring holds it
    got: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: got.setdefault("a", marker()))
    a_thread[0] = thread
    thread.start()
    assert entered.wait(10)
    got["b"] = marker()  # while A's record waits
    release.set()
    thread.join(10)
    assert got["a"] is not got["b"]
    assert (marker.made, marker.reused) == (2, 1)


def _windows(exporter: InMemoryExporter) -> list[dict[str, Any]]:
    summaries = []
    for window in exporter.exported:
        single = InMemoryExporter()
        single.exported.append(window)
        summaries.append(_summary(single))
    return summaries


class PooledDevice(VirtualDevice):
    """The virtual device, with marks that are events from a pooled C marker (as
    ``CudaEventTimer`` makes them): each event reads the device clock when recorded."""

    def __init__(self, pool: int) -> None:
        super().__init__()
        self.marker = _fastrecord.EventMarker(lambda: _Event(self), pool)

    def mark(self) -> Any:  # type: ignore[override]
        self.marks += 1
        return self.marker()

    def elapsed_s(self, start: Any, end: Any) -> float:  # type: ignore[override]
        return (end.at - start.at) * 1e-9


def _device_run(
    tmp_path: Path, device: VirtualDevice, *, steps: int, sampling: int
) -> list[dict[str, Any]]:
    tmp_path.mkdir()
    exporter, monitor = device_job(
        tmp_path, device, steps=steps, sampling=sampling, export_every=5, uneven=True
    )
    assert monitor.stats.misuse == 0
    return _windows(exporter)


@pytest.mark.parametrize("sampling", [1, 4])
def test_a_monitor_on_pooled_events_reads_what_plain_marks_read(
    tmp_path: Path, sampling: int
) -> None:
    steps = 40
    plain = _device_run(tmp_path / "plain", VirtualDevice(), steps=steps, sampling=sampling)
    device = PooledDevice(pool=64)
    pooled = _device_run(tmp_path / "pooled", device, steps=steps, sampling=sampling)
    assert len(plain) == len(pooled) >= steps // 5
    assert pooled == plain
    assert sum(window["steps"]["count"] for window in pooled) == steps
    # After the first window, marks mostly took events the export had let go of.
    assert device.marker.reused > 0.7 * device.marks
    assert device.marker.made < 0.3 * device.marks


def test_the_cuda_timer_marks_with_a_pool_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from stepwatch.exporters.device import _cuda
    from tests.exporters.test_auto_device import _TorchEvent

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "Event", _TorchEvent, raising=False)
    timer = _cuda.CudaEventTimer()
    assert timer.kind == "torch.Event (C marker, pool)"
    assert timer.mark.pool == _cuda.EVENT_POOL
    first = timer.mark()
    first_id = id(first)
    del first
    for _ in range(15):
        timer.mark()  # each let go at once: the first ring's 16 slots filled
    again = timer.mark()
    assert id(again) == first_id and timer.mark.reused >= 1
    assert timer.ready(again) and timer.elapsed_s(again, timer.mark()) > 0
    plain = _cuda.CudaEventTimer(pool=0)
    assert plain.kind == "torch.Event (C marker)" and plain.mark.pool == 0
