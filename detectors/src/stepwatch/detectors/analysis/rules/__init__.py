"""The diagnosis kinds, one module each: the module named after its kind defines ``RULE``.

Adding a kind is one new module here: its :class:`~stepwatch.detectors.analysis._rule.Kind`
(what it is: cost model, waiter role, raise bar, its place among the simulator's faults) and
its rule (an :class:`EpisodeRule` or a :class:`JobRule`), and its tests. This package finds
it; the schema's list of kinds, the cost model's and the waiter rules' sets, the simulator's
round and the docs' tables are made from the declarations (``tests/detectors/test_kinds.py``
checks the docs and that a simulated kind has a fault model).
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from stepwatch.core._errors import ConfigError
from stepwatch.detectors.analysis._rule import EpisodeRule, JobRule, Registry, Rule

__all__ = ["Registry", "registry"]


@functools.cache
def registry() -> Registry:
    """Every rule of this package (imported on first use, then cached).

    Raises:
        ConfigError: a module defines no ``RULE``, or one whose kind is not its name.
    """
    found: list[Rule] = []
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        rule = getattr(module, "RULE", None)
        if not isinstance(rule, EpisodeRule | JobRule) or rule.kind != module_info.name:
            raise ConfigError(f"rules: {module.__name__} must define RULE for its own kind")
        found.append(rule)
    return Registry.of(found)
