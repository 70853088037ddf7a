"""Where a recipe's MLflow tracker is, and the MLflow run a launch opens (moved here from
trainstack/cli/commands/mlflow_access.py so the API reaches it; that module re-exports them), and what
`runs --mlflow` says of a run's MLflow run (`describe`).

The tracking URI is the recipe's ARN (`tracking.mlflow: arn:...`), the team's managed MLflow App (output
`MlflowAppArn` of stack `Trainstack-<team>-Tracking`), or, on the emulator, the MLflow server it runs
beside moto (`mlflow` in .emulator/endpoint.json: the emulator's MLflow App is a placeholder). Talking
to the tracker never stops a launch: an unreachable one is one warning line, and the run's first job then
creates the MLflow run itself (trainer.metrics.tracking finds or creates it by its `trainstack.run` tag).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from trainstack.errors import TrainstackError

LOCAL_WAIT_S = 60.0  # the emulator's MLflow server answers some seconds after moto


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def tracking_uri(aws: Any, recipe: Any, team: str | None, hint: str, *, resource: bool = False) -> str | None:
    """The MLflow tracking URI of `recipe`'s runs, or None when it does not track in MLflow. `resource`:
    the MLflow resource ARN the jobs' request names, also in the emulator (where it is a placeholder)."""
    from trainstack.aws import tracking

    if not tracking.tracks_mlflow(recipe):
        return None
    if aws.local and not resource:
        from trainstack.emulator import endpoint, mlflow_server

        state = endpoint.read_state(endpoint.state_file()) or {}
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


def create_for_launch(
    uri: str, recipe: Any, team: str | None, run: str, warn: Callable[[str], None] = _stderr
) -> Any:
    """Create the MLflow run of a new trainstack run; None (and one warning) when the tracker cannot."""
    from trainstack.aws import tracking

    tags = {"trainstack.team": tracking.team_of(recipe, team), "trainstack.recipe": recipe.name}
    try:
        return tracking.create_run(uri, tracking.experiment_name(recipe, team), run, tags)
    except Exception as error:  # the tracker's trouble never stops a launch
        warn(
            f"warning: could not create the MLflow run in {uri} ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); the run's first job creates it"
        )
        return None


def describe(
    view: Any,
    uri: str | None,
    recipe: Any,
    team: str | None,
    s3: Any = None,
    warn: Callable[[str], None] = _stderr,
) -> tuple[str, Any]:
    """(one line: where the run's MLflow run is, the MLflow run or None); the records the run's jobs could
    not deliver (kept beside its checkpoints) are delivered; for a run that has ended, the registry's final
    state and every ended job's SageMaker status are written into the MLflow run's tags."""
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
    kept_line = ""
    where = getattr(run, "checkpoint_uri", None) or ""
    if where and (s3 is not None or not where.startswith("s3://")):
        try:
            delivered = tracking.deliver_kept(found, where, s3)
            kept_line = f" ({delivered} kept records delivered)" if delivered else ""
        except Exception as error:
            warn(f"warning: kept tracking records not delivered: {type(error).__name__}")
    if run.state in ("completed", "stopped", "failed"):
        ended = {str(j.index): f"{j.status} ({j.secondary_status})" for j in view.jobs}
        ended = {index: status for index, status in ended.items() if not status.startswith("InProgress")}
        try:
            tracking.record_state(found, run.state, run.why, ended)
        except Exception as error:
            warn(f"warning: could not tag the MLflow run: {type(error).__name__}")
    return f"mlflow: {found.url}{kept_line}", found
