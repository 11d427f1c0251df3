"""Running the detectors: one shot over a range, incrementally per job, or as a service.

The incremental runner keeps its state in InfluxDB itself: the ``stepwatch.diagnosis``
measurement holds every finding with its state (``open``/``closed``) and when it was last
seen, and ``stepwatch.detector.state`` records the end of the last pass per job. Each pass
re-analyses a trailing range, matches what it sees to the stored open findings by kind and
localisation (not by start, which a later, longer range may estimate differently), keeps
their original identity, opens new ones and closes the ones whose condition cleared. A
runner killed at any point and restarted re-reads that state: no finding is lost or
duplicated.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

from stepwatch.core import _schema, settings
from stepwatch.core._diagnosis import Diagnosis
from stepwatch.core._errors import ConfigError, StepwatchError
from stepwatch.core._influx import InfluxClient
from stepwatch.core._lineproto import encode_point
from stepwatch.detectors.analysis._analyse import Finding, analyse
from stepwatch.detectors.analysis._config import DetectorConfig
from stepwatch.detectors.frame._frame import list_jobs, read_frame
from stepwatch.detectors.frame._progress import list_reporting_jobs, read_progress, with_progress
from stepwatch.detectors.service._hang import detector_config, hang_findings, with_hangs
from stepwatch.detectors.sinks._sinks import Sink, diagnosis_line, read_diagnoses

_log = logging.getLogger(__name__)

STATE_MEASUREMENT = "stepwatch.detector.state"

#: Returns the current time in Unix nanoseconds (``time.time_ns`` in production).
Clock = Callable[[], int]


def detect_job_findings(
    client: InfluxClient,
    job: str,
    *,
    start_unix_nano: int,
    end_unix_nano: int,
    window_s: float | None = None,
    config: DetectorConfig | None = None,
) -> list[Finding]:
    """Read ``[start, end)`` of ``job`` from InfluxDB and analyse it (findings with timing).

    Where each rank is at ``end`` (its progress) is read too: a job hung at ``end`` is a
    ``hang`` finding. Without ``config``, the hang thresholds come from the settings.
    """
    config = detector_config(config, os.environ)
    frame = read_frame(
        client, job, start_unix_nano=start_unix_nano, end_unix_nano=end_unix_nano, window_s=window_s
    )
    progress = read_progress(client, job, now_unix_nano=end_unix_nano)
    findings = analyse(with_progress(frame, progress), config=config)
    return with_hangs(findings, hang_findings(progress, config))


def detect_job(
    client: InfluxClient,
    job: str,
    *,
    start_unix_nano: int,
    end_unix_nano: int,
    window_s: float | None = None,
    config: DetectorConfig | None = None,
) -> list[Diagnosis]:
    """Diagnoses of ``job`` over ``[start, end)``; nothing is stored or published.

    Example:
        ``detect_job(client, "run-42", start_unix_nano=t0, end_unix_nano=t1)`` →
        ``[Diagnosis(kind="compute_straggler", ranks=(17,), ...)]``
    """
    return [
        finding.diagnosis
        for finding in detect_job_findings(
            client,
            job,
            start_unix_nano=start_unix_nano,
            end_unix_nano=end_unix_nano,
            window_s=window_s,
            config=config,
        )
    ]


@dataclasses.dataclass(frozen=True)
class PassResult:
    """What one incremental pass changed.

    Attributes:
        opened: findings seen for the first time (open, or already over).
        closed: findings closed in this pass.
        open_now: every finding open after the pass.
    """

    opened: tuple[Diagnosis, ...]
    closed: tuple[Diagnosis, ...]
    open_now: tuple[Diagnosis, ...]

    @property
    def published(self) -> tuple[Diagnosis, ...]:
        """What the sinks receive: every open finding plus those closed in this pass."""
        closed_new = tuple(d for d in self.opened if d.end_unix_nano is not None)
        return self.open_now + self.closed + closed_new


#: Kinds whose findings the hang probe opens and closes between full passes.
HANG_KINDS = frozenset({"hang"})


def _same_condition(stored: Diagnosis, fresh: Diagnosis) -> bool:
    if stored.kind != fresh.kind or stored.job != fresh.job:
        return False
    if (stored.ranks or fresh.ranks) and not set(stored.ranks) & set(fresh.ranks):
        return False
    if stored.hosts and fresh.hosts and not set(stored.hosts) & set(fresh.hosts):
        return False
    return not (stored.kind == "dataloader_stall" and stored.phase != fresh.phase)


class IncrementalDetector:
    """Analyses one job every pass; restart-safe, never duplicates, closes findings.

    Args:
        client: InfluxDB client on the stepwatch database (windows and state).
        job: the job id.
        sinks: extra destinations (Alertmanager, Grafana, JSON lines); the InfluxDB
            diagnosis measurement is always written first, since it holds the state.
        window_s: analysis window (the data's export window when ``None``).
        lookback_s: trailing range analysed each pass (extended back to cover open findings,
            up to ``max_lookback_s``).
        max_lookback_s: longest range ever read.
        config: detector thresholds.
        clock: current time in Unix nanoseconds (injected in tests).
    """

    def __init__(
        self,
        client: InfluxClient,
        job: str,
        *,
        sinks: Sequence[Sink] = (),
        window_s: float | None = None,
        lookback_s: float = 1800.0,
        max_lookback_s: float = 6 * 3600.0,
        config: DetectorConfig | None = None,
        clock: Clock | None = None,
    ) -> None:
        if not job:
            raise ConfigError("job: must not be empty")
        if window_s is not None and window_s <= 0:
            raise ConfigError(f"window_s: must be positive, got {window_s}")
        if lookback_s < 6 * (window_s or 1.0):
            raise ConfigError(f"lookback_s: must cover at least 6 windows, got {lookback_s}")
        self.client = client
        self.job = job
        self.sinks = tuple(sinks)
        self.window_s = window_s
        self.lookback_s = lookback_s
        self.max_lookback_s = max(max_lookback_s, lookback_s)
        self.config = detector_config(config, os.environ)
        self.clock: Clock = clock or time.time_ns

    def run_pass(self, *, skip: frozenset[str] = frozenset()) -> PassResult:
        """One pass: read, analyse, reconcile with the stored findings, publish.

        Args:
            skip: kinds this pass neither opens nor closes (the detector service leaves
                ``hang`` to its probe, which runs on its own thread).
        """
        now = int(self.clock())
        stored = [
            item for item in read_diagnoses(self.client, self.job) if item[0].kind not in skip
        ]
        open_stored = [(d, seen) for d, seen in stored if d.end_unix_nano is None]
        lookback_ns = round(self.lookback_s * 1e9)
        start = now - lookback_ns
        if open_stored:
            earliest = min(d.start_unix_nano for d, _ in open_stored) - lookback_ns // 2
            start = max(min(start, earliest), now - round(self.max_lookback_s * 1e9))
        findings = detect_job_findings(
            self.client,
            self.job,
            start_unix_nano=start,
            end_unix_nano=now,
            window_s=self.window_s,
            config=self.config,
        )
        findings = [f for f in findings if f.diagnosis.kind not in skip]
        return self._reconcile(findings, stored, now=now)

    def probe_hang(self) -> PassResult:
        """The cheap pass between full ones: the job's latest progress → its ``hang`` finding.

        Opens, keeps or closes ``hang`` findings only (the other kinds wait for the next full
        pass); publishes what changed like :meth:`run_pass`.
        """
        now = int(self.clock())
        stored = [
            item for item in read_diagnoses(self.client, self.job) if item[0].kind in HANG_KINDS
        ]
        progress = read_progress(self.client, self.job, now_unix_nano=now)
        return self._reconcile(hang_findings(progress, self.config), stored, now=now, full=False)

    def _reconcile(
        self,
        findings: list[Finding],
        stored: list[tuple[Diagnosis, int | None]],
        *,
        now: int,
        full: bool = True,
    ) -> PassResult:
        """Match fresh findings to the stored ones, write what changed, publish."""
        open_stored = [(d, seen) for d, seen in stored if d.end_unix_nano is None]
        gap_ns = round(self.config.gap_windows * (self.window_s or 10.0) * 1e9)
        matched: set[str] = set()
        opened: list[Diagnosis] = []
        closed: list[Diagnosis] = []
        still_open: list[tuple[Diagnosis, int]] = []
        for finding in findings:
            fresh = finding.diagnosis
            match = next(
                (
                    (d, seen)
                    for d, seen in open_stored
                    if d.finding_id not in matched and _same_condition(d, fresh)
                ),
                None,
            )
            if match is not None:
                diagnosis, _ = match
                matched.add(diagnosis.finding_id)
                # Same identity and severity; the cost (and the summary saying it) is now's.
                diagnosis = dataclasses.replace(
                    diagnosis, slowdown=fresh.slowdown, summary=fresh.summary
                )
                if fresh.end_unix_nano is None:
                    still_open.append((diagnosis, finding.last_seen_unix_nano))
                else:
                    closed.append(
                        dataclasses.replace(
                            diagnosis,
                            end_unix_nano=max(fresh.end_unix_nano, diagnosis.start_unix_nano),
                        )
                    )
                continue
            # A hang that ended is over: the next one starts after it, however soon.
            gap = 0 if fresh.kind in HANG_KINDS else gap_ns
            already = any(
                d.end_unix_nano is not None
                and _same_condition(d, fresh)
                and fresh.start_unix_nano <= d.end_unix_nano + gap
                for d, _ in stored
            ) or any(d.finding_id == fresh.finding_id for d, _ in stored)
            if already:
                continue  # the same episode, already reported and closed
            opened.append(fresh)
            if fresh.end_unix_nano is None:
                still_open.append((fresh, finding.last_seen_unix_nano))
        for diagnosis, seen in open_stored:
            if diagnosis.finding_id in matched:
                continue
            end = seen if seen is not None else now
            closed.append(
                dataclasses.replace(diagnosis, end_unix_nano=max(end, diagnosis.start_unix_nano))
            )
        lines = [diagnosis_line(d, last_seen_unix_nano=seen) for d, seen in still_open]
        lines += [diagnosis_line(d) for d in closed]
        lines += [diagnosis_line(d) for d in opened if d.end_unix_nano is not None]
        if full:  # the state records full passes (a probe sees one kind only)
            lines.append(
                encode_point(
                    STATE_MEASUREMENT,
                    {_schema.JOB_ID: self.job},
                    {"last_end_unix_nano": now, "open_findings": len(still_open)},
                    0,
                )
            )
        if lines:
            self.client.write_lines(lines)
        result = PassResult(
            opened=tuple(opened),
            closed=tuple(closed),
            open_now=tuple(d for d, _ in still_open),
        )
        for sink in self.sinks:
            try:
                sink.publish(result.published)
            except StepwatchError as exc:  # one broken sink must not stop the others
                _log.warning("sink %s failed: %s", type(sink).__name__, exc)
        return result


class DetectorService:
    """Runs an :class:`IncrementalDetector` for every job seen, every ``interval_s``.

    A second thread probes every job that reported in the last minute for a hang
    (:meth:`IncrementalDetector.probe_hang`) every ``probe_interval_s``, so a hang is a
    finding within its threshold plus one probe interval however long a full pass takes; the
    full passes then leave ``hang`` findings to the probe (each kind has one owner, so the two
    threads never race on a finding). Publishing to the sinks is serialised. Used in-process
    by ``stepwatch up``/``demo``. Nothing runs until :meth:`start`.

    Args:
        client: InfluxDB client.
        sinks: destinations besides the InfluxDB diagnosis measurement.
        interval_s: time between passes (30 s when ``None``).
        probe_interval_s: time between hang probes (``STEPWATCH_HANG_PROBE_INTERVAL_S``, 5 s,
            when ``None``; 0 turns the probe off and the full passes find hangs themselves).
        window_s, lookback_s, config, clock: passed to each :class:`IncrementalDetector`.
        jobs: analyse only these jobs (every job with step windows when ``None``).

    Raises:
        ConfigError: a non-positive interval, a negative probe interval or a bad setting.
    """

    def __init__(
        self,
        client: InfluxClient,
        *,
        sinks: Sequence[Sink] = (),
        interval_s: float | None = 30.0,
        probe_interval_s: float | None = None,
        window_s: float | None = None,
        lookback_s: float = 1800.0,
        config: DetectorConfig | None = None,
        clock: Clock | None = None,
        jobs: Sequence[str] | None = None,
    ) -> None:
        interval_s = 30.0 if interval_s is None else interval_s
        if interval_s <= 0:
            raise ConfigError(f"interval_s: must be positive, got {interval_s}")
        probe = settings.HANG_PROBE_INTERVAL_S.resolve(probe_interval_s, os.environ)
        if probe is None or probe < 0:
            raise ConfigError(f"probe_interval_s: must be >= 0, got {probe}")
        self.client = client
        publishing = threading.Lock()
        self.sinks = tuple(_SerialSink(sink, publishing) for sink in sinks)
        self.interval_s = interval_s
        self.probe_interval_s = probe
        self.window_s = window_s
        self.lookback_s = lookback_s
        self.config = config
        self.clock = clock
        self.jobs = None if jobs is None else tuple(jobs)
        self._detectors: dict[str, IncrementalDetector] = {}
        self._detectors_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _detector(self, job: str) -> IncrementalDetector:
        with self._detectors_lock:
            detector = self._detectors.get(job)
            if detector is None:
                detector = self._detectors[job] = IncrementalDetector(
                    self.client,
                    job,
                    sinks=self.sinks,
                    window_s=self.window_s,
                    lookback_s=self.lookback_s,
                    config=self.config,
                    clock=self.clock,
                )
            return detector

    def run_once(self) -> dict[str, PassResult]:
        """One full pass over every job (``hang`` left to the probe when it runs)."""
        jobs = self.jobs if self.jobs is not None else tuple(list_jobs(self.client))
        skip = HANG_KINDS if self.probe_interval_s > 0 else frozenset()
        return self._each(jobs, lambda detector: detector.run_pass(skip=skip), "detection pass")

    def probe_once(self) -> dict[str, PassResult]:
        """One hang probe of every job that reported lately; a failing job is logged."""
        now = int((self.clock or time.time_ns)())
        # A job silent for longer keeps what the probe found (its findings are its own).
        reporting = list_reporting_jobs(self.client, now_unix_nano=now, lookback_s=60.0)
        jobs = [job for job in reporting if self.jobs is None or job in self.jobs]
        return self._each(jobs, IncrementalDetector.probe_hang, "hang probe")

    def _each(
        self,
        jobs: Sequence[str],
        run: Callable[[IncrementalDetector], PassResult],
        what: str,
    ) -> dict[str, PassResult]:
        results: dict[str, PassResult] = {}
        for job in jobs:
            try:
                results[job] = run(self._detector(job))
            except StepwatchError as exc:
                _log.warning("%s for job %s failed: %s", what, job, exc)
            except Exception:  # a bug on one job's data must not stop the others
                _log.exception("%s for job %s failed", what, job)
        return results

    def _loop(self, run: Callable[[], object], interval_s: float, what: str) -> None:
        while not self._stop.is_set():
            try:
                run()
            except StepwatchError as exc:
                _log.warning("%s failed: %s", what, exc)
            except Exception:  # the service outlives a bug: logged, retried next period
                _log.exception("%s failed", what)
            self._stop.wait(interval_s)

    def start(self) -> DetectorService:
        """Run passes (and probes) on background threads until :meth:`stop`."""
        if any(thread.is_alive() for thread in self._threads):
            return self
        self._stop.clear()
        loops = [("stepwatch-detectors", self.run_once, self.interval_s, "detection pass")]
        if self.probe_interval_s > 0:
            loops.append(("stepwatch-hang-probe", self.probe_once, self.probe_interval_s, "probe"))
        self._threads = [
            threading.Thread(target=self._loop, args=loop[1:], name=loop[0], daemon=True)
            for loop in loops
        ]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, *, timeout_s: float = 10.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)
        self._threads = []


class _SerialSink:
    """A sink whose ``publish`` never runs on two threads at once (passes and probes share it)."""

    def __init__(self, sink: Sink, lock: threading.Lock) -> None:
        self.sink = sink
        self._lock = lock

    def publish(self, findings: Sequence[Diagnosis]) -> None:
        with self._lock:
            self.sink.publish(findings)
