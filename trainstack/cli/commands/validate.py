"""`trainstack validate [PATHS...]`: every recipe and team file resolves and validates (the GitOps gate)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from trainstack.cli.commands.plan_options import RecipesDirOpt
from trainstack.errors import RecipeError, TrainstackError


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)


@dataclass(frozen=True)
class Check:
    """One resolution to try: a recipe (name or path) for a team, under a recipes directory."""

    label: str
    recipe: str
    team: str | None
    root: Path
    expect_name: str | None = None  # a base recipe's `name` must match its file name


def checks_for_tree(root: Path) -> list[Check]:
    """Every base recipe, and every team's view of every recipe it can run."""
    from trainstack.recipes.loader import base_recipe_names, team_names, team_recipe_names

    checks = [
        Check(_shown(root / f"{n}.yaml"), str(root / f"{n}.yaml"), None, root, n)
        for n in base_recipe_names(root)
    ]
    for team in team_names(root):
        checks += [Check(f"{n} --team {team}", n, team, root) for n in team_recipe_names(team, root)]
    return checks


def _shown(path: Path) -> str:
    """Relative to the working directory when under it, as the loader names files in errors (a symlink
    loop included)."""
    from trainstack.recipes.loader import display_path

    return display_path(path)


def checks_for_path(path: Path) -> list[Check]:
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


def run_check(check: Check, quiet: bool = False) -> None:
    from trainstack.aws import request_check
    from trainstack.planner import budget, plan, sanity
    from trainstack.recipes.loader import resolve

    resolved = resolve(check.recipe, team=check.team, recipes_dir=check.root)
    planned = plan(resolved.recipe)
    sanity.print_warnings(resolved, planned, quiet, label=check.label)  # legal but almost surely wrong
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


def _check_local_base(resolved) -> None:
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
    paths: Annotated[
        list[Path] | None,
        typer.Argument(
            help="Recipe files, team files or directories (default: every recipe and team file).",
            show_default=False,
        ),
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Print only errors (no ok lines, no warnings).")
    ] = False,
    recipes_dir: RecipesDirOpt = None,
) -> None:
    """Validate recipes and team overrides: schema, layering, cross-field checks, fits in memory.

    A team's defaults.yaml is checked against every recipe the team can run; a base recipe against
    every team override of it. Values that are legal but almost surely wrong (learning rate, warmup,
    batch size, volume) are printed as warnings with their threshold; they do not change the exit status.
    Exit status 0 when all are valid, 2 otherwise (one line per error).

    Examples:

      trainstack validate

      trainstack validate recipes/teams/vision
    """
    from trainstack.recipes.loader import recipes_dir_or_default

    checks: list[Check] = []
    errors: dict[str, list[str]] = {}  # one line per distinct error, with every check that hit it
    if paths:
        for path in paths:
            try:
                checks += checks_for_path(path)
            except TrainstackError as error:
                errors.setdefault(" ".join(str(error).split()), [])
    else:
        checks = checks_for_tree(recipes_dir_or_default(recipes_dir))
    seen: set[tuple[str, str | None, str]] = set()
    valid = 0
    for check in checks:
        key = (check.recipe, check.team, str(check.root))
        if key in seen:
            continue
        seen.add(key)
        try:
            run_check(check, quiet)
        except TrainstackError as error:
            errors.setdefault(" ".join(str(error).split()), []).append(check.label)
        else:
            valid += 1
            if not quiet:
                typer.echo(f"ok      {check.label}")
    for line, labels in errors.items():
        where = f" [{', '.join(labels)}]" if labels else ""
        typer.echo(f"invalid {line}{where}", err=True)
    unreadable = sum(1 for labels in errors.values() if not labels)  # paths that named no recipe
    typer.echo(f"{valid} valid, {len(seen) - valid + unreadable} invalid", err=bool(errors))
    if errors:
        raise typer.Exit(2)
