"""Device back ends: which timer times on the device and which source reads its health.

Each back end declares itself once, in :data:`TIMERS` or :data:`HEALTH`: its name, how it
*probes* for its device (the timer or health source when the device, its driver and its Python
package are here, else ``None``; a probe never imports a framework just to find out) and how
it is *made* when asked for by name. ``device_timer="auto"`` and ``health=None`` ask each in
turn and take the first that answers; where none does, the monitor runs on the host clock
and sends no health readings. A probe that raises counts as absent (logged): "auto" never
raises. Adding a vendor is its module and its line here; nothing else changes.

Today: CUDA events (``_cuda``) time on the device when torch is imported and CUDA is
available; NVML (``_nvml``) reads health when ``pynvml`` is installed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final, TypeVar

from stepwatch.core._errors import ConfigError
from stepwatch.exporters._protocols import DeviceTimer, HealthSource
from stepwatch.exporters.device import _cuda, _nvml

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

_log = logging.getLogger(__name__)

AUTO: Final = "auto"
HOST_CLOCK: Final = "cpu"
"""``device_timer="cpu"`` (or None): no device timer, the host clock times everything."""


@dataclasses.dataclass(frozen=True)
class TimerBackend:
    """A device timer a monitor can use: ``device_timer=name``, or found by ``"auto"``.

    Attributes:
        name: What ``device_timer=`` names it by.
        probe: The timer when its device is here, else None (``"auto"``).
        make: The timer, asked for by name; raises :class:`ConfigError` without its device.
    """

    name: str
    probe: Callable[[], DeviceTimer | None]
    make: Callable[[], DeviceTimer]


@dataclasses.dataclass(frozen=True)
class HealthBackend:
    """A device-health source a monitor can sample once per window.

    Attributes:
        name: The back end's name (in logs).
        probe: The source for this rank's resource when its device is here, else None.
        make: The source even where the probe finds nothing (``health=True``); it reports
            its own absence once and goes quiet.
    """

    name: str
    probe: Callable[[Resource], HealthSource | None]
    make: Callable[[Resource], HealthSource]


#: Device timers, in the order ``"auto"`` asks them.
TIMERS: tuple[TimerBackend, ...] = (TimerBackend("cuda", _cuda.probe, _cuda.CudaEventTimer),)
#: Device-health sources, in the order ``health=None`` asks them.
HEALTH: tuple[HealthBackend, ...] = (HealthBackend("nvml", _nvml.probe, _nvml.HealthSampler),)

_Found = TypeVar("_Found")


def _first_present(probes: Iterable[tuple[str, Callable[[], _Found | None]]]) -> _Found | None:
    """What the first probe that answers gives, or None; a probe that raises is absent."""
    for name, probe in probes:
        try:
            found = probe()
        except Exception:
            _log.warning("device back end %r: its probe raised; taken as absent", name)
            _log.debug("probe failure", exc_info=True)
            continue
        if found is not None:
            return found
    return None


def resolve_device_timer(device_timer: DeviceTimer | str | None) -> DeviceTimer | None:
    """The monitor's device timer, or None for the host clock.

    Args:
        device_timer: ``"auto"`` (the first of :data:`TIMERS` whose device is here, else
            None), a back end's name (``"cuda"``), ``"cpu"``/None (host clock only) or a
            timer.

    Raises:
        ConfigError: An unknown name, or a back end named whose device is not here.
    """
    if device_timer is None or device_timer == HOST_CLOCK:
        return None
    if device_timer == AUTO:
        return _first_present((backend.name, backend.probe) for backend in TIMERS)
    if isinstance(device_timer, str):
        for backend in TIMERS:
            if backend.name == device_timer:
                return backend.make()
        names = ", ".join(repr(name) for name in (AUTO, *(b.name for b in TIMERS), HOST_CLOCK))
        raise ConfigError(f"device_timer must be {names} or a DeviceTimer, got {device_timer!r}")
    return device_timer


def resolve_health(health: HealthSource | bool | None, resource: Resource) -> HealthSource | None:
    """The monitor's health source, or None.

    Args:
        health: ``None`` (the first of :data:`HEALTH` whose device is here, else None),
            ``True`` (the same, else the first back end all the same: it logs its absence
            once), ``False`` (none) or a source.
        resource: The rank's resource (the readings' resource).
    """
    if health is False:
        return None
    if health is None or health is True:
        found = _first_present(
            (backend.name, functools.partial(backend.probe, resource)) for backend in HEALTH
        )
        if found is None and health is True and HEALTH:
            return HEALTH[0].make(resource)
        return found
    return health
