"""Where in a training step stepwatch's cost falls, segment by segment, paired step by step (CPU
DDP; issue 15).

``bench/step_split.py`` prints a whole step's cost; at 1024 wide its estimates move ±5 µs from
run to run, as much as a change worth making. Split into the segments the loop's own code
marks, the differences are resolved better: each segment is short, so the model's jitter in it
is small. This bench runs bench/overhead.py's loop on a 1-rank gloo DDP job with auto mode
installed, and within each round, in a random order:

- ``off``: the monitor's hooks switched off and no ``monitor.step()`` (a plain step);
- two steps whose phases are not timed (what most steps are with ``phase_sampling="auto"``: 7
  in 8 at a 20 ms step), one after the other: ``first`` follows another kind of step and pays
  the changes back (the model's own class, the optimizer's post gate out of torch's loop),
  ``untimed`` follows an untimed step, as 6 in 8 steps do at 1 in 8;
- ``timed``: auto mode on, the step's phases timed.

``time.perf_counter_ns`` stamps each segment: ``enter`` (``with monitor.step()``'s entry),
``data`` (the ``phase("data")`` block), ``forward``, ``loss`` (the loss and ``zero_grad``),
``backward``, ``optimizer``, ``exit`` (the end of ``optimizer.step()`` to after the ``with``
block) and ``step`` (all of it). Printed per segment: the 10 % trimmed mean of the paired
differences untimed − off, first − off, timed − off and timed − untimed, in µs, and what
``auto`` pays a step on average at 1 in ``--stride`` timed (``stride − 2`` untimed steps, one
first, one timed), and at 1 in 8 and 1 in 16 always: ``auto``'s stride at a 20 ms step with 10 s
windows was 8 until the twenty-second round of issue 15 and is 16 since (32 timed steps a
window instead of 64, ``_sampling.SAMPLES_PER_WINDOW``); both from the same steps.

Each run's standard error of that average is printed too (robust: the interquartile range of
the per-round averages / 1.349 / √rounds): on this project's VM ~6-7 µs at 1024 wide and 1,000
rounds, nearly all of it from the long segments (forward, backward, optimizer: a 3 ms backward
moves ±130 µs from step to step), while ``enter``, ``data`` and ``exit`` resolve to tenths of a
µs. So one run's whole-step figure moves ±7 µs; runs are averaged for the whole (``--repeat``).

``--compare REV`` runs this tree and git ``REV`` (a worktree with its extensions built) in
alternate processes, ``--repeat`` times each.

``--engine-arm`` adds ``torch-engine`` to the untimed steps of each round, after ``first``
and before or after ``untimed`` at random: an untimed step on torch's own autograd engine
rather than stepwatch's gate
(``stepwatch.exporters.auto._engine``), and prints ``untimed − torch-engine`` per segment: what the
gate's check costs every backward, where the model's memory traffic makes it cold.

Run: ``.venv/bin/python bench/step_segments.py [--hidden 1024] [--rounds 1000] [--stride 16]
[--compare REV] [--repeat 2] [--engine-arm]``
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SEGMENTS = ("enter", "data", "forward", "loss", "backward", "optimizer", "exit", "step")
STEP_MS = 20.0  # the step
OFFSTEP_PERCENT = 0.04  # the op histograms' and the export's budget (bench/offstep_cost.py)
ARMS = ("off", "untimed", "timed")


def _trimmed(values: list[int], share: float = 0.1) -> float:
    ordered = sorted(values)
    cut = int(len(ordered) * share)
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def _measure(
    hidden: int, rounds: int, batch: int, engine_arm: bool = False
) -> dict[str, list[tuple[int, ...]]]:
    """Each arm's segment durations (ns), one tuple a round (module docstring)."""
    import hook_cost
    import overhead
    import torch
    import torch.distributed as dist

    from stepwatch.exporters._sampling import PhaseSampler

    job = hook_cost.one_rank_ddp(hidden, batch, "step-segments")
    monitor, model, optimizer, loss_fn, generator = job
    recorder = monitor._recorder
    samplers = {"untimed": PhaseSampler(1 << 62), "timed": PhaseSampler(1)}
    switch = overhead.HookSwitch(model, optimizer)
    clock = time.perf_counter_ns
    null = contextlib.nullcontext()
    order = random.Random(3)
    if engine_arm and switch.engines is None:
        raise SystemExit("--engine-arm: stepwatch's engine gate is not installed here")
    untimed_unit = ("first", "untimed", "torch-engine") if engine_arm else ("first", "untimed")
    spans: dict[str, list[tuple[int, ...]]] = {arm: [] for arm in ("first", *ARMS)}
    if engine_arm:
        spans["torch-engine"] = []
    for _ in range(rounds):
        if engine_arm:  # the two after ``first`` in either order: neither is always second
            untimed_unit = ("first", *order.sample(["untimed", "torch-engine"], 2))
        units = [("off",), untimed_unit, ("timed",)]
        order.shuffle(units)
        for arm in (arm for unit in units for arm in unit):
            on = arm != "off"
            switch.set(on)
            if on:
                recorder.sampler = samplers["timed" if arm == "timed" else "untimed"]
            if arm == "torch-engine":
                switch.variable._execution_engine = switch.engines[1]
            t0 = clock()
            with monitor.step() if on else null:
                t1 = clock()
                with monitor.phase("data") if on else null:
                    inputs = torch.randn(batch, 128, generator=generator)
                    targets = torch.randint(0, 10, (batch,), generator=generator)
                t2 = clock()
                output = model(inputs)
                t3 = clock()
                loss = loss_fn(output, targets)
                optimizer.zero_grad(set_to_none=True)
                t4 = clock()
                loss.backward()
                t5 = clock()
                optimizer.step()
                t6 = clock()
            t7 = clock()
            del output, loss
            spans[arm].append(
                (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6, t7 - t0)
            )
    switch.set(True)
    monitor.close(timeout_s=1.0)
    dist.destroy_process_group()
    return spans


def _paired(spans: dict[str, list[tuple[int, ...]]], a: str, b: str, position: int) -> float:
    """Trimmed mean (ns) of arm ``a``'s segment minus arm ``b``'s, round by round."""
    rounds = zip(spans[a], spans[b], strict=True)
    return _trimmed([x[position] - y[position] for x, y in rounds])


def _spread(values: list[float]) -> float:
    """A robust standard error of the mean of ``values`` (the interquartile range / 1.349)."""
    ordered = sorted(values)
    quartiles = ordered[(3 * len(ordered)) // 4] - ordered[len(ordered) // 4]
    return quartiles / 1.349 / max(1, len(ordered)) ** 0.5


def _report(label: str, hidden: int, stride: int, spans: dict[str, list[tuple[int, ...]]]) -> None:
    rounds = len(spans["off"])
    print(f"{label}: {hidden} wide, {rounds} rounds; trimmed mean of paired differences, µs")
    pairs = (("untimed", "off"), ("first", "off"), ("timed", "off"), ("timed", "untimed"))
    print(f"{label}:   {'segment':<10}" + "".join(f"{a + ' - ' + b:>18}" for a, b in pairs))
    for position, name in enumerate(SEGMENTS):
        cells = "".join(f"{_paired(spans, a, b, position) / 1e3:>+18.2f}" for a, b in pairs)
        print(f"{label}:   {name:<10}{cells}")
    step = SEGMENTS.index("step")
    untimed, first, timed = (
        _paired(spans, arm, "off", step) for arm in ("untimed", "first", "timed")
    )
    for each in sorted({stride, 8, 16}):
        average = ((each - 2) * untimed + first + timed) / each
        per_round = [
            ((each - 2) * (u[step] - o[step]) + f[step] - o[step] + t[step] - o[step]) / each
            for u, f, t, o in zip(
                spans["untimed"], spans["first"], spans["timed"], spans["off"], strict=True
            )
        ]
        error = _spread(per_round) / 1e3
        share = average / 1e3 / (STEP_MS * 1e3) * 100
        print(
            f"{label}: auto at 1 in {each} timed: {average / 1e3:+.2f} µs a step (standard "
            f"error {error:.2f}): {share:+.3f} % of a {STEP_MS:g} ms step, "
            f"{share + OFFSTEP_PERCENT:+.3f} % with the budget off the step",
            flush=True,
        )
    if "torch-engine" in spans:
        cells = "".join(
            f" {name} {_paired(spans, 'untimed', 'torch-engine', position) / 1e3:+.2f}"
            for position, name in enumerate(SEGMENTS)
        )
        print(f"{label}: untimed - torch-engine, µs:{cells}", flush=True)


def main() -> None:
    import step_instructions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1000, help="rounds of the four steps")
    parser.add_argument(
        "--stride", type=int, default=16, help="1 in this many steps timed (8 and 16 always)"
    )
    parser.add_argument("--engine-arm", action="store_true", help="module docstring")
    step_instructions.add_tree_options(parser)
    args = parser.parse_args()
    if not args.compare:
        spans = _measure(args.hidden, args.rounds, args.batch, args.engine_arm)
        _report(args.label, args.hidden, args.stride, spans)
        return
    arguments = ["--hidden", str(args.hidden), "--batch", str(args.batch)]
    arguments += ["--rounds", str(args.rounds), "--stride", str(args.stride)]
    step_instructions.alternate_trees(__file__, args.compare, args.repeat, arguments)


if __name__ == "__main__":
    main()
