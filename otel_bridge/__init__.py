"""stepwatch.otel_bridge (being written)."""

__all__: list[str] = []
