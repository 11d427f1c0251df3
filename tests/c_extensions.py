"""Tests that need a C extension: skipped where it is not built (a wheel made without a C
compiler), unless ``STEPWATCH_REQUIRE_C`` says it must be there (CI): then they run, and a
missing extension fails them instead of hiding behind a skip."""

from __future__ import annotations

import os

import pytest

from stepwatch.core import settings


def required() -> bool:
    """Whether ``STEPWATCH_REQUIRE_C`` asks for every C extension."""
    return bool(settings.REQUIRE_C.resolve(None, os.environ))


def needs(available: bool, what: str) -> pytest.MarkDecorator:
    """A skip where ``what`` is not built and not required."""
    return pytest.mark.skipif(
        not available and not required(), reason=f"{what} is not built (no C compiler)"
    )
