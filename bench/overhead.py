"""Overhead of stepwatch on a real CPU DDP job: A/B interleaved in one run.

Two ranks (gloo over loopback, one per core of the bench machine) train an MLP with DDP, the two
arms alternating (every step by default). Arm A is fully instrumented: ``monitor.step()``, a
``data`` phase, auto-mode hooks on forward/backward/optimizer and communication (the exposed
wait, DDP's built-in allreduce untouched), and op histograms from :class:`TorchProfilerSource`
(adaptive duty cycle, default budget), exporting OTLP/HTTP (the monitor's default interval, 10 s;
``--export-interval``) to a plain loopback
receiver (``--sink bridge``: the real stepwatch bridge in this process, with a counting writer,
which on a 2-core machine takes CPU from the ranks it measures). Arm B is plain DDP. The arm
order within each pair is random (seeded, the same on every rank) so drift and neighbours on the
machine hit both arms alike.

Designs (``--design``):

- ``alternate`` (default): one DDP replica; the arms alternate every step (A then B or B then
  A, at random), arm A's hooks installed just before its step and removed just after. This
  machine's noise is slow drift (other tenants, frequency, the neighbouring rank), which
  cancels between neighbouring steps: measured with both arms plain on 3,000 steps each, the
  95 % CI of the mean thread-CPU difference was ±0.28 % alternating every step, ±1.0 % in
  blocks of 10 and ±2.0 % in blocks of 40. Estimators, bootstrapped over step pairs (all
  ranks of a pair resampled together): the ratio of the median step times (the goal metric),
  of the mean step times, and of the training thread's CPU time. What runs elsewhere is
  added from its own measurement: the export thread's CPU (its thread clock) and the
  profiler's charged cycle cost; pairs inside a profiling cycle are set apart (the profiler
  runs through the B steps of its cycle). An A/A control comes first.
- ``toggle``: the same in blocks of ``--block`` steps (the previous default); an A/A control
  (the same block design with both arms plain) is measured first and printed: it shows
  what the estimators read when nothing differs.
- ``replicas``: two identical replicas, A's permanently instrumented (forced for the modes that
  register a DDP comm hook, which DDP cannot remove). The replicas are not exactly equally fast
  (memory placement), so the overhead is the A/B difference minus the A/A difference.

The block designs' three estimators, with 95 % bootstrap CIs over block pairs (one value
per pair: the ranks' mean, as DDP couples them):

- wall clock: per block pair, the relative difference of the median step times (robust to
  scheduling noise; by construction it does not see the rare profiled steps);
- CPU time: per block pair, the relative difference of the process CPU time per step
  (``time.process_time()``: every thread of the rank, the export thread and gloo's
  included), averaged over pairs so the rare profiled steps and the exports are paid for;
  insensitive to waiting for the CPU while other processes run. The export thread sends arm
  A's windows when its timer fires, often during the following B block: its CPU time
  (read from its own thread clock) is moved from the B block to arm A. Blocks shorter than a
  few export intervals over-charge it (each A block adds one partly filled window): with
  ``--block 80`` at 24 ms, about 1.5x what continuous training would pay;
- training-thread CPU: ``time.thread_time()`` of the loop's own thread, i.e. the hooks and the
  monitor on the critical path, without the export and gloo threads.

The run prints the hypervisor's steal time over the job (``/proc/stat``): on a shared VM it is
the noise floor no design removes (12–23 % on this project's CI machine, where run-to-run
differences of ±1–2 % are common).

``--mode`` isolates parts of arm A: ``no-ops`` (everything but op histograms),
``collective`` (communication timed per collective by a Python comm hook instead),
``no-comm-hook`` (no communication timing), ``manual`` (only ``step()`` and one phase),
``plain-python-hook`` (no stepwatch at all, just DDP's own Python ``allreduce_hook``: the price
of any Python comm hook).

Also measures the hot-path cost of one step with four phases in a tight loop, and the comm
hook's cost per bucket against DDP's built-in C++ allreduce (a separate 2-rank job with a
model of many small buckets, CPU time). Prints the 1-minute load average at start and end.

The defaults are the headline run (about 15 minutes here): 3,000 step pairs of a 2-rank job
whose step takes ~86 ms (``--hidden 2048 --batch 128``). ``--hidden 1024 --batch 64`` gives a
~22 ms step, where the fixed per-step cost weighs four times as much.

Usage: ``.venv/bin/python bench/overhead.py [--ranks 2] [--pairs 3000] [--hidden 2048]
[--batch 128] [--design alternate|toggle|replicas] [--mode M]``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.server
import json
import os
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


class CountingWriter:
    """A bridge LineWriter that only counts: the bench measures the exporter, not InfluxDB."""

    def __init__(self) -> None:
        self.lines = 0

    def write_lines(self, lines: Any) -> None:
        self.lines += len(lines)

    def close(self) -> None:
        return None


class BridgeSink:
    """The real stepwatch bridge (OTLP/HTTP) in this process, writing to a CountingWriter."""

    def __init__(self) -> None:
        from stepwatch.otel_bridge import Bridge

        self.writer = CountingWriter()
        self.bridge = Bridge(self.writer, grpc_port=None, http_port=0).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.bridge.http_port}"

    def describe(self) -> str:
        return f"stepwatch bridge: {self.writer.lines} line-protocol points converted"

    def stop(self) -> None:
        self.bridge.stop()


class Receiver:
    """A loopback OTLP/HTTP endpoint that accepts and counts requests (``--sink receiver``)."""

    def __init__(self) -> None:
        self.requests = 0
        self.bytes = 0
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # kept alive, as the bridge does

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.requests += 1
                receiver.bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def describe(self) -> str:
        return f"plain receiver: {self.requests} OTLP requests, {self.bytes} bytes"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5.0)


class HookSwitch:
    """Arm A's hooks, installed once, switched off and on per step without allocating.

    ``monitor.instrument()`` times the forward by swapping the model's class for a subclass
    (module hooks where it cannot) and puts its other hooks in torch's per-object hook dicts.
    Switching off puts the original class back, swaps the module's and the optimizer's hook
    dicts for empty ones and empties the parameter's post-accumulate-grad dict (refilled when
    switched on), so B steps run with no stepwatch hook at all and A steps with the very hooks
    a job keeps for its whole run: no registration per step, and none of its garbage for the
    collector. These are torch internals; a missing one stops the bench. Where auto mode marks
    backward starts at the autograd engine (``stepwatch.exporters.auto._engine``), B steps run on
    torch's own engine (``Variable._execution_engine`` put back while switched off), so the
    gate's check on every backward is in A's cost.
    """

    MODULE = ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called")
    OPTIMIZER = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")

    def __init__(self, model: Any, optimizer: Any) -> None:
        self.model = model
        self.on_class = type(model)
        timed = getattr(self.on_class.forward, "__wrapped__", None) is not None
        self.off_class = self.on_class.__base__ if timed else self.on_class
        self.targets = [(model, name) for name in self.MODULE]
        self.targets += [(optimizer, name) for name in self.OPTIMIZER]
        self.on = [getattr(target, name) for target, name in self.targets]
        self.off = [type(hooks)() for hooks in self.on]
        first = next(p for p in model.parameters() if p.requires_grad)
        self.parameter_hooks = first._post_accumulate_grad_hooks
        self.parameter_saved = dict(self.parameter_hooks or {})
        from torch.autograd.variable import Variable

        self.variable = Variable
        try:
            from stepwatch.exporters.auto import _engine
        except ImportError:  # a tree before the gate (step_segments --compare)
            installed: dict[str, Any] = {}
        else:
            installed = dict(_engine._installed)
        self.engines = (installed["engine"], installed["original"]) if installed else None

    def set(self, on: bool) -> None:
        object.__setattr__(self.model, "__class__", self.on_class if on else self.off_class)
        off_now = getattr(self.targets[0][0], self.targets[0][1]) is self.off[0]
        if on == off_now:  # a switch (else what is installed stays)
            if not on:  # what is there goes back when switched on: the optimizer's post-hook
                # dict may be the stand-in its pre gate put there for untimed steps
                self.on = [getattr(target, name) for target, name in self.targets]
            for (target, name), hooks_on, hooks_off in zip(
                self.targets, self.on, self.off, strict=True
            ):
                object.__setattr__(target, name, hooks_on if on else hooks_off)
        if self.engines is not None:
            engine = self.engines[0] if on else self.engines[1]
            if self.variable._execution_engine is not engine:
                self.variable._execution_engine = engine
        if self.parameter_hooks is not None:
            if on:
                self.parameter_hooks.update(self.parameter_saved)
            else:
                self.parameter_hooks.clear()


def mlp(hidden: int) -> Any:
    """The bench's model, seeded: 128 -> ``hidden`` -> ``hidden`` -> 10 with ReLUs (also
    bench/step_split.py's)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def train_step(
    monitor: Any, model: Any, optimizer: Any, loss_fn: Any, generator: Any, batch: int
) -> None:
    """One step of the bench's loop: a random batch drawn in a ``data`` phase, the forward,
    backward and optimizer, all inside ``monitor.step()`` (None: no monitor). Also
    bench/step_split.py's."""
    import torch

    with monitor.step() if monitor is not None else contextlib.nullcontext():
        with monitor.phase("data") if monitor is not None else contextlib.nullcontext():
            inputs = torch.randn(batch, 128, generator=generator)
            targets = torch.randint(0, 10, (batch,), generator=generator)
        loss = loss_fn(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _rank_main(rank: int, options: dict[str, Any]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from stepwatch.exporters import StepMonitor
    from stepwatch.exporters.kernels import TorchProfilerSource

    torch.set_num_threads(1)
    world_size = options["ranks"]
    dist.init_process_group(
        "gloo",
        init_method=f"file://{options['out_dir']}/store",
        rank=rank,
        world_size=world_size,
    )

    def make_model() -> Any:
        return DistributedDataParallel(mlp(options["hidden"]))

    try:
        toggle = options["design"] in ("toggle", "alternate")
        on_model = make_model()
        off_model = on_model if toggle else make_model()
        on_opt = torch.optim.SGD(on_model.parameters(), lr=0.01, momentum=0.9)
        off_opt = (
            on_opt if toggle else torch.optim.SGD(off_model.parameters(), lr=0.01, momentum=0.9)
        )
        source = (
            TorchProfilerSource()
            if options["mode"] in ("full", "collective", "no-comm-hook")
            else None
        )
        monitor = StepMonitor(
            job_id="overhead-bench",
            rank=rank,
            world_size=world_size,
            endpoint=options["endpoint"],
            export_interval_s=options["export_interval_s"],
            kernel_source=source,
            phase_sampling=options["phase_sampling"],
        )
        export_thread = monitor._thread
        export_clock = (
            time.pthread_getcpuclockid(export_thread.ident)
            if export_thread is not None and export_thread.ident is not None
            else None
        )

        def export_cpu_s() -> float:
            return time.clock_gettime(export_clock) if export_clock is not None else 0.0

        # Python's garbage collector runs in whichever thread allocates, holding the GIL: its
        # time is booked to the arm whose block is running (the parts' costs omit it).
        gc_account: dict[str, Any] = {"arm": None, "started": 0.0}
        gc_totals = {arm: {"s": 0.0, "gen2": 0, "all": 0} for arm in ("on", "off")}

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                gc_account["started"] = time.perf_counter()
                return
            arm = gc_account["arm"]
            if arm is not None:
                totals = gc_totals[arm]
                totals["s"] += time.perf_counter() - gc_account["started"]
                totals["all"] += 1
                totals["gen2"] += info["generation"] == 2

        gc.callbacks.append(on_gc)

        loss_fn = torch.nn.CrossEntropyLoss()
        generator = torch.Generator().manual_seed(rank)
        batch = options["batch"]
        instrumented = False
        handle: Any = None

        def install() -> None:
            """Arm A's hooks (toggle design: installed for each A block, removed after)."""
            nonlocal handle
            mode = options["mode"]
            if mode in ("full", "no-ops"):
                handle = monitor.instrument(on_model, on_opt)
            elif mode == "no-comm-hook":
                handle = monitor.instrument(on_model, on_opt, time_communication=False)
            elif mode == "collective":
                handle = monitor.instrument(on_model, on_opt, collective_timing=True)
            elif mode == "plain-python-hook":
                from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
                    allreduce_hook,
                )

                on_model.register_comm_hook(None, allreduce_hook)

        def uninstall() -> None:
            nonlocal handle
            if handle is not None:
                handle.remove()
                handle = None

        def step(model: Any, optimizer: Any, arm_on: bool) -> None:
            active = instrumented and arm_on and options["mode"] != "plain-python-hook"
            train_step(monitor if active else None, model, optimizer, loss_fn, generator, batch)

        order_rng = random.Random(options["seed"])  # same on every rank: blocks stay aligned

        def run_pairs(pairs: int) -> dict[str, Any]:
            samples: dict[str, list[float]] = {"on": [], "off": []}
            pair_medians: list[tuple[float, float]] = []
            pair_cpu: list[tuple[float, float]] = []
            pair_thread: list[tuple[float, float]] = []
            for _ in range(pairs):
                arms = ["on", "off"]
                order_rng.shuffle(arms)
                medians: dict[str, float] = {}
                cpu: dict[str, float] = {}
                thread_cpu: dict[str, float] = {}
                exported_in: dict[str, float] = {}
                for arm in arms:
                    model, optimizer = (on_model, on_opt) if arm == "on" else (off_model, off_opt)
                    if toggle and instrumented and arm == "on":
                        install()
                    times = []
                    cpu_started, export_started = time.process_time(), export_cpu_s()
                    thread_started = time.thread_time()
                    gc_account["arm"] = arm if instrumented else None
                    for _ in range(options["block"]):
                        started = time.perf_counter()
                        step(model, optimizer, arm == "on")
                        times.append(time.perf_counter() - started)
                    cpu[arm] = time.process_time() - cpu_started
                    thread_cpu[arm] = time.thread_time() - thread_started
                    gc_account["arm"] = None
                    exported_in[arm] = export_cpu_s() - export_started
                    if toggle and arm == "on":
                        uninstall()
                    samples[arm].extend(times)
                    medians[arm] = statistics.median(times)
                pair_medians.append((medians["on"], medians["off"]))
                # The export thread sends arm A's windows whenever its timer fires, often
                # during the next B block: its CPU time is moved to arm A, wherever it ran.
                block = options["block"]
                pair_cpu.append(
                    (
                        (cpu["on"] + exported_in["off"]) / block,
                        (cpu["off"] - exported_in["off"]) / block,
                    )
                )
                pair_thread.append((thread_cpu["on"], thread_cpu["off"]))
            return {
                "samples": samples,
                "pair_medians": pair_medians,
                "pair_cpu": pair_cpu,
                "pair_thread": pair_thread,
            }

        def run_alternating(pairs: int) -> list[list[float]]:
            """Arms alternating every step (order random per pair); one row per pair.

            Row: A wall, B wall, A thread CPU, B thread CPU (seconds), and 1.0 when a
            profiling cycle covered the pair (the profiler keeps running through the B steps
            of its cycle, so those pairs are set apart; its cost is accounted separately).
            """
            rows: list[list[float]] = []
            for _ in range(pairs):
                arms = ["on", "off"]
                order_rng.shuffle(arms)
                profiled = source is not None and source._running is not None
                measured: dict[str, tuple[float, float]] = {}
                for arm in arms:
                    active = switch is not None and arm == "on"
                    if active:
                        switch.set(True)
                    gc_account["arm"] = arm if instrumented else None
                    thread_started = time.thread_time()
                    started = time.perf_counter()
                    step(on_model, on_opt, arm == "on")
                    wall = time.perf_counter() - started
                    measured[arm] = (wall, time.thread_time() - thread_started)
                    gc_account["arm"] = None
                    if active:
                        switch.set(False)
                profiled = profiled or (source is not None and source._running is not None)
                (on_wall, on_cpu), (off_wall, off_cpu) = measured["on"], measured["off"]
                rows.append([on_wall, off_wall, on_cpu, off_cpu, float(profiled)])
            return rows

        alternate = options["design"] == "alternate"
        switch: HookSwitch | None = None
        for _ in range(options["warmup"]):
            step(on_model, on_opt, True)
            if not toggle:
                step(off_model, off_opt, False)
        # A/A first: arm A uninstrumented. Replicas design: the two replicas are not exactly
        # equally fast (memory placement), so the A/B difference is read against this
        # control; toggle design (one replica): the control shows the estimator's noise.
        if alternate:
            control_rows = run_alternating(options["control_pairs"])
        else:
            control = run_pairs(options["control_pairs"])
        instrumented = True
        install()
        # Past the one-time costs before measuring: the profiler's warm-up (Kineto's set-up)
        # and its one-step probe come after 50 and 100 steps; the steady state is measured.
        for _ in range(options["on_warmup"]):
            step(on_model, on_opt, True)
        if alternate and handle is not None:
            switch = HookSwitch(on_model, on_opt)
            switch.set(False)
        elif toggle:
            uninstall()
        spent_before = source.duty_cycle.spent_s if source is not None else 0.0
        drained_before = source.duty_cycle.drain_spent_s if source is not None else 0.0
        export_before = export_cpu_s()
        if alternate:
            rows = run_alternating(options["pairs"])
            export_total_s = export_cpu_s() - export_before
            monitor.close(timeout_s=5.0)
            result = {
                "rows": rows,
                "control_rows": control_rows,
                "export_cpu_s": export_total_s,
                "profiler_spent_s": (
                    source.duty_cycle.spent_s - spent_before if source is not None else 0.0
                ),
                # Its export-thread part (reading the cycles' ops) is also in export_cpu_s.
                "profiler_drain_s": (
                    source.duty_cycle.drain_spent_s - drained_before if source is not None else 0.0
                ),
                "on_steps_s": sum(row[0] for row in rows),
                "off_steps_s": sum(row[1] for row in rows),
                "gc": gc_totals,
                "stats": monitor.stats.__dict__,
                "duty_cycle": source.duty_cycle._asdict() if source is not None else None,
                "phase_stride": monitor.phase_sample_stride,
                "export_interval_s": monitor.export_interval_s,
            }
            Path(options["out_dir"], f"rank{rank}.json").write_text(json.dumps(result))
            return
        measured = run_pairs(options["pairs"])
        export_total_s = export_cpu_s() - export_before
        monitor.close(timeout_s=5.0)
        result = {
            "samples": measured["samples"],
            "pair_medians": measured["pair_medians"],
            "pair_cpu": measured["pair_cpu"],
            "control_pair_medians": control["pair_medians"],
            "control_pair_cpu": control["pair_cpu"],
            "pair_thread": measured["pair_thread"],
            "control_pair_thread": control["pair_thread"],
            "stats": monitor.stats.__dict__,
            "duty_cycle": source.duty_cycle._asdict() if source is not None else None,
            "on_steps_s": sum(measured["samples"]["on"]),
            "export_cpu_s": export_total_s,
            "gc": gc_totals,
            "phase_stride": monitor.phase_sample_stride,
            "export_interval_s": monitor.export_interval_s,
        }
        Path(options["out_dir"], f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _comm_rank_main(rank: int, options: dict[str, Any]) -> None:
    """One rank of the comm-hook job: same model three ways, only the comm path differs."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from stepwatch.exporters import InMemoryExporter, StepMonitor

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{options['out_dir']}/store", rank=rank, world_size=2
    )
    try:

        def make_model() -> Any:
            torch.manual_seed(0)
            layers: list[Any] = []
            for _ in range(options["layers"]):
                layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
            # A tiny bucket cap: one bucket per weight, so per-bucket costs add up.
            return DistributedDataParallel(torch.nn.Sequential(*layers), bucket_cap_mb=0.01)

        arms: dict[str, tuple[Any, Any]] = {}
        monitors = []
        for arm in ("builtin", "ddp-python-hook", "stepwatch"):
            model = make_model()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
            if arm == "ddp-python-hook":
                model.register_comm_hook(None, allreduce_hook)
            monitor = StepMonitor(
                job_id="comm-hook",
                rank=rank,
                world_size=2,
                exporter=InMemoryExporter(),
                buffer_steps=1_000_000,
                start=False,
            )
            # Every arm carries the auto-mode hooks; only the stepwatch arm times communication,
            # per collective (the Python comm hook whose per-bucket cost this job measures).
            monitor.instrument(
                model,
                optimizer,
                time_communication=arm == "stepwatch",
                collective_timing=arm == "stepwatch",
            )
            monitors.append(monitor)
            arms[arm] = (model, optimizer)
        inputs = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))

        def step(arm: str) -> None:
            model, optimizer = arms[arm]
            loss = model(inputs).pow(2).mean()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        for _ in range(20):
            for arm in arms:
                step(arm)
        reducer = arms["stepwatch"][0].reducer
        buckets = len(reducer._get_zeros_like_grad_buckets())
        order_rng = random.Random(options["seed"])
        cpu: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(options["pairs"]):
            order = list(arms)
            order_rng.shuffle(order)
            for arm in order:
                started = time.process_time()
                for _ in range(options["block"]):
                    step(arm)
                cpu[arm].append((time.process_time() - started) / options["block"])
        for monitor in monitors:
            monitor.close()
        Path(options["out_dir"], f"comm{rank}.json").write_text(
            json.dumps({"cpu": cpu, "buckets": buckets})
        )
    finally:
        dist.destroy_process_group()


def comm_hook_cost_us(*, pairs: int, block: int, seed: int) -> None:
    """Per-bucket CPU cost of the timing comm hook and of DDP's own Python hook."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        options = {"out_dir": out_dir, "layers": 16, "pairs": pairs, "block": block, "seed": seed}
        mp.start_processes(
            _comm_rank_main, args=(options,), nprocs=2, join=True, start_method="spawn"
        )
        results = [json.loads(Path(out_dir, f"comm{rank}.json").read_text()) for rank in (0, 1)]
    buckets = results[0]["buckets"]
    base = statistics.median(x for r in results for x in r["cpu"]["builtin"])
    print(
        f"comm hook, 2 ranks gloo, {buckets} buckets/step, built-in C++ allreduce "
        f"{base * 1e3:.2f} ms CPU/step; extra CPU per bucket (median of {2 * pairs} block "
        "pairs, 95% bootstrap CI):"
    )
    for arm in ("ddp-python-hook", "stepwatch"):
        diffs = [
            (a - b) * 1e6 / buckets
            for r in results
            for a, b in zip(r["cpu"][arm], r["cpu"]["builtin"], strict=True)
        ]
        low, high = _bootstrap_ci(diffs, [0.0], statistic=statistics.median)
        print(f"  {arm:<16} {statistics.median(diffs):7.1f} µs/bucket ({low:.1f} .. {high:.1f})")


def hot_path_cost_us(steps: int = 200_000) -> tuple[float, float]:
    """Per-step cost of ``step()`` + four ``phase()`` blocks, and of the same loop bare."""
    from stepwatch.exporters import InMemoryExporter, StepMonitor

    monitor = StepMonitor(
        job_id="hot-path",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        buffer_steps=steps + 1,
        start=False,
    )
    null = contextlib.nullcontext()

    def run(instrumented: bool) -> float:
        monitor.export_now()  # empty the buffer
        step = monitor.step if instrumented else (lambda: null)
        phase = monitor.phase if instrumented else (lambda name: null)
        started = time.perf_counter_ns()
        for _ in range(steps):
            with step():
                with phase("data"):
                    pass
                with phase("forward"):
                    pass
                with phase("backward"):
                    pass
                with phase("optimizer"):
                    pass
        return (time.perf_counter_ns() - started) / steps / 1000.0

    bare = min(run(False) for _ in range(3))
    instrumented = min(run(True) for _ in range(3))
    run(True)
    export_started = time.perf_counter()
    monitor.export_now()
    export_s = time.perf_counter() - export_started
    print(f"export of one {steps}-step window (export thread): {export_s * 1000:.1f} ms")
    monitor.close()
    return instrumented, bare


def _relative(pairs: list[list[float]]) -> list[float]:
    """Per block pair, the relative difference (%) of the on and off block medians."""
    return [(on - off) / off * 100.0 for on, off in pairs]


def _per_pair(results: list[dict[str, Any]], key: str) -> list[float]:
    """Per block pair, the ranks' relative differences (%) averaged."""
    per_rank = [_relative(result[key]) for result in results]
    return [statistics.fmean(values) for values in zip(*per_rank, strict=True)]


def _bootstrap_ci(
    values: list[float],
    control: list[float],
    *,
    statistic: Any = statistics.median,
    seed: int = 0,
    rounds: int = 4000,
) -> tuple[float, float]:
    """95% CI of statistic(values) - statistic(control), resampling both."""
    rng = random.Random(seed)
    estimates = sorted(
        statistic(rng.choices(values, k=len(values)))
        - statistic(rng.choices(control, k=len(control)))
        for _ in range(rounds)
    )
    return estimates[int(0.025 * rounds)], estimates[int(0.975 * rounds)]


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


def _cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat (Linux), or None elsewhere."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    ticks = [int(field) for field in fields[:8]]
    return ticks[7], sum(ticks)


def _steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> str:
    """Share of CPU time the hypervisor gave to other guests: noise no design removes."""
    if before is None or after is None or after[1] == before[1]:
        return "steal time n/a"
    return f"steal time {(after[0] - before[0]) / (after[1] - before[1]) * 100:.1f} % of CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument(
        "--pairs", type=int, default=3000, help="A/B pairs (of steps, or of blocks of --block)"
    )
    parser.add_argument("--block", type=int, default=20, help="steps per block")
    parser.add_argument("--control-pairs", type=int, default=500, help="A/A pairs, measured first")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--on-warmup",
        type=int,
        default=120,
        help="instrumented steps before measuring (past the profiler's warm-up and probe)",
    )
    parser.add_argument("--hidden", type=int, default=2048, help="MLP width (step time)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--mode",
        choices=("full", "no-ops", "collective", "no-comm-hook", "manual", "plain-python-hook"),
        default="full",
        help="arm A: everything (default), without op histograms, without the comm hook, "
        "only monitor.step()/phase('data'), or DDP's own Python allreduce_hook alone",
    )
    parser.add_argument(
        "--design",
        choices=("alternate", "toggle", "replicas"),
        default="alternate",
        help="alternate (default): one DDP replica, the arms alternating every step (arm A's "
        "hooks installed before its step and removed after); toggle: the same in blocks of "
        "--block steps; replicas: two replicas, arm A's permanently instrumented (forced for "
        "the modes that register a DDP comm hook, which DDP cannot remove)",
    )
    parser.add_argument(
        "--sink",
        choices=("receiver", "bridge"),
        default="receiver",
        help="receiver (default): a plain loopback OTLP/HTTP receiver; the bridge runs on other "
        "machines in a deployment, and here it would take CPU from the ranks it measures "
        "(decoding and converting each window); bridge: the real stepwatch bridge in this "
        "process, with a counting writer",
    )
    parser.add_argument("--comm-pairs", type=int, default=30, help="0 skips the comm-hook job")
    parser.add_argument(
        "--phase-sampling",
        default="auto",
        help="StepMonitor(phase_sampling=...): auto (the default), 1 (every step) or a stride",
    )
    parser.add_argument(
        "--export-interval",
        type=float,
        default=None,
        help="StepMonitor(export_interval_s=...) (default: the monitor's, 10 s)",
    )
    args = parser.parse_args()
    if args.mode in ("collective", "plain-python-hook"):
        args.design = "replicas"

    import torch.multiprocessing as mp

    print(f"start: {_load()}", flush=True)
    with_phases, bare = hot_path_cost_us()
    print(
        f"hot path: {with_phases:.2f} µs/step with step()+4 phases, {bare:.2f} µs bare "
        f"-> {with_phases - bare:.2f} µs added per step",
        flush=True,
    )
    if args.comm_pairs > 0:
        comm_hook_cost_us(pairs=args.comm_pairs, block=10, seed=args.seed)

    receiver: BridgeSink | Receiver = BridgeSink() if args.sink == "bridge" else Receiver()
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            options = {
                "ranks": args.ranks,
                "pairs": args.pairs,
                "control_pairs": args.control_pairs,
                "block": args.block,
                "warmup": args.warmup,
                "on_warmup": args.on_warmup,
                "hidden": args.hidden,
                "batch": args.batch,
                "seed": args.seed,
                "mode": args.mode,
                "design": args.design,
                "phase_sampling": (
                    args.phase_sampling
                    if args.phase_sampling == "auto"
                    else int(args.phase_sampling)
                ),
                "export_interval_s": args.export_interval,
                "endpoint": receiver.url,
                "out_dir": out_dir,
            }
            started, ticks = time.monotonic(), _cpu_ticks()
            mp.start_processes(
                _rank_main, args=(options,), nprocs=args.ranks, join=True, start_method="spawn"
            )
            wall_s = time.monotonic() - started
            steal = _steal_share(ticks, _cpu_ticks())
            results = [
                json.loads(Path(out_dir, f"rank{rank}.json").read_text())
                for rank in range(args.ranks)
            ]
    finally:
        receiver.stop()

    alternate = args.design == "alternate"
    block = 1 if alternate else args.block
    print(
        f"DDP job ({args.mode}, {args.design}): {args.ranks} ranks gloo, {args.pairs} pairs x "
        f"{block} steps per arm, {wall_s:.0f} s wall, {steal}"
    )
    if not alternate:
        on = [t for r in results for t in r["samples"]["on"]]
        off = [t for r in results for t in r["samples"]["off"]]
        median_on, median_off = statistics.median(on), statistics.median(off)
        print(f"median step time  on: {median_on * 1000:.3f} ms   off: {median_off * 1000:.3f} ms")
    for rank, result in enumerate(results):
        duty = result["duty_cycle"]
        if duty is None:
            continue
        cost = duty["cycle_cost_s"]
        spent_share = duty["spent_s"] / result["on_steps_s"] * 100.0
        print(
            f"profiler rank {rank}: {duty['cycles']} cycles of {duty['active_steps']} steps, "
            f"period {duty['period_steps']} steps, cost/cycle "
            + (f"{cost * 1e3:.2f} ms" if cost is not None else "n/a")
            + f" (training thread {_ms(duty['training_cost_s'])}, export thread "
            f"{_ms(duty['drain_cost_s'])}), baseline step {_ms(duty['baseline_step_s'])}, "
            f"expected {_pct(duty['expected_overhead'])} of step time; charged so far "
            f"{duty['spent_s'] * 1e3:.1f} ms = {spent_share:.2f} % of arm A's step time; "
            f"one-time warm-up {_ms(duty['warmup_cost_s'])} (not charged); the export "
            f"work's CPU paid from the same budget {duty.get('shared_spent_s', 0.0) * 1e3:.1f} ms"
            f" = {_pct(duty.get('shared_share'))} of the training time that earned it"
        )
    if alternate:
        _report_alternating(results)
    else:
        _report_blocks(results, args.design)
    steps_per_arm = args.pairs * block * args.ranks
    gc_line = []
    for arm in ("on", "off"):
        gc_s = sum(r["gc"][arm]["s"] for r in results)
        gen2 = sum(r["gc"][arm]["gen2"] for r in results)
        count = sum(r["gc"][arm]["all"] for r in results)
        gc_line.append(
            f"{arm}: {gc_s / steps_per_arm * 1e6:.1f} µs/step ({count} collections, {gen2} full)"
        )
    print(
        "garbage collection during the measured steps (in the times above), " + "; ".join(gc_line)
    )
    exported = sum(r["stats"]["steps_exported"] for r in results)
    recorded = sum(r["stats"]["steps_recorded"] for r in results)
    interval = results[0].get("export_interval_s")
    print(
        f"exported {exported}/{recorded} instrumented steps, one window per {interval} s; "
        f"sink: {receiver.describe()}"
    )
    strides = sorted({r["phase_stride"] for r in results})
    print(f"phase sampling: {args.phase_sampling}; stride at the end {strides} (1: every step)")
    print(f"end: {_load()}")
    return 0


def _report_blocks(results: list[dict[str, Any]], design: str) -> None:
    """The block designs' estimators (toggle, replicas)."""
    # DDP couples the ranks (each step waits for the slowest), so their pairs are not
    # independent samples: one value per pair, the mean over ranks.
    ab = _per_pair(results, "pair_medians")
    aa = _per_pair(results, "control_pair_medians")
    ab_cpu = _per_pair(results, "pair_cpu")
    aa_cpu = _per_pair(results, "control_pair_cpu")
    ab_thread = _per_pair(results, "pair_thread")
    aa_thread = _per_pair(results, "control_pair_thread")
    for label, values, control, statistic in (
        ("wall clock (median step time per block)", ab, aa, statistics.median),
        ("CPU time (mean per step, all threads)", ab_cpu, aa_cpu, statistics.fmean),
        ("training thread CPU (mean per step)", ab_thread, aa_thread, statistics.fmean),
    ):
        if design == "toggle":
            # One replica: nothing differs between the arms but stepwatch, so the overhead is
            # A/B itself; A/A (both arms plain) shows what the estimator reads for nothing.
            overhead = statistic(values)
            low, high = _bootstrap_ci(values, [0.0], statistic=statistic)
            c_low, c_high = _bootstrap_ci(control, [0.0], statistic=statistic)
            print(
                f"{label}: overhead {overhead:+.2f} % (95% CI {low:+.2f} .. {high:+.2f} %); "
                f"A/A control {statistic(control):+.2f} % (CI {c_low:+.2f} .. {c_high:+.2f} %)"
            )
        else:
            overhead = statistic(values) - statistic(control)
            low, high = _bootstrap_ci(values, control, statistic=statistic)
            print(
                f"{label}: A/B {statistic(values):+.2f} %, A/A {statistic(control):+.2f} % "
                f"-> overhead {overhead:+.2f} % (95% CI {low:+.2f} .. {high:+.2f} %)"
            )
    export_s = sum(r["export_cpu_s"] for r in results)
    on_s = sum(r["on_steps_s"] for r in results)
    print(
        f"export thread CPU: {export_s * 1e3:.0f} ms over {on_s:.0f} s of arm-A steps "
        f"= {export_s / on_s * 100:.3f} % of arm A's step time (charged to arm A above)"
    )


def _report_alternating(results: list[dict[str, Any]]) -> None:
    """The alternating design's estimators, each with a 95 % bootstrap CI over step pairs.

    A pair is one A step and one B step, on every rank at once (DDP couples the ranks, so a
    resample draws whole pairs, all ranks together). Pairs a profiling cycle covered on any
    rank are set apart: the profiler keeps running through the B steps of its cycle. Its cost
    is the duty cycle's own account, added to the CPU total with the export thread's.
    """
    import numpy as np

    rows = np.array([r["rows"] for r in results])  # rank, pair, field
    control = np.array([r["control_rows"] for r in results])
    profiled = rows[:, :, 4].max(axis=0) > 0
    print(
        f"pairs covered by a profiling cycle (set apart): {int(profiled.sum())} of {rows.shape[1]}"
    )
    rng = np.random.default_rng(0)

    def estimate(data: Any, statistic: str) -> tuple[float, float, float]:
        def value(index: Any) -> float:
            picked = data[:, index, :]
            if statistic == "median":
                return float(np.median(picked[:, :, 0]) / np.median(picked[:, :, 1]) - 1)
            a, b = (2, 3) if statistic == "cpu" else (0, 1)
            return float(picked[:, :, a].sum() / picked[:, :, b].sum() - 1)

        pairs = data.shape[1]
        point = value(np.arange(pairs))
        boot = sorted(value(rng.integers(0, pairs, pairs)) for _ in range(1000))
        return point * 100, boot[25] * 100, boot[974] * 100

    kept = rows[:, ~profiled, :]
    for label, statistic in (
        ("median step time (the goal metric)", "median"),
        ("mean step time", "mean"),
        ("training thread CPU (mean per step)", "cpu"),
    ):
        point, low, high = estimate(kept, statistic)
        c_point, c_low, c_high = estimate(control, statistic)
        print(
            f"{label}: overhead {point:+.3f} % (95% CI {low:+.3f} .. {high:+.3f} %); "
            f"A/A control {c_point:+.3f} % (CI {c_low:+.3f} .. {c_high:+.3f} %)"
        )
    on_s = sum(r["on_steps_s"] for r in results)
    all_s = on_s + sum(r["off_steps_s"] for r in results)
    export_s = sum(r["export_cpu_s"] for r in results)
    # The export thread works once an interval whatever the steps, plus a little per step: over
    # all steps its share is what training pays for the fixed part, over A's steps alone an
    # upper bound (a window holds half as many A steps as in training).
    export_low, export_high = export_s / all_s * 100, export_s / on_s * 100
    # The profiler earns its budget on every step boundary it sees, B steps included: its
    # charged cost over all steps is what training pays. Its export-thread part (reading the
    # ops) is already in the export thread's clock: counted there, not twice.
    profiler_share = (
        sum(r["profiler_spent_s"] - r.get("profiler_drain_s", 0.0) for r in results) / all_s * 100
    )
    thread, _, _ = estimate(kept, "cpu")
    low_total = thread + export_low + profiler_share
    high_total = thread + export_high + profiler_share
    print(
        f"off the training thread: export thread {export_low:.3f}-{export_high:.3f} % of step "
        f"time (op reading included), profiler cycles on the training thread "
        f"{profiler_share:.3f} % (their own account); CPU all in: "
        f"{low_total:+.3f} .. {high_total:+.3f} %"
    )
    # The headline: what a user with the defaults pays, per part, at this step time.
    step_ms = float(np.median(kept[:, :, 1])) * 1e3
    added_us = (kept[:, :, 2] - kept[:, :, 3]).mean(axis=0) * 1e6  # per pair, ranks' mean
    pairs = added_us.shape[0]
    boot_us = sorted(float(added_us[rng.integers(0, pairs, pairs)].mean()) for _ in range(1000))
    us, us_low, us_high = float(added_us.mean()), boot_us[25], boot_us[974]
    share = us / (step_ms * 1e3) * 100
    share_low, share_high = us_low / (step_ms * 10), us_high / (step_ms * 10)
    print(
        f"fully on at ~{step_ms:.0f} ms step: training-thread {us:.1f} µs/step "
        f"(95% CI {us_low:.1f} .. {us_high:.1f}) = {share:.3f} % "
        f"({share_low:.3f} .. {share_high:.3f}), export thread "
        f"{export_low:.3f}-{export_high:.3f} %, op histograms (training thread) "
        f"{profiler_share:.3f} %, total "
        f"{share + export_low + profiler_share:.3f} % (95% CI "
        f"{share_low + export_low + profiler_share:.3f} .. "
        f"{share_high + export_high + profiler_share:.3f} %) (goal <= 0.1 %)",
        flush=True,
    )


def _ms(value_s: float | None) -> str:
    return "n/a" if value_s is None else f"{value_s * 1e3:.2f} ms"


def _pct(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction * 100:.3f} %"


if __name__ == "__main__":
    raise SystemExit(main())
