"""Faults to inject (``KIND@STEP:RANKS[:SEVERITY]``) and the ground truth a run records."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from stepwatch.core._diagnosis import format_time, parse_time
from stepwatch.core._errors import ConfigError
from stepwatch.detectors.analysis import rules


#: The kinds the simulator can inject, in its round's order (each rule module declares its
#: place, ``Kind.simulated``; a hang stops the job, a slow rank is what step times alone say
#: of a fault: neither is a timing model of its own).
def simulated_kinds(registry: rules.Registry) -> tuple[str, ...]:
    """The kinds a registry's rules declare the simulator injects, in its round's order."""
    return tuple(k.name for k in registry.declared if k.simulated is not None)


SIMULATED_KINDS = simulated_kinds(rules.registry())

_FAULT_RE = re.compile(
    r"^(?P<kind>[a-z_]+)@(?P<step>\d+)(?::(?P<ranks>[^:]*))?(?::(?P<sev>[^:]*))?"
    r"(?::(?P<phase>[a-z_]+))?$"
)
#: ``jit_stall`` placed outside every phase: the rank stops between its optimizer and its
#: next step (a GC pause, a checkpoint write); its peers wait in their next all-reduce.
OUTSIDE = "outside"


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: ``KIND@STEP:RANKS[:SEVERITY][:PHASE]``.

    Severity is the slowdown factor of the affected component (1.3 = 30% slower): the kernel
    class (stragglers, regressions), the host-side compute time (masked straggler), the link
    (link degradation), the pipeline bubble, the mean step (data-loader and JIT stalls), the
    SM clock (GPU health, inverse), the forward and backward work of a pipeline stage
    (``stage_imbalance``, on every replica of the stage), ``e`` to the log-sd of each
    replica's per-step work (``workload_imbalance``: sequence lengths, mean work unchanged).
    Ignored for ``rank_missing``. ``phase`` places a ``jit_stall``: ``forward`` (default)
    or ``outside`` (between phases, :data:`OUTSIDE`).
    """

    kind: str
    start_step: int
    ranks: tuple[int, ...] = ()
    severity: float = 1.3
    end_step: int | None = None
    kernel_class: str | None = None
    phase: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in SIMULATED_KINDS:
            raise ConfigError(f"fault: kind {self.kind!r} is not one of {SIMULATED_KINDS}")
        if self.phase not in (None, "forward", OUTSIDE):
            raise ConfigError(f"fault: phase {self.phase!r} is not forward or {OUTSIDE}")
        if self.severity <= 1.0 and self.kind != "rank_missing":
            raise ConfigError(f"fault: severity must be > 1, got {self.severity}")

    @classmethod
    def parse(cls, text: str) -> Fault:
        """Parse ``KIND@STEP:RANKS[:SEVERITY][:PHASE]``; RANKS like ``3``, ``3,5``, ``8-15``,
        ``all``; SEVERITY like ``1.3``, ``30%``, ``3x``; PHASE ``forward`` or ``outside``."""
        match = _FAULT_RE.match(text.strip())
        if match is None:
            raise ConfigError(f"fault: {text!r} is not KIND@STEP:RANKS[:SEVERITY][:PHASE]")
        ranks: list[int] = []
        for item in (match["ranks"] or "").split(","):
            item = item.strip()
            if not item or item == "all":
                continue
            if "-" in item:
                low, high = item.split("-", 1)
                ranks.extend(range(int(low), int(high) + 1))
            elif item.isdigit():
                ranks.append(int(item))
            else:
                raise ConfigError(f"fault: bad rank list in {text!r}")
        severity = 1.3
        if match["sev"]:
            severity = _parse_severity(match["sev"], text)
        return cls(
            kind=match["kind"],
            start_step=int(match["step"]),
            ranks=tuple(ranks),
            severity=severity,
            phase=match["phase"],
        )


def _parse_severity(text: str, context: str) -> float:
    try:
        if text.endswith("%"):
            return 1.0 + float(text[:-1]) / 100.0
        if text.endswith("x"):
            return float(text[:-1])
        return float(text)
    except ValueError as exc:
        raise ConfigError(f"fault: bad severity in {context!r}") from exc


@dataclasses.dataclass(frozen=True)
class TruthFault:
    """A fault as the detectors should report it.

    ``start_unix_nano`` is when the injected effect begins: the fault's step, except for
    ``jit_stall``, whose stalls strike random steps from then on, where it is the first stall
    (nothing is observable before it, so detection latency counts from there).
    ``slowdown`` is its ground-truth cost: the job's mean step time over the fault's steps
    divided by the same job simulated without this fault (same draws, every other fault
    kept) over the same steps; 1.0 when unknown (older truth files).
    """

    kind: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    phase: str | None
    kernel_class: str | None
    severity: float
    start_unix_nano: int
    end_unix_nano: int | None
    slowdown: float = 1.0


@dataclasses.dataclass(frozen=True)
class Truth:
    """Ground truth of a simulated job (``--truth truth.json``)."""

    job: str
    world_size: int
    topology: str
    seed: int
    window_s: float
    steps_per_window: int
    start_unix_nano: int
    end_unix_nano: int
    faults: tuple[TruthFault, ...]

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "world_size": self.world_size,
            "topology": self.topology,
            "seed": self.seed,
            "window_s": self.window_s,
            "steps_per_window": self.steps_per_window,
            "start": format_time(self.start_unix_nano),
            "end": format_time(self.end_unix_nano),
            "start_unix_nano": self.start_unix_nano,
            "end_unix_nano": self.end_unix_nano,
            "faults": [
                {
                    "kind": fault.kind,
                    "ranks": list(fault.ranks),
                    "hosts": list(fault.hosts),
                    "phase": fault.phase,
                    "kernel_class": fault.kernel_class,
                    "severity": fault.severity,
                    "start": format_time(fault.start_unix_nano),
                    "start_unix_nano": fault.start_unix_nano,
                    "end_unix_nano": fault.end_unix_nano,
                    "slowdown": fault.slowdown,
                }
                for fault in self.faults
            ],
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> Truth:
        try:
            return cls(
                job=str(data["job"]),
                world_size=int(data["world_size"]),
                topology=str(data["topology"]),
                seed=int(data["seed"]),
                window_s=float(data["window_s"]),
                steps_per_window=int(data["steps_per_window"]),
                start_unix_nano=int(data.get("start_unix_nano") or parse_time(data["start"])),
                end_unix_nano=int(data.get("end_unix_nano") or parse_time(data["end"])),
                faults=tuple(
                    TruthFault(
                        kind=str(item["kind"]),
                        ranks=tuple(int(r) for r in item.get("ranks") or ()),
                        hosts=tuple(str(h) for h in item.get("hosts") or ()),
                        phase=item.get("phase"),
                        kernel_class=item.get("kernel_class"),
                        severity=float(item["severity"]),
                        start_unix_nano=int(item["start_unix_nano"]),
                        end_unix_nano=None
                        if item.get("end_unix_nano") is None
                        else int(item["end_unix_nano"]),
                        slowdown=float(item.get("slowdown", 1.0)),
                    )
                    for item in data.get("faults", ())
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"truth: not a stepwatch ground-truth document ({exc})") from exc

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Truth:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"truth: cannot read {path}: {exc}") from exc
        return cls.from_json_dict(data)
