"""StepMonitor: step and phase timing on the training thread, OTLP export on a background thread.

The hot path (``step()``, ``phase()``) only reads a monotonic clock and appends one finished-step
record to a bounded deque: no lock held, no SDK call, no allocation beyond the record. A daemon
export thread wakes every ``export_interval_s``, takes every whole step finished since the last
export, aggregates them with :class:`~stepwatch.exporters.WindowBuilder` and hands the window to
the OTLP exporter. Nothing raises into the training loop: misuse and export failures are
logged (rate-limited) and counted in :attr:`StepMonitor.stats`.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final, Protocol, cast

from stepwatch.core import settings
from stepwatch.core._errors import ConfigError
from stepwatch.core._ratelog import RateLimitedLog
from stepwatch.exporters._auto import Instrumentation, install_hooks
from stepwatch.exporters._config import DEFAULT_TIMEOUT_S, ExporterConfig, resolve_exporter_config
from stepwatch.exporters._device import DeviceTimer, resolve_device_timer
from stepwatch.exporters._export import Exporter, create_exporter
from stepwatch.exporters._recorder import Clock, StepRecord, StepRecorder, SystemClock
from stepwatch.exporters._window import KernelSource, KernelWindow, WindowBuilder, build_resource
from stepwatch.exporters.kernels._nvml import HealthSampler

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData
    from opentelemetry.sdk.resources import Resource

    from stepwatch.exporters._recorder import _NullContext, _PhaseContext, _StepContext

logger = logging.getLogger("stepwatch.exporters")

DEFAULT_EXPORT_INTERVAL_S: Final = cast(float, settings.METRIC_EXPORT_INTERVAL_S.default)
DEFAULT_BUFFER_STEPS: Final = 4096
RECONNECT_AFTER_FAILURES: Final = 2
AT_EXIT_TIMEOUT_S: Final = 2.0
_LOG_INTERVAL_S: Final = 60.0
_YIELD_EVERY_STEPS: Final = 16


@dataclasses.dataclass(frozen=True)
class MonitorStats:
    """Counters of one monitor since it was built.

    Attributes:
        steps_recorded: Steps finished and put in the buffer.
        steps_exported: Steps delivered in a successful export.
        steps_dropped: Steps lost: buffer full, or their window failed to export.
        windows_exported: Successful exports.
        export_failures: Exports that failed (exporter returned failure or raised).
        misuse: Calls ignored for bad usage (bad phase name, nested or unbalanced step).
        observations_overflowed: Observations folded into ``other`` by the series caps.
        observations_rejected: Durations refused as negative, NaN or infinite.
    """

    steps_recorded: int
    steps_exported: int
    steps_dropped: int
    windows_exported: int
    export_failures: int
    misuse: int
    observations_overflowed: int
    observations_rejected: int


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

    Args:
        job_id: The training run (``stepwatch.job.id``).
        rank: Global rank.
        world_size: Number of ranks.
        host_name: Node name; ``socket.gethostname()`` when omitted.
        local_rank: Rank within the node.
        dp_rank: Data-parallel coordinate.
        tp_rank: Tensor-parallel coordinate.
        pp_rank: Pipeline-parallel coordinate.
        service_name: ``service.name`` resource attribute.
        endpoint: OTLP endpoint (else ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``,
            ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``http://localhost:4318``/``:4317``).
        protocol: ``http/protobuf`` (default) or ``grpc`` (else the ``..._PROTOCOL`` variables).
        headers: Request headers (else the ``..._HEADERS`` variables).
        compression: ``none``, ``gzip`` or ``deflate`` (else the ``..._COMPRESSION`` variables).
        timeout_s: Bound on one export, retries included (else ``..._TIMEOUT`` in ms; 10 s).
        export_interval_s: Seconds between exports (else ``OTEL_METRIC_EXPORT_INTERVAL`` in ms;
            1 s). Each export carries every whole step finished since the previous one.
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
            device timer, ``step()`` and ``phase()`` durations are device time and a window
            holds only steps the device has finished; auto-mode hooks stay host-timed.
        buffer_steps: Most finished steps waiting for export; more are dropped and counted.
        max_scale: Finest exponential-histogram scale.
        max_size: Most buckets per histogram.
        start: Start the export thread now (``False``: call :meth:`export_now` yourself).

    Raises:
        ConfigError: A setting is invalid (the message names it). Raised at construction,
            before training starts; nothing raises later.
    """

    def __init__(
        self,
        *,
        job_id: str,
        rank: int,
        world_size: int,
        host_name: str | None = None,
        local_rank: int | None = None,
        dp_rank: int | None = None,
        tp_rank: int | None = None,
        pp_rank: int | None = None,
        service_name: str = "stepwatch",
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
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        max_scale: int = 5,
        max_size: int = 160,
        start: bool = True,
    ) -> None:
        resource = build_resource(
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
        self._interval_s = _resolve_interval(export_interval_s)
        if isinstance(buffer_steps, bool) or not isinstance(buffer_steps, int) or buffer_steps < 1:
            raise ConfigError(f"buffer_steps must be a positive integer, got {buffer_steps!r}")
        self.exporter_config: ExporterConfig | None = None
        if exporter is None:
            self.exporter_config = resolve_exporter_config(
                endpoint=endpoint,
                protocol=protocol,
                headers=headers,
                compression=compression,
                timeout_s=timeout_s,
            )
            exporter = create_exporter(self.exporter_config)
            self._export_timeout_s = self.exporter_config.timeout_s
        else:
            if timeout_s is not None and not timeout_s > 0:
                raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
            self._export_timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self._exporter: Exporter = exporter
        self._builder = WindowBuilder(resource, max_scale=max_scale, max_size=max_size)
        self._kernel_source = kernel_source
        self._health = _resolve_health(health, resource)
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._device_timer = resolve_device_timer(device_timer)
        self._mono_anchor_ns = self._clock.monotonic_ns()
        self._wall_anchor_ns = self._clock.time_ns()
        self._log = RateLimitedLog(logger, _LOG_INTERVAL_S)

        # Training-thread state: the recorder (handed to auto-mode hooks too). step() and
        # phase() return its contexts with no call in between.
        self._recorder = StepRecorder(
            clock=self._clock,
            device_timer=self._device_timer,
            kernel_source=kernel_source,
            buffer_steps=buffer_steps,
            log=self._log,
        )
        self._buffer = self._recorder.buffer
        self._step_context = self._recorder.step_context
        self._phase_contexts = self._recorder.phase_contexts

        # Export-thread state.
        self._export_lock = threading.Lock()
        self._steps_exported = 0
        self._export_dropped = 0
        self._windows_exported = 0
        self._export_failures = 0
        self._consecutive_failures = 0
        self._last_window_end_ns = self._wall_anchor_ns
        self._stop = threading.Event()
        self._close_deadline = 0.0
        self._closed = False
        self._instrumentations: list[Instrumentation] = []
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(
                target=self._run, name=f"stepwatch-export-r{rank}", daemon=True
            )
            self._thread.start()
            # A monitor nobody closed still flushes its last steps at interpreter exit.
            atexit.register(self._close_at_exit)

    # ------------------------------------------------------------------ hot path
    def step(self) -> _StepContext:
        """Context manager around one training step (reusable; costs two clock reads)."""
        return self._step_context

    def phase(self, name: str) -> _PhaseContext | _NullContext:
        """Context manager timing one phase (``data``, ``forward``, ... or your own name).

        A name that is not a non-empty string of at most 64 characters is ignored and counted
        in ``stats.misuse``; more than 256 distinct names fold into ``other``.
        """
        context = self._phase_contexts.get(name)
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

        The phases and where each starts and ends are in the ``stepwatch.exporters._auto``
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
                set-up, before training).
        """
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
    def _with_health(
        self, metrics: MetricsData, start_unix_nano: int, end_unix_nano: int
    ) -> MetricsData:
        """``metrics`` plus this window's device-health scope (one request per window)."""
        from opentelemetry.sdk.metrics.export import MetricsData, ResourceMetrics

        health = self._health
        try:
            if health is None:
                return metrics
            health.sample()
            extra = health.build(start_unix_nano=start_unix_nano, end_unix_nano=end_unix_nano)
        except Exception:
            self._log.warning("health", "device-health sampling raised", exc_info=True)
            return metrics
        if extra is None or not extra.resource_metrics:
            return metrics
        window = metrics.resource_metrics[0]
        scopes = [*window.scope_metrics]
        for resource_metrics in extra.resource_metrics:
            scopes.extend(resource_metrics.scope_metrics)
        return MetricsData(
            resource_metrics=[
                ResourceMetrics(
                    resource=window.resource, scope_metrics=scopes, schema_url=window.schema_url
                )
            ]
        )

    def _wall_ns(self, monotonic_ns: int) -> int:
        return self._wall_anchor_ns + (monotonic_ns - self._mono_anchor_ns)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.export_now()
        self._final_flush()

    def _final_flush(self) -> None:
        """Last export at close: first give the device until the close deadline to finish."""
        timer = self._device_timer
        if timer is not None:
            try:
                while self._buffer and time.monotonic() < self._close_deadline:
                    device = self._buffer[-1][4]
                    if device is None or timer.ready(device[1]):
                        break
                    time.sleep(0.001)
            except Exception:
                self._log.warning("device-ready", "device timer ready() raised", exc_info=True)
        self.export_now(timeout_s=max(self._close_deadline - time.monotonic(), 0.001))

    def export_now(self, *, timeout_s: float | None = None) -> bool:
        """Export every step finished so far as one window (the export thread calls this).

        Args:
            timeout_s: Bound for this export (default: the exporter timeout).

        Returns:
            True when a window was exported; False when there was nothing to export or the
            export failed (counted). Never raises.
        """
        with self._export_lock:
            try:
                return self._export_locked(timeout_s)
            except Exception:
                self._export_failures += 1
                self._log.warning(
                    "export-crash", "building or exporting a window failed", exc_info=True
                )
                return False

    def _export_locked(self, timeout_s: float | None) -> bool:
        records: list[StepRecord] = []
        buffer = self._buffer
        timer = self._device_timer
        while buffer:
            device = buffer[0][4]
            if device is not None and timer is not None and not timer.ready(device[1]):
                break  # the device is still running this step: it goes in a later window
            records.append(buffer.popleft())
        kernels: KernelWindow | None = None
        if self._kernel_source is not None:
            try:
                kernels = self._kernel_source.drain()
            except Exception:
                self._log.warning("kernel-drain", "kernel source drain() raised", exc_info=True)
        if not records and (
            kernels is None or not (kernels.durations_s or kernels.idle_durations_s)
        ):
            return False
        builder = self._builder
        for position, (index, start_ns, end_ns, phases, device) in enumerate(records):
            if position % _YIELD_EVERY_STEPS == _YIELD_EVERY_STEPS - 1:
                # Release the GIL now and then: the training thread (and DDP's comm-hook
                # callbacks) must never wait a whole switch interval (5 ms) for this thread.
                time.sleep(0)
            duration_s = (end_ns - start_ns) * 1e-9
            phases_s = {name: ns * 1e-9 for name, ns in phases.items()}
            if device is not None and timer is not None:
                duration_s = timer.elapsed_s(device[0], device[1])
                for name, intervals in device[2].items():
                    phases_s[name] = sum(timer.elapsed_s(a, b) for a, b in intervals)
            builder.add_step(step_index=index, duration_s=duration_s, phases_s=phases_s)
        if kernels is not None:
            builder.add_kernels(kernels)
        if records:
            start_unix_nano = self._wall_ns(records[0][1])
            end_unix_nano = self._wall_ns(records[-1][2])
        else:
            start_unix_nano = self._last_window_end_ns
            end_unix_nano = self._wall_ns(self._clock.monotonic_ns())
        metrics = builder.build(start_unix_nano=start_unix_nano, end_unix_nano=end_unix_nano)
        if metrics is None:
            return False
        if self._health is not None:
            metrics = self._with_health(metrics, start_unix_nano, end_unix_nano)
        self._last_window_end_ns = end_unix_nano
        timeout = self._export_timeout_s if timeout_s is None else timeout_s
        from opentelemetry.sdk.metrics.export import MetricExportResult

        try:
            result = self._exporter.export(metrics, timeout_millis=timeout * 1000.0)
        except Exception:
            result = MetricExportResult.FAILURE
            self._log.warning("export-raise", "the metric exporter raised", exc_info=True)
        if result is MetricExportResult.SUCCESS:
            self._windows_exported += 1
            self._steps_exported += len(records)
            self._consecutive_failures = 0
            return True
        self._export_failures += 1
        self._consecutive_failures += 1
        if self._consecutive_failures % RECONNECT_AFTER_FAILURES == 0:
            self._reconnect()
        self._export_dropped += len(records)
        self._log.warning(
            "export-failed", "export of a %d-step window failed; steps dropped", len(records)
        )
        return False

    def _reconnect(self) -> None:
        """Replace an exporter built from settings by a fresh one (new connections).

        A kept-alive connection can outlive the receiver it was opened to (a restarted
        bridge, a load balancer that moved the backend) and fail every retry; a new exporter
        opens new connections. Injected exporters are left alone.
        """
        if self.exporter_config is None:
            return
        try:
            self._exporter.shutdown(timeout_millis=100.0)
        except Exception:
            self._log.warning("reconnect", "shutting down the old exporter failed", exc_info=True)
        try:
            self._exporter = create_exporter(self.exporter_config)
        except Exception:
            self._log.warning("reconnect", "re-creating the exporter failed", exc_info=True)

    @property
    def stats(self) -> MonitorStats:
        """Counters since construction (a consistent-enough snapshot; never raises)."""
        return MonitorStats(
            steps_recorded=self._recorder.steps_recorded,
            steps_exported=self._steps_exported,
            steps_dropped=self._recorder.buffer_dropped + self._export_dropped,
            windows_exported=self._windows_exported,
            export_failures=self._export_failures,
            misuse=self._recorder.misuse_count,
            observations_overflowed=self._builder.overflow_observations,
            observations_rejected=self._builder.rejected_observations,
        )

    @property
    def export_interval_s(self) -> float:
        """Seconds between exports."""
        return self._interval_s

    def close(self, *, timeout_s: float = 5.0) -> None:
        """Remove hooks, flush the last window and shut the exporter down, within ``timeout_s``.

        Idempotent; never raises. Steps still unexported when the time is up count as dropped.
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
            if self._thread is not None:
                self._thread.join(max(deadline - time.monotonic(), 0.0))
                if self._thread.is_alive():
                    logger.warning("stepwatch export thread still busy after %.1f s", timeout_s)
            else:
                self._final_flush()
            if self._thread is None or not self._thread.is_alive():
                self._export_dropped += len(self._buffer)
                self._buffer.clear()
                remaining_ms = max(deadline - time.monotonic(), 0.001) * 1000.0
                self._exporter.shutdown(timeout_millis=remaining_ms)
            if self._kernel_source is not None:
                self._kernel_source.close()
        except Exception:
            logger.warning("closing the stepwatch monitor failed", exc_info=True)

    def _close_at_exit(self) -> None:
        self.close(timeout_s=AT_EXIT_TIMEOUT_S)

    def __enter__(self) -> StepMonitor:
        return self

    def __exit__(self, exc_type: object, exc: object, traceback: object) -> None:
        self.close()


class HealthSource(Protocol):
    """Device-health readings for a window (e.g. ``kernels.HealthSampler`` over NVML)."""

    def sample(self) -> None:
        """Read the devices now (export thread); never raises."""

    def build(self, *, start_unix_nano: int, end_unix_nano: int) -> MetricsData | None:
        """The readings since the last build as metrics of this rank's resource."""


def _resolve_health(health: HealthSource | bool | None, resource: Resource) -> HealthSource | None:
    if health is False:
        return None
    if health is None or health is True:
        if health is None and importlib.util.find_spec("pynvml") is None:
            return None
        return HealthSampler(resource)
    return health


def _resolve_interval(export_interval_s: float | None) -> float:
    if export_interval_s is not None:
        if isinstance(export_interval_s, bool) or not export_interval_s > 0:
            raise ConfigError(f"export_interval_s must be positive, got {export_interval_s!r}")
        return float(export_interval_s)
    # The variable is milliseconds; the setting reads it as seconds and names a bad value.
    interval_s, _ = settings.METRIC_EXPORT_INTERVAL_S.lookup(os.environ)
    return DEFAULT_EXPORT_INTERVAL_S if interval_s is None else interval_s


#: ``instrument(monitor, model, optimizer, ...)``: :meth:`StepMonitor.instrument` as a function.
instrument = StepMonitor.instrument
