"""Where the training thread is, from its Python stack (a rank stuck in an untimed step).

Auto mode times phases on a sample of steps (``_sampling``). When a rank stops making progress
inside a step whose phases are not timed, the export thread still has to say where it is
(the hang rule tells the ranks that wait in communication from the one that holds them). It
reads the training thread's stack (``sys._current_frames``; nothing is added to the training
thread) and names the innermost frame that runs a known function: the model's forward, one
of autograd's backward entry points, the optimizer's step. Torch's wrappers around a function
(``functools.wraps`` chains: the optimizer's hook wrapper, ``no_grad`` decorators) are
followed so every layer is known.
"""

from __future__ import annotations

import sys
from typing import Any

#: Most ``__wrapped__`` links followed from one function.
_MAX_WRAPPERS = 8


def phase_codes(torch: Any, model: Any, optimizer: Any) -> dict[Any, str]:
    """Code objects whose frame names its phase: forward, backward, optimizer.

    The model's forward (the timed wrapper, the original, and a wrapped module's: DDP's
    ``module``), autograd's backward entry points and the optimizer's step with every wrapper
    torch put around it.
    """
    codes: dict[Any, str] = {}

    def add(function: Any, phase: str) -> None:
        for _ in range(_MAX_WRAPPERS):
            if function is None:
                return
            code = getattr(function, "__code__", None)
            if code is not None:
                codes.setdefault(code, phase)
            function = getattr(function, "__wrapped__", None)

    add(getattr(type(model), "forward", None), "forward")
    inner = getattr(model, "module", None)
    if isinstance(inner, torch.nn.Module):
        add(getattr(type(inner), "forward", None), "forward")
    add(getattr(type(optimizer), "step", None), "optimizer")
    add(torch.autograd.backward, "backward")
    add(torch.Tensor.backward, "backward")
    add(getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None), "backward")
    return codes


def frame_phase(codes: dict[Any, str], frame: Any) -> str | None:
    """The phase of the innermost frame of this stack that runs a known function, or None."""
    while frame is not None:
        phase = codes.get(frame.f_code)
        if phase is not None:
            return phase
        frame = frame.f_back
    return None


def stack_phase(codes: dict[Any, str], thread_id: int) -> str | None:
    """The phase thread ``thread_id`` is in; failing that, of any thread running a known one.

    The training thread is the one that last ran a timed forward; a loop that moved to
    another thread since is found by looking at every thread's stack.
    """
    frames = sys._current_frames()
    first = frames.pop(thread_id, None)
    for frame in [first, *frames.values()]:
        phase = frame_phase(codes, frame)
        if phase is not None:
            return phase
    return None
