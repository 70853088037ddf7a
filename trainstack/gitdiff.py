"""Plan diff between the working tree and a git ref: what a merge would deploy, and what it would cost.

Every deploy target (a base recipe on its own, and every recipe a team can run under that team) is
resolved on both sides, from `recipes/` as it is at REF (read with `git archive`) and as it is in the
working tree, then planned with `trainstack.planner.plan`. A target is deployed when its resolved recipe
changed, so a changed base recipe reaches every team that runs it and a changed team file reaches only
that team's stacks; a change that resolves to the same recipe (a value a team already overrides)
deploys nothing. A change to infrastructure code (the CDK app, stacks, trainstack) redeploys everything.

`trainstack diff` renders this as a rich table, as Markdown (the pull request's job summary) and as
JSON (the deploy workflow's job matrix). Nothing here talks to AWS.
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainstack.errors import TrainstackError
from trainstack.loader import base_recipe_names, resolve, team_names, team_recipe_names
from trainstack.naming import recipe_hash, stack_prefix
from trainstack.recipe import Tags

RECIPES = "recipes"
# Paths whose change alters every synthesized stack (relative to the repository root).
INFRA_PATHS = ("app.py", "cdk.json", "stacks/", "trainstack/", "training_image/")
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


def compute(base: str, repo: Path | str | None = None) -> PlanDiff:
    """The plan diff between the working tree of the git repository at `repo` (default: cwd) and `base`."""
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
    with recipes_at(root, commit) as before_dir:
        after_dir = root / RECIPES
        before_targets, after_targets = deploy_targets(before_dir), deploy_targets(after_dir)
        ordered = after_targets + [t for t in before_targets if t not in after_targets]
        diffs = []
        for recipe, team in ordered:
            before = _side(before_dir, recipe, team) if (recipe, team) in before_targets else None
            after = _side(after_dir, recipe, team) if (recipe, team) in after_targets else None
            diffs.append(_classify(recipe, team, before, after, changed, code))
    return PlanDiff(base=base, base_commit=commit, changed_files=changed, targets=tuple(diffs))


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
    from trainstack import budget
    from trainstack.planner import plan

    root = recipes_dir.parent
    try:
        resolved = resolve(recipe, team=team, recipes_dir=recipes_dir)
    except TrainstackError as exc:
        return Side(stack=_fallback_stack(recipe, team), error=str(exc).replace(str(root) + "/", ""))
    files = tuple(_relative(f, root) for f in resolved.files)
    stack = stack_prefix(resolved.recipe, team)
    p = plan(resolved.recipe)
    figures = Figures(
        fits=bool(p.fits),
        peak_gib=p.memory.peak_gib,
        usable_gib=p.memory.usable_gib,
        tokens_per_sec_per_gpu=p.throughput.tokens_per_sec_per_gpu,
        mfu=p.throughput.mfu,
        hours=p.cost.hours,
        total_usd=p.cost.total_usd,
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
) -> TargetDiff:
    files = set((before.files if before else ()) + (after.files if after else ()))
    reasons = tuple(f for f in changed if f in files)
    if after is None:
        status = "removed"
    elif after.error is not None:
        status = "invalid"
    elif before is None:
        status = "added"
    elif (before.hash, before.account, before.region) != (after.hash, after.account, after.region):
        # What it trains, or where it goes, changed (a target that did not validate before included).
        status = "changed"
    elif code:
        status, reasons = "code", code
    else:
        status = "unchanged"
    return TargetDiff(recipe=recipe, team=team, status=status, before=before, after=after, reasons=reasons)


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


# --- Rendering: the same rows for the terminal table and the pull request's Markdown summary ---------

COLUMNS = ("Stacks", "Change", "Fits", "Peak GiB", "Tokens/s/GPU", "MFU", "Hours", "Cost", "Approval")
ARROW = " → "


def row(t: TargetDiff) -> list[str]:
    """One row of figures, each `before → after` (one value when equal, `-` where a side is missing)."""
    b = t.before.figures if t.before else None
    a = t.after.figures if t.after else None

    def pair(get, fmt) -> str:
        left = fmt(get(b)) if b else "-"
        right = fmt(get(a)) if a else "-"
        return left if left == right else f"{left}{ARROW}{right}"

    change = t.status + (f" ({', '.join(t.reasons)})" if t.reasons else "")
    if t.status == "code":
        change = f"code ({len(t.reasons)} infrastructure file(s) changed)"
    elif t.status == "invalid" and t.after and t.after.error:
        change = f"invalid: {t.after.error}"
    approval = "required" if t.after and t.after.needs_approval else ("-" if not t.deploys else "no")
    return [
        t.stack,
        change,
        pair(lambda f: f.fits, lambda v: "yes" if v else "NO"),
        pair(lambda f: f.peak_gib, lambda v: f"{v:.1f}"),
        pair(lambda f: f.tokens_per_sec_per_gpu, lambda v: f"{v:,.0f}"),
        pair(lambda f: f.mfu, lambda v: f"{100 * v:.1f}%"),
        pair(lambda f: f.hours, lambda v: f"{v:,.1f}"),
        pair(lambda f: f.total_usd, lambda v: f"${v:,.0f}"),
        approval,
    ]


def headline(diff: PlanDiff) -> str:
    names = ", ".join(t.stack for t in diff.deploys)
    if not diff.deploys:
        return "A merge deploys no stacks."
    return f"A merge deploys {len(diff.deploys)} recipe/team stack set(s): {names}"


def to_markdown(diff: PlanDiff) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = [
        f"### trainstack plan diff against `{diff.base}` ({diff.base_commit[:12]})",
        "",
        f"**{headline(diff)}**",
        "",
    ]
    if diff.shown:
        lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        lines += ["| " + " | ".join(cell(c) for c in row(t)) + " |" for t in diff.shown]
        lines.append("")
    code = next((t.reasons for t in diff.targets if t.status == "code"), ())
    if code:
        more = f" and {len(code) - 10} more" if len(code) > 10 else ""
        lines += [
            "Infrastructure code changed, so every unchanged recipe redeploys too: "
            + ", ".join(f"`{f}`" for f in code[:10])
            + more,
            "",
        ]
    if any(t.status == "removed" for t in diff.targets):
        lines += [
            "Removed targets are not destroyed by a merge: run `npx cdk destroy` for them deliberately "
            "(checkpoint buckets are retained either way).",
            "",
        ]
    if any(t.status == "invalid" for t in diff.targets):
        lines += ["**Invalid targets block the merge:** fix them before merging (`trainstack validate`).", ""]
    return "\n".join(lines)
