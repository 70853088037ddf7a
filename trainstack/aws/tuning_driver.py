"""The tuning run's job driver (moved from trainstack/cli/commands/tune.py so trainstack.api.tune can
compose it): the candidates' short jobs as SageMaker training jobs, one after another on one warm pool
(trainstack.aws.tuning_jobs builds, starts and follows each), on AWS or on the local emulator, whose
jobs train this checkout's trainer on CPU; and the tuning run's record in MLflow.

What a job measured and how a candidate is chosen are trainstack.tuning's (pure); this module only
knows AWS. A candidate is anything with `.name` and `.planned.step_time_s`, steps anything with
`.max_steps` (trainstack.tuning.candidates.Candidate, trainstack.tuning.engine.StepPlan).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from trainstack.errors import TrainstackError

EMULATOR_ROLE = "arn:aws:iam::123456789012:role/trainstack-tuning"  # the emulator checks no IAM
EMULATOR_BUCKET = "trainstack-tuning"
EMULATOR_IMAGE = "trainstack-local:emulator"  # the emulator runs this checkout's trainer whatever it says

Say = Callable[[str], None]


def emulator_aws() -> Any:
    """The emulator's Aws when one is running here (its jobs train for real), else None. Running: the
    recorded emulator's server process is alive (a busy one answers late: trainstack.emulator.endpoint
    .running waits for it), or AWS_ENDPOINT_URL names one that answers."""
    from trainstack.aws.session import Aws
    from trainstack.emulator import endpoint

    if os.environ.get("AWS_ENDPOINT_URL"):
        if not endpoint.answers(os.environ["AWS_ENDPOINT_URL"], timeout_s=15.0):
            return None
    elif endpoint.running() is None:
        return None
    try:
        return Aws(local=True)
    except TrainstackError:
        return None


class SageMakerJobs:
    """The candidates' short jobs as SageMaker training jobs, one after another: on AWS those of the
    recipe's deployed stacks (the execution role, the bucket and its key, the deployed training image);
    on the emulator the same where the stacks are deployed there, else a role and a bucket of its own
    (the emulator runs this checkout's trainer whatever the image URI says)."""

    def __init__(self, recipe: Any, team: str | None, say: Say, aws: Any):
        from trainstack.aws.launching import deployed_values
        from trainstack.aws.run_access import deploy_hint, deployed
        from trainstack.recipes import naming

        self.recipe, self.team, self.say, self.aws = recipe, team, say, aws
        try:
            stacks = deployed(
                aws, naming.stack_prefix(recipe, team), deploy_hint(recipe.name, team, aws.local)
            )
            self.values = deployed_values(aws, stacks)
        except TrainstackError:
            if not aws.local:
                raise
            s3 = aws.client("s3")
            try:
                s3.head_bucket(Bucket=EMULATOR_BUCKET)
            except Exception:
                s3.create_bucket(Bucket=EMULATOR_BUCKET)
            self.values = {
                "role_arn": EMULATOR_ROLE,
                "bucket_name": EMULATOR_BUCKET,
                "kms_key_arn": None,
                "image_uri": EMULATOR_IMAGE,
            }
        # Clients made once: boto3 clients may be shared by threads (--parallel), a session's factory not.
        self.sagemaker, self.logs = aws.client("sagemaker"), aws.client("logs")

    @property
    def image_uri(self) -> str:
        return self.values["image_uri"]

    @property
    def ranks(self) -> int:
        """The ranks each job trains on: on the emulator those its jobs run for the recipe's nodes (its
        CPU processes per node: trainstack.emulator.stand_in), on AWS the recipe's world size."""
        if not self.aws.local:
            return self.recipe.world_size
        from trainstack.emulator import jobs as emulator_jobs
        from trainstack.emulator import stand_in

        nodes = self.recipe.compute.instance_count
        return stand_in.ranks_per_node(self.recipe, nodes, emulator_jobs.RANKS_PER_NODE) * nodes

    def names(self, tuning_id: str, count: int) -> list[str]:
        from trainstack.aws.tuning_jobs import job_names

        return job_names(self.recipe, self.team, tuning_id, count)

    def run(self, name: str, tuning_id: str, candidate: Any, job_recipe: Any, steps: Any) -> Any:
        """Start candidate `candidate`'s short job `name`, follow it to its end and read its log; the
        job (trainstack.aws.tuning_jobs.SageMakerJob: status, failure reason, log lines, environment,
        billable seconds)."""
        from trainstack.aws.tuning_jobs import run_training_job, tuning_job_request

        body = tuning_job_request(
            job_recipe,
            self.team,
            job_name=name,
            tuning_id=tuning_id,
            candidate=candidate.name,
            max_steps=steps.max_steps,
            planned_seconds=steps.max_steps * candidate.planned.step_time_s,
            region=self.aws.region,
            **self.values,
        )
        return run_training_job(
            self.sagemaker,
            self.logs,
            body,
            poll_s=1.0 if self.aws.local else 15.0,
            echo=self.say,
        )


def tracking_uri_for_tuning(
    uri: str | None, local: bool, jobs: SageMakerJobs | None, recipe: Any, team: str | None, say: Say
) -> str | None:
    """Where the tuning run is recorded in MLflow: `uri` (--mlflow), else the emulator's tracker
    (--local), else the recipe's own (trainstack.aws.mlflow_access); None where none is known. A tracker
    that cannot be found is one warning line: the measurements are in the tuning store already."""
    if uri is None and local:
        from trainstack.emulator import endpoint

        return (endpoint.read_state() or {}).get("mlflow")
    if uri is None and jobs is not None:
        from trainstack.aws import mlflow_access
        from trainstack.aws.run_access import deploy_hint

        try:
            return mlflow_access.tracking_uri(jobs.aws, recipe, team, deploy_hint(recipe.name, team, False))
        except TrainstackError as error:
            say(f"warning: {error}; the tuning run is not recorded in MLflow")
            return None
    return uri


def record_in_mlflow(
    uri: str, recipe: Any, team: str | None, run_id: str, summary: dict[str, str], candidates: list, say: Say
) -> None:
    """The tuning run as an MLflow parent run with a child per candidate (trainstack.aws.tracking
    .record_tuning); the tracker's trouble is one warning line, never a lost measurement."""
    import contextlib
    import sys

    from trainstack.aws import tracking

    tags = {"trainstack.recipe": recipe.name, "trainstack.team": tracking.team_of(recipe, team)}
    try:
        # MLflow prints a "View run" line per finished run on stdout, which carries --json's answer.
        with contextlib.redirect_stdout(sys.stderr):
            parent = tracking.record_tuning(
                uri, tracking.experiment_name(recipe, team), run_id, tags, summary, candidates
            )
        say(f"mlflow: {tracking.run_url(uri, parent.experiment_id, parent.run_id)}")
    except Exception as error:  # the tracker's trouble never loses the measurements (already stored)
        say(f"warning: could not record the tuning run in MLflow {uri}: {type(error).__name__}: {error}")
