"""The exporters' optional C extensions; the rest of the build is in pyproject.toml.

- ``stepwatch.exporters._fastrecord`` (``csrc/fastrecord.c`` and the headers it includes, one
  per object: ``csrc/*.h``): the training thread's step boundary and
  ``step()``/``phase()`` contexts, auto mode's gates and stamps, the autograd engine's gate,
  the finished steps' buffer, and the export thread's pass over the steps;
- ``stepwatch.exporters._fasthist`` (``csrc/fasthist.c``): the histogram recording loops.

Where an extension does not compile (no C compiler), the package installs without it and the
Python code runs instead: the same phases and histograms, more CPU per step. A wheel without
either is pure Python (``py3-none-any``), and the first ``StepMonitor`` of a process logs a
warning (docs/packaging.md; ``STEPWATCH_REQUIRE_C=1`` makes it refuse to start).
"""

from __future__ import annotations

import glob
import sys

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

# ---- optional C build: the same in exporters/setup.py and otel_bridge/setup.py (each sdist
# builds alone; tests/test_packaging.py checks the two copies are one text) ----
WARNINGS = ["-Wall", "-Wextra", "-Wshadow", "-Wstrict-prototypes", "-Wconversion"]
# -ffp-contract=off: the C arithmetic must round exactly as Python's does (no fused multiply-add).
# An undeclared function is an error, never an implicit int (a truncated result).
UNIX_FLAGS = ["-O2", "-std=c11", "-ffp-contract=off", "-Werror=implicit-function-declaration"]
FLAGS = [] if sys.platform == "win32" else [*UNIX_FLAGS, *WARNINGS]
NOT_BUILT: dict[str, str] = {}  # extension -> why it was not built


class OptionalBuildExt(build_ext):
    """Builds each extension where it compiles; where one does not, says so and goes on."""

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # no compiler, or one that refuses the code
            NOT_BUILT[ext.name] = str(exc).strip().splitlines()[-1] if str(exc) else repr(exc)
            bar = "=" * 78
            print(
                f"\n{bar}\nWARNING: {ext.name} not built ({NOT_BUILT[ext.name]}).\nThe "
                "package installs without it: its Python code runs instead (the same results,"
                f" more CPU).\n{bar}\n",
                file=sys.stderr,
            )


class WheelOfWhatWasBuilt(bdist_wheel):
    """A wheel tagged by what it holds: with no extension built, pure (``py3-none-any``)."""

    def run(self) -> None:
        self.run_command("build")
        extensions = self.distribution.ext_modules or []
        if extensions and all(ext.name in NOT_BUILT for ext in extensions):
            self.distribution.ext_modules = []
            self.root_is_pure = True
        super().run()


COMMANDS = {"build_ext": OptionalBuildExt, "bdist_wheel": WheelOfWhatWasBuilt}
# ---- end of the optional C build ----

HEADERS = sorted(glob.glob("csrc/*.h"))  # fastrecord.c includes every one of them

setup(
    ext_modules=[
        Extension(
            f"stepwatch.exporters.{name}",
            [f"csrc/{source}"],
            depends=HEADERS,
            extra_compile_args=FLAGS,
        )
        for name, source in (("_fastrecord", "fastrecord.c"), ("_fasthist", "fasthist.c"))
    ],
    cmdclass=COMMANDS,
)
