"""StepMonitor: step and phase timing on the training thread, OTLP export on a background thread.

The hot path (``step()``, ``phase()``; in C where built, ``_recorder``) reads a monotonic clock and
appends one finished-step record to a bounded deque: no lock, no SDK call. A daemon export thread
wakes every ``export_interval_s`` (and early for a stalled rank: ``_cadence``), aggregates the
steps finished since the last export (:class:`~stepwatch.exporters.WindowBuilder`) and hands the
window to the OTLP exporter. A window without a finished step says where the rank is (step, phase,
for how long), so a rank stuck inside a step is seen. Nothing raises into the training loop:
misuse and export failures are logged (rate-limited) and counted in :attr:`StepMonitor.stats`.

A monitor is composed of four parts, each resolved from its own arguments by its own module,
as an OpenTelemetry ``MeterProvider`` is of a resource, readers, exporters and views: who the
rank is (``_identity``: the resource), how it times (``_timing``: clock, interval, buffer,
sampling, histogram options), where windows go (``_transport``: the exporter) and what it
reads besides its clock (``_sources``: kernel events, device health, the device timer).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, cast

from stepwatch.core import _schema, settings
from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters._config import ExporterConfig
from stepwatch.exporters._export import Exporter
from stepwatch.exporters._protocols import Clock, DeviceTimer, HealthSource, KernelSource
from stepwatch.exporters._recorder import (
    _NULL_CONTEXT,
    NullPhases,
    StepRecord,
    StepRecorder,
    SystemClock,
    new_recorder,
    sampled_steps,
    window_values,
)
from stepwatch.exporters._sdk_env import sdk_disabled
from stepwatch.exporters._window import Progress
from stepwatch.exporters.auto._auto import NoHooks
from stepwatch.exporters.auto._auto_device import Instrumentation, install_hooks
from stepwatch.exporters.monitor._account import ExportAccount, MonitorStats
from stepwatch.exporters.monitor._cadence import StopEvent, run_exports
from stepwatch.exporters.monitor._identity import rank_resource
from stepwatch.exporters.monitor._sources import Sources, resolve_sources, start_sources
from stepwatch.exporters.monitor._timing import Timing, resolve_timing
from stepwatch.exporters.monitor._transport import Transport, resolve_transport

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData
    from opentelemetry.sdk.resources import Resource

    from stepwatch.exporters._recorder import _NullContext, _PhaseContext, _StepContext

logger = logging.getLogger("stepwatch.exporters")

DEFAULT_EXPORT_INTERVAL_S: Final = cast(float, settings.METRIC_EXPORT_INTERVAL_S.default)
AT_EXIT_TIMEOUT_S: Final = 2.0
DEFAULT_CLOSE_TIMEOUT_S: Final = 2.0
#: What ``close()`` keeps for cutting short an export still in flight at its deadline.
_INTERRUPT_MARGIN_S: Final = 0.2
_LOG_INTERVAL_S: Final = 60.0
_YIELD_EVERY_STEPS: Final = 16


class StepMonitor:
    """Times training steps and their phases on one rank and exports them over OTLP.

    Usage::

        monitor = StepMonitor(job_id="run-42", rank=rank, world_size=world_size)
        for batch in loader:
            with monitor.step():
                with monitor.phase("forward"):
                    ...
        monitor.close()

    ``phase()`` outside a step is attributed to the next step (``with monitor.phase("data")``
    around the loader's ``next()`` works). Phases may nest; each reports its own wall time.

    Who the rank is: each of ``job_id``, ``rank``, ``world_size`` and ``local_rank`` is the
    argument when given, else what torchrun set (``TORCHELASTIC_RUN_ID``, ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``); a process with neither rank nor world size is rank 0 of 1.

    OTel SDK variables (``_sdk_env``, docs/exporters.md): ``OTEL_SDK_DISABLED=true`` makes it
    a no-op that never raises; ``OTEL_SERVICE_NAME``/``OTEL_RESOURCE_ATTRIBUTES`` add to the
    resource (arguments win), which always has a ``service.instance.id``;
    ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE=cumulative`` sends running totals.

    Args:
        job_id: The training run (``stepwatch.job.id``); else ``TORCHELASTIC_RUN_ID``.
        rank: Global rank; else ``RANK``.
        world_size: Number of ranks; else ``WORLD_SIZE``.
        host_name: Node name; else ``host.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, else
            ``socket.gethostname()``.
        local_rank: Rank within the node; else ``LOCAL_RANK``.
        dp_rank: Data-parallel coordinate.
        tp_rank: Tensor-parallel coordinate.
        pp_rank: Pipeline-parallel coordinate.
        service_name: ``service.name``; else ``OTEL_SERVICE_NAME``, else ``service.name`` in
            ``OTEL_RESOURCE_ATTRIBUTES``, else ``stepwatch``.
        endpoint: OTLP endpoint (else ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``,
            ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``http://localhost:4318``/``:4317``).
        protocol: ``http/protobuf`` (default) or ``grpc`` (else the ``..._PROTOCOL`` variables;
            ``http/json`` is sent as ``http/protobuf`` with one warning).
        headers: Request headers (else the ``..._HEADERS`` variables).
        compression: ``none``, ``gzip`` or ``deflate`` (else the ``..._COMPRESSION`` variables).
        timeout_s: Bound on one export, retries included (else ``..._TIMEOUT`` in ms; 10 s).
        export_interval_s: Seconds between exports (else ``OTEL_METRIC_EXPORT_INTERVAL`` in ms;
            10 s). Each export carries every whole step finished since the previous one.
        exporter: Any :class:`Exporter` (every SDK ``MetricExporter`` is one); replaces the
            OTLP exporter built from the settings above.
        kernel_source: Kernel events to add to each window.
        health: GPU health (NVML) sampled once per window and sent with it: a
            :class:`HealthSource` such as ``stepwatch.exporters.kernels.HealthSampler``;
            ``None`` (default) builds one when ``pynvml`` is installed (it logs once and goes
            quiet on a machine without a GPU); ``False`` turns it off.
        clock: Time source (tests inject a fake).
        device_timer: ``"auto"`` (CUDA events when torch is imported and CUDA is available,
            else the host clock), ``"cuda"``, ``"cpu"`` or a :class:`DeviceTimer`. With a
            device timer, step, ``phase()`` and auto-mode phase durations are device time
            (``_auto_device``) and a window holds only steps the device has finished.
        buffer_steps: Steps held for export; more are dropped, counted (4,096 per s of interval).
        max_scale: Finest exponential-histogram scale.
        max_size: Most buckets per histogram.
        histogram_buckets: ``exponential`` (default) or ``explicit`` (bounds a Collector's
            influxdb exporter keeps; docs/storage.md); else ``STEPWATCH_HISTOGRAM_BUCKETS``.
        phase_sampling: Steps whose phases auto mode times (docs/exporters.md): ``"auto"``
            (default) >= 50 ms apart, ``1`` all, ``k`` 1 in ``k``; the wait: every step.
        start: Start the export thread now (``False``: call :meth:`export_now` yourself).

    Raises:
        ConfigError: An argument is invalid, a TLS file is missing, or the rank's identity
            is missing or does not parse (the message names it). Raised at construction,
            before training starts; nothing raises later. A bad OTel variable only warns.
            Nothing raises with ``OTEL_SDK_DISABLED=true``.
    """

    def __init__(
        self,
        *,
        job_id: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        host_name: str | None = None,
        local_rank: int | None = None,
        dp_rank: int | None = None,
        tp_rank: int | None = None,
        pp_rank: int | None = None,
        service_name: str | None = None,
        endpoint: str | None = None,
        protocol: str | None = None,
        headers: Mapping[str, str] | None = None,
        compression: str | None = None,
        timeout_s: float | None = None,
        export_interval_s: float | None = None,
        exporter: Exporter | None = None,
        kernel_source: KernelSource | None = None,
        health: HealthSource | bool | None = None,
        clock: Clock | None = None,
        device_timer: DeviceTimer | str | None = "auto",
        buffer_steps: int | None = None,
        max_scale: int = 5,
        max_size: int = 160,
        histogram_buckets: str | None = None,
        phase_sampling: int | str = "auto",
        start: bool = True,
    ) -> None:
        environ = os.environ
        self._disabled = sdk_disabled(environ)
        if self._disabled:
            self._init_disabled()
            return
        resource = rank_resource(
            environ,
            job_id=job_id,
            rank=rank,
            world_size=world_size,
            host_name=host_name,
            local_rank=local_rank,
            dp_rank=dp_rank,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            service_name=service_name,
        )
        timing = resolve_timing(
            environ,
            clock=clock,
            export_interval_s=export_interval_s,
            buffer_steps=buffer_steps,
            phase_sampling=phase_sampling,
            histogram_buckets=histogram_buckets,
            max_scale=max_scale,
            max_size=max_size,
        )
        transport = resolve_transport(
            exporter,
            endpoint=endpoint,
            protocol=protocol,
            headers=headers,
            compression=compression,
            timeout_s=timeout_s,
        )
        sources = resolve_sources(
            resource, kernel_source=kernel_source, health=health, device_timer=device_timer
        )
        self._compose(resource, timing, transport, start_sources(sources))
        if start:
            self._start_export_thread(int(cast(int, resource.attributes[_schema.RANK])))

    def _compose(
        self, resource: Resource, timing: Timing, transport: Transport, sources: Sources
    ) -> None:
        """The monitor's state, from its parts: the training thread's, then the export's."""
        self._timing = timing
        self._transport = transport
        self._sources = sources
        self._builder = timing.window_builder(resource)
        self._log = RateLimitedLog(logger, _LOG_INTERVAL_S)
        self._mono_anchor_ns = timing.clock.monotonic_ns()
        self._wall_anchor_ns = timing.clock.time_ns()

        # Training-thread state: the recorder (handed to auto-mode hooks too), its contexts.
        self._unsampled_carry = 0  # the steps waiting for a sampled one
        self._recorder = new_recorder(
            clock=timing.clock,
            device_timer=sources.device_timer,
            kernel_source=sources.kernels,
            buffer_steps=timing.buffer_steps,
            log=self._log,
            sampler=timing.sampler,
        )
        self._buffer = self._recorder.buffer
        self._step_context = self._recorder.step_context
        self._phase_contexts = self._recorder.phase_contexts
        vars(self).update(self._recorder.monitor_calls())  # step(), phase() in C where built

        # Export-thread state.
        self._export_lock = threading.Lock()
        self._account = ExportAccount()
        self._last_window_end_ns = self._wall_anchor_ns
        # End (monotonic ns) of the last step that left the buffer: the rank's last progress.
        self._last_progress_ns = self._mono_anchor_ns
        self._stop = StopEvent()
        self._close_deadline = 0.0
        self._closed = False
        self._interrupted = False  # close() cut an export short
        self._instrumentations: list[Instrumentation] = []
        self._thread: threading.Thread | None = None

    def _start_export_thread(self, rank: int) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"stepwatch-export-r{rank}", daemon=True
        )
        self._thread.start()
        # A monitor nobody closed still flushes its last steps at interpreter exit.
        atexit.register(self._close_at_exit)

    def _init_disabled(self) -> None:
        """``OTEL_SDK_DISABLED=true``: null contexts, no exporter, no thread, no validation."""
        self._log = RateLimitedLog(logger, _LOG_INTERVAL_S)
        self._recorder = StepRecorder(
            clock=SystemClock(),
            device_timer=None,
            kernel_source=None,
            buffer_steps=1,
            log=self._log,
        )
        self._step_context = _NULL_CONTEXT  # type: ignore[assignment]
        self._phase_contexts = NullPhases()  # type: ignore[assignment]
        self._account = ExportAccount()
        self._closed = True  # close() has nothing to do
        logger.info("OTEL_SDK_DISABLED=true: this StepMonitor times and exports nothing")

    # ------------------------------------------------------------------ hot path
    def step(self) -> _StepContext:
        """Context manager around one training step (reusable; costs two clock reads)."""
        return self._step_context

    def phase(self, name: str) -> _PhaseContext | _NullContext:
        """Context manager timing one phase (``data``, ``forward``, ... or your own name).

        A name that is not a non-empty string of at most 64 characters is ignored and counted
        in ``stats.misuse``; more than 256 distinct names fold into ``other``.
        """
        context = self._phase_contexts.get(name) if type(name) is str else None
        if context is not None:
            return context
        return self._recorder.new_phase_context(name)

    # ------------------------------------------------------------------ auto mode
    def instrument(
        self,
        model: Any,
        optimizer: Any,
        *,
        comm_hook: Any = None,
        comm_state: Any = None,
        time_communication: bool = True,
        collective_timing: bool = False,
    ) -> Instrumentation:
        """Time forward, backward, optimizer and DDP communication with hooks (no code changes).

        The phases and where each starts and ends are in the ``stepwatch.exporters.auto._auto``
        module docstring. :meth:`close` removes the hooks. Also callable as a function,
        ``stepwatch.exporters.instrument(monitor, model, optimizer, ...)``.

        Args:
            model: A ``torch.nn.Module`` (a ``DistributedDataParallel`` also gets comm timing).
            optimizer: A ``torch.optim.Optimizer``.
            comm_hook: Your own DDP comm hook ``hook(state, bucket) -> Future``; it is
                registered wrapped by the timing hook (DDP accepts one comm hook, so pass it
                here instead of calling ``register_comm_hook`` yourself). Default: the
                standard allreduce hook.
            comm_state: State passed to ``comm_hook`` (default: the DDP process group).
            time_communication: Time a DDP model's communication (see the module docstring).
                ``False`` reports no communication phase.
            collective_timing: Without ``comm_hook``, time every bucket's collective from
                issue to completion with a timed copy of DDP's allreduce as a Python comm hook,
                instead of the exposed wait with no comm hook. Any Python comm hook costs more
                than DDP's built-in C++ allreduce: DDP calls into Python per bucket, the
                completion callback takes the GIL on the comm library's thread, and averaging
                the bucket is one more pass over the gradients (``bench/overhead.py --mode
                collective`` measures it): noise on a GPU, several percent of a CPU step.

        Returns:
            A handle whose ``remove()`` detaches the hooks.

        Raises:
            ConfigError: ``model`` or ``optimizer`` is not a torch module / optimizer (raised at
                set-up, before training). Not raised when the SDK is disabled: no hooks then.
        """
        if self._disabled:
            return cast(Instrumentation, NoHooks())
        instrumentation = install_hooks(
            self._recorder,
            model,
            optimizer,
            comm_hook=comm_hook,
            comm_state=comm_state,
            time_communication=time_communication,
            collective_timing=collective_timing,
        )
        self._instrumentations.append(instrumentation)
        return instrumentation

    # ------------------------------------------------------------------ export
    def _wall_ns(self, monotonic_ns: int) -> int:
        return self._builder.stamp(self._wall_anchor_ns + (monotonic_ns - self._mono_anchor_ns))

    def _run(self) -> None:
        run_exports(
            self._timing.interval_s, self._stop, self._recorder, self._buffer, self.export_now
        )
        self._final_flush()

    def _final_flush(self) -> None:
        """Last export at close: first give the device until the close deadline to finish."""
        timer = self._sources.device_timer
        if timer is not None:
            try:
                while self._buffer and time.monotonic() < self._close_deadline:
                    device = self._buffer[-1][4]
                    if device is None or timer.ready(device[1]):
                        break
                    time.sleep(0.001)
            except Exception:
                self._log.warning("device-ready", "device timer ready() raised", exc_info=True)
        remaining_s = self._close_deadline - time.monotonic() - _INTERRUPT_MARGIN_S / 2
        self._export(timeout_s=max(remaining_s, 0.001), final=True)

    def export_now(self, *, timeout_s: float | None = None) -> bool:
        """Export every step finished so far as one window (the export thread calls this).

        Args:
            timeout_s: Bound for this export (default: the exporter timeout).

        A window that holds no finished step carries where the rank is instead (its step,
        phase and time without progress: docs/schema.md), so every call sends one.

        Returns:
            True when a window was exported; False when the export failed (counted) or the
            SDK is disabled. Never raises.
        """
        if self._disabled:
            return False
        return self._export(timeout_s=timeout_s, final=False)

    def _export(self, *, timeout_s: float | None, final: bool) -> bool:
        with self._export_lock:
            started = self._account.cpu.begin()  # its CPU time, charged to the kernel source
            try:
                return self._export_locked(timeout_s, final=final)
            except Exception:
                self._account.export_failures += 1
                self._account.settle(delivered=False, reason="build_failed")
                self._log.warning(
                    "export-crash", "building or exporting a window failed", exc_info=True
                )
                return False
            finally:
                thread = threading.current_thread() is self._thread
                self._account.cpu.end(started, self._sources.kernels, export_thread=thread)

    def _export_locked(self, timeout_s: float | None, *, final: bool) -> bool:
        """One window: the steps the device has finished, the kernels, or where the rank is."""
        records = self._take_finished_steps()
        source = self._sources.kernels
        kernels = self._account.cpu.drain(source, self._log) if source is not None else None
        builder = self._builder
        if records:
            self._add_steps(records)
        if kernels is not None:
            builder.add_kernels(kernels)
        start_unix_nano, end_unix_nano = self._window_bounds(records)
        end_unix_nano = builder.stamp(end_unix_nano, after=self._last_window_end_ns)
        if final:
            builder.mark_closed()
        metrics = builder.build(start_unix_nano=start_unix_nano, end_unix_nano=end_unix_nano)
        if metrics is None:
            return False
        metrics = self._sources.add_health(metrics, start_unix_nano, end_unix_nano, self._log)
        self._last_window_end_ns = max(end_unix_nano, self._last_window_end_ns)
        return self._send(metrics, len(records), timeout_s)

    def _take_finished_steps(self) -> list[StepRecord]:
        """The buffered steps the device has finished, oldest first (all on the host clock)."""
        records: list[StepRecord] = []
        buffer = self._buffer
        timer = self._sources.device_timer
        account = self._account
        with account.lock:  # steps leave the buffer and enter the window in one move
            while buffer:
                device = buffer[0][4]
                if device is not None and timer is not None and not timer.ready(device[1]):
                    break  # the device is still running this step: it goes in a later window
                records.append(buffer.popleft())
            account.steps_in_flight = len(records)
        return records

    def _add_steps(self, records: list[StepRecord]) -> None:
        """Add the durations and phases of ``records`` to the window (sampled phases weighted)."""
        carry = self._unsampled_carry
        durations, phases, weighted, self._unsampled_carry = window_values(
            records, self._sources.device_timer, _YIELD_EVERY_STEPS, carry
        )
        sampler, auto_mode = self._timing.sampler, self._recorder.watchers > 0
        sampled = sampled_steps(records, durations, carry, sampler) if weighted else None
        self._builder.add_steps(
            last_step_index=max(record[0] for record in records),
            durations_s=durations,
            phases_s=phases,
            weighted_phases_s=weighted,
            sampled_steps_s=sampled,
            sampling=sampled is not None or (auto_mode and sampler.stride != 1),
        )
        sampler.observe(durations)

    def _window_bounds(self, records: list[StepRecord]) -> tuple[int, int]:
        """The window's start and end (Unix ns): its steps', or, with none, from the previous
        window's end to now, the window then saying where the rank is."""
        builder = self._builder
        if records:
            self._last_progress_ns = records[-1][2]
            if self._account.windows_built == 0:  # the first window says it reports progress
                builder.set_progress(Progress(step_index=records[-1][0] + 1, step_elapsed_s=0.0))
            return self._wall_ns(records[0][1]), self._wall_ns(records[-1][2])
        # No step finished: say where the rank is (a rank stuck in a step still reports).
        now_ns = self._timing.clock.monotonic_ns()
        progress = where(self._recorder, self._instrumentations, now_ns, self._last_progress_ns)
        builder.set_progress(progress)
        return self._last_window_end_ns, self._wall_ns(now_ns)

    def _send(self, metrics: MetricsData, steps: int, timeout_s: float | None) -> bool:
        """Hand the window to the exporter and settle the account; True when it was taken."""
        account = self._account
        transport = self._transport
        with account.lock:
            account.windows_built += 1
            account.window_in_flight = True
        timeout = transport.timeout_s if timeout_s is None else timeout_s
        if transport.send(metrics, timeout, self._log):
            account.settle(delivered=True)
            return True
        account.export_failures += 1
        account.settle(delivered=False, reason="closed" if self._interrupted else "export_failed")
        if transport.reconnect_due and not self._stop.is_set():
            transport.reconnect(self._log)
        self._log.warning(
            "export-failed", "export of a %d-step window failed; steps dropped", steps
        )
        return False

    @property
    def stats(self) -> MonitorStats:
        """Counters since construction; they add up (``_account``). Never raises."""
        recorder = self._recorder
        if self._disabled:  # all zero
            zero = dict.fromkeys(
                ("steps_recorded", "buffer_steps", "buffer_dropped", "misuse", "overflowed"), 0
            )
            return self._account.snapshot(rejected=0, **zero)
        return self._account.snapshot(
            steps_recorded=recorder.steps_recorded,
            buffer_steps=len(self._buffer),
            buffer_dropped=recorder.buffer_dropped,
            misuse=recorder.misuse_count,
            overflowed=self._builder.overflow_observations,
            rejected=self._builder.rejected_observations,
        )

    @property
    def phase_sample_stride(self) -> int:
        """Auto mode times phases on about 1 step in this many (``phase_sampling``)."""
        return 1 if self._disabled else self._timing.sampler.stride

    @property
    def export_interval_s(self) -> float:
        """Seconds between exports."""
        return DEFAULT_EXPORT_INTERVAL_S if self._disabled else self._timing.interval_s

    @property
    def exporter_config(self) -> ExporterConfig | None:
        """The OTLP settings the exporter was built from; None for an exporter passed in."""
        return None if self._disabled else self._transport.config

    def close(self, *, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Remove hooks, flush the last window and shut the exporter down, within ``timeout_s``.

        Returns within ``timeout_s`` (2 s by default) whatever the endpoint does: an export
        still in flight near the deadline is cut short (the OTLP/HTTP exporter's socket is shut
        down). The last window says the monitor closed (``stepwatch.monitor.closed``), so the
        rank's silence afterwards is not taken for a hang. Steps and windows still unexported
        when the time is up count as dropped with reason ``closed``. Idempotent; never raises.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        deadline = time.monotonic() + max(timeout_s, 0.0)
        self._close_deadline = deadline
        for instrumentation in self._instrumentations:
            try:
                instrumentation.remove()
            except Exception:
                logger.warning("removing auto-mode hooks failed", exc_info=True)
        try:
            self._stop.set()
            thread = self._thread
            if thread is not None:
                thread.join(max(deadline - time.monotonic() - _INTERRUPT_MARGIN_S, 0.0))
                if thread.is_alive():
                    # An export is still in flight (a black-hole endpoint): cut it short.
                    self._interrupted = True
                    self._shutdown_exporter(deadline)
                    thread.join(max(deadline - time.monotonic(), 0.0))
                if thread.is_alive():
                    logger.warning("stepwatch export thread still busy after %.1f s", timeout_s)
            else:
                self._final_flush()
            if thread is None or not thread.is_alive():
                with self._account.lock:
                    self._account.drop_steps("closed", len(self._buffer))
                    self._buffer.clear()
                self._shutdown_exporter(deadline)
            if self._sources.kernels is not None:
                self._sources.kernels.close()
        except Exception:
            logger.warning("closing the stepwatch monitor failed", exc_info=True)

    def _shutdown_exporter(self, deadline: float) -> None:
        remaining_ms = max(deadline - time.monotonic(), 0.001) * 1000.0
        try:
            self._transport.exporter.shutdown(timeout_millis=remaining_ms)
        except Exception:
            logger.warning("shutting the stepwatch exporter down failed", exc_info=True)

    def _close_at_exit(self) -> None:
        self.close(timeout_s=AT_EXIT_TIMEOUT_S)

    def __enter__(self) -> StepMonitor:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        self.close()


#: ``instrument(monitor, model, optimizer, ...)``: :meth:`StepMonitor.instrument` as a function.
instrument = StepMonitor.instrument


def where(
    recorder: StepRecorder, instrumentations: Iterable[Any], now_ns: int, last_progress_ns: int
) -> Progress:
    """Where the rank is now, from what the training thread recorded (export thread).

    The innermost ``phase()`` open or the auto-mode phase with the latest start (each
    instrumentation's ``open_phase()``: the stack, in a step whose phases are not timed);
    ``last_progress_ns`` is the end of the last step that left the buffer.
    """
    phase = recorder.open_phase()
    for instrumentation in instrumentations:
        auto = instrumentation.open_phase()
        if auto is not None and (phase is None or auto[1] >= phase[1]):
            phase = auto
    return Progress(
        step_index=recorder.step_index,
        step_elapsed_s=max(now_ns - last_progress_ns, 0) * 1e-9,
        phase=None if phase is None else phase[0],
        phase_elapsed_s=None if phase is None else max(now_ns - phase[1], 0) * 1e-9,
    )
