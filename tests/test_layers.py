"""The package layers, written once: a module may import from its own package and from packages
in lower layers, never from its own layer's other packages or from above. Within ``services``
the same holds for its sub-packages. The walk reads every module's import statements (function
bodies included: a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom first. One layer's packages may not import each other.
LAYERS: list[list[str]] = [
    ["protos", "loadtest"],
    ["kernels"],  # compute primitives: the KV copies of kvtransfer use kernels.openmp
    ["kvtransfer", "common"],
    ["services"],
    ["router"],
    ["pdserve"],
    ["benchmarks"],
]
SERVICES_LAYERS: list[list[str]] = [
    ["registry", "redis_server"],
    ["engine"],
    ["worker"],
    ["prefill", "decode"],
    ["server"],
    ["worker_pool"],
]


def imports_of(path: Path) -> set[str]:
    """Absolute module names ``path`` imports (relative imports stay in their package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def upward_imports(layers: list[list[str]], root: Path, prefix: str) -> list[str]:
    level = {name: i for i, layer in enumerate(layers) for name in layer}
    found = []
    for package, own in level.items():
        files = [root / f"{package}.py"] if (root / f"{package}.py").exists() else []
        files += sorted((root / package).rglob("*.py")) if (root / package).is_dir() else []
        for path in files:
            for name in imports_of(path):
                if not name.startswith(prefix):
                    continue
                target = name[len(prefix) :].split(".")[0]
                if target in level and target != package and level[target] >= own:
                    where = path.relative_to(ROOT)
                    found.append(f"{where} imports {name} ({prefix}{target} is not below it)")
    return found


def test_every_package_is_in_a_layer():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    packages |= {p.name for p in ROOT.iterdir() if p.is_dir() and list(p.glob("*.py"))}
    packages -= {"tests", "docs", "k8s", "monitoring", ".venv", "build", "deploy"}  # not layers
    assert packages <= {name for layer in LAYERS for name in layer}, packages
    services = {p.stem if p.is_file() else p.name for p in (ROOT / "services").iterdir()}
    services -= {"__init__", "__pycache__"}
    assert services == {name for layer in SERVICES_LAYERS for name in layer}, services


def test_no_package_imports_upward():
    assert upward_imports(LAYERS, ROOT, "") == []


def test_no_services_part_imports_upward():
    assert upward_imports(SERVICES_LAYERS, ROOT / "services", "services.") == []
