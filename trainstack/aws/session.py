"""boto3 access for the CLI: real AWS through the usual credential chain, or the local emulator.

`local=True` talks only to the emulator: AWS_ENDPOINT_URL (as `make demo` sets it) or the one
`trainstack emulator start` (or `make demo`) recorded in .emulator/endpoint.json, always with dummy
credentials, so a real profile is never sent to it. Without it boto3 follows the usual chain, which
honours AWS_ENDPOINT_URL too: the "where" line (`Aws.where`) names the endpoint actually used.
Errors a user can fix become one-line TrainstackErrors.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

from trainstack.errors import TrainstackError


def environment(local: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if environ is None else environ)
    if not local:
        return env
    from trainstack.emulator import endpoint as emulator

    endpoint = env.get("AWS_ENDPOINT_URL", "")
    if endpoint:
        from urllib.parse import urlsplit

        url = urlsplit(endpoint)
        if url.scheme != "http" or url.hostname not in ("localhost", "127.0.0.1"):
            raise TrainstackError(f"--local needs a local emulator, but AWS_ENDPOINT_URL is {endpoint}")
        try:
            port = url.port
        except ValueError:
            port = None
        if port is None:
            raise TrainstackError(
                f"AWS_ENDPOINT_URL={endpoint} names no port: use the URL the emulator printed, "
                "e.g. http://localhost:5000"
            )
        return {**env, **emulator.Emulator(port=port).env()}
    return {**env, **emulator.local_env()}


# botocore error class name -> what the user can do about it
_HINTS = {
    "NoCredentialsError": "configure AWS credentials (AWS_PROFILE, `aws configure` or `aws sso login`), "
    "or use --local for the emulator",
    "PartialCredentialsError": "the AWS credentials are incomplete: check AWS_ACCESS_KEY_ID, "
    "AWS_SECRET_ACCESS_KEY and the profile",
    "NoRegionError": "set AWS_REGION (or AWS_DEFAULT_REGION, or a profile region), or use --local",
    "ProfileNotFound": "AWS_PROFILE names a profile that is not in ~/.aws/config: fix or unset it",
    "SSOTokenLoadError": "the SSO session has expired: run `aws sso login`",
    "TokenRetrievalError": "the SSO session has expired: run `aws sso login`",
}
_CLIENT_HINTS = {
    "ExpiredToken": "the AWS session has expired: refresh the credentials",
    "ExpiredTokenException": "the AWS session has expired: refresh the credentials",
    "InvalidClientTokenId": "the AWS access key is not valid in this account/region",
    "UnrecognizedClientException": "the AWS access key is not valid in this account/region",
    "AccessDenied": "the caller lacks this permission: check the role or profile in use",
    "AccessDeniedException": "the caller lacks this permission: check the role or profile in use",
}


def explain(error: BaseException) -> str:
    """One line for a botocore error: what went wrong and, where we know it, what to do."""
    text = " ".join(str(error).split()) or type(error).__name__
    name = type(error).__name__
    hint = _HINTS.get(name)
    if hint is None and name == "ClientError":
        hint = _CLIENT_HINTS.get(getattr(error, "response", {}).get("Error", {}).get("Code", ""))
    if hint is None and name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError"):
        endpoint = str(getattr(error, "kwargs", {}).get("endpoint_url", ""))
        hint = (
            "is the local emulator still running? (`trainstack emulator status`)"
            if endpoint.startswith(("http://localhost", "http://127.0.0.1"))
            else "check the network, the region and any proxy settings"
        )
    return f"{text}: {hint}" if hint else text


class Aws:
    """boto3 clients for one target (an account/region, or the emulator)."""

    def __init__(self, local: bool = False, environ: Mapping[str, str] | None = None) -> None:
        import boto3
        from botocore.config import Config

        self.local = local
        env = environment(local, environ)
        self._endpoint = env.get("AWS_ENDPOINT_URL") if local else None
        self._config = Config(
            retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=5, read_timeout=60
        )
        if local:
            self._session = boto3.session.Session(
                aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                aws_session_token=env.get("AWS_SESSION_TOKEN"),
                region_name=env["AWS_REGION"],
            )
        else:
            # boto3 reads only AWS_DEFAULT_REGION and profiles; the CDK CLI and other SDKs also honour
            # AWS_REGION, so a user who set it for `cdk deploy` expects the CLI to follow it too.
            self._session = boto3.session.Session(region_name=env.get("AWS_REGION") or None)
        if not self._session.region_name:
            raise TrainstackError(
                "no AWS region configured: set AWS_REGION (or AWS_DEFAULT_REGION, or a profile region), "
                "or use --local"
            )

    @property
    def region(self) -> str:
        return self._session.region_name

    @functools.cached_property
    def where(self) -> str:
        """Where requests go, for messages: the endpoint boto3 actually uses (AWS_ENDPOINT_URL and
        config-file endpoints included), or the region when it is AWS's own."""
        endpoint = self._endpoint or self.client("sagemaker").meta.endpoint_url
        return where_line(endpoint, self._session.region_name)

    def client(self, service: str) -> Any:
        return self._session.client(service, endpoint_url=self._endpoint, config=self._config)

    def stack_outputs(self, stack_name: str, deploy_hint: str) -> dict[str, str]:
        """A deployed stack's outputs, or one line saying it is not deployed and how to deploy it."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            stacks = self.client("cloudformation").describe_stacks(StackName=stack_name)["Stacks"]
        except ClientError as exc:
            if "does not exist" in str(exc):
                raise TrainstackError(
                    f"stack {stack_name} is not deployed in {self.where}: run {deploy_hint}"
                ) from None
            raise TrainstackError(f"cannot read stack {stack_name} in {self.where}: {explain(exc)}") from None
        except BotoCoreError as exc:
            raise TrainstackError(f"cannot read stack {stack_name} in {self.where}: {explain(exc)}") from None
        return {o["OutputKey"]: o["OutputValue"] for o in stacks[0].get("Outputs", [])}


def where_line(endpoint: str | None, region: str | None) -> str:
    """`region us-west-2` for AWS's own endpoints, else the endpoint (the local emulator by name)."""
    from urllib.parse import urlsplit

    host = urlsplit(endpoint or "").hostname or ""
    if not endpoint or host.endswith((".amazonaws.com", ".amazonaws.com.cn", ".api.aws")):
        return f"region {region}"
    if host in ("localhost", "127.0.0.1"):
        return f"the local emulator ({endpoint})"
    return f"{endpoint} (region {region})"


def training_job_request_sent(stepfunctions: Any, execution_arn: str) -> dict[str, Any] | None:
    """The CreateTrainingJob request an execution sent, as its history records it (None if not yet)."""
    import json

    pages = stepfunctions.get_paginator("get_execution_history").paginate(executionArn=execution_arn)
    for page in pages:
        for event in page["events"]:
            details = event.get("taskScheduledEventDetails", {})
            if details.get("resource") == "createTrainingJob":
                return json.loads(details["parameters"])
    return None
