"""The 1F1B pipeline schedule: what one stage computes and transfers, in order."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Compute:
    """One microbatch's ``forward`` or ``backward`` on this stage."""

    kind: str
    microbatch: int


@dataclasses.dataclass(frozen=True)
class Transfer:
    """Point-to-point operations issued together and then waited for together.

    Each is ``(op, microbatch)``: ``send_forward`` (this stage's output to the next stage),
    ``recv_forward`` (the previous stage's output), ``send_backward`` (the gradient of this
    stage's input to the previous stage), ``recv_backward`` (the gradient of this stage's
    output from the next stage).
    """

    ops: tuple[tuple[str, int], ...]


def one_f_one_b(stage: int, stages: int, microbatches: int) -> list[Compute | Transfer]:
    """The 1F1B schedule of one stage (PipeDream-Flush, as Megatron-LM runs it).

    Stage ``s`` runs ``min(stages - s - 1, microbatches)`` warm-up forwards, then alternates
    one forward and one backward, then drains the remaining backwards. In the steady state
    the output sent forward and the gradient received back travel together (as do the
    gradient sent back and the next input), so two neighbours never wait on each other's
    send. The first stage has no previous stage and the last no next one: their transfers
    leave those operations out.

    References:
        Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021;
        Megatron-LM ``forward_backward_pipelining_without_interleaving``.
    """
    first, last = stage == 0, stage == stages - 1

    def transfer(*ops: tuple[str, int]) -> list[Compute | Transfer]:
        kept = tuple(
            (op, mb)
            for op, mb in ops
            if not (first and op in ("recv_forward", "send_backward"))
            and not (last and op in ("send_forward", "recv_backward"))
        )
        return [Transfer(kept)] if kept else []

    warmup = min(stages - stage - 1, microbatches)
    steady = microbatches - warmup
    items: list[Compute | Transfer] = []
    for mb in range(warmup):
        items += transfer(("recv_forward", mb))
        items.append(Compute("forward", mb))
        items += transfer(("send_forward", mb))
    if steady:
        items += transfer(("recv_forward", warmup))
    for i in range(steady):
        forward = warmup + i
        items.append(Compute("forward", forward))
        items += transfer(("send_forward", forward), ("recv_backward", i))
        items.append(Compute("backward", i))
        if i == steady - 1:
            items += transfer(("send_backward", i))
        else:
            items += transfer(("send_backward", i), ("recv_forward", forward + 1))
    for mb in range(steady, microbatches):
        items += transfer(("recv_backward", mb))
        items.append(Compute("backward", mb))
        items += transfer(("send_backward", mb))
    return items
