"""The autograd engine's backward-start mark: a timed step's backward without a tensor hook.

Auto mode times a step's backward from its start. Until the twentieth round of issue 15 the
start was a tensor hook on the forward's output, registered by each timed forward; torch's side
of it (the tensor's and its node's C++ hooks, the node's Python object made and freed, the
autograd engine taking the GIL and wrapping the gradient in a Python tensor to call it) cost
~17-20 µs of a timed step at 1024 wide on the CPU bench (docs/exporters.md).

Every backward torch runs from Python (``Tensor.backward``, ``torch.autograd.backward``,
``torch.autograd.grad``) goes through ``torch.autograd.graph._engine_run_backward``, which looks
up ``Variable._execution_engine.run_backward`` at each call. :func:`acquire` installs there an
instance of a subclass of torch's engine class whose ``run_backward`` (a class attribute; the
gate does not bind) is ``_fastrecord.EngineGate``: it runs the engine's own method with the
same arguments, and first, on a backward that accumulates gradients (not ``autograd.grad``),
calls the backward-start hooks that timed forwards of the step still open have armed. A timed
forward arms its hook (``EngineGate.arm``) where it registered the tensor hook before. The
instance is still a ``torch._C._ImperativeEngine`` (``queue_callback`` and the rest are the
engine's own; the C++ engine behind every instance is the same one).

What moves: the backward's start is the moment the backward is asked for, not the moment its
gradient reaches the model's output, so the autograd engine's own start (its pass over the
graph) and the loss's backward now count in the backward phase. A ``.backward()`` of
something else between a timed forward and the model's backward (a second model's loss, say)
would start the phase early; a tensor hook knew which output it was on.

The exposed wait ends there too (:func:`close_waits`, the twenty-first round): as the engine
returns, the gate resets the last-gradient stamp of each instrumentation on the host clock and
adds the time since to its recorder's pending wait. The wait is then what its name says, the
last gradient to the end of ``loss.backward()`` (DDP waits there for its allreduces); before,
the optimizer's pre gate ended it, so gradient clipping, unscaling or logging between
``backward()`` and ``step()`` counted as waiting for the peers. And an untimed step's pre gate
has nothing left to do: it leaves torch's pre-hook loop as the post gate does (``hide_pre``,
``fastrecord.c``), and the next timed step's begin puts it back.

Installed once a process, on the first instrumentation that can use it, after a probe (an
``autograd.grad`` that must not fire an armed hook, then a ``.backward()`` that must): where
the probe fails (a torch that no longer looks the engine up per call) or the environment says
``STEPWATCH_BACKWARD_MARK=tensor-hook``, :func:`acquire` returns None and auto mode registers
tensor hooks as before. Where the C extension is not built (or ``STEPWATCH_EXPORTERS_NO_C=1``)
the gate is its Python twin (``_engine_gate``): the same backward start and end of the wait.
The original engine is put back when the last instrumentation using it is removed, if it is
still the one installed.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Final

from stepwatch.core import settings
from stepwatch.exporters import _cext
from stepwatch.exporters._engine_gate import PythonEngineGate
from stepwatch.exporters._recorder import _ClockStamp

_fastrecord = _cext.fastrecord  # exporters/csrc/enginegate.h; None: not built or turned off

logger = logging.getLogger("stepwatch.exporters")

#: The environment variable that keeps auto mode on tensor hooks (``tensor-hook``).
ENV_BACKWARD_MARK: Final = settings.BACKWARD_MARK.variable

_lock = threading.Lock()
_installed: dict[str, Any] = {}  # "gate", "engine" (ours), "original"; empty: not installed
_users = 0
_refused = False  # the probe failed once: not tried again in this process


def _variable_class() -> Any:
    from torch.autograd.variable import Variable

    return Variable


def _probe(gate: Any) -> bool:
    """Whether an armed hook fires at a ``.backward()`` and not at an ``autograd.grad``."""
    import torch

    fired: list[Any] = []
    try:
        with torch.enable_grad():
            leaf = torch.ones(1, requires_grad=True)
            gate.arm(fired.append, None)
            torch.autograd.grad((leaf * 2.0).sum(), leaf)
            if fired:
                return False
            torch.autograd.backward((leaf * 2.0).sum())  # as Tensor.backward does
    except Exception:
        logger.debug("the autograd engine's probe raised", exc_info=True)
        return False
    finally:
        gate.disarm(fired.append)
    return len(fired) == 1


def _gate_type() -> Any:
    """``_fastrecord.EngineGate``, or its Python twin where the extension is not used."""
    return _fastrecord.EngineGate if _fastrecord is not None else PythonEngineGate


def acquire() -> Any | None:
    """The installed ``EngineGate`` (installed by the first call), or None: use tensor hooks."""
    global _users, _refused
    if settings.BACKWARD_MARK.resolve(None, os.environ) == "tensor-hook":
        return None
    with _lock:
        if _installed:
            _users += 1
            return _installed["gate"]
        if _refused:
            return None
        try:
            import torch

            variable = _variable_class()
            original = variable._execution_engine
            if type(original) is not torch._C._ImperativeEngine:
                _refused = True  # someone else's engine: theirs stays
                return None
            gate = _gate_type()(original.run_backward)
            # The gate is a class attribute (it binds to nothing: no __get__) and the instance
            # has no __dict__: the lookup of run_backward is the type's cached one.
            namespace = {"run_backward": gate, "__slots__": ()}
            engine = type("_StepwatchEngine", (torch._C._ImperativeEngine,), namespace)()
            variable._execution_engine = engine
        except Exception:
            logger.debug("the autograd engine's gate could not be installed", exc_info=True)
            _refused = True
            return None
        if not _probe(gate):
            variable._execution_engine = original
            _refused = True
            logger.info(
                "backward starts are marked by tensor hooks: this torch's autograd engine "
                "did not call the gate as expected"
            )
            return None
        _installed.update(gate=gate, engine=engine, original=original)
        _users = 1
        return gate


def release(gate: Any) -> None:
    """One user of ``gate`` fewer; the last one puts torch's engine back (if still ours)."""
    global _users
    with _lock:
        if not _installed or _installed["gate"] is not gate:
            return
        _users -= 1
        if _users > 0:
            return
        try:
            variable = _variable_class()
            if variable._execution_engine is _installed["engine"]:
                variable._execution_engine = _installed["original"]
        except Exception:  # pragma: no cover - torch gone at interpreter exit
            pass
        _installed.clear()


def close_waits(gate: Any, state: Any) -> bool:
    """End auto mode's exposed wait when a backward returns (``EngineGate.close_waits``) and let
    the optimizer's pre gate leave torch's loop on untimed steps (``hide_pre``).

    ``state`` is an ``_auto._AutoState`` with its C gates and the host clock's last-gradient
    ``ClockStamp``, or, where the extension is not used, the Python gate and stamp
    (``_engine_gate``). False where that does not hold (no gate, no C gates, a device timer's
    stamp, no slot left): the pre gate ends the wait at the next ``optimizer.step()``, as before.
    """
    gates = getattr(state, "gates", ())
    stamp = state.gradient_stamp
    if type(gate) is PythonEngineGate:
        return type(stamp) is _ClockStamp and gate.close_waits(stamp, state.recorder)
    if gate is None or not gates or _fastrecord is None:
        return False
    if type(stamp) is not _fastrecord.ClockStamp:
        return False
    try:
        if not gate.close_waits(stamp, state.recorder):
            return False
        gates[0].hide_pre()
    except Exception:
        logger.debug("the exposed wait stays with the optimizer's pre gate", exc_info=True)
        gate.unclose(stamp)
        return False
    return True
