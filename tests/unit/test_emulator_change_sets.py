"""trainstack.emulator.cloudformation against moto itself, in a child process (its patches change moto's
classes for the whole process, as they do in the emulator's server): the change-set path the CDK CLI
takes by default keeps exports, termination protection is answered, a failed creation rolls back to
ROLLBACK_COMPLETE, and a stale REVIEW_IN_PROGRESS stack is reused. The real CLI against the real server:
tests/integration/test_emulator_change_set_deploy.py (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.fast

SCRIPT = textwrap.dedent(
    """
    import json
    import boto3
    from moto import mock_aws
    from trainstack.emulator import cloudformation

    cloudformation.install()
    DATA = {"Resources": {"Bucket": {"Type": "AWS::S3::Bucket", "Properties": {"BucketName": "ts-data"}}},
            "Outputs": {"BucketName": {"Value": {"Ref": "Bucket"}, "Export": {"Name": "ts-BucketName"}}}}
    NAME = {"Fn::Join": ["-", [{"Fn::ImportValue": "ts-BucketName"}, "t"]]}
    LAUNCHER = {"Resources": {"Topic": {"Type": "AWS::SNS::Topic", "Properties": {"TopicName": NAME}}},
                "Outputs": {"TopicArn": {"Value": {"Ref": "Topic"}}}}
    seen = {}
    with mock_aws():
        cfn = boto3.client("cloudformation", region_name="us-east-1")

        def change_set(name, template):
            made = cfn.create_change_set(StackName=name, ChangeSetName="cdk-deploy-change-set",
                                         ChangeSetType="CREATE", TemplateBody=json.dumps(template))
            return made["StackId"]

        def status(name):
            (stack,) = cfn.describe_stacks(StackName=name)["Stacks"]
            return stack

        # a failed creation: the launcher before the export it imports exists
        failed_id = change_set("Launcher", LAUNCHER)
        cfn.update_termination_protection(StackName="Launcher", EnableTerminationProtection=True)
        cfn.execute_change_set(StackName="Launcher", ChangeSetName="cdk-deploy-change-set")
        failed = status("Launcher")
        seen["failed"] = [failed["StackStatus"], failed.get("StackStatusReason", ""), failed.get("Outputs")]
        seen["failed_events"] = [e["ResourceStatus"] for e in
                                 cfn.describe_stack_events(StackName="Launcher")["StackEvents"]]
        cfn.delete_stack(StackName=failed_id)  # what the CLI's next deploy does first

        # a stale review: a change set made, never executed; the next CREATE change set reuses its stack
        stale_id = change_set("Data", DATA)
        cfn.delete_change_set(StackName="Data", ChangeSetName="cdk-deploy-change-set")  # as the CLI does
        data_id = change_set("Data", DATA)
        seen["reused"] = stale_id == data_id
        seen["data_stacks"] = sum(s["StackName"] == "Data" for s in cfn.describe_stacks()["Stacks"])
        cfn.update_termination_protection(StackName="Data", EnableTerminationProtection=True)
        cfn.execute_change_set(StackName="Data", ChangeSetName="cdk-deploy-change-set")
        data = status("Data")
        seen["data"] = [data["StackStatus"], data["EnableTerminationProtection"], data["StackId"] == data_id]
        seen["exports"] = {e["Name"]: e["Value"] for e in cfn.list_exports()["Exports"]}

        change_set("Launcher", LAUNCHER)
        cfn.execute_change_set(StackName="Launcher", ChangeSetName="cdk-deploy-change-set")
        launcher = status("Launcher")
        seen["launcher"] = [launcher["StackStatus"], [o["OutputValue"] for o in launcher["Outputs"]]]

        try:
            cfn.describe_change_set(StackName="Data", ChangeSetName="not-there")
        except cfn.exceptions.ChangeSetNotFoundException:
            seen["missing_change_set"] = "ChangeSetNotFound"
        cfn.delete_change_set(StackName="Data", ChangeSetName="not-there")  # the CLI's cleanup: no error
        # each stack's change set of one name is its own: deleting the Launcher's leaves Data's (made first)
        cfn.delete_change_set(StackName="Launcher", ChangeSetName="cdk-deploy-change-set")
        try:
            cfn.describe_change_set(StackName="Launcher", ChangeSetName="cdk-deploy-change-set")
        except cfn.exceptions.ChangeSetNotFoundException:
            seen["launcher_change_set_gone"] = True
        kept = cfn.describe_change_set(StackName="Data", ChangeSetName="cdk-deploy-change-set")
        seen["data_change_set"] = kept["StackName"]
    print(json.dumps(seen))
    """
)


def test_change_sets_keep_exports_and_a_failed_creation_rolls_back_for_the_retry() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    status, reason, outputs = seen["failed"]
    assert status == "ROLLBACK_COMPLETE" and "No export named ts-BucketName" in reason and not outputs
    assert {"CREATE_FAILED", "ROLLBACK_COMPLETE"} <= set(seen["failed_events"])
    assert seen["reused"] and seen["data_stacks"] == 1
    assert seen["data"] == ["CREATE_COMPLETE", True, True]
    assert seen["exports"] == {"ts-BucketName": "ts-data"}
    assert seen["launcher"] == ["CREATE_COMPLETE", ["arn:aws:sns:us-east-1:123456789012:ts-data-t"]]
    assert seen["missing_change_set"] == "ChangeSetNotFound"
    assert seen["launcher_change_set_gone"] and seen["data_change_set"] == "Data"
