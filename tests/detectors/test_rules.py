"""The rule registry: one small module per kind, the kinds the schema names, the precedence."""

from __future__ import annotations

import pkgutil

import pytest

from stepwatch.core import ConfigError
from stepwatch.detectors.analysis import rules
from stepwatch.detectors.analysis._rule import (
    Description,
    EpisodeRule,
    JobRule,
    Registry,
    Signature,
)


def test_each_rule_is_one_module_named_after_its_kind() -> None:
    # Size follows cohesion: function complexity and length are ruff's (C901, PLR0915).
    modules = [info.name for info in pkgutil.iter_modules(rules.__path__)]
    assert sorted(modules) == sorted(rules.registry().kinds)


@pytest.mark.parametrize(
    ("flagged", "kind"),
    [
        # Today's classification order, most specific first (it was one if-chain).
        ({"clock", "burst:step", "phase:data"}, "gpu_health"),
        ({"stall:forward", "phase:data", "category:compute"}, "jit_stall"),
        ({"burst:idle"}, "jit_stall"),
        ({"phase:data", "share:gemm", "idle"}, "dataloader_stall"),
        ({"category:compute", "idle", "step"}, "compute_straggler"),
        ({"share:(minor classes)"}, "compute_straggler"),
        ({"idle", "step"}, "masked_straggler"),
        ({"phase:backward", "phase:communication"}, "masked_straggler"),
        ({"step", "phase:other"}, "link_degradation"),
        ({"arrival": 3}, "link_degradation"),
        ({"arrival": 2}, "jit_stall"),  # late in one or two windows alone: a pause
        ({"category:communication"}, "link_degradation"),
        ({"phase:other"}, "masked_straggler"),
        ({"category:memory"}, "compute_straggler"),  # nothing more specific: the catch-all
    ],
)
def test_precedence_reproduces_the_classification_order(
    flagged: set[str] | dict[str, int], kind: str
) -> None:
    counts = flagged if isinstance(flagged, dict) else dict.fromkeys(flagged, 1)
    assert rules.registry().classify(counts).kind == kind


def test_signatures_are_tried_by_precedence_and_job_rules_by_order() -> None:
    registry = rules.registry()
    order = [signature.precedence for signature, _ in registry.precedence]
    assert order == sorted(order)
    job_rules = [rule.kind for rule in registry.job_rules]
    assert job_rules == [
        "rank_missing",
        "stage_imbalance",
        "workload_imbalance",
        "job_regression",
        "hang",
    ]
    # pipeline_bubble has no signature of its own: masked_straggler hands whole stages over.
    assert registry.episode_rules["pipeline_bubble"].signatures == ()


def _describe_nothing(context: object, group: object) -> Description:
    raise AssertionError("not called")


def test_a_new_kind_is_one_rule_and_takes_its_place_by_precedence() -> None:
    new = EpisodeRule(
        declared=rules.registry().kind("stage_imbalance"),
        signatures=(Signature(5, lambda flagged: "clock" in flagged and "idle" in flagged),),
        describe=_describe_nothing,
    )
    registry = Registry.of([*rules.registry().episode_rules.values(), new])
    assert registry.classify({"clock": 2, "idle": 1}).kind == "stage_imbalance"
    assert registry.classify({"clock": 2}).kind == "gpu_health"


def test_registry_refuses_clashes_and_a_missing_catch_all() -> None:
    gpu = rules.registry().episode_rules["gpu_health"]
    with pytest.raises(ConfigError, match="kind"):
        Registry.of([gpu, gpu])
    twin = EpisodeRule(
        rules.registry().kind("jit_stall"), (Signature(10, bool),), _describe_nothing
    )
    with pytest.raises(ConfigError, match="precedence"):
        Registry.of([gpu, twin])
    job = JobRule(rules.registry().kind("rank_missing"), 1, lambda context, earlier: [])
    with pytest.raises(ConfigError, match="no signature"):
        Registry.of([gpu, job]).classify({"step": 3})
