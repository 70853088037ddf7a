"""`trainstack runs [RECIPE] [--team T] [--json] [--local]`: every run, newest first.

Reads the run registries (one DynamoDB table per deployed recipe and team, stack `<prefix>-Data`), then
SageMaker for the live state and the hours of each job (cost so far: those hours at the planned
cluster price) and CloudWatch for the newest step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from trainstack.aws.supervisor import CAPACITY_BLOCK_END
from trainstack.cli.commands.plan_options import RecipesDirOpt, TeamOpt
from trainstack.cli.commands.status import LocalOpt

if TYPE_CHECKING:
    from trainstack.aws.registry import RunView

STATE_STYLE = {"running": "cyan", "completed": "green", "stopped": "yellow", "failed": "bold red"}


def register(app: typer.Typer) -> None:
    app.command("runs")(runs)


def runs(
    recipe: Annotated[
        str | None,
        typer.Argument(
            help="Only this recipe's runs (a base recipe or a team variant's name).", show_default=False
        ),
    ] = None,
    team: TeamOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the runs as a JSON list.")] = False,
    local: LocalOpt = False,
    recipes_dir: RecipesDirOpt = None,
    mlflow: Annotated[
        bool,
        typer.Option(
            "--mlflow",
            help="Also print each run's MLflow run URL (and write an ended run's final state into it).",
        ),
    ] = False,
) -> None:
    """List runs across recipes and teams, newest first: state, step of steps, tokens, jobs, cost so far
    and the run's checkpoint URI.

    Without RECIPE, every deployed recipe's runs (of --team only, when given), each with its history
    (launch and every deliberate change: when, who, what) and notes (a decision still pending, a job
    waiting to be created, a deployment changed since launch: the run keeps its own recipe). --json
    prints a list of {run, recipe, team, state, why, next, jobs: [{name, status, ...}], step, steps,
    tokens, cost_usd, checkpoint_uri, history, deployment_changed, notes, ...}. Exit status 0, or 2 when
    the recipe is invalid or AWS cannot be read.

    Examples:

      trainstack runs

      trainstack runs 30b-fp8 --team nlp --json
    """
    from trainstack import api

    found = api.runs(recipe, team=team, local=local, recipes_dir=recipes_dir, mlflow=mlflow)
    if as_json:
        typer.echo(found.to_json())
        return
    render(list(found.views), found.where, recipe, team)
    for run_name, (line, _) in found.mlflow.items():
        typer.echo(f"{run_name}: {line}")


def _tokens(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:,}"


# How the jobs column names an end that its status alone would misname (trainstack.aws.supervisor).
JOB_END_WORDS = {CAPACITY_BLOCK_END: " (capacity block end)"}


def render(views: list[RunView], where: str, recipe: str | None, team: str | None) -> None:
    from rich.table import Table
    from rich.text import Text

    from trainstack.cli.commands.plan_options import console as make_console

    console = make_console()
    scope = (
        f"{recipe}{f' (team {team})' if team else ''}"
        if recipe
        else (f"team {team}" if team else "all recipes")
    )
    if not views:
        console.print(
            Text.assemble(
                ("No runs ", "bold yellow"),
                f"of {scope} in {where}. Start one with `trainstack launch RECIPE`.",
            )
        )
        return
    table = Table(title=f"Runs of {scope} in {where}, newest first", title_justify="left")
    for column in ("run", "state", "step / steps", "tokens", "jobs", "cost so far"):
        table.add_column(column, overflow="fold")
    for v in views:
        r = v.run
        state = Text(r.state, style=STATE_STYLE.get(r.state, ""))
        if r.stop_requested and r.state == "running":
            state.append(" (stopping)", style="yellow")
        elif v.unsupervised:
            state.append(" (deciding)", style="yellow")
        elif v.waiting:
            state.append(" (starting next job)", style="cyan")
        if v.deployment_changed:
            state.append(" (deployment changed)", style="magenta")
        step = f"{v.step:,}" if v.step is not None else "-"
        jobs = ", ".join(f"{j.index}:{j.status}{JOB_END_WORDS.get(j.rule, '')}" for j in v.jobs)
        table.add_row(
            r.run,
            state,
            f"{step} / {r.steps:,}",
            f"{_tokens(v.tokens)} / {_tokens(r.steps * r.tokens_per_step)}",
            f"{len(v.jobs)} ({jobs})",
            f"${v.cost_usd:,.0f}",
        )
    console.print(table)
    for v in views:
        console.print(
            Text.assemble((v.run.run, "bold"), f": {v.run.state}, {v.run.why}. Next: {v.run.next_step}.")
        )
        console.print(Text(f"  checkpoints {v.run.checkpoint_uri}", style="dim"), soft_wrap=True)
        for export in v.run.exports:  # trainstack export / export.on_complete (docs/models.md)
            step = f"step {export['step']}" if export.get("step") else "newest step"
            folder = export.get("folder") or f"{export['out_parent']}step-<N>/"
            line = f"  export {export['job']} ({step}, {export['reason']}) -> {folder}"
            console.print(Text(line, style="dim"), soft_wrap=True)
        for failed in v.run.export_failures:  # an export job that failed, or one that never started
            line = (
                f"  export failed: {failed.get('job') or 'on-complete export'} {failed.get('status', '')}: "
            )
            console.print(Text(line + str(failed.get("reason", "")), style="red"), soft_wrap=True)
        for note in v.notes:
            console.print(Text(f"  note: {note}", style="yellow"), soft_wrap=True)
        for change in v.run.history:
            console.print(Text(f"  {change.at}  {change.who}: {change.what}", style="dim"), soft_wrap=True)
