"""The diagnosis record every detector emits and every sink consumes (docs/schema.md)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from datetime import UTC, datetime
from typing import Any

from stepwatch.core._errors import ConfigError
from stepwatch.core._schema import DIAGNOSIS_KIND_PATTERN, SEVERITIES


def format_time(time_unix_nano: int) -> str:
    """RFC 3339 UTC with a Z suffix, second precision (the diagnosis format of docs/schema.md)."""
    return (
        datetime.fromtimestamp(time_unix_nano / 1e9, tz=UTC)
        .replace(microsecond=0)
        .strftime("%Y-%m-%dT%H:%M:%SZ")
    )


def parse_time(text: str) -> int:
    """Parse an RFC 3339 time into Unix nanoseconds."""
    moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1e9)


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """One finding, as printed by ``stepwatch detect --json`` (one JSON object per line).

    ``start_unix_nano``/``end_unix_nano`` bound the windows the finding covers; ``end`` is
    ``None`` while the finding is still open in an incremental run.
    """

    job: str
    kind: str
    start_unix_nano: int
    end_unix_nano: int | None
    severity: str
    score: float
    summary: str
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    phase: str | None = None
    kernel_class: str | None = None
    slowdown: float = 1.0

    def __post_init__(self) -> None:
        if not re.fullmatch(DIAGNOSIS_KIND_PATTERN, self.kind):
            raise ConfigError(
                f"kind: {self.kind!r} is not a kind's name ({DIAGNOSIS_KIND_PATTERN})"
            )
        if self.severity not in SEVERITIES:
            raise ConfigError(f"severity: {self.severity!r} is not one of {SEVERITIES}")
        if not (math.isfinite(self.slowdown) and self.slowdown >= 1.0):
            raise ConfigError(f"slowdown: must be a finite factor >= 1.0, got {self.slowdown!r}")

    @property
    def finding_id(self) -> str:
        """Stable identity: same job, kind, localisation and start → same id.

        Sinks key on it so re-running a detector over the same window never duplicates.
        """
        key = json.dumps(
            [
                self.job,
                self.kind,
                list(self.ranks),
                list(self.hosts),
                self.phase,
                self.kernel_class,
                self.start_unix_nano,
            ]
        )
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    @property
    def location(self) -> str:
        """Where the finding is, in words: "ranks 3, 17; hosts node-1; phase backward" or
        "job-wide" when the kind localises nothing."""
        parts = []
        if self.ranks:
            parts.append("ranks " + ", ".join(str(rank) for rank in self.ranks))
        if self.hosts:
            parts.append("hosts " + ", ".join(self.hosts))
        if self.phase:
            parts.append(f"phase {self.phase}")
        if self.kernel_class:
            parts.append(f"kernel class {self.kernel_class}")
        return "; ".join(parts) if parts else "job-wide"

    @property
    def blamed(self) -> str:
        """Who the finding names, in words: "rank 2", "ranks 1, 5", "host node-1", or "" when
        it names no rank or host (a job-wide finding)."""
        for noun, names in (("rank", [str(rank) for rank in self.ranks]), ("host", self.hosts)):
            if names:
                return f"{noun}{'s' if len(names) > 1 else ''} " + ", ".join(names)
        return ""

    def to_json_dict(self) -> dict[str, Any]:
        """The JSON object of docs/schema.md."""
        return {
            "job": self.job,
            "kind": self.kind,
            "ranks": list(self.ranks),
            "hosts": list(self.hosts),
            "phase": self.phase,
            "kernel_class": self.kernel_class,
            "start": format_time(self.start_unix_nano),
            "end": None if self.end_unix_nano is None else format_time(self.end_unix_nano),
            "severity": self.severity,
            "score": round(self.score, 3),
            "slowdown": round(self.slowdown, 3),
            "summary": self.summary,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), separators=(", ", ": "))

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> Diagnosis:
        end = data.get("end")
        return cls(
            job=str(data["job"]),
            kind=str(data["kind"]),
            ranks=tuple(int(r) for r in data.get("ranks") or ()),
            hosts=tuple(str(h) for h in data.get("hosts") or ()),
            phase=data.get("phase"),
            kernel_class=data.get("kernel_class"),
            start_unix_nano=parse_time(str(data["start"])),
            end_unix_nano=None if end is None else parse_time(str(end)),
            severity=str(data["severity"]),
            score=float(data["score"]),
            summary=str(data["summary"]),
            # Records written before findings carried their cost read as free.
            slowdown=float(data.get("slowdown", 1.0)),
        )
