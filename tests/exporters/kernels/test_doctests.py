"""The docstring examples of the kernel modules run as tests."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "stepwatch.exporters.kernels._names",
    "stepwatch.exporters.kernels._summary",
    "stepwatch.exporters.kernels._trace",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0
    assert result.failed == 0
