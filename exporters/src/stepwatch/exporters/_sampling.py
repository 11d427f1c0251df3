"""Which steps auto mode times phase by phase (issue 15: overhead at short steps).

Auto mode's hooks cost a fixed ~60-100 µs per step on a large model (docs/exporters.md): the
Python calls they make between the model's kernels find their code and data evicted from the
CPU caches. At an 86 ms step that is ~0.1 %; at 20 ms it is 0.5 %. So phases are timed on a
*sample* of steps, and each exported phase histogram still counts every step (below); the step
itself (its duration, its index, the user's own ``phase()`` contexts) is recorded every step.

Which steps: step ``i`` is sampled when ``h(i) % stride == 0``, ``h`` a fixed 64-bit mix of
the index (splitmix64's finaliser). The same steps on every rank (cross-rank comparisons look
at the same steps), no period of the workload can alias with it (a fixed stride ``i % k``
would see only the same micro-batch of a period-``k`` schedule), and with power-of-two strides
the sets nest: a rank at stride 16 samples a subset of a rank's at stride 8.

The default is every step (``phase_sampling=1``). While phases are sampled, each window also
says what they rest on (``stepwatch.step.sampled`` and ``stepwatch.step.sampled.duration``,
:func:`~stepwatch.exporters._recorder.sampled_steps`), and the detectors pool and pair on it
(docs/diagnosis.md); what sampling still loses is a one-off stall on a step whose phases were
not timed (docs/exporters.md). ``phase_sampling="auto"`` picks the smallest power of two that
keeps sampled steps at least :func:`sample_interval` apart, from the median step of the
last exported window, at most 1 in :data:`MAX_STRIDE`. The interval is
:data:`SAMPLE_INTERVAL_S` (10-20 timed steps in a 1 s window: every step at 50 ms and longer,
1 in 4 at 20 ms), or longer where a window holds more than :data:`SAMPLES_PER_WINDOW` such
samples: at the default 10 s windows 0.3125 s, 1 in 16 at 20 ms, 16-32 timed steps a window
(issue 15: a timed step costs the training thread ~28 µs more than another at a 20 ms step on
this project's VM, and the step after it ~6 µs more, so at 1 in 8 they were a third or more of
the training thread's ~12 µs, 0.06 %; 64 a window until the twenty-second round: 1 in 16 took
2.6 µs off a step, paired). The
stride changes only when the ideal one moves 25 % past a power of two (no flapping between
ranks whose steps differ by a hair).
Until the first window, every step is sampled.

A step whose phases are not timed costs auto mode one early return in the forward wrapper,
the optimizer hooks' check, and (DDP, exposed wait) a C-level mark when the last gradient
arrives: no Python frame from the autograd engine. A rank stuck in such a step names its phase
from the training thread's stack (``_AutoState._stack_phase``).

How a sample stands for the steps around it (``window_values``): the ``n`` instrumented steps
of an export batch are shared out among its ``m`` sampled steps as integer weights
(``n // m``, one more for the first ``n % m``), so a phase histogram's count is the number of
steps and ``sum / count`` is the mean over sampled steps: the ratio estimator, with no
window-to-window jitter from how many samples fell in a window. ``min`` and ``max`` are those
of the sampled steps.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Sequence
from typing import Any, Final

from stepwatch.core._errors import ConfigError
from stepwatch.exporters import _cext

SAMPLE_INTERVAL_S: Final = 0.05
SAMPLES_PER_WINDOW: Final = 32
MAX_STRIDE: Final = 256
_HYSTERESIS: Final = 1.25
_MASK64: Final = (1 << 64) - 1


def step_hash(index: int) -> int:
    """A 64-bit mix of a step index (splitmix64's finaliser): the same on every rank."""
    z = (index + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_interval(export_interval_s: float | None) -> float:
    """How far apart ``auto``'s sampled steps are: :data:`SAMPLE_INTERVAL_S`, or a window's
    :data:`SAMPLES_PER_WINDOW`-th part where that is longer (None: the former)."""
    if export_interval_s is None or not math.isfinite(export_interval_s):
        return SAMPLE_INTERVAL_S
    return max(SAMPLE_INTERVAL_S, export_interval_s / SAMPLES_PER_WINDOW)


def ideal_stride(step_s: float, interval_s: float = SAMPLE_INTERVAL_S) -> int:
    """The smallest power of two keeping sampled steps ``interval_s`` apart."""
    if not step_s > 0.0 or not math.isfinite(step_s):
        return 1
    ideal = interval_s / step_s
    if ideal <= 1.0:
        return 1
    return min(1 << math.ceil(math.log2(ideal)), MAX_STRIDE)


def _no_recorder() -> None:
    """No C recorder to tell of a changed stride."""


# The C recorders cache a sampler's stride; a set stride tells them (exporters/csrc).
_stride_changed = _no_recorder if _cext.fastrecord is None else _cext.fastrecord.sampler_changed


class PhaseSampler:
    """Decides, per step index, whether auto mode times that step's phases.

    The training thread calls :meth:`sampled` once per step (at the step's start); the export
    thread calls :meth:`observe` with each window's step durations. The export thread writes
    ``stride``, the training thread reads it; setting it tells the C recorders, which keep the
    stride they read rather than look in this object on every step (``_fastrecord``).

    Args:
        every: ``"auto"`` (the stride follows the step time) or a fixed stride ``>= 1`` (1:
            every step).
        export_interval_s: The monitor's window, for ``auto``'s :func:`sample_interval`.

    Raises:
        ConfigError: ``every`` is neither ``"auto"`` nor a positive integer.
    """

    def __init__(self, every: int | str = 1, *, export_interval_s: float | None = None) -> None:
        self.interval_s = sample_interval(export_interval_s)
        if every == "auto":
            self.adaptive = True
            self.stride = 1
        elif isinstance(every, int) and not isinstance(every, bool) and every >= 1:
            self.adaptive = False
            self.stride = every
        else:
            raise ConfigError(f"phase_sampling must be 'auto' or a positive integer, got {every!r}")
        #: Set by the export thread once a window said what its sampled phases rest on
        #: (``_recorder.sampled_steps``).
        self.reported = False

    @property
    def stride(self) -> int:
        """One step in ``stride`` is timed phase by phase (1: every step)."""
        return self._stride

    @stride.setter
    def stride(self, stride: int) -> None:
        self._stride = stride
        _stride_changed()

    def sampled(self, index: int) -> bool:
        """Whether step ``index`` is timed phase by phase."""
        stride = self.stride
        return stride == 1 or step_hash(index) % stride == 0

    def observe(self, durations_s: Sequence[float]) -> None:
        """Adapt the stride to the median of these step durations (export thread)."""
        if not self.adaptive or not durations_s:
            return
        try:
            median = statistics.median(durations_s)
        except (TypeError, ValueError):
            return
        if not median > 0.0 or not math.isfinite(median):
            return
        current = self.stride
        interval = self.interval_s
        low = ideal_stride(median * _HYSTERESIS, interval)
        high = ideal_stride(median / _HYSTERESIS, interval)
        if not low <= current <= high:
            self.stride = ideal_stride(median, interval)


def share_out(steps: int, samples: int) -> list[int]:
    """``steps`` split into ``samples`` integer weights as even as can be (sum = ``steps``)."""
    if samples <= 0:
        return []
    base, extra = divmod(steps, samples)
    return [base + 1] * extra + [base] * (samples - extra)


def swap_forward_classes(swaps: Sequence[tuple[Any, type, type]], sampled: bool) -> None:
    """Give each instrumented model the class its step needs, at the step's start.

    ``swaps`` holds ``(model, untimed, timed)`` per model whose forward auto mode times by a
    class swap (``_forward._ClassSwap``): ``timed`` when this step's phases are timed, else
    ``untimed``, the model's own class (or ``timed`` again once gradients were seen to
    accumulate, whose waits between micro-batches the forward ends). A model of any other
    class is left alone (someone swapped it since). So a step whose phases are not timed runs
    the model's own class: on a DDP model, whose every forward rewrites a class attribute and
    so empties the type cache of the class and its subclasses, each attribute read after it
    walks one class fewer (callgrind: ~10 k instructions a step, most of an untimed step's
    cost; docs/exporters.md). The C recorder does the same in C (``fastrecord.c``).
    """
    for model, untimed, timed in swaps:
        target = timed if sampled else untimed
        current = type(model)
        if current is not target and (current is untimed or current is timed):
            with contextlib.suppress(TypeError):  # refused: the class stays (its gate times)
                object.__setattr__(model, "__class__", target)
