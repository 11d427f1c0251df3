"""The same job gets the same diagnosis however it is instrumented: the matrix, on real data.

Each real case (the three what-if traces, recorded real DDP runs, recorded real pipeline
runs, a job exported by ranks whose windows do not line up) is stored in each layout a
producer may send (stepwatch's auto mode or per-op phases with a ``communication`` phase;
the README's loop, the collective inside ``backward``, or in a pipeline the waits left
untimed; step times alone) through the bridge's conversion into a real
InfluxDB and diagnosed as a live job is. A cell holds either the reference diagnosis (kind,
ranks, cost within its tolerance of the truth, or of the reference layout's cost where no
truth was measured), or a finding that says which evidence the layout lacks, or nothing
where the layout cannot show the fault (the reason is in the table). Every warning or
critical finding's own evidence must differ from 1.00x.

The table in docs/diagnosis.md ("The instrumentation matrix") is this test's output; run
it with ``STEPWATCH_WRITE_MATRIX=1`` to rewrite it after a change.
"""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stepwatch.app._replay import write_direct
from stepwatch.core import InfluxClient, ManagedInfluxDB
from stepwatch.detectors import Finding, detect_job_findings
from stepwatch.detectors.frame import job_time_range
from tests.detectors import real_pipeline, real_runs
from tests.detectors.test_whatif_traces import TRACES, trace, what_if
from tests.detectors.timeline_job import START_UNIX_NANO, TimelineJob, in_layout, masked_straggler

DOC = Path(__file__).resolve().parents[2] / "docs" / "diagnosis.md"
BEGIN, END = "<!-- matrix: begin -->", "<!-- matrix: end -->"
#: The layouts, by column: what the producer sends.
LAYOUTS = ("auto", "no-communication", "steps")
HEADINGS = {
    "auto": "phases with `communication`",
    "no-communication": "phases without `communication` (DDP: in `backward`)",
    "steps": "step times alone",
}
#: A finding's evidence must differ from 1.00x by this much to be a warning or critical.
MIN_EVIDENCE = 1.03


@dataclasses.dataclass(frozen=True)
class Expect:
    """What one cell must hold.

    Attributes:
        kind: the finding's kind; ``None``: no finding.
        ranks: its ranks.
        lacks: a phrase the finding must say (the evidence the layout lacks).
        why: why a layout shows nothing of a fault its reference layout names.
    """

    kind: str | None
    ranks: tuple[int, ...] = ()
    lacks: str | None = None
    why: str | None = None


@dataclasses.dataclass(frozen=True)
class Case:
    """A real job, how it is stored in a layout, and what each layout must show."""

    name: str
    load: Callable[[InfluxClient, str], tuple[str, int, int]]
    expect: dict[str, Expect]
    truth: float | None = None  # the measured what-if slowdown, where there is one
    tolerance: float = 0.15


def _trace(name: str) -> Callable[[InfluxClient, str], tuple[str, int, int]]:
    import yaml

    def load(influx: InfluxClient, layout: str) -> tuple[str, int, int]:
        meta = yaml.safe_load((TRACES / f"meta-{name}.yaml").read_text())
        layout = "phases" if layout == "auto" else layout
        job = trace(name).job(f"{name}-{uuid.uuid4().hex[:6]}", layout=layout,
                              world_size=meta["world_size"])  # fmt: skip
        write_direct(job, influx)
        end = job.start_unix_nano + round(float(job.step_s.max(axis=1).sum()) * 1e9)
        return job.job_id, job.start_unix_nano - 10**9, end + 10**10

    return load


def _run(
    name: str, *, pipeline: bool = False
) -> Callable[[InfluxClient, str], tuple[str, int, int]]:
    """A recorded real run (tests/data/real_runs, or real_pipeline) in a layout."""
    recorded = real_pipeline.load if pipeline else real_runs.load

    def load(influx: InfluxClient, layout: str) -> tuple[str, int, int]:
        job = recorded(influx, name, layout=layout).job
        span = job_time_range(influx, job)
        assert span is not None
        return job, span[0] - 10**9, span[1] + 10**9

    return load


def _pipeline(name: str) -> Callable[[InfluxClient, str], tuple[str, int, int]]:
    return _run(name, pipeline=True)


def _pipeline_truth(name: str) -> float:
    return float(real_pipeline.describe(name)["truth"]["ratio"])


def _misaligned(influx: InfluxClient, layout: str) -> tuple[str, int, int]:
    step, phases, phase_s = masked_straggler(steps=2000, slow_from=700, factor=3.0, seed=0)
    phases, phase_s = in_layout(phases, phase_s, layout)
    job = TimelineJob(f"sdk-{uuid.uuid4().hex[:6]}", step, phases, phase_s, 1.0,
                      (0.0, 0.3, 0.6, 0.9))  # fmt: skip
    write_direct(job, influx)
    return job.job_id, START_UNIX_NANO - 10**10, START_UNIX_NANO + round((job.n_windows + 10) * 1e9)


def _misaligned_truth() -> float:
    slow, _, _ = masked_straggler(steps=2000, slow_from=700, factor=3.0, seed=0)
    healthy, _, _ = masked_straggler(steps=2000, slow_from=700, factor=1.0, seed=0)
    return float(slow.max(axis=1)[700:].mean() / healthy.max(axis=1)[700:].mean())


NOTHING = Expect(None)
SYNCHRONOUS = "every rank's step ends at the same collective: step times cannot show who was late"
ONE_STEP = "a one-off long step of every rank: step times alone cannot show who stopped"
HELD = "backward holds the collective and its wait"
STEPS_ONLY = "step times alone"
SHORT = "11 windows of a noisy 2-core host: too few for a change point in the step alone"
STRUCTURE = "structure from the first step: step times alone show no change"
UNTIMED_PAUSE = "its pause and its peers' waits both lie in no phase: who stopped cannot be told"

CASES = [
    Case("what-if AR (pp 4, dp 4: one slow worker)", _trace("AR"), {
        "auto": Expect("masked_straggler", (0,)),
        "no-communication": Expect("masked_straggler", (0, 16, 32, 48),
                                   lacks="the data cannot tell which"),
        "steps": Expect(None, why=SYNCHRONOUS),
    }, truth=what_if("AR")),
    Case("what-if ST (pp 4, dp 2: heavy last stage)", _trace("ST"), {
        "auto": Expect("stage_imbalance", (6, 7)),
        "no-communication": Expect(None, why="the stages' waits lie inside their phases: "
                                   "their work cannot be measured"),
        "steps": Expect(None, why=SYNCHRONOUS),
    }, truth=what_if("ST")),
    Case("what-if SE (pp 2, dp 32: sequence lengths)", _trace("SE"), {
        "auto": Expect("workload_imbalance"),
        "no-communication": Expect("workload_imbalance", lacks="lower bound"),
        "steps": Expect(None, why=SYNCHRONOUS),
    }, truth=what_if("SE"), tolerance=0.2),
    Case("DDP healthy (`none`)", _run("none"), dict.fromkeys(LAYOUTS, NOTHING)),
    Case("DDP straggler, forward (`straggler`)", _run("straggler"), {
        "auto": Expect("masked_straggler", (2,)),
        "no-communication": Expect("masked_straggler", (2,)),
        "steps": Expect(None, why=SHORT),
    }),
    Case("DDP straggler, op histograms 1 step in 256", _run("straggler-sampled-kernels-256"), {
        "auto": Expect("compute_straggler", (2,)),
        "no-communication": Expect("compute_straggler", (2,)),
        "steps": Expect("job_regression", lacks=STEPS_ONLY),
    }),
    Case("DDP slow data loader (`dataloader`)", _run("dataloader"), {
        "auto": Expect("dataloader_stall", (2,)),
        "no-communication": Expect("dataloader_stall", (2,)),
        "steps": Expect(None, why=SHORT),
    }),
    Case("DDP slow data loader, phases sampled", _run("dataloader-sampled"), {
        "auto": Expect("dataloader_stall", (2,)),
        "no-communication": Expect("dataloader_stall", (2,)),
        "steps": Expect("job_regression", lacks=STEPS_ONLY),
    }),
    Case("DDP 3 s stall between phases (`stall`)", _run("stall"), {
        "auto": Expect("jit_stall", (2,)),
        "no-communication": Expect("jit_stall", (2,)),
        "steps": Expect(None, why=ONE_STEP),
    }),
    Case("DDP 1.5 s stall in forward (`jit`)", _run("jit"), {
        "auto": Expect("jit_stall", (2,)),
        "no-communication": Expect("jit_stall", (2,)),
        "steps": Expect(None, why=ONE_STEP),
    }),
    Case("DDP late to the all-reduce (`link-2`)", _run("link-2"), {
        "auto": Expect("link_degradation", (2, 3)),
        "no-communication": Expect("job_regression", lacks=HELD),
        "steps": Expect("job_regression", lacks=STEPS_ONLY),
    }),
    Case("DDP job-wide regression (`regression`)", _run("regression"), {
        "auto": Expect("job_regression"),
        "no-communication": Expect("job_regression"),
        "steps": Expect("job_regression", lacks=STEPS_ONLY),
    }),
    Case("pipeline pp 2 × dp 2, healthy (heavier last stage)", _pipeline("pp2x2-healthy"), {
        "auto": Expect("stage_imbalance", (2, 3)),
        "no-communication": Expect("stage_imbalance", (2, 3)),
        "steps": Expect(None, why=STRUCTURE),
    }),
    Case("pipeline pp 2 × dp 2, slow worker", _pipeline("pp2x2-slow-worker"), {
        "auto": Expect("masked_straggler", (1,)),
        "no-communication": Expect("masked_straggler", (1,)),
        "steps": Expect("job_regression", lacks=STEPS_ONLY),
    }, truth=_pipeline_truth("pp2x2-slow-worker")),
    Case("pipeline pp 4 × dp 1, slow worker", _pipeline("pp4x1-slow-worker"), {
        "auto": Expect("masked_straggler", (1,)),
        "no-communication": Expect("masked_straggler", (1,)),
        "steps": Expect("job_regression", lacks=STEPS_ONLY),
    }, truth=_pipeline_truth("pp4x1-slow-worker")),
    Case("pipeline pp 2 × dp 2, heavy stage", _pipeline("pp2x2-heavy-stage"), {
        "auto": Expect("stage_imbalance", (0, 1)),
        "no-communication": Expect("stage_imbalance", (0, 1)),
        "steps": Expect(None, why=STRUCTURE),
    }, truth=_pipeline_truth("pp2x2-heavy-stage")),
    Case("pipeline pp 2 × dp 2, rotating microbatches", _pipeline("pp2x2-rotating-microbatches"), {
        "auto": Expect("job_regression"),
        "no-communication": Expect("job_regression"),
        "steps": Expect("job_regression", lacks=STEPS_ONLY),
    }),
    Case("pipeline pp 2 × dp 2, 3 s stall between phases", _pipeline("pp2x2-stall"), {
        "auto": Expect("jit_stall", (1,)),
        "no-communication": Expect(None, why=UNTIMED_PAUSE),
        "steps": Expect(None, why=ONE_STEP),
    }),
    Case("straggler, windows 0.3 s apart per rank", _misaligned, {
        "auto": Expect("masked_straggler", (2,)),
        "no-communication": Expect("masked_straggler", (2,)),
        "steps": Expect("job_regression", lacks=STEPS_ONLY),
    }, truth=_misaligned_truth()),
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Cell:
    case: Case
    layout: str
    found: tuple[Finding, ...]


@pytest.fixture(scope="module")
def matrix(influxd: ManagedInfluxDB) -> Iterator[dict[tuple[str, str], Cell]]:
    cells = {}
    for case in CASES:
        for layout in LAYOUTS:
            influx = influxd.client(database=f"matrix_{uuid.uuid4().hex[:10]}")
            influx.create_database()
            job, start, end = case.load(influx, layout)
            found = detect_job_findings(influx, job, start_unix_nano=start, end_unix_nano=end)
            cells[case.name, layout] = Cell(case, layout, tuple(found))
    yield cells


def _reference_cost(cells: dict[tuple[str, str], Cell], case: Case) -> float | None:
    if case.truth is not None:
        return case.truth
    found = cells[case.name, "auto"].found
    return found[0].diagnosis.slowdown if found else None


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_layout_gives_the_diagnosis_or_says_what_it_lacks(
    matrix: dict[tuple[str, str], Cell], case: Case
) -> None:
    reference = case.expect["auto"]
    for layout in LAYOUTS:
        expect, found = case.expect[layout], matrix[case.name, layout].found
        shown = [(f.diagnosis.kind, f.diagnosis.ranks) for f in found]
        if expect.kind is None:
            assert shown == [], (layout, shown)
            continue
        assert shown == [(expect.kind, expect.ranks)], (layout, [f.diagnosis for f in found])
        (finding,) = found
        if expect.lacks is not None:
            assert expect.lacks in finding.diagnosis.summary, (layout, finding.diagnosis.summary)
        same = (expect.kind, expect.ranks) == (reference.kind, reference.ranks)
        cost = _reference_cost(matrix, case)
        # A finding that says what its layout lacks may cost less: it says so.
        if cost is not None and expect.lacks is None and (same or case.truth is not None):
            assert finding.diagnosis.slowdown == pytest.approx(cost, rel=case.tolerance), layout


def test_no_raised_finding_rests_on_evidence_of_one(matrix: dict[tuple[str, str], Cell]) -> None:
    for cell in matrix.values():
        for finding in cell.found:
            diagnosis = finding.diagnosis
            if diagnosis.severity == "info" or not diagnosis.ranks:
                continue
            if diagnosis.kind in ("rank_missing", "hang"):  # presence, not a ratio
                continue
            evidence = max(finding.evidence, 1.0 / finding.evidence)
            assert evidence >= MIN_EVIDENCE, (cell.case.name, cell.layout, finding.diagnosis)


def render(matrix: dict[tuple[str, str], Cell]) -> str:
    """The docs table: a row per case, a column per layout."""
    lines = [
        "| real case | truth | " + " | ".join(HEADINGS[layout] for layout in LAYOUTS) + " |",
        "|---|---|" + "---|" * len(LAYOUTS),
    ]
    for case in CASES:
        truth = f"{case.truth:.2f}x" if case.truth is not None else "—"
        cells = []
        for layout in LAYOUTS:
            found, expect = matrix[case.name, layout].found, case.expect[layout]
            if not found:
                cells.append(f"nothing ({expect.why})" if expect.why else "nothing")
                continue
            text = "; ".join(_finding_text(f) for f in found)
            cells.append(text + (f" — says: “{expect.lacks}”" if expect.lacks else ""))
        lines.append(f"| {case.name} | {truth} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _finding_text(finding: Finding) -> str:
    diagnosis = finding.diagnosis
    ranks = ""
    if diagnosis.ranks:
        ranks = " rank " if len(diagnosis.ranks) == 1 else " ranks "
        ranks += ",".join(str(r) for r in diagnosis.ranks)
    info = " (info)" if diagnosis.severity == "info" else ""
    return f"`{diagnosis.kind}`{ranks} {diagnosis.slowdown:.2f}x{info}"


def test_the_docs_table_is_this_matrix(matrix: dict[tuple[str, str], Cell]) -> None:
    table = render(matrix)
    text = DOC.read_text()
    pattern = re.compile(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), re.DOTALL)
    if os.environ.get("STEPWATCH_WRITE_MATRIX") == "1":
        DOC.write_text(pattern.sub(f"{BEGIN}\n{table}\n{END}", text))
        text = DOC.read_text()
    match = pattern.search(text)
    assert match, f"docs/diagnosis.md has no {BEGIN} ... {END} block"
    assert match.group(1) == table, "run with STEPWATCH_WRITE_MATRIX=1 to rewrite the table"
