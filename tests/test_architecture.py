"""The package's layering: each package of trainstack/ imports only the packages below it, and no module
takes part in an import circle. Every import counts, those inside functions and `if TYPE_CHECKING:`
blocks included: a lazy import is still a dependency, only a later one. The table is the one the
package docstring (trainstack/__init__.py) and docs/architecture.md draw.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainstack"

# package -> the trainstack packages it may import (`trainstack.errors` is open to all)
ALLOWED = {
    "protocol": set(),
    "recipes": set(),
    "planner": {"recipes"},
    "emulator": set(),
    "gitops": {"planner", "recipes"},
    "aws": {"planner", "recipes", "protocol", "emulator"},
    "tuning": {"planner", "recipes", "protocol"},
    "cli": {"aws", "gitops", "emulator", "tuning", "planner", "recipes", "protocol"},
}
OPEN_TO_ALL = {"trainstack", "trainstack.errors"}
# What the training image may import: its build context holds only these (see .dockerignore).
TRAINER_ALLOWED = {"recipes", "planner", "protocol"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, top: str = "trainstack") -> set[str]:
    """Every module of package `top` that `path` imports, resolved to module names (`from trainstack.x
    import y` counts `trainstack.x.y` when y is a module, else `trainstack.x`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == top)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != top:
                continue
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if is_module(candidate) else node.module)
    return found


def is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else None


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_lives_in_a_package_by_concern():
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "errors.py")]
    assert not loose, f"modules at trainstack/'s top level, outside every package: {loose}"
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_docstring_says_what_it_owns(package):
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
    assert doc and "import" in doc, f"trainstack/{package}/__init__.py: say what it owns and may import"


def test_imports_point_down_the_layers():
    wrong = []
    for path in SOURCES:
        mine = package_of(module_name(path))
        for target in sorted(imported_modules(path)):
            theirs = package_of(target)
            if target in OPEN_TO_ALL or theirs == mine or mine is None and theirs is None:
                continue
            if mine is None or theirs not in ALLOWED[mine]:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "imports against the layering (tests/test_architecture.py ALLOWED):\n" + "\n".join(
        wrong
    )


def test_no_import_circles():
    graph = {module_name(p): imported_modules(p) for p in SOURCES}
    state: dict[str, int] = {}
    circles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or nxt not in graph:
                continue
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt) :] + [nxt]) if nxt in path else nxt)
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_trainer_and_the_stacks_sit_outside_the_package():
    for path in sorted((ROOT / "training_image" / "trainer").glob("*.py")):
        for target in imported_modules(path):
            assert target in OPEN_TO_ALL or package_of(target) in TRAINER_ALLOWED, (
                f"{path.relative_to(ROOT)} imports {target}: the image carries only {sorted(TRAINER_ALLOWED)}"
            )
    for path in SOURCES:
        for outside in ("stacks", "trainer"):
            assert not imported_modules(path, outside), f"{path.relative_to(ROOT)} imports {outside}"
