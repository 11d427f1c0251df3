"""What the optimizer hooks of an untimed step cost in place, where the model's memory traffic
has made them cold (CPU DDP; issue 15).

Instruction counts (bench/hook_callgrind.py) say what the hooks execute, not what they wait
for. At 1024 wide the optimizer's pass over parameters, gradients and momenta (~14 MB) evicts
the caches and TLB between two steps, so every object a hook touches is a miss: the same
instructions cost ~4x what they cost at 256 wide. This bench times the hooks where they run,
in one process: a 1-rank gloo DDP job (bench/overhead.py's MLP) with auto mode installed and
every step untimed (what most steps are with ``phase_sampling="auto"``), steps alternating
between the C gates active and inactive (``gate.active = False``: the gate returns at once).
Around each gate sits a Python hook stamping ``perf_counter_ns`` (torch calls a step's hooks in
order), and the step's end is stamped after the last post-hook and after the ``with
monitor.step()`` block. Printed: the median of each span, gate active and inactive, and their
differences; ``total`` is what the gates' work adds to a step (pre + post + the step's end,
where a wait the pre-gate kept is put in the step's phases).

``--compare REV`` runs this tree and git ``REV`` (a worktree with its extensions built) in
alternate processes, ``--repeat`` times each.

Run: ``.venv/bin/python bench/hook_sandwich.py [--hidden 1024] [--steps 1000]
[--compare REV] [--repeat 2]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

SPANS = ("pre", "post", "end")


def _measure(hidden: int, steps: int, batch: int) -> dict[str, tuple[float, float]]:
    """Median ns of each span with the gates active and inactive (module docstring)."""
    import hook_cost
    import overhead
    import torch.distributed as dist

    from stepwatch.exporters._sampling import PhaseSampler

    job = hook_cost.one_rank_ddp(hidden, batch, "hook-sandwich")
    monitor, model, optimizer, loss_fn, generator = job
    monitor._recorder.sampler = PhaseSampler(1 << 62)  # no step timed
    pre_hooks = optimizer._optimizer_step_pre_hooks
    post_hooks = optimizer._optimizer_step_post_hooks
    ((pre_key, pre_gate),) = pre_hooks.items()
    ((post_key, post_gate),) = post_hooks.items()
    clock = time.perf_counter_ns
    stamps = [0, 0, 0, 0]

    def stamper(slot: int) -> Any:
        def hook(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            stamps[slot] = clock()

        return hook

    pre_hooks.clear()
    pre_hooks.update({-10: stamper(0), pre_key: pre_gate, -11: stamper(1)})
    post_hooks.clear()
    post_hooks.update({-12: stamper(2), post_key: post_gate, -13: stamper(3)})
    spans: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
    for index in range(2 * steps):
        active = index % 2 == 0
        pre_gate.active = post_gate.active = active
        overhead.train_step(monitor, model, optimizer, loss_fn, generator, batch)
        end = clock()
        spans[active].append((stamps[1] - stamps[0], stamps[3] - stamps[2], end - stamps[3]))
    pre_gate.active = post_gate.active = True
    monitor.close(timeout_s=1.0)
    dist.destroy_process_group()
    return {
        name: (
            statistics.median(span[position] for span in spans[True]),
            statistics.median(span[position] for span in spans[False]),
        )
        for position, name in enumerate(SPANS)
    }


def _report(label: str, hidden: int, medians: dict[str, tuple[float, float]]) -> None:
    total = 0.0
    parts = []
    for name in SPANS:
        active, inactive = medians[name]
        total += active - inactive
        parts.append(
            f"{name} {active / 1e3:.2f} / {inactive / 1e3:.2f} ({(active - inactive) / 1e3:+.2f})"
        )
    print(
        f"{label:<10} {hidden} wide, µs active / inactive (difference): "
        + "; ".join(parts)
        + f"; total {total / 1e3:+.2f} µs a step",
        flush=True,
    )


def main() -> None:
    import step_instructions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--steps", type=int, default=1000, help="steps of each state")
    step_instructions.add_tree_options(parser)
    args = parser.parse_args()
    if not args.compare:
        _report(args.label, args.hidden, _measure(args.hidden, args.steps, args.batch))
        return
    arguments = ["--hidden", str(args.hidden), "--batch", str(args.batch)]
    arguments += ["--steps", str(args.steps)]
    step_instructions.alternate_trees(__file__, args.compare, args.repeat, arguments)


if __name__ == "__main__":
    main()
