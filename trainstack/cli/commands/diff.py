"""`trainstack diff [--base REF]`: what merging the working tree would deploy, and its plan before/after."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    app.command("diff")(diff)


def diff(
    base: Annotated[str, typer.Option("--base", help="git ref to compare the working tree with")] = "main",
    as_json: Annotated[bool, typer.Option("--json", help="JSON, with the deploy job matrix")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="Markdown, as the pull request shows")] = False,
    synth: Annotated[
        bool,
        typer.Option(
            "--synth/--no-synth",
            help="When infrastructure files changed: synthesize both sides and deploy only the stack sets "
            "whose templates change (--no-synth: every target redeploys).",
        ),
    ] = True,
    summary: Annotated[
        Path | None,
        typer.Option(
            "--summary",
            metavar="FILE",
            help="Also append the Markdown to FILE (e.g. $GITHUB_STEP_SUMMARY), so one run gives both.",
        ),
    ] = None,
    repo: Annotated[Path | None, typer.Option("--repo", help="a path inside the git repository")] = None,
) -> None:
    """Plan diff against a git ref: the recipe/team stacks a merge would deploy, plans before -> after.

    Each row: peak memory, tokens/s per GPU, MFU, hours and cost, before -> after. Below the table: the
    infrastructure and recipe files that changed and the template resources they change.

    Compares recipes/ in the working tree (uncommitted changes included) with recipes/ at --base. When
    infrastructure files (app.py, stacks/, trainstack/, training_image/, the pins) changed, both sides
    are synthesized with this checkout's CDK CLI (`cdk synth -c recipe=all`, a minute or two) and only
    stack sets whose templates differ deploy; progress goes to stderr. Exit status 0 (invalid targets
    are listed, not fatal: `trainstack validate` is the gate), 2 when the ref or repository cannot be read.

    Examples:

      trainstack diff --base main

      trainstack diff --base origin/main --markdown

      trainstack diff --base HEAD~1 --json --summary "$GITHUB_STEP_SUMMARY" > diff.json
    """
    from trainstack import api
    from trainstack.errors import TrainstackError

    if as_json and markdown:
        raise TrainstackError("--json and --markdown are two formats of one output: choose one")
    found = api.diff(base, repo=repo, synth=synth, on_progress=lambda line: typer.echo(line, err=True))
    if summary is not None:
        with summary.open("a", encoding="utf-8") as out:
            out.write(found.to_markdown() + "\n")
    if as_json:
        typer.echo(found.to_json())
    elif markdown:
        typer.echo(found.to_markdown())
    else:
        _print_table(found.diff)


def _print_table(result) -> None:
    from rich.table import Table

    from trainstack.cli.commands.output import console as narrow_console
    from trainstack.gitops import report as diff_report

    console = narrow_console()  # 120 columns at most, also when piped (CI logs)
    table = Table(
        title=f"Plan diff against {result.base} ({result.base_commit[:12]}); stack sets "
        f"{diff_report.STACK_PREFIX}<team>-<recipe>",
        title_justify="left",
    )
    for column in diff_report.TERMINAL_COLUMNS:
        table.add_column(
            column, no_wrap=True, justify="left" if column in ("Stack set", "Change") else "right"
        )
    for target in result.shown:
        style = {"invalid": "red", "removed": "dim"}.get(target.status)
        table.add_row(*diff_report.terminal_row(target), style=style)
    if result.shown:
        console.print(table)
        console.print(
            "tok/s/GPU, hours and cost are the planner's central estimates; --markdown and --json give "
            "their ranges (docs/planner.md).",
            markup=False,
            highlight=False,
        )
    for note in diff_report.notes(result):
        console.print(note, markup=False, highlight=False)
    console.print(diff_report.headline(result), markup=False, highlight=False, soft_wrap=True)
