"""The packages build and install the same wherever they say they run (docs/packaging.md).

What the build matrix (scripts/ci_matrix.sh: sdists, wheels from them, Python 3.11-3.13, and
no C compiler) relies on, checked on every run of the suite: each sdist carries every C file
its extensions compile, the two packages' optional C build is one text, the C uses no private
CPython API, and, where ``STEPWATCH_REQUIRE_C`` says so (CI), every extension is built.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from stepwatch.core import settings

REPO = Path(__file__).resolve().parents[1]
C_PACKAGES = ("exporters", "otel_bridge")
_BLOCK = re.compile(r"# ---- optional C build.*?# ---- end of the optional C build ----", re.S)


def test_the_optional_c_build_is_one_text_in_both_packages() -> None:
    """Each sdist builds alone, so each setup.py carries the build; the two copies agree."""
    blocks = [_BLOCK.search((REPO / name / "setup.py").read_text()) for name in C_PACKAGES]
    assert all(blocks)
    assert blocks[0].group(0) == blocks[1].group(0)  # type: ignore[union-attr]


@pytest.mark.parametrize("package", C_PACKAGES)
def test_the_sdist_carries_every_c_file(package: str, tmp_path: Path) -> None:
    """A wheel built from the sdist compiles what the checkout compiles (the bridge's sdist
    once left out csrc/pow10.h: its wheels lacked the fast path, silently)."""
    pytest.importorskip("setuptools")  # not in a venv of Python 3.12+; the matrix has one
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; "
            "print(build_meta.build_sdist(sys.argv[1]))",
            str(tmp_path),
        ],
        cwd=REPO / package,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sdist = tmp_path / done.stdout.split()[-1]
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    wanted = {
        f"csrc/{path.name}"
        for path in (REPO / package / "csrc").iterdir()
        if path.suffix in (".c", ".h", ".py")
    }
    assert wanted and wanted <= names, sorted(wanted - names)
    assert not any(name.endswith((".so", ".pyd")) for name in names)


def test_the_c_uses_no_private_cpython_api() -> None:
    """Private names (``_Py...``) come and go between versions (3.13 dropped ``_Py_HashBytes``
    and ``_PyArg_NoKeywords`` from its headers); the public API is there on every version."""
    private = re.compile(r"\b_Py[A-Za-z_]+\s*\(")
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for package in C_PACKAGES
        for path in sorted((REPO / package / "csrc").glob("*.[ch]"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if private.search(line) and not line.lstrip().startswith(("/*", "*"))
    ]
    assert not found, "\n".join(found)


def test_every_c_extension_is_built_where_required() -> None:
    """``STEPWATCH_REQUIRE_C=1`` (CI, and images that must carry the fast paths): every
    extension imports. Elsewhere a missing one is reported here as a skip."""
    from stepwatch.exporters import _cext
    from stepwatch.otel_bridge import _fast

    missing = dict(_cext.NOT_BUILT)
    if _fast.IMPORT_ERROR is not None:
        missing["_fastpath"] = _fast.IMPORT_ERROR
    if not settings.REQUIRE_C.resolve(None, os.environ):
        if missing:
            pytest.skip(f"not built (no C compiler): {sorted(missing)}")
        return
    assert not missing, missing
