"""The CLI's AWS session follows the region variables a CDK user has already set."""

from __future__ import annotations

import pytest

from trainstack.aws.session import Aws
from trainstack.errors import TrainstackError

pytestmark = pytest.mark.fast

NO_PROFILE = {"AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null"}


@pytest.fixture(autouse=True)
def _no_ambient_aws(monkeypatch):
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in NO_PROFILE.items():
        monkeypatch.setenv(name, value)


def test_aws_region_alone_selects_the_region(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    assert Aws(environ={**NO_PROFILE, "AWS_REGION": "eu-west-1"}).where == "region eu-west-1"


def test_aws_default_region_still_works(monkeypatch):
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-west-2")
    assert Aws(environ={**NO_PROFILE, "AWS_DEFAULT_REGION": "us-west-2"}).where == "region us-west-2"


def test_no_region_is_one_clear_line():
    with pytest.raises(TrainstackError, match="^no AWS region configured: set AWS_REGION"):
        Aws(environ=dict(NO_PROFILE))


@pytest.mark.parametrize("endpoint", ["http://localhost", "http://localhost:abc/", "http://127.0.0.1:/"])
def test_local_endpoint_without_a_usable_port_is_one_clear_line(endpoint):
    with pytest.raises(
        TrainstackError, match=r"^AWS_ENDPOINT_URL=.* names no port: use the URL the emulator"
    ):
        Aws(local=True, environ={**NO_PROFILE, "AWS_ENDPOINT_URL": endpoint})


def test_local_refuses_a_remote_endpoint():
    with pytest.raises(TrainstackError, match="^--local needs a local emulator"):
        Aws(local=True, environ={**NO_PROFILE, "AWS_ENDPOINT_URL": "https://localhost.example.com:443"})


def test_aws_errors_say_what_to_do():
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    from trainstack.aws.session import explain

    assert explain(NoCredentialsError()) == (
        "Unable to locate credentials: configure AWS credentials (AWS_PROFILE, `aws configure` or "
        "`aws sso login`), or use --local for the emulator"
    )
    dead = EndpointConnectionError(endpoint_url="http://localhost:1/")
    assert explain(dead).endswith("is the local emulator still running? (`trainstack emulator status`)")
    remote = EndpointConnectionError(endpoint_url="https://sagemaker.us-east-1.amazonaws.com/")
    assert explain(remote).endswith("check the network, the region and any proxy settings")
    expired = ClientError({"Error": {"Code": "ExpiredToken", "Message": "expired"}}, "DescribeStacks")
    assert explain(expired).endswith(": the AWS session has expired: refresh the credentials")
    other = ClientError({"Error": {"Code": "Throttling", "Message": "slow down"}}, "DescribeStacks")
    assert explain(other) == str(other)


def test_dead_local_endpoint_is_one_line_through_the_cli(tmp_path):
    """`--local` against an endpoint nobody listens on: one line naming it, for each AWS command."""
    import subprocess
    import sys
    from pathlib import Path

    trainstack = str(Path(sys.executable).parent / "trainstack")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "AWS_ENDPOINT_URL": "http://localhost:1"}
    for command in ("status", "logs", "launch"):
        done = subprocess.run(
            [trainstack, command, "1b-bf16", "--local"], capture_output=True, text=True, timeout=120, env=env
        )
        assert done.returncode == 2, (command, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "http://localhost:1" in lines[0], (command, done.stderr)
        assert "is the local emulator still running?" in lines[0], (command, done.stderr)
