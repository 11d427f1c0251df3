"""What the monitor and its sources share: the Protocols each side implements or calls.

A source of kernel events (:class:`KernelSource`, returning a :class:`KernelWindow`), of
device time (:class:`DeviceTimer`) or of device health (:class:`HealthSource`), and the
monitor's :class:`Clock`, are defined here, below both: ``kernels/`` and ``device/`` implement
them without importing the recorder, the window builder or the monitor, and those use them
without importing a source. Users implement them to pass their own (tests pass fakes); each
is public as ``stepwatch.exporters.<name>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData


class Clock(Protocol):
    """Time source of a monitor (injected; tests pass a fake that implements it)."""

    def monotonic_ns(self) -> int:
        """A monotonic timestamp in nanoseconds, for durations."""

    def time_ns(self) -> int:
        """Wall time, Unix epoch nanoseconds, for window bounds."""


class DeviceTimer(Protocol):
    """Timestamps taken in the device's execution order."""

    def mark(self) -> Any:
        """Enqueue a timestamp at this point of the stream (training thread; non-blocking)."""

    def ready(self, mark: Any) -> bool:
        """Whether the device has passed ``mark`` (export thread; non-blocking)."""

    def elapsed_s(self, start: Any, end: Any) -> float:
        """Device time between two ready marks, in seconds."""


class HealthSource(Protocol):
    """Device-health readings for a window (e.g. ``kernels.HealthSampler`` over NVML)."""

    def sample(self) -> None:
        """Read the devices now (export thread); never raises."""

    def build(self, *, start_unix_nano: int, end_unix_nano: int) -> MetricsData | None:
        """The readings since the last build as metrics of this rank's resource."""


@dataclasses.dataclass(frozen=True)
class KernelWindow:
    """Kernel events of one export window, already classified.

    Attributes:
        durations_s: ``(kernel class, category)`` → one duration per execution, in seconds.
        idle_durations_s: Device-idle gap time, one value per step, in seconds.
    """

    durations_s: Mapping[tuple[str, str], Sequence[float]]
    idle_durations_s: Sequence[float] = ()


class KernelSource(Protocol):
    """A producer of kernel events (CUPTI, torch.profiler, a trace file) for a StepMonitor.
    It may also have ``on_monitor_start()``, called when the monitor is made (one that raises
    is logged and the monitor runs without the source),
    and ``charge(cpu_ns)``: the monitor's export work after each export, paid from its budget.
    """

    def on_step_end(self, step_index: int) -> int | None:
        """Mark a step boundary (training thread: O(1), never raises). An int ``n > 0`` back:
        the next ``n`` step ends go unreported (the next ``step_index`` says how many)."""

    def drain(self) -> KernelWindow:
        """Kernel events since the previous drain. Called on the export thread."""

    def close(self) -> None:
        """Stop collecting and release resources."""
