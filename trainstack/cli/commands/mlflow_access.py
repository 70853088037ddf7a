"""Moved to trainstack.aws.mlflow_access (the API needs it, and may not import the CLI); these names stay
here for the commands that still import them from this module."""

from trainstack.aws.mlflow_access import LOCAL_WAIT_S, create_for_launch, describe, tracking_uri

__all__ = ["LOCAL_WAIT_S", "create_for_launch", "describe", "tracking_uri"]
