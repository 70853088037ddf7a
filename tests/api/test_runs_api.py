"""trainstack.api's run operations (tune, launch, stop, resume, export, wait_for_run) against their
commands: the same inputs through the API and through the command line give the same `--json` bytes,
the same one-line errors and the same exit codes.

AWS is stood in for where the API reads it (trainstack.aws.session.Aws, the run registry's reads and
writes, trainstack.aws.run_access.find_run), as tests/unit/test_cli_export.py does; `launch --dry-run`
needs no AWS at all, and `tune` answers from a tuning store written here (a result for this checkout's
trainer), so no job trains. The whole path on the emulator is tests/docs/test_api_doc.py (slow tier).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from botocore.exceptions import ClientError
from typer.testing import CliRunner

from trainstack.api import runs_api as api  # (trainstack.api re-exports every name used here)
from trainstack.cli.main import app
from trainstack.errors import TrainstackError

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "trainer" / "fixtures" / "tiny.yaml")
RUN = "ts-platform-tiny-cpu--r1"


def cli(*args: str, input: str | None = None) -> SimpleNamespace:
    result = CliRunner().invoke(app, list(args), input=input)
    return SimpleNamespace(code=result.exit_code, out=result.stdout, err=result.stderr)


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    """No AWS configuration and no emulator: nothing to read the deployed stacks from."""
    for name in ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ACCESS_KEY_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("TRAINSTACK_TUNING_STORE", str(tmp_path / "tuning.json"))
    monkeypatch.chdir(tmp_path)  # no .emulator/endpoint.json here or above


# --- launch --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [(TINY,), ("1b-bf16", "--max-steps", "50"), ("8b-fp8", "--team", "nlp", "--keep-alive", "60")],
    ids=["recipe-file", "short-run", "team"],
)
def test_launch_dry_run_prints_the_api_results_json_and_request(no_aws, args):
    recipe, options = args[0], args[1:]
    keywords = {"team": "nlp", "keep_alive": 60} if "--team" in options else {}
    keywords |= {"max_steps": 50} if "--max-steps" in options else {}
    planned = api.launch(recipe, name="cap", dry_run=True, **keywords)
    as_json = cli("launch", *args, "--name", "cap", "--dry-run", "--json")
    assert as_json.code == 0, as_json.err
    assert as_json.out == planned.to_json() + "\n"
    plain = cli("launch", *args, "--name", "cap", "--dry-run")
    assert plain.out == planned.request_json() + "\n"
    # The notes the command prints on stderr are the result's, in order (placeholders, input mode).
    assert as_json.err.splitlines() == list(planned.notes)
    assert planned.placeholders == ("bucket_name", "image_uri", "kms_key_arn", "region", "role_arn")
    assert planned.execution is None and planned.state == "planned"
    assert json.loads(planned.to_json())["request"]["TrainingJobName"] == planned.job == f"{planned.run}-1"


def test_a_launch_that_is_refused_raises_the_line_the_command_prints(no_aws):
    refused = cli("launch", TINY, "--name", "Not_A_Name")
    assert refused.code == 2
    with pytest.raises(TrainstackError) as caught:
        api.launch(TINY, name="Not_A_Name")
    assert refused.err.strip() == f"error: {caught.value}"
    # No region, no emulator: the same line, exit 2, before anything is started.
    unconfigured = cli("launch", TINY, "--name", "cap")
    with pytest.raises(TrainstackError) as caught:
        api.launch(TINY, name="cap")
    assert unconfigured.code == caught.value.exit_code == 2
    assert unconfigured.err.strip() == f"error: {caught.value}"


def test_a_dry_run_result_is_frozen_and_hands_out_copies(no_aws):
    import dataclasses

    planned = api.launch(TINY, name="cap", dry_run=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        planned.run = "other"  # type: ignore[misc]
    planned.to_document()["request"]["TrainingJobName"] = "changed"
    assert json.loads(planned.to_json())["request"]["TrainingJobName"] == f"{planned.run}-1"


def test_a_run_actions_json_is_the_one_line_the_commands_printed_before():
    """`{run, job, execution}` on one line, as `json.dumps` of that dict (the commands' old `answer`)."""
    action = api.StopResult("ts-a--b", "ts-a--b-1", None, ("stopping",))
    assert action.to_json() == '{"run": "ts-a--b", "job": "ts-a--b-1", "execution": null}'
    started = api.LaunchResult("ts-a--b", "ts-a--b-1", "arn:x", ("launched",), checkpoint_uri="s3://b/")
    assert started.to_json() == '{"run": "ts-a--b", "job": "ts-a--b-1", "execution": "arn:x"}'
    assert started.state == "running" and not started.succeeded


# --- tune ----------------------------------------------------------------------------------------------


def _seed_tuning_store(path: Path) -> dict:
    """A tuning result for tiny.yaml on this checkout's trainer (the key `tune --local` looks up)."""
    from trainstack.recipes.loader import resolve
    from trainstack.tuning.local import local_hardware
    from trainstack.tuning.store import Store

    recipe = resolve(TINY).recipe
    choice = {
        "candidates": [
            {
                "name": "c0",
                "overrides": [],
                "layout": "micro-batch 2, selective 1/2, shard group 8, compile",
                "status": "ok",
                "measured": {"tokens_per_s": 4800.5, "tokens_per_s_spread": 120.25, "step_time_s": 0.1067},
            },
            {
                "name": "c1",
                "overrides": ["activation_checkpointing.every=4"],
                "layout": "micro-batch 2, selective 1/4, shard group 8, compile",
                "status": "ok",
                "measured": {"tokens_per_s": 4700.0, "tokens_per_s_spread": 90.0, "step_time_s": 0.109},
            },
        ],
        "chosen": {"name": "c0", "overrides": [], "why": "c0 is the cheapest to finish the run"},
    }
    store = Store(path)
    result = {"choice": choice, "overrides": [], "why": "", "gain": 0.0, "spent_usd": 0.01, "skipped": []}
    store.record("tune-seeded", "2026-12-06 07:00 UTC", recipe, None, local_hardware(1), [], result)
    store.save()
    return choice


def test_tune_json_is_the_api_tune_to_json_and_the_exit_code_its_choice(no_aws, tmp_path, monkeypatch):
    # In this process `trainer` is tests/trainer (pytest puts tests/ on the path), so the trainer's
    # digest is stood in for; `tune --local` in a process of its own: tests/tuning/test_tune_command.py.
    monkeypatch.setattr("trainstack.tuning.local.trainer_digest", lambda: "local:sha256:0123456789abcdef")
    choice = _seed_tuning_store(tmp_path / "tuning.json")
    progress: list[str] = []
    tuned = api.tune(TINY, local=True, candidates=2, on_progress=progress.append)
    assert tuned.reused and tuned.run == "tune-seeded" and tuned.exit_code == 0
    assert tuned.choice == choice and tuned.overrides == []
    as_json = cli("tune", TINY, "--local", "--candidates", "2", "--json")
    assert as_json.code == tuned.exit_code
    assert as_json.out == tuned.to_json() + "\n"
    # Progress: on stderr under --json, on stdout for a person; the same lines either way.
    assert as_json.err.splitlines() == progress
    assert progress[-1].startswith("reusing tuning run tune-seeded of 2026-12-06 07:00 UTC on local (cpu")
    plain = cli("tune", TINY, "--local", "--candidates", "2")
    assert plain.out.splitlines()[: len(progress)] == progress
    assert "chosen: c0 (the recipe's own layout)" in plain.out


def test_tune_refuses_what_its_command_refuses_in_the_same_line(no_aws):
    refused = cli("tune", TINY, "--set", "training.micro_batch=0")
    with pytest.raises(TrainstackError) as caught:
        api.tune(TINY, overrides=["training.micro_batch=0"])
    assert refused.code == 2 and refused.err.strip() == f"error: {caught.value}"
    with pytest.raises(TrainstackError, match=r"^--candidates: 9 is not in 1\.\.8$"):
        api.tune(TINY, candidates=9)


def test_the_commands_candidate_bound_is_the_apis():
    from trainstack.api.runs_api import MAX_CANDIDATES
    from trainstack.cli.commands import tune

    assert tune.MAX_CANDIDATES == MAX_CANDIDATES


# --- stop, resume, export on a stood-in deployment -----------------------------------------------------


class _Clients:
    """SageMaker, Step Functions and S3 as stop, resume and export ask them, recording what they did."""

    def __init__(self, job_status: str = "InProgress") -> None:
        self.job_status, self.calls, self.metrics = job_status, [], []
        self.where, self.local, self.region = "the local emulator (http://localhost:5)", True, "us-east-1"

    def client(self, service: str) -> _Clients:
        return self

    def describe_training_job(self, TrainingJobName: str) -> dict:  # noqa: N803 (boto3's spelling)
        if TrainingJobName.endswith("-X1"):
            raise ClientError({"Error": {"Code": "ValidationException", "Message": "no"}}, "Describe")
        return {
            "TrainingJobName": TrainingJobName,
            "TrainingJobStatus": self.job_status,
            "SecondaryStatus": "Training",
            "ResourceConfig": {"KeepAlivePeriodInSeconds": 1800},
            "FinalMetricDataList": self.metrics,
        }

    def stop_training_job(self, **kwargs) -> None:
        self.calls.append(("stop_training_job", kwargs))

    def update_training_job(self, **kwargs) -> None:
        self.calls.append(("update_training_job", kwargs))

    def start_execution(self, **kwargs) -> dict:
        self.calls.append(("start_execution", kwargs))
        return {"executionArn": f"arn:aws:states:us-east-1:123456789012:execution:m:{kwargs['name']}"}

    def get_caller_identity(self) -> dict:
        return {"Arn": "arn:aws:iam::123456789012:user/tester"}


def _record(**changes):
    from trainstack.aws.request import create_training_job_request
    from trainstack.recipes.loader import resolve

    recipe = resolve(TINY).recipe
    request = create_training_job_request(
        recipe,
        None,
        job_name=f"{RUN}-1",
        run=RUN,
        checkpoint_uri="s3://b/checkpoints/platform/tiny-cpu/r1/",
        keep_alive_seconds=0,
        region="us-east-1",
        previous_job_end="",
        role_arn="arn:aws:iam::123456789012:role/r",
        bucket_name="b",
        kms_key_arn="arn:aws:kms:us-east-1:123456789012:key/k",
        image_uri="img",
    )
    values = {
        "run": RUN,
        "run_id": "r1",
        "recipe": "tiny-cpu",
        "team": "platform",
        "state": "running",
        "why": "",
        "current_job": f"{RUN}-1",
        "job_index": 1,
        "jobs": (),
        "creator": "",
        "request": request,
        "checkpoint_uri": "s3://b/checkpoints/platform/tiny-cpu/r1/",
        "history": (),
        "overrides": {},
        "keep_alive": 0,
        "exports": (),
        "recipe_hash": "",
        "stop_requested": False,
        "mlflow_run_id": "",
        "step": 0,
        "steps": 30,
    }
    return SimpleNamespace(**{**values, **changes})


@pytest.fixture
def deployment(monkeypatch):
    """A run `RUN` of tiny.yaml, deployed, as find_run answers; the clients record every write."""
    clients = _Clients()
    state = {"record": _record()}
    where = SimpleNamespace(
        table="runs",
        start_job="arn:aws:states:::stateMachine:start",
        launcher={"ExportStateMachineArn": "arn:aws:states:::stateMachine:export", "RecipeHash": ""},
    )
    monkeypatch.setattr("trainstack.aws.session.Aws", lambda local: clients)
    monkeypatch.setattr("trainstack.aws.run_access.find_run", lambda aws, run: (state["record"], where))
    monkeypatch.setattr("trainstack.aws.registry.request_stop", lambda ddb, table, run: state["record"])
    monkeypatch.setattr("trainstack.aws.run_access.registration_won", lambda aws, arn, how: True)
    monkeypatch.setattr("trainstack.aws.checkpoints.step_problem", lambda s3, uri, step: None)
    monkeypatch.setattr("trainstack.aws.run_control.refuse_a_running_export", lambda *args: None)
    monkeypatch.setattr("trainstack.aws.run_control.exportable_step", lambda s3, run, uri, step: step or 7)
    return SimpleNamespace(clients=clients, state=state)


def test_stop_json_is_the_api_stop_to_json(deployment):
    stopped = api.stop(RUN, local=True)
    assert stopped.job == f"{RUN}-1" and stopped.execution is None
    assert stopped.lines[0].startswith(f"stopping run {RUN}: job {RUN}-1 is stopping (SIGTERM")
    as_json = cli("stop", RUN, "--local", "--json")
    assert as_json.code == 0 and as_json.out == stopped.to_json() + "\n"
    plain = cli("stop", RUN, "--local")
    assert plain.out.splitlines() == list(stopped.lines)
    assert [name for name, _ in deployment.clients.calls] == ["stop_training_job", "update_training_job"] * 3


def test_resume_json_is_the_api_resume_to_json_and_a_step_back_needs_a_yes(deployment):
    deployment.state["record"] = _record(state="stopped", why="it was stopped by trainstack stop")
    resumed = api.resume(RUN, overrides=["training.lr=0.0001"], local=True)
    assert resumed.job == f"{RUN}-2" and resumed.lines[-1] == "changes: training.lr: 0.003 -> 0.0001"
    as_json = cli("resume", RUN, "--local", "--set", "training.lr=0.0001", "--json")
    assert as_json.code == 0, as_json.err
    # The execution's name carries a new attempt token per call: equal but for it.
    mine, theirs = json.loads(resumed.to_json()), json.loads(as_json.out)
    assert mine["execution"] != theirs["execution"]
    assert as_json.out == resumed.to_json().replace(mine["execution"], theirs["execution"]) + "\n"

    started = len(deployment.clients.calls)
    with pytest.raises(api.NotConfirmed) as caught:  # a step back discards checkpoints: not without a yes
        api.resume(RUN, from_step=4, local=True)
    assert caught.value.exit_code == 1 and "pass yes=True" in str(caught.value)
    said_no = cli("resume", RUN, "--local", "--from-step", "4", input="n\n")
    assert said_no.code == 1 and "error:" not in said_no.err
    assert "its checkpoints after step 4 are discarded" in said_no.err
    assert len(deployment.clients.calls) == started  # nothing was started
    asked: list[str] = []
    confirmed = api.resume(RUN, from_step=4, local=True, confirm=lambda q: asked.append(q) or True)
    assert confirmed.lines[0].endswith("at step 4") and asked[0].endswith(". Continue?")


def test_resume_refuses_a_change_no_running_run_may_take_before_aws_is_asked(deployment):
    refused = cli("resume", RUN, "--local", "--set", "model.layers=2")
    with pytest.raises(TrainstackError) as caught:
        api.resume(RUN, overrides=["model.layers=2"], local=True)
    assert refused.code == 2 and refused.err.strip() == f"error: {caught.value}"
    assert deployment.clients.calls == []


def test_export_json_is_the_api_export_to_json(deployment):
    exported = api.export(RUN, local=True)
    assert (
        exported.job == f"{RUN}-X1" and exported.lines[0] == f"exporting run {RUN} (step 7) as job {RUN}-X1"
    )
    as_json = cli("export", RUN, "--local", "--json")
    assert as_json.code == 0 and as_json.out == exported.to_json() + "\n"
    assert (
        cli("export", RUN, "--local", "--step", "3")
        .out.splitlines()[0]
        .endswith("(step 3) as job " + f"{RUN}-X1")
    )


def _export_job_goes(deployment, monkeypatch, statuses: list[str], execution: str = "RUNNING") -> None:
    """The export job the Export execution creates: absent, then each of `statuses` at each look."""
    seen = iter(statuses)
    clients = deployment.clients
    monkeypatch.setattr("trainstack.aws.run_control.EXPORT_POLL_S", 0.0)

    def describe_training_job(TrainingJobName: str) -> dict:  # noqa: N803 (boto3's spelling)
        status = next(seen, statuses[-1])
        if status == "absent":
            raise ClientError({"Error": {"Code": "ValidationException", "Message": "no"}}, "Describe")
        ended = {"FailureReason": "AlgorithmError: out of memory"} if status == "Failed" else {}
        secondary = "Training" if status == "InProgress" else status  # as SageMaker pairs them
        return {"TrainingJobStatus": status, "SecondaryStatus": secondary, **ended}

    clients.describe_training_job = describe_training_job
    clients.describe_execution = lambda executionArn: {"status": execution}  # noqa: N803


def test_export_wait_follows_the_job_to_its_end_and_exits_1_on_a_failure(deployment, monkeypatch):
    _export_job_goes(deployment, monkeypatch, ["absent", "InProgress", "InProgress", "Completed"])
    said: list[str] = []
    done = api.export(RUN, local=True, wait=True, on_progress=said.append)
    assert done.succeeded and done.status == "Completed" and done.folder.endswith("/step-7/")
    assert [line.split(" / ")[0].split(" (")[0] for line in said] == [
        f"export job {RUN}-X1: being created",
        f"export job {RUN}-X1: InProgress",
        f"export job {RUN}-X1: Completed",
    ]
    assert json.loads(done.to_json())["status"] == "Completed"
    _export_job_goes(deployment, monkeypatch, ["InProgress", "Failed"])
    failed = cli("export", RUN, "--local", "--wait")
    assert failed.code == 1
    assert failed.out.splitlines()[-1] == f"export job {RUN}-X1: Failed: AlgorithmError: out of memory"
    _export_job_goes(deployment, monkeypatch, ["Failed"])
    as_json = cli("export", RUN, "--local", "--wait", "--json")
    assert as_json.code == 1 and json.loads(as_json.out)["failure_reason"] == "AlgorithmError: out of memory"


def test_export_wait_says_when_the_job_was_never_created_or_time_ran_out(deployment, monkeypatch):
    _export_job_goes(deployment, monkeypatch, ["absent"], execution="FAILED")
    with pytest.raises(
        TrainstackError, match=f"export job {RUN}-X1 was never created: its Export execution failed"
    ):
        api.export(RUN, local=True, wait=True)
    _export_job_goes(deployment, monkeypatch, ["InProgress"])
    late = cli("export", RUN, "--local", "--wait", "--timeout", "1")
    assert (
        late.code == 1
        and f"export job {RUN}-X1 has not ended after 1 s (InProgress / Training); it goes on" in late.err
    )


# --- waiting for a run's end ---------------------------------------------------------------------------


def test_wait_for_run_follows_the_registry_to_the_runs_end(deployment, monkeypatch):
    """One line per change of state, job or step; the end's record; a timeout says the run goes on."""
    records = iter(
        [
            _record(step=0, steps=30),
            _record(step=0, steps=30),
            _record(step=10, steps=30),
            _record(state="completed", why="its steps are done", step=30, steps=30, current_job=f"{RUN}-2"),
        ]
    )
    monkeypatch.setattr("trainstack.aws.registry.read_run", lambda ddb, table, run: next(records))
    monkeypatch.setattr("trainstack.aws.launching.time.sleep", lambda s: None)
    lines: list[str] = []
    ended = api.wait_for_run(RUN, local=True, on_progress=lines.append)
    assert ended.state == "completed" and ended.succeeded and ended.step == 30
    assert lines == [
        f"run {RUN}: running, job {RUN}-1 InProgress, step 0 of 30",
        f"run {RUN}: running, job {RUN}-1 InProgress, step 10 of 30",
        f"run {RUN}: completed, job {RUN}-2 InProgress, step 30 of 30",
        f"run {RUN} completed: its steps are done",
    ]
    # The step and loss SageMaker reports for the current job, where it has them.
    deployment.clients.metrics = [
        {"MetricName": "train:step", "Value": 12.0},
        {"MetricName": "train:loss", "Value": 3.25},
    ]
    records = iter([_record(step=0, steps=30), _record(state="completed", why="done", step=30, steps=30)])
    lines.clear()
    api.wait_for_run(RUN, local=True, on_progress=lines.append)
    assert lines[0] == f"run {RUN}: running, job {RUN}-1 InProgress, step 12 of 30, loss 3.25"
    assert json.loads(ended.to_json())["state"] == "completed"

    monkeypatch.setattr("trainstack.aws.registry.read_run", lambda ddb, table, run: _record(step=3, steps=30))
    with pytest.raises(api.StillRunning) as caught:
        api.wait_for_run(RUN, local=True, timeout=0)
    assert caught.value.exit_code == 1 and "it goes on" in str(caught.value)


def test_launch_wait_returns_the_runs_final_state(monkeypatch, no_aws):
    """launch(wait=True): the run started (as `launch` starts it), then followed to its end."""
    from trainstack.aws import launching

    clients = _Clients(job_status="Failed")
    clients.meta = SimpleNamespace(endpoint_url="http://localhost:5")  # the emulator's S3, as launch reads it
    monkeypatch.setattr("trainstack.aws.session.Aws", lambda local: clients)
    started = launching.Started(
        run="ts-platform-tiny-cpu--cap",
        job="ts-platform-tiny-cpu--cap-1",
        execution="arn:x",
        table="runs",
        checkpoint_uri="s3://b/c/",
        where=clients.where,
    )
    monkeypatch.setattr(launching, "start_run", lambda *args, **kwargs: started)
    failed = _record(run=started.run, state="failed", why="exit 2: bad recipe", step=0, steps=30)
    monkeypatch.setattr("trainstack.aws.registry.read_run", lambda ddb, table, run: failed)
    result = api.launch(TINY, name="cap", local=True, wait=True, timeout=5)
    assert result.to_json() == json.dumps({"run": started.run, "job": started.job, "execution": "arn:x"})
    assert result.state == "failed" and not result.succeeded and result.final.why == "exit 2: bad recipe"
