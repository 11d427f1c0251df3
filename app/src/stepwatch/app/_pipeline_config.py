"""What a pipeline job does (``stepwatch.app._pipeline_job``): its configuration, when its
faults are active (in the recorded steps and the truth blocks), how its blocks are partitioned
into stages, how much device time each part of the model stands for, and the sequence lengths
each replica reads."""

from __future__ import annotations

import dataclasses
import random

from stepwatch.core._errors import ConfigError

#: The faults :class:`PipelineJobConfig` injects.
FAULTS = ("healthy", "slow-worker", "heavy-stage", "rotating-microbatches", "stall")
#: Faults on one rank (``fault_rank``).
RANK_FAULTS = ("slow-worker", "stall")
#: Faults present from step 0: the structure of the job, not an event.
STRUCTURAL_FAULTS = ("healthy", "heavy-stage")
#: How long the ``stall`` fault stops its rank.
STALL_S = 3.0
#: ``rotating-microbatches``: the longest replica's sequences are this much above the mean
#: length, the others' below it by the same total.
ROTATION_SPREAD = 0.4
#: ``rotating-microbatches``: each microbatch's length varies by up to this fraction more.
ROTATION_JITTER = 0.15
#: The loss head's device time (a vocabulary projection and cross-entropy), in blocks: about
#: one transformer layer's, as in real LLMs with 6-12 layers a stage.
HEAD_BLOCKS = 1.0
#: The embedding's device time (a lookup), in blocks.
EMBEDDING_BLOCKS = 0.1
#: A backward's device time over its forward's (gradients of the inputs and of the weights).
BACKWARD_FACTOR = 2.0
#: The truth's series of paired blocks: ``fault`` (with the fault and without; for
#: ``healthy`` the same job twice) and, for ``healthy`` only, ``even-head`` (the job as it is
#: and with the loss head's device time spread evenly over the stages).
TRUTH_SERIES = ("fault", "even-head")


@dataclasses.dataclass(frozen=True)
class PipelineJobConfig:
    """What one pipeline job does.

    ``fault_rank`` (a rank fault) defaults to rank 1: stage 0's second replica with
    ``dp`` 2, stage 1 with ``dp`` 1. ``fault_stage`` (``heavy-stage``) defaults to stage 1 when
    there are more than two stages, else stage 0: never the last stage, whose loss head
    already makes it heavier. ``device_ms_per_block``: the device time one block's forward
    stands for on one microbatch of ``seq_len`` tokens (its backward ``BACKWARD_FACTOR`` times
    that; 0: no device time, the small real compute alone). ``result_file``: where rank 0
    writes what the job measured with its own clock (JSON: ``_pipeline_truth.results_of``).
    """

    job_id: str
    pp: int = 2
    dp: int = 2
    microbatches: int = 8
    steps: int = 300
    fault: str = "healthy"
    fault_rank: int | None = None
    fault_stage: int | None = None
    fault_step: int = 120
    fault_factor: float = 2.0
    truth_pairs: int = 0
    truth_block_steps: int = 5
    endpoint: str = "http://127.0.0.1:4318"
    export_interval_s: float = 0.25
    hidden: int = 32
    seq_len: int = 16
    batch: int = 8
    vocab: int = 256
    blocks_per_stage: int = 6
    device_ms_per_block: float = 0.5
    seed: int = 1234
    result_file: str | None = None

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ConfigError(f"fault: {self.fault!r} is not one of {FAULTS}")
        if self.pp < 2:
            raise ConfigError(f"pp: a pipeline needs at least 2 stages, got {self.pp}")
        if self.dp < 1:
            raise ConfigError(f"dp: must be positive, got {self.dp}")
        if self.microbatches < 1:
            raise ConfigError(f"microbatches: must be positive, got {self.microbatches}")
        if self.steps < 1:
            raise ConfigError(f"steps: must be positive, got {self.steps}")
        if not 0 <= self.faulty_rank < self.world_size:
            raise ConfigError(f"fault_rank: {self.faulty_rank} is not a rank of this job")
        if not 0 <= self.heavy_stage < self.pp:
            raise ConfigError(f"fault_stage: {self.heavy_stage} is not a stage of this job")
        if self.fault == "rotating-microbatches" and self.dp < 2:
            raise ConfigError("fault: rotating-microbatches needs dp >= 2 (replicas to rotate)")
        if self.fault_factor <= 1.0:
            raise ConfigError(f"fault_factor: must exceed 1.0, got {self.fault_factor}")
        if self.truth_pairs < 0 or self.truth_block_steps < 2:
            raise ConfigError("truth_pairs must be >= 0 and truth_block_steps >= 2")
        if self.blocks_per_stage < 1:
            raise ConfigError(f"blocks_per_stage: must be positive, got {self.blocks_per_stage}")
        if not 0.0 <= self.device_ms_per_block <= 1000.0:
            raise ConfigError(
                f"device_ms_per_block: must be in [0, 1000], got {self.device_ms_per_block}"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def truth_series(self) -> tuple[str, ...]:
        """The series of paired truth blocks this job runs, in order (``TRUTH_SERIES``)."""
        return TRUTH_SERIES if self.fault == "healthy" else TRUTH_SERIES[:1]

    @property
    def series_blocks(self) -> int:
        """Truth blocks in one series: ``truth_pairs`` pairs."""
        return 2 * self.truth_pairs

    @property
    def total_steps(self) -> int:
        """The recorded steps and the truth blocks' steps."""
        blocks = len(self.truth_series) * self.series_blocks
        return self.steps + blocks * self.truth_block_steps

    @property
    def faulty_rank(self) -> int:
        return 1 if self.fault_rank is None else self.fault_rank

    @property
    def heavy_stage(self) -> int:
        if self.fault_stage is not None:
            return self.fault_stage
        return 1 if self.pp > 2 else 0

    @property
    def onset_step(self) -> int | None:
        """The first recorded step with the fault (None: structural, present from step 0)."""
        return None if self.fault in STRUCTURAL_FAULTS else self.fault_step

    def coordinates(self, rank: int) -> tuple[int, int]:
        """``(pp_rank, dp_rank)`` of ``rank``."""
        return divmod(rank, self.dp)

    def rank_of(self, stage: int, replica: int) -> int:
        return stage * self.dp + replica


def fault_active(config: PipelineJobConfig, step: int) -> bool:
    """Whether ``step`` runs with the fault: from ``fault_step`` in the recorded steps (from
    step 0 for a structural fault); in the truth blocks, the blocks with the fault."""
    if config.fault == "healthy":
        return False
    if step >= config.steps:
        block = truth_block(config, step)
        return block is not None and block[1]
    if config.fault in STRUCTURAL_FAULTS:
        return True
    return step >= config.fault_step


def truth_block(config: PipelineJobConfig, step: int) -> tuple[int, bool] | None:
    """``(block index, with the fault)`` of a truth step; None for a recorded step.

    Blocks are numbered over every series (``config.truth_series``), one series after the
    other."""
    index = (step - config.steps) // config.truth_block_steps
    if step < config.steps or index >= len(config.truth_series) * config.series_blocks:
        return None
    return index, block_faulty(config, index)


def block_series(config: PipelineJobConfig, index: int) -> str:
    """The series (``TRUTH_SERIES``) that truth block ``index`` belongs to."""
    return config.truth_series[index // config.series_blocks]


def block_faulty(config: PipelineJobConfig, index: int) -> bool:
    """Whether truth block ``index`` runs with the fault (in ``even-head``: with the loss
    head's device time on the last stage, as the job is).

    Pair ``k`` of a series holds its blocks ``2k`` and ``2k + 1``; even pairs run the fault
    second, odd pairs first (ABBA), so a drift of the host's load cancels over two pairs.
    ``healthy``'s ``fault`` blocks never have a fault (an A/A comparison).
    """
    local = index % config.series_blocks
    second = local % 2 == 1
    faulty = second if (local // 2) % 2 == 0 else not second
    return faulty and (config.fault != "healthy" or block_series(config, index) == "even-head")


def head_spread(config: PipelineJobConfig, step: int) -> bool:
    """Whether ``step`` runs with the loss head's device time spread evenly over the stages
    (``healthy``'s ``even-head`` blocks without the fault) instead of on the last stage."""
    block = truth_block(config, step)
    if config.fault != "healthy" or block is None:
        return False
    return block_series(config, block[0]) == "even-head" and not block[1]


def blocks_held(config: PipelineJobConfig, stage: int) -> int:
    """How many blocks ``stage`` holds: ``blocks_per_stage``, and with ``heavy-stage`` what
    both partitions of the same model need (:func:`blocks_run`)."""
    if config.fault != "heavy-stage":
        return config.blocks_per_stage
    return max(uneven_partition(config)[stage], even_partition(config)[stage])


def uneven_partition(config: PipelineJobConfig) -> list[int]:
    """``heavy-stage``'s blocks per stage with the fault: the heavy stage holds twice
    ``blocks_per_stage`` (as many blocks more as a stage has), the others ``blocks_per_stage``."""
    base = config.blocks_per_stage
    return [2 * base if stage == config.heavy_stage else base for stage in range(config.pp)]


def even_partition(config: PipelineJobConfig) -> list[int]:
    """The same blocks as :func:`uneven_partition`, partitioned as evenly as whole blocks allow.

    Every stage gets ``total // pp`` blocks; the remainder goes one block each to the stages
    with the least device time beside their blocks: the middle stages, then the first (the
    embedding), the last (the loss head) last.
    """
    total = sum(uneven_partition(config))
    counts = [total // config.pp] * config.pp
    extra = [0.0] * config.pp
    extra[0] += EMBEDDING_BLOCKS
    extra[-1] += HEAD_BLOCKS
    for stage in sorted(range(config.pp), key=lambda s: extra[s])[: total % config.pp]:
        counts[stage] += 1
    return counts


def blocks_run(config: PipelineJobConfig, stage: int, step: int) -> int:
    """How many of its blocks ``stage`` runs at ``step``.

    ``heavy-stage`` partitions one model two ways: unevenly while the fault is active
    (:func:`uneven_partition`) and evenly in the truth blocks without it
    (:func:`even_partition`), so the truth is what re-partitioning the same blocks saves.
    """
    if config.fault != "heavy-stage":
        return config.blocks_per_stage
    if fault_active(config, step):
        return uneven_partition(config)[stage]
    return even_partition(config)[stage]


def stall_step(config: PipelineJobConfig, step: int) -> bool:
    """Whether the ``stall`` fault stops its rank at the end of ``step``: at ``fault_step``,
    and in the middle of each truth block with the fault."""
    if config.fault != "stall":
        return False
    if step < config.steps:
        return step == config.fault_step
    block = truth_block(config, step)
    if block is None or not block[1]:
        return False
    offset = (step - config.steps) % config.truth_block_steps
    return offset == config.truth_block_steps // 2


def sequence_lengths(config: PipelineJobConfig, step: int, replica: int) -> list[int]:
    """The sequence length of each of ``replica``'s microbatches at ``step``.

    Every rank computes the same lengths (a seeded generator per step and replica), so a
    stage knows the shape of what its neighbour sends. ``rotating-microbatches`` makes
    replica ``step % dp`` the longest: ``1 + ROTATION_SPREAD`` times the mean length, the
    others shorter by as much in all, each microbatch varying by ``±ROTATION_JITTER`` more.
    """
    base = config.seq_len
    if config.fault != "rotating-microbatches" or not fault_active(config, step):
        return [base] * config.microbatches
    if replica == step % config.dp:
        scale = 1.0 + ROTATION_SPREAD
    else:
        scale = 1.0 - ROTATION_SPREAD / (config.dp - 1)
    draw = random.Random(config.seed * 1_000_003 + step * 131 + replica)
    return [
        max(1, round(base * scale * draw.uniform(1 - ROTATION_JITTER, 1 + ROTATION_JITTER)))
        for _ in range(config.microbatches)
    ]
