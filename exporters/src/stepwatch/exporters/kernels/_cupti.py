"""GPU kernel source: CUPTI activity records (kernels, memcpy, memset, NCCL kernels).

The real CUPTI calls (``cupti-python``: ``cupti.cupti.activity_register_callbacks``,
``activity_enable``, ``activity_flush_all``, ``get_timestamp``) sit behind the small
:class:`CuptiBackend` Protocol. CUPTI fills its buffers asynchronously and hands completed
buffers to a callback on its own worker thread, so the training thread only records step
boundaries (one timestamp each); classification and summarising happen in
:meth:`CuptiSource.drain` on the export thread. If any backend call fails (no GPU, no
``cupti`` package, another tool owns CUPTI), the failure is logged once and the source turns into
a no-op: the training loop never notices.

Step attribution: a device record belongs to the step during whose host-side span it *started*
on the device (CUPTI timestamps and step boundaries both come from CUPTI's clock). Records that
start after the last boundary wait for the next drain. Kernels of an asynchronous step that run
past the host-side boundary are attributed to the next step; histograms per window are
unaffected, and device idle is computed per step on the device timeline.

The callback keeps four fields of each record in flat lists (:class:`ActivityColumns`, no
object per record); the export thread summarises them on numpy arrays
(:func:`summarise_bulk`), or per event when numpy is missing or the bulk path fails (logged
once); both give the same windows.

On a duty cycle (``period_steps``), CUPTI is on for a few steps in many, off in between:
``_cupti_cycle``'s docstring. CUPTI activity reference:
https://docs.nvidia.com/cupti/api/group__CUPTI__ACTIVITY__API.html; the cupti-python
bindings: https://docs.nvidia.com/cupti-python/
"""

from __future__ import annotations

import collections
import logging
import operator
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from stepwatch.core._errors import ConfigError
from stepwatch.exporters._protocols import KernelWindow
from stepwatch.exporters.kernels._cupti_backend import CuptiPythonBackend
from stepwatch.exporters.kernels._cupti_columns import summarise_bulk
from stepwatch.exporters.kernels._cupti_cycle import (
    DETACH_MODES,
    SPARE_STEPS,
    CuptiDutyCycle,
    Cycle,
    split_cycle,
    steps_to_skip,
    stride_for,
)
from stepwatch.exporters.kernels._cupti_records import ActivityColumns, ActivityRecord, columns_of
from stepwatch.exporters.kernels._duty import DEFAULT_OVERHEAD_BUDGET
from stepwatch.exporters.kernels._summary import DEFAULT_TOP_K, KernelEvent, KernelSummariser

_NEVER = 1 << 62  # step ends a failed duty-cycled source asks the recorder not to report
_log = logging.getLogger(__name__)


class CuptiBackend(Protocol):
    """The CUPTI calls the source makes; :class:`CuptiPythonBackend` is the real one."""

    def enable(
        self, on_records: Callable[[Sequence[ActivityRecord] | ActivityColumns], None]
    ) -> None:
        """Register buffer callbacks and enable kernel / memcpy / memset activity.

        ``on_records`` is called (on any thread) with the records of each completed buffer:
        :class:`ActivityRecord` objects, or :class:`ActivityColumns` (the real backend: no
        object per record).
        """

    def flush(self) -> None:
        """Complete all buffers now (``cuptiActivityFlushAll``), delivering their records."""

    def timestamp_ns(self) -> int:
        """Now on CUPTI's clock (``cuptiGetTimestamp``)."""

    def disable(self) -> None:
        """Disable activity collection."""

    # Optional, for detach="finalize": detach(on_detached), as CuptiPythonBackend.detach.


def _rows(columns: ActivityColumns) -> list[tuple[int, int, int, Any]]:
    """``(start, end, device, name)`` per record, as ints; a record with a value that is no
    int (a field CUPTI did not fill) is left out rather than failing the whole drain."""
    fields = (columns.starts, columns.ends, columns.devices, columns.names)
    try:
        starts, ends, devices = (map(int, values) for values in fields[:3])
        return list(zip(starts, ends, devices, fields[3], strict=True))
    except (TypeError, ValueError, OverflowError):
        pass
    rows = []
    for start, end, device, name in zip(*fields, strict=True):
        try:
            rows.append((int(start), int(end), int(device), name))
        except (TypeError, ValueError, OverflowError):
            continue
    return rows


_START = operator.itemgetter(0)


class CuptiSource:
    """A :class:`~stepwatch.exporters.KernelSource` of CUPTI activity records.

    Args:
        backend: The CUPTI calls (default :class:`CuptiPythonBackend`).
        top_k: Kernel classes kept by name (see :class:`KernelSummariser`).
        max_buffered_records: Records held between drains; beyond it new records are dropped
            and counted in :attr:`dropped_records` (bounded memory if the exporter stalls).
        period_steps: ``None`` (the default): CUPTI records every step from the monitor's
            start. A number: CUPTI records ``active_steps`` steps in every ``period_steps``,
            on the same steps on every rank, and is off in between (``_cupti_cycle``'s
            docstring); at least ``active_steps + 3``.
        active_steps: Steps recorded per cycle (with ``period_steps``).
        detach: How CUPTI is switched off between cycles: ``disable`` its activity kinds
            (CUPTI stays loaded, and on an H200 a launch kept most of CUPTI's cost), or
            ``finalize``: take CUPTI out of the process (the backend's ``detach``; where it
            fails, the kinds are disabled instead). Neither has run on a GPU yet
            (docs/exporters.md, "Kernel and op histograms").
        overhead_budget: On a duty cycle, the share of training time a cycle's switches
            (on, off, finalize: measured) may take; where they cost more at ``period_steps``,
            cycles take every second, fourth, ... grid step (``duty_cycle.stride``).

    Raises:
        ConfigError: An option is out of range.
    """

    def __init__(
        self,
        *,
        backend: CuptiBackend | None = None,
        top_k: int = DEFAULT_TOP_K,
        max_buffered_records: int = 2_000_000,
        period_steps: int | None = None,
        active_steps: int = 5,
        detach: str = "disable",
        overhead_budget: float = DEFAULT_OVERHEAD_BUDGET,
    ) -> None:
        if max_buffered_records < 1:
            raise ConfigError(f"max_buffered_records must be >= 1, got {max_buffered_records}")
        if active_steps < 1:
            raise ConfigError(f"active_steps must be >= 1, got {active_steps}")
        if period_steps is not None and period_steps < active_steps + SPARE_STEPS + 1:
            raise ConfigError(
                f"period_steps must be >= active_steps + {SPARE_STEPS + 1} "
                f"({active_steps + SPARE_STEPS + 1}), got {period_steps}"
            )
        if not 0 < overhead_budget <= 1:
            raise ConfigError(f"overhead_budget must be in (0, 1], got {overhead_budget}")
        if detach not in DETACH_MODES:
            raise ConfigError(f"detach must be one of {DETACH_MODES}, got {detach!r}")
        self._backend: CuptiBackend = backend if backend is not None else CuptiPythonBackend()
        if detach == "finalize" and not callable(getattr(self._backend, "detach", None)):
            raise ConfigError("detach='finalize' needs a backend with a detach() method")
        self._period = period_steps
        self._active = active_steps
        self._detach_mode = detach
        self._cycle: Cycle | None = None  # the cycle CUPTI is on for, None between cycles
        self._recording = False  # the cycle's warm-up is over
        self._cycles: collections.deque[Cycle] = collections.deque()  # finished, not drained
        self._detaching = False  # a finalize asked for and not yet done
        self._closed = False
        self._stats = {"cycles": 0, "skipped_cycles": 0, "fallbacks": 0}
        self._times: dict[str, float | None] = {"attach": None, "detach": None, "finalize": None}
        self._budget = overhead_budget
        self._stride = 1
        self._steps_per_s = 0.0  # training speed, measured from one cycle's end to the next
        self._last_off: tuple[int, float] | None = None  # (step, clock) of the last switch-off
        self._attached_at = (0, 0.0)  # (step, clock) of the last switch-on
        self._clock = time.perf_counter
        self._summariser = KernelSummariser(top_k=top_k)
        self._max_buffered = max_buffered_records
        self._columns = ActivityColumns()
        self._records_lock = threading.Lock()
        self._drain_lock = threading.Lock()
        self._boundaries: collections.deque[tuple[int, int]] = collections.deque()
        self._last_boundary_ns: int | None = None
        self._enabled = False
        self._failed = False
        self._bulk = True  # False once numpy was missing or the bulk path failed
        self.dropped_records = 0
        """Records discarded because the buffer bound was reached (cumulative)."""

    @property
    def active(self) -> bool:
        """False once a CUPTI call failed (the source is then a no-op)."""
        return not self._failed

    def _fail(self, what: str) -> None:
        if not self._failed:
            _log.warning(
                "CUPTI %s failed; GPU kernel collection disabled for this process",
                what,
                exc_info=True,
            )
        self._failed = True

    def _ensure_enabled(self) -> bool:
        if self._enabled:
            return True
        if self._failed:
            return False
        try:
            self._backend.enable(self._on_records)
        except Exception:
            self._fail("enable")
            return False
        self._enabled = True
        return True

    def _on_records(self, records: Sequence[ActivityRecord] | ActivityColumns) -> None:
        columns = records if isinstance(records, ActivityColumns) else columns_of(records)
        with self._records_lock:
            room = self._max_buffered - len(self._columns)
            if room < len(columns):
                self.dropped_records += len(columns) - max(room, 0)
                columns = columns.head(max(room, 0))
            self._columns.extend(columns)

    def on_monitor_start(self) -> None:
        """Enable CUPTI when the monitor is made, so the first step's kernels are recorded.

        That step's start is unknown to CUPTI: its kernels count and its idle time does not,
        and kernels launched between the monitor's creation and the first step count in it.
        On a duty cycle nothing happens here: CUPTI is switched on by the first cycle.
        """
        if self._period is None:
            self._ensure_enabled()

    def on_step_end(self, step_index: int) -> int | None:
        """Step boundary (training thread): one CUPTI timestamp and an append. On a duty cycle,
        the steps to skip until the next cycle's start (none reported between cycles)."""
        if self._period is not None:
            return self._cycle_step(step_index, self._period)
        if self._failed:
            return None
        try:
            if not self._ensure_enabled():
                return None
            self._boundaries.append((step_index, self._backend.timestamp_ns()))
        except Exception:
            self._fail("get_timestamp")
        return None

    def _cycle_step(self, step_index: int, asked: int) -> int | None:
        if self._failed or self._closed:
            return _NEVER
        cycle = self._cycle
        period = asked * self._stride
        try:
            if cycle is None:
                if (step_index + 1) % period:
                    return steps_to_skip(step_index, period)
                if self._detaching:  # no CUDA call since the last detach was asked for
                    self._stats["skipped_cycles"] += 1
                    return steps_to_skip(step_index, period)
                begin = self._clock()
                try:
                    self._backend.enable(self._on_records)
                except Exception:
                    self._fail("enable")
                    return _NEVER
                self._times["attach"] = self._clock() - begin
                self._attached_at = (step_index, begin)
                self._enabled, self._recording = True, False
                self._cycle = Cycle(0)
            elif not self._recording:
                cycle.start_ns = self._backend.timestamp_ns()  # the warm-up step's end
                self._recording = True
            elif len(cycle.boundaries) < self._active:
                cycle.boundaries.append((step_index, self._backend.timestamp_ns()))
            else:  # the spill-over step's end
                self._switch_off(cycle, step_index)
                return steps_to_skip(step_index, asked * self._stride)
        except Exception:
            self._fail("duty cycle")
            return _NEVER
        return None

    def _switch_off(self, cycle: Cycle, step_index: int) -> None:
        begin = self._clock()
        self._cycle = None
        if self._detach_mode == "finalize":
            self._detaching = True
            try:
                self._backend.detach(lambda took: self._detached(cycle, took))  # type: ignore[attr-defined]
            except Exception:
                _log.warning("CUPTI detach failed; its activity kinds are disabled instead",
                             exc_info=True)  # fmt: skip
                self._stats["fallbacks"] += 1
                self._detaching = False
                self._backend.disable()  # a no-op where the backend's detach disabled them
                # The export thread never flushes in this mode: the records come in here.
                self._backend.flush()
                cycle.flushed = cycle.ready = True
        else:
            self._backend.disable()
            cycle.ready = True
        self._enabled = False
        self._cycles.append(cycle)
        self._stats["cycles"] += 1
        now = self._clock()
        self._times["detach"] = now - begin
        # Speed since the last switch-off (first cycle: its switch-on; errs slow, stride short).
        since_step, since = self._last_off or self._attached_at
        if now > since:
            self._steps_per_s = (step_index - since_step) / (now - since)
        self._last_off = (step_index, now)
        self._restride()

    def _restride(self) -> None:
        """The grid steps a cycle takes, from what its switches cost (any thread)."""
        times = self._times
        cost = sum(times[name] or 0.0 for name in ("attach", "detach", "finalize"))
        if self._period is not None:
            self._stride = stride_for(cost, self._budget, self._steps_per_s, self._period)

    def _detached(self, cycle: Cycle, took: float | None) -> None:
        """The backend's detach callback (any thread): the cycle's records are all in."""
        self._times["finalize"] = took
        cycle.flushed = cycle.ready = True
        self._enabled = self._detaching = False
        self._restride()
        if took is None:
            self._fail("finalize")

    def drain(self) -> KernelWindow:
        """Records of the steps finished since the last drain (export thread); on a duty
        cycle, of the cycles whose records are all in."""
        if self._period is not None:
            return self._drain_cycles()
        with self._drain_lock:
            if self._failed or not self._enabled:
                return self._summariser.drain()
            # Boundaries first: a step that ends while we flush waits for the next drain.
            boundaries = []
            while self._boundaries:
                boundaries.append(self._boundaries.popleft())
            try:
                self._backend.flush()
            except Exception:
                self._fail("activity_flush_all")
                return self._summariser.drain()
            with self._records_lock:
                columns, self._columns = self._columns, ActivityColumns()
            carried = self._summarise(columns, boundaries)
            if len(carried):
                with self._records_lock:
                    self._columns.prepend(carried)
            return self._summariser.drain()

    def _drain_cycles(self) -> KernelWindow:
        with self._drain_lock:
            ready = []
            while self._cycles and self._cycles[0].ready:
                ready.append(self._cycles.popleft())
            if not ready:
                return self._summariser.drain()
            if self._detach_mode == "disable" and not self._failed:
                try:
                    self._backend.flush()  # CUPTI is loaded: the kinds are only disabled
                except Exception:
                    self._fail("activity_flush_all")
            with self._records_lock:
                columns, self._columns = self._columns, ActivityColumns()
            try:
                for cycle in ready:
                    if not cycle.boundaries:
                        continue
                    taken, columns = split_cycle(columns, cycle.start_ns, cycle.boundaries[-1][1])
                    self._last_boundary_ns = cycle.start_ns
                    self._summarise(taken, cycle.boundaries)
            except Exception:
                _log.warning("CUPTI records of a cycle could not be summarised", exc_info=True)
                columns = ActivityColumns()
            if len(columns):
                with self._records_lock:
                    self._columns.prepend(columns)
            return self._summariser.drain()

    @property
    def duty_cycle(self) -> CuptiDutyCycle | None:
        """What the duty cycle did (``None`` when CUPTI records every step)."""
        if self._period is None:
            return None
        return CuptiDutyCycle(
            self._period * self._stride, self._stride, self._active, self._detach_mode,
            **self._stats,
            attach_s=self._times["attach"], detach_s=self._times["detach"],
            finalize_s=self._times["finalize"], attached=self._cycle is not None,
        )  # fmt: skip

    def _summarise(
        self, columns: ActivityColumns, boundaries: list[tuple[int, int]]
    ) -> ActivityColumns:
        """Add whole steps to the summariser; return records of the step still running.

        On numpy arrays (:func:`summarise_bulk`) when it can, else per event: the same result.
        """
        if self._bulk:
            bounds = [boundary_ns for _, boundary_ns in boundaries]
            try:
                summary = summarise_bulk(
                    columns, bounds, self._last_boundary_ns, self._summariser.classifier
                )
            except ImportError:
                self._bulk = False
                _log.debug("numpy is not installed: CUPTI records are summarised per event")
            except Exception:
                self._bulk = False
                _log.warning(
                    "bulk summary of CUPTI records failed; summarising them per event from now on",
                    exc_info=True,
                )
            else:
                if summary is not None:
                    self._summariser.add_bulk(summary.durations_s, summary.idle_s)
                    if bounds:
                        self._last_boundary_ns = bounds[-1]
                    return summary.carried
        return self._summarise_events(columns, boundaries)

    def _summarise_events(
        self, columns: ActivityColumns, boundaries: list[tuple[int, int]]
    ) -> ActivityColumns:
        """:meth:`_summarise` one :class:`KernelEvent` at a time (Python ints throughout)."""
        rows = _rows(columns)
        rows.sort(key=_START)
        position = 0
        for _step_index, boundary_ns in boundaries:
            step_start = self._last_boundary_ns
            events: list[KernelEvent] = []
            while position < len(rows) and rows[position][0] <= boundary_ns:
                start, end, device, name = rows[position]
                events.append(KernelEvent(str(name), start, max(0, end - start), device))
                position += 1
            if step_start is None:
                # The first step's start is unknown (collection began inside it): its kernels
                # count, its idle time does not.
                self._summariser.add_events(events)
            else:
                self._summariser.add_step(events, start_ns=step_start, end_ns=boundary_ns)
            self._last_boundary_ns = boundary_ns
        rest = rows[position:]
        return ActivityColumns(
            [row[3] for row in rest],
            [row[0] for row in rest],
            [row[1] for row in rest],
            [row[2] for row in rest],
        )

    def close(self) -> None:
        """Disable CUPTI activity collection (records not yet drained are discarded)."""
        if self._period is not None:
            self._closed = True  # no cycle starts after this
            self._enabled, self._cycle = self._cycle is not None, None
        if self._enabled and not self._failed:
            try:
                self._backend.disable()
            except Exception:
                self._fail("activity_disable")
        self._enabled = False
