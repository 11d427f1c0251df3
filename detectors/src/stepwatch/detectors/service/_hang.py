"""Hangs between full passes: the latest progress of a job, as findings, in a few milliseconds.

A full detector pass reads and tests a job's whole trailing range (every 30 s under
``stepwatch up``); a hang needs only where each rank is now (:func:`~stepwatch.detectors.frame.
read_progress`: six ``last()`` statements), so the service probes for it every few seconds
(``STEPWATCH_HANG_PROBE_INTERVAL_S``) and the finding exists within threshold + probe interval
of the onset. Both paths give the same verdict (:func:`~stepwatch.detectors.analysis.rules.
hang.find_hangs`); matching by kind and ranks keeps one finding across them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from stepwatch.core import settings
from stepwatch.core._diagnosis import Diagnosis
from stepwatch.detectors.analysis import rules
from stepwatch.detectors.analysis._analyse import Finding, with_cost
from stepwatch.detectors.analysis._config import DetectorConfig
from stepwatch.detectors.analysis._rule import Probed
from stepwatch.detectors.frame._progress import JobProgress


def detector_config(config: DetectorConfig | None, environ: Mapping[str, str]) -> DetectorConfig:
    """``config``, else the defaults with the hang thresholds of the settings.

    Raises:
        ConfigError: a hang setting does not parse or is out of range (names the variable).
    """
    if config is not None:
        return config
    steps = settings.HANG_STEPS.resolve(None, environ)
    min_s = settings.HANG_MIN_S.resolve(None, environ)
    return DetectorConfig(
        hang_steps=DetectorConfig.hang_steps if steps is None else steps,
        hang_min_s=DetectorConfig.hang_min_s if min_s is None else min_s,
    )


def hang_findings(progress: JobProgress, config: DetectorConfig) -> list[Finding]:
    """What the rules that decide from progress alone find now (the ``hang`` rule, through
    the registry), as findings (start: the job's last progress)."""
    findings: list[Finding] = []
    for rule in rules.registry().job_rules:
        if rule.probe is not None:
            found = rule.probe(progress, config)
            findings.extend(_probed(progress, rule.kind, item) for item in found)
    return findings


def _probed(progress: JobProgress, kind: str, hang: Probed) -> Finding:
    """A probe's verdict as a finding: critical, costed by how long the job is stuck."""
    diagnosis = Diagnosis(
        job=progress.job,
        kind=kind,
        ranks=hang.ranks,
        hosts=hang.hosts,
        phase=hang.phase,
        start_unix_nano=hang.onset_unix_nano,
        end_unix_nano=None,
        severity="critical",
        score=hang.score,
        summary=with_cost(hang.summary, hang.slowdown),
        slowdown=hang.slowdown,
    )
    detected = hang.onset_unix_nano + round(hang.threshold_s * 1e9)
    return Finding(
        diagnosis=diagnosis,
        detected_unix_nano=min(detected, progress.now_unix_nano),
        last_seen_unix_nano=progress.now_unix_nano,
    )


def with_hangs(findings: Sequence[Finding], hangs: Sequence[Finding]) -> list[Finding]:
    """The engine's findings, plus ``hangs`` when the engine found none.

    The engine sees a hang only when the frame holds the hung ranks' earlier windows (a hang
    older than the range read has none); when it does, its finding (same rule, same cost) is
    the one kept.
    """
    probed = {rule.kind for rule in rules.registry().probes()}
    if any(f.diagnosis.kind in probed for f in findings):
        return list(findings)
    return [*findings, *hangs]
