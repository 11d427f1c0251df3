from collections.abc import Callable, Iterable, Mapping

CONSTANTS: dict[str, object]

def convert(
    body: bytes,
    allowlist: Iterable[str],
    max_duration_s: float | None,
    earliest: int | None,
    latest: int | None,
    resource_check: Callable[[Mapping[str, str]], str | None] | None,
    /,
) -> tuple[list[str], bytes, bytes, list[tuple[str, str, str]], dict[str, int], int] | None: ...
def unknown(series: Mapping[int, object], hashes: bytes, /) -> list[int]: ...
def touch(
    series: Mapping[int, object], hashes: bytes, now: float, stale_before: float, /
) -> None: ...
