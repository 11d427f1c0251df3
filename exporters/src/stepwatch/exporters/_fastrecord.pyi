# Type stub of the C extension exporters/csrc/fastrecord.c (see its module comment).
from collections.abc import Callable
from typing import Any

class RecorderCore: ...

class StepContext:
    def __init__(self, recorder: Any) -> None: ...
    def __enter__(self) -> None: ...
    def __exit__(self, exc_type: object, exc: object, traceback: object) -> bool: ...

class PhaseContext:
    _depth: int
    _start_ns: int
    _name: str
    def __init__(self, recorder: Any, name: str) -> None: ...
    def __enter__(self) -> None: ...
    def __exit__(self, exc_type: object, exc: object, traceback: object) -> bool: ...

def sampler_changed() -> None: ...
def configure(
    begin_step: Callable[..., None],
    end_step: Callable[..., None],
    unsampled: object,
    sampler: type,
    perf_counter_ns: Callable[[], int],
) -> None: ...

class PhaseLookup:
    def __init__(self, recorder: Any, contexts: dict[str, Any]) -> None: ...
    def __call__(self, name: str) -> Any: ...

def host_values(
    records: list[Any], carry: int
) -> tuple[list[float], dict[str, list[float]], list[dict[str, int]], int] | None: ...

class ClockStamp:
    ns: int
    def __init__(self) -> None: ...
    def __call__(self, *args: object, **kwargs: object) -> None: ...

class EventMarker:
    def __init__(self, factory: Callable[[], Any]) -> None: ...
    def __call__(self) -> Any: ...

class MarkStamp:
    ns: int
    mark: Any
    def __init__(self, device_timer: Any) -> None: ...
    def __call__(self, *args: object, **kwargs: object) -> None: ...

class OptimizerGate:
    active: bool
    slow: Any
    calls: int
    partner: OptimizerGate | None
    def __init__(
        self,
        kind: str,
        recorder: Any,
        slow: Any,
        extra: Any,
        state: Any = None,
        device: Any = None,
        partner: OptimizerGate | None = None,
    ) -> None: ...
    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> Any: ...

class ForwardGate:
    def __init__(
        self, target: Any, state: Any, recorder: Any, stamp: Any, forward: Any, slow: Any
    ) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def time_in_c(
        self,
        tensor_type: type,
        grad_enabled: Callable[[], bool],
        has_torch_function: Callable[[Any], bool],
        hook_dict_type: type,
        hook_key: int,
        hook: Callable[..., None],
        device: Any = None,
    ) -> None: ...

class BackwardStart:
    def __init__(self, state: Any, device: Any = None) -> None: ...
    def __call__(self, *args: object, **kwargs: object) -> None: ...

class ExportWaiter:
    def __init__(self) -> None: ...
    def wait(
        self,
        recorder: Any,
        timeout_s: float,
        probe_s: float,
        quiet_s: float,
        armed: bool,
        steps: int,
        changed_s: float,
    ) -> tuple[int, float, int]: ...
    def wake(self) -> None: ...
