"""The training image's build context as CDK stages it into cdk.out, which is what Docker builds from.

Three things no synth of the launcher shows without a Docker engine: the staged copy holds the Dockerfile
and everything it copies (CDK's own re-include covers only a root-level `Dockerfile`, so before
`!training_image/Dockerfile` was listed every image build would have failed); of trainstack/ it holds
exactly the modules the trainer imports; and a change elsewhere in trainstack/ (the CLI) leaves the
image's hash, and so every launcher template, unchanged, while a change to one of those modules does
not."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk import aws_ecr as ecr

from stacks import image
from trainstack.aws.deployment import ImageSource

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[2]
TRAINER = REPO / "training_image" / "trainer"


def _copy_context(root: Path) -> None:
    for part in ("trainstack", "recipes", "training_image"):
        shutil.copytree(REPO / part, root / part, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(REPO / ".dockerignore", root / ".dockerignore")


def _stage(root: Path, monkeypatch: pytest.MonkeyPatch, synth: bool = False) -> tuple[str, Path]:
    """(asset hash, staged directory) of the TrainingImage built from the context at `root`."""
    monkeypatch.setattr(image, "REPO_ROOT", root)
    cdk.AssetStaging.clear_asset_hash_cache()  # CDK caches fingerprints per source path
    app = cdk.App(outdir=str(root / "cdk.out"))
    stack = cdk.Stack(app, "Image")
    built = image.TrainingImage(
        stack, "Image", source=ImageSource(base_image_uri="base"), repository=ecr.Repository(stack, "Repo")
    )
    asset_hash = built.node.find_child("Build").asset_hash
    if synth:
        app.synth()
    return asset_hash, root / "cdk.out" / f"asset.{asset_hash}"


def _imports(path: Path) -> set[str]:
    """Every absolute import in a file, `from a import b` as both `a` and `a.b`; function-level too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _source(module: str) -> Path | None:
    top, *rest = module.split(".")
    base = {"trainer": REPO / "training_image" / "trainer", "trainstack": REPO / "trainstack"}.get(top)
    if base is None:
        return None
    path = base.joinpath(*rest)
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def trainstack_files_the_trainer_imports() -> set[str]:
    """trainstack/ files reachable from any trainer module by imports (packages: every file in them)."""
    todo = [
        ".".join(("trainer", *p.relative_to(TRAINER).with_suffix("").parts)) for p in TRAINER.rglob("*.py")
    ]
    seen: set[str] = set()
    while todo:
        module = todo.pop()
        source = _source(module)
        if module in seen or source is None:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))] + sorted(_imports(source))
    files: set[str] = set()
    for module in sorted(m for m in seen if m.startswith("trainstack.")):
        source = _source(module)
        if source.name == "__init__.py":  # a subpackage travels whole (one `!trainstack/planner/` line)
            files |= {str(p.relative_to(REPO)) for p in source.parent.glob("*.py")}
        else:
            files.add(str(source.relative_to(REPO)))
    files.add("trainstack/__init__.py")
    return files


def test_the_staged_context_holds_the_dockerfile_and_everything_it_copies(tmp_path, monkeypatch):
    _copy_context(tmp_path)
    _, staged = _stage(tmp_path, monkeypatch, synth=True)
    assert (staged / image.DOCKERFILE).is_file(), "the Dockerfile is not in the staged build context"
    for source in re.findall(r"^COPY (\S+) ", (REPO / image.DOCKERFILE).read_text(), re.M):
        assert (staged / source).exists(), f"COPY {source}: not in the staged build context"


def test_of_trainstack_the_context_holds_exactly_what_the_trainer_imports(tmp_path, monkeypatch):
    _copy_context(tmp_path)
    _, staged = _stage(tmp_path, monkeypatch, synth=True)
    held = {str(p.relative_to(staged)) for p in (staged / "trainstack").rglob("*.py")}
    needed = trainstack_files_the_trainer_imports()
    assert not needed - held, f"add to .dockerignore: {sorted('!' + f for f in needed - held)}"
    assert not held - needed, (
        f"not imported by the trainer, remove from .dockerignore: {sorted(held - needed)}"
    )


def test_a_cli_change_keeps_the_image_and_a_change_to_what_the_trainer_imports_rebuilds_it(
    tmp_path, monkeypatch
):
    _copy_context(tmp_path)
    before, _ = _stage(tmp_path, monkeypatch)
    (tmp_path / "trainstack" / "cli.py").write_text("# a CLI refactor\n")
    assert _stage(tmp_path, monkeypatch)[0] == before
    for path in (
        "trainstack/recipes/schema.py",
        "trainstack/planner/core.py",
        "training_image/trainer/train.py",
    ):
        changed = tmp_path / path
        changed.write_text(changed.read_text() + "\n# changed\n")
        after, _ = _stage(tmp_path, monkeypatch)
        assert after != before, path
        before = after
