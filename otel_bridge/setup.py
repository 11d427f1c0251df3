"""The bridge's optional C extension (``stepwatch.otel_bridge._fastpath``); the rest of the
build is in pyproject.toml. Without a C compiler the package still installs: the bridge then
uses its Python path (docs/deployment.md, "Bridge vs influxd CPU")."""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

WARNINGS = ["-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wconversion"]
# -ffp-contract=off: the C arithmetic must round exactly as Python's does (no fused multiply-add)
FLAGS = [] if sys.platform == "win32" else ["-O2", "-std=c11", "-ffp-contract=off", *WARNINGS]


class OptionalBuildExt(build_ext):
    """Builds the extension when it can; a failure leaves the pure-Python bridge."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            print(f"stepwatch-otel-bridge: C fast path not built ({exc})", file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"stepwatch-otel-bridge: C fast path not built ({exc})", file=sys.stderr)


setup(
    ext_modules=[
        Extension(
            "stepwatch.otel_bridge._fastpath",
            sources=["csrc/fastpath.c"],
            extra_compile_args=FLAGS,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
