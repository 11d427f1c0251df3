"""Auto mode: forward, backward, optimizer and DDP communication phases from torch hooks.

One line, no change to the training loop::

    monitor.instrument(model, optimizer)

- forward: module forward pre-hook → forward hook of the top-level module (summed when the
  model runs several times per step, e.g. gradient accumulation);
- backward: from the moment the gradient reaches the model's output (a tensor hook on the
  output) to the next ``optimizer.step()`` or forward on the training thread (by then
  ``loss.backward()`` has returned, DDP's allreduce wait included);
- optimizer: ``Optimizer.register_step_pre_hook`` → ``register_step_post_hook``;
- communication: a DDP comm hook that wraps the allreduce (the default one, or the hook you
  pass as ``comm_hook``) and times each bucket from the moment its collective is issued to
  its future's completion — the time in the collective: transfer plus waiting for the peers,
  so the rank that arrives last waits least; the hook's own work before the collective is not
  counted. The phase is the union of those intervals in the step (buckets overlap);
- data: time from the previous step's end to the next forward (auto steps only);
- step boundary: the end of ``optimizer.step()``, unless the loop uses ``monitor.step()``
  itself, in which case the hooks only add phases to those steps.

Numerics are untouched: hooks return ``None`` (no gradient or output is replaced) and the
comm hook returns the inner hook's own tensor.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stepwatch.exporters._monitor import StepMonitor


class Instrumentation:
    """Handle for the hooks installed by :func:`instrument`; :meth:`remove` detaches them.

    Attributes:
        communication_timed: Whether a timing DDP comm hook is installed.
    """

    def __init__(self, state: _AutoState, handles: list[Any], *, communication_timed: bool) -> None:
        self._state = state
        self._handles = handles
        self.communication_timed = communication_timed

    def remove(self) -> None:
        """Remove the module and optimizer hooks; the DDP comm hook becomes a pass-through."""
        self._state.enabled = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class _AutoState:
    """Hook callbacks; they run on the training thread except the comm completion callbacks."""

    def __init__(self, monitor: StepMonitor) -> None:
        self.monitor = monitor
        self.clock = monitor._clock
        self.enabled = True
        self.forward_depth = 0
        self.forward_start_ns = 0
        self.in_backward = False
        self.backward_start_ns = 0
        self.optimizer_start_ns: int | None = None
        self.data_start_ns: int | None = None
        self.comm_lock = threading.Lock()
        self.comm_intervals: list[tuple[int, int]] = []

    def _auto_steps(self) -> bool:
        return not self.monitor._explicit_steps

    def forward_pre(self, module: Any, args: Any) -> None:
        if not self.enabled:
            return
        try:
            now = self.clock.monotonic_ns()
            self._end_backward(now)  # gradient accumulation: the previous micro-batch ended
            if self._auto_steps():
                if self.monitor._step_depth == 0:
                    self.monitor._begin_step(explicit=False)
                if self.data_start_ns is not None:
                    self.monitor._add_phase_ns("data", now - self.data_start_ns)
                    self.data_start_ns = None
            self.forward_depth += 1
            if self.forward_depth == 1:
                self.forward_start_ns = now
        except Exception:
            self.monitor._misuse("auto", "auto-mode forward pre-hook failed", exc_info=True)

    def forward_post(self, module: Any, args: Any, output: Any) -> None:
        if not self.enabled:
            return
        try:
            if self.forward_depth <= 0:
                return
            self.forward_depth -= 1
            if self.forward_depth:
                return
            self.monitor._add_phase_ns("forward", self.clock.monotonic_ns() - self.forward_start_ns)
            tensor = _first_grad_tensor(output)
            if tensor is not None:
                tensor.register_hook(self.backward_start)
        except Exception:
            self.monitor._misuse("auto", "auto-mode forward hook failed", exc_info=True)

    def backward_start(self, grad: Any) -> None:
        # A tensor hook on the model's output: the gradient has reached the model.
        if not self.enabled or self.in_backward:
            return
        try:
            self.in_backward = True
            self.backward_start_ns = self.clock.monotonic_ns()
        except Exception:
            self.in_backward = False
            self.monitor._misuse("auto", "auto-mode backward hook failed", exc_info=True)

    def _end_backward(self, now_ns: int) -> None:
        """Close an open backward phase at the next hook on the training thread.

        ``loss.backward()`` returns (after DDP has waited for its allreduces) before the next
        ``optimizer.step()`` or forward. Ending the phase there, rather than with an autograd
        engine callback, keeps Python out of the autograd engine's final callbacks, which
        measurably slowed DDP steps (about 5% on the CPU/gloo overhead bench).
        """
        if self.in_backward:
            self.in_backward = False
            self.monitor._add_phase_ns("backward", now_ns - self.backward_start_ns)

    def optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.enabled:
            return
        try:
            self.optimizer_start_ns = self.clock.monotonic_ns()
            self._end_backward(self.optimizer_start_ns)
        except Exception:
            self.monitor._misuse("auto", "auto-mode optimizer pre-hook failed", exc_info=True)

    def optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self.enabled:
            return
        try:
            now = self.clock.monotonic_ns()
            monitor = self.monitor
            if self.optimizer_start_ns is not None:
                monitor._add_phase_ns("optimizer", now - self.optimizer_start_ns)
                self.optimizer_start_ns = None
            with self.comm_lock:
                intervals, self.comm_intervals = self.comm_intervals, []
            if intervals:
                monitor._add_phase_ns("communication", _union_ns(intervals))
            if self._auto_steps() and monitor._step_depth > 0:
                monitor._end_step(explicit=False)
                monitor._begin_step(explicit=False)
                self.data_start_ns = self.clock.monotonic_ns()
        except Exception:
            self.monitor._misuse("auto", "auto-mode optimizer hook failed", exc_info=True)

    def timed_comm_hook(self, inner: Any) -> Any:
        def hook(state: Any, bucket: Any) -> Any:
            if not self.enabled:
                return inner(state, bucket)
            future = inner(state, bucket)
            # From the moment the collective is issued: the hook's own work before it (e.g.
            # compression) is not communication, and a rank that reaches the collective late
            # is the one that waits least in it (arrival order, as in ARGUS).
            start_ns = self.clock.monotonic_ns()

            def done(completed: Any) -> Any:
                # Chained with then() (not add_done_callback) so DDP, which waits on the
                # returned future, cannot finish backward before the interval is recorded.
                try:
                    end_ns = self.clock.monotonic_ns()
                    with self.comm_lock:
                        self.comm_intervals.append((start_ns, end_ns))
                except Exception:
                    self.monitor._misuse("auto", "auto-mode comm callback failed")
                return completed.value()  # the inner hook's tensor, unchanged

            return future.then(done)

        # DDP inspects the hook's annotations and accepts only none or the exact runtime types;
        # with postponed annotations these are strings, so present an unannotated hook.
        hook.__annotations__ = {}
        return hook

    def timed_allreduce_hook(self) -> Any:
        """DDP's default allreduce with the timing folded into its one completion callback.

        Same arithmetic as ``default_hooks.allreduce_hook`` (divide by the group size, then
        sum), so gradients are bit-identical to DDP's built-in path; one Python callback per
        bucket instead of two.
        """
        import torch.distributed as dist

        def hook(state: Any, bucket: Any) -> Any:
            group: Any = state if state is not None else dist.group.WORLD
            tensor = bucket.buffer()
            tensor.div_(group.size())
            future = dist.all_reduce(tensor, group=group, async_op=True).get_future()
            start_ns = self.clock.monotonic_ns()
            if not self.enabled:
                return future.then(_first_value)

            def done(completed: Any) -> Any:
                try:
                    end_ns = self.clock.monotonic_ns()
                    with self.comm_lock:
                        self.comm_intervals.append((start_ns, end_ns))
                except Exception:
                    self.monitor._misuse("auto", "auto-mode comm callback failed")
                return completed.value()[0]

            return future.then(done)

        hook.__annotations__ = {}
        return hook


def _first_value(completed: Any) -> Any:
    return completed.value()[0]


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    """Total length of the union of ``[start, end]`` intervals."""
    total = 0
    current_start, current_end = None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None and current_start is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None and current_start is not None:
        total += current_end - current_start
    return total


def _first_grad_tensor(output: Any) -> Any:
    """The first tensor requiring grad in a (nested) forward output, or None."""
    import torch

    if not torch.is_grad_enabled():
        return None
    stack = [output]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                return item
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return None


def instrument(
    monitor: StepMonitor,
    model: Any,
    optimizer: Any,
    *,
    comm_hook: Any = None,
    comm_state: Any = None,
    time_communication: bool = True,
) -> Instrumentation:
    """Install auto-mode hooks on ``model`` and ``optimizer`` (see the module docstring).

    Args:
        monitor: The monitor receiving the phases.
        model: A ``torch.nn.Module`` (a ``DistributedDataParallel`` also gets comm timing).
        optimizer: A ``torch.optim.Optimizer``.
        comm_hook: Your own DDP comm hook ``hook(state, bucket) -> Future``; it is registered
            wrapped by the timing hook (DDP accepts one comm hook, so pass it here instead of
            calling ``register_comm_hook`` yourself). Default: the standard allreduce hook.
        comm_state: State passed to ``comm_hook`` (default: the DDP process group).
        time_communication: Install the timing comm hook on a DDP model. A Python comm hook
            costs more than DDP's built-in C++ allreduce (a Python call per bucket and one
            extra pass over the bucket to divide by the world size, which the built-in path
            fuses into the gradient copy): tens of microseconds per bucket on CPU, noise on
            a GPU step. ``False`` keeps DDP's built-in path and reports no communication.

    Returns:
        A handle whose ``remove()`` detaches the hooks.

    Raises:
        ConfigError: ``model`` or ``optimizer`` is not a torch module / optimizer (raised at
            set-up, before training).
    """
    from stepwatch._errors import ConfigError
    from stepwatch.exporters._monitor import logger

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
    state = _AutoState(monitor)
    handles = [
        model.register_forward_pre_hook(state.forward_pre),
        model.register_forward_hook(state.forward_post),
        optimizer.register_step_pre_hook(state.optimizer_pre),
        optimizer.register_step_post_hook(state.optimizer_post),
    ]
    communication_timed = False
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel) and time_communication:
        if getattr(model, "_comm_hooks", None) and comm_hook is None:
            logger.warning(
                "the DDP model already has a comm hook and DDP accepts only one: communication "
                "is not timed; pass your hook as instrument(..., comm_hook=...) instead"
            )
        else:
            hook = (
                state.timed_allreduce_hook()
                if comm_hook is None
                else state.timed_comm_hook(comm_hook)
            )
            if comm_state is None:
                comm_state = model.process_group
            model.register_comm_hook(comm_state, hook)
            communication_timed = True
    return Instrumentation(state, handles, communication_timed=communication_timed)
