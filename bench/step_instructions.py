"""Instructions per ``monitor.step()`` on the training thread, this tree and another (callgrind).

What the step boundary costs the training thread, with and without a kernel source attached,
counted by callgrind (deterministic, unlike a timing on a shared VM, docs/exporters.md): a loop
of empty steps (``with monitor.step(): pass``) per arm, the counters zeroed after a warm-up
and dumped after ``--steps`` steps, the garbage collector off meanwhile (the buffered step
records would otherwise trigger collections at different points per arm).

Arms: ``none`` (no kernel source), ``profiler`` (``TorchProfilerSource`` with the defaults, on
a backend that records nothing, so the steps measured fall between its cycles: after the
warm-up cycle, the probe and the full cycles the default budget spaces out), each twice.
``--baseline-rev REV`` runs the same in a checkout of ``REV`` (a git worktree, extensions
built there) in the same invocation, so before and after come side by side::

    .venv/bin/python bench/step_instructions.py --baseline-rev HEAD~1

Needs valgrind and a C compiler. Prints one line per tree and arm: instructions per step (the
median of the arm's blocks) and the difference to ``none``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("none", "profiler", "none", "profiler")


def _child(source_dir: str, steps: int, warmup: int) -> None:
    """Runs under callgrind: the arms, with ``source_dir``'s stepwatch.exporters first."""
    sys.path.insert(0, source_dir)
    sys.path.insert(0, str(ROOT / "bench"))
    import gc

    import hook_callgrind
    import hook_cost

    from stepwatch.exporters import StepMonitor
    from stepwatch.exporters.kernels import TorchProfilerSource

    class Silent:
        """A profiler backend that records nothing: cycles cost (and perturb) nothing."""

        def start(self) -> None:
            return None

        def stop(self) -> object:
            return list

    helper = hook_callgrind._helper()
    gc.disable()
    for arm in ARMS:
        source = TorchProfilerSource(backend=Silent()) if arm == "profiler" else None
        monitor = StepMonitor(
            job_id="step-instructions",
            rank=0,
            world_size=1,
            exporter=hook_cost.NullExporter(),
            health=False,
            kernel_source=source,
            start=False,
            buffer_steps=warmup + steps + 1,
        )
        step = monitor.step
        for _ in range(warmup):
            with step():
                pass
        helper.cg_zero()
        for _ in range(steps):
            with step():
                pass
        helper.cg_dump(arm.encode())
        monitor.close()


def _checkout(rev: str, folder: Path) -> Path:
    subprocess.run(
        ["git", "worktree", "add", "-q", "--detach", str(folder), rev], cwd=ROOT, check=True
    )
    subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=folder / "exporters",
        check=True,
        capture_output=True,
    )
    return folder / "exporters" / "src"


def add_tree_options(parser: argparse.ArgumentParser) -> None:
    """``--compare REV``, ``--repeat N`` and the hidden ``--label`` of
    :func:`alternate_trees`'s child processes."""
    parser.add_argument("--compare", default="", help="a git revision against this tree")
    parser.add_argument("--repeat", type=int, default=2, help="--compare: processes a tree")
    parser.add_argument("--label", default="this tree", help=argparse.SUPPRESS)


def alternate_trees(script: str, revision: str, repeat: int, arguments: list[str]) -> None:
    """Run ``script --label L ARGUMENTS`` on git ``revision`` (a worktree with its extensions
    built) and on this tree in alternate processes, ``repeat`` times each, printing the lines
    each prints that start with its label (its stderr's end if none)."""
    with tempfile.TemporaryDirectory() as temporary:
        base = Path(temporary) / "base"
        trees = [(revision, _checkout(revision, base)), ("this tree", ROOT / "exporters" / "src")]
        try:
            for _ in range(repeat):
                for label, source in trees:
                    done = subprocess.run(
                        [sys.executable, script, "--label", label, *arguments],
                        capture_output=True,
                        text=True,
                        env={**os.environ, "PYTHONPATH": str(source)},
                        check=False,
                    )
                    lines = [line for line in done.stdout.splitlines() if line.startswith(label)]
                    print("\n".join(lines) or done.stderr[-2000:], flush=True)
        finally:
            with contextlib.suppress(Exception):
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, check=False
                )


def _measure(source_dir: Path, steps: int, warmup: int, out: Path) -> dict[str, list[float]]:
    out.mkdir(parents=True)
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}/cg.%p",
            sys.executable,
            __file__,
            "--child",
            str(source_dir),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    per_arm: dict[str, list[float]] = {}
    for path in sorted(glob.glob(f"{out}/cg.*.*"), key=lambda p: int(p.rsplit(".", 1)[1])):
        lines = Path(path).read_text(errors="replace").splitlines()
        arm = next(line.split(":")[-1].strip() for line in lines if "Trigger" in line)
        total = next(int(line.split()[1]) for line in lines if line.startswith("summary:"))
        per_arm.setdefault(arm, []).append(total / steps)
    return per_arm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default="", help="also measure this git revision")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=3000, help="steps before measuring")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.steps, args.warmup)
        return
    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(temporary)
        trees = [("this tree", ROOT / "exporters" / "src")]
        if args.baseline_rev:
            trees.insert(0, (args.baseline_rev, _checkout(args.baseline_rev, scratch / "base")))
        try:
            for position, (name, source_dir) in enumerate(trees):
                per_arm = _measure(source_dir, args.steps, args.warmup, scratch / f"cg{position}")
                none = statistics.median(per_arm["none"])
                for arm, values in per_arm.items():
                    value = statistics.median(values)
                    print(
                        f"{name:<12} {arm:<9} {value:>9,.0f} instructions per step"
                        f" ({value - none:+,.0f} against none; blocks: "
                        + ", ".join(f"{v:,.0f}" for v in values)
                        + ")"
                    )
        finally:
            if args.baseline_rev:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(scratch / "base")],
                    cwd=ROOT,
                    check=False,
                )


if __name__ == "__main__":
    main()
