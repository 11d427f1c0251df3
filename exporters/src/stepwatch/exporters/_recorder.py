"""The training thread's side of a monitor: steps and phases into a bounded buffer of records.

A :class:`StepRecorder` belongs to one :class:`~stepwatch.exporters.StepMonitor`, which hands
it to whatever times steps and phases on the training thread: its own ``step()`` and
``phase()`` contexts and the auto-mode hooks (``_auto``). Those use only the small interface
below; the export thread only drains :attr:`StepRecorder.buffer` and reads the counters.

The hot path reads a monotonic clock and appends one finished-step record: no lock, no SDK
call, no allocation beyond the record. Nothing raises: misuse is logged and counted. Where the
C extension ``_fastrecord`` is built (``exporters/csrc/fastrecord.c``), monitors use
:data:`FAST_RECORDER`: the same class on a C base that keeps the hot state in a struct and runs
the step boundary and the ``step()``/``phase()`` contexts without a Python frame, its buffer a
``StepBuffer`` (a deque to readers; a host-timed step's end fills a plain C slot); anything
unusual goes to this module's Python methods. ``STEPWATCH_EXPORTERS_NO_C=1`` turns it off.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters import _cext
from stepwatch.exporters._device import DeviceTimer
from stepwatch.exporters._sampling import PhaseSampler, share_out, swap_forward_classes
from stepwatch.exporters._window import KernelSource

MAX_PHASE_NAME_LENGTH: Final = 64
MAX_PHASE_NAMES: Final = 256

# Device marks of one step: (step start, step end, phase name -> [(start, end), ...], the
# same for auto-mode phases of a sampled step: they replace its host times, ``_auto_device``).
# An auto step's start mark is the previous one's end mark (one instant, one mark).
Intervals = dict[str, list[tuple[Any, Any]]]
DeviceMarks = tuple[Any, Any, Intervals, Intervals | None]
# One finished step: (index, start monotonic ns, end monotonic ns, phase name -> ns, device,
# auto-mode phases). The last is None for a step no auto mode watched, UNSAMPLED for one whose
# phases it did not time (``_sampling``), else its phase name -> ns (possibly empty).
StepRecord = tuple[int, int, int, dict[str, int], DeviceMarks | None, dict[str, int] | None]
UNSAMPLED: Final[dict[str, int]] = {}  # by identity; never written

# Auto-mode phases of a batch of steps: name -> (seconds, weight) of each sampled step.
WeightedPhases = dict[str, tuple[list[float], list[int]]]


def window_values(
    records: list[StepRecord], timer: DeviceTimer | None, yield_every: int, carry: int = 0
) -> tuple[list[float], dict[str, list[float]], WeightedPhases, int]:
    """Step durations and per-phase times (seconds) of ``records``, for ``add_steps``.

    Device time where a step carries device marks. Sleeps ``0`` every ``yield_every`` steps:
    the export thread releases the GIL now and then, so the training thread (and DDP's
    comm-hook callbacks) never wait a whole switch interval (5 ms) for it.

    Auto-mode phases come back apart, with the weight of each sampled step: the batch's
    watched steps (plus ``carry``, those of earlier batches without a sampled step) shared out
    among its sampled ones (``_sampling.share_out``). Returns (durations, phases, weighted
    auto phases, the new carry).
    """
    fast = _fast_host_values(records, carry)
    if fast is not None:  # steps without device marks, in C (_fastrecord): the same floats
        durations, phases, sampled, watched = fast
    else:
        durations, phases, sampled, watched = _values(records, timer, yield_every, carry)
    if not sampled:
        return durations, phases, {}, watched
    weighted: WeightedPhases = {}
    for auto, weight in zip(sampled, share_out(watched, len(sampled)), strict=True):
        for name, ns in auto.items():
            seconds, weights = weighted.setdefault(name, ([], []))
            seconds.append(ns * 1e-9)
            weights.append(weight)
    return durations, phases, weighted, 0


def sampled_steps(
    records: list[StepRecord],
    durations: list[float],
    carry: int,
    sampler: PhaseSampler,
) -> tuple[list[float], list[int]] | None:
    """The durations (``window_values``' first list) of the steps whose auto-mode phases
    were timed, with the weights ``window_values`` gave their phases (same ``carry``): the
    step time a window's sampled phase times compare with. ``None`` unless phases are
    sampled (the stride is not 1), some auto-mode step of ``records`` was not timed, or
    they were in an earlier window (``sampler.reported``): once a rank's windows say what
    their phases rest on, they keep saying it (the detectors take a window without it for
    one with no step timed), also when ``auto`` comes back to timing every step.
    """
    if sampler.stride == 1 and not sampler.adaptive:
        return None  # every step is timed
    sampling = sampler.stride != 1
    timed: list[float] = []
    watched = carry
    for record, duration in zip(records, durations, strict=True):
        auto = record[5]
        if auto is not None:
            watched += 1
            if auto is not UNSAMPLED:
                timed.append(duration)
    if not timed or (len(timed) == watched and not (sampling or sampler.reported)):
        return None
    sampler.reported = True
    return timed, share_out(watched, len(timed))


def _values(
    records: list[StepRecord], timer: DeviceTimer | None, yield_every: int, carry: int
) -> tuple[list[float], dict[str, list[float]], list[dict[str, int]], int]:
    """:func:`window_values`' pass over the records in Python (any record)."""
    durations: list[float] = []
    phases: dict[str, list[float]] = {}
    sampled: list[dict[str, int]] = []
    watched = carry
    for position, (_, start_ns, end_ns, step_phases, device, auto) in enumerate(records):
        if position % yield_every == yield_every - 1:
            time.sleep(0)
        if auto is not None:
            watched += 1
            if auto is not UNSAMPLED:
                sampled.append(auto)
        if device is not None and timer is not None:
            durations.append(timer.elapsed_s(device[0], device[1]))
            device_phases = _device_seconds(timer, device[2])
            if len(device) > 3 and device[3] and auto is not None and auto is not UNSAMPLED:
                sampled[-1] = {  # auto-mode phases timed on the device (_auto_device)
                    **auto,
                    **{
                        name: round(seconds * 1e9)
                        for name, seconds in _device_seconds(timer, device[3]).items()
                    },
                }
            for name, ns in step_phases.items():
                seconds = device_phases.pop(name, None)
                phases.setdefault(name, []).append(ns * 1e-9 if seconds is None else seconds)
            for name, seconds in device_phases.items():
                phases.setdefault(name, []).append(seconds)
        else:
            durations.append((end_ns - start_ns) * 1e-9)
            for name, ns in step_phases.items():
                phases.setdefault(name, []).append(ns * 1e-9)
    return durations, phases, sampled, watched


def _device_seconds(
    timer: DeviceTimer, intervals_by_name: dict[str, list[tuple[Any, Any]]]
) -> dict[str, float]:
    """Seconds per phase from device marks; a phase with a mark the timer cannot read is left
    out (its host time stays)."""
    seconds: dict[str, float] = {}
    for name, intervals in intervals_by_name.items():
        try:
            seconds[name] = sum(timer.elapsed_s(start, end) for start, end in intervals)
        except Exception:
            continue
    return seconds


def _fast_host_values(
    records: list[StepRecord], carry: int
) -> tuple[list[float], dict[str, list[float]], list[dict[str, int]], int] | None:
    """The C pass (``_fastrecord.host_values``), or None where it does not take the batch."""
    if FAST_RECORDER is None or type(records) is not list or type(carry) is not int:
        return None
    return _fastrecord.host_values(records, carry)


class Clock(Protocol):
    """Time source of a monitor (injected; tests pass a fake that implements it)."""

    def monotonic_ns(self) -> int:
        """A monotonic timestamp in nanoseconds, for durations."""

    def time_ns(self) -> int:
        """Wall time, Unix epoch nanoseconds, for window bounds."""


class SystemClock:
    """``time.perf_counter_ns`` for durations, ``time.time_ns`` for the wall-clock anchor."""

    def monotonic_ns(self) -> int:
        """``time.perf_counter_ns()``."""
        return time.perf_counter_ns()

    def time_ns(self) -> int:
        """``time.time_ns()``."""
        return time.time_ns()


class _NullContext:
    """Returned for unusable phase names: does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        return None


_NULL_CONTEXT: Final = _NullContext()


class _StepContext:
    __slots__ = ("_recorder",)

    def __init__(self, recorder: StepRecorder) -> None:
        self._recorder = recorder

    def __enter__(self) -> None:
        self._recorder.begin_step(explicit=True)

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        self._recorder.end_step(explicit=True)


class _PhaseContext:
    __slots__ = ("_clock", "_depth", "_device", "_name", "_recorder", "_start_mark", "_start_ns")

    def __init__(self, recorder: StepRecorder, name: str) -> None:
        self._recorder = recorder
        self._clock = recorder.clock
        self._name = name
        self._depth = 0
        self._start_ns = 0
        self._device = recorder.device_timer
        self._start_mark: Any = None

    def __enter__(self) -> None:
        try:
            if self._depth == 0:
                self._start_ns = self._clock.monotonic_ns()
                if self._device is not None:
                    self._start_mark = self._device.mark()
            self._depth += 1
        except Exception:
            self._recorder.misuse("clock", "the clock raised in phase(); phase ignored")

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        try:
            if self._depth <= 0:
                return
            self._depth -= 1
            if self._depth == 0:
                recorder = self._recorder
                recorder.add_phase_ns(self._name, self._clock.monotonic_ns() - self._start_ns)
                if self._device is not None and self._start_mark is not None:
                    interval = (self._start_mark, self._device.mark())  # a failed mark: no list
                    recorder._device_phases.setdefault(self._name, []).append(interval)
                    self._start_mark = None
        except Exception:
            self._recorder.misuse("clock", "the clock raised in phase(); phase ignored")


def fast_monotonic_ns(clock: Clock) -> Callable[[], int]:
    """``clock.monotonic_ns``, or the C function itself when it is the system clock."""
    if type(clock) is SystemClock:
        return time.perf_counter_ns
    return clock.monotonic_ns


class StepRecorder:
    """Opens and closes steps, adds phase time, and buffers each finished step (training thread).

    The interface for what times the training thread (auto-mode hooks included); every call is
    cheap and never raises:

    - :meth:`begin_step` / :meth:`end_step` (``explicit=False`` for auto mode, with the time
      already read from :attr:`clock_ns`), :meth:`add_phase_ns` (every step),
      :meth:`add_sampled_phase_ns` (auto mode's phases of a sampled step), :meth:`misuse`;
    - :attr:`explicit_steps` (the loop marks steps itself with ``monitor.step()``),
      :attr:`step_depth` (a step is open when positive) and :attr:`sampled` (auto mode times
      this step's phases): read, never written, by hooks; :attr:`watchers` (auto-mode
      instrumentations) and :attr:`forward_swaps` (``_sampling``) are kept by them.

    Args:
        clock: The monitor's clock.
        device_timer: Device-side timing of steps and phases, or None (host clock only).
        kernel_source: Told the index of every finished step, or None.
        buffer_steps: Most finished steps waiting for export; more are dropped and counted.
        log: The monitor's rate-limited log.
        sampler: Which steps auto mode times phase by phase (default: every step).

    Attributes:
        clock: The monitor's clock.
        clock_ns: ``clock.monotonic_ns`` (``time.perf_counter_ns`` itself for the system clock).
        device_timer: As given.
        buffer: Finished steps, oldest first (a deque); the export thread pops from the left.
        steps_recorded: Steps finished and put in the buffer.
        buffer_dropped: Steps dropped because the buffer was full.
        misuse_count: Calls ignored for bad usage.
    """

    # The contexts' and buffer's classes (the C recorder's: C types, the same interface).
    _step_context_type: Callable[[Any], Any] = _StepContext
    _phase_context_type: Callable[[Any, str], Any] = _PhaseContext
    _buffer_type: Callable[[], Any] = collections.deque

    def __init__(
        self,
        *,
        clock: Clock,
        device_timer: DeviceTimer | None,
        kernel_source: KernelSource | None,
        buffer_steps: int,
        log: RateLimitedLog,
        sampler: PhaseSampler | None = None,
    ) -> None:
        self.clock = clock
        self.clock_ns: Callable[[], int] = fast_monotonic_ns(clock)
        self.device_timer = device_timer
        self._kernel_source = kernel_source
        self._kernel_skip = 0  # step ends the kernel source asked not to be told of
        self._log = log
        self.buffer: collections.deque[StepRecord] = self._buffer_type()
        self._buffer_steps = buffer_steps
        self.step_context: _StepContext = self._step_context_type(self)
        self.phase_contexts: dict[str, _PhaseContext] = {}
        self._phases_ns: dict[str, int] = {}
        self._sampled_ns: dict[str, int] = {}
        self.sampler = sampler if sampler is not None else PhaseSampler(1)
        self.sampled = True
        self.watchers = 0
        self.forward_swaps: tuple[tuple[Any, type, type], ...] = ()
        self._device_phases: dict[str, list[tuple[Any, Any]]] = {}
        self._device_sampled: dict[str, list[tuple[Any, Any]]] | None = None
        self._step_start_mark: Any = None
        self._boundary: tuple[int, Any] | None = None  # an auto step's end: (ns, its mark)
        self.step_depth = 0
        self._step_start_ns = 0
        self._step_index = 0
        self.explicit_steps = False
        self._auto_step_open = False
        self.steps_recorded = 0
        self.buffer_dropped = 0
        self.misuse_count = 0

    def new_phase_context(self, name: object) -> _PhaseContext | _NullContext:
        """The context of a phase name not seen yet (validated, capped, remembered)."""
        try:
            if not isinstance(name, str) or not name or len(name) > MAX_PHASE_NAME_LENGTH:
                self.misuse("phase-name", "phase(%r): not a short non-empty string; ignored", name)
                return _NULL_CONTEXT
            if len(self.phase_contexts) >= MAX_PHASE_NAMES:
                self.misuse(
                    "phase-cap",
                    "more than %d phase names; %r folded into 'other'",
                    MAX_PHASE_NAMES,
                    name,
                )
                name = "other"
                existing = self.phase_contexts.get(name)
                if existing is not None:
                    return existing
            context: _PhaseContext = self._phase_context_type(self, name)
            self.phase_contexts[name] = context
            return context
        except Exception:
            return _NULL_CONTEXT

    def add_phase_ns(self, name: str, elapsed_ns: int) -> None:
        """Add ``elapsed_ns`` to phase ``name`` of the current (or next) step."""
        phases = self._phases_ns
        phases[name] = phases.get(name, 0) + elapsed_ns

    def add_sampled_phase_ns(self, name: str, elapsed_ns: int) -> None:
        """Add ``elapsed_ns`` to auto-mode phase ``name`` of the current (sampled) step."""
        phases = self._sampled_ns
        phases[name] = phases.get(name, 0) + elapsed_ns

    def add_device_phase(self, name: str, start_mark: Any, end_mark: Any) -> None:
        """Add a device interval to phase ``name`` of the current step (every step)."""
        intervals = self._device_phases.get(name)
        if intervals is None:
            intervals = self._device_phases[name] = []
        intervals.append((start_mark, end_mark))

    def add_sampled_device_phase(self, name: str, start_mark: Any, end_mark: Any) -> None:
        """Add a device interval to auto-mode phase ``name`` of the current (sampled) step."""
        sampled = self._device_sampled
        if sampled is None:
            sampled = self._device_sampled = {}
        intervals = sampled.get(name)
        if intervals is None:
            intervals = sampled[name] = []
        intervals.append((start_mark, end_mark))

    def begin_step(self, *, explicit: bool, now_ns: int | None = None) -> None:
        """Open a step (``now_ns``: its start, already read from the monitor's clock)."""
        try:
            if explicit:
                self.explicit_steps = True
                if self._auto_step_open:
                    # Auto mode opened a step (a forward before the first monitor.step()):
                    # the loop marks steps itself, so that step is abandoned, not nested.
                    self._auto_step_open = False
                    self.step_depth = 0
            elif self.step_depth == 0:
                self._auto_step_open = True
            self.step_depth += 1
            if self.step_depth > 1:
                self.misuse("nested-step", "step() entered inside a step; inner step ignored")
                return
            self._step_start_ns = self.clock.monotonic_ns() if now_ns is None else now_ns
            if self.watchers:
                self.sampled = self.sampler.sampled(self._step_index)
                swap_forward_classes(self.forward_swaps, self.sampled)
            if self.device_timer is not None:  # an auto step's end at this instant: its mark
                boundary, self._boundary = self._boundary or (None, None), None
                same = not explicit and now_ns is not None and boundary[0] == now_ns
                self._step_start_mark = boundary[1] if same else self.device_timer.mark()
        except Exception:
            self.misuse("clock", "the clock raised in step(); step ignored")

    def end_step(self, *, explicit: bool, now_ns: int | None = None) -> None:
        """Close a step and record it (``now_ns``: its end, already read from the clock)."""
        try:
            if self.step_depth <= 0:
                self.misuse("unbalanced-step", "step end without a step start; ignored")
                return
            self.step_depth -= 1
            if self.step_depth > 0:
                return
            self._auto_step_open = False
            end_ns = self.clock.monotonic_ns() if now_ns is None else now_ns
            phases = self._phases_ns
            self._phases_ns = {}
            device: DeviceMarks | None = None
            if self.device_timer is not None:
                device_phases = self._device_phases
                self._device_phases = {}
                device_sampled, self._device_sampled = self._device_sampled, None
                start_mark, self._step_start_mark = self._step_start_mark, None
                self._boundary = None
                if start_mark is not None:
                    end_mark = self.device_timer.mark()
                    sampled = device_sampled if self.watchers and self.sampled else None
                    device = (start_mark, end_mark, device_phases, sampled)
                    if not explicit and now_ns is not None:  # the next auto step's start too
                        self._boundary = (now_ns, end_mark)
            auto: dict[str, int] | None = None
            if self.watchers:
                if self.sampled:
                    auto = self._sampled_ns
                    self._sampled_ns = {}
                else:
                    auto = UNSAMPLED
            index = self._step_index
            self._step_index = index + 1
            self.steps_recorded += 1
            buffer = self.buffer
            if len(buffer) < self._buffer_steps:
                buffer.append((index, self._step_start_ns, end_ns, phases, device, auto))
            else:
                self.buffer_dropped += 1
                self._log.warning(
                    "buffer-full", "step buffer full (%d steps); step dropped", self._buffer_steps
                )
            source = self._kernel_source
            if source is not None:
                if self._kernel_skip > 0:
                    self._kernel_skip -= 1  # the source asked not to be told of this one
                else:
                    self._kernel_skip = _skip_count(source.on_step_end(index))
        except Exception:
            self.misuse("step-end", "recording a step failed; step ignored", exc_info=True)

    @property
    def step_start_ns(self) -> int:
        """Start (monotonic ns) of the step in progress, or of the last one (any thread)."""
        return self._step_start_ns

    @property
    def step_index(self) -> int:
        """Index of the step in progress, or of the next one between steps (any thread)."""
        return self._step_index

    def open_phase(self) -> tuple[str, int] | None:
        """The innermost ``phase()`` open now and when it was entered (monotonic ns), or None.

        Read by the export thread from what ``phase()`` records on entry (depth, start): nothing
        added to the hot path. Of two phases, the later start; nested ones, the inner one.
        """
        try:
            best: tuple[str, int] | None = None
            for name, context in list(self.phase_contexts.items()):
                if context._depth > 0 and (best is None or context._start_ns >= best[1]):
                    best = (name, context._start_ns)
            return best
        except Exception:  # the training thread changed the dict: no phase this time
            return None

    def monitor_calls(self) -> dict[str, Any]:
        """C callables a monitor may bind as its ``step`` and ``phase`` (same results as its
        methods, no Python frame); none from the Python recorder."""
        return {}

    def misuse(self, key: str, message: str, *args: object, exc_info: bool = False) -> None:
        """Count a call ignored for bad usage and log it (rate-limited per ``key``)."""
        self.misuse_count += 1
        with contextlib.suppress(Exception):
            self._log.warning(key, message, *args, exc_info=exc_info)


def _skip_count(told: object) -> int:
    """A kernel source's ``on_step_end`` result as step ends to skip (0 unless a positive int)."""
    return min(told, (1 << 63) - 1) if type(told) is int and told > 0 else 0


FAST_RECORDER: type[StepRecorder] | None = None
""":class:`StepRecorder` on the C base ``_fastrecord.RecorderCore``, or None where the extension
is not built (or ``STEPWATCH_EXPORTERS_NO_C=1``)."""

_fastrecord = _cext.fastrecord  # None: not built, or STEPWATCH_EXPORTERS_NO_C
if _fastrecord is not None:
    _fastrecord.configure(
        StepRecorder.begin_step,
        StepRecorder.end_step,
        UNSAMPLED,
        PhaseSampler,
        time.perf_counter_ns,
    )

    class _FastStepRecorder(_fastrecord.RecorderCore, StepRecorder):
        """:class:`StepRecorder` whose step boundary and contexts run in C (``_fastrecord``)."""

        _step_context_type = _fastrecord.StepContext
        _phase_context_type = _fastrecord.PhaseContext
        _buffer_type = _fastrecord.StepBuffer

        def monitor_calls(self) -> dict[str, Any]:
            # The C step context returns itself when called; PhaseLookup is phase()'s body.
            return {
                "step": self.step_context,
                "phase": _fastrecord.PhaseLookup(self, self.phase_contexts),
            }

    FAST_RECORDER = _FastStepRecorder


class _ClockStamp:
    """``_fastrecord.ClockStamp`` in Python: called with anything, ``ns`` becomes the clock's
    reading (0 before the first call, once reset, or when the clock raises)."""

    __slots__ = ("_clock_ns", "ns")

    def __init__(self, clock_ns: Callable[[], int]) -> None:
        self._clock_ns = clock_ns
        self.ns = 0

    def __call__(self, *args: object, **kwargs: object) -> None:
        try:
            self.ns = int(self._clock_ns())
        except Exception:  # called by autograd: never raise into backward
            self.ns = 0


def _c_stamps(clock_ns: Callable[[], int]) -> bool:
    """Whether C stamps read ``clock_ns``: ``time.perf_counter_ns`` on Linux, extension on."""
    linux = sys.platform.startswith("linux")
    return FAST_RECORDER is not None and clock_ns is time.perf_counter_ns and linux


def new_clock_stamp(clock_ns: Callable[[], int]) -> Any:
    """A callable that takes ``clock_ns()`` into its ``ns`` when called, whatever its
    arguments: in C (no Python frame) where ``clock_ns`` is ``time.perf_counter_ns`` on
    Linux and the extension is on, else in Python."""
    if _c_stamps(clock_ns):
        return _fastrecord.ClockStamp()
    return _ClockStamp(clock_ns)


def new_mark_stamp(clock_ns: Callable[[], int], device: DeviceTimer) -> Any:
    """The last-gradient stamp with a device mark (``ns`` and ``mark``) in C,
    ``_fastrecord.MarkStamp`` (no Python frame of its own), where :func:`new_clock_stamp` would
    be C; None elsewhere (the caller uses ``_auto_device.DeviceStamp``)."""
    if _c_stamps(clock_ns):
        return _fastrecord.MarkStamp(device)
    return None


def new_recorder(**kwargs: Any) -> StepRecorder:
    """A :class:`StepRecorder` (:data:`FAST_RECORDER` where there is one) made with ``kwargs``,
    after its kernel source's ``on_monitor_start`` (CUPTI from here: the first step counts)."""
    _cext.start(os.environ)  # STEPWATCH_REQUIRE_C; a log line a process: which paths run
    cls = FAST_RECORDER if FAST_RECORDER is not None else StepRecorder
    if (start := getattr(kwargs.get("kernel_source"), "on_monitor_start", None)) is not None:
        start()
    return cls(**kwargs)
