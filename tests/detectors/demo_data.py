"""Demo-like data in the stored layout, written through the real components.

Per rank and window: ``WindowBuilder`` (exporters) → OTLP ``ExportMetricsServiceRequest`` →
``convert_request`` (otel_bridge) → ``InfluxClient.write_lines``. Device health and diagnoses
have no producer in this path, so they are written with ``encode_point`` in exactly the
stored layout (docs/storage.md; gauges → field ``gauge``, counters → ``counter``).
Findings go through the detectors' own ``InfluxDiagnosisSink`` (``stepwatch.diagnosis``).

The job: 8 ranks on 2 hosts; from ``straggler_from_window`` on, rank 5's compute kernels run
1.4× slower, so every rank's step grows and the peers' all-reduce wait grows (masked
straggler picture), while rank 5's own all-reduce shrinks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from stepwatch.core import Diagnosis, InfluxClient
from stepwatch.core._lineproto import encode_point
from stepwatch.detectors import InfluxDiagnosisSink

PHASES = ("data", "forward", "backward", "optimizer", "communication")
KERNELS = {  # (class, category): (executions per step, median duration s)
    ("gemm", "compute"): (20, 0.012),
    ("flash_attention", "compute"): (10, 0.010),
    ("layer_norm", "compute"): (10, 0.002),
    ("nccl_all_reduce", "communication"): (4, 0.020),
    ("memcpy_h2d", "memory"): (2, 0.004),
}


@dataclasses.dataclass(frozen=True)
class DemoJob:
    job: str
    start_unix_nano: int
    end_unix_nano: int
    ranks: int
    hosts: tuple[str, ...]
    straggler_rank: int
    change_unix_nano: int
    findings: tuple[Diagnosis, ...]


def host_of(rank: int) -> str:
    return f"node-{rank // 4}"


def write_demo(
    client: InfluxClient,
    *,
    job: str = "demo-job",
    end_unix_nano: int,
    ranks: int = 8,
    windows: int = 60,
    window_s: float = 2.0,
    steps_per_window: int = 4,
    straggler_rank: int = 5,
    straggler_from_window: int = 30,
    seed: int = 7,
    histogram_buckets: str = "exponential",
    to_lines: Callable[[Any], list[str]] | None = None,
) -> DemoJob:
    """Write one demo job ending at ``end_unix_nano``; return what was planted.

    ``histogram_buckets`` is the exporters' layout; ``to_lines`` turns each OTLP request into
    line protocol instead of the bridge's ``convert_request`` (e.g. by a Collector's rules).
    """
    from opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder import (
        encode_metrics,
    )

    from stepwatch.exporters import KernelWindow, WindowBuilder, build_resource
    from stepwatch.otel_bridge import convert_request

    rng = np.random.default_rng(seed)
    window_ns = int(window_s * 1e9)
    start_unix_nano = end_unix_nano - windows * window_ns
    change_unix_nano = start_unix_nano + straggler_from_window * window_ns
    lines: list[str] = []
    for rank in range(ranks):
        builder = WindowBuilder(
            build_resource(job_id=job, rank=rank, world_size=ranks, host_name=host_of(rank)),
            histogram_buckets=histogram_buckets,
        )
        for window in range(windows):
            slow = window >= straggler_from_window
            compute_factor = 1.4 if slow and rank == straggler_rank else 1.0
            durations: dict[tuple[str, str], list[float]] = {}
            for (kernel_class, category), (per_step, median_s) in KERNELS.items():
                scale = median_s * (compute_factor if category == "compute" else 1.0)
                if category == "communication" and slow:
                    # Peers wait for the straggler inside the collective; it waits for no one.
                    scale *= 0.6 if rank == straggler_rank else 2.2
                count = per_step * steps_per_window
                durations[(kernel_class, category)] = list(
                    scale * rng.lognormal(0.0, 0.08, size=count)
                )
            compute_s = sum(sum(v) for k, v in durations.items() if k[1] == "compute")
            comm_s = sum(sum(v) for k, v in durations.items() if k[1] == "communication")
            per_step_compute = compute_s / steps_per_window
            per_step_comm = comm_s / steps_per_window
            window_start = start_unix_nano + window * window_ns
            for step in range(steps_per_window):
                phases = {
                    "data": 0.03 * float(rng.lognormal(0, 0.1)),
                    "forward": per_step_compute * 0.35,
                    "backward": per_step_compute * 0.6,
                    "optimizer": per_step_compute * 0.05 + 0.01,
                    "communication": per_step_comm,
                }
                builder.add_step(
                    step_index=window * steps_per_window + step,
                    duration_s=sum(phases.values()),
                    phases_s=phases,
                )
            idle = [0.02 * float(rng.lognormal(0, 0.2)) for _ in range(steps_per_window)]
            builder.add_kernels(KernelWindow(durations_s=durations, idle_durations_s=idle))
            data = builder.build(
                start_unix_nano=window_start, end_unix_nano=window_start + window_ns
            )
            if data is None:
                continue
            request = encode_metrics(data)
            lines.extend(convert_request(request).lines if to_lines is None else to_lines(request))
            lines.extend(_health_lines(job, rank, window_start + window_ns, rng, slow=slow))
    findings = (
        Diagnosis(
            job=job,
            kind="compute_straggler",
            start_unix_nano=change_unix_nano,
            end_unix_nano=None,
            severity="critical",
            score=4.2,
            summary=f"rank {straggler_rank} compute 1.40x peers (gemm 1.40x)",
            ranks=(straggler_rank,),
            hosts=(host_of(straggler_rank),),
            phase="backward",
            kernel_class="gemm",
        ),
        Diagnosis(
            job=job,
            kind="job_regression",
            start_unix_nano=change_unix_nano,
            end_unix_nano=end_unix_nano - 5 * window_ns,
            severity="warning",
            score=2.5,
            summary="step time 1.3x higher since the change point",
            phase="backward",
        ),
    )
    for offset in range(0, len(lines), 5000):
        client.write_lines(lines[offset : offset + 5000])
    InfluxDiagnosisSink(client).publish(findings)
    return DemoJob(
        job=job,
        start_unix_nano=start_unix_nano,
        end_unix_nano=end_unix_nano,
        ranks=ranks,
        hosts=tuple(sorted({host_of(rank) for rank in range(ranks)})),
        straggler_rank=straggler_rank,
        change_unix_nano=change_unix_nano,
        findings=findings,
    )


def _health_lines(
    job: str, rank: int, time_unix_nano: int, rng: np.random.Generator, *, slow: bool
) -> list[str]:
    tags = {
        "stepwatch.job.id": job,
        "stepwatch.rank": str(rank),
        "host.name": host_of(rank),
        "hw.type": "gpu",
        "hw.id": f"gpu{rank % 4}",
    }
    hot = slow and rank == 5
    gauges = {
        "hw.gpu.utilization": 0.93 + 0.02 * float(rng.standard_normal()),
        "hw.temperature": (86.0 if hot else 68.0) + float(rng.standard_normal()),
        "hw.power": (310.0 if hot else 390.0) + 5 * float(rng.standard_normal()),
        "hw.gpu.memory.usage": 62.0e9,
        "stepwatch.gpu.sm_clock": (1.41e9 if hot else 1.98e9),
        "stepwatch.gpu.clock_event.mask": 32.0 if hot else 0.0,
    }
    lines = [
        encode_point(name, tags, {"gauge": value}, time_unix_nano) for name, value in gauges.items()
    ]
    xid_tags = {**tags, "stepwatch.gpu.xid.code": "79" if hot else "0"}
    lines.append(
        encode_point(
            "stepwatch.gpu.xid.errors", xid_tags, {"counter": 1.0 if hot else 0.0}, time_unix_nano
        )
    )
    return lines
