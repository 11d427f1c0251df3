"""Instructions (and simulated L1 misses) per step of auto-mode arms, deterministic: callgrind.

Wall and CPU figures of ``bench/hook_cost.py`` are noisy on a shared VM (±300 µs per step at
1024 wide); instruction counts are not. Run under callgrind; each arm of ``hook_cost.Bench``
runs a warm-up block, then the counters are zeroed, ``--steps`` steps run, and the counters are
dumped with the arm's name (a tiny C helper, built here with gcc, issues the client requests)::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --cache-sim=yes \\
        --callgrind-out-file=/tmp/cg.%p .venv/bin/python bench/hook_callgrind.py \\
        --arms plain,all,all@base,plain,all,all@base --baseline-rev a6f1a51
    .venv/bin/python bench/hook_callgrind.py --report '/tmp/cg.*.*' --steps 10

With ``--kind ddp``, gloo's own threads run during each block and their share varies by a few
thousand instructions per step from block to block; ``valgrind --separate-threads=yes`` dumps
each thread apart (``cg.PID.N-TT``) and ``--report '/tmp/cg.*.*-01'`` counts the training
thread alone (what the hooks cost it).

``--compare REV`` does all of that itself for a DDP step with the loop's own ``step()``, for
git ``REV`` (a worktree with its extensions built) and this tree, one callgrind run each:
arms ``plain+step``, ``all_unsampled+step`` and ``all+step``, ``--rounds`` rounds (the first
left out), the training thread only. It prints per tree the median instructions per step over
``plain+step`` of an untimed and of a timed step, and a step's average when ``auto`` times 1
step in ``--stride`` (16 at a 20 ms step with 10 s windows, 8 before issue 15's twenty-second
round); ``--auto-steps``: the same without ``step()``, auto mode marking the steps itself
(arms ``plain``, ``all_unsampled``, ``all``)::

    .venv/bin/python bench/hook_callgrind.py --compare e316de8 --steps 40 --rounds 6

``--device``: the same with phases timed on a stand-in device timer whose marks are C calls
(``hook_cost.StandInDevice``): ``DeviceAutoState``'s hooks and the recorder's device marks.

``--kind ddp`` wraps the model in ``DistributedDataParallel`` over a 1-rank gloo group (the
exposed-wait hook on the last gradient is then installed too). ``--report`` prints each dump's
events per step. Put ``plain`` twice or more: the first block
of a run is inflated (allocator, first calls); compare arms of the same round. At 1024 wide
(``--hidden 1024``) MKL's own instruction count varies by ±50 k per step between blocks.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_HELPER = """#include <valgrind/callgrind.h>
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


def _helper() -> ctypes.CDLL:
    folder = Path(tempfile.mkdtemp())
    (folder / "cg.c").write_text(_HELPER)
    library = folder / "libcg.so"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(library), str(folder / "cg.c")])
    return ctypes.CDLL(str(library))


def _report(pattern: str, steps: int) -> None:
    def dump_number(path: str) -> int:  # cg.PID.N or, with --separate-threads, cg.PID.N-TT
        return int(path.rsplit(".", 1)[1].split("-")[0])

    for path in sorted(glob.glob(pattern), key=dump_number):
        lines = Path(path).read_text(errors="replace").splitlines()
        arm = next((line.split(":")[-1].strip() for line in lines if "Trigger" in line), "?")
        events = next((line.split()[1:] for line in lines if line.startswith("events:")), [])
        summary = next((line.split()[1:] for line in lines if line.startswith("summary:")), [])
        values = ", ".join(
            f"{event} {int(value) / steps:,.0f}"
            for event, value in zip(events, summary, strict=False)
        )
        print(f"{Path(path).name:<16} {arm:<12} per step: {values}")


def _compare(
    rev: str, steps: int, rounds: int, stride: int, auto_steps: bool, device: bool = False
) -> None:
    """``--compare``: this tree and ``rev`` under callgrind, side by side (module docstring)."""
    import statistics

    import step_instructions

    suffix = "" if auto_steps else "+step"
    plain_arm, untimed_arm, timed_arm = (f"{a}{suffix}" for a in ("plain", "all_unsampled", "all"))
    arms = ",".join([plain_arm, untimed_arm, timed_arm] * rounds)
    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(temporary)
        trees = [(rev, step_instructions._checkout(rev, scratch / "base"))]
        trees.append(("this tree", Path(__file__).resolve().parent.parent / "exporters" / "src"))
        try:
            for position, (name, source) in enumerate(trees):
                out = scratch / f"cg{position}"
                out.mkdir()
                subprocess.run(
                    [
                        "valgrind",
                        "--tool=callgrind",
                        "--separate-threads=yes",
                        f"--callgrind-out-file={out}/cg.%p",
                        sys.executable,
                        __file__,
                        "--kind",
                        "ddp",
                        "--arms",
                        arms,
                        "--steps",
                        str(steps),
                    ],
                    check=True,
                    capture_output=True,
                    env={
                        **os.environ,
                        "PYTHONHASHSEED": "0",
                        "PYTHONPATH": str(source),
                        "STEPWATCH_BENCH_DEVICE": "1" if device else "0",
                    },
                )
                per_arm: dict[str, list[float]] = {}
                dumps = glob.glob(f"{out}/cg.*.*-01")
                for path in sorted(dumps, key=lambda p: int(p.rsplit(".", 1)[1].split("-")[0])):
                    lines = Path(path).read_text(errors="replace").splitlines()
                    arm = next(line.split(":")[-1].strip() for line in lines if "Trigger" in line)
                    total = next(
                        int(line.split()[1]) for line in lines if line.startswith("summary:")
                    )
                    per_arm.setdefault(arm, []).append(total / steps)
                plain = per_arm[plain_arm][1:]
                untimed, timed = (
                    statistics.median(a - b for a, b in zip(per_arm[arm][1:], plain, strict=True))
                    for arm in (untimed_arm, timed_arm)
                )
                average = (timed + (stride - 1) * untimed) / stride
                marks = " (device marks)" if device else ""
                print(
                    f"{name:<10} over plain DDP{suffix}{marks}: untimed {untimed:+,.0f}, timed "
                    f"{timed:+,.0f}, a step at 1 in {stride} timed {average:+,.0f} instructions "
                    f"(training thread, medians of {rounds - 1} rounds of {steps} steps)",
                    flush=True,
                )
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(scratch / "base")],
                cwd=Path(__file__).resolve().parent.parent,
                check=False,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="plain,all,plain,all")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--kind", choices=("plain", "ddp"), default="plain", help="ddp: a 1-rank gloo group"
    )
    parser.add_argument("--hidden", type=int, default=0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--baseline-rev", default="")
    parser.add_argument("--report", default="", help="glob of callgrind dumps to summarise")
    parser.add_argument("--compare", default="", help="a git revision against this tree")
    parser.add_argument("--rounds", type=int, default=6, help="--compare: rounds of arms")
    parser.add_argument("--stride", type=int, default=16, help="--compare: 1 step in N timed")
    parser.add_argument(
        "--auto-steps", action="store_true", help="--compare: no step(), auto mode's own steps"
    )
    parser.add_argument(
        "--device",
        action="store_true",
        help="--compare: phases on a stand-in device timer (DeviceAutoState, C-cheap marks)",
    )
    args = parser.parse_args()
    if args.report:
        _report(args.report, args.steps)
        return
    if args.compare:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        _compare(args.compare, args.steps, args.rounds, args.stride, args.auto_steps, args.device)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import hook_cost
    import torch

    torch.set_num_threads(1)
    helper = _helper()
    baseline = hook_cost._load_auto_at(args.baseline_rev) if args.baseline_rev else None
    if args.kind == "ddp":
        import torch.distributed as dist

        port = hook_cost._free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    bench = hook_cost.Bench(args.kind, baseline, args.hidden, args.batch)
    for arm in args.arms.split(","):
        with bench.installed(arm):
            bench.run_block(3)
            helper.cg_zero()
            bench.run_block(args.steps)
            helper.cg_dump(arm.encode())


if __name__ == "__main__":
    main()
