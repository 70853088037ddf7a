"""`trainstack status --watch`: says when it refreshed, stops when the run ends, and Ctrl-C ends it
cleanly (exit 0, no traceback). AWS is replaced by a stand-in snapshot; fast, no emulator."""

from __future__ import annotations

from typing import Any

import pytest
from rich.text import Text
from typer.testing import CliRunner

from trainstack.cli.commands import status
from trainstack.cli.main import app

pytestmark = pytest.mark.fast


class _Clients:
    where = "a stand-in"


@pytest.fixture
def views(monkeypatch) -> list[Any]:
    """What each refresh returns, in order: a Snapshot, or an exception to raise."""
    queue: list[Any] = []

    def view_and_snapshot(*args: Any) -> tuple[Text, status.Snapshot]:
        item = queue.pop(0)
        if isinstance(item, BaseException):
            raise item
        return Text("VIEW"), item

    monkeypatch.setattr(status, "_view_and_snapshot", view_and_snapshot)
    monkeypatch.setattr("trainstack.aws.runs.aws_clients", lambda local: _Clients())
    monkeypatch.setattr(status.time, "sleep", lambda s: None)
    return queue


def _snapshot() -> status.Snapshot:
    return status.Snapshot(reports=[], executions={}, pending=[], launcher_deployed=True)


def test_ctrl_c_while_watching_stops_cleanly(views):
    views += [_snapshot(), KeyboardInterrupt()]
    result = CliRunner().invoke(app, ["status", "1b-bf16", "--watch", "--interval", "5"])
    assert result.exit_code == 0, result.output
    assert result.exception is None
    assert "next in 5 s; Ctrl-C stops" in result.output
    assert result.output.rstrip().endswith("stopped watching")


def test_watch_stops_after_count_and_says_when_it_refreshed(views):
    views += [_snapshot(), _snapshot()]
    result = CliRunner().invoke(app, ["status", "1b-bf16", "--watch", "--count", "2", "--interval", "1"])
    assert result.exit_code == 0, result.output
    assert not views  # exactly two refreshes
    assert "refreshed " in result.output and result.output.endswith("\n")
