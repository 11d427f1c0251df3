"""The exporters' C extensions: whether this process runs them, and saying so.

``exporters/csrc`` builds two optional extensions: ``_fastrecord`` (the recorder's step
boundary and contexts, auto mode's gates and stamps, the autograd engine's gate) and
``_fasthist`` (the histogram loops). A wheel built without a C compiler holds neither, and
the Python code runs instead: the same steps, phases and histograms, more CPU per step
(docs/packaging.md). Every module that has a C path takes its extension from here, so one
decision holds for the process: the extensions as built, or none where
``STEPWATCH_EXPORTERS_NO_C`` says so (read once, when ``stepwatch.exporters`` is first
imported: the classes the recorder is made of are chosen then).

At the first monitor of a process :func:`start` logs which paths run (a warning where an
extension is missing) and, with ``STEPWATCH_REQUIRE_C=1``, refuses to start without them;
every monitor's ``stats.implementation`` says it (``c`` or ``python``). Not on the wire: the
exporters' resource carries only what the bridge stores as tags, and a rank's paths are not a
series' identity.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

from stepwatch.core import settings
from stepwatch.core._errors import ConfigError

__all__ = ["IMPLEMENTATION", "NOT_BUILT", "TURNED_OFF", "fasthist", "fastrecord", "start"]

_log = logging.getLogger("stepwatch.exporters")

NOT_BUILT: dict[str, str] = {}
"""Extension name -> why it does not import (it was not built: no C compiler)."""

try:
    from stepwatch.exporters import _fastrecord as fastrecord
except ImportError as exc:  # a wheel built without a C compiler
    fastrecord = None  # type: ignore[assignment]
    NOT_BUILT["_fastrecord"] = str(exc)
try:
    from stepwatch.exporters import _fasthist as fasthist
except ImportError as exc:
    fasthist = None  # type: ignore[assignment]
    NOT_BUILT["_fasthist"] = str(exc)

try:
    TURNED_OFF: bool = bool(settings.EXPORTERS_NO_C.resolve(None, os.environ))
    _BAD_SWITCH: str | None = None
except ConfigError as exc:  # logged at the first monitor; the Python paths, as asked for
    TURNED_OFF, _BAD_SWITCH = True, str(exc)
if TURNED_OFF:
    fastrecord = fasthist = None  # type: ignore[assignment]

IMPLEMENTATION: str = "c" if fastrecord is not None and fasthist is not None else "python"
"""``c``: both extensions run; ``python``: the Python paths (not built, or turned off)."""

_announced = threading.Event()


def start(environ: Mapping[str, str]) -> None:
    """At a monitor's construction: refuse to start without the extensions where
    ``STEPWATCH_REQUIRE_C`` asks for them, and log once a process which paths run.

    Raises:
        ConfigError: ``STEPWATCH_REQUIRE_C`` is on and an extension is not built, or the
            variable does not parse.
    """
    if settings.REQUIRE_C.resolve(None, environ) and NOT_BUILT:
        raise ConfigError(
            "STEPWATCH_REQUIRE_C=1 but the exporters' C extensions are not built ("
            + "; ".join(f"{name}: {why}" for name, why in sorted(NOT_BUILT.items()))
            + "): reinstall stepwatch-exporters with a C compiler present"
        )
    if _announced.is_set():
        return
    _announced.set()
    if _BAD_SWITCH is not None:
        _log.warning("%s; the exporters' Python paths run", _BAD_SWITCH)
    elif NOT_BUILT:
        _log.warning(
            "stepwatch exporters: C extensions not built (%s): the Python paths run (the same "
            "phases, more CPU per step); reinstall stepwatch-exporters with a C compiler present",
            ", ".join(sorted(NOT_BUILT)),
        )
    elif TURNED_OFF:
        _log.info("stepwatch exporters: Python paths (STEPWATCH_EXPORTERS_NO_C)")
    else:
        _log.info("stepwatch exporters: C paths (_fastrecord, _fasthist)")
