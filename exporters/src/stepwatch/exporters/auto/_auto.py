"""Auto mode: forward, backward, optimizer and DDP communication phases from torch hooks.

One line, no change to the training loop: ``monitor.instrument(model, optimizer)``.

- forward: from entering the top-level module's ``forward`` to its return (summed when the
  model runs several times per step, e.g. gradient accumulation), timed by swapping the
  model's class for a subclass whose ``forward`` wraps the original (``_forward``): no module
  hook, so ``nn.Module.__call__`` keeps its fast path. A forward that raises still closes
  the phase. Module hooks are the fallback (a forward set on the instance, a class that
  refuses the swap);
- backward: from the moment the backward is asked for (the next ``.backward()`` after a timed
  forward whose output requires grad: ``_engine``'s gate on torch's autograd engine; a tensor
  hook on the output, when the gradient reaches it, where the gate cannot be installed) to the
  next ``optimizer.step()`` or forward on the training thread (by then ``loss.backward()`` has
  returned, DDP's allreduce wait included);
- optimizer: ``Optimizer.register_step_pre_hook`` → ``register_step_post_hook``;
- communication, by default: the *exposed* wait, from the moment the model's last gradient
  is ready (a hook on its first parameter, whose gradient autograd produces last, which is
  when DDP issues its last bucket) to the end of ``loss.backward()`` (DDP waits there for its
  allreduces; ended by ``_engine``'s gate as it returns, or without that gate or with a
  device timer at the next optimizer pre-hook or forward). DDP keeps its built-in C++
  allreduce, so nothing is added per bucket: any Python comm hook costs a Python call per
  bucket and, on CPU, one more pass over the gradients to average them (DDP's reducer fuses
  that into its copy; ~1.6 ms per 1.2 M parameters on the CPU bench). The rank that arrives
  last waits least;
- communication with ``comm_hook`` (or ``collective_timing=True``): a DDP comm hook that
  wraps the allreduce (the hook you pass, or a timed copy of the default one) and times each
  bucket from the moment its collective is issued to its future's completion — transfer plus
  waiting for the peers, also the part hidden under backward; the hook's own work before the
  collective is not counted. The phase is the union of those intervals in the step;
- data: time from the previous step's end to the next forward (auto steps only);
- step boundary: the end of ``optimizer.step()``, unless the loop uses ``monitor.step()``.

Sampling (``StepMonitor(phase_sampling=...)``, ``_sampling``; default ``"auto"``): the
recorder says at each step's start whether its phases are timed (``recorder.sampled``) and
gives the model its own class on a step that is not (``_forward._ClassSwap``), which then runs
the optimizer hooks' check and, in auto steps, the step boundary; its output gets no backward
hook. **Communication is timed on every step**, sampled or not: the exposed wait's start is a
C clock stamp (``_fastrecord.ClockStamp``, the last parameter's post-accumulate-grad hook),
its end the backward's return (``_engine.close_waits``; the untimed step's optimizer pre gate
then leaves torch's loop) or the optimizer pre-hook; a comm hook's collectives run on every
step anyway.
So a one-off stall on an untimed step still shows who waited for whom; the window says which
phases rest on every step (``stepwatch.phase.every_step``, docs/schema.md). A rank stuck in
such a step is placed from the training thread's stack (``_stack_phase``).

Numerics are untouched: hooks return ``None`` (no gradient or output is replaced) and the
comm hook returns the inner hook's own tensor.

Cost on the training thread (issue 15; docs/exporters.md): the hooks run between the model's
kernels, which on a large model evict their code and data from L2, so each instruction costs
more there. Hence the least code per step (with the C recorder the gates in ``fastrecord.c``
take a step's hooks, timed or not, and auto steps' boundary: no Python frame of ours):

- the forward by a class swap (above) instead of two module hooks, whose slow path in
  ``nn.Module._call_impl`` was ~10 k instructions a step on its own;
- the backward-start hook is armed at the autograd engine's gate (``_engine``): torch's side of
  a tensor hook was ~17-20 µs of a timed step at 1024 wide. Where the gate is not installed,
  the hook goes in the output's tensor-hook dict with the two calls ``Tensor.register_hook``
  makes (``_backward_hooks`` and the node's ``_register_hook_dict``), not through it: its
  per-call ``OrderedDict`` and ``RemovableHandle`` cost more than the hook (a one-time probe
  at set-up falls back to ``register_hook`` if a torch version changes those internals;
  tensor subclasses that override torch functions still go through it);
- each hook reads the clock once, and the step boundary is one reading (a step's end is the
  next one's start and the data phase's). A deep copy, a copy or a pickle of an instrumented
  model is of the original class; a replica made by ``nn.DataParallel`` runs the plain forward.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from stepwatch.core._errors import ConfigError
from stepwatch.exporters._recorder import StepRecorder, new_clock_stamp
from stepwatch.exporters.auto._engine import acquire as acquire_engine
from stepwatch.exporters.auto._engine import close_waits
from stepwatch.exporters.auto._engine import release as release_engine
from stepwatch.exporters.auto._forward import (
    HOOK_KEYS,
    HookDict,
    direct_tensor_hooks_work,
    first_grad_tensor,
    hooks_in_c,
    time_forward,
)
from stepwatch.exporters.auto._opthooks import gates, nested, outer_post, outer_pre, union_ns
from stepwatch.exporters.auto._stack import phase_codes, stack_phase

logger = logging.getLogger("stepwatch.exporters")


class Instrumentation:
    """Handle for the hooks installed by :func:`instrument`; :meth:`remove` detaches them.

    Attributes:
        communication_timed: Whether a timing DDP comm hook is installed.
    """

    def __init__(self, state: _AutoState, handles: list[Any], *, communication_timed: bool) -> None:
        self._state = state
        self._handles = handles
        self.communication_timed = communication_timed

    def open_phase(self) -> tuple[str, int] | None:
        """The innermost auto-mode phase open now and its start (monotonic ns), or None.

        Read by the export thread from what the hooks already record (``_AutoState``); a rank
        waiting for its peers in DDP's allreduce reads ``communication``.
        """
        return self._state.open_phase()

    def remove(self) -> None:
        """Remove the module and optimizer hooks; the DDP comm hook becomes a pass-through."""
        state = self._state
        if state.enabled:
            state.recorder.watchers -= 1
        state.enabled = False
        for gate in state.gates:
            gate.active = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        # The backward-start hook of a forward whose backward has not run yet.
        pending_hooks, state.backward_hooks = state.backward_hooks, None
        if pending_hooks is not None:
            pending_hooks.pop(state.hook_key, None)
        pending_handle, state.backward_handle = state.backward_handle, None
        if pending_handle is not None:
            pending_handle.remove()
        engine, state.engine = state.engine, None
        if engine is not None:
            engine.disarm(state._on_backward_start)
            engine.unclose(state.gradient_stamp)
            release_engine(engine)


class NoHooks:
    """What ``instrument()`` returns when the SDK is disabled: no hooks to remove."""

    communication_timed = False

    def open_phase(self) -> None:
        """Never in a phase."""
        return None

    def remove(self) -> None:
        """Nothing to remove."""
        return None


class _AutoState:
    """Hook callbacks; they run on the training thread except the comm completion callbacks.

    The per-step hooks read the clock once each and reach the monitor only through its
    :class:`~stepwatch.exporters._recorder.StepRecorder` (its documented interface); whatever
    can be looked up once (the clock function, torch's ``Tensor`` type and grad-mode query, the
    bound backward-start callback) is, at set-up.
    """

    HOOKS_IN_C = True  # fastrecord.c's gates copy these hooks (_forward.hooks_in_c)

    def __init__(self, recorder: StepRecorder) -> None:
        import torch

        self.recorder = recorder
        self.enabled = True
        self.forward_depth = 0
        self.forward_start_ns = 0
        self.in_backward = False
        self.backward_start_ns = 0
        # The pending backward-start hook: the output's hook dict, or a handle (public API).
        self.backward_hooks: dict[int, Any] | None = None
        self.hook_key = -next(HOOK_KEYS)
        self.backward_handle: Any = None
        # Where a timed forward arms the backward-start hook instead (_engine), or None.
        self.engine: Any = None
        self.optimizer_start_ns: int | None = None
        self.data_start_ns: int | None = None
        # Issue and completion times of this step's collectives. Appends come from the training
        # thread (issue) and the comm library's completion thread; a list append is atomic
        # under the GIL, and DDP waits for every chained completion callback before backward
        # returns, so by optimizer.step() (where they are read and cleared) nothing appends.
        self.comm_starts_ns: list[int] = []
        self.comm_ends_ns: list[int] = []
        self.clock_ns = recorder.clock_ns
        # Exposed-wait timing (no comm hook): the last parameter's post-accumulate-grad hook is
        # this stamp, on every step; in C where it can be (no Python frame from autograd). It
        # takes the time the model's last gradient is ready (``ns``; 0: none since the last
        # reset). The autograd engine's gate as the backward returns (_engine.close_waits), or
        # else the next hook on the training thread (the optimizer pre-hook, or a forward when
        # gradients accumulate), records the wait since then as ``communication`` on every
        # step, sampled or not, and resets it.
        self.gradient_stamp: Any = new_clock_stamp(self.clock_ns)
        self.gates: tuple[Any, ...] = ()  # the optimizer hooks' C gates (_opthooks.gates)
        self._optimizer_calls = 0  # the optimizer's step() calls open (_opthooks), no C gates
        self.nested_call = nested  # for the C gates: is this step() inside another?
        self.class_swap: Any = None  # _forward._ClassSwap until gradients accumulate
        # Where a stack of the training thread is, for a rank stuck in a step whose phases
        # are not timed (``_sampling``): code object -> phase (set by install_hooks).
        self.phase_codes: dict[Any, str] = {}
        self.thread_id = threading.get_ident()
        self._tensor_type = torch.Tensor
        self._grad_enabled = torch.is_grad_enabled
        self._on_backward_start = self.backward_start
        self._direct_tensor_hooks = direct_tensor_hooks_work(torch)
        self._has_torch_function = torch.overrides.has_torch_function_unary

    @property
    def optimizer_calls(self) -> int:
        """The optimizer's ``step()`` calls open (``_opthooks``): the pre C gate's count where
        the gates run, else the state's own."""
        gates = self.gates
        return int(gates[0].calls) if gates else self._optimizer_calls

    @optimizer_calls.setter
    def optimizer_calls(self, calls: int) -> None:
        gates = self.gates
        if gates:
            gates[0].calls = calls
        else:
            self._optimizer_calls = calls

    def __deepcopy__(self, memo: dict[int, Any]) -> _AutoState:
        """A deep copy of an instrumented model (an EMA copy, say) is not instrumented.

        ``copy.deepcopy`` copies the model's hooks with their state; the copy's hooks get a
        disabled state that does nothing (the monitor, its lock and thread are not copied).
        """
        inert = object.__new__(_AutoState)
        inert.enabled = False
        return inert

    def open_phase(self) -> tuple[str, int] | None:
        """The phase the training thread is in now, by the latest start (export thread).

        Every field read here is one the hooks set anyway; reads are single attribute loads, so
        a torn read can only mix two neighbouring moments of the same step. Communication is
        the exposed wait (after the last gradient, until ``loss.backward()`` returns) or a
        timed collective still in flight (more issued than completed).
        """
        if not self.enabled:
            return None
        try:
            recorder = self.recorder
            if not recorder.sampled and recorder.step_depth > 0:
                return self._stack_phase()
            open_phases: list[tuple[str, int]] = []
            if self.forward_depth > 0:
                open_phases.append(("forward", self.forward_start_ns))
            if self.in_backward:
                open_phases.append(("backward", self.backward_start_ns))
            last_gradient = self.gradient_stamp.ns
            if last_gradient:
                open_phases.append(("communication", last_gradient))
            issued = sorted(self.comm_starts_ns)
            completed = len(self.comm_ends_ns)
            if len(issued) > completed:
                open_phases.append(("communication", issued[completed]))
            optimizer_start = self.optimizer_start_ns
            if optimizer_start is not None:
                open_phases.append(("optimizer", optimizer_start))
            data_start = self.data_start_ns
            if data_start is not None:
                open_phases.append(("data", data_start))
            return max(open_phases, key=lambda phase: phase[1]) if open_phases else None
        except Exception:
            return None

    def _stack_phase(self) -> tuple[str, int] | None:
        """The phase of a step whose phases are not timed, from the training thread's stack.

        The innermost frame running a known function names it (the model's forward, autograd's
        backward, the optimizer's step); inside backward, a last gradient already come (the
        C-level mark its hook leaves) means the rank waits for its collectives:
        ``communication``. Between the optimizer and the next forward of an auto step:
        ``data``. The phase's start is not known: the step's start is given (a lower bound of
        how long it has lasted is what the export thread needs). (The time the last gradient
        came is known, but the export thread names the phase from the stack alone there.)
        """
        recorder = self.recorder
        since = recorder.step_start_ns
        phase = stack_phase(self.phase_codes, self.thread_id)
        if phase is not None:
            if phase == "backward" and self.gradient_stamp.ns:
                return ("communication", since)
            return (phase, since)
        if self.data_start_ns is not None and not recorder.explicit_steps:
            return ("data", self.data_start_ns)
        return None

    def forward_pre(self, module: Any, args: Any) -> bool:
        """Open the forward phase; False when this step's phases are not timed (sampling)."""
        if not self.enabled:
            return False
        try:
            now = self.clock_ns()
            if self.in_backward or self.gradient_stamp.ns:
                if self.class_swap is not None:  # gradients may accumulate
                    self.class_swap = self.class_swap.after_backward(self)
                self._end_backward(now)  # gradient accumulation: the previous micro-batch ended
            recorder = self.recorder
            if not recorder.explicit_steps and recorder.step_depth == 0:
                recorder.begin_step(explicit=False, now_ns=now)
            if not recorder.sampled:
                return False
            if not recorder.explicit_steps:
                data_start = self.data_start_ns
                if data_start is not None:
                    recorder.add_sampled_phase_ns("data", now - data_start)
                    self.data_start_ns = None
            self.forward_depth += 1
            if self.forward_depth == 1:
                self.forward_start_ns = now
                self.thread_id = threading.get_ident()
            return True
        except Exception:
            self.recorder.misuse("auto", "auto-mode forward pre-hook failed", exc_info=True)
            return False

    def forward_post(self, module: Any, args: Any, output: Any) -> None:
        if not self.enabled:
            return
        try:
            depth = self.forward_depth
            if depth != 1:
                if depth > 1:
                    self.forward_depth = depth - 1
                return
            self.forward_depth = 0
            self.recorder.add_sampled_phase_ns("forward", self.clock_ns() - self.forward_start_ns)
            self.hook_output(output)
        except Exception:
            self.recorder.misuse("auto", "auto-mode forward hook failed", exc_info=True)

    def hook_output(self, output: Any) -> None:
        """The backward-start hook on the output a forward's gradient reaches first (its
        callers report what it raises)."""
        if not self._grad_enabled():
            return
        tensor = (
            output
            if type(output) is self._tensor_type
            else first_grad_tensor(output, self._tensor_type)
        )
        if tensor is None or not tensor.requires_grad:
            return
        engine = self.engine
        if engine is not None and engine.arm(self._on_backward_start, self.recorder):
            return  # the next backward marks the start (_engine)
        if self._direct_tensor_hooks and not self._has_torch_function(tensor):
            # What Tensor.register_hook does, without the OrderedDict and RemovableHandle
            # it builds per call (most of its cost in a step): our entry in the output's
            # dict of tensor hooks, which autograd runs when the gradient reaches the
            # output (before the output's node). A new dict is registered on the node (a
            # leaf output has none); an existing one (the model's own hooks, or ours on
            # a leaf output from the previous step) already is.
            hooks = tensor._backward_hooks
            if hooks is None:
                hooks = HookDict()
                tensor._backward_hooks = hooks
                node = tensor.grad_fn
                if node is not None:
                    node._register_hook_dict(tensor)
            hooks[self.hook_key] = self._on_backward_start
            self.backward_hooks = hooks
        else:  # a tensor subclass that overrides torch functions decides itself
            self.backward_handle = tensor.register_hook(self._on_backward_start)

    def backward_start(self, grad: Any) -> None:
        # A tensor hook on the model's output: the gradient has reached the model.
        if not self.enabled or self.in_backward:
            return
        try:
            self.backward_start_ns = self.clock_ns()
            self.in_backward = True
        except Exception:
            self.recorder.misuse("auto", "auto-mode backward hook failed", exc_info=True)

    def _end_backward(self, now_ns: int) -> None:
        """Close an open backward phase at the next hook on the training thread.

        ``loss.backward()`` returns (after DDP has waited for its allreduces) before the next
        ``optimizer.step()`` or forward. Ending the phase there, rather than with an autograd
        engine callback, keeps Python out of the autograd engine's final callbacks, which
        measurably slowed DDP steps (about 5% on the CPU/gloo overhead bench).
        """
        if self.in_backward:
            self.in_backward = False
            self.recorder.add_sampled_phase_ns("backward", now_ns - self.backward_start_ns)
        self._close_wait(now_ns)

    def _close_wait(self, now_ns: int) -> None:
        """Record the exposed wait since the last gradient (every step) and reset the stamp.

        An every-step phase (``add_phase_ns``), not a sampled one: a one-off stall on a step
        whose phases are not timed still shows who waited (the peers) and who did not.
        """
        stamp = self.gradient_stamp
        last_gradient = stamp.ns
        if last_gradient:
            stamp.ns = 0
            if now_ns > last_gradient:
                self.recorder.add_phase_ns("communication", now_ns - last_gradient)

    def optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's step pre-hook: :meth:`step_pre` for the outermost call only."""
        if self.enabled and outer_pre(self, optimizer):
            self.step_pre(optimizer, args, kwargs)

    def optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The optimizer's step post-hook: :meth:`step_post` for the outermost call only."""
        if self.enabled and outer_post(self):
            self.step_post(optimizer, args, kwargs)

    def step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.enabled:
            return
        try:
            if self.recorder.sampled:
                now = self.optimizer_start_ns = self.clock_ns()
                if self.in_backward or self.gradient_stamp.ns:
                    self._end_backward(now)
            elif self.gradient_stamp.ns:  # a step whose phases are not timed: its wait is
                self._close_wait(self.clock_ns())
        except Exception:
            self.recorder.misuse("auto", "auto-mode optimizer pre-hook failed", exc_info=True)

    def step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.enabled:
            return
        recorder = self.recorder
        if not (recorder.sampled or self.comm_starts_ns) and recorder.explicit_steps:
            return  # a step whose phases are not timed: nothing to add, no boundary to mark
        try:
            now = self.clock_ns()
            start = self.optimizer_start_ns
            if start is not None:
                recorder.add_sampled_phase_ns("optimizer", now - start)
                self.optimizer_start_ns = None
            starts = self.comm_starts_ns
            if starts:  # every step, as the exposed wait (_close_wait)
                ends = self.comm_ends_ns
                recorder.add_phase_ns("communication", union_ns(starts, ends))
                starts.clear()
                ends.clear()
            if not recorder.explicit_steps and recorder.step_depth > 0:
                # One clock read: this step's end is the next one's start and the data start.
                recorder.end_step(explicit=False, now_ns=now)
                recorder.begin_step(explicit=False, now_ns=now)
                self.data_start_ns = now
        except Exception:
            self.recorder.misuse("auto", "auto-mode optimizer hook failed", exc_info=True)

    def timed_comm_hook(self, inner: Any) -> Any:
        """Your DDP comm hook ``inner``, with its collective timed from issue to completion."""
        starts, done = self.comm_starts_ns, self._comm_done
        clock_ns = self.clock_ns

        def hook(state: Any, bucket: Any) -> Any:
            future = inner(state, bucket)
            if not self.enabled:
                return future
            # From the moment the collective is issued: the hook's own work before it (e.g.
            # compression) is not communication, and a rank that reaches the collective late
            # is the one that waits least in it (arrival order, as in ARGUS).
            starts.append(clock_ns())
            # Chained with then() (not add_done_callback) so DDP, which waits on the returned
            # future, cannot finish backward before the completion time is recorded.
            return future.then(done)

        # DDP inspects the hook's annotations and accepts only none or the exact runtime types;
        # with postponed annotations these are strings, so present an unannotated hook.
        hook.__annotations__ = {}
        return hook

    def _comm_done(self, completed: Any) -> Any:
        """Completion of a wrapped hook's future: its value, unchanged."""
        self.comm_ends_ns.append(self.clock_ns())
        return completed.value()

    def timed_allreduce_hook(self, group: Any, *, divide_in_place: bool) -> Any:
        """DDP's built-in allreduce as a Python hook, timed, with as little per bucket as can be.

        Per bucket: one scaling pass, the collective issued on the process group directly (not
        through ``dist.all_reduce``'s Python checks), one clock read and list append, and one
        chained completion callback that appends the completion time and unwraps the tensor.
        No closure, lock or tuple per bucket.

        Numerics: DDP's built-in reducer scales each gradient by ``1 / world_size`` while
        copying it into the bucket (``mul``), or divides the bucket view in place when
        ``gradient_as_bucket_view`` made the gradient alias it; a registered comm hook gets the
        unscaled copy. Scaling the bucket the same way, before the sum, keeps gradients
        bit-identical to DDP without a hook for any world size (``div_``, as DDP's own Python
        ``allreduce_hook`` does, differs in the last bit for world sizes that are not powers
        of two). The price is one pass over the bucket that DDP fuses into its copy.
        """
        world_size = group.size()
        scale = 1.0 / world_size
        allreduce = group.allreduce
        starts, done = self.comm_starts_ns, _allreduce_done_factory(self)
        clock_ns = self.clock_ns

        def hook(state: Any, bucket: Any) -> Any:
            tensor = bucket.buffer()
            if world_size > 1:
                if divide_in_place:
                    tensor.div_(world_size)
                else:
                    tensor.mul_(scale)
            future = allreduce([tensor]).get_future()
            if self.enabled:
                starts.append(clock_ns())
                return future.then(done)
            return future.then(_first_value)

        hook.__annotations__ = {}
        return hook


def _allreduce_done_factory(state: _AutoState) -> Any:
    """The one completion callback of the timed allreduce (shared by every bucket)."""
    ends, clock_ns = state.comm_ends_ns, state.clock_ns
    append = ends.append

    def done(completed: Any) -> Any:
        append(clock_ns())
        return completed.value()[0]

    return done


def _first_value(completed: Any) -> Any:
    return completed.value()[0]


def install_hooks(
    recorder: StepRecorder,
    model: Any,
    optimizer: Any,
    *,
    comm_hook: Any,
    comm_state: Any,
    time_communication: bool,
    collective_timing: bool,
    state_type: type[_AutoState] = _AutoState,
) -> Instrumentation:
    """Install auto-mode hooks feeding ``recorder`` (the options: ``StepMonitor.instrument``;
    ``state_type``: the hooks' class, ``_auto_device.install_hooks`` picks it).

    Raises:
        ConfigError: ``model`` or ``optimizer`` is not a torch module / optimizer, or
            ``comm_state`` is not a process group where one is needed.
    """
    try:
        import torch
    except ImportError as exc:
        raise ConfigError("instrument() needs torch (pip install 'stepwatch[torch]')") from exc

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    state = state_type(recorder)
    state.engine = acquire_engine()
    pre, post = gates(state, hooks_in_c)
    handles: list[Any] = [
        time_forward(state, model, in_c=True),
        optimizer.register_step_pre_hook(pre),
        optimizer.register_step_post_hook(post),
    ]
    state.phase_codes = phase_codes(torch, model, optimizer)
    recorder.watchers += 1
    communication_timed = False
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and time_communication:
        if comm_hook is None and collective_timing and getattr(model, "_comm_hooks", None):
            logger.warning(
                "the DDP model already has a comm hook and DDP accepts only one: collectives "
                "are not timed one by one, the exposed wait is; pass your hook as "
                "instrument(..., comm_hook=...) instead"
            )
            collective_timing = False
        if comm_state is None:
            comm_state = model.process_group
        elif comm_hook is None and not (
            hasattr(comm_state, "allreduce") and hasattr(comm_state, "size")
        ):
            raise ConfigError(
                "comm_state must be a process group when no comm_hook is given, "
                f"got {type(comm_state).__name__}"
            )
        if comm_hook is not None:
            model.register_comm_hook(comm_state, state.timed_comm_hook(comm_hook))
            communication_timed = True
        elif collective_timing:
            hook = state.timed_allreduce_hook(
                comm_state,
                divide_in_place=bool(getattr(model, "gradient_as_bucket_view", False)),
            )
            model.register_comm_hook(comm_state, hook)
            communication_timed = True
        else:
            last = next((p for p in model.parameters() if p.requires_grad), None)
            if last is not None:
                register: Any = last.register_post_accumulate_grad_hook
                handles.append(register(state.gradient_stamp))
                communication_timed = True
    close_waits(state.engine, state)  # the wait ends when backward() returns (_engine)
    return Instrumentation(state, handles, communication_timed=communication_timed)
