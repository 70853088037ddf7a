"""Plan diff between the working tree and a git ref: what a merge would deploy, and what it would cost.

Every deploy target (a base recipe on its own, and every recipe a team can run under that team) is
resolved on both sides, from `recipes/` as it is at REF (read with `git archive`) and as it is in the
working tree, then planned with `trainstack.planner.plan`. A target is deployed when its resolved recipe
changed, so a changed base recipe reaches every team that runs it and a changed team file reaches only
that team's stacks; a change that resolves to the same recipe (a value a team already overrides)
deploys nothing. A change to infrastructure code (the CDK app, stacks, trainstack, the training image,
the pinned CDK) deploys exactly the stack sets whose synthesized templates change: both sides are
synthesized with the same CDK CLI and compared (trainstack.gitops.template_diff), so a refactor that leaves
every template identical deploys nothing. When synthesis is not possible (`--no-synth`, no CDK CLI, a
side that fails to synthesize) every target redeploys, and the diff says why.

`trainstack diff` renders this (trainstack.gitops.report) as a rich table, as Markdown (the pull request's
job summary) and as JSON (the deploy workflow's job matrix). Nothing here talks to AWS.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainstack.errors import TrainstackError
from trainstack.recipes.loader import base_recipe_names, resolve, team_names, team_recipe_names
from trainstack.recipes.naming import recipe_hash, stack_prefix
from trainstack.recipes.schema import Tags

RECIPES = "recipes"
# Paths whose change can alter any synthesized stack (relative to the repository root): the app, its
# libraries and their pins, and the training image's build context.
INFRA_PATHS = (
    "app.py",
    "cdk.json",
    "stacks/",
    "trainstack/",
    "training_image/",
    ".dockerignore",
    "pyproject.toml",
    "requirements.lock",
    "package.json",
    "package-lock.json",
)
DEPLOYING = ("added", "changed", "code")


@dataclass(frozen=True)
class Figures:
    """The plan figures a reviewer compares: memory, speed, time and money."""

    fits: bool
    peak_gib: float
    usable_gib: float
    tokens_per_sec_per_gpu: float
    mfu: float
    hours: float
    total_usd: float
    # The planner's ranges ([low, high], trainstack.planner): every speed, time and cost is an estimate.
    tokens_per_sec_per_gpu_range: tuple[float, float] = (0.0, 0.0)
    hours_range: tuple[float, float] = (0.0, 0.0)
    total_usd_range: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class Side:
    """One target resolved and planned on one side of the diff."""

    stack: str
    hash: str | None = None  # recipe_hash of the resolved recipe; None when it did not resolve
    figures: Figures | None = None
    needs_approval: bool = False
    error: str | None = None  # the one-line reason it did not resolve, plan or pass the budget guard
    files: tuple[str, ...] = ()  # recipe files it was layered from, relative to the repository root
    account: str | None = None  # recipe.deploy: where the stacks go (None: the deployer's own)
    region: str | None = None


@dataclass(frozen=True)
class TargetDiff:
    recipe: str
    team: str | None
    status: str  # added | changed | code | removed | invalid | unchanged
    before: Side | None
    after: Side | None
    reasons: tuple[str, ...] = ()  # changed files behind the status
    resources: tuple[str, ...] = ()  # template changes the code makes: "Launcher: Id (Type) modified"

    @property
    def stack(self) -> str:
        return (self.after or self.before).stack  # type: ignore[union-attr]

    @property
    def deploys(self) -> bool:
        return self.status in DEPLOYING


@dataclass(frozen=True)
class PlanDiff:
    base: str
    base_commit: str
    changed_files: tuple[str, ...]
    targets: tuple[TargetDiff, ...] = field(default=())
    infra_files: tuple[str, ...] = ()  # changed files that can alter templates (INFRA_PATHS)
    templates: str = ""  # how infrastructure changes were judged: compared, or why not

    @property
    def deploys(self) -> tuple[TargetDiff, ...]:
        return tuple(t for t in self.targets if t.deploys)

    @property
    def shown(self) -> tuple[TargetDiff, ...]:
        return tuple(t for t in self.targets if t.status != "unchanged")

    def matrix(self) -> dict:
        """GitHub Actions `strategy.matrix` for the deploy workflow: one job per deployed target."""
        return {
            "include": [
                {
                    "recipe": t.recipe,
                    "team": t.team or "",
                    "stack": t.stack,
                    "account": t.after.account or "" if t.after else "",
                    "region": t.after.region or "" if t.after else "",
                    "cost_usd": round(t.after.figures.total_usd, 2) if t.after and t.after.figures else None,
                    "environment": "training-approval" if t.after and t.after.needs_approval else "training",
                }
                for t in self.deploys
            ]
        }

    def to_dict(self) -> dict:
        return {
            "base": self.base,
            "base_commit": self.base_commit,
            "changed_files": list(self.changed_files),
            "infra_files": list(self.infra_files),
            "templates": self.templates,
            "deploy_count": len(self.deploys),
            "matrix": self.matrix(),
            "targets": [{**asdict(t), "stack": t.stack, "deploys": t.deploys} for t in self.shown],
        }


def deploy_targets(recipes_dir: Path) -> list[tuple[str, str | None]]:
    """Every (recipe, team) the CDK app can deploy from `recipes_dir`; team None is the base recipe alone."""
    out: list[tuple[str, str | None]] = [(name, None) for name in base_recipe_names(recipes_dir)]
    for team in team_names(recipes_dir):
        out += [(name, team) for name in team_recipe_names(team, recipes_dir)]
    return out


def compute(
    base: str,
    repo: Path | str | None = None,
    synth: bool = True,
    progress: Callable[[str], None] = lambda line: None,
) -> PlanDiff:
    """The plan diff between the working tree of the git repository at `repo` (default: cwd) and `base`.

    `synth`: when infrastructure files changed, synthesize both sides and deploy only the stack sets
    whose templates change (else every target redeploys). `progress` gets a line per long step."""
    from trainstack.gitops import template_diff

    root = repo_root(Path(repo) if repo is not None else Path.cwd())
    commit = _git(
        root,
        "rev-parse",
        "--verify",
        "--quiet",
        f"{base}^{{commit}}",
        error=f"--base: {base!r} is not a commit in {root}",
    ).strip()
    changed = changed_files(root, commit)
    code = tuple(f for f in changed if f.startswith(INFRA_PATHS))
    per_stack: dict[str, tuple[str, ...]] | None = None
    note = ""
    if code and synth:
        try:
            stacks, images = template_diff.compare(root, commit, progress)
        except TrainstackError as exc:
            note = f"templates not compared ({exc}): every target redeploys"
        else:
            per_stack = _by_stack_set(stacks, images, image_context_files(root, code))
            note = "templates of both sides synthesized with the same CDK CLI and compared"
    elif code:
        note = "templates not compared (--no-synth): every target redeploys"
    with recipes_at(root, commit) as before_dir:
        after_dir = root / RECIPES
        before_targets, after_targets = deploy_targets(before_dir), deploy_targets(after_dir)
        ordered = after_targets + [t for t in before_targets if t not in after_targets]
        diffs = []
        for recipe, team in ordered:
            before = _side(before_dir, recipe, team) if (recipe, team) in before_targets else None
            after = _side(after_dir, recipe, team) if (recipe, team) in after_targets else None
            diffs.append(_classify(recipe, team, before, after, changed, code, per_stack))
    return PlanDiff(
        base=base,
        base_commit=commit,
        changed_files=changed,
        targets=tuple(diffs),
        infra_files=code,
        templates=note,
    )


def image_context(root: Path) -> tuple[str, ...]:
    """What the root .dockerignore lets into the training image's build context (its `!` lines:
    files, and directories ending in `/`)."""
    ignore = root / ".dockerignore"
    lines = ignore.read_text().splitlines() if ignore.is_file() else []
    return tuple(line[1:] for line in lines if line.startswith("!"))


def image_context_files(root: Path, files: tuple[str, ...]) -> tuple[str, ...]:
    """Which of `files` the training image is built from: .dockerignore itself and its build context
    (recipes/ aside: template comparison holds them equal on both sides)."""
    context = [entry for entry in image_context(root) if not entry.startswith(f"{RECIPES}/")]

    def held(path: str) -> bool:
        return path == ".dockerignore" or any(
            path == entry or (entry.endswith("/") and path.startswith(entry)) for entry in context
        )

    return tuple(f for f in files if held(f))


def _by_stack_set(
    stacks: dict[str, tuple[str, ...]], images: dict[str, bool], image_files: tuple[str, ...]
) -> dict[str, tuple[str, ...]]:
    """Template changes grouped by stack set (`Trainstack-<team>-<recipe>`), each prefixed by its stack."""
    out: dict[str, list[str]] = {}
    for stack, found in stacks.items():
        prefix, _, suffix = stack.rpartition("-")
        lines = out.setdefault(prefix, [])
        if images.get(stack):
            files = ", ".join(image_files) or "its build context"
            lines.append(f"{suffix}: training image rebuilt ({files} changed)")
        lines += [f"{suffix}: {change}" for change in found]
    return {prefix: tuple(lines) for prefix, lines in out.items()}


def repo_root(path: Path) -> Path:
    if not path.is_dir():  # else git's missing cwd would read as "git is not installed"
        raise TrainstackError(f"--repo: {path} is not a directory")
    out = _git(path, "rev-parse", "--show-toplevel", error=f"{path} is not inside a git repository")
    return Path(out.strip())


def changed_files(root: Path, commit: str) -> tuple[str, ...]:
    """Files that differ between `commit` and the working tree, untracked ones included."""
    tracked = _git(root, "diff", "--name-only", "--no-renames", commit, "--").splitlines()
    untracked = _git(root, "ls-files", "--others", "--exclude-standard").splitlines()
    return tuple(sorted(set(tracked) | set(untracked)))


@contextmanager
def recipes_at(root: Path, commit: str) -> Iterator[Path]:
    """`recipes/` as it is at `commit`, extracted into a temporary directory (empty if it did not exist)."""
    with tempfile.TemporaryDirectory(prefix="trainstack-diff-") as tmp:
        dest = Path(tmp) / RECIPES
        dest.mkdir()
        if _git(root, "ls-tree", "--name-only", commit, RECIPES).strip():
            archive = subprocess.run(
                ["git", "archive", "--format=tar", commit, RECIPES],
                cwd=root,
                capture_output=True,
                check=True,
            ).stdout
            with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
                tar.extractall(tmp, filter="data")
        yield dest


def _side(recipes_dir: Path, recipe: str, team: str | None) -> Side:
    from trainstack.planner import budget, plan

    root = recipes_dir.parent
    try:
        resolved = resolve(recipe, team=team, recipes_dir=recipes_dir)
    except TrainstackError as exc:
        return Side(stack=_fallback_stack(recipe, team), error=str(exc).replace(str(root) + "/", ""))
    files = tuple(_relative(f, root) for f in resolved.files)
    stack = stack_prefix(resolved.recipe, team)
    try:
        p = plan(resolved.recipe)
    except TrainstackError as exc:  # a checkpoint interval the run cannot keep (run_plan.IntervalError)
        return Side(stack=stack_prefix(resolved.recipe, team), error=str(exc), files=files)
    figures = Figures(
        fits=bool(p.fits),
        peak_gib=p.memory.peak_gib,
        usable_gib=p.memory.usable_gib,
        tokens_per_sec_per_gpu=p.throughput.tokens_per_sec_per_gpu,
        mfu=p.throughput.mfu,
        hours=p.cost.hours,
        total_usd=p.cost.total_usd,
        tokens_per_sec_per_gpu_range=tuple(p.throughput.tokens_per_sec_per_gpu_range),
        hours_range=tuple(p.cost.hours_range),
        total_usd_range=tuple(p.cost.total_usd_range),
    )
    error = None
    try:
        guard = budget.enforce(resolved, p)
    except TrainstackError as exc:
        error, guard = str(exc).replace(str(root) + "/", ""), budget.check(resolved.recipe, p)
    if error is None and not p.fits:
        error = f"does not fit: peak {p.memory.peak_gib:.1f} GiB > usable {p.memory.usable_gib:.1f} GiB"
    deploy = resolved.recipe.deploy
    return Side(
        stack=stack,
        hash=recipe_hash(resolved.recipe),
        figures=figures,
        needs_approval=guard.needs_approval,
        error=error,
        files=files,
        account=deploy.account,
        region=deploy.region,
    )


def _classify(
    recipe: str,
    team: str | None,
    before: Side | None,
    after: Side | None,
    changed: tuple[str, ...],
    code: tuple[str, ...],
    per_stack: dict[str, tuple[str, ...]] | None = None,
) -> TargetDiff:
    """`per_stack`: template changes by stack set when both sides were synthesized; None: not compared
    (then any infrastructure change redeploys every target)."""
    files = set((before.files if before else ()) + (after.files if after else ()))
    reasons = tuple(f for f in changed if f in files)
    stack = (after or before).stack  # type: ignore[union-attr]
    resources = (per_stack or {}).get(stack, ())
    code_deploys = bool(code) and (per_stack is None or bool(resources))
    if after is None:
        status = "removed"
    elif after.error is not None:
        status = "invalid"
    elif before is None:
        status = "added"
    elif (before.hash, before.account, before.region) != (after.hash, after.account, after.region):
        # What it trains, or where it goes, changed (a target that did not validate before included).
        status = "changed"
    elif code_deploys:
        status, reasons = "code", code
    else:
        status = "unchanged"
    return TargetDiff(
        recipe=recipe,
        team=team,
        status=status,
        before=before,
        after=after,
        reasons=reasons,
        resources=resources if after is not None else (),
    )


def _fallback_stack(recipe: str, team: str | None) -> str:
    """The stack name of a target that did not resolve (naming.stack_prefix needs a Recipe)."""
    return f"Trainstack-{team or Tags().team}-{recipe}"


def _relative(display: str, root: Path) -> str:
    """A loader source path (relative to cwd or absolute) relative to the repository root."""
    try:
        return str(Path(display).resolve().relative_to(root.resolve()))
    except ValueError:
        return display


def _git(cwd: Path, *args: str, error: str | None = None) -> str:
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    except FileNotFoundError:
        raise TrainstackError("git is not installed; trainstack diff needs it") from None
    if done.returncode != 0:
        detail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise TrainstackError(error or f"git {' '.join(args)}: {detail}")
    return done.stdout
