"""The floor plan holds: one import name per module, layers one way, no circles, reviewed rooms.

Read from the source with :mod:`ast` (every import, also those inside functions and under
``TYPE_CHECKING``), so a violation fails here before it confuses a reader. The rules and the
reasons are in docs/adr/0001-layout.md.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: distribution folder → (its package, layer). core ← components ← app.
DISTRIBUTIONS = {
    "core": ("stepwatch.core", 0),
    "exporters": ("stepwatch.exporters", 1),
    "otel_bridge": ("stepwatch.otel_bridge", 1),
    "detectors": ("stepwatch.detectors", 1),
    "app": ("stepwatch.app", 2),
}
#: What the big-file review looks at (tests/big_files.toml).
REVIEW_SUFFIXES = (".py", ".c", ".h", ".js", ".sh")
#: Import names of third-party packages → the distribution requirement that provides them.
THIRD_PARTY = {
    "opentelemetry": "opentelemetry-",
    "google": "protobuf",
    "grpc": "grpcio",
    "httptools": "httptools",
    "prometheus_client": "prometheus-client",
    "influxdb_client": "influxdb-client",
    "numpy": "numpy",
    "pyarrow": "pyarrow",
    "scipy": "scipy",
    "statsmodels": "statsmodels",
    "torch": "torch",
    "cupti": "cupti-python",
    "pynvml": "nvidia-ml-py",
    "pytorch_lightning": "pytorch-lightning",
    "lightning": "lightning",
    "transformers": "transformers",
}
#: Modules that exist for an extra: they import it at module level (users import them only
#: when they use that framework; no façade imports them).
EXTRA_ENTRY_POINTS = ("stepwatch.exporters.integrations.",)


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (absolute)
    line: int
    top_level: bool  # at module level (not in a function, not under TYPE_CHECKING)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> list[tuple[str, str, Path]]:
    """(distribution folder, module name, path) of every module of every distribution."""
    found = []
    for folder in DISTRIBUTIONS:
        root = REPO / folder / "src"
        for path in sorted(root.rglob("*.py")):
            found.append((folder, _module_name(path, root), path))
    return found


def _imports(module: str, path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    result: list[Import] = []

    def visit(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = top_level
            function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if function or (
                isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            ):
                nested = False
            if isinstance(child, ast.Import):
                for alias in child.names:
                    result.append(Import(module, alias.name, child.lineno, top_level))
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                for alias in child.names:
                    # ``from stepwatch.core import _schema`` imports the module _schema.
                    target = f"{base}.{alias.name}" if alias.name.startswith("_") else base
                    result.append(Import(module, target, child.lineno, top_level))
            visit(child, nested)

    visit(tree, True)
    return result


ALL_IMPORTS = [
    (folder, imp) for folder, module, path in _sources() for imp in _imports(module, path)
]


def _owner(module: str) -> str | None:
    """The distribution folder whose package holds ``module`` (None: not stepwatch's)."""
    for folder, (package, _) in DISTRIBUTIONS.items():
        if module == package or module.startswith(package + "."):
            return folder
    return None


def test_no_symlinks_and_stepwatch_is_a_namespace_everywhere() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    assert not [line for line in tracked.splitlines() if line.startswith("120000")]
    for folder in DISTRIBUTIONS:
        # PEP 420: a stepwatch/__init__.py in any portion would hide all the others.
        assert not (REPO / folder / "src" / "stepwatch" / "__init__.py").exists(), folder
    assert not (REPO / "stepwatch").exists()


def test_one_import_name_per_module() -> None:
    """From the repo root, the folders are not packages: only ``stepwatch.*`` imports."""
    code = (
        "import importlib, sys\n"
        "names = ['exporters._monitor', 'otel_bridge._bridge', 'detectors._frame',"
        " 'core._errors', 'app._cli']\n"
        "ok = []\n"
        "for name in names:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        ok.append(name)\n"
        "    except ImportError:\n"
        "        pass\n"
        "print(','.join(ok))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


@pytest.mark.parametrize("folder", list(DISTRIBUTIONS))
def test_layers_point_one_way(folder: str) -> None:
    """core ← components ← app; no component imports another component at all."""
    package, layer = DISTRIBUTIONS[folder]
    wrong = []
    for source_folder, imp in ALL_IMPORTS:
        if source_folder != folder:
            continue
        owner = _owner(imp.target)
        if owner is None or owner == folder:
            continue
        target_layer = DISTRIBUTIONS[owner][1]
        if target_layer > layer or (target_layer == layer == 1):
            wrong.append(f"{imp.source}:{imp.line} imports {imp.target}")
    assert not wrong, f"{package} reaches up or sideways:\n" + "\n".join(wrong)


def test_nobody_imports_another_components_private_module() -> None:
    """A component's ``_private`` modules are its own; core's serve every component."""
    wrong = []
    for source_folder, imp in ALL_IMPORTS:
        owner = _owner(imp.target)
        if owner in (None, source_folder, "core"):
            continue
        package = DISTRIBUTIONS[owner][0]
        rest = imp.target[len(package) :].split(".")
        if any(part.startswith("_") for part in rest):
            wrong.append(f"{imp.source}:{imp.line} imports {imp.target}")
    assert not wrong, "\n".join(wrong)


def _requirements(folder: str) -> tuple[set[str], set[str]]:
    """(dependencies, optional dependencies) of a distribution, as requirement names."""
    pyproject = REPO / ("pyproject.toml" if folder == "app" else f"{folder}/pyproject.toml")
    project = tomllib.loads(pyproject.read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {
            r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].strip() for r in requirements
        }

    optional: set[str] = set()
    for requirements in project.get("optional-dependencies", {}).values():
        optional |= names(requirements)
    return names(project.get("dependencies", [])), optional


@pytest.mark.parametrize("folder", list(DISTRIBUTIONS))
def test_third_party_imports_are_declared(folder: str) -> None:
    """Module-level imports need a dependency; lazy ones at least an extra.

    This is what lets a training image install ``./core ./exporters`` alone.
    """
    required, optional = _requirements(folder)
    wrong = []
    for source_folder, imp in ALL_IMPORTS:
        if source_folder != folder:
            continue
        top = imp.target.split(".")[0]
        if top in sys.stdlib_module_names or top in ("stepwatch", "__future__"):
            continue
        requirement = THIRD_PARTY.get(top)
        assert requirement is not None, f"{imp.source}:{imp.line}: unknown package {top}"
        lazy = not imp.top_level or imp.source.startswith(EXTRA_ENTRY_POINTS)
        pool = required | optional if lazy else required
        if folder == "app":  # the app reaches components' dependencies through its extras
            pool = pool | optional | {"stepwatch-exporters", "stepwatch-detectors"}
            if any(r.startswith("stepwatch-") for r in pool):
                continue
        if not any(name.startswith(requirement) for name in pool):
            wrong.append(f"{imp.source}:{imp.line} imports {top} ({requirement} not declared)")
    assert not wrong, "\n".join(wrong)


def _tracked_sources() -> dict[str, int]:
    """Every tracked source file (Python, C, JavaScript, shell) and its line count."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", *(f"*{suffix}" for suffix in REVIEW_SUFFIXES)],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return {
        name: len((REPO / name).read_text(errors="replace").splitlines())
        for name in listed.split("\0")
        if name and (REPO / name).is_file()
    }


def test_big_files_are_reviewed() -> None:
    """A soft trigger, not a cap: a file past the review size is listed with why it is big.

    Size alone says little (a C extension's one object, a table, a test of every case of one
    protocol); a file that grew past the trigger unnoticed usually mixes several concepts. So
    a file over ``trigger_lines`` (code, C and tests alike) must be in tests/big_files.toml
    with the size it was reviewed at and the reason it stays whole; one that grew by more
    than ``regrowth`` since, or an entry for a file now small or gone, asks for a new look.
    """
    config = tomllib.loads((REPO / "tests" / "big_files.toml").read_text())
    trigger = int(config["trigger_lines"])
    regrowth = float(config["regrowth"])
    reviewed = {entry["path"]: entry for entry in config["file"]}
    sizes = _tracked_sources()
    asks = []
    for name, lines in sorted(sizes.items()):
        entry = reviewed.get(name)
        if lines > trigger and entry is None:
            asks.append(f"{name}: {lines} lines, not reviewed (split it by concept, or list it)")
        elif entry is not None and lines > entry["lines"] * (1.0 + regrowth):
            asks.append(f"{name}: {lines} lines, reviewed at {entry['lines']}: look again")
    for name, entry in sorted(reviewed.items()):
        if not entry.get("why"):
            asks.append(f"{name}: listed without a reason")
        if sizes.get(name, 0) <= trigger:
            asks.append(f"{name}: listed but {sizes.get(name, 0)} lines now: drop the entry")
    assert not asks, "big files to review (tests/big_files.toml):\n" + "\n".join(asks)


def test_no_import_circles() -> None:
    """No module imports, directly or through others, a module that imports it back.

    Every import counts, also one deferred into a function (a circle hidden from the import
    machinery is still one for a reader). A package's ``__init__`` importing its own modules
    is not a circle.
    """
    modules = {module for _, module, _ in _sources()}

    def owner(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    graph: dict[str, set[str]] = {module: set() for module in modules}
    for _, imp in ALL_IMPORTS:
        target = owner(imp.target)
        if target is not None and target != imp.source and not imp.source.startswith(target + "."):
            graph[imp.source].add(target)
    circles = _strongly_connected(graph)
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one node (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize(
    "package", [package for package, _ in DISTRIBUTIONS.values() if package != "stepwatch.app"]
)
def test_public_names_report_their_public_module(package: str) -> None:
    """``StepMonitor.__module__ == 'stepwatch.exporters'``: docs, reprs and pickles agree.

    The module a class or function names must be public (no ``_private`` part) and export it.
    """
    module = importlib.import_module(package)
    wrong = []
    for name in module.__all__:
        member = getattr(module, name)
        routine = callable(member) and hasattr(member, "__qualname__")
        if not (isinstance(member, type) or routine):
            continue
        home = getattr(member, "__module__", "")
        public = not any(part.startswith("_") for part in home.split("."))
        if not public or getattr(importlib.import_module(home), name, None) is not member:
            wrong.append(f"{name}: {home}")
    assert not wrong, "\n".join(wrong)


def test_importing_every_module_starts_nothing() -> None:
    """Importing does nothing: no threads; no logging handlers installed."""
    modules = [module for _, module, _ in _sources() if module != "stepwatch.__main__"]
    code = (
        "import importlib, logging, sys, threading\n"
        f"modules = {modules!r}\n"
        "for name in modules:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as exc:\n"
        # the extras' packages (GPU; torch and the frameworks: not on every Python)
        "        if not exc.name or exc.name.split('.')[0] not in (\n"
        "            'cupti', 'pynvml', 'torch', 'lightning', 'pytorch_lightning',\n"
        "            'transformers', 'accelerate',\n"
        "        ):\n"
        "            raise\n"
        "print(threading.active_count(), len(logging.getLogger().handlers))\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["1", "0"]
