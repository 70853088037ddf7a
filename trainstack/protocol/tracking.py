"""How a training job and the CLI find the one MLflow run of a trainstack run: by its tag, in the
experiment named after the team and recipe unless the recipe names one. `trainstack launch` creates the
run (trainstack.aws.tracking); each job's trainer finds it, or creates it when launch could not
(trainer.metrics.tracking)."""

from __future__ import annotations

RUN_TAG = "trainstack.run"


def run_filter(run: str) -> str:
    """MLflow's search_runs filter for the MLflow run of trainstack run `run`."""
    return f"tags.`{RUN_TAG}` = '{run}'"


def default_experiment(team: str, recipe_name: str) -> str:
    return f"{team}/{recipe_name}"
