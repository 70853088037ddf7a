"""`validate`: every recipe and team file resolves, validates, fits and passes the checks AWS and the
team's budget would apply (the GitOps gate). Nothing here prints: warnings and the `ok` line of each
check go to the callbacks, as `trainstack validate` prints them while it works."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainstack.api.results import OnProgress, Result, report
from trainstack.errors import RecipeError, TrainstackError

if TYPE_CHECKING:
    from trainstack.recipes.loader import ResolvedRecipe


@dataclass(frozen=True)
class Check:
    """One resolution to try: a recipe (name or path) for a team, under a recipes directory."""

    label: str
    recipe: str
    team: str | None
    root: Path
    expect_name: str | None = None  # a base recipe's `name` must match its file name


@dataclass(frozen=True)
class Invalid:
    """One distinct error line and every check that hit it (none: a path that named no recipe)."""

    line: str
    labels: tuple[str, ...]


@dataclass(frozen=True)
class ValidateResult(Result):
    """What `validate` found: the labels that passed, each distinct error with the checks that hit it."""

    valid: tuple[str, ...]
    invalid: tuple[Invalid, ...]
    checked: int  # distinct checks run

    @property
    def ok(self) -> bool:
        return not self.invalid

    @property
    def invalid_count(self) -> int:
        """Failed checks, plus the paths that named no recipe (what the summary line counts)."""
        return self.checked - len(self.valid) + sum(1 for found in self.invalid if not found.labels)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 2

    def to_document(self) -> dict:
        return {
            "valid": list(self.valid),
            "invalid": [{"error": found.line, "checks": list(found.labels)} for found in self.invalid],
        }


def checks_for_tree(root: Path) -> list[Check]:
    """Every base recipe, and every team's view of every recipe it can run."""
    from trainstack.recipes.loader import base_recipe_names, display_path, team_names, team_recipe_names

    # Labels relative to the working directory when under it, as the loader names files in errors.
    checks = [
        Check(display_path(root / f"{n}.yaml"), str(root / f"{n}.yaml"), None, root, n)
        for n in base_recipe_names(root)
    ]
    for team in team_names(root):
        checks += [Check(f"{n} --team {team}", n, team, root) for n in team_recipe_names(team, root)]
    return checks


def checks_for_path(path: Path) -> list[Check]:
    """The checks a recipe file, team file or directory asks for: a team's defaults.yaml against every
    recipe the team can run, a base recipe against every team's override of it."""
    from trainstack.recipes.loader import TEAM_DEFAULTS, team_names, team_recipe_names

    if path.is_dir():
        found = sorted({*path.rglob("*.yaml"), *path.rglob("*.yml")})
        if not found:
            raise RecipeError(str(path), None, "no recipe files (*.yaml) in this directory")
        return [c for f in found for c in checks_for_path(f)]
    if not path.exists():
        raise RecipeError(str(path), None, "no such file or directory")
    if path.suffix not in (".yaml", ".yml"):
        raise RecipeError(str(path), None, "not a recipe file (expected *.yaml)")
    if path.parent.parent.name == "teams":  # recipes/teams/<team>/<file>.yaml
        team, root = path.parent.name, path.parent.parent.parent
        if path.name == TEAM_DEFAULTS:
            return [Check(f"{n} --team {team}", n, team, root) for n in team_recipe_names(team, root)]
        return [Check(f"{path.stem} --team {team}", path.stem, team, root)]
    root = path.parent
    checks = [Check(str(path), str(path), None, root, path.stem)]
    # A base recipe change must not break any team's override of it.
    if path.is_file():
        checks += [
            Check(f"{path.stem} --team {t}", path.stem, t, root)
            for t in team_names(root)
            if path.stem in team_recipe_names(t, root)
        ]
    return checks


def run_check(check: Check, on_warning: OnProgress = None) -> None:
    """One check, raising its one-line error: resolves, fits, within the team's caps, a request AWS
    would take, a local base model of the recipe's shape, a base recipe named as its file."""
    from trainstack.aws import request_check
    from trainstack.planner import budget, plan, sanity
    from trainstack.recipes.loader import resolve

    resolved = resolve(check.recipe, team=check.team, recipes_dir=check.root)
    planned = plan(resolved.recipe)
    for line in sanity.lines(resolved, planned, check.label):  # legal but almost surely wrong
        report(on_warning, line)
    if not planned.fits:  # the gate refuses what would run out of memory, before anyone pays for it
        raise TrainstackError(f"{resolved.files[-1]}: {planned.verdict}")
    budget.enforce(resolved, planned)  # a team's caps on nodes and planned cost
    request_check.enforce(resolved)  # every request AWS would refuse (trainstack.aws.request_check)
    _check_local_base(resolved)
    if check.expect_name is not None and resolved.recipe.name != check.expect_name:
        raise RecipeError(
            check.recipe,
            "name",
            f"{resolved.recipe.name!r} does not match the file name {check.expect_name!r}",
        )


def _check_local_base(resolved: ResolvedRecipe) -> None:
    """A local `model.init_from` must be a folder whose config.json matches the shape (the trainer would
    refuse it at step 0, every job of the run); an s3:// one is read by `plan` and `launch`, which have AWS
    access (this gate needs none)."""
    init_from = resolved.recipe.model.init_from
    if not init_from or init_from.startswith("s3://"):
        return
    from trainstack.aws.base_model import check_init_from

    source = resolved.source_of("model.init_from")
    if not Path(init_from).is_dir():
        raise RecipeError(
            source,
            "model.init_from",
            f"{init_from}: no such directory (a local base is a Hugging Face folder, relative to where the "
            "trainer runs; or an s3:// prefix)",
        )
    try:
        check_init_from(resolved.recipe, None)
    except TrainstackError as error:
        raise TrainstackError(f"{source}: {error}") from None


def validate(
    paths: Sequence[str | Path] = (),
    *,
    recipes_dir: str | Path | None = None,
    on_progress: OnProgress = None,
    on_warning: OnProgress = None,
) -> ValidateResult:
    """Validate recipes and team overrides (`trainstack validate [PATHS...]`): schema, layering,
    cross-field checks, fits in memory, the team's caps, what AWS would refuse. `paths`: recipe files,
    team files or directories (none: every recipe and team file under `recipes_dir`). Invalid recipes
    are in the result, not raised; `on_progress` gets `ok      <label>` for each check that passes,
    `on_warning` each warning line (labelled with its check)."""
    from trainstack.recipes.loader import recipes_dir_or_default

    checks: list[Check] = []
    errors: dict[str, list[str]] = {}  # one line per distinct error, with every check that hit it
    if paths:
        for path in paths:
            try:
                checks += checks_for_path(Path(path))
            except TrainstackError as error:
                errors.setdefault(" ".join(str(error).split()), [])
    else:
        checks = checks_for_tree(recipes_dir_or_default(recipes_dir))
    seen: set[tuple[str, str | None, str]] = set()
    valid: list[str] = []
    for check in checks:
        key = (check.recipe, check.team, str(check.root))
        if key in seen:
            continue
        seen.add(key)
        try:
            run_check(check, on_warning)
        except TrainstackError as error:
            errors.setdefault(" ".join(str(error).split()), []).append(check.label)
        else:
            valid.append(check.label)
            report(on_progress, f"ok      {check.label}")
    invalid = tuple(Invalid(line, tuple(labels)) for line, labels in errors.items())
    return ValidateResult(tuple(valid), invalid, len(seen))
