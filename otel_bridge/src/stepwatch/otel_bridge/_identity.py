"""One producer per (job, rank): the bridge's duplicate-rank guard.

Two processes claiming the same ``stepwatch.job.id`` and ``stepwatch.rank`` from different
hosts (a misconfigured launcher, or a rank restarted on another node while the old one still
exports) would interleave two different time series under one rank's tags, and every
per-rank detector would read garbage. The guard remembers, per (job, rank), the identity of the
producer it last accepted (``host.name`` and, when sent, ``service.instance.id`` and
``process.pid``) and when it last heard from it:

* same identity, or a (job, rank) never seen: accepted;
* another identity while the known producer was heard from within ``takeover_after_s``:
  the newcomer's points are rejected (``duplicate_rank``) and the first producer keeps the rank;
* another identity after the known producer has been silent for ``takeover_after_s``: the
  newcomer takes the rank over (a restarted rank), counted as a takeover.

Detection is per bridge process and best effort: bridges share no state, so two producers
whose connections land on different bridge processes are not seen by either. Memory is bounded
by ``max_ranks`` entries (least recently heard rank forgotten first). Producers that send none
of the identity attributes are never flagged.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import threading
from collections.abc import Mapping, Sequence

from stepwatch.core import _schema
from stepwatch.core._errors import ConfigError

IDENTITY_KEYS: tuple[str, ...] = (_schema.HOST_NAME, "service.instance.id", "process.pid")
"""Resource attributes that tell two producers of one (job, rank) apart."""


class Verdict(enum.Enum):
    """What the guard decided about one resource."""

    UNTRACKED = "untracked"  # no job, rank or identity attributes: not checked
    NEW = "new"  # first producer seen for this (job, rank)
    SAME = "same"  # the known producer
    TAKEOVER = "takeover"  # another producer after the known one went silent
    CONFLICT = "conflict"  # another producer while the known one is live: reject


@dataclasses.dataclass
class _Owner:
    identity: tuple[str, ...]
    last_seen_unix_nano: int


class RankIdentityGuard:
    """Remembers which producer owns each (job, rank) and refuses a live duplicate.

    Args:
        takeover_after_s: silence of the known producer after which another producer may take
            its rank over (make it a few export intervals: a restarted rank is refused for at
            most this long).
        max_ranks: (job, rank) pairs remembered at once.
        identity_keys: resource attributes that identify a producer.

    Example:
        >>> guard = RankIdentityGuard(takeover_after_s=30)
        >>> a = {"stepwatch.job.id": "j", "stepwatch.rank": "0", "host.name": "node-a"}
        >>> b = {**a, "host.name": "node-b"}
        >>> [guard.observe(a, now_unix_nano=0).value, guard.observe(b, now_unix_nano=10**9).value]
        ['new', 'conflict']
        >>> guard.observe(b, now_unix_nano=40 * 10**9).value
        'takeover'
    """

    def __init__(
        self,
        *,
        takeover_after_s: float = 30.0,
        max_ranks: int = 200_000,
        identity_keys: Sequence[str] = IDENTITY_KEYS,
    ) -> None:
        if not takeover_after_s > 0:
            raise ConfigError(f"takeover_after_s: must be positive, got {takeover_after_s}")
        if max_ranks <= 0:
            raise ConfigError(f"max_ranks: must be positive, got {max_ranks}")
        if not identity_keys or isinstance(identity_keys, str):
            raise ConfigError(f"identity_keys: need a sequence of keys, got {identity_keys!r}")
        self.takeover_after_s = float(takeover_after_s)
        self.max_ranks = max_ranks
        self.identity_keys = tuple(identity_keys)
        self._takeover_ns = int(takeover_after_s * 1e9)
        self._owners: collections.OrderedDict[tuple[str, str], _Owner] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._owners)

    def observe(self, attributes: Mapping[str, str], *, now_unix_nano: int) -> Verdict:
        """Record one resource's export and decide whether its points are accepted.

        Args:
            attributes: the resource's scalar attributes as strings.
            now_unix_nano: the bridge's receive time.

        Returns:
            The verdict; only :attr:`Verdict.CONFLICT` means "reject".
        """
        job = attributes.get(_schema.JOB_ID)
        rank = attributes.get(_schema.RANK)
        identity = tuple(attributes.get(key, "") for key in self.identity_keys)
        if not job or rank is None or not any(identity):
            return Verdict.UNTRACKED
        key = (job, rank)
        with self._lock:
            owner = self._owners.get(key)
            if owner is None:
                self._owners[key] = _Owner(identity, now_unix_nano)
                while len(self._owners) > self.max_ranks:
                    self._owners.popitem(last=False)
                return Verdict.NEW
            if owner.identity == identity:
                owner.last_seen_unix_nano = max(owner.last_seen_unix_nano, now_unix_nano)
                self._owners.move_to_end(key)
                return Verdict.SAME
            if now_unix_nano - owner.last_seen_unix_nano >= self._takeover_ns:
                owner.identity = identity
                owner.last_seen_unix_nano = now_unix_nano
                self._owners.move_to_end(key)
                return Verdict.TAKEOVER
            return Verdict.CONFLICT  # the newcomer does not refresh the owner's lease

    def owner(self, job: str, rank: str) -> tuple[str, ...] | None:
        """The identity currently owning (job, rank), or None."""
        with self._lock:
            owner = self._owners.get((job, rank))
            return None if owner is None else owner.identity
