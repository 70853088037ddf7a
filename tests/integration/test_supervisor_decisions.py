"""The supervisor's decision as a pure function, and the state machine definitions that carry it: every
way a job can end gets its decision; the definitions retry every task, write only expressions DynamoDB
accepts, visit each state at most once, and stay far below Step Functions' 25,000 history events.

No emulator here (fast); test_supervisor_emulator.py runs the same cases through the state machine.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

import pytest
from supervisor_cases import CASES, STEPS, Case

from stacks.retries import CAPACITY_ERRORS, TRANSIENT_ERRORS, integration_of
from stacks.supervisor.asl import REGISTRY_ATTRIBUTES, constants_for
from stacks.supervisor.job_ended import job_ended_definition, rule_condition
from stacks.supervisor.reconcile import reconcile_definition
from stacks.supervisor.stalled import stalled_definition
from stacks.supervisor.start_job import start_job_definition
from trainstack.aws import supervisor
from trainstack.aws.request import Runtime, create_training_job_request
from trainstack.aws.supervisor import EndedJob, Outcome, RunRecord, next_action
from trainstack.planner import plan
from trainstack.recipes import naming
from trainstack.recipes.loader import resolve
from trainstack.recipes.schema import to_hyperparameters

pytestmark = pytest.mark.fast

HISTORY_LIMIT = 25_000  # Step Functions standard workflows fail an execution at 25,000 events
EVENTS_PER_STATE = 2  # entered, exited
EVENTS_PER_TASK_ATTEMPT = 4  # scheduled, started, submitted, succeeded/failed (at most)


def run_record(case: Case, run: str = "ts-platform-1b-bf16--abc-r1") -> RunRecord:
    job = naming.JOB_INDEX_MAX if case.last_index else 3
    current = f"{run}-3"
    return RunRecord(
        run=run,
        state=case.run_state,
        current_job=f"{run}-4" if case.stale else current,
        job=job,
        counted=20 if case.at_job_limit else 3,
        max_jobs=20,
        stop_requested=case.stop_requested,
        crashes=case.crashes,
        stalled_job=current if case.stalled else "",
        capacity_minutes=case.capacity_minutes,
        capacity_wait_minutes=case.capacity_wait,
        capacity_budget_minutes=case.capacity_budget,
        steps=STEPS,
        step=case.step_before,
        saved_step=case.saved_before,
    )


def ended(case: Case, run: RunRecord) -> EndedJob:
    return EndedJob(
        f"{run.run}-3", case.status, case.secondary, case.reason, case.final_step, case.saved_step
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_every_way_a_job_ends_gets_its_decision(case: Case) -> None:
    run = run_record(case)
    action = next_action(run, ended(case, run))
    assert (action.outcome.value, action.rule) == (case.outcome, case.rule)
    if action.outcome is Outcome.NEXT_JOB:
        assert action.next_job == 4 and f"{run.run}-4 starts" in action.next_step
        assert action.wait_minutes == case.wait_minutes
        assert action.counted == run.counted + (0 if case.wait_minutes else 1)  # a retry takes no slot
        if case.crashes_after is not None:
            assert action.crashes == case.crashes_after
    if case.reason and supervisor.REASON in supervisor.RULE_BY_ID.get(case.rule, supervisor.RULES[0]).why:
        assert case.reason in action.why  # the failure reason reaches the notification


def test_a_long_shortage_backs_off_spends_no_job_slot_and_ends_at_the_capacity_budget() -> None:
    """A day of P6 shortage: every try is a job SageMaker fails with CapacityError. The waits double
    up to two hours, no try spends a slot of compute.max_jobs (the run sits at its job limit throughout)
    and the run fails only when its capacity budget (compute.capacity_wait_hours) is spent."""
    case = next(c for c in CASES if c.id == "capacity")
    budget = 24 * 60
    run = RunRecord(
        "ts-p-r--x", "running", "ts-p-r--x-1", 1, counted=20, max_jobs=20, capacity_budget_minutes=budget
    )
    waits = []
    while True:
        action = next_action(run, EndedJob(run.current_job, "Failed", "Failed", case.reason))
        if action.outcome is not Outcome.NEXT_JOB:
            break
        waits.append(action.wait_minutes)
        assert action.counted == 20 and f"after a {action.wait_minutes}-minute wait" in action.next_step
        index = action.next_job
        run = RunRecord(
            run.run,
            "running",
            naming.job_of_run(run.run, index),
            index,
            counted=action.counted,
            max_jobs=20,
            capacity_minutes=action.capacity_minutes,
            capacity_wait_minutes=action.wait_minutes,
            capacity_budget_minutes=budget,
        )
    assert waits[:5] == [15, 30, 60, 120, 120] and sum(waits) <= budget < sum(waits) + 120
    assert (action.outcome, action.rule) == (Outcome.FAILED, supervisor.CAPACITY_BUDGET)
    assert len(waits) < 20  # about a day of shortage, about a dozen tries: names to spare (1035)
    # Any other end resets the back-off: the next shortage waits 15 minutes again.
    ran = next_action(run, EndedJob(run.current_job, "Stopped", "MaxRuntimeExceeded"))
    assert ran.rule == supervisor.JOB_LIMIT  # that job did spend the last slot


def test_the_trainers_fatal_exit_codes_end_the_run_and_its_other_failures_do_not() -> None:
    from trainstack.protocol.exit_codes import FATAL, failure_line

    run = RunRecord("ts-p-r--x", "running", "ts-p-r--x-1", 1)
    for code in (1, 2, 3, 4, 5, 6, 7, 137):
        reason = f"AlgorithmError: {failure_line(code, 'boom')}"
        action = next_action(run, EndedJob("ts-p-r--x-1", "Failed", "Failed", reason))
        assert (action.outcome is Outcome.FAILED) is (code in FATAL), code


def test_string_matches_is_step_functions_glob_only_star() -> None:
    assert supervisor.string_matches("CapacityError: x", "*CapacityError*")
    assert supervisor.string_matches("ClientError: x", "ClientError*")
    assert not supervisor.string_matches("AlgorithmError: ClientError", "ClientError*")
    assert supervisor.string_matches("a.b[c]?", "a.b[c]?")  # regex and fnmatch characters are literal
    assert not supervisor.string_matches("axb", "a.b")


def test_the_message_names_run_job_why_next_and_the_runs_checkpoints() -> None:
    case = next(c for c in CASES if c.id == "fatal-nan")
    run = run_record(case)
    job = EndedJob(f"{run.run}-3", "Failed", "Failed", case.reason)
    action = next_action(run, job)
    text = supervisor.message(
        recipe="1b-bf16",
        team="platform",
        team_option="",
        job=job,
        action=action,
        run=run.run,
        checkpoint_uri="s3://b/checkpoints/platform/1b-bf16/abc-r1/",
    )
    assert f"run {run.run} (platform/1b-bf16): job {run.run}-3 ended Failed (Failed) because" in text
    assert "loss became nan" in text and f"trainstack resume {run.run}" in text
    assert "Checkpoints: s3://b/checkpoints/platform/1b-bf16/abc-r1/." in text
    longest = naming.run_name(resolve("1b-bf16").recipe, "t" * 16, "x" * naming.RUN_ID_MAX).replace(
        "1b-bf16", "r" * 22
    )
    for outcome in supervisor.OUTCOME_WORDS:  # SNS: a subject is under 100 ASCII characters
        assert len(supervisor.subject(longest, outcome)) < 100


# --- The definitions ---------------------------------------------------------------------------------


@cache
def constants_for_tests(sets: tuple[str, ...] = ()):
    """The supervisor's constants for 1b-bf16 with literal values (table `runs`, topic `t`)."""
    recipe = resolve("1b-bf16", None, sets).recipe
    return constants_for(
        recipe,
        None,
        plan(recipe),
        table_name="runs",
        topic_arn="arn:aws:sns:us-east-1:123456789012:t",
        bucket_name="bucket",
    )


@cache
def definitions(sets: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """The supervisor's definitions for 1b-bf16 (with `sets`: as a redeploy with them would build them)."""
    recipe = resolve("1b-bf16", None, sets).recipe
    constants = constants_for_tests(sets)
    request = create_training_job_request(
        recipe,
        None,
        job_name=Runtime("$.Names.JobName"),
        run=Runtime("$.Run"),
        checkpoint_uri=Runtime("$.Names.CheckpointUri"),
        role_arn="arn:aws:iam::123456789012:role/x",
        image_uri="img:1",
        bucket_name="bucket",
        hyperparameters=Runtime(
            "States.JsonMerge($.Recipe.HyperParameters, $.HyperParameterOverrides, false)"
        ),
        keep_alive_seconds=Runtime("$.KeepAlivePeriodInSeconds"),
        region="us-east-1",
    )
    machines = "arn:aws:states:us-east-1:123456789012:stateMachine:"
    return {
        "StartJob": start_job_definition(
            constants, request=request, hyperparameters=to_hyperparameters(recipe)
        ),
        "JobEnded": job_ended_definition(constants),
        "Reconcile": reconcile_definition(
            table_name="runs", start_job_arn=f"{machines}StartJob", job_ended_arn=f"{machines}JobEnded"
        ),
        "StopStalled": stalled_definition(table_name="runs"),
    }


def successors(state: dict[str, Any]) -> set[str]:
    found = {state[k] for k in ("Next", "Default") if k in state}
    found |= {c["Next"] for c in state.get("Choices", [])}
    found |= {c["Next"] for c in state.get("Catch", [])}
    return found


@pytest.mark.parametrize("name", ["StartJob", "JobEnded"])
def test_every_state_is_reachable_and_none_is_visited_twice(name: str) -> None:
    """No loop: an execution visits each state at most once, so its history is bounded by its states."""
    definition = definitions()[name]
    states = definition["States"]
    assert all(s in states for state in states.values() for s in successors(state))
    seen, order, path = set(), [], set()

    def visit(state: str) -> None:
        assert state not in path, f"{name}: a loop through {state}"
        if state in seen:
            return
        path.add(state)
        for nxt in successors(states[state]):
            visit(nxt)
        path.discard(state)
        seen.add(state)
        order.append(state)

    visit(definition["StartAt"])
    assert seen == set(states), set(states) - seen


def history_bound(definition: dict[str, Any]) -> int:
    """The most history events one execution can produce: every state once, every task attempt its
    events, every retry taken (each state is visited at most once: see the test above)."""
    events = 2  # ExecutionStarted, ExecutionSucceeded/Failed
    for state in definition["States"].values():
        events += EVENTS_PER_STATE
        if state["Type"] == "Task":
            attempts = 1 + sum(r["MaxAttempts"] for r in state.get("Retry", []))
            events += attempts * EVENTS_PER_TASK_ATTEMPT
    return events


@pytest.mark.parametrize("name", ["StartJob", "JobEnded"])
def test_no_execution_can_come_near_the_history_limit(name: str) -> None:
    bound = history_bound(definitions()[name])
    # Independent of how long a job runs: a 28-day job has one StartJob and one JobEnded execution, a
    # 90-day run four of each; each stays under this bound.
    assert bound < HISTORY_LIMIT / 20, bound


def tasks() -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (name, state_name, state)
        for name, definition in definitions().items()
        for state_name, state in definition["States"].items()
        if state["Type"] == "Task"
    ]


def test_every_task_retries_the_transient_errors_of_its_integration_and_nothing_that_cannot_fire() -> None:
    for machine, name, state in tasks():
        errors = {e for r in state["Retry"] for e in r["ErrorEquals"]}
        assert set(TRANSIENT_ERRORS[integration_of(state["Resource"])]) <= errors, (machine, name)
        assert "States.Timeout" not in errors or "TimeoutSeconds" in state, (machine, name)
        assert all(r["MaxAttempts"] <= 20 and r.get("MaxDelaySeconds", 0) <= 7200 for r in state["Retry"])
    create = definitions()["StartJob"]["States"]["CreateTrainingJob"]
    assert any(set(CAPACITY_ERRORS) <= set(r["ErrorEquals"]) for r in create["Retry"])


def test_the_retried_error_names_are_the_ones_step_functions_emits() -> None:
    """Pinned: aws-sdk integrations `<Service>.<Code>Exception`, optimized DynamoDB `DynamoDB.<Code>`,
    optimized SNS `SNS.<Code>Exception` (stacks/retries.py cites the rules)."""
    assert TRANSIENT_ERRORS["aws-sdk:sagemaker"][:1] == ("SageMaker.ThrottlingException",)
    assert "SageMaker.SageMakerException" in TRANSIENT_ERRORS["aws-sdk:sagemaker"]
    assert "CloudWatch.ThrottlingException" in TRANSIENT_ERRORS["aws-sdk:cloudwatch"]
    assert {"DynamoDB.ProvisionedThroughputExceededException", "DynamoDB.ThrottlingException"} <= set(
        TRANSIENT_ERRORS["dynamodb"]
    )
    assert {"DynamoDB.RequestLimitExceeded", "DynamoDB.InternalServerError"} <= set(
        TRANSIENT_ERRORS["dynamodb"]
    )
    assert {"SNS.ThrottledException", "SNS.KMSThrottlingException"} <= set(TRANSIENT_ERRORS["sns"])
    assert CAPACITY_ERRORS == ("SageMaker.ResourceLimitExceededException",)


def placeholders(expression: str, mark: str) -> set[str]:
    import re

    return set(re.findall(rf"{mark}[A-Za-z_]+", expression))


def test_dynamodb_writes_use_every_name_and_value_they_define_and_define_every_one_they_use() -> None:
    """DynamoDB rejects an expression with an undefined or an unused attribute name or value."""
    checked = 0
    for machine, name, state in tasks():
        if not state["Resource"].startswith("arn:aws:states:::dynamodb:"):
            continue
        p = state["Parameters"]
        text = " ".join(p.get(k, "") for k in ("UpdateExpression", "ConditionExpression"))
        names = {k.removesuffix(".$") for k in p.get("ExpressionAttributeNames", {})}
        values = {k for k in p.get("ExpressionAttributeValues", {})}
        assert placeholders(text, "#") == names, (machine, name)
        assert placeholders(text, ":") == values, (machine, name)
        assert {v for k, v in p.get("ExpressionAttributeNames", {}).items() if not k.endswith(".$")} <= set(
            REGISTRY_ATTRIBUTES
        )
        checked += 1
    assert checked >= 6


def test_the_registry_item_a_launch_writes_has_every_attribute() -> None:
    item = definitions()["StartJob"]["States"]["RegisterRun"]["Parameters"]["Item"]
    assert set(item) == set(REGISTRY_ATTRIBUTES)
    for attribute, kind in REGISTRY_ATTRIBUTES.items():
        (written,) = item[attribute]
        assert written.removesuffix(".$") == kind, attribute


def test_the_decision_choice_is_the_rule_table_in_order() -> None:
    states = definitions()["JobEnded"]["States"]
    choices = states["Decide"]["Choices"]
    assert [c["Next"] for c in choices] == [f"Rule{r.id}" for r in supervisor.RULES]
    for choice, rule in zip(choices, supervisor.RULES, strict=True):
        assert {k: v for k, v in choice.items() if k != "Next"} == rule_condition(rule)
        decided = states[f"Rule{rule.id}"]["Parameters"]
        assert decided["Outcome"] == rule.outcome.value and decided["Rule"] == rule.id


def drive(ends: list[tuple]) -> tuple[list[tuple[str, int]], Any]:
    """Each end (status, secondary, reason, step[, saved step]) in turn through the pure decision, the
    run's record updated as the registry records it with the next job (its crashes, slots, step and
    saved step); [(rule, crashes)], the last action."""
    run, outcomes = RunRecord("ts-p-r--x", "running", "ts-p-r--x-1", 1, steps=STEPS), []
    for status, secondary, reason, step, *saved in ends:
        job = EndedJob(run.current_job, status, secondary, reason, step, *saved)
        action = next_action(run, job)
        outcomes.append((action.rule, action.crashes))
        if action.outcome is not Outcome.NEXT_JOB:
            break
        index = action.next_job
        run = RunRecord(
            run.run,
            "running",
            f"{run.run}-{index}",
            index,
            action.counted,
            crashes=action.crashes,
            capacity_minutes=action.capacity_minutes,
            capacity_wait_minutes=action.wait_minutes,
            steps=STEPS,
            step=supervisor.progress(run, job).step,
            saved_step=supervisor.progress(run, job).saved_step,
        )
    return outcomes, action


CRASH = "AlgorithmError: ExecuteUserScriptError: IndexError: index out of range"


def test_a_crash_that_repeats_ends_the_run_and_only_a_job_that_trained_resets_the_count() -> None:
    crashed = ("Failed", "Failed", CRASH, None)
    trained = ("Stopped", "MaxRuntimeExceeded", None, 5000, 5000)  # it trained and saved past step 0
    outcomes, action = drive([crashed, trained] + [crashed] * supervisor.MAX_CONSECUTIVE_CRASHES)
    repeats = [("Crashed", n) for n in range(1, supervisor.MAX_CONSECUTIVE_CRASHES)]
    assert outcomes == [("Crashed", 1), ("MaxRuntime", 0), *repeats, (supervisor.CRASH_LOOP, 0)]
    assert action.outcome is Outcome.FAILED
    assert action.why.startswith(
        f"{supervisor.MAX_CONSECUTIVE_CRASHES} jobs of the run in a row ended without a checkpoint past step "
        "5000"
    )
    assert CRASH in action.why and "trainstack resume ts-p-r--x" in action.next_step


def test_jobs_that_log_steps_past_the_last_but_complete_no_new_checkpoint_are_a_crash_loop() -> None:
    """What a whole run on the emulator found (test_whole_runs.py): a worker killed during its save of
    step 20. The save completes in the background, so one job logged step 25 before it died, another 20,
    each resuming from step 10. Counting the logged step as progress reset the count at random; the
    checkpoint each job completed is what the next job keeps."""
    first = ("Failed", "Failed", CRASH, 20, 10)  # saved step 10, killed during the save of 20
    retries = [("Failed", "Failed", CRASH, step, None) for step in (20, 25, 20, 25)]
    outcomes, action = drive([first, *retries])
    assert outcomes == [("Crashed", 1), ("Crashed", 2), (supervisor.CRASH_LOOP, 0)]
    assert action.outcome is Outcome.FAILED


def test_a_bug_alternating_with_capacity_errors_stops_after_three_crashes() -> None:
    """The review's case: a bug alternating with capacity errors (a P6 shortage) ran 20 paid crashing
    jobs, since any other end reset the count. Now it stops at MAX_CONSECUTIVE_CRASHES crashes."""
    crashed = ("Failed", "Failed", CRASH, None)
    between = ("Failed", "Failed", "CapacityError: Unable to provision requested ML compute capacity.", None)
    outcomes, action = drive([crashed, between] * 10)
    crashes = [rule for rule, _ in outcomes if rule == "Crashed"]
    assert len(crashes) == supervisor.MAX_CONSECUTIVE_CRASHES - 1
    assert outcomes[-1][0] == supervisor.CRASH_LOOP and action.outcome is Outcome.FAILED


# Every end that starts a next job, as a job that completed no checkpoint past the run's newest ends it
# (status, secondary, reason, logged step, saved step): issue 40's list and the rest of RULES' NEXT_JOB rows.
CAPACITY_END = ("Failed", "Failed", "CapacityError: Unable to provision requested ML compute capacity.", None)
ENDS_WITHOUT_PROGRESS = {
    "block-deadline-exit-0": ("Completed", "Completed", None, 0, 0),  # after a capacity block's deadline
    "block-end-no-step": ("Completed", "Completed", None, None),
    "internal-error": (
        "Failed",
        "Failed",
        "InternalServerError: We encountered an internal error. Please try again.",
        None,
    ),
    "spot-before-a-step": ("Stopped", "Interrupted", None, 0),
    "spot-wait": ("Failed", "MaxWaitTimeExceeded", "spot capacity", None),
    "max-runtime-no-step": ("Stopped", "MaxRuntimeExceeded", None, None),
    "max-runtime-steps-no-save": ("Stopped", "MaxRuntimeExceeded", None, 40),
    "crashed": ("Failed", "Failed", CRASH, 30),
    "stopped-as-stalled": ("Stopped", "Stopped", None, None),  # `drive` cannot mark it stalled: below
}


@pytest.mark.parametrize("end", sorted(ENDS_WITHOUT_PROGRESS), ids=sorted(ENDS_WITHOUT_PROGRESS))
def test_ends_without_progress_fail_the_run_at_the_third_whatever_their_status(end: str) -> None:
    """Issue 40: after a capacity block's deadline, jobs 2-20 each started, trained 0 steps and exited 0,
    the next started at once, and the 20th failed the run (compute.max_jobs). The same 20-job bound held
    for internal errors, spot interruptions before the first step and max-runtime ends without a step.
    Now every end that completes no checkpoint past the run's newest counts, and the third in a row
    fails the run with the last job's cause."""
    ended = ENDS_WITHOUT_PROGRESS[end]
    if end == "stopped-as-stalled":
        run = RunRecord("ts-p-r--x", "running", "ts-p-r--x-1", 1, steps=STEPS, stalled_job="ts-p-r--x-1")
        ended_job = EndedJob(run.current_job, *ended)
        counts = [next_action(replace(run, crashes=n), ended_job) for n in range(3)]
        assert [a.rule for a in counts] == ["Stalled", "Stalled", supervisor.CRASH_LOOP]
        return
    outcomes, action = drive([ended] * 25)
    assert len(outcomes) == supervisor.MAX_CONSECUTIVE_CRASHES, outcomes
    assert [n for _, n in outcomes[:-1]] == list(range(1, supervisor.MAX_CONSECUTIVE_CRASHES))
    assert outcomes[-1][0] == supervisor.CRASH_LOOP and action.outcome is Outcome.FAILED
    assert "this job ended because " in action.why and "trainstack resume" in action.next_step
    assert action.why.startswith(f"{supervisor.MAX_CONSECUTIVE_CRASHES} jobs of the run in a row ended")


def test_no_sequence_of_jobs_without_progress_reaches_the_job_limit() -> None:
    """Every sequence of four ends drawn from the ends without progress and capacity errors: the run
    fails after at most MAX_CONSECUTIVE_CRASHES paid jobs (capacity errors spend no slot and keep their
    own back-off and budget), so compute.max_jobs is never what stops it."""
    from itertools import product

    kinds = [v for k, v in ENDS_WITHOUT_PROGRESS.items() if k != "stopped-as-stalled"] + [CAPACITY_END]
    for sequence in product(kinds, repeat=4):
        outcomes, action = drive(list(sequence) * 10)
        paid = [rule for rule, _ in outcomes if rule not in ("Capacity", supervisor.CAPACITY_BUDGET)]
        assert len(paid) <= supervisor.MAX_CONSECUTIVE_CRASHES, (sequence, outcomes)
        assert action.outcome is Outcome.FAILED, sequence
        assert action.rule in (supervisor.CRASH_LOOP, supervisor.CAPACITY_BUDGET), sequence
        assert action.rule != supervisor.CAPACITY_BUDGET or not paid  # a shortage alone: its own budget


def test_a_job_that_saves_past_the_runs_newest_resets_the_count_whatever_its_end() -> None:
    """Progress resets the count: a block end, an internal error or a spot interruption that completed a
    checkpoint past the run's newest starts a fresh budget (a crash or stall counts 1 even then)."""
    saved = [
        ("Completed", "Completed", None, 100, 100),
        ("Failed", "Failed", "InternalServerError: We encountered an internal error.", 200, 200),
        ("Stopped", "Interrupted", None, 300, 300),
    ]
    nothing = ("Stopped", "MaxRuntimeExceeded", None, None)
    outcomes, action = drive([nothing, nothing, saved[0], nothing, nothing, saved[1], nothing, saved[2]])
    assert [n for _, n in outcomes] == [1, 2, 0, 1, 2, 0, 1, 0]
    assert action.outcome is Outcome.NEXT_JOB


@pytest.mark.parametrize(
    "reason",
    [
        "AlgorithmError: trainstack exit=1: botocore.exceptions.ClientError: An error occurred "
        "(InternalServerError) when calling the GetObject operation: We encountered an internal error.",
        "AlgorithmError: trainstack exit=1: RuntimeError: CapacityError while reading shard 17",
        "AlgorithmError: InternalServerError: CapacityError:",  # quoted after the start, either name
        "ClientError: CapacityError: the request's instance type",  # SageMaker refused the input
    ],
)
def test_only_a_reason_that_starts_with_sagemakers_error_name_is_retried(reason: str) -> None:
    """SageMaker writes `CapacityError: ...` and `InternalServerError: ...` at the start of FailureReason
    (supervisor.py cites where); a trainer's line that quotes them is a crash: 3 jobs, not 20 or 39."""
    run = RunRecord("ts-p-r--x", "running", "ts-p-r--x-1", 1, steps=STEPS)
    action = next_action(run, EndedJob(run.current_job, "Failed", "Failed", reason))
    assert action.rule in ("Crashed", "ClientError"), action
    assert action.rule != "ClientError" or reason.startswith("ClientError")
    outcomes, last = drive([("Failed", "Failed", reason, None)] * 25)
    assert len(outcomes) <= supervisor.MAX_CONSECUTIVE_CRASHES and last.outcome is Outcome.FAILED
    for pattern in ("CapacityError*", "InternalServerError*"):
        assert pattern in {r.reason_pattern for r in supervisor.RULES}
        assert not supervisor.string_matches(reason, pattern)


def test_a_completed_job_with_steps_left_starts_the_next_job_and_names_the_block_end() -> None:
    run = RunRecord("ts-p-r--x", "running", "ts-p-r--x-1", 1, steps=STEPS, step=200)
    action = next_action(run, EndedJob(run.current_job, "Completed", "Completed", None, 1234))
    assert (action.outcome, action.rule, action.next_job) == (Outcome.NEXT_JOB, "CapacityBlockEnd", 2)
    assert action.why.startswith(f"it completed at step 1234 of {STEPS} steps")
    assert "capacity block" in action.why and action.counted == 2
    done = next_action(run, EndedJob(run.current_job, "Completed", "Completed", None, STEPS))
    assert (done.outcome, done.rule) == (Outcome.COMPLETED, "Completed")


def test_the_states_the_cli_reads_a_registration_from_are_the_start_job_definitions() -> None:
    """`launch` / `resume` tell a won registration from a lost one by the state their execution entered
    next (trainstack.cli.commands.run_access; the CLI imports no CDK code, so the names are pinned here)."""
    from stacks.supervisor.start_job import CREATE_AT
    from trainstack.cli.commands.run_access import CREATED_AT, LOST_AT

    states = definitions()["StartJob"]["States"]
    assert CREATED_AT == CREATE_AT
    assert states["RegisterRun"]["Next"] == CREATE_AT and states["RegisterResume"]["Next"] == CREATE_AT
    assert states["RegisterRun"]["Catch"][0]["Next"] == LOST_AT["launch"]
    assert states["RegisterResume"]["Catch"][0]["Next"] == LOST_AT["resume"]
    assert all(states[s]["Type"] == "Succeed" for s in LOST_AT.values())
