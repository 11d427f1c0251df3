"""Run stepwatch's GPU paths for real on a CUDA machine and record what they saw.

Parts (each in its own try: one failing part does not hide the others):

1. ``nvml``: :class:`~stepwatch.exporters.kernels.HealthSampler` on the real NVML: readings,
   then the metrics of one window.
2. ``cupti``: :class:`~stepwatch.exporters.kernels.CuptiSource` on the real CUPTI: steps of
   known work (matrix products, an element-wise op, a host-to-device copy, a memset), one
   drain per step, checked for the classes each step must hold.
3. ``timer``: :class:`~stepwatch.exporters.CudaEventTimer` around a device sleep the host does
   not wait for: the device time it reports against the host's launch time.
4. ``straggler``, ``regression``: a 2-rank DDP job (gloo, both ranks on the one GPU), fully
   instrumented (auto phases, CUPTI, NVML, CUDA-event timing), exporting a window every second
   to a capturing OTLP/HTTP receiver. From the middle on, extra matrix products in the forward
   pass: rank 1's alone (a compute straggler; on one shared GPU rank 0's kernels queue behind
   them too) or every rank's (a job-wide regression). Each capture (``otlp_FAULT.jsonl.gz``)
   replays into a bridge with ``--replay``, for the detectors where InfluxDB runs.
5. ``overhead``: a single-GPU loop without and with the full monitor, in alternating
   processes: median step times side by side (``--baseline DIR`` adds ``old:ARM`` arms run
   on another stepwatch tree, e.g. the previous commit's, in the same run).
6. ``marks``: what one device mark costs the training thread, each way of making one (and,
   in a ring of 256, with the oldest event's destruction).
7. ``hostbound``: ``overhead`` on a model so small the host is the bottleneck (no
   synchronisation per step): the microseconds each arm adds to the host's step.
8. ``frames``: a 1-rank DDP job (NCCL) with the default monitor: whether a step, timed or
   not, loop-marked or auto, enters a Python frame of stepwatch's, and its phases.
9. ``abhooks``: the hooks' cost to the training thread in one process (blocks with and
   without each monitor's instrumentation, paired per round; bare-event arms), free of the
   process-to-process spread of ``hostbound``. Run it once per tree (``PYTHONPATH``).

The first step's kernels: ``cupti`` enables CUPTI before its warm-up step, as the monitor does
(``on_monitor_start``), and reports that step's matrix-product records.

Usage (on the GPU machine; ``OUT`` is where results go)::

    python bench/gpu_check.py --out "$OUT"
    python bench/gpu_check.py --replay OUT/otlp_straggler.jsonl.gz --endpoint http://127.0.0.1:4318

Results: ``gpu_check.json`` (every part's figures), the captures.
"""

from __future__ import annotations

import argparse
import base64
import collections
import gzip
import http.server
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from typing import Any, ClassVar

JOB_STEPS = 1600
JOB_FAULT_STEP = 800
JOB_HIDDEN = 1024
JOB_BATCH = 256
JOB_BURN = 4096  # the straggler's extra products: JOB_BURN x JOB_BURN, 3 per forward


def _versions() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    for module, attribute in (("cupti", "__version__"), ("pynvml", "__version__")):
        try:
            info[module] = getattr(__import__(module), attribute, "?")
        except Exception as exc:
            info[module] = f"missing: {exc}"
    try:
        from cupti import cupti

        info["cupti_api_version"] = cupti.get_version()
    except Exception as exc:
        info["cupti_api_version"] = f"n/a: {exc}"
    try:
        import pynvml

        pynvml.nvmlInit()
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:
        info["driver"] = f"n/a: {exc}"
    return info


def part_nvml() -> dict[str, Any]:
    from stepwatch.exporters import build_resource
    from stepwatch.exporters.kernels import HealthSampler

    sampler = HealthSampler(build_resource(job_id="gpu-check", rank=0, world_size=1))
    start = time.time_ns()
    sampler.sample()
    time.sleep(0.2)
    sampler.sample()
    metrics = sampler.build(start_unix_nano=start, end_unix_nano=time.time_ns())
    readings = {str(k): repr(v) for k, v in sampler._last.items()}
    points: dict[str, list[Any]] = {}
    if metrics is not None:
        for resource_metrics in metrics.resource_metrics:
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    points[metric.name] = [
                        (dict(point.attributes or {}), getattr(point, "value", None))
                        for point in metric.data.data_points
                    ]
    sampler.close()
    return {"active": sampler.active, "readings": readings, "metrics": points}


def part_cupti() -> dict[str, Any]:
    import torch

    from stepwatch.exporters.kernels import CuptiSource

    # A tiny kernel's launch before CUPTI is on: what CUPTI's tracing adds to each launch (the
    # runs below launch the same kernels with it on).
    small = torch.ones(16, device="cuda")
    for _ in range(1000):
        small.add_(1)
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(20000):
        small.add_(1)
    torch.cuda.synchronize()
    launch_without_cupti_us = (time.perf_counter() - begin) / 20000 * 1e6
    source = CuptiSource()
    # As the monitor does when it makes its recorder: CUPTI on before the first step, so that
    # the first step's kernels count (the warm-up below must hold its 4 products).
    start = getattr(source, "on_monitor_start", None)
    if start is not None:
        start()
    device = torch.device("cuda")
    a = torch.randn(2048, 2048, device=device)
    host = torch.randn(4096, 4096)
    steps: list[dict[str, Any]] = []

    def gemm() -> None:
        for _ in range(4):
            torch.mm(a, a)

    def elementwise() -> None:
        for _ in range(4):
            a.mul_(1.0001)

    def copy_and_set() -> None:
        host.to(device, non_blocking=False)
        torch.zeros(1 << 24, device=device)

    work = [("warm-up", gemm), ("gemm", gemm), ("elementwise", elementwise), ("copy", copy_and_set)]
    for index, (label, body) in enumerate(work):
        torch.cuda.synchronize()
        body()
        torch.cuda.synchronize()
        source.on_step_end(index)
        window = source.drain()
        steps.append(
            {
                "step": label,
                "classes": {
                    f"{name}/{category}": [len(d), round(sum(d) * 1e6, 1)]
                    for (name, category), d in window.durations_s.items()
                },
                "idle_us": [round(v * 1e6, 1) for v in window.idle_durations_s],
            }
        )
    # Throughput: records per second CUPTI delivers for small kernels, and the drain's cost.
    runs: dict[str, dict[str, Any]] = {}
    # The same 20,000 tiny kernels twice per path: summarised in bulk (numpy), then per event.
    for label, bulk in (("bulk", True), ("per-event", False), ("bulk-2", True)):
        source._bulk = bulk
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(20000):
            small.add_(1)
        torch.cuda.synchronize()
        launch_s = time.perf_counter() - begin
        source.on_step_end(len(work) + len(runs))
        begin = time.perf_counter()
        source._backend.flush()  # CUPTI's buffers to records (the callback converts them)
        flush_s = time.perf_counter() - begin
        begin = time.perf_counter()
        window = source.drain()  # the records into histograms
        drain_s = time.perf_counter() - begin
        runs[label] = {
            "launched": 20000,
            "records_drained": sum(len(d) for d in window.durations_s.values()),
            "classes": sorted(f"{name}/{category}" for name, category in window.durations_s),
            "launch_us_per_kernel": round(launch_s / 20000 * 1e6, 3),
            "flush_and_convert_us_per_record": round(flush_s / 20000 * 1e6, 3),
            "summarise_us_per_record": round(drain_s / 20000 * 1e6, 3),
        }
    source.close()

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_cupti_cycle import launch_us as launch

    def launch_us() -> float:
        return launch(torch, small)

    # Whether a duty cycle would help: a launch once CUPTI's activity kinds are disabled again,
    # and what switching them on and off costs (each switch timed, three rounds).
    after_disable = [launch_us()]
    switches: dict[str, list[float]] = {"enable_ms": [], "disable_ms": [], "launch_on_us": []}
    for _ in range(3):
        again = CuptiSource()
        begin = time.perf_counter()
        again.on_monitor_start()
        switches["enable_ms"].append(round((time.perf_counter() - begin) * 1e3, 3))
        switches["launch_on_us"].append(launch_us())
        begin = time.perf_counter()
        again.close()
        switches["disable_ms"].append(round((time.perf_counter() - begin) * 1e3, 3))
        after_disable.append(launch_us())
    first = steps[0]["classes"]
    return {
        "launch_us_per_kernel_without_cupti": round(launch_without_cupti_us, 3),
        "launch_us_per_kernel_after_disable": after_disable,
        "switching": switches,
        "first_step_gemm_records": sum(
            count for name, (count, _) in first.items() if name.startswith("gemm")
        ),
        "active": source.active,
        "bulk_still_on": source._bulk,
        "dropped_records": source.dropped_records,
        "steps": steps,
        "small_kernels": runs,
    }


def part_timer() -> dict[str, Any]:
    import torch

    from stepwatch.exporters.device._cuda import CudaEventTimer

    timer = CudaEventTimer()
    rate_khz = (
        torch.cuda.get_device_properties(0).clock_rate
        if hasattr(torch.cuda.get_device_properties(0), "clock_rate")
        else None
    )
    results = []
    for cycles in (10_000_000, 50_000_000):
        torch.cuda.synchronize()
        host_begin = time.perf_counter()
        start = timer.mark()
        torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
        end = timer.mark()
        host_launch_s = time.perf_counter() - host_begin
        ready_at_launch = timer.ready(end)
        while not timer.ready(end):
            time.sleep(0.0005)
        host_done_s = time.perf_counter() - host_begin
        results.append(
            {
                "cycles": cycles,
                "device_s": round(timer.elapsed_s(start, end), 6),
                "host_launch_s": round(host_launch_s, 6),
                "host_until_ready_s": round(host_done_s, 6),
                "ready_right_after_launch": ready_at_launch,
            }
        )
    return {"clock_rate_khz": rate_khz, "mark": timer.kind, "sleeps": results}


def part_marks(count: int = 20_000, rounds: int = 3) -> dict[str, Any]:
    """Training-thread cost of one device mark, each way of making one, interleaved rounds."""
    import functools

    import torch

    from stepwatch.exporters import _fastrecord
    from stepwatch.exporters.device._cuda import CudaEventTimer

    def cuda_event() -> Any:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
        return event

    factory = functools.partial(torch.Event, "cuda", enable_timing=True)

    def torch_event() -> Any:
        event = factory()
        event.record()
        return event

    timer = CudaEventTimer()
    stamp = _fastrecord.MarkStamp(timer)
    marker = _fastrecord.EventMarker(factory)
    ring: collections.deque[Any] = collections.deque(maxlen=256)

    def ring_mark() -> None:  # steady state: each mark also destroys the oldest event
        ring.append(marker())

    pooled = _fastrecord.EventMarker(factory, 256)

    def pool_mark() -> None:  # let go at once: each mark records a kept event again
        pooled()

    ways: dict[str, Callable[[], Any]] = {
        "torch.cuda.Event + record (Python)": cuda_event,
        "torch.Event + record (Python frame)": torch_event,
        "EventMarker (C)": _fastrecord.EventMarker(factory),
        "MarkStamp call (C, autograd's last-gradient stamp)": stamp,
        "CudaEventTimer.mark (as configured)": timer.mark,
        "EventMarker, a ring of 256 (+ the oldest event's destruction)": ring_mark,
        "EventMarker with a pool (an event recorded again)": pool_mark,
    }
    per_mark: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            held = []
            torch.cuda.synchronize()
            begin = time.perf_counter_ns()
            for _ in range(count):
                held.append(way())
            per_mark[name].append((time.perf_counter_ns() - begin) / count / 1000)
            torch.cuda.synchronize()
            held.clear()
    return {
        "count": count,
        "timer_kind": timer.kind,
        "us_per_mark_median": {
            name: round(statistics.median(values), 3) for name, values in per_mark.items()
        },
        "us_per_mark_rounds": {
            name: [round(value, 3) for value in values] for name, values in per_mark.items()
        },
    }


# --- the 2-rank job ---------------------------------------------------------------------------


class _Capture(http.server.BaseHTTPRequestHandler):
    store: ClassVar[list[dict[str, Any]]] = []
    lock: ClassVar[threading.Lock] = threading.Lock()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        with self.lock:
            self.store.append(
                {
                    "t": time.time_ns(),
                    "path": self.path,
                    "content_type": self.headers.get("Content-Type", ""),
                    "content_encoding": self.headers.get("Content-Encoding", ""),
                    "body": base64.b64encode(body).decode(),
                }
            )
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _rank_main(
    rank: int, world: int, port: int, endpoint: str, result_dir: str, fault: str
) -> None:
    logging.basicConfig(level=logging.INFO)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from stepwatch.exporters import StepMonitor
    from stepwatch.exporters.kernels import CuptiSource

    torch.manual_seed(1234 + rank)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    device = torch.device("cuda", 0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, JOB_HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(JOB_HIDDEN, JOB_HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(JOB_HIDDEN, JOB_HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(JOB_HIDDEN, 10),
    ).to(device)
    burner = torch.randn(JOB_BURN, JOB_BURN, device=device)
    slow = [False]

    def straggle(_module: Any, _inputs: Any) -> None:
        if slow[0]:
            x = burner
            for _ in range(3):
                x = torch.mm(x, burner).clamp_(-1.0, 1.0)

    model[0].register_forward_pre_hook(straggle)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    source = CuptiSource()
    monitor = StepMonitor(
        job_id=f"gpu-{fault}{world}",
        rank=rank,
        world_size=world,
        host_name="gpu-node0",
        local_rank=rank,
        endpoint=endpoint,
        protocol="http/protobuf",
        export_interval_s=1.0,
        kernel_source=source,
        health=True,
        device_timer="auto",
    )
    monitor.instrument(ddp, optimizer)
    step_s: list[float] = []
    for step in range(JOB_STEPS):
        slow[0] = step >= JOB_FAULT_STEP and (fault == "regression" or rank == 1)
        begin = time.perf_counter()
        with monitor.step():
            with monitor.phase("data"):
                inputs = torch.randn(JOB_BATCH, 256).to(device, non_blocking=True)
                targets = torch.randint(0, 10, (JOB_BATCH,)).to(device, non_blocking=True)
            loss = loss_fn(ddp(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        step_s.append(time.perf_counter() - begin)
    torch.cuda.synchronize()
    monitor.close()
    healthy = step_s[100:JOB_FAULT_STEP]
    faulty = step_s[JOB_FAULT_STEP + 100 :]
    summary = {
        "rank": rank,
        "device_timer": type(monitor._sources.device_timer).__name__
        if hasattr(monitor, "_device_timer")
        else "?",
        "cupti_active": source.active,
        "cupti_dropped_records": source.dropped_records,
        "median_step_ms_healthy": round(statistics.median(healthy) * 1e3, 3),
        "median_step_ms_faulty": round(statistics.median(faulty) * 1e3, 3),
    }
    with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as out:
        json.dump(summary, out)
    dist.destroy_process_group()


def part_job(out_dir: str, fault: str, world: int = 2) -> dict[str, Any]:
    from torch.multiprocessing.spawn import spawn

    from stepwatch.core._net import free_port

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    begin = time.monotonic()
    _Capture.store.clear()
    spawn(_rank_main, args=(world, free_port(), endpoint, out_dir, fault), nprocs=world, join=True)  # type: ignore[no-untyped-call]
    wall_s = time.monotonic() - begin
    time.sleep(0.5)
    server.shutdown()
    with _Capture.lock:
        store = list(_Capture.store)
    capture = os.path.join(out_dir, f"otlp_{fault}{world}.jsonl.gz")
    with gzip.open(capture, "wt") as out:
        for request in store:
            out.write(json.dumps(request) + "\n")
    ranks = []
    for rank in range(world):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as handle:
            ranks.append(json.load(handle))
        os.remove(os.path.join(out_dir, f"rank{rank}.json"))
    return {
        "wall_s": round(wall_s, 1),
        "requests": len(store),
        "bytes": sum(len(base64.b64decode(r["body"])) for r in store),
        "ranks": ranks,
        "metric_names": sorted(_metric_names(store)),
    }


def _metric_names(store: list[dict[str, Any]]) -> set[str]:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    names: set[str] = set()
    for request in store:
        body = base64.b64decode(request["body"])
        if request["content_encoding"] == "gzip":
            body = gzip.decompress(body)
        message = ExportMetricsServiceRequest()
        message.ParseFromString(body)
        for resource_metrics in message.resource_metrics:
            for scope in resource_metrics.scope_metrics:
                names.update(metric.name for metric in scope.metrics)
    return names


# --- frames -----------------------------------------------------------------------------------


def part_frames(out_dir: str, steps: int = 40) -> dict[str, Any]:
    """A 1-rank DDP job (NCCL on the GPU; gloo on a CPU, to try this part anywhere), fully
    instrumented with the default device timer: does a step, timed or not, marked by the loop
    or by auto mode, enter a Python frame of stepwatch's, and what do its phases read."""
    import contextlib
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from stepwatch.exporters import InMemoryExporter, StepMonitor, _recorder

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    store = tempfile.mkdtemp(dir=out_dir if os.path.isdir(out_dir) else None)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{store}/store", rank=0, world_size=1
    )
    package = os.path.dirname(_recorder.__file__)
    results: dict[str, Any] = {"backend": dist.get_backend(), "device": str(device)}

    def case(stride: int, loop_marks: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
        model = DistributedDataParallel(torch.nn.Sequential(*layers).to(device))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        exporter = InMemoryExporter()
        monitor = StepMonitor(
            job_id="frames",
            rank=0,
            world_size=1,
            exporter=exporter,
            start=False,
            health=False,
            phase_sampling=stride,
        )
        handle = monitor.instrument(model, optimizer)
        data = torch.randn(256, 1024, device=device)
        context = monitor.step if loop_marks else contextlib.nullcontext
        entered: list[str] = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code.co_filename.startswith(package):
                entered.append(f"{frame.f_code.co_name}:{frame.f_lineno}")

        for index in range(steps):
            if index == steps // 2:
                sys.setprofile(profile)
            try:
                with context():
                    model(data).square().mean().backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            finally:
                sys.setprofile(None)
        if cuda:
            torch.cuda.synchronize()
        state = handle._state
        sampled = monitor._recorder.sampled  # the last step's (1 in 2**40: none)
        handle.remove()
        monitor.close(timeout_s=5.0)
        phases: dict[str, list[float]] = {}
        for window in exporter.exported:
            for metric in window.resource_metrics[0].scope_metrics[0].metrics:
                if metric.name == "stepwatch.phase.duration":
                    for point in metric.data.data_points:
                        name = str(point.attributes["stepwatch.phase"])
                        entry = phases.setdefault(name, [0, 0.0])
                        entry[0] += point.count
                        entry[1] += point.sum
        return {
            "state": type(state).__name__,
            "c_gates": bool(state.gates),
            "timer": getattr(monitor._sources.device_timer, "kind", None),
            "last_step_sampled": sampled,
            "python_frames_entered": entered[:20],
            "python_frames_count": len(entered),
            "misuse": monitor.stats.misuse,
            "phase_ms_per_step": {
                name: round(total / max(count, 1) * 1e3, 4)
                for name, (count, total) in sorted(phases.items())
            },
            "phase_counts": {name: entry[0] for name, entry in sorted(phases.items())},
        }

    try:
        for stride in (1, 1 << 40):
            for loop_marks in (True, False):
                kind = "timed" if stride == 1 else "untimed"
                results[f"{kind}/{'step()' if loop_marks else 'auto'}"] = case(stride, loop_marks)
    finally:
        dist.destroy_process_group()
    return results


# --- in-process A/B of the hooks -----------------------------------------------------------------


def part_abhooks(
    rounds: int = 30, block: int = 50, hidden: int = 256, batch: int = 64, events: Any = None
) -> Any:
    """The training thread's cost of auto mode's hooks, in one process: blocks of ``block``
    host-bound steps (no synchronisation), with no instrumentation and with each monitor's
    in turn (instrumented, then removed; its steps exported after the block's timing, as the
    export thread would), round after round. No export thread runs and no kernel source: the
    hooks, the recorder and the marks alone. Paired per round, so the process-to-process
    spread of ``hostbound`` (±15 %) is out. On a GPU (or with ``events`` True: a test's
    stand-in ``torch.Event``), device-timed monitors with the timer's event pool and without,
    and arms ``bare-WAY-N`` (no monitor) that make N CUDA events a step: what the events
    themselves cost in this loop, made, recorded, destroyed or recorded again."""
    import functools

    import torch

    from stepwatch.exporters import InMemoryExporter, StepMonitor

    cuda = torch.cuda.is_available()
    events = cuda if events is None else events
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(4):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = torch.randn(batch, hidden, device=device)

    def monitor(**options: Any) -> StepMonitor:
        return StepMonitor(
            job_id="ab",
            rank=0,
            world_size=1,
            exporter=InMemoryExporter(),
            start=False,
            health=False,
            **options,
        )

    from stepwatch.exporters.device._cuda import CudaEventTimer

    # No monitor: N CUDA events a step, made and recorded in C (EventMarker) and spread over
    # the step as a device timer's marks are: "new" keeps the last 512 (each mark then
    # destroys the oldest, as when steps held none), "held" keeps a block's (destroyed after
    # its timing, as the export thread would), "pool" is the marker's pool (recorded again).
    bare: dict[str, tuple[int, str]] = {}
    if events:
        bare = {
            f"bare-{way}-{count}": (count, way)
            for count, way in ((3, "new"), (3, "pool"), (7, "new"), (7, "held"), (7, "pool"))
        }
    ring: collections.deque[Any] = collections.deque(maxlen=512)
    held: list[Any] = []
    makers: dict[str, Any] = {}
    if events:
        from stepwatch.exporters import _fastrecord

        factory = functools.partial(torch.Event, "cuda", enable_timing=True)
        makers = {"new": _fastrecord.EventMarker(factory), "held": _fastrecord.EventMarker(factory)}
        makers["pool"] = _fastrecord.EventMarker(factory, 4096)
    keep = {"new": ring.append, "held": held.append, "pool": lambda _event: None}
    # 1 in 8: what "auto" picks at a 20 ms step once windows are built (with no window, as
    # here, it would time every step); phases on the device where there is one, the default,
    # with the timer's event pool and without (each block's steps exported after its timing,
    # so their events are let go as the export thread does).
    monitors = {
        "device-1-in-8": monitor(phase_sampling=8),
        "host-1-in-8": monitor(device_timer="cpu", phase_sampling=8),
        "device-every-step": monitor(phase_sampling=1),
        "host-every-step": monitor(device_timer="cpu", phase_sampling=1),
    }
    if events:
        from bench.hook_cost import StandInDevice

        monitors["device-1-in-8-no-pool"] = monitor(
            device_timer=CudaEventTimer(pool=0), phase_sampling=8
        )
        monitors["device-every-step-no-pool"] = monitor(
            device_timer=CudaEventTimer(pool=0), phase_sampling=1
        )
        # The device-timed path with marks that cost a C call (no CUDA event): what a
        # device-timed step costs besides its events.
        monitors["stand-in-1-in-8"] = monitor(device_timer=StandInDevice(), phase_sampling=8)
        monitors["stand-in-every-step"] = monitor(device_timer=StandInDevice(), phase_sampling=1)

    marks, mark, put = 0, None, ring.append
    spread = (0, 0, 1, 1, 2, 2, 3)  # before the forward, after it, after backward, after step

    def at(position: int) -> None:
        for index in range(marks):
            if spread[index % 7] == position:
                put(mark())

    def one() -> None:
        at(0)
        loss = model(data).square().mean()
        at(1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        at(2)
        optimizer.step()
        at(3)

    for _ in range(30):
        one()
    times: dict[str, list[float]] = {"off": [], **{name: [] for name in (*monitors, *bare)}}
    for _ in range(rounds):
        for arm in times:
            handle = monitors[arm].instrument(model, optimizer) if arm in monitors else None
            marks, way = bare.get(arm, (0, "new"))
            mark, put = makers.get(way), keep[way]
            for _ in range(5):
                one()
            if cuda:
                torch.cuda.synchronize()
            begin = time.perf_counter()
            for _ in range(block):
                one()
            times[arm].append((time.perf_counter() - begin) / block)
            if handle is not None:
                handle.remove()
            if cuda:
                torch.cuda.synchronize()
            if arm in monitors:
                monitors[arm].export_now()  # its steps let go of their events
            held.clear()
    for each in monitors.values():
        each.close(timeout_s=5.0)
    added = {
        arm: sorted((a - b) * 1e6 for a, b in zip(times[arm], times["off"], strict=True))
        for arm in times
        if arm != "off"
    }
    return {
        "timers": {
            name: getattr(m._sources.device_timer, "kind", None) for name, m in monitors.items()
        },
        "median_step_us": {arm: round(statistics.median(v) * 1e6, 2) for arm, v in times.items()},
        "added_us_median_paired": {arm: round(statistics.median(v), 2) for arm, v in added.items()},
        "added_us_trimmed_mean_paired": {  # the 10 % trimmed mean: less noisy than the median
            arm: round(statistics.fmean(v[len(v) // 10 : len(v) - len(v) // 10]), 2)
            for arm, v in added.items()
        },
        "added_us_quartiles": {
            arm: [round(v[len(v) // 4], 2), round(v[(3 * len(v)) // 4], 2)]
            for arm, v in added.items()
        },
        "misuse": {name: m.stats.misuse for name, m in monitors.items()},
        "events": {
            name: [getattr(marker, key, None) for key in ("made", "reused", "held")]
            for name, marker in [
                *((f"bare-{way}", maker) for way, maker in makers.items()),
                *(
                    (name, getattr(m._sources.device_timer, "mark", None))
                    for name, m in monitors.items()
                    if hasattr(getattr(m._sources.device_timer, "mark", None), "made")
                ),
            ]
        },
    }


# --- overhead ---------------------------------------------------------------------------------

OVERHEAD_CHILD = r"""
import json, statistics, sys, time
import torch
arm = sys.argv[1]
steps, hidden, batch = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sync_every_step = sys.argv[6] == "sync"
torch.manual_seed(0)
device = torch.device("cuda")
layers = []
for _ in range(4):
    layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
data = torch.randn(batch, hidden, device=device)
monitor = None
marks = int(arm.split("-")[1]) if arm.startswith("marks-") else 0
inner = int(arm.split("-")[1]) if arm.startswith("inner-") else 0
held = []
def inner_mark(position):  # bare timing events between the step's kernels, as phases take
    if position < inner:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        held.append(event)
if arm != "off" and not marks and not inner:
    from stepwatch.exporters import StepMonitor
    from stepwatch.exporters.device._cuda import CudaEventTimer
    from stepwatch.exporters.kernels import CuptiSource
    monitor = StepMonitor(
        job_id="ovh", rank=0, world_size=1, endpoint=sys.argv[5],
        kernel_source=None if arm == "no-cupti" else CuptiSource(**{
            "cupti-cycle": {"period_steps": 256},
            "cupti-detach": {"period_steps": 256, "detach": "finalize"}}.get(arm, {})),
        health=True,
        device_timer={"host-phases": "cpu", "no-pool": CudaEventTimer(pool=0)}.get(arm, "auto"),
        phase_sampling=1 if arm == "every-step" else "auto",
        export_interval_s=3600.0 if arm == "on-no-export" else None)
    handle = monitor.instrument(model, optimizer)
    kind = getattr(monitor._sources.device_timer, "kind", None)
    c_gates = bool(getattr(handle._state, "gates", ()))
def one():
    inner_mark(0)
    output = model(data)
    inner_mark(1)
    loss = output.square().mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    inner_mark(2)
    inner_mark(3)
    optimizer.step()
    inner_mark(4)
    for _ in range(marks):  # bare timing events, as a device timer's marks, kept till "export"
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        held.append(event)
    if len(held) > 1000:
        held.clear()
for _ in range(30):
    one()
torch.cuda.synchronize()
times = []
if sync_every_step:
    for _ in range(steps):
        begin = time.perf_counter()
        one()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
else:  # host-bound: blocks of 50 steps, the device never the bottleneck
    for _ in range(steps // 50):
        begin = time.perf_counter()
        for _ in range(50):
            one()
        times.append((time.perf_counter() - begin) / 50)
    torch.cuda.synchronize()
if monitor is not None:
    monitor.close()
print(json.dumps({"median_ms": statistics.median(times) * 1e3,
                  "mean_ms": statistics.fmean(times) * 1e3,
                  "mark": None if monitor is None else kind,
                  "c_gates": None if monitor is None else c_gates,
                  "misuse": None if monitor is None else monitor.stats.misuse,
                  "cupti_duty": None if monitor is None or monitor._sources.kernels is None
                  else str(getattr(monitor._sources.kernels, "duty_cycle", None))}))
"""


def part_overhead(
    runs: int,
    steps: int,
    hidden: int,
    batch: int,
    arms_text: str,
    *,
    sync: bool = True,
    baseline: str | None = None,
) -> dict[str, Any]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    # off: no monitor; on: the defaults (CUPTI, NVML, phases on the device, sampled);
    # host-phases: phases on the host clock; no-cupti: no kernel source; every-step: phases
    # timed on every step; on-no-export: no window during the run; cupti-cycle: CUPTI on 5
    # steps in 256, kinds disabled between; cupti-detach: the same, CUPTI finalized between
    # (bench/gpu_cupti_cycle.py); marks-N: no monitor, N
    # bare CUDA timing events recorded after each optimizer step; inner-N: no monitor, N bare
    # events inside the step (before and after the forward, after backward, ...), where a
    # sampled step's phases put theirs.
    names = tuple(arms_text.split(","))
    arms: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for _ in range(runs):
        for arm in names:
            env = dict(os.environ)
            if arm.startswith("old:"):
                if baseline is None:
                    raise RuntimeError(f"arm {arm} needs --baseline")
                paths = [os.path.join(baseline, part, "src") for part in ("core", "exporters")]
                env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
            done = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    OVERHEAD_CHILD,
                    arm.removeprefix("old:"),
                    str(steps),
                    str(hidden),
                    str(batch),
                    endpoint,
                    "sync" if sync else "host-bound",
                ],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
                env=env,
            )
            if done.returncode != 0:
                raise RuntimeError(f"overhead child ({arm}) failed: {done.stderr[-2000:]}")
            arms[arm].append(json.loads(done.stdout.strip().splitlines()[-1]))
    server.shutdown()
    medians = {name: statistics.median(r["median_ms"] for r in arms[name]) for name in names}
    return {
        "hidden": hidden,
        "batch": batch,
        "synchronised_every_step": sync,
        "steps_per_run": steps,
        "runs": arms,
        "median_of_medians_ms": {name: round(value, 4) for name, value in medians.items()},
        "overhead_pct": {
            name: round((medians[name] / medians["off"] - 1.0) * 100, 3) for name in names[1:]
        },
        "added_us_per_step": {
            name: round((medians[name] - medians["off"]) * 1e3, 2) for name in names[1:]
        },
    }


# --- replay (where the bridge runs) -----------------------------------------------------------


def replay(capture: str, endpoint: str) -> int:
    """POST every captured request to ``endpoint`` in order; returns the number refused."""
    refused = 0
    with gzip.open(capture, "rt") as lines:
        for line in lines:
            request = json.loads(line)
            headers = {"Content-Type": request["content_type"] or "application/x-protobuf"}
            if request["content_encoding"]:
                headers["Content-Encoding"] = request["content_encoding"]
            post = urllib.request.Request(
                endpoint.rstrip("/") + request["path"],
                data=base64.b64decode(request["body"]),
                headers=headers,
                method="POST",
            )
            try:
                with urllib.request.urlopen(post, timeout=30) as answer:
                    answer.read()
            except Exception as exc:
                refused += 1
                print(f"refused: {exc}", file=sys.stderr)
    return refused


def _part_cupticycle() -> dict[str, Any]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpu_cupti_cycle import part_cupticycle

    return part_cupticycle()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--parts", default="nvml,cupti,timer,straggler,regression,overhead")
    parser.add_argument("--overhead-runs", type=int, default=2)
    parser.add_argument("--overhead-steps", type=int, default=300)
    parser.add_argument("--overhead-hidden", type=int, default=4096)
    parser.add_argument("--overhead-batch", type=int, default=2048)
    parser.add_argument(
        "--overhead-arms",
        default="off,on,host-phases,no-cupti,every-step",
        help="off first; also on-no-export, no-pool, cupti-cycle, cupti-detach, marks-N",
    )
    parser.add_argument("--abhooks-rounds", type=int, default=30)
    parser.add_argument("--host-bound-hidden", type=int, default=256)
    parser.add_argument("--host-bound-batch", type=int, default=64)
    parser.add_argument("--host-bound-steps", type=int, default=3000)
    parser.add_argument("--host-bound-arms", default="off,host-phases,on,no-cupti")
    parser.add_argument("--baseline", help="another stepwatch tree, for the 'old:ARM' arms")
    parser.add_argument("--replay", help="a capture to POST to --endpoint (no GPU needed)")
    parser.add_argument("--endpoint", default="http://127.0.0.1:4318")
    args = parser.parse_args()
    if args.replay:
        refused = replay(args.replay, args.endpoint)
        print(f"replayed {args.replay} to {args.endpoint}: {refused} refused")
        return 1 if refused else 0
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {"versions": _versions()}
    print(json.dumps(results["versions"]), flush=True)
    parts: dict[str, Callable[[], dict[str, Any]]] = {
        "nvml": part_nvml,
        "cupti": part_cupti,
        "timer": part_timer,
        "marks": part_marks,
        "frames": lambda: part_frames(args.out),
        "abhooks": lambda: part_abhooks(args.abhooks_rounds),
        "cupticycle": _part_cupticycle,
        "straggler": lambda: part_job(args.out, "straggler"),
        "regression": lambda: part_job(args.out, "regression"),
        "straggler4": lambda: part_job(args.out, "straggler", 4),
        "overhead": lambda: part_overhead(
            args.overhead_runs,
            args.overhead_steps,
            args.overhead_hidden,
            args.overhead_batch,
            args.overhead_arms,
            baseline=args.baseline,
        ),
        "hostbound": lambda: part_overhead(
            args.overhead_runs,
            args.host_bound_steps,
            args.host_bound_hidden,
            args.host_bound_batch,
            args.host_bound_arms,
            sync=False,
            baseline=args.baseline,
        ),
    }
    for name in args.parts.split(","):
        begin = time.monotonic()
        try:
            results[name] = parts[name]()
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        results[name + "_s"] = round(time.monotonic() - begin, 1)
        print(
            f"== {name} ({results[name + '_s']} s)\n{json.dumps(results[name], indent=1)}",
            flush=True,
        )
        with open(os.path.join(args.out, "gpu_check.json"), "w") as out:
            json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
