"""The documented `npx cdk deploy --all -c recipe=R` (the CDK CLI's default: change sets) into the emulator,
and a deploy that fails half-way leaves nothing that blocks the retry (trainstack.emulator.cloudformation;
issue 41: it failed with "XML parse error" and left the Data stack in REVIEW_IN_PROGRESS, which every
retry ran into).

One emulator, the real CDK CLI, in order: a deploy interrupted after its change set was made (the stack
left in REVIEW_IN_PROGRESS), a deploy that fails (the Launcher alone: the Data stack's exports it imports
are not there), then the plain retry, then an update through a change set."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from trainstack.emulator.endpoint import ACCOUNT, REGION, Emulator, clients

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("emulator-change-sets")]
ROOT = Path(__file__).resolve().parents[2]
RECIPE = "1b-bf16"
DATA, LAUNCHER = f"Trainstack-platform-{RECIPE}-Data", f"Trainstack-platform-{RECIPE}-Launcher"


def test_the_documented_deploy_works_and_a_failed_one_does_not_block_the_retry(tmp_path: Path) -> None:
    with Emulator(log_path=tmp_path / "moto.log").start(timeout_s=300) as emulator:
        env = {
            **os.environ,
            **emulator.env(),
            "CDK_DISABLE_CLI_TELEMETRY": "true",
            "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
            "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
        }
        (cfn,) = clients(emulator.env(), "cloudformation")
        assembly = tmp_path / "cdk.out"

        def cdk(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [shutil.which("npx") or "npx", "cdk", *args],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )

        def stacks() -> dict[str, dict]:
            found = cfn.describe_stacks()["Stacks"]
            assert len({s["StackName"] for s in found}) == len(found), "two stacks of one name"
            return {s["StackName"]: s for s in found}

        done = cdk("bootstrap", f"aws://{ACCOUNT}/{REGION}", "-o", str(tmp_path / "bootstrap.out"))
        assert done.returncode == 0, done.stderr[-3000:]
        done = cdk("synth", "-c", f"recipe={RECIPE}", "-q", "-o", str(assembly))
        assert done.returncode == 0, done.stderr[-3000:]

        # 1. A deploy killed after it made the Data stack's change set: the stack waits in review.
        template = (assembly / f"{DATA}.template.json").read_text()
        cfn.create_change_set(
            StackName=DATA,
            ChangeSetName="cdk-deploy-change-set",
            ChangeSetType="CREATE",
            TemplateBody=template,
        )
        assert stacks()[DATA]["StackStatus"] == "REVIEW_IN_PROGRESS"

        # 2. A deploy that fails half-way: the Launcher alone imports exports no stack has made yet.
        failed = cdk("deploy", "-a", str(assembly), "-e", LAUNCHER, "--require-approval=never")
        output = failed.stdout + failed.stderr
        assert failed.returncode != 0
        assert "XML parse error" not in output and "No export named" in output, output[-3000:]
        launcher = stacks()[LAUNCHER]
        assert launcher["StackStatus"] == "ROLLBACK_COMPLETE"
        assert "No export named" in launcher["StackStatusReason"]
        assert not launcher.get("Outputs")

        # 3. The same documented command again: no hand in between.
        retry = cdk("deploy", "-a", str(assembly), "--all", "--require-approval=never")
        assert retry.returncode == 0, (retry.stdout + retry.stderr)[-3000:]
        now = stacks()
        assert {now[DATA]["StackStatus"], now[LAUNCHER]["StackStatus"]} == {"CREATE_COMPLETE"}
        assert now[DATA]["EnableTerminationProtection"] is True  # what the CLI set through the new call
        assert now[LAUNCHER]["StackId"] != launcher["StackId"]  # the rolled-back one deleted, made anew
        exports = {e["Name"]: e["ExportingStackId"] for e in cfn.list_exports()["Exports"]}
        assert exports[f"Trainstack-platform-{RECIPE}-BucketName"] == now[DATA]["StackId"]
        # (the Launcher's CREATE_COMPLETE is its imports resolved: step 2 is what a missing one does)

        # 4. An update through a change set (the CLI first deletes a change set of the same name, if any).
        before = {o["OutputKey"]: o["OutputValue"] for o in now[LAUNCHER]["Outputs"]}["RecipeHash"]
        update = cdk(
            "deploy",
            "--all",
            "-c",
            f"recipe={RECIPE}",
            "-c",
            "set=training.lr=1e-4",
            "--require-approval=never",
            "-o",
            str(tmp_path / "cdk.out.update"),
        )
        assert update.returncode == 0, (update.stdout + update.stderr)[-3000:]
        updated = stacks()[LAUNCHER]
        assert updated["StackStatus"] == "UPDATE_COMPLETE"
        assert {o["OutputKey"]: o["OutputValue"] for o in updated["Outputs"]}["RecipeHash"] != before
        assert set(exports) <= {e["Name"] for e in cfn.list_exports()["Exports"]}
