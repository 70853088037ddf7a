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
    """Plan diff against a git ref: which recipe/team stacks a merge would deploy, with memory,
    tokens/s, MFU, time and cost before and after."""
    from trainstack import gitdiff

    result = gitdiff.compute(base, repo)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    elif markdown:
        typer.echo(gitdiff.to_markdown(result))
    else:
        _print_table(result)


def _print_table(result) -> None:
    from rich.console import Console
    from rich.table import Table

    from trainstack import gitdiff

    console = Console()
    table = Table(title=f"Plan diff against {result.base} ({result.base_commit[:12]})", title_justify="left")
    for column in gitdiff.COLUMNS:
        table.add_column(column, overflow="fold")
    for target in result.shown:
        style = {"invalid": "red", "removed": "dim"}.get(target.status)
        table.add_row(*gitdiff.row(target), style=style)
    if result.shown:
        console.print(table)
    console.print(gitdiff.headline(result), markup=False, highlight=False)
