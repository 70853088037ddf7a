"""The documented walkthrough (test_doc_commands.py) runs every command as the doc writes it, and answers
only the CDK CLI's own approval question, as a reader at a terminal does. Fast: nothing here deploys;
the runner is driven over every documented block with bash and the emulator left out."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest
import test_doc_commands as walkthrough
from doc_commands import Command

pytestmark = pytest.mark.fast


class Recorded(walkthrough.Workspace):
    """The walkthrough's workspace with bash left out: every command 'succeeds' with no output."""

    def execute(self, text: str, script: str, env: dict[str, str], timeout: float) -> tuple[int, str]:
        return 0, ""


def test_the_walkthrough_adds_nothing_to_a_documented_command(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(walkthrough, "_ensure_deployed", lambda ws, commands: None)
    monkeypatch.setattr(walkthrough, "_demo_trained_a_whole_run", lambda ws: None)
    monkeypatch.setattr(walkthrough, "_wait_for_job_ends", lambda ws, run: None)
    ws = Recorded(tmp_path, tmp_path, {}, aws_env={"AWS_ENDPOINT_URL": "http://localhost:1"})
    for _, commands in walkthrough.GROUPS:
        walkthrough._run_block(ws, commands)
    runnable = [c for _, cmds in walkthrough.GROUPS for c in cmds if c.skip is None]
    assert ws.ran and not ws.failures, ws.failures
    assert walkthrough.changed_commands(ws) == []
    # every runnable command ran, or one with the same words ran before it (the runner's only omission)
    ran = {walkthrough._words(c.text) for c, _ in ws.ran}
    assert [c.where for c in runnable if walkthrough._words(c.text) not in ran] == []
    # and the documented deploys are the CDK CLI's plain command: no method, no approval flag
    deploys = [c.text for c, _ in ws.ran if "npx cdk deploy" in c.text]
    assert deploys and not [d for d in deploys if "--method" in d or "--require-approval" in d]


def test_a_changed_command_is_reported(tmp_path: Path) -> None:
    ws = Recorded(tmp_path, tmp_path, {})
    command = Command("docs/x.md", 3, "npx cdk deploy --all -c recipe=1b-bf16")
    ws.ran.append((command, 0))
    ws.executed.append(command.text + " --method=direct")
    assert walkthrough.changed_commands(ws) == [
        "docs/x.md:3: documented `npx cdk deploy --all -c recipe=1b-bf16`, "
        "ran `npx cdk deploy --all -c recipe=1b-bf16 --method=direct`"
    ]


def _asks(question: str) -> list[str]:
    script = f"[ -t 1 ] || exit 7; printf '%s (y/n) ' {shlex.quote(question)}; read answer; echo got=$answer"
    return ["bash", "-c", script]


def test_a_deploy_runs_in_a_terminal_and_its_approval_question_is_answered_yes(tmp_path: Path) -> None:
    status, output = walkthrough.in_a_terminal(
        _asks("Do you wish to deploy these changes"), tmp_path, {"PATH": "/usr/bin:/bin"}, 30
    )
    assert status == 0 and "got=y" in output, output


def test_any_other_question_ends_the_command_unanswered(tmp_path: Path) -> None:
    status, output = walkthrough.in_a_terminal(
        _asks("Delete the Data stack too"), tmp_path, {"PATH": "/usr/bin:/bin"}, 30
    )
    assert status != 0 and "got=" not in output and "a question it does not answer" in output, output


def test_a_terminal_command_that_asks_nothing_keeps_its_exit_status(tmp_path: Path) -> None:
    status, output = walkthrough.in_a_terminal(
        [sys.executable, "-c", "import sys; print('done'); sys.exit(3)"], tmp_path, {}, 30
    )
    assert status == 3 and "done" in output
