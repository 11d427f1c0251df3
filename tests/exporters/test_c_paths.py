"""Which paths the exporters run (``_cext``): one decision a process, said once, refusable.

A wheel built without a C compiler holds neither extension; ``STEPWATCH_EXPORTERS_NO_C``
turns them off where they are built. The first monitor of a process logs which paths run (a
warning where an extension is missing), and ``STEPWATCH_REQUIRE_C=1`` makes the monitor
refuse to start without them (CI).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest

from stepwatch.core import ConfigError, settings
from stepwatch.exporters import InMemoryExporter, StepMonitor, _cext


def _monitor() -> StepMonitor:
    return StepMonitor(
        job_id="paths", rank=0, world_size=1, exporter=InMemoryExporter(), start=False
    )


@pytest.fixture
def first_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next monitor is the process's first (it logs which paths run)."""
    monkeypatch.setattr(_cext, "_announced", threading.Event())
    monkeypatch.delenv(settings.REQUIRE_C.variable, raising=False)


def test_the_first_monitor_says_which_paths_run(
    first_monitor: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="stepwatch.exporters"):
        _monitor().close()
        _monitor().close()
    said = [r for r in caplog.records if r.getMessage().startswith("stepwatch exporters:")]
    assert len(said) == 1
    expected = "C paths" if _cext.IMPLEMENTATION == "c" else "Python paths"
    assert expected in said[0].getMessage()


def test_a_missing_extension_is_a_warning_and_required_it_is_an_error(
    first_monitor: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_cext, "NOT_BUILT", {"_fasthist": "No module named '_fasthist'"})
    with caplog.at_level(logging.WARNING, logger="stepwatch.exporters"):
        _monitor().close()
    (warning,) = [r for r in caplog.records if "not built" in r.getMessage()]
    assert warning.levelno == logging.WARNING and "_fasthist" in warning.getMessage()
    monkeypatch.setenv(settings.REQUIRE_C.variable, "1")
    with pytest.raises(ConfigError, match=r"STEPWATCH_REQUIRE_C.*_fasthist"):
        _monitor()
    monkeypatch.setenv(settings.REQUIRE_C.variable, "0")
    _monitor().close()


@pytest.mark.parametrize(
    ("value", "implementation", "warns"),
    [("1", "python", False), ("off", "c", False), ("sometimes", "python", True)],
)
def test_the_switch_is_read_through_the_settings(
    value: str, implementation: str, warns: bool
) -> None:
    """A process's choice, made when stepwatch.exporters is first imported; text that is no
    switch is said at the first monitor (and the Python paths run, as asked for)."""
    if _cext.NOT_BUILT and implementation == "c":
        pytest.skip("the C extensions are not built here")
    script = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from stepwatch.exporters import StepMonitor, InMemoryExporter, _cext, _recorder\n"
        "StepMonitor(job_id='j', rank=0, world_size=1, exporter=InMemoryExporter(),"
        " start=False).close()\n"
        "print(_cext.IMPLEMENTATION, _recorder.FAST_RECORDER is not None)\n"
    )
    environment = {**os.environ, settings.EXPORTERS_NO_C.variable: value}
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [implementation, str(implementation == "c")]
    assert ("STEPWATCH_EXPORTERS_NO_C: 'sometimes' is not valid" in done.stderr) is warns


def test_the_monitors_account_says_which_paths_run() -> None:
    monitor = _monitor()
    assert monitor.stats.implementation == _cext.IMPLEMENTATION
    monitor.close()
