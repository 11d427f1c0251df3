"""The stepwatch metric schema (docs/schema.md is the authoritative prose).

Names here are a public contract: add, never rename.
"""

from __future__ import annotations

from typing import Final

SCHEMA_VERSION: Final = "1"

# Resource attributes: one resource = one rank of one job.
JOB_ID: Final = "stepwatch.job.id"
RANK: Final = "stepwatch.rank"
WORLD_SIZE: Final = "stepwatch.world_size"
HOST_NAME: Final = "host.name"
LOCAL_RANK: Final = "stepwatch.local_rank"
DP_RANK: Final = "stepwatch.dp_rank"
TP_RANK: Final = "stepwatch.tp_rank"
PP_RANK: Final = "stepwatch.pp_rank"
SERVICE_NAME: Final = "service.name"

# Point attributes.
PHASE: Final = "stepwatch.phase"
KERNEL_CLASS: Final = "stepwatch.kernel.class"
KERNEL_CATEGORY: Final = "stepwatch.kernel.category"

# Metric names (instrument, unit).
STEP_DURATION: Final = "stepwatch.step.duration"  # histogram, s
STEP_LAST: Final = "stepwatch.step.last"  # gauge, {step}
PHASE_DURATION: Final = "stepwatch.phase.duration"  # histogram, s
# The steps whose phases auto mode timed, while phases are sampled (issue 15): their durations
# (weighted as the phases) are the step time those phase times compare with, their number
# what they rest on.
SAMPLED_STEP_DURATION: Final = "stepwatch.step.sampled.duration"  # histogram, s; weighted
SAMPLED_STEPS: Final = "stepwatch.step.sampled"  # sum, {step}: how many were sampled
# While phases are sampled: a phase timed on every step nevertheless (the communication wait;
# phase() contexts), and on how many of the window's steps; its time compares with every step's.
PHASE_EVERY_STEP: Final = "stepwatch.phase.every_step"  # sum, {step}; stepwatch.phase
KERNEL_DURATION: Final = "stepwatch.kernel.duration"  # histogram, s
DEVICE_IDLE_DURATION: Final = "stepwatch.device.idle.duration"  # histogram, s
# Where a rank is now (issue 12), sent in every window that holds no finished step (a rank
# stuck in a step still reports) and read by the hang probe.
STEP_CURRENT: Final = "stepwatch.step.current"  # gauge, {step}
STEP_ELAPSED: Final = "stepwatch.step.elapsed"  # gauge, s; attribute stepwatch.phase (if in one)
PHASE_ELAPSED: Final = "stepwatch.phase.elapsed"  # gauge, s; attribute stepwatch.phase
MONITOR_CLOSED: Final = "stepwatch.monitor.closed"  # gauge, 1; in the monitor's last window

# Device health (GPU only): the OpenTelemetry hardware semantic conventions where they have a
# name (https://opentelemetry.io/docs/specs/semconv/hardware/: common.md, gpu.md,
# temperature.md), stepwatch.gpu.* otherwise, named by the semconv naming rules (no plural
# unless counting discrete things with a {unit}; no name that is also a namespace).
# Issue 13 renamed stepwatch.gpu.clock_event.reasons (→ .mask and .active) and
# stepwatch.gpu.xid (→ stepwatch.gpu.xid.errors).
HW_GPU_UTILIZATION: Final = "hw.gpu.utilization"  # gauge, 1; hw.type=gpu
HW_GPU_MEMORY_USAGE: Final = "hw.gpu.memory.usage"  # updowncounter (sum, non-monotonic), By
HW_POWER: Final = "hw.power"  # gauge, W; hw.type=gpu
HW_TEMPERATURE: Final = "hw.temperature"  # gauge, Cel; hw.type=temperature, hw.parent=GPU
HW_ERRORS: Final = "hw.errors"  # counter, {error}; hw.type=gpu, error.type=uncorrected
GPU_SM_CLOCK: Final = "stepwatch.gpu.sm_clock"  # gauge, Hz
GPU_CLOCK_EVENT_MASK: Final = "stepwatch.gpu.clock_event.mask"  # gauge, 1 (NVML bitmask)
GPU_CLOCK_EVENT_ACTIVE: Final = "stepwatch.gpu.clock_event.active"  # gauge, 1 (0/1 per reason)
GPU_XID_ERRORS: Final = "stepwatch.gpu.xid.errors"  # counter, {error}; stepwatch.gpu.xid.code
HW_TYPE: Final = "hw.type"
HW_ID: Final = "hw.id"
HW_NAME: Final = "hw.name"
HW_PARENT: Final = "hw.parent"
ERROR_TYPE: Final = "error.type"
GPU_XID_CODE: Final = "stepwatch.gpu.xid.code"
GPU_CLOCK_EVENT_REASON: Final = "stepwatch.gpu.clock_event.reason"

PHASES: Final = ("data", "forward", "backward", "optimizer", "communication", "other")
KERNEL_CATEGORIES: Final = ("compute", "communication", "memory", "other")

#: A diagnosis kind's name: each kind is declared once, by its rule module in
#: ``stepwatch.detectors.analysis.rules`` (docs/schema.md's list is generated from them).
DIAGNOSIS_KIND_PATTERN: Final = r"[a-z][a-z0-9_]*"
SEVERITIES: Final = ("info", "warning", "critical")

# Measurement holding diagnoses (Grafana's annotation query reads it).
DIAGNOSIS_MEASUREMENT: Final = "stepwatch.diagnosis"

# Attribute keys the bridge turns into InfluxDB tags; everything else is dropped (counted).
# Step numbers, raw kernel names and command lines never become tags.
RESOURCE_TAGS: Final = (
    JOB_ID,
    RANK,
    WORLD_SIZE,
    HOST_NAME,
    LOCAL_RANK,
    DP_RANK,
    TP_RANK,
    PP_RANK,
    SERVICE_NAME,
)
POINT_TAGS: Final = (
    PHASE,
    KERNEL_CLASS,
    KERNEL_CATEGORY,
    HW_TYPE,
    HW_ID,
    HW_NAME,
    HW_PARENT,
    ERROR_TYPE,
    GPU_XID_CODE,
    GPU_CLOCK_EVENT_REASON,
)
TAG_ALLOWLIST: Final = frozenset(RESOURCE_TAGS + POINT_TAGS)

DEFAULT_DATABASE: Final = "stepwatch"
