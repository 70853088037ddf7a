"""A run meets the world: redeploys, lost events, a decision cut off half-way, a notifier that fails, a
stop racing a creation, a hung job, warm pools, job 100. Each driven through the supervisor's state
machines in the emulator (supervisor_cloud.py), as docs/runs.md's fault table lists them.

Where AWS differs from moto, the emulator follows AWS's documented behaviour (trainstack.emulator.events:
StopTrainingJob's Stopping phase, warm pools, alarm events); the capacity errors themselves are
FailureReasons of a job SageMaker ends Failed, driven in supervisor_cases.py.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from supervisor_cloud import PREFIX, TABLE, job_ended, launch, reconcile, start_job_ended, update
from test_supervisor_decisions import definitions

from stacks.monitoring.patterns import NOTIFY_STATES
from stacks.supervisor.stalled import STALLED_ALARM
from trainstack.aws import run_request
from trainstack.aws.registry import history_with, read_run, request_stop
from trainstack.aws.request import RESUME_STEP_ENV, execution_input, run_limits
from trainstack.emulator import events as emulator_events
from trainstack.protocol.metrics import FIELD_BY_KEY
from trainstack.recipes import naming

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("supervisor-emulator")]
CAPACITY = "CapacityError: Unable to provision requested ML compute capacity."
FATAL_REASON = "AlgorithmError: trainstack-fatal exit=2: training.lr: must be positive"


@pytest.fixture(scope="module")
def cloud(supervisor_cloud):
    return supervisor_cloud


def job(cloud, name: str) -> dict:
    return cloud.sagemaker.describe_training_job(TrainingJobName=name)


def job_exists(cloud, name: str) -> bool:
    return bool(cloud.sagemaker.list_training_jobs(NameContains=name)["TrainingJobSummaries"])


def registered(cloud, run: str, job_name: str, timeout_s: float = 60) -> None:
    """Wait until the run's record names `job_name` its current job (a decision was recorded)."""
    deadline = time.monotonic() + timeout_s
    while read_run(cloud.ddb, TABLE, run).current_job != job_name:
        assert time.monotonic() < deadline, f"{run}: {job_name} never registered"
        time.sleep(0.2)


def test_a_run_trains_its_recorded_request_whatever_was_deployed_since(cloud) -> None:
    """A redeploy with another learning rate and node count changes no running run: its next job is its
    recorded request with the next name. A run launched after the redeploy trains the new recipe."""
    run, _ = launch(cloud, "pinned")
    first = job(cloud, f"{run}-1")
    redeploy = ("training.lr=0.0009", "compute.instance_count=2")
    try:
        for name in ("StartJob", "JobEnded"):
            changed = json.loads(json.dumps(definitions(redeploy)[name]))
            if name == "JobEnded":
                changed["States"]["WaitForCapacity"] = {"Type": "Wait", "Seconds": 1, "Next": "NextInput"}
            cloud.sfn.update_state_machine(
                stateMachineArn=getattr(cloud, "start_job" if name == "StartJob" else "job_ended"),
                definition=json.dumps(changed),
            )
        emulator_events.end_training_job(cloud.env, f"{run}-1", "Stopped", "MaxRuntimeExceeded")
        decision, _ = job_ended(cloud, f"{run}-1")
        assert decision["Rule"] == "MaxRuntime"
        second = job(cloud, f"{run}-2")
        assert second["HyperParameters"] == first["HyperParameters"]
        assert second["HyperParameters"]["training.lr"] != "0.0009"
        assert second["ResourceConfig"]["InstanceCount"] == first["ResourceConfig"]["InstanceCount"] == 1
        # the recorded environment, and the one value that is the job's own: why its predecessor ended
        assert second["Environment"] == {**first["Environment"], "TRAINSTACK_PREVIOUS_JOB_END": "MaxRuntime"}
        newer, _ = launch(cloud, "after-redeploy")
        third = job(cloud, f"{newer}-1")
        assert third["HyperParameters"]["training.lr"] == "0.0009"
        assert third["ResourceConfig"]["InstanceCount"] == 2
    finally:
        for name in ("StartJob", "JobEnded"):
            original = json.loads(json.dumps(definitions()[name]))
            if name == "JobEnded":
                original["States"]["WaitForCapacity"] = {"Type": "Wait", "Seconds": 1, "Next": "NextInput"}
            cloud.sfn.update_state_machine(
                stateMachineArn=getattr(cloud, "start_job" if name == "StartJob" else "job_ended"),
                definition=json.dumps(original),
            )


def test_a_lost_event_is_decided_by_the_reconciler_once(cloud) -> None:
    run, _ = launch(cloud, "lost-event")
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Stopped", "MaxRuntimeExceeded")  # no event
    actions, _ = reconcile(cloud)
    assert {"Run": run, "Action": "decide"} in actions
    record = read_run(cloud.ddb, TABLE, run)
    assert record.current_job == f"{run}-2" and record.state == "running"
    assert job(cloud, f"{run}-2")["TrainingJobStatus"] == "InProgress"
    again, _ = reconcile(cloud)  # idempotent: nothing left to drive
    assert {"Run": run, "Action": "none"} in again
    assert [j.name for j in read_run(cloud.ddb, TABLE, run).jobs] == [f"{run}-1", f"{run}-2"]


def test_a_decision_cut_off_half_way_is_finished_by_the_reconciler(cloud) -> None:
    """JobEnded records the end and registers job 2 in one write, then waits for capacity; cut off
    there (an execution aborted, timed out or failed), job 2 is registered and never created. The
    reconciler creates it, exactly once."""
    run, _ = launch(cloud, "half-way")
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Failed", "Failed", CAPACITY)
    decision = start_job_ended(cloud, f"{run}-1", machine=cloud.job_ended_slow)
    registered(cloud, run, f"{run}-2")
    cloud.sfn.stop_execution(executionArn=decision, error="Test", cause="cut off during the capacity wait")
    assert not job_exists(cloud, f"{run}-2")
    actions, started = reconcile(cloud)
    assert {"Run": run, "Action": "recreate"} in actions
    assert job(cloud, f"{run}-2")["TrainingJobStatus"] == "InProgress"
    assert read_run(cloud.ddb, TABLE, run).creator in started  # claimed by the recreation
    again, _ = reconcile(cloud)
    assert {"Run": run, "Action": "none"} in again


def test_a_failed_notification_strands_no_run_and_fails_its_execution(cloud) -> None:
    """With the topic gone, the decision is recorded, the next job created, and only then does the
    publish fail: the execution ends failed (NotificationFailed), which the ExecutionFailed alarm
    reports on a topic of its own (test_cdk_supervisor.py)."""
    run, _ = launch(cloud, "mute")
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Stopped", "MaxRuntimeExceeded")
    cloud.sns.delete_topic(TopicArn="arn:aws:sns:us-east-1:123456789012:t")
    try:
        done = cloud.wait(start_job_ended(cloud, f"{run}-1"))
    finally:
        cloud.subscribe()
    assert (done["status"], done.get("error")) == ("FAILED", "NotificationFailed")
    assert read_run(cloud.ddb, TABLE, run).current_job == f"{run}-2"
    assert job(cloud, f"{run}-2")["TrainingJobStatus"] == "InProgress"


def test_a_stop_during_a_creation_stops_the_job_it_could_not_see(cloud) -> None:
    """`trainstack stop` asks while job 2 is registered and not yet created (here: a capacity wait that
    the stop did not end). The creation's own stop check stops job 2 at once; SageMaker passes through
    Stopping before Stopped ("When it receives a StopTrainingJob request, SageMaker changes the status
    of the job to Stopping. After SageMaker stops the job, it sets the status to Stopped": SageMaker API
    reference, StopTrainingJob; the emulator does the same); only its Stopped end stops the run."""
    run, _ = launch(cloud, "stop-race")
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Failed", "Failed", CAPACITY)
    decision = start_job_ended(cloud, f"{run}-1", machine=cloud.job_ended_slow)
    registered(cloud, run, f"{run}-2")
    request_stop(cloud.ddb, TABLE, run)  # the stop's conditional write, as the CLI makes it
    assert cloud.wait(decision)["status"] == "SUCCEEDED"
    assert job(cloud, f"{run}-2")["TrainingJobStatus"] in ("Stopping", "Stopped")
    emulator_events.wait_for_status(cloud.env, f"{run}-2", ("Stopped",))
    assert "Stopping" not in NOTIFY_STATES  # the supervisor hears the job only once it has stopped
    decided, _ = job_ended(cloud, f"{run}-2")
    assert (decided["Rule"], read_run(cloud.ddb, TABLE, run).state) == ("StopRequested", "stopped")


def test_a_stalled_job_is_stopped_and_its_run_continues_on_fresh_instances(cloud) -> None:
    """The Stalled alarm going to ALARM (CloudWatch's documented event, delivered to the stall rule)
    stops the job; the trainer saves on SIGTERM; the Stalled rule starts job 2, after releasing job 1's
    warm pool so that job 2 is not placed on the hung cluster."""
    run, _ = launch(cloud, "stalls", keep_alive=1800)
    step_metric = FIELD_BY_KEY["step"].metric_name
    alarm = f"{run}-1-{STALLED_ALARM}"
    (handled,) = emulator_events.deliver_alarm_state_change(cloud.env, alarm, f"{run}-1", step_metric)
    assert cloud.wait(handled)["status"] == "SUCCEEDED"
    assert read_run(cloud.ddb, TABLE, run).stalled == f"{run}-1"
    emulator_events.wait_for_status(cloud.env, f"{run}-1", ("Stopped",))
    decision, _ = job_ended(cloud, f"{run}-1")
    assert (decision["Outcome"], decision["Rule"]) == ("next_job", "Stalled")
    assert job(cloud, f"{run}-1")["WarmPoolStatus"]["Status"] == "Terminated"
    assert job(cloud, f"{run}-2")["TrainingJobStatus"] == "InProgress"
    assert read_run(cloud.ddb, TABLE, run).crashes == 1  # a stall counts toward the crash loop

    kept, _ = launch(cloud, "stalls-kept")  # monitoring.stop_stalled: false keeps only the alarm
    update(cloud, kept, {"stop_stalled": {"BOOL": False}})
    (left,) = emulator_events.deliver_alarm_state_change(
        cloud.env, f"{kept}-1-{STALLED_ALARM}", f"{kept}-1", step_metric
    )
    assert cloud.wait(left)["status"] == "SUCCEEDED"
    assert job(cloud, f"{kept}-1")["TrainingJobStatus"] == "InProgress"
    other = "ts-nlp-1b-bf16--x-1"  # another deployment's alarm starts nothing here
    assert emulator_events.deliver_alarm_state_change(cloud.env, f"{other}-Stalled", other, step_metric) == []


def test_a_healthy_end_leaves_its_warm_pool_to_the_next_job_and_a_crash_does_not(cloud) -> None:
    """SageMaker places a job on a matching warm pool ("If the warm pool identifies a second training
    job with matching specifications such as instance count or instance type, then the warm pool moves
    from the first training job to the second": developer guide, "SageMaker AI Managed Warm Pools"):
    after a max-runtime stop that is a faster restart; after a crash it would be the suspect cluster
    again, so JobEnded ends it first (UpdateTrainingJob KeepAlivePeriodInSeconds=0)."""
    run, _ = launch(cloud, "warm", keep_alive=1800)
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Stopped", "MaxRuntimeExceeded")
    job_ended(cloud, f"{run}-1")
    assert job(cloud, f"{run}-1")["WarmPoolStatus"] == {"Status": "Reused", "ReusedByJob": f"{run}-2"}
    emulator_events.end_training_job(cloud.env, f"{run}-2", "Failed", "Failed", "AlgorithmError: exit 1")
    decision, _ = job_ended(cloud, f"{run}-2")
    assert decision["Rule"] == "Crashed"
    assert job(cloud, f"{run}-2")["WarmPoolStatus"]["Status"] == "Terminated"
    assert job(cloud, f"{run}-3")["WarmPoolStatus"]["Status"] == "InUse"  # a new cluster


def test_resume_with_changes_records_them_and_job_101_is_named_past_two_digits(cloud) -> None:
    """A resume carries the run's request changed by `--set` (recorded) and `--from-step` (this job's
    environment only); the run's history gains the change; job 101 is `<run>-a1` (naming.job_suffix)."""
    run, _ = launch(cloud, "resumed")
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Failed", "Failed", "AlgorithmError: " + "x")
    update(cloud, run, {"crashes": {"N": "2"}})  # the third crash in a row fails the run
    assert job_ended(cloud, f"{run}-1")[0]["Rule"] == "CrashLoop"
    update(cloud, run, {"job_index": {"N": "100"}})  # as if it had run 100 jobs
    record = read_run(cloud.ddb, TABLE, run)
    before = run_request.recipe_of(record.request)
    after = run_request.apply_sets(before, ["training.lr=0.0001"])
    changed = run_request.changed_request(record.request, before, after, record.team)
    payload = execution_input(
        run,
        record.run_id,
        101,
        after.training.steps,
        record.overrides,
        0,
        "resume",
        request=changed,
        job_environment=run_request.resume_step_environment(40),
        limits=run_limits(after),
        history=history_with(record, "2026-12-01T00:00:00+00:00", "tester", "resume; training.lr changed"),
    )
    name = naming.job_of_run(run, 101)
    assert name == f"{run}-a1"
    started = cloud.sfn.start_execution(
        stateMachineArn=cloud.start_job, name=f"{name}-{uuid.uuid4().hex[:12]}", input=json.dumps(payload)
    )["executionArn"]
    assert cloud.wait(started)["status"] == "SUCCEEDED"
    resumed = job(cloud, name)
    assert resumed["HyperParameters"]["training.lr"] == "0.0001"
    assert resumed["Environment"][RESUME_STEP_ENV] == "40"
    record = read_run(cloud.ddb, TABLE, run)
    assert record.state == "running" and record.current_job == name and record.crashes == 0
    assert record.request["HyperParameters"]["training.lr"] == "0.0001"
    assert RESUME_STEP_ENV not in record.request["Environment"]  # --from-step is the resumed job's only
    assert [h.what for h in record.history] == ["launch", "resume; training.lr changed"]
    emulator_events.end_training_job(cloud.env, name, "Stopped", "MaxRuntimeExceeded")
    assert job_ended(cloud, name)[0]["NextJob"] == f"{run}-a2"
    later = job(cloud, f"{run}-a2")
    assert later["HyperParameters"]["training.lr"] == "0.0001" and RESUME_STEP_ENV not in later["Environment"]
    assert PREFIX in later["TrainingJobName"]


def test_the_reconciler_finds_a_job_by_its_exact_name_behind_a_hundred_lookalikes(cloud) -> None:
    """ListTrainingJobs' NameContains is a substring filter and MaxResults at most 100 a page: with
    more than 100 jobs whose names contain the current one (job `-1` and a run id that extends this
    one's), the job is not on the first page, whichever order the pages come in (AWS: newest first;
    moto: oldest first). The reconciler reads page after page and compares names exactly."""
    from stacks.supervisor.reconcile import LIST_PAGE_MAX

    run = f"{PREFIX}lookalike"
    first = f"{run}-1"
    template = job(cloud, f"{launch(cloud, 'lookalike-seed')[0]}-1")

    def lookalikes(tag: str) -> None:
        for i in range(LIST_PAGE_MAX + 10):
            cloud.sagemaker.create_training_job(
                TrainingJobName=f"{first}{tag}{i}",
                AlgorithmSpecification={"TrainingImage": "img:1", "TrainingInputMode": "File"},
                RoleArn=template["RoleArn"],
                OutputDataConfig={"S3OutputPath": "s3://bucket/out"},
                ResourceConfig={"InstanceType": "ml.m5.large", "InstanceCount": 1, "VolumeSizeInGB": 1},
                StoppingCondition={"MaxRuntimeInSeconds": 60},
            )

    lookalikes("0")  # older than the run's job
    launch(cloud, "lookalike")
    lookalikes("9")  # newer
    page = cloud.sagemaker.list_training_jobs(NameContains=first, MaxResults=LIST_PAGE_MAX)
    assert first not in [j["TrainingJobName"] for j in page["TrainingJobSummaries"]] and page.get("NextToken")
    emulator_events.end_training_job(cloud.env, first, "Stopped", "MaxRuntimeExceeded")  # its event lost
    actions, _ = reconcile(cloud)
    assert {"Run": run, "Action": "decide"} in actions
    assert read_run(cloud.ddb, TABLE, run).current_job == f"{run}-2"
    for name in (f"{first}09", f"{first}95"):  # never driven: they are no job of a run
        assert job(cloud, name)["TrainingJobStatus"] == "InProgress"


def export_machines(cloud) -> tuple[str, str, str]:
    """(Export, JobEnded with the on-complete hook, JobEnded whose hook starts a machine that does not
    exist) in the emulator, built as the launcher stack builds them (literal values for CDK tokens)."""
    from supervisor_cloud import RECIPE, TOPIC
    from test_supervisor_decisions import constants_for_tests

    from stacks.export import export_definition, export_on_complete_state, recorded_export_request
    from stacks.supervisor.job_ended import job_ended_definition
    from trainstack.aws.export_job import STEP_ARGUMENT, export_job_request
    from trainstack.aws.request import Runtime
    from trainstack.aws.supervisor import export_failed_template

    if hasattr(cloud, "export_machines"):
        return cloud.export_machines
    request = recorded_export_request(
        export_job_request(
            RECIPE,
            None,
            job_name=Runtime("$.Export.Job"),
            checkpoint_uri=Runtime("$.Export.Checkpoint"),
            out_parent=Runtime("$.Export.OutParent"),
            step=STEP_ARGUMENT,
            role_arn="arn:aws:iam::123456789012:role/x",
            image_uri="img:1",
            bucket_name="bucket",
            region="us-east-1",
        )
    )
    role = "arn:aws:iam::123456789012:role/supervisor"

    def machine(name: str, definition: dict) -> str:
        return cloud.sfn.create_state_machine(name=name, definition=json.dumps(definition), roleArn=role)[
            "stateMachineArn"
        ]

    export = machine(
        "Export",
        export_definition(
            request,
            TABLE,
            "s3://bucket/exports/platform/1b-bf16/",
            TOPIC,
            export_failed_template("1b-bf16", "platform", ""),
        ),
    )
    missing = export.replace(":Export", ":NoSuchExport")
    hooked = [
        job_ended_definition(constants_for_tests(), on_complete=export_on_complete_state(arn))
        for arn in (export, missing)
    ]
    for d in hooked:
        d["States"]["WaitForCapacity"] = {"Type": "Wait", "Seconds": 1, "Next": "NextInput"}  # EMULATOR
    cloud.export_machines = (
        export,
        machine("JobEndedExport", hooked[0]),
        machine("JobEndedNoExport", hooked[1]),
    )
    return cloud.export_machines


def record_request(cloud, run: str, *sets: str) -> None:
    """Change the run's recorded request as `resume --set` does (run_request.changed_request)."""
    record = read_run(cloud.ddb, TABLE, run)
    before = run_request.recipe_of(record.request)
    after = run_request.apply_sets(before, list(sets))
    changed = run_request.changed_request(record.request, before, after, None)
    update(cloud, run, {"request": {"S": json.dumps(changed)}})


def complete(cloud, run: str, machine: str) -> dict:
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Completed", "Completed")
    done = cloud.wait(start_job_ended(cloud, f"{run}-1", machine=machine))
    assert done["status"] == "SUCCEEDED", done
    return json.loads(done["output"])


def test_every_export_setting_is_the_runs_recorded_one_and_a_failed_export_is_told(cloud) -> None:
    """export.on_complete and the export's own settings come from the run's recorded request (what
    `resume --set` changed), never from what is deployed at completion time; an export job that fails,
    and an on-complete export that cannot start, reach the notification topic and the run's record."""
    export, hooked, broken = export_machines(cloud)
    # Deployed with export.on_complete false (1b-bf16); this run's record asks for it, as bf16 -> fp32.
    wanted, _ = launch(cloud, "export-on")
    record_request(cloud, wanted, "export.on_complete=true", "export.dtype=fp32")
    cloud.messages()
    assert complete(cloud, wanted, hooked)["Outcome"] == "completed"
    (started,) = [e for e in cloud.sfn.list_executions(stateMachineArn=export)["executions"]]
    assert cloud.wait(started["executionArn"])["status"] == "SUCCEEDED"
    exported = job(cloud, f"{wanted}-X1")
    assert exported["HyperParameters"]["export.dtype"] == '"fp32"'  # the record's, not the deployed bf16
    assert exported["Environment"]["TRAINSTACK_EXPORT_OF"] == wanted
    assert [e["reason"] for e in read_run(cloud.ddb, TABLE, wanted).exports] == ["on_complete"]

    # The deployed recipe would export (a redeploy with export.on_complete true); this run's record says
    # false: no export.
    unwanted, _ = launch(cloud, "export-off")
    assert complete(cloud, unwanted, hooked)["Outcome"] == "completed"
    assert len(cloud.sfn.list_executions(stateMachineArn=export)["executions"]) == 1

    # The export job fails: recorded in the run's export_failures and published to the topic.
    cloud.messages()
    reason = "AlgorithmError: trainstack-fatal exit=2: tokenizer files not found"
    emulator_events.end_training_job(cloud.env, f"{wanted}-X1", "Failed", "Failed", reason)
    decided, _ = job_ended(cloud, f"{wanted}-X1")
    assert (decided["Outcome"], decided["Rule"]) == ("ignored", "ExportFailed")
    record = read_run(cloud.ddb, TABLE, wanted)
    assert record.state == "completed"  # the run itself is unchanged
    ((failure),) = record.export_failures
    assert (failure["job"], failure["status"], failure["reason"]) == (f"{wanted}-X1", "Failed", reason)
    (note,) = cloud.messages()
    assert f"export job {wanted}-X1 ended Failed: {reason}" in note and f"trainstack export {wanted}" in note

    # The on-complete export cannot start (its machine is gone): the run completes, the failure is told.
    gone, _ = launch(cloud, "export-gone")
    record_request(cloud, gone, "export.on_complete=true")
    decided = complete(cloud, gone, broken)
    assert decided["Outcome"] == "completed" and "on-complete export did not start" in decided["Next"]
    record = read_run(cloud.ddb, TABLE, gone)
    assert record.state == "completed" and [f["status"] for f in record.export_failures] == ["NotStarted"]
    (note,) = cloud.messages()
    assert "its on-complete export did not start" in note


def test_concurrent_registrations_of_one_run_have_exactly_one_winner(cloud) -> None:
    """What `launch` and `resume` rely on (run_access.registration_won): a ConditionExpression is
    evaluated atomically with its write, so of concurrent conditional writes to one item exactly one
    succeeds and the others fail with ConditionalCheckFailedException (DynamoDB developer guide,
    "Condition expressions"; API reference PutItem/UpdateItem). Pinned against the emulator under real
    concurrency: 8 PutItems racing `attribute_not_exists`, then 4 StartJob resumes of one failed run
    started at once, each with its own change: one registers job 2 and creates it, the others end at
    NotStarted and create nothing."""
    from concurrent.futures import ThreadPoolExecutor

    from trainstack.cli.commands.run_access import CREATED_AT, LOST_AT

    key = f"race-{uuid.uuid4().hex[:8]}"

    def put(i: int) -> bool:
        try:
            cloud.ddb.put_item(
                TableName=TABLE,
                Item={"run": {"S": key}, "writer": {"N": str(i)}},
                ConditionExpression="attribute_not_exists(#run)",
                ExpressionAttributeNames={"#run": "run"},
            )
            return True
        except cloud.ddb.exceptions.ConditionalCheckFailedException:
            return False

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(put, range(8)))
    assert won.count(True) == 1
    item = cloud.ddb.get_item(TableName=TABLE, Key={"run": {"S": key}}, ConsistentRead=True)["Item"]
    assert item["writer"]["N"] == str(won.index(True))
    cloud.ddb.delete_item(TableName=TABLE, Key={"run": {"S": key}})

    run, _ = launch(cloud, "resume-race")
    emulator_events.end_training_job(cloud.env, f"{run}-1", "Failed", "Failed", FATAL_REASON)
    assert job_ended(cloud, f"{run}-1")[0]["Rule"] == "Fatal"
    record = read_run(cloud.ddb, TABLE, run)
    before = run_request.recipe_of(record.request)

    def start(lr: str) -> str:
        after = run_request.apply_sets(before, [f"training.lr={lr}"])
        payload = execution_input(
            run,
            record.run_id,
            2,
            after.training.steps,
            record.overrides,
            0,
            "resume",
            request=run_request.changed_request(record.request, before, after, record.team),
            limits=run_limits(after),
            history=history_with(record, "2026-12-01T00:00:00+00:00", "tester", f"resume lr={lr}"),
        )
        return cloud.sfn.start_execution(
            stateMachineArn=cloud.start_job,
            name=f"{run}-2-{uuid.uuid4().hex[:12]}",
            input=json.dumps(payload),
        )["executionArn"]

    # Started back to back, not in the same instant (EMULATOR: moto's Step Functions can leave executions
    # started concurrently RUNNING with no history); their registrations still race.
    rates = ["0.0001", "0.0002", "0.0003", "0.0004"]
    arns = [start(rate) for rate in rates]
    entered = []
    for arn in arns:
        assert cloud.wait(arn)["status"] == "SUCCEEDED"
        names = {
            e["stateEnteredEventDetails"]["name"]
            for e in cloud.events(arn)
            if "stateEnteredEventDetails" in e
        }
        entered.append(CREATED_AT in names and LOST_AT["resume"] not in names)
    assert entered.count(True) == 1
    winner = rates[entered.index(True)]
    record = read_run(cloud.ddb, TABLE, run)
    assert [h.what for h in record.history][-1] == f"resume lr={winner}"
    assert job(cloud, f"{run}-2")["HyperParameters"]["training.lr"] == winner
    assert [j.name for j in record.jobs] == [f"{run}-1", f"{run}-2"]
