"""The public surface of stepwatch.otel_bridge is pinned; helpers stay private; import is cheap."""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import subprocess
import sys
import types

import stepwatch.otel_bridge

# What users call: the bridge and the conversion it runs; the writers and spools it uses.
EXPECTED = {
    *("Bridge", "BridgeMetrics", "CardinalityGuard", "TAG_ALLOWLIST"),
    *("convert_request", "Conversion"),
    # the compact layout's fixed field set and the reader of its `buckets` field (issue 15)
    *("COMPACT_FIELDS", "LAYOUTS", "decode_buckets", "bucket_quantile", "merge_buckets"),
    "buckets_from_bound_fields",
    *("InfluxV1Writer", "InfluxV2Writer", "LineWriter", "DiskSpool", "MemorySpool", "SpoolAppend"),
}


def test_all_is_pinned() -> None:
    assert set(stepwatch.otel_bridge.__all__) == EXPECTED
    assert len(stepwatch.otel_bridge.__all__) == len(EXPECTED)


def test_every_exported_name_exists_and_names_its_public_home() -> None:
    for name in stepwatch.otel_bridge.__all__:
        member = getattr(stepwatch.otel_bridge, name)
        if isinstance(member, type | types.FunctionType):
            assert member.__module__ == "stepwatch.otel_bridge", name


def test_helpers_are_not_public() -> None:
    """Bucket maths and quantile constants are the conversion's, not the user's."""
    public = {
        name
        for name, value in vars(stepwatch.otel_bridge).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public - {"publish"} == EXPECTED
    for helper in ("format_bound", "nearest_rank_quantile", "explicit_buckets", "Buckets"):
        assert not hasattr(stepwatch.otel_bridge, helper), helper


def test_docstring_examples_run() -> None:
    modules = [stepwatch.otel_bridge] + [
        importlib.import_module(f"stepwatch.otel_bridge.{info.name}")
        for info in pkgutil.iter_modules(stepwatch.otel_bridge.__path__)
    ]
    assert len(modules) > 10
    for module in modules:
        failures, _ = doctest.testmod(module, raise_on_error=False)
        assert failures == 0, module.__name__


def test_import_does_not_load_grpc_protobuf_or_prometheus() -> None:
    """Receivers and metrics load their libraries when a Bridge is built or started."""
    heavy = ("grpc", "google.protobuf", "opentelemetry", "prometheus_client")
    code = f"import sys, stepwatch.otel_bridge; print([m for m in {heavy!r} if m in sys.modules])"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (run.returncode, run.stdout.strip()) == (0, "[]"), run.stderr
