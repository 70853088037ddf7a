"""The package's layering: each package of trainstack/ imports only the packages below it, and no module
takes part in an import circle. Every import counts, those inside functions and `if TYPE_CHECKING:`
blocks included: a lazy import is still a dependency, only a later one. The table is the one the
package docstring (trainstack/__init__.py) and docs/architecture.md draw.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainstack"

# package -> the trainstack packages it may import (`trainstack.errors` and `.units` are open to all)
ALLOWED = {
    "protocol": set(),
    "recipes": set(),
    "planner": {"recipes"},
    "emulator": {"planner", "recipes", "protocol"},  # jobs: the container contract; stand_in: the planner
    "gitops": {"planner", "recipes"},
    "aws": {"planner", "recipes", "protocol", "emulator"},
    "tuning": {"planner", "recipes", "protocol"},
    "api": {"aws", "gitops", "emulator", "tuning", "planner", "recipes", "protocol"},
    # The command line is a shell over the API: it parses options, calls trainstack.api and prints
    # (with the types and renderers of the layers below); the tuning run is driven through the API.
    "cli": {"api", "aws", "gitops", "emulator", "planner", "recipes"},
}
OPEN_TO_ALL = {"trainstack", "trainstack.errors", "trainstack.units"}
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
    open_to_all = {f"{module.rpartition('.')[2]}.py" for module in OPEN_TO_ALL if module != "trainstack"}
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name not in {"__init__.py", *open_to_all}]
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


def import_circles(graph: dict[str, set[str]]) -> list[str]:
    """Every circle of `graph` (node -> the nodes it imports), each as `a -> b -> a`."""
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
    return circles


def test_no_import_circles():
    circles = import_circles({module_name(p): imported_modules(p) for p in SOURCES})
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_trainer_and_the_stacks_sit_outside_the_package():
    for path in TRAINER_SOURCES:
        for target in imported_modules(path):
            assert target in OPEN_TO_ALL or package_of(target) in TRAINER_ALLOWED, (
                f"{path.relative_to(ROOT)} imports {target}: the image carries only {sorted(TRAINER_ALLOWED)}"
            )
    for path in SOURCES:
        for outside in ("stacks", "trainer"):
            assert not imported_modules(path, outside), f"{path.relative_to(ROOT)} imports {outside}"


# --- The trainer (training_image/trainer): packages by concern, the same rules, its own table ---------
# Its units are its packages and the modules at its top level; `trainer` itself (its __init__, the
# layout's docstring) is open to all. The table is the one trainer/__init__.py and docs/architecture.md
# draw: the job's steps (train, __main__, entrypoint, export, prepare) on top, then what they compose.
TRAINER = ROOT / "training_image" / "trainer"
TRAINER_SOURCES = sorted(TRAINER.rglob("*.py"))
TRAINER_LAYERS = {
    "__main__": {"train", "checkpoint", "runtime"},
    "entrypoint": {"distributed", "runtime"},  # runtime: the failure line (runtime.failure)
    "train": {
        "validation",
        "checkpoint",
        "hf",
        "distributed",
        "models",
        "data",
        "metrics",
        "runtime",
        "config",
        "optim",
        "storage",
    },
    "export": {"checkpoint", "hf", "config", "storage", "runtime", "prepare"},  # prepare: the chat template
    "trace": {"train", "config", "distributed", "models", "optim"},  # the train step on fake tensors
    "prepare": {"data", "runtime"},
    "validation": {"data", "config"},
    "checkpoint": {"runtime", "optim", "storage"},
    "hf": {"storage"},
    "distributed": {"models"},
    "models": set(),
    "data": set(),
    "metrics": set(),
    "runtime": set(),
    "config": set(),
    "optim": set(),
    "storage": set(),
}
TRAINER_TOP_LEVEL_MODULES_AT_MOST = 10


def trainer_unit(module: str) -> str:
    """`trainer.checkpoint.manager` -> `checkpoint`, `trainer.train` -> `train`, `trainer` -> `trainer`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__init__" else "trainer"


def trainer_module_name(path: Path) -> str:
    parts = ("trainer", *path.relative_to(TRAINER).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def trainer_imports(path: Path) -> set[str]:
    """Every trainer module `path` imports (`from trainer.x import y` counts `trainer.x.y` when y is a
    module of the trainer, else `trainer.x`); lazy imports included, as for trainstack/."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "trainer")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "trainer":
                continue
            for alias in node.names:
                base = TRAINER.joinpath(*node.module.split(".")[1:], alias.name)
                held = base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
                found.add(f"{node.module}.{alias.name}" if held else node.module)
    return found


def test_the_trainer_keeps_few_modules_at_its_top_level_and_every_unit_is_in_the_table():
    top = sorted(p.name for p in TRAINER.glob("*.py"))
    assert len(top) <= TRAINER_TOP_LEVEL_MODULES_AT_MOST, (
        f"{len(top)} modules at training_image/trainer's top level (at most "
        f"{TRAINER_TOP_LEVEL_MODULES_AT_MOST}): move some into a package by concern: {top}"
    )
    packages = {p.name for p in TRAINER.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units = packages | {p.stem for p in TRAINER.glob("*.py") if p.name != "__init__.py"}
    assert units == set(TRAINER_LAYERS), f"units not in TRAINER_LAYERS: {sorted(units ^ set(TRAINER_LAYERS))}"
    assert not import_circles(TRAINER_LAYERS), "TRAINER_LAYERS is not a layering: it has a circle"


@pytest.mark.parametrize("package", sorted(k for k in TRAINER_LAYERS if (TRAINER / k).is_dir()))
def test_trainer_package_docstring_says_what_it_owns_and_may_import(package):
    doc = ast.get_docstring(ast.parse((TRAINER / package / "__init__.py").read_text()))
    assert doc and "may import" in doc.lower(), (
        f"training_image/trainer/{package}/__init__.py: say what it owns and what it may import"
    )


def test_trainer_imports_point_down_its_layers():
    wrong = []
    for path in TRAINER_SOURCES:
        mine = trainer_unit(trainer_module_name(path))
        for target in sorted(trainer_imports(path)):
            theirs = trainer_unit(target)
            if theirs in ("trainer", mine):
                continue
            if mine == "trainer" or theirs not in TRAINER_LAYERS[mine]:
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, (
        "trainer imports against its layering (tests/test_architecture.py TRAINER_LAYERS):\n"
        + "\n".join(wrong)
    )


def test_no_import_circles_in_the_trainer():
    circles = import_circles({trainer_module_name(p): trainer_imports(p) for p in TRAINER_SOURCES})
    assert not circles, "import circles in the trainer:\n" + "\n".join(circles)


# --- The command line is a shell over trainstack.api (issue 37) ----------------------------------------
CLI = PACKAGE / "cli"
CLI_SOURCES = sorted(CLI.rglob("*.py"))
# What only the layers below may do: hold AWS clients (boto3, botocore) or make them (Aws, aws_clients).
AWS_CLIENT_MAKERS = {"Aws", "aws_clients"}
COMMAND_BODY_LINES_AT_MOST = 60  # a longer command body is a sign that something still belongs below
# Commands outside issue 37's list (the ones with a trainstack.api function), not yet moved below.
LONG_COMMANDS_NOT_YET_MOVED = {"recipes.recipes"}


def test_nothing_imports_the_cli_and_the_cli_imports_the_api():
    outside = [
        f"{path.relative_to(ROOT)} imports {target}"
        for path in SOURCES
        if package_of(module_name(path)) != "cli"
        for target in imported_modules(path)
        if package_of(target) == "cli"
    ]
    assert not outside, "the command line is the top layer; nothing imports it:\n" + "\n".join(outside)
    assert any(package_of(t) == "api" for p in CLI_SOURCES for t in imported_modules(p))


def test_no_module_of_the_cli_holds_an_aws_client():
    found = []
    for path in CLI_SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [alias.name for alias in node.names]
            elif isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                names = [called] if called in AWS_CLIENT_MAKERS | {"client"} else []
            for name in names:
                if name.split(".")[0] in ("boto3", "botocore") or name in AWS_CLIENT_MAKERS | {"client"}:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not found, "AWS clients belong in trainstack.aws, reached through trainstack.api:\n" + "\n".join(
        found
    )


def command_bodies() -> list[tuple[str, int]]:
    """(command, lines of its body past the docstring) for every command a CLI module registers."""
    bodies = []
    for path in sorted((CLI / "commands").glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        registered = {
            node.args[0].id
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Name)
        }
        registered |= {  # @app.command("x") decorated functions
            node.name
            for node in tree.body
            if isinstance(node, ast.FunctionDef)
            and any(
                isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command"
                for d in node.decorator_list
            )
        }
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in registered:
                body = node.body[1:] if ast.get_docstring(node) else node.body
                bodies.append((f"{path.stem}.{node.name}", body[-1].end_lineno - body[0].lineno + 1))
    return bodies


def test_every_command_is_a_short_shell_over_the_api():
    bodies = command_bodies()
    assert len(bodies) >= 15, bodies  # the walk finds the commands (main.COMMAND_MODULES register them)
    long = [
        f"{name}: {lines} lines"
        for name, lines in bodies
        if lines > COMMAND_BODY_LINES_AT_MOST and name not in LONG_COMMANDS_NOT_YET_MOVED
    ]
    still = {name for name, lines in bodies if lines > COMMAND_BODY_LINES_AT_MOST}
    assert LONG_COMMANDS_NOT_YET_MOVED <= still, "shortened: take it off LONG_COMMANDS_NOT_YET_MOVED"
    assert not long, (
        f"command bodies over {COMMAND_BODY_LINES_AT_MOST} lines: move the work into trainstack.api or "
        "below:\n" + "\n".join(long)
    )
