"""End to end against the local AWS emulator: the real `npx cdk bootstrap` / `npx cdk deploy`, the real
`trainstack launch`, `runs`, `stop` and `resume`, state machine executions the emulator interprets, the
training jobs they create, and SageMaker's state-change events delivered to the deployed rule.

Two recipes and a team override; the request the execution sent must equal the pure function's output
for the deployed values; a second deploy changes nothing; a changed recipe keeps the bucket, key,
repository and run registry; launch_on_deploy starts the recipe-hash run from the deployed rule; a run
continues after a spot interruption under one checkpoint prefix; resume and stop refuse what they
should; concurrent launches and resumes have one winner.

Jobs here are held (InProgress until a test ends them): these tests are about requests and decisions.
Runs whose jobs really train, through max runtime, stop, resume, divergence and a crash loop to
completion, are test_whole_runs.py's.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import pytest
from deployed_cloud import ROOT, TRAINSTACK, Cloud, one_line_error

from trainstack.aws.request import (
    WARM_POOL_SECONDS,
    checkpoint_uri,
    create_training_job_request,
    job_name,
    stopping_condition,
)
from trainstack.aws.session import training_job_request_sent
from trainstack.emulator import events as emulator_events
from trainstack.emulator.endpoint import ACCOUNT, REGION, Emulator, clients, deliver_stack_status
from trainstack.recipes import naming
from trainstack.recipes.loader import resolve

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("emulator")]


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cloud]:
    log = tmp_path_factory.mktemp("emulator") / "moto.log"
    with Emulator(log_path=log) as emulator:
        cloud = Cloud(emulator, tmp_path_factory.mktemp("cdk-out"))
        # EMULATOR: jobs stay InProgress until the tests end them, as on AWS.
        emulator_events.configure(cloud.env, jobs_run=True)
        cloud.cdk("bootstrap", f"aws://{ACCOUNT}/{REGION}", "-c", "recipe=1b-bf16")
        yield cloud


def expected_request(
    cloud: Cloud,
    recipe_name: str,
    team: str | None,
    name: str,
    keep_alive: int,
    *sets: str,
    run_sets: tuple[str, ...] = (),
) -> dict:
    """The pure function's request for the deployed values; `run_sets` are the launch's own overrides."""
    deployed = resolve(recipe_name, team, sets).recipe
    recipe = resolve(recipe_name, team, (*sets, *run_sets)).recipe
    prefix = naming.stack_prefix(recipe, team)
    launcher, data = cloud.outputs(f"{prefix}-Launcher"), cloud.outputs(f"{prefix}-Data")
    # EMULATOR: no image is built; the stack references the deployed recipe's tag in its repository.
    image = (
        f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{data['RepositoryName']}:{naming.recipe_hash(deployed)}"
    )
    run = name.rsplit("-", 1)[0]
    request = create_training_job_request(
        recipe,
        team,
        job_name=name,
        run=run,
        checkpoint_uri=checkpoint_uri(data["BucketName"], deployed, team, naming.parse_run_name(run).run_id),
        role_arn=launcher["ExecutionRoleArn"],
        image_uri=image,
        bucket_name=data["BucketName"],
        kms_key_arn=data["KeyArn"],
        keep_alive_seconds=keep_alive,
        region=REGION,
    )
    # The job limit is fixed at deploy time by the deployed recipe's plan; a short run just ends sooner.
    return {**request, "StoppingCondition": stopping_condition(deployed)}


@pytest.mark.parametrize(("recipe", "team"), [("1b-bf16", None), ("30b-fp8", None), ("8b-fp8", "nlp")])
def test_deploy_and_launch_sends_the_full_request(cloud: Cloud, recipe: str, team: str | None) -> None:
    cloud.deploy(recipe, team)
    name, execution = cloud.launch(recipe, team)
    resolved = resolve(recipe, team).recipe
    assert name.startswith(f"{naming.job_name_prefix(resolved, team)}{naming.recipe_hash(resolved)}-r")
    assert name.endswith("-1")
    sent = cloud.sent(execution)
    assert sent == expected_request(cloud, recipe, team, name, resolved.compute.keep_alive_seconds)
    job = cloud.sagemaker.describe_training_job(TrainingJobName=name)
    assert job["ResourceConfig"]["InstanceType"] == resolved.compute.instance_type
    assert job["ResourceConfig"]["InstanceCount"] == resolved.compute.instance_count
    assert job["Environment"] == sent["Environment"] and "CheckpointConfig" not in sent
    assert job["HyperParameters"] == sent["HyperParameters"]
    deadline = time.monotonic() + 120
    while (status := cloud.sfn.describe_execution(executionArn=execution)["status"]) == "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(1)
    assert status == "SUCCEEDED"


def test_a_short_run_overrides_steps_on_a_warm_pool(cloud: Cloud) -> None:
    cloud.deploy("1b-bf16")
    name, execution = cloud.launch("1b-bf16", None, "--max-steps", "5")
    sent = cloud.sent(execution)
    assert sent == expected_request(
        cloud, "1b-bf16", None, name, WARM_POOL_SECONDS, run_sets=("training.steps=5",)
    )
    assert sent["HyperParameters"]["training.steps"] == "5"
    assert sent["ResourceConfig"]["KeepAlivePeriodInSeconds"] == WARM_POOL_SECONDS


def test_dry_run_prints_the_request_and_starts_nothing(cloud: Cloud) -> None:
    cloud.deploy("1b-bf16")
    before = cloud.sfn.list_executions(
        stateMachineArn=cloud.outputs("Trainstack-platform-1b-bf16-Launcher")["StateMachineArn"]
    )["executions"]
    dry_run = subprocess.run(
        [TRAINSTACK, "launch", "1b-bf16", "--local", "--dry-run"],
        cwd=ROOT,
        env=cloud.env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    printed = json.loads(dry_run.stdout)
    recipe = resolve("1b-bf16").recipe
    assert printed == expected_request(
        cloud, "1b-bf16", None, printed["TrainingJobName"], recipe.compute.keep_alive_seconds
    )
    assert "placeholder" not in dry_run.stdout and "placeholder" not in dry_run.stderr
    after = cloud.sfn.list_executions(
        stateMachineArn=cloud.outputs("Trainstack-platform-1b-bf16-Launcher")["StateMachineArn"]
    )["executions"]
    assert len(after) == len(before)


def test_launching_an_undeployed_recipe_is_one_line(cloud: Cloud) -> None:
    result = subprocess.run(
        [TRAINSTACK, "launch", "64b-fp8", "--local"],
        cwd=ROOT,
        env=cloud.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: stack Trainstack-platform-64b-fp8-Launcher is not deployed in the local emulator "
        f"({cloud.env['AWS_ENDPOINT_URL']}): run `npx cdk deploy --all -c recipe=64b-fp8` "
        "with the emulator's AWS_* variables exported"
    ]


def test_redeploy_changes_nothing_and_a_changed_recipe_keeps_the_stateful_resources(cloud: Cloud) -> None:
    cloud.deploy("1b-bf16")
    data_stack, launcher_stack = "Trainstack-platform-1b-bf16-Data", "Trainstack-platform-1b-bf16-Launcher"
    before = cloud.physical_ids(data_stack), cloud.physical_ids(launcher_stack)
    again = cloud.deploy("1b-bf16", again=True)
    assert again.count("(no changes)") == 2, again[-2000:]
    assert (cloud.physical_ids(data_stack), cloud.physical_ids(launcher_stack)) == before

    changed = cloud.deploy("1b-bf16", None, "training.steps=123")
    assert "(no changes)" in changed  # the data stack: nothing in it depends on the recipe's knobs
    assert cloud.physical_ids(data_stack) == before[0]
    assert cloud.outputs(launcher_stack)["RecipeHash"] == naming.recipe_hash(
        resolve("1b-bf16", None, ["training.steps=123"]).recipe
    )
    # The launcher refuses to start a recipe that differs from the deployed one.
    result = subprocess.run(
        [TRAINSTACK, "launch", "1b-bf16", "--local"],
        cwd=ROOT,
        env=cloud.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "changed since it was deployed" in result.stderr
    cloud.deploy("1b-bf16")


def test_launch_on_deploy_starts_the_recipe_hash_run(cloud: Cloud) -> None:
    cloud.deploy("3b-bf16", None, "launch_on_deploy=true")
    recipe = resolve("3b-bf16", None, ["launch_on_deploy=true"]).recipe
    # EMULATOR: moto publishes no CloudFormation events; deliver the one real AWS sends on completion.
    (execution,) = deliver_stack_status(cloud.env, "Trainstack-platform-3b-bf16-Launcher", "CREATE_COMPLETE")
    sent = cloud.sent(execution)
    expected_name = f"{job_name(recipe, None, 'deploy')}-1"  # job 1 of the run <prefix><hash>-deploy
    assert sent["TrainingJobName"] == expected_name
    assert sent == expected_request(
        cloud, "3b-bf16", None, expected_name, recipe.compute.keep_alive_seconds, "launch_on_deploy=true"
    )
    # Another stack's completion starts nothing.
    assert deliver_stack_status(cloud.env, "Trainstack-platform-3b-bf16-Data", "CREATE_COMPLETE") == []
    # A repeated deploy event finds the run registered and starts no second run or job. (Started by
    # hand with the rule's own input: the emulator names every unnamed execution "None", so a second
    # deliver_stack_status would collide with the first.)
    import uuid

    (rule,) = [r for r in cloud.events.list_rules()["Rules"] if "LaunchOnDeploy" in r["Name"]]
    (target,) = cloud.events.list_targets_by_rule(Rule=rule["Name"])["Targets"]
    again = cloud.sfn.start_execution(
        stateMachineArn=target["Arn"], name=uuid.uuid4().hex, input=target["Input"]
    )["executionArn"]
    deadline = time.monotonic() + 60
    while cloud.sfn.describe_execution(executionArn=again)["status"] == "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert training_job_request_sent(cloud.sfn, again) is None


def test_a_spot_interruption_is_continued_by_the_next_job_under_the_same_checkpoint_prefix(
    cloud: Cloud,
) -> None:
    """SageMaker ends a spot job Stopped / Interrupted when it reclaims the capacity: a local job cannot
    be interrupted, so its end is delivered by hand. (Max runtime, a stop, a divergence, a crash loop and
    completion happen to jobs that really train: test_whole_runs.py.)"""
    cloud.deploy("1b-bf16")
    first, execution = cloud.launch("1b-bf16", None, "--name", "spot")
    run = first.rsplit("-", 1)[0]
    sent = [cloud.sent(execution)]
    decided = cloud.end_and_deliver(first, "Stopped", "Interrupted")
    assert (decided["Outcome"], decided["Rule"], decided["NextJob"]) == (
        "next_job",
        "SpotInterrupted",
        f"{run}-2",
    )
    sent.append(cloud.sent(decided["execution"]))
    assert [r["TrainingJobName"] for r in sent] == [f"{run}-{i}" for i in (1, 2)]
    prefixes = {r["Environment"]["TRAINSTACK_CHECKPOINT_URI"] for r in sent}
    run_id = naming.parse_run_name(run).run_id
    assert prefixes == {
        f"s3://{cloud.outputs('Trainstack-platform-1b-bf16-Data')['BucketName']}/checkpoints/platform/1b-bf16/{run_id}/"
    }
    listed = cloud.run_of("1b-bf16", run)
    assert listed["state"] == "running" and listed["checkpoint_uri"] in prefixes
    assert [(j["name"], j["status"]) for j in listed["jobs"]] == [
        (f"{run}-1", "Stopped"),
        (f"{run}-2", "InProgress"),
    ]
    assert {"run", "recipe", "team", "state", "jobs", "checkpoint_uri"} <= set(listed)
    assert (listed["recipe"], listed["team"]) == ("1b-bf16", "platform")
    assert cloud.cli_json("stop", run, "--local")["job"] == f"{run}-2"  # the held job ends here


def test_resume_of_an_unknown_run_changes_nothing(cloud: Cloud) -> None:
    """(Stop, resume and launch of a completed run's name are refused: test_whole_runs.py, on a run that
    really completed.)"""
    cloud.deploy("1b-bf16")
    machine = cloud.outputs("Trainstack-platform-1b-bf16-Launcher")["StateMachineArn"]
    before = len(cloud.sfn.list_executions(stateMachineArn=machine)["executions"])
    unknown = one_line_error(cloud.cli("resume", "ts-platform-1b-bf16--no-such-run", "--local"))
    assert unknown.startswith("error: unknown run ts-platform-1b-bf16--no-such-run: ")
    assert one_line_error(cloud.cli("resume", "not-a-run", "--local")).startswith(
        "error: unknown run 'not-a-run'"
    )
    assert len(cloud.sfn.list_executions(stateMachineArn=machine)["executions"]) == before


def put_checkpoint(cloud: Cloud, uri: str, step: int, complete: bool) -> None:
    """A checkpoint of `step` as one rank lays it out (trainstack.protocol.checkpoint_format): its shard,
    DCP metadata, rank file and manifest with their digests, and, when complete, the marker last."""
    from trainstack.protocol import checkpoint_format as fmt

    (s3,) = clients(cloud.env, "s3")
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    folder = f"{prefix}{fmt.step_dir_name(step)}/"
    files = {"__0_0.distcp": b"abc", fmt.DCP_METADATA: b"meta", fmt.extras_name(0): b"rank"}
    for name, body in files.items():
        s3.put_object(Bucket=bucket, Key=folder + name, Body=body)
    records = {name: fmt.record_of(body) for name, body in files.items()}
    manifest = fmt.manifest_document(step=step, rank=0, world_size=1, files=records)
    s3.put_object(Bucket=bucket, Key=folder + fmt.manifest_name(0), Body=manifest)
    if complete:
        records[fmt.manifest_name(0)] = fmt.record_of(manifest)
        marker = fmt.marker_document(
            step=step, world_size=1, samples_consumed=0, data_source="synthetic", run=None, files=records
        )
        s3.put_object(Bucket=bucket, Key=folder + fmt.MARKER, Body=marker)


def test_resume_changes_the_run_deliberately_and_from_a_checkpoint(cloud: Cloud) -> None:
    """`resume --set` of a safe key and `--from-step` of a complete checkpoint: the next job carries
    both, the record and `runs` the change; an unsafe key and an incomplete checkpoint are refused."""
    cloud.deploy("1b-bf16")
    first, _ = cloud.launch("1b-bf16", None, "--name", "changes")
    run = "ts-platform-1b-bf16--changes"
    cloud.cli_json("stop", run, "--local")
    emulator_events.wait_for_status(cloud.env, first, ("Stopped",))
    cloud.deliver(first)
    uri = cloud.run_of("1b-bf16", run)["checkpoint_uri"]
    put_checkpoint(cloud, uri, 40, complete=True)
    put_checkpoint(cloud, uri, 50, complete=False)  # killed while saving
    unsafe = one_line_error(cloud.cli("resume", run, "--local", "--set", "model.layers=2"))
    assert "model.layers: cannot change in a running run" in unsafe
    partial = one_line_error(cloud.cli("resume", run, "--local", "--from-step", "50", "--yes"))
    assert "--from-step 50: no COMPLETE.json" in partial
    missing = one_line_error(cloud.cli("resume", run, "--local", "--from-step", "60", "--yes"))
    assert "no checkpoint of step 60" in missing
    unconfirmed = cloud.cli("resume", run, "--local", "--from-step", "40")  # no terminal to say yes
    assert unconfirmed.returncode == 1 and cloud.run_of("1b-bf16", run)["state"] == "stopped"

    resumed = cloud.cli_json(
        "resume", run, "--local", "--set", "training.lr=0.0001", "--from-step", "40", "--yes"
    )
    sent = cloud.sent(resumed["execution"])
    assert sent["TrainingJobName"] == f"{run}-2"
    assert sent["HyperParameters"]["training.lr"] == "0.0001"
    assert sent["Environment"]["TRAINSTACK_RESUME_STEP"] == "40"
    listed = cloud.run_of("1b-bf16", run)
    assert listed["state"] == "running" and [h["what"] for h in listed["history"]][0].startswith("launch")
    (change,) = listed["history"][1:]
    launched_lr = json.dumps(resolve("1b-bf16").recipe.training.lr)
    assert f"training.lr: {launched_lr} -> 0.0001" in change["what"] and "from step 40" in change["what"]
    assert change["who"].startswith("arn:aws:")


def test_stop_never_overwrites_an_end_and_releases_the_warm_pool(cloud: Cloud) -> None:
    cloud.deploy("1b-bf16")
    # A job that trains: stopped (Stopping, then Stopped) with its warm pool released.
    job, _ = cloud.launch("1b-bf16", None, "--name", "warm-stop", "--max-steps", "5")  # a 1800 s warm pool
    cloud.cli_json("stop", "ts-platform-1b-bf16--warm-stop", "--local")
    described = emulator_events.wait_for_status(cloud.env, job, ("Stopped",))
    assert described["ResourceConfig"]["KeepAlivePeriodInSeconds"] == 0
    assert described["WarmPoolStatus"]["Status"] == "Terminated"
    assert cloud.deliver(job)["Rule"] == "StopRequested"
    # A job that completed before the stop, its event not yet delivered: its end is the supervisor's.
    done, _ = cloud.launch("1b-bf16", None, "--name", "done-first")
    run = "ts-platform-1b-bf16--done-first"
    emulator_events.end_training_job(cloud.env, done, "Completed", "Completed")
    said = cloud.cli("stop", run, "--local")
    assert said.returncode == 0 and "has already ended Completed" in said.stdout
    assert cloud.run_of("1b-bf16", run)["state"] == "running"  # nothing recorded over the end
    assert cloud.deliver(done)["Rule"] == "Completed"
    assert cloud.run_of("1b-bf16", run)["state"] == "completed"
    # `stop` was asked of a run that then completed: resume says it is completed, not "still stopping".
    refused = one_line_error(cloud.cli("resume", run, "--local"))
    assert "is completed: only a stopped or failed run can be resumed" in refused
    assert "still stopping" not in refused


def concurrently(cloud: Cloud, *commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """The CLI commands run together, each its own process (as two people would), started 0.5 s apart:
    EMULATOR: moto's Step Functions can leave executions started in the same instant RUNNING with no
    history (seen with and without the DynamoDB lock). Both still pass the CLI's own check before
    either registers (a process takes seconds to get there), or the second names the first there."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    def run(indexed: tuple[int, tuple[str, ...]]) -> subprocess.CompletedProcess:
        time.sleep(0.5 * indexed[0])
        return cloud.cli(*indexed[1])

    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(run, enumerate(commands)))


def test_concurrent_launches_and_resumes_have_one_winner_the_loser_names_it(cloud: Cloud) -> None:
    """Two `launch --name` of one name and two `resume` with different --set, at the same moment: the
    run registry's conditional writes let one register; the other caller exits 2 with one line naming
    the launch or resume that won and its settings (before: both exited 0, each printing its own).
    Between them, `resume --set` values the run cannot continue with are refused in one line."""
    cloud.deploy("1b-bf16")
    run = "ts-platform-1b-bf16--race"
    launches = concurrently(
        cloud,
        ("launch", "1b-bf16", "--local", "--name", "race", "--max-steps", "50"),
        ("launch", "1b-bf16", "--local", "--name", "race"),
    )
    assert sorted(r.returncode for r in launches) == [0, 2], [r.stderr for r in launches]
    (won,) = [r for r in launches if r.returncode == 0]
    lost = one_line_error(next(r for r in launches if r.returncode == 2))
    listed = cloud.run_of("1b-bf16", run)
    winner = listed["history"][0]["what"]
    assert winner in lost and run in lost, lost  # the winner's settings, whichever it was
    assert ("training.steps=50" in winner) == ("--max-steps" in won.args)
    assert [j["name"] for j in listed["jobs"]] == [f"{run}-1"]

    cloud.cli_json("stop", run, "--local")
    emulator_events.wait_for_status(cloud.env, f"{run}-1", ("Stopped",))
    cloud.deliver(f"{run}-1")
    put_checkpoint(cloud, listed["checkpoint_uri"], 40, complete=True)
    below = one_line_error(cloud.cli("resume", run, "--local", "--set", "training.steps=10"))
    assert below.startswith("error: --set training.steps=10: training.steps: 10 is below the run's step 40")
    warmup = one_line_error(cloud.cli("resume", run, "--local", "--set", "training.warmup_steps=999999"))
    assert "--set training.warmup_steps=999999: training.warmup_steps: 999,999 is not below" in warmup
    assert cloud.run_of("1b-bf16", run)["state"] == "stopped"  # nothing started

    resumes = concurrently(
        cloud,
        ("resume", run, "--local", "--set", "training.lr=0.0001"),
        ("resume", run, "--local", "--set", "training.lr=0.0002"),
    )
    assert sorted(r.returncode for r in resumes) == [0, 2], [r.stderr for r in resumes]
    lost = one_line_error(next(r for r in resumes if r.returncode == 2))
    listed = cloud.run_of("1b-bf16", run)
    change = listed["history"][-1]["what"]
    assert "training.lr" in change and change in lost, (change, lost)
    assert [j["name"] for j in listed["jobs"]] == [f"{run}-1", f"{run}-2"]  # one job 2, not two
    sent = cloud.sagemaker.describe_training_job(TrainingJobName=f"{run}-2")["HyperParameters"]
    assert sent["training.lr"] in change
