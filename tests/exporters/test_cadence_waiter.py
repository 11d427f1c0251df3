"""The export thread's looks between exports, in C without the GIL (``ExportWaiter``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from stepwatch.exporters import InMemoryExporter, StepMonitor
from stepwatch.exporters.monitor import _cadence
from stepwatch.exporters.monitor._cadence import ExportCadence, StopEvent, run_exports

pytestmark = pytest.mark.skipif(_cadence.WAITER is None, reason="no C ExportWaiter here")


def _recorder() -> tuple[StepMonitor, Any]:
    monitor = StepMonitor(
        job_id="waiter",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        start=False,
        health=False,
    )
    return monitor, monitor._recorder


def _step(monitor: StepMonitor) -> None:
    with monitor.step():
        pass


def test_a_wait_ends_when_its_time_is_up() -> None:
    _monitor, recorder = _recorder()
    started = time.monotonic()
    steps, changed_s, reason = _cadence.WAITER().wait(recorder, 0.3, 0.1, 10.0, True, 0, started)
    assert reason == 0 and steps == 0 and changed_s == started
    assert 0.29 <= time.monotonic() - started < 0.5


def test_a_wait_ends_when_the_count_stands_still_for_the_quiet_time() -> None:
    monitor, recorder = _recorder()
    waiter = _cadence.WAITER()
    stop = threading.Event()

    def steps() -> None:  # steps every 20 ms for 0.5 s, then none
        until = time.monotonic() + 0.5
        while time.monotonic() < until and not stop.is_set():
            _step(monitor)
            time.sleep(0.02)

    thread = threading.Thread(target=steps)
    started = time.monotonic()
    thread.start()
    try:
        count, changed_s, reason = waiter.wait(recorder, 5.0, 0.05, 0.4, False, 0, started)
    finally:
        stop.set()
        thread.join()
    ended = time.monotonic()
    assert reason == 1 and count == recorder.steps_recorded > 10
    # The count last moved within a look of the last step; the wait ended once it had stood
    # still for the quiet time, at a look.
    assert 0.45 <= changed_s - started <= 0.65
    assert 0.4 <= ended - changed_s < 0.55


def test_a_wait_not_armed_ignores_a_count_that_does_not_move() -> None:
    # After an early export (or before the first step) a still count is no news: only a step
    # finishing arms the stall again.
    monitor, recorder = _recorder()
    _step(monitor)
    started = time.monotonic()
    steps, _, reason = _cadence.WAITER().wait(recorder, 0.4, 0.05, 0.1, False, 1, started)
    assert reason == 0 and steps == 1 and time.monotonic() - started >= 0.39


def test_wake_ends_a_wait_now_and_every_later_one() -> None:
    _monitor, recorder = _recorder()
    waiter = _cadence.WAITER()
    threading.Timer(0.1, waiter.wake).start()
    started = time.monotonic()
    assert waiter.wait(recorder, 30.0, 1.0, 10.0, True, 0, started)[2] == 2
    assert time.monotonic() - started < 1.0
    assert waiter.wait(recorder, 30.0, 1.0, 10.0, True, 0, started)[2] == 2


def test_a_wait_refuses_what_it_cannot_look_at() -> None:
    with pytest.raises(TypeError):
        _cadence.WAITER().wait(object(), 0.1, 0.1, 1.0, True, 0, 0.0)
    _monitor, recorder = _recorder()
    with pytest.raises(ValueError, match="probe_s"):
        _cadence.WAITER().wait(recorder, 0.1, 0.0, 1.0, True, 0, 0.0)


class _Counting:
    def __init__(self) -> None:
        self.looks = 0


def _count_looks(monkeypatch: pytest.MonkeyPatch) -> _Counting:
    """Count the export thread's Python-side looks (``ExportCadence.due``)."""
    counter = _Counting()
    due = ExportCadence.due

    def counted(self: ExportCadence, now_s: float, steps: int, *, pending: int) -> bool:
        counter.looks += 1
        return due(self, now_s, steps, pending=pending)

    monkeypatch.setattr(ExportCadence, "due", counted)
    return counter


@pytest.mark.parametrize("in_c", [True, False])
def test_between_exports_the_thread_takes_the_gil_only_in_python(
    in_c: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a C recorder the looks between two 10 s exports stay in C: no Python look in 2.5 s
    of steps (the Python loop makes one a second), and close() still ends the wait at once."""
    counter = _count_looks(monkeypatch)
    if not in_c:
        monkeypatch.setattr(_cadence, "WAITER", None)
    monitor = StepMonitor(
        job_id="looks",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        health=False,
        export_interval_s=10.0,
    )
    until = time.monotonic() + 2.5
    while time.monotonic() < until:
        _step(monitor)
        time.sleep(0.01)
    looks = counter.looks
    started = time.monotonic()
    monitor.close()
    assert time.monotonic() - started < 1.0
    assert monitor.stats.steps_exported == monitor.stats.steps_recorded > 100
    if in_c:
        assert looks == 0
    else:
        assert looks >= 2


def test_a_recorder_in_python_keeps_the_python_looks() -> None:
    """A recorder the C wait cannot read: run_exports falls back to its Python loop."""

    class Recorder:
        steps_recorded = 0

    stop, exports = StopEvent(), []
    thread = threading.Thread(
        target=run_exports, args=(0.3, stop, Recorder(), [], lambda: exports.append(1))
    )
    thread.start()
    time.sleep(1.0)
    stop.set()
    thread.join(timeout=2.0)
    assert not thread.is_alive() and 2 <= len(exports) <= 4


def test_a_forked_child_never_waits_on_the_parents_copy() -> None:
    """A child forked while the export thread waits in C gets the waiter's mutex copied as it
    was (maybe locked, by a thread the child does not have): in the child the waiter neither
    waits nor locks; wake() (close at the child's exit) just marks it woken."""
    import os

    monitor = StepMonitor(
        job_id="fork",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        health=False,
        export_interval_s=10.0,
    )
    for _ in range(5):
        _step(monitor)
    time.sleep(0.2)  # the export thread is in its C wait
    waiter = monitor._stop.waiter  # type: ignore[attr-defined]
    pid = os.fork()
    if pid == 0:  # the child: a wait returns at once, woken; wake() returns
        code = 1
        try:
            started = time.monotonic()
            reason = waiter.wait(monitor._recorder, 5.0, 1.0, 10.0, True, 5, started)[2]
            waiter.wake()
            code = 0 if reason == 2 and time.monotonic() - started < 1.0 else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the waiter")
    assert os.waitstatus_to_exitcode(status) == 0
    monitor.close()  # the parent's waiter still works
    assert monitor.stats.steps_exported == 5
