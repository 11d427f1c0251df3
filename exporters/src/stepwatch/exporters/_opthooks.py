"""Auto mode's optimizer step hooks: once per ``optimizer.step()``, and their C gates.

torch runs an optimizer's step hooks inside the wrapper it puts around a class's ``step``
(``Optimizer.profile_hook_step``, once per class, when the first instance of that class is
made). A subclass whose ``step`` calls its parent's (``super().step()``) therefore runs the
hooks twice, nested, once an instance of the parent class has been made in the process too:
outer pre, inner pre, inner post, outer post. Taken at face value, the inner pre-hook restarted
the optimizer phase (it held only the parent's part) and, in auto steps, the inner post-hook
ended the step, so every step was counted twice, the second a few microseconds long.

The state counts the ``step()`` calls of its optimizer that are open (``optimizer_calls``, 0
between steps); only the outermost call's hooks act:

- a pre-hook with none open is the outermost one: the common case, nothing more is read;
- a pre-hook with some open is nested when a wrapper frame of the same optimizer is running
  above its own (:func:`nested`); otherwise the count is stale, as after a ``step()`` that
  raised (torch skips the post-hooks then), and starts again from this call;
- a post-hook closes one call; it acts when it closes the last.

The C gates (``_fastrecord.OptimizerGate``) keep the same count in the pre gate's struct
(``calls``; the post gate reaches it as its ``partner``), which ``state.optimizer_calls`` reads
then, and call :func:`nested` only in the nested or stale case. In the state's ``__dict__`` the
count cost each step two lookups in a dict that is cold by the time the optimizer hooks run
(the optimizer's pass over parameters, gradients and momenta has evicted it; issue 15).
"""

from __future__ import annotations

import sys
from typing import Any

from stepwatch.exporters import _cext
from stepwatch.exporters._recorder import FAST_RECORDER

_fastrecord = _cext.fastrecord  # the C gates of the optimizer hooks (exporters/csrc/fastrecord.c)

__all__ = ["gates", "nested", "outer_post", "outer_pre", "union_ns"]

NESTED_SEARCH_FRAMES = 16  # frames above a hook searched for an enclosing step() call


def _wrapper_code() -> Any:
    """The code object of torch's step wrapper (every wrapped ``step`` runs it), or None."""
    try:
        import torch

        wrap = torch.optim.Optimizer.profile_hook_step
        return wrap(lambda *args, **kwargs: None).__code__
    except Exception:
        return None


_WRAPPER_CODE: Any = None
_WRAPPER_FOUND = False


def nested(optimizer: Any) -> bool:
    """Whether a ``step()`` of ``optimizer`` is running around the innermost one on this
    thread's stack (two of torch's step-wrapper frames for it, within
    :data:`NESTED_SEARCH_FRAMES`). Never raises (False)."""
    global _WRAPPER_CODE, _WRAPPER_FOUND
    try:
        if not _WRAPPER_FOUND:
            _WRAPPER_CODE, _WRAPPER_FOUND = _wrapper_code(), True
        code = _WRAPPER_CODE
        if code is None:
            return False
        frame: Any = sys._getframe(1)
        found = 0
        for _ in range(NESTED_SEARCH_FRAMES):
            if frame is None:
                break
            if frame.f_code is code and frame.f_locals.get("self") is optimizer:
                found += 1
                if found == 2:
                    return True
            frame = frame.f_back
        return False
    except Exception:
        return False


def outer_pre(state: Any, optimizer: Any) -> bool:
    """Count a ``step()`` call opening; whether its pre-hook is the outermost one's."""
    calls = state.optimizer_calls
    if calls > 0 and nested(optimizer):
        state.optimizer_calls = calls + 1
        return False
    state.optimizer_calls = 1
    return True


def outer_post(state: Any) -> bool:
    """Count a ``step()`` call closing; whether its post-hook is the outermost one's."""
    calls = state.optimizer_calls
    if calls > 1:
        state.optimizer_calls = calls - 1
        return False
    state.optimizer_calls = 0
    return True


def gates(state: Any, hooks_in_c: Any) -> tuple[Any, Any]:
    """The optimizer's pre- and post-hooks: ``state``'s hook bodies (``step_pre``,
    ``step_post``) behind C gates (``_fastrecord.OptimizerGate``: a step enters no Python frame
    in ``optimizer.step()``, timed or not, with the device timer's marks where there is one)
    where the recorder is the C one and ``hooks_in_c(state)`` says so; the state's Python hooks
    (``optimizer_pre``, ``optimizer_post``) elsewhere (no extension)."""
    in_c, device = hooks_in_c(state)
    if FAST_RECORDER is None or not in_c or not isinstance(state.recorder, FAST_RECORDER):
        return state.optimizer_pre, state.optimizer_post
    gate, recorder, stamp = _fastrecord.OptimizerGate, state.recorder, state.gradient_stamp
    pre = gate("pre", recorder, state.step_pre, stamp, state, device)
    post = gate("post", recorder, state.step_post, state.comm_starts_ns, state, device, pre)
    pre.hide_post(post)  # out of torch's post-hook loop on untimed steps (fastrecord.c)
    state.gates = (pre, post)  # the pre gate keeps the count now (state.optimizer_calls)
    return pre, post


def union_ns(starts_ns: list[int], ends_ns: list[int]) -> int:
    """Length of the union of intervals known only by their start and end times.

    The pairing is not needed: a time is covered when more intervals have started than ended
    by then. Starts without an end yet (still in flight) add nothing.
    """
    starts, ends = sorted(starts_ns), sorted(ends_ns)
    total = active = opened_at = 0
    next_start = next_end = 0
    while next_start < len(starts) or next_end < len(ends):
        if next_end >= len(ends) or (
            next_start < len(starts) and starts[next_start] <= ends[next_end]
        ):
            if active == 0:
                opened_at = starts[next_start]
            active += 1
            next_start += 1
        else:
            if active > 0:
                active -= 1
                if active == 0:
                    total += ends[next_end] - opened_at
            next_end += 1
    return total
