"""``_fastrecord.EngineGate`` in Python: the autograd engine's gate where the C extension is not
built (or is turned off), so that auto mode's phases have the same boundaries either way.

Without it, the Python paths marked a backward's start with a tensor hook on the forward's
output (when its gradient arrives, after the autograd engine's own start and the loss's
backward) and ended the exposed wait at the next ``optimizer.step()`` (gradient clipping,
unscaling or logging between ``backward()`` and ``step()`` counted as ``communication``):
the same job gave different phase times depending on whether a C compiler was present. This
gate does what ``exporters/csrc/enginegate.h`` does, read that file's comment for the
semantics; the differences are only where the C one keeps state in C structs:

- the recorder of an arm is any object with ``step_depth`` and ``step_index`` (the C gate
  reads ``RecorderCore``'s struct, or these attributes of a Python ``StepRecorder``);
- :meth:`close_waits` takes the Python last-gradient stamp (``_recorder._ClockStamp``) and a
  Python recorder, reads the recorder's clock when a backward returns and adds the wait with
  ``add_phase_ns("communication", ...)`` (the C gate adds it to ``RecorderCore.wait_ns``,
  folded into the same phase at the step's end).

One Python call per backward, where the tensor hook it replaces cost a hook registration per
timed step and the autograd engine's Python call at the output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Final

SLOTS: Final = 8  # ENGINE_GATE_SLOTS: hooks armed, or waits closed, at once
_ACCUMULATE_GRAD_POSITION: Final = 6  # torch's run_backward: accumulate_grad, 7th parameter


def _accumulates(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a ``run_backward`` call accumulates gradients (``.backward()``, not ``.grad``)."""
    if "accumulate_grad" in kwargs:
        value = kwargs["accumulate_grad"]
    elif len(args) > _ACCUMULATE_GRAD_POSITION:
        value = args[_ACCUMULATE_GRAD_POSITION]
    else:
        return True
    try:
        return bool(value)
    except Exception:
        return True


def _open_step(recorder: Any) -> int:
    """The open step's index of ``recorder``, or -1 where none is open or it cannot be read."""
    try:
        depth, index = recorder.step_depth, recorder.step_index
    except Exception:
        return -1
    if type(depth) is int and type(index) is int and depth > 0:
        return index
    return -1


class PythonEngineGate:
    """``EngineGate(run_backward)`` in Python (see the module's docstring).

    An instance is a class attribute of the engine subclass ``_engine.acquire`` installs: it
    has no ``__get__``, so it is called with the engine's arguments, unbound, as the C gate is.
    """

    __slots__ = ("_arms", "_closers", "backwards", "closed", "dropped", "marks", "run")

    def __init__(self, run: Callable[..., Any]) -> None:
        if not callable(run):
            raise TypeError("EngineGate: run_backward must be callable")
        self.run = run
        self._arms: list[tuple[Callable[[Any], Any], Any, int]] = []
        self._closers: list[tuple[Any, Any]] = []  # (last-gradient stamp, recorder)
        self.backwards = 0  # accumulating backwards that found an arm
        self.marks = 0  # hooks called
        self.dropped = 0  # arms dropped as stale (their step had closed)
        self.closed = 0  # exposed waits ended when a backward returned

    @property
    def armed(self) -> int:
        """Hooks armed now."""
        return len(self._arms)

    @property
    def closing(self) -> int:
        """Stamps whose waits end here."""
        return len(self._closers)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._arms and _accumulates(args, kwargs):
            self.backwards += 1
            self._fire()
        try:
            return self.run(*args, **kwargs)
        finally:
            if self._closers:
                self._close_waits()

    def _fire(self) -> None:
        """Every arm taken out (before any hook runs: a hook may start a backward itself),
        the current ones' hooks called in the order armed; what they raise is dropped."""
        arms, self._arms = self._arms, []
        for hook, recorder, index in arms:
            if recorder is None or _open_step(recorder) == index:
                self.marks += 1
                with contextlib.suppress(Exception):  # the hooks report their own failures
                    hook(None)
            else:
                self.dropped += 1

    def _close_waits(self) -> None:
        """After the engine returned (or raised): each set stamp's wait ended now."""
        for stamp, recorder in self._closers:
            last = stamp.ns
            if not last:
                continue
            stamp.ns = 0
            try:
                now = int(recorder.clock_ns())
            except Exception:  # no clock: the wait is not counted
                continue
            if now > last:
                recorder.add_phase_ns("communication", now - last)
            self.closed += 1

    def arm(self, hook: Callable[[Any], Any], recorder: Any) -> bool:
        """``hook(None)`` at the next accumulating backward of the recorder's open step
        (``recorder`` None: the next one); False where no step is open or no slot is left."""
        if not callable(hook):
            raise TypeError("arm(hook, recorder)")
        index = 0
        if recorder is not None and (index := _open_step(recorder)) < 0:
            return False
        for position, (armed_hook, _, _) in enumerate(self._arms):
            if armed_hook is hook:
                self._arms[position] = (hook, recorder, index)
                return True
        if len(self._arms) >= SLOTS:
            return False
        self._arms.append((hook, recorder, index))
        return True

    def disarm(self, hook: Callable[[Any], Any]) -> bool:
        """Its arm removed, if any (True when there was one)."""
        for position, (armed_hook, _, _) in enumerate(self._arms):
            if armed_hook is hook:
                del self._arms[position]
                return True
        return False

    def close_waits(self, stamp: Any, recorder: Any) -> bool:
        """The exposed wait since ``stamp`` (its ``ns``; 0: none) ends when a backward returns,
        into ``recorder``'s ``communication``; False when no slot is left. The same stamp
        again takes the new recorder."""
        for position, (closing, _) in enumerate(self._closers):
            if closing is stamp:
                self._closers[position] = (stamp, recorder)
                return True
        if len(self._closers) >= SLOTS:
            return False
        self._closers.append((stamp, recorder))
        return True

    def unclose(self, stamp: Any) -> bool:
        """Its waits no longer end here (True when they did)."""
        for position, (closing, _) in enumerate(self._closers):
            if closing is stamp:
                del self._closers[position]
                return True
        return False
