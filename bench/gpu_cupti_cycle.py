"""On a CUDA machine: what CUPTI costs in each state a duty cycle puts it in (issue 15).

``python bench/gpu_check.py --parts cupticycle`` runs this (or ``python bench/gpu_cupti_cycle.py``
alone, printing JSON). Each measurement runs in a fresh process, because CUPTI's state is the
process's: a launch "before CUPTI" can only be timed before CUPTI was ever loaded.

``states``: one process walks CUPTI through the states a ``CuptiSource(period_steps=...)``
uses, and in each times (a) a tiny kernel's launch on the host (20,000 launches, 3 repeats)
and (b) a synchronised GPU-bound step (4 layers of 4096, batch 2048, forward, backward, SGD;
median of 40), where CUPTI's instrumentation of each kernel on the device would show. Before
CUPTI once, then 4 rounds of:

- on (round 0: CUPTI loaded for the first time; later rounds: attached again after a
  finalize, the switch-on a ``detach="finalize"`` cycle pays, timed);
- disabled (``detach="disable"`` between cycles);
- finalized (``CuptiPythonBackend.detach``: ``cuptiFinalize`` at the next CUDA API exit, as
  ``detach="finalize"`` between cycles), with the detach call's and the finalize's times.

The nineteenth round measured the first four on an H200 (launch 7.35 µs before, 8.5–9.8 on,
8.3–9.4 disabled); what finalize gives back, and what attaching again costs, is the question.

``cycles``: a ``CuptiSource`` on a duty cycle (period 64, 5 steps, budget 1 so that no cycle
is stretched) over 300 steps of the same model, drained every 50 steps, once per detach mode
(each in its own process), against a continuous source's kernel count per step: each window
should hold 5 x that per cycle finished in it, and 5 idle values per cycle; and the stride the
default budget would take for the switches' measured cost.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Any

CHILD_STATES = "states"
CHILD_CYCLES = "cycles"
ROUNDS = 4


def _model() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for _ in range(4):
        layers += [torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = torch.randn(2048, 4096, device="cuda")

    def step() -> None:
        loss = model(data).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step, torch


def launch_us(torch: Any, small: Any, count: int = 20000) -> float:
    """A tiny kernel's launch on the host, µs (``count`` launches between synchronisations)."""
    torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(count):
        small.add_(1)
    torch.cuda.synchronize()
    return round((time.perf_counter() - begin) / count * 1e6, 3)


def _counts(window: Any) -> dict[str, int]:
    return {
        "kernels": sum(len(v) for v in window.durations_s.values()),
        "idle_values": len(window.idle_durations_s),
    }


def child_states() -> dict[str, Any]:
    from stepwatch.exporters.kernels import CuptiPythonBackend

    step, torch = _model()
    small = torch.ones(16, device="cuda")
    for _ in range(1000):
        small.add_(1)
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    records: list[int] = []

    def step_ms() -> float:
        times = []
        for _ in range(40):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - begin)
        times.sort()
        return round(times[len(times) // 2] * 1e3, 4)

    states: list[dict[str, Any]] = []

    def measure(label: str, **extra: Any) -> None:
        states.append(
            {"state": label, "launch_us": [launch_us(torch, small) for _ in range(3)],
             "step_ms": step_ms(),
             "records_so_far": len(records), **extra}
        )  # fmt: skip
        print(json.dumps(states[-1]), file=sys.stderr, flush=True)

    def timed(call: Any) -> float:
        begin = time.perf_counter()
        call()
        return round((time.perf_counter() - begin) * 1e3, 3)

    def finalize() -> dict[str, Any]:
        done: list[float | None] = []
        detach_ms = timed(lambda: backend.detach(done.append))
        small.add_(1)  # a CUDA call: the detach happens at its exit
        torch.cuda.synchronize()
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            small.add_(1)
            time.sleep(0.01)
        return {
            "detach_call_ms": detach_ms,
            "finalize_ms": None if not done or done[0] is None else round(done[0] * 1e3, 3),
            "finalized": bool(done) and done[0] is not None,
        }

    backend = CuptiPythonBackend()

    def on_records(columns: Any) -> None:
        records.extend([0] * len(columns))

    measure("before CUPTI")
    # Rounds, so that the states compare in pairs (the GPU's clocks drift over a run): on (the
    # first round's switch-on loads CUPTI, the others attach it again after a finalize),
    # disabled, finalized.
    for round_index in range(ROUNDS):
        measure("on", round=round_index, enable_ms=timed(lambda: backend.enable(on_records)))
        backend.flush()
        measure("disabled", round=round_index, disable_ms=timed(backend.disable))
        backend.enable(on_records)
        measure("finalized", round=round_index, **finalize())
    summary = {}
    for label in ("before CUPTI", "on", "disabled", "finalized"):
        rows = [row for row in states if row["state"] == label]
        launches = sorted(value for row in rows for value in row["launch_us"])
        steps = sorted(row["step_ms"] for row in rows)
        summary[label] = {
            "launch_us_median": launches[len(launches) // 2],
            "step_ms_median": steps[len(steps) // 2],
        }
    return {"summary": summary, "states": states}


def child_cycles(detach: str) -> dict[str, Any]:
    from stepwatch.exporters.kernels import CuptiSource

    step, torch = _model()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    continuous = CuptiSource()
    continuous.on_monitor_start()
    continuous.on_step_end(0)
    for index in range(1, 4):
        step()
        torch.cuda.synchronize()
        continuous.on_step_end(index)
    torch.cuda.synchronize()
    window = continuous.drain()
    per_step = sum(len(v) for v in window.durations_s.values()) / 3
    continuous.close()
    # Budget 1: every grid step takes a cycle, whatever the switches cost (what the default
    # budget would make of their cost is computed below).
    source = CuptiSource(period_steps=64, active_steps=5, detach=detach, overhead_budget=1.0)
    windows = []
    skip = 0
    times = []
    for index in range(300):
        begin = time.perf_counter()
        step()
        if skip:
            skip -= 1
        else:
            told = source.on_step_end(index)
            skip = told if isinstance(told, int) and told > 0 else 0
        times.append(time.perf_counter() - begin)
        if (index + 1) % 50 == 0:
            torch.cuda.synchronize()
            windows.append(_counts(source.drain()))
    torch.cuda.synchronize()
    small = torch.ones(1, device="cuda")
    small.add_(1)  # a last CUDA call for a pending detach
    torch.cuda.synchronize()
    windows.append(_counts(source.drain()))
    duty = source.duty_cycle
    source.close()
    stride = None
    if duty is not None:
        from stepwatch.exporters.kernels._cupti_cycle import stride_for
        from stepwatch.exporters.kernels._duty import DEFAULT_OVERHEAD_BUDGET

        cost = sum(t or 0.0 for t in (duty.attach_s, duty.detach_s, duty.finalize_s))
        speed = 1.0 / max(sorted(times)[len(times) // 2], 1e-9)
        stride = stride_for(cost, DEFAULT_OVERHEAD_BUDGET, speed, 64)
    return {
        "stride_at_the_default_budget": stride,
        "detach": detach,
        "continuous_kernels_per_step": per_step,
        "windows": windows,
        "duty_cycle": None if duty is None else duty._asdict(),
        "active": source.active,
        "host_step_ms_median": round(sorted(times)[len(times) // 2] * 1e3, 4),
    }


def _child(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        return {"failed": done.returncode, "stderr": done.stderr[-3000:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def part_cupticycle() -> dict[str, Any]:
    return {
        "states": _child(CHILD_STATES),
        "cycles": [_child(CHILD_CYCLES, mode) for mode in ("disable", "finalize")],
    }


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        result = child_states() if sys.argv[2] == CHILD_STATES else child_cycles(sys.argv[3])
        print(json.dumps(result))
    else:
        print(json.dumps(part_cupticycle(), indent=1))
