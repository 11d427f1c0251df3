"""Auto mode's forward timing: a class swap that keeps ``nn.Module.__call__``'s fast path.

``time_forward(state, model)`` makes ``model``'s forward call ``state.forward_pre(model, args)``
before and ``state.forward_post(model, args, output)`` after (also when it raises), where
``state`` is the auto-mode state of ``_auto``. Any module hook, however empty, takes
``nn.Module._call_impl`` off its fast path (a closure, a set, ``torch.compiler.is_compiling``
and the hook loops per call: ~10-11 k instructions per step under callgrind with empty hooks,
whose cache misses cost more on a large model, as its kernels evict that code from L2 between
calls; docs/exporters.md). The swap adds one Python frame on a timed step; an untimed one
runs the model's own class (the recorder swaps it back, ``_ClassSwap``), or with gradients
accumulating the C gate (``_forward_gate``). Module hooks remain the fallback.

Also the output's backward-start hook mechanics ``_auto`` uses: the probe of torch's tensor-hook
internals, the hook dict and keys, and the output tensor a forward's gradient reaches first.
"""

from __future__ import annotations

import copyreg
import functools
import itertools
import logging
import sys
import types
from typing import Any, Final

from stepwatch.exporters import _cext
from stepwatch.exporters._recorder import FAST_RECORDER

_fastrecord = _cext.fastrecord  # the forward's C gate (exporters/csrc/fastrecord.c)

logger = logging.getLogger("stepwatch.exporters")


class _ClassSwap:
    """The model's class swapped for a subclass whose ``forward`` times it; ``remove()`` undoes.

    ``nn.Module.__call__`` keeps its hook-free fast path (no module hook is registered), and
    the subclass binds ``self``: it times only the instrumented instance. A copy made by
    ``copy.deepcopy``/``copy.copy``/pickle is of the original class (``__reduce_ex__``), a
    replica made as ``nn.DataParallel`` does (``__new__(type(model))``) is not the instance
    and runs the plain forward. The subclass carries the original's name, module and
    docstring; ``isinstance`` holds; only ``type(model) is Original`` sees the swap.

    The swap is registered with the recorder (``forward_swaps``), which puts the original
    class back at the start of each step whose phases are not timed and the subclass at the
    start of each one whose are (``_sampling.swap_forward_classes``): an untimed step runs
    the model's own class. Once gradients are seen to accumulate (:meth:`keep_timed`) the
    subclass stays, as its forward ends the wait between micro-batches on every step.
    """

    def __init__(self, model: Any, original: type, timed: type, recorder: Any) -> None:
        self.model = model
        self.original = original
        self.timed = timed
        self.recorder = recorder
        self.entry = (model, original, timed)
        recorder.forward_swaps = (*recorder.forward_swaps, self.entry)

    def keep_timed(self) -> None:
        """Keep the subclass on every step from now on (gradients accumulate)."""
        entry, self.entry = self.entry, (self.model, self.timed, self.timed)
        swaps = self.recorder.forward_swaps
        self.recorder.forward_swaps = tuple(self.entry if e is entry else e for e in swaps)
        if type(self.model) is self.original:
            object.__setattr__(self.model, "__class__", self.timed)

    def after_backward(self, state: Any) -> _ClassSwap | None:
        """A forward after a backward (``state``: the auto-mode state): in the same step,
        gradients accumulate, and the subclass stays (None: nothing more to watch); before it
        (an optimizer step skipped, as a gradient scaler does on overflow), this swap."""
        last = max(state.gradient_stamp.ns, state.backward_start_ns if state.in_backward else 0)
        if last < state.recorder.step_start_ns:
            return self
        self.keep_timed()
        return None

    def remove(self) -> None:
        entry = self.entry
        swaps = self.recorder.forward_swaps
        self.recorder.forward_swaps = tuple(e for e in swaps if e is not entry)
        if type(self.model) is self.timed:
            object.__setattr__(self.model, "__class__", self.original)


def time_forward(state: Any, model: Any, *, in_c: bool = False) -> Any:
    """Time ``model``'s forward by a class swap, or with module hooks where it cannot be.

    ``in_c``: the C gate may time a step's forward itself (``ForwardGate.time_in_c``) where
    :func:`hooks_in_c` says so for ``state``.

    Module hooks are the fallback: a forward set on the instance (it would shadow the
    class's), a forward that is not a plain function, or a class that refuses the swap.
    """
    try:
        swap = _swap_class(state, model, in_c)
    except Exception:
        logger.debug("class swap refused; forward timed with module hooks", exc_info=True)
        swap = None
    state.class_swap = swap
    if swap is not None:
        return swap
    forward_pre = state.forward_pre

    def pre_hook(module: Any, args: Any) -> None:
        forward_pre(module, args)  # its result says whether it timed; a pre-hook returns None

    pre = model.register_forward_pre_hook(pre_hook)
    # always_call: a forward that raises still closes the phase (else it stays open forever).
    post = model.register_forward_hook(state.forward_post, always_call=True)
    return _Handles(pre, post)


class _Handles:
    """Several removable handles as one."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _new_object(cls: Any, *args: Any) -> Any:
    """``copyreg.__newobj__`` for the original class of a swapped instance (pickle, copy)."""
    return cls.__new__(cls, *args)


def _swap_class(state: Any, model: Any, in_c: bool = False) -> _ClassSwap | None:
    original: Any = type(model)
    forward = getattr(original, "forward", None)
    if "forward" in vars(model) or not isinstance(forward, types.FunctionType):
        return None
    target = model
    forward_pre, forward_post = state.forward_pre, state.forward_post
    recorder, stamp = state.recorder, state.gradient_stamp

    @functools.wraps(forward)
    def timed_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self is not target or not state.enabled:
            return forward(self, *args, **kwargs)
        if recorder.step_depth and not recorder.sampled and not state.in_backward:
            # A step whose phases are not timed (_sampling); a last gradient already come
            # (gradients accumulate) ends its wait here, as in a timed step.
            if stamp.ns:
                forward_pre(self, args)
            return forward(self, *args, **kwargs)
        if not forward_pre(self, args):
            return forward(self, *args, **kwargs)
        output = None
        try:
            output = forward(self, *args, **kwargs)
        finally:
            forward_post(self, args, output)  # also when the forward raises: the phase closes
        return output

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # Copies and pickles are of the original class: not instrumented, importable.
        reduced = original.__reduce_ex__(self, protocol)
        if isinstance(reduced, tuple) and len(reduced) >= 2 and reduced[1]:
            arguments = reduced[1]
            if arguments[0] is timed:
                # pickle insists that copyreg.__newobj__'s class is the object's: same call.
                newobj = getattr(copyreg, "__newobj__", None)
                rebuild = _new_object if reduced[0] is newobj else reduced[0]
                reduced = (rebuild, (original, *arguments[1:]), *reduced[2:])
        return reduced

    namespace = {
        "__slots__": (),
        "forward": _forward_gate(state, target, forward, timed_forward, in_c),
        "__reduce_ex__": __reduce_ex__,
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": original.__doc__,
    }
    metaclass: Any = type(original)
    timed = metaclass(original.__name__, (original,), namespace)
    object.__setattr__(model, "__class__", timed)
    return _ClassSwap(model, original, timed, recorder)


def hooks_in_c(state: Any) -> tuple[bool, Any]:
    """Whether C may run ``state``'s hooks on a timed step itself, and the device timer whose
    marks it then takes (None: the host clock alone).

    Yes for the classes whose hooks ``_fastrecord``'s timed paths copy: ``_auto._AutoState``
    and ``_auto_device.DeviceAutoState``, each saying so in its own namespace
    (``HOOKS_IN_C``), so that a subclass with hooks of its own keeps them; and only with the
    C last-gradient stamp that fits (``ClockStamp``, or ``MarkStamp`` with a device timer),
    which is made only where the recorder's clock is the one C reads.
    """
    if not type(state).__dict__.get("HOOKS_IN_C", False) or _fastrecord is None:
        return False, None
    device = getattr(state, "device", None)
    stamp_type = getattr(_fastrecord, "ClockStamp" if device is None else "MarkStamp", None)
    return type(state.gradient_stamp) is stamp_type, device


def _forward_gate(
    state: Any, target: Any, forward: Any, timed_forward: Any, in_c: bool = False
) -> Any:
    """``timed_forward`` behind a C gate (``_fastrecord.ForwardGate``: a step whose phases are
    not timed calls the original forward without a Python frame of ours; with ``in_c`` and
    torch's tensor-hook internals as probed, a timed step is timed there too, as
    ``forward_pre``, ``forward_post`` and ``hook_output`` would, with a device timer's marks
    where the state has one) where the recorder and the last-gradient stamp are the C ones;
    ``timed_forward`` itself elsewhere."""
    recorder, stamp = state.recorder, state.gradient_stamp
    stamps = (getattr(_fastrecord, "ClockStamp", None), getattr(_fastrecord, "MarkStamp", None))
    if FAST_RECORDER is None or not isinstance(recorder, FAST_RECORDER):
        return timed_forward
    if type(stamp) not in stamps:
        return timed_forward
    gate = _fastrecord.ForwardGate(target, state, recorder, stamp, forward, timed_forward)
    in_c, device = hooks_in_c(state) if in_c else (False, None)
    if in_c and state._direct_tensor_hooks:
        # The backward-start hook in C too (_fastrecord.BackwardStart): the same variables.
        state._on_backward_start = _fastrecord.BackwardStart(state, device)
        torch = sys.modules["torch"]
        has_torch_function = torch.overrides.has_torch_function_unary
        gate.time_in_c(
            torch.Tensor,
            torch.is_grad_enabled,
            has_torch_function,
            HookDict,
            state.hook_key,
            state._on_backward_start,
            device,
            getattr(state, "engine", None),
        )
    return functools.update_wrapper(gate, forward)  # __wrapped__: signature, _stack's codes


# Keys of stepwatch's hooks in an output's tensor-hook dict, one per instrumentation (several
# may hook one output); torch keys its hooks by RemovableHandle ids, which count up from 0.
HOOK_KEYS: Final = itertools.count(1)


class HookDict(dict[int, Any]):
    """A tensor's hook dict: a dict that ``torch.utils.hooks.RemovableHandle`` can weakref."""

    __slots__ = ("__weakref__",)


def direct_tensor_hooks_work(torch: Any) -> bool:
    """Whether a tensor hook registered the way ``_AutoState.forward_post`` does runs (probe).

    The two calls are torch internals (what ``Tensor.register_hook`` itself does); should a
    torch version change them, the public ``register_hook`` is used instead.
    """
    fired: list[Any] = []
    try:
        with torch.enable_grad():
            leaf = torch.ones(1, requires_grad=True)
            output = leaf * 2.0
            output._backward_hooks = HookDict({-1: fired.append})
            output.grad_fn._register_hook_dict(output)
            output.sum().backward()
    except Exception:
        return False
    return len(fired) == 1


def first_grad_tensor(output: Any, tensor_type: Any) -> Any:
    """The first tensor requiring grad in a (nested) forward output, or None."""
    stack = [output]
    while stack:
        item = stack.pop(0)
        if isinstance(item, tensor_type):
            if item.requires_grad:
                return item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return None
