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


def sagemaker_headers_for_arns_only() -> None:
    """Consult sagemaker-mlflow's request-header provider only when it has headers to give.

    The plugin (installed for MLflow App ARNs) says it is in context for every request, then parses the
    process's tracking URI as an ARN; for any other URI (the emulator's http://, a file store) that
    raises, and MLflow logs "Encountered unexpected error during resolving request headers" on every
    call (aws/sagemaker-mlflow#15, from 0.2.0 on). Its provider, registered by MLflow from the plugin's
    entry point, is replaced by one that is in context exactly when that URI is an ARN; MLflow's other
    providers and any other error are untouched. Idempotent; a no-op without mlflow or the plugin.
    """
    try:
        from mlflow import get_tracking_uri
        from mlflow.tracking.request_header.registry import _request_header_provider_registry as registry
    except ImportError:
        return
    providers = getattr(registry, "_registry", None)
    if not isinstance(providers, list):
        return
    for index, provider in enumerate(providers):
        if type(provider).__module__.startswith("sagemaker_mlflow."):
            providers[index] = _ArnsOnly(provider, get_tracking_uri)


class _ArnsOnly:
    """A request-header provider consulted only while the process's tracking URI is an ARN."""

    def __init__(self, inner: object, tracking_uri: object) -> None:
        self.inner, self.tracking_uri = inner, tracking_uri

    def in_context(self) -> bool:
        return str(self.tracking_uri()).startswith("arn:") and bool(self.inner.in_context())

    def request_headers(self) -> dict:
        return self.inner.request_headers()
