"""`trainstack tune RECIPE`: short measured jobs choose the layout, correct the plan, hand off to the run.

The engine (docs/tuning.md): this command drives the candidates' short jobs one after another (on
AWS, SageMaker training jobs on one warm pool; with --local, CPU processes of the trainer as the
emulator's jobs run it), measures each from its log (trainstack.tuning.measure), chooses by projected
cost to finish the run (trainstack.tuning.choose), and records the measurements and the result in
the tuning store (trainstack.tuning.store), where `plan`, `show` and `launch --tuned` find them.

The work is trainstack.api.tune's (the job driver: trainstack.aws.tuning_driver); this command parses its
options, calls it and prints its result.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from trainstack.cli.commands.plan_options import RecipeArg, RecipesDirOpt, SetOpt, TeamOpt

# trainstack.api.runs_api.MAX_CANDIDATES (the API is imported when the command runs, not for --help;
# tests/api/test_runs_api.py holds the two equal).
MAX_CANDIDATES = 8


def register(app: typer.Typer) -> None:
    app.command("tune")(tune)


def tune(
    recipe: RecipeArg,
    team: TeamOpt = None,
    set_: SetOpt = None,
    n_candidates: Annotated[
        int,
        typer.Option(
            "--candidates",
            "-n",
            min=1,
            max=MAX_CANDIDATES,
            help="How many layouts to measure, the recipe's own included.",
        ),
    ] = 3,
    budget_usd: Annotated[
        float | None,
        typer.Option(
            "--budget-usd",
            min=0.0,
            help="The most the tuning run may spend (planned per job, at the recipe's price); a job that "
            "would pass it is not started.",
        ),
    ] = None,
    local: Annotated[
        bool,
        typer.Option(
            "--local",
            help="Run the jobs on the local AWS emulator (AWS_ENDPOINT_URL, or the one `trainstack emulator "
            "start` started here), whose jobs train on this machine's CPU; without one, as local trainer "
            "processes (the output's first line says which).",
        ),
    ] = False,
    ranks: Annotated[
        int,
        typer.Option(
            "--ranks", min=1, max=8, help="--local without an emulator: CPU processes per job (default 1)."
        ),
    ] = 1,
    parallel: Annotated[
        bool,
        typer.Option(
            "--parallel",
            help="Run the candidates' jobs at once, each on its own instances (no shared warm pool; needs "
            "the capacity for all of them). Locally they share this machine's CPUs and slow each other.",
        ),
    ] = False,
    fresh: Annotated[
        bool,
        typer.Option("--fresh", help="Measure again even where a result for this recipe and image exists."),
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option("--json", help='Print {"candidates": [...], "chosen": {...}} as JSON.'),
    ] = False,
    mlflow_uri: Annotated[
        str | None,
        typer.Option(
            "--mlflow",
            metavar="URI",
            help="Record the tuning run in this MLflow tracker (default: the emulator's with --local, "
            "else the recipe's tracker when it has one).",
        ),
    ] = None,
    recipes_dir: RecipesDirOpt = None,
    trace: Annotated[
        bool,
        typer.Option(
            "--trace/--no-trace",
            help="Trace each candidate's step at the recipe's full size on fake tensors before any job "
            "starts (as `plan --trace`; cached) and never run one that does not fit by its trace.",
        ),
    ] = True,
) -> None:
    """Measure the planner's best layouts of RECIPE on short jobs and choose the one that finishes the run
    for the least money, beyond the measured noise.

    Candidates: the recipe's own layout and the planner's cheapest others that fit (micro-batch, activation
    checkpointing, shard group, FP8 recipe, compile); every candidate trains the same run. Each job runs
    past its warm-up into a steady window; the result is recorded per hardware and model shape, and reused
    by a second `tune` of the same recipe, team and image unless --fresh. Then `trainstack plan` shows the
    measured figures beside the arithmetic, and `trainstack launch --tuned` trains with the chosen layout.

    Exit status: 0 a layout was chosen, 1 no candidate completed, 2 invalid input or no AWS/emulator.

    Examples:

      trainstack tune 30b-fp8 --budget-usd 500

      trainstack tune tests/trainer/fixtures/tiny.yaml --local --json
    """
    from trainstack.api.runs_api import NothingFits
    from trainstack.api.runs_api import tune as tune_run

    say = (lambda line: typer.echo(line, err=True)) if as_json else typer.echo
    try:
        result = tune_run(
            recipe,
            team=team,
            overrides=set_ or (),
            local=local,
            candidates=n_candidates,
            budget_usd=budget_usd,
            ranks=ranks,
            parallel=parallel,
            fresh=fresh,
            mlflow=mlflow_uri,
            recipes_dir=recipes_dir,
            trace=trace,
            on_progress=say,
        )
    except NothingFits as nothing:  # said as progress, as before any job: no `error:` line
        say(str(nothing))
        raise typer.Exit(1) from None
    _print(result, as_json)
    if not result.reused:
        say(f"recorded in {result.store_path} as tuning run {result.run}")
    raise typer.Exit(result.exit_code)


def _print(result: Any, as_json: bool) -> None:
    if as_json:
        typer.echo(result.to_json())
        return
    choice = result.choice
    for c in choice["candidates"]:
        m = c["measured"]
        figures = (
            f"{m['tokens_per_s']:,.0f} +- {m['tokens_per_s_spread']:,.0f} tokens/s, "
            f"step {m['step_time_s']:.4f} s"
            if m
            else c.get("why", "")
        )
        typer.echo(f"{c['name']} {c['status']:>7}  {c['layout']}: {figures}")
    if choice["chosen"]:
        flags = " ".join(f"--set {o}" for o in choice["chosen"]["overrides"]) or "(the recipe's own layout)"
        typer.echo(f"chosen: {choice['chosen']['name']} {flags}")
        typer.echo(f"why: {choice['chosen']['why']}")
        typer.echo("next: trainstack launch ... --tuned (or paste the --set flags)")
    else:
        typer.echo("chosen: none (no candidate completed with an agreeing loss)")
