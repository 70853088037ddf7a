"""`trainstack runs [RECIPE] [--team T] [--json] [--local]`: every run, newest first.

Reads the run registries (one DynamoDB table per deployed recipe and team, stack `<prefix>-Data`), then
SageMaker for the live state and the hours of each job (cost so far: those hours at the planned
cluster price) and CloudWatch for the newest step.
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

from trainstack.aws.supervisor import CAPACITY_BLOCK_END
from trainstack.cli.commands.plan_options import RecipesDirOpt, TeamOpt
from trainstack.cli.commands.status import LocalOpt
from trainstack.errors import TrainstackError

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
    from botocore.exceptions import BotoCoreError, ClientError

    from trainstack.aws.runs import aws_clients
    from trainstack.aws.session import explain

    stack_prefix = None
    if recipe is not None:
        from trainstack.recipes.loader import resolve
        from trainstack.recipes.naming import stack_prefix as make_prefix

        stack_prefix = make_prefix(resolve(recipe, team=team, recipes_dir=recipes_dir).recipe, team)
    elif team is not None:
        from trainstack.recipes.schema import team_name_problem

        if (problem := team_name_problem(team)) is not None:
            raise TrainstackError(f"--team: {problem}")
    clients = aws_clients(local)
    try:
        views = collect(clients, stack_prefix, team if recipe is None else None)
    except (BotoCoreError, ClientError) as error:
        raise TrainstackError(f"reading runs from {clients.where} failed: {explain(error)}") from None
    tracked = _mlflow_lines(clients.aws, views, recipes_dir) if mlflow else {}
    if as_json:
        rows = [v.as_dict() for v in views]
        for row in rows if mlflow else ():
            line, found = tracked[row["run"]]
            row["mlflow"] = {"url": found.url, "run_id": found.run_id} if found is not None else line
        typer.echo(json.dumps(rows, indent=2))
        return
    render(views, clients.where, recipe, team)
    for run_name, (line, _) in tracked.items():
        typer.echo(f"{run_name}: {line}")


def _mlflow_lines(aws: Any, views: list[RunView], recipes_dir: str | None) -> dict[str, tuple[str, Any]]:
    """run -> (where its MLflow run is, the MLflow run or None) (trainstack.cli.commands.mlflow_access)."""
    from trainstack.aws.run_request import recipe_of
    from trainstack.cli.commands import mlflow_access
    from trainstack.cli.commands.run_access import deploy_hint, team_option
    from trainstack.recipes.loader import resolve

    out = {}
    for v in views:
        # The registry names the deployment's team; the default team's recipes deploy without `--team`.
        team = team_option(v.run.team, recipes_dir)
        try:
            # The run's own recorded recipe: what it trained and tracked, whatever is deployed or on disk
            # now; a recipe deployed from a file (the demo's scripts/demo-tiny.yaml) has no name that
            # `resolve` finds ("unknown recipe 'demo-tiny'", issue 40). By name only for a run recorded
            # before runs recorded their request.
            resolved = (
                recipe_of(v.run.request)
                if v.run.request
                else resolve(v.run.recipe, team=team, recipes_dir=recipes_dir).recipe
            )
            uri = mlflow_access.tracking_uri(aws, resolved, team, deploy_hint(v.run.recipe, team, aws.local))
        except TrainstackError as error:
            out[v.run.run] = (f"mlflow: {error}", None)
            continue
        out[v.run.run] = mlflow_access.describe(v, uri, resolved, team, s3=aws.client("s3"))
    return out


def collect(clients: Any, stack_prefix: str | None, team: str | None) -> list[RunView]:
    """Every run of the registries found, with SageMaker's job states and the newest step, newest first."""
    from botocore.exceptions import ClientError

    from trainstack.aws.registry import deployed_recipe_hash, registries, scan_runs, view
    from trainstack.aws.runs import job_from_description, latest_metrics

    now = datetime.now(UTC)
    dynamodb = clients.aws.client("dynamodb")
    cloudformation = clients.aws.client("cloudformation")
    found, deployed = [], {}
    for registry in registries(cloudformation, stack_prefix):
        if team is not None and not registry.stack.startswith(f"Trainstack-{team}-"):
            continue
        runs_here = scan_runs(dynamodb, registry.table)
        found.extend(runs_here)
        deployed_hash = deployed_recipe_hash(cloudformation, registry)
        deployed.update({r.run: deployed_hash for r in runs_here})
    views = []
    for run in sorted(found, key=lambda r: r.created, reverse=True):
        described = {}
        for record in run.jobs:
            try:
                described[record.name] = job_from_description(
                    clients.sagemaker.describe_training_job(TrainingJobName=record.name)
                )
            except ClientError as error:
                if error.response.get("Error", {}).get("Code") not in (
                    "ValidationException",
                    "ResourceNotFound",
                ):
                    raise  # a job not created yet (or never) is simply not described
        step = None
        for record in sorted(run.jobs, key=lambda j: j.index, reverse=True):
            if record.name in described:
                metrics = latest_metrics(clients.cloudwatch, described[record.name], now)
                if "step" in metrics:
                    step = int(metrics["step"].value)
                    break
        if run.exports:  # the folder each export wrote (or will): its step, asked or reported
            run = replace(run, exports=tuple(_with_folder(clients.sagemaker, e) for e in run.exports))
        found_view = view(run, described, step, now, deployed.get(run.run))
        stand_ins = sorted({j.stand_in for j in described.values() if j.stand_in})
        if stand_ins:  # the local emulator trained a scaled-down stand-in (trainstack.emulator.stand_in)
            found_view = replace(found_view, notes=(*found_view.notes, *(f"emulator {s}" for s in stand_ins)))
        views.append(found_view)
    return views


def _with_folder(sagemaker: Any, export: dict[str, Any]) -> dict[str, Any]:
    from botocore.exceptions import ClientError

    from trainstack.aws.runs import export_folder

    try:
        described = (
            sagemaker.describe_training_job(TrainingJobName=export["job"]) if export.get("job") else None
        )
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") not in ("ValidationException", "ResourceNotFound"):
            raise
        described = None  # not created (yet)
    return {**export, "folder": export_folder(export, described)}


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
