"""A deployed emulator cloud for the integration tests: the real `npx cdk` and `trainstack` commands
against one local AWS emulator, and what a test reads back (stack outputs, the request an execution
sent, a run's listing, a job's log)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from trainstack.aws.session import training_job_request_sent
from trainstack.emulator import events as emulator_events
from trainstack.emulator.endpoint import Emulator, clients

ROOT = Path(__file__).resolve().parents[2]
TRAINSTACK = str(Path(sys.executable).parent / "trainstack")


class Cloud:
    def __init__(self, emulator: Emulator, outdir: Path) -> None:
        self.env = {
            **os.environ,
            **emulator.env(),
            "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
            "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20",
            "CDK_DISABLE_CLI_TELEMETRY": "true",
        }
        self.outdir = outdir
        self.deployed: dict[tuple[str, str | None], tuple[str, ...]] = {}  # (recipe, team) -> its --set
        self.cfn, self.sfn, self.sagemaker, self.events, self.ddb = clients(
            emulator.env(), "cloudformation", "stepfunctions", "sagemaker", "events", "dynamodb"
        )
        self.tables: dict[str, str] = {}  # data stack -> its run table

    def run(self, *cmd: str) -> str:
        result = subprocess.run(
            list(cmd), cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=900
        )
        assert result.returncode == 0, f"{' '.join(cmd)}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result.stdout + result.stderr

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [TRAINSTACK, *args], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=300
        )

    def cli_json(self, *args: str):
        result = self.cli(*args, "--json")
        assert result.returncode == 0, f"{args}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return json.loads(result.stdout)

    def cdk(self, *args: str) -> str:
        return self.run(shutil.which("npx") or "npx", "cdk", *args, "-o", str(self.outdir))

    def deploy(self, recipe: str, team: str | None = None, *sets: str, again: bool = False) -> str:
        """`cdk deploy --all` of the recipe's stacks. A recipe already deployed with the same overrides
        by an earlier test is left as it is (a deploy of unchanged stacks costs a synthesis and changes
        nothing; nothing in this module changes stacks behind CloudFormation's back), unless `again`:
        the redeploy test's very subject."""
        if not again and self.deployed.get((recipe, team)) == sets:
            return "(deployed already: unchanged)"
        context = ["-c", f"recipe={recipe}"] + (["-c", f"team={team}"] if team else [])
        context += ["-c", f"set={','.join(sets)}"] if sets else []
        output = self.cdk("deploy", "--all", *context, "--method=direct", "--require-approval=never")
        self.deployed[(recipe, team)] = sets
        return output

    def outputs(self, stack: str) -> dict[str, str]:
        (found,) = self.cfn.describe_stacks(StackName=stack)["Stacks"]
        return {o["OutputKey"]: o["OutputValue"] for o in found.get("Outputs", [])}

    def physical_ids(self, stack: str) -> dict[str, str]:
        summaries = self.cfn.list_stack_resources(StackName=stack)["StackResourceSummaries"]
        return {r["LogicalResourceId"]: r["PhysicalResourceId"] for r in summaries}

    def launch(self, recipe: str, team: str | None = None, *extra: str) -> tuple[str, str]:
        """(first job's name, execution ARN) of a new run."""
        answer = self.cli_json(
            "launch", recipe, *(["--team", team] if team else []), "--local", "--wait", *extra
        )
        assert answer["job"] == f"{answer['run']}-1"
        return answer["job"], answer["execution"]

    def deliver(self, job: str) -> dict:
        """Deliver `job`'s state-change event to the deployed rules, as EventBridge does, and wait for
        the supervisor's decision (the JobEnded execution's output)."""
        started = emulator_events.deliver_job_state_change(self.env, job)
        machine = self.outputs(f"{job.split('--')[0].replace('ts-', 'Trainstack-', 1)}-Launcher")[
            "JobEndedStateMachineArn"
        ]
        (ended,) = [
            a for a in started if self.sfn.describe_execution(executionArn=a)["stateMachineArn"] == machine
        ]
        deadline = time.monotonic() + 120
        while (described := self.sfn.describe_execution(executionArn=ended))["status"] == "RUNNING":
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert described["status"] == "SUCCEEDED", described
        return {**json.loads(described["output"]), "execution": ended}

    def end_and_deliver(self, job: str, status: str, secondary: str, reason: str | None = None) -> dict:
        """End `job` as SageMaker would, then deliver its event and wait for the decision."""
        emulator_events.end_training_job(self.env, job, status, secondary, reason)
        return self.deliver(job)

    def run_of(self, recipe: str, run: str) -> dict:
        (found,) = [r for r in self.cli_json("runs", recipe, "--local") if r["run"] == run]
        return found

    def sent(self, execution_arn: str) -> dict:
        deadline = time.monotonic() + 60
        while (request := training_job_request_sent(self.sfn, execution_arn)) is None:
            assert time.monotonic() < deadline, f"no CreateTrainingJob in {execution_arn}"
            time.sleep(0.5)
        return request

    def run_record(self, data_stack: str, run: str):
        """The run's registry record, as the supervisor keeps it (trainstack.aws.registry)."""
        from trainstack.aws.registry import read_run

        if data_stack not in self.tables:  # polled every second: the stack's outputs read once
            self.tables[data_stack] = self.outputs(data_stack)["RunTableName"]
        return read_run(self.ddb, self.tables[data_stack], run)

    def wait_for_run(self, data_stack: str, run: str, states: tuple[str, ...], timeout_s: float = 600):
        """Poll the registry until the run is in one of `states`; nothing is done to it meanwhile."""
        return wait_until(lambda: self.run_record(data_stack, run), lambda r: r.state in states, timeout_s)

    def log_of(self, job: str) -> str:
        """The job's log as SageMaker keeps it (CloudWatch Logs, /aws/sagemaker/TrainingJobs, streams
        `<job>/algo-<n>-<epoch>`), read as `trainstack logs` reads it. (Not FilterLogEvents: moto ignores
        its logStreamNamePrefix and returns every job's lines.)"""
        from trainstack.aws.runs import LogCursor, log_streams, read_new_lines

        (logs,) = clients(self.env, "logs")
        lines = read_new_lines(logs, log_streams(logs, job), LogCursor())
        return "\n".join(message for _, _, message in lines)

    def final_metrics(self, job: str) -> dict[str, float]:
        described = self.sagemaker.describe_training_job(TrainingJobName=job)
        return {m["MetricName"]: m["Value"] for m in described.get("FinalMetricDataList", [])}


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The one line a refused command printed (exit 2, no traceback)."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def wait_until(read, done, timeout_s: float):
    """Poll `read()` every second until `done(value)`; the value (the last one in the failure)."""
    deadline = time.monotonic() + timeout_s
    while not done(value := read()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s; last: {value}"
        time.sleep(1)
    return value
