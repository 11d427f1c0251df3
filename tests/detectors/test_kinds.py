"""A kind is declared once, by its rule module; every list of kinds is made from that.

The docs' tables (docs/schema.md's kinds, docs/diagnosis.md's classification) are the
declarations' output (``STEPWATCH_WRITE_DOCS=1`` rewrites them); a kind declared in a test
fixture, with no other edit, appears in both tables, in the cost model's and the waiter
rules' sets, in the simulator's round (whose coverage then asks for its fault model), and
is a kind a diagnosis record takes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from stepwatch.core import Diagnosis
from stepwatch.detectors.analysis import rules
from stepwatch.detectors.analysis._catalogue import classification_table, kinds_table
from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.analysis._rule import (
    Description,
    EpisodeGroup,
    EpisodeRule,
    Kind,
    Registry,
    Signature,
)
from stepwatch.detectors.simulation._faults import FAULT_MODELS
from stepwatch.detectors.simulation._truth import SIMULATED_KINDS, simulated_kinds

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _block(path: Path, name: str, table: str) -> None:
    """``path``'s generated block ``name`` holds ``table`` (rewritten first when asked)."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    pattern = re.compile(re.escape(begin) + r"\n(.*?)\n" + re.escape(end), re.DOTALL)
    text = path.read_text()
    if os.environ.get("STEPWATCH_WRITE_DOCS") == "1":
        path.write_text(pattern.sub(lambda _: f"{begin}\n{table}\n{end}", text))
        text = path.read_text()
    match = pattern.search(text)
    assert match, f"{path.name} has no {begin} ... {end} block"
    assert match.group(1) == table, f"run with STEPWATCH_WRITE_DOCS=1 to rewrite {path.name}"


def test_the_schema_lists_the_declared_kinds() -> None:
    _block(DOCS / "schema.md", "kinds", kinds_table(rules.registry()))


def test_the_diagnosis_docs_list_the_declared_signatures() -> None:
    _block(DOCS / "diagnosis.md", "classification", classification_table(rules.registry()))


def test_the_simulator_has_a_fault_model_for_every_kind_declared_simulated() -> None:
    assert set(SIMULATED_KINDS) <= FAULT_MODELS
    assert "hang" not in SIMULATED_KINDS and "slow_rank" not in SIMULATED_KINDS


def _describe(context: Context, group: EpisodeGroup) -> Description:
    return Description("noisy_neighbour", "a neighbour", 1.5, indices=group.indices)


NEW = EpisodeRule(
    declared=Kind(
        name="noisy_neighbour",
        shows="a rank slowed by another job sharing its host",
        localised="ranks",
        late_arrival=True,
        paced=True,
        role="culprit",
        simulated=11,
    ),
    signatures=(Signature(45, lambda flagged: "phase:other" in flagged, "`phase:other`"),),
    describe=_describe,
)


def test_a_kind_declared_once_appears_everywhere() -> None:
    registry = Registry.of([*rules.registry().rules, NEW])
    assert "| `noisy_neighbour` | a rank slowed by another job sharing its host | ranks |" in (
        kinds_table(registry)
    )
    assert "| 45 | `phase:other` | `noisy_neighbour` |" in classification_table(registry)
    assert "noisy_neighbour" in registry.having(lambda kind: kind.late_arrival)
    assert "noisy_neighbour" in registry.having(lambda kind: kind.role == "culprit")
    assert simulated_kinds(registry)[-1] == "noisy_neighbour"
    # The simulator's coverage asks for its fault model:
    assert set(simulated_kinds(registry)) - FAULT_MODELS == {"noisy_neighbour"}
    assert registry.classify({"phase:other": 3}).kind == "noisy_neighbour"
    record = Diagnosis(
        job="j",
        kind="noisy_neighbour",
        start_unix_nano=0,
        end_unix_nano=None,
        severity="warning",
        score=1.0,
        summary="s",
    )
    assert record.to_json_dict()["kind"] == "noisy_neighbour"


def test_a_kind_twice_or_a_shared_precedence_is_refused() -> None:
    with pytest.raises(Exception, match="two rules"):
        Registry.of([*rules.registry().rules, NEW, NEW])
