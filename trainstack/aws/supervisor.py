"""The run supervisor's one decision: a job of a run has ended; what happens to the run?

`next_action(run, ended_job)` is a pure function. The "job ended" state machine
(stacks/supervisor/job_ended.py) makes the same decision with Choice states generated from the same
table, `RULES`, and a test drives a table of cases through both
(tests/integration/test_supervisor_emulator.py).

What a job's end says (SageMaker API reference: DescribeTrainingJob `TrainingJobStatus`,
`SecondaryStatus`, `FailureReason`; the SecondaryStatus enum of the service model lists Starting,
Downloading, Training, Uploading, Stopping, Stopped, MaxRuntimeExceeded, Completed, Failed, Interrupted,
MaxWaitTimeExceeded, ...):

- `Completed`: the trainer exited 0 on its own. Either it trained the run's steps, or (with a training
  plan) it saved and exited before its capacity block ended (training_image/trainer/runtime/capacity.py): the
  steps decide which. A job's step is the last `train:step` SageMaker parsed from the trainer's metric
  line, DescribeTrainingJob `FinalMetricDataList` ("the names, values, and dates and times that the
  training algorithm emitted", SageMaker API reference). Chosen over the checkpoint marker and the
  failure file: it is in the description the decision reads anyway (no S3 read, no extra permission,
  no key), it exists for a job of any end (the failure file only for a failed one), and the trainer
  prints the line at its last step and at every stop (training_image/trainer/train.py). Without one
  (no step logged: "nothing to do", or a block that ended before the first step) the run's recorded
  step decides. The run's steps are done when that step reaches `training.steps`; a `Completed` job
  short of them is a capacity-block end (CAPACITY_BLOCK_END) and the next job continues;
- `Stopped` / `MaxRuntimeExceeded`: the job reached `StoppingCondition.MaxRuntimeInSeconds` (at most 28
  days); SageMaker sent SIGTERM and the trainer saved. The next job continues;
- `Interrupted` (managed spot) and `MaxWaitTimeExceeded`: spot capacity went away or never came back in
  time. The next job continues;
- `Stopped` otherwise: someone called StopTrainingJob. Through `trainstack stop` the run's record says
  so (a stop request); through the stall handler it names the job as stalled (the run continues, on
  fresh instances); from the console or another script it says neither, and the run stops all the same.
  A stop request never hides an end that says more: a completed job, a fatal or a client error keep
  theirs (those rules come first);
- `Failed`: `FailureReason` says why. SageMaker copies the trainer's failure file into it
  (trainstack.protocol.exit_codes); a line with `trainstack-fatal` names a failure the next job would repeat
  (a mistake in the recipe or data, a diverged loss, no EFA). `ClientError: ...` is SageMaker refusing
  the job's own input (role, image, data channel). SageMaker Pipelines' retry policy documents
  `InternalServerError` and EC2 `InsufficientCapacityError` (`CapacityError: ...`) as worth a new job
  (SageMaker developer guide, "Retry Policy for Pipeline Steps"). Both are matched only at the start of
  the reason, where SageMaker writes them: AWS Batch's guide reads a SageMaker capacity failure as
  "failedReason begins with CapacityError" (AWS Batch user guide, "Jobs stuck in RUNNABLE due to
  capacity"), and SageMaker's internal failure reads `InternalServerError: We encountered an internal
  error. Please try again.` (aws/sagemaker-python-sdk#70, #2496). The trainer's own failure line
  (`AlgorithmError: trainstack exit=1: ... (InternalServerError) when calling the GetObject operation`)
  may quote either name anywhere after its start: that is a crash, not a retry. A capacity error waits
  first, longer each time in a row (CAPACITY_BACKOFF_MINUTES), spends no slot of `compute.max_jobs`,
  and the run's waits are bounded by `compute.capacity_wait_hours`. Any other failure (a node or a
  collective lost, the trainer killed) is worth the next job, which resumes from the newest complete
  checkpoint on new instances.

Progress is the currency of retries. A job that ends without completing a checkpoint past the newest
any job of the run reported (SAVED_METRIC, read by SageMaker from the trainer's `checkpoint complete:`
line) made no progress, whatever its status or exit code: a `Completed` job after its capacity block's
deadline that trained 0 steps, an internal error, a spot interruption before the first save, a max
runtime too short to reach one, a crash. Every such end counts, and MAX_CONSECUTIVE_CRASHES of them in
a row fail the run for a person (CRASH_LOOP, its why naming the last cause), so no sequence of
progress-less jobs can reach `compute.max_jobs` (issue 40: 19 jobs after a block's deadline, each
exiting 0 at step 0, each started at once). Only a job that completed a checkpoint past the run's
newest resets the count (a crash or stall counts even then: the one after it must save again). Not
its logged step: a job that trains on and crashes before its save completes (saves complete in the
background, after later steps) leaves the next job where it started, and a loop of such jobs, each
logging a few steps more or less, must still end. A capacity error (no instance ever ran) neither
counts nor resets: it has its own back-off and budget, and a bug alternating with capacity errors
still stops after MAX_CONSECUTIVE_CRASHES paid jobs.

The patterns are Step Functions `StringMatches` globs (only `*` is special), so the deployed Choice
states apply them exactly as `string_matches` below does.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from enum import StrEnum

from trainstack.protocol.exit_codes import FATAL_MARKER
from trainstack.protocol.metrics import FIELD_BY_KEY, SAVED_STEP_METRIC
from trainstack.recipes.naming import JOB_INDEX_MAX, job_of_run

# After a capacity failure the next job waits before it asks again, longer each time in a row (minutes):
# a shortage of P6 instances lasts hours to days, and every try is a cluster request. The waits of a run
# since it was launched or resumed are summed and bounded by compute.capacity_wait_hours; capacity
# failures spend no slot of compute.max_jobs.
CAPACITY_BACKOFF_MINUTES = (15, 30, 60, 120)
CAPACITY_WAIT_MINUTES = CAPACITY_BACKOFF_MINUTES[0]
CAPACITY_WAIT_MAX_MINUTES = CAPACITY_BACKOFF_MINUTES[-1]
# Jobs in a row that may end without progress (crashed, stalled, or any other end that completed no
# checkpoint past the run's newest; capacity errors aside) before the run stops for a person. A lost node
# or a collective timeout is gone in the next job, which gets new instances; the same end three times
# over is a bug, bad data or a setting (a max runtime too short to save, a capacity block already over)
# that more jobs would only pay for again (each one a cluster start-up and a restore, about 105 USD
# billed for 64b-fp8, docs/runs.md).
MAX_CONSECUTIVE_CRASHES = 3
# The reconciler's period: how long a run whose event was lost, or whose decision failed half-way, can
# wait for its next decision (stacks/supervisor/reconcile.py).
RECONCILE_MINUTES = 10


class Outcome(StrEnum):
    NEXT_JOB = "next_job"  # start the run's next job
    COMPLETED = "completed"
    STOPPED = "stopped"
    FAILED = "failed"
    IGNORED = "ignored"  # not the run's current job, or the run is not running: nothing changes


# The run's state after each outcome (IGNORED leaves it as it is).
RUN_STATE = {
    Outcome.NEXT_JOB: "running",
    Outcome.COMPLETED: "completed",
    Outcome.STOPPED: "stopped",
    Outcome.FAILED: "failed",
}
RUN_STATES = ("running", "stopped", "completed", "failed")
REASON = "{reason}"  # where a rule's `why` puts the job's FailureReason
STEP, STEPS = "{step}", "{steps}"  # ... the step the job reached, and the run's training.steps
STEP_METRIC = FIELD_BY_KEY["step"].metric_name  # train:step: the FinalMetricDataList entry of a job's step
SAVED_METRIC = SAVED_STEP_METRIC  # train:saved_step: the step of the newest checkpoint the job completed


@dataclass(frozen=True)
class Rule:
    """One row of the decision table. A rule matches when every condition it names holds."""

    id: str  # also the name of its Step Functions state: letters only
    outcome: Outcome
    why: str  # for the notification and the run's record; REASON is replaced by the FailureReason
    status: tuple[str, ...] = ()  # TrainingJobStatus is one of these
    secondary: tuple[str, ...] = ()  # SecondaryStatus is one of these
    reason_pattern: str | None = None  # FailureReason StringMatches this glob
    stop_requested: bool | None = None  # the run's record asks to stop
    stalled: bool | None = None  # the record names this job as the one the supervisor stopped as stalled
    steps_done: bool | None = None  # the run's steps are done (the job's step, else the record's)
    # NEXT_JOB only:
    capacity: bool = False  # wait with the capacity back-off first; the next job takes this job's slot
    # Counts toward MAX_CONSECUTIVE_CRASHES even after progress (a crash or a stall); any other NEXT_JOB
    # rule but a capacity error counts only when the job completed no checkpoint past the run's newest.
    crash: bool = False
    # The ended job's instances are suspect: its warm pool is released (UpdateTrainingJob
    # KeepAlivePeriodInSeconds=0) so that no later job of the run is placed on them.
    fresh_instances: bool = False

    def matches(self, job: EndedJob, run: RunRecord) -> bool:
        if self.status and job.status not in self.status:
            return False
        if self.secondary and job.secondary_status not in self.secondary:
            return False
        if self.reason_pattern is not None and not string_matches(
            job.failure_reason or "", self.reason_pattern
        ):
            return False
        if self.stalled is not None and (run.stalled_job == job.name) != self.stalled:
            return False
        if self.steps_done is not None and progress(run, job).done != self.steps_done:
            return False
        return self.stop_requested is None or self.stop_requested == run.stop_requested


# In order: the first rule that matches decides. The job's own end comes first where it says more than
# a stop request would: a job that completed, or failed in a way the next job would repeat, keeps that
# end (and its reason) even when `trainstack stop` raced it. Rules that read FailureReason name status
# Failed, the only status with a reason.
RULES: tuple[Rule, ...] = (
    Rule(
        "Completed",
        Outcome.COMPLETED,
        "the trainer finished the steps of the run",
        status=("Completed",),
        steps_done=True,
    ),
    Rule(
        "Fatal",
        Outcome.FAILED,
        f"the trainer reported a failure the next job would repeat: {REASON}",
        status=("Failed",),
        reason_pattern=f"*{FATAL_MARKER}*",
    ),
    Rule(
        "ClientError",
        Outcome.FAILED,
        f"SageMaker refused the input of the job (role, image, data or request): {REASON}",
        status=("Failed",),
        reason_pattern="ClientError*",
    ),
    Rule("StopRequested", Outcome.STOPPED, "it was stopped by trainstack stop", stop_requested=True),
    Rule(
        "CapacityBlockEnd",
        Outcome.NEXT_JOB,
        f"it completed at step {STEP} of {STEPS} steps: the trainer saved and exited before its "
        "capacity block (training plan) ended",
        status=("Completed",),
        steps_done=False,
    ),
    Rule(
        "Stalled",
        Outcome.NEXT_JOB,
        "it made no step progress for monitoring.stall_minutes, so the supervisor stopped it (the trainer "
        "saved on SIGTERM)",
        status=("Stopped",),
        stalled=True,
        crash=True,
        fresh_instances=True,
    ),
    Rule(
        "MaxRuntime",
        Outcome.NEXT_JOB,
        "it reached its max runtime (StoppingCondition.MaxRuntimeInSeconds) and saved on SIGTERM",
        secondary=("MaxRuntimeExceeded",),
    ),
    Rule(
        "SpotInterrupted", Outcome.NEXT_JOB, "its spot capacity was interrupted", secondary=("Interrupted",)
    ),
    Rule(
        "SpotWait",
        Outcome.NEXT_JOB,
        "it waited for spot capacity longer than MaxWaitTimeInSeconds",
        secondary=("MaxWaitTimeExceeded",),
    ),
    Rule(
        "StoppedElsewhere",
        Outcome.STOPPED,
        "it was stopped outside trainstack (StopTrainingJob from the console or another client)",
        status=("Stopped",),
    ),
    Rule(
        "Capacity",
        Outcome.NEXT_JOB,
        f"SageMaker could not provision its instances: {REASON}",
        status=("Failed",),
        reason_pattern="CapacityError*",
        capacity=True,
    ),
    Rule(
        "InternalError",
        Outcome.NEXT_JOB,
        f"SageMaker had an internal error: {REASON}",
        status=("Failed",),
        reason_pattern="InternalServerError*",
        fresh_instances=True,
    ),
    Rule(
        "Crashed",
        Outcome.NEXT_JOB,
        f"it failed without a trainstack-fatal reason (a node, a collective or the process lost): {REASON}",
        status=("Failed",),
        crash=True,
        fresh_instances=True,
    ),
)
RULE_BY_ID = {rule.id: rule for rule in RULES}
assert all(rule.id.isalpha() for rule in RULES) and len(RULE_BY_ID) == len(RULES)
assert all(REASON not in r.why or r.status == ("Failed",) for r in RULES)  # only Failed has a reason
assert all(r.outcome is Outcome.NEXT_JOB or not (r.capacity or r.crash) for r in RULES)

CAPACITY_BLOCK_END = "CapacityBlockEnd"
JOB_LIMIT = "JobLimit"  # the id of the decision that ends a run at compute.max_jobs
CRASH_LOOP = "CrashLoop"  # the id of the decision that ends a run after repeated crashes
CAPACITY_BUDGET = "CapacityBudget"  # ... after waiting compute.capacity_wait_hours for capacity
NO_JOB_NAMES = "NoJobNames"  # ... when naming.JOB_INDEX_MAX jobs have been named
CRASH_LOOP_WHY = (
    "{crashes} jobs of the run in a row ended without a checkpoint past step {saved} (crashed, stalled, or "
    "stopped or completed before their first save), so the next would most likely end the same way"
)
JOB_LIMIT_WHY = (
    "the run reached its job limit ({counted} jobs since it was launched or resumed, compute.max_jobs "
    "{max_jobs}; capacity retries not counted)"
)
CAPACITY_BUDGET_WHY = (
    "the run would wait {minutes} minutes for capacity since it was launched or resumed, more than its "
    "compute.capacity_wait_hours allow ({budget} minutes)"
)
NO_JOB_NAMES_WHY = f"the run has named all {JOB_INDEX_MAX} jobs a run name has room for"
IGNORED_WHY = "it is not the current job of the run, or the run is no longer running"
WAIT_TEXT = " after a {minutes}-minute wait for capacity"
NEXT = {
    Outcome.NEXT_JOB: "job {next_job} starts{when} and resumes from the newest checkpoint of the run",
    Outcome.COMPLETED: "nothing: the run is complete",
    Outcome.STOPPED: "nothing until it is resumed: trainstack resume {run}",
    Outcome.FAILED: "a person must look at it: fix the cause, then trainstack resume {run}",
    Outcome.IGNORED: "nothing changes",
}


@dataclass(frozen=True)
class EndedJob:
    """A training job that reached Completed, Failed or Stopped (DescribeTrainingJob's fields)."""

    name: str
    status: str
    secondary_status: str
    failure_reason: str | None = None
    final_step: int | None = None  # the last train:step of FinalMetricDataList; None: none was logged
    saved_step: int | None = None  # the last train:saved_step; None: the job completed no checkpoint


@dataclass(frozen=True)
class RunRecord:
    """What the run registry says about the run when one of its jobs ends."""

    run: str  # ts-<team>-<recipe>--<run id>
    state: str  # one of RUN_STATES
    current_job: str  # the name of its newest job
    job: int  # that job's index
    counted: int = 1  # jobs since launch or resume that spent a slot of max_jobs, the current one included
    max_jobs: int = 20  # compute.max_jobs of the run's recipe
    stop_requested: bool = False
    crashes: int = 0  # jobs in a row, up to the previous one, that ended without progress (or crashed)
    stalled_job: str = ""  # the job the supervisor stopped because it stalled
    capacity_minutes: int = 0  # minutes waited for capacity since launch or resume
    capacity_wait_minutes: int = 0  # the last capacity wait, when the previous job also lacked capacity
    capacity_budget_minutes: int = 72 * 60  # compute.capacity_wait_hours of the run's recipe
    steps: int = 0  # training.steps of the run (0: unknown, as in records before steps were read)
    step: int = 0  # the step the previous job reported (its final train:step), 0 before any
    saved_step: int = 0  # the newest checkpoint step a job of the run reported (train:saved_step)


@dataclass(frozen=True)
class Action:
    outcome: Outcome
    rule: str  # the id of the rule that decided (JOB_LIMIT, CRASH_LOOP, ..., or "Ignored")
    why: str  # why the job ended, in words
    next_step: str  # what happens next, in words
    next_job: int | None = None  # NEXT_JOB: the index of the job to start
    wait_minutes: int = 0
    crashes: int = 0  # NEXT_JOB: the ends without progress in a row, this job's included, recorded
    counted: int = 0  # NEXT_JOB: the slots of max_jobs spent, the next job included
    capacity_minutes: int = 0  # NEXT_JOB: minutes waited for capacity, this wait included
    fresh_instances: bool = False  # the ended job's warm pool is released

    @property
    def run_state(self) -> str | None:
        return RUN_STATE.get(self.outcome)


@dataclass(frozen=True)
class Progress:
    """What the ended job's steps say: the run's step now, whether the job completed a checkpoint past
    the newest the run had (progress the next job keeps), and whether the run's steps are done."""

    step: int  # the job's step, or the record's when it logged none (recorded for the next decision)
    advanced: bool
    done: bool
    saved_step: int  # the newest checkpoint step now (recorded for the next decision)


def progress(run: RunRecord, job: EndedJob) -> Progress:
    step = job.final_step if job.final_step is not None else run.step
    advanced = job.saved_step is not None and job.saved_step > run.saved_step
    saved = job.saved_step if advanced else run.saved_step
    return Progress(step, advanced, step >= run.steps, saved)


def crashes_after(rule: Rule, run: RunRecord, job: EndedJob) -> int:
    """The ends without progress in a row after `job`'s end. A capacity error keeps the count (no
    instance ran; it has its own back-off and budget). A job that completed a checkpoint past the run's
    newest resets it (to 1 for a crash or stall: the job after it must save again); any other end adds
    one, whatever its status: Completed at step 0 after a capacity block's deadline, an internal error,
    a spot interruption or a max runtime before the first save, a crash."""
    if rule.capacity:
        return run.crashes
    if progress(run, job).advanced:
        return 1 if rule.crash else 0
    return run.crashes + 1


def why_of(rule: Rule, run: RunRecord, job: EndedJob) -> str:
    return (
        rule.why.replace(REASON, job.failure_reason or "")
        .replace(STEPS, str(run.steps))
        .replace(STEP, str(progress(run, job).step))
    )


def string_matches(value: str, pattern: str) -> bool:
    """Step Functions' StringMatches: `*` matches any run of characters, everything else itself."""
    regex = ".*".join(re.escape(part) for part in pattern.split("*"))
    return re.fullmatch(regex, value, flags=re.DOTALL) is not None


def capacity_wait(previous_minutes: int) -> int:
    """The wait before the next try after a capacity failure: the back-off's first step after the
    previous wait (0: the previous job did not lack capacity)."""
    return next((m for m in CAPACITY_BACKOFF_MINUTES if m > previous_minutes), CAPACITY_WAIT_MAX_MINUTES)


def next_job_text(run: str, index: int, wait_minutes: int) -> str:
    when = WAIT_TEXT.format(minutes=wait_minutes) if wait_minutes else ""
    return NEXT[Outcome.NEXT_JOB].format(next_job=job_of_run(run, index), when=when)


def _failed(rule: str, why: str, run: RunRecord, fresh: bool) -> Action:
    return Action(Outcome.FAILED, rule, why, NEXT[Outcome.FAILED].format(run=run.run), fresh_instances=fresh)


def next_action(run: RunRecord, job: EndedJob) -> Action:
    """What the supervisor does when `job` of `run` has ended (pure)."""
    if job.name != run.current_job or run.state != "running":
        return Action(Outcome.IGNORED, "Ignored", IGNORED_WHY, NEXT[Outcome.IGNORED])
    rule = next(r for r in RULES if r.matches(job, run))  # Crashed or Stopped* catch all
    why = why_of(rule, run, job)
    fresh = rule.fresh_instances
    if rule.outcome is not Outcome.NEXT_JOB:
        return Action(
            rule.outcome, rule.id, why, NEXT[rule.outcome].format(run=run.run), fresh_instances=fresh
        )
    crashes = crashes_after(rule, run, job)
    if crashes >= MAX_CONSECUTIVE_CRASHES:
        text = CRASH_LOOP_WHY.format(crashes=crashes, saved=progress(run, job).saved_step)
        return _failed(CRASH_LOOP, f"{text}; this job ended because {why}", run, fresh)
    wait, counted, spent = 0, run.counted + 1, run.capacity_minutes
    if rule.capacity:
        wait, counted = capacity_wait(run.capacity_wait_minutes), run.counted
        spent = run.capacity_minutes + wait
        if spent > run.capacity_budget_minutes:
            text = CAPACITY_BUDGET_WHY.format(minutes=spent, budget=run.capacity_budget_minutes)
            return _failed(CAPACITY_BUDGET, f"{text}; this job ended because {why}", run, fresh)
    elif run.counted >= run.max_jobs:
        text = JOB_LIMIT_WHY.format(counted=run.counted, max_jobs=run.max_jobs)
        return _failed(JOB_LIMIT, f"{text}; this job ended because {why}", run, fresh)
    if run.job >= JOB_INDEX_MAX:
        return _failed(NO_JOB_NAMES, f"{NO_JOB_NAMES_WHY}; this job ended because {why}", run, fresh)
    index = run.job + 1
    return Action(
        Outcome.NEXT_JOB,
        rule.id,
        why,
        next_job_text(run.run, index, wait),
        next_job=index,
        wait_minutes=wait,
        crashes=crashes,
        counted=counted,
        capacity_minutes=spent,
        fresh_instances=fresh,
    )


# --- The notification -----------------------------------------------------------------------------
# One template for the state machine's States.Format and for `message` (tests compare the two). Texts
# that go into a States.Format template hold no quote, brace or backslash (asl.literal refuses them).
SUBJECT = "trainstack: run {} {}"  # run, OUTCOME_WORDS; SNS subjects stay under 100 characters
MESSAGE = (
    "trainstack run {run} ({team}/{recipe}): job {job} ended {status} ({secondary}) because {why}. "
    "Next: {next}. Checkpoints: {checkpoint_uri}. Details: trainstack runs {recipe}{team_option}; "
    "trainstack logs {recipe}{team_option} --job {job}"
)
RUN_TIME_FIELDS = ("run", "job", "status", "secondary", "why", "next", "checkpoint_uri")
OUTCOME_WORDS = {
    Outcome.NEXT_JOB: "continues",
    Outcome.COMPLETED: "completed",
    Outcome.STOPPED: "stopped",
    Outcome.FAILED: "failed",
}


def message_template(recipe: str, team: str, team_option: str) -> tuple[str, tuple[str, ...]]:
    """MESSAGE with the deployment's constants filled in and a `{}` for each run-time value, and the
    run-time fields in the order of those `{}` (for States.Format's arguments)."""
    constants = {"recipe": recipe, "team": team, "team_option": team_option}
    text, fields = [], []
    for literal, field, _spec, _conv in string.Formatter().parse(MESSAGE):
        text.append(literal)
        if field is None:
            continue
        if field in constants:
            text.append(constants[field])
        else:
            assert field in RUN_TIME_FIELDS, field
            text.append("{}")
            fields.append(field)
    return "".join(text), tuple(fields)


def message(
    *, recipe: str, team: str, team_option: str, job: EndedJob, action: Action, run: str, checkpoint_uri: str
) -> str:
    values = {
        "run": run,
        "job": job.name,
        "status": job.status,
        "secondary": job.secondary_status,
        "why": action.why,
        "next": action.next_step,
        "checkpoint_uri": checkpoint_uri,
    }
    template, fields = message_template(recipe, team, team_option)
    return template.format(*(values[f] for f in fields))


def subject(run: str, outcome: Outcome) -> str:
    return SUBJECT.format(run, OUTCOME_WORDS[outcome])


# --- Exports ------------------------------------------------------------------------------------------
# The run's own recorded request decides its on-complete export (resume --set export.on_complete=...
# changes it; a redeploy does not), and an export that fails reaches the topic and the run's record.
EXPORT_ON_COMPLETE_KEY = "export.on_complete"  # the recorded request's hyperparameter ("true"/"false")
EXPORT_OF_ENV = "TRAINSTACK_EXPORT_OF"  # an export job's environment: the run it exports
EXPORT_SUBJECT = "trainstack: run {} export failed"
EXPORT_FAILED_MESSAGE = (
    "trainstack run {run} ({team}/{recipe}): {what}. Next: `trainstack export {run}` tries again; the run "
    "itself is unchanged. Details: trainstack runs {recipe}{team_option}"
)
EXPORT_JOB_FAILED = "export job {job} ended {status}: {reason}"
EXPORT_NOT_STARTED = "its on-complete export did not start: {cause}"


def export_failed_template(recipe: str, team: str, team_option: str) -> str:
    """EXPORT_FAILED_MESSAGE with the deployment's constants and a `{}` for the run, the failure and the
    run again (States.Format's arguments, in that order)."""
    return (
        EXPORT_FAILED_MESSAGE.replace("{recipe}", recipe)
        .replace("{team_option}", team_option)
        .replace("{team}", team)
        .replace("{run}", "{}")
        .replace("{what}", "{}")
    )
