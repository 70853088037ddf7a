"""Where the CLI finds a recipe's MLflow tracker, and the MLflow work of `launch` and `runs --mlflow`.

The tracking URI is the recipe's ARN (`tracking.mlflow: arn:...`), the team's managed MLflow App (output
`MlflowAppArn` of stack `Trainstack-<team>-Tracking`), or, with `--local`, the MLflow server the emulator
runs beside moto (`mlflow` in .emulator/endpoint.json: the emulator's MLflow App is a placeholder). Talking
to the tracker never stops a launch: an unreachable one is one warning line, and the run's first job then
creates the MLflow run itself (trainer.metrics.tracking finds or creates it by its `trainstack.run` tag).
"""

from __future__ import annotations

import time
from typing import Any

import typer

from trainstack.errors import TrainstackError

LOCAL_WAIT_S = 60.0  # the emulator's MLflow server answers some seconds after moto


def tracking_uri(aws: Any, recipe: Any, team: str | None, hint: str, *, resource: bool = False) -> str | None:
    """The MLflow tracking URI of `recipe`'s runs, or None when it does not track in MLflow. `resource`:
    the MLflow resource ARN the jobs' request names, also in the emulator (where it is a placeholder)."""
    from trainstack.aws import tracking

    if not tracking.tracks_mlflow(recipe):
        return None
    if aws.local and not resource:
        from trainstack.emulator import endpoint, mlflow_server

        state = endpoint.read_state() or {}
        url = state.get("mlflow")
        if not url:
            raise TrainstackError(
                f"recipe {recipe.name} tracks runs in MLflow, but the local emulator has no MLflow server "
                "(restart it with `trainstack emulator stop && trainstack emulator start`)"
            )
        deadline = time.monotonic() + LOCAL_WAIT_S
        while not mlflow_server.answers(url) and time.monotonic() < deadline:
            time.sleep(0.5)
        return url
    if recipe.tracking.mlflow_arn:
        return recipe.tracking.mlflow_arn
    team_name = tracking.team_of(recipe, team)
    outputs = aws.stack_outputs(tracking.tracking_stack_name(team_name), hint)
    return outputs[tracking.MLFLOW_ARN_EXPORT]


def create_for_launch(uri: str, recipe: Any, team: str | None, run: str) -> Any:
    """Create the MLflow run of a new trainstack run; None (and one warning) when the tracker cannot."""
    from trainstack.aws import tracking

    tags = {"trainstack.team": tracking.team_of(recipe, team), "trainstack.recipe": recipe.name}
    try:
        return tracking.create_run(uri, tracking.experiment_name(recipe, team), run, tags)
    except Exception as error:  # the tracker's trouble never stops a launch
        typer.echo(
            f"warning: could not create the MLflow run in {uri} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); the run's first job creates it",
            err=True,
        )
        return None


def describe(view: Any, uri: str | None, recipe: Any, team: str | None) -> tuple[str, Any]:
    """(one line: where the run's MLflow run is, the MLflow run or None); for a run that has ended, the
    registry's final state and every ended job's SageMaker status are written into the MLflow run's tags."""
    from trainstack.aws import tracking

    run = view.run
    if uri is None:
        return "mlflow: not tracked (tracking.mlflow is off)", None
    try:
        found = tracking.find_run(uri, tracking.experiment_name(recipe, team), run.run, run.mlflow_run_id)
    except Exception as error:
        return f"mlflow: {uri} could not be read ({type(error).__name__})", None
    if found is None:
        return f"mlflow: no run tagged trainstack.run={run.run} in {uri} yet", None
    if run.state in ("completed", "stopped", "failed"):
        ended = {str(j.index): f"{j.status} ({j.secondary_status})" for j in view.jobs}
        ended = {index: status for index, status in ended.items() if not status.startswith("InProgress")}
        try:
            tracking.record_state(found, run.state, run.why, ended)
        except Exception as error:
            typer.echo(f"warning: could not tag the MLflow run: {type(error).__name__}", err=True)
    return f"mlflow: {found.url}", found
