"""CUPTI on a duty cycle: what :class:`~stepwatch.exporters.kernels.CuptiSource` records when
``period_steps`` is set, and the arithmetic of its schedule.

A cycle takes ``active_steps + 2`` steps with CUPTI's activity kinds on:

- CUPTI is switched on at the end of step ``k``, where ``k + 1`` is a multiple of
  ``period_steps``. Every rank counts the same steps, so every rank records the same ones,
  and a synchronous job pays for one rank's cycles, not for the sum of all ranks' (the reason
  the op histograms' cycles are on a grid too: docs/exporters.md);
- step ``k + 1`` warms up: CUPTI records only kernels *launched* while it is on, and kernels
  launched in step ``k`` may still run in ``k + 1`` on the device. Its end is the cycle's start;
- steps ``k + 2`` to ``k + 1 + active_steps`` are recorded, each with a boundary on CUPTI's
  clock, as in continuous mode (a record belongs to the step in whose host span it started on
  the device);
- step ``k + 2 + active_steps`` spills over: its own records are dropped, but while it runs the
  last recorded step's kernels finish on the device with CUPTI on. At its end CUPTI is
  switched off (``detach="disable"``) or taken out of the process (``detach="finalize"``,
  :meth:`CuptiPythonBackend.detach`).

Between cycles the source asks the step recorder not to report step ends (no call a step)
and, with ``finalize``, CUPTI is not in the process at all, so a kernel launch costs what it
costs without CUPTI. Each window then holds the kernels of the cycles finished in it, the
device-idle histogram one value per recorded step and device, which is how the detectors
know how many steps a window's kernel times cover (docs/schema.md).
"""

from __future__ import annotations

from typing import NamedTuple

from stepwatch.exporters.kernels._cupti_records import ActivityColumns

DETACH_MODES = ("disable", "finalize")
SPARE_STEPS = 2
"""Steps of a cycle with CUPTI on that are not recorded: the warm-up and the spill-over."""
MAX_STRIDE = 1 << 16
"""The most grid steps one cycle may be stretched over (switches of seconds at a budget)."""


class CuptiDutyCycle(NamedTuple):
    """What a duty-cycled :class:`~stepwatch.exporters.kernels.CuptiSource` did.

    Attributes:
        period_steps: Steps from one cycle's start to the next (a cycle starts where the step
            count is a multiple of it): the ``period_steps`` asked for times ``stride``.
        stride: Grid steps per cycle: 1 unless the switches cost more than the budget allows
            at the asked period (then the power of two that keeps them within it).
        active_steps: Steps recorded per cycle.
        detach: ``disable`` (activity kinds off between cycles, CUPTI stays loaded) or
            ``finalize`` (CUPTI taken out of the process between cycles).
        cycles: Cycles finished (CUPTI switched off again).
        skipped_cycles: Cycles not started because the previous detach had not completed
            (no CUDA API call since it was asked for).
        fallbacks: Detaches that could not finalize and disabled the kinds instead.
        attach_s: The last switch-on's time on the training thread.
        detach_s: The last switch-off's time on the training thread.
        finalize_s: The last flush and ``cuptiFinalize``, in the CUDA API call it rode on.
        attached: Whether CUPTI is on now.
    """

    period_steps: int
    stride: int
    active_steps: int
    detach: str
    cycles: int
    skipped_cycles: int
    fallbacks: int
    attach_s: float | None
    detach_s: float | None
    finalize_s: float | None
    attached: bool


class Cycle:
    """One cycle's record: its start on CUPTI's clock and its steps' boundaries.

    ``ready`` is set once the cycle's records can be read: at once when the kinds are
    disabled (``flushed`` stays False: the export thread's flush delivers them, CUPTI being
    still loaded), in the detach callback when CUPTI is finalized (``flushed``: that callback
    flushed first, and no flush may follow, as any CUPTI call would attach CUPTI again).
    """

    __slots__ = ("boundaries", "flushed", "ready", "start_ns")

    def __init__(self, start_ns: int) -> None:
        self.start_ns = start_ns
        self.boundaries: list[tuple[int, int]] = []
        self.ready = False
        self.flushed = False


def stride_for(cost_s: float, budget: float, steps_per_s: float, period_steps: int) -> int:
    """Grid steps per cycle (a power of two) that keep a cycle's switches within ``budget``.

    ``cost_s`` (switching CUPTI on, off, and a finalize) is paid once a cycle; at
    ``steps_per_s`` it needs ``cost_s / budget * steps_per_s`` steps of training to pay for it.
    A power of two keeps ranks whose costs differ a little on nested grids: one that takes every
    fourth grid step records steps another, taking every second, records too.
    """
    if cost_s <= 0 or steps_per_s <= 0:
        return 1
    needed = cost_s / budget * steps_per_s / period_steps
    stride = 1
    while stride < needed and stride < MAX_STRIDE:
        stride *= 2
    return stride


def steps_to_skip(step_index: int, period_steps: int) -> int | None:
    """Step ends the recorder need not report after ``step_index``'s: all until the one at
    which the next cycle starts (the next ``k`` with ``(k + 1) % period_steps == 0``)."""
    following = ((step_index + 1) // period_steps + 1) * period_steps - 1
    skip = following - step_index - 1
    return skip if skip > 0 else None


def split_cycle(
    columns: ActivityColumns, start_ns: int, end_ns: int
) -> tuple[ActivityColumns, ActivityColumns]:
    """A cycle's records (device start in ``(start_ns, end_ns]``) and the later ones.

    Records that started at or before ``start_ns`` (the warm-up step, an earlier cycle's
    spill-over) are dropped: they belong to no recorded step.
    """
    taken = ActivityColumns()
    later = ActivityColumns()
    for name, start, end, device in zip(
        columns.names, columns.starts, columns.ends, columns.devices, strict=True
    ):
        if start > end_ns:
            target = later
        elif start > start_ns:
            target = taken
        else:
            continue
        target.names.append(name)
        target.starts.append(start)
        target.ends.append(end)
        target.devices.append(device)
    return taken, later
