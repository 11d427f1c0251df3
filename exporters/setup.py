"""The exporters' optional C extensions; the rest of the build is in pyproject.toml.

- ``stepwatch.exporters._fastrecord`` (``csrc/fastrecord.c``, ``csrc/stepbuffer.h``): the
  training thread's step boundary and ``step()``/``phase()`` contexts, the finished steps'
  buffer, and the export thread's pass over the steps;
- ``stepwatch.exporters._fasthist`` (``csrc/fasthist.c``): the histogram recording loops.

Both are ``optional``: where one does not compile (no C compiler), setuptools warns and the
package installs without it, and the Python code runs instead: the same results, more CPU per
step (docs/exporters.md, "C fast paths").
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup

# -ffp-contract=off: the C arithmetic must round exactly as Python's does (no fused multiply-add)
ARGS = [] if sys.platform == "win32" else ["-O2", "-std=c11", "-ffp-contract=off", "-Wall"]
ARGS += (
    []
    if sys.platform == "win32"
    else ["-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wconversion"]
)

setup(
    ext_modules=[
        Extension(
            f"stepwatch.exporters.{name}",
            [f"csrc/{source}"],
            depends=["csrc/stepbuffer.h", "csrc/eventmarker.h", "csrc/enginegate.h"],
            extra_compile_args=ARGS,
            optional=True,
        )
        for name, source in (("_fastrecord", "fastrecord.c"), ("_fasthist", "fasthist.c"))
    ],
)
