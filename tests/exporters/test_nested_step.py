"""An optimizer subclass whose ``step`` calls its parent's (issue 15, fifteenth round).

torch wraps each optimizer class's ``step`` with the step hooks (``Optimizer.profile_hook_step``)
when the first instance of that class is made; once the parent class has an instance too, a
subclass's ``super().step()`` runs the hooks a second time, nested. Auto mode must still see one
``optimizer.step()`` per step: one step recorded, the optimizer phase around the whole call, on
the C gates and on the pure-Python hooks, and after a ``step()`` that raised.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
import torch

from stepwatch.exporters import InMemoryExporter, StepMonitor, _recorder
from stepwatch.exporters.auto import _opthooks
from tests.exporters import test_device_in_c as device_in_c

OUTER_SLEEP_S = 0.03  # the subclass's own work around its parent's step


class _Outer(torch.optim.SGD):
    """SGD with work of its own before the parent's ``step`` (which torch hooks too)."""

    fail_next = False

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        time.sleep(OUTER_SLEEP_S)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("a step that raised")
        return super().step(closure)


@pytest.fixture(autouse=True)
def _parent_hooked() -> None:
    """An instance of the parent class: torch then hooks ``SGD.step`` too (nested hooks)."""
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert getattr(torch.optim.SGD.step, "hooked", False)


def _use(path: str, monkeypatch: Any) -> None:
    if path == "c" and _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    if path == "python":
        monkeypatch.setattr(_recorder, "FAST_RECORDER", None)


def _run(steps: int, *, loop_marks: bool, fail_at: int = -1) -> tuple[list[Any], StepMonitor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = _Outer(model.parameters(), lr=0.01)
    monitor = StepMonitor(
        job_id="nested",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        start=False,
        health=False,
        phase_sampling=1,
    )
    handle = monitor.instrument(model, optimizer)
    context = monitor.step if loop_marks else contextlib.nullcontext
    try:
        for index in range(steps):
            with context():
                model(torch.randn(4, 8)).sum().backward()
                optimizer.fail_next = index == fail_at
                with contextlib.suppress(RuntimeError):
                    optimizer.step()
                optimizer.zero_grad()
        assert handle._state.optimizer_calls == 0  # every call closed
    finally:
        handle.remove()
    return list(monitor._recorder.buffer), monitor


@pytest.mark.parametrize("loop_marks", [True, False], ids=["step()", "auto steps"])
@pytest.mark.parametrize("path", ["c", "python"])
def test_a_nested_step_is_one_step_and_its_phase_holds_the_whole_call(
    path: str, loop_marks: bool, monkeypatch: Any
) -> None:
    _use(path, monkeypatch)
    records, monitor = _run(6, loop_marks=loop_marks)
    try:
        # Auto steps: the last step's end opened a seventh, still open (not recorded).
        assert len(records) == 6
        for record in records:
            assert record[5]["optimizer"] >= OUTER_SLEEP_S * 1e9, record[5]
            assert record[2] - record[1] >= OUTER_SLEEP_S * 1e9
        assert monitor.stats.misuse == 0
    finally:
        monitor.close(timeout_s=1.0)


@pytest.mark.parametrize("path", ["c", "python"])
def test_after_a_step_that_raised_the_next_steps_count_once_each(
    path: str, monkeypatch: Any
) -> None:
    _use(path, monkeypatch)
    records, monitor = _run(6, loop_marks=False, fail_at=2)
    try:
        # The step that raised had no post-hook: it runs into the next one (one record for
        # both); every other step is one record, each with its whole optimizer call.
        assert len(records) == 5
        for record in records:
            assert record[5]["optimizer"] >= OUTER_SLEEP_S * 1e9, record[5]
    finally:
        monitor.close(timeout_s=1.0)


def test_on_a_device_timer_the_nested_step_is_one_step_too(gloo: None) -> None:
    if _recorder.FAST_RECORDER is None:
        pytest.skip("_fastrecord is not built")
    device = device_in_c.VirtualDevice()
    model = device_in_c._Model(device)
    optimizer = _Outer(model.parameters(), lr=0.01)
    optimizer.register_step_post_hook(lambda *_: device.run(device_in_c.OPTIMIZER_NS))
    monitor = StepMonitor(
        job_id="nested-device",
        rank=0,
        world_size=1,
        exporter=InMemoryExporter(),
        device_timer=device,
        phase_sampling=1,
        start=False,
        health=False,
    )
    handle = monitor.instrument(model, optimizer)
    try:
        for _ in range(4):
            with monitor.step():
                model(torch.randn(4, 8)).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        records = list(monitor._recorder.buffer)
        assert len(records) == 4
        for record in records:
            # The device's optimizer phase: the post-hook's work ran twice per step (inner
            # and outer wrapper), both inside the outer call.
            ((start, end),) = record[4][3]["optimizer"]
            assert end - start == 2 * device_in_c.OPTIMIZER_NS
        assert monitor.stats.misuse == 0
    finally:
        handle.remove()
        monitor.close(timeout_s=1.0)


def test_nested_tells_a_step_inside_another_of_the_same_optimizer() -> None:
    seen: list[bool] = []

    class Probe(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            return super().step(closure)

    model = torch.nn.Linear(2, 1)
    probe = Probe(model.parameters(), lr=0.1)
    probe.register_step_pre_hook(lambda optimizer, *_: seen.append(_opthooks.nested(optimizer)))
    model(torch.ones(1, 2)).sum().backward()
    probe.step()
    assert seen == [False, True]  # the outer call's hook, then the parent's inside it
    assert _opthooks.nested(probe) is False  # no step() running
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _opthooks.nested(other) is False
