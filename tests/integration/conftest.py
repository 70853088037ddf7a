"""Fixtures shared by the emulator tests of this folder."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def supervisor_cloud(tmp_path_factory):
    """One emulator with the supervisor's state machines (supervisor_cloud.py), for every module that
    drives them (each in the xdist group "supervisor-emulator", so on one worker)."""
    from supervisor_cloud import start_cloud

    yield from start_cloud(tmp_path_factory.mktemp("moto") / "moto.log")
