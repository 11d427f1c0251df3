"""Where a simulated rank sits: its ``DP x TP x PP`` coordinates and its host."""

from __future__ import annotations

import dataclasses

from stepwatch.core._errors import ConfigError

RANKS_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class Topology:
    """Parallel layout ``DP x TP x PP``; rank = ``pp*(dp*tp) + dp_i*tp + tp_i``."""

    dp: int
    tp: int = 1
    pp: int = 1

    @classmethod
    def parse(cls, text: str) -> Topology:
        parts = text.lower().split("x")
        try:
            numbers = [int(part) for part in parts]
        except ValueError as exc:
            raise ConfigError(f"topology: {text!r} is not DPxTPxPP") from exc
        if not 1 <= len(numbers) <= 3 or min(numbers) < 1:
            raise ConfigError(f"topology: {text!r} is not DPxTPxPP with positive sizes")
        numbers += [1] * (3 - len(numbers))
        return cls(numbers[0], numbers[1], numbers[2])

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.dp * self.tp)

    def __str__(self) -> str:
        return f"{self.dp}x{self.tp}x{self.pp}"


def host_of(rank: int) -> str:
    """Host name of a simulated rank (8 ranks per host)."""
    return f"node-{rank // RANKS_PER_HOST:04d}"
