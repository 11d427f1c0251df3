"""CPU kernel source: ATen ops recorded by ``torch.profiler``, in bounded cycles.

Cost model (measured by ``bench/profiler_cost.py`` on torch 2.13 CPU, idle machine): while the
profiler runs, every op pays its RecordFunction callbacks, and stopping it costs ~2.3 µs per
recorded op (Kineto materialises its result); reading events through
``kineto_results.events()`` costs ~2.8 µs per op, against ~39 µs (``prof.events()``) and ~51 µs
(``key_averages()``) for the Python post-processing. Profiling every step of a training step
made of small ops costs tens of percent (+45 % on the bench's 4 ms MLP step), so the source
profiles ``active_steps`` consecutive steps out of every ``period_steps`` (a duty cycle, like
``torch.profiler.schedule(wait, active, repeat)``); the default 5 of 200 keeps even that
op-dense step near 1 % and samples 2.5 % of steps. Start/stop happen on the training thread at
step boundaries (the profiler's state belongs to the thread that started it); events are read
on the export thread in :meth:`TorchProfilerSource.drain`.

Timestamps: Kineto stamps CPU ops on the Unix-epoch clock in nanoseconds, the same clock as
``time.time_ns()``, which is the default ``clock_ns`` for step boundaries.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from stepwatch._errors import ConfigError
from stepwatch.exporters._window import KernelWindow
from stepwatch.exporters.kernels._summary import (
    DEFAULT_TOP_K,
    KernelEvent,
    KernelSummariser,
    self_time_events,
)

_log = logging.getLogger(__name__)


class OpRecord(NamedTuple):
    """One CPU op as the profiler recorded it (Unix-epoch nanoseconds)."""

    name: str
    start_ns: int
    end_ns: int
    thread_id: int


class ProfilerBackend(Protocol):
    """Starts and stops one profiling cycle (both on the training thread).

    ``stop`` must be cheap beyond what the profiler itself costs: it returns a reader that the
    export thread calls later to get the cycle's ops.
    """

    def start(self) -> None:
        """Begin recording ops."""

    def stop(self) -> Callable[[], Sequence[OpRecord]]:
        """Stop recording; the returned callable yields the cycle's ops."""


class TorchProfilerBackend:
    """:class:`ProfilerBackend` on ``torch.profiler.profile(activities=[CPU])``."""

    def __init__(self) -> None:
        self._profile: Any = None

    def start(self) -> None:
        """Start a fresh CPU-activity profile."""
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._profile.start()

    def stop(self) -> Callable[[], Sequence[OpRecord]]:
        """Stop the profile; read its raw Kineto results later."""
        current, self._profile = self._profile, None
        if current is None:
            return list
        current.stop()
        results = current.profiler.kineto_results
        return lambda: read_kineto_ops(results)


def read_kineto_ops(results: Any) -> list[OpRecord]:
    """CPU ops of a ``torch._C._autograd._ProfilerResult`` via ``events()`` (the cheap path).

    Skips user annotations (``record_function`` ranges, ``ProfilerStep#N``), Python function
    events and non-CPU activity.
    """
    from torch._C._autograd import DeviceType

    ops: list[OpRecord] = []
    append = ops.append
    cpu = DeviceType.CPU
    events = results.events()
    # Older torch builds may lack is_user_annotation / is_python_function; then only
    # ProfilerStep#N is recognised (by name) and every other CPU event counts as an op.
    sample = events[0] if events else None
    has_flags = hasattr(sample, "is_user_annotation") and hasattr(sample, "is_python_function")
    for event in events:
        if event.device_type() != cpu:
            continue
        if has_flags and (event.is_user_annotation() or event.is_python_function()):
            continue
        name = event.name()
        if name.startswith("ProfilerStep#"):
            continue
        append(OpRecord(name, event.start_ns(), event.end_ns(), event.start_thread_id()))
    return ops


def _take_until(
    events: Sequence[KernelEvent], position: int, start_ns: int, end_ns: int
) -> tuple[list[KernelEvent], int]:
    """Events (sorted by start) starting in ``[start_ns, end_ns)`` from ``position`` on."""
    taken = []
    while position < len(events) and events[position].start_ns < end_ns:
        if events[position].start_ns >= start_ns:
            taken.append(events[position])
        position += 1
    return taken, position


class _Cycle(NamedTuple):
    read_ops: Callable[[], Sequence[OpRecord]]
    start_ns: int
    boundaries: list[tuple[int, int]]  # (step index, step end ns), in order


class TorchProfilerSource:
    """A :class:`~stepwatch.exporters._window.KernelSource` of ATen CPU ops.

    Args:
        active_steps: Consecutive steps profiled per cycle.
        period_steps: A cycle starts every ``period_steps`` steps (``>= active_steps``);
            ``period_steps == active_steps`` profiles every step.
        top_k: Kernel classes kept by name (see :class:`KernelSummariser`).
        backend: Starts / stops the profiler (default :class:`TorchProfilerBackend`).
        clock_ns: Clock of the step boundaries; must be the profiler's (Unix-epoch ns).
        max_pending_cycles: Finished cycles kept for the next drain; older ones are dropped
            (counted in :attr:`dropped_cycles`) if the export thread falls behind.

    Raises:
        ConfigError: An option is out of range (names it).
    """

    def __init__(
        self,
        *,
        active_steps: int = 5,
        period_steps: int = 200,
        top_k: int = DEFAULT_TOP_K,
        backend: ProfilerBackend | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        max_pending_cycles: int = 4,
    ) -> None:
        if active_steps < 1:
            raise ConfigError(f"active_steps must be >= 1, got {active_steps}")
        if period_steps < active_steps:
            raise ConfigError(
                f"period_steps must be >= active_steps ({active_steps}), got {period_steps}"
            )
        if max_pending_cycles < 1:
            raise ConfigError(f"max_pending_cycles must be >= 1, got {max_pending_cycles}")
        self._active_steps = active_steps
        self._period_steps = period_steps
        self._backend: ProfilerBackend = backend if backend is not None else TorchProfilerBackend()
        self._clock_ns = clock_ns
        self._summariser = KernelSummariser(top_k=top_k)
        self._pending: collections.deque[_Cycle] = collections.deque()
        self._max_pending = max_pending_cycles
        self._lock = threading.Lock()  # serialises drain() callers, never the training thread
        self._running: _Cycle | None = None
        self._countdown = 0  # steps to skip before the next cycle starts
        self._disabled = False
        self._closed = False
        self.dropped_cycles = 0
        """Finished cycles discarded because drain() fell behind (cumulative)."""

    def on_step_end(self, step_index: int) -> None:
        """Step boundary (training thread): O(1) except when a cycle starts or stops."""
        if self._disabled:
            return
        try:
            now = self._clock_ns()
            running = self._running
            if running is not None:
                running.boundaries.append((step_index, now))
                if len(running.boundaries) >= self._active_steps:
                    self._running = None
                    read_ops = self._backend.stop()
                    self._pending.append(running._replace(read_ops=read_ops))
                    while len(self._pending) > self._max_pending:
                        self._pending.popleft()
                        self.dropped_cycles += 1
                    self._countdown = self._period_steps - self._active_steps
                    if self._countdown > 0:
                        return
                else:
                    return
            if self._countdown > 0:
                self._countdown -= 1
                if self._countdown > 0:
                    return
            if self._closed:
                return
            self._backend.start()
            self._running = _Cycle(list, self._clock_ns(), [])
        except Exception:  # never raise into the training loop
            _log.exception("torch.profiler kernel source failed; kernel collection disabled")
            self._disabled = True
            self._running = None

    def drain(self) -> KernelWindow:
        """Ops of the cycles finished since the last drain, as one window (export thread)."""
        with self._lock:
            while self._pending:
                cycle = self._pending.popleft()
                try:
                    ops = cycle.read_ops()
                except Exception:
                    _log.exception("reading torch.profiler results failed; cycle dropped")
                    continue
                self._add_cycle(cycle, ops)
            return self._summariser.drain()

    def _add_cycle(self, cycle: _Cycle, ops: Sequence[OpRecord]) -> None:
        own, top = self_time_events(ops)
        own_position = top_position = 0
        step_start = cycle.start_ns
        for _step_index, step_end in cycle.boundaries:
            events, own_position = _take_until(own, own_position, step_start, step_end)
            busy, top_position = _take_until(top, top_position, step_start, step_end)
            self._summariser.add_step(events, start_ns=step_start, end_ns=step_end, busy=busy)
            step_start = step_end

    def close(self) -> None:
        """Stop a running cycle (its partial data is discarded) and collect nothing more."""
        self._closed = True
        if self._running is not None:
            self._running = None
            try:
                self._backend.stop()
            except Exception:
                _log.exception("stopping torch.profiler failed")
