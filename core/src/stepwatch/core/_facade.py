"""Façades name their members' public home, so reprs, docs and pickles show the public path."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any


def publish(module_name: str, members: Iterable[Any]) -> None:
    """Set ``__module__`` of the classes and functions among ``members`` to ``module_name``.

    Called by a package's ``__init__`` for the names of its ``__all__`` that live in private
    modules: ``StepMonitor.__module__`` then reads ``stepwatch.exporters``, where users import
    it from, instead of ``stepwatch.exporters.monitor._monitor``. Constants and modules are left
    alone.
    """
    for member in members:
        if isinstance(member, type) or (callable(member) and hasattr(member, "__qualname__")):
            # Builtins and C types keep theirs.
            with contextlib.suppress(AttributeError, TypeError):
                member.__module__ = module_name
