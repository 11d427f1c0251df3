"""The profiler behind :class:`~stepwatch.exporters.kernels.TorchProfilerSource`: one
cycle's start and stop on the training thread, and the cheap read of its CPU ops.

``TorchProfilerSource`` takes any :class:`ProfilerBackend` (tests pass scripted ones);
:class:`TorchProfilerBackend` is ``torch.profiler`` with CPU activity.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from stepwatch.core import settings

_log = logging.getLogger("stepwatch.exporters.kernels._torch_source")


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


KINETO_LOG_LEVEL_QUIET = "6"
"""Above every Kineto severity (VERBOSE 0 … ERROR 4, USDT 5): Kineto prints nothing."""


class TorchProfilerBackend:
    """:class:`ProfilerBackend` on ``torch.profiler.profile(activities=[CPU])``.

    Args:
        quiet_kineto: torch 2.13's Kineto writes two lines to stderr at every profiler start
            and stop (``USDT:… profiler_start`` / ``profiler_stop``): from an always-on source,
            two lines per cycle on every rank, forever. When ``KINETO_LOG_LEVEL`` is unset,
            the first start sets it to :data:`KINETO_LOG_LEVEL_QUIET` (Kineto reads it once,
            when the profiler first runs in the process, so it has no effect if something
            profiled before). That also silences Kineto's own warnings and errors for the
            process; this source reports its failures through ``logging`` itself. Set
            ``KINETO_LOG_LEVEL`` yourself (or pass ``False``) to keep Kineto's output.
    """

    def __init__(self, *, quiet_kineto: bool = True) -> None:
        self._profile: Any = None
        self._quiet_kineto = quiet_kineto

    def start(self) -> None:
        """Start a fresh CPU-activity profile."""
        from torch.profiler import ProfilerActivity, profile

        if self._quiet_kineto:
            self._quiet_kineto = False  # once: never touch the environment again
            variable = settings.KINETO_LOG_LEVEL.variable
            if variable not in os.environ:  # set, even empty, it is the user's choice
                os.environ[variable] = KINETO_LOG_LEVEL_QUIET
                _log.info(
                    "%s=%s: Kineto's per-cycle log lines silenced (set %s to keep them)",
                    variable,
                    KINETO_LOG_LEVEL_QUIET,
                    variable,
                )

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

    Skips user annotations (``record_function`` ranges, ``ProfilerStep#N``). Each accessor is a
    pybind11 call of ~0.1-0.2 µs, so the loop makes only the ones it needs: a profile of CPU
    activity alone (what :class:`TorchProfilerBackend` records, without ``with_stack``) holds
    no device events and no Python function events, and asking each event its device type
    (~0.23 µs) and whether it is a Python function cost the export thread a third of the
    reading (bench/profiler_cost.py: ~1.6 against ~0.8 µs an event). A profile with them
    (another configuration's) goes through :func:`read_kineto_ops_checked`, as does an older
    torch build's.
    """
    events = results.events()
    sample = events[0] if events else None
    if not hasattr(sample, "is_user_annotation"):
        return read_kineto_ops_checked(results, events)
    ops: list[OpRecord] = []
    append = ops.append
    new = tuple.__new__
    for event in events:
        if event.is_user_annotation():
            continue
        op = (event.name(), event.start_ns(), event.end_ns(), event.start_thread_id())
        append(new(OpRecord, op))
    return ops


def read_kineto_ops_checked(results: Any, events: Any = None) -> list[OpRecord]:
    """:func:`read_kineto_ops` asking every event its device and kind: CPU ops only, user
    annotations and Python function events skipped (any profile, any torch build)."""
    from torch._C._autograd import DeviceType

    ops: list[OpRecord] = []
    append = ops.append
    cpu = DeviceType.CPU
    if events is None:
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
