"""The docstring examples of the kernel modules run as tests."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

# A public function's examples run from the façade: its __module__ names the façade, so
# doctest finds it there and no longer in its private module.
MODULES = [
    "stepwatch.exporters.kernels",  # classify_kernel
    "stepwatch.exporters.kernels._summary",  # quantised_seconds, busy_ns, self_time_events
    "stepwatch.exporters.kernels._trace",  # phase_of_annotation
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0


def test_no_example_is_missed() -> None:
    """Every ``>>>`` line of the kernel modules runs from one of the modules above."""
    package = Path(importlib.import_module("stepwatch.exporters.kernels").__file__ or "").parent
    written = sum(
        line.lstrip().startswith(">>> ")
        for path in package.glob("*.py")
        for line in path.read_text().splitlines()
    )
    attempted = sum(
        doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS).attempted
        for name in MODULES
    )
    assert attempted == written > 0
