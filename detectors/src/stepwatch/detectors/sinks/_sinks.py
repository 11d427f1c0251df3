"""Where diagnoses go: the :class:`Sink` protocol and the InfluxDB diagnosis measurement.

The ``stepwatch.diagnosis`` measurement is documented in docs/diagnosis.md. One point per
finding, at the finding's start time, in a series keyed by the finding id: writing the same
finding again (for instance when it closes) overwrites the point instead of adding one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol, TextIO

from stepwatch.core import _schema
from stepwatch.core._diagnosis import Diagnosis
from stepwatch.core._influx import InfluxClient, quote_ident, quote_literal
from stepwatch.core._lineproto import FieldValue, encode_point

#: Tag and field keys of the ``stepwatch.diagnosis`` measurement.
TAG_KIND = "kind"
TAG_SEVERITY = "severity"
TAG_FINDING = "finding"
STATE_OPEN = "open"
STATE_CLOSED = "closed"


class Sink(Protocol):
    """A destination for findings."""

    def publish(self, findings: Sequence[Diagnosis]) -> None:
        """After each detection pass: every finding open now (end_unix_nano None) or closed
        in this pass (end set). Idempotent: publishing the same finding again never
        duplicates it downstream."""


def diagnosis_title(diagnosis: Diagnosis) -> str:
    """Short title: ``compute_straggler: rank 17 backward`` style."""
    where = []
    if diagnosis.hosts and diagnosis.kind == "link_degradation":
        where.append(",".join(diagnosis.hosts))
    elif diagnosis.ranks:
        ranks = ",".join(str(rank) for rank in diagnosis.ranks[:8])
        if len(diagnosis.ranks) > 8:
            ranks += ",..."
        where.append(("rank " if len(diagnosis.ranks) == 1 else "ranks ") + ranks)
    if diagnosis.phase:
        where.append(diagnosis.phase)
    if diagnosis.kernel_class:
        where.append(diagnosis.kernel_class)
    return diagnosis.kind + (": " + " ".join(where) if where else "")


def diagnosis_line(diagnosis: Diagnosis, *, last_seen_unix_nano: int | None = None) -> str:
    """The line protocol point of one finding (docs/diagnosis.md)."""
    tags = {
        _schema.JOB_ID: diagnosis.job,
        TAG_KIND: diagnosis.kind,
        TAG_SEVERITY: diagnosis.severity,
        TAG_FINDING: diagnosis.finding_id,
    }
    fields: dict[str, FieldValue] = {
        "title": diagnosis_title(diagnosis),
        "text": diagnosis.summary,
        "ranks": ",".join(str(rank) for rank in diagnosis.ranks),
        "hosts": ",".join(diagnosis.hosts),
        "phase": diagnosis.phase or "",
        "kernel_class": diagnosis.kernel_class or "",
        "score": float(diagnosis.score),
        "slowdown": float(diagnosis.slowdown),
        "state": STATE_OPEN if diagnosis.end_unix_nano is None else STATE_CLOSED,
    }
    if diagnosis.end_unix_nano is not None:
        fields["end_unix_nano"] = int(diagnosis.end_unix_nano)
        fields["time_end"] = int(diagnosis.end_unix_nano // 1_000_000)
    if last_seen_unix_nano is not None:
        fields["last_seen_unix_nano"] = int(last_seen_unix_nano)
    return encode_point(_schema.DIAGNOSIS_MEASUREMENT, tags, fields, diagnosis.start_unix_nano)


class InfluxDiagnosisSink:
    """Writes findings into the ``stepwatch.diagnosis`` measurement.

    Args:
        client: InfluxDB client on the stepwatch database.

    Idempotent by construction: the point's series is keyed by the finding id and its time
    is the finding's start, so a rewrite replaces the fields of the same point.
    """

    def __init__(self, client: InfluxClient) -> None:
        self.client = client

    def publish(self, findings: Sequence[Diagnosis]) -> None:
        if findings:
            self.client.write_lines([diagnosis_line(finding) for finding in findings])


def read_diagnoses(
    client: InfluxClient, job: str | None = None, *, state: str | None = None
) -> list[tuple[Diagnosis, int | None]]:
    """Findings stored in ``stepwatch.diagnosis`` with their ``last_seen_unix_nano``.

    Args:
        client: InfluxDB client.
        job: only this job (all jobs when ``None``).
        state: ``"open"`` or ``"closed"`` to filter.
    """
    conditions = []
    if job is not None:
        conditions.append(f"{quote_ident(_schema.JOB_ID)} = {quote_literal(job)}")
    if state is not None:
        conditions.append(f'"state" = {quote_literal(state)}')
    where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
    series = client.query(
        f"SELECT * FROM {quote_ident(_schema.DIAGNOSIS_MEASUREMENT)}{where} "
        f"GROUP BY {quote_ident(_schema.JOB_ID)}, {quote_ident(TAG_KIND)}, "
        f"{quote_ident(TAG_SEVERITY)}, {quote_ident(TAG_FINDING)}"
    )
    results = []
    for item in series:
        for record in item.records():
            end = record.get("end_unix_nano")
            last_seen = record.get("last_seen_unix_nano")
            ranks = str(record.get("ranks") or "")
            hosts = str(record.get("hosts") or "")
            diagnosis = Diagnosis(
                job=item.tags.get(_schema.JOB_ID, ""),
                kind=item.tags.get(TAG_KIND, ""),
                severity=item.tags.get(TAG_SEVERITY, ""),
                start_unix_nano=int(record["time"]),
                end_unix_nano=None if end is None else int(end),
                score=float(record.get("score") or 0.0),
                summary=str(record.get("text") or ""),
                ranks=tuple(int(rank) for rank in ranks.split(",") if rank),
                hosts=tuple(host for host in hosts.split(",") if host),
                phase=str(record.get("phase") or "") or None,
                kernel_class=str(record.get("kernel_class") or "") or None,
                # Findings stored before they carried their cost read as free.
                slowdown=max(1.0, float(record.get("slowdown") or 1.0)),
            )
            results.append((diagnosis, None if last_seen is None else int(last_seen)))
    return sorted(results, key=lambda item: (item[0].start_unix_nano, item[0].finding_id))


class JsonLinesSink:
    """Prints each finding as JSON (docs/schema.md), once when it opens and once when it closes.

    Args:
        stream: text stream (``sys.stdout``).
        json_lines: ``True`` for JSON lines, ``False`` for a readable line.
    """

    def __init__(self, stream: TextIO, *, json_lines: bool = True) -> None:
        self.stream = stream
        self.json_lines = json_lines
        self._seen: set[tuple[str, int | None]] = set()
        self._lock = threading.Lock()

    def publish(self, findings: Sequence[Diagnosis]) -> None:
        with self._lock:
            for finding in findings:
                key = (finding.finding_id, finding.end_unix_nano)
                if key in self._seen:
                    continue
                self._seen.add(key)
                self.stream.write(
                    (finding.to_json() if self.json_lines else format_row(finding)) + "\n"
                )
            self.stream.flush()


class MemorySink:
    """Keeps the latest version of every finding by id (tests, in-process consumers)."""

    def __init__(self) -> None:
        self.findings: dict[str, Diagnosis] = {}
        self.publish_calls = 0

    def publish(self, findings: Sequence[Diagnosis]) -> None:
        self.publish_calls += 1
        for finding in findings:
            self.findings[finding.finding_id] = finding


def format_row(diagnosis: Diagnosis) -> str:
    """One readable line for the terminal table."""
    data = diagnosis.to_json_dict()
    end = data["end"] or "open"
    return (
        f"{data['start']}  {end:<20}  {diagnosis.severity:<8}  {diagnosis.kind:<18}  "
        f"{diagnosis.summary}"
    )


def format_table(diagnoses: Sequence[Diagnosis]) -> str:
    """A header and one :func:`format_row` line per diagnosis (``stepwatch detect``)."""
    header = f"{'start':<20}  {'end':<20}  {'severity':<8}  {'kind':<18}  summary"
    return "\n".join([header, *(format_row(d) for d in diagnoses)])
