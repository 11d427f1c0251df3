"""Device back ends: which timer times on the device and which source reads its health.

``device_timer="auto"`` picks CUDA events when torch is imported and CUDA is available, else
the host clock; ``health=None`` builds an NVML sampler when ``pynvml`` is installed.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

from stepwatch.core._errors import ConfigError
from stepwatch.exporters._protocols import DeviceTimer, HealthSource
from stepwatch.exporters.device._cuda import CudaEventTimer
from stepwatch.exporters.device._nvml import HealthSampler

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource


def resolve_device_timer(device_timer: DeviceTimer | str | None) -> DeviceTimer | None:
    """``"auto"`` → CUDA events when torch is imported and CUDA is available, else None.

    Args:
        device_timer: ``"auto"``, ``"cuda"``, ``"cpu"``/None (host clock only) or a timer.

    Raises:
        ConfigError: An unknown name, or ``"cuda"`` without a CUDA device.
    """
    if device_timer is None or device_timer == "cpu":
        return None
    if device_timer == "cuda":
        return CudaEventTimer()
    if device_timer == "auto":
        torch = sys.modules.get("torch")  # never import torch just to find out
        if torch is None:
            return None
        try:
            available = bool(torch.cuda.is_available())
        except Exception:
            return None
        return CudaEventTimer() if available else None
    if isinstance(device_timer, str):
        raise ConfigError(
            f"device_timer must be 'auto', 'cuda', 'cpu' or a DeviceTimer, got {device_timer!r}"
        )
    return device_timer


def resolve_health(health: HealthSource | bool | None, resource: Resource) -> HealthSource | None:
    """``False`` → None; ``None`` → an NVML sampler when ``pynvml`` is installed; ``True`` → one."""
    if health is False:
        return None
    if health is None or health is True:
        if health is None and importlib.util.find_spec("pynvml") is None:
            return None
        return HealthSampler(resource)
    return health
