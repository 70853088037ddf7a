"""`trainstack diff [--base REF]`: what merging the working tree would deploy, and its plan before/after."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("diff")(diff)


def diff(
    base: Annotated[str, typer.Option("--base", help="git ref to compare the working tree with")] = "main",
    as_json: Annotated[bool, typer.Option("--json", help="JSON, with the deploy job matrix")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Markdown, as the pull request shows")] = False,
    repo: Annotated[Path | None, typer.Option("--repo", help="a path inside the git repository")] = None,
) -> None:
    """Plan diff against a git ref: the recipe/team stacks a merge would deploy, plans before -> after.

    Each row: peak memory, tokens/s per GPU, MFU, hours and cost, before -> after.

    Compares recipes/ in the working tree (uncommitted changes included) with recipes/ at --base.
    Exit status 0 (invalid targets are listed, not fatal: `trainstack validate` is the gate), 2 when
    the ref or repository cannot be read.

    Examples:

      trainstack diff --base main

      trainstack diff --base origin/main --markdown
    """
    from trainstack import gitdiff
    from trainstack.errors import TrainstackError

    if as_json and markdown:
        raise TrainstackError("--json and --markdown are two formats of one output: choose one")
    result = gitdiff.compute(base, repo)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    elif markdown:
        typer.echo(gitdiff.to_markdown(result))
    else:
        _print_table(result)


def _print_table(result) -> None:
    from rich.table import Table

    from trainstack import gitdiff
    from trainstack.commands.plan_options import console as wide_console

    console = wide_console()  # piped (CI logs): wide enough that the columns do not fold
    table = Table(title=f"Plan diff against {result.base} ({result.base_commit[:12]})", title_justify="left")
    for column in gitdiff.COLUMNS:
        table.add_column(column, overflow="fold")
    for target in result.shown:
        style = {"invalid": "red", "removed": "dim"}.get(target.status)
        table.add_row(*gitdiff.row(target), style=style)
    if result.shown:
        console.print(table)
    console.print(gitdiff.headline(result), markup=False, highlight=False)
