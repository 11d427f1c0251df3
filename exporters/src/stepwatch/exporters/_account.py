"""The monitor's own account: every step and window delivered, dropped (with a reason) or queued.

Two ledgers that always add up (exactly whenever no step is being recorded at that instant,
for instance after ``close()``):

- steps: ``steps_recorded == steps_exported + steps_dropped + steps_queued``, and
  ``steps_dropped`` is the sum of ``steps_dropped_by_reason``;
- windows: ``windows_built == windows_exported + windows_dropped + windows_in_flight``, and
  ``windows_dropped`` is the sum of ``windows_dropped_by_reason``.

Reasons (:data:`STEP_DROP_REASONS`, :data:`WINDOW_DROP_REASONS`):

- ``buffer_full``: the step buffer was full when the step finished (the export thread was
  stuck, e.g. behind a black-hole endpoint);
- ``export_failed``: the window's export failed (refused, unreachable, or no answer before the
  export's deadline) or the exporter raised;
- ``build_failed``: building the window raised (a bug; logged with its traceback);
- ``closed``: still waiting when ``close()`` ran out of time, or cut short by it.

The export thread changes the export-side counters under one lock, and :meth:`ExportAccount.
snapshot` reads them under it, so a window moving from the buffer to the wire is never counted
twice or not at all.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from stepwatch.exporters import _cext

if TYPE_CHECKING:
    from stepwatch.exporters._window import KernelSource, KernelWindow

_log = logging.getLogger(__name__)

STEP_DROP_REASONS: Final = ("buffer_full", "export_failed", "build_failed", "closed")
WINDOW_DROP_REASONS: Final = ("export_failed", "closed")


@dataclasses.dataclass(frozen=True)
class MonitorStats:
    """Counters of one monitor since it was built (see :mod:`stepwatch.exporters._account`).

    Attributes:
        steps_recorded: Steps finished on the training thread.
        steps_exported: Steps delivered in a successful export.
        steps_dropped: Steps lost, whatever the reason (the sum of the next field).
        windows_exported: Successful exports.
        export_failures: Exports that failed (exporter returned failure or raised).
        misuse: Calls ignored for bad usage (bad phase name, nested or unbalanced step).
        observations_overflowed: Observations folded into ``other`` by the series caps.
        observations_rejected: Durations refused as negative, NaN or infinite.
        steps_queued: Steps waiting: in the buffer or in the window being exported.
        steps_dropped_by_reason: Reason (``buffer_full``, ``export_failed``, ``build_failed``,
            ``closed``) → steps.
        windows_built: Windows handed to the exporter (with steps, kernels or only progress).
        windows_dropped: Windows whose export failed or was cut short by ``close()``.
        windows_dropped_by_reason: Reason (``export_failed``, ``closed``) → windows.
        windows_in_flight: A window being exported right now (0 or 1).
        export_cpu_s: CPU time of the export work so far: every export (building, encoding
            and sending a window, the kernel source's drain included, on whichever thread
            called it) and the export thread's looks between exports.
        implementation: Which paths time the steps and build the windows: ``c`` (the C
            extensions) or ``python`` (not built: no C compiler; or turned off by
            ``STEPWATCH_EXPORTERS_NO_C``). The same phases either way (docs/packaging.md).
    """

    steps_recorded: int
    steps_exported: int
    steps_dropped: int
    windows_exported: int
    export_failures: int
    misuse: int
    observations_overflowed: int
    observations_rejected: int
    steps_queued: int
    steps_dropped_by_reason: dict[str, int]
    windows_built: int
    windows_dropped: int
    windows_dropped_by_reason: dict[str, int]
    windows_in_flight: int
    export_cpu_s: float = 0.0
    implementation: str = "c"


class ExportAccount:
    """The export side's counters, changed by the export thread (and ``close``) under a lock.

    Attributes:
        lock: Held while steps leave the buffer and while a snapshot is taken.
        steps_in_flight: Steps of the window being built or exported.
        window_in_flight: Whether a window is with the exporter now.
        steps_exported: Steps delivered.
        windows_exported: Windows delivered.
        windows_built: Windows handed to the exporter.
        export_failures: Failed exports (what ``MonitorStats.export_failures`` has always said).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps_in_flight = 0
        self.window_in_flight = False
        self.steps_exported = 0
        self.windows_exported = 0
        self.windows_built = 0
        self.export_failures = 0
        self._steps_dropped = dict.fromkeys(STEP_DROP_REASONS, 0)
        self._windows_dropped = dict.fromkeys(WINDOW_DROP_REASONS, 0)
        self.cpu = CpuLedger()

    def drop_steps(self, reason: str, count: int) -> None:
        """Count ``count`` steps lost for ``reason`` (caller holds :attr:`lock`)."""
        self._steps_dropped[reason] += count

    def settle(self, *, delivered: bool, reason: str = "export_failed") -> None:
        """The window in flight was delivered, or dropped for ``reason`` (takes the lock)."""
        with self.lock:
            steps, self.steps_in_flight = self.steps_in_flight, 0
            window, self.window_in_flight = self.window_in_flight, False
            if delivered:
                self.steps_exported += steps
                self.windows_exported += int(window)
                return
            self._steps_dropped[reason] += steps
            if window:
                self._windows_dropped[reason] += 1

    def snapshot(
        self,
        *,
        steps_recorded: int,
        buffer_steps: int,
        buffer_dropped: int,
        misuse: int,
        overflowed: int,
        rejected: int,
    ) -> MonitorStats:
        """The counters as :class:`MonitorStats` (training-side figures passed in)."""
        with self.lock:
            steps_dropped = dict(self._steps_dropped)
            steps_dropped["buffer_full"] += buffer_dropped
            windows_dropped = dict(self._windows_dropped)
            return MonitorStats(
                steps_recorded=steps_recorded,
                steps_exported=self.steps_exported,
                steps_dropped=sum(steps_dropped.values()),
                windows_exported=self.windows_exported,
                export_failures=self.export_failures,
                misuse=misuse,
                observations_overflowed=overflowed,
                observations_rejected=rejected,
                steps_queued=buffer_steps + self.steps_in_flight,
                steps_dropped_by_reason=steps_dropped,
                windows_built=self.windows_built,
                windows_dropped=sum(windows_dropped.values()),
                windows_dropped_by_reason=windows_dropped,
                windows_in_flight=int(self.window_in_flight),
                export_cpu_s=self.cpu.spent_ns / 1e9,
                implementation=_cext.IMPLEMENTATION,
            )


class CpuLedger:
    """What the export work costs in CPU time, charged to a kernel source's budget.

    Measured on the CPU clock of the thread doing it (``time.thread_time_ns``, a system call
    of ~0.4 µs, three an export). A kernel source with a ``charge(cpu_ns)`` method (the
    ``torch.profiler`` one) pays it from its overhead budget, so its cycles get what the
    export leaves (docs/exporters.md, "One budget off the training step"). What is charged:
    each export's CPU less the source's own ``drain()`` (which charges itself), and on the
    export thread also its CPU between exports (its looks at the step count, a garbage
    collection it ran). The export thread's first export is counted, not charged: like the
    profiler's warm-up, it pays one-time set-up (the first connection).

    Only the thread holding the monitor's export lock calls it.
    """

    def __init__(self, clock_ns: Callable[[], int] = time.thread_time_ns) -> None:
        self._clock_ns = clock_ns
        self.spent_ns = 0
        self._drained_ns = 0
        self._thread_mark: int | None = None  # export thread's clock when its export ended
        self._charge_failed = False

    def begin(self) -> int:
        """The calling thread's CPU clock as an export begins."""
        self._drained_ns = 0
        return self._clock_ns()

    def drain(self, source: KernelSource, log: Any) -> KernelWindow | None:
        """``source.drain()`` (None when it raised: logged), its CPU time set apart."""
        started = self._clock_ns()
        try:
            return source.drain()
        except Exception:
            log.warning("kernel-drain", "kernel source drain() raised", exc_info=True)
            return None
        finally:
            self._drained_ns += self._clock_ns() - started

    def end(self, started_ns: int, source: object, *, export_thread: bool) -> None:
        """An export that began at ``started_ns`` ended: count it, charge ``source``."""
        now = self._clock_ns()
        spent = now - started_ns
        first = False
        if export_thread:
            mark, self._thread_mark = self._thread_mark, now
            first = mark is None
            if mark is not None:  # and its CPU since its last export: the looks between
                spent = now - mark
        self.spent_ns += max(0, spent)
        charge = getattr(source, "charge", None)
        if charge is None or first:
            return
        try:
            charge(max(0, spent - self._drained_ns))
        except Exception:  # a source's accounting never stops an export: said once
            if not self._charge_failed:
                self._charge_failed = True
                _log.warning("the kernel source's charge() raised", exc_info=True)
