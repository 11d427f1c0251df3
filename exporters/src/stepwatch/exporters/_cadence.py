"""When the export thread exports: once an interval, and early once a rank stops finishing steps.

A window goes out every ``export_interval_s`` (10 s by default). A rank that stops finishing
steps (a hang, a stall) says where it is only in a window without a finished step, so with
10 s windows a hang's first such window could come up to 10 s after it began, and the
detectors' hang finding that much later. The export thread therefore also looks every
``probe_s`` (1 s) at how many steps the training thread has finished: when none for
max(``stall_s``, ``stall_steps`` × the usual step), it exports at once: first the steps
finished before the stall (if any wait), then, a probe later, a window that says where the
rank is. Then nothing early until a step finishes again; the regular windows go on. The probe
reads one counter. In Python each look takes the GIL (~35 µs of the export thread in a DDP job,
~130 µs in a loop that rarely releases it, and a forced hand-over for the training thread), so
where the C recorder is built the looks run in C without the GIL (``_fastrecord.ExportWaiter``):
the thread takes the GIL back only to export, at a stall or at close (docs/exporters.md, "One
budget off the training step").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sized
from typing import Any, Final

from stepwatch.exporters import _cext

# _fastrecord.ExportWaiter where built (Linux): the looks in C; without it (no C extension,
# STEPWATCH_EXPORTERS_NO_C, not Linux): in Python
WAITER: Any = getattr(_cext.fastrecord, "ExportWaiter", None)

#: How often the export thread looks at the step count between two exports.
PROBE_S: Final = 1.0
#: No finished step for at least this long (and ``STALL_STEPS`` usual steps): export early.
STALL_S: Final = 2.0
STALL_STEPS: Final = 4.0


class ExportCadence:
    """The export thread's schedule (docs: module docstring); one instance per export thread.

    Args:
        interval_s: Seconds between regular exports.
        now_s: The monotonic time the schedule starts at.
        probe_s: Seconds between two looks at the step count (no probe when ``interval_s``
            is not longer).
    """

    def __init__(self, interval_s: float, now_s: float, *, probe_s: float = PROBE_S) -> None:
        self.interval_s = interval_s
        self.probe_s = probe_s if probe_s < interval_s else interval_s
        self.next_tick_s = now_s + interval_s
        self.early_exports = 0
        self._steps = 0
        self._changed_s = now_s
        self._step_s: float | None = None
        self._last_estimate_s = float("inf")
        self._told = False

    def wait_s(self, now_s: float) -> float:
        """Seconds to sleep before the next look (0 when a regular export is due)."""
        return max(0.0, min(self.probe_s, self.next_tick_s - now_s))

    def due(self, now_s: float, steps: int, *, pending: int) -> bool:
        """Whether to export now, given ``steps`` finished so far and ``pending`` not yet sent."""
        if now_s >= self.next_tick_s - 1e-3:
            self.next_tick_s += self.interval_s
            if self.next_tick_s <= now_s:  # an export overran a whole interval: start afresh
                self.next_tick_s = now_s + self.interval_s
            self._note(now_s, steps)
            return True
        if self._note(now_s, steps) or self._told or steps == 0:
            return False
        if now_s - self._changed_s < self.quiet_s():
            return False
        # Stalled: the steps still waiting go first; the next early window says where it is.
        self._told = pending == 0
        self.early_exports += 1
        return True

    def quiet_s(self) -> float:
        """How long the step count must stand still for an early export."""
        return max(STALL_S, STALL_STEPS * (self._step_s or 0.0))

    def wait_args(self) -> tuple[float, bool, int, float]:
        """What a look elsewhere (``ExportWaiter.wait``) needs: the quiet time, whether a stall
        would export now (a step finished since the last early export), the count, its time."""
        return self.quiet_s(), not self._told and self._steps > 0, self._steps, self._changed_s

    def observe(self, steps: int, changed_s: float) -> None:
        """Take in looks made elsewhere: the count, and when it last moved."""
        if steps != self._steps:
            self._note(changed_s, steps)

    def _note(self, now_s: float, steps: int) -> bool:
        """Take in the step count; True when steps finished since the last look."""
        if steps == self._steps:
            return False
        if steps > self._steps:  # the first steps: since the start (an upper bound)
            # The smaller of the last two estimates: the look that catches a stall's last
            # step sees one step in a second, not the job's step time.
            estimate = (now_s - self._changed_s) / (steps - self._steps)
            self._step_s = min(estimate, self._last_estimate_s)
            self._last_estimate_s = estimate
        self._steps, self._changed_s, self._told = steps, now_s, False
        return True


class StopEvent(threading.Event):
    """The export thread's stop signal; ``set()`` also ends a wait in C (close)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiter = WAITER() if WAITER is not None else None

    def set(self) -> None:
        super().set()
        if self.waiter is not None:
            self.waiter.wake()


def run_exports(
    interval_s: float,
    stop: threading.Event,
    recorder: Any,
    buffer: Sized,
    export: Callable[[], Any],
) -> ExportCadence:
    """The export thread's loop until ``stop`` is set: ``export()`` when :class:`ExportCadence`
    says so, from ``recorder.steps_recorded`` and the steps waiting in ``buffer``. The looks
    between exports run in C without the GIL where they can (module docstring)."""
    cadence = ExportCadence(interval_s, time.monotonic())
    waiter = getattr(stop, "waiter", None)
    if waiter is not None and cadence.probe_s < interval_s:
        try:
            waiter.wait(recorder, 0.0, 1.0, 1.0, False, 0, 0.0)  # a C recorder: it can look
        except TypeError:
            waiter = None
    else:
        waiter = None
    while not stop.is_set():
        if waiter is None:
            if stop.wait(cadence.wait_s(time.monotonic())):
                break
        else:
            remaining = cadence.next_tick_s - time.monotonic()
            if remaining > 0:
                steps, changed_s, _ = waiter.wait(
                    recorder, remaining, cadence.probe_s, *cadence.wait_args()
                )
                cadence.observe(steps, changed_s)
            if stop.is_set():
                break
        if cadence.due(time.monotonic(), recorder.steps_recorded, pending=len(buffer)):
            export()
    return cadence
