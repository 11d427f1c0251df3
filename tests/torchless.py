"""pytest plugin for a Python without PyTorch: ``PYTEST_PLUGINS=tests.torchless pytest``
(the variable, not ``-p``: pytest runs that tests start in subprocesses load it too).

The build matrix (scripts/ci_matrix.sh) runs the suite on Python 3.12 and 3.13, for which this
machine has no PyTorch CPU wheel (pip would fetch a multi-GB CUDA build). There a test module
or test that needs torch (or a framework built on it) is skipped, saying so, where it would
fail on the import; everything else runs, the C extensions included.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

TORCH_STACK = frozenset({"torch", "torchvision", "pytorch_lightning", "lightning", "transformers"})


def _missing_torch(error: BaseException | None) -> str | None:
    """The torch-stack module whose absence raised ``error`` (or caused it), else None."""
    while error is not None:
        if isinstance(error, ModuleNotFoundError) and error.name:
            top = error.name.split(".")[0]
            return top if top in TORCH_STACK else None
        error = error.__cause__
    return None


class _Module(pytest.Module):
    def _getobj(self) -> Any:
        try:
            return super()._getobj()
        except pytest.Collector.CollectError as error:
            missing = _missing_torch(error)
            if missing is None:
                raise
            pytest.skip(
                f"{self.path.name} needs {missing} (not installed on this Python)",
                allow_module_level=True,
            )


def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> Any:
    if module_path.name == "__init__.py":
        return None
    return _Module.from_parent(parent, path=module_path)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, Any]:
    report = yield
    missing = None if call.excinfo is None else _missing_torch(call.excinfo.value)
    if missing is not None and report.failed:
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: needs {missing}")
    return report
