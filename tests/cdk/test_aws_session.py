"""The CLI's AWS session follows the region variables a CDK user has already set."""

from __future__ import annotations

import pytest

from trainstack.aws import Aws
from trainstack.errors import TrainstackError

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
