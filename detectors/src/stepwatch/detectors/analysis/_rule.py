"""The rule interface: each diagnosis kind is one module in ``analysis/rules`` defining ``RULE``.

Two shapes:

* :class:`EpisodeRule` — decides from one rank-episode's flagged metrics whether it is its
  kind (:class:`Signature`, tried in ``precedence`` order across every rule: the lowest
  matching one wins), then describes each merged group of such episodes
  (:class:`EpisodeGroup` → :class:`Description`). A description may name another kind
  (``masked_straggler`` on whole pipeline stages is a ``pipeline_bubble``).
* :class:`JobRule` — looks at the whole frame and at the verdicts found before it (episode
  rules first, then job rules by ``order``) and returns whole :class:`Verdict` objects.

The engine (:mod:`._analyse`) turns every :class:`Verdict` into a :class:`Finding`. A rule
never builds a :class:`~stepwatch.core.Diagnosis` itself, so what every finding carries
(its ``slowdown`` cost, the severity that follows from it, the score) is decided in one
place; a rule that measures its own cost says so in :attr:`Description.slowdown`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from stepwatch.core._errors import ConfigError
from stepwatch.detectors.analysis._config import DetectorConfig
from stepwatch.detectors.analysis._context import Context
from stepwatch.detectors.frame._progress import JobProgress

#: An episode's flagged metric names → the number of windows each was flagged in.
Flagged = Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class Kind:
    """A diagnosis kind, declared once by its rule module: every list of kinds derives from
    it (the schema's kinds, the cost model's sets, the waiter rules, the simulator's round of
    faults, the docs' tables).

    Attributes:
        name: the kind (the rule module's name).
        shows: what the data shows, one line (docs/schema.md's list of kinds).
        localised: what its findings name (ranks, hosts, phase, kernel class, stage).
        late_arrival: priced by the late-arrival what-if when its rule gives no cost
            (:func:`~._cost.estimate`).
        paced: its evidence is the rank's time in what paces the job, so it costs at most
            that ratio (:func:`~._analyse._costed`).
        own_work: its ranks' own work may lie inside the phase that holds the wait as well
            (:func:`~._cost._held_growth`).
        role: ``culprit`` (a rank doing its own work slowly), ``waiter`` (what a rank that only
            waits inside its pipeline can look like) or ``None``: without communication data,
            a waiter's finding yields to a culprit's in the same replicas.
        narrows_replicas: a group of it may hold its pipeline replica's waiters: only the
            ranks of each replica that waited least are kept.
        narrows_neighbours: in a data-parallel job, a group of it may hold neighbours slowed a
            little that still wait for the straggler: they are dropped.
        raise_bar: the :class:`~._config.DetectorConfig` field holding the smallest cost at
            which it is raised (with ``min_slowdown`` as a floor).
        warning_bar: the field holding the smallest cost at which it is a warning (below
            it, ``info``); ``None``: :func:`severity_of` alone decides.
        simulated: its place in the simulator's round of fault kinds; ``None``: the simulator
            does not inject it.
    """

    name: str
    shows: str
    localised: str = ""
    late_arrival: bool = False
    paced: bool = False
    own_work: bool = False
    role: str | None = None
    narrows_replicas: bool = False
    narrows_neighbours: bool = False
    raise_bar: str = "min_slowdown"
    warning_bar: str | None = None
    simulated: int | None = None

    def __post_init__(self) -> None:
        if self.role not in (None, "culprit", "waiter"):
            raise ConfigError(f"kind {self.name}: role must be culprit, waiter or None")


@dataclasses.dataclass(frozen=True)
class Signature:
    """A pattern of flagged metrics that makes an episode one kind.

    Attributes:
        precedence: rank among every rule's signatures; the lowest matching one wins, so a
            more specific signature (SM clock low) takes precedence over a broader one.
        matches: whether an episode's flagged metrics show the pattern.
        shows: the pattern in words (docs/diagnosis.md's classification table).
    """

    precedence: int
    matches: Callable[[Flagged], bool]
    shows: str = ""


@dataclasses.dataclass(frozen=True)
class EpisodeGroup:
    """Episodes of one kind on one or more ranks, merged where they overlap in time.

    Attributes:
        indices: the ranks (indices into the frame), sorted.
        first: first window (the onset walked back from the first flag).
        last: last flagged window.
        detected: first flagged window (when an incremental run raised it).
        episodes: each merged rank's own ``(rank, first, last, detected)``.
    """

    indices: tuple[int, ...]
    first: int
    last: int
    detected: int
    episodes: tuple[tuple[int, int, int, int], ...] = ()

    @property
    def span(self) -> slice:
        """The windows ``first .. last``."""
        return slice(self.first, self.last + 1)

    def with_indices(self, indices: Sequence[int]) -> EpisodeGroup:
        """The same windows on other ranks (a host, a pipeline stage)."""
        return dataclasses.replace(self, indices=tuple(indices))

    def narrowed(self, indices: Sequence[int]) -> EpisodeGroup:
        """The group kept to ``indices``, some of its own ranks, over their own episodes'
        windows: ranks dropped as waiters or noise take their windows with them (a noisy
        rank flagged a minute before a stall merged with it must not date its onset)."""
        kept = set(indices)
        own = [e for e in self.episodes if e[0] in kept]
        if not own or {e[0] for e in own} != kept:
            return self.with_indices(sorted(kept))
        return EpisodeGroup(
            tuple(sorted(kept)),
            min(e[1] for e in own),
            max(e[2] for e in own),
            min(e[3] for e in own),
            tuple(own),
        )


@dataclasses.dataclass(frozen=True)
class Description:
    """What a rule concludes about a group of ranks, before timing and scoring.

    Attributes:
        kind: the docs/schema.md kind.
        summary: one line for people, e.g. ``rank 5 backward compute 1.31x peers since ...``.
        ratio: the effect against the peers (or the job's shift; 1 when none applies); it
            sets an episode finding's severity.
        phase: the phase that moved, if any.
        kernel_class: the kernel class that moved, if any.
        indices: the ranks blamed (indices into the frame), empty for job-wide findings.
        hosts: the hosts blamed.
        slowdown: the finding's cost when the rule measures it itself (the what-if slowdown
            of the job's step); ``None``: the engine estimates it (:mod:`._cost`), or, for
            kinds it has no model for, the finding carries 1.0 and keeps its severity.
    """

    kind: str
    summary: str
    ratio: float
    phase: str | None = None
    kernel_class: str | None = None
    indices: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    slowdown: float | None = None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A finding in window indices: what the engine turns into a :class:`Finding`.

    Attributes:
        description: kind, localisation and summary.
        first: first window of the condition.
        last: last window showing it.
        detected: window at which it was confirmed (flags only use past windows).
        open: still going at the end of the frame (the diagnosis has no end yet).
        severity: ``info``, ``warning`` or ``critical``; the engine replaces it with the
            severity of the finding's cost whenever it has one (:func:`severity_of`).
        score: strength of the evidence (robust z for rank findings).
    """

    description: Description
    first: int
    last: int
    detected: int
    open: bool
    severity: str
    score: float


@dataclasses.dataclass(frozen=True)
class EpisodeRule:
    """A kind decided per rank-episode from its flagged metrics.

    Attributes:
        declared: the kind the rule names (its module's name) and what it is.
        signatures: the patterns that make an episode this kind; empty when the kind is
            only reached from another rule's description (``pipeline_bubble``).
        describe: the :class:`Description` of one merged group.
        narrow: the group kept to the ranks the kind blames (``None``: all of them).
    """

    declared: Kind
    signatures: tuple[Signature, ...]
    describe: Callable[[Context, EpisodeGroup], Description]
    narrow: Callable[[Context, EpisodeGroup], EpisodeGroup] | None = None

    @property
    def kind(self) -> str:
        return self.declared.name


@dataclasses.dataclass(frozen=True)
class JobRule:
    """A kind decided over the whole frame.

    Attributes:
        declared: the kind the rule names (its module's name) and what it is.
        order: job rules run by increasing order, each seeing the verdicts before it.
        find: the verdicts, given the context and the verdicts found so far.
        probe: the same decision from where each rank is now alone (a
            :class:`~stepwatch.detectors.frame.JobProgress` and the thresholds), for the
            detector service's probe between full passes; ``None``: the rule needs windows.
    """

    declared: Kind
    order: int
    find: Callable[[Context, Sequence[Verdict]], list[Verdict]]
    probe: Callable[[JobProgress, DetectorConfig], Sequence[Probed]] | None = None

    @property
    def kind(self) -> str:
        return self.declared.name


class Probed(Protocol):
    """What a rule's probe found (a ``hang``): where, since when, what it costs so far."""

    @property
    def ranks(self) -> tuple[int, ...]: ...

    @property
    def hosts(self) -> tuple[str, ...]: ...

    @property
    def phase(self) -> str | None: ...

    @property
    def onset_unix_nano(self) -> int: ...

    @property
    def threshold_s(self) -> float: ...

    @property
    def summary(self) -> str: ...

    @property
    def slowdown(self) -> float: ...

    @property
    def score(self) -> float: ...


Rule = EpisodeRule | JobRule


@dataclasses.dataclass(frozen=True)
class Registry:
    """Every rule, ready to classify episodes.

    Attributes:
        episode_rules: by kind.
        job_rules: in the order they run.
        precedence: every episode rule's signatures, lowest precedence first.
    """

    episode_rules: Mapping[str, EpisodeRule]
    job_rules: tuple[JobRule, ...]
    precedence: tuple[tuple[Signature, EpisodeRule], ...]

    @classmethod
    def of(cls, rules: Sequence[Rule]) -> Registry:
        """Index ``rules``.

        Raises:
            ConfigError: a kind or a signature precedence is given twice.
        """
        kinds = sorted(rule.kind for rule in rules)
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"rules: a kind has two rules: {kinds}")
        episode_rules = [rule for rule in rules if isinstance(rule, EpisodeRule)]
        job_rules = [rule for rule in rules if isinstance(rule, JobRule)]
        signatures = [(s, rule) for rule in episode_rules for s in rule.signatures]
        precedences = sorted(signature.precedence for signature, _ in signatures)
        if len(set(precedences)) != len(precedences):
            raise ConfigError(f"rules: two signatures share a precedence: {precedences}")
        return cls(
            episode_rules={rule.kind: rule for rule in episode_rules},
            job_rules=tuple(sorted(job_rules, key=lambda rule: rule.order)),
            precedence=tuple(sorted(signatures, key=lambda pair: pair[0].precedence)),
        )

    @property
    def kinds(self) -> frozenset[str]:
        """Every kind a rule names."""
        return frozenset(self.episode_rules) | {rule.kind for rule in self.job_rules}

    @property
    def rules(self) -> tuple[Rule, ...]:
        """Every rule: the episode rules, then the job rules in their order."""
        return (*self.episode_rules.values(), *self.job_rules)

    @property
    def declared(self) -> tuple[Kind, ...]:
        """Every kind's declaration: the simulated ones in the simulator's order, then the
        others by name."""
        kinds = [rule.declared for rule in self.rules]
        return tuple(sorted(kinds, key=lambda k: (k.simulated is None, k.simulated or 0, k.name)))

    def kind(self, name: str) -> Kind:
        """The declaration of kind ``name``.

        Raises:
            ConfigError: no rule names it.
        """
        for declared in self.declared:
            if declared.name == name:
                return declared
        raise ConfigError(f"rules: no rule names the kind {name!r}")

    def probes(self) -> tuple[JobRule, ...]:
        """The job rules that decide from where the ranks are now (the service's probe)."""
        return tuple(rule for rule in self.job_rules if rule.probe is not None)

    def having(self, trait: Callable[[Kind], bool]) -> frozenset[str]:
        """The kinds whose declaration has ``trait``."""
        return frozenset(k.name for k in self.declared if trait(k))

    def classify(self, flagged: Flagged) -> EpisodeRule:
        """The rule of the lowest-precedence signature that matches ``flagged``.

        Raises:
            ConfigError: no signature matches (the rules lack a catch-all).
        """
        for signature, rule in self.precedence:
            if signature.matches(flagged):
                return rule
        raise ConfigError(f"rules: no signature matches the flags {sorted(flagged)}")


def severity_of(ratio: float) -> str:
    """``critical`` from 1.2x (or 1/1.2x), ``warning`` from 1.05x, else ``info``.

    Applied to a finding's cost (its slowdown of the job's step), or to a rule's ratio when
    the finding has no cost.
    """
    ratio = max(ratio, 1.0 / ratio) if ratio > 0 else 1.0
    if ratio >= 1.2:
        return "critical"
    if ratio >= 1.05:
        return "warning"
    return "info"


def severity_for(config: DetectorConfig, declared: Kind, slowdown: float) -> str:
    """The severity of a finding of kind ``declared`` that costs ``slowdown``."""
    if declared.warning_bar is not None and slowdown < float(getattr(config, declared.warning_bar)):
        return "info"
    return severity_of(slowdown)


def raise_bar(config: DetectorConfig, declared: Kind) -> float:
    """The smallest cost at which a finding of kind ``declared`` is raised."""
    return max(config.min_slowdown, float(getattr(config, declared.raise_bar)))
